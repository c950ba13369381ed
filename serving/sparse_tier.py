"""A served version's sparse tables read from the embedding store through the worker's cache of hot rows.

Per batch, the ids of every table (`CtrModel.table_ids`) are looked up in the version's cache; the misses
of all tables are read in one pipelined round trip (models/embedding_store.py), bounded by
`sparse_tier.timeout_ms`. A read that fails or times out scores its ids with the default row, counts
them (`flywheel_sparse_rows{outcome="default"}`) and, for `retry_after_s`, sends the next batches
straight to the defaults instead of waiting on a store that is down: never a 500. Default rows taken for a
failure are not cached, so the next read once the store answers gets the real ones.

Deltas: `DeltaListener` reads `sparse_tier.deltas_topic` (each worker on its own, from the newest
message); a delta whose parent's cache this worker holds becomes the new version's cache (the parent's
hot rows with the changed ones replaced), ready before any alias names it. One whose parent it does not
hold is ignored with a log line: the new version's cache then starts empty and fills from the store.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict

import confluent_kafka
import msgspec
import numpy as np
import redis

from infra.settings import Settings
from models.embedding_store import EmbeddingStore, VersionInfo
from models.sparse import DEFAULT_ROW
from models.sparse_tier import DeltaPart
from serving import metrics

log = logging.getLogger(__name__)


class RowCache:
    """One version's hot rows in a worker: (table, id) -> row ([dim] float32, None: the default row),
    least recently used evicted past `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[tuple[str, str], np.ndarray | None] = OrderedDict()
        self._lock = threading.Lock()  # the batch executors and the delta listener

    def __len__(self) -> int:
        return len(self.rows)

    def get_many(self, table: str, ids: list[str]) -> tuple[list[np.ndarray | None], list[int]]:
        """Rows of the cached ids (None where missing or default) and the indices of the missing ones."""
        found: list[np.ndarray | None] = [None] * len(ids)
        missing = []
        with self._lock:
            rows = self.rows
            for i, id_ in enumerate(ids):
                key = (table, id_)
                if key in rows:
                    rows.move_to_end(key)
                    found[i] = rows[key]
                else:
                    missing.append(i)
        return found, missing

    def put_many(self, table: str, ids: list[str], values: list[np.ndarray | None]) -> None:
        with self._lock:
            rows = self.rows
            for id_, value in zip(ids, values):
                rows[(table, id_)] = value
            while len(rows) > self.capacity:
                rows.popitem(last=False)

    def replace(self, table: str, ids: list[str], values: list[np.ndarray | None]) -> int:
        """Replace the rows of the ids this cache holds (a delta); returns how many it held."""
        held = 0
        with self._lock:
            rows = self.rows
            for id_, value in zip(ids, values):
                if (table, id_) in rows:
                    rows[(table, id_)] = value
                    held += 1
        return held

    def copy(self) -> RowCache:
        twin = RowCache(self.capacity)
        with self._lock:
            twin.rows = self.rows.copy()
        return twin


class BatchTable:
    """A batch's rows of one table, answering `SparseTable.lookup`/`gather` for `CtrModel.scoring_inputs`."""

    def __init__(self, index: dict[str, int], values: np.ndarray) -> None:
        self.index, self.values = index, values

    def lookup(self, ids: list[str], train: bool = False) -> np.ndarray:
        return np.fromiter(map(self.index.get, ids, itertools.repeat(DEFAULT_ROW)), np.int64, len(ids))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        return self.values[rows]


class Breaker:
    """After a failed read, the store is not asked again for `retry_after_s` (shared by a worker's versions)."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s, self.open_until = retry_after_s, 0.0

    @property
    def open(self) -> bool:
        return time.monotonic() < self.open_until

    def trip(self) -> None:
        self.open_until = time.monotonic() + self.retry_after_s


class TieredTables:
    """The sparse tables of one served version: its lineage in the store, its cache in this worker."""

    def __init__(self, store: EmbeddingStore, lineage: list[VersionInfo], cache: RowCache, breaker: Breaker) -> None:
        self.store, self.lineage, self.cache, self.breaker = store, lineage, cache, breaker
        self.dim = lineage[0].dim

    def tables_for(self, wanted: dict[str, list[str]]) -> dict[str, BatchTable]:
        """Each table's rows of `wanted` ids: the cache's, and the misses of every table in one read."""
        found, missing = {}, {}
        for table, ids in wanted.items():
            found[table], idx = self.cache.get_many(table, ids)
            if idx:
                missing[table] = idx
        hits = sum(len(ids) for ids in wanted.values()) - sum(map(len, missing.values()))
        metrics.SPARSE_ROWS.labels("cache").inc(hits)
        if missing:
            self._read(wanted, found, missing)
        out = {}
        for table, ids in wanted.items():
            values = np.zeros((len(ids) + 1, self.dim), np.float32)  # row 0: the default
            for i, row in enumerate(found[table]):
                if row is not None:
                    values[i + 1] = row
            out[table] = BatchTable({id_: i + 1 for i, id_ in enumerate(ids)}, values)
        return out

    def _read(self, wanted: dict[str, list[str]], found: dict, missing: dict[str, list[int]]) -> None:
        count = sum(map(len, missing.values()))
        if self.breaker.open:
            metrics.SPARSE_ROWS.labels("default").inc(count)
            return
        asked = {table: [wanted[table][i] for i in idx] for table, idx in missing.items()}
        started = time.perf_counter()
        try:
            answers = self.store.fetch(self.lineage, asked)
        except (redis.RedisError, OSError) as exc:
            self.breaker.trip()
            metrics.SPARSE_ROWS.labels("default").inc(count)
            metrics.SPARSE_READ_ERRORS.inc()
            log.warning("embedding store read failed (%s: %s): %d rows scored with the default row; asking "
                        "again in %.1fs", type(exc).__name__, exc, count, self.breaker.retry_after_s)
            return
        metrics.SPARSE_READ_SECONDS.observe(time.perf_counter() - started)
        metrics.SPARSE_ROWS.labels("store").inc(count)
        for table, idx in missing.items():
            rows = [np.frombuffer(raw, "<f4") if raw else None for raw in answers[table]]
            for i, row in zip(idx, rows):
                found[table][i] = row
            self.cache.put_many(table, asked[table], rows)


class DeltaListener:
    """Builds the caches of announced versions from the caches of their parents (see the module's doc)."""

    def __init__(self, s: Settings, caches: dict[str, RowCache]) -> None:
        self.s, self.caches = s, caches  # version -> cache: the follower's, shared
        self.prepared: dict[str, RowCache] = {}  # complete: every part applied
        self._building: dict[str, tuple[RowCache, set[int]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sparse-deltas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def take(self, version: str) -> RowCache | None:
        return self.prepared.pop(version, None)

    def _run(self) -> None:
        # Every worker reads every part: the topic's partitions assigned from their ends, no group to join
        # (a join takes seconds, and messages sent meanwhile would be skipped).
        consumer = confluent_kafka.Consumer(self.s.kafka.client_options("librdkafka") | {
            "group.id": f"sparse-deltas-{socket.gethostname()}-{os.getpid()}", "enable.auto.commit": False,
            "fetch.wait.max.ms": 50, "fetch.max.bytes": 16 << 20})
        try:
            while not self._stop.is_set():
                try:
                    topic = self.s.sparse_tier.deltas_topic
                    partitions = consumer.list_topics(topic, timeout=5).topics[topic].partitions
                    if partitions:
                        consumer.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_END)
                                         for p in partitions])
                        break
                except confluent_kafka.KafkaException as exc:
                    log.warning("deltas topic not read yet (%s); trying again", exc)
                self._stop.wait(2)
            while not self._stop.is_set():
                message = consumer.poll(0.5)
                if message is None or message.error():
                    continue
                try:
                    self.apply(msgspec.msgpack.decode(message.value(), type=DeltaPart))
                except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                    log.exception("delta message not applied")
        finally:
            consumer.close()

    def apply(self, part: DeltaPart) -> None:
        if part.model != self.s.models.name:
            return
        building = self._building.get(part.version)
        if building is None:
            parent = self.caches.get(part.parent)
            if parent is None:
                if part.part == 0:
                    log.info("delta of v%s ignored: this worker does not hold its parent v%s (the version will be "
                             "read from the store at its swap)", part.version, part.parent)
                return
            building = self._building[part.version] = (parent.copy(), set())
        cache, seen = building
        values = np.frombuffer(part.rows, "<f4").reshape(-1, part.dim) if part.ids else np.zeros((0, part.dim))
        cache.replace(part.table, part.ids, list(values))
        cache.replace(part.table, part.removed, [None] * len(part.removed))
        seen.add(part.part)
        if len(seen) == part.parts:
            del self._building[part.version]
            self.prepared[part.version] = cache
            for old in list(self.prepared)[:-4]:  # versions announced and never served
                del self.prepared[old]
            metrics.SPARSE_DELTA_APPLIED.set(float(part.version))
            metrics.SPARSE_DELTA_SECONDS.observe(max(0.0, time.time() - part.announced_ms / 1000))
            log.info("delta of v%s applied to the hot rows of v%s (%d rows cached)", part.version, part.parent,
                     len(cache))
