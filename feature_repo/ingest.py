"""The Feast ingestor: feature-update topics -> online store (Redis) and offline store (Parquet).

Micro-batches: poll up to `max_records` or `max_wait_ms`, write each view's rows offline (one
Parquet file per batch and partition, named by its first record, so a replayed batch rewrites the
same file), then online (Feast's Redis layout, written directly in one pipelined round trip per view,
newer row wins: feature_repo/online.py), then commit the offsets. A crash between the write and the
commit replays the batch: rows are snapshots keyed by entity and event time, so writing one twice
changes nothing.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import pyarrow as pa
from confluent_kafka import Consumer, KafkaException

from feature_repo.definitions import TIMESTAMP_FIELD, offline_schema, view_dir
from feature_repo.files import part_name, write_atomic
from feature_repo.online import OnlineWriter
from feature_repo.store import apply
from infra.settings import Settings, get_settings
from streaming.features import StreamView, topics

log = logging.getLogger("flywheel.feast-ingestor")
GROUP = "flywheel-feast-ingestor"
VIEWS_BY_TOPIC = topics()  # a topic shared by views carries all their columns in each row
_decode_row = msgspec.json.Decoder(dict).decode  # several times json.loads's speed on these rows


@dataclass
class IngestStats:
    batches: int = 0
    rows: int = 0
    skipped: int = 0  # tombstones and undecodable rows


def rows_table(view: StreamView, rows: list[dict]) -> pa.Table:
    """A view's rows as an offline file's table (column by column: no DataFrame in between)."""
    schema = offline_schema(view)
    columns = {name: pa.array([r.get(name) for r in rows], schema.field(name).type)
               for name in [*view.keys, *(c for c, _ in view.columns)]}
    columns[TIMESTAMP_FIELD] = pa.array([r["event_time"] for r in rows], schema.field(TIMESTAMP_FIELD).type)
    return pa.table(columns, schema=schema)


class FeatureIngestor:
    def __init__(self, s: Settings, max_records: int = 10_000, max_wait_ms: int = 100):
        self.s, self.max_records, self.max_wait_ms = s, max_records, max_wait_ms
        apply(s)  # the feature views Feast reads these rows through
        self.writer = OnlineWriter(s)
        self.stats = IngestStats()
        # librdkafka: fetching and decoding in C, a prefetch queue filled while this process writes
        self.consumer = Consumer(s.kafka.client_options("librdkafka") | {
            "group.id": GROUP, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": s.kafka.session_timeout_ms, "heartbeat.interval.ms": s.kafka.heartbeat_interval_ms})
        self.consumer.subscribe(list(VIEWS_BY_TOPIC))

    def run_once(self) -> int:
        """One micro-batch; returns the number of rows written."""
        polled = self.consumer.consume(self.max_records, self.max_wait_ms / 1000)
        by_partition: dict[tuple[str, int], list] = defaultdict(list)
        for record in polled:
            if record.error():  # librdkafka retries transient ones (a broker away) itself
                if record.error().fatal():
                    raise KafkaException(record.error())
                log.warning("consumer: %s", record.error())
                continue
            by_partition[record.topic(), record.partition()].append(record)
        batches: list[tuple[StreamView, str, list[dict]]] = []  # view, file name, rows
        for (topic, partition), records in by_partition.items():
            decoded = []
            for record in records:
                try:
                    decoded.append(_decode_row(record.value()))
                except (TypeError, msgspec.DecodeError):  # tombstone (None) or not JSON: nothing to write
                    self.stats.skipped += 1
            if decoded:
                name = part_name(partition, records[0].offset(), records[0].value() or b"")
                for view in VIEWS_BY_TOPIC[topic]:
                    rows = [view.finish(self.s, row) for row in decoded] if view.finish else decoded
                    batches.append((view, name, rows))
        # Offline first: a row visible online is then always in the training data too.
        by_view: dict[StreamView, list[dict]] = defaultdict(list)
        for view, name, rows in batches:
            write_atomic(rows_table(view, rows), view_dir(self.s, view.name) / name)
            by_view[view].extend(rows)
        for view, rows in by_view.items():
            self.writer.write(view.name, view.keys, view.columns, rows)
        if polled:
            self.consumer.commit(asynchronous=False)
            self.stats.batches += 1
        written = sum(len(rows) for _, _, rows in batches)
        self.stats.rows += written
        return written

    def close(self) -> None:
        self.consumer.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ingestor = FeatureIngestor(get_settings())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    log.info("ingesting %s", ", ".join(VIEWS_BY_TOPIC))
    last_report = time.monotonic()
    try:
        while not stopping:
            ingestor.run_once()
            if time.monotonic() - last_report > 30:
                log.info("%s", ingestor.stats)
                last_report = time.monotonic()
    finally:
        ingestor.close()


if __name__ == "__main__":
    main()
