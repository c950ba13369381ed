"""The end both training DAGs share: promote through the gate only when the run asks
(models/train.py: gate_version). Not a DAG file (.airflowignore); imported by the DAG files."""

from __future__ import annotations

from airflow.sdk import task

from task_settings import task_settings  # dags/ is on sys.path


def gate_if_asked(trained) -> None:
    """trained >> promotion_asked (skips the rest when the `promote` param is false) >> gate(trained version).
    After the training task: a run that skips training (a quiet stack, every few minutes) then starts no
    second task process (each costs seconds of CPU, taken from serving on the same host)."""

    @task.short_circuit
    def promotion_asked(params=None) -> bool:
        return bool(params["promote"])

    @task
    def gate(trained: dict, params=None) -> dict:
        from dataclasses import asdict

        from models.train import gate_version

        s = task_settings()  # the model trained: the run's, or the one a scheduled run chose
        return asdict(gate_version(s, trained["version"], s.registered_model(trained["model"])))

    trained >> promotion_asked() >> gate(trained)
