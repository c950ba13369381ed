"""Retrieval benchmark: recall@K and NDCG@K of the candidate sources on MovieLens-100k, one run.

Chronological split: everything rated before `--split` trains (the two-tower model, the item
neighbours, popularity); each user with clicks on both sides is then asked for K items, judged
against the next `--next` items they clicked after the split. Items a user rated before the split
are never candidates. No stack needed: `make bench-retrieval`. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import keras
import numpy as np
import psutil

from infra import stack
from infra.settings import get_settings, load_settings, override, redis_password
from models.recall import co_interaction, merge, neighbours_of
from models.retrieval import Catalogue, Profiles, Split, TwoTower, judge, two_tower_lists
from serving.nearline import redis_client
from streaming.movielens import dataset_dir, load_ratings, load_side_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", default="1998-03-01", help="train before, test after (`make demo`'s history)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--next", type=int, default=10, help="test items: each user's next N clicks")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--ann", action="store_true", help="also time the ANN index against exact search "
                                                             "(starts a throwaway Redis)")
    args = parser.parse_args()
    s = get_settings()
    click, k = s.movielens.click_min_rating, args.k
    split_s = int(datetime.fromisoformat(args.split).replace(tzinfo=UTC).timestamp())
    data = dataset_dir(s)
    ratings = load_ratings(data / "ml-100k.inter")
    split = Split.at(((r.user_id, r.item_id, r.timestamp, r.rating >= click) for r in ratings), split_s, args.next,
                     s.retrieval.sequence_length)
    train = [r for r in ratings if r.timestamp < split_s]
    positives = [item for _, item in split.clicks]
    catalogue = Catalogue.build(load_side_table(data / "ml-100k.item"), dict(zip(*np.unique(positives, return_counts=True))))
    profiles = Profiles.build(load_side_table(data / "ml-100k.user"))
    half_life = s.graph.half_life_days * 86_400
    neighbours = co_interaction(((r.user_id, r.item_id, s.graph.click_weight * 2 ** (-(split_s - r.timestamp) / half_life))
                                 for r in train if r.rating >= click), keep=s.graph.neighbours)
    users, n = split.users, 3 * k  # the merge takes each source's top 3k, as /recommend does
    graph = {u: neighbours_of(split.recent[u][-s.retrieval.graph_seeds:], neighbours, n, split.seen[u]) for u in users}
    by_popularity = {u: [i for i in catalogue.popular if i not in split.seen[u]][:n] for u in users}
    names = ("two-tower", "graph", "merged", "popularity")
    runs: list[dict[str, tuple[float, float]]] = []  # per seed: source -> (recall, ndcg) over users
    for seed in range(args.seeds):  # the two-tower model's initialisation moves its figures: several seeds
        keras.utils.set_random_seed(seed)
        model = TwoTower(catalogue, profiles, sorted(split.seen), s.retrieval.dim, s.retrieval.sequence_length)
        started = time.perf_counter()
        losses = model.fit(model.positives(split.clicks), epochs=args.epochs, seed=seed)
        train_s = time.perf_counter() - started
        ann = two_tower_lists(model, split, n)
        lists = {"two-tower": ann, "graph": graph, "popularity": by_popularity,
                 "merged": {u: [i for i, _, _ in merge({"two-tower": ann[u], "graph": graph[u],
                                                        "popularity": by_popularity[u]}, k)] for u in users}}
        runs.append({name: judge(lists[name], split, k) for name in names})

    cpu = f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    print(f"Machine: {cpu}. MovieLens-100k, train before {args.split} ({len(train):,} ratings), test: {len(users)} users' "
          f"next {args.next} clicks after it. Two-tower: {args.epochs} epochs in {train_s:.0f} s (last seed), in-batch "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}. Merged: reciprocal-rank fusion of each source's top {3 * k}. "
          f"Mean over {args.seeds} seeds of the two-tower model (sd: across seeds).\n")
    print(f"| source | recall@{k} | NDCG@{k} | recall sd | users |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        recall, ndcg = (np.array([run[name][m] for run in runs]) for m in (0, 1))
        print(f"| {name} | {recall.mean():.4f} | {ndcg.mean():.4f} | {recall.std():.4f} | {len(users)} |")
    if args.ann:
        ann_table(model, split, n)


def ann_table(model: TwoTower, split: Split, n: int, queries: int = 2000) -> None:
    """The ANN index /recommend queries (a Redis 8 vector set, HNSW, as serving/nearline.py builds it)
    against exact search in process (numpy, the same vectors): latency per query as a server sees it
    (the vector set's includes its round trip) and the share of the exact top n the index returns."""
    vectors = model.item_embeddings().astype("float32")
    ids = model.catalogue.item_ids
    rng = np.random.default_rng(0)
    users = [split.users[i] for i in rng.integers(0, len(split.users), queries)]
    queries_v = model.user_embeddings(users, [split.recent[u] for u in users]).astype("float32")
    with tempfile.TemporaryDirectory() as tmp:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        s = load_settings(environ | stack.side_by_side_environ(Path(tmp)) | {"FLYWHEEL_STACK_SERVICES": "redis"})
        s = override(s, "redis", password=redis_password(s))
        stack.up(s)
        try:
            r, key = redis_client(s), "bench:items"
            pipe = r.pipeline(transaction=False)
            for item, v in zip(ids, vectors):
                pipe.execute_command("VADD", key, "FP32", v.tobytes(), item, "NOQUANT")
            pipe.execute()
            rows = []
            for name, search in (
                    ("Redis vector set (VSIM, HNSW, one round trip)",
                     lambda q: [i.decode() for i in r.execute_command("VSIM", key, "FP32", q.tobytes(), "COUNT", n)]),
                    ("exact, in process (numpy, brute force)",
                     lambda q: [ids[j] for j in np.argsort(-(vectors @ q))[:n]])):
                seconds, overlap = [], []
                for q in queries_v:
                    t0 = time.perf_counter()
                    got = search(q)
                    seconds.append(time.perf_counter() - t0)
                    overlap.append(len(set(got) & {ids[j] for j in np.argsort(-(vectors @ q))[:n]}) / n)
                rows.append((name, *np.percentile(seconds, [50, 99]) * 1000, np.mean(overlap)))
        finally:
            stack.down(s)
    print(f"\nANN: {len(ids):,} items, {vectors.shape[1]} dimensions, top {n}, {queries:,} queries (users' vectors).\n")
    print(f"| index | p50 ms | p99 ms | share of the exact top {n} |")
    print("|---|---:|---:|---:|")
    for name, p50, p99, share in rows:
        print(f"| {name} | {p50:.3f} | {p99:.3f} | {share:.3f} |")


if __name__ == "__main__":
    main()
