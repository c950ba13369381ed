"""Serving benchmarks, all in one run on one machine (`make bench-serving`).

Self-contained: Kafka, Redis and MLflow of its own on free ports; online features for 943 users
(behavior sequences of 0-50 items) and 1,682 items; a ranker with the platform's 22 numeric features
(trained briefly on synthetic clicks: its quality is not what is measured) registered as @champion.
Requests carry a mixed number of candidates (log-normal, median 100, 10-500) with their categories.

  1. the limit: the dense model on full batches in-process (1024 rows x 50 behaviors), with and without
     the sparse lookup;
  2. the server (the stack's ranking-server: HTTP, features, batching, prediction log): the highest open-loop
     rate whose p99 stays <= 50 ms, and its ratio to (1);
  3. batching on vs off, buckets on vs off (p99 and compiles during traffic), 1 worker vs N, each a
     server restarted with that one setting changed, under the same closed-loop load;
  4. scoring alone (batcher + lookup + XLA, no HTTP or features), batching on vs off, 16 threads;
  5. swap and rollback time under load.
The load generator runs on the same cores as the server. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import keras
import mlflow
import numpy as np
import pandas as pd
import tensorflow as tf

from benchmarks.record import record
from contract.examples import PAD, Examples
from contract.inputs import NUMERIC_FEATURES
from feature_repo.store import apply
from infra import process, stack
from infra.services import enabled_services
from infra.settings import ServingSettings, Settings, load_settings, mlflow_password, override, redis_password
from models.ctr import CtrModel, ModelSpec
from models.registry import CHAMPION, connect, log_model
from models.sparse import SparseConfig
from serving.batching import Batcher
from serving.client import Served, closed_loop, open_loop
from serving.dense import DenseRunner
from streaming.topics import ensure_topics

USERS, ITEMS, CATEGORIES = 943, 1682, 18
SPEC = ModelSpec(numeric_features=NUMERIC_FEATURES, sequence_length=50, sparse=SparseConfig(dim=16, admit_after=1))


def _examples(n: int, rng: np.random.Generator) -> Examples:
    users, items = rng.integers(USERS, size=n), rng.integers(ITEMS, size=n)
    lengths = rng.integers(0, 51, size=n)
    seq = np.full((n, 50), PAD, dtype=object)
    for r, k in enumerate(lengths):
        seq[r, :k] = [f"i{j}" for j in rng.integers(ITEMS, size=k)]
    labels = ((items % CATEGORIES) == (users % CATEGORIES)).astype(np.float32)
    return Examples(np.array([f"u{u}" for u in users], object), np.array([f"i{i}" for i in items], object),
                    np.array([f"c{i % CATEGORIES}" for i in items], object), seq,
                    rng.random((n, len(NUMERIC_FEATURES)), dtype=np.float32), labels)


def _world(s: Settings, tmp: Path) -> tuple[CtrModel, str, str]:
    """Features online, two versions registered (v1 @champion, v2 for the swap); the model in memory."""
    rng = np.random.default_rng(0)
    store = apply(s)
    now = pd.Timestamp.now(tz="UTC")
    users, items = [f"u{u}" for u in range(USERS)], [f"i{i}" for i in range(ITEMS)]
    store.write_to_online_store("user_total", pd.DataFrame({
        "user_id": users, "user_impressions_total": rng.integers(1, 900, USERS),
        "user_clicks_total": rng.integers(0, 90, USERS), "user_ctr_total": rng.random(USERS), "event_timestamp": now}))
    store.write_to_online_store("item_total", pd.DataFrame({
        "item_id": items, "item_impressions_total": rng.integers(1, 900, ITEMS),
        "item_clicks_total": rng.integers(0, 90, ITEMS), "item_ctr_total": rng.random(ITEMS), "event_timestamp": now}))
    base = int(time.time() * 1000) - 86_400_000
    lengths = rng.integers(0, 51, USERS)
    store.write_to_online_store("user_sequence", pd.DataFrame({
        "user_id": users, "seq_item_ids": [[f"i{j}" for j in rng.integers(ITEMS, size=k)] for k in lengths],
        "seq_event_types": [["click"] * k for k in lengths],
        "seq_event_times": [[base + j * 1000 for j in range(k)] for k in lengths], "event_timestamp": now}))
    ensure_topics(s, [s.serving.predictions_topic])
    keras.utils.set_random_seed(1)
    model = CtrModel(SPEC)
    model.fit(_examples(20_000, rng), progress=False)
    connect(s)
    mlflow.set_experiment(s.ranker.experiment)
    versions = []
    for label in ("v1", "v2"):
        with mlflow.start_run(run_name=label):
            versions.append(log_model(s, model.save(tmp / label), {"kind": "ranker"}))
        model.fit(_examples(5_000, rng), progress=False)
    connect(s).set_registered_model_alias(s.ranker.name, CHAMPION, versions[0])
    return model, versions[0], versions[1]


# --- 1. the limit ---------------------------------------------------------------------------------

def raw_throughput(model: CtrModel, seconds: float = 5.0) -> tuple[float, float]:
    """Rows/s of the compiled dense network on 1024 x 50 batches, and of lookup + dense."""
    runner = DenseRunner(model, (1024,), (50,))
    ex = _examples(1024, np.random.default_rng(2))
    ex.sequences[:, :] = [f"i{j}" for j in range(50)]  # full length
    weights = [tf.constant(w) for w in model.dense_weights()]
    inputs = model.scoring_inputs(ex)
    runner.warm(weights, inputs)
    rates = []
    for with_lookup in (False, True):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            runner.run(weights, model.scoring_inputs(ex) if with_lookup else inputs)
            n += 1024
        rates.append(n / (time.perf_counter() - start))
    return rates[0], rates[1]


def scoring_batching(model: CtrModel, batching: bool, threads: int = 16, seconds: float = 5.0) -> float:
    """Rows/s through Batcher + lookup + compiled dense (no HTTP, no features), `threads` callers."""
    sv = ServingSettings()
    runner = DenseRunner(model, sv.row_buckets, sv.sequence_buckets)
    weights = [tf.constant(w) for w in model.dense_weights()]
    rng = np.random.default_rng(3)
    runner.warm(weights, model.scoring_inputs(_examples(4, rng)))
    batcher = Batcher(lambda parts: _split(runner, weights, model, parts), max_batch_rows=1024 if batching else 1,
                      max_delay_s=0.002, max_queue_rows=1 << 20, executors=2)
    pool = [_examples(int(k), rng) for k in _candidates(rng, 64)]
    done, stop = [0], time.perf_counter() + seconds

    def caller(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            ex = pool[i % len(pool)]
            batcher.submit(ex, len(ex), 60).result()
            done[0] += len(ex)
            i += threads

    workers = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    batcher.close()
    return done[0] / (time.perf_counter() - start)


def _split(runner: DenseRunner, weights, model: CtrModel, parts: list[Examples]) -> list[np.ndarray]:
    from contract.examples import concat

    scores = runner.run(weights, model.scoring_inputs(concat(parts)))
    bounds = np.cumsum([0, *(len(p) for p in parts)])
    return [scores[a:b] for a, b in zip(bounds, bounds[1:])]


def _candidates(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(100), 0.8, n), 10, 500).astype(int)


# --- 2, 3, 5. the server ------------------------------------------------------------------------------

class Server:
    """The stack's ranking server alone, with some serving settings changed; ready when built."""

    def __init__(self, s: Settings, **serving: object) -> None:
        # Passwords explicit: with only itself as the stack's service, the server's settings would not find the
        # generated ones of the stack's Redis and MLflow.
        s = override(override(s, "redis", password=redis_password(s)), "mlflow", password=mlflow_password(s))
        self.s = override(override(s, "stack", services=("serving",)), "serving", **serving)
        self.url = f"http://127.0.0.1:{self.s.serving.port}"
        stack.up(self.s)
        deadline = time.monotonic() + 240
        while httpx.get(f"{self.url}/readyz", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready; see `flywheel logs ranking-server`")
            time.sleep(0.5)

    def compiles(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("flywheel_compiles_total{") and 'where="warm"' not in line)

    def close(self) -> None:
        # Only this service: `stack.down` would stop everything of the data directory.
        for svc in enabled_services(self.s):
            process.stop(stack.pidfile(self.s, svc), self.s.stack.stop_timeout_s)


def _request(rng: np.random.Generator) -> dict:
    user, n = int(rng.integers(USERS)), int(_candidates(rng, 1)[0])
    return {"user_id": f"u{user}", "tier": "high",
            "candidates": [{"item_id": f"i{i}", "category": f"c{i % CATEGORIES}"} for i in rng.integers(ITEMS, size=n)]}


def _open_loop(url: str, rate: float, seconds: float, seed: int) -> list[Served]:
    rng = np.random.default_rng(seed)
    bodies = [_request(rng) for _ in range(256)]
    return asyncio.run(open_loop(url, (bodies[n % len(bodies)] for n in range(int(rate * seconds))), rate))


def _closed_loop(url: str, concurrency: int, seconds: float, seed: int) -> list[Served]:
    rng = np.random.default_rng(seed)
    bodies = [_request(rng) for _ in range(256)]
    return asyncio.run(closed_loop(url, lambda k, n: bodies[(k + n * concurrency) % len(bodies)], concurrency,
                                   seconds))


def _summary(results: list[Served], seconds: float) -> dict[str, float]:
    ok = [r for r in results if r.status == 200]
    lat = np.array([r.seconds for r in ok]) * 1000 if ok else np.array([np.nan])
    return {"req_s": len(ok) / seconds, "rows_s": sum(r.rows for r in ok) / seconds,
            "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "errors": len(results) - len(ok)}


def throughput_at_p99(server: Server, bound_ms: float, seconds: float) -> tuple[dict, list[tuple[float, dict]]]:
    """Open-loop rates up from 5 req/s (x1.4 per step) until over 5 % of requests fail or p99 passes
    20x the bound (the latency-vs-load curve); the highest rate whose p99 <= bound without errors (the
    first rate's when none)."""
    rate, best, curve = 5.0, None, []
    while rate < 2000:
        summary = _summary(_open_loop(server.url, rate, seconds, seed=int(rate)), seconds)
        curve.append((rate, summary))
        print(f"  open loop {rate:.0f} req/s: {summary}", flush=True)
        if summary["errors"] > 0.05 * rate * seconds or summary["p99"] > 20 * bound_ms:
            break
        if summary["p99"] <= bound_ms and not summary["errors"]:
            best = summary
        rate *= 1.4
    return best or curve[0][1], curve


def swap_times(s: Settings, server: Server, v1: str, v2: str) -> tuple[float, float, int, int]:
    """Seconds from an alias move to the first response naming the new version, under closed-loop
    load from 4 clients; and how many of the responses were not 200, of how many."""
    seen: list[tuple[float, str]] = []
    stop = threading.Event()

    def load() -> None:
        rng = np.random.default_rng(9)
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                r = http.post(f"{server.url}/rank", json=_request(rng))
                seen.append((time.monotonic(), r.json().get("model_version", f"HTTP {r.status_code}")))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    client, out = connect(s), []
    try:
        for version in (v2, v1):
            time.sleep(2)
            moved = time.monotonic()
            client.set_registered_model_alias(s.ranker.name, CHAMPION, version)
            while not any(t >= moved and v == version for t, v in seen):
                time.sleep(0.05)
            out.append(min(t for t, v in seen if t >= moved and v == version) - moved)
    finally:
        stop.set()
        for t in threads:
            t.join()
    failed = sum(v.startswith("HTTP") for _, v in seen)
    return out[0], out[1], failed, len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="Length of each load run.")
    parser.add_argument("--concurrency", type=int, default=8, help="Closed-loop clients for the A/B runs.")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, TensorFlow {tf.__version__}, "
          f"devices {[d.device_type for d in tf.config.list_physical_devices()]}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-serving-"))
    s = load_settings(os.environ | stack.side_by_side_environ(tmp) | {
        "FLYWHEEL_CONFIG": os.devnull, "FLYWHEEL_STACK_SERVICES": "kafka,redis,mlflow",
        "FLYWHEEL_SERVING_POLL_INTERVAL_S": "1"})
    stack.up(s)
    try:
        model, v1, v2 = _world(s, tmp)
        dense, lookup_dense = raw_throughput(model)
        print(f"limit: dense {dense:,.0f} rows/s, lookup + dense {lookup_dense:,.0f} rows/s", flush=True)
        scoring = {on: scoring_batching(model, on) for on in (True, False)}
        print(f"scoring tier: batching on {scoring[True]:,.0f} rows/s, off {scoring[False]:,.0f}", flush=True)

        # The A/B rows measure capacity, not shedding: a generous deadline and admission bound.
        roomy = {"default_deadline_ms": 5000.0, "max_inflight_rows": 1 << 16}
        workers = s.serving.workers
        configs = {f"default (batching, buckets, {workers} worker(s), item cache)": {},
                   "batching off": {"batching": False}, "buckets off": {"buckets": False},
                   "1 worker": {"workers": 1},
                   "item feature cache off": {"item_features_ttl_ms": 0.0}}
        server = Server(s)
        try:
            best, curve = throughput_at_p99(server, 50.0, args.seconds)
            record("serving_latency_vs_load", [{"offered_req_s": rate} | summary for rate, summary in curve])
            swap, rollback, failed, answered = swap_times(s, server, v1, v2)
        finally:
            server.close()
        # Twice each, interleaved, after a warm-up: the machine's noise and drift are of the size of the
        # effects; the table shows the mean of the two and both throughputs.
        runs: dict[str, list[dict]] = {label: [] for label in configs}
        for _ in range(2):
            for label, change in configs.items():
                server = Server(s, **roomy, **change)
                try:
                    _closed_loop(server.url, args.concurrency, 3, 4)  # warm-up, not measured
                    before = server.compiles()
                    summary = _summary(_closed_loop(server.url, args.concurrency, args.seconds, 5), args.seconds)
                    summary["compiles"] = server.compiles() - before
                    runs[label].append(summary)
                    print(f"{label}: {summary}", flush=True)
                finally:
                    server.close()
        rows = [(label, {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} | {"each": [r["req_s"] for r in rs]})
                for label, rs in runs.items()]
    finally:
        stack.down(s)

    print("\n| measure | value |\n|---|---|")
    print(f"| dense network alone, 1024 x 50 batches in-process (the limit) | {dense:,.0f} rows/s |")
    print(f"| sparse lookup + dense, same batches | {lookup_dense:,.0f} rows/s |")
    print(f"| server, highest open-loop rate with p99 <= 50 ms | {best['req_s']:.1f} req/s = {best['rows_s']:,.0f} "
          f"rows/s (p50 {best['p50']:.1f} ms, p99 {best['p99']:.1f} ms) |")
    print(f"| server / limit (lookup + dense) | {best['rows_s'] / lookup_dense:.3f} |")
    print(f"| scoring tier in-process, 16 threads: batching on / off | {scoring[True]:,.0f} / {scoring[False]:,.0f}"
          f" rows/s = {scoring[True] / scoring[False]:.2f}x |")
    print(f"| swap to a new champion under load (alias moved -> first response naming it) | {swap:.2f} s |")
    print(f"| rollback to the previous (warm) champion under load | {rollback:.2f} s (poll interval 1 s) |")
    print(f"| responses not 200 during the swap and rollback (4 clients) | {failed} of {answered} |")
    print(f"\nClosed loop, {args.concurrency} clients, {args.seconds:.0f} s each after a 3 s warm-up, a fresh server"
          " per run, each row run twice interleaved (deadline 5 s, admission bound 65,536 rows: capacity, not "
          "shedding):\n")
    print("| server | req/s (each run) | rows/s | p50 ms | p99 ms | errors | compiles during traffic |\n"
          "|---|---|---|---|---|---|---|")
    for label, r in rows:
        each = " / ".join(f"{x:.1f}" for x in r["each"])
        print(f"| {label} | {r['req_s']:.1f} ({each}) | {r['rows_s']:,.0f} | {r['p50']:.1f} | {r['p99']:.1f} "
              f"| {r['errors']:.0f} | {r['compiles']:.0f} |")
    base = rows[0][1]
    for label, r in rows[1:]:
        print(f"- default / {label}: throughput {base['rows_s'] / r['rows_s']:.2f}x, p99 {r['p99'] / base['p99']:.2f}x")


if __name__ == "__main__":
    main()
