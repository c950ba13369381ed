"""Quality metrics of click predictions (numpy only, so every environment can compute them)."""

from __future__ import annotations

import numpy as np

# The ranking baselines train_full(baselines=True) scores on the ranker's split: name -> its metric's suffix
# (test_auc_<suffix>).
RANKING_BASELINES = {"popularity": "popularity", "logistic regression": "logreg", "gradient-boosted trees": "gbdt"}


def best_baseline(aucs: dict[str, float]) -> tuple[str, float] | None:
    """The strongest of RANKING_BASELINES in `aucs` (name -> test AUC), if any."""
    scored = [(name, aucs[name]) for name in RANKING_BASELINES if name in aucs]
    return max(scored, key=lambda x: x[1]) if scored else None


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing their average rank."""
    order = np.argsort(x, kind="mergesort")
    _, starts, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(len(x), np.float64)
    ranks[order] = np.repeat(starts + (counts + 1) / 2, counts)
    return ranks


def _clicks(labels: np.ndarray) -> np.ndarray:
    clicks = np.asarray(labels) > 0.5
    positives, negatives = int(clicks.sum()), int((~clicks).sum())
    if not positives or not negatives:
        raise ValueError(f"AUC needs clicks and non-clicks; got {positives} and {negatives}")
    return clicks


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random click scores above a random
    non-click (ties count half). Needs both classes."""
    clicks = _clicks(labels)
    positives, negatives = int(clicks.sum()), int((~clicks).sum())
    ranks = _midranks(np.asarray(scores, np.float64))
    return float((ranks[clicks].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def auc_difference(labels: np.ndarray, scores_a: np.ndarray, scores_b: np.ndarray) -> tuple[float, float]:
    """AUC(a) - AUC(b) on the same examples and its standard error, by DeLong's method for paired
    ROC curves (DeLong et al. 1988, with Sun and Xu's midrank computation, 2014). Needs >= 2 of each class."""
    clicks = _clicks(labels)
    m, n = int(clicks.sum()), int((~clicks).sum())
    if m < 2 or n < 2:
        raise ValueError(f"an AUC's variance needs two clicks and two non-clicks; got {m} and {n}")
    per_click, per_non_click = [], []
    for scores in (scores_a, scores_b):
        x = np.asarray(scores, np.float64)
        ranks = _midranks(x)
        # A click's share of non-clicks scored below it; a non-click's share of clicks scored above it.
        per_click.append((ranks[clicks] - _midranks(x[clicks])) / n)
        per_non_click.append(1 - (ranks[~clicks] - _midranks(x[~clicks])) / m)
    difference = float(per_click[0].mean() - per_click[1].mean())
    contrast = np.array([1.0, -1.0])
    variance = contrast @ np.cov(per_click) @ contrast / m + contrast @ np.cov(per_non_click) @ contrast / n
    return difference, float(np.sqrt(max(variance, 0.0)))


def logloss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probabilities, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def calibration(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean predicted CTR over observed CTR: 1.0 is calibrated, above 1 over-predicts."""
    observed = float(np.mean(labels))
    return float(np.mean(probabilities)) / observed if observed else float("inf")


def evaluate(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    return {"auc": auc(labels, probabilities), "logloss": logloss(labels, probabilities),
            "calibration": calibration(labels, probabilities), "examples": float(len(labels)),
            "ctr": float(np.mean(labels))}


def graded_ndcg(relevance: np.ndarray, scores: np.ndarray, k: int) -> float:
    """NDCG@k of the lists ordered by `scores` against graded `relevance` (both [lists, candidates]; a gain of
    relevance / log2(rank + 1)), averaged over the lists: 1.0 orders each list's top k as its relevance does."""
    relevance, scores = np.asarray(relevance, np.float64), np.asarray(scores, np.float64)
    discount = 1.0 / np.log2(np.arange(2, min(k, relevance.shape[1]) + 2))
    ranked = np.take_along_axis(relevance, np.argsort(-scores, axis=1, kind="stable"), axis=1)[:, : len(discount)]
    ideal = -np.sort(-relevance, axis=1)[:, : len(discount)]
    return float(np.mean((ranked @ discount) / np.maximum(ideal @ discount, 1e-12)))
