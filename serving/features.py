"""Online features for one ranking request: one batched read of the `ranking_serving` feature
service (one entity row per candidate), turned into model inputs by the same function that builds
training sets (`models.dataset.to_examples`), so serving and training see the same features.

Documented defaults: a feature with nothing stored (a new user or item, a window without events, a
candidate sent without its category) is 0 after scaling, and an empty behavior sequence; every such
feature is named in the response's `defaulted_features`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from feast.errors import FeatureServiceNotFoundException

from feature_repo.store import feature_store
from infra.settings import Settings
from models.dataset import NUMERIC_FEATURES, SEQUENCE, to_examples
from models.examples import PAD, Examples

SERVICE = "ranking_serving"


@dataclass(frozen=True)
class Candidate:
    item_id: str
    category: str = ""


@dataclass
class Fetched:
    examples: Examples  # one row per candidate
    defaulted: list[str]  # features missing for at least one candidate
    snapshot: dict[str, list]  # raw feature values as read, for the prediction log


class OnlineFeatures:
    def __init__(self, s: Settings) -> None:
        self.store = feature_store(s)
        try:
            self.service = self.store.get_feature_service(SERVICE)
        except FeatureServiceNotFoundException:
            raise ValueError(f"feature service {SERVICE} is not registered: apply the feature repo first "
                             "(`flywheel up` does)") from None

    def fetch(self, user_id: str, candidates: list[Candidate], now_ms: int, sequence_length: int,
              keep_behaviors: int | None = None) -> Fetched:
        """Inputs for scoring `candidates` for `user_id` at `now_ms`; sequences keep the newest
        `keep_behaviors` (compute allocation) of at most `sequence_length`."""
        rows = [{"user_id": user_id, "item_id": c.item_id, "category": c.category} for c in candidates]
        values = self.store.get_online_features(features=self.service, entity_rows=rows).to_dict()
        frame = pd.DataFrame(values)
        defaulted = sorted(name for name in (*NUMERIC_FEATURES, *SEQUENCE)
                           if name in frame and frame[name].isna().any())
        missing = [name for name in (*NUMERIC_FEATURES, *SEQUENCE) if name not in frame]
        if missing:
            raise RuntimeError(f"feature service {SERVICE} lacks {missing}: is the feature repo applied?")
        ex = to_examples(frame, np.full(len(frame), now_ms), np.zeros(len(frame)), sequence_length)
        if keep_behaviors is not None:
            ex.sequences[:, keep_behaviors:] = PAD
        snapshot = {name: [None if pd.isna(v) else float(v) for v in frame[name]] for name in NUMERIC_FEATURES}
        snapshot["sequence"] = [i for i in ex.sequences[0] if i != PAD]
        return Fetched(ex, defaulted, snapshot)
