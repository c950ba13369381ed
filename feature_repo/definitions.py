"""Feast objects: entities, the stream feature views (one per spec in streaming/features.py) and the
feature services for serving and training.

Each stream view is fed by a push source (the ingestor pushes rows online) backed by a directory of
Parquet files (the ingestor appends one file per micro-batch, all with the view's Arrow schema),
which point-in-time-correct training sets read through the DuckDB offline store. Windowed views
live only as long as their window: past it, a point-in-time join finds nothing and the model sees
the documented default (0), not a stale count. Batch views hold catalog snapshots (catalog.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pyarrow as pa
from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource
from feast.data_format import ParquetFormat
from feast.types import Array, FeastType, Float64, Int64, String
from feast.value_type import ValueType

from feature_repo.files import view_dir
from infra.dataset import TableSpec
from infra.settings import Settings
from streaming.events import dataset_spec
from streaming.features import BIGINT, DOUBLE, DOUBLE_ARRAY, STREAM_VIEWS, STRING, STRING_ARRAY, StreamView

FEAST_TYPES: dict[str, FeastType] = {
    "BIGINT": Int64, "DOUBLE": Float64, "STRING": String,
    "ARRAY<STRING>": Array(String), "ARRAY<BIGINT>": Array(Int64), "ARRAY<DOUBLE>": Array(Float64),
}
ARROW_TYPES: dict[str, pa.DataType] = {
    "BIGINT": pa.int64(), "DOUBLE": pa.float64(), "STRING": pa.string(),
    "ARRAY<STRING>": pa.list_(pa.string()), "ARRAY<BIGINT>": pa.list_(pa.int64()),
    "ARRAY<DOUBLE>": pa.list_(pa.float64()),
}
TIMESTAMP_FIELD = "event_timestamp"

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.STRING, description="A user (raw id).")
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.STRING, description="An item (raw id).")
category = Entity(name="category", join_keys=["category"], value_type=ValueType.STRING,
                  description="An item category.")
# The spec's further grouping keys (a brand beside the category, a page), each an entity of its per-user counts.
GROUPS = tuple(Entity(name=key, join_keys=[key], value_type=ValueType.STRING,
                      description=f"A request's {key}." if key in dataset_spec().context_keys else f"An item {key}.")
               for key in dataset_spec().group_by)
ENTITIES = {"user_id": user, "item_id": item, "category": category, **{e.name: e for e in GROUPS}}


@dataclass(frozen=True)
class BatchView:
    """A feature view written in batches, not by the stream job: catalog snapshots, graph results."""

    name: str
    keys: tuple[str, ...]
    columns: tuple[tuple[str, str], ...]  # (feature name, SQL type), as in StreamView
    description: str = "Catalog snapshots, materialized into the online store."


# The catalog's views: one column per attribute the dataset spec declares for its item and user tables.
SQL_TYPES = {"categorical": STRING, "multi": STRING_ARRAY, "integer": BIGINT, "number": DOUBLE, "date": DOUBLE}


def catalog_view(name: str, table: TableSpec) -> BatchView:
    return BatchView(name, (f"{table.entity}_id",),
                     tuple((table.feature(a), SQL_TYPES[a.kind]) for a in table.attributes))


ITEM_ATTRIBUTES = catalog_view("item_attributes", dataset_spec().table("item"))
USER_PROFILE = catalog_view("user_profile", dataset_spec().table("user"))
BATCH_VIEWS: tuple[BatchView, ...] = (ITEM_ATTRIBUTES, USER_PROFILE)  # materialized from their files
# Written online by the graph update itself (models/graph.py), and offline for training sets.
ITEM_NEIGHBOURS = BatchView("item_neighbours", ("item_id",), (
    ("neighbour_ids", STRING_ARRAY), ("neighbour_scores", DOUBLE_ARRAY)),
    "Item-item neighbours by decayed co-interaction in the behavior graph, best first, for recall.")
GRAPH_VIEWS: tuple[BatchView, ...] = (ITEM_NEIGHBOURS,)


def offline_schema(spec: StreamView | BatchView) -> pa.Schema:
    """The Arrow schema of every offline file of a view: its keys, its columns, the event timestamp."""
    return pa.schema([*((k, pa.string()) for k in spec.keys), *((n, ARROW_TYPES[t]) for n, t in spec.columns),
                      (TIMESTAMP_FIELD, pa.timestamp("ms", tz="UTC"))])


def offline_rows(spec: BatchView, rows: list[dict], as_of: datetime) -> pa.Table:
    """Rows of a batch view (one dict per entity) valid from `as_of`, as an offline file's table."""
    return pa.Table.from_pylist([r | {TIMESTAMP_FIELD: as_of} for r in rows], schema=offline_schema(spec))


def _offline_source(s: Settings, name: str) -> FileSource:
    return FileSource(name=f"{name}_offline", path=str(view_dir(s, name) / "*.parquet"),
                      file_format=ParquetFormat(), timestamp_field=TIMESTAMP_FIELD)


def _schema(spec: StreamView | BatchView) -> list[Field]:
    return [Field(name=n, dtype=FEAST_TYPES[t]) for n, t in spec.columns]


def stream_feature_view(s: Settings, spec: StreamView) -> FeatureView:
    batch = _offline_source(s, spec.name)
    return FeatureView(
        name=spec.name,
        entities=[ENTITIES[k] for k in spec.keys],
        ttl=spec.ttl,
        schema=_schema(spec),
        source=PushSource(name=spec.push_source, batch_source=batch),
        online=True,
        description=f"Stream feature view computed by the Flink job into topic {spec.topic}.",
    )


def batch_feature_view(s: Settings, spec: BatchView) -> FeatureView:
    return FeatureView(
        name=spec.name,
        entities=[ENTITIES[k] for k in spec.keys],
        ttl=timedelta(0),  # rows hold until newer ones replace them
        schema=_schema(spec),
        source=_offline_source(s, spec.name),
        online=True,
        description=spec.description,
    )


def definitions(s: Settings) -> list:
    """Everything `apply` registers."""
    stream = [stream_feature_view(s, spec) for spec in STREAM_VIEWS]
    batch = [batch_feature_view(s, spec) for spec in BATCH_VIEWS]
    graph = [batch_feature_view(s, spec) for spec in GRAPH_VIEWS]
    # The ranking model's features: the candidate item and its user; the user x category affinity
    # is looked up with the candidate's category.
    ranking = [*stream, *batch]
    services = [
        FeatureService(name="ranking_serving", features=ranking, description="Online features for ranking."),
        FeatureService(name="ranking_training", features=ranking,
                       description="The same features, point-in-time correct, for training sets."),
        FeatureService(name="recall", features=graph, description="Candidate generation: item neighbours."),
    ]
    return [user, item, category, *GROUPS, *stream, *batch, *graph, *services]
