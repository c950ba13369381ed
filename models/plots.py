"""Figures logged with every training run: ROC, calibration and loss curves."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display; figures go to MLflow

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def roc(labels: np.ndarray, scores: np.ndarray) -> Figure:
    order = np.argsort(-scores, kind="mergesort")
    y = labels[order] > 0.5
    tpr = np.concatenate([[0.0], np.cumsum(y) / max(y.sum(), 1)])
    fpr = np.concatenate([[0.0], np.cumsum(~y) / max((~y).sum(), 1)])
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot(fpr, tpr)
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (test window)")
    return fig


def calibration(labels: np.ndarray, probabilities: np.ndarray, bins: int = 10) -> Figure:
    edges = np.quantile(probabilities, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, probabilities, side="right") - 1, 0, bins - 1)
    predicted = [probabilities[which == b].mean() for b in range(bins) if (which == b).any()]
    observed = [labels[which == b].mean() for b in range(bins) if (which == b).any()]
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot(predicted, observed, marker="o")
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey")
    ax.set(xlabel="mean predicted CTR", ylabel="observed CTR", title="Calibration (test window)")
    return fig


def losses(train: list[float], validation_auc: list[float]) -> Figure:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    epochs = range(1, len(train) + 1)
    ax.plot(epochs, train, marker="o", label="train logloss")
    ax.plot(epochs, validation_auc, marker="s", label="validation AUC")
    ax.set(xlabel="epoch", title="Training")
    ax.legend()
    return fig
