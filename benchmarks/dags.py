"""DAG benchmarks: behavior edges/s into the graph store, and the time of an incremental training run.

Graph (self-contained): a Redis with FalkorDB of its own on free ports; MovieLens-100k's replay events
are written to an event log (all but the newest 1%), built into the graph at several upsert batch
sizes, neighbours refreshed, then the newest 1% added as one incremental run. Baseline in the same
run: the same edge rows written as plain Redis hashes (pipelined HSETs), what a key-value store
costs for the rows without MERGE and adjacency upkeep.

Training (`--training`, after `make demo`, on the running stack): a full ranker on MovieLens up to
`--split` becomes @champion of `<models.name>-bench-dags`; incremental training from its watermark
runs in-process (baseline) and as an `incremental_training` run through Airflow's REST API, scheduler
and executor; both register without promoting. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil

from feature_repo.event_log import read_event_log, write_batch
from feature_repo.store import apply
from infra import stack
from infra.redis_clients import graph_store
from infra.settings import RANKER, RegisteredModel, Settings, get_settings, load_settings, override
from models import graph
from streaming.consumer import Consumed
from streaming.movielens import replay_events


def _log(s: Settings, events: list, first_offset: int) -> None:
    for i in range(0, len(events), 5000):
        write_batch(s, [Consumed(e, 0, first_offset + i + k) for k, e in enumerate(events[i:i + 5000])])


def _baseline_hset(s: Settings, rows: list[dict]) -> float:
    client = graph_store(s)  # the graph's own server: the baseline shares it
    started = time.perf_counter()
    for i in range(0, len(rows), s.graph.batch_size):
        pipe = client.pipeline(transaction=False)
        for r in rows[i:i + s.graph.batch_size]:
            pipe.hset(f"bench:edge:{r['u']}:{r['i']}", mapping={"w": r["w"], "t": r["t"], "n": r["n"]})
        pipe.execute()
    return len(rows) / (time.perf_counter() - started)


def graph_benchmark(batch_sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        environ = dict(os.environ) | stack.side_by_side_environ(Path(tmp)) | {
            "FLYWHEEL_STACK_SERVICES": "redis", "FLYWHEEL_CONFIG": os.devnull, "FLYWHEEL_GRAPH_ALLOWED_LATENESS_S": "0"}
        s = load_settings(environ)
        stack.up(s)
        try:
            apply(s)
            events = list(replay_events(s))
            cut = int(len(events) * 0.99)
            _log(s, events[:cut], 0)
            logged = read_event_log(s).to_pandas()
            rows = graph.edge_rows(s, logged, None, int(logged["event_time"].max()))
            kv = _baseline_hset(s, rows)
            print(f"Events: {cut:,} MovieLens-100k replay events (impressions, clicks) -> {len(rows):,} user-item "
                  f"edges; then {len(events) - cut:,} newer events as one incremental run.\n")
            print("| run | upsert batch | behavior events | edges | seconds | edges/s | vs plain Redis HSET |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            print(f"| baseline: HSET per edge, pipelined | {s.graph.batch_size} | - | {len(rows):,} | "
                  f"{len(rows) / kv:.2f} | {kv:,.0f} | 1.00 |")
            for size in batch_sizes:
                g = override(s, "graph", name=f"bench-{size}", batch_size=size)
                added = graph.add_edges(g)
                rate = added.edges / added.seconds
                print(f"| full build (Cypher MERGE) | {size} | {added.events:,} | {added.edges:,} | "
                      f"{added.seconds:.2f} | {rate:,.0f} | {rate / kv:.2f} |")
            g = override(s, "graph", name=f"bench-{s.graph.batch_size}")
            if s.graph.batch_size not in batch_sizes:
                graph.add_edges(g)
            refreshed = graph.refresh_neighbours(g)
            _log(s, events[cut:], cut)
            added = graph.add_edges(g)
            incremental = graph.refresh_neighbours(g)
            print(f"| incremental run | {s.graph.batch_size} | {added.events:,} | {added.edges:,} | "
                  f"{added.seconds:.2f} | {added.edges / added.seconds:,.0f} | - |")
            print(f"\nNeighbour refresh after the full build: {refreshed.items:,} items "
                  f"(top {s.graph.neighbours}) in {refreshed.seconds:.2f} s ({refreshed.items / refreshed.seconds:,.0f}"
                  f" items/s, published online and offline). Incremental run: {added.items} items touched, their "
                  f"neighbours refreshed in {incremental.seconds:.2f} s; add + refresh "
                  f"{added.seconds + incremental.seconds:.2f} s.")
        finally:
            stack.down(s)


def training_benchmark(start: datetime, split: datetime) -> None:
    from infra.airflow_api import AirflowClient
    from models.dataset import Window
    from models.train import train_full, train_incremental

    s = get_settings()
    name = f"{s.ranker.name}-bench-dags"
    bench = RegisteredModel(name, name, RANKER)
    full = train_full(s, Window(start, split), progress=False, model=bench)
    started = time.perf_counter()
    baseline = train_incremental(s, promote=False, progress=False, model=bench)
    in_process = time.perf_counter() - started
    if baseline is None:
        print("Incremental: no new examples after the split; nothing to time.")
        return
    client = AirflowClient(s)
    was_paused = client.set_paused("incremental_training", False)
    try:
        run_id = client.trigger("incremental_training", {"model_name": name, "promote": False})
        queued = time.perf_counter()
        state = client.wait("incremental_training", run_id)
        wall = time.perf_counter() - queued
    finally:
        client.set_paused("incremental_training", was_paused)
    run = client.run("incremental_training", run_id)
    tasks = {t["task_id"]: t for t in client.task_instances("incremental_training", run_id)}
    def seconds(a: str, b: str) -> float:
        return (datetime.fromisoformat(run[b]) - datetime.fromisoformat(run[a])).total_seconds()

    train = tasks["train"]["duration"]
    print(f"Champion v{full.version} trained on {start:%Y-%m-%d} .. {split:%Y-%m-%d}; incremental window "
          f"{baseline.window} ({baseline.metrics['eval_examples']:.0f} evaluation examples).\n")
    print("| incremental run | seconds | vs in-process |")
    print("|---|---:|---:|")
    print(f"| in-process `train_incremental` (baseline; TensorFlow and MLflow already imported) | {in_process:.1f} | 1.00 |")
    print(f"| Airflow task `train` (a fresh task process: imports included) | {train:.1f} | {train / in_process:.2f} |")
    print(f"| Airflow run ({state}): started -> finished (train, promotion_asked, gate) | "
          f"{seconds('start_date', 'end_date'):.1f} | {seconds('start_date', 'end_date') / in_process:.2f} |")
    print(f"| Airflow run: queued -> finished, as the REST client saw it | {wall:.1f} | {wall / in_process:.2f} |")
    waited = seconds("queued_at", "start_date")
    print(f"\nQueued -> started: {waited:.1f} s" + (" (unpausing the DAG started its scheduled run too; "
                                                    "max_active_runs=1 queued this one behind it)." if waited > 5 else "."))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="500,2000,5000")
    parser.add_argument("--training", action="store_true", help="also time incremental training (after make demo)")
    parser.add_argument("--start", default="1997-09-01")
    parser.add_argument("--split", default="1998-03-01")
    args = parser.parse_args()
    print(f"Machine: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB. "
          f"{datetime.now(UTC):%Y-%m-%d}.\n")
    graph_benchmark([int(b) for b in args.batch_sizes.split(",")])
    if args.training:
        print()
        training_benchmark(*(datetime.fromisoformat(d).replace(tzinfo=UTC) for d in (args.start, args.split)))


if __name__ == "__main__":
    main()
