"""The dataset spec: what a company declares about its data, in one TOML file (docs/dataset-spec.md).

The settings say where the spec is (`dataset.spec`); the spec says what the data means:
- the event types, by the dataset's own names, and their roles, from which every stage takes its event
  vocabulary (validation in Python and in the JVM, the stream's counts, the long history's type order,
  the ranker's labels and type ids, the graph's weights, retrieval's positives);
- past events to replay, as a file's columns (streaming/history.py);
- where its files come from: beside the spec, or written by a bundled adapter (`[dataset] adapter`);
- the item and user tables: where they are, their id column and their attributes by kind, from which the
  catalog's feature views and loader, the ranker's attribute tokens and numeric inputs and the two-tower
  model's towers derive.

A spec is checked whole before anything uses it: an unknown key, a missing one or a value of the wrong
type is refused with the file, the key and what was expected.
Standard library only: the Flink job's environment reads it too.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import tomllib

from infra.value import ValueExpression

# Shown to a user / an action that signals interest / one that says the user did not want it (a hide, a dislike:
# its exposure's label is 0 even if clicked)
ROLES = ("exposure", "positive", "negative")
ENTITIES = ("item", "user")  # the tables a spec declares, each keyed by the entity's id
# An attribute's kind: a string, a list of strings, an integer or a number.
KINDS = ("categorical", "multi", "integer", "number", "date")
NUMERIC_KINDS = ("integer", "number", "date")  # the ranker's numeric inputs
DAY_MS = 86_400_000
# A type's name travels to the JVM in a job parameter: no separators, nothing to escape.
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
JVM_SEPARATOR = "|"
# The context field of an event, and the field of a /rank or /recommend request, naming its scenario (the surface
# it was served on: `[scenarios.<name>]`); an event without it belongs to no declared scenario.
SCENARIO_FIELD = "scenario"
# A declared request context field's kinds (`[events.context.<name>] kind`): a string, one token per value; a
# number, one token per declared bucket; a number, a numeric input of the ranker (`context_<name>`).
CONTEXT_KINDS = ("categorical", "bucketed", "number")
MAX_CONTEXT = 8  # declared context fields: each is a slot of every scored row
MAX_BUCKETS = 32
# Context fields the platform itself reads or writes on events: not a declared field's name. The position a list
# showed an item at is a bias of the list that served it, not the request's context (unknown when /rank scores).
POSITION_FIELD = "position"  # an exposure's 0-based rank in the list that showed it (the platform's traffic writes it)
# Objectives (`[objectives.<name>]`): at most this many, each a network of the ranker; the training frame's label
# column of each after the first is this prefix and its name (the first's: `label`).
MAX_OBJECTIVES, OBJECTIVE_COLUMN = 4, "objective_"
PLATFORM_CONTEXT = frozenset((SCENARIO_FIELD, "test_traffic", POSITION_FIELD, "served_by", "source"))
# `[events.position] slots`: the ranks with a bias of their own (later ones share the last); at most MAX_SLOTS.
DEFAULT_SLOTS, MAX_SLOTS = 10, 100
# A sliding window of the stream's counts: minutes, hours or days ("5m", "1h", "7d").
WINDOW = re.compile(r"([1-9][0-9]{0,3})([mhd])")
WINDOW_MINUTES = {"m": 1, "h": 60, "d": 1440}
DEFAULT_WINDOWS = ("5m", "1h")


class SpecError(ValueError):
    """A dataset spec that cannot be used; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class EventTypeSpec:
    name: str
    role: str  # one of ROLES
    weight: float = 0.0  # a positive's weight as an edge of the behavior graph
    label: bool = False  # a positive that labels the ranker's examples
    # A label's context field holding its number (an order's amount, a view's dwell seconds): the example it labels
    # weighs that much against the others (LABEL_WEIGHT). Out of the repr: a spec without one keeps its digest.
    value: str = field(default="", repr=False)


@dataclass(frozen=True)
class ObjectiveSpec:
    """A named objective (`[objectives.<name>]`): the probability that an exposure is followed by one of its label
    types on the same request, or with `over`, by one of its types and by the other objective's (ESMM's CTCVR: a buy
    over the clicks, predicted for every exposure as P(click) x P(buy | click), so that the conditional rate is
    trained where it is scored, over every exposure, not only over clicked ones)."""

    name: str
    labels: tuple[str, ...]
    over: str = ""  # an objective declared before it


@dataclass(frozen=True)
class HistorySpec:
    """Past events to replay (`flywheel replay`): the bundled MovieLens ratings, or a file's columns."""

    source: str  # "movielens", or a CSV or Parquet file (relative to the spec's directory)
    user: str = "user_id"  # the columns holding each event field
    item: str = "item_id"
    type: str = "event_type"
    time: str = "event_time"  # a timestamp column, or numbers in `time_unit` since the epoch
    time_unit: str = "ms"  # "s" or "ms"
    request: str = ""  # the request id column: an action labels the exposure of its request; none: each event its own
    context: tuple[str, ...] = ()  # columns kept in each event's context (the ones the features read: the key)
    # > 0: the history holds no exposures; per request, each item acted on and this many times as many
    # sampled by popularity are replayed as exposures before it (streaming/history.py)
    negatives: int = 0


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    kind: str  # one of KINDS
    column: str  # in the source table
    separator: str = ""  # multi: the separator of a string column's entries (a list column needs none)
    token: str = ""  # its tokens' prefix ("genre:Drama")
    tokens: str = "value"  # the ranker's tokens: "value" (one per value), "decade" (a number's) or "none"
    # integer and number: the model's numeric input is max(x - origin, 0) * scale; date: x is its age in days
    # at the request's time (a launch date: how old the product is when shown), scale 1/365.25 unless declared
    origin: float = 0.0
    scale: float = 1.0

    @property
    def numeric(self) -> bool:
        return self.kind in NUMERIC_KINDS


@dataclass(frozen=True)
class TableSpec:
    entity: str  # one of ENTITIES
    source: str  # "movielens" (the bundled loader), or a CSV or Parquet file (relative to the spec's directory)
    id: str  # the column holding the entity's id
    attributes: tuple[AttributeSpec, ...]
    category: str = ""  # item: the attribute whose first value is the item's category (default: the first
    # categorical or multi one); the category events carry in their context, for the ranker's affinity features

    @property
    def category_attribute(self) -> AttributeSpec | None:
        """The declared one, else the first categorical or multi attribute; None: items have no category."""
        named = [a for a in self.attributes if a.name == self.category] or [a for a in self.attributes if not a.numeric]
        return named[0] if named else None

    def feature(self, attribute: AttributeSpec) -> str:
        """The attribute's feature name in the store and the models ("item_genres")."""
        return f"{self.entity}_{attribute.name}"


@dataclass(frozen=True)
class ContextSpec:
    """A declared field of a request's context (`[events.context.<name>]`: the page a list is shown on, the
    device, the hour): sent by the client with `/rank` and `/recommend`, carried by the events of what was shown,
    and a request-time input of the ranker: the token "<name>:<value>" (categorical; bucketed: its bucket's) or the
    numeric input `context_<name>` (number). A request or an event without it has its `default` ("" or None: none,
    no token; a number's: 0)."""

    name: str
    kind: str = "categorical"  # one of CONTEXT_KINDS
    default: str | float | None = ""
    buckets: tuple[float, ...] = ()  # bucketed: the buckets' lower edges, ascending (below the first: one more)

    @property
    def tokens(self) -> bool:
        """Whether the ranker reads it as a token (else as a number)."""
        return self.kind != "number"

    @property
    def feature(self) -> str:
        """A number's numeric input of the ranker."""
        return f"context_{self.name}"

    def accepts(self, raw: object) -> bool:
        """Whether a request's value has the field's type: a string, number or boolean for a categorical, a
        number (not a boolean) for the others; missing (None) always."""
        if raw is None or self.kind == "categorical":
            return True
        return _number(raw) is not None

    def value(self, raw: object) -> str | float:
        """The field's value as the ranker reads it, from an event's or a request's context. Categorical: a
        string; a boolean "true" or "false"; a whole number without a fraction (a client's 2 and 2.0 are one page);
        missing (None, "") the default. Bucketed: its bucket's lower edge ("<6" below the first), "" where no
        number. Number: the number, the default (0) where none."""
        if self.kind != "categorical":
            x = _number(raw)
            x = _number(self.default) if x is None else x
            if self.kind == "number":
                return 0.0 if x is None else x
            if x is None:
                return ""
            at = bisect.bisect_right(self.buckets, x)  # the buckets below or at x
            return _plain(self.buckets[at - 1]) if at else f"<{_plain(self.buckets[0])}"
        if raw is None or raw == "":
            return self.default
        if isinstance(raw, bool):
            return "true" if raw else "false"
        if isinstance(raw, float) and raw.is_integer():
            return str(int(raw))
        return str(raw)


def _number(raw: object) -> float | None:
    """A finite int or float (not a boolean) as a float; else None."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        return None
    return float(raw)


def _plain(x: float) -> str:
    """A number as a token's text: a whole one without its fraction."""
    return str(int(x)) if x.is_integer() else str(x)


@dataclass(frozen=True)
class DemoSpec:
    """How `flywheel demo` cuts the history (`[demo]`): events from `split` on are its live traffic, and the
    first champion trains on the `train_days` before it. None: derived from the history (see flywheel/demo)."""

    split: datetime | None = None
    train_days: int | None = None


# The settings' sections a scenario may set for itself (their keys: infra/settings.py SCENARIO_KEYS).
SCENARIO_SECTIONS = ("canary", "serving")


@dataclass(frozen=True)
class ScenarioSpec:
    """A surface of the shop with its own ranker (`[scenarios.<name>]`): trained on the exposures whose context
    names it, served to the requests that name it, promoted and rolled back apart from the others."""

    name: str
    model: str = ""  # its registered model; "": `<models.name>-<name>`
    description: str = ""
    # Its own settings over the platform's, by section (`[scenarios.<name>.canary]`: how its canaries ramp;
    # `[scenarios.<name>.serving]`: its experiment's splits), as (key, value) pairs; checked by the settings.
    settings: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    def section(self, name: str) -> dict[str, Any]:
        return dict(dict(self.settings).get(name, ()))


@dataclass(frozen=True)
class DatasetSpec:
    """A checked spec. Its derived lists are computed once (consumers and the demo ask per event)."""

    name: str
    path: Path
    event_types: tuple[EventTypeSpec, ...]  # from the weakest signal to the strongest
    tables: tuple[TableSpec, ...] = ()  # one per entity of ENTITIES, in that order
    history: HistorySpec | None = None
    # The context field whose value is an event's key: the per (user, key) views and the long history
    # group by it, and the ranker's category inputs are its values (the item's category attribute).
    key: str = "category"
    # Further grouping keys (`[events] key = [key, *group_by]`): item attributes by name, each also the context
    # field an event may carry it in, or declared categorical context fields (a page: the request's value, not the
    # item's); each has per (user, value) counts and an interest histogram of its own.
    group_by: tuple[str, ...] = ()
    # Each entity's sliding windows of exposure and label counts and CTR (`[features] windows`)
    windows: tuple[str, ...] = DEFAULT_WINDOWS
    # A bundled adapter (streaming/adapters.py) that writes the files the sources name, outside the
    # repository (licensed data fetched at run time); None: the files are beside the spec.
    adapter: str | None = None
    demo: DemoSpec = DemoSpec()
    # Whether a user's next positives may be items they had before (groceries, music: true) or not (movies):
    # `/recommend` leaves a user's own items out only where they may not, and the candidate sources and
    # the judged benchmark follow it (`[events] repeats`).
    repeats: bool = False
    # Settings this dataset was tuned with (`[settings.<section>]`: the merge's weights that its validation
    # window chose, say), under the config file and the environment (infra/settings.py SPEC_SECTIONS).
    settings: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)
    # The surfaces with a ranker of their own (`[scenarios.<name>]`); requests naming none get the platform's
    # ranker, trained on every exposure.
    scenarios: tuple[ScenarioSpec, ...] = ()
    # The request context fields the ranker reads (`[events.context]`), in the spec's order.
    context: tuple[ContextSpec, ...] = ()
    # `[events.position]`: the exposures' rank is a bias the ranker learns apart and leaves out when it scores
    # (slots: ranks with a bias of their own); 0: not declared, the rank is not read.
    position_slots: int = 0
    # `[objectives]`: what the ranker predicts, by name, the first's labels being `labels`; (): one objective, the
    # types declaring label = true.
    objectives: tuple[ObjectiveSpec, ...] = ()
    # `[ranking] value`: what a list is ordered by (infra/value.py); None: the first objective's prediction.
    value: ValueExpression | None = None

    def objective_column(self, name: str) -> str:
        """The training frame's label column of an objective: `label` for the first, else `objective_<name>`."""
        return "label" if not self.objectives or name == self.objectives[0].name else OBJECTIVE_COLUMN + name

    def position_of(self, given: Mapping[str, object] | None) -> int:
        """An event's rank in the list that showed it (`position`, 0-based), 0 (the top, no bias) where missing or
        no whole number >= 0."""
        x = _number((given or {}).get(POSITION_FIELD))
        return int(x) if x is not None and x >= 0 and x.is_integer() else 0

    @functools.cached_property
    def window_buckets(self) -> tuple[tuple[str, int, int], ...]:
        """(name, minutes, time buckets) of each window: a minute per bucket up to 12, else 12 buckets."""
        return tuple((name, window_minutes(name), min(window_minutes(name), 12)) for name in self.windows)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every grouping key, the category's first."""
        return (self.key, *self.group_by)

    @property
    def context_keys(self) -> tuple[str, ...]:
        """The further keys that are declared context fields: a row's value is its request's, not its item's."""
        fields = {c.name for c in self.context}
        return tuple(k for k in self.group_by if k in fields)

    def key_default(self, key: str) -> str:
        """A key's value for an event that carries none and whose item the catalog gives none: a context key's
        declared default ("" for none, and for the item's keys)."""
        return next((str(c.default) for c in self.context if c.name == key and key in self.context_keys), "")

    def context_of(self, given: Mapping[str, object] | None) -> dict[str, str | float]:
        """Each declared context field's value in `given` (an event's or a request's context; other fields
        ignored), its default where missing."""
        given = given or {}
        return {c.name: c.value(given.get(c.name)) for c in self.context}

    def undeclared_context(self, given: Mapping[str, object]) -> list[str]:
        """The fields of a request's context the spec does not declare (a client's typo, or another spec's)."""
        names = {c.name for c in self.context}
        return sorted(set(given) - names)

    def mistyped_context(self, given: Mapping[str, object]) -> list[ContextSpec]:
        """The declared fields of a request's context whose value is not of their kind (a bucketed field's text)."""
        return [c for c in self.context if not c.accepts(given.get(c.name))]

    @property
    def context_numbers(self) -> tuple[str, ...]:
        """The request's context fields a value may weigh by: the `number` ones (a bucketed one's bucket is none)."""
        return tuple(c.name for c in self.context if c.kind == "number")

    @property
    def item_numbers(self) -> tuple[str, ...]:
        """The item's attributes a value may weigh by: its integers and numbers (a price, a bid), not its dates."""
        return tuple(a.name for a in self.table("item").attributes if a.kind in ("integer", "number"))

    def table(self, entity: str) -> TableSpec:
        return next(t for t in self.tables if t.entity == entity)

    @functools.cached_property
    def type_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types)

    @functools.cached_property
    def exposures(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.role == "exposure")

    @functools.cached_property
    def positives(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.role == "positive")

    @functools.cached_property
    def negatives(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.role == "negative")

    @functools.cached_property
    def labels(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.event_types if t.label)

    @functools.cached_property
    def valued(self) -> dict[str, str]:
        """Each label type declaring a value: the context field holding its number."""
        return {t.name: t.value for t in self.event_types if t.label and t.value}

    def label_value(self, event_type: str, given: Mapping[str, object] | None) -> float | None:
        """A label event's declared number (its amount, its dwell), where it has one > 0."""
        holder = self.valued.get(event_type)
        x = _number((given or {}).get(holder)) if holder else None
        return x if x is not None and x > 0 else None

    @property
    def weights(self) -> dict[str, float]:
        """Each positive's weight (graph edges, retrieval positives)."""
        return {t.name: t.weight for t in self.event_types if t.role == "positive"}

    @functools.cached_property
    def digest(self) -> str:
        """Identifies what the spec declares (not how the file is laid out)."""
        declared = ((self.name, self.event_types, self.tables) + ((self.key,) if self.key != "category" else ())
                    + ((self.group_by,) if self.group_by else ())
                    + ((self.windows,) if self.windows != DEFAULT_WINDOWS else ())  # MovieLens' as before
                    + (("repeats",) if self.repeats else ())
                    + ((self.context,) if self.context else ())
                    + ((("position", self.position_slots),) if self.position_slots else ())
                    + ((("values", tuple(self.valued.items())),) if self.valued else ())
                    + ((("objectives", self.objectives),) if self.objectives else ()))
        return hashlib.sha256(repr(declared).encode()).hexdigest()[:16]

    def source_path(self, source: str) -> Path:
        """A table's or the history's file, relative to the spec's directory (an adapter's files:
        streaming/adapters.source_path)."""
        return self.path.parent / source


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
    t = _check(where, raw, {"name": str, "role": str}, {"weight": (int, float), "label": bool, "value": str})
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
        article = "an" if t["role"][0] in "aeiou" else "a"
        raise SpecError(f"{where}: {article} {t['role']} has no weight and labels nothing (only positives do)")
    value = t.get("value", "")
    if "value" in t and not (positive and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", value)):
        raise SpecError(f"{where}.value: {VALUE_EXPECTED}, got {value!r}")
    return EventTypeSpec(t["name"], t["role"], weight, t.get("label", False), value)


VALUE_EXPECTED = ("expected the context field holding a label's number (lowercase letters, digits and '_', at most "
                  "32) on a positive with label = true (or a label of the first objective)")


def _attribute(where: str, name: str, raw: Any) -> AttributeSpec:
    a = _check(where, raw, {"kind": str}, {"column": str, "separator": str, "token": str, "tokens": str,
                                           "origin": (int, float), "scale": (int, float)})
    if not NAME.fullmatch(name):
        raise SpecError(f"{where}: expected an attribute name of letters, digits, '_' or '-' starting with a "
                        f"letter (at most 64), got {name!r}")
    if a["kind"] not in KINDS:
        raise SpecError(f"{where}.kind: expected one of {', '.join(KINDS)}, got {a['kind']!r}")
    numeric = a["kind"] in NUMERIC_KINDS
    tokens = a.get("tokens", "none" if numeric else "value")
    allowed = ("none",) if a["kind"] == "date" else ("decade", "none") if numeric else ("value", "none")
    if tokens not in allowed:
        raise SpecError(f"{where}.tokens: expected {' or '.join(allowed)} for a {a['kind']} attribute, got {tokens!r}")
    if not numeric and ("origin" in a or "scale" in a):
        raise SpecError(f"{where}: origin and scale are for integer, number and date attributes (the numeric "
                        "inputs)")
    if a.get("origin", 0) < 0:  # a missing value is 0 before the transform: it must stay 0 after it
        raise SpecError(f"{where}.origin: expected a number >= 0, got {a['origin']}")
    if "separator" in a and a["kind"] != "multi":
        raise SpecError(f"{where}.separator: only a multi attribute has a separator")
    return AttributeSpec(name, a["kind"], a.get("column", name), a.get("separator", ""), a.get("token", name),
                         tokens, float(a.get("origin", 0.0)),
                         float(a.get("scale", 1 / 365.25 if a["kind"] == "date" else 1.0)))


def _table(where: str, entity: str, raw: Any) -> TableSpec:
    t = _check(where, raw, {"source": str, "id": str, "attributes": dict}, {"category": str} if entity == "item" else {})
    attributes = tuple(_attribute(f"{where}.attributes.{name}", name, a) for name, a in t["attributes"].items())
    if not attributes:
        raise SpecError(f"{where}.attributes: expected at least one attribute")
    category = t.get("category", "")
    if category and not any(a.name == category and not a.numeric for a in attributes):
        raise SpecError(f"{where}.category: expected the name of a categorical or multi attribute, got {category!r}")
    return TableSpec(entity, t["source"], t["id"], attributes, category)


# A training example's weight: a label's declared value over the mean of its window's values (1 without one)
LABEL_WEIGHT = "label_weight"
# A further key names its features ("brand_ctr", "interest_brand_share") and a stream column: not these.
RESERVED_KEYS = frozenset(("category", "user", "item", "user_id", "item_id", "event_id", "event_type", "event_time",
                           "request_id", "history", "interest", "seq", "sequence", "total", "profile", "row", "label",
                           "keys", "proctime", LABEL_WEIGHT))


def _identifier(where: str, what: str, name: object) -> None:
    """A name that becomes a column or a feature's: lowercase letters, digits and '_', none reserved or prefixed as
    the objectives' label columns."""
    if (not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name) or name in RESERVED_KEYS
            or name.startswith(OBJECTIVE_COLUMN)):
        raise SpecError(f"{where}: expected {what} of lowercase letters, digits and '_' (at most 32, not "
                        f"{', '.join(sorted(RESERVED_KEYS))}, nor starting with {OBJECTIVE_COLUMN!r}), got {name!r}")


def _group_by(where: str, key: str, names: list, item: dict, context: dict) -> tuple[str, ...]:
    """The keys after the first: distinct identifiers, each a categorical or multi item attribute or a categorical
    field of `[events.context]` (not both)."""
    attributes = item.get("attributes", {}) if isinstance(item, dict) else {}
    for name in names:
        _identifier(where, "the keys after the first to be item attribute or context field names", name)
        if name == key or names.count(name) > 1:
            raise SpecError(f"{where}: {name!r} is named twice")
        of_item, of_request = (isinstance(d.get(name), dict) for d in (attributes, context))
        if of_item and of_request:
            raise SpecError(f"{where}: {name!r} is both an attribute of [tables.item] and a field of "
                            "[events.context]: rename one")
        if of_request and context[name].get("kind") in CONTEXT_KINDS and context[name]["kind"] != "categorical":
            raise SpecError(f"{where}: {name!r} is a {context[name].get('kind')} context field: a key's values are "
                            "categorical")
        if of_request and re.search(r"""[|,:'"]""", str(context[name].get("default", ""))):
            raise SpecError(f"{where}: {name!r}'s default is the stream job's too: expected none of | , : ' \" in "
                            f"it, got {context[name]['default']!r}")
        if not of_request and (not of_item or attributes[name].get("kind") not in ("categorical", "multi")):
            raise SpecError(f"{where}: {name!r} is not a categorical or multi attribute of [tables.item] (an event "
                            "without it takes its item's) nor a categorical field of [events.context]")
    return tuple(names)


def _context(where: str, raw: dict[str, Any], keys: tuple[str, ...]) -> tuple[ContextSpec, ...]:
    """The declared request context fields: identifiers that name no key, no platform field and no reserved name."""
    if len(raw) > MAX_CONTEXT:
        raise SpecError(f"{where}: at most {MAX_CONTEXT} fields, got {len(raw)}")
    out = []
    for name, table in raw.items():
        _identifier(where, "a field name", name)
        if name == keys[0]:
            raise SpecError(f"{where}.{name}: {name!r} is the first grouping key ([events] key): its values come "
                            "from the catalog and have features of their own")
        if name in PLATFORM_CONTEXT:
            raise SpecError(f"{where}.{name}: {name!r} is a context field the platform reads or writes itself "
                            f"({', '.join(sorted(PLATFORM_CONTEXT))})")
        c = _check(f"{where}.{name}", table, {"kind": str}, {"default": (str, int, float), "buckets": list})
        kind = c["kind"]
        if kind not in CONTEXT_KINDS:
            raise SpecError(f"{where}.{name}.kind: expected {', '.join(CONTEXT_KINDS)}, got {kind!r}")
        default = c.get("default", "" if kind == "categorical" else None)
        if kind == "categorical" and not isinstance(default, str):
            raise SpecError(f"{where}.{name}.default: expected str, got {type(default).__name__} {default!r}")
        if kind != "categorical" and "default" in c and _number(default) is None:
            raise SpecError(f"{where}.{name}.default: expected a number, got {type(default).__name__} {default!r}")
        if (kind == "bucketed") != ("buckets" in c):
            raise SpecError(f"{where}.{name}.buckets: " + ("expected the buckets' lower edges of a bucketed field"
                            if kind == "bucketed" else f"only a bucketed field has buckets, not a {kind} one"))
        buckets = tuple(c.get("buckets", ()))
        if kind == "bucketed" and (not 1 <= len(buckets) <= MAX_BUCKETS or any(_number(b) is None for b in buckets)
                                   or list(buckets) != sorted(set(buckets))):
            raise SpecError(f"{where}.{name}.buckets: expected 1 to {MAX_BUCKETS} numbers, ascending, each once; "
                            f"got {list(buckets)!r}")
        out.append(ContextSpec(name, kind, default, tuple(float(b) for b in buckets)))
    return tuple(out)


def _objectives(where: str, raw: dict[str, Any], types: tuple[EventTypeSpec, ...]) -> tuple[ObjectiveSpec, ...]:
    """The named objectives: 1 to MAX_OBJECTIVES, each labelled by positives, `over` one declared before it."""
    if not 1 <= len(raw) <= MAX_OBJECTIVES:
        raise SpecError(f"{where}: expected 1 to {MAX_OBJECTIVES} objectives, got {len(raw)}")
    if labelled := [t.name for t in types if t.label]:
        raise SpecError(f"{where}: the objectives name what is predicted: drop label = true from {labelled[0]!r}")
    positives = [t.name for t in types if t.role == "positive"]
    out: list[ObjectiveSpec] = []
    for name, table in raw.items():
        _identifier(where, "an objective name", name)
        o = _check(f"{where}.{name}", table, {"labels": list}, {"over": str})
        labels = o["labels"]
        if not labels or any(label not in positives for label in labels) or len(set(labels)) < len(labels):
            raise SpecError(f"{where}.{name}.labels: expected event types with role = \"positive\" (of "
                            f"{', '.join(positives)}), each once, got {labels!r}")
        over = o.get("over", "")
        if over and over not in [d.name for d in out]:
            raise SpecError(f"{where}.{name}.over: expected an objective declared before it (its exposure space), "
                            f"got {over!r}")
        out.append(ObjectiveSpec(name, tuple(labels), over))
    return tuple(out)


def _value(where: str, raw: dict[str, Any], spec: DatasetSpec) -> ValueExpression:
    """`[ranking] value`: an expression of the objectives' predictions, the item's numbers and the request's, naming
    at least one objective, each name one of one kind."""
    text = _check(where, raw, {"value": str}, {})["value"]
    if not spec.objectives:
        raise SpecError(f"{where}.value: a value weighs the objectives' predictions: declare [objectives] (one may "
                        "be the labels)")
    try:
        value = ValueExpression.parse(text)
    except ValueError as exc:
        raise SpecError(f"{where}.value: {exc}") from None
    kinds = {"an objective": [o.name for o in spec.objectives], "an item's number": list(spec.item_numbers),
             "a request's number": list(spec.context_numbers)}
    for name in value.names:
        of = [kind for kind, names in kinds.items() if name in names]
        if not of:
            expected = ", ".join(f"{kind} ({', '.join(names) or 'none declared'})" for kind, names in kinds.items())
            raise SpecError(f"{where}.value: unknown name {name!r} in {text!r}: expected {expected}")
        if len(of) > 1:
            raise SpecError(f"{where}.value: {name!r} is both {' and '.join(of)}: rename one")
    if not set(value.names) & set(kinds["an objective"]):
        raise SpecError(f"{where}.value: {text!r} names no objective: a value ranks by what the ranker predicts")
    return value


def _position(where: str, raw: dict[str, Any]) -> int:
    """The ranks with a position bias of their own: 2 to MAX_SLOTS."""
    slots = _check(where, raw, {}, {"slots": int}).get("slots", DEFAULT_SLOTS)
    if not 2 <= slots <= MAX_SLOTS:
        raise SpecError(f"{where}.slots: expected an integer from 2 to {MAX_SLOTS}, got {slots}")
    return slots


def _history(where: str, raw: Any) -> HistorySpec:
    h = _check(where, raw, {"source": str}, {"user": str, "item": str, "type": str, "time": str, "time_unit": str,
                                             "request": str, "context": list, "negatives": int})
    if h.get("time_unit", "ms") not in ("s", "ms"):
        raise SpecError(f"{where}.time_unit: expected s or ms, got {h['time_unit']!r}")
    if not all(isinstance(c, str) for c in h.get("context", [])):
        raise SpecError(f"{where}.context: expected a list of column names")
    if h.get("negatives", 0) < 0:
        raise SpecError(f"{where}.negatives: expected an integer >= 0, got {h['negatives']}")
    if h.get("negatives") and h["source"] == "movielens":
        raise SpecError(f"{where}.negatives: MovieLens' replay has its exposures (each rating)")
    return HistorySpec(**h | {"context": tuple(h.get("context", []))})


def _demo(where: str, raw: Any) -> DemoSpec:
    d = _check(where, raw, {}, {"split": (str, date), "train_days": int})
    split = d.get("split")
    if isinstance(split, str):
        try:
            split = datetime.fromisoformat(split)
        except ValueError:
            raise SpecError(f"{where}.split: expected a date such as 2017-10-01, got {split!r}") from None
    if isinstance(split, date) and not isinstance(split, datetime):
        split = datetime(split.year, split.month, split.day)
    if split is not None and split.tzinfo is None:
        split = split.replace(tzinfo=UTC)
    if d.get("train_days", 1) < 1:
        raise SpecError(f"{where}.train_days: expected an integer >= 1, got {d['train_days']}")
    return DemoSpec(split, d.get("train_days"))


def window_minutes(name: str) -> int:
    """A window's length ("1h" -> 60)."""
    return int(name[:-1]) * WINDOW_MINUTES[name[-1]]


def _windows(where: str, raw: Any) -> tuple[str, ...]:
    windows = _check(where, raw, {}, {"windows": list}).get("windows", list(DEFAULT_WINDOWS))
    if not 1 <= len(windows) <= 4 or not all(isinstance(w, str) and WINDOW.fullmatch(w) for w in windows):
        raise SpecError(f"{where}.windows: expected 1 to 4 windows such as \"5m\", \"1h\" or \"7d\" (minutes, hours, "
                        f"days), got {windows!r}")
    minutes = [window_minutes(w) for w in windows]
    if len(set(minutes)) < len(minutes) or len(set(windows)) < len(windows):
        raise SpecError(f"{where}.windows: a window is declared twice: {windows!r}")
    return tuple(windows)


def _scenarios(where: str, raw: dict[str, Any]) -> tuple[ScenarioSpec, ...]:
    out = []
    for name, table in raw.items():
        if not NAME.fullmatch(name):
            raise SpecError(f"{where}: expected a scenario name of letters, digits, '_' or '-' starting with a letter "
                            f"(at most 64), got {name!r}")
        t = _check(f"{where}.{name}", table, {}, {"model": str, "description": str, **dict.fromkeys(
            SCENARIO_SECTIONS, dict)})
        if "model" in t and not NAME.fullmatch(t["model"]):
            raise SpecError(f"{where}.{name}.model: expected a registered model name of letters, digits, '_' or '-' "
                            f"starting with a letter (at most 64), got {t['model']!r}")
        own = tuple((section, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in t[section].items()))
                    for section in SCENARIO_SECTIONS if section in t)
        out.append(ScenarioSpec(name, t.get("model", ""), t.get("description", ""), own))
    models = [s.model for s in out if s.model]
    if twice := sorted({m for m in models if models.count(m) > 1}):
        raise SpecError(f"{where}: the model {twice[0]!r} is named by two scenarios (each has its own)")
    return tuple(out)


def parse_spec(text: str, path: Path) -> DatasetSpec:
    """The spec in `text` (read from `path`), checked whole, or SpecError."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not TOML: {exc}") from None
    top = _check(str(path), raw, {"dataset": dict, "events": dict, "tables": dict},
                 {"features": dict, "demo": dict, "settings": dict, "scenarios": dict, "objectives": dict,
                  "ranking": dict})
    for section, values in top.get("settings", {}).items():
        if not isinstance(values, dict):
            raise SpecError(f"{path} [settings].{section}: expected a table of settings, got {type(values).__name__}")
    dataset = _check(f"{path} [dataset]", top["dataset"], {"name": str}, {"adapter": str})
    events = _check(f"{path} [events]", top["events"], {"types": list},
                    {"history": dict, "key": (str, list), "repeats": bool, "context": dict,
                     "position": dict})
    keys = events.get("key", "category")
    key, *group_by = [keys] if isinstance(keys, str) else keys or [""]  # several: the category's first
    if not isinstance(key, str) or not NAME.fullmatch(key):
        raise SpecError(f"{path} [events].key: expected a context field name of letters, digits, '_' or '-' "
                        f"starting with a letter (at most 64), got {key!r}")
    types = tuple(_event_type(f"{path} [[events.types]] #{n + 1}", t) for n, t in enumerate(events["types"]))
    names = [t.name for t in types]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"{path} [[events.types]]: the name {twice[0]!r} is declared twice")
    objectives = _objectives(f"{path} [objectives]", top["objectives"], types) if "objectives" in top else ()
    if objectives:  # the first objective's labels are the spec's labels (the stream's clicks, the gate's AUC)
        types = tuple(replace(t, label=t.name in objectives[0].labels) for t in types)
    for n, t in enumerate(types):
        if t.value and not t.label:
            raise SpecError(f"{path} [[events.types]] #{n + 1}.value: {VALUE_EXPECTED}, got {t.value!r}")
    tables = _check(f"{path} [tables]", top["tables"], {e: dict for e in ENTITIES}, {})
    spec = DatasetSpec(dataset["name"], path, types,
                       tuple(_table(f"{path} [tables.{e}]", e, tables[e]) for e in ENTITIES),
                       _history(f"{path} [events.history]", events["history"]) if "history" in events else None,
                       key, _group_by(f"{path} [events].key", key, group_by, tables.get("item", {}),
                                      events.get("context", {})),
                       adapter=dataset.get("adapter"),
                       demo=_demo(f"{path} [demo]", top["demo"]) if "demo" in top else DemoSpec(),
                       repeats=events.get("repeats", False), settings=top.get("settings", {}),
                       objectives=objectives)
    if "features" in top:
        spec = replace(spec, windows=_windows(f"{path} [features]", top["features"]))
    if "scenarios" in top:
        spec = replace(spec, scenarios=_scenarios(f"{path} [scenarios]", top["scenarios"]))
    if "context" in events:
        spec = replace(spec, context=_context(f"{path} [events.context]", events["context"], spec.keys))
        tokens = {a.token for table in spec.tables for a in table.attributes if a.tokens != "none"}
        if clash := sorted(tokens & {c.name for c in spec.context}):
            raise SpecError(f"{path} [events.context].{clash[0]}: {clash[0]!r} is also an attribute's token prefix "
                            "([tables]): the two would share embeddings")
    if "position" in events:
        spec = replace(spec, position_slots=_position(f"{path} [events.position]", events["position"]))
    if "ranking" in top:
        spec = replace(spec, value=_value(f"{path} [ranking]", top["ranking"], spec))
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
