"""Models benchmark: the ranker vs the previous DIN ranker (ranker-v1: 50 recent behaviors, the stream's
counts) vs the logistic-regression baseline, the ranker's baselines on its own split (popularity, logistic
regression, gradient-boosted trees), and the ranker with its long-history inputs off (the
ablation), on MovieLens-100k replayed through the platform; then one incremental run.

Run after `make demo` (the stack up, MovieLens replayed through Kafka and Flink into the offline
store): `make bench-models`. Registers under the model name `<models.name>-bench`, so the platform's
own `@champion` is untouched. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import psutil

from infra.settings import RANKER, RegisteredModel, get_settings
from models.dataset import Window
from models.metrics import RANKING_BASELINES, best_baseline
from models.train import train_full, train_incremental


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--start", default="1997-09-01")
    # `make demo` replays the ratings before 1998-03-01 as history (the rest is live traffic, timed now).
    parser.add_argument("--split", default="1998-02-01", help="full training data ends here; incremental after")
    parser.add_argument("--end", default="1998-03-01")
    args = parser.parse_args()
    s = get_settings()
    bench = RegisteredModel(f"{s.ranker.name}-bench", f"{s.ranker.experiment}-bench", RANKER)
    start, split, end = (datetime.fromisoformat(d).replace(tzinfo=UTC) for d in (args.start, args.split, args.end))
    rows = []
    # The ranker last: the incremental run continues the @champion, which the ablation (not promoted)
    # must not be.
    for name, kind, long_history in (("logreg", "logreg", True), ("ranker-v1", "ranker-v1", True),
                                     ("ranker (long history off)", "ranker", False), ("ranker", "ranker", True)):
        started = time.perf_counter()
        out = train_full(s, Window(start, split), kind=kind, progress=False, long_history=long_history,
                         promote=name != "ranker (long history off)", baselines=name == "ranker", model=bench)
        rows.append((name, out, time.perf_counter() - started))
    started = time.perf_counter()
    inc = train_incremental(s, until=end, progress=False, model=bench)
    inc_seconds = time.perf_counter() - started

    cpu = f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    print(f"Machine: {cpu}. Data: impressions {start:%Y-%m-%d} .. {split:%Y-%m-%d}, chronological 80/10/10 split.\n")
    print("| model | test AUC | logloss | calibration | epochs | train samples/s | run (s) | version |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, out, seconds in rows:
        m = out.metrics
        verdict = "not gated" if out.decision is None else "promoted" if out.decision.promoted else "refused"
        print(f"| {name} | {m['test_auc']:.4f} | {m['test_logloss']:.4f} | {m['test_calibration']:.3f} | "
              f"{m['epochs']:.0f} | {m['train_samples_per_s']:,.0f} | {seconds:.0f} | v{out.version} ({verdict}) |")
    auc = {name: out.metrics["test_auc"] for name, out, _ in rows}
    print(f"\nRanker vs ranker-v1 test AUC: {auc['ranker'] - auc['ranker-v1']:+.4f}; vs the baseline: "
          f"{auc['ranker'] - auc['logreg']:+.4f}; the long history's share: "
          f"{auc['ranker'] - auc['ranker (long history off)']:+.4f}.")
    ranker = rows[-1][1].metrics
    baselines = {name: ranker[f"test_auc_{key}"] for name, key in RANKING_BASELINES.items()}
    print("\nBaselines of the ranker's split: " + ", ".join(f"{k} {v:.4f}" for k, v in baselines.items()))
    if inc is None:
        print("\nIncremental: skipped (no new examples).")
    else:
        d = inc.decision
        print(f"\nIncremental run {split:%Y-%m-%d} .. {end:%Y-%m-%d}: {inc.metrics['eval_examples']:.0f} evaluation "
              f"examples, eval AUC {inc.metrics['eval_auc']:.4f}, {inc.samples_per_s:,.0f} samples/s, whole run "
              f"{inc_seconds:.0f} s; gate: {'promoted' if d and d.promoted else 'refused'} ({d.reason if d else '-'}).")
    best, value = best_baseline(baselines)
    print(f"\nranking ({s.spec.name}): ranker {ranker['test_auc']:.4f}, best baseline {best} {value:.4f}")


if __name__ == "__main__":
    main()
