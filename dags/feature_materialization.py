"""Batch feature views (catalog snapshots) into the online store, incrementally: each run copies the
rows newer than the last materialization, up to the end of its data interval. Logic: feature_repo/catalog.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task

from infra.settings import setting_from_environ
from task_settings import task_settings  # dags/ is on sys.path


@dag(
    dag_id="feature_materialization",
    schedule=timedelta(minutes=setting_from_environ("airflow", "materialization_minutes")),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    tags=["features"],
    doc_md=__doc__,
)
def feature_materialization():
    @task
    def materialize(data_interval_end=None) -> list[str]:
        from feature_repo.catalog import materialize

        return materialize(task_settings(), data_interval_end or datetime.now(UTC))

    materialize()


feature_materialization()
