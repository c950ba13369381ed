"""The drills, once an incrementally trained champion serves: a bad version the gate must refuse, a
rollback through Airflow that the ranking server must follow, and a live regression: a bad version the
gate promotes, which the canary analysis must roll back by itself."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import mlflow

from flywheel.demo.plan import LoopError, Say, Summary
from flywheel.demo.probes import wait_serving
from infra.airflow_api import AirflowClient
from infra.settings import Settings
from models.registry import CHAMPION, Decision, alias_version, connect, gate, load_version, log_model, version_tags


def drills(s: Settings, server: str, airflow: AirflowClient, champion: str, summary: Summary, known: set[str],
           say: Say) -> None:
    bad, decision = register_inverted(s, champion)
    known.add(bad)
    summary.refused_drill = {"version": bad, "gate": "promoted" if decision.promoted else "refused",
                             "reason": decision.reason}
    say(f"  drill: v{bad} = v{champion} with its output inverted: gate "
        f"{'PROMOTED (the gate failed!)' if decision.promoted else 'refused'}: {decision.reason}")
    if decision.promoted:
        raise LoopError(f"the gate promoted the inverted v{bad}")
    target = version_tags(s, champion).get("previous_champion", "")
    run_id = airflow.trigger("model_rollback", {"reason": "demo drill: roll back the newest champion"})
    t0 = time.monotonic()
    state = airflow.wait("model_rollback", run_id, 600)
    if state != "success":
        raise LoopError(f"model_rollback run {run_id} {state}: {airflow.task_states('model_rollback', run_id)}")
    moved = airflow.xcom("model_rollback", run_id, "rollback")
    dag_s = time.monotonic() - t0
    served_s = wait_serving(server, moved["to"], 120)
    summary.rollback = {"from": moved["from"], "to": moved["to"], "expected": target, "dag_s": dag_s,
                        "served_after_dag_s": served_s}
    say(f"  drill: model_rollback (Airflow) moved @champion v{moved['from']} -> v{moved['to']} in {dag_s:.1f}s; "
        f"the ranking server served v{moved['to']} {served_s:.1f}s after the run finished")
    airflow.set_paused("incremental_training", True)  # no version trained on the regression's traffic meanwhile
    try:
        live_regression(s, moved["to"], summary, known, say)
    finally:
        airflow.set_paused("incremental_training", False)


def live_regression(s: Settings, champion: str, summary: Summary, known: set[str], say: Say,
                    timeout_s: float = 600.0) -> None:
    """A version the offline gate promotes and that serves worse: the champion with its output inverted,
    judged on its evaluation window with the labels swapped (a join upstream of the gate that marked the
    clicks as passes and the passes as clicks). The canary analysis (serving/canary.py) must roll it back
    by itself, with the reason on the version."""
    bad, decision = register_inverted(s, champion, labels_swapped=True)
    known.add(bad)
    if not decision.promoted:
        raise LoopError(f"the live-regression drill's v{bad} was refused by the gate ({decision.reason}): it "
                        "needs a version the gate promotes")
    promoted_at = datetime.fromisoformat(version_tags(s, bad)["gate_at"])
    say(f"  drill: v{bad} = v{champion} with its output inverted, gated on labels swapped upstream: promoted "
        f"({decision.reason}); in its canary against v{champion}")
    tags = wait_rolled_back(s, bad, timeout_s)
    rolled_back_at = datetime.fromisoformat(tags["rolled_back_at"])
    summary.live_regression = {
        "version": bad, "control": tags["rolled_back_to"], "promoted_at": promoted_at.isoformat(),
        "rolled_back_at": rolled_back_at.isoformat(), "seconds": (rolled_back_at - promoted_at).total_seconds(),
        "reason": tags["rolled_back_reason"], "champion_now": alias_version(connect(s), s.ranker.name, CHAMPION)}
    say(f"  drill: the canary analysis rolled v{bad} back to v{tags['rolled_back_to']} "
        f"{summary.live_regression['seconds']:.0f}s after its promotion: {tags['rolled_back_reason']}")


def wait_rolled_back(s: Settings, bad: str, timeout_s: float, alive: Callable[[], None] = lambda: None
                     ) -> dict[str, str]:
    """`bad`'s tags once the canary analysis has rolled it back; LoopError if it ramps it or `timeout_s` passes
    first. `alive()`, called each second, raises to stop the wait (the traffic the analysis judges stopped)."""
    deadline = time.monotonic() + timeout_s
    # The rollback's tags are set one by one, `rolled_back_at` last (models/registry.py: rollback).
    while (tags := version_tags(s, bad)).get("rolled_back_by") != "canary-analysis" or "rolled_back_at" not in tags:
        if tags.get("canary_decision", "").startswith("ramped"):  # final: it serves everyone now
            raise LoopError(f"the canary analysis ramped v{bad} instead of rolling it back: {tags['canary_decision']}")
        if time.monotonic() > deadline:
            raise LoopError(f"the canary analysis did not roll back v{bad} within {timeout_s:.0f}s: "
                            f"{tags.get('canary_status', 'no status')}; see `flywheel logs canary-analyst`")
        alive()
        time.sleep(1)
    return tags


def register_inverted(s: Settings, champion: str, labels_swapped: bool = False) -> tuple[str, Decision]:
    """Register the champion with its output layer negated (every ranking reversed, as a model trained
    on inverted labels would rank) and run the gate, on the test window of the full training the
    champion descends from: the live windows of incremental runs pool /rank's candidates with
    /recommend's (which the ranker put first and few click), where even a good version's AUC can sit
    near 0.5 and an inverted one is not shown worse (docs/benchmarks.md)."""
    from models.dataset import Window, training_set
    from models.train import gate_version  # imports TensorFlow (~10 s): only once the drill runs

    from models.networks import PositionBias, scorer

    model = load_version(s, champion)
    for variable in scorer(model.network).trainable_variables[-2:]:  # the scores' output layer: kernel and bias
        variable.assign(-variable)
    if isinstance(model.network, PositionBias):  # trained on inverted labels, it would have the ranks' bias inverted:
        model.network.bias.assign(-model.network.bias)  # as the gate sees it (its calibration), not as it is served
    root = champion
    while parent := version_tags(s, root).get("parent_version"):
        root = parent
    tags = version_tags(s, champion) | {k: v for k, v in version_tags(s, root).items() if k.startswith("eval_")}
    tags = {k: v for k, v in tags.items() if k in ("kind", "data_start", "data_end", "eval_start", "eval_end")}
    connect(s)
    mlflow.set_experiment(s.ranker.experiment)
    drill = "output inverted, labels swapped at the gate" if labels_swapped else "output inverted"
    with mlflow.start_run(run_name="drill-inverted"), tempfile.TemporaryDirectory() as tmp:
        version = log_model(s, model.save(Path(tmp) / "model"), tags | {"parent_version": champion, "drill": drill})
    if not labels_swapped:
        return version, gate_version(s, version)
    window = Window(datetime.fromisoformat(tags["eval_start"]),
                    datetime.fromisoformat(tags["eval_end"]) + timedelta(milliseconds=1))
    evaluation, _ = training_set(s, window, s.streaming.sequence_length)
    swapped = replace(evaluation, labels=1.0 - evaluation.labels)
    return version, gate(s, version, model, swapped, f"its evaluation window {window}, labels swapped")
