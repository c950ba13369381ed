"""Past events as the dataset spec declares them (`[events.history]`), in event-time order: MovieLens'
ratings through its bundled replay, or a CSV or Parquet file through the spec's column mapping.

A file is checked whole before its first event is yielded: a declared column it lacks, a row without a
user, item, type or time, or an event type the spec does not declare is refused with the file and the row,
so a replay never stops halfway.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from infra.settings import Settings
from streaming.events import Event
from streaming.movielens import replay_events


class HistoryError(ValueError):
    """A history file that does not match the spec; nothing of it was produced."""


def _read(path) -> pa.Table:
    if path.suffix == ".csv":
        return pcsv.read_csv(path)
    if path.suffix == ".parquet":
        return pq.read_table(path)
    raise HistoryError(f"{path}: expected a .csv or .parquet file")


def _missing(value: object) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _ms(value: object, unit: str) -> int:
    if isinstance(value, datetime):  # a timestamp column
        return int(value.timestamp() * 1000)
    return int(float(value) * (1000 if unit == "s" else 1))


def history_events(s: Settings, limit: int | None = None, before: int | None = None) -> Iterator[Event]:
    """The first `limit` events (all when None) before `before` (seconds since the epoch; all when None)."""
    spec, h = s.spec, s.spec.history
    if h is None:
        raise HistoryError(f"{spec.path}: the dataset spec declares no [events.history] to replay")
    if h.source == "movielens":
        yield from replay_events(s, limit, before)
        return
    path = spec.source_path(h.source)
    table = _read(path)
    fields = {"user": h.user, "item": h.item, "type": h.type, "time": h.time} | ({"request": h.request} if h.request else {})
    wanted = list(dict.fromkeys([*fields.values(), *h.context]))
    absent = [c for c in wanted if c not in table.column_names]
    if absent:
        raise HistoryError(f"{spec.path} [events.history]: {h.source} has no column {', '.join(map(repr, absent))} "
                           f"(it has: {', '.join(table.column_names)})")
    rows = table.select(wanted).to_pylist()
    for n, row in enumerate(rows):
        empty = [f"{k} ({c})" for k, c in fields.items() if _missing(row[c])]
        if empty:
            raise HistoryError(f"{path} row {n + 1}: no {', '.join(empty)}")
        if str(row[h.type]) not in spec.type_names:
            raise HistoryError(f"{path} row {n + 1}: event type {row[h.type]!r} is not declared in {spec.path} "
                               f"(declared: {', '.join(spec.type_names)})")
    times = [_ms(row[h.time], h.time_unit) for row in rows]
    order = sorted(range(len(rows)), key=times.__getitem__)  # stable: a file's order breaks ties
    for n in order[:limit]:
        row, t_ms = rows[n], times[n]
        if before is not None and t_ms >= before * 1000:
            break
        user, item = str(row[h.user]), str(row[h.item])
        yield Event(event_id=f"{spec.name}:{h.source}:{n}", user_id=user, item_id=item, event_type=str(row[h.type]),
                    request_id=str(row[h.request]) if h.request else f"{spec.name}:{user}:{item}:{t_ms}",
                    event_time=t_ms, context={c: row[c] for c in h.context if not _missing(row[c])})
