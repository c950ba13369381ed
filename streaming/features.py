"""The stream feature views, each declared once: its keys, columns, TTL, whether it is an updating
(upsert) view, and the Flink SQL query that computes it.

This is the contract between the stream job (streaming/job.py runs every view's query into the view's
topic), the feature store (feature_repo/ builds a Feast push source and feature view from each) and the
training-set builder (models/dataset.py takes the model's scalar inputs from the views' columns). A new
view is one declaration here plus the model inputs that use it. Standard library only: both
environments import it.

Every row is a snapshot "as of" `event_time` of the event that produced it, so rewriting a row is
idempotent and Feast's point-in-time joins see only what was known then. Queries read the job's
`valid_events` view (parsed events with `is_impression` / `is_click` flags and the event-time
attribute `rowtime`) and select the keys, `event_time`, then the columns in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from infra.settings import Settings

# Column types, in the Flink SQL spelling; feature_repo maps them to Feast types.
BIGINT, DOUBLE, STRING = "BIGINT", "DOUBLE", "STRING"
STRING_ARRAY, BIGINT_ARRAY, DOUBLE_ARRAY = "ARRAY<STRING>", "ARRAY<BIGINT>", "ARRAY<DOUBLE>"

TOPIC_PREFIX = "features."
LONG_TTL = timedelta(days=365)


@dataclass(frozen=True)
class StreamView:
    name: str
    keys: tuple[str, ...]  # entity join keys
    columns: tuple[tuple[str, str], ...]  # (feature name, SQL type)
    ttl: timedelta  # how long a row answers for its key: a window view's rows live as long as their window
    # True: an updating aggregate (GROUP BY, no watermark wait, late events included) upserted by key;
    # False: one appended row per input, in event-time order.
    upsert: bool
    query: Callable[[Settings], str]  # the SELECT over `valid_events`: keys, event_time, columns

    @property
    def topic(self) -> str:
        return TOPIC_PREFIX + self.name

    @property
    def push_source(self) -> str:
        return f"{self.name}_push"


def _smoothed_ctr(s: Settings, clicks: str, impressions: str) -> str:
    weight = s.streaming.ctr_prior_weight
    return f"({clicks} + {weight * s.streaming.ctr_prior}) / ({impressions} + {weight})"


def _counts_columns(entity: str, suffix: str) -> tuple[tuple[str, str], ...]:
    return ((f"{entity}_impressions_{suffix}", BIGINT), (f"{entity}_clicks_{suffix}", BIGINT),
            (f"{entity}_ctr_{suffix}", DOUBLE))


def window_view(entity: str, suffix: str, minutes: int) -> StreamView:
    """Impressions, clicks and smoothed CTR of an entity in the event-time window ending at each event."""
    key = f"{entity}_id"

    def query(s: Settings) -> str:
        return f"""
            SELECT {key}, event_time, imps, clicks, {_smoothed_ctr(s, 'clicks', 'imps')}
            FROM (SELECT {key}, event_time,
                    CAST(SUM(is_impression) OVER w AS BIGINT) AS imps, CAST(SUM(is_click) OVER w AS BIGINT) AS clicks
                  FROM valid_events
                  WINDOW w AS (PARTITION BY {key} ORDER BY rowtime
                               RANGE BETWEEN INTERVAL '{minutes}' MINUTE PRECEDING AND CURRENT ROW))"""

    return StreamView(f"{entity}_{suffix}", (key,), _counts_columns(entity, suffix), timedelta(minutes=minutes),
                      upsert=False, query=query)


def running_view(name: str, keys: tuple[str, ...], columns: tuple[tuple[str, str], ...],
                 where: str = "TRUE") -> StreamView:
    """Impressions, clicks and smoothed CTR over all history: an updating aggregate, upserted by key."""
    key_list = ", ".join(keys)

    def query(s: Settings) -> str:
        return f"""
            SELECT {key_list}, MAX(event_time), CAST(SUM(is_impression) AS BIGINT), CAST(SUM(is_click) AS BIGINT),
                   {_smoothed_ctr(s, 'SUM(is_click)', 'SUM(is_impression)')}
            FROM valid_events WHERE {where} GROUP BY {key_list}"""

    return StreamView(name, keys, columns, LONG_TTL, upsert=True, query=query)


def _sequence(s: Settings) -> str:
    n = s.streaming.sequence_length
    return f"""
        SELECT user_id, event_time, ARRAY_AGG(item_id) OVER w, ARRAY_AGG(event_type) OVER w,
               ARRAY_AGG(event_time) OVER w
        FROM valid_events WHERE event_type <> 'impression'
        WINDOW w AS (PARTITION BY user_id ORDER BY rowtime ROWS BETWEEN {n - 1} PRECEDING AND CURRENT ROW)"""


def _interest(s: Settings) -> str:
    # interest_histogram: the job's aggregate function (decayed weights per category, top k)
    return """
        SELECT user_id, event_time, interest.categories, interest.weights
        FROM (SELECT user_id, MAX(event_time) AS event_time, interest_histogram(category, event_time) AS interest
              FROM valid_events WHERE event_type <> 'impression' AND category IS NOT NULL GROUP BY user_id)"""


STREAM_VIEWS: tuple[StreamView, ...] = (
    *(window_view(entity, suffix, minutes) for entity in ("user", "item") for suffix, minutes in (("5m", 5), ("1h", 60))),
    *(running_view(f"{entity}_total", (f"{entity}_id",), _counts_columns(entity, "total")) for entity in ("user", "item")),
    running_view("user_category", ("user_id", "category"), (
        ("category_impressions", BIGINT), ("category_clicks", BIGINT), ("category_ctr", DOUBLE)),
        where="category IS NOT NULL"),
    StreamView("user_sequence", ("user_id",), (
        ("seq_item_ids", STRING_ARRAY), ("seq_event_types", STRING_ARRAY), ("seq_event_times", BIGINT_ARRAY)),
        LONG_TTL, upsert=False, query=_sequence),
    StreamView("user_interest", ("user_id",), (
        ("interest_categories", STRING_ARRAY), ("interest_weights", DOUBLE_ARRAY)), LONG_TTL, upsert=True,
        query=_interest),
)
