"""The Feast ingestor: feature-update topics -> online store (Redis) and offline store (Parquet).

Micro-batches: as soon as a row is in, up to `max_records` that are, write each view's rows offline
(one Parquet file per batch and partition, named by its first record, so a replayed batch rewrites
the same file), then online (Feast's Redis layout, written directly: one pipelined round trip per topic,
the views sharing a topic in one script call per few hundred entities, newer row wins per view:
feature_repo/online.py), then commit the offsets. A crash between the write and the
commit replays the batch: rows are snapshots keyed by entity and event time, so writing one twice
changes nothing. A partition's small files of the last minute are then rewritten as one from memory
(feature_repo/files.py: MergingWriter), so a training scan reads few files however long the stack runs.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain

import msgspec
import pyarrow as pa
from confluent_kafka import Consumer, KafkaException, Message

from feature_repo.definitions import TIMESTAMP_FIELD, offline_schema
from feature_repo.files import MergingWriter, part_name, view_dir
from feature_repo.online import Columns, OnlineWriter, columns_of
from feature_repo.store import apply
from infra.progress import ProgressReport
from infra.settings import Settings, get_settings
from streaming.consumer import commit_written
from streaming.features import StreamView, row_schema, topics

log = logging.getLogger("flywheel.feast-ingestor")
GROUP = "flywheel-feast-ingestor"
VIEWS_BY_TOPIC = topics()  # a topic shared by views carries all their columns in each row
FIELDS_BY_TOPIC = {topic: tuple(name for name, _ in row_schema(views))
                   for topic, views in VIEWS_BY_TOPIC.items()}
_decode_row = msgspec.json.Decoder(list).decode  # a row is a JSON array of its fields (row_schema)


@dataclass
class IngestStats:
    batches: int = 0
    rows: int = 0
    skipped: int = 0  # tombstones and undecodable rows


def offline_tables(views: tuple[StreamView, ...], batch: Columns) -> dict[StreamView, pa.Table]:
    """The rows of views sharing a topic (as columns) as each view's offline file: each column converted
    once for all views, no DataFrame in between."""
    schemas = {view: offline_schema(view) for view in views}
    size = len(batch["event_time"])
    arrays: dict[str, pa.Array] = {}
    for view, schema in schemas.items():
        for name in [*view.keys, *(c for c, _ in view.columns)]:
            if name not in arrays:
                arrays[name] = pa.array(batch.get(name, [None] * size), schema.field(name).type)
    times = pa.array(batch["event_time"], schemas[views[0]].field(TIMESTAMP_FIELD).type)
    return {view: pa.table({**{name: arrays[name] for name in schema.names if name != TIMESTAMP_FIELD},
                            TIMESTAMP_FIELD: times}, schema=schema) for view, schema in schemas.items()}


@contextmanager
def acyclic() -> Iterator[None]:
    """No cyclic garbage collection inside: a batch's rows are lists of strings and numbers, no cycles,
    and the collector's walks over them as they piled up took a third of the ingestor's CPU at 50,000
    records a batch (with the start-up frozen too: 10.7-11.5 -> 7.2-7.4 s of CPU for stream-throughput's
    300,000 events). Enabled again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class FeatureIngestor:
    # A backlog drains in batches up to this large: fewer Parquet files and Redis calls per row, more rows
    # collapsed per entity (stream-throughput's 300,000-event burst: 10,000 -> 50,000 took it from 9,288
    # to 10,169-10,526 events/s; 200,000 gained nothing more).
    def __init__(self, s: Settings, max_records: int = 50_000, max_wait_ms: int = 100):
        self.s, self.max_records, self.max_wait_ms = s, max_records, max_wait_ms
        apply(s)  # the feature views Feast reads these rows through
        self.writer = OnlineWriter(s)
        self.stats = IngestStats()
        self.offline = MergingWriter(s.streaming.offline_merge_after_s)
        self.online_s: list[float] = []  # the last batch's rows: appended to their topic -> online, seconds
        # librdkafka: fetching and decoding in C, a prefetch queue filled while this process writes; a
        # fetch answered within `kafka.fetch_wait_ms`, not its default 500, on a quiet stream (freshness)
        self.consumer = Consumer(s.kafka.stream_consumer(GROUP))
        self.consumer.subscribe(list(VIEWS_BY_TOPIC))

    def run_once(self) -> int:
        """One micro-batch; returns the number of rows written."""
        # Written as soon as one row is in (consume() would wait for `max_records` or the whole
        # `max_wait_ms`), with whatever the consumer fetched meanwhile: batches grow with the load.
        first = self.consumer.poll(self.max_wait_ms / 1000)
        polled = [] if first is None else [first, *self.consumer.consume(self.max_records - 1, 0)]
        with acyclic():
            written = self._write(polled)
        return written

    def _write(self, polled: list[Message]) -> int:
        """`polled` offline, online, then committed; the number of rows written."""
        self.online_s = []
        by_partition: dict[tuple[str, int], list] = defaultdict(list)
        for record in polled:
            if record.error():  # librdkafka retries transient ones (a broker away) itself
                if record.error().fatal():
                    raise KafkaException(record.error())
                log.warning("consumer: %s", record.error())
                continue
            by_partition[record.topic(), record.partition()].append(record)
        batches: list[tuple[str, int, str, Columns]] = []  # topic, partition, file name, rows
        for (topic, partition), records in by_partition.items():
            decoded, fields = [], FIELDS_BY_TOPIC[topic]
            for record in records:
                try:
                    values = _decode_row(record.value())
                except (TypeError, msgspec.DecodeError):  # tombstone (None) or not JSON: nothing to write
                    values = None
                if values is None or len(values) != len(fields):  # not a row of this job's views
                    self.stats.skipped += 1
                    continue
                decoded.append(values)
            if decoded:
                first = VIEWS_BY_TOPIC[topic][0]  # only a topic's first view may finish its rows
                batch = (columns_of([first.finish(self.s, dict(zip(fields, row))) for row in decoded])
                         if first.finish else dict(zip(fields, map(list, zip(*decoded)))))
                batches.append((topic, partition, part_name(partition, records[0].offset(), records[0].value() or b""),
                                batch))
        # Offline first: a row visible online is then always in the training data too.
        by_topic: dict[str, list[Columns]] = defaultdict(list)
        for topic, partition, name, batch in batches:
            for view, table in offline_tables(VIEWS_BY_TOPIC[topic], batch).items():
                self.offline.write(view_dir(self.s, view.name), name, partition, table)
            by_topic[topic].append(batch)
        for topic, parts in by_topic.items():  # the views sharing a topic (and its partitions) in one write
            views = VIEWS_BY_TOPIC[topic]
            batch = {name: list(chain.from_iterable(part[name] for part in parts)) for name in parts[0]}
            self.writer.write(views[0].keys, [(v.name, v.columns) for v in views], batch)
        if polled:
            commit_written(self.consumer)
            self.stats.batches += 1
            online = time.time()  # every row of the batch is online: from the stream job's append to now
            self.online_s = [online - r.timestamp()[1] / 1000 for r in polled if r.timestamp()[0] and not r.error()]
        written = sum(len(batch["event_time"]) * len(VIEWS_BY_TOPIC[topic]) for topic, _, _, batch in batches)
        self.stats.rows += written
        return written

    def close(self) -> None:
        self.offline.close()
        self.consumer.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ingestor = FeatureIngestor(get_settings())
    # What the imports and the set-up leave (Feast, Arrow: long-lived) out of the collector's walks.
    gc.collect()
    gc.freeze()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    log.info("ingesting %s", ", ".join(VIEWS_BY_TOPIC))
    progress = ProgressReport(ingestor.s, "feast-ingestor", GROUP, list(VIEWS_BY_TOPIC))
    last_report = time.monotonic()
    try:
        while not stopping:
            wrote = ingestor.run_once() > 0
            progress.observe("feature_online", ingestor.online_s)
            progress.beat(wrote=wrote)
            if time.monotonic() - last_report > 30:
                log.info("%s, %d offline files merged away", ingestor.stats, ingestor.offline.merged)
                last_report = time.monotonic()
    finally:
        ingestor.close()


if __name__ == "__main__":
    main()
