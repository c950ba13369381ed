"""Synthetic click data with a known structure, for model and registry tests."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np

from contract.examples import PAD, Examples, to_frame
from contract.inputs import NUMERIC_FEATURES
from models.ctr import ModelSpec
from models.sparse import SparseConfig

CATEGORIES = 8


def synthetic(n: int, seed: int, users: int = 50, items: int = 200, length: int = 10,
              long_history: bool = False) -> Examples:
    """Each user prefers one category; clicks are likely on it (0.7, else 0.08). The sequence holds
    the user's last clicked items; with `long_history`, the long history holds the user's last 5
    clicked items in the candidate's category and the item tokens its category. Only the user x category interaction predicts a click: a model of
    per-id effects (the baseline) cannot beat chance, and knowing the preference (the oracle) reaches
    an AUC of about 0.72."""
    rng = np.random.default_rng(seed)
    prefer = {u: u % CATEGORIES for u in range(users)}
    history: dict[int, list[str]] = {u: [] for u in range(users)}
    rows, long = [], []
    for _ in range(n):
        u, i = int(rng.integers(users)), int(rng.integers(items))
        click = rng.random() < (0.7 if i % CATEGORIES == prefer[u] else 0.08)
        seq = (history[u][::-1] + [PAD] * length)[:length]
        rows.append((f"u{u}", f"i{i}", f"c{i % CATEGORIES}", seq, [rng.normal()], float(click)))
        long.append(([h for h in history[u][::-1] if int(h[1:]) % CATEGORIES == i % CATEGORIES] + [PAD] * 5)[:5])
        if click:
            history[u].append(f"i{i}")
    cols = list(zip(*rows))
    extra = {"long_sequences": np.array(long, object),
             "item_tokens": np.array([[f"category:{c}"] for c in cols[2]], object)} if long_history else {}
    return Examples(np.array(cols[0], object), np.array(cols[1], object), np.array(cols[2], object),
                    np.array(cols[3], object), np.array(cols[4], np.float32), np.array(cols[5], np.float32), **extra)


def with_buys(data: Examples, seed: int) -> Examples:
    """`data` with a second objective, a buy over the clicks: about 1 in 4 clicks, as each item's hidden quality
    draws it (a rare label, each item's own)."""
    rng = np.random.default_rng(seed)
    quality = rng.normal(-1.5, 1.2, 1 + max(int(i[1:]) for i in data.item_ids))
    item = np.array([int(i[1:]) for i in data.item_ids])
    bought = (data.labels > 0) & (rng.random(len(data)) < 1 / (1 + np.exp(-quality[item])))
    return replace(data, objectives=np.stack([data.labels, bought], axis=1).astype(np.float32))


SPEC = ModelSpec(numeric_features=("noise",), sequence_length=10,
                 sparse=SparseConfig(dim=8, admit_after=2, learning_rate=0.2),
                 hidden=(32, 16), batch_size=128, learning_rate=3e-3)


USER_NETS = '''
    import keras
    import numpy as np
    from keras import ops

    from models.architectures import Architecture


    class Dot(keras.Model):
        """A user's own network: the user x item product, the category, the numeric features, a bias
        fitted from the training part (adapt)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.head = keras.layers.Dense(1)
            self.centre = self.add_weight(shape=(), initializer="zeros", trainable=False, name="centre")
            self.adapted = False

        def call(self, inputs):
            x = ops.concatenate([inputs["user"] * inputs["item"], inputs["category"],
                                 inputs["numeric"] - self.centre], axis=-1)
            return ops.squeeze(self.head(x), -1)

        def adapt(self, numeric):
            self.centre.assign(float(np.mean(numeric)))
            self.adapted = True


    def build(spec):
        return Dot()


    SHORT = Architecture("short", "user_nets.nets:build", "the user's network on two numeric features",
                         numeric_features=("user_ctr_total", "item_ctr_total"), long_history=False)
'''


def write_user_nets(directory: Path) -> str:
    """A user's package of networks (`user_nets.nets`: `build`, a builder; `SHORT`, a record) written under
    `directory`, outside the platform's packages; returns its module's name."""
    package = directory / "user_nets"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent(USER_NETS))
    return "user_nets.nets"


# MLflow's sklearn flavor saves with skops, which loads only the types it is told to trust.
TRUSTED = ["collections.OrderedDict", "lightgbm.basic.Booster", "lightgbm.sklearn.LGBMClassifier"]


def trees_pipeline(train: Examples):
    """What a data scientist brings: LightGBM on the contract frame's numeric columns (every one of
    NUMERIC_FEATURES), the rest dropped; a scikit-learn pipeline."""
    import lightgbm
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import make_pipeline

    pipeline = make_pipeline(ColumnTransformer([("numeric", "passthrough", list(NUMERIC_FEATURES))]),
                             lightgbm.LGBMClassifier(n_estimators=30, verbose=-1))
    return pipeline.fit(to_frame(train, NUMERIC_FEATURES), train.labels)
