"""The simulated world (streaming/world.py, datasets/world): a dataset the platform onboards like any other,
whose users click by a hidden taste and the position an item is shown at, and which changes on schedule. What
the benchmarks and drills that run on it rely on: the same seed is the same world, the order served moves the
clicks, and each change moves exactly what it declares."""

import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from feature_repo.tables import check_tables
from flywheel.cli import main
from infra.dataset import SpecError, load_spec
from infra.settings import REPO_ROOT, load_settings
from streaming.history import history_events
from streaming.world import (
    FILES, WORLD_FILE, Launch, Promotion, Retaste, World, load_world, parse_world, prepare)

BUNDLED = REPO_ROOT / "datasets" / "world"
SMALL = """
[world]
seed = 11
users = 300
items = 400
categories = 6
clusters = 3

[traffic]
candidates = 30
shown = 8

[history]
days = 2
requests = 400

[[changes]]
kind = "launch"
at_s = 60
items = 10
appeal = 2.0
"""


def _world(text: str = SMALL) -> World:
    return World(parse_world(text, Path("world.toml")))


@pytest.fixture(scope="module")
def bundled() -> World:
    return World(load_world(BUNDLED / WORLD_FILE))


@pytest.mark.parametrize("text, message", [
    ("[planet]\nseed = 1", "unknown key 'planet'"),
    ("[world]\nusers = 100\nmoons = 2", "[world]: unknown key 'moons'"),
    ("[world]\nusers = 'many'", "[world].users: expected int, got str 'many'"),
    ("[world]\nseed = true", "[world].seed: expected int, got bool"),
    ("[world]\npurchase_rate = 1.5", "[world].purchase_rate: 1.5 is no share between 0 and 1"),
    ("[world]\ncategories = 1", "[world].categories: 1 is below 2"),
    ("[traffic]\nshown = 50", "expected shown <= candidates <= [world] items, got 50, 40, 2000"),
    ("[history]\nstart = 'Monday'", "[history].start: 'Monday' is no date"),
    ("[[changes]]\nkind = 'flood'\nat_s = 1",
     "[[changes]] 1.kind: 'flood' is none of promotion, rotate, retaste, launch"),
    ("[[changes]]\nkind = 'rotate'\nat_s = -5", "[[changes]] 1.at_s: expected seconds after the traffic starts"),
    ("[[changes]]\nkind = 'promotion'\nat_s = 1", "[[changes]] 1: missing key 'category'"),
    ("[[changes]]\nkind = 'promotion'\nat_s = 1\ncategory = 20", "category: 20 is not one of the 20 categories"),
    ("[[changes]]\nkind = 'rotate'\nat_s = 1\nshare = 2", "share: 2.0 is no share between 0 and 1"),
    ("[[changes]]\nkind = 'rotate'\nat_s = 1\nitems = 3", "[[changes]] 1: unknown key 'items'"),
    ("[[changes]]\nkind = 'launch'\nat_s = 1\nitems = 1990", "1990 launched items leave fewer than [traffic] cand"),
    ("[[changes]]\nkind = ['rotate']\nat_s = 1", "1.kind: ['rotate'] is none of promotion, rotate, retaste, launch"),
    ("[[changes]]\nkind = 'rotate'\nat_s = nan", "1.at_s: expected seconds after the traffic starts"),
    ("[[changes]]\nkind = 'rotate'\nat_s = inf", "1.at_s: expected seconds after the traffic starts"),
    ("[traffic]\nrate = nan", "[traffic].rate: expected a finite number, got nan"),
    ("[world]\nzipf = 300", "[world].zipf: 300.0 is above 5"),
    ("[world]\nclusters = 1\n[[changes]]\nkind = 'rotate'\nat_s = 1", "kind 'rotate' needs [world] clusters >= 2"),
    ("[world]\nclusters = 1\n[[changes]]\nkind = 'retaste'\nat_s = 1", "kind 'retaste' needs [world] clusters >= 2"),
    ("[[changes]]\nkind = 'retaste'\nat_s = 1\nshare = 2", "share: 2.0 is no share between 0 and 1"),
    ("[[changes]]\nkind = 'retaste'\nat_s = 1\nshare = 0", "share: a retaste moves at least two clusters, got 0"),
    ("[world]\nitems = 300\n[traffic]\nshown = 120\ncandidates = 200", "[traffic].shown: 120 is above 100"),
])
def test_a_wrong_world_is_refused_with_its_file_and_key(text: str, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_world(text, Path("/w/world.toml"))
    assert str(refused.value).startswith("/w/world.toml") and message in str(refused.value)


def test_the_same_seed_writes_the_same_world_and_another_seed_another(tmp_path: Path) -> None:
    from streaming.world import write

    a, b = write(_world(), tmp_path / "a"), write(_world(), tmp_path / "b")
    c = write(_world(SMALL.replace("seed = 11", "seed = 12")), tmp_path / "c")
    for f in FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes()
    assert (a / "history.csv").read_bytes() != (c / "history.csv").read_bytes()
    w = _world()
    draws = [[w.react(3, np.arange(8), 0.0, r)[0].tolist() for _ in range(50)]
             for r in (np.random.default_rng(5), np.random.default_rng(5), np.random.default_rng(6))]
    assert draws[0] == draws[1] != draws[2]


def test_the_history_shows_lists_top_down_with_what_was_done_with_them(tmp_path: Path) -> None:
    w = _world()
    history = w.history()
    shown = history[history["event_type"] == "impression"]
    assert len(shown) == 400 * 8 and shown.groupby("request_id")["position"].apply(sorted).map(
        lambda p: p == list(range(8))).all()
    acted = history[history["event_type"] != "impression"]
    pairs = set(zip(shown["request_id"], shown["item_id"], shown["position"]))
    assert len(acted) > 0 and all(p in pairs for p in zip(acted["request_id"], acted["item_id"], acted["position"]))
    bought = set(zip(*[acted.loc[acted["event_type"] == "purchase", c] for c in ("request_id", "item_id")]))
    assert bought <= set(zip(*[acted.loc[acted["event_type"] == "click", c] for c in ("request_id", "item_id")]))
    # the launched items (the catalog's last 10) are in no list before their launch
    assert not set(shown["item_id"]) & set(w.item_ids[-10:]) and history["event_time"].is_monotonic_increasing
    # the former ranker's order is the clicks' order: the top clicked most
    ctr = history[history["event_type"] == "click"]["position"].value_counts().reindex(range(8), fill_value=0)
    assert ctr[0] > ctr[3] > ctr[7]


def test_a_world_beside_a_spec_onboards_like_any_dataset(tmp_path: Path) -> None:
    """The bundled spec with a smaller world.toml of its own: the adapter writes the files the spec names,
    the tables pass the preflight and the history replays, every exposure with its position."""
    root = tmp_path / "mine"
    root.mkdir()
    shutil.copy(BUNDLED / "dataset.toml", root / "dataset.toml")
    (root / WORLD_FILE).write_text(SMALL)
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(root / "dataset.toml"),
                       "FLYWHEEL_PATHS_CACHE_DIR": str(tmp_path / "cache")})
    check_tables(s)
    events = list(history_events(s))
    assert len(events) == len(pd.read_csv(prepare(s) / "history.csv"))
    exposures = [e for e in events if e.event_type == "impression"]
    assert {e.context["position"] for e in exposures} == set(range(8))
    assert all(e.context["category"].startswith("c") for e in events)
    assert load_spec(root / "dataset.toml").position_slots == 10
    # another world is another directory: the cache never serves a world its file no longer says
    first = prepare(s)
    (root / WORLD_FILE).write_text(SMALL.replace("seed = 11", "seed = 13"))
    second = prepare(s)
    assert second != first and (first / "history.csv").read_bytes() != (second / "history.csv").read_bytes()


def test_clicks_fall_with_the_position_and_the_true_order_earns_more(bundled: World) -> None:
    """Position-based clicks: the same item shown at rank p is clicked (1 + p) ** -eta as often as at the top;
    the order served moves the clicks, so a better ranker earns more."""
    top = bundled.click_probability(7, np.array([5]), 0.0)[0]
    fifth = bundled.click_probability(7, np.array([9, 9, 9, 9, 5]), 0.0)[4]
    assert fifth / top == pytest.approx(5 ** -bundled.spec.truth.position_eta)
    rng = np.random.default_rng(1)  # and the clicks drawn follow it
    drawn = np.mean([bundled.react(7, np.array([5, 9, 9, 9, 5]), 0.0, rng)[0][[0, 4]] for _ in range(40_000)], axis=0)
    assert drawn == pytest.approx([top, fifth], rel=0.1)

    def random_order(user: int, items: np.ndarray, t_s: float) -> np.ndarray:
        return np.random.default_rng([user, 9]).random(len(items))

    assert bundled.expected_ctr(bundled.oracle(), 0.0, 400) >= 1.3 * bundled.expected_ctr(random_order, 0.0, 400)


def test_each_change_moves_what_it_declares_and_only_from_its_time(bundled: World) -> None:
    changes = {type(c.what): c for c in bundled.spec.changes}
    retaste, promote, launch = changes[Retaste], changes[Promotion], changes[Launch]
    before, after = bundled.clusters(retaste.at_s - 1), bundled.clusters(retaste.at_s)
    assert (before == bundled.cluster).all()
    assert {len(set(after[before == k])) for k in range(bundled.spec.truth.clusters)} == {1}  # a cluster moves as one
    assert (before != after).all()  # share 1.0: every cluster takes another's tastes
    users, items = np.arange(0, bundled.spec.truth.users, 7), np.flatnonzero(np.isinf(bundled.launch_at))
    promoted = bundled.category[items] == promote.what.category
    for at_s, lifted in ((promote.at_s - 1, False), (promote.at_s, True)):  # the logit as the tastes of then say
        tastes = bundled.affinity[bundled.clusters(at_s)[users][:, None], bundled.category[items][None, :]]
        lift = bundled.logit(users[:, None], items[None, :], at_s) - (
            bundled.spec.truth.base_logit + tastes + bundled.appeal[items])
        assert np.allclose(lift[:, promoted], promote.what.lift if lifted else 0.0)
        assert np.allclose(lift[:, ~promoted], 0.0)
    launched = set(np.flatnonzero(bundled.launch_at == launch.at_s))
    assert len(launched) == launch.what.items
    rng = np.random.default_rng(3)
    assert not any(set(bundled.candidates(rng, launch.at_s - 1)) & launched for _ in range(200))
    per_request = [len(set(bundled.candidates(rng, launch.at_s)) & launched) for _ in range(200)]
    assert set(per_request) == {bundled.spec.traffic.launched_per_request}


def test_a_retaste_moves_a_share_of_clusters_in_a_cycle_from_where_their_users_are_then() -> None:
    w = _world(SMALL.replace("clusters = 3", "clusters = 6") + "[[changes]]\nkind = 'rotate'\nat_s = 10\nshare = 0.3\n"
               "[[changes]]\nkind = 'retaste'\nat_s = 20\nshare = 0.5\n")
    then, after = w.clusters(19), w.clusters(20)
    moved = sorted({int(k) for k in then[then != after]})
    assert len(moved) == 3  # half of the 6 clusters
    mapping = {int(k): int(after[then == k][0]) for k in moved}
    assert all(len(set(after[then == k])) == 1 for k in moved)  # the rotated users move with their cluster of then
    cycle = [moved[0]]
    while mapping[cycle[-1]] != moved[0]:
        cycle.append(mapping[cycle[-1]])
    assert sorted(cycle) == moved  # one cycle through all of them: each takes the next one's tastes
    assert (then[then != after] != w.cluster[then != after]).any()  # some of them had rotated before


def test_a_segment_that_learns_its_new_tastes_wins_back_what_a_frozen_one_loses(bundled: World) -> None:
    """What `make bench-drift` relies on: the season's turn is a change of what each declared segment likes, so a
    ranker that relearns it from the segment's clicks (its users seen together, not one by one) earns a fifth more
    than one that keeps the segments' old tastes (the items' appeal known to both)."""
    truth, at = bundled.spec.truth, max(c.at_s for c in bundled.spec.changes)

    def segment_tastes(t_s: float) -> np.ndarray:
        clusters = bundled.clusters(t_s)
        return np.array([bundled.affinity[clusters[bundled.segment == k]].mean(0) for k in range(truth.clusters)])

    def by_segment(tastes: np.ndarray) -> Callable[[int, np.ndarray, float], np.ndarray]:
        # the order by the user's segment's tastes and each item's appeal of the moment
        return lambda user, items, t_s: (tastes[bundled.segment[user], bundled.category[items]]
                                         + np.where(bundled.launch_at[items] <= t_s, bundled.appeal[items], 0.0))

    relearnt, frozen = (bundled.expected_ctr(by_segment(segment_tastes(t)), at, 800) for t in (at, at - 1))
    assert relearnt >= 1.15 * frozen


def test_rotations_move_each_user_from_the_taste_they_have_then() -> None:
    w = _world(SMALL + "[[changes]]\nkind = 'rotate'\nat_s = 10\nshare = 1.0\n"
                       "[[changes]]\nkind = 'rotate'\nat_s = 20\nshare = 1.0\n")
    first, second, third = w.clusters(0), w.clusters(10), w.clusters(20)
    assert (first != second).all() and (second != third).all()
    segments = np.array([int(s[1:]) for s in w.users_table()["segment"]])
    assert segments.max() < 3 and 0.5 < (segments == w.cluster).mean() < 0.7  # segment_accuracy 0.6


def test_the_shift_leaves_room_that_only_learning_takes(bundled: World) -> None:
    """After the changes the order the world had before them (a model that never learns again, at best) earns
    far less than the order of the moment: the room the learning arm of an experiment has to win."""
    at = max(c.at_s for c in bundled.spec.changes)
    fresh = bundled.expected_ctr(bundled.oracle(), at, 600)
    stale = bundled.expected_ctr(bundled.oracle(at - 1), at, 600)
    assert fresh >= 1.25 * stale


def test_the_cli_sizes_a_world_and_refuses_a_dataset_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.settings import get_settings

    for name in ("FLYWHEEL_DATASET_SPEC", "FLYWHEEL_PATHS_DATA_DIR"):  # --dataset sets them for the process
        monkeypatch.setenv(name, "set so that the teardown restores its absence")
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLYWHEEL_CONFIG", "/dev/null")
    get_settings.cache_clear()
    try:
        sized = CliRunner().invoke(main, ["world", "--dataset", "world", "--requests", "200"])
        assert sized.exit_code == 0, sized.output
        assert "4,000 users, 2,000 items" in sized.output
        assert "change at 600 s: promotion of category c03" in sized.output
        assert "as before" in sized.output.splitlines()[-2]
        monkeypatch.delenv("FLYWHEEL_PATHS_DATA_DIR")
        none = CliRunner().invoke(main, ["world", "--dataset", "movielens"])
        assert none.exit_code != 0 and "no world.toml beside it" in none.output
    finally:
        get_settings.cache_clear()


def test_the_traffic_asks_for_the_worlds_lists_and_sends_what_its_users_do_with_them_as_shown() -> None:
    """As a client: /rank of the world's candidates showing the best `shown` (a /recommend now and then), and for an
    answer an exposure of each item it shows in the order served, each with its position, then the users' clicks
    and purchases, as often as the world says for those positions, all under the request's id."""
    from flywheel.world_traffic import WorldTraffic
    from serving.client import Served
    from streaming.events import Event

    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(BUNDLED / "dataset.toml")})
    w = World(load_world(BUNDLED / WORLD_FILE))
    traffic = WorldTraffic(s, w, "http://127.0.0.1:1")
    asked = list(itertools.islice(traffic.requests(), 200))
    ranked = [r for r in asked if "candidates" in r]
    assert len(asked) - len(ranked) == 20 and all(r["k"] == 10 for r in asked if "candidates" not in r)
    assert {len(r["candidates"]) for r in ranked} == {40} and {r["top_k"] for r in ranked} == {10}
    number = {item: n for n, item in enumerate(w.item_ids)}
    assert all(c["category"] == f"c{w.category[number[c['item_id']]]:02d}" for r in ranked for c in r["candidates"])
    assert not any(w.launch_at[number[c["item_id"]]] > 0 for r in ranked for c in r["candidates"])  # not launched yet
    traffic.started -= max(c.at_s for c in w.spec.changes) + 40  # past the launch: the launched items are candidates
    later = [r for r in itertools.islice(traffic.requests(), 30) if "candidates" in r]
    assert all(sum(w.launch_at[number[c["item_id"]]] > 0 for c in r["candidates"]) == 3 for r in later)

    sent: list[Event] = []
    expected = np.zeros(10)
    for n, request in enumerate(ranked * 10):
        top = list(np.random.default_rng(n).permutation(40)[:10])
        served = Served(request, 0.0, 0.01, 200, {"model_version": "4", "scores": [0.5] * 40, "top": top})
        events = traffic.shown_events(served, 0.0, 1_000_000 + n)
        shown = [request["candidates"][i]["item_id"] for i in top]
        exposures = [e for e in events if e.event_type == "impression"]
        assert [e.item_id for e in exposures] == shown and [e.context["position"] for e in exposures] == list(range(10))
        clicks = {e.item_id for e in events if e.event_type == "click"}
        assert {e.item_id for e in events if e.event_type == "purchase"} <= clicks <= set(shown)
        assert {e.request_id for e in events} == {request["request_id"]} and {e.user_id for e in events} == {
            request["user_id"]}
        assert all(e.context["served_by"] == "4" and e.context["category"] == c["category"] for e in events
                   for c in request["candidates"] if c["item_id"] == e.item_id)
        expected += w.click_probability(int(request["user_id"][1:]), np.array([number[i] for i in shown]), 0.0)
        sent += events
    clicked = np.zeros(10)
    for e in sent:
        if e.event_type == "click":
            clicked[e.context["position"]] += 1
    # position bias as the world says: the clicks per position within 4 standard deviations of its expectation
    assert np.all(np.abs(clicked - expected) < 4 * np.sqrt(expected)), (clicked, expected)
    assert clicked[0] > 1.5 * clicked[9]
    recommended = Served({"user_id": "u00007", "request_id": "r", "k": 10}, 0.0, 0.01, 200,
                         {"items": [{"item_id": "i00003"}, {"item_id": "i00001"}], "model_versions": {"ranker": "4"}})
    assert [e.item_id for e in traffic.shown_events(recommended, 0.0, 5) if e.event_type == "impression"] == [
        "i00003", "i00001"]
