"""Monitoring without a stack: the alert rules, run by Prometheus' own rule tester on series shaped like a
stalled consumer and a server that stopped following @champion; the exporter's answers when its sources are
down."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest

from infra import monitoring
from infra.exporter import _Exporter
from infra.progress import ProgressReport
from infra.settings import Settings, load_settings
from serving.consistency import save
from tests.conftest import stack_environ


@pytest.fixture(scope="module")
def promtool() -> str:
    monitoring.install()  # Debian's package, as `flywheel up` installs it
    return str(Path(monitoring.binary()).with_name("promtool"))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(stack_environ(tmp_path / "data"))


def values(*runs: tuple[str | float, int]) -> str:
    """promtool's series values: each (value, count) run repeated, one sample per interval."""
    return " ".join(str(v) for v, n in runs for _ in range(n))


def rule_test(promtool: str, s: Settings, tmp_path: Path, series: dict[str, str], expect: list[dict]) -> None:
    config = monitoring.write_config(s)
    tests = {"rule_files": [str(config.with_name("alerts.yml"))], "evaluation_interval": "5s",
             "tests": [{"interval": "5s", "input_series": [{"series": k, "values": v} for k, v in series.items()],
                        "alert_rule_test": expect}]}
    (tmp_path / "tests.yml").write_text(json.dumps(tests))
    checked = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_generated_config_and_rules_are_valid(promtool: str, settings: Settings) -> None:
    checked = subprocess.run([promtool, "check", "config", str(monitoring.write_config(settings))],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    jobs = {j["job_name"] for j in monitoring.scrape_jobs(settings)}
    assert jobs == {"prometheus", "ranking-server", "pipeline", "flink", "redis", "registry", "airflow", "canary",
                    "consistency"}


def test_a_consumer_that_stops_polling_fires_once_past_stall_after_s_and_clears_when_it_resumes(
        promtool: str, settings: Settings, tmp_path: Path) -> None:
    stall = settings.stack.stall_after_s  # 30 s: 6 samples of 5 s
    # Polls with every sample (its timestamp = the evaluation's time()) for 60 s, stops for 60 s, resumes.
    polled = [t * 5 for t in range(13)] + [60] * 12 + [t * 5 for t in range(25, 40)]
    labels = {"service": "feast-ingestor", "severity": "page"}
    fired = [{"exp_labels": labels, "exp_annotations": {
        "summary": f"feast-ingestor has not polled Kafka for 35s (stack.stall_after_s {stall:g})"}}]
    rule_test(promtool, settings, tmp_path, {
        'flywheel_consumer_polled_timestamp_seconds{service="feast-ingestor"}': " ".join(map(str, polled))}, [
        {"eval_time": "85s", "alertname": "FlywheelConsumerStalled", "exp_alerts": []},  # 25 s without a poll
        {"eval_time": "95s", "alertname": "FlywheelConsumerStalled", "exp_alerts": fired},  # 35 s
        {"eval_time": "130s", "alertname": "FlywheelConsumerStalled", "exp_alerts": []},  # polling again
    ])


def test_a_server_that_does_not_serve_the_registrys_champion_for_a_minute_fires(
        promtool: str, settings: Settings, tmp_path: Path) -> None:
    """@champion moves from version 3 to 4 at 60 s. Worker 1 follows within a scrape; worker 2 keeps serving 3:
    after the rule's minute, the alert names worker 2 and version 3, and nothing names worker 1."""
    model = settings.models.name
    rule_test(promtool, settings, tmp_path, {
        f'flywheel_registry_alias{{model="{model}",alias="champion",version="3"}}': values((1, 13), ("stale", 1)),
        f'flywheel_registry_alias{{model="{model}",alias="champion",version="4"}}': values(("_", 13), (1, 40)),
        f'flywheel_model_version{{model="{model}",route="champion",version="3",pid="1"}}': values((1, 14), (0, 39)),
        f'flywheel_model_version{{model="{model}",route="champion",version="4",pid="1"}}': values(("_", 14), (1, 39)),
        f'flywheel_model_version{{model="{model}",route="champion",version="3",pid="2"}}': values((1, 53)),
    }, [
        {"eval_time": "100s", "alertname": "FlywheelNotFollowingChampion", "exp_alerts": []},  # under a minute
        {"eval_time": "140s", "alertname": "FlywheelNotFollowingChampion", "exp_alerts": [{
            "exp_labels": {"model": model, "route": "champion", "version": "3", "pid": "2", "severity": "page"},
            "exp_annotations": {"summary": f"the ranking server does not serve @champion of {model} (registry: "
                                           "version 3 served by worker 2)"}}]},
    ])


def test_the_canary_analysis_alerts_say_the_rollback_and_its_reason_and_a_failing_one(
        promtool: str, settings: Settings, tmp_path: Path) -> None:
    reason = "shown worse than v4 on live traffic: request AUC v5 0.331 ..."
    rule_test(promtool, settings, tmp_path, {
        f'flywheel_canary_rollback_timestamp_seconds{{version="5",to="4",reason="{reason}"}}': values((60, 300)),
        "flywheel_canary_rollback_failing": values((0, 4), (2, 4), (0, 4)),
    }, [
        {"eval_time": "100s", "alertname": "FlywheelCanaryRolledBack", "exp_alerts": [{
            "exp_labels": {"version": "5", "to": "4", "reason": reason, "severity": "page"},
            "exp_annotations": {"summary": f"the canary analysis rolled v5 back to v4: {reason}"}}]},
        {"eval_time": "1000s", "alertname": "FlywheelCanaryRolledBack", "exp_alerts": []},  # 15 min later
        {"eval_time": "25s", "alertname": "FlywheelCanaryRollbackFailing", "exp_alerts": [{
            "exp_labels": {"severity": "page"}, "exp_annotations": {
                "summary": "the canary analysis asked for a rollback that failed 2 times (retried every look)"}}]},
        {"eval_time": "45s", "alertname": "FlywheelCanaryRollbackFailing", "exp_alerts": []},
    ])


@pytest.fixture
def exporter(settings: Settings) -> Iterator[Settings]:
    server = _Exporter(settings)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield settings
    finally:
        server.shutdown()
        server.server_close()


def test_the_exporter_answers_503_with_the_reason_for_a_source_that_is_down_and_keeps_the_rest(
        exporter: Settings) -> None:
    s = exporter
    report = ProgressReport(s, "feast-ingestor", "group", ["features.x"])
    report.observe("feature_online", [0.03, 0.2, 0.7, 0.7, 90.0])
    report.observe("feature_online", [0.04])
    report.beat(wrote=True)
    report._save(0)  # a beat saves at most once a second
    pipeline = httpx.get(f"{s.prometheus.exporter_url}/metrics/pipeline", timeout=10)
    assert pipeline.status_code == 200
    # The rows' times as a cumulative histogram per bound, summed over both observations.
    for le, count in (("0.05", 2), ("0.25", 3), ("1", 5), ("60", 5), ("+Inf", 6)):
        assert f'flywheel_feature_online_seconds_bucket{{le="{le}",service="feast-ingestor"}} {count:.1f}' in \
            pipeline.text, pipeline.text
    assert 'flywheel_feature_online_seconds_count{service="feast-ingestor"} 6.0' in pipeline.text
    assert 'flywheel_consumer_polled_timestamp_seconds{service="feast-ingestor"}' in pipeline.text
    assert 'flywheel_consumer_lag_records{service=' not in pipeline.text  # no broker: unknown, not 0
    for part, source in (("flink", "Flink REST"), ("redis", "Redis"), ("registry", "MLflow"), ("airflow", "Airflow")):
        answer = httpx.get(f"{s.prometheus.exporter_url}/metrics/{part}", timeout=10)
        assert answer.status_code == 503 and source in answer.text, (part, answer.status_code, answer.text)
    unknown = httpx.get(f"{s.prometheus.exporter_url}/metrics/nope", timeout=10)
    assert unknown.status_code == 404 and "/metrics/{pipeline," in unknown.text


def test_the_last_consistency_report_is_a_metric_per_feature_and_skew_is_alerted(
        exporter: Settings, promtool: str, tmp_path: Path) -> None:
    s = exporter
    assert "flywheel_feature_mismatch_ratio" not in httpx.get(f"{s.prometheus.exporter_url}/metrics/consistency",
                                                              timeout=10).text  # no report yet: nothing said
    table = pd.DataFrame([{"feature": "user_clicks_5m", "rate": 0.02, "point_in_time_rate": 0.3},
                          {"feature": "item_ctr_1h", "rate": 0.0, "point_in_time_rate": 0.01}])
    save(s, table, {"lists": 10, "served": 40, "compared": 40}, None, None)
    text = httpx.get(f"{s.prometheus.exporter_url}/metrics/consistency", timeout=10).text
    assert 'flywheel_feature_mismatch_ratio{against="training",feature="user_clicks_5m"} 0.02' in text, text
    assert 'flywheel_feature_mismatch_ratio{against="point_in_time",feature="item_ctr_1h"} 0.01' in text
    assert "flywheel_consistency_compared_candidates 40.0" in text
    series = {'flywheel_feature_mismatch_ratio{against="training",feature="user_clicks_5m"}': values((0.02, 4)),
              'flywheel_feature_mismatch_ratio{against="training",feature="item_ctr_1h"}': values((0, 4)),
              'flywheel_feature_mismatch_ratio{against="point_in_time",feature="item_ctr_1h"}': values((0.3, 4))}
    rule_test(promtool, s, tmp_path, series, [{"eval_time": "10s", "alertname": "FlywheelFeatureSkew", "exp_alerts": [
        {"exp_labels": {"severity": "ticket", "against": "training", "feature": "user_clicks_5m"},
         "exp_annotations": {"summary": "2% of served candidates were trained on another value of user_clicks_5m "
                                        "than they were served with (the last consistency report)"}}]}])
