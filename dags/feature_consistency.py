"""Features served vs features trained on, every period: for the newest /rank lists served in the run's
data interval, each numeric feature's value as the ranking server read it against the training set's
(Chronon's consistency job). Saved for the exporter (/metrics/consistency: flywheel_feature_mismatch_ratio,
alerted above 0.1%). Logic: serving/consistency.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task

from infra.settings import setting_from_environ
from task_settings import task_settings  # dags/ is on sys.path


@dag(
    dag_id="feature_consistency",
    schedule=timedelta(minutes=setting_from_environ("airflow", "consistency_minutes")),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    tags=["features"],
    doc_md=__doc__,
)
def feature_consistency():
    @task
    def compare(data_interval_start=None, data_interval_end=None) -> dict:
        from serving.consistency import report, save

        s = task_settings()
        until = data_interval_end or datetime.now(UTC)
        since = data_interval_start or until - timedelta(minutes=s.airflow.consistency_minutes)
        period = int(since.timestamp() * 1000), int(until.timestamp() * 1000)
        table, counts = report(s, *period, requests=s.airflow.consistency_requests)
        save(s, table, counts, *period)
        worst = table.iloc[0] if len(table) else None  # the report's first row: the highest rate
        return {**counts, "worst": None if worst is None else {"feature": str(worst["feature"]),
                                                               "rate": float(worst["rate"])}}

    compare()


feature_consistency()
