"""Small composable Keras layers of the ranking models. Embeddings come in as inputs: the sparse
tables (models/sparse.py) gather them on CPU, so every layer here is dense and XLA-compilable."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops


class MLP(keras.layers.Layer):
    """Dense layers with ReLU between them; the last layer is linear.

    Input [..., F] -> output [..., units[-1]].
    """

    def __init__(self, units: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.units = list(units)
        self.dense = [keras.layers.Dense(u, activation="relu" if i < len(units) - 1 else None)
                      for i, u in enumerate(units)]

    def build(self, input_shape) -> None:
        for layer in self.dense:
            layer.build(input_shape)
            input_shape = (*input_shape[:-1], layer.units)

    def call(self, x):
        for layer in self.dense:
            x = layer(x)
        return x

    def get_config(self) -> dict:
        return super().get_config() | {"units": self.units}


class TargetAttention(keras.layers.Layer):
    """DIN-style attention: weighs the user's past behaviors by their relevance to the candidate.

    Inputs: query [B, D] (the candidate item), keys [U, L, D] (behavior sequences), mask [U, L] (1.0 for
    a real behavior, 0.0 for padding), owner [B] int (row b attends to sequence owner[b]; None: U = B
    and each row has its own). Output [B, D]: the relevance-weighted sum of the row's keys; zeros for a
    user without behaviors. The relevance of each behavior is an MLP over [query, key, query - key,
    query * key]; the weights are a softmax over the real behaviors.

    The MLP's first layer is computed split by term (W [q, k, q-k, q*k] = (Wq + Wd) q + (Wk - Wd) k +
    Wp (q*k)): the key term once per sequence, the query term once per row, only the product per
    (row, behavior). Serving passes each request's sequence once (owner), not once per candidate.
    """

    def __init__(self, hidden: list[int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden or [32]
        self.score = MLP([*self.hidden, 1])

    def build(self, query_shape, keys_shape=None, mask_shape=None) -> None:
        self.score.build((None, None, 4 * query_shape[-1]))

    def call(self, query, keys, mask, owner=None):
        d, first = query.shape[-1], self.score.dense[0]
        w = first.kernel
        w_query, w_key, w_diff, w_prod = w[:d], w[d:2 * d], w[2 * d:3 * d], w[3 * d:]
        key_term = ops.matmul(keys, w_key - w_diff)  # [U, L, H]
        if owner is not None:
            keys, key_term, mask = (ops.take(t, owner, axis=0) for t in (keys, key_term, mask))  # -> [B, ...]
        q = ops.expand_dims(query, 1)  # [B, 1, D]
        hidden = first.activation(ops.matmul(q, w_query + w_diff) + key_term + ops.matmul(q * keys, w_prod)
                                  + first.bias)  # [B, L, H]
        for layer in self.score.dense[1:]:
            hidden = layer(hidden)
        scores = ops.squeeze(hidden, -1)  # [B, L]
        scores = ops.where(mask > 0, scores, ops.full_like(scores, -1e9))
        weights = ops.softmax(scores, axis=-1) * mask  # all-padding rows -> all zeros
        return ops.einsum("bl,bld->bd", weights, keys)

    def get_config(self) -> dict:
        return super().get_config() | {"hidden": self.hidden}


class PiecewiseLinear(keras.layers.Layer):
    """Each numeric feature as `bins` values in [0, 1]: how far it is through each bin between the training
    part's quantiles (`set_edges`; Gorishniy et al. 2022, "On embeddings for numerical features in tabular
    deep learning"). An MLP then reads a count's thresholds as a tree does. The edges are weights but not
    trained (non-trainable): they travel with each version's dense weights.

    Input [B, F] -> output [B, F * bins].
    """

    def __init__(self, bins: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bins = bins

    def build(self, input_shape) -> None:
        shape = (input_shape[-1], self.bins)
        self.lower = self.add_weight(shape=shape, initializer="zeros", trainable=False, name="lower")
        self.width = self.add_weight(shape=shape, initializer="ones", trainable=False, name="width")

    def set_edges(self, x: np.ndarray) -> None:
        """Bins between the quantiles of `x` [N, F]; a feature's repeated quantiles give steps (width ~0)."""
        edges = np.maximum.accumulate(np.quantile(x, np.linspace(0, 1, self.bins + 1), axis=0).T, axis=1)
        self.lower.assign(edges[:, :-1].astype("float32"))
        self.width.assign(np.maximum(np.diff(edges, axis=1), 1e-6).astype("float32"))

    def call(self, x):
        share = ops.clip((x[..., None] - self.lower) / self.width, 0.0, 1.0)
        return ops.reshape(share, (-1, share.shape[-2] * share.shape[-1]))

    def get_config(self) -> dict:
        return super().get_config() | {"bins": self.bins}


class MaskedMean(keras.layers.Layer):
    """The mean of the real entries of a padded list.

    Inputs: x [B, T, D], mask [B, T] (1.0 real, 0.0 padding). Output [B, D]; zeros for an empty list.
    """

    def call(self, x, mask):
        total = ops.einsum("btd,bt->bd", x, mask)
        return total / ops.maximum(ops.sum(mask, axis=-1, keepdims=True), 1.0)
