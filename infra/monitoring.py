"""Prometheus for the stack: its scrape jobs and alert rules, derived from the settings, and what it says.

    python -m infra.monitoring install   Debian's prometheus package, if absent and this is root

Prometheus scrapes the ranking server (`/metrics`, every worker) and the platform's exporter
(infra/exporter.py, one path per source) and evaluates `alerts(s)`, the alert rules as data: each names the
figure it watches and the threshold the settings give. Firing alerts are on its /alerts page, in
`flywheel status` (`firing`) and on the dashboard, /consoles/flywheel.html (infra/consoles/). Nothing
of the platform waits on Prometheus: it only reads them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from infra.settings import Settings, get_settings

CONSOLES = Path(__file__).parent / "consoles"
# Prometheus' console library (prom.lib: graphs, tables), shipped with the server: Debian keeps it with the
# examples, the upstream tarball beside the binary.
CONSOLE_LIBRARIES = (Path("/usr/share/doc/prometheus/examples/console_libraries"),
                     Path("/etc/prometheus/console_libraries"))


@dataclass(frozen=True)
class Alert:
    """One alert rule: firing while `expr` has a result for `for_s` seconds. `summary` may use the
    result's labels ({{ $labels.service }}) and value ({{ $value }})."""

    name: str
    expr: str
    summary: str
    for_s: float = 0.0
    severity: str = "page"  # page: someone acts now; ticket: in working hours


def alerts(s: Settings) -> list[Alert]:
    stall, deadline_s = s.stack.stall_after_s, s.serving.default_deadline_ms / 1000
    served = 'flywheel_model_version{route="champion"} == 1'
    # The platform's ranker and each scenario's: a regex alternation, each name escaped for RE2 inside PromQL's string
    rankers = "|".join(re.escape(m.name).replace("\\", "\\\\") for m in s.rankers)
    champion = f'flywheel_registry_alias{{model=~"{rankers}", alias="champion"}}'
    return [
        Alert("FlywheelTargetDown", "up == 0", "scrape target {{ $labels.job }} ({{ $labels.instance }}) "
              "is down: Prometheus' /targets page says why", for_s=30),
        Alert("FlywheelConsumerStalled", f"time() - flywheel_consumer_polled_timestamp_seconds > {stall:g}",
              "{{ $labels.service }} has not polled Kafka for {{ $value | humanizeDuration }} "
              f"(stack.stall_after_s {stall:g})"),
        Alert("FlywheelConsumerFallingBehind", f"flywheel_consumer_lag_records > 0 and time() - "
              f"flywheel_consumer_written_timestamp_seconds > {stall:g}",
              "{{ $labels.service }} is behind and has written nothing for over " f"{stall:g} s"),
        Alert("FlywheelStreamLagGrowing",
              "(flywheel_flink_source_lag_records > 10000 and deriv(flywheel_flink_source_lag_records[2m]) "
              "> 0) or (flywheel_consumer_lag_records > 10000 and deriv(flywheel_consumer_lag_records[2m]) > 0)",
              "lag of {{ $labels.service }}{{ $labels.vertex }} is {{ $value }} records and growing", for_s=120),
        Alert("FlywheelFeatureFreshness", "histogram_quantile(0.99, sum by (le) "
              "(rate(flywheel_feature_online_seconds_bucket[1m]))) > 1",
              "feature rows reach the online store {{ $value | humanizeDuration }} after the stream job appends "
              "them (p99, over 1 s)", for_s=120),
        Alert("FlywheelStreamJobDown", "flywheel_flink_job_running == 0", "the stream job {{ $labels.flink_job }} "
              "is not RUNNING", for_s=30),
        Alert("FlywheelStreamJobRestarting", "flywheel_flink_restarts_last_10m > 2",
              "the stream job failed {{ $value }} times in the last 10 minutes"),
        Alert("FlywheelServerErrors", 'sum(rate(flywheel_requests_total{status=~"5.."}[1m])) / '
              "sum(rate(flywheel_requests_total[1m])) > 0.001",
              "{{ $value | humanizePercentage }} of ranking requests answered 5xx", for_s=60),
        Alert("FlywheelLatencyOverDeadline", "histogram_quantile(0.99, sum by (le) "
              f'(rate(flywheel_request_seconds_bucket{{outcome="ok"}}[1m]))) > {deadline_s:g}',
              "ranking p99 {{ $value | humanizeDuration }} is over the deadline "
              f"({s.serving.default_deadline_ms:g} ms)", for_s=60),
        Alert("FlywheelNotFollowingChampion", f"({champion} unless on (model, version) ({served})) or "
              f"(({served}) unless on (model, version) {champion})",
              "the ranking server does not serve @champion of {{ $labels.model }} (registry: version "
              "{{ $labels.version }} "
              "{{ if $labels.pid }}served by worker {{ $labels.pid }}{{ else }}served by no worker{{ end }})",
              for_s=60),
        Alert("FlywheelPredictionLogDown", "flywheel_prediction_log_up == 0", "worker {{ $labels.pid }} cannot "
              "deliver its prediction log to Kafka", for_s=30),
        Alert("FlywheelRegistryUnreachable", "flywheel_registry_reachable == 0", "worker {{ $labels.pid }} "
              "cannot reach the registry (the last known aliases keep serving)", for_s=60, severity="ticket"),
        Alert("FlywheelCanaryRolledBack", "time() - flywheel_canary_rollback_timestamp_seconds < 900",
              "the canary analysis rolled v{{ $labels.version }} back to v{{ $labels.to }}: {{ $labels.reason }}"),
        Alert("FlywheelCanaryRollbackFailing", "flywheel_canary_rollback_failing > 0", "the canary analysis "
              "asked for a rollback that failed {{ $value }} times (retried every look)"),
        Alert("FlywheelCanaryAnalysisStalled", "time() - flywheel_canary_analysis_timestamp_seconds > "
              f"{max(stall, 3 * s.canary.interval_s):g}", "the canary analysis has not looked for "
              "{{ $value | humanizeDuration }}"),
        Alert("FlywheelFeatureSkew", 'flywheel_feature_mismatch_ratio{against="training"} > 0.001',
              "{{ $value | humanizePercentage }} of served candidates were trained on another value of "
              "{{ $labels.feature }} than they were served with (the last consistency report)", severity="ticket"),
        Alert("FlywheelDagRunFailed", "flywheel_dag_last_run_failed == 1", "the last run of DAG "
              "{{ $labels.dag_id }} failed", severity="ticket"),
    ]


def rules(s: Settings) -> dict:
    return {"groups": [{"name": "flywheel", "rules": [
        {"alert": a.name, "expr": a.expr, "for": f"{a.for_s:g}s", "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary}} for a in alerts(s)]}]}


def scrape_jobs(s: Settings) -> list[dict]:
    """Prometheus itself, the ranking server and one job per exporter path whose source this stack uses."""
    from infra.services import used_groups

    groups = used_groups(s)
    fast, slow = s.prometheus.scrape_interval_s, s.prometheus.slow_scrape_interval_s
    exporter = "{}:{}".format(*s.prometheus.exporter_host_port)

    def job(name: str, target: str, path: str, interval: float) -> dict:
        return {"job_name": name, "metrics_path": path, "scrape_interval": f"{interval:g}s",
                "scrape_timeout": f"{min(interval * 0.8, 10):g}s", "static_configs": [{"targets": [target]}]}

    parts = {"pipeline": ("pipeline", fast), "flink": ("pipeline", fast), "redis": ("redis", fast),
             "registry": ("mlflow", slow), "airflow": ("airflow", slow), "canary": ("serving", fast),
             "consistency": ("serving", slow)}
    return [job("prometheus", "{}:{}".format(*s.prometheus.host_port), "/metrics", fast),
            *([job("ranking-server", f"{s.serving.host}:{s.serving.port}", "/metrics", fast)]
              if "serving" in groups else []),
            *(job(part, exporter, f"/metrics/{part}", interval) for part, (group, interval) in parts.items()
              if group in groups)]


def write_config(s: Settings) -> Path:
    """prometheus.yml and its rule file in the service's directory (JSON is YAML); the config's path."""
    d = s.paths.service_dir("prometheus")
    d.mkdir(parents=True, exist_ok=True)
    (d / "alerts.yml").write_text(json.dumps(rules(s), indent=1))
    config = {"global": {"scrape_interval": f"{s.prometheus.scrape_interval_s:g}s",
                         "evaluation_interval": f"{s.prometheus.scrape_interval_s:g}s"},
              "rule_files": [str(d / "alerts.yml")], "scrape_configs": scrape_jobs(s)}
    (d / "prometheus.yml").write_text(json.dumps(config, indent=1))
    return d / "prometheus.yml"


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise SystemExit("prometheus not found: `python -m infra.monitoring install` as root (Debian's package), "
                         "or drop \"prometheus\" from stack.services")
    return found


def command(s: Settings) -> list[str]:
    libraries = next((str(p) for p in CONSOLE_LIBRARIES if (p / "prom.lib").exists()), None)
    host, port = s.prometheus.host_port
    return [binary(), f"--config.file={write_config(s)}", f"--web.listen-address={host}:{port}",
            f"--storage.tsdb.path={s.paths.service_dir('prometheus') / 'data'}",
            f"--storage.tsdb.retention.time={s.prometheus.retention}",
            f"--web.console.templates={CONSOLES}",
            *([f"--web.console.libraries={libraries}"] if libraries else [])]


def install() -> None:
    """Debian's prometheus (server, promtool, console library) when absent, as PostgreSQL is installed."""
    if shutil.which("prometheus"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit("prometheus is not installed: apt-get install prometheus (Debian), or drop "
                         "\"prometheus\" from stack.services")
    # Its service is the stack's to start: the package's own (systemd) must not run.
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"], check=True, env=env)


def firing(s: Settings, timeout_s: float = 3.0) -> list[dict]:
    """The alerts firing now: [{"name", "summary", "since", "labels"}]. Raises httpx.HTTPError when
    Prometheus does not answer."""
    answer = httpx.get(f"{s.prometheus.url}/api/v1/alerts", timeout=timeout_s)
    answer.raise_for_status()
    return [{"name": a["labels"]["alertname"], "summary": a["annotations"].get("summary", ""),
             "since": a.get("activeAt"), "labels": a["labels"]}
            for a in answer.json()["data"]["alerts"] if a["state"] == "firing"]


def targets(s: Settings, timeout_s: float = 3.0) -> list[dict]:
    """Each active scrape target: {"job", "health", "error"}."""
    answer = httpx.get(f"{s.prometheus.url}/api/v1/targets", params={"state": "active"}, timeout=timeout_s)
    answer.raise_for_status()
    return [{"job": t["labels"]["job"], "health": t["health"], "error": t.get("lastError", "")}
            for t in answer.json()["data"]["activeTargets"]]


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        raise SystemExit(__doc__)
    install()
    get_settings()  # the settings are valid before anything starts
