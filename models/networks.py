"""The dense networks: the DIN-style ranker and the logistic-regression baseline.

Both take the same inputs (a dict of tensors), so one training loop serves both:
  user, item, category  [B, D]     embeddings gathered from the sparse tables
  sequence              [B, L, D]  embeddings of the user's last L behaviors (item table)
  sequence_mask         [B, L]     1.0 for a real behavior, 0.0 for padding
  owner (optional)      [B] int    serving: row b's behaviors are sequence[owner[b]], which is then
                                   [U, L, D] with its mask [U, L] (one per request, not per candidate)
  numeric               [B, F]     real-time and profile features, already scaled
and return click logits [B].
"""

from __future__ import annotations

import keras
from keras import ops

from models.layers import MLP, TargetAttention


class Ranker(keras.Model):
    """Target attention over the behavior sequence, then an MLP over every input."""

    def __init__(self, hidden: list[int] | None = None, attention_hidden: list[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden or [128, 64]
        self.attention_hidden = attention_hidden or [32]
        self.attention = TargetAttention(self.attention_hidden)
        self.head = MLP([*self.hidden, 1])

    def call(self, inputs):
        interest = self.attention(inputs["item"], inputs["sequence"], inputs["sequence_mask"], inputs.get("owner"))
        x = ops.concatenate([inputs["user"], inputs["item"], inputs["category"], interest,
                             inputs["user"] * inputs["item"], inputs["numeric"]], axis=-1)
        return ops.squeeze(self.head(x), -1)

    def get_config(self) -> dict:
        return {"hidden": self.hidden, "attention_hidden": self.attention_hidden}


class LogisticRegression(keras.Model):
    """The baseline: a weight per id (embeddings of dimension 1) plus a linear term on the numeric
    features. The behavior sequence is not used."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.linear = keras.layers.Dense(1)

    def call(self, inputs):
        ids = inputs["user"][:, 0] + inputs["item"][:, 0] + inputs["category"][:, 0]
        return ids + ops.squeeze(self.linear(inputs["numeric"]), -1)

    def get_config(self) -> dict:
        return {}
