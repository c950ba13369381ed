"""A version of another flavor: any MLflow pyfunc registered under the ranker's name that takes the
contract's scoring frame (contract/examples.py `to_frame`: the ids, the behavior and attribute lists, one
column per numeric feature of NUMERIC_FEATURES) and returns a click probability per row. A LightGBM or
scikit-learn model wrapped so, or a user's own `mlflow.pyfunc.PythonModel`.

The gate judges it as any version (its `predict` on the evaluation window: the version needs the
`eval_start` and `eval_end` tags that `flywheel promote` reads); the ranking server scores it on a generic
path, batched like the others but without XLA (serving/lifecycle.py), its time per batch in
`flywheel_foreign_batch_seconds`. Incremental training continues only the platform's own models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.examples import Examples, to_frame
from contract.inputs import NUMERIC_FEATURES


@dataclass(frozen=True)
class ForeignModel:
    pyfunc: Any  # mlflow.pyfunc.PyFuncModel
    version: str = ""

    def predict(self, ex: Examples) -> np.ndarray:
        """Click probabilities [N] of the pyfunc on `ex` as the contract's frame."""
        scores = np.asarray(self.pyfunc.predict(to_frame(ex, NUMERIC_FEATURES)), dtype=np.float64)
        if scores.ndim == 2 and scores.shape[1] == 2:  # a classifier's two columns: P(no click), P(click)
            scores = scores[:, 1]
        scores = scores.reshape(-1)
        if len(scores) != len(ex):
            raise ValueError(f"foreign model v{self.version} returned {len(scores)} scores for {len(ex)} rows")
        return scores

    def predict_as_shown(self, ex: Examples) -> np.ndarray:
        """A foreign model learns no position apart: its probabilities are those of the exposures as shown."""
        return self.predict(ex)
