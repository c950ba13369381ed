"""The sparse tier on a real Redis: a version's rows in the embedding store serve the same scores as the
in-memory model; an incremental version writes only its delta and a rollback reads the parent's rows
exactly; an incremental run continued from the store pulls only its window's rows and changes exactly
what the whole parent's would; compaction keeps what a lineage needs; bad rows and a full Redis are
refused; a store that does not answer gives default rows, counted, never an error; a delta updates a
worker's hot rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import redis
import tensorflow as tf

from infra.redis_clients import online_store
from infra.settings import Settings, override
from models.ctr import TABLES, CtrModel, load_snapshot
from models.embedding_store import EmbeddingStore, MissingVersion, StoreFull, TableRows
from models.sparse_tier import DeltaPart, export_rows, publish, pull, store
from serving import metrics
from serving.dense import DenseRunner
from serving.sparse_tier import Breaker, DeltaListener, RowCache, TieredTables, settle
from tests.ctr_data import SPEC, synthetic

pytestmark = pytest.mark.stack
# Evicting rows not seen for 30 steps: the delta then holds evictions as well as changed and new rows.
TIER_SPEC = dataclasses.replace(SPEC, sparse=dataclasses.replace(SPEC.sparse, evict_after_steps=30))


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[CtrModel, CtrModel, Path, Path, Path]:
    """A trained full version (export) and its continuation (export and delta)."""
    tmp = tmp_path_factory.mktemp("tier")
    model = CtrModel(TIER_SPEC)
    model.fit(synthetic(3000, seed=1, users=300, items=800, long_history=True), progress=False)
    parent = CtrModel.load(model.save(tmp / "v1"))
    since = model.versions()
    model.fit(synthetic(1500, seed=2, long_history=True), progress=False)  # fewer ids: a part changes
    model.save_delta(tmp / "v2-delta", since)
    child = CtrModel.load(model.save(tmp / "v2"))
    return parent, child, tmp / "v1", tmp / "v2", tmp / "v2-delta"


def _write(emb: EmbeddingStore, version: str, parent: str, export: Path, delta: Path | None = None) -> object:
    return emb.write(version, parent, TIER_SPEC.sparse.dim, (export / "spec.json").read_text(),
                     (export / "dense.weights.h5").read_bytes(), delta=lambda: export_rows(delta) if delta else {},
                     full=lambda: export_rows(export))


def _store(s: Settings, prefix: str, **options: object) -> EmbeddingStore:
    return EmbeddingStore(online_store(s, **options), "ctr", prefix)


def _scores(model: CtrModel, inputs: dict[str, np.ndarray]) -> np.ndarray:
    runner = DenseRunner(model, (64, 512), (10,))
    return runner.run([tf.constant(w) for w in model.dense_weights()], inputs)


def test_a_version_in_the_store_serves_the_in_memory_models_scores(redis_stack: Settings, versions) -> None:
    parent, child, v1, v2, delta = versions
    emb = _store(redis_stack, "t1")
    full = _write(emb, "1", "", v1)
    written = _write(emb, "2", "1", v2, delta)
    assert (full.depth, written.depth, written.parent) == (0, 1, "1")
    # The incremental version wrote only its changed rows (and evictions), in the parent's buckets.
    changed = sum(len(r.ids) + len(r.removed) for r in export_rows(delta).values())
    stored = sum(emb.client.hlen(k) for k in emb.client.scan_iter(match="t1:ctr:2:*")
                 if not k.endswith(b":meta") and b"~" not in k)  # the rows, not their training state
    assert stored == changed < sum(len(t) for t in child.tables.values())
    assert any(len(r.removed) for r in export_rows(delta).values()), "the test's delta should evict rows"
    ex = synthetic(400, seed=9, users=400, items=1000, long_history=True)  # ids known, unknown and evicted
    # A worker's reads on a pool of one connection: each batch gives it back, also one whose rows no
    # gather took (its scoring failed first), else the next read has none.
    reader = _store(redis_stack, "t1", max_connections=1)
    unread = TieredTables(reader, reader.lineage("2"), RowCache(10_000, child.spec.sparse.dim), Breaker(1.0))
    tables = unread.tables_for(child.table_ids(ex))
    settle(tables)
    assert np.any(tables["item"].values) and not unread.breaker.open
    for version, model in (("2", child), ("1", parent)):  # v1 after v2: a rollback reads v1's rows exactly
        tiered = TieredTables(reader, reader.lineage(version), RowCache(10_000, model.spec.sparse.dim), Breaker(1.0))
        served = model.with_tables(tiered.tables_for(model.table_ids(ex))).scoring_inputs(ex)
        expected = model.scoring_inputs(ex)
        for name, value in expected.items():
            np.testing.assert_array_equal(served[name], value, err_msg=f"v{version} {name}")
        np.testing.assert_array_equal(_scores(model, served), _scores(model, expected))
        # Second time from the worker's cache: the same rows, and no read.
        before = metrics.SPARSE_ROWS.labels("store")._value.get()
        again = model.with_tables(tiered.tables_for(model.table_ids(ex))).scoring_inputs(ex)
        np.testing.assert_array_equal(again["item"], expected["item"])
        assert metrics.SPARSE_ROWS.labels("store")._value.get() == before
    # A Redis Cluster's reads (a pipeline: the buckets are on many nodes) answer as the server's script does.
    wanted = child.table_ids(ex)
    assert emb._fetch_pipelined(emb.lineage("2"), wanted) == emb.fetch(emb.lineage("2"), wanted)
    # The dense weights and spec travel with the version: the tiered model is the in-memory one.
    rebuilt = CtrModel.from_parts(*emb.model_of("2"))
    assert rebuilt.spec == child.spec
    for a, b in zip(rebuilt.dense_weights(), child.dense_weights()):
        np.testing.assert_array_equal(a, b)


def test_an_incremental_run_from_the_store_changes_what_one_from_the_whole_parent_does(redis_stack: Settings,
                                                                                       tmp_path: Path) -> None:
    """Continued from the store, a run reads only the rows its window touches, with their accumulators, steps and
    admission counters; trained on the window, it changes exactly the rows, state and dense weights the whole
    parent trained on it does. Its delta is the next version in the store, which a later run continues."""
    s = override(redis_stack, "sparse_tier", key_prefix="t-pull")
    model = CtrModel(SPEC)  # no eviction: a run continued from the store never sweeps every row
    model.fit(synthetic(3000, seed=1, users=300, items=800, long_history=True), progress=False)
    publish(s, "1", "", model.save(tmp_path / "v1"), None, keep=set())
    window = synthetic(400, seed=5, users=300, items=800, long_history=True)
    whole, pulled = CtrModel.load(tmp_path / "v1"), pull(s, "1", window)
    assert pulled is not None and pulled.versions() == whole.versions()
    for name in TABLES:
        assert len(pulled.tables[name]) <= len(whole.tables[name])
    assert 0 < len(pulled.tables["item"]) < len(whole.tables["item"]) / 2
    assert pulled.tables["item"].pending, "ids seen once in v1 come with their admission counters"
    np.testing.assert_array_equal(pulled.predict(window), whole.predict(window))
    since = whole.versions()
    for continued, out in ((whole, "whole"), (pulled, "pulled")):
        continued.fit(window, progress=False)
        continued.save_delta(tmp_path / out, since)
    for name in TABLES:
        a, b = (load_snapshot(tmp_path / out / f"sparse-{name}.npz") for out in ("whole", "pulled"))
        assert len(a.ids) and a.equals(b), name
    for a, b in zip(whole.dense_weights(), pulled.dense_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pulled.predict(window), whole.predict(window))  # the gate's scores: the window's
    later = synthetic(400, seed=6, users=300, items=800, long_history=True)
    # The pulled run's delta as v2 (its export is the delta): a run continued from v2 reads v2's rows.
    assert publish(s, "2", "1", tmp_path / "pulled", tmp_path / "pulled", keep=set()).parent == "1"
    again = pull(s, "2", later)
    assert again is not None and again.versions() == whole.versions()
    for name in TABLES:
        got, full = again.tables[name].snapshot(), whole.tables[name].snapshot()
        at = {id_: n for n, id_ in enumerate(full.ids)}
        rows = [at[id_] for id_ in got.ids]
        for part in ("values", "accumulators", "last_seen"):
            np.testing.assert_array_equal(getattr(got, part), getattr(full, part)[rows], err_msg=f"{name} {part}")
        counts = dict(zip(full.pending_ids, full.pending_counts))
        assert all(counts[i] == c for i, c in zip(got.pending_ids, got.pending_counts)), name
    # Past max_lineage the next version is written whole, which needs every row: no pull.
    assert pull(override(s, "sparse_tier", max_lineage=2), "2", later) is None


def test_rows_are_packed_close_to_their_bytes(redis_stack: Settings, versions) -> None:
    emb = _store(redis_stack, "t2")
    _write(emb, "1", "", versions[2])
    keys = [k for k in emb.client.scan_iter(match="t2:ctr:1:item:*")]
    assert {emb.client.object("encoding", k) for k in keys} == {b"listpack"}
    rows = sum(emb.client.hlen(k) for k in keys)
    used = sum(emb.client.memory_usage(k, samples=0) for k in keys)
    # A row: 8 float32 (32 bytes) and an id of ~4 characters, plus listpack's few bytes and each key's share.
    assert used / rows < 32 + 4 + 16


def test_compaction_keeps_what_a_kept_lineage_needs(redis_stack: Settings, versions) -> None:
    _, _, v1, v2, delta = versions
    emb = _store(redis_stack, "t3")
    _write(emb, "1", "", v1)
    _write(emb, "2", "1", v2, delta)
    _write(emb, "3", "", v1)
    assert emb.compact({"2"}) == ["3"]  # v2 needs v1: both stay
    assert emb.versions() == ["1", "2"]
    assert emb.compact({"3"}) == ["1", "2"]
    assert emb.versions() == [] and not list(emb.client.scan_iter(match="t3:*"))
    with pytest.raises(MissingVersion):
        emb.lineage("2")


def test_a_delta_that_kafka_does_not_take_is_written_and_compacted_all_the_same(redis_stack: Settings,
                                                                                versions) -> None:
    """Kafka away as training publishes (no broker runs in this stack): the delta is not announced, and workers
    read its rows from the store; the version is written and the store compacted to what is kept."""
    _, _, v1, v2, delta = versions
    s = override(redis_stack, "sparse_tier", key_prefix="t-unannounced")
    publish(s, "1", "", v1, None, keep=set())
    assert publish(s, "2", "1", v2, delta, keep=set()).parent == "1"  # a delta: the one announced
    assert store(s).versions() == ["1", "2"]  # v2 needs v1
    publish(s, "3", "", v1, None, keep=set())
    assert store(s).versions() == ["3"]


def test_a_lineage_is_written_in_full_past_max_lineage(redis_stack: Settings, versions) -> None:
    _, _, v1, v2, delta = versions
    emb = _store(redis_stack, "t4")
    emb.max_lineage = 2
    _write(emb, "1", "", v1)
    assert _write(emb, "2", "1", v2, delta).depth == 1
    third = _write(emb, "3", "2", v2, delta)
    assert (third.depth, third.parent) == (0, "")


def test_rows_of_a_wrong_width_and_a_full_redis_are_refused(redis_stack: Settings, versions) -> None:
    _, _, v1, _, _ = versions
    emb = _store(redis_stack, "t5")
    empty = TableRows(np.array([], object), np.zeros((0, 8), np.float32), np.array([], object))
    assert emb.write_full("0", 8, "{}", b"", {"item": 0}, [("item", empty)]).buckets == {"item": 1}
    emb.delete("0")
    narrow = {"item": TableRows(np.array(["i1"], object), np.zeros((1, 4), np.float32), np.array([], object))}
    with pytest.raises(ValueError, match="8 wide"):
        emb.write("1", "", 8, "{}", b"", delta=dict, full=lambda: narrow)
    used = int(emb.client.info("memory")["used_memory"])
    emb.client.config_set("maxmemory", str(used + 20_000))
    try:
        with pytest.raises(StoreFull, match="maxmemory"):
            _write(emb, "2", "", v1)
    finally:
        emb.client.config_set("maxmemory", "0")
    assert emb.versions() == [] and not list(emb.client.scan_iter(match="t5:*"))


def test_a_store_that_does_not_answer_gives_default_rows_counted(redis_stack: Settings, versions) -> None:
    parent, _, v1, _, _ = versions
    emb = _store(redis_stack, "t6")
    _write(emb, "1", "", v1)
    lineage = emb.lineage("1")
    dead = EmbeddingStore(redis.Redis(port=1, socket_timeout=0.05, socket_connect_timeout=0.05), "ctr", "t6")
    breaker = Breaker(60.0)
    tiered = TieredTables(dead, lineage, RowCache(1000, parent.spec.sparse.dim), breaker)
    ex = synthetic(50, seed=4, long_history=True)
    before = metrics.SPARSE_ROWS.labels("default")._value.get()
    tables = tiered.tables_for(parent.table_ids(ex))
    assert breaker.open and not np.any(tables["item"].values)  # every row the default
    assert metrics.SPARSE_ROWS.labels("default")._value.get() - before == sum(map(len, parent.table_ids(ex).values()))
    assert len(tiered.cache) == 0  # defaults taken for a failure are not kept
    # Back: the same cache gets the real rows once the breaker lets the store be asked again.
    tiered.store, breaker.open_until = emb, 0.0
    inputs = parent.with_tables(tiered.tables_for(parent.table_ids(ex))).scoring_inputs(ex)
    np.testing.assert_array_equal(inputs["item"], parent.scoring_inputs(ex)["item"])


def test_a_delta_replaces_the_hot_rows_of_the_parents_cache(versions) -> None:
    parent, child, _, _, delta = versions
    s = Settings()
    caches = {"1": RowCache(100_000, parent.spec.sparse.dim)}
    ids = list(parent.tables["item"].index)
    caches["1"].put_many("item", ids, parent.tables["item"].values[parent.tables["item"].lookup(ids)],
                         np.ones(len(ids), bool))
    listener = DeltaListener(s, caches)
    rows = export_rows(delta)["item"]
    half = len(rows.ids) // 2
    for n, (a, b) in enumerate(((0, half), (half, len(rows.ids)))):
        assert "2" not in listener.prepared  # not before every part is applied
        listener.apply(DeltaPart(s.models.name, "2", "1", "item", n, 2, 8, rows.ids[a:b].astype(str).tolist(),
                                 rows.values[a:b].astype("<f4").tobytes(),
                                 rows.removed.astype(str).tolist() if n == 0 else [], 0))
    cache = listener.take("2")
    table = child.tables["item"]
    values, cached, real = cache.get_many("item", ids)
    assert cached.all()  # every row the parent's cache held, now the child's (evicted: the default row)
    for id_, row, has_row in zip(ids, values, real):
        if id_ in table.index:
            assert has_row
            np.testing.assert_array_equal(row, table.values[table.index[id_]])
        else:
            assert not has_row and not row.any()
    assert caches["1"].get_many("item", ids[:1])[2].all()  # the parent's own cache unchanged
    listener.apply(DeltaPart(s.models.name, "9", "8", "item", 0, 1, 8, [], b"", [], 0))  # parent not held
    assert listener.take("9") is None


def test_cache_is_bounded_and_evicts_rows_not_read_since_the_hand_passed() -> None:
    """CLOCK: at capacity, a new row takes the slot of one not read since the hand last passed it; a row
    read meanwhile stays; rows keep their values and tables (the same id in two tables is two rows)."""
    cache = RowCache(3, 2)
    cache.put_many("item", ["a", "b", "c"], np.arange(6, dtype=np.float32).reshape(3, 2), np.ones(3, bool))
    cache.put_many("item", ["d"], np.full((1, 2), 9, np.float32), np.zeros(1, bool))  # every bit set: one sweep
    held = {t: set(ids) for t, ids in cache.index.items()}
    assert len(cache) == 3 and held["item"] == {"b", "c", "d"}, held  # the hand's first slot, "a"
    cache.get_many("item", ["b"])  # read: kept past the next sweep
    cache.put_many("user", ["a"], np.full((1, 2), 7, np.float32), np.ones(1, bool))
    assert {t: set(ids) for t, ids in cache.index.items()} == {"item": {"b", "d"}, "user": {"a"}}
    values, cached, real = cache.get_many("item", ["b", "d", "a"])
    assert cached.tolist() == [True, True, False] and real.tolist() == [True, False, False]
    np.testing.assert_array_equal(values, [[2, 3], [9, 9], [0, 0]])  # "d" has no row: the default (zeros)
    np.testing.assert_array_equal(cache.get_many("user", ["a"])[0], [[7, 7]])
    many = [f"x{i}" for i in range(10)]  # more than it holds: the last ones
    cache.put_many("item", many, np.ones((10, 2), np.float32), np.ones(10, bool))
    assert set(cache.index["item"]) == set(many[-3:]) and not cache.index["user"]
