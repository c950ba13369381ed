"""The dense networks: the ranker, the previous DIN ranker (ranker-v1) and the logistic-regression
baseline.

All take the same inputs (a dict of tensors; `DENSE_INPUTS` below declares each as a record), each using
what it needs, so one training loop and one serving path serve them all:
  user, item, category  [B, D]     embeddings gathered from the sparse tables
  sequence              [B, L, D]  embeddings of the user's last L behaviors (item table)
  sequence_mask         [B, L]     1.0 for a real behavior, 0.0 for padding
  sequence_types        [B, L] int each behavior's event type (0: padding or unknown)
  owner (optional)      [B] int    serving: row b's behaviors are sequence[owner[b]], which is then
                                   [U, L, D] with its mask and types [U, L] (one per request, not per
                                   candidate), and so are its user tokens (user_tokens [U, T, D])
  long_sequence         [B, K, D]  the user's newest behaviors in the candidate's category, from the long
                                   history (item table); long_mask [B, K]; long_types [B, K] int
  long_owner (optional) [B] int    serving: row b's long-history list is long_sequence[long_owner[b]],
                                   which is then [G, K, D] (one per user x category)
  item_tokens           [B, T, D]  the candidate's attributes (attribute table); item_token_mask [B, T]
  user_tokens           [B, T, D]  the user's profile attributes (attribute table); user_token_mask [B, T]
  context_tokens        [B, C, D]  the request's declared context (attribute table); context_token_mask [B, C]
  numeric               [B, F]     real-time, profile and long-history features, already scaled
and return click logits [B]. At training only, where the dataset declares a position bias:
  position              [B] int    the exposure's rank in the list that showed it (0: the top, or unknown)
which `PositionBias` reads around any of them. The ranker's numeric features also enter piecewise-linear
(`numeric_bins` per feature, edges at the training part's quantiles: `adapt`). Each is built from a version's
spec by the function models/architectures.py names for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
from keras import ops

from models.layers import MLP, MaskedMean, PiecewiseLinear, TargetAttention


@dataclass(frozen=True)
class DenseInput:
    """One input of the dense networks, as the table above documents it."""

    name: str
    table: str | None = None  # the sparse table its ids' embeddings are gathered from (None: not embedded)
    mask: str | None = None  # the input holding its padded list's mask
    per: str = "row"  # "row": [B, ...]; "owner": [U, ...], a request's group's; "long_owner": [G, ...]
    sequence_axis: bool = False  # its axis 1 is the recent behaviors' (L: padded to a serving bucket)


# Declared once: models/ctr.py builds them (gathers, masks, gradients by table), serving/dense.py slices and
# pads them by their grouping. The embedded ones' order is their gradients' order.
DENSE_INPUTS = (
    DenseInput("user", "user"),
    DenseInput("item", "item"),
    DenseInput("category", "category"),
    DenseInput("sequence", "item", "sequence_mask", "owner", sequence_axis=True),
    DenseInput("long_sequence", "item", "long_mask", "long_owner"),
    DenseInput("item_tokens", "attribute", "item_token_mask"),
    DenseInput("user_tokens", "attribute", "user_token_mask", "owner"),
    DenseInput("context_tokens", "attribute", "context_token_mask"),
    DenseInput("sequence_mask", per="owner", sequence_axis=True),
    DenseInput("sequence_types", per="owner", sequence_axis=True),
    DenseInput("long_mask", per="long_owner"),
    DenseInput("long_types", per="long_owner"),
    DenseInput("item_token_mask"),
    DenseInput("user_token_mask", per="owner"),
    DenseInput("context_token_mask"),
    DenseInput("numeric"),
)
EMBEDDED = tuple(i.name for i in DENSE_INPUTS if i.table)
TABLE_OF = {i.name: i.table for i in DENSE_INPUTS if i.table}  # the table each embedded input is gathered from
MASK_OF = {i.name: i.mask for i in DENSE_INPUTS if i.mask}


class Ranker(keras.Model):
    """Target attention over the recent behaviors (with their event types) and, apart, over the long
    history's behaviors in the candidate's category (SIM); pooled attributes of the candidate and of
    the user; then an MLP over all of it, with the products of the pairs that meet (user x item, the
    behaviors' interests x item, user attributes x item attributes), and the numeric features, as they
    are and, with `numeric_bins`, piecewise-linear (Instacart: test AUC +0.011 over the features as they
    are, three seeds). With `context`, the request's pooled context tokens too, and their product with the
    candidate (a page that favours some items)."""

    def __init__(self, dim: int, event_types: int, hidden: list[int] | None = None,
                 attention_hidden: list[int] | None = None, numeric_bins: int = 0, context: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.event_types, self.numeric_bins, self.context = dim, event_types, numeric_bins, context
        self.numeric_encoding = PiecewiseLinear(numeric_bins) if numeric_bins else None
        self.hidden = hidden or [128, 64]
        self.attention_hidden = attention_hidden or [32]
        self.types = keras.layers.Embedding(event_types, dim)
        self.attention = TargetAttention(self.attention_hidden)
        self.long_attention = TargetAttention(self.attention_hidden)
        self.pool = MaskedMean()
        self.head = MLP([*self.hidden, 1])

    def call(self, inputs):
        item, owner = inputs["item"], inputs.get("owner")
        behaviors = inputs["sequence"] + self.types(inputs["sequence_types"])
        recent = self.attention(item, behaviors, inputs["sequence_mask"], owner)
        long = self.long_attention(item, inputs["long_sequence"] + self.types(inputs["long_types"]), inputs["long_mask"],
                                   inputs.get("long_owner"))
        item_side = self.pool(inputs["item_tokens"], inputs["item_token_mask"])
        user_side = self.pool(inputs["user_tokens"], inputs["user_token_mask"])
        if owner is not None:  # one per owner group, as the sequences
            user_side = ops.take(user_side, owner, axis=0)
        numeric = inputs["numeric"]
        if self.numeric_encoding is not None:
            numeric = ops.concatenate([numeric, self.numeric_encoding(numeric)], axis=-1)
        parts = [inputs["user"], item, inputs["category"], recent, long, item_side, user_side,
                 inputs["user"] * item, recent * item, long * item, user_side * item_side, numeric]
        if self.context:
            context = self.pool(inputs["context_tokens"], inputs["context_token_mask"])
            parts += [context, context * item, context * item_side]
        x = ops.concatenate(parts, axis=-1)
        return ops.squeeze(self.head(x), -1)

    def adapt(self, numeric: np.ndarray) -> None:
        """The piecewise-linear bins' edges from the training part's numeric features [N, F]."""
        if self.numeric_encoding is not None:
            self.numeric_encoding.set_edges(numeric)

    def get_config(self) -> dict:
        return {"dim": self.dim, "event_types": self.event_types, "hidden": self.hidden,
                "attention_hidden": self.attention_hidden, "numeric_bins": self.numeric_bins, "context": self.context}


class PositionBias(keras.Model):
    """A shallow tower of the rank an exposure was shown at (YouTube's, PAL's), apart from the network: one logit
    per rank (the top's 0, later ranks than `slots` share the last's), added to the network's while training, so
    that the network learns the item's appeal, not the slot the last ranker gave it. Scoring has no rank (the
    `position` input is absent): every candidate is scored as at the top."""

    # Its few weights take the dense network's Adam steps, while the items' rows take the sparse tables' larger ones
    # and absorb the rank first: x30 (the test's log, true bias -3.6 at rank 9: learnt -2.9; x10: -2.0; x1: -0.3).
    STEP = 30.0

    def __init__(self, network: keras.Model, slots: int, **kwargs):
        super().__init__(**kwargs)
        self.slots = slots
        self.bias = self.add_weight(shape=(slots,), initializer="zeros", name="position_bias")
        self.network = network

    def call(self, inputs, training=None):
        logits = self.network({k: v for k, v in inputs.items() if k != "position"}, training=training)
        return logits if "position" not in inputs else logits + self._bias(inputs["position"])

    def heads(self, inputs, training=None):
        """Each objective's logit [B, K] (`Objectives.heads`), the rank's bias on the first's (the click it draws:
        an objective `over` it inherits it through its probability, one over the exposures is left alone)."""
        heads = self.network.heads({k: v for k, v in inputs.items() if k != "position"}, training=training)
        if "position" not in inputs:
            return heads
        return ops.concatenate([heads[:, :1] + self._bias(inputs["position"])[:, None], heads[:, 1:]], axis=-1)

    def _bias(self, position):
        rank = ops.minimum(ops.cast(position, "int32"), self.slots - 1)
        return ops.where(rank > 0, ops.take(self.bias, rank) * self.STEP, 0.0)

    def adapt(self, numeric: np.ndarray) -> None:
        if hasattr(self.network, "adapt"):
            self.network.adapt(numeric)

    def get_config(self) -> dict:
        return {"slots": self.slots}


class Objectives(keras.Model):
    """One network per declared objective (`[objectives]`), over the embeddings they share: the sparse tables, the
    bulk of the parameters, learn from every objective's labels, the sparse ones' (a buy) most from the dense ones'
    (a click), as ESMM shares its embeddings between its CTR and CVR towers. `heads` gives each objective's logit
    [B, K]: of the objective's probability over the exposures, or for one `over` another, of its rate given that
    one's positive (models/ctr.py chains them: P(buy) = P(click) x P(buy | click)). Scores are the first's: `call`
    runs its network alone (the server runs `heads`, to return each objective's and order by a declared value)."""

    def __init__(self, networks: list[keras.Model], **kwargs):
        super().__init__(**kwargs)
        self.networks = networks

    def build(self, inputs_shape=None):  # each network builds on its first call (Keras warns of a default build)
        self.built = True

    def call(self, inputs, training=None):
        return self.networks[0](inputs, training=training)

    def heads(self, inputs, training=None):
        return ops.stack([network(inputs, training=training) for network in self.networks], axis=-1)

    def adapt(self, numeric: np.ndarray) -> None:
        for network in self.networks:
            if hasattr(network, "adapt"):
                network.adapt(numeric)

    def get_config(self) -> dict:
        return {"objectives": len(self.networks)}


def scorer(network: keras.Model) -> keras.Model:
    """The network whose logits are the scores: inside a position bias, the first objective's."""
    while isinstance(network, (PositionBias, Objectives)):
        network = network.network if isinstance(network, PositionBias) else network.networks[0]
    return network


class RankerV1(keras.Model):
    """The previous ranker: target attention over the behavior sequence, then an MLP over every input."""

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


def ranker(spec) -> Ranker:
    return Ranker(spec.sparse.dim, len(spec.event_types) + 1, list(spec.hidden), numeric_bins=spec.numeric_bins,
                  context=bool(spec.context))


def ranker_v1(spec) -> RankerV1:
    return RankerV1(list(spec.hidden))


def logistic_regression(spec) -> LogisticRegression:
    return LogisticRegression()
