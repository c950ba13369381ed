"""The gradient-boosted trees baseline (LightGBM): what a practitioner tries first on tabular CTR data, on
the ranker's own inputs and split. A version is judged against it (`train_full(baselines=True)`).

Its columns, from the same Examples the ranker reads:
  numeric         every numeric feature (windowed counts and rates, catalog numbers, history length, how
                  often the user's recent positives are the candidate)
  item, category  the candidate's id and category, as LightGBM categoricals (codes of the training part;
                  an id it did not see is missing)
  tokens          each attribute of the item and user tokens ("genre:Drama") and each field of the request's
                  context ("page:search"): one indicator per value of one with at most MULTI_HOT values,
                  else the code of its first value
  history         the user's behaviors before the example in the candidate's category (the long history),
                  and of those how many of each action type
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from contract.examples import PAD, Examples

MULTI_HOT = 64  # an attribute with more values than this is one categorical column
PARAMS = {"objective": "binary", "learning_rate": 0.05, "num_leaves": 31, "min_data_in_leaf": 50,
          "feature_fraction": 0.9, "bagging_fraction": 0.9, "bagging_freq": 1, "lambda_l2": 1.0,
          "cat_smooth": 20.0, "verbosity": -1, "num_threads": 2, "seed": 7, "deterministic": True}
ROUNDS, PATIENCE = 1000, 30  # boosting rounds at most; stopped when the validation AUC has not risen for PATIENCE


@dataclass
class Columns:
    """The encoding learned on the training part and applied to every part alike."""

    ids: dict[str, dict[str, int]]  # "item", "category", or a token attribute coded as one column -> value codes
    hot: dict[str, list[str]]  # a token attribute -> its values, one indicator each
    types: list[str]  # the action types of the long history

    @classmethod
    def learn(cls, ex: Examples) -> Columns:
        values: dict[str, set[str]] = {}
        for tokens in (ex.item_tokens, ex.user_tokens, ex.context_tokens):
            for token in set(tokens.ravel()) - {PAD}:
                name, _, value = str(token).partition(":")
                values.setdefault(name, set()).add(value)
        codes = lambda vs: {v: n for n, v in enumerate(sorted(vs))}  # noqa: E731
        ids = {"item": codes(set(ex.item_ids)), "category": codes(set(ex.categories))}
        ids |= {f"token {name}": codes(vs) for name, vs in values.items() if len(vs) > MULTI_HOT}
        hot = {name: sorted(vs) for name, vs in values.items() if len(vs) <= MULTI_HOT}
        return cls(ids, hot, sorted(set(ex.long_types.ravel()) - {PAD}))

    def names(self, ex: Examples) -> list[str]:
        numeric = list(ex.numeric_names) or [f"numeric {j}" for j in range(ex.numeric.shape[1])]
        return [*numeric, *self.ids, *(f"{a}={v}" for a, vs in self.hot.items() for v in vs),
                "in category", *(f"in category {t}" for t in self.types)]

    def matrix(self, ex: Examples) -> np.ndarray:
        n = len(ex)
        firsts: dict[str, list[str | None]] = {name: [None] * n for name in self.ids if name.startswith("token ")}
        hot = {a: np.zeros((n, len(vs)), np.float32) for a, vs in self.hot.items()}
        index = {a: {v: j for j, v in enumerate(vs)} for a, vs in self.hot.items()}
        for row, tokens in enumerate(np.concatenate([ex.item_tokens, ex.user_tokens, ex.context_tokens], axis=1)):
            for token in tokens:
                if token == PAD:
                    continue
                name, _, value = str(token).partition(":")
                if name in index and value in index[name]:
                    hot[name][row, index[name][value]] = 1.0
                elif f"token {name}" in firsts and firsts[f"token {name}"][row] is None:
                    firsts[f"token {name}"][row] = value
        raw = {"item": ex.item_ids, "category": ex.categories} | firsts
        coded = [np.array([self.ids[name].get(v, np.nan) if v is not None else np.nan for v in raw[name]],
                          np.float64) for name in self.ids]
        in_category = [(ex.long_sequences != PAD).sum(axis=1)] + [(ex.long_types == t).sum(axis=1) for t in self.types]
        return np.column_stack([ex.numeric.astype(np.float64), *coded, *hot.values(), *in_category]
                               ).astype(np.float64)


def gbdt_scores(train: Examples, validation: Examples, test: Examples) -> np.ndarray:
    """Trees boosted on `train` until the validation AUC stops rising; their scores of `test`."""
    import lightgbm

    columns = Columns.learn(train)
    # LightGBM's names refuse JSON's punctuation: a position keeps them apart whatever the values hold.
    names = [f"f{j}_{re.sub(r'[^0-9A-Za-z]+', '_', n)}" for j, n in enumerate(columns.names(train))]
    categorical = names[train.numeric.shape[1]:train.numeric.shape[1] + len(columns.ids)]
    data = lightgbm.Dataset(columns.matrix(train), train.labels, weight=train.weights, feature_name=names,
                            categorical_feature=categorical, free_raw_data=False)
    valid = data.create_valid(columns.matrix(validation), validation.labels)
    booster = lightgbm.train(PARAMS | {"metric": "auc"}, data, ROUNDS, valid_sets=[valid],
                             callbacks=[lightgbm.early_stopping(PATIENCE, verbose=False)])
    return booster.predict(columns.matrix(test), num_iteration=booster.best_iteration)
