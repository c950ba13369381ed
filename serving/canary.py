"""Canary analysis of a promoted ranker: the new @champion's served outcomes against @control's, the
champion before it, on the same period's traffic; a version shown worse is rolled back at once.

A promotion that replaces a champion (models/registry.py: decide) leaves @control on the old one and the
registered model's `champion_canary` tag at `canary.ramp_percent[0]`: the ranking server scores that share of
users (by a stable hash) with the new champion, the others with @control. Every `canary.interval_s` this
process joins the prediction archive to the event log's clicks (serving/outcomes.py) since the canary
started and judges each /rank request the users were served: its AUC, the share of (clicked, not
clicked) pairs of shown items that the scores put in the clicked one's favour. Requests with no click or
nothing but clicks tell nothing and are left out; /recommend lists too (their candidates come from recall
sources the ranker did not choose).

The test is the mixture sequential probability ratio test (mSPRT, Johari, Pekelis & Walsh 2017, "Always
valid inference") on the difference d of the two sides' mean request AUC, with a normal mixture of standard
deviation tau = `canary.mixture_sd` over it; V = s_t^2 / n_t + s_c^2 / n_c, the variance of d estimated from the
lists themselves:

    Lambda(theta) = sqrt(V / (V + tau^2)) * exp(tau^2 * (d - theta)^2 / (2 V (V + tau^2)))

Under a true difference theta the chance that Lambda(theta) ever reaches 1/alpha is at most alpha (Ville's
inequality), however often it is looked at; the thetas it has not reached form an always-valid confidence
sequence, d +- sqrt(2 V (V + tau^2) / tau^2 * (log(1/alpha) + log((V + tau^2) / V) / 2)). Decisions, each side
with at least `canary.min_requests` judged lists (a variance from fewer is noise):

- Lambda(0) >= 1/`canary.alpha` with d < 0, on the lists since the canary started: **shown worse**. Rolled back
  to @control (models/registry.py: rollback), the reason on the version (`rolled_back_reason`,
  `canary_decision`) and in the alert. A version as good as its control is rolled back with probability at
  most `canary.alpha`. A rollback that fails (the registry down) is retried every interval and alerted.
- the lower end of the `canary.ramp_alpha` sequence above -`canary.margin`, on the lists since this step
  began: **shown not worse than the control by the margin** (non-inferiority). The next share of
  `canary.ramp_percent`, then all traffic (@control removed, `canary_decision` on the version). A version
  worse than its control by more than the margin ramps with probability at most `canary.ramp_alpha` at each
  step. How many lists that takes follows from their spread, not from a fixed count: `ramp_lists` (at the
  demo's per-list sd 0.22 with the defaults, about 436 a side for a version as good as its control).
- otherwise: **lacking evidence**: the share stays, and the version says so (`canary_status`); the canary
  never ramps on the absence of evidence.

What it found is in `run/canary-analyst.state.json`: the exporter's /metrics/canary (served CTR and request AUC
per version too), `flywheel status`, the dashboard. Every minute it also measures the experiment running, if any
(serving/experiments.py): each arm's /rank CTR over the last five minutes, for the same gauges and dashboard.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np
import pandas as pd

from infra.progress import replace_text, state_path
from infra.settings import CanarySettings, RegisteredModel, Settings, get_settings
from models.registry import (
    CANARY_TAG, CHAMPION, CONTROL, RAMPED, canary_tag, connect, end_canary, experiment, rollback, routing)
from serving.experiments import compare
from serving.outcomes import RANK, clicked_outcomes, endpoints, list_aucs, served_outcomes

log = logging.getLogger("flywheel.canary")
WHO = "canary-analysis"
SERVICE = "canary-analyst"  # the stack's name for this process
SERVED_WINDOW_S = 300.0  # served figures per version, outside a canary: the last five minutes
SERVED_EVERY_S = 60.0  # how often they are measured (pooled AUC scans every item: 4M in a load test's 5 min)
# A gate writes @control and the canary's tags, then moves @champion: four registry writes, seen taking more
# than two looks (10 s) on a demo's loaded 2 cores. A canary started this recently is waited for, not ended.
PROMOTING_S = 120.0


def ranked_lists(outcomes: pd.DataFrame) -> pd.DataFrame:
    """The judged /rank lists (serving/outcomes.py list_aucs): what the analysis compares."""
    judged = list_aucs(outcomes)
    return judged[judged["endpoint"] == RANK]


def msprt(treatment: np.ndarray, control: np.ndarray, tau: float) -> tuple[float, float]:
    """(difference of means treatment - control, the mixture likelihood ratio Lambda(0)); Lambda 1 with fewer
    than two observations on a side (nothing to estimate a variance from)."""
    d, v = _difference(treatment, control)
    if math.isnan(d):
        return d, 1.0
    log_lambda = 0.5 * math.log(v / (v + tau**2)) + tau**2 * d**2 / (2 * v * (v + tau**2))
    return d, math.exp(min(log_lambda, 700.0))


def half_width(v, tau: float, alpha: float):
    """Half the width of the always-valid (1 - alpha) interval at variance `v` of the difference (floats or
    arrays): the distance from d at which Lambda reaches 1/alpha."""
    return np.sqrt(2 * v * (v + tau**2) / tau**2 * (np.log(1 / alpha) + 0.5 * np.log((v + tau**2) / v)))


def confidence_sequence(treatment: np.ndarray, control: np.ndarray, tau: float, alpha: float
                        ) -> tuple[float, float]:
    """The always-valid (1 - alpha) interval of the difference of means, treatment - control: the thetas
    whose mixture likelihood ratio has not reached 1/alpha ((-inf, inf) with fewer than two on a side)."""
    d, v = _difference(treatment, control)
    if math.isnan(d):
        return -math.inf, math.inf
    half = float(half_width(v, tau, alpha))
    return d - half, d + half


def ramp_lists(sd: float, c: CanarySettings) -> int:
    """Judged lists a side after which a version as good as its control (d = 0) is shown not worse by
    `c.margin`, at a per-list sd `sd`: the canary's sizing (docs/concepts.md "Canary analysis")."""
    n = np.arange(2, 100_000)
    return int(n[np.argmax(half_width(2 * sd**2 / n, c.mixture_sd, c.ramp_alpha) < c.margin)])


def first_ramp(treatment: np.ndarray, control: np.ndarray, c: CanarySettings) -> int | None:
    """Lists a side at the first look, one per new list a side, where the canary would ramp (`judge`'s
    rule, computed for every look at once): a simulation's measure (tests/test_canary.py, benchmarks/canary.py)."""
    n = np.arange(1, min(len(treatment), len(control)) + 1)

    def running(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = x[: len(n)]
        mean = np.cumsum(x) / n
        return mean, (np.cumsum(x**2) - n * mean**2) / np.maximum(n - 1, 1)

    (mt, vt), (mc, vc) = running(treatment), running(control)
    low = mt - mc - half_width(np.maximum((vt + vc) / n, 1e-12), c.mixture_sd, c.ramp_alpha)
    ramps = np.flatnonzero((low > -c.margin) & (n >= max(2, c.min_requests)))
    return int(n[ramps[0]]) if len(ramps) else None


def _difference(treatment: np.ndarray, control: np.ndarray) -> tuple[float, float]:
    if len(treatment) < 2 or len(control) < 2:
        return float("nan"), float("nan")
    v = float(treatment.var(ddof=1) / len(treatment) + control.var(ddof=1) / len(control))
    return float(treatment.mean() - control.mean()), max(v, 1e-12)


@dataclass
class Arm:
    version: str
    judged: int = 0  # requests with a click and a non-click among the shown
    auc: float = float("nan")  # their mean request AUC
    requests: int = 0
    ctr: float = float("nan")  # clicks per shown item


@dataclass
class Verdict:
    decision: str  # "worse", "ramp", "lacking"
    reason: str
    difference: float
    likelihood_ratio: float
    arms: dict[str, Arm]  # "champion", "control"


def totals_of(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Requests and items per model_version and route, from outcomes that hold every list."""
    if not len(outcomes):
        return pd.DataFrame(columns=["model_version", "route", "requests", "items"])
    grouped = outcomes.groupby(["model_version", "route"])
    return pd.DataFrame({"requests": grouped["request_id"].nunique(), "items": grouped.size()}).reset_index()


def judge(s: Settings, outcomes: pd.DataFrame, champion: str, control: str, step_started_ms: int,
          totals: pd.DataFrame | None = None) -> Verdict:
    """The verdict on `champion` against `control` from the outcomes since the canary started (the clicked
    lists are enough: serving/outcomes.py clicked_outcomes, with every list's `totals`)."""
    c = s.canary
    totals = totals_of(outcomes) if totals is None else totals
    judged = ranked_lists(outcomes)
    arms, values, at_step = {}, {}, {}
    for route, version in ((CHAMPION, champion), (CONTROL, control)):
        mine = outcomes[(outcomes["model_version"] == version) & (outcomes["route"] == route)] if len(outcomes) \
            else outcomes
        rows = judged[(judged["model_version"] == version) & (judged["route"] == route)]
        values[route] = rows["auc"].to_numpy()
        stamps = mine.groupby("request_id")["served_at"].min() if len(mine) else pd.Series(dtype=float)
        at_step[route] = (stamps.reindex(rows["request_id"]) >= step_started_ms).to_numpy()
        total = totals[(totals["model_version"] == version) & (totals["route"] == route)]
        items = int(total["items"].sum())
        arms[route] = Arm(version, len(rows), float(values[route].mean()) if len(rows) else float("nan"),
                          int(total["requests"].sum()), float(mine["label"].sum()) / items if items else float("nan"))
    d, lam = msprt(values[CHAMPION], values[CONTROL], c.mixture_sd)
    at_this_step = min(int(m.sum()) for m in at_step.values())
    low, _ = confidence_sequence(values[CHAMPION][at_step[CHAMPION]], values[CONTROL][at_step[CONTROL]],
                                 c.mixture_sd, c.ramp_alpha)
    said = (f"request AUC v{champion} {arms[CHAMPION].auc:.3f} on {arms[CHAMPION].judged} judged requests vs "
            f"v{control} {arms[CONTROL].auc:.3f} on {arms[CONTROL].judged}, difference {d:+.3f}; mSPRT "
            f"likelihood ratio {lam:.3g} (threshold 1/alpha = {1 / c.alpha:g}); at this step "
            f"{at_this_step} a side, difference > {low:+.3f} "
            f"(always valid at {1 - c.ramp_alpha:g}; ramps above -{c.margin:g})")
    enough = min(a.judged for a in arms.values()) >= max(2, c.min_requests)
    if enough and lam >= 1 / c.alpha and d < 0:
        return Verdict("worse", f"shown worse than v{control} on live traffic: {said}", d, lam, arms)
    if enough and at_this_step >= c.min_requests and low > -c.margin:
        return Verdict("ramp", f"shown not worse by more than {c.margin:g}: {said}", d, lam, arms)
    return Verdict("lacking", f"lacking evidence: {said}", d, lam, arms)


def served_figures(outcomes: pd.DataFrame, totals: pd.DataFrame) -> dict[str, dict[str, dict]]:
    """Per version served and endpoint (`rank`, `recommend`): requests, items shown, CTR, `auc` pooled over
    its items, `list_auc` the mean over its `judged` lists (`outcomes`: the clicked lists at least;
    `totals`: every list's, serving/outcomes.py totals)."""
    judged = list_aucs(outcomes)
    clicks = outcomes.groupby(["model_version", endpoints(outcomes)])["label"].sum() if len(outcomes) else {}
    out: dict[str, dict[str, dict]] = {}
    for (version, endpoint), g in (totals.groupby(["model_version", "endpoint"]) if len(totals) else []):
        items = int(g["items"].sum())
        aucs = judged.loc[(judged["model_version"] == version) & (judged["endpoint"] == endpoint), "auc"]
        out.setdefault(str(version), {})[endpoint] = {
            "requests": int(g["requests"].sum()), "items": items,
            "ctr": float(clicks.get((version, endpoint), 0.0)) / items if items else float("nan"),
            "auc": float(g["auc"].iloc[0]),
            "list_auc": float(aucs.mean()) if len(aucs) else float("nan"), "judged": len(aucs)}
    return out


@dataclass
class State:
    """What the analysis found at its last look (run/canary-analyst.state.json)."""

    updated_at: float = 0.0
    version: str = ""  # the champion in its canary ("" when none runs)
    control: str = ""
    champion_percent: float = 100.0
    decision: str = ""
    reason: str = ""
    likelihood_ratio: float = 1.0
    arms: dict = field(default_factory=dict)
    served: dict = field(default_factory=dict)
    rollbacks: list = field(default_factory=list)  # the last ones it made: version, to, reason, at
    rollback_failing: int = 0  # failed tries of the rollback it asked for (0 once one succeeds)
    error: str = ""
    experiment: dict = field(default_factory=dict)  # the experiment running: its arms over the last five minutes
    # (the platform's ranker's, for /metrics)


def _state_name(model: RegisteredModel) -> str:
    """The platform's ranker's state is the service's; each scenario's ranker has its own beside it."""
    return f"{SERVICE}-{model.scenario}" if model.scenario else SERVICE


def read_state(s: Settings, model: RegisteredModel | None = None) -> State | None:
    """What the analysis of `model`'s canaries (the platform's ranker's by default) found at its last look."""
    try:
        return State(**json.loads(state_path(s, _state_name(model or s.ranker)).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Analyst:
    def __init__(self, s: Settings, model: RegisteredModel | None = None) -> None:
        self.model = model or s.ranker  # the registered model whose canaries it judges
        self.s = s.for_model(self.model)  # under its scenario's own canary settings, if any
        self.state = read_state(s, self.model) or State()
        self.state.rollback_failing, self._said, self._served_at, self._measured_at = 0, ("", 0.0), 0.0, 0.0
        self._client, self._moot = None, False

    def client(self):
        """One registry client for every look (connecting costs a registry call); a new one after a failure."""
        if self._client is None:
            self._client = connect(self.s)
        return self._client

    def look(self) -> None:
        """One look: judge the canary running, if any, and act on the verdict; every SERVED_EVERY_S, measure the
        experiment running."""
        self._judge()
        if not self.model.scenario and time.time() - self._measured_at >= SERVED_EVERY_S:  # /metrics: the platform's
            self._measure_experiment()

    def _measure_experiment(self) -> None:
        """Each arm of the experiment running on the model (serving/experiments.py), on its /rank lists of the last
        SERVED_WINDOW_S: what /metrics shows over time (`flywheel experiment show`: since its start)."""
        self._measured_at, self.state.experiment = time.time(), {}  # none said rather than a stale one
        running = experiment(self.s, self.model)
        if running is None:
            return
        since = max(int(running.started_at.timestamp() * 1000), int((time.time() - SERVED_WINDOW_S) * 1000))
        served = served_outcomes(self.s, since, model=self.model.name)
        arms, ratio = compare(served[endpoints(served) == RANK] if len(served) else served, running)
        self.state.experiment = {"version": running.version, "percent": running.percent,
                                 "started_at": running.started_at.isoformat(), "since_ms": since,
                                 "arms": {name: asdict(a) for name, a in arms.items()}, "ratio": asdict(ratio)}

    def _judge(self) -> None:
        s, name = self.s, self.model.name
        client = self.client()
        try:
            found = routing(client, name)
        except Exception:
            self._client = None
            raise
        champion, control = found.aliases.get(CHAMPION), found.aliases.get(CONTROL)
        st = self.state
        # @champion moved by hand (to @control, or to a version the canary is not for): the canary is over.
        # Twice in a row (one registry read is not atomic), and not while a gate is still promoting its version.
        moot = control is not None and (champion in (None, control) or found.canary_version != champion)
        seen_before, self._moot = self._moot, moot
        if moot and (not seen_before or self._being_promoted(found.canary_version, champion)):
            return
        if control is None or moot:
            if moot:
                end_canary(s, self.model)
                if found.canary_version and found.canary_version != champion:
                    client.set_model_version_tag(name, found.canary_version, "canary_decision",
                                                 f"ended: @champion moved to v{champion or '-'} by hand")
                log.info("@champion v%s is not the canary's (v%s): @control v%s removed", champion,
                         found.canary_version, control)
            st.version, st.control, st.champion_percent, st.decision, st.reason, st.arms = "", "", 100.0, "", "", {}
            if time.time() - self._served_at >= SERVED_EVERY_S:  # a read of the archives: outside a canary
                st.served = served_figures(*clicked_outcomes(s, int((time.time() - SERVED_WINDOW_S) * 1000),
                                                             model=self.model.name))
                self._served_at = time.time()
            return
        tags = dict(client.get_model_version(name, champion).tags)
        started = _ms(tags.get("canary_started_at")) or int(time.time() * 1000)
        step_started = _ms(tags.get("canary_step_started_at")) or started
        pooled = time.time() - self._served_at >= SERVED_EVERY_S  # every item's score: not at every look
        outcomes, totals = clicked_outcomes(s, started, pooled, self.model.name)
        verdict = judge(s, outcomes, champion, control, step_started, totals)
        st.version, st.control, st.champion_percent = champion, control, found.champion_percent
        st.decision, st.reason, st.likelihood_ratio = verdict.decision, verdict.reason, verdict.likelihood_ratio
        st.arms = {route: asdict(arm) for route, arm in verdict.arms.items()}
        if pooled:
            st.served, self._served_at = served_figures(outcomes, totals), time.time()
        if verdict.decision == "worse":
            self._roll_back(champion, control, verdict.reason)
        elif verdict.decision == "ramp":
            self._ramp(champion, found.champion_percent, verdict.reason)
        elif self._said[0] != champion or time.time() - self._said[1] > 30:  # a registry write: not every look
            client.set_model_version_tag(name, champion, "canary_status", f"{found.champion_percent:g}% of users; "
                                         f"{verdict.reason}")
            self._said = (champion, time.time())

    def _being_promoted(self, version: str | None, champion: str | None) -> bool:
        """Whether `version`'s canary began under PROMOTING_S ago, undecided, and @champion is yet to reach it."""
        if version is None or version == champion:
            return False
        tags = dict(self.client().get_model_version(self.model.name, version).tags)
        started = _ms(tags.get("canary_started_at"))
        return ("canary_decision" not in tags and started is not None
                and time.time() * 1000 - started < PROMOTING_S * 1000)

    def _roll_back(self, champion: str, control: str, reason: str) -> None:
        try:
            rollback(self.s, f"canary analysis: {reason}", to=control, who=WHO, model=self.model)
            self.client().set_model_version_tag(self.model.name, champion, "canary_decision",
                                                  f"rolled back to v{control}: {reason}")
        except Exception as exc:  # noqa: BLE001 - the registry down: tried again at the next look, and alerted
            self.state.rollback_failing += 1
            self.state.error = f"rollback of v{champion} to v{control} failed: {type(exc).__name__}: {exc}"[:500]
            log.error("%s (try %d; again in %gs)", self.state.error, self.state.rollback_failing,
                      self.s.canary.interval_s)
            return
        log.warning("rolled back v%s to v%s: %s", champion, control, reason)
        self.state.rollbacks = [*self.state.rollbacks, {"version": champion, "to": control, "reason": reason,
                                                         "at": time.time()}][-10:]
        self.state.rollback_failing, self.state.error = 0, ""

    def _ramp(self, champion: str, percent: float, reason: str) -> None:
        client, name = self.client(), self.model.name
        steps = [p for p in self.s.canary.ramp_percent if p > percent]
        if steps:
            client.set_registered_model_tag(name, CANARY_TAG, canary_tag(champion, steps[0]))
            client.set_model_version_tag(name, champion, "canary_step_started_at", datetime.now(UTC).isoformat())
            client.set_model_version_tag(name, champion, "canary_status", f"ramped to {steps[0]:g}% of users: {reason}")
            log.info("v%s ramped to %g%% of users: %s", champion, steps[0], reason)
            return
        end_canary(self.s, self.model)
        client.set_model_version_tag(name, champion, "canary_decision", f"{RAMPED}: {reason}")
        log.info("v%s ramped to all traffic: %s", champion, reason)

    def save(self) -> None:
        self.state.updated_at = time.time()
        path = state_path(self.s, _state_name(self.model))
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(asdict(self.state), default=str))


def _ms(iso: str | None) -> int | None:
    return int(datetime.fromisoformat(iso).timestamp() * 1000) if iso else None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    analysts, stopping = [Analyst(s, m) for m in s.rankers], []  # the platform's ranker's and each scenario's
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    log.info("judging the canaries of %s every %gs (alpha %g, ramp %s%%)", ", ".join(a.model.name for a in analysts),
             s.canary.interval_s, s.canary.alpha, "/".join(f"{p:g}" for p in s.canary.ramp_percent))
    while not stopping:
        for analyst in analysts:
            try:
                analyst.look()
                if not analyst.state.rollback_failing:
                    analyst.state.error = ""
            except Exception as exc:  # noqa: BLE001 - the registry or the archives away: said, and looked at again
                analyst.state.error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("canary analysis of %s: %s", analyst.model.name, analyst.state.error)
            analyst.save()
        time.sleep(s.canary.interval_s)


if __name__ == "__main__":
    main()
