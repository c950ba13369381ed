"""Topic and ACL administration (as the admin role), and whole-topic reads.

End offsets are read from the high watermark fetch responses carry, which is right on every broker
(some Kafka-protocol brokers answer ListOffsets(latest) with the last batch's base offset + 1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import (ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, NewTopic, ResourcePattern,
                         ResourceType)
from kafka.errors import TopicAlreadyExistsError
from kafka.consumer.fetcher import ConsumerRecord

from infra.kafka_auth import acls
from infra.settings import Settings, get_settings
from streaming.features import topics


def ensure_topics(s: Settings, topics: list[str], partitions: int | None = None, role: str = "admin") -> set[str]:
    """Create `topics` (and their dead-letter topics) if missing; existing topics are left as they are.
    Returns the topics this call created. A role other than the admin sees only the topics it may use."""
    wanted = set(topics) | {s.kafka.dlq_topic(t) for t in topics if not t.endswith(s.kafka.dlq_suffix)}
    admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", role))
    try:
        missing = wanted - set(admin.list_topics())
        for name in sorted(missing):
            try:
                admin.create_topics([NewTopic(name, partitions or s.kafka.partitions, s.kafka.replication_factor)])
            except TopicAlreadyExistsError:
                pass  # created concurrently by another client
    finally:
        admin.close()
    _wait_for_metadata(s, wanted, role)
    return missing


def ensure_acls(s: Settings, feature_topics: list[str]) -> int:
    """Grant every role its ACLs (infra/kafka_auth.py) on the local broker; granting again changes nothing.
    Returns how many bindings were sent."""
    wanted = [ACL(a.principal, "*", ACLOperation[a.operation], ACLPermissionType.ALLOW,
                  ResourcePattern(ResourceType[a.resource], a.name, ACLResourcePatternType[a.pattern]))
              for a in acls(s, feature_topics)]
    admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", "admin"))
    try:
        result = admin.create_acls(wanted)
    finally:
        admin.close()
    if result["failed"]:
        raise RuntimeError(f"ACLs refused by the broker: {result['failed'][:3]}")
    return len(wanted)


def _wait_for_metadata(s: Settings, topics: set[str], role: str, timeout_s: float = 10.0) -> None:
    consumer = KafkaConsumer(**s.kafka.client_options("kafka-python", role))
    try:
        deadline = time.monotonic() + timeout_s
        while any(not consumer.partitions_for_topic(t) for t in topics):
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics {sorted(topics)} not visible in metadata after {timeout_s}s")
            time.sleep(0.1)
    finally:
        consumer.close()


def end_offsets(s: Settings, topic: str, timeout_s: float = 30.0) -> dict[int, int]:
    """Partition -> high watermark (offset of the next record), read from fetch responses."""
    offsets: dict[int, int] = {}
    with _reader(s, topic) as (consumer, partitions):
        consumer.seek_to_end()  # fetching at the (possibly low) listed end still returns the watermark
        deadline = time.monotonic() + timeout_s
        while len(offsets) < len(partitions):
            consumer.poll(timeout_ms=200, max_records=1)
            for tp in partitions:
                if consumer.highwater(tp) is not None:
                    offsets[tp.partition] = consumer.highwater(tp)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no high watermark for {topic} after {timeout_s}s")
    return offsets


def read_range(s: Settings, topic: str, start: dict[int, int], end: dict[int, int],
               idle_timeout_s: float = 15.0) -> Iterator[ConsumerRecord]:
    """Every record of `topic` with start[p] <= offset < end[p], in offset order per partition."""
    with _reader(s, topic) as (consumer, partitions):
        todo = {tp for tp in partitions if start.get(tp.partition, 0) < end.get(tp.partition, 0)}
        for tp in todo:
            consumer.seek(tp, start.get(tp.partition, 0))
        consumer.pause(*(set(partitions) - todo))
        last_progress = time.monotonic()
        while todo:
            batch = consumer.poll(timeout_ms=500, max_records=5000)
            if batch:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > idle_timeout_s:
                raise TimeoutError(f"{topic}: no records for {idle_timeout_s}s before the end offsets")
            for tp, records in batch.items():
                for record in records:
                    if record.offset < end[tp.partition]:
                        yield record
                if consumer.position(tp) >= end[tp.partition] and tp in todo:
                    todo.discard(tp)
                    consumer.pause(tp)


class _reader:
    """A group-less consumer assigned to every partition of a topic."""

    def __init__(self, s: Settings, topic: str):
        self.s, self.topic = s, topic

    def __enter__(self) -> tuple[KafkaConsumer, list[TopicPartition]]:
        self.consumer = KafkaConsumer(**self.s.kafka.client_options("kafka-python", "admin"),
                                      enable_auto_commit=False, group_id=None, fetch_max_bytes=16 * 1024 * 1024)
        ids = self.consumer.partitions_for_topic(self.topic)
        if not ids:
            self.consumer.close()
            raise LookupError(f"topic {self.topic!r} does not exist")
        partitions = [TopicPartition(self.topic, p) for p in sorted(ids)]
        self.consumer.assign(partitions)
        return self.consumer, partitions

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()


def prepare_pipeline(s: Settings) -> None:
    """Before the pipeline starts, and whenever a broker starts (the stack runs this as their setup): the
    platform's topics must exist with their partitions, since a missing source topic fails a Flink job and
    a topic a client's metadata request creates gets the broker's defaults.

    On the stack's own broker, every role is granted its ACLs on them (infra/kafka_auth.py); a cluster of
    your own keeps the ACLs its administrators give.

    A recreated events topic (a broker that lost its log) keeps the stream job's checkpoints: the job
    resumes its aggregates from them and reads the new topic from its start (streaming/job.py,
    `events_source`).
    """
    feature_topics = topics()
    ensure_topics(s, [s.kafka.events_topic, *feature_topics, s.serving.predictions_topic])
    if "kafka" in s.stack.services:
        ensure_acls(s, feature_topics)


if __name__ == "__main__":
    prepare_pipeline(get_settings())
