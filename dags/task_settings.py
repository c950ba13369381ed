"""The settings a task runs with. Not a DAG file (.airflowignore); imported by the DAG files.

Loaded inside tasks only: parsing a DAG file reads no config (what the DAG itself needs, its schedule
and parameter defaults, comes from `setting_from_environ`)."""

from __future__ import annotations

from datetime import UTC, datetime

from infra.settings import RegisteredModel, Settings, get_settings


def task_settings() -> Settings:
    """The process's settings."""
    return get_settings()


def task_model(params: dict | None) -> tuple[Settings, RegisteredModel]:
    """The settings and the registered model the run names: its `scenario`'s ranker, else `model_name`'s model
    (the platform's ranker where it names neither). A scenario and another model's name are refused together."""
    s, params = get_settings(), params or {}
    named = s.registered_model(params.get("model_name"))
    if not params.get("scenario"):
        return s, named
    model = s.scenario_model(params["scenario"])
    if named not in (model, s.ranker):
        raise ValueError(f"the run names scenario {params['scenario']!r} (model {model.name}) and model_name "
                         f"{named.name!r}: name one")
    return s, model


def moment(text: str) -> datetime:
    """A run parameter's ISO date or date-time; UTC when it names no zone."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
