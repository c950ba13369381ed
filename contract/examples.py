"""Training and scoring examples: what the dataset builder produces and the models consume."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

PAD = ""  # a padding slot of a behavior sequence


ARRAYS = ("user_ids", "item_ids", "categories", "sequences", "numeric", "labels", "sequence_types",
          "long_sequences", "long_types", "item_tokens", "user_tokens", "context_tokens", "positions",
          "weights", "objectives")


@dataclass
class Examples:
    """N examples, as numpy arrays. Ids are raw strings. A sequence holds the user's behaviors before
    the example, newest first, padded with PAD at the end; the token lists are padded the same way.
    `numeric_names` names the numeric columns (empty: exactly the consuming model's features)."""

    user_ids: np.ndarray  # [N] str
    item_ids: np.ndarray  # [N] str
    categories: np.ndarray  # [N] str
    sequences: np.ndarray  # [N, L] str
    numeric: np.ndarray  # [N, F] float32
    labels: np.ndarray  # [N] float32, 1.0 = clicked
    sequence_types: np.ndarray | None = None  # [N, L] str: each behavior's event type
    # [N, K] str: the user's newest behaviors in the candidate's category, from the long history
    long_sequences: np.ndarray | None = None
    long_types: np.ndarray | None = None  # [N, K] str: their strongest actions (impression, click, ...)
    item_tokens: np.ndarray | None = None  # [N, T] str: the candidate's attributes ("genre:Drama", ...)
    user_tokens: np.ndarray | None = None  # [N, T] str: the user's ("gender:F", ...)
    # [N, C] str: the request's declared context, one column per field in the spec's order ("page:search", ...)
    context_tokens: np.ndarray | None = None
    # [N] int32: the exposure's rank in the list that showed it (0: the top, or unknown), a training input only
    positions: np.ndarray | None = None
    # [N] float32: how much the example weighs in training (a label's declared value over its window's mean), 1 if none
    weights: np.ndarray | None = None
    # [N, K] float32: each objective's label (`[objectives]`; column 0 is `labels`), the labels alone if not given
    objectives: np.ndarray | None = None
    numeric_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.labels)
        for name in ("sequence_types", "long_sequences", "long_types", "item_tokens", "user_tokens", "context_tokens"):
            if getattr(self, name) is None:  # not given: no such input (all padding)
                width = (self.sequences.shape[1] if name == "sequence_types" else
                         self.long_sequences.shape[1] if name == "long_types" else 1)
                setattr(self, name, np.full((n, width), PAD, dtype=object))
        if self.positions is None:
            self.positions = np.zeros(n, np.int32)
        if self.weights is None:
            self.weights = np.ones(n, np.float32)
        if self.objectives is None:
            self.objectives = np.asarray(self.labels, np.float32).reshape(n, 1)
        elif not np.array_equal(self.objectives[:, 0], self.labels):  # the labels are the first's (replaced ones too)
            self.objectives = np.column_stack([self.labels, self.objectives[:, 1:]]).astype(np.float32)
        for name in ARRAYS:
            if len(getattr(self, name)) != n:
                raise ValueError(f"examples: {name} has {len(getattr(self, name))} rows, labels {n}")
        if self.numeric_names and len(self.numeric_names) != self.numeric.shape[1]:
            raise ValueError(f"examples: {self.numeric.shape[1]} numeric columns, {len(self.numeric_names)} names")

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray | slice) -> Examples:
        return Examples(**{name: getattr(self, name)[index] for name in ARRAYS}, numeric_names=self.numeric_names)

    def numeric_of(self, features: tuple[str, ...]) -> np.ndarray:
        """The numeric columns of `features`, in that order: [N, len(features)] float32."""
        if not self.numeric_names or self.numeric_names == features:
            return self.numeric
        missing = [f for f in features if f not in self.numeric_names]
        if missing:
            raise ValueError(f"examples lack numeric features {missing}")
        return self.numeric[:, [self.numeric_names.index(f) for f in features]]


# The scoring frame's list columns (each row's non-padding entries) and the Examples array of each.
LIST_COLUMNS = {"sequence": "sequences", "sequence_types": "sequence_types", "long_sequence": "long_sequences",
                "long_types": "long_types", "item_tokens": "item_tokens", "user_tokens": "user_tokens",
                "context_tokens": "context_tokens"}


def to_frame(ex: Examples, numeric_features: tuple[str, ...]) -> pd.DataFrame:
    """The scoring input of a registered model (`models:/<name>@champion`): one row per example, the
    list columns (`sequence`: item ids, newest first; `sequence_types`, `long_sequence`, `long_types`,
    `item_tokens`, `user_tokens`, `context_tokens`) as lists, one column per numeric feature."""
    frame = pd.DataFrame({"user_id": ex.user_ids, "item_id": ex.item_ids, "category": ex.categories} | {
        column: [[i for i in row if i != PAD] for row in getattr(ex, name)] for column, name in LIST_COLUMNS.items()})
    for j, name in enumerate(numeric_features):
        frame[name] = ex.numeric_of(numeric_features)[:, j]
    return frame


def _padded(lists, width: int) -> np.ndarray:
    out = np.full((len(lists), width), PAD, dtype=object)
    for n, items in enumerate(lists):
        items = list(items)[:width]
        out[n, : len(items)] = items
    return out


def from_frame(frame: pd.DataFrame, numeric_features: tuple[str, ...], sequence_length: int) -> Examples:
    """`to_frame`'s layout back as examples; list columns other than `sequence` may be left out."""
    missing = [c for c in ("user_id", "item_id", "category", "sequence", *numeric_features) if c not in frame]
    if missing:
        raise ValueError(f"scoring input lacks columns {missing}")
    lists = {name: _padded(frame[column], sequence_length if name in ("sequences", "sequence_types") else max(
        1, max((len(v) for v in frame[column]), default=1))) for column, name in LIST_COLUMNS.items() if column in frame}
    return Examples(frame["user_id"].astype(str).to_numpy(object), frame["item_id"].astype(str).to_numpy(object),
                    frame["category"].astype(str).to_numpy(object), lists.pop("sequences"),
                    frame[list(numeric_features)].to_numpy(np.float32).reshape(len(frame), -1),
                    np.zeros(len(frame), np.float32), **lists)


def concat(parts: list[Examples]) -> Examples:
    """The examples of `parts`, in order. A list input is padded (PAD) to the widest of the parts: requests
    differ in a user's attribute count, their candidates' genre counts, their sequences' lengths, and
    padding is what a consuming model ignores, so each part scores as it does alone."""
    if len(parts) == 1:
        return parts[0]
    if len({p.objectives.shape[1] for p in parts}) > 1:
        raise ValueError(f"examples labelled for {sorted({p.objectives.shape[1] for p in parts})} objectives: "
                         "parts to join must label the same ones")
    arrays = {}
    for name in ARRAYS:
        values = [getattr(p, name) for p in parts]
        if name in LIST_COLUMNS.values():
            width = max(v.shape[1] for v in values)
            values = [fit_width(v, width) for v in values]
        arrays[name] = np.concatenate(values)
    return Examples(**arrays, numeric_names=parts[0].numeric_names)


def fit_width(lists: np.ndarray, width: int) -> np.ndarray:
    """A padded list array cut or padded (PAD) to `width` columns (at least 1)."""
    width = max(1, width)
    if lists.shape[1] >= width:
        return lists[:, :width]
    out = np.full((len(lists), width), PAD, dtype=object)
    out[:, : lists.shape[1]] = lists
    return out
