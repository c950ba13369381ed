"""Producing behavior events: validated before they leave the process, keyed by user."""

from __future__ import annotations

from kafka import KafkaProducer

from infra.settings import Settings
from streaming.events import Event


class EventProducer:
    """Sends Events to a topic with acks=all; an invalid event raises InvalidEvent and is not sent."""

    def __init__(self, s: Settings, topic: str | None = None, **client_overrides: object):
        self.topic = topic or s.kafka.events_topic
        self.max_bytes = s.kafka.max_event_bytes
        self.sent = 0
        self._producer = KafkaProducer(
            **s.kafka.client_config(), acks="all", linger_ms=5, batch_size=256 * 1024,
            max_in_flight_requests_per_connection=5, **client_overrides,
        )
        self._failures: list[Exception] = []

    def send(self, event: Event) -> None:
        payload = event.encode(self.max_bytes)
        self._producer.send(self.topic, key=event.key, value=payload).add_errback(self._failures.append)
        self.sent += 1

    def flush(self) -> None:
        """Block until every sent event is acknowledged; raise if any was not."""
        self._producer.flush()
        if self._failures:
            failures, self._failures = self._failures, []
            raise RuntimeError(f"{len(failures)} event(s) were not acknowledged by Kafka: {failures[0]!r}")

    def close(self) -> None:
        self.flush()
        self._producer.close()

    def __enter__(self) -> "EventProducer":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._producer.close(timeout=5)
