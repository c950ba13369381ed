"""The row-to-inputs transform: model inputs (Examples) from feature rows, as training reads them from
the offline store and the ranking server from the online one. One function for both, so a model sees
online what it was trained on.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from contract.examples import PAD, Examples
from contract.inputs import (ATTRIBUTES, CONTEXT_NUMBERS, CONTEXT_TOKEN_FIELDS, COUNTS, DECADES, GROUP_SHARES,
                             NUMERIC_FEATURES, TOKENS)
from infra.dataset import DAY_MS, LABEL_WEIGHT, POSITION_FIELD, AttributeSpec
from streaming.features import interest_columns, key_count_columns

Columns = pd.DataFrame | Mapping[str, Sequence]


def _numbers(column: pd.Series | Sequence) -> np.ndarray:
    """float64; missing (None, NaN, pd.NA) -> 0."""
    values = (column.to_numpy(np.float64, na_value=np.nan) if isinstance(column, pd.Series)
              else np.array(column, np.float64))  # None -> NaN
    return np.where(np.isnan(values), 0.0, values)


def _strings(column: pd.Series | Sequence) -> np.ndarray:
    values = np.array(column, dtype=object) if not isinstance(column, pd.Series) else column.to_numpy(object)
    if pd.api.types.infer_dtype(values, skipna=False) == "string":  # all str already (serving): as they are
        return values
    return np.array(["" if v is None or v != v else str(v) for v in values], dtype=object)  # v != v: NaN


def _listed(value: object) -> bool:
    """A non-empty list value (a missing one reads as None, NaN or pd.NA, depending on the reader)."""
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0


def _shared(column: Sequence) -> bool:
    """Every row holds the same object (serving: a request's rows hold their user's lists once)."""
    if not len(column):
        return False
    first = _first(column)
    return all(map(operator.is_, column, itertools.repeat(first)))  # stops at the first other (training: row 2)


def _first(column: Sequence) -> object:
    return next(iter(column))  # a Series' first value whatever its index


def _per_category(categories: np.ndarray, of_category: Callable[[str], object]) -> tuple[list, np.ndarray]:
    """`of_category` of each distinct category of the rows, and each row's index into them: rows that
    share their lists are computed per category, not per row."""
    codes, uniques = pd.factorize(categories)
    return [of_category(c) for c in uniques], codes


def _category_shares(categories: np.ndarray, keys: Sequence, values: Sequence, totals: np.ndarray | None = None
                     ) -> np.ndarray:
    """Per row, the row's category's value in `values` (a row's list, aligned with its list `keys`) over
    the row's total (default: the sum of `values`); 0 where the row has no such list or its category
    is not in it. Rows holding the same lists take the first such row's total."""
    out, memo = np.zeros(len(categories), np.float32), {}

    def shares_of(r: int, k: Any, v: Any) -> dict:
        total = (float(totals[r]) if totals is not None else float(sum(v) if _listed(v) else 0)) or 1.0
        return {c: w / total for c, w in zip(k, v)} if _listed(k) and _listed(v) else {}

    if _shared(keys) and _shared(values):  # serving: a request
        shares = shares_of(0, _first(keys), _first(values))
        per, codes = _per_category(categories, lambda c: shares.get(c, 0.0))
        return np.asarray(per, np.float32)[codes]
    for r, (category, k, v) in enumerate(zip(categories, keys, values)):
        shares = memo.get((id(k), id(v)))
        if shares is None:
            shares = memo[id(k), id(v)] = shares_of(r, k, v)
        out[r] = shares.get(category, 0.0)
    return out


def _padded_rows(rows: Sequence[tuple[str, ...]]) -> np.ndarray:
    """Lists of strings as one [N, W] array, "" padding, W the longest (>= 1). Rows that are the same
    object (a request's candidates of one category, an entity's tokens) are padded once."""
    if len(rows) > 1 and _shared(rows):  # a request's user tokens
        return np.repeat(_padded_rows(rows[:1]), len(rows), axis=0)
    first = {id(row): row for row in rows}  # the distinct rows, in order
    at = {key: j for j, key in enumerate(first)}
    width = max(1, max(map(len, first.values()), default=1))
    distinct = np.empty((len(first), width), dtype=object)
    distinct[:] = [row + (PAD,) * (width - len(row)) for row in first.values()]
    return distinct[np.fromiter(map(at.__getitem__, map(id, rows)), np.intp, len(rows))]


def _long_sequences(categories: np.ndarray, history_categories: Sequence, history_items: Sequence,
                    history_types: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the user's newest behaviors in the row's category from the long history (its categories
    each with an equal number of item slots, "" padding), and their types: [N, K] each, K the widest
    found (>= 1)."""
    none: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    def by_category(cats: Any, items: Any, types: Any) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """A user's long history split by category (stored lists; missing: None or NaN)."""
        if not (_listed(cats) and _listed(items)):
            return {}
        k = len(items) // len(cats)
        types = types if _listed(types) and len(types) == len(items) else [PAD] * len(items)
        out = {}
        for j, c in enumerate(cats):
            kept = [(i, t) for i, t in zip(items[j * k:(j + 1) * k], types[j * k:(j + 1) * k]) if i != PAD]
            out[c] = (tuple(i for i, _ in kept), tuple(t for _, t in kept))
        return out

    if _shared(history_categories) and _shared(history_items):  # serving: a request, per category
        lists = by_category(_first(history_categories), _first(history_items), _first(history_types))
        per, codes = _per_category(categories, lambda c: lists.get(c, none))
        return (_padded_rows([items for items, _ in per])[codes], _padded_rows([kinds for _, kinds in per])[codes])
    rows: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    memo: dict[tuple[int, int], dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {}
    for category, cats, items, types in zip(categories, history_categories, history_items, history_types):
        found = memo.get((id(cats), id(items)))
        if found is None:
            found = memo[id(cats), id(items)] = by_category(cats, items, types)
        rows.append(found.get(category, none))
    return _padded_rows([items for items, _ in rows]), _padded_rows([kinds for _, kinds in rows])


def _entries(value: object) -> list:
    """A stored value as a list of its non-empty entries: none for missing (None, NaN, pd.NA)."""
    if isinstance(value, str):
        return [value] if value else []
    return [v for v in value if v] if _listed(value) else []  # type: ignore[union-attr]


def _token_row(prefixes: Sequence[str], values: Sequence) -> tuple[str, ...]:
    return tuple(f"{prefix}:{v}" for prefix, value in zip(prefixes, values) for v in _entries(value))


def entity_tokens(column: str, values: Mapping[str, object]) -> tuple[str, ...]:
    """One entity's tokens of `column` (TOKENS) from its raw feature values: what `to_examples` builds
    per row, for a caller that holds each entity once (serving, for the entities it caches)."""
    pairs = TOKENS[column]
    return _token_row([prefix for prefix, _ in pairs],
                      [_decade_of(values[f]) if f in DECADES else values[f] for _, f in pairs])


def _tokens(column: str, features: Columns) -> np.ndarray:
    """Per row, the tokens of `column` (TOKENS): [N, T]. A caller may pass them per row, built by
    `entity_tokens` (the same tuple object for an entity's rows)."""
    if column in features:
        return _padded_rows(list(features[column]))
    pairs = TOKENS[column]
    prefixes = [prefix for prefix, _ in pairs]
    columns = [_decade(features[f]) if f in DECADES else features[f] for _, f in pairs]
    memo: dict[tuple[int, ...], tuple[str, ...]] = {}  # serving: a user's values are one object per column
    rows = []
    for values in zip(*columns):
        key = tuple(map(id, values))
        row = memo.get(key)
        if row is None:
            row = memo[key] = _token_row(prefixes, values)
        rows.append(row)
    return _padded_rows(rows)


def _context_tokens(features: Columns, n: int) -> np.ndarray:
    """Per row, the request's context read as tokens (CONTEXT_TOKEN_FIELDS, each field's value as
    `ContextSpec.value` gives it, the default applied): [N, C], one column per field, "<name>:<value>", PAD where a
    field has none."""
    out = np.full((n, max(1, len(CONTEXT_TOKEN_FIELDS))), PAD, dtype=object)
    for j, name in enumerate(CONTEXT_TOKEN_FIELDS):
        if name in features:
            out[:, j] = [f"{name}:{v}" if v else PAD for v in _strings(features[name])]
    return out


def _decade_of(value: object) -> str | None:
    """A year or an age as its decade ("1990s", "20s"); None where missing (None, NaN, pd.NA) or 0."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f"{int(number) // 10 * 10}s" if number > 0 else None  # NaN > 0 is False


def _decade(column: pd.Series | Sequence) -> list[str | None]:
    """Each value's `_decade_of`, one string object per decade (rows memoize tokens by identity)."""
    names: dict[str | None, str | None] = {}
    return [names.setdefault(d, d) for d in map(_decade_of, _numbers(column))]


def _sequences(features: Columns, times_ms: np.ndarray, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the newest `sequence_length` behaviors before the row's time and their types, newest
    first: [N, L] each, "" padding."""
    n, names = len(times_ms), ("seq_item_ids", "seq_event_types", "seq_event_times")
    if n > 1 and all(_shared(features[name]) for name in names) and (times_ms == times_ms[0]).all():
        row, row_types = _sequences({name: [_first(features[name])] for name in names}, times_ms[:1], sequence_length)
        return np.repeat(row, n, axis=0), np.repeat(row_types, n, axis=0)  # serving: a request's one history
    sequences = np.full((n, sequence_length), PAD, dtype=object)
    types = np.full((n, sequence_length), PAD, dtype=object)
    runs: list[list] = []  # [first row, end row, behaviors, types]: consecutive rows with the same sequence
    last: tuple = (None, None, None)
    for r, (items, kinds, times) in enumerate(zip(*(features[name] for name in names))):
        if not _listed(items) or not _listed(times):
            continue
        if items is last[0] and times is last[1] and times_ms[r] == last[2] and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            kinds = kinds if _listed(kinds) and len(kinds) == len(items) else [PAD] * len(items)
            before = [(i, k) for i, k, t in zip(items, kinds, times) if t < times_ms[r]][::-1][:sequence_length]
            last = (items, times, times_ms[r])  # newest first
            runs.append([r, r + 1, [i for i, _ in before], [k for _, k in before]])
    for first, end, before, kinds in runs:
        sequences[first:end, : len(before)] = before
        types[first:end, : len(kinds)] = kinds
    return sequences, types


def attribute_input(a: AttributeSpec, values: pd.Series | Sequence, times_ms: np.ndarray) -> np.ndarray:
    """A numeric attribute's model input for requests at `times_ms`: max(x - origin, 0) * scale, where x is the
    stored value, or for a date (stored as days since the epoch) its age in days at the request; missing: 0."""
    x = _numbers(values)
    if a.kind == "date":  # the same at training (the request's time) and serving (now): no skew by design
        x = np.where(x != 0, np.asarray(times_ms, np.float64) / DAY_MS - x, 0.0)
    return np.maximum(x - a.origin, 0.0) * a.scale


# Each further key's derived input: (key, whether it is the interest histogram's share).
OF_GROUP = {name: (key, n == 1) for key, names in GROUP_SHARES.items() for n, name in enumerate(names)}


def _group_share(features: Columns, key: str, interest: bool) -> np.ndarray:
    """Per row, the row's value of `key` (a brand) as a share of the user's interest histogram over the key, or
    of the user's exposures (its (user, value) count over the user's total; at most 1: two views, two writes)."""
    values = _strings(features[key])
    if interest:
        return _category_shares(values, *(features[c] for c in interest_columns(key)))
    impressions = key_count_columns(key)[0]
    share = _numbers(features[impressions]) / np.maximum(_numbers(features["user_impressions_total"]), 1.0)
    return np.minimum(share, 1.0).astype(np.float32)


def to_examples(features: Columns, times_ms: np.ndarray, labels: np.ndarray, sequence_length: int) -> Examples:
    """Model inputs from feature rows (a frame as `get_historical_features` returns it, or columns of
    values as the online store holds them) for requests at `times_ms`, with every numeric feature of
    NUMERIC_FEATURES (each model takes its own, a number context field's among them) and, from a column per
    declared context field, the request's context tokens; from a `position` column (the training join's), each
    exposure's rank, and from a `label_weight` column each example's weight. `labels` [N], or [N, K]: each objective's
    (the first's are the labels). Serving uses the same function (no rank: scored as at the top)."""
    labels = np.asarray(labels, np.float32)
    objectives = labels if labels.ndim == 2 else labels[:, None]
    labels = objectives[:, 0]
    n = len(labels)
    categories = _strings(features["category"])
    numeric = np.zeros((n, len(NUMERIC_FEATURES)), np.float32)
    sequences, types = _sequences(features, times_ms, sequence_length)
    item_ids = _strings(features["item_id"])
    for j, name in enumerate(NUMERIC_FEATURES):
        if name == "user_item_repeats":
            numeric[:, j] = np.log1p((sequences == item_ids[:, None]).sum(axis=1))
        elif name == "history_category_share":
            numeric[:, j] = _category_shares(categories, features["history_categories"],
                                             features["history_category_counts"], _numbers(features["history_length"]))
        elif name == "interest_category_share":
            numeric[:, j] = _category_shares(categories, features["interest_categories"], features["interest_weights"])
        elif name in OF_GROUP:
            numeric[:, j] = _group_share(features, *OF_GROUP[name])
        elif name in CONTEXT_NUMBERS:  # the request's number, as `ContextSpec.value` gives it (none given: 0)
            field = CONTEXT_NUMBERS[name]
            numeric[:, j] = _numbers(features[field]) if field in features else 0.0
        elif name in ATTRIBUTES:  # the catalog's numbers as the spec scales them (a missing one: 0)
            numeric[:, j] = attribute_input(ATTRIBUTES[name], features[name], times_ms)
        else:
            values = _numbers(features[name])
            numeric[:, j] = np.log1p(np.maximum(values, 0.0)) if name in COUNTS else values
    long, long_types = _long_sequences(categories, features["history_categories"], features["history_item_ids"],
                                       features["history_event_types"])
    return Examples(user_ids=_strings(features["user_id"]), item_ids=item_ids,
                    categories=categories, sequences=sequences, numeric=numeric,
                    labels=labels, sequence_types=types,
                    long_sequences=long, long_types=long_types,
                    item_tokens=_tokens("item_tokens", features), user_tokens=_tokens("user_tokens", features),
                    context_tokens=_context_tokens(features, n),
                    positions=np.asarray(features[POSITION_FIELD], np.int32) if POSITION_FIELD in features else None,
                    weights=np.asarray(features[LABEL_WEIGHT], np.float32) if LABEL_WEIGHT in features else None,
                    objectives=objectives, numeric_names=NUMERIC_FEATURES)
