"""The MLflow registry against a real MLflow server: register, the promotion gate (promote, refuse a
worse model), rollback, `models:/<name>@champion` scoring like the in-memory model, and bad input
that never moves @champion."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import keras
import mlflow
import numpy as np
import pytest
from click.testing import CliRunner

from contract.examples import to_frame
from flywheel.cli import main
from infra.settings import Settings, get_settings, to_environ
from models.ctr import CtrModel
from models.dataset import Window
from models.registry import (
    CHALLENGER, CHAMPION, CONTROL, HOLDOUT, RAMPED, RegistryError, Routing, alias_version, connect, experiment,
    floor_version, gate, log_model, rollback, routing, start_canary, start_experiment, stop_experiment)
from models.train import train_full
from tests.conftest import running_stack
from tests.ctr_data import SPEC, synthetic, with_buys

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    yield from running_stack(tmp_path_factory.mktemp("mlflow"), "mlflow")


def register(s: Settings, model: CtrModel, tmp: Path, label: str) -> str:
    connect(s)
    mlflow.set_experiment(s.models.experiment)
    with mlflow.start_run(run_name=label):
        return log_model(s, model.save(tmp / label), {"kind": "ranker", "data_start": "", "data_end": ""})


def champion(s: Settings) -> str | None:
    return alias_version(connect(s), s.models.name, CHAMPION)


def test_gate_promotes_refuses_and_rollback_restores(registry: Settings, tmp_path: Path) -> None:
    s = registry
    keras.utils.set_random_seed(3)
    data = synthetic(8000, seed=5)
    train, evaluation = data.take(slice(0, 6000)), data.take(slice(6000, None))

    good = CtrModel(SPEC)
    good.fit(train, epochs=2, progress=False)
    v1 = register(s, good, tmp_path, "good")
    first = gate(s, v1, good, evaluation, "synthetic evaluation")
    assert first.promoted and "first champion" in first.reason and champion(s) == v1

    # Deliberately worse: trained on shuffled labels.
    worse = CtrModel(SPEC)
    worse.fit(replace(train, labels=np.random.default_rng(0).permutation(train.labels)), progress=False)
    v2 = register(s, worse, tmp_path, "worse")
    refused = gate(s, v2, worse, evaluation, "synthetic evaluation")
    assert not refused.promoted and refused.score < refused.champion_score and refused.guardrail == "auc"
    assert champion(s) == v1 and alias_version(connect(s), s.models.name, CHALLENGER) == v2
    tags = connect(s).get_model_version(s.models.name, v2).tags
    assert tags["gate_decision"] == "refused" and f"champion v{v1}" in tags["gate_reason"]

    # Better (trained longer on the same data): promoted; then rolled back to v1.
    better = CtrModel.load(tmp_path / "good")
    better.fit(train, epochs=1, progress=False)
    v3 = register(s, better, tmp_path, "better")
    promoted = gate(s, v3, better, evaluation, "synthetic evaluation")
    # Whatever the sign of its small difference, it is not significantly worse: promoted.
    assert promoted.promoted and "DeLong" in promoted.reason, promoted.reason
    assert champion(s) == v3
    # ... in a canary: the champion it replaced serves the users outside the first share (serving/canary.py).
    assert routing(connect(s), s.models.name) == Routing({CHAMPION: v3, CHALLENGER: v2, CONTROL: v1},
                                                         s.canary.ramp_percent[0], v3)
    assert "canary_started_at" in connect(s).get_model_version(s.models.name, v3).tags
    started = time.monotonic()
    assert rollback(s, why="bad canary", who="tester") == (v3, v1)
    assert time.monotonic() - started < 5  # rollback is an alias move: seconds, not a redeploy
    assert champion(s) == v1
    assert routing(connect(s), s.models.name) == Routing({CHAMPION: v1, CHALLENGER: v2})  # the canary is over
    tags = connect(s).get_model_version(s.models.name, v3).tags
    assert (tags["rolled_back_to"], tags["rolled_back_by"], tags["rolled_back_reason"]) == (v1, "tester", "bad canary")


def test_the_gate_never_promotes_below_the_floor_whatever_the_champion_is(registry: Settings, tmp_path: Path) -> None:
    """A champion that should never have served (noise, moved there by a ramp or a hand) is no bar: a version
    better than it but worse than the floor, the first champion or the last version that passed a canary, is
    refused, and the reason names the floor."""
    s = replace(registry, models=replace(registry.models, name="floor"))
    keras.utils.set_random_seed(3)
    data = synthetic(8000, seed=5)  # the data and seed the first test's good version learns from (AUC ~0.7)
    train, evaluation = data.take(slice(0, 6000)), data.take(slice(6000, None))
    good = CtrModel(SPEC)
    good.fit(train, epochs=2, progress=False)
    v1 = register(s, good, tmp_path, "good")
    assert gate(s, v1, good, evaluation, "synthetic evaluation").promoted and floor_version(connect(s), s.models.name) == v1

    def noise(seed: int) -> CtrModel:  # trained on shuffled labels: calibrated, ranks at chance
        model = CtrModel(SPEC)
        model.fit(replace(train, labels=np.random.default_rng(seed).permutation(train.labels)), progress=False)
        return model

    v2 = register(s, noise(1), tmp_path, "noise-champion")
    connect(s).set_registered_model_alias(s.models.name, CHAMPION, v2)
    candidate = noise(2)
    v3 = register(s, candidate, tmp_path, "noise-candidate")
    refused = gate(s, v3, candidate, evaluation, "synthetic evaluation")
    assert not refused.promoted and refused.guardrail == "floor" and f"floor v{v1}" in refused.reason, refused.reason
    assert "not shown worse" in refused.reason  # than the champion it would have replaced
    assert champion(s) == v2 and connect(s).get_model_version(s.models.name, v3).tags["gate_guardrail"] == "floor"
    # The floor moves to the newest version that passed a canary.
    connect(s).set_model_version_tag(s.models.name, v2, "canary_decision", f"{RAMPED}: shown not worse")
    assert floor_version(connect(s), s.models.name) == v2


def test_a_version_predicting_a_further_objective_worse_is_refused_naming_it(registry: Settings,
                                                                            tmp_path: Path) -> None:
    """Two objectives, a buy over the clicks: a version whose buys were joined on the wrong key (each click's buy
    another click's) predicts clicks as well as the champion and buys worse: refused by the objective guardrail, the reason
    naming the buy; an honest one (trained on) is promoted."""
    s = replace(registry, models=replace(registry.models, name="objectives"))
    keras.utils.set_random_seed(3)
    data = with_buys(synthetic(16_000, seed=6, long_history=True), seed=6)
    train, evaluation = data.take(slice(0, 10_000)), data.take(slice(10_000, None))
    spec = replace(SPEC, objectives=(("click", ""), ("buy", "click")))
    good = CtrModel(spec)
    good.fit(train, epochs=2, progress=False)
    v1 = register(s, good, tmp_path, "good")
    assert gate(s, v1, good, evaluation, "synthetic evaluation").promoted

    buys = train.objectives.copy()  # each click's buy shuffled among the clicks (joined on the wrong key)
    clicked = np.flatnonzero(buys[:, 0] > 0)
    buys[clicked, 1] = np.random.default_rng(0).permutation(buys[clicked, 1])
    keras.utils.set_random_seed(3)
    wrong = CtrModel(spec)
    wrong.fit(replace(train, objectives=buys), epochs=2, progress=False)
    v2 = register(s, wrong, tmp_path, "wrong-buys")
    refused = gate(s, v2, wrong, evaluation, "synthetic evaluation")
    print(f"buys joined on the wrong key: {refused.reason}")
    assert not refused.promoted and refused.guardrail == "objective" and "buy: AUC" in refused.reason, refused.reason
    assert champion(s) == v1 and connect(s).get_model_version(s.models.name, v2).tags["gate_guardrail"] == "objective"

    honest = CtrModel.load(tmp_path / "good")
    honest.fit(train, epochs=1, progress=False)
    v3 = register(s, honest, tmp_path, "honest")
    promoted = gate(s, v3, honest, evaluation, "synthetic evaluation")
    assert promoted.promoted and "buy: AUC" in promoted.reason, promoted.reason


def test_too_little_evidence_or_a_miscalibrated_version_is_refused_naming_the_guardrail(registry: Settings,
                                                                                       tmp_path: Path) -> None:
    s = replace(registry, models=replace(registry.models, name="guardrails"))
    data = synthetic(6000, seed=13)
    train, evaluation = data.take(slice(0, 4000)), data.take(slice(4000, None))
    model = CtrModel(SPEC)
    model.fit(train, progress=False)
    first = register(s, model, tmp_path, "first")
    assert gate(s, first, model, evaluation, "synthetic evaluation").promoted

    # Load-test traffic whose clicks did not join: 2,000 impressions, 2 clicks. The champion itself
    # would score a near-perfect AUC there; no version is promoted on it.
    labels = np.zeros(len(evaluation), np.float32)
    labels[[100, 1500]] = 1.0
    same = register(s, model, tmp_path, "same")
    thin = gate(s, same, model, replace(evaluation, labels=labels), "two clicks")
    assert not thin.promoted and thin.guardrail == "evidence" and "2000 examples with 2 clicks" in thin.reason
    assert connect(s).get_model_version(s.models.name, same).tags["gate_guardrail"] == "evidence"

    # Trained on labels mostly set to 1: it predicts a CTR several times the observed one.
    inflated = replace(train, labels=np.where(np.random.default_rng(1).random(len(train)) < 0.9, 1.0,
                                              train.labels).astype(np.float32))
    biased = CtrModel(SPEC)
    biased.fit(inflated, progress=False)
    overconfident = register(s, biased, tmp_path, "overconfident")
    refused = gate(s, overconfident, biased, evaluation, "synthetic evaluation")
    assert not refused.promoted and refused.guardrail == "calibration", refused.reason
    assert champion(s) == first


def test_champion_from_the_registry_scores_like_the_in_memory_model(registry: Settings, tmp_path: Path) -> None:
    s = replace(registry, models=replace(registry.models, name="scoring-check"))
    # The first test's data and seed (AUC ~0.7): a version at chance may be refused by the gate's floor.
    keras.utils.set_random_seed(3)
    data = synthetic(8000, seed=5)
    model = CtrModel(SPEC)
    model.fit(data.take(slice(0, 6000)), epochs=2, progress=False)
    test = data.take(slice(6000, None))
    version = register(s, model, tmp_path, "scoring")
    assert gate(s, version, model, test, "synthetic evaluation").promoted
    loaded = mlflow.pyfunc.load_model(f"models:/{s.models.name}@champion")
    scores = loaded.predict(to_frame(test, SPEC.numeric_features))
    assert np.array_equal(np.asarray(scores), model.predict(test))


def test_bad_input_never_moves_the_champion(registry: Settings, tmp_path: Path) -> None:
    s = registry
    data = synthetic(2000, seed=11)
    model = CtrModel(SPEC)
    model.fit(data.take(slice(0, 1500)), progress=False)
    before = champion(s)
    version = register(s, model, tmp_path, "no-positives")
    no_clicks = replace(data.take(slice(1500, None)), labels=np.zeros(500, np.float32))
    with pytest.raises(ValueError, match="clicks and non-clicks"):
        gate(s, version, model, no_clicks, "a window without clicks")
    # An empty data window (no event log here) is refused before training.
    with pytest.raises(ValueError, match="no impressions"):
        train_full(s, Window(datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 2, 1, tzinfo=UTC)), progress=False)
    assert champion(s) == before


def test_unreachable_mlflow_is_a_clear_error(registry: Settings) -> None:
    s = replace(registry, mlflow=replace(registry.mlflow, tracking_uri="http://127.0.0.1:9"))
    started = time.monotonic()
    with pytest.raises(RegistryError, match="127.0.0.1:9 is unreachable"):
        train_full(s, Window(datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 2, 1, tzinfo=UTC)), progress=False)
    with pytest.raises(RegistryError, match="unreachable"):
        rollback(s, why="x")
    assert time.monotonic() - started < 30


def test_the_registry_refuses_writes_without_credentials(registry: Settings) -> None:
    """@champion decides what every user is served: moving it, or registering a model, takes the
    credentials; a wrong password is named as such, not as an unreachable server."""
    s, url = registry, registry.mlflow.tracking_uri
    connect(s).create_registered_model("guarded")
    anonymous = {"create": ("registered-models/create", {"name": "intruder"}),
                 "alias": ("registered-models/alias", {"name": "guarded", "alias": CHAMPION, "version": "1"})}
    for path, body in anonymous.values():
        assert httpx.post(f"{url}/api/2.0/mlflow/{path}", json=body, timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no credentials
    wrong = replace(s, mlflow=replace(s.mlflow, password="not-the-password"))
    with pytest.raises(RegistryError, match="refused user 'admin'"):
        connect(wrong)
    names = [m.name for m in connect(s).search_registered_models()]
    assert "guarded" in names and "intruder" not in names


def test_an_experiments_holdout_stays_through_promotions_canaries_and_rollbacks_until_stopped(
        registry: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    s = replace(registry, models=replace(registry.models, name="held"))
    client, name = connect(s), "held"
    for key, value in to_environ(s).items():  # the CLI's settings: this stack's, this model
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FLYWHEEL_MODELS_NAME", name)
    get_settings.cache_clear()
    cli = CliRunner()
    with pytest.raises(RegistryError, match="no @champion"):  # nothing registered yet
        start_experiment(s, 20.0)
    client.create_registered_model(name)
    v1, v2, v3 = (str(client.create_model_version(name, f"s3://held/v{k}").version) for k in (1, 2, 3))
    client.set_registered_model_alias(name, CHAMPION, v1)
    for percent in (0.0, 100.0, -5.0):
        with pytest.raises(RegistryError, match="in \\(0, 100\\)"):
            start_experiment(s, percent)
    with pytest.raises(RegistryError, match="no version 9"):
        start_experiment(s, 20.0, version="9")
    with pytest.raises(RegistryError, match="no experiment runs"):
        stop_experiment(s)
    shown = cli.invoke(main, ["experiment", "show"])
    assert shown.exit_code != 0 and "no experiment has run on held" in shown.output
    assert experiment(s) is None and routing(client, name).holdout_percent == 0.0

    started = cli.invoke(main, ["experiment", "start", "--percent", "20"])  # @champion's version by default
    assert started.exit_code == 0 and f"held@holdout v{v1} serves 20% of users" in started.output, started.output
    running = experiment(s)
    assert (running.version, running.percent) == (v1, 20.0)
    again = cli.invoke(main, ["experiment", "start", "--percent", "10", "--version", v2])
    assert again.exit_code != 0 and "runs already" in again.output
    # The champion learns: a promotion in a canary, then a rollback; the holdout never moves.
    client.set_model_version_tag(name, v2, "previous_champion", v1)
    start_canary(s, v2, v1)
    client.set_registered_model_alias(name, CHAMPION, v2)
    assert routing(client, name) == Routing({CHAMPION: v2, CONTROL: v1, HOLDOUT: v1},
                                            s.canary.ramp_percent[0], v2, 20.0, running.salt)
    rollback(s, why="a drill")
    client.set_registered_model_alias(name, CHAMPION, v3)
    assert routing(client, name) == Routing({CHAMPION: v3, HOLDOUT: v1}, holdout_percent=20.0,
                                            holdout_salt=running.salt)
    assert experiment(s) == running
    # Nothing served yet: each arm's figures are null, the output JSON any parser reads.
    empty = cli.invoke(main, ["experiment", "show", "--json"])
    assert empty.exit_code == 0, empty.output
    report = json.loads(empty.output)
    assert report["holdout"] == v1 and report["arms"]["frozen"]["requests"] == 0
    assert report["arms"]["frozen"]["ctr"] is None and report["ratio"]["ratio"] is None

    stopped = cli.invoke(main, ["experiment", "stop"])
    assert stopped.exit_code == 0 and f"held@holdout v{v1} served 20%" in stopped.output, stopped.output
    assert routing(client, name) == Routing({CHAMPION: v3}) and experiment(s) is None
    assert experiment(s, last=True) == running  # what `show` reads once it stopped
    # During a canary the holdout is by default the version that passed the last one (@control), not the new champion.
    start_canary(s, v2, v3)
    client.set_registered_model_alias(name, CHAMPION, v2)
    during = start_experiment(s, 10.0)
    assert during.version == v3 and during.salt != running.salt
    stop_experiment(s)
    # A @holdout left by a hand, its tag broken: no experiment, a share of 0; a start replaces it.
    client.set_registered_model_alias(name, HOLDOUT, v1)
    client.set_registered_model_tag(name, "experiment", "twenty")
    assert routing(client, name).holdout_percent == 0.0 and experiment(s) is None
    assert start_experiment(s, 5.0, version=v2).version == v2 and routing(client, name).aliases[HOLDOUT] == v2
    get_settings.cache_clear()


def test_a_changed_password_setting_is_the_admins_after_a_restart(tmp_path: Path) -> None:
    """MLflow takes its admin password only when it creates its user store; the local stack makes the
    setting the admin's on every start, so changing it never locks the platform out of its registry."""
    first = running_stack(tmp_path, "mlflow", FLYWHEEL_MLFLOW_PASSWORD="first-password-0")
    s = next(first)
    connect(s).create_registered_model("kept")
    next(first, None)  # stopped
    again = running_stack(tmp_path, "mlflow", FLYWHEEL_MLFLOW_PASSWORD="second-password-0")
    s2 = next(again)
    try:
        assert [m.name for m in connect(s2).search_registered_models()] == ["kept"]
        with pytest.raises(RegistryError, match="refused user 'admin'"):
            connect(replace(s2, mlflow=replace(s2.mlflow, password=s.mlflow.password)))
    finally:
        next(again, None)


def test_a_version_continuing_a_former_champion_is_refused(registry: Settings, tmp_path: Path) -> None:
    """An incremental version whose parent was rolled back (or replaced) while it trained never
    undoes that: the gate refuses it, however good its AUC."""
    s = registry
    data = synthetic(4000, seed=9)
    model = CtrModel(SPEC)
    model.fit(data.take(slice(0, 3000)), progress=False)
    client = connect(s)
    current = register(s, model, tmp_path, "current")
    client.set_registered_model_alias(s.models.name, CHAMPION, current)
    former = register(s, model, tmp_path, "former")
    stale = register(s, model, tmp_path, "stale")  # the same model: it would pass on AUC alone
    client.set_model_version_tag(s.models.name, stale, "parent_version", former)
    decision = gate(s, stale, model, data.take(slice(3000, None)), "synthetic evaluation")
    assert not decision.promoted and f"continues v{former}, which is no longer @champion" in decision.reason
    assert champion(s) == current


def test_a_demo_stopped_by_a_failing_drill_leaves_the_last_good_version_serving(registry: Settings,
                                                                                tmp_path: Path) -> None:
    """Whatever stops the demo: a drill's inverted model serving (in its canary, or ramped to everyone) goes
    back to the last version that is no drill, an honest version in its canary to @control; a champion that
    passed stays. (flywheel/demo/loop.py: run_loop calls it on any failure.)"""
    from flywheel.demo.loop import leave_last_good
    from models.registry import start_canary

    s = replace(registry, models=replace(registry.models, name="demo-stopped"))
    client, name = connect(s), s.models.name
    assert leave_last_good(s) == "no @champion yet"
    model = CtrModel(SPEC)
    model.fit(synthetic(2000, seed=4), progress=False)
    good = register(s, model, tmp_path, "good")
    client.set_registered_model_alias(name, CHAMPION, good)
    assert leave_last_good(s) == f"@champion v{good} serves every user" and champion(s) == good

    def promote(label: str, drill: str = "") -> str:  # as the gate does: a canary against the champion
        version, before = register(s, model, tmp_path, label), champion(s)
        for key, value in {"previous_champion": before, **({"drill": drill} if drill else {})}.items():
            client.set_model_version_tag(name, version, key, value)
        start_canary(s, version, before)
        client.set_registered_model_alias(name, CHAMPION, version)
        return version

    inverted = promote("inverted", drill="output inverted")  # stopped in its canary
    said = leave_last_good(s)
    assert champion(s) == good and alias_version(client, name, CONTROL) is None, said
    assert said == f"@champion v{inverted} (the drill's model, output inverted) rolled back to v{good}, which " \
                   "serves every user"
    assert client.get_model_version(name, inverted).tags["rolled_back_by"] == "flywheel-demo"

    honest = promote("honest")  # a good version in its canary: back to @control, which passed
    ramped = promote("ramped-inverted", drill="output inverted")  # ramped to all: no @control left
    client.delete_registered_model_alias(name, CONTROL)
    said = leave_last_good(s)
    assert said.startswith(f"@champion v{ramped} (the drill") and said.endswith(f"back to v{honest}, which serves "
                                                                                "every user") and champion(s) == honest
    assert leave_last_good(s) == f"@champion v{honest} serves every user"  # its canary had ended
    client.set_registered_model_alias(name, CONTROL, good)  # in a canary again
    assert f"v{honest} (in its canary) rolled back to v{good}" in leave_last_good(s) and champion(s) == good
