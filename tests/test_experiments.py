"""An experiment's arms on their served outcomes: CTR intervals clustered by request that cover the truth as often
as they claim, and the ratio of the arms' CTRs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT
from serving.experiments import FROZEN, LEARNING, compare, ctr_interval, over_time, ratio_interval


def _lists(rng: np.random.Generator, requests: int, ctr: float, shown: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(clicks, items) per request of lists whose clicks go together: each request's own CTR drawn around `ctr`
    (a keen user clicks several, a hurried one none), as a real list's are."""
    keen = rng.beta(ctr * 2, (1 - ctr) * 2, requests)
    items = rng.integers(shown // 2, shown + 1, requests).astype(float)
    return rng.binomial(items.astype(int), keen).astype(float), items


def test_the_ctr_interval_covers_the_truth_95_times_in_100_where_one_over_items_would_not() -> None:
    rng = np.random.default_rng(0)
    covered, naive = [], []
    for _ in range(600):
        clicks, items = _lists(rng, 300, 0.1)
        ctr, low, high = ctr_interval(clicks, items)
        covered.append(low <= 0.1 <= high)
        half = 1.96 * np.sqrt(ctr * (1 - ctr) / items.sum())  # as if every item shown were an independent draw
        naive.append(ctr - half <= 0.1 <= ctr + half)
    assert 0.93 <= np.mean(covered) <= 0.97, np.mean(covered)
    assert np.mean(naive) < 0.85  # clustered clicks: an interval over items claims far more than it knows


def test_the_ratio_interval_covers_the_true_ratio_and_tells_a_15_percent_lift_from_none() -> None:
    rng = np.random.default_rng(1)
    covered, told = [], []
    for _ in range(400):
        ratio = ratio_interval(_lists(rng, 12_000, 0.115), _lists(rng, 3000, 0.1))
        covered.append(ratio.low <= 1.15 <= ratio.high)
        told.append(ratio.low > 1.0)
    assert 0.93 <= np.mean(covered) <= 0.97, np.mean(covered)
    assert np.mean(told) > 0.8
    same = [ratio_interval(_lists(rng, 2000, 0.1), _lists(rng, 500, 0.1)) for _ in range(400)]
    assert 0.93 <= np.mean([r.low <= 1.0 <= r.high for r in same]) <= 0.97
    assert np.isnan(ratio_interval(_lists(rng, 100, 0.1), (np.zeros(5), np.full(5, 10.0))).ratio)  # no clicks


def _served(route: str, request: str, clicks: int, shown: int, at_ms: int) -> list[dict]:
    return [{"request_id": request, "item_id": f"i{k}", "model_version": "1", "route": route, "served_at": at_ms,
             "score": 0.5, "label": float(k < clicks), "sources": None} for k in range(shown)]


def test_compare_puts_the_holdout_in_the_frozen_arm_and_every_other_route_in_the_learning_one() -> None:
    rows = (_served(HOLDOUT, "r1", 1, 10, 0) + _served(HOLDOUT, "r2", 0, 10, 70_000)
            + _served(CHAMPION, "r3", 3, 10, 0) + _served(CONTROL, "r4", 2, 10, 0)
            + _served(CHALLENGER, "r5", 1, 10, 70_000))
    arms, ratio = compare(pd.DataFrame(rows))
    frozen, learning = arms[FROZEN], arms[LEARNING]
    assert (frozen.requests, frozen.items, frozen.clicks, frozen.ctr) == (2, 20, 1, 0.05)
    assert (learning.requests, learning.items, learning.clicks) == (3, 30, 6)
    assert learning.ctr == pytest.approx(0.2) and learning.clicks_per_request == pytest.approx(2.0)
    assert ratio.ratio == pytest.approx(4.0) and ratio.low < 4.0 < ratio.high
    minutes = over_time(pd.DataFrame(rows), 60)
    first = minutes[minutes["t"] == 0].set_index("arm")
    assert first.loc[FROZEN, "clicks"] == 1 and first.loc[LEARNING, "clicks"] == 5 and len(minutes) == 4
    assert (minutes[minutes["t"] == 60_000].set_index("arm").loc[LEARNING, "ctr"]) == pytest.approx(0.1)
    empty = compare(pd.DataFrame(columns=list(rows[0])))[0]
    assert empty[FROZEN].requests == 0 and np.isnan(empty[FROZEN].ctr)
