"""Minute-level incremental training: continue @champion on the labelled impressions since its data
watermark, register the version (with its sparse delta), and gate it on the newest part of the new data.

Every `airflow.incremental_training_minutes` (2). Airflow suits minutes, not seconds: a run costs
seconds of scheduling and task start-up, and a few minutes of traffic is what it takes to collect
enough new clicks to move the model and to judge it. Runs never overlap (max_active_runs=1); a run with
too little new data is skipped, and the next one picks it up. With scenarios declared, a scheduled run
continues one ranker: of those with new events, the one waiting longest (each in turn); a run naming a
scenario (or triggered by hand) continues that one. Logic: models/train.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Param, dag, task

from infra.settings import setting_from_environ
from promotion import gate_if_asked  # dags/ is on sys.path
from task_settings import due, task_model


@dag(
    dag_id="incremental_training",
    schedule=timedelta(minutes=setting_from_environ("airflow", "incremental_training_minutes")),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=30),
    default_args={"retries": 0},  # the next run, minutes later, is the retry
    params={
        "model_name": Param(setting_from_environ("models", "name"), type="string", minLength=1, description="Registered model."),
        "scenario": Param("", type="string", description="A scenario the dataset spec declares ([scenarios.<name>]): "
                                                        "its ranker, on its own exposures. Empty: model_name's model."),
        "promote": Param(True, type="boolean", description="Run the promotion gate after registering."),
    },
    tags=["models"],
    doc_md=__doc__,
)
def incremental_training():
    @task
    def train(params=None, dag_run=None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from feature_repo.event_log import last_write
        from models.registry import champion_watermark

        s, model = task_model(params)
        written, marks = last_write(s), {}
        if dag_run is not None and dag_run.run_type == "scheduled" and len(s.rankers) > 1:
            # Scenarios' rankers too: a scheduled run continues the one waiting longest for its new events.
            marks = {m: champion_watermark(s, m) for m in s.rankers}
            model = due({m: mark and mark[1] for m, mark in marks.items()}, written) or model
        # Most runs of a quiet stack find nothing new: decide that before importing TensorFlow, the
        # bulk of a run's CPU. Events after the watermark reach the log after it too.
        champion = marks[model] if model in marks else champion_watermark(s, model)
        if champion is not None and (written is None or written < champion[1]):
            raise AirflowSkipException(f"nothing logged since @champion v{champion[0]}'s data watermark")

        from models.train import train_incremental

        outcome = train_incremental(s, promote=False, progress=False, model=model)
        if outcome is None:
            raise AirflowSkipException("too few new labelled impressions or clicks since the champion's data watermark "
                                        "to train a version and judge it (the task log says how many)")
        return {"model": model.name, "version": outcome.version, "window": str(outcome.window), **outcome.metrics}

    gate_if_asked(train())


incremental_training()
