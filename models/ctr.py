"""A CTR model = sparse embedding tables (CPU, keyed by raw id) + a dense Keras network (XLA).

A training step gathers the rows of the batch's ids, runs the compiled dense step, which returns the
loss, applies the dense gradients and hands back the gradients of the gathered embeddings, and then
applies those to the sparse rows (each table's own Adagrad). Exported as the dense weights plus a
snapshot of every table; `save_delta` writes only the rows changed since a version.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banner is not ours to show
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from contract.examples import PAD, Examples, fit_width  # noqa: E402
from contract.inputs import CONTEXT_TOKEN_FIELDS  # noqa: E402
from contract.terms import Terms, context_fields, token_prefixes  # noqa: E402
from models.architectures import architecture  # noqa: E402
from models.networks import EMBEDDED, MASK_OF, TABLE_OF  # noqa: E402
from models.sparse import DEFAULT_ROW, SparseConfig, SparseTable, TableSnapshot, apply_delta  # noqa: E402
from streaming.events import dataset_spec, declared_types  # noqa: E402

TABLES = ("user", "item", "category", "attribute")  # behaviors share the item table; attribute: item and user tokens


@dataclass(frozen=True)
class Groups:
    """The rows of a batch that share lists (`CtrModel.groups`)."""

    lists: dict[str, np.ndarray]  # the padded id lists at the spec's widths (`CtrModel._lists`)
    firsts: np.ndarray  # [U] the first row of each run of rows with the same behaviors and user attributes
    long_owner: np.ndarray  # [N] int32: each row's distinct (long history, its types)
    long_firsts: np.ndarray  # [G] the first row of each


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "ranker"  # its architecture (models/architectures.py): a registered name or an import path
    numeric_features: tuple[str, ...] = ()
    sequence_length: int = 50
    long_length: int = 20  # behaviors of the candidate's category from the long history (0: none)
    token_length: int = 8  # attribute tokens per item and per user
    sparse: SparseConfig = field(default_factory=SparseConfig)
    hidden: tuple[int, ...] = (128, 64)
    numeric_bins: int = 0  # the ranker's piecewise-linear bins per numeric feature (0: versions before them)
    learning_rate: float = 1e-3  # the dense network's Adam
    batch_size: int = 256
    jit_compile: bool = True
    # The behaviors' event types the type embedding is sized for (id n + 1; 0: padding or a type not in it):
    # the dataset spec's when trained, kept with the version whatever the spec says later.
    event_types: tuple[str, ...] = field(default_factory=declared_types)
    # The rest of its terms (contract/terms.py): empty in versions that predate them (not checked).
    dataset: str = field(default_factory=lambda: dataset_spec().name)
    tokens: tuple[str, ...] = field(default_factory=token_prefixes)
    # The exposures' ranks with a bias of their own, learnt apart and left out of every score (`[events.position]`
    # when trained; 0: none).
    position_slots: int = 0
    # Its objectives (`[objectives]` when trained): (name, the name of the one it is over or ""), a network each;
    # (): one, the spec's labels.
    objectives: tuple[tuple[str, str], ...] = ()

    @property
    def chain(self) -> tuple[int, ...]:
        """Each objective's exposure space: the index of the objective it is over, -1 for the exposures; (): one
        objective (two or more have a network each)."""
        names = [name for name, _ in self.objectives]
        return tuple(names.index(over) if over else -1 for _, over in self.objectives) if len(names) > 1 else ()

    @property
    def context(self) -> tuple[str, ...]:
        """The request context fields it reads (`[events.context]` when trained, less an ablation's)."""
        return context_fields(self.tokens)

    @property
    def terms(self) -> Terms:
        return Terms(self.dataset, self.event_types, self.numeric_features, self.tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        raw = json.loads(text)
        if "long_length" not in raw:  # exported before the long history: its ranker is ranker-v1
            raw |= {"kind": "ranker-v1" if raw["kind"] == "ranker" else raw["kind"], "long_length": 0}
        return cls(**raw | {"sparse": SparseConfig(**raw["sparse"]), "numeric_features": tuple(raw["numeric_features"]),
                            "hidden": tuple(raw["hidden"])}
                   | ({"event_types": tuple(raw["event_types"])} if "event_types" in raw else {})
                   | {"dataset": raw.get("dataset", ""), "tokens": tuple(raw.get("tokens", ())),
                      "objectives": tuple(tuple(o) for o in raw.get("objectives", ()))})


class CtrModel:
    def __init__(self, spec: ModelSpec, tables: dict[str, SparseTable] | None = None) -> None:
        arch = architecture(spec.kind)
        if arch.embedding_dim is not None and spec.sparse.dim != arch.embedding_dim:
            raise ValueError(f"{spec.kind} takes embeddings of dimension {arch.embedding_dim}, not {spec.sparse.dim}")
        self.spec = spec
        self._type_ids = {kind: n + 1 for n, kind in enumerate(spec.event_types)}
        self.tables = {name: SparseTable(name, spec.sparse) for name in TABLES} | (tables or {})
        self.network = arch.build(spec)
        self.optimizer = keras.optimizers.Adam(spec.learning_rate)
        self._over = spec.chain
        # Build the variables eagerly: the compiled step must not create any.
        inputs = self._dense_inputs(self._lookup(_empty(spec), train=False), _empty(spec))
        self.network(inputs)
        if self._over:  # every objective's network, not only the first's (the scores')
            self.network.heads(inputs)
        self.optimizer.build(self.network.trainable_variables)
        self._step = tf.function(self._dense_step, jit_compile=spec.jit_compile, reduce_retracing=True)
        self._predict = tf.function(self._dense_predict, jit_compile=spec.jit_compile, reduce_retracing=True)
        self._predict_objectives = tf.function(lambda x: probabilities(self.network.heads(x), self._over),
                                               jit_compile=spec.jit_compile, reduce_retracing=True)

    # --- inputs ----------------------------------------------------------------------------------

    def _lists(self, ex: Examples) -> dict[str, np.ndarray]:
        """The padded id lists of `ex` at this spec's widths (the long history's: none for a spec without)."""
        k = self.spec.long_length
        return {"sequence": ex.sequences[:, : self.spec.sequence_length],
                "long_sequence": fit_width(ex.long_sequences[:, :k], k),
                "long_types": fit_width(ex.long_types[:, :k], k),
                "item_tokens": fit_width(ex.item_tokens, self.spec.token_length),
                "user_tokens": fit_width(ex.user_tokens, self.spec.token_length),
                "context_tokens": self._context(ex.context_tokens)}

    def _context(self, tokens: np.ndarray) -> np.ndarray:
        """The request context tokens [N, C] this version reads: all the spec declares, or (an ablation) those of
        its fields only; none (one padding column) for a version without."""
        fields = self.spec.context
        if not fields:
            return np.full((len(tokens), 1), PAD, dtype=object)
        if fields != CONTEXT_TOKEN_FIELDS:
            read = np.array([str(v).partition(":")[0] in fields for v in tokens.ravel()], bool).reshape(tokens.shape)
            tokens = np.where(read, tokens, PAD)
        return fit_width(tokens, len(CONTEXT_TOKEN_FIELDS))

    def _rows(self, table: str, ids: np.ndarray, train: bool, distinct: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows of a padded id list ([N, W]; padding -> the default row, never counted) and its mask.
        Scoring looks each distinct list up once (a request's candidates share their user's, a
        category's), unless the caller says its lists are `distinct` already."""
        if not train and not distinct and len(ids) > 1 and ids.shape[1]:
            of_row, firsts = _distinct_rows(ids)
            if len(firsts) < len(ids):
                rows, mask = self._rows(table, ids[firsts], train, distinct=True)
                return rows[of_row], mask[of_row]
        real = ids != PAD
        rows = np.full(ids.shape, DEFAULT_ROW, np.int64)
        rows[real] = self.tables[table].lookup(ids[real].tolist(), train)  # training: each occurrence counts
        return rows, real.astype(np.float32)

    def _types(self, types: np.ndarray) -> np.ndarray:
        """Event types [N, L] str as type ids [N, L] int32."""
        if not types.size:
            return np.zeros(types.shape, np.int32)
        # Hashed, not sorted (np.unique of strings was a third of a batch's input preparation).
        codes, kinds = pd.factorize(types.ravel(), use_na_sentinel=False)
        return np.array([self._type_ids.get(k, 0) for k in kinds], np.int32)[codes].reshape(types.shape)

    def _lookup(self, ex: Examples, train: bool) -> dict[str, np.ndarray]:
        """Rows of every id of the batch; list padding -> the default row, never counted. Only the newest
        `sequence_length` behaviors are used."""
        lists = self._lists(ex)
        rows = {"user": self.tables["user"].lookup(ex.user_ids.tolist(), train),
                "item": self.tables["item"].lookup(ex.item_ids.tolist(), train),
                "category": self.tables["category"].lookup(ex.categories.tolist(), train),
                "sequence_types": self._types(ex.sequence_types[:, : self.spec.sequence_length]),
                "long_types": self._types(lists["long_types"])}
        for name, mask in MASK_OF.items():
            rows[name], rows[mask] = self._rows(TABLE_OF[name], lists[name], train)
        return rows

    def _dense_inputs(self, rows: dict[str, np.ndarray], ex: Examples) -> dict[str, tf.Tensor]:
        """Inputs with the sequence padded to `spec.sequence_length`: one compiled shape per batch size."""
        return {k: tf.constant(v) for k, v in self._input_arrays(rows, ex, self.spec.sequence_length).items()}

    def _input_arrays(self, rows: dict[str, np.ndarray], ex: Examples, length: int) -> dict[str, np.ndarray]:
        seq, mask, types = rows["sequence"][:, :length], rows["sequence_mask"][:, :length], rows["sequence_types"][:, :length]
        if seq.shape[1] < length:
            pad = ((0, 0), (0, length - seq.shape[1]))
            seq, mask, types = np.pad(seq, pad), np.pad(mask, pad), np.pad(types, pad)
        return self._gathered(rows | {"sequence": seq, "sequence_mask": mask, "sequence_types": types}, ex)

    def _gathered(self, rows: dict[str, np.ndarray], ex: Examples) -> dict[str, np.ndarray]:
        """The network's inputs from looked-up rows: embeddings gathered, masks and types as they are."""
        out = {name: self.tables[TABLE_OF[name]].gather(value) if name in TABLE_OF else value
               for name, value in rows.items()}
        return out | {"numeric": ex.numeric_of(self.spec.numeric_features).astype(np.float32).reshape(len(ex), -1)}

    def groups(self, ex: Examples) -> Groups:
        """Which rows of `ex` share which lists, for `table_ids` and `scoring_inputs` (found once for both)."""
        lists = self._lists(ex)
        long_owner, long_firsts = _distinct_rows(lists["long_sequence"], lists["long_types"])
        return Groups(lists, np.flatnonzero(_group_starts(lists["sequence"], lists["user_tokens"])), long_owner,
                      long_firsts)

    def scoring_inputs(self, ex: Examples, groups: Groups | None = None) -> dict[str, np.ndarray]:
        """The dense network's inputs for scoring `ex`, each list that rows share once, with the index
        of each row's. Consecutive rows with the same behavior sequence and user attributes (a
        request's candidates) share one group: `owner` [B] names each row's (`sequence` [U, L, D],
        `sequence_mask` and `sequence_types` [U, L], `user_tokens` [U, T, D], `user_token_mask` [U, T]).
        Rows with the same long-history list (a user x category) share it: `long_owner` [B] names each
        row's (`long_sequence` [G, K, D], `long_mask` and `long_types` [G, K]). L is the longest real
        sequence of the batch (padding past it changes no score: the attention masks it out); K and
        T are the spec's widths. Serving pads these to a compiled shape bucket. Every table's `gather`
        comes after all its lookups (a tier's rows may still be on their way during the lookups)."""
        g = groups or self.groups(ex)
        lists, firsts = g.lists, g.firsts
        seq = lists["sequence"]
        longest = max(1, int((seq[firsts] != PAD).sum(axis=1).max(initial=0)))
        types = self._types(ex.sequence_types[firsts, : self.spec.sequence_length][:, :longest])
        shared = {"sequence_types": types}
        for name in ("sequence", "user_tokens"):  # per owner
            ids = lists[name][firsts][:, :longest] if name == "sequence" else lists[name][firsts]
            shared[name], shared[MASK_OF[name]] = self._rows(TABLE_OF[name], ids, train=False)
        shared["long_types"] = self._types(lists["long_types"][g.long_firsts])
        shared["long_sequence"], shared["long_mask"] = self._rows("item", lists["long_sequence"][g.long_firsts],
                                                                  train=False, distinct=True)
        rows = {"user": self.tables["user"].lookup(ex.user_ids.tolist(), False),
                "item": self.tables["item"].lookup(ex.item_ids.tolist(), False),
                "category": self.tables["category"].lookup(ex.categories.tolist(), False)}
        rows["item_tokens"], rows["item_token_mask"] = self._rows("attribute", lists["item_tokens"], train=False)
        if self.spec.context:  # per row (a request's rows share theirs: looked up once)
            rows["context_tokens"], rows["context_token_mask"] = self._rows("attribute", lists["context_tokens"], False)
        else:  # none: padding, without a pass over the rows
            rows["context_tokens"] = np.full((len(ex), 1), DEFAULT_ROW, np.int64)
            rows["context_token_mask"] = np.zeros((len(ex), 1), np.float32)
        owner = np.zeros(len(ex), np.int32)
        owner[firsts[1:]] = 1
        return self._gathered(rows | shared, ex) | {"owner": np.cumsum(owner, dtype=np.int32),
                                                    "long_owner": g.long_owner}

    def table_ids(self, ex: Examples, groups: Groups | None = None) -> dict[str, list[str]]:
        """The distinct ids `scoring_inputs(ex)` looks up in each table (padding left out)."""
        g = groups or self.groups(ex)
        # Each list once where rows share it, as `scoring_inputs` looks them up: a unique of every row's
        # ids (a request's 500 candidates repeat their user's 50 behaviors) was 0.9 ms of such a batch.
        named = {"user": ex.user_ids, "item": ex.item_ids, "category": ex.categories,
                 "sequence": g.lists["sequence"][g.firsts], "user_tokens": g.lists["user_tokens"][g.firsts],
                 "long_sequence": g.lists["long_sequence"][g.long_firsts], "item_tokens": g.lists["item_tokens"],
                 "context_tokens": g.lists["context_tokens"]}
        parts: dict[str, list[np.ndarray]] = {name: [] for name in TABLES}
        for name, ids in named.items():
            parts[TABLE_OF[name]].append(np.asarray(ids, dtype=object).ravel())
        out = {}
        for table, arrays in parts.items():
            ids = pd.unique(np.concatenate(arrays)) if arrays else np.array([], object)
            out[table] = [i for i in ids.tolist() if i != PAD]
        return out

    def with_tables(self, tables: dict[str, object]) -> CtrModel:
        """This model with other tables: anything with `lookup` and `gather` to score (a batch's rows read from
        the embedding store), `SparseTable`s to train (the rows an incremental run pulled); shares the network."""
        twin = copy.copy(self)
        twin.tables = tables
        return twin

    def adapt(self, ex: Examples) -> None:
        """Fit what the network derives from its training data before the first step (the ranker's numeric
        bins); a version continued from this one keeps it."""
        if hasattr(self.network, "adapt"):
            self.network.adapt(ex.numeric_of(self.spec.numeric_features))

    def dense_weights(self) -> list[np.ndarray]:
        """The dense network's weights: `network.trainable_variables`, then its non-trainable ones
        (`stateless_call`'s two lists, one after the other)."""
        return [v.numpy() for v in (*self.network.trainable_variables, *self.network.non_trainable_variables)]

    # --- compiled dense parts --------------------------------------------------------------------

    def _dense_step(self, inputs: dict[str, tf.Tensor], labels: tf.Tensor, weights: tf.Tensor):
        embedded = [inputs[k] for k in EMBEDDED]
        variables = self.network.trainable_variables
        with tf.GradientTape() as tape:
            tape.watch(embedded)
            if self._over:  # labels [B, K]: each objective's, over its probability
                log_p, log_not = log_probabilities(self.network.heads(inputs, training=True), self._over)
                losses = -tf.reduce_sum(labels * log_p + (1.0 - labels) * log_not, axis=-1)
            else:
                logits = self.network(inputs, training=True)
                losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            loss = tf.reduce_mean(weights * losses)
        grads = tape.gradient(loss, [*variables, *embedded], unconnected_gradients=tf.UnconnectedGradients.ZERO)
        self.optimizer.apply(grads[: len(variables)], variables)
        return loss, grads[len(variables):]

    def _dense_predict(self, inputs: dict[str, tf.Tensor]) -> tf.Tensor:
        return tf.sigmoid(self.network(inputs, training=False))

    # --- training and scoring --------------------------------------------------------------------

    def train_batch(self, ex: Examples) -> float:
        if self._over and ex.objectives.shape[1] != len(self._over):  # before a lookup admits any id
            raise ValueError(f"examples with the labels of {ex.objectives.shape[1]} objectives; the model predicts "
                             f"{len(self._over)} ({', '.join(name for name, _ in self.spec.objectives)})")
        rows = self._lookup(ex, train=True)
        inputs = self._dense_inputs(rows, ex)
        if self.spec.position_slots:  # a training input only: scores are the item's, at the top
            inputs["position"] = tf.constant(ex.positions, tf.int32)
        labels = ex.objectives if self._over else ex.labels
        loss, grads = self._step(inputs, tf.constant(labels, tf.float32), tf.constant(ex.weights, tf.float32))
        # The rows get the gradient of the summed loss, not the mean: a row's update then does not
        # shrink with the batch size (each row is touched by a few examples of a batch).
        grad = dict(zip(EMBEDDED, (g.numpy() * len(ex) for g in grads)))
        by_table: dict[str, tuple[list, list]] = {name: ([], []) for name in TABLES}
        for name in EMBEDDED:
            used = rows[name]
            g = grad[name][:, : used.shape[1]] if used.ndim == 2 else grad[name]
            by_table[TABLE_OF[name]][0].append(used.reshape(-1))
            by_table[TABLE_OF[name]][1].append(g.reshape(-1, g.shape[-1]))
        for name, (used, g) in by_table.items():
            self.tables[name].apply_gradients(np.concatenate(used), np.concatenate(g))
        return float(loss)

    def fit(self, ex: Examples, epochs: int = 1, progress: bool = True) -> list[float]:
        """Train in time order (no shuffling across the window: later examples come last, as in
        online learning). Returns the mean loss of each epoch."""
        if not len(ex):
            raise ValueError("no training examples")
        losses = []
        size = self.spec.batch_size
        for epoch in range(epochs):
            batches = range(0, len(ex), size)
            total = 0.0
            for start in tqdm(batches, desc=f"{self.spec.kind} epoch {epoch + 1}/{epochs}", unit="step",
                              disable=not progress, leave=False):
                total += self.train_batch(ex.take(slice(start, start + size))) * len(ex.labels[start:start + size])
            losses.append(total / len(ex))
        return losses

    def predict(self, ex: Examples, batch_size: int = 1024) -> np.ndarray:
        """Click probabilities [N]. Ids never admitted score with the default (zero) embedding."""
        out = []
        for start in range(0, len(ex), batch_size):
            part = ex.take(slice(start, start + batch_size))
            out.append(self._predict(self._dense_inputs(self._lookup(part, train=False), part)).numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def predict_as_shown(self, ex: Examples, batch_size: int = 1024) -> np.ndarray:
        """Click probabilities [N] at the position each exposure was shown at (`predict`'s where the spec declares
        no position bias): what its clicks are measured against, not a score (scores are at the top: the top of
        the world's lists is clicked 0.42 of the time, its tenth 0.05)."""
        if not self.spec.position_slots:
            return self.predict(ex, batch_size)
        out = []
        for start in range(0, len(ex), batch_size):
            part = ex.take(slice(start, start + batch_size))
            inputs = self._dense_inputs(self._lookup(part, train=False), part)
            out.append(self._dense_predict(inputs | {"position": tf.constant(part.positions, tf.int32)}).numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def predict_objectives(self, ex: Examples, batch_size: int = 1024) -> np.ndarray:
        """Each objective's probability over the exposures [N, K] (one objective: `predict`'s)."""
        if not self._over:
            return self.predict(ex, batch_size)[:, None]
        out = [self._predict_objectives(self._dense_inputs(self._lookup(part, train=False), part)).numpy()
               for part in (ex.take(slice(start, start + batch_size)) for start in range(0, len(ex), batch_size))]
        return np.concatenate(out) if out else np.zeros((0, len(self._over)), np.float32)

    # --- export ----------------------------------------------------------------------------------

    def versions(self) -> dict[str, int]:
        return {name: table.step for name, table in self.tables.items()}

    def save(self, directory: Path) -> Path:
        """Dense weights, spec and a full snapshot of every table."""
        return self._save(directory, {name: table.snapshot() for name, table in self.tables.items()})

    def save_delta(self, directory: Path, since: dict[str, int]) -> dict[str, int]:
        """Dense weights, spec and, per table, only the rows changed after `since[table]`. Returns the
        number of changed rows per table."""
        deltas = {name: table.delta(since[name]) for name, table in self.tables.items()}
        self._save(directory, deltas)
        (directory / "delta-of.json").write_text(json.dumps(since))
        return {name: len(delta.ids) for name, delta in deltas.items()}

    def _save(self, directory: Path, snapshots: dict[str, TableSnapshot]) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "spec.json").write_text(self.spec.to_json())
        self.network.save_weights(directory / "dense.weights.h5")
        for name, snap in snapshots.items():
            _save_snapshot(snap, directory / f"sparse-{name}.npz")
        return directory

    @classmethod
    def load(cls, directory: Path, delta: Path | None = None) -> CtrModel:
        """A saved model; with `delta`, that export patched by a delta (its dense weights win)."""
        spec = ModelSpec.from_json((directory / "spec.json").read_text())
        tables = {name: SparseTable.restore(name, spec.sparse, load_snapshot(directory / f"sparse-{name}.npz"))
                  for name in TABLES if (directory / f"sparse-{name}.npz").exists()}  # older exports: fewer
        model = cls(spec, tables)
        model.network.load_weights(directory / "dense.weights.h5")
        return model.with_delta(delta) if delta is not None else model

    @classmethod
    def from_parts(cls, spec: str, dense: bytes) -> CtrModel:
        """A model of `spec` (JSON) with the dense weights of an export's `dense.weights.h5` and empty tables
        (the sparse tier supplies the rows per batch: `with_tables`)."""
        model = cls(ModelSpec.from_json(spec))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "dense.weights.h5"
            path.write_bytes(dense)
            model.network.load_weights(path)
        return model

    def with_delta(self, delta: Path) -> CtrModel:
        """A new model: this one's tables patched by an incremental export's delta, and its dense
        weights. Refused unless the delta was taken from exactly these table versions."""
        base = {name: table.snapshot() for name, table in self.tables.items()}
        expected = json.loads((delta / "delta-of.json").read_text())
        if expected != {name: snap.version for name, snap in base.items()}:
            raise ValueError(f"delta {delta} is relative to versions {expected}, not {self.versions()}")
        spec = ModelSpec.from_json((delta / "spec.json").read_text())
        if spec != self.spec:
            raise ValueError(f"delta {delta} is of a different model spec")
        model = type(self)(spec, {name: SparseTable.restore(
            name, spec.sparse, apply_delta(snap, load_snapshot(delta / f"sparse-{name}.npz")))
            for name, snap in base.items()})
        model.network.load_weights(delta / "dense.weights.h5")
        return model


def _group_starts(sequences: np.ndarray, user_tokens: np.ndarray) -> np.ndarray:
    """[N] bool: where a run of consecutive rows with the same behaviors and user attributes starts."""
    starts = np.ones(len(sequences), bool)
    starts[1:] = (sequences[1:] != sequences[:-1]).any(axis=1) | (user_tokens[1:] != user_tokens[:-1]).any(axis=1)
    return starts


def _distinct_rows(*lists: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of padded lists [N, W] that are equal in all of `lists`: the distinct one of each row
    ([N] int32) and the first row of each distinct one ([G]), in order of first appearance."""
    first: dict[tuple, int] = {}
    of_row = np.fromiter((first.setdefault(key, n) for n, key in enumerate(zip(*(map(tuple, x.tolist()) for x in lists)))),
                         np.int64, len(lists[0]))
    firsts = np.fromiter(first.values(), np.int64, len(first))
    index = np.empty(len(lists[0]), np.int64)
    index[firsts] = np.arange(len(firsts))
    return index[of_row].astype(np.int32), firsts


def _empty(spec: ModelSpec) -> Examples:
    return Examples(np.array([PAD]), np.array([PAD]), np.array([PAD]),
                    np.full((1, spec.sequence_length), PAD, dtype=object),
                    np.zeros((1, len(spec.numeric_features)), np.float32), np.zeros(1, np.float32))


def _save_snapshot(snap: TableSnapshot, path: Path) -> None:
    np.savez(path, ids=snap.ids.astype(str), values=snap.values, accumulators=snap.accumulators,
             last_seen=snap.last_seen, pending_ids=snap.pending_ids.astype(str), pending_counts=snap.pending_counts,
             removed=snap.removed.astype(str), version=np.int64(snap.version))


def load_snapshot(path: Path) -> TableSnapshot:
    with np.load(path) as z:
        return TableSnapshot(ids=z["ids"].astype(object), values=z["values"], accumulators=z["accumulators"],
                             last_seen=z["last_seen"], pending_ids=z["pending_ids"].astype(object),
                             pending_counts=z["pending_counts"], version=int(z["version"]),
                             removed=z["removed"].astype(object))


def log_probabilities(heads: tf.Tensor, chain: tuple[int, ...]) -> tuple[tf.Tensor, tf.Tensor]:
    """log p and log(1 - p) [B, K] of each objective from its logit (`ModelSpec.chain`): over the exposures, its
    sigmoid; over another objective, its sigmoid (the rate given that one) times that one's probability (ESMM)."""
    log_p, log_not = [], []
    for k, over in enumerate(chain):
        if over < 0:
            log_p.append(tf.math.log_sigmoid(heads[:, k]))
            log_not.append(tf.math.log_sigmoid(-heads[:, k]))
        else:
            log_p.append(tf.math.log_sigmoid(heads[:, k]) + log_p[over])
            log_not.append(tf.math.log(tf.maximum(-tf.math.expm1(log_p[-1]), 1e-7)))
    return tf.stack(log_p, axis=-1), tf.stack(log_not, axis=-1)


def probabilities(heads: tf.Tensor, chain: tuple[int, ...]) -> tf.Tensor:
    """Each objective's probability over the exposures [B, K], from the networks' logits (`heads`)."""
    return tf.exp(log_probabilities(heads, chain)[0])
