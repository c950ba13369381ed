"""A model of another flavor (models/foreign.py): a LightGBM classifier in a scikit-learn pipeline over the
contract's scoring frame, saved with MLflow's sklearn flavor as any user would, scores through the
platform's wrapper and the ranking server's generic path exactly as its own pyfunc does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlflow
import mlflow.sklearn
import numpy as np
import pytest

from contract.examples import Examples, to_frame
from contract.inputs import NUMERIC_FEATURES
from models.foreign import ForeignModel
from models.metrics import auc
from serving.lifecycle import ServedModel
from tests.ctr_data import TRUSTED, synthetic, trees_pipeline


def examples(n: int, seed: int) -> Examples:
    """Synthetic examples with every numeric feature, one of which tells clicks apart."""
    ex = synthetic(n, seed)
    numeric = np.random.default_rng(seed).random((n, len(NUMERIC_FEATURES))).astype(np.float32)
    numeric[:, 0] += ex.labels
    return replace(ex, numeric=numeric, numeric_names=NUMERIC_FEATURES)


def test_a_pyfunc_of_another_flavor_scores_through_the_platform_as_through_its_own_pyfunc(tmp_path: Path) -> None:
    train, test = examples(2000, seed=1), examples(500, seed=2)
    pipeline = trees_pipeline(train)
    mlflow.sklearn.save_model(pipeline, tmp_path / "trees", pyfunc_predict_fn="predict_proba",
                              skops_trusted_types=TRUSTED)
    pyfunc = mlflow.pyfunc.load_model(str(tmp_path / "trees"))
    with pytest.raises(mlflow.exceptions.MlflowException):
        pyfunc.unwrap_python_model()  # not a PythonModel: the registry's loader takes it as foreign
    foreign = ForeignModel(pyfunc, "7")
    expected = pipeline.predict_proba(to_frame(test, NUMERIC_FEATURES))[:, 1]
    np.testing.assert_allclose(foreign.predict(test), expected, rtol=1e-9)
    assert auc(test.labels, foreign.predict(test)) > 0.9  # it learned the column that tells
    served = ServedModel("7", foreign, [], None, "full")  # the server's generic path: no compiled runner
    np.testing.assert_allclose(served.score(test), expected, rtol=1e-9)


def test_a_foreign_model_that_answers_the_wrong_number_of_rows_is_an_error() -> None:
    class Short:
        def predict(self, frame):
            return np.zeros(len(frame) - 1)

    with pytest.raises(ValueError, match="returned 9 scores for 10 rows"):
        ForeignModel(Short(), "3").predict(examples(10, seed=3))
