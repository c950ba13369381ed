"""The behavior graph: add the user-item behavior logged since the last run to FalkorDB (batched Cypher
upserts, time-decayed weights), then recompute and publish the item neighbours (the `item_neighbours`
feature, for recall) of the items that gained behavior. Incremental and exactly once: see models/graph.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task

from infra.settings import setting_from_environ
from task_settings import task_settings  # dags/ is on sys.path


@dag(
    dag_id="graph_update",
    schedule=timedelta(minutes=setting_from_environ("airflow", "graph_update_minutes")),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    tags=["graph", "features"],
    doc_md=__doc__,
)
def graph_update():
    @task
    def add_edges() -> dict:
        from dataclasses import asdict

        from models.graph import add_edges

        return asdict(add_edges(task_settings()))

    @task
    def refresh_neighbours() -> dict:
        # Refreshes every item still marked stale, so a failed earlier refresh is made good here.
        from dataclasses import asdict

        from models.graph import refresh_neighbours

        return asdict(refresh_neighbours(task_settings()))

    add_edges() >> refresh_neighbours()


graph_update()
