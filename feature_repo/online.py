"""Reading and writing Feast's Redis online store directly: one pipelined round trip for many entities,
values decoded without building a response object per value (the serving path), rows written in
batches with a newer-row-wins check in Redis itself (the ingestor).

Feast's layout (feast/infra/online_stores/redis.py, helpers.py, key_encoding_utils.py; serialization
v3): one hash per entity key, shared by every feature view of that entity. The key is the serialized
entity key followed by the project name; a feature's field is the little-endian murmur3-32 of
`"{view}:{feature}"`; `_ts:{view}` holds the row's timestamp; values are serialized `feast.types.Value`
protobufs. Feast does not enforce TTLs when it reads online, and neither does this: a field that is
absent reads as None, exactly as `get_online_features` returns it (tests/test_online_reader.py proves
the two equal over every feature type the views use).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import redis
from feast.infra.online_stores.helpers import _mmh3, _redis_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey
from feast.protos.feast.types.Value_pb2 import DoubleList, Int64List, StringList, Value
from google.protobuf.timestamp_pb2 import Timestamp

from feature_repo.store import PROJECT
from infra.settings import Settings

_DOUBLE, _INT64 = 0x29, 0x20  # Value.double_val (field 5, fixed64) and .int64_val (field 4, varint) tags
_unpack_double = struct.Struct("<d").unpack_from


def decode(raw: bytes | None) -> object:
    """A stored `feast.types.Value` as Python: None when absent or unset; lists as lists."""
    if not raw:
        return None
    tag = raw[0]
    if tag == _DOUBLE and len(raw) == 9:
        return _unpack_double(raw, 1)[0]
    if tag == _INT64 and len(raw) <= 11:
        value, shift = 0, 0
        for byte in raw[1:]:
            value |= (byte & 0x7F) << shift
            shift += 7
        return value - (1 << 64) if value >= 1 << 63 else value
    value = Value.FromString(raw)
    kind = value.WhichOneof("val")
    if kind is None or kind == "null_val":
        return None
    got = getattr(value, kind)
    return list(got.val) if kind.endswith("_list_val") else got


@functools.lru_cache(maxsize=1 << 16)
def entity_key(join_keys: tuple[str, ...], values: tuple[str, ...]) -> bytes:
    """The Redis key of one entity (string join keys), exactly as Feast writes it."""
    return _redis_key(PROJECT, EntityKey(join_keys=list(join_keys),
                                         entity_values=[Value(string_val=v) for v in values]), 3)


@functools.lru_cache(maxsize=4096)
def field(view: str, feature: str) -> bytes:
    return _mmh3(f"{view}:{feature}")


class OnlineReader:
    """Reads features of many entities of one kind in one pipelined round trip. Every command waits at
    most `timeout_s`: a stalled Redis raises redis.TimeoutError instead of holding the caller."""

    def __init__(self, s: Settings, timeout_s: float) -> None:
        self.client = redis.Redis.from_url(s.redis.url, password=s.redis.password or None,
                                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def read(self, join_keys: tuple[str, ...], entities: list[tuple[str, ...]],
             refs: list[tuple[str, str]]) -> list[tuple]:
        """For each entity (its join-key values in `join_keys` order), the values of `refs`
        ((view, feature) pairs) in order; None where nothing is stored."""
        return self.read_all([(join_keys, entities, refs)])[0]

    def read_all(self, reads: Sequence[tuple[tuple[str, ...], list[tuple[str, ...]], list[tuple[str, str]]]]
                 ) -> list[list[tuple]]:
        """`read` of several entity kinds, in one round trip: one list of rows per (join_keys, entities,
        refs) of `reads`."""
        with self.client.pipeline(transaction=False) as pipe:
            for join_keys, entities, refs in reads:
                fields = [field(view, feature) for view, feature in refs]
                for e in entities:
                    pipe.hmget(entity_key(join_keys, e), fields)
            rows = iter(pipe.execute())
        return [[tuple(map(decode, next(rows))) for _ in entities] for _, entities, _ in reads]


# Newer row wins, and a row as new as the stored one replaces it (a late event updates an aggregate
# without moving its time). `_ms:{view}` holds the row's time as a number for this comparison; Feast
# reads only its own fields and ignores it.
_WRITE_IF_NEWER = """
local stored = redis.call('HGET', KEYS[1], ARGV[1])
if stored and tonumber(stored) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], unpack(ARGV, 3))
return 1
"""

def _value(make: Callable[[Any], Value]) -> Callable[[Any], bytes]:
    """A serialized `feast.types.Value` of one SQL type; null as Feast writes it (an empty Value)."""
    return lambda v: b"" if v is None else make(v).SerializeToString()


# What Feast's python_values_to_proto_values writes for each column type, built directly (it checks and
# converts value by value): tests/test_online_reader.py reads them back.
ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "BIGINT": _value(lambda v: Value(int64_val=v)),
    "DOUBLE": _value(lambda v: Value(double_val=v)),
    "STRING": _value(lambda v: Value(string_val=v)),
    "ARRAY<STRING>": _value(lambda v: Value(string_list_val=StringList(val=v))),
    "ARRAY<BIGINT>": _value(lambda v: Value(int64_list_val=Int64List(val=v))),
    "ARRAY<DOUBLE>": _value(lambda v: Value(double_list_val=DoubleList(val=v))),
}


class OnlineWriter:
    """Writes rows of one feature view into Feast's layout, exactly as `FeatureStore.push` would
    (tests/test_online_reader.py reads them back with `get_online_features`), in one pipelined round
    trip per batch: per entity, only the batch's newest row, checked against the stored one in Redis."""

    def __init__(self, s: Settings) -> None:
        self.client = redis.Redis.from_url(s.redis.url, password=s.redis.password or None)
        self._sha = self.client.script_load(_WRITE_IF_NEWER)

    def write(self, view: str, join_keys: tuple[str, ...], columns: Sequence[tuple[str, str]],
              rows: Sequence[dict]) -> int:
        """Write `rows` (dicts holding the join keys, `event_time` in ms and the columns, as (name, SQL
        type) pairs); returns how many entities got a newer row than what was stored."""
        newest: dict[tuple[str, ...], dict] = {}  # a later row as new as an earlier one replaces it
        for row in rows:
            entity = tuple(str(row[k]) for k in join_keys)
            kept = newest.get(entity)
            if kept is None or int(row["event_time"]) >= int(kept["event_time"]):
                newest[entity] = row
        if not newest:
            return 0
        encoders = [(field(view, name), ENCODERS[sql_type], name) for name, sql_type in columns]
        ts_field, ms_field = f"_ts:{view}".encode(), f"_ms:{view}".encode()
        with self.client.pipeline(transaction=False) as pipe:
            for entity, row in newest.items():
                ms = int(row["event_time"])
                ts = Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000).SerializeToString()
                args = [ms_field, ms, ts_field, ts]
                for f, encode, name in encoders:
                    args += (f, encode(row.get(name)))
                pipe.evalsha(self._sha, 1, entity_key(join_keys, entity), *args)
            try:
                return sum(pipe.execute())
            except redis.exceptions.NoScriptError:  # Redis restarted since: load it again, write again
                self._sha = self.client.script_load(_WRITE_IF_NEWER)
                return self.write(view, join_keys, columns, rows)
