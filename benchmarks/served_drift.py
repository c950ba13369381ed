"""Why a champion's served AUC falls short of its offline test AUC, with its features ruled out (`make
bench-served-drift`, after `make demo`, its stack up). For the demo's first champion (or `--version`):

- its AUC on its own test part, week by week before its data's end (the version's `eval_start` tag on);
- its AUC on the live traffic's sessions (streaming/live.py: the history after the split, as the demo
  serves them), week by week of the history they replay, every feature as of its data's end: nothing the
  live stream wrote, so a fall here is the sessions', not the served features';
- what it served (`.flywheel/demo/summary.json`, its `/rank` entry: the features as served).

The demo replays weeks of the history in minutes: the first champion serves sessions further from its
training data than any of its test part. Prints one line, `served-drift (NAME): ...`.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import numpy as np
import pandas as pd

from contract.transform import to_examples
from streaming.live import Live
from infra.settings import get_settings
from models.dataset import Window, features_as_of, training_set
from models.metrics import auc
from models.registry import load_version, version_tags

WEEK_MS = 7 * 86_400_000


def by_week(labels: np.ndarray, scores: np.ndarray, times_ms: np.ndarray, origin_ms: int
            ) -> list[tuple[int, float, int]]:
    """(week relative to `origin_ms`: -1 the week before it, 1 the week after; AUC; items) per week with both
    clicks and passes."""
    weeks = np.floor((times_ms - origin_ms) / WEEK_MS).astype(int)
    out = []
    for w in np.unique(weeks):
        m = weeks == w
        if 0 < labels[m].mean() < 1:
            out.append((int(w) + (w >= 0), auc(labels[m], scores[m]), int(m.sum())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", help="the ranker version (default: the demo's first champion)")
    args = parser.parse_args()
    s = get_settings()
    summary = json.loads((s.paths.data_dir / "demo" / "summary.json").read_text())
    version = args.version or str(summary["first_champion"])
    model, tags = load_version(s, version), version_tags(s, version)
    start, end, eval_start = (datetime.fromisoformat(tags[k]) for k in ("data_start", "data_end", "eval_start"))
    end_ms = int(end.timestamp() * 1000)

    ex, times = training_set(s, Window(start, end), s.streaming.sequence_length)
    test = times >= eval_start.timestamp() * 1000
    test_scores = model.predict(ex.take(test))
    test_auc = auc(ex.labels[test], test_scores)

    live = Live(s, end)
    rows = pd.DataFrame([(x.user_id, item, live.keys.get(item, ""), float(item in x.actions), x.at_ms)
                         for x in live.sessions for item in x.candidates],
                        columns=["user_id", "item_id", "category", "label", "at_ms"])
    rows["event_timestamp"] = pd.Timestamp(end) - pd.Timedelta(milliseconds=1)
    rows["row"] = np.arange(len(rows))
    frozen = to_examples(features_as_of(s, rows), np.full(len(rows), end_ms - 1), rows["label"].to_numpy(),
                         s.streaming.sequence_length)
    live_scores = model.predict(frozen)

    print(f"v{version} of {s.ranker.name}, trained on [{start.date()}, {end.date()}); test part from {eval_start}")
    print("| data | week | AUC | items |\n|---|---|---|---|")
    for week, value, n in by_week(ex.labels[test], test_scores, times[test], end_ms):
        print(f"| test part | {week} | {value:.4f} | {n:,} |")
    for week, value, n in by_week(frozen.labels, live_scores, rows["at_ms"].to_numpy(), end_ms):
        print(f"| live sessions, features as of {end.date()} | {week} | {value:.4f} | {n:,} |")
    served = [x for x in summary["served"] if str(x["model_version"]) == version]
    said = "not served"
    if served:  # the demo draws the sessions in order: the version's requests took the first ones
        n = sum(x["requests"] for x in served)
        items = sum(len(x.candidates) for x in live.sessions[:n])
        rank = next((x for x in served if x["endpoint"] == "rank"), {"auc": float("nan"), "requests": 0})
        said = (f"served /rank {rank['auc']:.4f} on {rank['requests']} requests (its first {n} sessions with the "
                f"features as of {end.date()}: {auc(frozen.labels[:items], live_scores[:items]):.4f})")
    print(f"served-drift ({s.spec.name}): v{version} test AUC {test_auc:.4f}; the live sessions with the features "
          f"as of its data's end {auc(frozen.labels, live_scores):.4f} ({len(live.sessions)} sessions); {said}")

if __name__ == "__main__":
    main()
