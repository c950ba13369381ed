"""The server's Prometheus metrics (`GET /metrics`). One process serves one model name, so the
default registry holds them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("flywheel_requests", "Ranking requests answered, by route and HTTP status.", ["route", "status"])
LATENCY = Histogram("flywheel_request_seconds", "Ranking request latency in the server, by outcome: ok, or the "
                    "reason it was shed (queue, tier, deadline, not_ready).", ["outcome"],
                    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0,
                             1.5, 2.5, 5.0))
BATCH_ROWS = Histogram("flywheel_batch_rows", "Candidate rows per executed batch.",
                       buckets=(1, 16, 32, 64, 128, 256, 512, 1024, 2048))
BATCH_REQUESTS = Histogram("flywheel_batch_requests", "Requests merged into one executed batch.",
                           buckets=(1, 2, 4, 8, 16, 32, 64))
QUEUE_ROWS = Gauge("flywheel_queue_rows", "Candidate rows queued for the executors (the batch queue's depth).")
INFLIGHT_ROWS = Gauge("flywheel_inflight_rows", "Candidate rows admitted and not yet answered (admission).")
SHED = Counter("flywheel_shed", "Requests answered 503 without being scored, by tier and reason.",
               ["tier", "reason"])
DEGRADED = Counter("flywheel_degraded", "Requests scored at reduced cost, by tier.", ["tier"])
COMPILES = Counter("flywheel_compiles", "XLA compiles, by where they ran (warm, background, request_path).",
                   ["where"])
MODEL_VERSION = Gauge("flywheel_model_version", "1 for the version serving each route, 0 for earlier ones.",
                      ["route", "version"])
MODEL_SWAPS = Counter("flywheel_model_swaps", "Versions swapped in, by route.", ["route"])
SWAP_SECONDS = Histogram("flywheel_model_swap_seconds", "Alias change seen -> new version serving.",
                         buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60))
MODEL_REFUSED = Counter("flywheel_model_refused", "Versions that failed to load or warm and were refused.")
REGISTRY_ERRORS = Counter("flywheel_registry_poll_errors", "Alias polls that failed (registry unreachable).")
DEFAULTED = Counter("flywheel_defaulted_features", "Requests with at least one feature defaulted.")
PREDICTION_LOG_ERRORS = Counter("flywheel_prediction_log_errors", "Prediction records not delivered to Kafka.")

_versions: dict[str, str] = {}


def set_version(route: str, version: str | None) -> None:
    """`flywheel_model_version{route, version}` is 1 for the version now serving a route, 0 for the
    ones that served it before (set to 0, not removed: removal is unsupported in multiprocess mode)."""
    old = _versions.pop(route, None)
    if old is not None:
        MODEL_VERSION.labels(route, old).set(0)
    if version is not None:
        MODEL_VERSION.labels(route, version).set(1)
        _versions[route] = version
