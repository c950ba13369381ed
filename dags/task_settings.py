"""The settings a task runs with. Not a DAG file (.airflowignore); imported by the DAG files.

Loaded inside tasks only: parsing a DAG file reads no config (what the DAG itself needs, its schedule
and parameter defaults, comes from `setting_from_environ`)."""

from __future__ import annotations

from datetime import UTC, datetime

from infra.settings import Settings, get_settings, override


def task_settings(params: dict | None = None) -> Settings:
    """The process's settings, for the registered model the run names (`model_name`), if it names one."""
    s = get_settings()
    return override(s, "models", name=params["model_name"]) if params and params.get("model_name") else s


def moment(text: str) -> datetime:
    """A run parameter's ISO date or date-time; UTC when it names no zone."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
