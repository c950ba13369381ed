"""Small composable Keras layers of the ranking models. Embeddings come in as inputs: the sparse
tables (models/sparse.py) gather them on CPU, so every layer here is dense and XLA-compilable."""

from __future__ import annotations

import keras
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

    def call(self, x):
        for layer in self.dense:
            x = layer(x)
        return x

    def get_config(self) -> dict:
        return super().get_config() | {"units": self.units}


class TargetAttention(keras.layers.Layer):
    """DIN-style attention: weighs the user's past behaviors by their relevance to the candidate.

    Inputs: query [B, D] (the candidate item), keys [B, L, D] (the behavior sequence), mask [B, L]
    (1.0 for a real behavior, 0.0 for padding). Output [B, D]: the relevance-weighted sum of the
    keys; zeros for a user without behaviors. The relevance of each behavior is an MLP over
    [query, key, query - key, query * key]; the weights are a softmax over the real behaviors.
    """

    def __init__(self, hidden: list[int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden or [32]
        self.score = MLP([*self.hidden, 1])

    def call(self, query, keys, mask):
        q = ops.broadcast_to(ops.expand_dims(query, 1), ops.shape(keys))  # [B, L, D]
        scores = ops.squeeze(self.score(ops.concatenate([q, keys, q - keys, q * keys], axis=-1)), -1)  # [B, L]
        scores = ops.where(mask > 0, scores, ops.full_like(scores, -1e9))
        weights = ops.softmax(scores, axis=-1) * mask  # all-padding rows -> all zeros
        return ops.einsum("bl,bld->bd", weights, keys)

    def get_config(self) -> dict:
        return super().get_config() | {"hidden": self.hidden}
