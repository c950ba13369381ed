"""Architectures as records (models/architectures.py): the registered ones give the inputs they declare, and
a user's network from a package outside the platform, named by its import path, trains, saves, loads and
scores on the serving path's compiled runner as the model itself does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from contract.inputs import LONG_HISTORY_FEATURES, NUMERIC_FEATURES, V1_NUMERIC_FEATURES
from infra.settings import load_settings
from models.architectures import ARCHITECTURES, ArchitectureError, architecture
from models.ctr import CtrModel
from models.train import model_spec
from serving.dense import DenseRunner
from tests.ctr_data import SPEC, synthetic, write_user_nets



@pytest.fixture
def user_nets(tmp_path: Path, monkeypatch) -> str:
    """A package of the user's, outside the platform's, on the path as an installed one would be."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_user_nets(tmp_path)


def test_each_registered_architecture_declares_its_inputs(tmp_path: Path) -> None:
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=None)
    ranker, v1, logreg = (model_spec(s, kind) for kind in ("ranker", "ranker-v1", "logreg"))
    assert ranker.numeric_features == NUMERIC_FEATURES and ranker.long_length > 0 and ranker.numeric_bins > 0
    assert v1.numeric_features == V1_NUMERIC_FEATURES and v1.long_length == 0 and v1.numeric_bins == 0
    assert logreg.sparse.dim == 1 and logreg.long_length == 0
    ablation = model_spec(s, "ranker", long_history=False)
    assert ablation.long_length == 0 and not set(LONG_HISTORY_FEATURES) & set(ablation.numeric_features)
    assert model_spec(s).kind == s.models.architecture == "ranker"
    # an ablation by name or pattern (`flywheel train --without`): the rest in their order; a name matching none refused
    without = model_spec(s, "ranker", without=("category_*", "user_ctr_total"))
    assert without.numeric_features == tuple(n for n in NUMERIC_FEATURES if not n.startswith("category_")
                                             and n != "user_ctr_total")
    with pytest.raises(ValueError, match="--without brand_ctr: no numeric input, context field or position bias of "
                                         "ranker matches it"):
        model_spec(s, "ranker", without=("brand_ctr",))
    with pytest.raises(ValueError, match="dimension 1"):
        CtrModel(replace(logreg, sparse=ranker.sparse))
    with pytest.raises(ArchitectureError, match="ranker, ranker-v1, logreg"):
        architecture("deep-and-wide")
    assert set(ARCHITECTURES) == {"ranker", "ranker-v1", "logreg"}


def test_a_users_network_by_import_path_trains_saves_and_serves_as_it_scores(tmp_path: Path, user_nets: str) -> None:
    kind = f"{user_nets}:build"
    model = CtrModel(replace(SPEC, kind=kind))
    train = synthetic(2000, seed=11)
    model.adapt(train)
    assert model.network.adapted and float(model.network.centre.numpy()) == pytest.approx(train.numeric.mean())
    model.fit(train, progress=False)
    test = synthetic(600, seed=12)
    loaded = CtrModel.load(model.save(tmp_path / "export"))
    assert loaded.spec.kind == kind
    np.testing.assert_allclose(loaded.predict(test), model.predict(test), rtol=1e-6)
    runner = DenseRunner(loaded, row_buckets=(16, 64), sequence_buckets=(10,))
    weights = [tf.constant(w) for w in loaded.dense_weights()]
    runner.warm(weights, loaded.scoring_inputs(test.take(slice(0, 4))))
    for n in (1, 16, 50):
        part = test.take(slice(0, n))
        np.testing.assert_allclose(runner.run(weights, loaded.scoring_inputs(part)), loaded.predict(part),
                                   rtol=1e-5, atol=1e-6)


def test_a_users_architecture_record_declares_its_inputs_and_a_bad_path_says_why(tmp_path: Path,
                                                                                 user_nets: str) -> None:
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path), "FLYWHEEL_MODELS_ARCHITECTURE": f"{user_nets}:SHORT"},
                      config_file=None)
    spec = model_spec(s)
    assert spec.kind == f"{user_nets}:SHORT" and spec.numeric_features == ("user_ctr_total", "item_ctr_total")
    assert spec.long_length == 0 and spec.numeric_bins == 0
    with pytest.raises(ArchitectureError, match="does not import"):
        architecture(f"{user_nets}:missing")
    with pytest.raises(ArchitectureError, match="does not import"):
        architecture("no_such_package.nets:build")
