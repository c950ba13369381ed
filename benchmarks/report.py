"""`make bench-report`: run every benchmark suite and the demo loop, one after another on this machine,
and write docs/benchmarks.md (each suite's own Markdown output under its command) plus plots in
docs/plots/: feature freshness, serving latency percentiles vs load, AUC per model version over time.
The plots' figures are kept as JSON in docs/plots/data/, so `ARGS=--only serving` re-runs one suite,
replaces its section and redraws the plots with the others' figures as they were.

Order matters: the self-contained suites (own stacks on free ports, the default stack down) first;
then `flywheel demo` on the default stack, whose data the models and DAG suites train on; then
`flywheel down`. A failed suite is reported in its section and the report goes on (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks.record import ENV, recorded  # noqa: E402
from infra.settings import get_settings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
FLYWHEEL = [PY, "-m", "flywheel.cli"]


@dataclass(frozen=True)
class Suite:
    key: str
    title: str
    command: list[str]
    make: str  # how a user runs it alone


SUITES = [
    Suite("foundation", "Foundation: producers, stack cold start and memory (issue 2)",
          [PY, "-m", "benchmarks.foundation"], "make bench"),
    Suite("streaming", "Streaming: Kafka -> Flink -> Feast online store, feature freshness (issue 3)",
          [PY, "-m", "benchmarks.streaming"], "make bench-streaming"),
    Suite("serving", "Serving: the model's limit vs the ranking server (issue 6)",
          [PY, "-m", "benchmarks.serving"], "make bench-serving"),
    Suite("loop", "The whole loop: `flywheel demo` (issue 7)", [*FLYWHEEL, "demo"], "make demo"),
    Suite("models", "Models: ranker vs ranker-v1 vs logistic-regression baseline, long-history ablation (issues 4, 19)",
          [PY, "-m", "benchmarks.models"], "make bench-models (after make demo)"),
    Suite("dags", "DAGs: edges/s into the behavior graph, incremental training through Airflow (issue 5)",
          [PY, "-m", "benchmarks.dags", "--training"], "make bench-dags ARGS=--training (after make demo)"),
]


def run(suite: Suite, out: Path) -> tuple[int, str, float]:
    """Run a suite, echoing its output; returns (exit status, stdout, seconds)."""
    print(f"\n=== {suite.title}: {' '.join(suite.command[1:])}", flush=True)
    started = time.monotonic()
    env = os.environ | {ENV: str(out), "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
    proc = subprocess.Popen(suite.command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines), time.monotonic() - started


def plot_freshness(out: Path, plots: Path) -> str | None:
    stream, loop = recorded(out, "streaming_freshness"), recorded(out, "loop")
    series = []
    for probes in stream or []:
        series.append((f"streaming bench, synthetic load {probes['rate']:,.0f} events/s", probes["seconds"]))
    if loop and loop.get("feature_freshness_s"):
        series.append(("demo, live traffic (probes)", loop["feature_freshness_s"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, seconds in series:
        x = np.sort(seconds)
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{label}, n={len(x)}")
    ax.set(xlabel="event sent -> its running total online (s)", ylabel="fraction of probes",
           title="Feature freshness (CDF)", xscale="log")
    ax.legend(fontsize=7)
    return _save(fig, plots / "freshness.png")


def plot_latency(out: Path, plots: Path) -> str | None:
    curve = recorded(out, "serving_latency_vs_load")
    if not curve:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    offered = [c["offered_req_s"] for c in curve]
    for q in ("p50", "p99"):
        ax.plot(offered, [c[q] for c in curve], marker="o", label=q)
    for c in curve:
        if c["errors"]:
            ax.annotate(f"{c['errors']:.0f} refused", (c["offered_req_s"], c["p99"]), fontsize=7)
    ax.set(xlabel="offered load, requests/s (open loop; 10-500 candidates each)", ylabel="latency of 200s (ms)",
           title="Ranking server latency vs load", xscale="log", yscale="log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=7)
    return _save(fig, plots / "latency_vs_load.png")


def plot_auc(out: Path, plots: Path) -> str | None:
    loop = recorded(out, "loop")
    if not loop or not loop.get("auc_over_time"):
        return None
    points = [p for p in loop["auc_over_time"] if p.get("endpoint", "rank") == "rank"]  # the /rank lists
    if not points:
        return None
    t0 = min(p["t"] for p in points)
    fig, ax = plt.subplots(figsize=(7, 4))
    for version in sorted({p["model_version"] for p in points}, key=int):
        xs, ys = [], []
        for p in (p for p in points if p["model_version"] == version and p["items"] >= 30):
            if xs and (p["t"] - t0) / 60000 - xs[-1] > 0.51:  # not served in between: no line across the gap
                xs, ys = [*xs, np.nan], [*ys, np.nan]
            xs, ys = [*xs, (p["t"] - t0) / 60000], [*ys, p["auc"]]
        ax.plot(xs, ys, marker="o", label=f"v{version}")
    ax.set(xlabel="minutes of live traffic", ylabel="AUC on the /rank lists it served (30 s buckets)",
           title="AUC per model version over time (demo)")
    ax.legend(fontsize=7)
    return _save(fig, plots / "auc_per_version.png")


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def sections_of(text: str) -> dict[str, str]:
    """A report's suite sections by title ("## title" up to the next one)."""
    return {m.group(1): m.group(0).rstrip() + "\n" for m in re.finditer(r"^## (.+?)$.*?(?=^## |\Z)", text, re.M | re.S)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated suites of {[x.key for x in SUITES]}")
    parser.add_argument("--docs", type=Path, default=REPO / "docs")
    args = parser.parse_args()
    chosen = [x for x in SUITES if not args.only or x.key in args.only.split(",")]
    report, plots_dir = args.docs / "benchmarks.md", args.docs / "plots"
    out = plots_dir / "data"
    out.mkdir(parents=True, exist_ok=True)
    sections = sections_of(report.read_text()) if report.exists() else {}
    failed = 0
    for suite in chosen:
        status, stdout, seconds = run(suite, out)
        failed += status != 0
        if suite.key == "loop":  # the demo keeps its figures with the stack's data
            summary = get_settings().paths.data_dir / "demo" / "summary.json"
            if summary.exists():
                (out / "loop.json").write_text(summary.read_text())
        verdict = "" if status == 0 else f" **FAILED (exit {status})**"
        # The stack's status lines print the local Airflow password: not into a committed report. Nor colours.
        stdout = re.sub(r"(login:? \S+ / )\S+", r"\1<password>", re.sub(r"\x1b\[[0-9;]*m", "", stdout.strip()))
        body = f"```\n{stdout}\n```" if suite.key == "loop" else stdout  # the demo prints text
        sections[suite.title] = (f"## {suite.title}\n\nCommand: `{suite.make}`, {seconds / 60:.1f} min, "
                                 f"{datetime.now(UTC):%Y-%m-%d}{verdict}.\n\n{body}\n")
    if any(x.key == "loop" for x in chosen):
        subprocess.run([*FLYWHEEL, "down"], cwd=REPO, check=False)
    plots = [p for p in (plot_freshness(out, plots_dir), plot_latency(out, plots_dir), plot_auc(out, plots_dir)) if p]
    machine = (f"{psutil.cpu_count()} cores ({platform.processor() or platform.machine()}), "
               f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}")
    header = [
        "# Benchmarks", "",
        f"Written by `make bench-report` (benchmarks/report.py), last on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{machine}. Each section is one run of its suite (its date is under the title); every ratio's "
        "baseline was measured in that same run. Reading of the figures, profiles and earlier runs: "
        "[benchmark-notes.md](benchmark-notes.md). Plots drawn from docs/plots/data/.", ""]
    header += [f"![{p}](plots/{p})" for p in plots] + [""]
    ordered = [sections[x.title] for x in SUITES if x.title in sections]
    report.write_text("\n".join(header) + "\n" + "\n".join(ordered))
    print(f"\nwrote {report} and plots {plots}; their figures in {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
