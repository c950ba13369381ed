"""The drills, once an incrementally trained champion serves: a bad version the gate must refuse, and a
rollback through Airflow that the ranking server must follow."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import mlflow

from flywheel.demo.plan import LoopError, Say, Summary
from flywheel.demo.probes import wait_serving
from infra.airflow_api import AirflowClient
from infra.settings import Settings
from models.registry import Decision, connect, load_version, log_model, version_tags


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


def register_inverted(s: Settings, champion: str) -> tuple[str, Decision]:
    """Register the champion with its output layer negated (every ranking reversed, as a model trained
    on inverted labels would rank) and run the gate, on the test window of the full training the
    champion descends from: the live windows of incremental runs pool /rank's candidates with
    /recommend's (which the ranker put first and few click), where even a good version's AUC can sit
    near 0.5 and an inverted one is not shown worse (docs/benchmarks.md)."""
    from models.train import gate_version  # imports TensorFlow (~10 s): only once the drill runs

    model = load_version(s, champion)
    for variable in model.network.trainable_variables[-2:]:  # the output layer's kernel and bias
        variable.assign(-variable)
    root = champion
    while parent := version_tags(s, root).get("parent_version"):
        root = parent
    tags = version_tags(s, champion) | {k: v for k, v in version_tags(s, root).items() if k.startswith("eval_")}
    tags = {k: v for k, v in tags.items() if k in ("kind", "data_start", "data_end", "eval_start", "eval_end")}
    connect(s)
    mlflow.set_experiment(s.models.experiment)
    with mlflow.start_run(run_name="drill-inverted"), tempfile.TemporaryDirectory() as tmp:
        version = log_model(s, model.save(Path(tmp) / "model"),
                            tags | {"parent_version": champion, "drill": "output inverted"})
    return version, gate_version(s, version)
