"""The CTR models on synthetic behavior with a known structure: they learn it, exports reproduce
their scores exactly, and an incremental export's delta reproduces the new model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import keras
import numpy as np
import pytest

from contract.examples import PAD, Examples, from_frame, to_frame
from infra.settings import ModelsSettings
from infra.value import ValueExpression
from models.ctr import CtrModel, ModelSpec
from models.metrics import auc
from models.networks import RankerV1
from models.sparse import SparseConfig
from tests.ctr_data import CATEGORIES, SPEC, synthetic, with_buys


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(7)


@pytest.fixture(scope="module")
def data() -> Examples:
    return synthetic(12_000, seed=1, long_history=True)


def test_ranker_and_baseline_learn_the_preference(data: Examples) -> None:
    train, test = data.take(slice(0, 10_000)), data.take(slice(10_000, None))
    pref = np.array([int(u[1:]) % CATEGORIES for u in test.user_ids])
    oracle = auc(test.labels, (pref == np.array([int(c[1:]) for c in test.categories])).astype(float))
    ranker = CtrModel(SPEC)
    losses = ranker.fit(train, epochs=3, progress=False)
    assert losses[2] < losses[1] < losses[0]
    ranked = auc(test.labels, ranker.predict(test))
    baseline = CtrModel(replace(SPEC, kind="logreg", sparse=SparseConfig(dim=1, admit_after=2, learning_rate=0.2)))
    baseline.fit(train, epochs=3, progress=False)
    base = auc(test.labels, baseline.predict(test))
    print(f"test AUC: ranker {ranked:.3f}, baseline {base:.3f}, oracle {oracle:.3f}")
    assert ranked > 0.62 and ranked > base + 0.05, (ranked, base, oracle)
    assert ranked < oracle + 0.02  # sanity: no leak of the label into the features


def test_export_reproduces_scores_and_delta_reproduces_the_next_model(data: Examples, tmp_path: Path) -> None:
    model = CtrModel(SPEC)
    model.fit(data.take(slice(0, 6000)), progress=False)
    model.save(tmp_path / "v1")
    loaded = CtrModel.load(tmp_path / "v1")
    test = data.take(slice(10_000, None))
    assert np.array_equal(loaded.predict(test), model.predict(test))

    # Incremental training, warm-started from the export, on newer events only.
    base_versions = loaded.versions()
    before = {name: t.snapshot() for name, t in loaded.tables.items()}
    newer = data.take(slice(6000, 6200))
    loaded.fit(newer, progress=False)
    loaded.save(tmp_path / "v2")
    loaded.save_delta(tmp_path / "v2-delta", since=base_versions)

    touched_items = set(newer.item_ids) | {i for lists in (newer.sequences, newer.long_sequences)
                                           for row in lists for i in row if i != PAD}
    after = loaded.tables["item"].snapshot()
    old_rows = dict(zip(before["item"].ids, before["item"].values))
    changed = {i for i, v in zip(after.ids, after.values) if i not in old_rows or not np.array_equal(old_rows[i], v)}
    assert changed and changed <= touched_items

    patched = CtrModel.load(tmp_path / "v1", delta=tmp_path / "v2-delta")
    full = CtrModel.load(tmp_path / "v2")
    for name in patched.tables:
        assert patched.tables[name].snapshot().equals(full.tables[name].snapshot())
    assert np.array_equal(patched.predict(test), loaded.predict(test))

    with pytest.raises(ValueError, match="relative to versions"):
        CtrModel.load(tmp_path / "v2", delta=tmp_path / "v2-delta")


def test_the_ranker_reads_a_new_users_preference_from_the_long_history() -> None:
    # Users never seen in training, without recent behaviors: only the long history (the user's clicks
    # in the candidate's category) tells what they prefer.
    data = synthetic(16_000, seed=3, users=400, long_history=True)
    data = replace(data, sequences=np.full(data.sequences.shape, PAD, dtype=object))
    seen = np.array([int(u[1:]) < 300 for u in data.user_ids])
    train, test = data.take(np.flatnonzero(seen)), data.take(np.flatnonzero(~seen))
    scores = {}
    for long_length in (5, 0):
        model = CtrModel(replace(SPEC, long_length=long_length))
        model.fit(train, epochs=2, progress=False)
        scores[long_length] = auc(test.labels, model.predict(test))
    print(f"new users' test AUC: long history {scores[5]:.3f}, without {scores[0]:.3f}")
    assert scores[5] > scores[0] + 0.05, scores


def test_a_spec_exported_before_the_long_history_is_the_previous_ranker() -> None:
    old = json.loads(SPEC.to_json())
    del old["long_length"], old["token_length"]
    spec = ModelSpec.from_json(json.dumps(old))
    assert (spec.kind, spec.long_length) == ("ranker-v1", 0)
    assert isinstance(CtrModel(spec).network, RankerV1)


def test_scoring_input_without_a_feature_is_a_clear_error(data: Examples) -> None:
    frame = to_frame(data.take(slice(0, 5)), SPEC.numeric_features).drop(columns=["noise"])
    with pytest.raises(ValueError, match=r"lacks columns \['noise'\]"):
        from_frame(frame, SPEC.numeric_features, SPEC.sequence_length)


def test_the_trees_baseline_learns_from_the_rankers_columns_and_scores_unseen_ids() -> None:
    """Gradient-boosted trees on the ranker's inputs (models/gbdt.py): the user x category preference is in
    the long history's count of the candidate's category, which the trees read (near the oracle's ~0.72);
    without that column they have ids and noise only (near chance). An id the training part never saw is
    scored as missing, not refused."""
    from models.gbdt import gbdt_scores

    def parts(long_history: bool) -> list[Examples]:
        data = synthetic(8000, seed=5, long_history=long_history)
        return [data.take(slice(0, 6000)), data.take(slice(6000, 7000)), data.take(slice(7000, None))]

    train, validation, test = parts(long_history=True)
    assert auc(test.labels, gbdt_scores(train, validation, test)) > 0.68
    train, validation, test = parts(long_history=False)
    assert auc(test.labels, gbdt_scores(train, validation, test)) < 0.6
    unseen = replace(test, item_ids=np.array([f"new-{i}" for i in test.item_ids], object),
                     categories=np.full(len(test), "new", object))
    scores = gbdt_scores(*parts(long_history=True)[:2], unseen)
    assert scores.shape == (len(test),) and np.isfinite(scores).all()


def test_the_ranker_reads_the_requests_declared_context(tmp_path: Path) -> None:
    """The page a list is shown on decides which categories are clicked (a sale page: the even ones, home: the odd
    ones): the ranker reading the request's context learns it, the same ranker without it cannot; a candidate's
    score moves with the page, and its export scores it alike."""
    data = synthetic(12_000, seed=4)
    rng = np.random.default_rng(4)
    page = rng.choice(["home", "sale"], len(data))
    favoured = (page == "sale") == np.array([int(c[1:]) % 2 == 0 for c in data.categories])
    data = replace(data, labels=(rng.random(len(data)) < np.where(favoured, 0.5, 0.05)).astype(np.float32),
                   context_tokens=np.array([[f"page:{p}"] for p in page], object))
    train, test = data.take(slice(0, 9_000)), data.take(slice(9_000, None))
    scores, models = {}, {}
    for fields in (("page",), ()):
        models[fields] = CtrModel(replace(SPEC, tokens=tuple(f"context_tokens:{f}" for f in fields)))
        models[fields].fit(train, epochs=2, progress=False)
        scores[fields] = auc(test.labels, models[fields].predict(test))
    print(f"test AUC: with the page {scores[('page',)]:.3f}, without {scores[()]:.3f}")
    assert scores[("page",)] > scores[()] + 0.1, scores
    model = models[("page",)]
    one = test.take(slice(0, 1))
    on = {p: float(model.predict(replace(one, context_tokens=np.array([[f"page:{p}"]], object)))[0])
          for p in ("home", "sale")}
    assert abs(on["sale"] - on["home"]) > 0.1, on
    model.save(tmp_path / "v1")
    loaded = CtrModel.load(tmp_path / "v1")
    assert loaded.spec.context == ("page",) and np.allclose(loaded.predict(test), model.predict(test), atol=1e-6)


def _logged_by_a_biased_ranker(requests: int, seed: int, items: int = 300, shown: int = 10
                               ) -> tuple[Examples, np.ndarray]:
    """Lists of `shown` random candidates, each shown in the order of a former ranker that knew nothing of their
    appeal (a promotion's order), clicked with P = sigmoid(appeal + bias of the rank): -0.4 per rank down. Returns
    the exposures (with their ranks) and each item's hidden appeal (a logit)."""
    rng = np.random.default_rng(seed)
    appeal, promoted = rng.normal(-1.0, 1.0, items), rng.normal(0.0, 1.0, items)
    lists = np.array([rng.choice(items, shown, replace=False) for _ in range(requests)])
    lists = np.take_along_axis(lists, np.argsort(-(promoted[lists] + rng.normal(0, 0.3, lists.shape)), axis=1), axis=1)
    ranks = np.tile(np.arange(shown), requests)
    item = lists.ravel()
    clicked = rng.random(len(item)) < 1 / (1 + np.exp(-(appeal[item] - 0.4 * ranks)))
    n = len(item)
    ex = Examples(np.array([f"u{r % 50}" for r in np.repeat(np.arange(requests), shown)], object),
                  np.array([f"i{i}" for i in item], object), np.array([f"c{i % CATEGORIES}" for i in item], object),
                  np.full((n, 10), PAD, object), rng.normal(size=(n, 1)).astype(np.float32),
                  clicked.astype(np.float32), positions=ranks.astype(np.int32))
    return ex, appeal


def test_a_position_bias_learnt_apart_ranks_by_the_items_appeal_not_the_former_rankers_order(tmp_path: Path) -> None:
    """Exposures logged by a ranker whose order knew nothing of the items' appeal, clicked less the lower they were
    shown: the ranker that learns the rank as a bias of its own (`position_slots`) orders unseen lists closer to
    the hidden appeal (graded NDCG@10) than the same ranker reading the clicks as they came; it scores without the
    rank (a candidate's score is the same whatever rank its example was logged at), and its export alike."""
    from models.metrics import graded_ndcg

    logged, appeal = _logged_by_a_biased_ranker(2_000, seed=11)
    rng = np.random.default_rng(12)
    candidates = np.array([rng.choice(len(appeal), 20, replace=False) for _ in range(300)])
    shown = Examples(np.full(candidates.size, "u0", object), np.array([f"i{i}" for i in candidates.ravel()], object),
                     np.array([f"c{i % CATEGORIES}" for i in candidates.ravel()], object),
                     np.full((candidates.size, 10), PAD, object), np.zeros((candidates.size, 1), np.float32),
                     np.zeros(candidates.size, np.float32))
    relevance = 1 / (1 + np.exp(-appeal[candidates]))  # the click rate at the top
    ndcg, models = {}, {}
    for slots in (10, 0):
        models[slots] = CtrModel(replace(SPEC, position_slots=slots))
        models[slots].fit(logged, epochs=3, progress=False)
        ndcg[slots] = graded_ndcg(relevance, models[slots].predict(shown).reshape(candidates.shape), k=10)
    print(f"NDCG@10 against the hidden appeal: position bias apart {ndcg[10]:.4f}, clicks as they came {ndcg[0]:.4f}")
    assert ndcg[10] >= ndcg[0] + 0.03, ndcg
    model = models[10]
    bias = model.network.bias.numpy()
    assert bias[0] == 0 and bias[9] < bias[3] < bias[1] < 0, bias  # learnt: lower ranks are clicked less
    at_seven = replace(shown, positions=np.full(len(shown), 7, np.int32))
    assert np.array_equal(model.predict(at_seven), model.predict(shown))
    # its clicks are measured against the probabilities where the items were shown (the gate's calibration: 1.15x
    # the observed CTR), not against the scores, which are each item's at the top (2.3x: the gate would refuse it)
    observed, (_, high) = logged.labels.mean(), ModelsSettings().gate_calibration
    as_shown, at_top = model.predict_as_shown(logged).mean() / observed, model.predict(logged).mean() / observed
    assert abs(as_shown - 1.0) < 0.25 and at_top > high, (as_shown, at_top)
    model.save(tmp_path / "v1")
    loaded = CtrModel.load(tmp_path / "v1")
    assert loaded.spec.position_slots == 10 and np.allclose(loaded.predict(shown), model.predict(shown), atol=1e-6)


def test_a_labels_declared_value_as_its_weight_ranks_for_value_not_only_for_clicks() -> None:
    """Orders of items alike in how often they are bought but not in what they are worth: the ranker whose
    examples weigh each order's amount (over the mean, as the training labels' `label_weight`) puts the items
    that earn more on top, and the value of its top 3 per list beats the same ranker's learnt from orders alone."""
    rng = np.random.default_rng(21)
    items, n = 300, 30_000
    bought = 1 / (1 + np.exp(-rng.normal(-1.5, 0.7, items)))
    amount = rng.lognormal(3.0, 1.0, items)
    shown = rng.integers(0, items, n)
    ordered = rng.random(n) < bought[shown]
    weights = np.where(ordered, amount[shown] / amount[shown][ordered].mean(), 1.0).astype(np.float32)

    def examples(item: np.ndarray, labels: np.ndarray, w: np.ndarray | None = None) -> Examples:
        m = len(item)
        return Examples(np.array([f"u{u}" for u in rng.integers(0, 50, m)], object),
                        np.array([f"i{i}" for i in item], object),
                        np.array([f"c{i % CATEGORIES}" for i in item], object), np.full((m, 10), PAD, object),
                        np.zeros((m, 1), np.float32), labels.astype(np.float32), weights=w)

    lists = np.array([rng.choice(items, 20, replace=False) for _ in range(500)])
    candidates = examples(lists.ravel(), np.zeros(lists.size))
    worth = {}
    for weighted in (True, False):
        model = CtrModel(SPEC)
        model.fit(examples(shown, ordered, weights if weighted else None), epochs=3, progress=False)
        top = np.take_along_axis(lists, np.argsort(-model.predict(candidates).reshape(lists.shape), axis=1)[:, :3], 1)
        worth[weighted] = float((bought[top] * amount[top]).sum(axis=1).mean())
    print(f"expected value of the top 3 per list: weighted by amount {worth[True]:.1f}, "
          f"orders alone {worth[False]:.1f}")
    assert worth[True] >= 1.2 * worth[False], worth


def test_a_conversion_over_the_clicks_learns_from_them_and_the_clicks_lose_nothing(tmp_path: Path) -> None:
    """Two objectives, ESMM's: a click over the exposures, a buy over the clicks (an item's quality decides it, a
    rare label). The two-objective ranker scores the buy over every exposure as P(click) x P(buy | click): its buy
    AUC is at least the ranker's trained on the buys alone, and its click AUC within 0.005 of the ranker's trained on
    the clicks alone, on the same split; its export scores as it does. Its test part cut into lists of 20, each
    list's top 3 by the declared value `buy * price` (the buy's probability over the exposures: P(click) x
    P(buy | click)) earn (bought x price) more than its top 3 by the click: at least 1.1 times as much, by more
    than twice the paired difference's standard error."""
    data = with_buys(synthetic(50_000, seed=5, long_history=True), seed=5)
    train, test = data.take(slice(0, 35_000)), data.take(slice(35_000, None))
    flipped = replace(test, labels=1 - test.labels)  # the labels are the first objective's, replaced ones too
    assert np.array_equal(flipped.objectives, np.column_stack([1 - test.labels, test.objectives[:, 1]]))
    both = CtrModel(replace(SPEC, objectives=(("click", ""), ("buy", "click"))))
    both.fit(train, epochs=2, progress=False)
    scores = both.predict_objectives(test)
    assert np.allclose(scores[:, 0], both.predict(test), atol=1e-6) and (scores[:, 1] <= scores[:, 0] + 1e-6).all()
    assert np.array_equal(CtrModel.load(both.save(tmp_path / "both")).predict_objectives(test), scores)
    alone = {}
    for k in (0, 1):
        keras.utils.set_random_seed(7)
        single = CtrModel(SPEC)
        single.fit(replace(train, labels=train.objectives[:, k], objectives=None), epochs=2, progress=False)
        alone[k] = auc(test.objectives[:, k], single.predict(test))
    click, buy = (auc(test.objectives[:, k], scores[:, k]) for k in (0, 1))
    print(f"test AUC: click {click:.4f} (alone {alone[0]:.4f}), buy {buy:.4f} (alone {alone[1]:.4f})")
    assert buy >= alone[1] and click >= alone[0] - 0.005, (click, buy, alone)
    price = np.random.default_rng(8).lognormal(3.0, 1.0, 200)[[int(i[1:]) for i in test.item_ids]]
    value = ValueExpression.parse("buy * price")
    lists = len(test) // 20
    earned = (test.objectives[:, 1] * price)[: lists * 20].reshape(lists, 20)
    per_list: dict[str, np.ndarray] = {}
    for name, order in (("click", scores[:, 0]), ("value", value({"click": scores[:, 0], "buy": scores[:, 1],
                                                                  "price": price}))):
        top = np.argsort(-order[: lists * 20].reshape(lists, 20), axis=1, kind="stable")[:, :3]
        per_list[name] = np.take_along_axis(earned, top, 1).sum(axis=1)
    gain = per_list["value"] - per_list["click"]
    by_value, by_click, error = per_list["value"].mean(), per_list["click"].mean(), gain.std() / np.sqrt(lists)
    print(f"earned per list's top 3 of {lists} lists of 20: by value {by_value:.2f}, by click {by_click:.2f} "
          f"(difference {gain.mean():.2f} +- {error:.2f})")
    assert by_value >= 1.1 * by_click and gain.mean() > 2 * error, (by_value, by_click, error)
