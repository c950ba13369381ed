"""Feast objects: entities, the stream feature views (one per spec in streaming/features.py) and the
feature services for serving and training.

Each stream view is fed by a push source (the ingestor pushes rows online) backed by a directory of
Parquet files (the ingestor appends one file per micro-batch), which is what point-in-time-correct
training sets read. Windowed views live only as long as their window: past it, a point-in-time join
finds nothing and the model sees the documented default (0), not a stale count.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource
from feast.types import Array, FeastType, Float64, Int64, String
from feast.value_type import ValueType

from infra.settings import Settings
from streaming.features import STREAM_VIEWS, WINDOWS, StreamView

FEAST_TYPES: dict[str, FeastType] = {
    "BIGINT": Int64, "DOUBLE": Float64, "STRING": String,
    "ARRAY<STRING>": Array(String), "ARRAY<BIGINT>": Array(Int64), "ARRAY<DOUBLE>": Array(Float64),
}
WINDOW_TTL = {"5m": timedelta(minutes=5), "1h": timedelta(hours=1)}
LONG_TTL = timedelta(days=365)
TIMESTAMP_FIELD = "event_timestamp"

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.STRING, description="A user (raw id).")
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.STRING, description="An item (raw id).")
category = Entity(name="category", join_keys=["category"], value_type=ValueType.STRING,
                  description="An item category.")
ENTITIES = {"user_id": user, "item_id": item, "category": category}


def offline_dir(s: Settings) -> Path:
    return s.paths.service_dir("offline")


def view_dir(s: Settings, view: str) -> Path:
    """Where a feature view's offline rows live: a directory of Parquet files."""
    return offline_dir(s) / "features" / view


def _ttl(view: StreamView) -> timedelta:
    suffix = view.name.rsplit("_", 1)[-1]
    return WINDOW_TTL[suffix] if suffix in WINDOWS else LONG_TTL


def stream_feature_view(s: Settings, spec: StreamView) -> FeatureView:
    batch = FileSource(name=f"{spec.name}_offline", path=str(view_dir(s, spec.name)),
                       timestamp_field=TIMESTAMP_FIELD)
    return FeatureView(
        name=spec.name,
        entities=[ENTITIES[k] for k in spec.keys],
        ttl=_ttl(spec),
        schema=[Field(name=n, dtype=FEAST_TYPES[t]) for n, t in spec.columns],
        source=PushSource(name=spec.push_source, batch_source=batch),
        online=True,
        description=f"Stream feature view computed by the Flink job into topic {spec.topic}.",
    )


def definitions(s: Settings) -> list:
    """Everything `apply` registers."""
    stream = [stream_feature_view(s, spec) for spec in STREAM_VIEWS]
    # The ranking model's features: the candidate item and its user; the user x category affinity
    # is looked up with the candidate's category.
    ranking = stream
    services = [
        FeatureService(name="ranking_serving", features=ranking, description="Online features for ranking."),
        FeatureService(name="ranking_training", features=ranking,
                       description="The same features, point-in-time correct, for training sets."),
    ]
    return [user, item, category, *stream, *services]
