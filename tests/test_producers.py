"""The MovieLens replay and the synthetic generator: what they emit, and through the CLI, what lands."""

import json
import math
from collections import Counter
from datetime import UTC, datetime

import pytest

from streaming.live import Live, Session, served_events
from infra.settings import Settings, load_settings
from streaming.movielens import Rating, dataset_dir, load_ratings, rating_events, replay_events, sessions
from streaming.produce import count_landed, event_time_pace, fixed_rate_pace
from streaming.synthetic import SyntheticConfig, SyntheticGenerator
from streaming.topics import end_offsets, prepare_pipeline, read_range
from tests.conftest import broker_environ, run_cli, stack_environ


@pytest.fixture(scope="module")
def ratings() -> list[Rating]:
    return load_ratings(dataset_dir(load_settings()) / "ml-100k.inter")


def test_movielens_100k_is_read_whole_and_in_event_time_order(ratings: list[Rating]) -> None:
    assert len(ratings) == 100_000
    assert len({r.user_id for r in ratings}) == 943
    assert len({r.item_id for r in ratings}) == 1682
    times = [r.timestamp for r in ratings]
    assert times == sorted(times)


def test_a_rating_of_four_or_more_is_an_impression_and_a_click_on_it() -> None:
    liked = rating_events(Rating("7", "9", 4.0, 880_000_000), click_min_rating=4)
    seen = rating_events(Rating("7", "10", 3.0, 880_000_000), click_min_rating=4)
    assert [e.event_type for e in liked] == ["impression", "click"]
    assert liked[0].request_id == liked[1].request_id
    assert (liked[0].event_time, liked[1].event_time) == (880_000_000_000, 880_000_000_001)  # click after
    assert [e.event_type for e in seen] == ["impression"]
    # stable ids: a second replay produces the same event ids, so consumers can deduplicate
    assert [e.event_id for e in liked] == [e.event_id for e in rating_events(Rating("7", "9", 4.0, 880_000_000), 4)]


def test_the_replay_emits_one_impression_per_rating_and_a_click_per_liked_one(ratings: list[Rating]) -> None:
    events = list(replay_events(load_settings()))
    counts = Counter(e.event_type for e in events)
    assert counts["impression"] == 100_000
    assert counts["click"] == sum(r.rating >= 4 for r in ratings)
    toy_story = next(e for e in events if e.item_id == "1")
    assert toy_story.context["category"] == "Animation"  # the item's first genre


def test_live_sessions_cut_at_gaps_and_size_and_their_served_lists_become_events(ratings: list[Rating]) -> None:
    rs = [Rating("1", "a", 5.0, 0), Rating("2", "x", 1.0, 10), Rating("1", "b", 2.0, 60), Rating("1", "c", 4.0, 4000)]
    cut = sessions(rs, gap_s=1800)
    assert [(x.user_id, [r.item_id for r in x.ratings]) for x in cut] == [("1", ["a", "b"]), ("2", ["x"]), ("1", ["c"])]
    assert all(len(x.ratings) <= 50 for x in sessions(ratings))
    assert sum(len(x.ratings) for x in sessions(ratings)) == len(ratings)
    sess = Session("1", "0", ("a", "b"), {"a": "click"})
    request_id = sess.request_id(1_000)
    events = served_events(load_settings().spec, {"a": "Drama"}, sess, request_id, ["b", "a"], 1_000, served_by="3")
    assert [(e.item_id, e.event_type, e.event_time) for e in events] == [
        ("b", "impression", 1_000), ("a", "impression", 1_000), ("a", "click", 1_001)]
    assert {e.request_id for e in events} == {request_id} and request_id != sess.request_id(2_000)
    assert events[1].context == {"position": 1, "served_by": "3", "category": "Drama"}


def test_the_demo_serves_the_sessions_after_the_split_and_clicks_what_the_user_rated_highly(
        ratings: list[Rating]) -> None:
    s = load_settings()
    split = datetime(1998, 3, 1, tzinfo=UTC)
    later = [r for r in ratings if r.timestamp >= split.timestamp()]
    live = Live(s, split)
    assert len(live.sessions) == len(sessions(later))
    cut, first = sessions(later)[0], live.sessions[0]
    assert first.user_id == cut.user_id and first.candidates == tuple(dict.fromkeys(r.item_id for r in cut.ratings))
    assert first.actions == {r.item_id: "click" for r in cut.ratings if r.rating >= s.movielens.click_min_rating}
    judged = live.judged[cut.user_id]  # a /recommend list: everything the user rates later
    assert set(judged.candidates) == {r.item_id for r in later if r.user_id == cut.user_id}
    assert live.keys["1"] == "Animation"


def test_pacing_follows_event_time_or_a_fixed_rate() -> None:
    events = list(replay_events(load_settings(), limit=50))
    pace = event_time_pace(speed=3600.0)
    offsets = [pace(i, e) for i, e in enumerate(events)]
    assert offsets[0] == 0.0
    assert offsets[-1] == pytest.approx((events[-1].event_time - events[0].event_time) / 1000 / 3600)
    assert fixed_rate_pace(200.0)(100, events[0]) == pytest.approx(0.5)
    assert event_time_pace(0) is None and fixed_rate_pace(0) is None


def test_the_synthetic_stream_has_a_learnable_click_signal() -> None:
    gen = SyntheticGenerator(SyntheticConfig(seed=3))
    stream = gen.events(now_ms=lambda: 1_700_000_000_000)
    events = [next(stream) for _ in range(60_000)]
    shown = Counter()
    clicked = Counter()
    for e in events:
        user, item = int(e.user_id[1:]), int(e.item_id[1:])
        if e.event_type == "impression":
            shown[gen.affinity(user, item)] += 1
        elif e.event_type == "click":
            clicked[gen.affinity(user, item)] += 1
    ctr_preferred, ctr_other = clicked[1.0] / shown[1.0], clicked[-1.0] / shown[-1.0]
    assert ctr_preferred > 3 * ctr_other
    c = gen.config
    assert ctr_preferred == pytest.approx(1 / (1 + math.exp(-(c.base_logit + c.affinity_weight))), rel=0.15)
    assert ctr_other == pytest.approx(1 / (1 + math.exp(-(c.base_logit - c.affinity_weight))), rel=0.15)
    # Zipf popularity: the top 1 % of items get a large share of impressions
    per_item = Counter(e.item_id for e in events if e.event_type == "impression")
    top = sum(n for _, n in per_item.most_common(gen.config.items // 100))
    assert top / sum(per_item.values()) > 0.3
    # every click refers to an impression of the same request shown before it
    impressions = set()
    for e in events:
        if e.event_type == "impression":
            impressions.add((e.request_id, e.item_id))
        elif e.event_type == "click":
            assert (e.request_id, e.item_id) in impressions
    # the same content per seed, but new ids: a second run is new traffic, not a duplicate
    again = SyntheticGenerator(SyntheticConfig(seed=3)).events(now_ms=lambda: 1_700_000_000_000)
    rerun = [next(again) for _ in range(100)]
    content = lambda e: (e.user_id, e.item_id, e.event_type, e.context)  # noqa: E731
    assert [content(e) for e in rerun] == [content(e) for e in events[:100]]
    assert not {e.event_id for e in rerun} & {e.event_id for e in events}


@pytest.mark.stack
def test_replay_and_generate_through_the_cli_land_in_kafka(broker: Settings, tmp_path) -> None:
    environ = stack_environ(tmp_path, **broker_environ(broker), FLYWHEEL_KAFKA_EVENTS_TOPIC="cli-events",
                            FLYWHEEL_STACK_SERVICES="kafka")
    prepare_pipeline(load_settings(environ))  # as `up` does: the topics, and the roles' ACLs on them
    done = run_cli(environ, "replay", "--limit", "2000")
    assert done.returncode == 0, done.stderr
    assert "replayed movielens-100k: " in done.stdout and "'impression': 2000" in done.stdout
    s = load_settings(environ)
    after_replay = end_offsets(s, "cli-events")
    landed = count_landed(s, "cli-events", {}, after_replay)
    expected = Counter(e.event_type for e in replay_events(s, limit=2000))
    assert landed == expected

    done = run_cli(environ, "generate", "--limit", "3000", "--rate", "0")
    assert done.returncode == 0, done.stderr
    landed = count_landed(s, "cli-events", after_replay, end_offsets(s, "cli-events"))
    assert sum(landed.values()) == 3000 and landed["impression"] > landed["click"] > 0

    counted = run_cli(environ, "count")
    assert f"cli-events: {sum(expected.values()) + 3000} records" in counted.stdout


@pytest.mark.stack
def test_a_shops_history_file_replays_through_its_spec_and_a_wrong_one_sends_nothing(broker: Settings,
                                                                                    tmp_path) -> None:
    from tests.test_dataset_spec import SHOP

    (tmp_path / "shop.toml").write_text(SHOP.replace("[tables.item]", """[events.history]
source = "history.csv"
user = "customer"
item = "sku"
type = "action"
time = "at"
time_unit = "s"
request = "visit"
context = ["category"]

[tables.item]"""))
    (tmp_path / "history.csv").write_text("customer,sku,action,at,visit,category\n"
                                          "c1,A1,view,1700000060,v1,shoes\nc1,A1,order,1700000090,v1,shoes\n"
                                          "c2,007,view,1700000000,v2,\n")
    environ = stack_environ(tmp_path, **broker_environ(broker), FLYWHEEL_KAFKA_EVENTS_TOPIC="shop-events",
                            FLYWHEEL_STACK_SERVICES="kafka", FLYWHEEL_DATASET_SPEC=str(tmp_path / "shop.toml"))
    prepare_pipeline(load_settings(environ))
    done = run_cli(environ, "replay")
    assert done.returncode == 0, done.stderr
    s = load_settings(environ)
    records = [json.loads(r.value) for r in read_range(s, "shop-events", {}, end_offsets(s, "shop-events"))]
    assert sorted((r["user_id"], r["item_id"], r["event_type"], r["event_time"], r["request_id"], r["context"])
                  for r in records) == [
        ("c1", "A1", "order", 1_700_000_090_000, "v1", {"category": "shoes"}),
        ("c1", "A1", "view", 1_700_000_060_000, "v1", {"category": "shoes"}),
        ("c2", "007", "view", 1_700_000_000_000, "v2", {})]  # an id that looks like a number stays text

    (tmp_path / "history.csv").write_text("customer,sku,action,at,visit,category\n"
                                          "c3,A1,view,1700000000,v3,shoes\nc3,A1,click,1700000001,v3,shoes\n")
    done = run_cli(environ, "replay")
    assert done.returncode != 0
    assert "history.csv row 2: unknown event_type 'click' (declared: view, cart, order)" in done.stderr
    assert sum(end_offsets(s, "shop-events").values()) == len(records)  # nothing of the wrong file was sent
