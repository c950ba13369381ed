"""Manual rollback: move @champion back to the previous champion (or a named version), recording who
and why on the version rolled back from, then verify the alias. Serving follows the alias.
Logic: models/registry.py (also `flywheel rollback`).
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag, task

from infra.settings import setting_from_environ
from task_settings import task_model  # dags/ is on sys.path


@dag(
    dag_id="model_rollback",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "model_name": Param(setting_from_environ("models", "name"), type="string", minLength=1, description="Registered model."),
        "scenario": Param("", type="string", description="A scenario the dataset spec declares ([scenarios.<name>]): "
                                                        "its ranker, on its own exposures. Empty: model_name's model."),
        "version": Param("previous", type="string", pattern=r"^(previous|[0-9]+)$",
                         description='Target version number, or "previous" (the champion before the current one).'),
        "reason": Param("", type="string", description="Why; recorded on the version rolled back from. Required."),
    },
    tags=["models"],
    doc_md=__doc__,
)
def model_rollback():
    @task
    def rollback(params=None, dag_run=None) -> dict:
        from models.registry import rollback

        who = f"airflow:{getattr(dag_run, 'triggering_user_name', None) or 'unknown'}"
        s, model = task_model(params)
        old, new = rollback(s, params["reason"], params["version"], who=who, model=model)
        return {"from": old, "to": new}

    @task
    def verify(moved: dict, params=None) -> str:
        from models.registry import CHAMPION, alias_version, connect

        s, model = task_model(params)
        serving = alias_version(connect(s), model.name, CHAMPION)
        if serving != moved["to"]:
            raise RuntimeError(f"@champion is v{serving}, not v{moved['to']} as the rollback set it")
        return serving

    verify(rollback())


model_rollback()
