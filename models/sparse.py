"""The sparse half of the model: embedding rows keyed by raw id, on CPU, with their own optimizer.

No vocabulary and no hashing: any string id gets its own row once it has been seen `admit_after`
times in training (one-off ids share the default row 0, all zeros, never trained); rows not seen for
`evict_after_steps` steps are evicted. Each row has its own Adagrad accumulator, so a row's update
depends only on its own gradients. Every change is stamped with the step that made it, which gives
the delta of an incremental export: the rows (and admission counters) changed since a version.

At scale this table is what a parameter server shards by id: `lookup` is a pull, `apply_gradients`
a push, `delta` what each shard publishes to the serving replicas.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np

DEFAULT_ROW = 0


@dataclass(frozen=True)
class SparseConfig:
    dim: int = 16
    admit_after: int = 2  # times an id must be seen in training before it gets its own row
    evict_after_steps: int = 0  # 0 = never evict
    learning_rate: float = 0.1
    initial_accumulator: float = 0.1
    init_scale: float = 0.05


@dataclass
class TableSnapshot:
    """A table's state, rows sorted by id: what an export holds and a delta patches."""

    ids: np.ndarray  # [n] str
    values: np.ndarray  # [n, dim] float32
    accumulators: np.ndarray  # [n, dim] float32
    last_seen: np.ndarray  # [n] int64, step
    pending_ids: np.ndarray  # [m] str, ids seen but not admitted yet
    pending_counts: np.ndarray  # [m] int64
    version: int = 0
    removed: np.ndarray = field(default_factory=lambda: np.array([], dtype=object))  # deltas only: evicted ids

    def equals(self, other: TableSnapshot) -> bool:
        return (self.version == other.version and np.array_equal(self.ids, other.ids)
                and np.array_equal(self.values, other.values)
                and np.array_equal(self.accumulators, other.accumulators)
                and np.array_equal(self.last_seen, other.last_seen)
                and np.array_equal(self.pending_ids, other.pending_ids)
                and np.array_equal(self.pending_counts, other.pending_counts))


def _initial_row(id_: str, dim: int, scale: float) -> np.ndarray:
    """A deterministic random start for an id's row: the same id starts the same on every run."""
    seed = int.from_bytes(hashlib.blake2b(id_.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).normal(0.0, scale, dim).astype(np.float32)


class SparseTable:
    def __init__(self, name: str, config: SparseConfig = SparseConfig()) -> None:
        self.name, self.config = name, config
        self.step = 0  # one per apply_gradients; the table's version
        self.index: dict[str, int] = {}
        self.ids: list[str | None] = [None]  # row -> id; row 0 is the default
        self.values = np.zeros((1, config.dim), np.float32)
        self.accumulators = np.full((1, config.dim), config.initial_accumulator, np.float32)
        self.last_seen = np.zeros(1, np.int64)
        self.changed = np.zeros(1, np.int64)  # step of the last change to the row
        self.pending: dict[str, int] = {}
        self.pending_changed: dict[str, int] = {}
        self.removed: dict[str, int] = {}  # evicted id -> step
        self.free: list[int] = []

    def __len__(self) -> int:
        return len(self.index)

    # --- lookups ---------------------------------------------------------------------------------

    def lookup(self, ids: list[str], train: bool = False) -> np.ndarray:
        """Rows of `ids` ([n] int64). In training, counts each id toward admission and admits it
        once seen `admit_after` times; unknown ids get the default row."""
        if not train:
            return np.fromiter(map(self.index.get, ids, itertools.repeat(DEFAULT_ROW)), np.int64, len(ids))
        rows = np.empty(len(ids), np.int64)
        now = self.step + 1
        for n, id_ in enumerate(ids):
            row = self.index.get(id_)
            if row is None:
                count = self.pending.get(id_, 0) + 1
                if count >= self.config.admit_after:
                    self.pending.pop(id_, None)
                    row = self._admit(id_)
                else:
                    self.pending[id_] = count
                    row = DEFAULT_ROW
                self.pending_changed[id_] = now
            if row != DEFAULT_ROW:
                self.last_seen[row] = now
                self.changed[row] = now
            rows[n] = row
        return rows

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Embeddings of `rows`: [*rows.shape, dim] float32."""
        return self.values[rows]

    def _admit(self, id_: str) -> int:
        if self.free:
            row = self.free.pop()
        else:
            row = len(self.ids)
            self.ids.append(None)
            self._grow(row + 1)
        self.ids[row] = id_
        self.index[id_] = row
        self.removed.pop(id_, None)
        self.values[row] = _initial_row(id_, self.config.dim, self.config.init_scale)
        self.accumulators[row] = self.config.initial_accumulator
        return row

    def _grow(self, size: int) -> None:
        if size <= len(self.values):
            return
        capacity = max(size, 2 * len(self.values))
        extra = capacity - len(self.values)
        self.values = np.concatenate([self.values, np.zeros((extra, self.config.dim), np.float32)])
        self.accumulators = np.concatenate(
            [self.accumulators, np.full((extra, self.config.dim), self.config.initial_accumulator, np.float32)])
        self.last_seen = np.concatenate([self.last_seen, np.zeros(extra, np.int64)])
        self.changed = np.concatenate([self.changed, np.zeros(extra, np.int64)])

    # --- updates ---------------------------------------------------------------------------------

    def apply_gradients(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """Adagrad on the gathered rows; gradients of repeated rows are summed first. The default
        row is never trained. Ends the step."""
        self.step += 1
        rows, grads = rows.reshape(-1), grads.reshape(-1, self.config.dim)
        unique, inverse = np.unique(rows, return_inverse=True)
        summed = np.zeros((len(unique), self.config.dim), np.float32)
        np.add.at(summed, inverse, grads)
        keep = unique != DEFAULT_ROW
        unique, summed = unique[keep], summed[keep]
        self.accumulators[unique] += summed * summed
        self.values[unique] -= self.config.learning_rate * summed / (np.sqrt(self.accumulators[unique]) + 1e-7)
        self.changed[unique] = self.step
        if self.config.evict_after_steps:
            self._evict(self.step - self.config.evict_after_steps)

    def _evict(self, seen_before: int) -> None:
        live = np.flatnonzero(self.last_seen[: len(self.ids)] < seen_before)
        for row in live[live != DEFAULT_ROW]:
            id_ = self.ids[row]
            if id_ is None:
                continue
            del self.index[id_]
            self.ids[row] = None
            self.removed[id_] = self.step
            self.values[row] = 0.0
            self.free.append(int(row))

    # --- export ----------------------------------------------------------------------------------

    def snapshot(self) -> TableSnapshot:
        return self._snapshot(since=None)

    def delta(self, since: int) -> TableSnapshot:
        """The rows, admission counters and evictions changed after step `since`."""
        return self._snapshot(since=since)

    def _snapshot(self, since: int | None) -> TableSnapshot:
        live = sorted((id_, row) for id_, row in self.index.items() if since is None or self.changed[row] > since)
        rows = np.array([row for _, row in live], np.int64)
        pending = sorted((id_, c) for id_, c in self.pending.items()
                         if since is None or self.pending_changed.get(id_, 0) > since)
        removed = sorted(i for i, step in self.removed.items() if since is not None and step > since)
        dim = self.config.dim
        return TableSnapshot(
            ids=np.array([i for i, _ in live], dtype=object),
            values=self.values[rows] if len(rows) else np.zeros((0, dim), np.float32),
            accumulators=self.accumulators[rows] if len(rows) else np.zeros((0, dim), np.float32),
            last_seen=self.last_seen[rows] if len(rows) else np.zeros(0, np.int64),
            pending_ids=np.array([i for i, _ in pending], dtype=object),
            pending_counts=np.array([c for _, c in pending], np.int64),
            version=self.step,
            removed=np.array(removed, dtype=object))

    @classmethod
    def restore(cls, name: str, config: SparseConfig, snap: TableSnapshot) -> SparseTable:
        """A table in the state of `snap` (a warm start for incremental training, or serving)."""
        table = cls(name, config)
        table.step = snap.version
        n = len(snap.ids)
        table._grow(n + 1)
        table.ids = [None, *snap.ids.tolist()]
        table.index = {id_: row + 1 for row, id_ in enumerate(snap.ids.tolist())}
        table.values[1:n + 1] = snap.values
        table.accumulators[1:n + 1] = snap.accumulators
        table.last_seen[1:n + 1] = snap.last_seen
        table.pending = dict(zip(snap.pending_ids.tolist(), snap.pending_counts.tolist()))
        return table


def apply_delta(base: TableSnapshot, delta: TableSnapshot) -> TableSnapshot:
    """`base` patched with `delta`: changed rows replaced, new rows added, removed ids dropped."""
    gone = set(delta.removed.tolist())
    rows = {i: (v, a, s) for i, v, a, s in zip(base.ids, base.values, base.accumulators, base.last_seen)
            if i not in gone}
    rows.update({i: (v, a, s) for i, v, a, s in zip(delta.ids, delta.values, delta.accumulators, delta.last_seen)})
    # An id admitted since the base has a row now and no admission counter.
    pending = {i: c for i, c in zip(base.pending_ids, base.pending_counts) if i not in gone and i not in rows}
    pending.update(zip(delta.pending_ids, delta.pending_counts))
    ids = sorted(rows)
    dim = base.values.shape[1]
    return TableSnapshot(
        ids=np.array(ids, dtype=object),
        values=np.array([rows[i][0] for i in ids], np.float32).reshape(-1, dim),
        accumulators=np.array([rows[i][1] for i in ids], np.float32).reshape(-1, dim),
        last_seen=np.array([rows[i][2] for i in ids], np.int64),
        pending_ids=np.array(sorted(pending), dtype=object),
        pending_counts=np.array([pending[i] for i in sorted(pending)], np.int64),
        version=delta.version)
