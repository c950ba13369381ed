"""Offline full training: the training set of a date range -> full model -> registered version -> the
promotion gate against @champion on the same recent window.

On `airflow.full_training_schedule` (daily), over the `airflow.full_training_days` before the run; a
scheduled run whose window holds no impressions is skipped (a run given a window fails instead).
Triggered from the UI ("Trigger DAG w/ config") or the REST API, a run can name its own window, model
and kind, or register without promoting.
All logic is in models/train.py; this file only schedules it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Param, dag, task
from promotion import gate_if_asked  # dags/ is on sys.path
from task_settings import moment, task_model

from infra.settings import setting_from_environ


@dag(
    dag_id="offline_training",
    schedule=setting_from_environ("airflow", "full_training_schedule") or None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=2)},
    params={
        "data_start": Param(None, type=["null", "string"],
                            description="First impression time, ISO date or date-time (UTC). "
                                        "Empty: `full_training_days` before data_end."),
        "data_end": Param(None, type=["null", "string"],
                          description="End of the window (exclusive), ISO. Empty: the run's data interval end."),
        "model_name": Param(setting_from_environ("models", "name"), type="string", minLength=1, description="Registered model."),
        "scenario": Param("", type="string", description="A scenario the dataset spec declares ([scenarios.<name>]): "
                                                        "its ranker, on its own exposures. Empty: model_name's model."),
        "kind": Param(setting_from_environ("models", "architecture"), type="string", minLength=1,
                      description="The network: a name of models/architectures.py (ranker, ranker-v1, logreg) "
                                  "or a user's by import path, package.module:attribute."),
        "promote": Param(True, type="boolean", description="Run the promotion gate after registering."),
        "baselines": Param(False, type="boolean",
                           description="Also report the test AUC of popularity, logistic regression and "
                                       "gradient-boosted trees on the same split (test_auc_popularity, "
                                       "test_auc_logreg, test_auc_gbdt)."),
    },
    tags=["models"],
    doc_md=__doc__,
)
def offline_training():
    @task
    def train(params=None, data_interval_end=None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from models.dataset import NoImpressions, Window
        from models.train import train_full

        s, model = task_model(params)
        end = moment(params["data_end"]) if params["data_end"] else data_interval_end or datetime.now(UTC)
        start = (moment(params["data_start"]) if params["data_start"]
                 else end - timedelta(days=s.airflow.full_training_days))
        try:
            outcome = train_full(s, Window(start, end), kind=params["kind"], promote=False, progress=False,
                                 baselines=params.get("baselines", False), model=model)
        except NoImpressions as exc:
            if params["data_start"] or params["data_end"]:
                raise
            raise AirflowSkipException(str(exc)) from None
        return {"model": model.name, "version": outcome.version, "window": str(outcome.window), **outcome.metrics}

    gate_if_asked(train())


offline_training()
