"""The sparse tables in Redis: rows packed per bucket, a version as a lineage of deltas.

Keys (prefix `sparse_tier.key_prefix`, model: the registered model's name):

    {prefix}:{model}:{version}:meta             hash: parent ("" for a full version), depth, dim, buckets
                                                (JSON {table: count}), spec (JSON), dense (the weights' .h5)
    {prefix}:{model}:{version}:{table}:{bucket} hash: id -> the row's float32 bytes (b"": evicted, the default row)
    {prefix}:{model}:{version}:{table}~state:{bucket}    id -> its Adagrad accumulator (float32) and last step
                                                         seen (int64): what training continues from
    {prefix}:{model}:{version}:{table}~pending:{bucket}  id -> an id's admission counter (int64), not admitted yet

The training state is written when the version's rows carry it (a registered model's do; `make
bench-sparse`'s synthetic ones do not), and its tables then have buckets of their own in the meta (the
table's count) and the meta its tables' steps (`steps`). Serving never reads it; an incremental run pulls
the rows its window touches with it (`pull`) instead of loading its parent whole.

An id's bucket is crc32(id) mod its table's bucket count, fixed by the full version at the root of the
lineage. A hash of at most `hash-max-listpack-entries` (128 by default) fields of at most 64 bytes is
one listpack in Redis: a row of 16 float32 costs its 64 bytes, its id and a few bytes (`bytes_per_row`
in `make bench-sparse`). On a Redis Cluster the bucket keys spread over the slots: the tables are sharded
by id with no change here.

A version's rows are the rows it wrote and, for other ids, its parent's, and so on up to the full version:
an incremental version writes only the rows it changed. A read for version v asks each version of v's
lineage for the ids' buckets, all in one pipelined round trip, and takes the newest answer. A version
whose lineage would pass `max_lineage` is written in full. The meta is written last and deleted first: a
version without it is not in the store, so a half-written or half-deleted one is never read.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import redis

from models.sparse import TableSnapshot

log = logging.getLogger(__name__)
ROWS_PER_BUCKET = 64  # rows per bucket on average: a bucket past 128 fields (Redis' listpack bound) is rare
WRITE_CHUNK = 200_000  # rows per pipeline when writing
EVICTED = b""
STATE, PENDING = "~state", "~pending"  # a table's training state: its rows', and its admission counters
# Ids per script call of `pull`. A call holds Redis ~8 us per id (three hashes): 500 ids, ~4 ms, so serving's
# reads on the same Redis wait at most that long for an incremental run's pull (20,000 ids held it 119 ms).
PULL_CHUNK = 500


# ARGV: the lineage's length d, its versions' key prefixes (newest first), then (bucket key suffix, id) pairs.
# Returns each id's row at the newest version that has one (nil: none). The keys are built here, which a
# Redis Cluster refuses: there the reads are a pipeline (fetch).
_FETCH = """
local d = tonumber(ARGV[1])
local out, n = {}, 0
for i = d + 2, #ARGV, 2 do
  local row = false
  for v = 2, d + 1 do
    row = redis.call('HGET', ARGV[v] .. ARGV[i], ARGV[i + 1])
    if row then break end
  end
  n = n + 1
  out[n] = row
end
return out
"""


class StoreFull(RuntimeError):
    """Redis refused the version's rows (maxmemory): the version is not in the store."""


class MissingVersion(LookupError):
    """A version, or one of its lineage, is not in the store."""


@dataclass(frozen=True)
class VersionInfo:
    version: str
    parent: str  # "" for a full version
    depth: int  # 0 for a full version, the parent's + 1 for a delta
    dim: int
    buckets: dict[str, int]  # table -> bucket count (the lineage's full version's)
    steps: dict[str, int] = field(default_factory=dict)  # table -> its step (versions with training state)


@dataclass(frozen=True)
class TableState:
    """A table's training state beside the rows a version writes: each row's Adagrad accumulator ([n, dim]
    float32) and last step seen ([n] int64), the admission counters of ids not admitted yet, the table's step."""

    accumulators: np.ndarray
    last_seen: np.ndarray
    pending_ids: np.ndarray
    pending_counts: np.ndarray
    step: int


@dataclass(frozen=True)
class TableRows:
    """What a version writes of one table: rows of `ids` ([n] str, `values` [n, dim] float32), the ids it
    evicted and, to be continued from the store, the training state of those rows."""

    ids: np.ndarray
    values: np.ndarray
    removed: np.ndarray
    state: TableState | None = None


def _state_dtype(dim: int) -> np.dtype:
    return np.dtype([("accumulators", "<f4", (dim,)), ("last_seen", "<i8")])


def _void(rows: np.ndarray) -> np.ndarray:
    """[n] bytes-like rows of a contiguous array of n rows (one void item per row, trailing zero bytes kept)."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.dtype((np.void, rows.itemsize * int(np.prod(rows.shape[1:]))))).ravel()


def bucket_of(ids: Iterable[str], buckets: int) -> np.ndarray:
    """Each id's bucket: crc32 of its UTF-8 bytes mod `buckets` (the same in every process and language)."""
    return np.fromiter((zlib.crc32(i.encode()) for i in ids), np.int64) % buckets


def _snapshot(ids: list[str], values: list[bytes | None], state: list[bytes | None], pending: list[bytes | None],
              dim: int, step: int) -> TableSnapshot:
    """A table's pulled ids as a snapshot (ids sorted): rows where the store has one, counters for the rest."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    rowed = [i for i in order if values[i]]  # None: never admitted; EVICTED: evicted (the default row)
    if any(not state[i] for i in rowed):
        raise MissingVersion("rows in the embedding store without their training state")
    rows = np.frombuffer(b"".join(state[i] for i in rowed), _state_dtype(dim))
    counted = [i for i in order if not values[i] and pending[i]]
    return TableSnapshot(
        ids=np.array([ids[i] for i in rowed], dtype=object),
        values=np.frombuffer(b"".join(values[i] for i in rowed), "<f4").reshape(-1, dim).copy(),
        accumulators=rows["accumulators"].copy(), last_seen=rows["last_seen"].astype(np.int64),
        pending_ids=np.array([ids[i] for i in counted], dtype=object),
        pending_counts=np.frombuffer(b"".join(pending[i] for i in counted), "<i8").astype(np.int64),
        version=step)


class EmbeddingStore:
    def __init__(self, client: redis.Redis, model: str, prefix: str = "emb", max_lineage: int = 8) -> None:
        self.client, self.model, self.prefix, self.max_lineage = client, model, prefix, max_lineage
        self._script = None

    def _key(self, version: str, *parts: object) -> str:
        return ":".join((self.prefix, self.model, version, *map(str, parts)))

    # --- reading ---------------------------------------------------------------------------------

    def info(self, version: str) -> VersionInfo | None:
        meta = self.client.hmget(self._key(version, "meta"), ["parent", "depth", "dim", "buckets", "steps"])
        if meta[0] is None:
            return None
        return VersionInfo(version, meta[0].decode(), int(meta[1]), int(meta[2]), json.loads(meta[3]),
                           json.loads(meta[4]) if meta[4] else {})

    def lineage(self, version: str) -> list[VersionInfo]:
        """The version and its ancestors up to its full version, newest first."""
        chain, at = [], version
        while True:
            info = self.info(at)
            if info is None:
                held = f" (in the lineage of v{version})" if at != version else ""
                raise MissingVersion(f"v{at}{held} is not in the embedding store")
            chain.append(info)
            if not info.parent:
                return chain
            at = info.parent

    def model_of(self, version: str) -> tuple[str, bytes]:
        """The version's spec (JSON) and dense weights (.h5 bytes)."""
        spec, dense = self.client.hmget(self._key(version, "meta"), ["spec", "dense"])
        if spec is None or dense is None:
            raise MissingVersion(f"v{version} is not in the embedding store")
        return spec.decode(), dense

    def fetch(self, lineage: list[VersionInfo], wanted: dict[str, list[str]]) -> dict[str, list[bytes | None]]:
        """Each wanted id's row bytes at the lineage's first version (None: no row, the default row; b"":
        evicted, also the default row), every table in one round trip: one script call on a Redis server
        (its lineage walked there), a pipeline of one HMGET per bucket and version on a Redis Cluster
        (the buckets are on many nodes)."""
        return self.fetch_later(lineage, wanted)()

    def fetch_later(self, lineage: list[VersionInfo], wanted: dict[str, list[str]]
                    ) -> Callable[[], dict[str, list[bytes | None]]]:
        """`fetch` in two halves: on a Redis server the request is sent now and the function returned
        reads its reply (call it once; it raises what `fetch` would), so the caller works while Redis
        does. On a Redis Cluster the pipeline is read whole now."""
        if not isinstance(self.client, redis.Redis):
            out = self._fetch_pipelined(lineage, wanted)
            return lambda: out
        args, asked = self._script_args(lineage, wanted)
        out: dict[str, list[bytes | None]] = {table: [None] * len(ids) for table, ids in wanted.items()}
        if not asked:
            return lambda: out
        if self._script is None:
            self._script = self.client.register_script(_FETCH)
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_command("EVALSHA", self._script.sha, 0, *args)
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise

        def reply() -> dict[str, list[bytes | None]]:
            try:
                rows = connection.read_response()
            except redis.exceptions.NoScriptError:  # a restarted server: the script loaded again
                pool.release(connection)
                rows = self._script(args=args)
            except BaseException:
                connection.disconnect()  # a reply may still come: never hand this connection out again
                pool.release(connection)
                raise
            else:
                pool.release(connection)
            at = 0
            for table, n in asked:
                out[table] = rows[at:at + n]
                at += n
            return out
        return reply

    def _fetch_pipelined(self, lineage: list[VersionInfo], wanted: dict[str, list[str]]
                         ) -> dict[str, list[bytes | None]]:
        pipe = self.client.pipeline(transaction=False)
        plan: list[tuple[str, np.ndarray]] = []
        for table, ids in wanted.items():
            count = lineage[-1].buckets.get(table)
            if not ids or count is None:
                continue
            of = bucket_of(ids, count)
            order = np.argsort(of, kind="stable")
            cuts = np.flatnonzero(np.diff(of[order])) + 1
            for group in np.split(order, cuts):
                fields = [ids[i] for i in group]
                for info in lineage:
                    pipe.hmget(self._key(info.version, table, int(of[group[0]])), fields)
                plan.append((table, group))
        replies = iter(pipe.execute()) if plan else iter(())
        out: dict[str, list[bytes | None]] = {table: [None] * len(ids) for table, ids in wanted.items()}
        depth = len(lineage)
        for table, group in plan:
            answers = [next(replies) for _ in range(depth)]
            rows = out[table]
            for k, i in enumerate(group):
                for answer in answers:  # newest first
                    if answer[k] is not None:
                        rows[i] = answer[k]
                        break
        return out

    def _script_args(self, lineage: list[VersionInfo], wanted: dict[str, list[str]]
                     ) -> tuple[list[str | int], list[tuple[str, int]]]:
        """The fetch script's arguments and the (table, id count) of each table asked, in their order."""
        args: list[str | int] = [len(lineage), *(self._key(info.version, "") for info in lineage)]
        asked = []
        for table, ids in wanted.items():
            count = lineage[-1].buckets.get(table)
            if not ids or count is None:
                continue
            for id_, bucket in zip(ids, bucket_of(ids, count).tolist()):
                args += (f"{table}:{bucket}", id_)
            asked.append((table, len(ids)))
        return args, asked

    def pull(self, lineage: list[VersionInfo], wanted: dict[str, list[str]]) -> dict[str, TableSnapshot]:
        """What training continues from, of each wanted id at the lineage's first version, per table: the rows
        of the ids that have one (values, accumulators, last steps seen) and the admission counters of those
        that do not, at the table's step (`SparseTable.restore` takes it). PULL_CHUNK ids per round trip.
        Raises MissingVersion when the lineage was written without its training state."""
        head, root = lineage[0], lineage[-1]
        out = {}
        for table, ids in wanted.items():
            if table not in head.steps or table + STATE not in root.buckets:
                raise MissingVersion(f"v{head.version}'s {table} table is in the embedding store without its "
                                     "training state")
            values, state, pending = [], [], []
            for at in range(0, len(ids), PULL_CHUNK):
                part = ids[at:at + PULL_CHUNK]
                got = self.fetch(lineage, {table: part, table + STATE: part, table + PENDING: part})
                values += got[table]
                state += got[table + STATE]
                pending += got[table + PENDING]
            out[table] = _snapshot(ids, values, state, pending, head.dim, head.steps[table])
        return out

    # --- writing ---------------------------------------------------------------------------------

    def write(self, version: str, parent: str, dim: int, spec: str, dense: bytes,
              delta: Callable[[], dict[str, TableRows]], full: Callable[[], dict[str, TableRows]],
              on_delta: Callable[[VersionInfo, dict[str, TableRows]], object] | None = None) -> VersionInfo:
        """Write a version: only `delta()`'s rows when its parent is in the store and the lineage stays under
        `max_lineage` (`on_delta` is called with them first), else `full()`'s. Raises StoreFull (the
        version's keys removed) when Redis refuses the rows, ValueError for rows of another width than
        `dim`."""
        above = self.info(parent) if parent else None
        if above is not None and above.dim != dim:
            raise ValueError(f"v{version} has {dim}-wide rows, its parent v{parent}'s are {above.dim}-wide")
        if above is not None and above.depth + 1 < self.max_lineage:
            info = VersionInfo(version, parent, above.depth + 1, dim, above.buckets)
            rows = delta()
            if on_delta is not None:
                on_delta(info, rows)
            return self._write(info, spec, dense, rows.items())
        tables = full()
        stateful = bool(tables) and all(rows.state is not None for rows in tables.values())
        return self.write_full(version, dim, spec, dense, {name: len(rows.ids) for name, rows in tables.items()},
                               tables.items(), stateful)

    def write_full(self, version: str, dim: int, spec: str, dense: bytes, counts: dict[str, int],
                   chunks: Iterable[tuple[str, TableRows]], stateful: bool = False) -> VersionInfo:
        """A full version from chunks of rows (a table need not fit in memory): `counts`, each table's ids,
        fixes its buckets. `stateful`: the chunks carry their training state (`TableRows.state`), which is
        written too."""
        buckets = {name: max(1, -(-n // ROWS_PER_BUCKET)) for name, n in counts.items()}
        if stateful:
            buckets |= {name + part: n for name, n in buckets.items() for part in (STATE, PENDING)}
        return self._write(VersionInfo(version, "", 0, dim, buckets), spec, dense, chunks)

    def _write(self, info: VersionInfo, spec: str, dense: bytes, chunks: Iterable[tuple[str, TableRows]]
               ) -> VersionInfo:
        """The chunks' rows, and their training state where the lineage holds it, then the meta."""
        steps: dict[str, int] = {}
        try:
            for name, rows in chunks:
                if rows.values.ndim != 2 or rows.values.shape[1] != info.dim or len(rows.values) != len(rows.ids):
                    raise ValueError(f"table {name} of v{info.version}: rows of shape {rows.values.shape} for "
                                     f"{len(rows.ids)} ids, the model's rows are {info.dim} wide")
                if name not in info.buckets:
                    continue
                count = info.buckets[name]
                self._write_rows(info.version, name, rows.ids, _void(rows.values.astype("<f4")), rows.removed, count)
                if rows.state is not None and name + STATE in info.buckets:
                    self._write_state(info.version, name, rows, count)
                    steps[name] = rows.state.step
            self.client.hset(self._key(info.version, "meta"), mapping={
                "parent": info.parent, "depth": info.depth, "dim": info.dim, "buckets": json.dumps(info.buckets),
                "steps": json.dumps(steps), "spec": spec, "dense": dense})
        except redis.ResponseError as exc:
            self.delete(info.version)
            if isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM" in str(exc):
                raise StoreFull(f"the embedding store refused v{info.version}'s rows: {exc}") from None
            raise
        except ValueError:
            self.delete(info.version)
            raise
        return VersionInfo(info.version, info.parent, info.depth, info.dim, info.buckets, steps)

    def _write_state(self, version: str, table: str, rows: TableRows, buckets: int) -> None:
        st = rows.state
        if st.accumulators.shape != rows.values.shape or st.last_seen.shape != rows.ids.shape:
            raise ValueError(f"table {table} of v{version}: training state of shapes {st.accumulators.shape} and "
                             f"{st.last_seen.shape} for rows of shape {rows.values.shape}")
        state = np.empty(len(rows.ids), _state_dtype(rows.values.shape[1]))
        state["accumulators"], state["last_seen"] = st.accumulators, st.last_seen
        self._write_rows(version, table + STATE, rows.ids, _void(state), rows.removed, buckets)
        self._write_rows(version, table + PENDING, st.pending_ids, _void(st.pending_counts.astype("<i8")),
                         np.array([], object), buckets)

    def _write_rows(self, version: str, table: str, ids: np.ndarray, packed: np.ndarray, removed: np.ndarray,
                    buckets: int) -> None:
        """`packed` ([n] void: each id's row bytes) and the removed ids as EVICTED: one HSET per bucket (the
        rows sorted by bucket first), WRITE_CHUNK rows per pipeline."""
        n = len(ids)
        ids = np.concatenate([ids.astype(object), removed.astype(object)])
        if not len(ids):
            return
        of = bucket_of(ids, buckets)
        order = np.argsort(of, kind="stable")
        bucket = of[order].tolist()
        cuts = [0, *(np.flatnonzero(np.diff(of[order])) + 1).tolist(), len(ids)]
        # id, row, id, row, ... in bucket order (an evicted id: an empty row); a row's bytes from its void item
        # (one bytes object per row), not a slice per row
        rowed = order < n
        rows = np.full(len(ids), EVICTED, object)
        rows[rowed] = packed[order[rowed]].tolist()
        fields: list[object] = [None] * (2 * len(ids))
        fields[0::2] = ids[order].tolist()
        fields[1::2] = rows.tolist()
        commands, queued = [], 0
        for a, b in zip(cuts, cuts[1:]):
            commands.append(("HSET", self._key(version, table, bucket[a]), *fields[2 * a:2 * b]))
            queued += b - a
            if queued >= WRITE_CHUNK:
                self._send(commands)
                commands, queued = [], 0
        self._send(commands)

    def _send(self, commands: list[tuple[object, ...]]) -> None:
        """Commands sent in one write and their replies read: a pipeline without its bookkeeping per command
        (a 1,000,000-row delta is ~150,000 HSETs), on a Redis server. Raises the first error reply."""
        if not commands:
            return
        if not isinstance(self.client, redis.Redis):  # a Redis Cluster: its pipeline routes each key
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            pipe.execute()
            return
        pool = self.client.connection_pool
        conn = pool.get_connection()
        errors: list[redis.ResponseError] = []
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            for _ in commands:
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    errors.append(exc)
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)
        if errors:
            raise errors[0]

    # --- compaction ------------------------------------------------------------------------------

    def versions(self) -> list[str]:
        pattern = self._key("*", "meta")
        return sorted(key.decode().split(":")[-2] for key in self.client.scan_iter(match=pattern, count=1000))

    def delete(self, version: str) -> None:
        self.client.delete(self._key(version, "meta"))  # first: readers no longer see it
        batch = []
        for key in self.client.scan_iter(match=self._key(version, "*"), count=10_000):
            batch.append(key)
            if len(batch) >= 1000:
                self._unlink(batch)
                batch = []
        self._unlink(batch)

    def _unlink(self, keys: list[bytes]) -> None:
        if keys:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:  # one key per command: on a Redis Cluster the keys are on many nodes
                pipe.unlink(key)
            pipe.execute()

    def compact(self, keep: Iterable[str]) -> list[str]:
        """Delete every version that no kept version's lineage needs; returns them."""
        needed: set[str] = set()
        for version in keep:
            try:
                needed.update(info.version for info in self.lineage(version))
            except MissingVersion:
                continue
        gone = [v for v in self.versions() if v not in needed]
        for version in gone:
            self.delete(version)
        if gone:
            log.info("embedding store: deleted v%s (no kept version's lineage needs them)", ", v".join(gone))
        return gone
