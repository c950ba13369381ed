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
from models.recall import co_interaction, merge, ndcg_at_k, neighbours_of, popular, recall_at_k, top_k
from models.retrieval import Catalogue, Profiles, TwoTower, recent_clicks
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
    split = int(datetime.fromisoformat(args.split).replace(tzinfo=UTC).timestamp())
    data = dataset_dir(s)
    ratings = load_ratings(data / "ml-100k.inter")
    train = [r for r in ratings if r.timestamp < split]
    test: dict[str, list[str]] = {}
    for r in ratings:
        if r.timestamp >= split and r.rating >= click and len(test.setdefault(r.user_id, [])) < args.next:
            test[r.user_id].append(r.item_id)
    seen: dict[str, set[str]] = {}
    for r in train:
        seen.setdefault(r.user_id, set()).add(r.item_id)
    clicks = [(r.user_id, r.item_id) for r in train if r.rating >= click]
    recent = recent_clicks(clicks, 20)
    users = sorted(u for u in test if u in recent)

    positives = [item for _, item in clicks]
    catalogue = Catalogue.build(load_side_table(data / "ml-100k.item"), dict(zip(*np.unique(positives, return_counts=True))))
    profiles = Profiles.build(load_side_table(data / "ml-100k.user"))
    half_life = s.graph.half_life_days * 86_400
    neighbours = co_interaction(((r.user_id, r.item_id, s.graph.click_weight * 2 ** (-(split - r.timestamp) / half_life))
                                 for r in train if r.rating >= click), keep=s.graph.neighbours)
    by_popularity = popular(positives)
    names = ("two-tower", "graph", "merged", "popularity")
    runs: list[dict[str, tuple[float, float]]] = []  # per seed: source -> (recall, ndcg) over users
    for seed in range(args.seeds):  # the two-tower model's initialisation moves its figures: several seeds
        keras.utils.set_random_seed(seed)
        model = TwoTower(catalogue, profiles, sorted(seen))
        started = time.perf_counter()
        losses = model.fit(model.positives(clicks), epochs=args.epochs, seed=seed)
        train_s = time.perf_counter() - started
        scores = model.user_embeddings(users, [recent[u] for u in users]) @ model.item_embeddings().T

        def sources(n: int, u: str, row: int) -> dict[str, list[str]]:
            return {"two-tower": top_k(scores[row], catalogue.item_ids, n, seen[u]),
                    "graph": neighbours_of(recent[u][-5:], neighbours, n, seen[u]),
                    "popularity": [i for i in by_popularity if i not in seen[u]][:n]}

        per_user: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for row, u in enumerate(users):
            relevant, lists = set(test[u]), sources(k, u, row)
            lists["merged"] = [i for i, _, _ in merge(sources(3 * k, u, row), k)]
            for name, listed in lists.items():
                per_user[name].append((recall_at_k(listed, relevant, k), ndcg_at_k(listed, relevant, k)))
        runs.append({name: tuple(np.mean(v, axis=0)) for name, v in per_user.items()})

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
