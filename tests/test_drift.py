"""`flywheel drift`'s reading of a run (flywheel/drift.py): the arms before and after the world's change, when
the learning arm is back, the clicks on launched items per arm, and the one line a script reads."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import numpy as np
import pandas as pd

from flywheel.drift import analyse, headline
from models.registry import CHAMPION, HOLDOUT, Experiment
from serving.access import frozen_arm

RUNNING = Experiment("1", 50.0, datetime(2026, 12, 7, 9, tzinfo=UTC))
CHANGE_MS = 1_800_000_000_000
USERS = [f"u{n:04d}" for n in range(400)]


def _lists(minute: int, ctr: dict[bool, float], item: str = "i0") -> list[dict]:
    """One list of 10 items per user in the minute starting `minute` minutes after the change, each user's arm
    clicking its `ctr` (by frozen-or-not) of the items, the first ones; `item` first in the learning arm's lists
    (clicked), last in the frozen arm's (not)."""
    rows = []
    for n, user in enumerate(USERS):
        frozen = frozen_arm(user, RUNNING.percent, RUNNING.salt)
        clicks = round(10 * ctr[frozen])
        for k in range(10):
            rows.append({"request_id": f"{user}:{minute}", "item_id": item if k == (9 if frozen else 0) else f"i{k}",
                         "model_version": "1" if frozen else "2", "route": HOLDOUT if frozen else CHAMPION,
                         "served_at": CHANGE_MS + minute * 60_000 + n, "score": 0.5, "label": float(k < clicks),
                         "sources": None, "user_id": user})
    return rows


def test_the_arms_before_and_after_the_change_when_learning_is_back_and_the_launched_items_clicks() -> None:
    rows = [r for m in (-3, -2, -1) for r in _lists(m, {True: 0.2, False: 0.2})]
    rows += _lists(0, {True: 0.1, False: 0.1}, "new")  # the change: both fall at first
    rows += _lists(1, {True: 0.1, False: 0.1}, "new")  # the learning arm at 50% of before: not back yet
    rows += [r for m in range(2, 10) for r in _lists(m, {True: 0.1, False: 0.2}, "new")]
    rows += _lists(12, {True: 0.2, False: 0.2})  # past the end: not counted
    outcomes = pd.DataFrame(rows)
    drift, buckets = analyse(outcomes, RUNNING, CHANGE_MS, CHANGE_MS + 10 * 60_000, {"new"})

    assert drift.frozen_before == drift.learning_before == 0.2
    assert drift.ratio_before[0] == 1.0
    assert drift.frozen_after == 0.1
    assert abs(drift.learning_after - 0.18) < 1e-9
    assert drift.ratio_after[1] > 1.0  # every user of the learning arm clicks more: the interval says so
    assert drift.recovered_in_s == 120.0  # the end of the second minute: every minute from then on at >= 90%
    assert abs(drift.recovered_share - 1.0) < 1e-9  # the learning arm's CTR from then on over before
    # the launched item: the learning arm's lists' first (clicked, one a list), the frozen arm's last (never)
    frozen_users = sum(frozen_arm(u, RUNNING.percent, RUNNING.salt) for u in USERS)
    assert drift.launched_clicks == {"learning": 10 * (len(USERS) - frozen_users), "frozen": 0}
    assert drift.requests_before == {"learning": 3 * (len(USERS) - frozen_users), "frozen": 3 * frozen_users}
    assert drift.requests_after == {"learning": 10 * (len(USERS) - frozen_users), "frozen": 10 * frozen_users}
    assert drift.crossed == {"frozen": 0, "learning": 0}
    assert sorted(buckets["t"].unique()) == [m * 60_000 for m in range(-3, 10)]

    line = headline(drift, 95.0)
    assert re.fullmatch(r"drift: frozen CTR before 0\.2000 after 0\.1000; learning before 0\.2000 after 0\.1800; "
                        r"ratio after 1\.800 \(95% CI [\d.]+-[\d.]+\); learning recovered to 100\.0% of before in "
                        r"120 s; launched-item clicks learning \d+ frozen 0; model freshness 95 s", line), line


def test_a_learning_arm_that_never_comes_back_one_that_never_fell_and_a_run_with_no_promotion_say_so() -> None:
    before = [r for m in (-2, -1) for r in _lists(m, {True: 0.2, False: 0.2})]
    fell = before + [r for m in range(0, 5) for r in _lists(m, {True: 0.1, False: 0.2 if m == 2 else 0.1})]
    drift, _ = analyse(pd.DataFrame(fell), RUNNING, CHANGE_MS, CHANGE_MS + 5 * 60_000, {"never-shown"})
    assert drift.recovered_in_s is None  # one minute back is no recovery: the last is below
    assert np.isclose(drift.recovered_share, 0.6)  # all of after: (4 x 0.1 + 0.2) / 5 over 0.2
    assert drift.launched_clicks == {"learning": 0, "frozen": 0}
    line = headline(drift, None)
    assert "recovered to 60.0% of before in inf s" in line and line.endswith("model freshness none promoted")
    assert float(re.search(r"in (\S+) s;", line).group(1)) == float("inf")  # as a script reads it
    held = before + [r for m in range(0, 5) for r in _lists(m, {True: 0.1, False: 0.2})]
    drift, _ = analyse(pd.DataFrame(held), RUNNING, CHANGE_MS, CHANGE_MS + 5 * 60_000, set())
    assert drift.recovered_in_s == 0.0 and drift.recovered_share == 1.0 and drift.ratio_after[0] == 2.0
