"""An experiment's arms measured on what they served: the frozen arm (the users the experiment's hash pins to
@holdout) against the learning arm (every other user: the champion as it learns, canaries included), from the
served outcomes (serving/outcomes.py: the prediction archive joined with the clicks on the same request and item).

Users are assigned, not requests: an arm is its users' lists whatever route served them (a worker still loading
@holdout serves its users the champion's), and `crossed` counts the items an arm's users were served by the other
arm's model, a run to distrust when it is not ~0. Per arm: requests, items shown, clicks, CTR (clicks per item
shown) and clicks per request, the CTR with its 95% interval, and the learning arm's CTR over the frozen arm's with
the ratio's. A user's clicks are not independent draws (one taste, many lists): the intervals are the delta
method's for a ratio of sums, clustered by user. They hold at a horizon fixed in advance; looked at every minute
until one excludes 1, they claim more than they know (the canary's confidence sequences are for that).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd

from models.registry import HOLDOUT, Experiment
from serving.access import frozen_arm

FROZEN, LEARNING = "frozen", "learning"
ARMS = (FROZEN, LEARNING)
Z95 = NormalDist().inv_cdf(0.975)
NAN = float("nan")


@dataclass(frozen=True)
class ArmOutcome:
    """One arm's served outcomes over a period (NaN: too little served to say)."""

    users: int
    requests: int
    items: int
    clicks: int
    ctr: float
    low: float  # the CTR's 95% interval
    high: float
    clicks_per_request: float
    crossed: int  # items its users were served by the other arm's model


@dataclass(frozen=True)
class Ratio:
    """The learning arm's CTR over the frozen arm's, with its 95% interval (NaN where an arm has no clicks)."""

    ratio: float
    low: float
    high: float


def arms_of(outcomes: pd.DataFrame, running: Experiment) -> pd.Series:
    """Each served row's arm, by its user's assignment in `running`."""
    frozen = {u: frozen_arm(u, running.percent, running.salt) for u in outcomes["user_id"].unique()}
    return pd.Series(np.where(outcomes["user_id"].map(frozen).astype(bool), FROZEN, LEARNING), index=outcomes.index,
                     dtype=object)


def _per_user(outcomes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(clicks, items) per user: the clusters the intervals are computed over."""
    if not len(outcomes):
        return np.zeros(0), np.zeros(0)
    g = outcomes.groupby("user_id", sort=False)["label"].agg(["sum", "size"])
    return g["sum"].to_numpy(float), g["size"].to_numpy(float)


def _ratio_variance(clicks: np.ndarray, items: np.ndarray) -> tuple[float, float]:
    """CTR = sum(clicks) / sum(items) over clusters and its variance by the delta method (a ratio estimator)."""
    n = len(items)
    if n == 0 or items.sum() == 0:
        return NAN, NAN
    ctr = clicks.sum() / items.sum()
    if n < 2:
        return ctr, NAN
    residual = clicks - ctr * items
    return ctr, float(residual.var(ddof=1) / (n * items.mean() ** 2))


def ctr_interval(clicks: np.ndarray, items: np.ndarray) -> tuple[float, float, float]:
    """CTR over clusters (`clicks`, `items` per cluster) and its 95% interval, clipped to [0, 1]; NaN bounds where
    there is too little to say."""
    ctr, var = _ratio_variance(clicks, items)
    if np.isnan(var):
        return ctr, NAN, NAN
    half = Z95 * np.sqrt(var)
    return ctr, max(0.0, ctr - half), min(1.0, ctr + half)


def ratio_interval(treated: tuple[np.ndarray, np.ndarray], control: tuple[np.ndarray, np.ndarray]) -> Ratio:
    """CTR of `treated` over `control` (each (clicks, items) per cluster, the arms independent: disjoint users)
    with its 95% interval, on the log scale where the ratio is near normal."""
    (a, va), (b, vb) = _ratio_variance(*treated), _ratio_variance(*control)
    if not (a > 0 and b > 0):
        return Ratio(NAN, NAN, NAN)
    half = Z95 * np.sqrt(va / a**2 + vb / b**2)
    return Ratio(a / b, float(a / b * np.exp(-half)), float(a / b * np.exp(half)))


def _arm(outcomes: pd.DataFrame, crossed: int) -> ArmOutcome:
    clicks, items = _per_user(outcomes)
    ctr, low, high = ctr_interval(clicks, items)
    requests = outcomes["request_id"].nunique() if len(outcomes) else 0
    return ArmOutcome(len(items), requests, int(items.sum()), int(clicks.sum()), ctr, low, high,
                      clicks.sum() / requests if requests else NAN, crossed)


def compare(outcomes: pd.DataFrame, running: Experiment) -> tuple[dict[str, ArmOutcome], Ratio]:
    """Each arm's outcomes and the learning arm's CTR over the frozen arm's, over every row of `outcomes`."""
    if not len(outcomes):
        return {name: _arm(outcomes, 0) for name in ARMS}, Ratio(NAN, NAN, NAN)
    arm = arms_of(outcomes, running)
    by_holdout = (outcomes["route"] == HOLDOUT) & (outcomes["model_version"] == running.version)
    split = {FROZEN: outcomes[arm == FROZEN], LEARNING: outcomes[arm == LEARNING]}
    crossed = {FROZEN: int((~by_holdout[arm == FROZEN]).sum()), LEARNING: int(by_holdout[arm == LEARNING].sum())}
    return ({name: _arm(rows, crossed[name]) for name, rows in split.items()},
            ratio_interval(_per_user(split[LEARNING]), _per_user(split[FROZEN])))


def over_time(outcomes: pd.DataFrame, running: Experiment, bucket_s: float) -> pd.DataFrame:
    """compare() per `bucket_s` of serving time: t (ms, the bucket's start), arm, the arm's outcomes, and on each row
    the bucket's ratio (ratio, ratio_low, ratio_high)."""
    columns = ["t", "arm", *ArmOutcome.__dataclass_fields__, "ratio", "ratio_low", "ratio_high"]
    if not len(outcomes):
        return pd.DataFrame(columns=columns)
    width = int(bucket_s * 1000)
    rows = []
    for t, g in outcomes.groupby(outcomes["served_at"] // width * width):
        arms, ratio = compare(g, running)
        rows += [{"t": int(t), "arm": name, **asdict(a), "ratio": ratio.ratio, "ratio_low": ratio.low,
                  "ratio_high": ratio.high} for name, a in arms.items()]
    return pd.DataFrame(rows, columns=columns)
