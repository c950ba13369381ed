"""Producing and consuming behavior events through a real broker."""

import json
import os
import signal
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from confluent_kafka import TopicPartition
from kafka import KafkaProducer

from infra import process, stack
from infra.progress import consumer_lag
from infra.services import enabled_services
from infra.settings import Settings, to_environ
from streaming.consumer import LOG_END_PROBE_S, EventConsumer, read_dead_letter
from streaming.events import Event, InvalidEvent
from streaming.producer import EventProducer
from streaming.topics import end_offsets, ensure_topics, read_range
from tests.conftest import run_cli, running_stack, wait_for

pytestmark = pytest.mark.stack


@pytest.fixture
def topic(broker: Settings) -> str:
    name = f"events-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker, [name])
    return name


def make_events(n: int, users: int = 7, start: int = 0) -> list[Event]:
    return [Event(event_id=f"e{i}", user_id=f"u{i % users}", item_id=f"i{i % 13}", event_type="impression",
                  request_id=f"r{i}", event_time=1_700_000_000_000 + i, context={"seq": i})
            for i in range(start, start + n)]


def drain(consumer: EventConsumer, expected: int, polls: int = 60) -> list:
    got: list = []
    for _ in range(polls):
        got += consumer.poll(timeout_ms=500)
        if len(got) >= expected:
            break
    return got


def test_a_consumer_group_gets_every_event_in_per_user_order(broker: Settings, topic: str) -> None:
    sent = make_events(3000)
    with EventProducer(broker, topic) as producer:
        for event in sent:
            producer.send(event)
    with EventConsumer(broker, "g-order", topic, role="admin") as consumer:
        got = drain(consumer, len(sent))
        consumer.commit()
    assert sorted(c.event.event_id for c in got) == sorted(e.event_id for e in sent)
    per_user = defaultdict(list)
    for c in got:
        per_user[c.event.user_id].append(c.event.context["seq"])
    assert all(seqs == sorted(seqs) for seqs in per_user.values())
    assert len({c.partition for c in got}) > 1  # keys spread over partitions, order held within each


def test_a_restarted_consumer_resumes_from_its_committed_offset(broker: Settings, topic: str) -> None:
    with EventProducer(broker, topic) as producer:
        for event in make_events(500):
            producer.send(event)
    with EventConsumer(broker, "g-resume", topic, role="admin") as consumer:
        first = drain(consumer, 500)
        consumer.commit()
    with EventProducer(broker, topic) as producer:
        for event in make_events(200, start=500):
            producer.send(event)
    with EventConsumer(broker, "g-resume", topic, role="admin") as consumer:
        uncommitted = drain(consumer, 200)  # read but never committed: must come again
    with EventConsumer(broker, "g-resume", topic, role="admin") as consumer:
        second = drain(consumer, 200, polls=20)
        consumer.commit()
    ids = lambda batch: {c.event.event_id for c in batch}  # noqa: E731
    assert ids(first) == {f"e{i}" for i in range(500)}
    assert ids(uncommitted) == ids(second) == {f"e{i}" for i in range(500, 700)}
    assert len(second) == 200  # nothing from before the committed offset is delivered again


def test_bad_records_go_to_the_dead_letter_topic_with_the_reason(broker: Settings, topic: str) -> None:
    good = [e.encode(broker.kafka.max_event_bytes) for e in make_events(50)]
    valid = json.loads(good[0])
    bad = {
        b"{not json": "malformed JSON",
        json.dumps({k: v for k, v in valid.items() if k != "item_id"}).encode(): "missing field(s): item_id",
        json.dumps(valid | {"event_time": "yesterday"}).encode(): "event_time must be integer milliseconds",
        json.dumps(valid | {"event_type": "hover"}).encode(): "unknown event_type 'hover'",
        json.dumps(valid | {"context": {"blob": "x" * 100_000}}).encode(): "oversized",
    }
    raw = KafkaProducer(**broker.kafka.client_options("kafka-python", "admin"), acks="all", max_request_size=1 << 20)
    records = good[:20] + list(bad) + good[20:]
    for value in records:
        raw.send(topic, key=b"u0", value=value, headers=[("origin", b"test")])
    raw.flush()
    raw.close()

    with EventConsumer(broker, "g-dlq", topic, role="admin") as consumer:
        got = drain(consumer, len(good))
        consumer.commit()
        assert consumer.dead_lettered == len(bad)
    assert [c.event.event_id for c in got] == [f"e{i}" for i in range(50)]

    dlq = broker.kafka.dlq_topic(topic)
    letters = [read_dead_letter(r) for r in read_range(broker, dlq, {}, end_offsets(broker, dlq))]
    limit = broker.kafka.max_event_bytes  # byte for byte, in order; an oversized one cut to the limit
    assert [d.value for d in letters] == [b[:limit] for b in bad]
    assert [d.original_size for d in letters] == [len(b) for b in bad]
    for letter, reason in zip(letters, bad.values()):
        assert reason in letter.reason
        assert letter.topic == topic and letter.key == b"u0"
    assert [d.offset for d in letters] == list(range(20, 20 + len(bad)))


def test_the_producer_refuses_an_invalid_event(broker: Settings, topic: str) -> None:
    bad = Event(event_id="e", user_id="u", item_id="i", event_type="click", request_id="r",
                event_time=1_700_000_000_000, context={"blob": "x" * broker.kafka.max_event_bytes})
    with EventProducer(broker, topic) as producer:
        with pytest.raises(InvalidEvent, match="oversized"):
            producer.send(bad)
        assert producer.sent == 0
    assert sum(end_offsets(broker, topic).values()) == 0


def test_flywheel_dlq_shows_a_record_dead_lettered_twice_once(broker: Settings, topic: str) -> None:
    """The stream job may write a dead letter again when it replays after a restart: `flywheel dlq`
    recognises the copy by its source topic, partition and offset."""
    raw = KafkaProducer(**broker.kafka.client_options("kafka-python", "admin"), acks="all")
    raw.send(topic, key=b"u0", value=b"{junk").get(timeout=30)
    raw.send(topic, key=b"u0", value=b"{more junk").get(timeout=30)
    raw.close()
    for group in ("g-dlq-once", "g-dlq-again"):  # the second: the same records dead-lettered again
        with EventConsumer(broker, group, topic, role="admin") as consumer:
            deadline = time.monotonic() + 60
            while consumer.dead_lettered < 2 and time.monotonic() < deadline:
                consumer.poll(timeout_ms=1000)
            consumer.commit()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | to_environ(broker)
    shown = run_cli(environ, "dlq", "--topic", topic)
    assert shown.returncode == 0, shown.stderr
    assert f"{broker.kafka.dlq_topic(topic)}: 4 dead letters; last 2 distinct:" in shown.stdout
    assert shown.stdout.count(f"{topic}[") == 2 and "malformed JSON" in shown.stdout


@pytest.mark.chaos
def test_a_broker_killed_with_records_acknowledged_loses_none_of_them(tmp_path, faults) -> None:
    """kill -9 of the broker a moment after 2,000 records were acknowledged (acks=all), then `up`: a
    consumer fetching ahead, and one restarted from its ledger, read every one of them and count nothing
    lost; the one restarted resumes at its committed position."""
    for s in running_stack(tmp_path / "stack", "kafka"):
        name, ledger = f"events-{uuid.uuid4().hex[:8]}", tmp_path / "consumer.offsets.json"
        ensure_topics(s, [name])

        def consumer() -> EventConsumer:
            return EventConsumer(s, "g-ledger", name, count_lost=True, ledger=ledger, role="admin")

        def produce(n: int, start: int) -> None:
            with EventProducer(s, name) as producer:
                for e in make_events(n, start=start):
                    producer.send(e)
        with consumer() as first:
            produce(40, 0)
            assert len(drain(first, 40)) == 40
            first.commit()
            produce(2000, 40)  # acknowledged, fetched ahead or not, never committed
            kafka = next(svc for svc in enabled_services(s) if svc.name == "kafka")
            broker = psutil.Process(process.read_pidfile(stack.pidfile(s, kafka)).pid)
            broker.send_signal(signal.SIGKILL)
            broker.wait(10)
            assert stack.up(s) == ["kafka"]
            produce(4, 5000)
            live = drain(first, 2004)
        with consumer() as restarted:
            again = drain(restarted, 2004)
        ids = {f"e{i}" for i in (*range(40, 2040), *range(5000, 5004))}
        held = faults.record(
            "kill -9 broker, 2,000 records acknowledged, `up`", "every acknowledged record read; 0 counted lost",
            f"a live consumer read {len({c.event.event_id for c in live} & ids)} of 2,004, one restarted from its "
            f"ledger {len({c.event.event_id for c in again} & ids)}; counted lost {first.lost} and {restarted.lost}",
            {c.event.event_id for c in live} == ids == {c.event.event_id for c in again}
            and first.lost == restarted.lost == 0)
        assert held


def test_a_commit_while_the_coordinator_is_away_is_deferred_and_the_consumer_carries_on(tmp_path) -> None:
    """A commit the group's coordinator cannot take (its broker killed; in a cluster, the group moving to
    another node) leaves the consumer running, where it once took the feature ingestor down: once the
    broker is back it rejoins, reads again what the deferred commit covered, and commits it."""
    for s in running_stack(tmp_path / "stack", "kafka"):
        name, group = f"events-{uuid.uuid4().hex[:8]}", "g-deferred"
        ensure_topics(s, [name])
        with EventProducer(s, name) as producer:
            for e in make_events(30):
                producer.send(e)
        with EventConsumer(s, group, name, count_lost=True, ledger=tmp_path / "ledger.json", role="admin") as consumer:
            assert len(drain(consumer, 30)) == 30
            with EventProducer(s, name) as producer:  # fetched ahead, not read: the log's end past the position
                for e in make_events(20, start=30):
                    producer.send(e)
            time.sleep(3 * LOG_END_PROBE_S)
            kafka = next(svc for svc in enabled_services(s) if svc.name == "kafka")
            broker = psutil.Process(process.read_pidfile(stack.pidfile(s, kafka)).pid)
            broker.send_signal(signal.SIGKILL)
            broker.wait(10)
            # Deferred, not raised: librdkafka answers at once when it already knows the coordinator gone,
            # or holds the request until the broker is back (the consumer's loop then waits, as it should).
            committing = ThreadPoolExecutor(1).submit(consumer.commit)
            time.sleep(2)
            assert stack.up(s) == ["kafka"]
            committing.result(timeout=60)
            lag = consumer_lag(s, group, [name])
            assert lag in (50, 20), lag  # 50: deferred, the 30 read again; 20: made once the broker was back
            read_again: list = []

            def committed() -> None:  # what the ingestor's loop does: read, write, commit
                read_again.extend(consumer.poll(timeout_ms=500))
                consumer.commit()
                assert consumer_lag(s, group, [name]) == 0
            wait_for(committed, 60)
            assert {c.event.event_id for c in read_again} == {f"e{i}" for i in range(50 - lag, 50)}
            assert consumer.lost == 0  # read again below what was read, from the last commit: not a new topic

            # An offset reset to the log's start, below the last commit, with records fetched ahead: the log
            # still holds all it read (its high watermark past it), so it is read again, not counted lost as
            # a recreated topic's would be (the broker-crash fault test once counted 600 so).
            with EventProducer(s, name) as producer:
                for e in make_events(20, start=50):
                    producer.send(e)
            time.sleep(3 * LOG_END_PROBE_S)
            for tp in consumer._consumer.assignment():
                consumer._consumer.seek(TopicPartition(tp.topic, tp.partition, 0))
            assert {c.event.event_id for c in drain(consumer, 70)} == {f"e{i}" for i in range(70)}
            assert consumer.lost == 0
