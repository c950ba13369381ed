"""Online/offline consistency (Chronon's consistency job): for logged /rank requests, each numeric feature's
value as the ranking server read it (the prediction archive's snapshot) against what the training set holds
for the same request and item (models/dataset.py `training_frame`), and against what a point-in-time join
alone would hold (`as_of` at the time it was served).

Training takes a logged candidate's numeric features from the snapshot, so its mismatches say where that
join failed (a candidate shown but its record not found). The point-in-time column says what the
snapshot saves: its mismatches are a row not yet online when it was served (`missing_online`: the
ingestion's lag), a value the join drops (`missing_offline`: a row past its view's TTL, which the online
read still serves), or other values (an item's features cached up to `serving.item_features_ttl_ms`).

The last report run (`flywheel consistency`, the `feature_consistency` DAG's hourly one) is saved in
`run/consistency.state.json`: the exporter's /metrics/consistency (`flywheel_feature_mismatch_ratio`).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from contract.inputs import NUMERIC_FEATURES
from feature_repo.predictions import logged_features, read_predictions
from infra.progress import replace_text, state_path
from infra.settings import Settings
from models.dataset import NoImpressions, Window, features_as_of, training_frame

EXPOSED_WITHIN_MS = 600_000
STATE = "consistency"  # run/consistency.state.json
KEYS = ("request_id", "user_id", "item_id", "category", "served_at")
COLUMNS = ["feature", "compared", "mismatched", "rate", "point_in_time_mismatched", "point_in_time_rate",
           "missing_online", "missing_offline"]


def served_rows(s: Settings, since_ms: int | None, until_ms: int | None, requests: int) -> pd.DataFrame:
    """The newest `requests` /rank lists served (not shadow) in the period, one row per shown candidate:
    KEYS and each logged feature's value as read (NaN: nothing stored)."""
    table = read_predictions(s, since_ms, until_ms, columns=["request_id", "user_id", "served_at", "items",
                                                             "categories", "features", "sources", "shadow"])
    table = table.filter(~pc.field("shadow") & pc.field("sources").is_null())
    table = table.sort_by([("served_at", "descending")]).slice(0, requests)
    return logged_features(table, NUMERIC_FEATURES, ("request_id", "user_id", "served_at"),
                           {"items": "item_id", "categories": "category"})


def _mismatches(served: np.ndarray, held: np.ndarray) -> tuple[int, int, int]:
    """(mismatched, missing online, missing offline): equal within float rounding, or both missing."""
    on, off = ~np.isnan(served), ~np.isnan(held)
    both = on & off
    different = int((~np.isclose(served[both], held[both], rtol=1e-9, atol=1e-9)).sum())
    missing_online, missing_offline = int((off & ~on).sum()), int((on & ~off).sum())
    return different + missing_online + missing_offline, missing_online, missing_offline


def report(s: Settings, since_ms: int | None = None, until_ms: int | None = None, requests: int = 2000
           ) -> tuple[pd.DataFrame, dict[str, int]]:
    """Per feature: candidates compared (shown and in the training set), mismatches of the training set and
    of the point-in-time join, and the latter's causes; and counts: lists, candidates served, compared."""
    served = served_rows(s, since_ms, until_ms, requests)
    counts = {"lists": int(served["request_id"].nunique()) if len(served) else 0, "served": len(served),
              "compared": 0}
    if served.empty:
        return pd.DataFrame(columns=COLUMNS), counts
    first, last = int(served["served_at"].min()), int(served["served_at"].max())
    # A list's exposures follow its serving within seconds; its request began up to a day before (the join's reach).
    window = Window(*(datetime.fromtimestamp(t / 1000, UTC) for t in (first, last + EXPOSED_WITHIN_MS)))
    try:
        imps, joined = training_frame(s, window)
    except NoImpressions:  # lists no one was shown (a load test's): nothing was trained on them
        return pd.DataFrame(columns=COLUMNS), counts
    groups = list(s.spec.group_by)  # a candidate's further keys (a brand): as its exposure was trained on
    trained = pd.concat([imps[["request_id", "item_id", *groups]],
                         joined.drop(columns=["row", "user_id", "item_id", "category", *groups, "event_timestamp"],
                                     errors="ignore")], axis=1)
    compared = served.merge(trained.drop_duplicates(["request_id", "item_id"]), on=["request_id", "item_id"],
                            suffixes=("", "_trained"))
    counts["compared"] = len(compared)
    entities = compared[["user_id", "item_id", "category", *groups]].copy()
    entities["event_timestamp"] = pd.to_datetime(compared["served_at"], unit="ms", utc=True)
    entities["row"] = np.arange(len(compared))
    point_in_time = features_as_of(s, entities)
    out = []
    for name in (c for c in served.columns if c not in KEYS and f"{c}_trained" in compared.columns):
        value = compared[name].to_numpy(float)
        mismatched, _, _ = _mismatches(value, pd.to_numeric(compared[f"{name}_trained"]).to_numpy(float))
        pit, missing_online, missing_offline = _mismatches(value, pd.to_numeric(point_in_time[name]).to_numpy(float))
        n = max(len(value), 1)
        out.append((name, len(value), mismatched, mismatched / n, pit, pit / n, missing_online, missing_offline))
    table = pd.DataFrame(out, columns=COLUMNS).sort_values(["rate", "point_in_time_rate"], ascending=False,
                                                             kind="stable")
    return table, counts


def save(s: Settings, table: pd.DataFrame, counts: dict[str, int], since_ms: int | None, until_ms: int | None
         ) -> None:
    """The report as the exporter reads it: when, the period, the counts, per feature its rates."""
    path = state_path(s, STATE)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps({"at": time.time(), "since_ms": since_ms, "until_ms": until_ms, **counts,
                                   "features": table.to_dict("records")}, default=float))
