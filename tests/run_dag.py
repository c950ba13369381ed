"""Airflow in a child process, for tests (Airflow reads AIRFLOW_HOME once, at import).

    python -m tests.run_dag --parse         the DAG folder's DAGs, import errors, the heavy modules
                                            parsing imported and whether it loaded settings, as JSON
    python -m tests.run_dag DAG_ID [CONF]   one run with `dag.test()` (no scheduler, no executor); the
                                            run's state, each task's state and return value, as JSON

Needs AIRFLOW_HOME (with a migrated database for runs) and the Flywheel settings of the stack to run
against in the environment.
"""

from __future__ import annotations

import json
import sys

# What tasks import lazily; none of it may be imported while the DAG files are parsed.
HEAVY = ("tensorflow", "keras", "mlflow", "feast", "pyflink", "falkordb", "pandas", "pyarrow",
         "models", "feature_repo", "streaming")


def main() -> None:
    from airflow.dag_processing.dagbag import BundleDagBag

    from infra.settings import get_settings, setting_from_environ

    # As the dag-processor and the task runner load them: the bundle (dags/) is on sys.path.
    dags = setting_from_environ("paths", "dags_dir")
    bag = BundleDagBag(dag_folder=str(dags), bundle_path=dags)
    if sys.argv[1] == "--parse":
        print("RESULT " + json.dumps({"dags": sorted(bag.dag_ids), "errors": bag.import_errors,
                                      "heavy": sorted(m for m in HEAVY if m in sys.modules),
                                      "settings_loaded": get_settings.cache_info().currsize > 0}))
        return
    dag_id, conf = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if bag.import_errors or dag_id not in bag.dag_ids:
        raise SystemExit(f"cannot load {dag_id}: {bag.import_errors}")
    run = bag.get_dag(dag_id).test(run_conf=conf)
    print("RESULT " + json.dumps({"state": run.state, "tasks": {ti.task_id: ti.state for ti in run.get_task_instances()},
                                  "values": _return_values(dag_id, run.run_id)}, default=str))


def _return_values(dag_id: str, run_id: str) -> dict:
    from sqlalchemy import select

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.dag_id == dag_id, XComModel.run_id == run_id,
                                                       XComModel.key == "return_value")).all()
        return {x.task_id: XComModel.deserialize_value(x) for x in rows}


if __name__ == "__main__":
    main()
