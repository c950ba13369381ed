"""AUC per served model version, overall and over time (no services: the join's output as a frame)."""

from __future__ import annotations

import math

import pandas as pd

from serving.outcomes import auc_by_version, auc_over_time, percentiles


def _outcomes() -> pd.DataFrame:
    rows = []
    for n in range(40):  # v1 ranks every click first; v2 ranks every click last; v2 starts after 60 s
        label = float(n % 2)
        rows.append((f"r{n}", f"i{n}", "1", "champion", 1_000 + n * 1_000, 0.1 + 0.8 * label, label))
        rows.append((f"s{n}", f"i{n}", "2", "champion", 61_000 + n * 1_000, 0.9 - 0.8 * label, label))
    return pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at", "score",
                                       "label"])


def test_each_version_is_judged_on_the_traffic_it_served() -> None:
    table = auc_by_version(_outcomes()).set_index("model_version")
    assert table.loc["1", "auc"] == 1.0 and table.loc["2", "auc"] == 0.0
    assert table.loc["1", "requests"] == 40 and table.loc["1", "clicks"] == 20 and table.loc["1", "ctr"] == 0.5
    assert table.loc["1", "first_served"] == 1_000 and table.loc["2", "last_served"] == 100_000
    assert list(auc_by_version(_outcomes()).model_version) == ["1", "2"]  # in order of first serving


def test_auc_over_time_buckets_by_serving_time_and_version() -> None:
    points = auc_over_time(_outcomes(), bucket_s=30)
    assert set(points[points.t < 60_000].model_version) == {"1"}
    assert set(points[points.t >= 90_000].model_version) == {"2"}
    assert points["items"].sum() == 80
    one_label = auc_over_time(_outcomes().iloc[:2:2], bucket_s=30)  # a bucket with no click has no AUC
    assert math.isnan(one_label.auc.iloc[0])


def test_no_traffic_is_no_figures() -> None:
    assert auc_by_version(_outcomes().iloc[:0]).empty
    assert auc_over_time(_outcomes().iloc[:0], 30).empty
    assert math.isnan(percentiles([])["p99"])
    assert percentiles([0.010, 0.020, 0.030], (50,)) == {"p50": 20.0}
