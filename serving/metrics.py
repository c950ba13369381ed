"""The server's Prometheus metrics (`GET /metrics`), summed over its worker processes.

Every worker writes its values to files under PROMETHEUS_MULTIPROC_DIR (prometheus_client's
multiprocess mode, set up by serving/supervisor.py); any worker's `/metrics` reads them all: counters
and histograms summed, `flywheel_inflight_rows` summed over live workers, and the per-worker gauges
(`flywheel_model_version`, `flywheel_worker_*`) with a `pid` label.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

REQUESTS = Counter("flywheel_requests", "Ranking requests answered, by route and HTTP status.", ["route", "status"])
LATENCY = Histogram("flywheel_request_seconds", "Ranking request latency in the server (from the complete "
                    "request to the answer), by outcome: ok, or the reason it was shed (queue, tier, deadline, "
                    "not_ready).", ["outcome"],
                    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0,
                             1.5, 2.5, 5.0))
BATCH_ROWS = Histogram("flywheel_batch_rows", "Candidate rows per executed batch.",
                       buckets=(1, 16, 32, 64, 128, 256, 512, 1024, 2048))
FOREIGN_SECONDS = Histogram("flywheel_foreign_batch_seconds", "A batch scored by a model of another flavor "
                            "(models/foreign.py: its pyfunc, no XLA).",
                            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5))
BATCH_REQUESTS = Histogram("flywheel_batch_requests", "Requests merged into one executed batch.",
                           buckets=(1, 2, 4, 8, 16, 32, 64))
INFLIGHT_ROWS = Gauge("flywheel_inflight_rows", "Candidate rows admitted and not yet answered (fetching features, "
                      "queued or scoring).", multiprocess_mode="livesum")
SHED = Counter("flywheel_shed", "Requests answered 503 without being scored, by tier and reason.",
               ["tier", "reason"])
DEGRADED = Counter("flywheel_degraded", "Requests scored at reduced cost, by tier.", ["tier"])
COMPILES = Counter("flywheel_compiles", "XLA compiles, by where they ran (warm, background, request_path).",
                   ["where"])
MODEL_VERSION = Gauge("flywheel_model_version", "1 for the version of each ranker (the platform's, each "
                      "scenario's) serving each route, 0 for earlier ones, per worker.", ["model", "route", "version"],
                      multiprocess_mode="liveall")
WORKER_READY = Gauge("flywheel_worker_ready", "1 once the worker has a champion loaded and warm.",
                     multiprocess_mode="liveall")
WORKER_LISTENING = Gauge("flywheel_worker_listening", "1 once the worker takes connections.",
                         multiprocess_mode="liveall")
SPARSE_ROWS = Counter("flywheel_sparse_rows", "Embedding rows a batch looked up, by where they came from: cache "
                      "(the worker's hot rows), store (read from the embedding store), default (the store failed "
                      "or timed out: scored with the default row).", ["outcome"])
SPARSE_READ_SECONDS = Histogram("flywheel_sparse_read_seconds", "What a batch spent on its one round trip to the "
                                "embedding store: sending, and the wait its own lookups did not cover.",
                                buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
SPARSE_READ_ERRORS = Counter("flywheel_sparse_read_errors", "Embedding store reads that failed or timed out.")
SPARSE_DELTA_APPLIED = Gauge("flywheel_sparse_delta_applied", "The newest version whose announced delta the worker "
                             "applied to its hot rows, per worker.", multiprocess_mode="liveall")
SPARSE_DELTA_SECONDS = Histogram("flywheel_sparse_delta_seconds", "From a delta's announcement to a worker's "
                                 "cache of the new version complete.", buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
MODEL_SWAPS = Counter("flywheel_model_swaps", "Versions swapped in, by route.", ["route"])
SWAP_SECONDS = Histogram("flywheel_model_swap_seconds", "Alias change seen -> new version serving.",
                         buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60))
MODEL_REFUSED = Counter("flywheel_model_refused", "Versions that failed to load or warm and were refused.")
REGISTRY_ERRORS = Counter("flywheel_registry_poll_errors", "Alias polls that failed (registry unreachable).")
REGISTRY_REACHABLE = Gauge("flywheel_registry_reachable", "1 while the worker's last alias poll was answered, 0 "
                           "while the registry is unreachable (the last known aliases keep serving).",
                           multiprocess_mode="liveall")
FAULTS = Counter("flywheel_faults", "Requests that failed on an unexpected error (answered 503 `internal`), by "
                 "path and error type.", ["path", "error"])
DEFAULTED = Counter("flywheel_defaulted_features", "Requests with at least one feature defaulted.")
PREDICTION_LOG_ERRORS = Counter("flywheel_prediction_log_errors", "Prediction records not delivered to Kafka.")
PREDICTION_LOG_UP = Gauge("flywheel_prediction_log_up", "1 while the worker's prediction log delivers, 0 while no "
                          "broker answers or its records fail.", multiprocess_mode="liveall")

REFUSED_RECENTLY = Gauge("flywheel_refused_share", "Share of the worker's requests answered 503 over the last "
                         "serving.refused_window_s (0 with fewer than RecentAnswers.min_requests).",
                         multiprocess_mode="liveall")


class RecentAnswers:
    """This worker's answers over a sliding window, from its own request counter sampled every few seconds:
    the share it refused (503: shed, features, not ready, a fault). A server that refuses most of its
    traffic is not serving, however alive its processes are (`/healthz`)."""

    min_requests = 20

    def __init__(self, window_s: float) -> None:
        self.window_s, self.every_s = window_s, min(5.0, window_s / 4)
        self.samples: deque[tuple[float, float, float]] = deque()  # (monotonic time, answered, refused)

    def sample(self, now: float | None = None) -> float:
        answered = refused = 0.0
        for family in REQUESTS.collect():  # this process's own values
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    answered += sample.value
                    refused += sample.value * (sample.labels["status"] == "503")
        now = time.monotonic() if now is None else now
        self.samples.append((now, answered, refused))
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()  # the oldest kept is the last one at least window_s old
        _, answered_then, refused_then = self.samples[0]
        n = answered - answered_then
        share = (refused - refused_then) / n if n >= self.min_requests else 0.0
        REFUSED_RECENTLY.set(share)
        return share


_versions: dict[tuple[str, str], str] = {}


def set_version(model: str, route: str, version: str | None) -> None:
    """`flywheel_model_version{model, route, version}` is 1 for the version of registered model `model` now serving
    a route, 0 for the ones that served it before (set to 0, not removed: removal is unsupported in multiprocess
    mode)."""
    old = _versions.pop((model, route), None)
    if old is not None:
        MODEL_VERSION.labels(model, route, old).set(0)
    if version is not None:
        MODEL_VERSION.labels(model, route, version).set(1)
        _versions[model, route] = version


def exposition() -> bytes:
    """The text format of every live worker's metrics (this process's alone outside multiprocess mode)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return generate_latest()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)


def workers(ranker: str) -> dict[str, dict]:
    """Each live worker by pid: `listening` (takes connections), `ready` (a champion warm),
    `registry_reachable` (its last alias poll answered), `prediction_log_up`, `refused_share` (of its
    last minute's requests, answered 503), the version of `ranker` (the platform's) `serving` each route, and of
    every ranker it follows (the scenarios' too) by `models`."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return {}
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    out: dict[str, dict] = defaultdict(lambda: {"listening": False, "ready": False, "registry_reachable": None,
                                                "prediction_log_up": None, "refused_share": 0.0, "serving": {},
                                                "models": {}})
    for family in registry.collect():
        for sample in family.samples:
            pid = sample.labels.get("pid")
            if sample.name in ("flywheel_worker_ready", "flywheel_worker_listening") and pid:
                out[pid][sample.name.removeprefix("flywheel_worker_")] = sample.value == 1
            elif sample.name in ("flywheel_registry_reachable", "flywheel_prediction_log_up") and pid:
                out[pid][sample.name.removeprefix("flywheel_")] = sample.value == 1
            elif sample.name == "flywheel_refused_share" and pid:
                out[pid]["refused_share"] = sample.value
            elif sample.name == "flywheel_model_version" and pid and sample.value == 1:
                model, route, version = sample.labels["model"], sample.labels["route"], sample.labels["version"]
                out[pid]["models"].setdefault(model, {})[route] = version
                if model == ranker:
                    out[pid]["serving"][route] = version
    return dict(out)
