"""Producing behavior events: validated before they leave the process, keyed by user.

Uses confluent-kafka (librdkafka), about ten times the throughput of kafka-python here, with the
murmur2 partitioner that kafka-python and the Java clients use, so a key maps to the same partition
whichever client wrote it.
"""

from __future__ import annotations

import confluent_kafka

from infra.settings import Settings
from streaming.events import Event

PRODUCER_OPTIONS = {
    "acks": "all",
    "enable.idempotence": True,  # retries neither duplicate nor reorder a user's events
    "linger.ms": 5,
    "message.timeout.ms": 60_000,  # give up (and raise on flush) after a minute without the broker
    "partitioner": "murmur2_random",
}


class EventProducer:
    """Sends Events to a topic; an invalid event raises InvalidEvent and is not sent."""

    def __init__(self, s: Settings, topic: str | None = None, role: str | None = None,
                 **librdkafka_overrides: object):
        self.topic = topic or s.kafka.events_topic
        # An outside producer writes only the events topic; a topic of another name is an operator's own
        # (a test's, a replay's), written as the admin.
        role = role or ("producer" if self.topic == s.kafka.events_topic else "admin")
        self.max_bytes = s.kafka.max_event_bytes
        self.types = s.spec.type_names  # the event types this producer's dataset spec declares
        self.sent = 0
        self._producer = confluent_kafka.Producer(
            s.kafka.client_options("librdkafka", role) | PRODUCER_OPTIONS | librdkafka_overrides)
        self._failures: list[confluent_kafka.KafkaError] = []

    def _delivered(self, err: confluent_kafka.KafkaError | None, _msg: object) -> None:
        if err is not None:
            self._failures.append(err)

    def send(self, event: Event) -> None:
        payload = event.encode(self.max_bytes, self.types)
        while True:
            try:
                self._producer.produce(self.topic, payload, event.key, on_delivery=self._delivered)
                break
            except BufferError:  # the local queue is full: wait for acknowledgements to drain it
                self._producer.poll(0.05)
        self._producer.poll(0)
        self.sent += 1

    def flush(self, timeout_s: float = 90.0) -> None:
        """Block until every sent event is acknowledged; raise if any was not."""
        unsent = self._producer.flush(timeout_s)
        failures, self._failures = self._failures, []
        if unsent or failures:
            first = repr(failures[0]) if failures else "timed out"
            raise RuntimeError(f"{unsent + len(failures)} event(s) were not acknowledged by Kafka: {first}")

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "EventProducer":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._producer.flush(5)
