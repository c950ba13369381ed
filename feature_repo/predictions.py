"""The prediction archive at rest: every record the ranking server logged (`serving.prediction_log`), served
and shadow, as Parquet partitioned by the date it was served (written by serving/prediction_archive.py).
Read by the outcome join and the consistency report (serving/) and by training (models/dataset.py: the
features each served candidate was scored with)."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import pandas as pd
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


def logged_features(records: pa.Table, names: Collection[str], repeated: Sequence[str] = ("request_id",),
                    per_item: Mapping[str, str] | None = None) -> pd.DataFrame:
    """One row per logged candidate of `records`: each record's `repeated` fields, its per-item lists renamed by
    `per_item` (default: `items` as `item_id`), and the features of `names` (numbers) as the server read
    them (NaN: nothing stored; a feature a record lacks: NaN for its rows)."""
    per_item = per_item or {"items": "item_id"}
    rows: dict[str, list] = {name: [] for name in (*repeated, *per_item.values())}
    for p in records.select([*repeated, *per_item, "features"]).to_pylist():
        n, at = len(p["items"]), len(rows[per_item["items"]])
        for field in repeated:
            rows[field] += [p[field]] * n
        for field, column in per_item.items():
            rows[column] += p[field]
        for name, values in (json.loads(p["features"]) if p["features"] else {}).items():
            if name in names and isinstance(values, list) and len(values) == n:
                column = rows.setdefault(name, [math.nan] * at)
                column += [math.nan] * (at - len(column)) + [math.nan if v is None else float(v) for v in values]
    n = len(rows[per_item["items"]])
    return pd.DataFrame({k: v + [math.nan] * (n - len(v)) for k, v in rows.items()})
