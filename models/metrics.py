"""Quality metrics of click predictions (numpy only, so every environment can compute them)."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random click scores above a random
    non-click (ties count half). Needs both classes."""
    labels = np.asarray(labels) > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if not positives or not negatives:
        raise ValueError(f"AUC needs clicks and non-clicks; got {positives} and {negatives}")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = np.asarray(scores)[order]
    ranks = np.empty(len(order), np.float64)
    # Average rank within each run of tied scores.
    _, starts, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, count in zip(starts, counts):
        ranks[order[start:start + count]] = start + (count + 1) / 2
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


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
