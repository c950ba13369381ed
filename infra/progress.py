"""Health by progress for the stack's consumers (the Feast ingestor, the event log): a live PID is not a
working consumer. Each consumer reports when it last polled and last wrote, in a small file under the
run directory; `flywheel status` reads it and asks Kafka how far the consumer's committed offsets are
behind the log's end (the consumers commit only after writing, so committed = written).

A consumer is unhealthy when it has not polled for `stack.stall_after_s` (stopped or stuck), or when it is
behind and has not written for that long (failing to write). A quiet stream with nothing to consume is
healthy however long ago the last write was.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.settings import Settings


def progress_path(s: Settings, service: str) -> Path:
    return s.paths.run_dir / f"{service}.progress.json"


def ledger_path(s: Settings, service: str) -> Path:
    """Where a consumer that counts lost records keeps what it counts from across its restarts (`up` keeps it,
    unlike the progress report: streaming/consumer.py)."""
    return s.paths.run_dir / f"{service}.offsets.json"


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def state_path(s: Settings, service: str) -> Path:
    """Where a stack process that is not a consumer says what it found (the canary analyst)."""
    return s.paths.run_dir / f"{service}.state.json"


@dataclass
class Progress:
    group: str  # the consumer group and its topics: where `consumer_lag` looks
    topics: list[str]
    started_at: float  # epoch seconds
    polled_at: float
    written_at: float | None = None
    lost: int = 0  # records a restarted broker no longer held when the consumer came for them (a lower bound)
    lost_at: float | None = None
    # What the consumer timed, as cumulative histograms: name -> {"counts": per LATENCY_BUCKETS bound (the
    # last: +Inf), "sum": seconds}; the exporter serves them to Prometheus (flywheel_<name>_seconds).
    latencies: dict = field(default_factory=dict)


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class ProgressReport:
    """Kept by a consumer: call `beat` after each poll; the file is rewritten at most every `every_s`."""

    def __init__(self, s: Settings, service: str, group: str, topics: Sequence[str], every_s: float = 1.0) -> None:
        self.path, self.every_s, self._saved = progress_path(s, service), every_s, 0.0
        now = time.time()
        self.progress = Progress(group, list(topics), started_at=now, polled_at=now)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._save(now)

    def beat(self, wrote: bool, lost: int = 0, lost_at: float | None = None) -> None:
        """`lost`: the consumer's count so far of records a broker restart took before it read them, the last
        of them counted at `lost_at` (epoch seconds; now when not given)."""
        now = time.time()
        self.progress.polled_at = now
        if wrote:
            self.progress.written_at = now
        if lost != self.progress.lost:
            self.progress.lost, self.progress.lost_at = lost, lost_at or now
            self._save(now)  # at once: `flywheel status` reports it
        elif now - self._saved >= self.every_s:
            self._save(now)

    def observe(self, name: str, seconds: Sequence[float]) -> None:
        """Add timings (seconds) to the histogram `name`, saved with the next beat."""
        import numpy as np

        if not len(seconds):
            return
        h = self.progress.latencies.setdefault(name, {"counts": [0] * len(LATENCY_BUCKETS), "sum": 0.0})
        values = np.asarray(seconds, dtype=float)
        at = np.searchsorted(LATENCY_BUCKETS, values, side="left")  # the first bound >= the value
        per_bucket = np.bincount(at, minlength=len(LATENCY_BUCKETS))
        h["counts"] = [int(c) for c in np.cumsum(per_bucket) + np.asarray(h["counts"])]
        h["sum"] += float(values.sum())

    def _save(self, now: float) -> None:
        replace_text(self.path, json.dumps(asdict(self.progress)))
        self._saved = now


def read_progress(s: Settings, service: str) -> Progress | None:
    try:
        return Progress(**json.loads(progress_path(s, service).read_text()))
    except FileNotFoundError:
        return None


def consumer_lag(s: Settings, group: str, topics: Sequence[str], timeout_s: float = 5.0) -> int:
    """Records in `topics` past `group`'s committed offsets."""
    from confluent_kafka import Consumer, TopicPartition  # librdkafka: only when a health check asks

    consumer = Consumer(s.kafka.client_options("librdkafka", "admin") | {"group.id": group,
                                                                         "enable.auto.commit": False})
    try:
        partitions = [TopicPartition(topic, p) for topic in topics
                      for p in consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions]
        lag = 0
        for tp in consumer.committed(partitions, timeout=timeout_s):
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
            lag += max(0, high - (tp.offset if tp.offset >= 0 else low))
        return lag
    finally:
        consumer.close()


def topic_id(s: Settings, topic: str, role: str = "admin") -> str | None:
    """The topic's id on the broker: a topic deleted and created again (every topic of a restarted embedded
    broker) has a new one. None when the broker does not say (kafka-python: both environments have it)."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", role), request_timeout_ms=5000)
    except KafkaError:
        return None
    try:
        return next((str(t["topic_id"]) for t in admin.describe_topics([topic]) if t["error_code"] == 0), None)
    except KafkaError:
        return None
    finally:
        admin.close()


def progress_health(s: Settings, service: str) -> tuple[bool, str]:
    """(healthy, why) of the consumer that reports as `service`."""
    p = read_progress(s, service)
    if p is None:
        return True, "started, no progress report yet"
    now, limit = time.time(), s.stack.stall_after_s
    lag = consumer_lag(s, p.group, p.topics)
    wrote = "never" if p.written_at is None else f"{now - p.written_at:.0f} s ago"
    if p.lost:
        wrote += f"; {p.lost} records lost in a broker restart {now - (p.lost_at or now):.0f} s ago (at least)"
    if now - p.polled_at > limit:
        return False, (f"stalled: no poll for {now - p.polled_at:.0f} s (> {limit:g}); lag {lag} records, "
                       f"last write {wrote}")
    if lag > 0 and now - (p.written_at or p.started_at) > limit:
        return False, f"falling behind: lag {lag} records and no write for over {limit:g} s (last write {wrote})"
    return True, f"lag {lag} records, last write {wrote}"


def wait_caught_up(s: Settings, service: str, wait_s: float) -> int | None:
    """The lag of the consumer reporting as `service` once it has had up to `wait_s` to reach the end of
    its topics. None: it never reported, or Kafka did not answer."""
    p = read_progress(s, service)
    if p is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        while (lag := consumer_lag(s, p.group, p.topics)) and time.monotonic() < deadline:
            time.sleep(0.5)
    except Exception:  # noqa: BLE001 - a broker that does not answer: nothing to tell
        return None
    return lag
