"""Classical recall baselines the candidate sources are judged against (`make bench-retrieval`): the
lists a practitioner tries first. Each takes the users' positives before a cut and gives a user the k
best items they have not seen.

  EASE      Steck, "Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019: item-item weights
            B = I - P / diag(P), P = (X'X + lambda I)^-1, the diagonal forced to 0; a user's scores x B.
  item-kNN  Sarwar et al., WWW 2001: cosine similarity of the items' user columns, each item's
            `neighbours` best kept; a user's score for j, the sum of j's similarity to their items.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import numpy as np

from models.recall import top_k


class Interactions:
    """The binary user x item matrix of positives: X [U, I] float32."""

    def __init__(self, positives: Sequence[tuple[str, str]]) -> None:
        self.users = sorted({u for u, _ in positives})
        self.items = sorted({i for _, i in positives})
        self.user_index = {u: j for j, u in enumerate(self.users)}
        item_index = {i: j for j, i in enumerate(self.items)}
        self.x = np.zeros((len(self.users), len(self.items)), np.float32)
        for u, i in positives:
            self.x[self.user_index[u], item_index[i]] = 1.0

    def lists(self, weights: np.ndarray, users: Sequence[str], k: int, seen: dict[str, Set[str]]
              ) -> dict[str, list[str]]:
        """Each user's k best items by x_u @ weights [I, I], skipping what they have seen."""
        return {u: top_k(self.x[self.user_index[u]] @ weights, self.items, k, seen.get(u, frozenset()))
                if u in self.user_index else [] for u in users}


def ease(x: np.ndarray, l2: float = 500.0) -> np.ndarray:
    """EASE's item-item weights [I, I] of X [U, I] (`l2`: lambda, the paper's MovieLens range)."""
    gram = x.T.astype(np.float64) @ x + l2 * np.eye(x.shape[1])
    p = np.linalg.inv(gram)
    b = -p / np.diag(p)
    np.fill_diagonal(b, 0.0)
    return b.astype(np.float32)


def item_knn(x: np.ndarray, neighbours: int = 100) -> np.ndarray:
    """Item-kNN's weights [I, I] of X [U, I]: cosine similarity, each item's `neighbours` best kept
    (row i holds the items similar to i), no self-similarity."""
    norms = np.sqrt((x * x).sum(axis=0))
    sim = (x.T @ x) / np.maximum(np.outer(norms, norms), 1e-12)
    np.fill_diagonal(sim, 0.0)
    if neighbours < sim.shape[1]:
        cut = np.argpartition(-sim, neighbours, axis=1)[:, neighbours:]
        np.put_along_axis(sim, cut, 0.0, axis=1)
    return sim.astype(np.float32)
