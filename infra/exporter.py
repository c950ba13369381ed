"""The platform's Prometheus exporter: what no stage serves itself, read from where it already is.

One path per scrape job, each asked of its own source at scrape time (nothing is cached between scrapes):

    /metrics/pipeline   every consumer's progress report (infra/progress.py) and its lag in Kafka
    /metrics/flink      the stream job, from Flink's REST API: state, restarts, records, checkpoints,
                        back-pressure, the Kafka source's lag
    /metrics/redis      INFO of each Redis server of the stack
    /metrics/registry   the registered models' aliases in MLflow
    /metrics/airflow    each DAG's last finished run
    /metrics/canary     the canary analysis' last look (serving/canary.py), served CTR and AUC per version, the
                        experiment's arms
    /metrics/consistency  the last online/offline consistency report (serving/consistency.py), per feature

A path whose source does not answer is answered 503 with the reason: Prometheus shows that target down
(and `up` 0), the others keep their figures. Run as `python -m infra.exporter`; binds
`prometheus.exporter_url`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from infra.progress import LATENCY_BUCKETS, Progress, consumer_lag, state_path
from infra.settings import RANKER, Settings, get_settings, mlflow_password

log = logging.getLogger("flywheel.exporter")


class Unreachable(RuntimeError):
    """The source of a scrape job did not answer: the whole path is answered 503."""


def _gauge(name: str, doc: str, labels: list[str], samples: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


LATENCY_DOCS = {"feature_online": "Feature rows: appended to their topic by the stream job -> written online by "
                                  "the ingestor (the stream job's own time is its source lag)."}


class PipelineCollector(Collector):
    """Every consumer that reports progress (run/<service>.progress.json): when it last polled and wrote,
    what a broker restart took from it, and its lag (records past its committed offsets)."""

    def __init__(self, s: Settings) -> None:
        self.s = s

    def collect(self) -> Iterator[Metric]:
        reports: dict[str, Progress] = {}
        for path in sorted(self.s.paths.run_dir.glob("*.progress.json")):
            try:
                reports[path.name.removesuffix(".progress.json")] = Progress(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):  # being replaced (os.replace) or not ours
                continue
        lags: list[tuple[list[str], float]] = []
        for service, p in reports.items():
            try:
                lags.append(([service], consumer_lag(self.s, p.group, p.topics, timeout_s=2.0)))
            except Exception as exc:  # noqa: BLE001 - no broker: the lag is unknown, not zero
                log.debug("lag of %s: %s", service, exc)
        yield _gauge("flywheel_consumer_polled_timestamp_seconds", "When the consumer last polled Kafka.",
                     ["service"], [([k], p.polled_at) for k, p in reports.items()])
        yield _gauge("flywheel_consumer_written_timestamp_seconds", "When the consumer last wrote what it read "
                     "(its start while it never did).", ["service"],
                     [([k], p.written_at or p.started_at) for k, p in reports.items()])
        yield _gauge("flywheel_consumer_lost_records", "Records a restarted broker no longer held when the "
                     "consumer came for them (a lower bound).", ["service"],
                     [([k], p.lost) for k, p in reports.items()])
        histograms: dict[str, HistogramMetricFamily] = {}
        for service, p in reports.items():
            for name, h in p.latencies.items():
                if name not in histograms:
                    histograms[name] = HistogramMetricFamily(
                        f"flywheel_{name}_seconds", LATENCY_DOCS.get(name, name), labels=["service"])
                histograms[name].add_metric([service], [(f"{b:g}" if b != float("inf") else "+Inf", c) for b, c in
                                                        zip(LATENCY_BUCKETS, h["counts"])], h["sum"])
        yield from histograms.values()
        yield _gauge("flywheel_consumer_lag_records", "Records in the consumer's topics past its committed "
                     "offsets (absent while Kafka does not answer).", ["service"], lags)


class FlinkCollector(Collector):
    """The stream job, through the read-only front of Flink's REST API (`flink.rest_url`)."""

    def __init__(self, s: Settings) -> None:
        self.s, self.http = s, httpx.Client(base_url=s.flink.rest_url, timeout=3)

    def _get(self, path: str) -> dict | list:
        try:
            answer = self.http.get(path)
            answer.raise_for_status()
            return answer.json()
        except httpx.HTTPError as exc:
            raise Unreachable(f"Flink REST {self.s.flink.rest_url}{path}: {type(exc).__name__}: {exc}") from None

    def collect(self) -> Iterator[Metric]:
        name = self.s.streaming.job_name
        jobs = [j for j in self._get("/jobs/overview")["jobs"] if j.get("name") == name]
        running = next((j for j in jobs if j.get("state") == "RUNNING"), None)
        yield _gauge("flywheel_flink_job_running", "1 while the stream job is RUNNING.", ["flink_job"],
                     [([name], 1.0 if running else 0.0)])
        if running is None:
            return
        jid = running["jid"]
        job = self._get(f"/jobs/{jid}")
        fed = {i["id"] for node in job["plan"]["nodes"] for i in node.get("inputs", [])}
        sources = [v for v in job["vertices"] if v["name"].startswith("Source")]
        yield _gauge("flywheel_flink_job_uptime_seconds", "Since the stream job (re)started.", ["flink_job"],
                     [([name], max(0, job["now"] - job["start-time"]) / 1000)])
        yield _gauge("flywheel_flink_records_in", "Events read by the job's Kafka sources.", ["flink_job"],
                     [([name], sum(v["metrics"]["read-records"] for v in sources))])
        yield _gauge("flywheel_flink_records_out", "Rows written by the job's sinks.", ["flink_job"],
                     [([name], sum(v["metrics"]["write-records"] for v in job["vertices"] if v["id"] not in fed))])
        failures = self._get(f"/jobs/{jid}/exceptions")["exceptionHistory"]["entries"]
        yield _gauge("flywheel_flink_restarts_last_10m", "Job failures (each a restart) in the last 10 minutes.",
                     ["flink_job"], [([name], sum(job["now"] - f["timestamp"] < 600_000 for f in failures))])
        checkpoints = self._get(f"/jobs/{jid}/checkpoints")
        counts = checkpoints.get("counts", {})
        yield _gauge("flywheel_flink_checkpoints", "Checkpoints of the running job, by outcome.",
                     ["flink_job", "outcome"], [([name, k], counts.get(k, 0)) for k in ("completed", "failed")])
        latest = (checkpoints.get("latest") or {}).get("completed")
        if latest:
            yield _gauge("flywheel_flink_checkpoint_duration_seconds", "The last completed checkpoint's "
                         "end-to-end duration.", ["flink_job"], [([name], latest["end_to_end_duration"] / 1000)])
            yield _gauge("flywheel_flink_checkpoint_timestamp_seconds", "When the last completed checkpoint "
                         "was triggered.", ["flink_job"], [([name], latest["trigger_timestamp"] / 1000)])
        back: list[tuple[list[str], float]] = []
        pending: list[tuple[list[str], float]] = []
        for v in job["vertices"]:
            for m in self._get(f"/jobs/{jid}/vertices/{v['id']}/subtasks/metrics?get=backPressuredTimeMsPerSecond"
                               "&agg=max"):
                back.append(([name, v["name"][:80]], m.get("max", 0.0) / 1000))
        for v in sources:
            ids = [m["id"] for m in self._get(f"/jobs/{jid}/vertices/{v['id']}/subtasks/metrics")
                   if m["id"].endswith("KafkaConsumer.records-lag-max")]
            if ids:
                got = self._get(f"/jobs/{jid}/vertices/{v['id']}/subtasks/metrics?get={','.join(ids)}&agg=sum")
                pending.append(([name, v["name"][:80]], sum(m.get("sum", 0.0) for m in got)))
        yield _gauge("flywheel_flink_backpressured_ratio", "Share of time the busiest subtask of each vertex "
                     "was back-pressured.", ["flink_job", "vertex"], back)
        yield _gauge("flywheel_flink_source_lag_records", "Records in Kafka the job's source has not read yet: "
                     "its Kafka consumers' records-lag-max, summed over subtasks.", ["flink_job", "vertex"], pending)


class RedisCollector(Collector):
    """INFO of the online store's servers (each master of a cluster) and of the graph store's."""

    FIELDS = {"used_memory": "bytes of memory used", "connected_clients": "client connections",
              "instantaneous_ops_per_sec": "commands per second (the server's own estimate)",
              "rejected_connections": "connections refused (maxclients)", "evicted_keys": "keys evicted (maxmemory)",
              "aof_last_write_status_ok": "1 while the last append-only-file write succeeded"}

    def __init__(self, s: Settings) -> None:
        self.s = s

    def servers(self) -> dict[str, str]:
        from infra.redis_clients import graph_url

        nodes = {f"{h}:{p}": f"redis://{h}:{p}" for h, p in self.s.redis.nodes} if self.s.redis.cluster_nodes \
            else {"{}:{}".format(*self.s.redis.host_port): self.s.redis.url}
        graph = urlsplit(graph_url(self.s))
        return nodes | {f"{graph.hostname}:{graph.port or 6379}": graph_url(self.s)}

    def collect(self) -> Iterator[Metric]:
        import redis

        from infra.redis_clients import credentials

        infos: dict[str, dict] = {}
        for server, url in self.servers().items():
            try:
                infos[server] = redis.Redis.from_url(url, **credentials(self.s), socket_timeout=2).info()
            except redis.RedisError as exc:
                raise Unreachable(f"Redis {server}: {type(exc).__name__}: {exc}") from None
        for info in infos.values():
            info["aof_last_write_status_ok"] = float(info.get("aof_last_write_status") == "ok")
        for field, doc in self.FIELDS.items():
            yield _gauge(f"flywheel_redis_{field}", f"Redis: {doc}.", ["server"],
                         [([server], float(info.get(field, 0))) for server, info in infos.items()])
        yield _gauge("flywheel_redis_keys", "Redis: keys in each database.", ["server", "db"],
                     [([server, db], float(v["keys"])) for server, info in infos.items()
                      for db, v in info.items()
                      if db.startswith("db") and db[2:].isdigit() and isinstance(v, dict) and "keys" in v])


class RegistryCollector(Collector):
    """The aliases of the registered models the settings declare, as MLflow says them."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.http = httpx.Client(base_url=s.mlflow.tracking_uri, timeout=5,
                                 auth=(s.mlflow.username, mlflow_password(s) or ""))

    def collect(self) -> Iterator[Metric]:
        samples: list[tuple[list[str], float]] = []
        numbers: list[tuple[list[str], float]] = []
        freshness: list[tuple[list[str], float]] = []
        for registered in self.s.registered_models:
            model = registered.name
            try:
                answer = self.http.get("/api/2.0/mlflow/registered-models/get", params={"name": model})
            except httpx.HTTPError as exc:
                raise Unreachable(f"MLflow {self.s.mlflow.tracking_uri}: {type(exc).__name__}: {exc}") from None
            if answer.status_code == 404:  # not registered yet
                continue
            if answer.status_code != 200:
                raise Unreachable(f"MLflow: HTTP {answer.status_code} {answer.text[:200]}")
            for alias in answer.json()["registered_model"].get("aliases", []):
                samples.append(([model, alias["alias"], str(alias["version"])], 1.0))
                numbers.append(([model, alias["alias"]], float(alias["version"])))
                if registered.role == RANKER:
                    freshness.extend(self._freshness(model, alias["alias"], str(alias["version"])))
        yield _gauge("flywheel_registry_alias_version", "The version number each alias points at (versions over "
                     "time on a graph).", ["model", "alias"], numbers)
        yield _gauge("flywheel_registry_alias", "1 for the version each alias of a registered model points at.",
                     ["model", "alias", "version"], samples)
        yield _gauge("flywheel_model_data_end_timestamp_seconds", "The end of the data each alias' ranker version "
                     "was trained on (time() minus it: how stale the served model is).", ["model", "alias", "version"],
                     [(labels, end) for labels, end, _ in freshness])
        yield _gauge("flywheel_model_freshness_seconds", "Per ranker version an alias names: the newest event in its "
                     "data -> its promotion.", ["model", "alias", "version"],
                     [(labels, fresh) for labels, _, fresh in freshness if fresh is not None])

    def _freshness(self, model: str, alias: str, version: str) -> list[tuple[list[str], float, float | None]]:
        from datetime import datetime

        answer = self.http.get("/api/2.0/mlflow/model-versions/get", params={"name": model, "version": version})
        if answer.status_code != 200:
            return []
        tags = {t["key"]: t["value"] for t in answer.json()["model_version"].get("tags", [])}
        try:
            end = datetime.fromisoformat(tags["data_end"]).timestamp()
        except (KeyError, ValueError):
            return []
        promoted = datetime.fromisoformat(tags["gate_at"]).timestamp() if tags.get("gate_at") else None
        return [([model, alias, version], end, promoted - end if promoted else None)]


class AirflowCollector(Collector):
    """Each DAG's last finished run: whether it failed, and when it ended."""

    def __init__(self, s: Settings) -> None:
        self.s, self.client = s, None

    def collect(self) -> Iterator[Metric]:
        from infra.airflow_api import AirflowApiError, AirflowClient

        try:
            self.client = self.client or AirflowClient(self.s, timeout_s=5)
            latest = self.client.last_finished_runs()
        except (AirflowApiError, httpx.HTTPError) as exc:
            self.client = None  # a new login next time (the token may be what failed)
            raise Unreachable(str(exc)) from None
        yield _gauge("flywheel_dag_last_run_failed", "1 when the DAG's last finished run failed.", ["dag_id"],
                     [([dag], float(run["state"] == "failed")) for dag, run in latest.items()])
        yield _gauge("flywheel_dag_last_run_end_timestamp_seconds", "When the DAG's last finished run ended.",
                     ["dag_id"], [([dag], run["end"]) for dag, run in latest.items()])


class CanaryCollector(Collector):
    """What the canary analyst found at its last look (its state file): the canary running, each side's
    judged requests and request AUC, the test's likelihood ratio, the rollbacks it made and a failing one;
    and per version and endpoint served (in the canary, else the last five minutes): CTR, pooled and list AUC."""

    def __init__(self, s: Settings) -> None:
        self.s = s

    def collect(self) -> Iterator[Metric]:
        try:
            st = json.loads(state_path(self.s, "canary-analyst").read_text())
        except (OSError, ValueError):
            return
        active = bool(st.get("version"))
        yield _gauge("flywheel_canary_analysis_timestamp_seconds", "When the canary analysis last looked.", [],
                     [([], st["updated_at"])])
        yield _gauge("flywheel_canary_active", "1 while a new champion serves a share of users against @control.",
                     ["version", "control"], [([st["version"], st["control"]], 1.0)] if active else [(["", ""], 0.0)])
        if active:
            yield _gauge("flywheel_canary_champion_percent", "The new champion's share of users.", ["version"],
                         [([st["version"]], st["champion_percent"])])
            yield _gauge("flywheel_canary_likelihood_ratio", "The mSPRT's likelihood ratio (rolled back at 1/alpha "
                         "when worse).", ["version"], [([st["version"]], st["likelihood_ratio"])])
            arms = st.get("arms", {})
            yield _gauge("flywheel_canary_judged_requests", "Judged /rank requests per side since the canary began.",
                         ["side", "version"], [([side, a["version"]], a["judged"]) for side, a in arms.items()])
            yield _gauge("flywheel_canary_request_auc", "Mean request AUC per side since the canary began.",
                         ["side", "version"], [([side, a["version"]], a["auc"]) for side, a in arms.items()])
        yield _gauge("flywheel_canary_rollback_failing", "Failed tries of the rollback the analysis asked for (0 "
                     "once one succeeds).", [], [([], st.get("rollback_failing", 0))])
        yield _gauge("flywheel_canary_rollback_timestamp_seconds", "When the analysis rolled a version back, and why.",
                     ["version", "to", "reason"], [([r["version"], r["to"], r["reason"][:300]], r["at"])
                                                   for r in st.get("rollbacks", [])])
        yield from _experiment_gauges(st.get("experiment") or {})
        served = [(version, endpoint, f) for version, by_endpoint in st.get("served", {}).items()
                  for endpoint, f in by_endpoint.items()]
        for key, doc in (("ctr", "clicks per item shown"), ("auc", "AUC pooled over the items it scored (as the "
                         "offline test AUC is)"), ("list_auc", "mean AUC of its judged lists (a click and a pass)"),
                         ("judged_lists", "lists judged (a click and a pass)"), ("requests", "requests served")):
            yield _gauge(f"flywheel_served_{key}", f"Per version and endpoint (rank, recommend), on the traffic it "
                         f"served (the canary, else the last five minutes): {doc}.", ["version", "endpoint"],
                         [([v, e], f["judged" if key == "judged_lists" else key]) for v, e, f in served])


def _experiment_gauges(ex: dict) -> Iterator[Metric]:
    """The experiment the canary analyst measured (serving/experiments.py): each arm over the last five minutes."""
    yield _gauge("flywheel_experiment_holdout_percent", "The frozen arm's share of users, @holdout's version (0: no "
                 "experiment runs).", ["holdout"], [([ex["version"]], ex["percent"])] if ex else [([""], 0.0)])
    if not ex:
        return
    arms = ex["arms"]
    for key, doc in (("ctr", "served CTR (clicks per /rank item shown)"), ("ctr_low", "the CTR's 95% interval, low"),
                     ("ctr_high", "the CTR's 95% interval, high"), ("requests", "/rank requests"),
                     ("users", "users served"), ("crossed_items", "items served by the other arm's model")):
        src = {"ctr_low": "low", "ctr_high": "high", "crossed_items": "crossed"}.get(key, key)
        yield _gauge(f"flywheel_experiment_{key}", f"Per arm (frozen: the users @holdout serves; learning: the "
                     f"others), over the last five minutes: {doc}.", ["arm"],
                     [([arm], a[src]) for arm, a in arms.items()])
    for key, src in (("ratio", "ratio"), ("ratio_low", "low"), ("ratio_high", "high")):
        yield _gauge(f"flywheel_experiment_ctr_{key}", f"The learning arm's CTR over the frozen arm's, over the last "
                     f"five minutes{'' if key == 'ratio' else ': its 95% interval, ' + src}.", [],
                     [([], ex["ratio"][src])])


class ConsistencyCollector(Collector):
    """The last online/offline consistency report (serving/consistency.py, its state file): per numeric
    feature, the share of served candidates whose value differs from the training set's and from a
    point-in-time join's."""

    def __init__(self, s: Settings) -> None:
        self.s = s

    def collect(self) -> Iterator[Metric]:
        try:
            st = json.loads(state_path(self.s, "consistency").read_text())
        except (OSError, ValueError):
            return
        yield _gauge("flywheel_consistency_report_timestamp_seconds", "When the last consistency report ran.", [],
                     [([], st["at"])])
        yield _gauge("flywheel_consistency_compared_candidates", "Served /rank candidates the last report "
                     "compared (shown, and so in the training set).", [], [([], st.get("compared", 0))])
        yield _gauge("flywheel_feature_mismatch_ratio", "Per feature, the share of compared candidates whose "
                     "served value differs from the training set's (against=training) or from a point-in-time "
                     "join's (against=point_in_time).", ["feature", "against"],
                     [([f["feature"], against], f[key]) for f in st.get("features", [])
                      for against, key in (("training", "rate"), ("point_in_time", "point_in_time_rate"))])


def collectors(s: Settings) -> dict[str, Callable[[], Collector]]:
    """Each path's collector, made on first use (a stack without Airflow never logs in to it)."""
    return {"pipeline": lambda: PipelineCollector(s), "flink": lambda: FlinkCollector(s),
            "redis": lambda: RedisCollector(s), "registry": lambda: RegistryCollector(s),
            "airflow": lambda: AirflowCollector(s), "canary": lambda: CanaryCollector(s),
            "consistency": lambda: ConsistencyCollector(s)}


class _Handler(BaseHTTPRequestHandler):
    server: _Exporter

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/healthz":
            return self._answer(200, b"ok\n", "text/plain")
        part = path.removeprefix("/metrics/")
        if part not in self.server.parts:
            return self._answer(404, f"unknown path {path}; known: /metrics/{{{','.join(self.server.parts)}}}\n"
                                .encode(), "text/plain")
        registry = self.server.registry(part)
        t0 = time.monotonic()
        try:
            body = generate_latest(registry)
        except Unreachable as exc:
            return self._answer(503, f"{exc}\n".encode(), "text/plain")
        except Exception as exc:  # noqa: BLE001 - a source's unexpected answer: that target down, with why
            log.exception("collecting %s", part)
            return self._answer(503, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain")
        log.debug("%s in %.3f s", part, time.monotonic() - t0)
        self._answer(200, body, CONTENT_TYPE_LATEST)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # Prometheus asks every few seconds: not worth a line each
        pass


class _Exporter(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, s: Settings) -> None:
        super().__init__(s.prometheus.exporter_host_port, _Handler)
        self.parts = collectors(s)
        self._registries: dict[str, CollectorRegistry] = {}

    def registry(self, part: str) -> CollectorRegistry:
        if part not in self._registries:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(self.parts[part]())
            self._registries[part] = registry
        return self._registries[part]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    server = _Exporter(s)
    log.info("serving %s on %s", ", ".join(f"/metrics/{p}" for p in server.parts), s.prometheus.exporter_url)
    server.serve_forever()


if __name__ == "__main__":
    main()
