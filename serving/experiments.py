"""An experiment's arms measured on what they served: the frozen arm (@holdout's users) against the learning arm
(every other user, the champion as it learns, canaries included), from the served outcomes (serving/outcomes.py:
the prediction archive joined with the clicks on the same request and item).

Per arm: requests, items shown, clicks, CTR (clicks per item shown) and clicks per request, each CTR with its 95%
interval, and the learning arm's CTR over the frozen arm's with the ratio's. A list's items are not independent
draws (one user, one moment): the intervals are the delta method's for a ratio of sums over requests, clustered by
request, which a bootstrap over requests matches at a thousandth of its cost (a per-minute report of a long run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd

from models.registry import HOLDOUT

FROZEN, LEARNING = "frozen", "learning"
ARMS = (FROZEN, LEARNING)
Z95 = NormalDist().inv_cdf(0.975)


@dataclass(frozen=True)
class ArmOutcome:
    """One arm's served outcomes over a period (NaN: nothing served)."""

    requests: int
    items: int
    clicks: int
    ctr: float
    low: float  # the CTR's 95% interval
    high: float
    clicks_per_request: float


@dataclass(frozen=True)
class Ratio:
    """The learning arm's CTR over the frozen arm's, with its 95% interval (NaN where an arm has no clicks)."""

    ratio: float
    low: float
    high: float


def arm_of(routes: pd.Series) -> pd.Series:
    """Each served row's arm: the frozen one for @holdout's, the learning one for every other route."""
    return pd.Series(np.where(routes == HOLDOUT, FROZEN, LEARNING), index=routes.index, dtype=object)


def _per_request(outcomes: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(clicks, items) per request: the clusters the intervals are computed over."""
    if not len(outcomes):
        return np.zeros(0), np.zeros(0)
    g = outcomes.groupby("request_id", sort=False)["label"].agg(["sum", "size"])
    return g["sum"].to_numpy(float), g["size"].to_numpy(float)


def _ratio_variance(clicks: np.ndarray, items: np.ndarray) -> tuple[float, float]:
    """CTR = sum(clicks) / sum(items) over requests and its variance by the delta method (a ratio estimator)."""
    n = len(items)
    if n == 0 or items.sum() == 0:
        return float("nan"), float("nan")
    ctr = clicks.sum() / items.sum()
    if n < 2:
        return ctr, float("nan")
    residual = clicks - ctr * items
    return ctr, float(residual.var(ddof=1) / (n * items.mean() ** 2))


def ctr_interval(clicks: np.ndarray, items: np.ndarray) -> tuple[float, float, float]:
    """CTR over requests (`clicks`, `items` per request) and its 95% interval, clipped to [0, 1]."""
    ctr, var = _ratio_variance(clicks, items)
    half = Z95 * np.sqrt(var)
    return ctr, max(0.0, ctr - half), min(1.0, ctr + half)


def ratio_interval(treated: tuple[np.ndarray, np.ndarray], control: tuple[np.ndarray, np.ndarray]) -> Ratio:
    """CTR of `treated` over `control` (each (clicks, items) per request, the arms independent: disjoint users)
    with its 95% interval, on the log scale where the ratio is near normal."""
    (a, va), (b, vb) = _ratio_variance(*treated), _ratio_variance(*control)
    if not (a > 0 and b > 0):
        return Ratio(float("nan"), float("nan"), float("nan"))
    half = Z95 * np.sqrt(va / a**2 + vb / b**2)
    return Ratio(a / b, float(a / b * np.exp(-half)), float(a / b * np.exp(half)))


def arm(outcomes: pd.DataFrame) -> ArmOutcome:
    clicks, items = _per_request(outcomes)
    ctr, low, high = ctr_interval(clicks, items)
    return ArmOutcome(len(items), int(items.sum()), int(clicks.sum()), ctr, low, high,
                      float(clicks.mean()) if len(clicks) else float("nan"))


def compare(outcomes: pd.DataFrame) -> tuple[dict[str, ArmOutcome], Ratio]:
    """Each arm's outcomes and the learning arm's CTR over the frozen arm's, over every row of `outcomes`."""
    arms = arm_of(outcomes["route"]) if len(outcomes) else pd.Series(dtype=object)
    split = {name: outcomes[arms == name] if len(outcomes) else outcomes for name in ARMS}
    return ({name: arm(rows) for name, rows in split.items()},
            ratio_interval(_per_request(split[LEARNING]), _per_request(split[FROZEN])))


def over_time(outcomes: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    """compare() per `bucket_s` of serving time: t (ms, the bucket's start), arm, the arm's outcomes, and on each row
    the bucket's ratio (ratio, ratio_low, ratio_high)."""
    columns = ["t", "arm", *ArmOutcome.__dataclass_fields__, "ratio", "ratio_low", "ratio_high"]
    if not len(outcomes):
        return pd.DataFrame(columns=columns)
    width = int(bucket_s * 1000)
    rows = []
    for t, g in outcomes.groupby(outcomes["served_at"] // width * width):
        arms, ratio = compare(g)
        rows += [{"t": int(t), "arm": name, **asdict(a), "ratio": ratio.ratio, "ratio_low": ratio.low,
                  "ratio_high": ratio.high} for name, a in arms.items()]
    return pd.DataFrame(rows, columns=columns)
