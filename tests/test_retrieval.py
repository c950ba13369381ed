"""Retrieval: the two-tower model finds what a user's behavior points to, graph recall follows
co-interaction, the merge favours what sources agree on, and the offline measures."""

from __future__ import annotations

import time

import keras
import numpy as np
import pytest

from infra.settings import Settings, load_settings
from models.baselines import Interactions, ease, item_knn
from models.recall import (IndexFrame, PopularityPrior, co_interaction, decayed, merge, ndcg_at_k, neighbours_of,
                           popular, query_vectors, recall_at_k, recently_popular, source_weights, top_k)
from models.retrieval import Catalogue, Profiles, Split, TwoTower, judge, two_tower_lists
from serving.nearline import ItemIndex, Keys, count_popular, redis_client

DAY = 86_400.0

# The catalog's rows as the default (MovieLens) spec declares them.
ITEMS = [{"item_id": str(i), "item_release_year": 1990 + i % 10, "item_genres": ["Drama" if i < 20 else "Comedy"]}
         for i in range(40)]
USERS = [{"user_id": f"u{n}", "user_age": 20 + n % 40, "user_gender": "MF"[n % 2], "user_occupation": "other"}
         for n in range(60)]
SPEC = load_settings({"FLYWHEEL_CONFIG": "/dev/null"}).spec
ITEM_TABLE, USER_TABLE = SPEC.table("item"), SPEC.table("user")


def _clicks(seed: int = 3) -> list[tuple[str, str]]:
    """Users u0..u29 click only items 0..19, u30..u59 only 20..39; item 0 and 20 are each side's favourite."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(30):
        for n in range(60):
            base = 0 if n < 30 else 20
            item = base if rng.random() < 0.3 else base + int(rng.integers(1, 20))
            out.append((f"u{n}", str(item)))
    return out


def test_the_two_tower_model_retrieves_from_the_users_side_of_the_catalogue() -> None:
    clicks = _clicks()
    catalogue = Catalogue.build(ITEMS, dict(zip(*np.unique([item for _, item in clicks], return_counts=True))), ITEM_TABLE)
    keras.utils.set_random_seed(0)  # the towers' initial weights
    model = TwoTower(catalogue, Profiles.build(USERS, USER_TABLE), [u["user_id"] for u in USERS], dim=16)
    losses = model.fit(model.positives(clicks, range(len(clicks))), epochs=6, batch_size=64)
    assert losses[-1] < losses[0]
    users = ["u1", "u40", "new-user"]
    recent = [["3", "5", "7"], ["25", "33"], ["4", "9"]]  # the new user's recent clicks alone place them
    scores = model.user_embeddings(users, recent) @ model.item_embeddings().T
    sides = [[int(i) < 20 for i in top_k(row, catalogue.item_ids, 10)] for row in scores]
    assert sum(sides[0]) >= 9 and sum(sides[1]) <= 1 and sum(sides[2]) >= 8, sides


def test_graph_recall_follows_co_interaction_and_popularity_counts() -> None:
    rows = [("a", "1", 1.0), ("a", "2", 1.0), ("b", "1", 1.0), ("b", "2", 1.0), ("b", "3", 1.0), ("c", "3", 2.0),
            ("c", "4", 1.0)]
    neighbours = co_interaction(rows, keep=2)
    assert neighbours["1"] == [("2", 2.0), ("3", 1.0)]
    assert neighbours_of(["1"], neighbours, 5, exclude={"2"}) == ["3"]
    assert neighbours_of(["3"], neighbours, 5) == ["4", "1"]  # 2 ties with 1 and falls outside `keep`
    assert popular(["b", "a", "b", "c", "a", "b"]) == ["b", "a", "c"]


def test_popularity_follows_time() -> None:
    now = 1_795_000_000.0  # 2026; the other positives are 28 years older: weights 2^-1460 of today's
    positives = ([("old", now - 60 * DAY)] * 10 + [("new", now - DAY)] * 3 + [("1998", now - 28 * 365 * DAY)] * 50
                 + [("today", now)])
    assert popular(i for i, _ in positives) == ["1998", "old", "new", "today"]
    # half-life 7 days: 3 positives a day old outweigh one today, which outweighs 10 two months old
    assert recently_popular(positives, 7 * DAY) == ["new", "today", "old", "1998"]
    assert recently_popular(positives, 1000 * 365 * DAY) == ["1998", "old", "new", "today"]  # ~no decay: counts


def test_the_baselines_recommend_from_the_users_side_of_the_catalogue() -> None:
    clicks = _clicks()
    x = Interactions(clicks)
    seen = {"u1": {"0", "1"}, "u40": {"20"}}
    for weights in (ease(x.x, l2=10.0), item_knn(x.x, neighbours=10)):
        lists = x.lists(weights, ["u1", "u40", "unknown"], 10, seen)
        assert all(int(i) < 20 for i in lists["u1"]) and all(int(i) >= 20 for i in lists["u40"]), lists
        assert not set(lists["u1"]) & seen["u1"] and lists["unknown"] == []


def test_ease_is_a_ridge_regression_of_each_item_on_the_others_and_knn_keeps_the_nearest() -> None:
    x = (np.random.default_rng(2).random((30, 6)) < 0.4).astype(np.float32)
    b = ease(x, l2=3.0)
    for j in range(6):  # EASE's closed form, column by column: item j regressed on the other items
        others = [i for i in range(6) if i != j]
        xo = x[:, others].astype(np.float64)
        expected = np.linalg.solve(xo.T @ xo + 3.0 * np.eye(5), xo.T @ x[:, j])
        assert np.allclose(b[others, j], expected, atol=1e-4) and b[j, j] == 0
    sim = item_knn(x, neighbours=2)
    norms = np.linalg.norm(x, axis=0)
    cosine = (x.T @ x) / np.outer(norms, norms)
    for i in range(6):
        kept = np.flatnonzero(sim[i])
        nearest = sorted((j for j in range(6) if j != i), key=lambda j: -cosine[i, j])[:2]
        assert set(kept) == set(nearest) and np.allclose(sim[i, kept], cosine[i, kept]), (i, kept, nearest)


@pytest.mark.stack
def test_the_near_line_popularity_orders_items_as_the_benchmark_does(redis_stack: Settings) -> None:
    rng, now = np.random.default_rng(5), 1_795_000_000.0
    # and a history from 1998 (no two items with equal weights: Redis orders ties the other way round)
    ages = np.concatenate([rng.exponential(20 * DAY, 400), 28 * 365 * DAY + rng.uniform(0, DAY, 30)])
    positives = [(f"i{int(rng.zipf(1.5)) % 40}", now - float(age)) for age in rng.permutation(ages)]
    r, key = redis_client(redis_stack), "test:popular"
    r.delete(key)
    for batch in (positives[:150], positives[150:]):  # a running sum: batches as the embedder polls them
        pipe = r.pipeline(transaction=False)
        count_popular(pipe, key, batch, 7 * DAY)
        pipe.execute()
    served = [i.decode() for i in r.zrevrange(key, 0, -1)]
    assert served == recently_popular(positives, 7 * DAY)
    assert served != popular(i for i, _ in positives)  # it is not the all-time count


def test_the_merge_favours_agreement_and_names_the_sources() -> None:
    merged = merge({"two-tower": ["x", "y", "z"], "graph": ["y", "w"], "popularity": ["p", "x"]}, k=3)
    assert [m[0] for m in merged] == ["x", "y", "p"]  # x and y: two sources each (tied, by id); then a first place
    named = {item: sources for item, _, sources in merged}
    assert named["y"] == ["two-tower", "graph"] and named["x"] == ["two-tower", "popularity"]
    assert len(merged) == 3 and len({m[0] for m in merged}) == 3
    # weighted: popularity's first place outweighs two sources' agreement
    weights = source_weights((1.0, 1.0, 4.0, 1.0))
    assert [m[0] for m in merge({"two-tower": ["x", "y"], "graph": ["y"], "popularity": ["p"]}, 2, weights)] == ["p", "y"]
    for bad in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.0, 1.0)):  # one per source, none switched off
        with pytest.raises(ValueError, match="one weight"):
            source_weights(bad)


def test_recall_and_ndcg() -> None:
    assert recall_at_k(["a", "b", "c"], {"a", "c", "d", "e"}, 2) == 0.25
    assert ndcg_at_k(["a", "b"], {"a"}, 2) == 1.0
    assert abs(ndcg_at_k(["b", "a"], {"a"}, 2) - 1 / np.log2(3)) < 1e-9
    assert recall_at_k(["a"], set(), 5) == 0.0


def test_a_saved_model_loads_to_the_same_embeddings(tmp_path) -> None:
    clicks = _clicks()
    catalogue = Catalogue.build(ITEMS, dict(zip(*np.unique([item for _, item in clicks], return_counts=True))), ITEM_TABLE)
    model = TwoTower(catalogue, Profiles.build(USERS, USER_TABLE), [u["user_id"] for u in USERS], dim=8)
    model.fit(model.positives(clicks, range(len(clicks))), epochs=1, batch_size=64, recency_half_life_s=300.0)
    model.save(tmp_path / "m")
    loaded = TwoTower.load(tmp_path / "m")
    users, recent = ["u3", "someone-new"], [["1", "2"], ["30"]]
    np.testing.assert_allclose(loaded.user_embeddings(users, recent), model.user_embeddings(users, recent), atol=1e-6)
    np.testing.assert_allclose(loaded.item_embeddings(), model.item_embeddings(), atol=1e-6)
    assert sorted(loaded.catalogue.popular[:2]) == ["0", "20"] and loaded.catalogue.categories[25] == "Comedy"


def test_the_split_judges_each_users_next_positives_and_never_what_they_saw() -> None:
    rows = [("a", "1", 1, True), ("a", "2", 2, False), ("b", "3", 3, True), ("a", "4", 10, True),
            ("a", "4", 11, True), ("a", "5", 12, False), ("c", "6", 13, True)]
    split = Split.at(rows, cut=10, next_n=5, length=20)
    assert split.clicks == [("a", "1"), ("b", "3")] and split.seen == {"a": {"1", "2"}, "b": {"3"}}
    assert split.test == {"a": ["4"], "c": ["6"]} and split.users == ["a"]  # c has nothing before the cut
    assert judge({"a": ["9", "4"]}, split, k=2) == (1.0, 1 / np.log2(3))
    assert split.excluded("a") == {"1", "2"} and split.excluded("c") == set()
    # where items repeat (groceries), a user's own items are candidates, and may be what they want next
    again = Split.at([*rows, ("a", "1", 14, True)], cut=10, next_n=5, length=20, repeats=True)
    assert again.test["a"] == ["4", "1"] and again.excluded("a") == set()
    assert judge({"a": ["1", "4"]}, again, k=2)[0] == 1.0


def test_the_towers_inputs_are_the_specs_attributes(tmp_path) -> None:
    from infra.dataset import parse_spec
    from tests.test_dataset_spec import SHOP

    shop = parse_spec(SHOP, tmp_path / "shop.toml")
    items = [{"item_id": "A1", "item_brand": "acme", "item_price": 19.5, "item_tags": ["new", "sale"]},
             {"item_id": "B2", "item_brand": None, "item_price": None, "item_tags": []},
             {"item_id": "C3"}]  # only behavior names it
    catalogue = Catalogue.build(items, {"A1": 3}, shop.table("item"))
    assert catalogue.tokens.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]  # brand:acme, tags:new, tags:sale
    assert catalogue.dense.shape == (3, 2)  # the price (a missing one: the mean) and popularity
    assert catalogue.dense[1, 0] == catalogue.dense[0, 0]
    assert catalogue.categories == ["acme", "", ""]  # the first categorical attribute, as none is named
    profiles = Profiles.build([{"user_id": "c1", "user_region": "north"}, {"user_id": "c2", "user_region": "south"},
                               {"user_id": "c3", "user_region": None}], shop.table("user"))
    assert profiles.sizes == (3,) and profiles.of(["c2", "c3", "nobody"]).tolist() == [[2], [0], [0]]
    # MovieLens: a user's gender, occupation and age decade, in the spec's order
    movielens = Profiles.build(USERS, USER_TABLE)
    assert movielens.sizes == (3, 2, 5) and movielens.index["u2"] == (2, 1, 1)  # M, other, 20s (of 20s-50s)


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_index_orders_items_by_the_model_score_plus_the_prior_in_one_cosine() -> None:
    rng, temperature = np.random.default_rng(1), 0.1
    items, users, prior = _unit(rng, 300, 8), _unit(rng, 20, 8), rng.normal(0, 5, 300)
    frame = IndexFrame.around(prior, temperature, at=0.0, headroom=2.0)
    indexed, queries = frame.index_vectors(items, prior), query_vectors(users)
    assert np.allclose(np.linalg.norm(indexed, axis=1), np.linalg.norm(indexed[0]), rtol=1e-5)  # one norm
    cosine = (queries @ indexed.T) / np.linalg.norm(queries, axis=1, keepdims=True) / np.linalg.norm(indexed[0])
    for c, score in zip(cosine, users @ items.T / temperature + prior):
        assert list(np.argsort(-c)[:30]) == list(np.argsort(-score)[:30])
    assert frame.holds(prior + 1.9) and not frame.holds(prior + 2.1)  # risen past the headroom: drawn again
    assert PopularityPrior(4.0, 0.1, DAY).headroom == pytest.approx(4 * np.log(16))


def test_the_prior_is_the_popularity_sources_decayed_count_with_a_floor() -> None:
    prior, now = PopularityPrior(weight=2.0, floor=0.5, half_life_s=7 * DAY), 1_795_000_000.0
    scores = decayed([("a", now)] * 4 + [("b", now - 7 * DAY)] * 2 + [("c", now - 70 * DAY)], 7 * DAY)
    assert np.allclose(prior.values(scores, ["a", "b", "c", "never"], now),
                       [2 * np.log(4), 2 * np.log(1), 2 * np.log(0.5), 2 * np.log(0.5)])
    for bad in ({"weight": -1.0}, {"floor": 0.0}):
        with pytest.raises(ValueError, match="prior_floor"):
            PopularityPrior(**({"weight": 1.0, "floor": 0.1, "half_life_s": DAY} | bad))


def test_the_prior_puts_what_is_popular_now_first_and_the_model_orders_the_rest() -> None:
    clicks = _clicks()
    catalogue = Catalogue.build(ITEMS, dict(zip(*np.unique([item for _, item in clicks], return_counts=True))), ITEM_TABLE)
    keras.utils.set_random_seed(0)  # the towers' initial weights
    model = TwoTower(catalogue, Profiles.build(USERS, USER_TABLE), [u["user_id"] for u in USERS], dim=16)
    model.fit(model.positives(clicks, range(len(clicks))), epochs=6, batch_size=64)
    # The day before the cut, the other side's users click item 35 again and again: it is popular now.
    rows = [(u, i, float(n), True) for n, (u, i) in enumerate(clicks)]
    rows += [(f"u{30 + n % 30}", "35", 4 * DAY + n, True) for n in range(600)]
    # A new user of the first side (items 0..19), judged on a click after the cut.
    rows += [("fan", "3", 4.5 * DAY, True), ("fan", "5", 4.6 * DAY, True), ("fan", "9", 10 * DAY, True)]
    split = Split.at(rows, cut=5 * DAY, next_n=5, length=20)
    alone = two_tower_lists(model, split, 10, PopularityPrior(0.0, 0.1, DAY))["fan"]
    with_prior = two_tower_lists(model, split, 10, PopularityPrior(8.0, 0.1, DAY))["fan"]
    assert "35" not in alone and sum(int(i) < 20 for i in alone) >= 8, alone  # the model alone: the fan's side
    assert with_prior[0] == "35" and sum(int(i) < 20 for i in with_prior[1:]) >= 7, with_prior  # popular now first


@pytest.mark.stack
def test_the_near_line_index_follows_the_live_popularity(redis_stack: Settings) -> None:
    rng, now = np.random.default_rng(4), time.time()
    ids, vectors, users = [f"i{n}" for n in range(200)], _unit(rng, 200, 8), _unit(rng, 5, 8)
    keys, prior = Keys(f"test-{time.time_ns()}"), PopularityPrior(4.0, 0.1, 7 * DAY)
    r = redis_client(redis_stack)
    pipe = r.pipeline(transaction=False)
    count_popular(pipe, keys.popular, [(f"i{int(rng.integers(0, 200))}", now - float(rng.uniform(0, 20 * DAY)))
                                       for _ in range(2000)], prior.half_life_s)
    pipe.execute()

    def served(user: np.ndarray) -> list[str]:
        got = r.execute_command("VSIM", keys.items("1"), "FP32", query_vectors(user[None])[0].tobytes(), "COUNT", 10)
        return [i.decode() for i in got]

    def exact(user: np.ndarray) -> list[str]:
        scores = dict(zip(ids, (float(x) for x in r.zmscore(keys.popular, ids)))) if ids else {}
        return top_k(vectors @ user / 0.1 + prior.values(scores, ids, now), ids, 10)

    index = ItemIndex(r, keys, prior, "1", ids, vectors, temperature=0.1, step=0.5)
    index.write()
    assert all(served(u) == exact(u) for u in users)

    def act(item: str, times: int) -> None:
        pipe = r.pipeline(transaction=False)
        count_popular(pipe, keys.popular, [(item, time.time())] * times, prior.half_life_s)
        pipe.execute()

    def vector(item: str) -> list[float]:
        return r.execute_command("VEMB", keys.items("1"), item)

    # A prior that moved less than the step keeps its vector; one that moved more is written again.
    popular_one, frame = max(ids, key=lambda i: index.written[index.rows[i]]), index.frame
    before = vector(popular_one)
    act(popular_one, 1)
    index.reprice({popular_one})
    assert vector(popular_one) == before and not index.pending
    rare = min(ids, key=lambda i: index.written[index.rows[i]])
    before = vector(rare)
    act(rare, 3)
    index.reprice({rare, "not-indexed"})
    assert vector(rare) != before and index.frame == frame and not index.pending
    held = index.written.copy()  # the priors the index holds: the moved one's new, the other's as it was
    assert all(served(u) == top_k(vectors @ u / 0.1 + held, ids, 10) for u in users)

    tail = ids[int(np.argmin(vectors @ users[0]))]  # the model's last item for user 0
    act(tail, 5000)  # a burst: past the frame
    index.reprice({tail})
    assert index.frame != frame and served(users[0])[0] == tail  # every item redrawn around the priors now
    assert all(set(served(u)) == set(exact(u)) for u in users)


def test_the_gates_baselines_follow_the_datas_repeat_rule() -> None:
    """Where items repeat, the retrieval gate also records the grocer's baseline (a user's own items by count,
    then the popular ones) and no baseline leaves a user's own items out; where they do not, none lists them."""
    from infra.settings import Settings
    from models.retrieval_train import baseline_lists

    rows = [("a", "milk", 1, True), ("a", "eggs", 2, True), ("a", "milk", 3, True), ("b", "tea", 4, True),
            ("b", "milk", 5, True), ("c", "tea", 6, True), ("a", "milk", 20, True), ("b", "tea", 21, True)]
    groceries = baseline_lists(Settings(), Split.at(rows, cut=10, next_n=5, length=20, repeats=True), k=3)
    assert groceries["own-items"] == {"a": ["milk", "eggs", "tea"], "b": ["tea", "milk", "eggs"]}
    assert "milk" in groceries["popularity"]["a"]
    films = baseline_lists(Settings(), Split.at(rows, cut=10, next_n=5, length=20), k=3)
    assert "own-items" not in films and films["popularity"] == {"a": ["tea"], "b": ["eggs"]}
