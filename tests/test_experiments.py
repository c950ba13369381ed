"""An experiment's arms on their served outcomes: users assigned by the experiment's hash whatever route served
them, CTR intervals clustered by user that cover the truth as often as they claim, and the ratio of the arms'
CTRs."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pytest

from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT, Experiment
from serving.access import frozen_arm
from serving.experiments import FROZEN, LEARNING, compare, ctr_interval, over_time, ratio_interval

RUNNING = Experiment("3", 30.0, datetime(2026, 12, 7, 9, tzinfo=UTC))


def _users(rng: np.random.Generator, users: int, ctr: float) -> tuple[np.ndarray, np.ndarray]:
    """(clicks, items) per user of users whose clicks go together: each user's own CTR drawn around `ctr` (a keen
    user clicks many of their lists' items, another none), over 1-8 lists of 5-10 items each."""
    keen = rng.beta(ctr * 2, (1 - ctr) * 2, users)
    lists = rng.integers(1, 9, users)
    items = np.where(np.arange(8) < lists[:, None], rng.integers(5, 11, (users, 8)), 0).sum(1).astype(float)
    return rng.binomial(items.astype(int), keen).astype(float), items


def test_the_ctr_interval_covers_the_truth_95_times_in_100_where_one_over_items_would_not() -> None:
    rng = np.random.default_rng(0)
    covered, naive = [], []
    for _ in range(600):
        clicks, items = _users(rng, 300, 0.1)
        ctr, low, high = ctr_interval(clicks, items)
        covered.append(low <= 0.1 <= high)
        half = 1.96 * np.sqrt(ctr * (1 - ctr) / items.sum())  # as if every item shown were an independent draw
        naive.append(ctr - half <= 0.1 <= ctr + half)
    assert 0.93 <= np.mean(covered) <= 0.97, np.mean(covered)
    assert np.mean(naive) < 0.6  # a user's clicks go together: an interval over items claims far more than it knows
    assert all(np.isnan(ctr_interval(np.array([1.0]), np.array([10.0]))[1:]))  # one user: nothing to say
    assert all(np.isnan(ctr_interval(np.zeros(0), np.zeros(0))))


def test_the_ratio_interval_covers_the_true_ratio_and_tells_a_15_percent_lift_from_none() -> None:
    rng = np.random.default_rng(1)
    covered, told = [], []
    for _ in range(400):
        ratio = ratio_interval(_users(rng, 10_000, 0.115), _users(rng, 2500, 0.1))
        covered.append(ratio.low <= 1.15 <= ratio.high)
        told.append(ratio.low > 1.0)
    assert 0.93 <= np.mean(covered) <= 0.97, np.mean(covered)
    assert np.mean(told) > 0.8
    same = [ratio_interval(_users(rng, 10_000, 0.1), _users(rng, 2500, 0.1)) for _ in range(400)]
    assert 0.93 <= np.mean([r.low <= 1.0 <= r.high for r in same]) <= 0.97
    assert np.isnan(ratio_interval(_users(rng, 100, 0.1), (np.zeros(5), np.full(5, 10.0))).ratio)  # no clicks


def _served(user: str, route: str, version: str, request: str, clicks: int, shown: int, at_ms: int) -> list[dict]:
    return [{"request_id": request, "item_id": f"i{k}", "model_version": version, "route": route,
             "served_at": at_ms, "score": 0.5, "label": float(k < clicks), "sources": None, "user_id": user}
            for k in range(shown)]


def test_an_arm_is_its_users_whatever_route_served_them_and_crossings_are_counted() -> None:
    users = [f"u{n}" for n in range(200)]
    frozen = [u for u in users if frozen_arm(u, RUNNING.percent, RUNNING.salt)]
    learning = [u for u in users if u not in frozen]
    assert frozen and not frozen_arm(learning[0], RUNNING.percent, RUNNING.salt)
    rows = (_served(frozen[0], HOLDOUT, "3", "r1", 1, 10, 0) + _served(frozen[1], HOLDOUT, "3", "r2", 0, 10, 70_000)
            + _served(frozen[2], CHAMPION, "5", "r3", 2, 10, 0)  # a worker that had not loaded @holdout yet
            + _served(learning[0], CHAMPION, "5", "r4", 3, 10, 0) + _served(learning[1], CONTROL, "4", "r5", 2, 10, 0)
            + _served(learning[1], CHALLENGER, "6", "r6", 1, 10, 70_000))
    arms, ratio = compare(pd.DataFrame(rows), RUNNING)
    f, le = arms[FROZEN], arms[LEARNING]
    assert (f.users, f.requests, f.items, f.clicks, f.crossed) == (3, 3, 30, 3, 10)
    assert (le.users, le.requests, le.items, le.clicks, le.crossed) == (2, 3, 30, 6, 0)
    assert f.ctr == pytest.approx(0.1) and le.ctr == pytest.approx(0.2) and le.clicks_per_request == pytest.approx(2)
    assert ratio.ratio == pytest.approx(2.0) and ratio.low < 2.0 < ratio.high
    minutes = over_time(pd.DataFrame(rows), RUNNING, 60)
    first = minutes[minutes["t"] == 0].set_index("arm")
    assert first.loc[FROZEN, "clicks"] == 3 and first.loc[LEARNING, "clicks"] == 5 and len(minutes) == 4
    assert minutes[minutes["t"] == 60_000].set_index("arm").loc[LEARNING, "ctr"] == pytest.approx(0.1)
    empty, none = compare(pd.DataFrame(columns=list(rows[0])), RUNNING)
    assert empty[FROZEN].requests == 0 and np.isnan(empty[FROZEN].ctr) and np.isnan(none.ratio)
