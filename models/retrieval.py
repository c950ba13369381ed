"""Two-tower retrieval: a user tower (id, recent positive items, profile) and an item tower (id, attribute
tokens, numbers, popularity) map into one space; the attributes are the dataset spec's item and user tables'
(MovieLens: genres and release year; age, gender and occupation); a user's candidates are the catalogue items nearest to
its embedding (cosine), so retrieval covers the whole catalogue, not a list the caller brings.

Trained on positives (clicks) with in-batch negatives: the other items of a batch are each example's
negatives. Items enter a batch in proportion to their popularity, so each logit is corrected by the log
of that probability (logQ, Yi et al., RecSys 2019); uncorrected, the model learns to push popular
items away. The recent-items input shares the item id embedding with the item tower. Examples are drawn
by their recency (weight 2^(-age / half-life) at the newest one, `retrieval.recency_half_life_days`),
and logQ is taken of that draw: the model learns today's tastes more than last season's.

What the logQ-corrected score leaves out is how popular an item is now: the model learns how much more
likely an item is for this user than in the batches. Served and judged, the source adds the item's
decayed popularity as a prior (models/recall.py `PopularityPrior`: score = cos(u, i) / T + weight x ln(decayed count)),
the popularity source's own definition (models/recall.py `decayed`), so the two-tower list is the
currently popular items reweighted by the user's tastes. The ANN index serves that sum as one cosine
(models/recall.py `IndexFrame`): each item vector carries its prior and is padded to one norm.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from infra.dataset import AttributeSpec, TableSpec
from models.layers import MLP
from models.recall import PopularityPrior, decayed, ndcg_at_k, recall_at_k, top_k

PAD = 0  # index 0 of every vocabulary: padding and ids not seen in training


def _values(value: object) -> list[str]:
    """A categorical or multi cell's values (a missing one: none)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return [str(v) for v in value if v is not None and v == v]
    return [] if value is None or value != value or value == "" else [str(value)]


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


@dataclass(frozen=True)
class Catalogue:
    """The items the model can retrieve and their side inputs, row k = item k + 1 of the vocabulary."""

    item_ids: list[str]
    tokens: np.ndarray  # (n, T) multi-hot: the values of its categorical and multi attributes
    dense: np.ndarray  # (n, F): its number attributes and log popularity, standardized (missing: the mean)
    categories: list[str]  # each item's category (the spec's): what the ranker's affinity features use
    popular: list[str]  # items by positives in training, most first: the fallback source

    @classmethod
    def build(cls, items: list[dict], counts: dict[str, int], table: TableSpec) -> Catalogue:
        """From the item view's rows (item_id and each attribute's feature of `table`) and positives per
        item in training."""
        ids = [row["item_id"] for row in items]
        listed = [a for a in table.attributes if not a.numeric]
        per_row = [{f"{a.token}:{v}" for a in listed for v in _values(row.get(table.feature(a)))} for row in items]
        vocabulary = sorted(set().union(*per_row))
        hot = np.array([[v in r for v in vocabulary] for r in per_row], "float32").reshape(len(ids), len(vocabulary))
        columns = []
        for a in (a for a in table.attributes if a.numeric):
            x = np.array([_number(row.get(table.feature(a))) for row in items], "float32")
            columns.append(np.nan_to_num(x, nan=float(np.nanmean(x)) if np.isfinite(x).any() else 0.0))
        columns.append(np.log1p(np.array([counts.get(i, 0) for i in ids], "float32")))
        dense = np.stack(columns, axis=1)
        attribute = table.category_attribute
        category = table.feature(attribute) if attribute else ""
        categories = [(_values(row.get(category)) or [""])[0] for row in items]
        popular = sorted((i for i in ids if counts.get(i, 0) > 0), key=lambda i: (-counts[i], i))
        return cls(ids, hot, (dense - dense.mean(0)) / (dense.std(0) + 1e-6), categories, popular)


def _profile_key(a: AttributeSpec, value: object) -> object:
    """A user attribute's value as a profile input: a category, a list's first entry, a number's decade."""
    if a.numeric:
        x = _number(value)
        if a.kind == "date":  # days since the epoch: its year
            return None if x != x else 1970 + int(x // 365.25)
        return None if x != x else int(x) // 10 * 10
    return (_values(value) or [None])[0]


@dataclass(frozen=True)
class Profiles:
    """User id -> one index per profile attribute (the spec's user attributes with tokens: a category, a
    list's first entry, a number's decade); unknown users and missing values get PAD."""

    index: dict[str, tuple[int, ...]]
    sizes: tuple[int, ...]

    @classmethod
    def build(cls, users: list[dict], table: TableSpec) -> Profiles:
        """From the user view's rows (user_id and each attribute's feature of `table`)."""
        used = [a for a in table.attributes if a.tokens != "none"]
        keys = [[_profile_key(a, row.get(table.feature(a))) for a in used] for row in users]
        vocabularies = [{v: k + 1 for k, v in enumerate(sorted({row[j] for row in keys} - {None}))}
                        for j in range(len(used))]
        index = {row["user_id"]: tuple(vocab.get(k, PAD) for vocab, k in zip(vocabularies, key))
                 for row, key in zip(users, keys)}
        return cls(index, tuple(len(v) + 1 for v in vocabularies))

    def of(self, user_ids: Sequence[str]) -> np.ndarray:
        missing = (PAD,) * len(self.sizes)
        return np.array([self.index.get(u, missing) for u in user_ids], dtype="int32").reshape(-1, len(self.sizes))


class UserTower(keras.layers.Layer):
    """(user (B,) int, recent (B, L) int with PAD, profile (B, P) int) -> (B, D) unit vectors."""

    def __init__(self, users: int, item_embedding: keras.layers.Embedding, profile_sizes: Sequence[int], dim: int,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.user = keras.layers.Embedding(users, dim)
        self.items = item_embedding
        self.profile = [keras.layers.Embedding(n, 8) for n in profile_sizes]
        self.mlp = MLP([2 * dim, dim])

    def call(self, user, recent, profile):
        mask = tf.cast(recent != PAD, "float32")[..., None]
        pooled = tf.reduce_sum(self.items(recent) * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
        parts = [self.user(user), pooled] + [e(profile[:, k]) for k, e in enumerate(self.profile)]
        return tf.math.l2_normalize(self.mlp(tf.concat(parts, -1)), -1)


class ItemTower(keras.layers.Layer):
    """(item (B,) int, tokens (B, T), dense (B, F)) -> (B, D) unit vectors."""

    def __init__(self, item_embedding: keras.layers.Embedding, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.items = item_embedding
        self.mlp = MLP([2 * dim, dim])

    def call(self, item, tokens, dense):
        return tf.math.l2_normalize(self.mlp(tf.concat([self.items(item), tokens, dense], -1)), -1)


def in_batch_loss(users: tf.Tensor, items: tf.Tensor, item_index: tf.Tensor, log_q: tf.Tensor,
                  temperature: float) -> tf.Tensor:
    """Softmax over the batch's items, each row's own item the label. users, items (B, D); item_index,
    log_q (B,). A row's other copies of its own item are masked: they are not negatives."""
    logits = tf.matmul(users, items, transpose_b=True) / temperature - log_q[None, :]
    same = tf.equal(item_index[:, None], item_index[None, :])
    logits = tf.where(same & ~tf.eye(tf.shape(users)[0], dtype=tf.bool), -1e9, logits)
    labels = tf.range(tf.shape(users)[0])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


@dataclass
class Positives:
    """Training examples: a user's state just before a click, and the clicked item (vocabulary indices)."""

    users: np.ndarray  # (N,)
    recent: np.ndarray  # (N, L)
    items: np.ndarray  # (N,)
    user_ids: list[str]
    times: np.ndarray  # (N,) seconds: when the click happened


def recent_clicks(clicks: Sequence[tuple[str, str]], length: int) -> dict[str, list[str]]:
    """Each user's last `length` clicked items after `clicks` (user, item; time order), newest last."""
    recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=length))
    for user, item in clicks:
        recent[user].append(item)
    return {u: list(q) for u, q in recent.items()}


class TwoTower:
    """The retrieval model over a fixed vocabulary of training users and the catalogue's items."""

    def __init__(self, catalogue: Catalogue, profiles: Profiles, user_ids: Sequence[str], dim: int = 32,
                 sequence_length: int = 20, temperature: float = 0.1) -> None:
        self.catalogue, self.profiles, self.length, self.temperature = catalogue, profiles, sequence_length, temperature
        self.dim, self.user_ids = dim, list(user_ids)
        self.item_index = {i: k + 1 for k, i in enumerate(catalogue.item_ids)}
        self.user_index = {u: k + 1 for k, u in enumerate(user_ids)}
        shared = keras.layers.Embedding(len(catalogue.item_ids) + 1, dim)
        self.user_tower = UserTower(len(user_ids) + 1, shared, profiles.sizes, dim)
        self.item_tower = ItemTower(shared, dim)
        self.tokens = np.vstack([np.zeros((1, catalogue.tokens.shape[1]), "float32"), catalogue.tokens])
        self.dense = np.vstack([np.zeros((1, catalogue.dense.shape[1]), "float32"), catalogue.dense]).astype("float32")

    def positives(self, clicks: Sequence[tuple[str, str]], times: Sequence[float]) -> Positives:
        """Every (user, item) click at its time (seconds), in time order, with the user's clicks before it."""
        history: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.length))
        users, recent, items, ids, at = [], [], [], [], []
        for (user, item), t in zip(clicks, times, strict=True):
            if item not in self.item_index:
                continue
            users.append(self.user_index.get(user, PAD))
            recent.append(self._pad(history[user]))
            items.append(self.item_index[item])
            ids.append(user)
            at.append(t)
            history[user].append(item)
        return Positives(np.array(users, "int32"), np.array(recent, "int32").reshape(-1, self.length),
                         np.array(items, "int32"), ids, np.array(at, "float64"))

    def _pad(self, items: Sequence[str]) -> list[int]:
        idx = [self.item_index.get(i, PAD) for i in list(items)[-self.length:]]
        return [PAD] * (self.length - len(idx)) + idx

    def fit(self, data: Positives, epochs: int = 8, batch_size: int = 512, seed: int = 7,
            recency_half_life_s: float | None = None) -> list[float]:
        """Adam on the in-batch softmax with logQ; returns the mean loss per epoch. With a recency half-life,
        each epoch draws as many examples as there are, with replacement, each by 2^(-age / half-life) at the
        newest; without, each example once in a shuffled order."""
        weights = (np.ones(len(data.items)) if recency_half_life_s is None else
                   np.exp2((data.times - data.times.max(initial=0.0)) / recency_half_life_s))
        counts = np.bincount(data.items, weights=weights, minlength=len(self.item_index) + 1).astype("float64")
        log_q = np.log(counts / counts.sum() + 1e-12).astype("float32")
        profiles = self.profiles.of(data.user_ids)
        optimizer = keras.optimizers.Adam(0.003)
        towers = (self.user_tower, self.item_tower)

        @tf.function(reduce_retracing=True)
        def step(u, rec, prof, it):
            with tf.GradientTape() as tape:
                loss = in_batch_loss(self.user_tower(u, rec, prof),
                                     self.item_tower(it, tf.gather(self.tokens, it), tf.gather(self.dense, it)),
                                     it, tf.gather(log_q, it), self.temperature)
            variables = [v for t in towers for v in t.trainable_variables]
            variables = list({id(v): v for v in variables}.values())  # the shared item table once
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        n = len(data.items)
        batch_size = min(batch_size, n)  # a small window is one batch
        rng, losses = np.random.default_rng(seed), []
        for _ in range(epochs):
            total = []
            order = rng.permutation(n) if recency_half_life_s is None else rng.choice(n, n, p=weights / weights.sum())
            for b in range(0, len(order) - batch_size + 1, batch_size):
                k = order[b:b + batch_size]
                total.append(float(step(data.users[k], data.recent[k], profiles[k], data.items[k])))
            losses.append(float(np.mean(total)))
        return losses

    def item_embeddings(self) -> np.ndarray:
        """(n, D): row k is catalogue item k."""
        idx = np.arange(1, len(self.catalogue.item_ids) + 1, dtype="int32")
        return self.item_tower(idx, self.tokens[idx], self.dense[idx]).numpy()

    def user_embeddings(self, user_ids: Sequence[str], recent: Sequence[Sequence[str]]) -> np.ndarray:
        """(B, D) for users with their recent clicked items (oldest first); a new user is PAD everywhere."""
        users = np.array([self.user_index.get(u, PAD) for u in user_ids], "int32")
        rec = np.array([self._pad(r) for r in recent], "int32").reshape(-1, self.length)
        return self.user_tower(users, rec, self.profiles.of(user_ids)).numpy()

    # --- export ---------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """The model as a directory: its vocabularies and side inputs (JSON) and both towers' weights."""
        path.mkdir(parents=True, exist_ok=True)
        self.item_embeddings(), self.user_embeddings([""], [[]])  # builds the towers if never called
        c, p = self.catalogue, self.profiles
        (path / "model.json").write_text(json.dumps({
            "dim": self.dim, "sequence_length": self.length, "temperature": self.temperature,
            "user_ids": self.user_ids, "profiles": {"index": p.index, "sizes": p.sizes},
            "catalogue": {"item_ids": c.item_ids, "tokens": c.tokens.tolist(), "dense": c.dense.tolist(),
                          "categories": c.categories, "popular": c.popular}}))
        weights = [*self.user_tower.get_weights(), *self.item_tower.get_weights()]
        np.savez(path / "weights.npz", *weights)

    @classmethod
    def load(cls, path: Path) -> TwoTower:
        meta = json.loads((path / "model.json").read_text())
        c = meta["catalogue"]
        n = len(c["item_ids"])
        catalogue = Catalogue(c["item_ids"], np.array(c.get("tokens", c.get("genres")), "float32").reshape(n, -1),
                              np.array(c["dense"], "float32").reshape(n, -1), c["categories"], c["popular"])
        profiles = Profiles({u: tuple(v) for u, v in meta["profiles"]["index"].items()},
                            tuple(meta["profiles"]["sizes"]))
        model = cls(catalogue, profiles, meta["user_ids"], meta["dim"], meta["sequence_length"], meta["temperature"])
        model.item_embeddings(), model.user_embeddings([""], [[]])  # builds the towers
        with np.load(path / "weights.npz") as stored:
            weights = [stored[f"arr_{k}"] for k in range(len(stored.files))]
        users = len(model.user_tower.get_weights())
        model.user_tower.set_weights(weights[:users])
        model.item_tower.set_weights(weights[users:])
        return model


# --- judging candidates offline ---------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """Behavior split at a moment for judging candidate lists: what came before trains, each user's next
    clicks after it are what a list should have held."""

    clicks: list[tuple[str, str]]  # (user, item) positives before the cut, in time order
    times: list[float]  # each click's time (seconds)
    cut: float  # seconds
    seen: dict[str, set[str]]  # every item a user touched before the cut
    recent: dict[str, list[str]]  # each user's last positives before the cut, newest last
    test: dict[str, list[str]]  # each judged user's next positives after the cut
    users: list[str]  # the judged users: positives on both sides
    repeats: bool = False  # the spec's `[events] repeats`: a user's own items may be what they want next

    def excluded(self, user: str) -> set[str]:
        """What a list for `user` must leave out: every item they touched before, unless items repeat."""
        return set() if self.repeats else self.seen.get(user, set())

    @classmethod
    def at(cls, behavior: Iterable[tuple[str, str, int, bool]], cut: int, next_n: int, length: int,
           repeats: bool = False) -> Split:
        """From (user, item, time s, positive) rows in time order, split at time `cut` (s)."""
        clicks, times, seen, test = [], [], defaultdict(set), defaultdict(list)
        for user, item, t, positive in behavior:
            if t < cut:
                seen[user].add(item)
                if positive:
                    clicks.append((user, item))
                    times.append(t)
            elif positive and len(test[user]) < next_n and item not in test[user]:
                test[user].append(item)
        recent = recent_clicks(clicks, length)
        return cls(clicks, times, cut, dict(seen), recent, dict(test), sorted(u for u in test if u in recent),
                   repeats)


def judge(lists: dict[str, Sequence[str]], split: Split, k: int) -> tuple[float, float]:
    """Mean recall@k and NDCG@k of each judged user's list against their next positives."""
    scores = [(recall_at_k(lists[u], set(split.test[u]), k), ndcg_at_k(lists[u], set(split.test[u]), k))
              for u in split.users]
    return tuple(float(x) for x in np.mean(scores, axis=0)) if scores else (0.0, 0.0)


def two_tower_lists(model: TwoTower, split: Split, k: int, prior: PopularityPrior) -> dict[str, list[str]]:
    """Each judged user's top k by the model, from their recent positives, plus the items' popularity prior
    at the cut (as served), never an item the split excludes."""
    if not split.users:
        return {}
    users = model.user_embeddings(split.users, [split.recent[u] for u in split.users])
    now = decayed(zip((i for _, i in split.clicks), split.times), prior.half_life_s)
    scores = (users @ model.item_embeddings().T / model.temperature
              + prior.values(now, model.catalogue.item_ids, split.cut)[None, :])
    return {u: top_k(scores[row], model.catalogue.item_ids, k, split.excluded(u))
            for row, u in enumerate(split.users)}
