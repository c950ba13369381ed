"""The canary analysis' test and verdicts (serving/canary.py), without a stack: the mSPRT's false-alarm
rate under continuous monitoring, its power against a regression the size of an inverted ranker, the
non-inferiority ramp's false ramps of a version 10 % worse and the lists an honest one waits for, and the
verdicts it gives on served outcomes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException

from infra.settings import load_settings
from models import registry as registry_module
from models.registry import CANARY_TAG, CHAMPION, CONTROL, RegistryError, routing, start_canary
from serving import canary
from benchmarks.canary import list_aucs_like
from serving.canary import Analyst, first_ramp, judge, msprt, ramp_lists, ranked_lists, read_state
from tests.conftest import stack_environ


def aucs(rng: np.random.Generator, mean: float, n: int) -> np.ndarray:
    """Request AUCs like the demo's (mean 0.66, sd 0.22 on MovieLens /rank sessions), in [0, 1]."""
    return np.clip(rng.normal(mean, 0.22, n), 0, 1)


def first_alarm(treatment: np.ndarray, control: np.ndarray, alpha: float, tau: float, minimum: int) -> int | None:
    """The number of requests per side at the first look (one per new request) where the test says worse."""
    for n in range(minimum, len(treatment) + 1):
        d, lam = msprt(treatment[:n], control[:n], tau)
        if lam >= 1 / alpha and d < 0:
            return n
    return None


def test_an_equal_version_is_rolled_back_at_most_alpha_of_the_time_however_often_it_is_looked_at() -> None:
    s = load_settings({}, config_file=None)
    c = s.canary
    rng = np.random.default_rng(0)
    runs = 400
    alarms = sum(first_alarm(aucs(rng, 0.66, 150), aucs(rng, 0.66, 150), c.alpha, c.mixture_sd,
                             c.min_requests) is not None for _ in range(runs))
    # 150 looks each: a fixed-sample test at alpha repeated this often would alarm in most runs.
    assert alarms / runs <= c.alpha + 3 * np.sqrt(c.alpha / runs), alarms


def test_an_inverted_ranker_is_shown_worse_within_a_few_dozen_judged_requests() -> None:
    s = load_settings({}, config_file=None)
    c = s.canary
    rng = np.random.default_rng(1)
    found = [first_alarm(aucs(rng, 1 - 0.66, 100), aucs(rng, 0.66, 100), c.alpha, c.mixture_sd, c.min_requests)
             for _ in range(50)]
    assert all(n is not None for n in found) and np.median(found) <= c.min_requests + 5, found


def test_a_version_10_percent_worse_ramps_at_most_ramp_alpha_of_the_time_and_an_honest_one_within_its_sizing() -> None:
    """Per-list AUC distributions like the served ones (mean 0.55-0.65, sd 0.22-0.3), looked at after every
    list: a version 10 % worse (0.60 -> 0.54) ramps in at most `ramp_alpha` of canaries; one as good as its
    control ramps within twice `ramp_lists` of its sd in at least 90 % of them."""
    c = load_settings({}, config_file=None).canary
    rng = np.random.default_rng(3)
    false_ramps, runs, waited = 0, 0, []
    for mean in (0.55, 0.60, 0.65):
        for sd in (0.22, 0.30):
            sized = ramp_lists(sd, c)
            for _ in range(100):
                control = list_aucs_like(rng, mean, sd, 4 * sized)
                worse = list_aucs_like(rng, 0.9 * mean, sd, 4 * sized)
                false_ramps += first_ramp(worse, control, c) is not None
                runs += 1
                honest = first_ramp(list_aucs_like(rng, mean, sd, 2 * sized), control[: 2 * sized], c)
                waited.append(honest is not None)
    assert false_ramps / runs <= c.ramp_alpha, (false_ramps, runs)
    assert np.mean(waited) >= 0.9, np.mean(waited)
    assert ramp_lists(0.22, c) < 600  # the sizing docs/concepts.md states


def outcomes(rng: np.random.Generator, champion_mean: float, requests: int) -> pd.DataFrame:
    """Served /rank lists of 6 items, half the users on each side: scores that put the clicked items ahead
    with probability `champion_mean` for the champion (0.7 for the control), one or two clicks each."""
    rows = []
    for r in range(requests):
        route, version, mean = (CHAMPION, "5", champion_mean) if r % 2 else (CONTROL, "4", 0.7)
        clicks = rng.integers(1, 3)
        for k in range(6):
            label = float(k < clicks)
            score = rng.random() + (0.5 if (rng.random() < mean) == bool(label) else 0.0)
            rows.append((f"r{r}", f"i{k}", version, route, 1_000 + r, score, label, None))
    return pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at", "score",
                                       "label", "sources"])


def test_the_verdicts_worse_ramp_and_lacking_evidence() -> None:
    s = load_settings({}, config_file=None)
    rng = np.random.default_rng(2)
    worse = judge(s, outcomes(rng, 0.2, 80), "5", "4", step_started_ms=0)
    assert worse.decision == "worse" and worse.difference < 0 and "shown worse than v4" in worse.reason
    assert worse.arms[CHAMPION].judged == worse.arms[CONTROL].judged == 40
    # As good as its control, on 40 lists a side: not shown worse, but not shown not worse either.
    few_same = judge(s, outcomes(rng, 0.7, 80), "5", "4", step_started_ms=0)
    assert few_same.decision == "lacking" and "lacking evidence" in few_same.reason, few_same.reason
    same = judge(s, outcomes(rng, 0.7, 3000), "5", "4", step_started_ms=0)
    assert same.decision == "ramp" and "shown not worse by more than 0.05" in same.reason, same.reason
    # The same traffic, but the step began after most of it: too little at this step to ramp.
    late = judge(s, outcomes(rng, 0.7, 3000), "5", "4", step_started_ms=1_000 + 2_900)
    assert late.decision == "lacking" and "at this step 50 a side" in late.reason, late.reason
    # /recommend lists (with candidate sources) and lists without both a click and a non-click judge nothing.
    few = outcomes(rng, 0.2, 8)
    recommended = few.assign(sources=[["graph"]] * len(few))
    assert ranked_lists(recommended).empty
    assert judge(s, few, "5", "4", 0).decision == "lacking"


def test_a_rollback_that_fails_is_tried_again_at_each_look_and_counted_until_it_succeeds(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    s = load_settings(stack_environ(tmp_path / "data"))
    tries, tagged = [], []

    def rollback(s, why: str, to: str, who: str, model) -> tuple[str, str]:
        assert model == s.ranker  # the analyst's model, named to the registry call
        tries.append((why, to, who))
        if len(tries) < 3:
            raise RegistryError("MLflow at ... is unreachable (ConnectError)")
        return "5", to

    class Client:
        def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
            tagged.append((version, key, value))

    monkeypatch.setattr(canary, "rollback", rollback)
    monkeypatch.setattr(canary, "connect", lambda s: Client())
    analyst = Analyst(s)
    for look in range(3):
        analyst._roll_back("5", "4", "shown worse than v4 on live traffic: ...")
        analyst.save()
        state = read_state(s)
        assert state.rollback_failing == (look + 1 if look < 2 else 0), state
        assert ("unreachable" in state.error) == (look < 2)
    assert [to for _, to, _ in tries] == ["4"] * 3 and {who for _, _, who in tries} == {"canary-analysis"}
    assert state.rollbacks[-1]["version"] == "5" and state.rollbacks[-1]["to"] == "4"
    assert tagged == [("5", "canary_decision", "rolled back to v4: shown worse than v4 on live traffic: ...")]


class Registry:
    """MLflow's client over one registered model, in memory: what the gate and the analyst call."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.versions: dict[str, dict[str, str]] = {}

    def get_registered_model(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(aliases=dict(self.aliases), tags=dict(self.tags))

    def get_model_version(self, name: str, version: str) -> SimpleNamespace:
        return SimpleNamespace(tags=dict(self.versions.setdefault(version, {})))

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        if alias not in self.aliases:
            raise MlflowException(f"alias {alias} not found", error_code="RESOURCE_DOES_NOT_EXIST")
        return SimpleNamespace(version=self.aliases[alias])

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self.versions.setdefault(version, {})[key] = value

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self.aliases[alias] = version

    def delete_registered_model_alias(self, name: str, alias: str) -> None:
        del self.aliases[alias]

    def set_registered_model_tag(self, name: str, key: str, value: str) -> None:
        self.tags[key] = value

    def delete_registered_model_tag(self, name: str, key: str) -> None:
        del self.tags[key]


def test_a_promotion_slower_than_the_analysts_looks_keeps_its_canary_and_a_hand_move_ends_it(
        tmp_path: Path, monkeypatch) -> None:
    """A gate writes @control and the canary's tags before it moves @champion; on a loaded machine that took
    longer than two looks, and the analyst took the half-done promotion for a hand's move and ended the
    canary: the new version then served everyone unjudged."""
    s = load_settings(stack_environ(tmp_path / "data"))
    registry = Registry()
    monkeypatch.setattr(canary, "connect", lambda s: registry)
    monkeypatch.setattr(registry_module, "connect", lambda s: registry)
    registry.set_registered_model_alias(s.models.name, CHAMPION, "1")
    analyst = Analyst(s)
    start_canary(s, "4", "1")  # the gate, up to its last write
    for _ in range(3):
        analyst.look()
    registry.set_registered_model_alias(s.models.name, CHAMPION, "4")
    found = routing(registry, s.models.name)
    assert found.aliases[CONTROL] == "1" and found.champion_percent == s.canary.ramp_percent[0], found
    # A hand moves @champion to v2 during the canary: after two looks it is over, and v4 says why.
    registry.versions["4"]["canary_started_at"] = "2026-01-01T00:00:00+00:00"
    registry.set_registered_model_alias(s.models.name, CHAMPION, "2")
    for _ in range(2):
        analyst.look()
    assert CONTROL not in registry.aliases and CANARY_TAG not in registry.tags
    assert registry.versions["4"]["canary_decision"] == "ended: @champion moved to v2 by hand"


def test_the_experiment_running_is_measured_per_arm_every_minute_and_exported(tmp_path: Path, monkeypatch) -> None:
    """Beside its canaries the analyst measures the experiment running: each arm's /rank CTR over the last five
    minutes (serving/experiments.py), which /metrics/canary exports per arm with the ratio; none once it stops."""
    from infra.exporter import CanaryCollector
    from models.registry import HOLDOUT, start_experiment, stop_experiment
    from serving.access import frozen_arm

    s = load_settings(stack_environ(tmp_path / "data"))
    registry = Registry()
    monkeypatch.setattr(canary, "connect", lambda s: registry)
    monkeypatch.setattr(registry_module, "connect", lambda s: registry)
    registry.set_registered_model_alias(s.models.name, CHAMPION, "1")
    running = start_experiment(s, 50.0)
    asked: list[int] = []

    def served_outcomes(s, since_ms: int, until_ms: int | None = None, model: str | None = None) -> pd.DataFrame:
        asked.append(since_ms)
        rows = []
        for n in range(200):  # the frozen arm's users click 1 item in 10, the learning arm's 2, on /rank lists
            user = f"u{n}"
            frozen = frozen_arm(user, running.percent, running.salt)
            for k in range(10):
                rows.append({"request_id": f"r{n}", "item_id": f"i{k}", "model_version": "1" if frozen else "2",
                             "route": HOLDOUT if frozen else CHAMPION, "served_at": since_ms + n, "score": 0.5,
                             "label": float(k < (1 if frozen else 2)), "sources": None, "user_id": user})
        rows.append({**rows[-1], "request_id": "rec", "label": 1.0, "sources": ["graph"]})  # /recommend: apart
        return pd.DataFrame(rows)

    monkeypatch.setattr(canary, "served_outcomes", served_outcomes)
    analyst = Analyst(s)
    analyst.look()
    analyst.look()  # within the minute: not measured again
    analyst.save()
    assert len(asked) == 1 and asked[0] >= int(running.started_at.timestamp() * 1000)
    measured = read_state(s).experiment
    assert measured["version"] == "1" and measured["percent"] == 50.0
    assert measured["arms"]["frozen"]["ctr"] == 0.1 and measured["arms"]["learning"]["ctr"] == 0.2
    assert abs(measured["ratio"]["ratio"] - 2.0) < 1e-9 and measured["ratio"]["low"] > 1.0

    def exported() -> dict[str, float]:
        return {f"{m.name}{sample.labels}": sample.value for m in CanaryCollector(s).collect() for sample in m.samples}

    gauges = exported()
    assert gauges["flywheel_experiment_holdout_percent{'holdout': '1'}"] == 50.0
    assert gauges["flywheel_experiment_ctr{'arm': 'frozen'}"] == 0.1
    assert gauges["flywheel_experiment_ctr{'arm': 'learning'}"] == 0.2
    assert gauges["flywheel_experiment_ctr_ratio{}"] == measured["ratio"]["ratio"]
    assert gauges["flywheel_experiment_ctr_ratio_low{}"] > 1.0
    assert gauges["flywheel_experiment_crossed_items{'arm': 'frozen'}"] == 0

    stop_experiment(s)
    analyst._measured_at = 0.0  # a minute later
    analyst.look()
    analyst.save()
    assert read_state(s).experiment == {}
    gauges = exported()
    assert gauges["flywheel_experiment_holdout_percent{'holdout': ''}"] == 0.0
    assert not any(name.startswith("flywheel_experiment_ctr") for name in gauges)
