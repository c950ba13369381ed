"""Retrieval benchmark: recall@K and NDCG@K of the candidate sources on the dataset's history (the spec's,
`dataset.spec`: MovieLens-100k by default), one run.

Chronological split: everything before `--split` (default: the spec's `[demo] split`) trains (the
two-tower model, the item neighbours, popularity); each user with positives on both sides is then asked
for K items, judged against the next `--next` items they acted on positively after the split. Items a
user touched before the split are never candidates, unless the spec says items repeat (`[events] repeats`:
groceries), where they are what the repeat source lists. The sources are judged beside the baselines a
practitioner tries first, on the same split in the same run (models/baselines.py; popularity of all time,
of the last 30 days, decayed; where items repeat, each user's own items by count, then popularity).
Its last line, for scripts: `retrieval (NAME): merged R, two-tower T, best baseline BASELINE B`.
No stack needed: `make bench-retrieval` (another dataset: `FLYWHEEL_DATASET_SPEC=datasets/instacart/
dataset.toml make bench-retrieval`). Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import keras
import numpy as np
import psutil

from feature_repo.tables import catalog_rows
from infra import stack
from infra.settings import Settings, get_settings, load_settings, override, redis_password
from models.baselines import Interactions, ease, item_knn
from models.recall import (SOURCES, IndexFrame, PopularityPrior, co_interaction, decayed, merge, neighbours_of, popular,
                           query_vectors, recently_popular, source_weights)
from models.retrieval import Catalogue, Profiles, Split, TwoTower, judge, two_tower_lists
from models.retrieval_train import fit
from serving.nearline import redis_client
from streaming.history import history_events

WEIGHT_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)  # each source's weight in the merge, tuned on the validation window
PRIOR_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0)  # the popularity prior's weight, judged on the validation window
REPEAT_GRID = (7.0, 14.0, 30.0, 60.0, 120.0, 365.0)  # the repeat source's half-life (days), judged alike


Row = tuple[str, str, float, float]  # (user, item, time s, weight: the spec's for a positive, else 0)


def behavior(s: Settings) -> list[Row]:
    """The history the spec declares, as the demo replays it, in time order."""
    weights = s.spec.weights
    return [(e.user_id, e.item_id, e.event_time / 1000, weights.get(e.event_type, 0.0)) for e in history_events(s)]


@dataclass
class Window:
    """Behavior before `cut` trains; each judged user's next positives after it (before `end`) test."""

    cut: float
    rows: int  # behavior before the cut
    split: Split
    positives: list[Row]  # before the cut, in time order

    @classmethod
    def of(cls, rows: list[Row], cut: float, end: float, next_n: int, length: int, repeats: bool) -> Window:
        kept = [r for r in rows if r[2] < end]
        split = Split.at(((u, i, t, w > 0) for u, i, t, w in kept), cut, next_n, length, repeats)
        return cls(cut, sum(r[2] < cut for r in kept), split, [r for r in kept if r[2] < cut and r[3] > 0])

    @property
    def clicked(self) -> list[tuple[str, float]]:
        """(item, time) of each positive before the cut."""
        return [(i, t) for _, i, t, _ in self.positives]

    def unseen(self, ranked: list[str], n: int) -> dict[str, list[str]]:
        """`ranked`'s first n items each judged user may be given (`Split.excluded`)."""
        return {u: [i for i in ranked if i not in self.split.excluded(u)][:n] for u in self.split.users}

    def own(self, half_life_s: float | None) -> dict[str, list[str]]:
        """Each judged user's own positives before the cut, by their count decayed with `half_life_s` (None:
        not decayed), most first."""
        by_user: dict[str, list[tuple[str, float]]] = {u: [] for u in self.split.users}
        for u, i, t, _ in self.positives:
            if u in by_user:
                by_user[u].append((i, t))
        return {u: recently_popular(acted, half_life_s) if half_life_s else popular(i for i, _ in acted)
                for u, acted in by_user.items()}


def fixed_lists(s: Settings, w: Window, n: int) -> dict[str, dict[str, list[str]]]:
    """The graph's, popularity's and the repeat source's top n per judged user of window `w`, as /recommend
    finds them (no seed)."""
    split, half_life = w.split, s.graph.half_life_days * 86_400
    neighbours = co_interaction(((u, i, weight * 2 ** (-(w.cut - t) / half_life)) for u, i, t, weight in w.positives),
                                keep=s.graph.neighbours)
    own = w.own(s.retrieval.repeat_half_life_days * 86_400)
    return {"graph": {u: neighbours_of(split.recent[u][-s.retrieval.graph_seeds:], neighbours, n, split.excluded(u))
                      for u in split.users},
            "popularity": w.unseen(recently_popular(w.clicked, s.retrieval.popularity_half_life_days * 86_400), n),
            "repeat": {u: [i for i in own[u] if i not in split.excluded(u)][:n] for u in split.users}}


@dataclass
class Trained:
    """A two-tower model of one window and seed: its lists per prior weight, its training's seconds and losses."""

    lists: dict[float, dict[str, list[str]]]  # prior weight (PRIOR_GRID) -> top n per judged user
    seconds: float
    losses: list[float]
    model: TwoTower


def two_tower(s: Settings, w: Window, items: list, profiles: Profiles, seed: int, n: int) -> Trained:
    """The two-tower source's top n per judged user of window `w`, with each prior weight of PRIOR_GRID, its
    model trained on the window's past with `seed` as the retrieval_training DAG trains it (`s.retrieval`)."""
    split = w.split
    catalogue = Catalogue.build(items, dict(zip(*np.unique([i for _, i in split.clicks], return_counts=True))),
                                s.spec.table("item"))
    keras.utils.set_random_seed(seed)
    model = TwoTower(catalogue, profiles, sorted(split.seen), s.retrieval.dim, s.retrieval.sequence_length)
    started = time.perf_counter()
    losses = fit(s, model, split, seed)
    seconds = time.perf_counter() - started
    served = PopularityPrior.of(s.retrieval)
    lists = {weight: two_tower_lists(model, split, n, replace(served, weight=weight))
             for weight in sorted({*PRIOR_GRID, served.weight})}
    return Trained(lists, seconds, losses, model)


def merged(lists: dict[str, dict[str, list[str]]], users: list[str], k: int, weights: dict[str, float]
           ) -> dict[str, list[str]]:
    return {u: [i for i, _, _ in merge({name: lists[name][u] for name in SOURCES}, k, weights)] for u in users}


def tuned_weights(runs: list[dict[str, dict[str, list[str]]]], split: Split, k: int) -> dict[str, float]:
    """The merge weights (WEIGHT_GRID per source that lists anything; 1 for one that never does, as the
    repeat source where items do not repeat) of the best mean recall@k over the runs."""
    listing = [name for name in SOURCES if any(lists[name][u] for lists in runs for u in split.users)]
    best, best_recall = dict.fromkeys(SOURCES, 1.0), -1.0
    for values in itertools.product(WEIGHT_GRID, repeat=len(listing)):
        weights = dict.fromkeys(SOURCES, 1.0) | dict(zip(listing, values))
        recall = float(np.mean([judge(merged(lists, split.users, k, weights), split, k)[0] for lists in runs]))
        if recall > best_recall + 1e-9:
            best, best_recall = weights, recall
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", default=None, help="train before, test after (default: the spec's [demo] split)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--next", type=int, default=20, help="test items: each user's next N positives")
    parser.add_argument("--validation-days", type=int, default=28,
                        help="the merge's weights are tuned on the window this long before the split")
    parser.add_argument("--epochs", type=int, default=None, help="default: retrieval.epochs")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--ann", action="store_true", help="also time the ANN index against exact search "
                                                             "(starts a throwaway Redis)")
    args = parser.parse_args()
    s = get_settings()
    if args.epochs is not None:
        s = override(s, "retrieval", epochs=args.epochs)
    r = s.retrieval
    k, n = args.k, 3 * args.k  # the merge takes each source's top 3k, as /recommend does
    split = datetime.fromisoformat(args.split).replace(tzinfo=UTC) if args.split else s.spec.demo.split
    if split is None:
        parser.error(f"{s.spec.path} has no [demo] split: name one (--split YYYY-MM-DD)")
    split_s = split.timestamp()
    history = behavior(s)
    items = catalog_rows(s, s.spec.table("item"))  # the catalog's rows, as the DAG's training reads them
    profiles = Profiles.build(catalog_rows(s, s.spec.table("user")), s.spec.table("user"))
    test = Window.of(history, split_s, float("inf"), args.next, r.sequence_length, s.spec.repeats)
    validation = Window.of(history, split_s - args.validation_days * 86_400, split_s, args.next, r.sequence_length,
                           s.spec.repeats)
    users, served = test.split.users, source_weights(s.retrieval.source_weights)
    x = Interactions(test.split.clicks)
    excluded = {u: test.split.excluded(u) for u in users}
    fixed = {"test": fixed_lists(s, test, n), "validation": fixed_lists(s, validation, n)}
    baselines = {"popularity (decayed, the popularity source)": fixed["test"]["popularity"],
                 "popularity (all time)": test.unseen(popular(i for i, _ in test.clicked), n),
                 "popularity (last 30 days)": test.unseen(popular(i for i, t in test.clicked if t >= split_s - 30 * 86_400), n),
                 "EASE": x.lists(ease(x.x), users, n, excluded),
                 "item-kNN": x.lists(item_knn(x.x), users, n, excluded)}
    if s.spec.repeats:  # what a grocer tries first: each customer's usual items, then the popular ones
        everyone = popular(i for i, _ in test.clicked)
        baselines["own items by count, then popularity (all time)"] = {
            u: list(dict.fromkeys([*mine, *everyone]))[:n] for u, mine in test.own(None).items()}
    baseline_scores = {name: judge(lists, test.split, k) for name, lists in baselines.items()}
    trained, validation_runs, uniform = [], [], []
    for seed in range(args.seeds):  # the two-tower model's initialisation moves its figures: several seeds
        validation_runs.append(two_tower(s, validation, items, profiles, seed, n))
        trained.append(two_tower(s, test, items, profiles, seed, n))
        if r.recency_half_life_days:  # the ablation: each example once, as before the recency draw
            uniform.append(two_tower(override(s, "retrieval", recency_half_life_days=0.0), test, items, profiles,
                                     seed, n).lists[r.popularity_prior])
    tuned = tuned_weights([fixed["validation"] | {"two-tower": v.lists[r.popularity_prior]} for v in validation_runs],
                          validation.split, k)
    test_runs = [fixed["test"] | {"two-tower": t.lists[r.popularity_prior]} for t in trained]
    rows: dict[str, list[tuple[float, float]]] = {name: [judge(lists[name], test.split, k) for lists in test_runs]
                                                 for name in SOURCES}
    rows["two-tower, the model alone (prior weight 0)"] = [judge(t.lists[0.0], test.split, k) for t in trained]
    if uniform:
        rows["two-tower, examples drawn uniformly (no recency)"] = [judge(u, test.split, k) for u in uniform]
    rows["merged (as served)"] = [judge(merged(lists, users, k, served), test.split, k) for lists in test_runs]
    rows["merged (equal weights)"] = [judge(merged(lists, users, k, dict.fromkeys(SOURCES, 1.0)), test.split, k)
                                      for lists in test_runs]
    rows["merged (weights tuned on validation)"] = [judge(merged(lists, users, k, tuned), test.split, k)
                                                    for lists in test_runs]

    cpu = f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    last = trained[-1]
    print(f"Machine: {cpu}. {s.spec.name}, train before {split.date()} ({test.rows:,} events, {len(test.positives):,} "
          f"positives), test: {len(users)} users' next {args.next} positives after it. Two-tower: {r.epochs} epochs in "
          f"{last.seconds:.0f} s (last seed), in-batch loss {last.losses[0]:.3f} -> {last.losses[-1]:.3f}, examples "
          f"drawn by recency (half-life {r.recency_half_life_days:g} days), popularity prior weight {r.popularity_prior:g} (floor "
          f"{r.prior_floor:g}). Popularity: decayed, half-life "
          f"{s.retrieval.popularity_half_life_days:g} days, as served. Merged: weighted reciprocal-rank fusion of each "
          f"source's top {n}; as served: weights {served}; tuned on validation (the {args.validation_days} days "
          f"before the split, {len(validation.split.users)} users, trained before them): {tuned}. Mean over "
          f"{args.seeds} seeds of the two-tower model (sd: across seeds); baselines have no seed.\n")
    print(f"| source | recall@{k} | NDCG@{k} | recall sd | users |")
    print("|---|---:|---:|---:|---:|")
    for name, scores in rows.items():
        recall, ndcg = np.array(scores).T
        print(f"| {name} | {recall.mean():.4f} | {ndcg.mean():.4f} | {recall.std():.4f} | {len(users)} |")
    for name, (recall, ndcg) in baseline_scores.items():
        print(f"| *baseline:* {name} | {recall:.4f} | {ndcg:.4f} | - | {len(users)} |")
    best = max(baseline_scores, key=lambda b: baseline_scores[b][0])
    for name in ("merged (as served)", "two-tower"):
        recall, ndcg = np.mean(rows[name], axis=0)
        print(f"\n{name} / best baseline ({best}): recall@{k} {recall / baseline_scores[best][0]:.3f}, "
              f"NDCG@{k} {ndcg / baseline_scores[best][1]:.3f}", end="")
    print(f"\n\nThe two-tower source's recall@{k} by the prior's weight, on validation (the setting's choice) "
          "and on the test:\n")
    print("| prior weight | " + " | ".join(f"{w:g}" for w in PRIOR_GRID) + " |")
    print("|---|" + "---:|" * len(PRIOR_GRID))
    for name, runs, split in (("validation", validation_runs, validation.split), ("test", trained, test.split)):
        print(f"| {name} | " + " | ".join(f"{np.mean([judge(t.lists[w], split, k)[0] for t in runs]):.4f}"
                                          for w in PRIOR_GRID) + " |")
    if s.spec.repeats:
        print(f"\n\nThe repeat source's recall@{k} by its half-life in days, on validation (the setting's choice) "
              "and on the test:\n")
        print("| half-life | " + " | ".join(f"{h:g}" for h in REPEAT_GRID) + " |")
        print("|---|" + "---:|" * len(REPEAT_GRID))
        for name, w in (("validation", validation), ("test", test)):
            print(f"| {name} | " + " | ".join(f"{judge(w.own(h * 86_400), w.split, k)[0]:.4f}" for h in REPEAT_GRID)
                  + " |")
    if args.ann:
        ann_table(last.model, test.split, n, PopularityPrior.of(r))
    print(f"\nretrieval ({s.spec.name}): merged {np.mean(rows['merged (as served)'], axis=0)[0]:.4f}, two-tower "
          f"{np.mean(rows['two-tower'], axis=0)[0]:.4f}, best baseline {best} {baseline_scores[best][0]:.4f}")


def ann_table(model: TwoTower, split: Split, n: int, prior: PopularityPrior, queries: int = 2000) -> None:
    """The ANN index /recommend queries (a Redis 8 vector set, HNSW, the item vectors with their popularity
    prior at the cut, as serving/nearline.py builds it) against exact search in process (numpy, the same
    vectors): latency per query as a server sees it (the vector set's includes its round trip) and the share
    of the exact top n the index returns."""
    ids = model.catalogue.item_ids
    values = prior.values(decayed(zip((i for _, i in split.clicks), split.times), prior.half_life_s), ids, split.cut)
    frame = IndexFrame.around(values, model.temperature, split.cut, prior.headroom)
    vectors = frame.index_vectors(model.item_embeddings(), values)
    rng = np.random.default_rng(0)
    users = [split.users[i] for i in rng.integers(0, len(split.users), queries)]
    queries_v = query_vectors(model.user_embeddings(users, [split.recent[u] for u in users]))
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
