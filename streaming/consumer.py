"""Consuming behavior events as a consumer group, with invalid records dead-lettered, never fatal.

An invalid record is copied (key, headers, and its value cut to `kafka.max_event_bytes`) to
``<topic>.dlq`` with the headers of streaming/events.py: reason, source topic, partition, offset and
original size. Offsets are committed only by `commit()`, after the dead-letter writes are acknowledged,
so nothing is lost on a crash (at-least-once delivery).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from infra.progress import replace_text
from infra.settings import Settings
from streaming.events import (
    DLQ_OFFSET, DLQ_ORIGINAL_SIZE, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC, Event, InvalidEvent, decode)

log = logging.getLogger(__name__)

LOG_END_PROBE_S = 0.25  # how often a consumer asks the broker where its partitions end (see `lost`)


@dataclass(frozen=True)
class Consumed:
    """A valid event (or what the consumer's decoder made of a record) and where it was read from."""

    event: Event | Any
    partition: int
    offset: int


@dataclass(frozen=True)
class DeadLetter:
    """A record of a dead-letter topic: the original bytes and why they were refused."""

    reason: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # at most `kafka.max_event_bytes` of the original
    original_size: int | None  # bytes of the original value; None for a tombstone or a letter without it


class EventConsumer:
    """Reads validated Events from `topic` as member of `group_id` (librdkafka: records fetched and
    unpacked in C, so the Python cost per event is its decoding)."""

    def __init__(self, s: Settings, group_id: str, topic: str | None = None, *, dead_letter: bool = True,
                 decoder: Callable[[bytes | None], Any] | None = None, count_lost: bool = False,
                 ledger: Path | None = None, role: str = "pipeline", **client_overrides: object):
        """`dead_letter=False` skips invalid records (counted in `invalid`) for a reader that is not
        their owner: the stream job dead-letters the events topic, so the event log only skips.
        `decoder` reads another topic's records (raising InvalidEvent); events by default.
        `ledger` (with `count_lost`): a file that keeps `lost` and what it is counted from (the committed
        positions, the log ends seen) across this consumer's restarts, rewritten at each commit.
        `role`: the Kafka principal it reads (and dead-letters) as (infra/kafka_auth.py)."""
        self.topic, self.group = topic or s.kafka.events_topic, group_id
        self.dead_letter = dead_letter
        self.invalid = 0
        self.dlq_topic = s.kafka.dlq_topic(self.topic)
        self.max_bytes = s.kafka.max_event_bytes
        types = s.spec.type_names
        self.decoder = decoder or (lambda value: decode(value, self.max_bytes, types))
        self.dead_lettered = 0
        # A broker that comes back with a topic empty (a new incarnation: one that lost its log) has lost
        # what it held past what this consumer had read. With `count_lost`, `lost` counts it up to the log ends
        # last seen (a lower bound: what was acknowledged after the last fetch is not seen), looked at by
        # a thread of its own: a consumer busy writing, or niced on a busy host, still knows them.
        # A consumer restarted with the broker (by `up`, unhealthy after the crash) counts from its ledger:
        # committed positions only, so one restarted beside a live broker resumes where it counts from.
        self.lost, self.lost_at = 0, None  # lost_at: epoch seconds of the last count
        self._next: dict[int, int] = {}  # partition -> the offset after the last record read
        self._end: dict[int, int] = {}  # partition -> the largest log end seen in this incarnation
        self._floor: dict[int, int] = {}  # partition -> the largest position seen (where reading starts)
        self._committed: dict[int, int] = {}  # partition -> the offset after the last record committed
        self._ends_lock, self._closed = threading.Lock(), threading.Event()
        self._ledger = ledger if count_lost else None
        if self._ledger is not None:
            self._resume(self._ledger)
        # Not on a freshness path (the archives): librdkafka's default fetch wait, the broker's CPU spared.
        options = s.kafka.stream_consumer(group_id, role) | {"fetch.wait.max.ms": 500} | client_overrides
        self._consumer = Consumer(options)
        self._consumer.subscribe([self.topic])
        self._dlq = Producer(s.kafka.client_options("librdkafka", role) | {"acks": "all", "linger.ms": 5})
        self._dlq_errors: list[KafkaError] = []
        self._prober = threading.Thread(target=self._probe_log_ends, name="log-end-probe", daemon=True)
        if count_lost:
            self._prober.start()

    def poll(self, timeout_ms: int = 1000, max_records: int = 1000) -> list[Consumed]:
        """The next valid events (up to `max_records`, waiting at most `timeout_ms` for them); invalid
        ones are dead-lettered on the way."""
        out: list[Consumed] = []
        for record in self._consumer.consume(max_records, timeout_ms / 1000):
            if record.error():  # librdkafka retries transient ones (a broker away) itself
                if record.error().fatal():
                    raise KafkaException(record.error())
                continue
            self._track(record.partition(), record.offset())
            try:
                out.append(Consumed(self.decoder(record.value()), record.partition(), record.offset()))
            except InvalidEvent as exc:
                self.invalid += 1
                if self.dead_letter:
                    self._dead_letter(record, exc.reason)
        return out

    def _probe_log_ends(self) -> None:
        """Every LOG_END_PROBE_S, the log's end per partition as the last fetch response gave it (librdkafka
        fetches ahead of what poll() returned, in threads of its own; no request of its own). Kept as it
        grows: a recreated topic's end is smaller until it is read."""
        while not self._closed.wait(LOG_END_PROBE_S):
            try:
                assigned = self._consumer.assignment()
                ends = [(tp.partition, self._consumer.get_watermark_offsets(tp, cached=True)[1]) for tp in assigned]
                positions = [(tp.partition, tp.offset) for tp in self._consumer.position(assigned)]
            except (KafkaException, RuntimeError):  # the consumer closed: nothing learnt
                continue
            with self._ends_lock:
                for seen, values in ((self._end, ends), (self._floor, positions)):
                    for partition, offset in values:
                        if offset >= 0:  # librdkafka's "not known yet" is negative
                            seen[partition] = max(seen.get(partition, 0), offset)

    def _resume(self, ledger: Path) -> None:
        try:
            saved = json.loads(ledger.read_text())
        except (FileNotFoundError, ValueError):  # the first start, or a file cut short: nothing to go on
            return
        if (saved.get("topic"), saved.get("group")) != (self.topic, self.group):
            return
        self.lost, self.lost_at = saved["lost"], saved["lost_at"]
        self._committed = {int(p): offset for p, offset in saved["committed"].items()}
        self._next = dict(self._committed)
        self._end = {int(p): offset for p, offset in saved["ends"].items()}

    def _save_ledger(self, ledger: Path) -> None:
        with self._ends_lock:
            ends = dict(self._end)
        replace_text(ledger, json.dumps({"topic": self.topic, "group": self.group, "lost": self.lost,
                                         "lost_at": self.lost_at, "committed": self._committed, "ends": ends}))

    def _track(self, partition: int, offset: int) -> None:
        read = self._next.get(partition, 0)
        # Back below what was read while the log still holds it (back to the last commit after an assignment
        # lost or a commit deferred; to the log's start after an offset reset): read again, at-least-once,
        # nothing lost. The high watermark is the one the fetch of this record brought (no request).
        if offset < read and (self._committed.get(partition, 0) <= offset or self._log_end(partition) >= read):
            self._next[partition] = offset + 1
            return
        if offset < read:  # the partition starts again below what was read: the topic was recreated, and
            with self._ends_lock:  # with it every partition (a partition without new records says nothing)
                starts = self._floor | self._next  # a partition not read from: where reading would start
                gone = sum(max(0, end - starts.get(p, end)) for p, end in self._end.items())
                self._end.clear()
                self._floor.clear()
            self._next.clear()
            self._committed.clear()  # the old incarnation's: a ledger saved from now on counts `gone` once
            self.lost += gone
            self.lost_at = time.time() if gone else self.lost_at
            log.warning("%s[%d] starts again at offset %d below the %d read: the topic was recreated; %d "
                        "records the broker held were not read (%d in all)", self.topic, partition, offset, read,
                        gone, self.lost)
        self._next[partition] = offset + 1

    def _log_end(self, partition: int) -> int:
        """The partition's high watermark as the last fetch gave it (negative: not known)."""
        return self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition), cached=True)[1]

    def _dead_letter(self, record: Message, reason: str) -> None:
        value = record.value()
        headers = list(record.headers() or []) + [
            (DLQ_REASON, reason.encode()),
            (DLQ_TOPIC, record.topic().encode()),
            (DLQ_PARTITION, str(record.partition()).encode()),
            (DLQ_OFFSET, str(record.offset()).encode()),
            (DLQ_ORIGINAL_SIZE, b"" if value is None else str(len(value)).encode()),
        ]
        self._dlq.produce(self.dlq_topic, key=record.key(), value=None if value is None else value[:self.max_bytes],
                          headers=headers, on_delivery=lambda err, _: err and self._dlq_errors.append(err))
        self._dlq.poll(0)
        self.dead_lettered += 1

    def commit(self) -> None:
        """Commit what poll() returned, once every dead letter is acknowledged (raises if one is not)."""
        if self._dlq.flush(30):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "dead letters not acknowledged in 30 s"))
        if self._dlq_errors:
            error, self._dlq_errors = self._dlq_errors[0], []
            raise KafkaException(error)  # the offsets stay uncommitted
        if commit_written(self._consumer):
            self._committed = dict(self._next)
        if self._ledger is not None:
            self._save_ledger(self._ledger)

    def __iter__(self) -> Iterator[Consumed]:
        """Events forever; commits after each polled batch has been handed out."""
        while True:
            yield from self.poll()
            self.commit()

    def close(self) -> None:
        self._closed.set()
        if self._prober.is_alive():
            self._prober.join(10)  # not inside a call on the consumer as it is destroyed
        if self._ledger is not None:
            self._save_ledger(self._ledger)  # with the log ends seen since the last commit
        self._dlq.flush(30)
        self._consumer.close()

    def __enter__(self) -> "EventConsumer":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# A commit the group no longer takes: the partitions were reassigned (a rebalance, or a restarted broker that
# forgot the group). What was read is written; whoever reads those partitions next reads it again
# (at-least-once), so the consumer carries on. _NO_OFFSET: nothing read since the last commit.
_NOT_TAKEN = (KafkaError._ASSIGNMENT_LOST, KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION,
              KafkaError.REBALANCE_IN_PROGRESS)
# The group's coordinator away: its broker down, or the group moving to another (a cluster node killed
# under load took the feature ingestor down with _WAIT_COORD). A commit is of the positions read so far,
# so the next one covers this batch too; until then a restart reads it again (at-least-once).
_COORDINATOR_AWAY = (KafkaError._WAIT_COORD, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
                     KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TRANSPORT, KafkaError._TIMED_OUT,
                     KafkaError.REQUEST_TIMED_OUT, KafkaError._ALL_BROKERS_DOWN)


def commit_written(consumer: Consumer) -> bool:
    """Commit, synchronously, the offsets of what `consumer` read and its owner has written. False: the
    group did not take them, or its coordinator could not be reached (the next commit covers them)."""
    try:
        consumer.commit(asynchronous=False)
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        if error.code() in _NOT_TAKEN:
            log.warning("commit not taken (%s): what was read is written, and read again", error.str())
            return False
        if error.code() in _COORDINATOR_AWAY or error.retriable():
            log.warning("commit deferred (%s): the next one covers what was read", error.str())
            return False
        if error.code() != KafkaError._NO_OFFSET:
            raise
    return True


def read_dead_letter(record: ConsumerRecord) -> DeadLetter:
    """Read a record of a dead-letter topic."""
    headers = {k: v for k, v in record.headers or []}
    return DeadLetter(
        reason=headers.get(DLQ_REASON, b"").decode(errors="replace"),
        topic=headers.get(DLQ_TOPIC, b"").decode(),
        partition=int(headers.get(DLQ_PARTITION) or b"-1"),
        offset=int(headers.get(DLQ_OFFSET) or b"-1"),
        key=record.key, value=record.value,
        original_size=int(headers[DLQ_ORIGINAL_SIZE]) if headers.get(DLQ_ORIGINAL_SIZE) else None,
    )
