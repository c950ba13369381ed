"""The sparse tier at scale, in one run on one machine (`make bench-sparse`).

Self-contained: Kafka, Redis and MLflow of its own on free ports, the embedding store on a throwaway Redis
of its own (`sparse_tier.redis_url`; `--shared-redis`: on the online store's, as the default profile has it),
the ranking server with the sparse tier on (`sparse_tier.enabled`), its workers as `serving.workers` says.

  1. A ranker of the serving benchmark's spec (22 numeric features, behavior sequences of 50, 16-dim rows),
     trained briefly on synthetic clicks (its quality is not what is measured). v1: its dense network with
     user and item tables of `--users` and `--items` ids (seeded random rows) written to the embedding
     store in chunks: served from the store. v2: the same network with its trained tables (a few thousand
     ids), registered with the tier off: each worker holds it whole (the in-worker baseline).
  2. Zipf requests (users and items by rank, exponent `--zipf`; median 100 candidates, 10-500; the hottest
     users have behavior sequences online) at an open-loop `--rate`, on v1 and v2 in turn (@champion moved),
     `--rounds` times, a fresh stream per round, once the store's snapshot and log rewrite are taken; the
     p99 of each version's requests pooled. Each run says what could have stalled it: this process's full
     collections (its objects are frozen before each run) and the store's forks; and, on v1, its reads.
  3. Worker RSS (the largest of the server's worker processes), the cache's hit rate on v1 (/metrics),
     the store's bytes (Redis' used_memory before and after v1's rows).
  4. A delta of `--delta-rows` rows of v1 (its hottest ids, new values) written as v3 and announced on the
     deltas topic while it is written, as registration does: seconds from the write's start until every
     worker reports v3's cache complete.
Prints the issue's one line, `sparse-scale: ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import keras
import mlflow
import numpy as np
import pandas as pd
import psutil
import redis
import tensorflow as tf

from benchmarks.serving import CATEGORIES, SPEC, Server, _candidates, _examples, _summary
from feature_repo.store import apply
from infra import process, stack
from infra.services import enabled_services
from infra.settings import Settings, load_settings, override
from models.ctr import CtrModel
from models.embedding_store import TableRows
from models.registry import CHAMPION, connect, log_model
from models.sparse_tier import store, write
from serving.client import open_loop
from streaming.topics import ensure_topics

CHUNK = 5_000_000  # rows per write: a bucket gets ~8 of them per HSET (40M users: 625,000 buckets)
HOT_USERS = 20_000  # users with a behavior sequence online


def _zipf(rng: np.random.Generator, n: int, size: int, a: float) -> np.ndarray:
    return (rng.zipf(a, size) - 1) % n


def _ids(prefix: str, a: int, b: int) -> np.ndarray:
    return np.char.add(prefix, np.arange(a, b).astype(str)).astype(object)


def _chunks(model: CtrModel, users: int, items: int):
    """v1's tables: users and items generated chunk by chunk; categories and attributes as trained."""
    for table, prefix, n in (("user", "u", users), ("item", "i", items)):
        for k, a in enumerate(range(0, n, CHUNK)):
            b = min(a + CHUNK, n)
            rng = np.random.default_rng(k)
            yield table, TableRows(_ids(prefix, a, b), rng.normal(0, 0.05, (b - a, 16)).astype(np.float32),
                                   np.array([], object))
            print(f"  {table} rows {b:,} of {n:,}", flush=True)
    for table in ("category", "attribute"):
        snap = model.tables[table].snapshot()
        yield table, TableRows(snap.ids, snap.values, np.array([], object))


def _world(s: Settings, tmp: Path, users: int, items: int, zipf: float) -> tuple[str, str, float, float]:
    """Features online for the hottest users; v1 (the store's) and v2 (in-worker) registered. Returns them,
    v1's write seconds and the store's bytes for v1's rows."""
    rng = np.random.default_rng(0)
    feast = apply(s)
    now = pd.Timestamp.now(tz="UTC")
    hot = [f"u{u}" for u in range(HOT_USERS)]
    lengths = rng.integers(0, 51, HOT_USERS)
    base = int(time.time() * 1000) - 86_400_000
    feast.write_to_online_store("user_sequence", pd.DataFrame({
        "user_id": hot, "seq_item_ids": [[f"i{j}" for j in _zipf(rng, items, k, zipf)] for k in lengths],
        "seq_event_types": [["click"] * k for k in lengths],
        "seq_event_times": [[base + j * 1000 for j in range(k)] for k in lengths], "event_timestamp": now}))
    ensure_topics(s, [s.serving.predictions_topic, s.sparse_tier.deltas_topic])
    keras.utils.set_random_seed(1)
    model = CtrModel(SPEC)
    model.fit(_examples(20_000, rng), progress=False)
    connect(s)
    mlflow.set_experiment(s.ranker.experiment)
    off = override(s, "sparse_tier", enabled=False)  # registered only: v1's rows are written below
    versions = []
    for label in ("v1", "v2"):
        with mlflow.start_run(run_name=label):
            versions.append(log_model(off, model.save(tmp / label), {"kind": "ranker"}))
    emb = store(s)
    before = int(emb.client.info("memory")["used_memory"])
    started = time.perf_counter()
    counts = {"user": users, "item": items} | {t: len(model.tables[t]) for t in ("category", "attribute")}
    emb.write_full(versions[0], 16, (tmp / "v1" / "spec.json").read_text(),
                   (tmp / "v1" / "dense.weights.h5").read_bytes(), counts, _chunks(model, users, items))
    seconds = time.perf_counter() - started
    used = int(emb.client.info("memory")["used_memory"]) - before
    return versions[0], versions[1], seconds, used


def _request(rng: np.random.Generator, users: int, items: int, zipf: float) -> dict:
    user, n = int(_zipf(rng, users, 1, zipf)[0]), int(_candidates(rng, 1)[0])
    return {"user_id": f"u{user}", "tier": "high",
            "candidates": [{"item_id": f"i{i}", "category": f"c{i % CATEGORIES}"} for i in _zipf(rng, items, n, zipf)]}


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}(\{{.*?\}})? (\S+)$", text, re.M)}


def _tier(url: str) -> dict[str, float]:
    """The sparse tier's counters, summed over the server's workers: rows from the cache, all rows, store
    reads (one per batch with misses) and their seconds."""
    rows = _metric(url, "flywheel_sparse_rows_total")
    return {"cache": rows.get('{outcome="cache"}', 0.0), "rows": sum(rows.values()),
            "reads": sum(_metric(url, "flywheel_sparse_read_seconds_count").values()),
            "read_s": sum(_metric(url, "flywheel_sparse_read_seconds_sum").values())}


def _quiet(s: Settings) -> None:
    """Redis' snapshot and log rewrite taken before the runs, not during one (a fork of the 4 GB process
    stalls the host: a round that had one read a p99 of 52 ms against 29-33 ms): wait for a running one,
    start one the writes so far make due (`save`'s least change count, `auto-aof-rewrite-percentage`),
    until none runs nor is due 10 s in a row. The runs compare serving, not Redis' persistence."""
    client, calm = store(s).client, 0
    config = client.config_get("save") | client.config_get("auto-aof-rewrite-*")
    least = min(map(int, config["save"].split()[1::2]), default=0)  # "60 1000 ..." -> 1000; none: no snapshots
    growth, floor = int(config["auto-aof-rewrite-percentage"]), int(config["auto-aof-rewrite-min-size"])
    while calm < 10:
        info = client.info("persistence")
        busy = info["rdb_bgsave_in_progress"] or info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]
        due = {"bgsave": least and info["rdb_changes_since_last_save"] >= least,
               "bgrewriteaof": growth and info["aof_enabled"] and info["aof_current_size"] > floor
               and info["aof_current_size"] >= info["aof_base_size"] * (1 + growth / 100)}
        if not busy and (command := next((c for c, now in due.items() if now), None)):
            try:
                client.execute_command(command.upper())
            except redis.ResponseError:  # Redis' own cron started one first
                pass
            busy = True
        calm = 0 if busy else calm + 1
        time.sleep(1)


def _serve(s: Settings, server: Server, version: str, load: list[dict], rate: float, seconds: float
           ) -> list[float]:
    client = connect(s)
    client.set_registered_model_alias(s.ranker.name, CHAMPION, version)
    deadline = time.monotonic() + 120
    while sum(1 for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines()
              if line.startswith("flywheel_model_version{") and 'route="champion"' in line
              and f'version="{version}"' in line and line.endswith(" 1.0")) < s.serving.workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not swap to v{version}")
        time.sleep(0.5)
    warm = int(rate * 3)
    asyncio.run(open_loop(server.url, iter(load[:warm]), rate))  # warm-up, not measured
    # This process holds ~560,000 tracked objects (TensorFlow, pandas, MLflow): one full collection of them
    # paused its event loop 668 ms in a measured run, counted as the server's latency by the requests in
    # flight. Set aside before each run, they are not walked again; what a run allocates still is.
    gc.collect()
    gc.freeze()
    pauses: list[float] = []  # this process's full collections while it measures, in seconds
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        else:
            pauses.append(time.perf_counter() - started[-1])
    forks = store(s).client.info("stats")["total_forks"]
    gc.callbacks.append(timed)
    try:
        results = asyncio.run(open_loop(server.url, iter(load[warm:warm + int(rate * seconds)]), rate))
    finally:
        gc.callbacks.remove(timed)
    forks = store(s).client.info("stats")["total_forks"] - forks
    refused = Counter(r.status for r in results if r.status != 200)
    print(f"  v{version}: {_summary(results, seconds)}, non-200 {dict(refused)}; client full collections "
          f"{len(pauses)} (max {max(pauses, default=0) * 1000:.0f} ms), Redis forks {forks}", flush=True)
    return [r.seconds * 1000 if r.status == 200 else float("inf") for r in results]


def _workers_rss(s: Settings) -> float:
    """The largest resident memory of the server's worker processes, in bytes."""
    rss = []
    for svc in enabled_services(s):
        path = stack.pidfile(s, svc)
        if not path.exists():
            continue
        root = psutil.Process(process.read_pidfile(path).pid)
        rss += [p.memory_info().rss for p in root.children(recursive=True) if "serving.api" in " ".join(p.cmdline())]
    return max(rss)


def _delta(s: Settings, server: Server, parent: str, rows: int) -> float:
    """Seconds from writing a delta of `rows` rows of `parent` until every worker applied it."""
    emb = store(s)
    version = str(int(parent) + 100)
    delta = {"item": TableRows(_ids("i", 0, rows), np.random.default_rng(7).normal(0, 0.05, (rows, 16)).astype(
        np.float32), np.array([], object))}
    spec, dense = emb.model_of(parent)
    started = time.perf_counter()
    write(s, emb, version, parent, 16, spec, dense, delta=lambda: delta, full=dict)  # as registration does
    written = time.perf_counter() - started
    workers = s.serving.workers
    while True:
        applied = _metric(server.url, "flywheel_sparse_delta_applied")
        if sum(v == float(version) for v in applied.values()) >= workers:
            break
        if time.perf_counter() - started > 120:
            raise RuntimeError(f"the delta reached {applied}, not {workers} workers, in 120 s")
        time.sleep(0.05)
    total = time.perf_counter() - started
    print(f"  delta of {rows:,} rows: written and sent in {written:.1f}s, applied by {workers} workers at {total:.1f}s",
          flush=True)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=40_000_000)
    parser.add_argument("--items", type=int, default=10_000_000)
    parser.add_argument("--zipf", type=float, default=1.1, help="Exponent of the ids' Zipf law.")
    parser.add_argument("--rate", type=float, default=40.0, help="Open-loop requests/s of each run.")
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of each measured run.")
    parser.add_argument("--rounds", type=int, default=3, help="Runs of each version, alternated.")
    parser.add_argument("--delta-rows", type=int, default=1_000_000)
    parser.add_argument("--shared-redis", action="store_true",
                        help="The store on the online store's Redis, as the default profile has it.")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, Python "
          f"{sys.version.split()[0]}, TensorFlow {tf.__version__}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-sparse-"))
    common = {"FLYWHEEL_CONFIG": os.devnull, "FLYWHEEL_REDIS_PASSWORD": secrets.token_hex(12)}
    # The store on a Redis of its own (`sparse_tier.redis_url`), a stack of its own in `tmp/store`: the
    # tier HugeCTR's parameter server reads, apart from the online features; `--shared-redis`: the
    # default profile's one server for both.
    own = load_settings(os.environ | stack.side_by_side_environ(tmp / "store") | common | {
        "FLYWHEEL_STACK_SERVICES": "redis"})
    s = load_settings(os.environ | stack.side_by_side_environ(tmp) | common | {
        "FLYWHEEL_STACK_SERVICES": "kafka,redis,mlflow", "FLYWHEEL_SERVING_POLL_INTERVAL_S": "1",
        "FLYWHEEL_SPARSE_TIER_ENABLED": "true", "FLYWHEEL_SPARSE_TIER_REDIS_URL": "" if args.shared_redis
        else own.redis.url})
    print(f"store: {'the online store' if args.shared_redis else 'its own'} Redis", flush=True)
    if not args.shared_redis:
        stack.up(own)
    try:
        stack.up(s)
        v1, v2, write_s, used = _world(s, tmp, args.users, args.items, args.zipf)
        ids = args.users + args.items
        print(f"store: {ids:,} ids written in {write_s:.0f}s, {used / 1e9:.2f} GB", flush=True)
        rng = np.random.default_rng(5)
        # A fresh stream per round (the same one for both versions of a round): the tier's cache must keep up
        # with requests it has not seen, as in production.
        loads = [[_request(rng, args.users, args.items, args.zipf) for _ in range(int(args.rate * (args.seconds + 3)))]
                 for _ in range(args.rounds + 1)]
        _quiet(s)
        connect(s).set_registered_model_alias(s.ranker.name, CHAMPION, v1)
        server = Server(s)
        try:
            latencies: dict[str, list[float]] = {v1: [], v2: []}  # every request's, pooled over the rounds
            cache = {"hit": 0.0, "all": 0.0}
            for load in loads[:-1]:
                for version in (v1, v2):
                    before = _tier(server.url)
                    latencies[version] += _serve(s, server, version, load, args.rate, args.seconds)
                    if version == v1:
                        moved = {k: v - before[k] for k, v in _tier(server.url).items()}
                        cache["hit"] += moved["cache"]
                        cache["all"] += moved["rows"]
                        each = 1000 * moved["read_s"] / max(moved["reads"], 1)
                        print(f"    store reads {moved['reads']:.0f}, {each:.2f} ms each", flush=True)
            connect(s).set_registered_model_alias(s.ranker.name, CHAMPION, v1)
            _serve(s, server, v1, loads[-1], args.rate, 3)
            rss = _workers_rss(server.s)
            delta_s = _delta(s, server, v1, args.delta_rows)
        finally:
            server.close()
    finally:
        alone = override(s, "stack", services=("serving",))  # a server that never became ready is left too
        for svc in enabled_services(alone):
            process.stop(stack.pidfile(alone, svc), alone.stack.stop_timeout_s)
        try:
            stack.down(s)
        finally:  # the store's Redis goes too when the stack's `down` fails
            if not args.shared_redis:
                stack.down(own)
        shutil.rmtree(tmp, ignore_errors=True)  # the store's append-only file: GBs
    p99 = {v: float(np.percentile(lat, 99)) for v, lat in latencies.items()}
    ratio = p99[v1] / p99[v2]
    print(f"p99 over {len(latencies[v1])} requests each: tier {p99[v1]:.1f} ms, in-worker {p99[v2]:.1f} ms")
    print(f"sparse-scale: ids {ids:,}, store GB {used / 1e9:.2f}, bytes/row {used / ids:.0f}, worker RSS max "
          f"{rss / 1e9:.2f} GB, p99 ratio {ratio:.2f} (tier vs in-worker), "
          f"cache hit {cache['hit'] / cache['all']:.3f}, "
          f"delta of {args.delta_rows:,} rows to all workers {delta_s:.1f} s")


if __name__ == "__main__":
    main()
