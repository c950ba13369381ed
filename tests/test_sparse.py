"""The sparse embedding table: raw-id rows, frequency admission, eviction, per-row Adagrad, and the
delta of an incremental export."""

from __future__ import annotations

import numpy as np

from models.sparse import DEFAULT_ROW, SparseConfig, SparseTable, apply_delta


def train(table: SparseTable, ids: list[str], seed: int = 0) -> np.ndarray:
    rows = table.lookup(ids, train=True)
    grads = np.random.default_rng(seed).normal(size=(len(ids), table.config.dim)).astype(np.float32)
    table.apply_gradients(rows, grads)
    return rows


def test_an_id_seen_often_enough_is_admitted_and_a_one_off_id_is_not() -> None:
    table = SparseTable("item", SparseConfig(dim=4, admit_after=3))
    for step in range(3):
        rows = train(table, ["popular", "rare"] if step == 0 else ["popular"], seed=step)
    assert rows[0] != DEFAULT_ROW and "popular" in table.index
    assert "rare" not in table.index and table.pending == {"rare": 1}
    assert np.array_equal(table.gather(table.lookup(["rare", "never-seen"])), np.zeros((2, 4), np.float32))
    # The default row is shared by every unknown id and never trained.
    assert not table.values[DEFAULT_ROW].any()


def test_rows_are_keyed_by_raw_id_without_collisions() -> None:
    table = SparseTable("user", SparseConfig(dim=4, admit_after=1))
    ids = [f"user-{i}" for i in range(5000)]
    rows = table.lookup(ids, train=True)
    assert len(set(rows.tolist())) == 5000 and len(table) == 5000
    assert table.lookup(["user-4321"])[0] == rows[4321]


def test_adagrad_sums_repeated_rows_and_touches_only_their_rows() -> None:
    config = SparseConfig(dim=2, admit_after=1, learning_rate=0.5, initial_accumulator=0.0)
    table = SparseTable("item", config)
    rows = table.lookup(["a", "b", "a"], train=True)
    before = table.values.copy()
    table.apply_gradients(rows, np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]], np.float32))
    a, b = rows[0], rows[1]
    # a: summed gradient (2, 0) -> accumulator (4, 0) -> step 0.5 * 2 / 2 = 0.5 on the first coordinate
    np.testing.assert_allclose(table.values[a], before[a] - [0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(table.values[b], before[b] - [0.0, 0.5], rtol=1e-6)


def test_delta_changes_only_touched_rows_and_reproduces_the_next_export() -> None:
    config = SparseConfig(dim=4, admit_after=2)
    table = SparseTable("item", config)
    history = [f"item-{i % 50}" for i in range(400)]
    for start in range(0, 400, 40):
        train(table, history[start:start + 40], seed=start)
    base = table.snapshot()

    # Incremental training from the export: new events touch a few old ids, admit a new one,
    # count a one-off one.
    warm = SparseTable.restore("item", config, base)
    assert warm.snapshot().equals(base)
    new_events = ["item-3", "item-7", "new-hit", "new-hit", "one-off"]
    train(warm, new_events, seed=99)
    after = warm.snapshot()

    delta = warm.delta(since=base.version)
    assert sorted(delta.ids.tolist()) == ["item-3", "item-7", "new-hit"]
    assert delta.pending_ids.tolist() == ["one-off"]
    untouched = [i for i in base.ids if i not in {"item-3", "item-7"}]
    base_rows = dict(zip(base.ids, base.values))
    after_rows = dict(zip(after.ids, after.values))
    assert all(np.array_equal(base_rows[i], after_rows[i]) for i in untouched)
    assert not any(np.array_equal(base_rows[i], after_rows[i]) for i in ("item-3", "item-7"))

    assert apply_delta(base, delta).equals(after)


def test_stale_rows_are_evicted_and_the_delta_removes_them() -> None:
    config = SparseConfig(dim=4, admit_after=1, evict_after_steps=3)
    table = SparseTable("item", config)
    train(table, ["old", "kept"])
    base = table.snapshot()
    for step in range(4):
        train(table, ["kept"], seed=step)
    assert "old" not in table.index and "kept" in table.index
    delta = table.delta(since=base.version)
    assert delta.removed.tolist() == ["old"]
    assert apply_delta(base, delta).equals(table.snapshot())
    # Its row is reused by the next new id, starting fresh.
    row = table.lookup(["newcomer"], train=True)[0]
    table.apply_gradients(np.array([row]), np.zeros((1, 4), np.float32))
    assert table.ids[row] == "newcomer"
