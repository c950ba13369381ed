"""Past events as the dataset spec declares them (`[events.history]`), in event-time order: MovieLens'
ratings through its bundled replay, or a CSV or Parquet file through the spec's column mapping.

A file is checked whole before its first event is yielded: a declared column it lacks, a row without a
user, item, type or time, a time that reads as neither a timestamp nor a number, or a row the event schema
refuses (an undeclared type, an id too long, a time outside 1970-2100) is refused with the file and the
row, so a replay never stops halfway. Ids are read as text ("007" stays "007"); a timestamp without a time
zone is UTC.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from infra.settings import Settings
from streaming.events import Event, InvalidEvent, validate
from streaming.movielens import replay_events


class HistoryError(ValueError):
    """A history file that does not match the spec; nothing of it was produced."""


def _read(path, text: list[str]) -> pa.Table:
    """The file, the `text` columns as strings whatever they look like."""
    if path.suffix == ".csv":
        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in text}))
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        for c in (c for c in text if c in table.column_names):
            table = table.set_column(table.column_names.index(c), c, table[c].cast(pa.string()))
        return table
    raise HistoryError(f"{path}: expected a .csv or .parquet file")


def _missing(value: object) -> bool:
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
    path = spec.source_path(h.source)
    fields = {"user": h.user, "item": h.item, "type": h.type, "time": h.time} | ({"request": h.request} if h.request else {})
    table = _read(path, [c for k, c in fields.items() if k != "time"])
    wanted = list(dict.fromkeys([*fields.values(), *h.context]))
    absent = [c for c in wanted if c not in table.column_names]
    if absent:
        raise HistoryError(f"{spec.path} [events.history]: {h.source} has no column {', '.join(map(repr, absent))} "
                           f"(it has: {', '.join(table.column_names)})")
    events = []
    for n, row in enumerate(table.select(wanted).to_pylist()):
        empty = [f"{k} ({c})" for k, c in fields.items() if _missing(row[c])]
        if empty:
            raise HistoryError(f"{path} row {n + 1}: no {', '.join(empty)}")
        try:
            t_ms = _ms(row[h.time], h.time_unit)
        except (TypeError, ValueError, OverflowError):
            raise HistoryError(f"{path} row {n + 1}: time {row[h.time]!r} is neither a timestamp nor a number "
                               f"of {h.time_unit} since the epoch") from None
        user, item = row[h.user], row[h.item]
        event = Event(event_id=f"{spec.name}:{h.source}:{n}", user_id=user, item_id=item, event_type=row[h.type],
                      request_id=row[h.request] if h.request else f"{spec.name}:{user}:{item}:{t_ms}",
                      event_time=t_ms, context={c: row[c] for c in h.context if not _missing(row[c])})
        try:  # the checks every consumer applies, now rather than halfway through the replay
            validate(event.to_dict(), spec.type_names)
        except InvalidEvent as exc:
            raise HistoryError(f"{path} row {n + 1}: {exc.reason}") from None
        events.append(event)
    events.sort(key=lambda e: e.event_time)  # stable: a file's order breaks ties
    for event in events[:limit]:
        if before is not None and event.event_time >= before * 1000:
            break
        yield event
