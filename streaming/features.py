"""The stream feature views: what the Flink job computes, the topic each goes to, the columns each has.

This is the contract between the stream job (which writes one Kafka topic per view) and the feature
store (feature_repo/ builds a Feast push source and feature view from each spec). Standard library
only: both environments import it.

Every row is a snapshot "as of" `event_time` of the event that produced it, so rewriting a row is
idempotent and Feast's point-in-time joins see only what was known then.
"""

from __future__ import annotations

from dataclasses import dataclass

# Column types, in the Flink SQL spelling; feature_repo maps them to Feast types.
BIGINT, DOUBLE, STRING = "BIGINT", "DOUBLE", "STRING"
STRING_ARRAY, BIGINT_ARRAY, DOUBLE_ARRAY = "ARRAY<STRING>", "ARRAY<BIGINT>", "ARRAY<DOUBLE>"

TOPIC_PREFIX = "features."


@dataclass(frozen=True)
class StreamView:
    name: str
    keys: tuple[str, ...]  # entity join keys
    columns: tuple[tuple[str, str], ...]  # (feature name, SQL type)

    @property
    def topic(self) -> str:
        return TOPIC_PREFIX + self.name

    @property
    def push_source(self) -> str:
        return f"{self.name}_push"


def _window_view(entity: str, suffix: str) -> StreamView:
    """Impressions, clicks and smoothed CTR of an entity over a window ("total": all history)."""
    return StreamView(f"{entity}_{suffix}", (f"{entity}_id",), (
        (f"{entity}_impressions_{suffix}", BIGINT), (f"{entity}_clicks_{suffix}", BIGINT),
        (f"{entity}_ctr_{suffix}", DOUBLE)))


# Sliding event-time windows over the events up to and including the current one.
WINDOWS = {"5m": "INTERVAL '5' MINUTE", "1h": "INTERVAL '1' HOUR"}

STREAM_VIEWS: tuple[StreamView, ...] = (
    *(_window_view(entity, suffix) for entity in ("user", "item") for suffix in WINDOWS),
    *(_window_view(entity, "total") for entity in ("user", "item")),
    StreamView("user_category", ("user_id", "category"), (
        ("category_impressions", BIGINT), ("category_clicks", BIGINT), ("category_ctr", DOUBLE))),
    StreamView("user_sequence", ("user_id",), (
        ("seq_item_ids", STRING_ARRAY), ("seq_event_types", STRING_ARRAY), ("seq_event_times", BIGINT_ARRAY))),
    StreamView("user_interest", ("user_id",), (
        ("interest_categories", STRING_ARRAY), ("interest_weights", DOUBLE_ARRAY))),
)

VIEWS_BY_NAME = {v.name: v for v in STREAM_VIEWS}
