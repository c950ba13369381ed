"""The world drill's regression (flywheel/world_drill.py): labels shuffled across a window's exposures keep every
exposure's features and the outcomes' mix, and a ranker trained on them ranks no better than chance, where the
same ranker on the true labels learns the preference: a regression the served CTR shows, not a tweak."""

from __future__ import annotations

from dataclasses import replace

import keras
import numpy as np

from flywheel.world_drill import shuffled
from models.ctr import CtrModel
from models.metrics import auc
from tests.ctr_data import SPEC, synthetic, with_buys


def test_shuffled_labels_keep_the_features_and_the_outcomes_and_pair_each_label_with_its_weight() -> None:
    data = with_buys(synthetic(2_000, seed=3), seed=3)
    data = replace(data, weights=np.where(data.objectives[:, 1] > 0, 3.0, 1.0).astype(np.float32))
    out = shuffled(data, np.random.default_rng(0))
    assert np.array_equal(out.user_ids, data.user_ids) and np.array_equal(out.item_ids, data.item_ids)
    assert np.array_equal(out.sequences, data.sequences) and np.array_equal(out.numeric, data.numeric)
    assert out.labels.sum() == data.labels.sum() and out.objectives[:, 1].sum() == data.objectives[:, 1].sum()
    assert not np.array_equal(out.labels, data.labels)
    assert np.array_equal(out.objectives[:, 0], out.labels)  # a buy stays with its click, its weight with it
    assert np.array_equal(out.weights, np.where(out.objectives[:, 1] > 0, 3.0, 1.0))
    assert (out.objectives[:, 1] <= out.labels).all()


def test_a_ranker_trained_on_shuffled_labels_ranks_at_chance_where_the_true_ones_teach_it() -> None:
    data = synthetic(12_000, seed=1, long_history=True)
    train, test = data.take(slice(0, 10_000)), data.take(slice(10_000, None))
    aucs = {}
    for name, part in (("true", train), ("shuffled", shuffled(train, np.random.default_rng(1)))):
        keras.utils.set_random_seed(7)
        model = CtrModel(SPEC)
        model.fit(part, epochs=3, progress=False)
        aucs[name] = auc(test.labels, model.predict(test))
    assert aucs["true"] > 0.62, aucs
    assert abs(aucs["shuffled"] - 0.5) < 0.04, aucs
