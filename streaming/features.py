"""The stream feature views, each declared once: its keys, columns, TTL, whether it is an updating
(upsert) view, and the Flink SQL query that computes it.

This is the contract between the stream job (streaming/job.py runs every view's query into the view's
topic), the feature store (feature_repo/ builds a Feast push source and feature view from each) and the
training-set builder (models/dataset.py takes the model's scalar inputs from the views' columns). A new
view is one declaration here plus the model inputs that use it. Standard library only: both
environments import it.

Every row is a snapshot "as of" `event_time` of the event that produced it, so rewriting a row is
idempotent and Feast's point-in-time joins see only what was known then. Queries read the job's
`valid_events` view (parsed events with `is_impression` / `is_click` flags and the processing-time
attribute `proctime`) and select the keys, `event_time`, then the columns in order (of every view
sharing the topic, in declaration order). No query waits for
a watermark: every view is an updating aggregate or ordered by arrival, so a row is out as soon as
the job has its event (or within one mini-batch), on a quiet stream too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from infra.settings import Settings
from streaming.events import dataset_spec

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
    # False: one appended row per input, in arrival order.
    upsert: bool
    query: Callable[[Settings], str]  # the SELECT over `valid_events`: keys, event_time, then `emitted`
    # What the query emits after the keys and event_time when it is not `columns`, and the function the
    # ingestor applies to each emitted row (a dict) to give it `columns`.
    emitted: tuple[tuple[str, str], ...] | None = None
    finish: Callable[[Settings, dict], dict] | None = None
    # Views computed by one aggregate share its topic (`features.{shared_topic}`): they have the same
    # keys and query, which emits all of their columns; the job runs it once, one row per update for
    # all of them, and the ingestor writes each view's columns from that row.
    shared_topic: str | None = None

    @property
    def topic(self) -> str:
        return TOPIC_PREFIX + (self.shared_topic or self.name)

    @property
    def push_source(self) -> str:
        return f"{self.name}_push"


def _smoothed_ctr(s: Settings, clicks: str, impressions: str) -> str:
    # DOUBLE literals (`E0`): a plain 0.5 is a DECIMAL in Flink SQL, and the sum then runs in BigDecimal
    weight = s.streaming.ctr_prior_weight
    return f"({clicks} + {weight * s.streaming.ctr_prior!r}E0) / ({impressions} + {float(weight)!r}E0)"


def _counts_columns(entity: str, suffix: str) -> tuple[tuple[str, str], ...]:
    return ((f"{entity}_impressions_{suffix}", BIGINT), (f"{entity}_clicks_{suffix}", BIGINT),
            (f"{entity}_ctr_{suffix}", DOUBLE))


# (suffix, minutes, time buckets) of the sliding windows of each entity with counts: the dataset spec's
WINDOWS = dataset_spec().window_buckets


def _entity_counts(entity: str) -> Callable[[Settings], str]:
    """One aggregate per entity for all its windows and its running totals (the views' declaration
    order), into the entity's shared topic `{entity}_counts`: one shuffle, one state lookup and one Kafka
    row per event for all of them.

    A window is `window_counts` (streaming/java/flywheel/WindowCounts.java): a ring of per-bucket counts
    per entity, `buckets` time buckets of `minutes` in all, ending with the bucket of the entity's
    newest event. An event adds to its bucket and a newer bucket pushes the oldest out, so the window
    spans between `minutes` minus one bucket and `minutes`, and older buckets leave it as the entity's
    events move on. A late event counts if its bucket is still in the window (nothing waits for a
    watermark); an older one changes no window.
    """
    key = f"{entity}_id"

    def query(s: Settings) -> str:
        windows = "".join(
            f"W.w_{suffix}.impressions, W.w_{suffix}.clicks, "
            f"{_smoothed_ctr(s, f'W.w_{suffix}.clicks', f'W.w_{suffix}.impressions')}, " for suffix, _, _ in WINDOWS)
        ring = "".join(f", window_counts(event_time, is_impression, is_click, {minutes * 60_000 // buckets}, "
                       f"{buckets}) AS w_{suffix}" for suffix, minutes, buckets in WINDOWS)
        return f"""
            SELECT {key}, event_time, {windows}imps, clicks, {_smoothed_ctr(s, 'clicks', 'imps')}
            FROM (SELECT {key}, MAX(event_time) AS event_time, CAST(SUM(is_impression) AS BIGINT) AS imps,
                         CAST(SUM(is_click) AS BIGINT) AS clicks{ring}
                  FROM valid_events GROUP BY {key}) AS W"""

    return query


def window_view(entity: str, suffix: str) -> StreamView:
    """Impressions, clicks and smoothed CTR of an entity in its sliding window `suffix` of WINDOWS, as
    of its newest event: an updating aggregate, so an event counts as soon as the job has it (or its
    mini-batch is flushed), whether or not any event follows. Its rows live as long as the window."""
    minutes = next(m for name, m, _ in WINDOWS if name == suffix)
    return StreamView(f"{entity}_{suffix}", (f"{entity}_id",), _counts_columns(entity, suffix),
                      timedelta(minutes=minutes), upsert=True, query=_entity_counts(entity),
                      shared_topic=f"{entity}_counts")


def total_view(entity: str) -> StreamView:
    """Impressions, clicks and smoothed CTR of an entity over all history, upserted by key."""
    return StreamView(f"{entity}_total", (f"{entity}_id",), _counts_columns(entity, "total"), LONG_TTL,
                      upsert=True, query=_entity_counts(entity), shared_topic=f"{entity}_counts")


def _user_key(column: str) -> Callable[[Settings], str]:
    """Impressions, clicks and smoothed CTR per user and value of a grouping key (`valid_events`' `column`)."""
    def query(s: Settings) -> str:
        return f"""
            SELECT user_id, `{column}`, MAX(event_time), CAST(SUM(is_impression) AS BIGINT),
                   CAST(SUM(is_click) AS BIGINT), {_smoothed_ctr(s, 'SUM(is_click)', 'SUM(is_impression)')}
            FROM valid_events WHERE `{column}` IS NOT NULL GROUP BY user_id, `{column}`"""

    return query


def key_count_columns(key: str) -> tuple[str, str, str]:
    """Impressions, clicks and CTR per (user, value) of the category ("category_ctr") or a further key
    ("brand_ctr")."""
    return f"{key}_impressions", f"{key}_clicks", f"{key}_ctr"


def user_key_view(key: str) -> StreamView:
    """Per (user, value) counts of the spec's first key (the category) or of a further one, over all history."""
    columns = tuple(zip(key_count_columns(key), (BIGINT, BIGINT, DOUBLE)))
    return StreamView(f"user_{key}", ("user_id", key), columns, LONG_TTL, upsert=True, query=_user_key(key))


def _sequence(s: Settings) -> str:
    # In arrival order (the order of the user's partition), so a row never waits for a watermark; the
    # row's time is the newest event in it, so a late event's row is not dated before what it holds.
    n = s.streaming.sequence_length
    return f"""
        SELECT user_id, MAX(event_time) OVER w, ARRAY_AGG(item_id) OVER w, ARRAY_AGG(event_type) OVER w,
               ARRAY_AGG(event_time) OVER w
        FROM valid_events WHERE is_impression = 0
        WINDOW w AS (PARTITION BY user_id ORDER BY proctime ROWS BETWEEN {n - 1} PRECEDING AND CURRENT ROW)"""


def _history(s: Settings) -> str:
    st = s.streaming
    return f"""
        SELECT user_id, H.event_time, H.history_length, H.categories, H.counts, H.items, H.types
        FROM (SELECT user_id, long_history(item_id, category, event_type, event_time, {st.history_length},
                                           {st.history_categories}, {st.history_per_category},
                                           {st.history_emit_every}) AS H
              FROM valid_events GROUP BY user_id)"""


# The long history (streaming/java/flywheel/LongHistory.java): every exposure and action, an action
# merged into the exposure it follows; `history_categories` categories, and `history_per_category`
# item slots per category with the strongest action on each ("" pads), newest first.
LONG_HISTORY_VIEW = StreamView("user_history", ("user_id",), (
    ("history_length", BIGINT), ("history_categories", STRING_ARRAY), ("history_category_counts", BIGINT_ARRAY),
    ("history_item_ids", STRING_ARRAY), ("history_event_types", STRING_ARRAY)), LONG_TTL, upsert=True, query=_history)


# --- the decayed interest histogram ------------------------------------------------------------
# Each action adds 1 to its category; a weight halves every half-life. Summing exp(rate * (t - epoch))
# is order-free and needs no Python: the job keeps one such sum per user and category, and the
# ingestor rescales them to the row's time (the user's newest action) and keeps the top k. A double
# holds exp(x) for |x| < 709: with the default one-week half-life, events within 19.6 years of the
# epoch (2012-01-01), i.e. 1992..2031; `streaming.interest_epoch_ms` moves it (a fresh job state).

def _interest_rate(s: Settings) -> float:
    return math.log(2) / (s.streaming.interest_half_life_hours * 3_600_000)


def _interest(column: str) -> Callable[[Settings], str]:
    def query(s: Settings) -> str:
        return f"""
            SELECT user_id, MAX(event_time), JSON_ARRAYAGG(JSON_ARRAY(`{column}`, weight))
            FROM (SELECT user_id, `{column}`, MAX(event_time) AS event_time,
                         SUM(EXP({_interest_rate(s)!r} * (event_time - {s.streaming.interest_epoch_ms}))) AS weight
                  FROM valid_events WHERE is_impression = 0 AND is_negative = 0 AND `{column}` IS NOT NULL
                  GROUP BY user_id, `{column}`)
            GROUP BY user_id"""

    return query


def _interest_top(values: str, weights: str, sums_column: str) -> Callable[[Settings, dict], dict]:
    def finish(s: Settings, row: dict) -> dict:
        """The job's scaled sums (a JSON array of [value, sum]) as the k heaviest values, ties by name, and
        their weights as of the row's time. A value's sum only grows: where an update left two, the larger
        is the newer."""
        scale = math.exp(-_interest_rate(s) * (row["event_time"] - s.streaming.interest_epoch_ms))
        sums: dict[str, float] = {}
        for value, weight in json.loads(row.pop(sums_column)):
            sums[value] = max(weight, sums.get(value, 0.0))
        ranked = sorted(((c, w * scale) for c, w in sums.items()), key=lambda cw: (-cw[1], cw[0]))
        top = ranked[:s.streaming.interest_top_k]
        return row | {values: [c for c, _ in top], weights: [w for _, w in top]}

    return finish


def interest_columns(key: str) -> tuple[str, str]:
    """The values and weights of the interest histogram over the category or a further key."""
    return (("interest_categories", "interest_weights") if key == "category" else
            (f"interest_{key}_values", f"interest_{key}_weights"))


def interest_view(key: str) -> StreamView:
    """The user's decayed interest histogram over the values of the category or of a further key."""
    name = "user_interest" if key == "category" else f"user_{key}_interest"
    (values, weights), sums = interest_columns(key), f"{name}_sums"
    return StreamView(name, ("user_id",), ((values, STRING_ARRAY), (weights, DOUBLE_ARRAY)), LONG_TTL, upsert=True,
                      query=_interest(key), emitted=((sums, STRING),), finish=_interest_top(values, weights, sums))


STREAM_VIEWS: tuple[StreamView, ...] = (
    *(window_view(entity, suffix) for entity in ("user", "item") for suffix, _, _ in WINDOWS),
    *(total_view(entity) for entity in ("user", "item")),
    user_key_view("category"),
    StreamView("user_sequence", ("user_id",), (
        ("seq_item_ids", STRING_ARRAY), ("seq_event_types", STRING_ARRAY), ("seq_event_times", BIGINT_ARRAY)),
        LONG_TTL, upsert=False, query=_sequence),
    LONG_HISTORY_VIEW,
    interest_view("category"),
    # The spec's further grouping keys (a brand beside a department): counts and an interest histogram each.
    *(view for key in dataset_spec().group_by for view in (user_key_view(key), interest_view(key))),
)


def row_schema(views: tuple[StreamView, ...]) -> tuple[tuple[str, str], ...]:
    """The fields of a topic's rows, by position (a row is a JSON array), with their SQL types: the
    keys, `event_time`, then what the query of `views` (the views sharing the topic) emits, view by view."""
    return (*((k, STRING) for k in views[0].keys), ("event_time", BIGINT),
            *(c for view in views for c in (view.emitted or view.columns)))


def topics(views: tuple[StreamView, ...] = STREAM_VIEWS) -> dict[str, tuple[StreamView, ...]]:
    """Each feature-update topic and the views written to it, in declaration order."""
    grouped: dict[str, tuple[StreamView, ...]] = {}
    for view in views:
        grouped[view.topic] = (*grouped.get(view.topic, ()), view)
    for topic, sharing in grouped.items():  # one row per key carries them all
        if len({(v.keys, v.upsert) for v in sharing}) > 1 or any(v.finish for v in sharing[1:]):
            raise ValueError(f"views sharing {topic} must have the same keys and kind, and no finish but "
                             f"the first's: {[v.name for v in sharing]}")
    return grouped
