"""A served version's sparse tables read from the embedding store through the worker's cache of hot rows.

Per batch, the ids of every table (`CtrModel.table_ids`) are looked up in the version's cache; the misses
of all tables are read in one pipelined round trip (models/embedding_store.py), bounded by
`sparse_tier.timeout_ms`: sent before the batch's own lookups, its reply taken by the first gather. A read
that fails or times out scores its ids with the default row, counts them
(`flywheel_sparse_rows{outcome="default"}`) and, for `retry_after_s`, sends the next batches straight to
the defaults instead of waiting on a store that is down: never a 500. Default rows taken for a failure are
not cached, so the next read once the store answers gets the real ones.

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
from collections.abc import Callable

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
    """One version's hot rows in a worker: per table, id -> slot of one [capacity, dim] float32 array; slots
    reused by CLOCK (second chance: a hit sets its slot's bit, one numpy store per batch). No Python object
    per row and no per-id move, as an OrderedDict LRU of (table, id) -> row had (the same time per batch,
    measured: docs/benchmarks.md; a 16-dim row costs its 64 bytes and an index entry)."""

    def __init__(self, capacity: int, dim: int) -> None:
        self.capacity, self.dim = capacity, dim
        self.values = np.zeros((capacity, dim), np.float32)
        self.real = np.zeros(capacity, bool)  # False: the id has no row (it scores with the default row)
        self.used = np.zeros(capacity, bool)  # CLOCK's reference bits
        self.owner = np.empty(capacity, object)  # slot -> its id
        self.table_of = np.zeros(capacity, np.int16)  # slot -> its table's position in `tables`
        self.tables: list[str] = []
        self.index: dict[str, dict[str, int]] = {}  # table -> id -> slot
        self.filled = self.hand = 0
        self._lock = threading.Lock()  # the batch executors and the delta listener

    def __len__(self) -> int:
        return self.filled

    def _slots(self, table: str, ids: list[str]) -> np.ndarray:
        return np.fromiter(map(self.index.get(table, {}).get, ids, itertools.repeat(-1)), np.int64, len(ids))

    def get_many(self, table: str, ids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cached rows of `ids`: values [n, dim] (zeros where not cached or default), `cached` [n] and
        `real` [n] (cached with a row of its own) masks."""
        with self._lock:
            slots = self._slots(table, ids)
            cached = slots >= 0
            held = slots[cached]
            self.used[held] = True
            values = np.zeros((len(ids), self.dim), np.float32)
            values[cached] = self.values[held]
            real = np.zeros(len(ids), bool)
            real[cached] = self.real[held]
        return values, cached, real

    def put_many(self, table: str, ids: list[str], values: np.ndarray, real: np.ndarray) -> None:
        """Cache rows of `ids` (values [n, dim]; `real` False: the id has no row), replacing held ones."""
        with self._lock:
            if table not in self.index:
                self.index[table] = {}
                self.tables.append(table)
            slots = self._slots(table, ids)
            held = slots >= 0
            self._write(slots[held], values[held], real[held])
            new = np.flatnonzero(~held)[-self.capacity:]  # past capacity: the last ones
            fresh = self._take(len(new))  # may evict a held one just written: its slot is then a new id's
            index = self.index[table]
            for n, slot in zip(new.tolist(), fresh.tolist()):
                index[ids[n]] = slot
                self.owner[slot] = ids[n]
            self.table_of[fresh] = self.tables.index(table)
            self._write(fresh, values[new], real[new])

    def _write(self, slots: np.ndarray, values: np.ndarray, real: np.ndarray) -> None:
        self.values[slots], self.real[slots], self.used[slots] = values, real, True

    def _take(self, n: int) -> np.ndarray:
        """`n` free slots: unused ones first, then those CLOCK's hand finds unreferenced since it last
        passed (their ids evicted)."""
        fresh = np.arange(self.filled, min(self.capacity, self.filled + n))
        self.filled += len(fresh)
        taken, need = [fresh], n - len(fresh)
        while need > 0:
            span = (self.hand + np.arange(min(self.capacity, max(4 * need, 4096)))) % self.capacity
            idle = np.flatnonzero(~self.used[span])
            if len(idle) >= need:
                passed = idle[need - 1] + 1
                chosen = span[idle[:need]]
            else:
                passed, chosen = len(span), span[idle]
            self.used[span[:passed]] = False
            self.used[chosen] = True  # not taken twice
            self.hand = int(span[passed - 1] + 1) % self.capacity
            for slot, code in zip(chosen.tolist(), self.table_of[chosen].tolist()):
                self.index[self.tables[code]].pop(self.owner[slot], None)
            taken.append(chosen)
            need -= len(chosen)
        return np.concatenate(taken)

    def replace(self, table: str, ids: list[str], values: np.ndarray, real: np.ndarray) -> int:
        """Replace the rows of the ids this cache holds (a delta); returns how many it held."""
        with self._lock:
            slots = self._slots(table, ids)
            held = slots >= 0
            self.values[slots[held]], self.real[slots[held]] = values[held], real[held]
        return int(held.sum())

    def copy(self) -> RowCache:
        twin = RowCache.__new__(RowCache)
        with self._lock:
            twin.__dict__.update({k: v.copy() if hasattr(v, "copy") else v for k, v in self.__dict__.items()
                                  if k not in ("_lock", "index")})
            twin.index = {table: ids.copy() for table, ids in self.index.items()}
        twin._lock = threading.Lock()
        return twin


class BatchTable:
    """A batch's rows of one table, answering `SparseTable.lookup`/`gather` for `CtrModel.scoring_inputs`.
    Rows read from the store land by the first `gather` (`settle`): the lookups run while Redis works."""

    def __init__(self, index: dict[str, int], values: np.ndarray, settle: Callable[[], None]) -> None:
        self.index, self.values, self.settle = index, values, settle

    def lookup(self, ids: list[str], train: bool = False) -> np.ndarray:
        return np.fromiter(map(self.index.get, ids, itertools.repeat(DEFAULT_ROW)), np.int64, len(ids))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        self.settle()
        return self.values[rows]


def settle(tables: dict[str, BatchTable]) -> None:
    """Take the store's reply for `tables` if no `gather` did (its connection back to the pool)."""
    for table in tables.values():
        table.settle()


def _settled() -> None:
    pass


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
        """Each table's rows of `wanted` ids: the cache's now, the misses of every table in one read whose
        reply the first `gather` takes (`settle` takes it when none did)."""
        values, missing = {}, {}  # table -> its rows [1 + n, dim] (row 0: the default); indices not cached
        for table, ids in wanted.items():
            cached_rows, cached, _ = self.cache.get_many(table, ids)
            values[table] = np.zeros((len(ids) + 1, self.dim), np.float32)
            values[table][1:] = cached_rows
            if not cached.all():
                missing[table] = np.flatnonzero(~cached)
        hits = sum(len(ids) for ids in wanted.values()) - sum(map(len, missing.values()))
        metrics.SPARSE_ROWS.labels("cache").inc(hits)
        done = self._read(wanted, values, missing) if missing else _settled
        return {table: BatchTable({id_: i + 1 for i, id_ in enumerate(ids)}, values[table], done)
                for table, ids in wanted.items()}

    def _read(self, wanted: dict[str, list[str]], values: dict[str, np.ndarray], missing: dict[str, np.ndarray]
              ) -> Callable[[], None]:
        """Send the read of the `missing` rows; the function returned takes its reply into `values` (once)."""
        count = sum(map(len, missing.values()))
        if self.breaker.open:
            metrics.SPARSE_ROWS.labels("default").inc(count)
            return _settled
        asked = {table: [wanted[table][i] for i in idx.tolist()] for table, idx in missing.items()}
        started = time.perf_counter()
        try:
            reply = self.store.fetch_later(self.lineage, asked)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc, count)
            return _settled
        sent = time.perf_counter() - started
        pending = [reply]

        def take() -> None:
            if not pending:
                return
            started = time.perf_counter()
            try:
                answers = pending.pop()()
            except (redis.RedisError, OSError) as exc:
                self._failed(exc, count)
                return
            # what the batch spent on the store: sending, and the wait its lookups did not cover
            metrics.SPARSE_READ_SECONDS.observe(sent + time.perf_counter() - started)
            metrics.SPARSE_ROWS.labels("store").inc(count)
            for table, idx in missing.items():
                raw = answers[table]
                real = np.fromiter(map(bool, raw), bool, len(raw))
                rows = np.zeros((len(raw), self.dim), np.float32)
                if real.any():
                    rows[real] = np.frombuffer(b"".join(r for r in raw if r), "<f4").reshape(-1, self.dim)
                values[table][1 + idx] = rows
                self.cache.put_many(table, asked[table], rows, real)
        return take

    def _failed(self, exc: Exception, count: int) -> None:
        self.breaker.trip()
        metrics.SPARSE_ROWS.labels("default").inc(count)
        metrics.SPARSE_READ_ERRORS.inc()
        log.warning("embedding store read failed (%s: %s): %d rows scored with the default row; asking "
                    "again in %.1fs", type(exc).__name__, exc, count, self.breaker.retry_after_s)


class DeltaListener:
    """Builds the caches of announced versions from the caches of their parents (see the module's doc)."""

    def __init__(self, s: Settings, caches: dict[str, RowCache], model: str | None = None) -> None:
        self.s, self.caches = s, caches  # version -> cache: the follower's, shared
        self.model = model or s.ranker.name  # the registered model whose deltas it applies
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
        consumer = confluent_kafka.Consumer(self.s.kafka.client_options("librdkafka", "serving") | {
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
        if part.model != self.model:
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
        cache.replace(part.table, part.ids, values, np.ones(len(part.ids), bool))
        cache.replace(part.table, part.removed, np.zeros((len(part.removed), part.dim), np.float32),
                      np.zeros(len(part.removed), bool))
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
