"""Training and scoring examples: what the dataset builder produces and the models consume."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

PAD = ""  # a padding slot of a behavior sequence


@dataclass
class Examples:
    """N examples, as numpy arrays. Ids are raw strings. A sequence holds the user's behaviors before
    the example, newest first, padded with PAD at the end."""

    user_ids: np.ndarray  # [N] str
    item_ids: np.ndarray  # [N] str
    categories: np.ndarray  # [N] str
    sequences: np.ndarray  # [N, L] str
    numeric: np.ndarray  # [N, F] float32
    labels: np.ndarray  # [N] float32, 1.0 = clicked

    def __post_init__(self) -> None:
        n = len(self.labels)
        for name in ("user_ids", "item_ids", "categories", "sequences", "numeric"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"examples: {name} has {len(getattr(self, name))} rows, labels {n}")

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray | slice) -> Examples:
        return Examples(self.user_ids[index], self.item_ids[index], self.categories[index],
                        self.sequences[index], self.numeric[index], self.labels[index])


def to_frame(ex: Examples, numeric_features: tuple[str, ...]) -> pd.DataFrame:
    """The scoring input of a registered model (`models:/<name>@champion`): one row per example,
    `sequence` a list of item ids (newest first), one column per numeric feature."""
    frame = pd.DataFrame({"user_id": ex.user_ids, "item_id": ex.item_ids, "category": ex.categories,
                          "sequence": [[i for i in row if i != PAD] for row in ex.sequences]})
    for j, name in enumerate(numeric_features):
        frame[name] = ex.numeric[:, j]
    return frame


def from_frame(frame: pd.DataFrame, numeric_features: tuple[str, ...], sequence_length: int) -> Examples:
    missing = [c for c in ("user_id", "item_id", "category", "sequence", *numeric_features) if c not in frame]
    if missing:
        raise ValueError(f"scoring input lacks columns {missing}")
    sequences = np.full((len(frame), sequence_length), PAD, dtype=object)
    for n, items in enumerate(frame["sequence"]):
        items = list(items)[:sequence_length]
        sequences[n, : len(items)] = items
    return Examples(frame["user_id"].astype(str).to_numpy(object), frame["item_id"].astype(str).to_numpy(object),
                    frame["category"].astype(str).to_numpy(object), sequences,
                    frame[list(numeric_features)].to_numpy(np.float32).reshape(len(frame), -1),
                    np.zeros(len(frame), np.float32))


def concat(parts: list[Examples]) -> Examples:
    """The examples of `parts`, in order (their sequences must have the same width)."""
    return Examples(*(np.concatenate([getattr(p, name) for p in parts]) for name in
                      ("user_ids", "item_ids", "categories", "sequences", "numeric", "labels")))
