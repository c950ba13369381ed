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
    """The settings and the registered model the run names (`model_name`; the ranker where it names none)."""
    s = get_settings()
    return s, s.registered_model((params or {}).get("model_name"))


def moment(text: str) -> datetime:
    """A run parameter's ISO date or date-time; UTC when it names no zone."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
