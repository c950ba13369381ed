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
    """The settings and the registered model the run names (Settings.model_for): its `scenario`'s ranker, else
    `model_name`'s model."""
    s, params = get_settings(), params or {}
    return s, s.model_for(params.get("model_name"), params.get("scenario"))


def due(watermarks: dict[RegisteredModel, datetime | None], written: datetime | None) -> RegisteredModel | None:
    """Of rankers and their @champion's data watermark (None: no champion to continue), the one a scheduled
    incremental run continues: of those with events logged since their watermark, the longest waiting; each
    in turn (None: none has new events)."""
    waiting = [(mark, i, m) for i, (m, mark) in enumerate(watermarks.items())
               if mark is not None and written is not None and written >= mark]
    return min(waiting)[2] if waiting else None


def moment(text: str) -> datetime:
    """A run parameter's ISO date or date-time; UTC when it names no zone."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
