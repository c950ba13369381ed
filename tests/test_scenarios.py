"""Scenarios (surfaces) without a stack: each declared one is a ranker of its own, named once in the dataset spec,
trained on the exposures whose context names it; an undeclared one is refused naming the declared ones. The
served side (one server, a champion per scenario, a rollback of one leaving the others) is in test_serving.py;
training by the DAG on each scenario's own traffic in test_dags.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from infra.dataset import SCENARIO_FIELD, SpecError, parse_spec
from infra.settings import RANKER, RegisteredModel, SettingsError, load_settings
from tests.test_dataset_spec import SHOP, shop

SCENARIOS = """
[scenarios.home]
description = "the home page's recommendations"

[scenarios.search]
model = "shop-search-ranker"
"""


def _settings(tmp_path: Path, text: str = SHOP + SCENARIOS, **environ: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                          "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")} | environ)


def test_each_declared_scenario_is_a_ranker_of_its_own_and_an_undeclared_one_is_refused(tmp_path: Path) -> None:
    s = _settings(tmp_path, FLYWHEEL_MODELS_NAME="shop-ranker")
    home, search = s.scenarios["home"], s.scenarios["search"]
    assert home == RegisteredModel("shop-ranker-home", s.models.experiment, RANKER, "home")  # named after the ranker
    assert search == RegisteredModel("shop-search-ranker", s.models.experiment, RANKER, "search")  # or by the spec
    assert s.rankers == (s.ranker, home, search) and s.ranker.scenario is None
    assert s.registered_models == (s.ranker, home, search, s.retriever)
    assert s.scenario_model(None) == s.scenario_model("") == s.ranker
    assert s.scenario_model("home") == s.registered_model("shop-ranker-home") == home
    with pytest.raises(SettingsError, match="unknown scenario 'cart': the dataset spec .* declares 'home', 'search'"):
        s.scenario_model("cart")
    # What a command or a DAG run names: a scenario wins over the platform's ranker's name (a DAG's default) ...
    assert s.model_for("shop-ranker", "home") == s.model_for(None, "home") == home
    assert s.model_for("trial", None) == RegisteredModel("trial", s.models.experiment, RANKER)
    with pytest.raises(SettingsError, match="scenario 'home' .* and model 'shop-search-ranker' both named"):
        s.model_for("shop-search-ranker", "home")  # ... but not over another model's
    # Without scenarios, the platform's ranker alone: today's requests and models, unchanged.
    plain = _settings(tmp_path / "plain", SHOP)
    assert plain.rankers == (plain.ranker,) and plain.scenarios == {}
    with pytest.raises(SettingsError, match="declares none"):
        plain.scenario_model("home")
    # A scenario's model may not be another's, nor the platform's.
    clash = _settings(tmp_path / "clash", SHOP + SCENARIOS, FLYWHEEL_MODELS_NAME="shop-search-ranker")
    with pytest.raises(SettingsError, match="'shop-search-ranker' is declared twice"):
        clash.registered_models


@pytest.mark.parametrize("table, message", [
    ('[scenarios."home page"]\n', r"\[scenarios\]: expected a scenario name .* got 'home page'"),
    ("[scenarios.home]\nranker = 'x'\n", r"\[scenarios\].home: unknown key 'ranker' \(expected: model, description, "
                                        r"canary, serving\)"),
    ("[scenarios.home]\ncanary = 5\n", r"\[scenarios\].home.canary: expected dict, got int 5"),
    ("[scenarios.a]\nmodel = 'm'\n[scenarios.b]\nmodel = 'm'\n", r"the model 'm' is named by two scenarios"),
    ("[scenarios.home]\nmodel = 'my model'\n", r"\[scenarios\].home.model: expected a registered model name"),
])
def test_a_wrong_scenario_is_refused_with_the_file_and_the_key(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(SHOP + table, shop(tmp_path))


def test_a_scenario_canaries_and_splits_its_traffic_under_its_own_settings(tmp_path: Path) -> None:
    """`[scenarios.<name>.canary]` and `[scenarios.<name>.serving]` over the platform's settings, for its ranker
    alone: how its new champions ramp, whether they are canaried at all, its experiment's splits."""
    own = ('\n[scenarios.search.canary]\nramp_percent = [10, 50]\nmargin = 0.02\n'
           '\n[scenarios.search.serving]\ncanary_percent = 5\nshadow_percent = 20\n')
    s = _settings(tmp_path, SHOP + SCENARIOS + own, FLYWHEEL_CANARY_MIN_REQUESTS="30")
    search = s.for_model(s.scenarios["search"])
    assert (search.canary.ramp_percent, search.canary.margin, search.canary.min_requests) == ((10.0, 50.0), 0.02, 30)
    assert (search.serving.canary_percent, search.serving.shadow_percent) == (5.0, 20.0)
    for other in (s.ranker, s.scenarios["home"], s.retriever):  # the others keep the platform's
        assert s.for_model(other) == s and s.canary.ramp_percent == (50.0,) and s.serving.canary_percent == 0.0
    wrong = {"[scenarios.search.canary]\ninterval_s = 1\n": r"may set enabled, .*, not interval_s",
             "[scenarios.search.serving]\nmax_candidates = 9\n": r"canary_percent, shadow_percent, not max_candidates",
             "[scenarios.search.canary]\nmargin = 'wide'\n": r"\[scenarios.search.canary\] margin: cannot read 'wide'"}
    for i, (table, message) in enumerate(wrong.items()):
        with pytest.raises(SettingsError, match=message):  # refused when the settings load, not at first use
            _settings(tmp_path / f"bad{i}", SHOP + SCENARIOS + "\n" + table)


def test_a_scenarios_training_set_holds_its_own_exposures_alone(tmp_path: Path) -> None:
    """The labelled impressions of a scenario are those whose context names it (its clicks label them as any
    other's); without a scenario, every exposure, whatever it names."""
    from feature_repo.event_log import write_batch
    from models.dataset import Window, labelled_impressions
    from streaming.consumer import Consumed
    from streaming.events import Event

    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nB2,zeta,250,\n")
    s = _settings(tmp_path)
    t = 1_700_000_000_000
    surfaces = ["home", "search", None, "home", "elsewhere"]
    events = [Event(event_id=f"{kind}-{n}", user_id=f"u{n}", item_id="A1", event_type=kind, request_id=f"r{n}",
                    event_time=t + 10 * n + (kind == "order"),
                    context={"brand": "acme"} | ({SCENARIO_FIELD: surface} if surface else {}))
              for n, surface in enumerate(surfaces) for kind in ("view", "order")[: 1 + n % 2]]
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    window = Window(datetime.fromtimestamp(t / 1000, UTC), datetime.fromtimestamp(t / 1000 + 1, UTC))
    home = labelled_impressions(s, window, "home")
    assert list(home["request_id"]) == ["r0", "r3"] and list(home["label"]) == [0.0, 1.0]
    assert list(labelled_impressions(s, window, "search")["request_id"]) == ["r1"]
    assert list(labelled_impressions(s, window)["request_id"]) == [f"r{n}" for n in range(len(surfaces))]
