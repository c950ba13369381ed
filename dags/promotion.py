"""The end both training DAGs share: promote through the gate only when the run asks
(models/train.py: gate_version). Not a DAG file (.airflowignore); imported by the DAG files."""

from __future__ import annotations

from airflow.sdk import task

from infra.settings import get_settings


def gate_if_asked(trained) -> None:
    """promotion_asked (skips the rest when the `promote` param is false) >> gate(trained version)."""

    @task.short_circuit
    def promotion_asked(params=None) -> bool:
        return bool(params["promote"])

    @task
    def gate(trained: dict, params=None) -> dict:
        from dataclasses import asdict

        from infra.settings import override
        from models.train import gate_version

        s = override(get_settings(), "models", name=params["model_name"])
        return asdict(gate_version(s, trained["version"]))

    promotion_asked() >> gate(trained)
