"""End to end with the real broker, the real Flink job, the real ingestor and Redis: known events in,
exactly the expected features out of `get_online_features`; bad records dead-lettered on the way."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime

import httpx
import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pytest
from confluent_kafka import Producer
from kafka import KafkaProducer

from contract.examples import PAD
from contract.inputs import NUMERIC_FEATURES
from feature_repo.definitions import TIMESTAMP_FIELD
from feature_repo.event_log import read_event_log
from feature_repo.files import day, view_dir, write_atomic
from feature_repo.predictions import SCHEMA as PREDICTIONS
from feature_repo.predictions import archive_dir
from feature_repo.store import feature_store, online_row
from infra import monitoring, process, stack
from infra.progress import read_progress
from infra.settings import Settings, to_environ
from models.dataset import Window, labelled_impressions, training_frame, training_set
from serving.consistency import report as consistency_report
from streaming.consumer import read_dead_letter
from streaming.events import Event, InvalidEvent, decode
from streaming.features import TOPIC_PREFIX
from streaming.producer import EventProducer
from streaming.topics import end_offsets, read_range
from tests.conftest import FaultTable, run_cli, running_stack, wait_for

pytestmark = pytest.mark.stack

MINUTE = 60_000
CLICK, IMP, BUY = "click", "impression", "purchase"

HUGE = 1 << 19


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    yield from running_stack(tmp_path_factory.mktemp("pipeline"), "kafka,redis,pipeline,prometheus",
                             FLYWHEEL_STREAMING_SEQUENCE_LENGTH="3", FLYWHEEL_STREAMING_HISTORY_LENGTH="4",
                             FLYWHEEL_STREAMING_HISTORY_CATEGORIES="2", FLYWHEEL_STREAMING_HISTORY_PER_CATEGORY="3")


class Timeline:
    """Event-time spans for the tests of one pipeline, each after the last, so that one test's events
    never fall in another's windows."""

    def __init__(self) -> None:
        self.next = int(time.time() * 1000) - 60 * MINUTE

    def take(self, span_ms: int) -> int:
        start, self.next = self.next, self.next + span_ms
        return start


@pytest.fixture(scope="module")
def timeline() -> Timeline:
    return Timeline()


def event(n: int, user: str, item: str, kind: str, t: int, category: str | None = "c1") -> Event:
    context = {"category": category} if category else {}
    return Event(event_id=f"e{n}", user_id=user, item_id=item, event_type=kind, request_id=f"r{n}",
                 event_time=t, context=context)


WINDOW_BUCKETS = {5 * MINUTE: 5, 60 * MINUTE: 12}  # streaming/features.py: the views' time buckets


def expected_counts(events: list[Event], key: str, value: str, at: int, window_ms: int) -> tuple[int, int]:
    """Impressions and clicks of `value` in the window of time buckets ending with the bucket of `at`,
    counting the events up to `at`."""
    bucket_ms = window_ms // WINDOW_BUCKETS[window_ms]
    first = (at // bucket_ms - WINDOW_BUCKETS[window_ms] + 1) * bucket_ms
    rows = [e for e in events if getattr(e, key) == value and first <= e.event_time <= at]
    return sum(e.event_type is IMP for e in rows), sum(e.event_type is CLICK for e in rows)


def smoothed(s: Settings, clicks: int, imps: int) -> float:
    w = s.streaming.ctr_prior_weight
    return (clicks + w * s.streaming.ctr_prior) / (imps + w)


def online(s: Settings, features: list[str], row: dict) -> dict:
    return online_row(feature_store(s), features, row)


def test_known_events_give_exactly_the_expected_online_features(pipeline: Settings, timeline: Timeline) -> None:
    s = pipeline
    t0 = timeline.take(25 * MINUTE)
    ua, ub = "user-a", "user-b"
    on_time = [
        event(1, ua, "i1", IMP, t0), event(2, ua, "i1", CLICK, t0 + 1),
        event(3, ua, "i2", IMP, t0 + 10 * MINUTE, "c2"),
        event(4, ub, "i1", IMP, t0 + 12 * MINUTE), event(5, ub, "i1", CLICK, t0 + 12 * MINUTE + 5),
        event(6, ub, "i1", BUY, t0 + 12 * MINUTE + 9),
        event(7, ua, "i3", IMP, t0 + 20 * MINUTE), event(8, ua, "i3", CLICK, t0 + 20 * MINUTE + 3),
        event(9, ua, "i1", IMP, t0 + 21 * MINUTE), event(10, ua, "i1", CLICK, t0 + 21 * MINUTE + 2),
        event(11, ua, "i2", IMP, t0 + 22 * MINUTE, "c2"), event(12, ua, "i2", CLICK, t0 + 22 * MINUTE + 4, "c2"),
    ]
    last = t0 + 22 * MINUTE + 4
    late = event(13, ua, "i9", CLICK, t0 + 5 * MINUTE, "c2")  # sent after everything else
    # A 512 KiB record: valid JSON, over the platform's size limit, under the broker's (1 MiB, which refuses
    # a larger one to its producer)
    huge = json.dumps(on_time[0].to_dict() | {"context": {"category": "c1", "note": "x" * HUGE}}).encode()
    huge = huge[:HUGE - 3] + b'"}}'
    bad = [b"{broken", json.dumps({"event_id": "x"}).encode(),
           json.dumps(on_time[0].to_dict() | {"event_type": "hover"}).encode(),
           json.dumps(on_time[0].to_dict() | {"user_id": 42}).encode(), huge,
           json.dumps(on_time[0].to_dict() | {"event_time": 1.5e12, "context": {"x": None}}).encode()]

    with EventProducer(s) as producer:
        for e in on_time:
            producer.send(e)
        producer.flush()
    raw = KafkaProducer(**s.kafka.client_options("kafka-python"), acks="all", max_request_size=2 << 20)
    for value in bad:
        raw.send(s.kafka.events_topic, key=b"user-a", value=value)
    raw.flush()
    with EventProducer(s) as producer:
        wait_for(lambda: _assert_online(s, ua, impressions_5m=3))
        producer.send(late)

    # Windows as of each user's newest event; the late click counts in the windows it falls in.
    def user_features(user: str, at: int, category: str) -> dict:
        return online(s, ["user_5m:user_impressions_5m", "user_5m:user_clicks_5m", "user_5m:user_ctr_5m",
                          "user_1h:user_impressions_1h", "user_1h:user_clicks_1h",
                          "user_total:user_impressions_total", "user_total:user_clicks_total",
                          "user_category:category_impressions", "user_category:category_clicks",
                          "user_sequence:seq_item_ids", "user_sequence:seq_event_types",
                          "user_sequence:seq_event_times", "user_history:history_length",
                          "user_history:history_categories", "user_history:history_category_counts",
                          "user_history:history_item_ids", "user_history:history_event_types",
                          "user_interest:interest_categories", "user_interest:interest_weights"],
                      {"user_id": user, "category": category})

    def check_user_a() -> None:
        got = user_features(ua, last, "c2")
        imps_5m, clicks_5m = expected_counts(on_time, "user_id", ua, last, 5 * MINUTE)
        assert (got["user_impressions_5m"], got["user_clicks_5m"]) == (imps_5m, clicks_5m) == (3, 3)
        assert got["user_ctr_5m"] == pytest.approx(smoothed(s, 3, 3))
        imps_1h, clicks_1h = expected_counts([*on_time, late], "user_id", ua, last, 60 * MINUTE)
        assert (got["user_impressions_1h"], got["user_clicks_1h"]) == (imps_1h, clicks_1h) == (5, 5)
        assert (got["user_impressions_total"], got["user_clicks_total"]) == (5, 5)
        assert (got["category_impressions"], got["category_clicks"]) == (2, 2)
        # last 3 behaviors (sequence_length=3) in arrival order, oldest first: the late click is newest
        assert got["seq_item_ids"] == ["i1", "i2", "i9"]
        assert got["seq_event_types"] == ["click", "click", "click"]
        assert got["seq_event_times"] == [t0 + 21 * MINUTE + 2, t0 + 22 * MINUTE + 4, t0 + 5 * MINUTE]
        # the long history: every impression, a click merged into the impression it follows, a repeated
        # impression a behavior of its own: i1 c1 click, i2 c2 impression, i3 c1 click, i1 c1 click,
        # i2 c2 click, i9 c2 click (late). It keeps the newest 4; c1 and c2 have 2 each, c2 the newer:
        # first; each with its newest 3 item slots and their types, newest first, "" padding
        assert got["history_length"] == 4
        assert (got["history_categories"], got["history_category_counts"]) == (["c2", "c1"], [2, 2])
        assert got["history_item_ids"] == ["i9", "i2", "", "i1", "i3", ""]
        assert got["history_event_types"] == ["click", "click", "", "click", "click", ""]
        # its row changes on the first behavior and on each action, not on an exposure alone: 6 rows
        # (e1, e2, e8, e10, e12, the late e13) for 12 valid events
        history = pd.read_parquet(view_dir(s, "user_history")).query("user_id == @ua")
        assert len(history) == 6, history.to_string()

    wait_for(check_user_a)
    # interest: decayed category histogram of all actions (late one included), as of the newest
    rate = math.log(2) / (s.streaming.interest_half_life_hours * 3_600_000)
    actions = [e for e in [*on_time, late] if e.user_id == ua and e.event_type is not IMP]
    weights: dict[str, float] = {}
    for e in actions:
        weights[e.context["category"]] = weights.get(e.context["category"], 0) + math.exp(-rate * (last - e.event_time))

    def check_interest() -> None:
        got = user_features(ua, last, "c2")
        assert got["interest_categories"] == sorted(weights, key=lambda c: -weights[c])
        assert got["interest_weights"] == pytest.approx([weights[c] for c in got["interest_categories"]])
    wait_for(check_interest, timeout_s=30)

    item = wait_for(lambda: _item_i1(s, on_time, t0))
    assert item["item_impressions_total"] == 3

    # bad records: dead-lettered with the reasons of streaming/events.py and where they came from, an
    # oversized one cut to the size limit; the job kept going
    dlq = s.kafka.dlq_topic(s.kafka.events_topic)
    letters = wait_for(lambda: _dead_letters(s, dlq, len(bad)))
    assert [d.value for d in letters] == [b[:s.kafka.max_event_bytes] for b in bad]
    assert [d.original_size for d in letters] == [len(b) for b in bad]
    reasons = [_python_reason(s, b) for b in bad]
    assert letters[0].reason.startswith("malformed JSON: ") and reasons[0].startswith("malformed JSON: ")
    assert [d.reason for d in letters[1:]] == reasons[1:]
    assert letters[4].reason == f"oversized: {HUGE} bytes (limit {s.kafka.max_event_bytes})"
    assert {d.topic for d in letters} == {s.kafka.events_topic} and all(d.offset >= 0 for d in letters)

    # the offline event log holds every valid event once
    logged = wait_for(lambda: _logged(s, len(on_time) + 1))
    assert {f"e{i}" for i in range(1, 14)} <= set(logged)


def test_ids_that_json_must_escape_arrive_intact(pipeline: Settings, timeline: Timeline) -> None:
    """Users, items and categories with quotes, backslashes, control and non-ASCII characters come out
    of the job's hand-written rows (streaming/java/flywheel/JsonRow.java) as they went in, also inside
    the interest histogram's JSON text."""
    s = pipeline
    t0 = timeline.take(MINUTE)
    user, item, category = 'u"\\\t\n-\u00e9-\U0001d11e', 'i"\\\x01-\u00df', 'c"\\-\u00fc'
    with EventProducer(s) as producer:
        producer.send(event(500, user, item, IMP, t0, category))
        producer.send(event(501, user, item, CLICK, t0 + 1, category))

    def arrived() -> None:
        got = online(s, ["user_total:user_impressions_total", "user_total:user_clicks_total",
                         "user_category:category_clicks", "user_sequence:seq_item_ids",
                         "user_interest:interest_categories"], {"user_id": user, "category": category})
        assert (got["user_impressions_total"], got["user_clicks_total"], got["category_clicks"]) == (1, 1, 1)
        assert (got["seq_item_ids"], got["interest_categories"]) == ([item], [category])
        assert online(s, ["item_total:item_clicks_total"], {"item_id": item})["item_clicks_total"] == 1
    wait_for(arrived, timeout_s=30)


def _python_reason(s: Settings, payload: bytes) -> str:
    with pytest.raises(InvalidEvent) as refused:
        decode(payload, s.kafka.max_event_bytes)
    return refused.value.reason


def _assert_online(s: Settings, user: str, impressions_5m: int) -> None:
    assert online(s, ["user_5m:user_impressions_5m"], {"user_id": user})["user_impressions_5m"] == impressions_5m


def _item_i1(s: Settings, events: list[Event], t0: int) -> dict:
    got = online(s, ["item_5m:item_impressions_5m", "item_1h:item_impressions_1h", "item_1h:item_clicks_1h",
                     "item_total:item_impressions_total"], {"item_id": "i1"})
    at = t0 + 21 * MINUTE + 2  # the last event on i1
    assert got["item_impressions_5m"] == expected_counts(events, "item_id", "i1", at, 5 * MINUTE)[0] == 1
    assert (got["item_impressions_1h"], got["item_clicks_1h"]) == expected_counts(events, "item_id", "i1", at,
                                                                                   60 * MINUTE) == (3, 3)
    return got


def _dead_letters(s: Settings, topic: str, n: int) -> list:
    letters = [read_dead_letter(r) for r in read_range(s, topic, {}, end_offsets(s, topic))]
    assert len(letters) == n
    return letters


def _logged(s: Settings, n: int) -> list[str]:
    ids = read_event_log(s).column("event_id").to_pylist()
    assert len(ids) == n
    return ids


def test_training_features_are_point_in_time_correct(pipeline: Settings, timeline: Timeline) -> None:
    """A label at time t is joined with the features as of t: never from an event after t."""
    s = pipeline
    t0 = timeline.take(11 * MINUTE)
    user = "user-pit"
    events = [event(100 + i, user, f"i{i}", kind, t0 + i * MINUTE + (kind is CLICK))
              for i in range(6) for kind in ((IMP, CLICK) if i % 2 == 0 else (IMP,))]
    with EventProducer(s) as producer:
        for e in events:
            producer.send(e)
    last = max(e.event_time for e in events)
    wait_for(lambda: _assert_online(s, user, impressions_5m=expected_counts(events, "user_id", user, last,
                                                                             5 * MINUTE)[0]))

    label_times = [t0 + 2 * MINUTE, t0 + 2 * MINUTE + 1, t0 + 4 * MINUTE + 30_000, t0 - MINUTE]
    entity_df = pd.DataFrame({"user_id": user, "event_timestamp": pd.to_datetime(label_times, unit="ms", utc=True)})
    got = feature_store(s).get_historical_features(
        entity_df=entity_df, features=["user_5m:user_impressions_5m", "user_5m:user_clicks_5m",
                                       "user_total:user_clicks_total"]).to_df()
    by_time = {int(row.event_timestamp.timestamp() * 1000): row for row in got.itertuples()}
    for t in label_times:
        row = by_time.get(t)
        if t < t0:  # nothing known yet
            assert row is None or pd.isna(row.user_impressions_5m)
            continue
        # the features of the newest event at or before t, counted over the 5 minutes up to it
        as_of = max(e.event_time for e in events if e.event_time <= t)
        imps, clicks = expected_counts(events, "user_id", user, as_of, 5 * MINUTE)
        offline = pd.read_parquet(view_dir(s, "user_5m")).query("user_id == @user").sort_values(TIMESTAMP_FIELD)
        assert (row.user_impressions_5m, row.user_clicks_5m) == (imps, clicks), (t - t0, offline.to_string())
        assert row.user_clicks_total == sum(e.event_type is CLICK and e.event_time <= t for e in events)


def test_a_restarted_job_and_ingestor_lose_nothing_and_count_nothing_twice(pipeline: Settings,
                                                                           timeline: Timeline) -> None:
    s = pipeline
    t0 = timeline.take(3 * MINUTE)
    user = "user-restart"
    before = [event(200 + i, user, f"i{i % 3}", IMP if i % 3 else CLICK, t0 + i * 1000) for i in range(30)]
    after = [event(300 + i, user, f"i{i % 3}", IMP if i % 3 else CLICK, t0 + (30 + i) * 1000) for i in range(30)]
    with EventProducer(s) as producer:
        for e in before:
            producer.send(e)
    wait_for(lambda: _assert_online(s, user, impressions_5m=sum(e.event_type is IMP for e in before)))
    time.sleep(2 * s.streaming.checkpoint_interval_ms / 1000)  # a checkpoint holds `before`

    pipeline_services = [svc for svc in stack.enabled_services(s) if svc.group == "pipeline"]
    for svc in pipeline_services:  # as `flywheel down` stops them
        assert process.stop(stack.pidfile(s, svc), timeout_s=30, sig=svc.stop_signal)
    with EventProducer(s) as producer:  # produced while the job and the ingestor are down
        for e in after:
            producer.send(e)
    assert sorted(stack.up(s)) == sorted(svc.name for svc in pipeline_services)

    everything = before + after
    last = everything[-1].event_time
    imps, clicks = expected_counts(everything, "user_id", user, last, 5 * MINUTE)

    def check() -> None:
        got = online(s, ["user_5m:user_impressions_5m", "user_5m:user_clicks_5m",
                         "user_total:user_impressions_total", "user_total:user_clicks_total",
                         "user_sequence:seq_event_times"], {"user_id": user})
        assert (got["user_impressions_5m"], got["user_clicks_5m"]) == (imps, clicks)
        assert (got["user_impressions_total"], got["user_clicks_total"]) == (imps, clicks)  # not doubled
        assert got["seq_event_times"] == [e.event_time for e in everything if e.event_type is CLICK][-3:]
    wait_for(check, timeout_s=120)


def test_training_set_labels_impressions_and_joins_features_from_just_before(pipeline: Settings,
                                                                             timeline: Timeline) -> None:
    """models.dataset: each impression labelled by its click (same request id), with the features
    as they were just before its request: its own update, its click and later behaviors never leak in, nor
    (q5) an earlier exposure and click of the same request, which the server scored before showing any."""
    s = pipeline
    t0 = timeline.take(11 * MINUTE)
    user = "user-train"

    def with_request(e: Event, request: str) -> Event:
        return replace(e, request_id=request)

    events = [with_request(event(300, user, "i1", IMP, t0), "q1"),
              with_request(event(301, user, "i1", CLICK, t0 + 1), "q1"),
              with_request(event(302, user, "i2", IMP, t0 + MINUTE), "q2"),
              with_request(event(303, user, "i2", CLICK, t0 + MINUTE + 1), "q2"),
              with_request(event(304, user, "i4", IMP, t0 + 90_000), "q4"),
              with_request(event(305, user, "i3", IMP, t0 + 2 * MINUTE), "q3"),
              with_request(event(306, user, "i3", CLICK, t0 + 2 * MINUTE + 1), "q3"),
              with_request(event(307, user, "i5", IMP, t0 + 150_000), "q5"),
              with_request(event(308, user, "i5", CLICK, t0 + 150_001), "q5"),
              with_request(event(309, user, "i6", IMP, t0 + 160_000), "q5")]
    with EventProducer(s) as producer:
        for e in events:
            producer.send(e)
    window = Window(datetime.fromtimestamp(t0 / 1000, UTC), datetime.fromtimestamp((t0 + 3 * MINUTE) / 1000, UTC))

    def logged() -> None:
        assert len(labelled_impressions(s, window)) == 6

    wait_for(logged)
    wait_for(lambda: _assert_online(s, user, impressions_5m=6))  # the last event's window row is online
    ex, times = training_set(s, window, sequence_length=3)
    assert list(times) == [t0, t0 + MINUTE, t0 + 90_000, t0 + 2 * MINUTE, t0 + 150_000, t0 + 160_000]
    assert list(ex.labels) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert list(ex.item_ids) == ["i1", "i2", "i4", "i3", "i5", "i6"] and set(ex.user_ids) == {user}
    clicks_total = ex.numeric[:, NUMERIC_FEATURES.index("user_clicks_total")]
    impressions_5m = ex.numeric[:, NUMERIC_FEATURES.index("user_impressions_5m")]
    # Own click never included, nor q5's click on i5 in i6's features.
    np.testing.assert_allclose(clicks_total, np.log1p([0, 1, 2, 2, 3, 3]), rtol=1e-6)
    np.testing.assert_allclose(impressions_5m, np.log1p([0, 1, 2, 3, 4, 4]), rtol=1e-6)  # nor own impression
    # The behavior sequence (clicks and purchases) before each request, newest first.
    assert ex.sequences.tolist() == [[PAD] * 3, ["i1", PAD, PAD], ["i2", "i1", PAD], ["i2", "i1", PAD],
                                     ["i3", "i2", "i1"], ["i3", "i2", "i1"]]


def test_a_served_candidate_is_trained_on_the_features_it_was_served_with(pipeline: Settings,
                                                                         timeline: Timeline) -> None:
    """A user back after a quiet spell past their 5-minute window's TTL: the online read serves the stale
    window, a point-in-time join drops it. Training takes what the ranking server logged it read (the
    prediction archive, by request id and item), so what the model is trained on is what it was served
    with, and the consistency report says so (serving/consistency.py)."""
    s = pipeline
    t0 = timeline.take(12 * MINUTE)
    user, back = "user-idle", t0 + 10 * MINUTE
    with EventProducer(s) as producer:
        for n in range(3):
            producer.send(event(600 + n, user, f"i{n}", IMP, t0 + n))
    wait_for(lambda: _assert_online(s, user, impressions_5m=3))
    served = {name: value for name, value in online(s, ["user_5m:user_impressions_5m", "user_total:user_impressions_total"],
                                                    {"user_id": user}).items() if name in NUMERIC_FEATURES}
    # The record the server logs for the request it serves when the user is back, then the exposure.
    record = {"request_id": "q-back", "user_id": user, "model_name": s.models.name, "model_version": "1",
              "route": "champion", "shadow": False, "tier": "high", "served_at": back - 5, "items": ["i9"],
              "categories": ["c1"], "scores": [0.5], "sources": None, "kafka_partition": 0, "kafka_offset": 0,
              "features": json.dumps({name: [value] for name, value in served.items()})}
    write_atomic(pa.Table.from_pylist([record], schema=PREDICTIONS), archive_dir(s) / f"date={day(back)}" / "q.parquet")
    with EventProducer(s) as producer:
        producer.send(replace(event(610, user, "i9", IMP, back), request_id="q-back"))
    window = Window(datetime.fromtimestamp(back / 1000, UTC), datetime.fromtimestamp((back + MINUTE) / 1000, UTC))
    def exposed() -> None:
        assert len(labelled_impressions(s, window)) == 1

    wait_for(exposed)
    imps, joined = training_frame(s, window)
    assert served["user_impressions_5m"] == 3 and joined["user_impressions_5m"].tolist() == [3.0]
    table, counts = consistency_report(s, back - 5, back)
    assert counts == {"lists": 1, "served": 1, "compared": 1}, counts
    row = table.set_index("feature").loc["user_impressions_5m"]
    # The point-in-time join drops the row past its TTL: the skew training no longer has.
    assert row["mismatched"] == 0 and row["point_in_time_mismatched"] == row["missing_offline"] == 1, row


def test_window_counts_arrive_on_a_quiet_stream(pipeline: Settings, timeline: Timeline) -> None:
    """No event follows the user's: its window counts are online anyway (nothing waits for a watermark)."""
    s = pipeline
    time.sleep(3)  # whatever the earlier tests sent is through: the stream is quiet
    t0 = max(timeline.take(MINUTE), int(time.time() * 1000))
    user = "user-quiet"
    events = [event(400 + i, user, f"i{i}", IMP, t0 + i) for i in range(5)]
    events += [event(410 + i, user, f"i{i}", CLICK, t0 + 10 + i) for i in range(2)]
    with EventProducer(s) as producer:
        for e in events:
            producer.send(e)

    def counts() -> None:
        got = online(s, ["user_5m:user_impressions_5m", "user_5m:user_clicks_5m",
                         "user_1h:user_impressions_1h"], {"user_id": user})
        assert (got["user_impressions_5m"], got["user_clicks_5m"], got["user_impressions_1h"]) == (5, 2, 5)
    wait_for(counts, timeout_s=30)


@pytest.mark.chaos
def test_a_stopped_ingestor_is_named_unhealthy_with_its_lag_and_recovers(pipeline: Settings, timeline: Timeline,
                                                                          faults: FaultTable) -> None:
    """Health by progress: a consumer whose PID lives but which does not poll (kill -STOP, the default
    stall_after_s) is unhealthy, with the records it is behind; resumed, it catches up and is healthy
    again with nobody's help."""
    s = pipeline

    def health(name: str) -> tuple[str, str, int | None]:
        status = next(st for st in stack.status(s) if st.name == name)
        return status.state, status.detail, status.pid

    def healthy() -> None:
        assert health("event-log")[0] == health("feast-ingestor")[0] == "healthy", stack.status(s)
    wait_for(healthy, timeout_s=30)
    pid = health("feast-ingestor")[2]
    t0 = timeline.take(MINUTE)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with EventProducer(s) as producer:
            for i in range(20):
                producer.send(event(500 + i, f"user-stall-{i}", "i1", IMP, t0 + i))

        def stalled() -> None:
            state, detail, _ = health("feast-ingestor")
            lag = re.search(r"lag (\d+) records", detail)
            assert state == "unhealthy" and detail.startswith("stalled") and lag and int(lag[1]) > 0, detail
        wait_for(stalled, timeout_s=s.stack.stall_after_s + 30)
        unhealthy_s = time.monotonic() - stopped
        wait_for(lambda: _assert_stall_alert(s, firing=True), timeout_s=60)
        alert_s = time.monotonic() - stopped
        environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | to_environ(s)
        status = run_cli(environ, "status").stdout
        assert "FIRING FlywheelConsumerStalled" in status and "feast-ingestor has not polled Kafka" in status, status
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()

    def caught_up() -> None:
        state, detail, _ = health("feast-ingestor")
        assert state == "healthy" and "lag 0 records" in detail, detail
    wait_for(caught_up, timeout_s=30)
    healthy_s = time.monotonic() - resumed
    wait_for(lambda: _assert_stall_alert(s, firing=False), timeout_s=60)
    cleared_s = time.monotonic() - resumed
    assert faults.record("stuck consumer (kill -STOP of the ingestor)",
                         "status unhealthy and the stalled-consumer alert firing within 60 s; healthy and cleared "
                         "again without a human after the cause ends",
                         f"unhealthy {unhealthy_s:.0f} s, alert firing {alert_s:.0f} s after the stop (stall_after_s "
                         f"{s.stack.stall_after_s:g}); healthy, lag 0, {healthy_s:.0f} s and the alert cleared "
                         f"{cleared_s:.0f} s after kill -CONT", unhealthy_s <= 60 and alert_s <= 60)


def test_the_dashboard_renders_in_a_headless_browser(pipeline: Settings, tmp_path) -> None:
    """The console page Prometheus serves, as Debian's Chromium renders it (scripts run): the figures table,
    every target's health and the graphs drawn from the stack's own series."""
    s = pipeline
    if shutil.which("chromium") is None:  # as the stack installs Prometheus: Debian's package, once
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"], check=True,
                       env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"}, capture_output=True)
    wait_for(lambda: _assert({t["job"] for t in monitoring.targets(s) if t["health"] == "up"} >= {"pipeline", "flink"}),
             timeout_s=60)
    url = f"{s.prometheus.url}/consoles/flywheel.html"
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1800",
               "--virtual-time-budget=10000"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "Flywheel: the loop" in dom and "Alerts firing" in dom, dom[:2000]
    assert re.search(r"<td>pipeline</td><td>up</td>", dom) and re.search(r"<td>flink</td><td>up</td>", dom), dom
    # Rickshaw drew the series Prometheus holds: a line path inside a graph's SVG.
    assert dom.count("rickshaw_graph") >= 8 and re.search(r'<path class="path" d="M[0-9]', dom), dom[-3000:]
    shot = tmp_path / "dashboard.png"
    subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000


def _assert_stall_alert(s: Settings, firing: bool) -> None:
    from infra.monitoring import firing as firing_now

    stalled = [a for a in firing_now(s) if a["name"] == "FlywheelConsumerStalled"
               and a["labels"].get("service") == "feast-ingestor"]
    assert bool(stalled) == firing, stalled


def test_up_restarts_a_supervised_consumer_that_is_stuck(pipeline: Settings, timeline: Timeline) -> None:
    """Supervision: `flywheel up` restarts a pipeline process that is running but unhealthy (here stopped
    with SIGSTOP), says why, and the new one takes over where the old one left off."""
    s = replace(pipeline, stack=replace(pipeline.stack, stall_after_s=5.0))
    stuck = next(st.pid for st in stack.status(s) if st.name == "feast-ingestor")
    os.kill(stuck, signal.SIGSTOP)
    try:
        user, t0 = "user-supervised", timeline.take(MINUTE)
        with EventProducer(s) as producer:
            for i in range(4):
                producer.send(event(800 + i, user, "i1", IMP, t0 + i))
        def unhealthy() -> None:
            assert next(st for st in stack.status(s) if st.name == "feast-ingestor").state == "unhealthy"
        wait_for(unhealthy, timeout_s=30)
        said: list[str] = []
        assert stack.up(s, say=said.append) == ["feast-ingestor"]
        assert len(said) == 1 and said[0].startswith("restarting feast-ingestor: unhealthy ("), said
    finally:
        if psutil.pid_exists(stuck):
            os.kill(stuck, signal.SIGCONT)
    assert next(st.pid for st in stack.status(s) if st.name == "feast-ingestor") != stuck
    wait_for(lambda: _assert_online(s, user, impressions_5m=4), timeout_s=60)


def test_the_stack_knows_the_events_the_event_log_has_not_written(pipeline: Settings, timeline: Timeline) -> None:
    """What the event log has yet to write is known (the demo's summary waits for it), and caught up
    once the event log resumes."""
    s = pipeline
    pid = next(st.pid for st in stack.status(s) if st.name == "event-log")
    t0 = timeline.take(MINUTE)
    os.kill(pid, signal.SIGSTOP)
    try:
        with EventProducer(s) as producer:
            for i in range(10):
                producer.send(event(600 + i, "user-unarchived", "i1", IMP, t0 + i))
        wait_for(lambda: assert_positive(stack.unarchived(s, wait_s=0).get("event-log")), timeout_s=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stack.unarchived(s, wait_s=30) == {}  # caught up once resumed: nothing to lose


def assert_positive(n: int | None) -> None:
    assert n is not None and n > 0, n


@pytest.mark.chaos
def test_a_broker_crash_loses_no_acknowledged_event(pipeline: Settings, timeline: Timeline,
                                                    faults: FaultTable) -> None:
    """kill -9 of the broker with 2,000 events acknowledged (acks=all) a moment before, and `up`: every one
    of them is online and in the event log, a user's total goes on from its value before the crash, later
    events flow, and nothing is counted lost (the log is on disk; the page cache outlives the process)."""
    s = pipeline
    t0 = timeline.take(MINUTE)
    user = "user-broker-crash"
    with EventProducer(s) as producer:
        for i in range(5):
            producer.send(event(700 + i, user, "i1", IMP, t0 + i * 1000))

    def total_is(u: str, n: int) -> None:
        got = online(s, ["user_total:user_impressions_total"], {"user_id": u})["user_impressions_total"]
        assert got == n, (u, got)
    wait_for(lambda: total_is(user, 5))
    broker = psutil.Process(next(st.pid for st in stack.status(s) if st.name == "kafka"))
    # 2,000 events for 20 users acknowledged by the broker, as an outside producer sends them; the kill at once.
    burst = [event(10_000 + i, f"user-burst-{i % 20}", "i1", IMP, t0 + 10_000 + i) for i in range(2000)]
    acked: list[str] = []
    plain = Producer(s.kafka.client_options("librdkafka") | {"acks": "all", "linger.ms": 5})
    for e in burst:
        plain.produce(s.kafka.events_topic, key=e.user_id.encode(), value=json.dumps(e.to_dict()).encode(),
                      on_delivery=lambda err, msg: err or acked.append(msg.key()))
    assert plain.flush(30) == 0 and len(acked) == len(burst)
    broker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    broker.wait(10)
    said: list[str] = []
    up = time.monotonic()
    assert stack.up(s, say=said.append)[:1] == ["kafka"], said
    with EventProducer(s) as producer:
        for i in range(3):
            producer.send(event(710 + i, user, "i1", IMP, t0 + (5 + i) * 1000))
    wait_for(lambda: total_is(user, 8), timeout_s=120)
    online_s = time.monotonic() - up
    wait_for(lambda: [total_is(f"user-burst-{k}", 100) for k in range(20)], timeout_s=120)

    def archived(ids: set[str]) -> set[str]:
        return ids & set(read_event_log(s, t0, t0 + MINUTE).column("event_id").to_pylist())
    burst_ids = {e.event_id for e in burst}
    wait_for(lambda: _assert(archived(burst_ids | {"e710", "e711", "e712"}) == burst_ids | {"e710", "e711", "e712"}),
             timeout_s=120)
    reported = read_progress(s, "event-log").lost
    held = faults.record(
        "kill -9 broker, 2,000 acknowledged events in flight, `up`",
        "all 2,000 online and in the event log; totals continue; later events online within 60 s; 0 lost",
        f"2,000 of 2,000 online and archived; total 5 -> 8 online {online_s:.0f} s after `up` "
        f"({time.monotonic() - killed:.0f} s after the kill); {reported} reported lost",
        online_s <= 60 and reported == 0)
    assert held, (online_s, reported, said)


@pytest.mark.chaos
def test_flink_rest_takes_no_change_from_outside(pipeline: Settings, faults: FaultTable) -> None:
    """Flink's web UI and REST API are readable by anyone on the host, changed by nobody but the platform:
    the front refuses every method but GET and HEAD; the API itself wants the stack's client certificate."""
    s = pipeline
    url = s.flink.rest_url
    jobs = httpx.get(f"{url}/jobs/overview", timeout=10).json()["jobs"]
    assert [j["state"] for j in jobs if j["name"] == s.streaming.job_name] == ["RUNNING"]
    upload = httpx.post(f"{url}/jars/upload", timeout=10,
                        files={"jarfile": ("x.jar", b"PK\x03\x04", "application/x-java-archive")})
    run = httpx.post(f"{url}/jars/x.jar/run", json={}, timeout=10)
    cancel = httpx.patch(f"{url}/jobs/{jobs[0]['jid']}?mode=cancel", timeout=10)
    shutdown = httpx.delete(f"{url}/cluster", timeout=10)
    codes = [r.status_code for r in (upload, run, cancel, shutdown)]
    assert "read-only" in cancel.json()["errors"][0]
    # The API itself, without the certificate: no TLS session, whatever the request.
    with pytest.raises(httpx.TransportError):
        httpx.patch(f"{s.flink.api_url}/jobs/{jobs[0]['jid']}?mode=cancel", verify=False, timeout=10)
    faults.record("submit or cancel a Flink job over REST", "refused",
                  f"upload, run, cancel, cluster shutdown: {', '.join(map(str, codes))} at the front; the API "
                  "itself: no TLS session without the stack's client certificate", set(codes) == {405})
    assert set(codes) == {405}, [r.text for r in (upload, run, cancel, shutdown)]
    jobs = httpx.get(f"{url}/jobs/overview", timeout=10).json()["jobs"]
    assert [j["state"] for j in jobs if j["name"] == s.streaming.job_name] == ["RUNNING"]


@pytest.mark.chaos
def test_a_producer_without_credentials_or_rights_is_refused(pipeline: Settings, faults: FaultTable) -> None:
    """Authentication: no SCRAM credentials, no write anywhere. Authorization: an outside producer's
    credentials write `events` and nothing else (feature rows are served and trained on; predictions are
    joined to outcomes)."""
    s = pipeline

    def acked(options: dict, topics: list[str]) -> list[str]:
        producer = Producer(options | {"acks": "all", "message.timeout.ms": 8000})
        done: list[str] = []
        for topic in topics:
            producer.produce(topic, value=b"{}", on_delivery=lambda err, msg: err or done.append(msg.topic()))
        producer.flush(15)
        return sorted(set(done))

    guarded = [s.kafka.events_topic, f"{TOPIC_PREFIX}user_counts"]
    anonymous = acked({"bootstrap.servers": s.kafka.bootstrap_servers}, guarded)
    faults.record("produce to `events` or `features.*` without credentials", "refused",
                  f"accepted on {', '.join(anonymous) or 'neither'}", not anonymous)
    outside = acked(s.kafka.client_options("librdkafka"), [f"{TOPIC_PREFIX}user_counts", s.serving.predictions_topic])
    faults.record("produce to `features.*` or `predictions` with an outside producer's credentials", "refused",
                  f"accepted on {', '.join(outside) or 'neither'}", not outside)
    assert (anonymous, outside) == ([], [])
    # The same credentials write the events topic: refused elsewhere by authorization, not a dead login.
    assert acked(s.kafka.client_options("librdkafka"), [s.kafka.events_topic]) == [s.kafka.events_topic]


@pytest.mark.chaos
def test_a_redis_crash_loses_no_feature_ingested_a_second_before(pipeline: Settings, timeline: Timeline,
                                                                 faults: FaultTable) -> None:
    """kill -9 of the online store's Redis and `up`: a user's features, online more than a second before
    the kill, are online after it (append-only file synced every second), and new events flow again."""
    s = pipeline
    user, t0 = "user-redis-crash", timeline.take(MINUTE)
    with EventProducer(s) as producer:
        for i in range(10):
            producer.send(event(900 + i, user, "i1", IMP, t0 + i))
    wait_for(lambda: _assert_online(s, user, impressions_5m=10), timeout_s=60)
    time.sleep(1.2)
    redis = psutil.Process(next(st.pid for st in stack.status(s) if st.name == "redis"))
    redis.send_signal(signal.SIGKILL)
    redis.wait(10)
    assert "redis" in stack.up(s)
    kept = online(s, ["user_5m:user_impressions_5m"], {"user_id": user})["user_impressions_5m"]
    with EventProducer(s) as producer:
        producer.send(event(910, user, "i1", IMP, t0 + 10))
    up = time.monotonic()
    wait_for(lambda: _assert_online(s, user, impressions_5m=11), timeout_s=60)
    held = faults.record("kill -9 Redis, `up`", "events ingested more than 1 s before the kill are online after it",
                         f"{kept} of 10 impressions online after `up`; one more online "
                         f"{time.monotonic() - up:.1f} s after it was sent",
                         kept == 10)
    assert held, kept


def _assert(ok: bool) -> None:
    assert ok


@pytest.fixture(scope="module")
def shop_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A pipeline whose dataset spec is a shop's (view / cart / order, and a hide), nothing else changed."""
    from tests.test_dataset_spec import SHOP

    root = tmp_path_factory.mktemp("shop")
    (root / "shop.toml").write_text(SHOP + '\n[[events.types]]\nname = "hide"\nrole = "negative"\n')
    yield from running_stack(root / "data", "kafka,redis,pipeline", FLYWHEEL_DATASET_SPEC=str(root / "shop.toml"),
                             FLYWHEEL_STREAMING_HISTORY_CATEGORIES="1", FLYWHEEL_STREAMING_HISTORY_PER_CATEGORY="3")


def test_a_shops_own_event_types_flow_through_the_stream_job(shop_pipeline: Settings) -> None:
    """The JVM's parser and long history take the spec's vocabulary: views count as exposures, orders
    as the label, an order or a cart raises the view it follows, a hide is an action of the sequence but no sign
    of interest; a MovieLens "click" is undeclared here."""
    s = shop_pipeline
    t0 = int(time.time() * 1000) - 10 * MINUTE
    events = [event(1, "shopper", "sku1", "view", t0), event(2, "shopper", "sku2", "view", t0 + 1_000),
              replace(event(3, "shopper", "sku1", "order", t0 + 2_000), request_id="r1"),
              replace(event(4, "shopper", "sku2", "cart", t0 + 3_000), request_id="r2"),
              event(6, "shopper", "sku3", "view", t0 + 4_000, "c2"),
              replace(event(7, "shopper", "sku3", "hide", t0 + 5_000, "c2"), request_id="r6")]
    with EventProducer(s) as producer:  # validated against the shop's spec, as every client is
        for e in events:
            producer.send(e)
        with pytest.raises(InvalidEvent, match=r"unknown event_type 'click' \(declared: view, cart, order, hide\)"):
            producer.send(event(5, "shopper", "sku1", "click", t0 + 4_000))
        producer.flush()
    undeclared = json.dumps(event(5, "shopper", "sku1", "click", t0 + 4_000).to_dict()).encode()
    raw = KafkaProducer(**s.kafka.client_options("kafka-python"), acks="all")
    raw.send(s.kafka.events_topic, key=b"shopper", value=undeclared)  # a client that validates nothing
    raw.flush()

    def check() -> None:
        got = online(s, ["user_total:user_impressions_total", "user_total:user_clicks_total",
                         "user_sequence:seq_event_types", "user_history:history_item_ids",
                         "user_history:history_event_types", "user_interest:interest_categories"],
                     {"user_id": "shopper"})
        assert (got["user_impressions_total"], got["user_clicks_total"]) == (3, 1)
        assert got["seq_event_types"] == ["order", "cart", "hide"]  # actions only, oldest first
        assert got["interest_categories"] == ["c1"]  # not the hidden item's c2
        assert got["history_item_ids"][:2] == ["sku2", "sku1"]
        assert got["history_event_types"][:2] == ["cart", "order"]  # each view raised to its action
    wait_for(check)
    dlq = s.kafka.dlq_topic(s.kafka.events_topic)
    [letter] = wait_for(lambda: _dead_letters(s, dlq, 1))
    assert letter.reason == "unknown event_type 'click' (declared: view, cart, order, hide)"
