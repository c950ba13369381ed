"""Registering a version's sparse tables in the embedding store (`[sparse_tier]`), and announcing its delta.

At registration a full version writes every row, an incremental one only the rows it changed (its delta
export), each with its training state; the store then drops the versions no alias or recent version needs.
An incremental run continues a version from the store (`pull`): its dense weights and only the rows its
window touches. The delta's rows are
announced on `sparse_tier.deltas_topic` in parts of `delta_part_rows` while Redis takes them: every
serving worker holding the parent builds its cache of hot rows for the new version before any alias
names it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import confluent_kafka
import msgspec
import numpy as np

from contract.examples import PAD, Examples
from infra.redis_clients import embedding_store
from infra.settings import RegisteredModel, Settings
from models.ctr import TABLES, CtrModel, ModelSpec, load_snapshot
from models.embedding_store import EmbeddingStore, MissingVersion, StoreFull, TableRows, TableState, VersionInfo
from models.sparse import SparseTable
from streaming.producer import PRODUCER_OPTIONS
from streaming.topics import ensure_topics

log = logging.getLogger(__name__)
__all__ = ["DeltaPart", "MissingVersion", "StoreFull", "announce", "publish", "pull", "store", "write"]


class DeltaPart(msgspec.Struct, frozen=True):
    """One message of a version's delta: rows of one table (`rows`: the ids' float32 rows, concatenated)."""

    model: str
    version: str
    parent: str
    table: str
    part: int
    parts: int
    dim: int
    ids: list[str]
    rows: bytes
    removed: list[str]
    announced_ms: int


def store(s: Settings, model: RegisteredModel | None = None, **options: object) -> EmbeddingStore:
    """The embedding store's view of `model`'s versions (the ranker by default)."""
    client = embedding_store(s, **options)
    return EmbeddingStore(client, (model or s.ranker).name, s.sparse_tier.key_prefix, s.sparse_tier.max_lineage)


def export_rows(directory: Path) -> dict[str, TableRows]:
    out = {}
    for name in TABLES:
        path = directory / f"sparse-{name}.npz"
        if path.exists():
            snap = load_snapshot(path)
            out[name] = TableRows(snap.ids, snap.values, snap.removed, TableState(
                snap.accumulators, snap.last_seen, snap.pending_ids, snap.pending_counts, snap.version))
    return out


def pull(s: Settings, version: str, ex: Examples, model: RegisteredModel | None = None) -> CtrModel | None:
    """`version` continued from the embedding store: its dense weights and the rows `ex` touches, with their
    training state; nothing else is read. Training on `ex` then changes what training the whole version on it
    would. None (with the reason logged) where the store cannot give it: the version or its training state is
    not there, its lineage is at `max_lineage` (the next version is written whole, which needs every row), or
    its spec evicts rows (eviction sweeps every row)."""
    emb = store(s, model)
    try:
        lineage = emb.lineage(version)
        if lineage[0].depth + 1 >= emb.max_lineage:
            raise MissingVersion(f"v{version}'s lineage is at max_lineage ({emb.max_lineage}): the next version "
                                 "is written whole")
        spec, dense = emb.model_of(version)
        if ModelSpec.from_json(spec).sparse.evict_after_steps:
            raise MissingVersion("its spec evicts rows, which sweeps every row")
        model = CtrModel.from_parts(spec, dense)
        wanted = model.table_ids(ex)
        for table, ids in (("user", ex.user_ids), ("item", ex.item_ids), ("category", ex.categories)):
            if (ids == PAD).any():  # training counts an empty id as any other; scoring's ids leave it out
                wanted[table].append(PAD)
        snaps = emb.pull(lineage, wanted)
    except MissingVersion as exc:
        log.info("embedding store: v%s not continued from the store (%s)", version, exc)
        return None
    log.info("embedding store: v%s continued from the store with %s rows", version,
             ", ".join(f"{len(snap.ids)} {name}" for name, snap in snaps.items()))
    return model.with_tables({name: SparseTable.restore(name, model.spec.sparse, snap) for name, snap in snaps.items()})


def publish(s: Settings, version: str, parent: str, export_dir: Path, delta_dir: Path | None,
            keep: set[str], model: RegisteredModel | None = None) -> VersionInfo:
    """Write the version's tables (its delta when it has one and the store holds its parent) and compact the
    store to the lineages of `keep` and this version; announce the delta. Raises StoreFull when Redis
    refuses the rows."""
    spec = (export_dir / "spec.json").read_text()
    emb = store(s, model)
    started = time.perf_counter()

    def full() -> dict[str, TableRows]:
        if (export_dir / "delta-of.json").exists():  # trained from the store: the registry has its parent's rows
            raise MissingVersion(f"v{version} is a delta of v{parent}, which the store no longer continues")
        return export_rows(export_dir)

    info = write(s, emb, version, parent, ModelSpec.from_json(spec).sparse.dim, spec,
                 (export_dir / "dense.weights.h5").read_bytes(),
                 delta=lambda: export_rows(delta_dir) if delta_dir else {}, full=full)
    log.info("embedding store: v%s written as %s in %.1fs", version,
             f"a delta of v{parent}" if info.parent else "a full version", time.perf_counter() - started)
    emb.compact(keep | {version})
    return info


def write(s: Settings, emb: EmbeddingStore, version: str, parent: str, dim: int, spec: str, dense: bytes,
          delta: Callable[[], dict[str, TableRows]], full: Callable[[], dict[str, TableRows]]) -> VersionInfo:
    """`EmbeddingStore.write`, a delta announced while Redis takes its rows: the workers build the version's
    cache meanwhile, which no alias names before the write ends. A version the store then refuses is never
    swapped in: its cache, built for nothing, is dropped with the versions never served."""
    with ThreadPoolExecutor(1, thread_name_prefix="announce") as pool:
        sent: list[Future[int]] = []

        def send(planned: VersionInfo, rows: dict[str, TableRows]) -> None:
            if rows:
                sent.append(pool.submit(announce, s, planned, rows, emb.model))

        info = emb.write(version, parent, dim, spec, dense, delta=delta, full=full, on_delta=send)
        for future in sent:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - Kafka away: the version stands, its rows in the store
                log.warning("embedding store: v%s's delta not announced (%s); workers read its rows from the store",
                            version, exc)
    return info


def announce(s: Settings, info: VersionInfo, tables: dict[str, TableRows], model: str | None = None) -> int:
    """Send the delta's rows of `model`'s version (the ranker's by default) to every serving worker; returns the
    messages sent. Best effort: a worker that misses it reads the rows from the store (its cache of the version
    starts empty)."""
    size = s.sparse_tier.delta_part_rows
    ensure_topics(s, [s.sparse_tier.deltas_topic])
    parts = [(name, a) for name, rows in tables.items() for a in range(0, max(len(rows.ids), 1), size)]
    producer = confluent_kafka.Producer(s.kafka.client_options("librdkafka", "trainer") | PRODUCER_OPTIONS |
                                        {"compression.type": "lz4", "linger.ms": 20})
    now = int(time.time() * 1000)
    for n, (name, a) in enumerate(parts):
        rows = tables[name]
        ids = rows.ids[a:a + size]
        body = DeltaPart(model or s.ranker.name, info.version, info.parent, name, n, len(parts), info.dim,
                         ids.astype(str).tolist(), np.ascontiguousarray(rows.values[a:a + size], "<f4").tobytes(),
                         rows.removed.astype(str).tolist() if a == 0 else [], now)
        while True:
            try:
                producer.produce(s.sparse_tier.deltas_topic, msgspec.msgpack.encode(body), key=info.version)
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.1)
    left = producer.flush(30)
    if left:
        log.warning("embedding store: %d of %d parts of v%s's delta not delivered; workers read those rows "
                    "from the store", left, len(parts), info.version)
    return len(parts) - left

