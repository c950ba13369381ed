"""The behavior-event schema (version 1): one definition, validated on produce and on consume.

Wire format: a compact JSON object, UTF-8, keyed in Kafka by ``user_id`` so that one user's events
stay in order on one partition::

    {"schema_version": 1, "event_id": "...", "user_id": "42", "item_id": "1193",
     "event_type": "click", "request_id": "...", "event_time": 874965758000,
     "context": {"source": "movielens-100k"}}

``event_time`` is milliseconds since the Unix epoch (UTC). ``event_type`` is one the dataset spec
declares (infra/dataset.py; MovieLens': impression, click, add_to_cart, purchase). ``request_id`` names
the ranking request that produced an exposure; an action on it carries the same request id.
``context`` is free-form (string, number or boolean values); ``"test_traffic": true`` marks load-test
traffic, which training and evaluation skip.
Standard library only: the Flink job's environment imports this module too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from infra.dataset import DatasetSpec
from infra.settings import get_settings

SCHEMA_VERSION = 1
MAX_ID_CHARS = 128
MAX_CONTEXT_KEYS = 32
# 1970 .. 2100 in ms: catches seconds-vs-milliseconds mistakes in either direction.
MIN_EVENT_TIME_MS = 0
MAX_EVENT_TIME_MS = 4_102_444_800_000

ContextValue = str | int | float | bool

# Context key of test traffic (load tests, probes): true marks an event that training and evaluation
# skip (models/dataset.py), so a load test cannot teach or judge a model. Features still count it.
TEST_TRAFFIC = "test_traffic"

# Headers of a dead letter (`<topic>.dlq`): why the record was refused, where it was read, and its size
# before a dead letter cut it to `max_event_bytes`. Topic, partition and offset name a record once, so a
# dead letter written again after a restart is recognised as the same.
DLQ_REASON, DLQ_TOPIC, DLQ_PARTITION, DLQ_OFFSET = "dlq.reason", "dlq.topic", "dlq.partition", "dlq.offset"
DLQ_ORIGINAL_SIZE = "dlq.original_size"


@functools.cache
def dataset_spec() -> DatasetSpec:
    """This process's dataset spec (`dataset.spec`): the event types and their roles."""
    return get_settings().spec


def declared_types() -> tuple[str, ...]:
    return dataset_spec().type_names


class InvalidEvent(ValueError):
    """A record that does not satisfy the schema; `reason` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Event:
    event_id: str
    user_id: str
    item_id: str
    event_type: str
    request_id: str
    event_time: int
    context: dict[str, ContextValue] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "event_id": self.event_id, "user_id": self.user_id,
                "item_id": self.item_id, "event_type": self.event_type, "request_id": self.request_id,
                "event_time": self.event_time, "context": self.context}

    def encode(self, max_bytes: int, types: Collection[str] | None = None) -> bytes:
        """The wire bytes of this event, validated by the same checks a consumer applies."""
        record = self.to_dict()
        validate(record, types)
        payload = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        _check_size(payload, max_bytes)
        return payload

    @property
    def key(self) -> bytes:
        return self.user_id.encode()


_STRING_FIELDS = ("event_id", "user_id", "item_id", "request_id")
_FIELDS = {"schema_version", "event_type", "event_time", "context", *_STRING_FIELDS}


def validate(record: Any, types: Collection[str] | None = None) -> Event:
    """Check a decoded JSON value against the schema and build the Event, or raise InvalidEvent.
    `types`: the event types to accept (default: the dataset spec's)."""
    if not isinstance(record, dict):
        raise InvalidEvent(f"not a JSON object: got {type(record).__name__}")
    if record.keys() != _FIELDS:
        missing = sorted(_FIELDS - record.keys())
        if missing:
            raise InvalidEvent(f"missing field(s): {', '.join(missing)}")
        raise InvalidEvent(f"unexpected field(s): {', '.join(sorted(record.keys() - _FIELDS))}")
    version = record["schema_version"]
    if type(version) is not int:
        raise InvalidEvent(f"wrong type: schema_version must be an integer, got {type(version).__name__}")
    if version != SCHEMA_VERSION:
        raise InvalidEvent(f"unsupported schema_version {version} (this consumer reads {SCHEMA_VERSION})")
    for name in _STRING_FIELDS:
        value = record[name]
        if not isinstance(value, str):
            raise InvalidEvent(f"wrong type: {name} must be a string, got {type(value).__name__}")
        if not value or len(value) > MAX_ID_CHARS:
            raise InvalidEvent(f"bad value: {name} must have 1..{MAX_ID_CHARS} characters")
    types = declared_types() if types is None else types
    event_type = record["event_type"]
    if not isinstance(event_type, str) or event_type not in types:
        raise InvalidEvent(f"unknown event_type {event_type!r} (declared: {', '.join(types)})")
    event_time = record["event_time"]
    if type(event_time) is not int:
        raise InvalidEvent(f"wrong type: event_time must be integer milliseconds, got {type(event_time).__name__}")
    if not MIN_EVENT_TIME_MS <= event_time <= MAX_EVENT_TIME_MS:
        raise InvalidEvent(f"bad value: event_time {event_time} is not milliseconds between 1970 and 2100")
    context = record["context"]
    if not isinstance(context, dict):
        raise InvalidEvent(f"wrong type: context must be an object, got {type(context).__name__}")
    if len(context) > MAX_CONTEXT_KEYS:
        raise InvalidEvent(f"bad value: context has {len(context)} keys (at most {MAX_CONTEXT_KEYS})")
    for key, value in context.items():
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidEvent(f"wrong type: context[{key!r}] must be a string, number or boolean, "
                               f"got {type(value).__name__}")
    return Event(**{k: record[k] for k in _FIELDS})


def decode(payload: bytes | None, max_bytes: int, types: Collection[str] | None = None) -> Event:
    """Parse and validate one wire record, or raise InvalidEvent with the reason."""
    if payload is None:
        raise InvalidEvent("empty record (null value)")
    _check_size(payload, max_bytes)
    try:
        record = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(f"malformed JSON: {exc}") from None
    return validate(record, types)


def _check_size(payload: bytes, max_bytes: int) -> None:
    if len(payload) > max_bytes:
        raise InvalidEvent(f"oversized: {len(payload)} bytes (limit {max_bytes})")
