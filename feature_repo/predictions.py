"""The prediction archive at rest: every record the ranking server logged (`serving.prediction_log`), served
and shadow, as Parquet partitioned by the date it was served (written by serving/prediction_archive.py).
Read by the outcome join and the consistency report (serving/) and by training (models/dataset.py: the
features each served candidate was scored with)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from feature_repo.files import offline_dir, read_days
from infra.settings import Settings

SCHEMA = pa.schema([
    ("request_id", pa.string()), ("user_id", pa.string()), ("model_name", pa.string()),
    ("model_version", pa.string()), ("route", pa.string()), ("shadow", pa.bool_()), ("tier", pa.string()),
    ("served_at", pa.int64()), ("items", pa.list_(pa.string())), ("categories", pa.list_(pa.string())),
    ("scores", pa.list_(pa.float64())),  # null: a candidate the request's deadline left unscored
    ("features", pa.string()),  # the raw feature values as read (JSON): what the model saw
    ("sources", pa.list_(pa.list_(pa.string()))),  # /recommend: per item, the candidate sources; null for /rank
    ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
])


def archive_dir(s: Settings) -> Path:
    return offline_dir(s) / "predictions"


def read_predictions(s: Settings, start_ms: int | None = None, end_ms: int | None = None,
                     columns: list[str] | None = None) -> pa.Table:
    """The archive's records served in start_ms <= served_at < end_ms (all when not given); `columns`:
    only those (`served_at` among them when a period is given)."""
    # A file is written after the records in it were served: one older than start_ms holds none after it.
    table = read_days(archive_dir(s), SCHEMA, start_ms, end_ms, columns, written_since_ms=start_ms)
    if start_ms is not None:
        table = table.filter(pc.field("served_at") >= start_ms)
    return table.filter(pc.field("served_at") < end_ms) if end_ms is not None else table
