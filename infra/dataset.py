"""The dataset spec: what a company declares about its data, in one TOML file (docs/dataset-spec.md).

The settings say where the spec is (`dataset.spec`); the spec says what the data means. So far it
declares the event types, by the dataset's own names, and their roles; every stage derives its event
vocabulary from it (the schema's validation in Python and in the JVM, the stream's counts, the long
history's type order, the ranker's labels and type ids, the graph's weights, retrieval's positives).

A spec is checked whole before anything uses it: an unknown key, a missing one or a value of the wrong
type is refused with the file, the key and what was expected.
Standard library only: the Flink job's environment reads it too.
"""

from __future__ import annotations

import functools
import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("exposure", "positive")  # shown to a user / an action that signals interest
# A type's name travels to the JVM in a job parameter: no separators, nothing to escape.
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
JVM_SEPARATOR = "|"


class SpecError(ValueError):
    """A dataset spec that cannot be used; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class EventTypeSpec:
    name: str
    role: str  # one of ROLES
    weight: float = 0.0  # a positive's weight in the behavior graph and in retrieval's positives
    label: bool = False  # a positive that labels the ranker's examples


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    path: Path
    event_types: tuple[EventTypeSpec, ...]  # from the weakest signal to the strongest

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types)

    @property
    def exposures(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.role == "exposure")

    @property
    def positives(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.role == "positive")

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.label)

    @property
    def weights(self) -> dict[str, float]:
        """Each positive's weight (graph edges, retrieval positives)."""
        return {t.name: t.weight for t in self.event_types if t.role == "positive"}

    @property
    def digest(self) -> str:
        """Identifies what the spec declares (not how the file is laid out)."""
        return hashlib.sha256(repr((self.name, self.event_types)).encode()).hexdigest()[:16]


def _check(where: str, table: Any, required: dict[str, type | tuple[type, ...]],
           optional: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise SpecError(f"{where}: expected a table, got {type(table).__name__}")
    unknown = sorted(set(table) - set(required) - set(optional))
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r} (expected: {', '.join([*required, *optional])})")
    for key, kind in {**required, **optional}.items():
        if key not in table:
            if key in required:
                raise SpecError(f"{where}: missing key {key!r}")
            continue
        value = table[key]
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise SpecError(f"{where}.{key}: expected {names}, got bool")
        if not isinstance(value, kind):
            raise SpecError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r}")
    return table


def _event_type(where: str, raw: Any) -> EventTypeSpec:
    t = _check(where, raw, {"name": str, "role": str}, {"weight": (int, float), "label": bool})
    if not NAME.fullmatch(t["name"]):
        raise SpecError(f"{where}.name: expected a name of letters, digits, '_' or '-' starting with a letter "
                        f"(at most 64), got {t['name']!r}")
    if t["role"] not in ROLES:
        raise SpecError(f"{where}.role: expected one of {', '.join(ROLES)}, got {t['role']!r}")
    positive = t["role"] == "positive"
    weight = float(t.get("weight", 1.0 if positive else 0.0))
    if positive and weight <= 0:
        raise SpecError(f"{where}.weight: expected a number > 0 for a positive, got {weight}")
    if not positive and ("weight" in t or t.get("label")):
        raise SpecError(f"{where}: an exposure has no weight and labels nothing (only positives do)")
    return EventTypeSpec(t["name"], t["role"], weight, t.get("label", False))


def parse_spec(text: str, path: Path) -> DatasetSpec:
    """The spec in `text` (read from `path`), checked whole, or SpecError."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not TOML: {exc}") from None
    top = _check(str(path), raw, {"dataset": dict, "events": dict}, {})
    dataset = _check(f"{path} [dataset]", top["dataset"], {"name": str}, {})
    events = _check(f"{path} [events]", top["events"], {"types": list}, {})
    types = tuple(_event_type(f"{path} [[events.types]] #{n + 1}", t) for n, t in enumerate(events["types"]))
    names = [t.name for t in types]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"{path} [[events.types]]: the name {twice[0]!r} is declared twice")
    spec = DatasetSpec(dataset["name"], path, types)
    if not spec.exposures:
        raise SpecError(f"{path} [[events.types]]: expected at least one type with role = \"exposure\" "
                        "(the ranker's examples are exposures)")
    if not spec.labels:
        raise SpecError(f"{path} [[events.types]]: expected at least one positive with label = true "
                        "(what the ranker predicts)")
    return spec


@functools.cache
def load_spec(path: Path) -> DatasetSpec:
    """The spec at `path` (read once per process), or SpecError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the dataset spec: {exc.strerror}") from None
    return parse_spec(text, path)
