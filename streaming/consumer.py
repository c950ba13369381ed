"""Consuming behavior events as a consumer group, with invalid records dead-lettered, never fatal.

An invalid record is copied (key, headers, and its value cut to `kafka.max_event_bytes`) to
``<topic>.dlq`` with the headers of streaming/events.py: reason, source topic, partition, offset and
original size. Offsets are committed only by `commit()`, after the dead-letter writes are acknowledged,
so nothing is lost on a crash (at-least-once delivery).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from kafka.consumer.fetcher import ConsumerRecord

from infra.settings import Settings
from streaming.events import (
    DLQ_OFFSET, DLQ_ORIGINAL_SIZE, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC, Event, InvalidEvent, decode)


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
                 decoder: Callable[[bytes | None], Any] | None = None, **client_overrides: object):
        """`dead_letter=False` skips invalid records (counted in `invalid`) for a reader that is not
        their owner: the stream job dead-letters the events topic, so the event log only skips.
        `decoder` reads another topic's records (raising InvalidEvent); events by default."""
        self.topic, self.group = topic or s.kafka.events_topic, group_id
        self.dead_letter = dead_letter
        self.invalid = 0
        self.dlq_topic = s.kafka.dlq_topic(self.topic)
        self.max_bytes = s.kafka.max_event_bytes
        types = s.spec.type_names
        self.decoder = decoder or (lambda value: decode(value, self.max_bytes, types))
        self.dead_lettered = 0
        # Not on a freshness path (the archives): librdkafka's default fetch wait, the broker's CPU spared.
        options = s.kafka.stream_consumer(group_id) | {"fetch.wait.max.ms": 500} | client_overrides
        self._consumer = Consumer(options)
        self._consumer.subscribe([self.topic])
        self._dlq = Producer(s.kafka.client_options("librdkafka") | {"acks": "all", "linger.ms": 5})
        self._dlq_errors: list[KafkaError] = []

    def poll(self, timeout_ms: int = 1000, max_records: int = 1000) -> list[Consumed]:
        """The next valid events (up to `max_records`, waiting at most `timeout_ms` for them); invalid
        ones are dead-lettered on the way."""
        out: list[Consumed] = []
        for record in self._consumer.consume(max_records, timeout_ms / 1000):
            if record.error():  # librdkafka retries transient ones (a broker away) itself
                if record.error().fatal():
                    raise KafkaException(record.error())
                continue
            try:
                out.append(Consumed(self.decoder(record.value()), record.partition(), record.offset()))
            except InvalidEvent as exc:
                self.invalid += 1
                if self.dead_letter:
                    self._dead_letter(record, exc.reason)
        return out

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
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:  # nothing consumed since the last commit
                raise

    def __iter__(self) -> Iterator[Consumed]:
        """Events forever; commits after each polled batch has been handed out."""
        while True:
            yield from self.poll()
            self.commit()

    def close(self) -> None:
        self._dlq.flush(30)
        self._consumer.close()

    def __enter__(self) -> "EventConsumer":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


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
