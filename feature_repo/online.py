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

Keys, field hashes and values are encoded here byte by byte, without Feast's SDK: importing any of it
loads all of Feast (3 s), which a one-shot reader such as `flywheel features` should not pay. What the
ranking service reads (`served_features`) comes from a file `store.apply` writes next to the registry.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mmh3
import redis
from redis.cluster import RedisCluster

from infra.redis_clients import online_store
from infra.settings import Settings

PROJECT = "flywheel"  # the Feast project: the suffix of every entity key

# `feast.types.Value` fields (one of): the ones the views use.
_STRING, _INT64, _DOUBLE, _STRING_LIST, _INT64_LIST, _DOUBLE_LIST, _NULL = 2, 4, 5, 12, 14, 15, 19
_INT64_TAG, _DOUBLE_TAG = _INT64 << 3, _DOUBLE << 3 | 1  # a varint and a fixed64
_unpack_double = struct.Struct("<d").unpack_from
_uint32 = struct.Struct("<I").pack


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # a negative int64 is written as its 64-bit two's complement, ten bytes
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _read_varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _lists_message() -> type:
    """The list kinds of `feast.types.Value` (the field numbers above), declared here: parsed by
    protobuf's C parser without importing Feast (a 1,000-behavior history is one value; its Python
    loop took ~0.3 us per element, its int64 times ~1.5 us)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    kind = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="flywheel/feast_value_lists.proto", package="flywheel.feast",
                                              syntax="proto3")
    value = file.message_type.add(name="Value")
    for name, number, element in (("string_list_val", _STRING_LIST, kind.TYPE_STRING),
                                  ("int64_list_val", _INT64_LIST, kind.TYPE_INT64),
                                  ("double_list_val", _DOUBLE_LIST, kind.TYPE_DOUBLE)):
        message = f"List{number}"
        file.message_type.add(name=message).field.add(name="val", number=1, type=element, label=kind.LABEL_REPEATED)
        value.field.add(name=name, number=number, type=kind.TYPE_MESSAGE, type_name=f".flywheel.feast.{message}",
                        label=kind.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("flywheel.feast.Value"))


_LIST_FIELDS = {_STRING_LIST: "string_list_val", _INT64_LIST: "int64_list_val", _DOUBLE_LIST: "double_list_val"}
_LISTS: type | None = None


@functools.lru_cache(maxsize=1 << 16)
def _scalar(raw: bytes) -> object:
    """A number, string or null, decoded once per distinct value (counts and attributes repeat across
    entities): an item read is a dozen such values."""
    if raw[0] == _DOUBLE_TAG and len(raw) == 9:
        return _unpack_double(raw, 1)[0]
    key, i = _read_varint(raw, 0)
    number = key >> 3
    if number == _INT64:
        return _int64(_read_varint(raw, i)[0])
    if number == _NULL:
        return None
    if number == _STRING:
        length, i = _read_varint(raw, i)
        return raw[i:i + length].decode()
    raise ValueError(f"a Feast value of a kind no view uses (field {number})")


def decode(raw: bytes | None) -> object:
    """A stored `feast.types.Value` as Python: None when absent or unset; lists as (new) lists."""
    global _LISTS
    if not raw:
        return None
    number = raw[0] >> 3  # the key's first byte holds the field number for every number below 32
    if number not in _LIST_FIELDS:
        return _scalar(raw) if len(raw) <= 64 else _scalar.__wrapped__(raw)  # a long string: not kept
    if _LISTS is None:
        _LISTS = _lists_message()
    return list(getattr(_LISTS.FromString(raw), _LIST_FIELDS[number]).val)


@functools.lru_cache(maxsize=1 << 16)
def entity_key(join_keys: tuple[str, ...], values: tuple[str, ...]) -> bytes:
    """The Redis key of one entity (string join keys), exactly as Feast writes it (serialization v3:
    key count, then each key and each value as type, length, UTF-8, keys sorted; then the project)."""
    pairs = sorted(zip(join_keys, values))
    out = [_uint32(len(pairs))]
    for text in [k for k, _ in pairs] + [v for _, v in pairs]:
        encoded = text.encode()
        out += (_uint32(2), _uint32(len(encoded)), encoded)  # 2: Feast's ValueType.STRING
    return b"".join(out) + PROJECT.encode()


@functools.lru_cache(maxsize=4096)
def field(view: str, feature: str) -> bytes:
    """A feature's hash field: the little-endian murmur3-32 of `view:feature`."""
    return _uint32(mmh3.hash(f"{view}:{feature}", signed=False))


def layout_path(s: Settings) -> Path:
    return s.paths.service_dir("feast") / "online_layout.json"


def write_layout(s: Settings, services: dict[str, list[tuple[tuple[str, ...], str, list[str]]]]) -> None:
    """Record each feature service's reads, (join keys, view, features), from the registry."""
    path = layout_path(s)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(services, indent=1))
    os.replace(tmp, path)


def served_features(s: Settings, service: str) -> list[tuple[tuple[str, ...], str, list[str]]]:
    """What `service` serves, as `write_layout` recorded it: (join keys, view, features) per view."""
    try:
        layout = json.loads(layout_path(s).read_text())[service]
    except (FileNotFoundError, KeyError):
        raise ValueError(f"feature service {service} is not registered: apply the feature repo first "
                         "(`flywheel up` does)") from None
    return [(tuple(keys), view, features) for keys, view, features in layout]


class OnlineReader:
    """Reads features of many entities of one kind in one pipelined round trip. Every command waits at
    most `timeout_s`: a stalled Redis raises redis.TimeoutError instead of holding the caller."""

    def __init__(self, s: Settings, timeout_s: float) -> None:
        self.client = online_store(s, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def connect(self) -> None:
        """Open a connection to every node now (each shard of a cluster), not within a first read's deadline."""
        if isinstance(self.client, RedisCluster):
            self.client.ping(target_nodes=RedisCluster.ALL_NODES)
        else:
            self.client.ping()

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
# ARGV: the number of keys and the entity keys; the number of views; per view: its n, ms field, ts field and
# n feature fields; then per key: ms, ts, and per view its n values. The keys are arguments, not KEYS: a
# Redis Cluster refuses declared keys of several slots, and lets a script flagged allow-cross-slot-keys
# write keys of any slots its node serves (the writer sends each node its own).
_WRITE_IF_NEWER = """#!lua flags=allow-cross-slot-keys
local nkeys = tonumber(ARGV[1])
local views, at = {}, nkeys + 3
for j = 1, tonumber(ARGV[nkeys + 2]) do
  local n = tonumber(ARGV[at])
  views[j] = {n = n, ms = ARGV[at + 1], ts = ARGV[at + 2], fields = at + 3}
  at = at + 3 + n
end
local ms_fields = {}
for j, view in ipairs(views) do ms_fields[j] = view.ms end
local written = 0
for k = 2, nkeys + 1 do
  local key = ARGV[k]
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


def _length_delimited(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _packed(number: int, items: bytes) -> bytes:
    """A list message of packed numbers (`items`, its field 1) as field `number` of a Value."""
    return _length_delimited(number, _length_delimited(1, items) if items else b"")


def _strings(values: list[str]) -> bytes:
    items = b"".join(_length_delimited(1, v.encode()) for v in values)  # not packed: one field each
    return _length_delimited(_STRING_LIST, items)


_pack_double = struct.Struct("<d").pack
_SMALL_INT64 = [bytes((_INT64_TAG,)) + _varint(v) for v in range(1 << 14)]  # counts: at most 2 varint bytes


def _int64_value(v: int) -> bytes:
    return _SMALL_INT64[v] if 0 <= v < 1 << 14 else bytes((_INT64_TAG,)) + _varint(v)


def _nullable(encode: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    return lambda v: b"" if v is None else encode(v)  # null as Feast writes it: an empty Value


# What Feast's python_values_to_proto_values writes for each column type, as protobuf lays it out (a oneof
# member is present even when zero or empty; repeated numbers packed): tests/test_online_reader.py reads
# every type back with `get_online_features`.
ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "BIGINT": _nullable(_int64_value),
    "DOUBLE": _nullable(lambda v: bytes((_DOUBLE_TAG,)) + _pack_double(v)),
    "STRING": _nullable(lambda v: _length_delimited(_STRING, v.encode())),
    "ARRAY<STRING>": _nullable(_strings),
    "ARRAY<BIGINT>": _nullable(lambda v: _packed(_INT64_LIST, b"".join(map(_varint, v)))),
    "ARRAY<DOUBLE>": _nullable(lambda v: _packed(_DOUBLE_LIST, struct.pack(f"<{len(v)}d", *v))),
}


def timestamp(ms: int) -> bytes:
    """A serialized `google.protobuf.Timestamp` of `ms` since the epoch (zero fields left out)."""
    seconds, nanos = divmod(ms, 1000)
    return ((b"\x08" + _varint(seconds) if seconds else b"") + (b"\x10" + _varint(nanos * 1_000_000) if nanos else b""))


View = tuple[str, Sequence[tuple[str, str]]]  # a feature view's name and its columns, (name, SQL type)
# A batch of rows as its columns (name -> values, all of one length): the ingestor decodes a topic's rows
# straight into columns, for Parquet and for Redis, with no dict per row (a fifth of its time at 10,000 rows).
Columns = Mapping[str, Sequence[Any]]


def columns_of(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """`rows` as Columns: every name any row has, None where a row lacks it."""
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [row.get(name) for row in rows] for name in names}


class OnlineWriter:
    """Writes rows of feature views into Feast's layout, exactly as `FeatureStore.push` would
    (tests/test_online_reader.py reads them back with `get_online_features`), in one pipelined round
    trip per batch: per entity, only the batch's newest row, checked against the stored one in Redis.
    On a Redis Cluster, a call per node and chunk, with the node's entities (scripts cannot be pipelined there)."""

    def __init__(self, s: Settings) -> None:
        self.client = online_store(s)
        self._sha = self.client.script_load(_WRITE_IF_NEWER)

    def write(self, join_keys: tuple[str, ...], views: Sequence[View], batch: Columns) -> int:
        """Write the rows of `batch` (columns: the join keys, `event_time` in ms and the columns of every
        view in `views`, views of one entity that share their rows; a column it lacks is null); returns
        how many entities got a newer row than what was stored, in any of the views."""
        times = [int(t) for t in batch["event_time"]]
        newest: dict[tuple[str, ...], int] = {}  # entity -> its row; a later row as new as an earlier one wins
        for i, entity in enumerate(zip(*(map(str, batch[k]) for k in join_keys))):
            kept = newest.get(entity)
            if kept is None or times[i] >= times[kept]:
                newest[entity] = i
        if not newest:
            return 0
        header: list = [len(views)]
        for view, columns in views:
            header += (len(columns), f"_ms:{view}".encode(), f"_ts:{view}".encode(),
                       *(field(view, name) for name, _ in columns))
        picked = list(newest.values())
        stamps = [times[i] for i in picked]
        encoded = []  # column by column: one map per column, not a generator per row
        for _, columns in views:
            for name, sql_type in columns:
                encode, column = ENCODERS[sql_type], batch.get(name)
                encoded.append([encode(None)] * len(picked) if column is None
                               else list(map(encode, map(column.__getitem__, picked))))
        groups: dict[str, list[tuple[bytes, tuple]]] = {}  # node (one on one server) -> its keys and values
        for entity, values in zip(newest, zip(stamps, map(timestamp, stamps), *encoded)):
            key = entity_key(join_keys, entity)
            node = self.client.get_node_from_key(key).name if isinstance(self.client, RedisCluster) else ""
            groups.setdefault(node, []).append((key, values))
        calls = []  # (node, args) per script call
        for node, entities in groups.items():
            for i in range(0, len(entities), WRITE_CHUNK):
                chunk = entities[i:i + WRITE_CHUNK]
                args = [len(chunk), *(key for key, _ in chunk), *header]
                for _, values in chunk:
                    args += values
                calls.append((node, args))
        try:
            if isinstance(self.client, RedisCluster):
                return sum(self.client.execute_command("EVALSHA", self._sha, 0, *args,
                                                       target_nodes=self.client.get_node(node_name=node))
                           for node, args in calls)
            with self.client.pipeline(transaction=False) as pipe:
                for _, args in calls:
                    pipe.evalsha(self._sha, 0, *args)
                return sum(pipe.execute())
        except redis.exceptions.NoScriptError:  # Redis restarted since: load it again, write again
            self._sha = self.client.script_load(_WRITE_IF_NEWER)
            return self.write(join_keys, views, batch)
