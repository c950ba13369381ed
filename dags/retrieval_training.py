"""Retrieval training: the two-tower model on the offline event log's behavior -> a registered version of
the retrieval model -> its gate (recall@K against the retrieval @champion on the same recent window).
A promoted version reaches `POST /recommend` by itself: the near-line embedder follows the alias, builds
the version's ANN index and user embeddings, then switches the server to them (serving/nearline.py).

On `retrieval.training_schedule` (daily), over the `retrieval.training_days` before the run; a scheduled
run with too little behavior is skipped (a run given a window fails instead). Rollback: the
model_rollback DAG with this model's name. Logic: models/retrieval_train.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Param, dag, task

from infra.settings import setting_from_environ
from task_settings import moment, task_settings  # dags/ is on sys.path


@dag(
    dag_id="retrieval_training",
    schedule=setting_from_environ("retrieval", "training_schedule") or None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=2)},
    params={
        "data_start": Param(None, type=["null", "string"], description="First event time, ISO (UTC). Empty: "
                            "`retrieval.training_days` before data_end."),
        "data_end": Param(None, type=["null", "string"],
                          description="End of the window (exclusive), ISO. Empty: the run's data interval end."),
        "promote": Param(True, type="boolean", description="Run the gate after registering."),
    },
    tags=["models", "retrieval"],
    doc_md=__doc__,
)
def retrieval_training():
    @task
    def train(params=None, data_interval_end=None) -> dict:
        from dataclasses import asdict

        from airflow.sdk.exceptions import AirflowSkipException

        from models.retrieval_train import NoBehavior, retrieval_window, train_retrieval

        s = task_settings()
        given = params["data_start"] or params["data_end"]
        start, end = retrieval_window(s, moment(params["data_end"]) if params["data_end"] else data_interval_end)
        start = moment(params["data_start"]) if params["data_start"] else start
        try:
            return asdict(train_retrieval(s, start, end))
        except NoBehavior as exc:
            if given:
                raise
            raise AirflowSkipException(str(exc)) from None

    @task.short_circuit
    def promotion_asked(params=None) -> bool:
        return bool(params["promote"])

    @task
    def gate(trained: dict) -> dict:
        from dataclasses import asdict

        from models.retrieval_train import gate_retrieval

        return asdict(gate_retrieval(task_settings(), trained["version"]))

    trained = train()
    trained >> promotion_asked() >> gate(trained)


retrieval_training()
