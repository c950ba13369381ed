"""An incremental run's warm start with the sparse tier on: the rows its window touches pulled from the embedding
store, beside its parent loaded whole as the registry gives it (`make bench-sparse-pull`).

Self-contained: a throwaway Redis. The parent: the serving benchmark's ranker with user and item tables of
`--ids` ids each (seeded random rows, accumulators and steps), exported as training exports it and registered
in the store as registration writes it (rows and training state). The window: `--examples` examples with Zipf
users, items and behavior sequences over those ids. Each warm start is timed, then run again under tracemalloc
for the memory it allocates (its peak); both are then trained one pass on the window, and their deltas must be
equal. Prints one line, `sparse-pull: ...`.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import tensorflow as tf

from benchmarks.serving import NUMERIC_FEATURES, SPEC
from contract.examples import PAD, Examples
from infra import stack
from infra.settings import load_settings
from models.ctr import TABLES, CtrModel, load_snapshot
from models.sparse import SparseTable, TableSnapshot
from models.sparse_tier import publish, pull, store


def _parent(n: int, rng: np.random.Generator) -> CtrModel:
    dim = SPEC.sparse.dim
    tables = {}
    for name, prefix in (("user", "u"), ("item", "i")):
        ids = np.char.add(prefix, np.arange(n).astype(str)).astype(object)
        tables[name] = SparseTable.restore(name, SPEC.sparse, TableSnapshot(
            ids, rng.normal(0, 0.05, (n, dim)).astype(np.float32), rng.uniform(0.1, 2, (n, dim)).astype(np.float32),
            rng.integers(1, 1000, n), np.array([], object), np.zeros(0, np.int64), version=1000))
    return CtrModel(SPEC, tables)


def _window(n: int, ids: int, rng: np.random.Generator) -> Examples:
    def zipf(size: int) -> np.ndarray:
        return (rng.zipf(1.1, size) - 1) % ids

    users, items = zipf(n), zipf(n)
    seq = np.full((n, SPEC.sequence_length), PAD, dtype=object)
    for r, k in enumerate(rng.integers(0, SPEC.sequence_length + 1, size=n)):
        seq[r, :k] = [f"i{j}" for j in zipf(k)]
    return Examples(np.array([f"u{u}" for u in users], object), np.array([f"i{i}" for i in items], object),
                    np.array([f"c{i % 20}" for i in items], object), seq,
                    rng.random((n, len(NUMERIC_FEATURES)), dtype=np.float32),
                    (rng.random(n) < 0.1).astype(np.float32))


def _timed(what: str, load):
    """The warm start timed, then once more under tracemalloc for its memory (numpy's arrays are traced too):
    the peak of what it allocated."""
    started = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - started
    del model
    gc.collect()
    tracemalloc.start()
    model = load()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"  {what}: {seconds:.2f} s, {peak / 1e6:.0f} MB allocated at peak, item rows {len(model.tables['item']):,}",
          flush=True)
    return model, seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=2_000_000, help="Ids in each of the user and item tables.")
    parser.add_argument("--examples", type=int, default=20_000, help="Examples in the run's window.")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, Python "
          f"{sys.version.split()[0]}, TensorFlow {tf.__version__}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-pull-"))
    s = load_settings(os.environ | stack.side_by_side_environ(tmp) | {
        "FLYWHEEL_CONFIG": os.devnull, "FLYWHEEL_REDIS_PASSWORD": secrets.token_hex(12),
        "FLYWHEEL_STACK_SERVICES": "redis"})
    rng = np.random.default_rng(0)
    stack.up(s)
    try:
        export = _parent(args.ids, rng).save(tmp / "v1")
        redis = store(s).client
        used, started = redis.info("memory")["used_memory"], time.perf_counter()
        publish(s, "1", "", export, None, keep=set())
        used = redis.info("memory")["used_memory"] - used
        print(f"  parent: {2 * args.ids:,} ids written to the store with their training state in "
              f"{time.perf_counter() - started:.0f}s, {used / (2 * args.ids):.0f} bytes per id", flush=True)
        window = _window(args.examples, args.ids, rng)
        pulled, pull_s, pull_mb = _timed("from the store", lambda: pull(s, "1", window))
        whole, whole_s, whole_mb = _timed("whole", lambda: CtrModel.load(export))
        since = whole.versions()
        for model, out in ((whole, "whole"), (pulled, "pulled")):
            model.fit(window, progress=False)
            model.save_delta(tmp / out, since)
        for name in TABLES:
            a, b = (load_snapshot(tmp / out / f"sparse-{name}.npz") for out in ("whole", "pulled"))
            if not a.equals(b):
                raise SystemExit(f"the deltas of table {name} differ")
        rows = sum(len(t) for t in pulled.tables.values())
    finally:
        stack.down(s)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"sparse-pull: parent ids {2 * args.ids:,}, window {args.examples:,} examples touching {rows:,} rows; "
          f"from the store {pull_s:.2f} s ({pull_mb / 1e6:.0f} MB), whole parent {whole_s:.2f} s "
          f"({whole_mb / 1e6:.0f} MB); deltas equal; store bytes/id {used / (2 * args.ids):.0f} with training state")


if __name__ == "__main__":
    main()
