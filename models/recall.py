"""Candidate sources for recommendation and their merge, with the offline measures of a candidate list.

Sources: the two-tower model's best items by its score plus a popularity prior (models/retrieval.py;
`PopularityPrior`, and `IndexFrame`, how one cosine search serves that sum), item neighbours of the user's recent
positives (the behavior graph's co-interaction score, models/graph.py), and popularity, the fallback for
a user the other two know nothing of (decayed: it follows what is popular now), and, where the spec says a
user's next positives may be items they had before, the user's own positives by their decayed count
(`recently_popular` of theirs alone: a grocery customer's staples). Merged by weighted
reciprocal-rank fusion: an item's score is the sum over the sources that list it of the source's weight
/ (60 + its rank there), so an item two sources agree on rises, and no source's score scale has to be
comparable to another's (`retrieval.source_weights`; `make bench-retrieval` tunes them on a validation
window before its split, never on its test, and serves them only where that beats the seeds' spread).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np

from infra.settings import RetrievalSettings

RRF_K = 60  # the usual constant of reciprocal-rank fusion (Cormack et al., 2009)
# The candidate sources, in `retrieval.source_weights`' order. "repeat": the user's own positives by their
# decayed count, for data whose users come back to what they had (`[events] repeats`); empty otherwise.
SOURCES = ("two-tower", "graph", "popularity", "repeat")


def top_k(scores: np.ndarray, item_ids: Sequence[str], k: int, exclude: Set[str] = frozenset()) -> list[str]:
    """The k best-scored items, skipping `exclude`."""
    out = []
    for j in np.argsort(-scores, kind="stable"):
        if item_ids[j] not in exclude:
            out.append(item_ids[j])
            if len(out) == k:
                break
    return out


def popular(positives: Iterable[str]) -> list[str]:
    """Items by number of positives, most first (ties by id)."""
    counts = Counter(positives)
    return sorted(counts, key=lambda i: (-counts[i], i))


def log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b), without leaving the log domain (no overflow for any a, b)."""
    hi, lo = max(a, b), min(a, b)
    return hi + math.log2(1.0 + 2.0 ** (lo - hi))


def decayed(positives: Iterable[tuple[str, float]], half_life_s: float) -> dict[str, float]:
    """Each item's decayed popularity, as log2 of a running sum: at any moment `now`, an item's positives
    (item, time s) weigh sum 2^(-(now - t) / half-life) = 2^(-now / half-life) x sum 2^(t / half-life); the
    first factor is common to every item, so an item keeps log2(sum 2^(t / half-life)), a running sum
    (`log2_add`) that never needs rescaling as time passes and never overflows (serving/nearline.py keeps
    it in Redis). Its decayed count at `now` is 2^(score - now / half-life)."""
    scores: dict[str, float] = {}
    for item, t in positives:
        w = t / half_life_s
        scores[item] = log2_add(scores[item], w) if item in scores else w
    return scores


def recently_popular(positives: Iterable[tuple[str, float]], half_life_s: float) -> list[str]:
    """Items by decayed popularity (`decayed`), most first (ties by id): the popularity source /recommend
    serves, as the benchmark judges it."""
    scores = decayed(positives, half_life_s)
    return sorted(scores, key=lambda i: (-scores[i], i))


@dataclass(frozen=True)
class PopularityPrior:
    """What the two-tower source adds to cos(u, i) / T: weight x ln(max(c_i, floor)), c_i item i's decayed
    positives now (models/recall.py `decayed`, the popularity source's definition and half-life). The floor
    stands for an item with (almost) no recent positives. Weight 0: the model alone."""

    weight: float
    floor: float
    half_life_s: float

    def __post_init__(self) -> None:
        if not (self.weight >= 0 and self.floor > 0 and self.half_life_s > 0):
            raise ValueError(f"retrieval: popularity_prior >= 0, prior_floor > 0 and popularity_half_life_days > 0, "
                             f"got {self.weight}, {self.floor}, {self.half_life_s / 86_400}")

    @classmethod
    def of(cls, r: RetrievalSettings) -> PopularityPrior:
        return cls(r.popularity_prior, r.prior_floor, r.popularity_half_life_days * 86_400)

    @property
    def headroom(self) -> float:
        """How far a prior may rise past an index's frame before it is redrawn: a 16-fold rise of an item's
        count over the frame's time (new positives, or four half-lives of time passing, as the frame's time
        stays put). Each redraw rewrites every item's vector."""
        return self.weight * math.log(16)

    def values(self, log2_scores: Mapping[str, float], item_ids: Sequence[str], now_s: float) -> np.ndarray:
        """(n,) each item's prior at `now_s` from its log2 running sum (`decayed`; an item without one: the floor)."""
        x = np.array([log2_scores.get(i, -np.inf) for i in item_ids], "float64") - now_s / self.half_life_s
        return self.weight * math.log(2) * np.maximum(x, math.log2(self.floor))


@dataclass(frozen=True)
class IndexFrame:
    """How item vectors carry their prior in a cosine index: [v / T, prior - center, pad], the pad giving every
    item the one norm N = sqrt(1 / T^2 + reach^2); a query [u, 1, 0] then has cosine
    (u.v / T + prior - center) / (|q| N) with every item: the order of the score (maximum inner product by cosine: Bachrach et al., RecSys 2014). Every
    prior in one index is taken at the frame's time `at` (decay scales all counts alike, so the order holds
    as time passes); a prior may rise by `headroom` past the range it was framed for before the frame must
    be drawn again."""

    temperature: float
    at: float  # seconds: the time every prior of the index is taken at
    center: float
    reach: float  # the largest |prior - center| the frame holds

    @classmethod
    def around(cls, prior: np.ndarray, temperature: float, at: float, headroom: float) -> IndexFrame:
        lo, hi = (float(prior.min()), float(prior.max())) if len(prior) else (0.0, 0.0)
        return cls(temperature, at, (lo + hi) / 2, (hi - lo) / 2 + headroom)

    def holds(self, prior: np.ndarray) -> bool:
        return bool(np.all(np.abs(prior - self.center) <= self.reach))

    def index_vectors(self, items: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """(n, D + 2) float32 from unit item vectors (n, D) and their priors (n,) within the frame."""
        shifted = prior - self.center
        norm2 = 1 / self.temperature ** 2 + self.reach ** 2
        pad = np.sqrt(np.maximum(norm2 - (items ** 2).sum(1) / self.temperature ** 2 - shifted ** 2, 0.0))
        return np.column_stack([items / self.temperature, shifted, pad]).astype("float32")


def query_vectors(users: np.ndarray) -> np.ndarray:
    """(B, D + 2) float32: user vectors (B, D) as queries of an index of `IndexFrame.index_vectors`."""
    return np.column_stack([users, np.ones(len(users)), np.zeros(len(users))]).astype("float32")


def co_interaction(weighted: Iterable[tuple[str, str, float]], keep: int) -> dict[str, list[tuple[str, float]]]:
    """Per item, its `keep` best neighbours by score(i, j) = sum over users u of w(u, i) * w(u, j), from
    (user, item, weight) rows: the graph store's item_neighbours, computed in memory."""
    by_user: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for user, item, w in weighted:
        by_user[user][item] += w
    scores: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for items in by_user.values():
        for i, wi in items.items():
            for j, wj in items.items():
                if i != j:
                    scores[i][j] += wi * wj
    return {i: sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:keep] for i, row in scores.items()}


def neighbours_of(recent: Sequence[str], neighbours: Mapping[str, Sequence[tuple[str, float]]], k: int,
                  exclude: Set[str] = frozenset()) -> list[str]:
    """Graph recall: items neighbouring the user's recent positives, by summed neighbour score."""
    scores: dict[str, float] = defaultdict(float)
    for item in recent:
        for other, score in neighbours.get(item, ()):
            if other not in exclude:
                scores[other] += score
    return sorted(scores, key=lambda i: (-scores[i], i))[:k]


def source_weights(values: Sequence[float]) -> dict[str, float]:
    """The merge's weights by source from `retrieval.source_weights` (one per SOURCES, in its order). Each
    is > 0: every source stays in (popularity is what a user nobody knows gets)."""
    if len(values) != len(SOURCES) or any(not w > 0 for w in values):
        raise ValueError(f"retrieval.source_weights: one weight > 0 per source {SOURCES}, got {tuple(values)}")
    return dict(zip(SOURCES, map(float, values)))


def merge(sources: Mapping[str, Sequence[str]], k: int, weights: Mapping[str, float] | None = None
          ) -> list[tuple[str, float, list[str]]]:
    """Weighted reciprocal-rank fusion of the sources' lists (weight 1 for a source `weights` does not
    name): (item, fused score, the sources that listed it), best first, at most k."""
    fused: dict[str, float] = defaultdict(float)
    named: dict[str, list[str]] = defaultdict(list)
    for name, items in sources.items():
        weight = 1.0 if weights is None else weights.get(name, 1.0)
        for rank, item in enumerate(items):
            fused[item] += weight / (RRF_K + rank + 1)
            named[item].append(name)
    best = sorted(fused, key=lambda i: (-fused[i], i))[:k]
    return [(i, fused[i], named[i]) for i in best]


def recall_at_k(listed: Sequence[str], relevant: set[str], k: int) -> float:
    """Share of the relevant items among the first k listed."""
    return len(set(listed[:k]) & relevant) / len(relevant) if relevant else 0.0


def ndcg_at_k(listed: Sequence[str], relevant: set[str], k: int) -> float:
    """Discounted cumulative gain of the first k listed (binary relevance), over the best possible."""
    gain = sum(1.0 / np.log2(r + 2) for r, item in enumerate(listed[:k]) if item in relevant)
    ideal = sum(1.0 / np.log2(r + 2) for r in range(min(k, len(relevant))))
    return gain / ideal if ideal else 0.0
