"""Past events as the dataset spec declares them (`[events.history]`), in event-time order: MovieLens'
ratings through its bundled replay, or a CSV or Parquet file through the spec's column mapping.

A file is checked whole before its first event is yielded: a declared column it lacks, a row without a
user, item, type or time, a time that reads as neither a timestamp nor a number, or a row the event schema
refuses (an undeclared type, an id too long, a time outside 1970-2100) is refused with the file and the
row, so a replay never stops halfway. Ids are read as text ("007" stays "007"); a timestamp without a time
zone is UTC.

An event without the spec's key (`[events] key`: its category) gets it from the catalog's item table (the
item's category attribute, its first value), so a history need not copy the item's category into every row;
an item the catalog does not know keeps none (the key's empty default), counted in the log. The stream job
does the same for live events from `write_item_keys`'s file (streaming/java/flywheel/ItemKeys.java).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import time
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from infra.dataset import DAY_MS, AttributeSpec
from infra.settings import Settings
from streaming.adapters import source_path
from streaming.events import Event, InvalidEvent, validate
from streaming.movielens import dataset_dir, load_side_table, replay_events


log = logging.getLogger(__name__)


class HistoryError(ValueError):
    """A history file that does not match the spec; nothing of it was produced."""


def read_source(path: Path, text: Sequence[str]) -> pa.Table:
    """A CSV or Parquet file of the spec (a history, a catalog table), its `text` columns as strings
    whatever they look like ("007" stays "007", as events carry ids). In a CSV, an empty cell or "NA",
    "null", "N/A", "nan" is missing. ValueError for another kind of file."""
    if path.suffix == ".csv":
        options = pcsv.ConvertOptions(strings_can_be_null=True, column_types={c: pa.string() for c in text})
        return pcsv.read_csv(path, convert_options=options)
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        for c in (c for c in text if c in table.column_names):
            table = table.set_column(table.column_names.index(c), c, table[c].cast(pa.string()))
        return table
    raise ValueError(f"{path}: expected a .csv or .parquet file")


def source_columns(path: Path) -> list[str]:
    """A CSV's or Parquet file's column names, from its header or schema alone (a spec's preflight)."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return next(csv.reader(f), [])
    if path.suffix == ".parquet":
        return pq.read_schema(path).names
    raise ValueError(f"{path}: expected a .csv or .parquet file")


def _columns(s: Settings) -> tuple[Path, dict[str, str], list[str]]:
    """The history file, its fields' columns (user, item, type, time, request) and every column it must have."""
    h = s.spec.history
    fields = {"user": h.user, "item": h.item, "type": h.type, "time": h.time} | ({"request": h.request} if h.request else {})
    return source_path(s, h.source), fields, list(dict.fromkeys([*fields.values(), *h.context]))


def _absent(s: Settings, wanted: list[str], present: list[str]) -> None:
    absent = [c for c in wanted if c not in present]
    if absent:
        raise HistoryError(f"{s.spec.path} [events.history]: {s.spec.history.source} has no column "
                           f"{', '.join(map(repr, absent))} (it has: {', '.join(present)})")


def check_history(s: Settings) -> None:
    """The spec's history file has every column the spec names (its header only: a preflight before any
    service starts); HistoryError, in one line, if not. The rows are checked as they are replayed."""
    h = s.spec.history
    if h is None or h.source == "movielens":
        return
    path, _, wanted = _columns(s)
    try:
        present = source_columns(path)
    except (OSError, ValueError) as exc:
        raise HistoryError(f"{s.spec.path} [events.history] source: {exc}") from None
    _absent(s, wanted, present)


def item_keys(s: Settings) -> dict[str, tuple[str | None, ...]]:
    """Each item's keys as the catalog gives them, in the order of the spec's `keys`: the first value of the item
    table's category attribute, then of each further key's attribute (None: the item has none; {}: no item table
    read here, or no category). A key that is a context field (a page) is the request's: None for every item."""
    table = next((t for t in s.spec.tables if t.entity == "item"), None)
    a = table.category_attribute if table is not None else None
    if a is None:
        return {}
    of_request = s.spec.context_keys
    attributes = [a, *(next(b for b in table.attributes if b.name == k) for k in s.spec.group_by
                       if k not in of_request)]
    movielens = table.source == "movielens"
    path = dataset_dir(s) / "ml-100k.item" if movielens else source_path(s, table.source)
    if not path.exists():  # the catalog's own check says so where it is loaded (`flywheel demo`'s preflight)
        log.warning("%s: no item table to take the events' %s from", path, s.spec.key)
        return {}
    # read as the catalog reads it (feature_repo/catalog.py)
    columns = list(dict.fromkeys([table.id, *(b.column for b in attributes)]))
    rows = load_side_table(path) if movielens else read_source(path, [table.id]).select(columns).to_pylist()
    keys = {}
    for row in rows:
        values = [cell_value(b, row[b.column]) for b in attributes]  # a category (categorical) or its entries (multi)
        firsts = iter((v or [None])[0] if isinstance(v, list) else v for v in values)
        of = (next(firsts), *(None if k in of_request else next(firsts) for k in s.spec.group_by))
        if any(v is not None for v in of) and not missing(row[table.id]):
            keys[str(row[table.id])] = of
    return keys


def with_keys(s: Settings, context: dict, of_item: tuple[str | None, ...] | None) -> dict:
    """`context` with each grouping key it lacks taken from the item's (`item_keys`), as the stream job does."""
    return context | {k: v for k, v in zip(s.spec.keys, of_item or ()) if v is not None and context.get(k, "") == ""}


def item_keys_path(s: Settings) -> Path:
    """The catalog's item keys as the stream job reads them (a JSON object, item id to its keys' values)."""
    return s.paths.service_dir("flink") / "item-keys.json"


def write_item_keys(s: Settings) -> int:
    """Write `item_keys` where the stream job reads them, whole or not at all (the job reloads the file when
    it changes: a catalog loaded while the job runs reaches live events within seconds); the count written."""
    keys, path = item_keys(s), item_keys_path(s)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")  # the job's start and a `flywheel catalog` may overlap
    partial.write_text(json.dumps(keys))
    os.replace(partial, path)
    return len(keys)


class ItemKeyFile:
    """`write_item_keys`' file as a reader sees it (the ranking server: candidates sent without their
    category), read again when it changes, looked at no more than once every `recheck_s` (as the stream
    job's streaming/java/flywheel/ItemKeys.java does); a file not there or not readable: the keys read before."""

    def __init__(self, path: Path, recheck_s: float = 2.0) -> None:
        self.path, self.recheck_s = path, recheck_s
        self.keys: dict[str, list[str | None]] = {}
        self._version: tuple[int, int, int] | None = None  # the file's (mtime, inode, size): a replace changes it
        self._checked = -math.inf

    def get(self, item: str) -> str:
        """The item's key (its category), or "" when the catalog has none for it."""
        return self.values(item)[0] or ""

    def values(self, item: str) -> list[str | None]:
        """The item's keys, in the spec's order (None: the catalog has none)."""
        now = time.monotonic()
        if now - self._checked >= self.recheck_s:
            self._checked = now
            self._reload()
        return self.keys.get(item) or [None]

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            if (st.st_mtime_ns, st.st_ino, st.st_size) != self._version:
                self.keys, self._version = json.loads(self.path.read_text()), (st.st_mtime_ns, st.st_ino, st.st_size)
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("item keys %s not read, the %d read before kept: %s", self.path, len(self.keys), exc)


def cell_value(a: AttributeSpec, value: object) -> object:
    """One cell as the attribute's kind stores it (a value that does not read as its kind: missing)."""
    if a.kind == "multi":
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value if not missing(v)]
        return [] if missing(value) else [v for v in str(value).split(a.separator or None) if v]
    if missing(value):
        return None
    if a.kind == "categorical":
        return str(value)
    if a.kind == "date":  # days since the epoch (UTC) from a date, a timestamp or ISO text; a number: missing
        if not isinstance(value, (str, date, np.datetime64)):
            return None
        try:
            when = pd.Timestamp(value)
        except (TypeError, ValueError):
            return None
        if when is pd.NaT:
            return None
        when = when.tz_localize("UTC") if when.tzinfo is None else when.tz_convert("UTC")
        return when.value / 1e6 / DAY_MS
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if a.kind == "number":
        return None if math.isnan(number) else number
    return int(number) if number.is_integer() else None


def missing(value: object) -> bool:
    """A cell without a value, however its reader gives it (None, "", NaN)."""
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _ms(value: object, unit: str) -> int:
    if isinstance(value, datetime):  # a timestamp column; one without a zone is UTC
        return int((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp() * 1000)
    return int(float(value) * (1000 if unit == "s" else 1))  # type: ignore[arg-type]


def history_events(s: Settings, limit: int | None = None, before: int | None = None) -> Iterator[Event]:
    """The first `limit` events (all when None) before `before` (seconds since the epoch; all when None)."""
    spec, h = s.spec, s.spec.history
    if h is None:
        raise HistoryError(f"{spec.path}: the dataset spec declares no [events.history] to replay")
    if h.source == "movielens":
        yield from replay_events(s, limit, before)
        return
    path, fields, wanted = _columns(s)
    try:
        table = read_source(path, [c for k, c in fields.items() if k != "time"])
    except ValueError as exc:
        raise HistoryError(str(exc)) from None
    _absent(s, wanted, table.column_names)
    keys = {} if set(spec.keys) <= set(h.context) else item_keys(s)
    events, unknown = [], set()
    for n, row in enumerate(table.select(wanted).to_pylist()):
        empty = [f"{k} ({c})" for k, c in fields.items() if missing(row[c])]
        if empty:
            raise HistoryError(f"{path} row {n + 1}: no {', '.join(empty)}")
        try:
            t_ms = _ms(row[h.time], h.time_unit)
        except (TypeError, ValueError, OverflowError):
            raise HistoryError(f"{path} row {n + 1}: time {row[h.time]!r} is neither a timestamp nor a number "
                               f"of {h.time_unit} since the epoch") from None
        user, item = row[h.user], row[h.item]
        context = {c: row[c] for c in h.context if not missing(row[c])}
        if keys and any(k not in context for k in spec.keys):
            if item in keys:
                context = with_keys(s, context, keys[item])
            else:
                unknown.add(item)
        event = Event(event_id=f"{spec.name}:{h.source}:{n}", user_id=user, item_id=item, event_type=row[h.type],
                      request_id=row[h.request] if h.request else f"{spec.name}:{user}:{item}:{t_ms}",
                      event_time=t_ms, context=context)
        try:  # the checks every consumer applies, now rather than halfway through the replay
            validate(event.to_dict(), spec.type_names)
        except InvalidEvent as exc:
            raise HistoryError(f"{path} row {n + 1}: {exc.reason}") from None
        events.append(event)
    if unknown:
        log.warning("%s: %d items the catalog does not know keep no %s (e.g. %s)", path, len(unknown), spec.key,
                    ", ".join(sorted(unknown)[:3]))
    if h.negatives:
        of_item = tuple(k for k in spec.keys if k not in spec.context_keys)
        events += sampled_exposures(events, spec.exposures, h.negatives, of_item, f"{spec.name}:{h.source}:shown",
                                    tuple(c.name for c in spec.context))
    events.sort(key=lambda e: e.event_time)  # stable: a file's order breaks ties
    for event in events[:limit]:
        if before is not None and event.event_time >= before * 1000:
            break
        yield event


def sampled_exposures(events: list[Event], exposures: tuple[str, ...], per_item: int, keys: tuple[str, ...],
                      prefix: str, fields: tuple[str, ...] = ()) -> list[Event]:
    """Exposures (the first of `exposures`) for the requests of a history that have none (a shop's
    orders): per request, each item acted on and `per_item` times as many items the user did not act on
    there, sampled by their popularity in the history (deterministic: their ids start with `prefix`, the
    seed), all shown 1 ms before the request's first action. Each carries the item's context `keys` as its
    newest event in the history does, and the request's context `fields` (its page) as its first action does:
    the ranker learns the acted items against what else was popular, and the stream counts them as exposures."""
    requests: dict[str, list[Event]] = {}
    for e in events:
        requests.setdefault(e.request_id, []).append(e)
    counts = Counter(e.item_id for e in events)
    items, cdf = list(counts), np.cumsum(np.array(list(counts.values()), np.float64))
    keyed: dict[str, dict] = {}
    for e in sorted(events, key=lambda e: e.event_time):
        keyed.setdefault(e.item_id, {}).update((k, e.context[k]) for k in keys if k in e.context)
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:8], "little"))
    out: list[Event] = []
    for request_id, acted in requests.items():
        if any(e.event_type in exposures for e in acted):
            continue  # shown already
        first, user = min(e.event_time for e in acted), acted[0].user_id
        shown = list(dict.fromkeys(e.item_id for e in acted))
        request = {k: v for k, v in min(acted, key=lambda e: e.event_time).context.items() if k in fields}
        wanted = min(per_item * len(shown), len(items) - len(shown))
        drawn = np.searchsorted(cdf, rng.random(4 * wanted + 8) * cdf[-1], side="right")  # by popularity
        others = [i for i in dict.fromkeys(items[j] for j in drawn) if i not in shown][:wanted]
        for item in [*shown, *others]:
            out.append(Event(event_id=f"{prefix}:{len(out)}", user_id=user, item_id=item, event_type=exposures[0],
                             request_id=request_id, event_time=first - 1,
                             context=keyed.get(item, {}) | request))
    return out
