"""Click-prediction metrics: AUC with ties, and DeLong's paired test of an AUC difference, which the
promotion gate relies on (models/registry.py)."""

from __future__ import annotations

import numpy as np
import pytest

from models.metrics import auc, auc_difference


def _pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.fixture()
def scored() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = (rng.random(2000) < 0.3).astype(np.float32)
    strong = labels * 0.5 + rng.random(2000)
    weak = np.round(labels * 0.3 + rng.random(2000), 1)  # rounded: many ties
    return labels, strong, weak


def test_auc_counts_ties_half(scored) -> None:
    labels, strong, weak = scored
    for scores in (strong, weak):
        assert auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_delong_standard_error_agrees_with_a_bootstrap(scored) -> None:
    labels, strong, weak = scored
    difference, se = auc_difference(labels, strong, weak)
    assert difference == pytest.approx(auc(labels, strong) - auc(labels, weak), abs=1e-12)
    rng = np.random.default_rng(1)
    boot = []
    for _ in range(400):
        i = rng.integers(0, len(labels), len(labels))
        boot.append(auc(labels[i], strong[i]) - auc(labels[i], weak[i]))
    assert se == pytest.approx(float(np.std(boot)), rel=0.2)
    assert auc_difference(labels, strong, strong) == (0.0, 0.0)  # the same scorer: no difference, no noise


def test_an_auc_variance_needs_two_of_each_class() -> None:
    with pytest.raises(ValueError, match="two clicks"):
        auc_difference(np.array([1, 0, 0, 0]), np.array([0.9, 0.1, 0.2, 0.3]), np.array([0.5, 0.1, 0.2, 0.3]))
