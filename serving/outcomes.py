"""What served predictions led to: the prediction log joined with the clicks that followed (by request
id and item), and the AUC of each model version on the traffic it served.

Reads both topics between offsets the caller recorded (the start of a live period and its end), so
it measures exactly that period. Shadow predictions are left out: they were never shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from infra.settings import Settings
from models.metrics import auc
from streaming.events import decode
from streaming.topics import end_offsets, read_range

Offsets = dict[int, int]


@dataclass(frozen=True)
class Period:
    """Offsets of the prediction log and the events topic where a period of traffic starts."""

    predictions: Offsets
    events: Offsets

    @classmethod
    def now(cls, s: Settings) -> Period:
        return cls(end_offsets(s, s.serving.predictions_topic), end_offsets(s, s.kafka.events_topic))


def served_outcomes(s: Settings, since: Period) -> pd.DataFrame:
    """One row per scored item shown since `since`: request_id, item_id, model_version, route,
    served_at (ms), score, label (1.0 if the user clicked it on that request)."""
    clicks = set()
    for record in read_range(s, s.kafka.events_topic, since.events, end_offsets(s, s.kafka.events_topic)):
        event = decode(record.value, s.kafka.max_event_bytes)
        if event.event_type.value == "click":
            clicks.add((event.request_id, event.item_id))
    rows = []
    topic = s.serving.predictions_topic
    for record in read_range(s, topic, since.predictions, end_offsets(s, topic)):
        p = json.loads(record.value)
        if p["shadow"]:
            continue
        for item, score in zip(p["items"], p["scores"]):
            if score is not None:
                rows.append((p["request_id"], item, str(p["model_version"]), p["route"], p["served_at"], score,
                             float((p["request_id"], item) in clicks)))
    return pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at", "score",
                                       "label"])


def _auc(frame: pd.DataFrame) -> float:
    labels = frame["label"].to_numpy()
    return auc(labels, frame["score"].to_numpy()) if 0 < labels.sum() < len(labels) else float("nan")


def auc_by_version(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Per model version: requests, items shown, clicks, CTR, AUC of its scores, first/last served (ms)."""
    rows = [{"model_version": v, "requests": g["request_id"].nunique(), "items": len(g),
             "clicks": int(g["label"].sum()), "ctr": float(g["label"].mean()), "auc": _auc(g),
             "first_served": int(g["served_at"].min()), "last_served": int(g["served_at"].max())}
            for v, g in outcomes.groupby("model_version", sort=False)]
    return pd.DataFrame(rows).sort_values("first_served").reset_index(drop=True) if rows else pd.DataFrame()


def auc_over_time(outcomes: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    """AUC per model version per `bucket_s` of serving time: model_version, t (ms, bucket start), items, auc."""
    if outcomes.empty:
        return pd.DataFrame(columns=["model_version", "t", "items", "auc"])
    bucket = (outcomes["served_at"] // int(bucket_s * 1000)) * int(bucket_s * 1000)
    rows = [{"model_version": v, "t": int(t), "items": len(g), "auc": _auc(g)}
            for (v, t), g in outcomes.groupby(["model_version", bucket])]
    return pd.DataFrame(rows).sort_values(["t", "model_version"]).reset_index(drop=True)


def percentiles(seconds: list[float], qs: tuple[float, ...] = (50, 95, 99)) -> dict[str, float]:
    """Latency percentiles in milliseconds ({"p50": ...}); NaN when there is nothing to measure."""
    values = np.asarray(seconds) * 1000
    return {f"p{q:g}": float(np.percentile(values, q)) if len(values) else float("nan") for q in qs}
