"""Retrieval benchmark: recall@K and NDCG@K of the candidate sources on MovieLens-100k, one run.

Chronological split: everything rated before `--split` trains (the two-tower model, the item
neighbours, popularity); each user with clicks on both sides is then asked for K items, judged
against the next `--next` items they clicked after the split. Items a user rated before the split
are never candidates. No stack needed: `make bench-retrieval`. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import keras
import numpy as np
import psutil

from infra.settings import get_settings
from models.recall import co_interaction, merge, neighbours_of
from models.retrieval import Catalogue, Profiles, Split, TwoTower, judge, two_tower_lists
from streaming.movielens import dataset_dir, load_ratings, load_side_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", default="1998-03-01", help="train before, test after (`make demo`'s history)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--next", type=int, default=10, help="test items: each user's next N clicks")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=5)
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


if __name__ == "__main__":
    main()
