"""Retrieval training from the platform's own data, its MLflow versions and its gate.

A run reads the offline event log's behavior in [start, end) (test traffic left out) and the catalogue's
batch views (item attributes, user profiles), splits it at end - `retrieval.eval_days` (or halfway through a
shorter window), trains the two-tower model on what came before and judges it by recall@K on each user's next
`retrieval.gate_next` positives after the cut, its list scored as /recommend serves it (with the popularity
prior at the cut), as `make bench-retrieval` judges. The version is registered as `retrieval.name`; the gate
(its own task) recomputes that split from the version's tags (`eval_start` its cut) and compares it with
`@champion` on the same window:
promoted unless its recall is lower by more than `retrieval.max_recall_drop`, and never on fewer than
`retrieval.gate_min_users` judged users. Rollback is the ranker's (models/registry.py, the model_rollback
DAG with this model's name).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path

import keras
import mlflow
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
import tensorflow as tf

from feature_repo.definitions import ITEM_ATTRIBUTES, TIMESTAMP_FIELD, USER_PROFILE, BatchView
from feature_repo.event_log import read_event_log
from feature_repo.files import view_dir
from infra.settings import Settings
from models.recall import PopularityPrior, co_interaction, neighbours_of, recently_popular
from models.registry import CHAMPION, Decision, alias_version, connect, decide
from models.retrieval import Catalogue, Profiles, Split, TwoTower, judge, two_tower_lists
from streaming.events import TEST_TRAFFIC


class NoBehavior(RuntimeError):
    """The window holds too little behavior to train or judge a retrieval model."""


@dataclass(frozen=True)
class RetrievalOutcome:
    version: str
    recall: float
    ndcg: float
    users: int  # judged
    clicks: int  # trained on
    seconds: float
    # The same users' lists from the baselines a practitioner tries first: {name: {"recall": r, "ndcg": n}}
    baselines: dict[str, dict[str, float]]


def behavior(s: Settings, start_ms: int, end_ms: int) -> list[tuple[str, str, int, bool]]:
    """(user, item, time, positive) of every logged event in [start_ms, end_ms), time order, each once."""
    log = read_event_log(s, start_ms, end_ms)
    log = log.filter(pc.field("event_time") >= start_ms).filter(pc.field("event_time") < end_ms)
    df = log.select(["event_id", "user_id", "item_id", "event_type", "event_time", "context"]).to_pandas()
    df = df.drop_duplicates("event_id")
    df = df[[TEST_TRAFFIC not in c or json.loads(c).get(TEST_TRAFFIC) is not True for c in df["context"]]]
    df = df.sort_values("event_time", kind="stable")
    return list(zip(df["user_id"], df["item_id"], df["event_time"].astype(int), df["event_type"].isin(s.spec.positives)))


def _latest(s: Settings, view: str, key: str) -> pd.DataFrame:
    """The newest row per entity of a batch view's offline files."""
    files = sorted(view_dir(s, view).glob("*.parquet"))
    if not files:
        return pd.DataFrame()
    df = pd.concat([pq.read_table(f).to_pandas() for f in files])
    return df.sort_values(TIMESTAMP_FIELD, kind="stable").drop_duplicates(key, keep="last")


def catalogue_rows(s: Settings) -> tuple[list[dict], list[dict]]:
    """The catalogue's items and users: each one's newest row of the catalog's views (id and a feature per
    attribute the dataset spec declares)."""
    def rows(view: BatchView) -> list[dict]:
        df = _latest(s, view.name, view.keys[0])
        return df[[c for c in (*view.keys, *(name for name, _ in view.columns)) if c in df]].to_dict("records")
    return rows(ITEM_ATTRIBUTES), rows(USER_PROFILE)


def eval_cut(s: Settings, start: datetime, end: datetime) -> datetime:
    """Where a window's judged part begins: `retrieval.eval_days` before its end, or halfway through a window
    shorter than twice that (a shop's 12 days of history would otherwise leave nothing to train on)."""
    return end - min(timedelta(days=s.retrieval.eval_days), (end - start) / 2)


def split_of(s: Settings, start: datetime, cut: datetime, end: datetime) -> Split:
    """The window's behavior split at `cut`, times in seconds."""
    ms = [int(t.timestamp() * 1000) for t in (start, cut, end)]
    rows = ((u, i, t / 1000, positive) for u, i, t, positive in behavior(s, ms[0], ms[2]))
    return Split.at(rows, ms[1] / 1000, s.retrieval.gate_next, s.retrieval.sequence_length, s.spec.repeats)


def baseline_lists(s: Settings, split: Split, k: int) -> dict[str, dict[str, list[str]]]:
    """Per judged user, the top k items (of those the split does not exclude) of item popularity (positives
    before the cut, decayed as the popularity source serves them), of item co-occurrence (the items most often
    positive with the user's `retrieval.graph_seeds` newest positives by the same users: the behavior graph's
    neighbours, unweighted) and, where items repeat, of the user's own items by count, then popularity."""
    ranked = recently_popular(zip((i for _, i in split.clicks), split.times),
                              s.retrieval.popularity_half_life_days * 86_400)
    neighbours = co_interaction(((u, i, 1.0) for u, i in split.clicks), keep=s.graph.neighbours)
    seen = {u: split.excluded(u) for u in split.users}
    lists = {"popularity": {u: list(islice((i for i in ranked if i not in seen[u]), k)) for u in split.users},
             "co-occurrence": {u: neighbours_of(split.recent[u][-s.retrieval.graph_seeds:], neighbours, k, seen[u])
                               for u in split.users}}
    if split.repeats:  # a grocer's first try
        own: dict[str, Counter] = defaultdict(Counter)
        for u, i in split.clicks:
            own[u][i] += 1
        lists["own-items"] = {u: list(islice(dict.fromkeys([*(i for i, _ in own[u].most_common()), *ranked]), k))
                              for u in split.users}
    return lists


def build_model(s: Settings, split: Split) -> TwoTower:
    """An untrained model over the catalogue, with the items that only behavior names added to it."""
    items, users = catalogue_rows(s)
    known = {row["item_id"] for row in items}
    items += [{"item_id": i} for i in sorted({i for _, i in split.clicks} - known)]
    counts = pd.Series([i for _, i in split.clicks]).value_counts().to_dict()
    r = s.retrieval
    return TwoTower(Catalogue.build(items, counts, s.spec.table("item")), Profiles.build(users, s.spec.table("user")),
                    sorted(split.seen), r.dim,
                    r.sequence_length)


def fit(s: Settings, model: TwoTower, split: Split, seed: int) -> list[float]:
    """Train `model` on the split's clicks before the cut, drawn by recency (`retrieval.recency_half_life_days`)."""
    r = s.retrieval
    half_life = r.recency_half_life_days * 86_400 or None
    return model.fit(model.positives(split.clicks, split.times), epochs=r.epochs, seed=seed,
                     recency_half_life_s=half_life)


class RetrievalPyfunc(mlflow.pyfunc.PythonModel):
    """`models:/<retrieval>@champion` as a pyfunc: a frame of user_id and recent (item ids, oldest first)
    -> their user-tower embeddings."""

    def load_context(self, context) -> None:
        self.model = TwoTower.load(Path(context.artifacts["model"]))

    def predict(self, context, model_input: pd.DataFrame, params=None):
        return self.model.user_embeddings(list(model_input["user_id"]), list(model_input["recent"]))


def load_retrieval(s: Settings, version: str) -> TwoTower:
    connect(s)
    return mlflow.pyfunc.load_model(f"models:/{s.retriever.name}/{version}").unwrap_python_model().model


def train_retrieval(s: Settings, start: datetime, end: datetime, seed: int = 7) -> RetrievalOutcome:
    """Train on [start, eval_cut), judge on the rest, register the version (no promotion)."""
    connect(s)  # fail before any work when the registry is unreachable
    started, r = time.perf_counter(), s.retrieval
    cut = eval_cut(s, start, end)
    split = split_of(s, start, cut, end)
    if len(split.clicks) < 100 or not split.users:
        raise NoBehavior(f"{len(split.clicks)} positives before and {len(split.users)} users with positives on both "
                         f"sides of the cut in [{start.isoformat()}, {end.isoformat()}): nothing to train or judge on")
    keras.utils.set_random_seed(seed)
    model = build_model(s, split)
    losses = fit(s, model, split, seed)
    recall, ndcg = judge(two_tower_lists(model, split, r.gate_k, PopularityPrior.of(r)), split, r.gate_k)
    baselines = {name: dict(zip(("recall", "ndcg"), judge(lists, split, r.gate_k)))
                 for name, lists in baseline_lists(s, split, r.gate_k).items()}
    mlflow.set_experiment(s.retriever.experiment)
    with mlflow.start_run(run_name="two-tower"), tempfile.TemporaryDirectory() as tmp:
        mlflow.log_params({"data_start": start.isoformat(), "data_end": end.isoformat(), "eval_start": cut.isoformat(),
                           "dim": r.dim, "sequence_length": r.sequence_length, "epochs": r.epochs,
                           "recency_half_life_days": r.recency_half_life_days,
                           "items": len(model.catalogue.item_ids), "users": len(model.user_ids)})
        for epoch, loss in enumerate(losses):
            mlflow.log_metric("in_batch_loss", loss, step=epoch)
        mlflow.log_metrics({f"recall_at_{r.gate_k}": recall, f"ndcg_at_{r.gate_k}": ndcg,
                            "judged_users": float(len(split.users)), "positives": float(len(split.clicks)),
                            **{f"{m}_at_{r.gate_k}_{name}": v for name, b in baselines.items() for m, v in b.items()}})
        model.save(Path(tmp) / "model")
        info = mlflow.pyfunc.log_model(
            name="model", python_model=RetrievalPyfunc(), artifacts={"model": str(Path(tmp) / "model")},
            pip_requirements=[f"tensorflow-cpu=={tf.__version__}", f"mlflow=={mlflow.__version__}"],
            registered_model_name=s.retriever.name)
    version = str(info.registered_model_version)
    client = connect(s)
    for key, value in {"kind": "two-tower", "data_start": start.isoformat(), "data_end": end.isoformat(),
                       "eval_start": cut.isoformat(), "eval_end": end.isoformat(),
                       "gate_recall": f"{recall:.6f}"}.items():
        client.set_model_version_tag(s.retriever.name, version, key, value)
    return RetrievalOutcome(version, recall, ndcg, len(split.users), len(split.clicks), time.perf_counter() - started,
                            baselines)


def gate_retrieval(s: Settings, version: str) -> Decision:
    """Promote `version` to the retrieval @champion, or make it @challenger, by recall@K on its own
    evaluation window against the champion's on the same window."""
    r, name, client = s.retrieval, s.retriever.name, connect(s)
    tags = client.get_model_version(name, version).tags
    start, cut, end = (datetime.fromisoformat(tags[k]) for k in ("data_start", "eval_start", "data_end"))
    split = split_of(s, start, cut, end)
    window = f"{len(split.users)} users' next positives in [{tags['eval_start']}, {tags['eval_end']})"
    prior = PopularityPrior.of(r)
    recall, _ = judge(two_tower_lists(load_retrieval(s, version), split, r.gate_k, prior), split, r.gate_k)
    champion, champion_recall, guardrail = alias_version(client, name, CHAMPION), None, None
    if champion == version:
        reason = f"v{version} is already the champion"
    elif len(split.users) < r.gate_min_users:
        guardrail, reason = "evidence", f"{len(split.users)} judged users; the gate needs {r.gate_min_users}"
    elif champion is None:
        reason = f"first champion (recall@{r.gate_k} {recall:.4f} on {window})"
    else:
        champion_recall, _ = judge(two_tower_lists(load_retrieval(s, champion), split, r.gate_k, prior), split,
                                   r.gate_k)
        worse = recall < champion_recall - r.max_recall_drop
        guardrail = "recall" if worse else None
        reason = (f"recall@{r.gate_k} {recall:.4f} vs champion v{champion}'s {champion_recall:.4f} on {window}: "
                  f"{'worse' if worse else 'not worse'} beyond the tolerance {r.max_recall_drop}")
    return decide(s, version, guardrail, reason, recall, champion, champion_recall, {"gate_recall": f"{recall:.6f}"},
                  model=s.retriever)


def retrieval_window(s: Settings, end: datetime | None) -> tuple[datetime, datetime]:
    end = end or datetime.now(UTC)
    return end - timedelta(days=s.retrieval.training_days), end

