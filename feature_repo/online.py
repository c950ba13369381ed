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
# without moving its time), view by view. `_ms:{view}` holds the row's time as a number for this
# comparison; Feast reads only its own fields and ignores it. One call writes many entities and every
# view of a row (one command instead of one per entity and view: the client's work per command was most
# of the ingestor's time).
# KEYS: entity keys. ARGV: the number of views; per view: its n, ms field, ts field and n feature fields;
# then per key: ms, ts, and per view its n values.
_WRITE_IF_NEWER = """
local views, at = {}, 2
for j = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[at])
  views[j] = {n = n, ms = ARGV[at + 1], ts = ARGV[at + 2], fields = at + 3}
  at = at + 3 + n
end
local ms_fields = {}
for j, view in ipairs(views) do ms_fields[j] = view.ms end
local written = 0
for _, key in ipairs(KEYS) do
  local ms, ts = ARGV[at], ARGV[at + 1]
  at = at + 2
  local stored = redis.call('HMGET', key, unpack(ms_fields))
  local args = {}
  for j, view in ipairs(views) do
    if not stored[j] or tonumber(stored[j]) <= tonumber(ms) then
      args[#args + 1] = view.ms; args[#args + 1] = ms; args[#args + 1] = view.ts; args[#args + 1] = ts
      for f = 0, view.n - 1 do
        args[#args + 1] = ARGV[view.fields + f]; args[#args + 1] = ARGV[at + f]
      end
    end
    at = at + view.n
  end
  if #args > 0 then
    redis.call('HSET', key, unpack(args))
    written = written + 1
  end
end
return written
"""
# Entities per script call: one call runs to its end before Redis serves anyone else, so a call is kept
# to about a millisecond or two (the ranking server's reads wait behind it).
WRITE_CHUNK = 256


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # a negative int64 is written as its 64-bit two's complement, ten bytes
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_pack_double = struct.Struct("<d").pack
_SMALL_INT64 = [b"\x20" + _varint(v) for v in range(1 << 14)]  # counts mostly: two bytes of varint at most


def _int64(v: int) -> bytes:
    return _SMALL_INT64[v] if 0 <= v < 1 << 14 else b"\x20" + _varint(v)


def _value(make: Callable[[Any], Value]) -> Callable[[Any], bytes]:
    """A serialized `feast.types.Value` of one SQL type; null as Feast writes it (an empty Value)."""
    return lambda v: b"" if v is None else make(v).SerializeToString()


# What Feast's python_values_to_proto_values writes for each column type, built directly (it checks and
# converts value by value); scalars byte by byte, as protobuf lays out a oneof member (present even when
# zero). tests/test_online_reader.py reads them back with `get_online_features`.
ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "BIGINT": lambda v: b"" if v is None else _int64(v),
    "DOUBLE": lambda v: b"" if v is None else b"\x29" + _pack_double(v),
    "STRING": _value(lambda v: Value(string_val=v)),
    "ARRAY<STRING>": _value(lambda v: Value(string_list_val=StringList(val=v))),
    "ARRAY<BIGINT>": _value(lambda v: Value(int64_list_val=Int64List(val=v))),
    "ARRAY<DOUBLE>": _value(lambda v: Value(double_list_val=DoubleList(val=v))),
}


@functools.lru_cache(maxsize=1 << 16)  # the views sharing a topic write the same row times
def timestamp(ms: int) -> bytes:
    """A serialized `google.protobuf.Timestamp` of `ms` since the epoch (zero fields left out)."""
    seconds, nanos = divmod(ms, 1000)
    return ((b"\x08" + _varint(seconds) if seconds else b"") + (b"\x10" + _varint(nanos * 1_000_000) if nanos else b""))


View = tuple[str, Sequence[tuple[str, str]]]  # a feature view's name and its columns, (name, SQL type)


class OnlineWriter:
    """Writes rows of feature views into Feast's layout, exactly as `FeatureStore.push` would
    (tests/test_online_reader.py reads them back with `get_online_features`), in one pipelined round
    trip per batch: per entity, only the batch's newest row, checked against the stored one in Redis.
    The script's keys must live on one server (a Redis Cluster would need them grouped by slot)."""

    def __init__(self, s: Settings) -> None:
        self.client = redis.Redis.from_url(s.redis.url, password=s.redis.password or None)
        self._sha = self.client.script_load(_WRITE_IF_NEWER)

    def write(self, join_keys: tuple[str, ...], views: Sequence[View], rows: Sequence[dict]) -> int:
        """Write `rows` (dicts holding the join keys, `event_time` in ms and the columns of every view
        in `views`, views of one entity that share their rows); returns how many entities got a newer
        row than what was stored, in any of the views."""
        newest: dict[tuple[str, ...], dict] = {}  # a later row as new as an earlier one replaces it
        for row in rows:
            entity = tuple(str(row[k]) for k in join_keys)
            kept = newest.get(entity)
            if kept is None or int(row["event_time"]) >= int(kept["event_time"]):
                newest[entity] = row
        if not newest:
            return 0
        header: list = [len(views)]
        for view, columns in views:
            header += (len(columns), f"_ms:{view}".encode(), f"_ts:{view}".encode(),
                       *(field(view, name) for name, _ in columns))
        encoders = [(name, ENCODERS[sql_type]) for _, columns in views for name, sql_type in columns]
        entities = list(newest.items())
        with self.client.pipeline(transaction=False) as pipe:
            for i in range(0, len(entities), WRITE_CHUNK):
                chunk = entities[i:i + WRITE_CHUNK]
                args = list(header)
                for _, row in chunk:
                    ms = int(row["event_time"])
                    args += (ms, timestamp(ms), *(encode(row.get(name)) for name, encode in encoders))
                pipe.evalsha(self._sha, len(chunk), *(entity_key(join_keys, e) for e, _ in chunk), *args)
            try:
                return sum(pipe.execute())
            except redis.exceptions.NoScriptError:  # Redis restarted since: load it again, write again
                self._sha = self.client.script_load(_WRITE_IF_NEWER)
                return self.write(join_keys, views, rows)
