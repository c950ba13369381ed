"""A realistic regression on a world (`flywheel world-drill --dataset world`, on a running stack with a champion: the
one `make bench-drift` leaves up). Not an inverted model: the champion's architecture trained from scratch (one
epoch) on the history its line descends from, with the labels shuffled across the window's exposures (a label join
upstream that attached each click to some other exposure). The gate judges it on its test part shuffled the same
way (the broken join feeds the gate too, so its AUC and the champion's are both chance there) and promotes it into
a canary against the champion, while the world's users (flywheel/world_traffic.py, at the world's time after its
last change) are the traffic. The canary analysis must roll it back by itself within `within_s` of its promotion;
the /rank CTR each version served meanwhile says how much worse it was.

incremental_training is paused for the drill (no version learnt from the regression's traffic) and left as it was
found; whatever stops the drill once its version is promoted, that version does not stay @champion. Ends with one
line: `world-drill: vB (labels shuffled) rolled back T s after its promotion; served CTR vB X control vC Y (ratio
R)`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np

from infra.settings import Settings

SHUFFLED = "labels shuffled across its window's exposures, the gate's test part too"


class WorldDrillError(RuntimeError):
    """The drill could not run (no champion, a canary in flight, the gate refused the version, the traffic
    stopped) or the canary analysis did not roll the version back in time."""


def shuffled(ex, rng: np.random.Generator):
    """`ex` with its labels (and their weights and objectives) permuted across the examples: each exposure keeps its
    features and gets another's outcome."""
    order = rng.permutation(len(ex))
    return replace(ex, labels=ex.labels[order], weights=ex.weights[order], objectives=ex.objectives[order])


def register_shuffled(s: Settings, champion: str, seed: int = 0, say: Callable[[str], None] = print):
    """Train and register the regression, then gate it: (version, the gate's Decision)."""
    import mlflow

    from models.ctr import CtrModel
    from models.dataset import Window, chronological_split, training_set
    from models.registry import connect, gate, load_version, log_model, version_tags

    served = load_version(s, champion)
    if not isinstance(served, CtrModel):
        raise WorldDrillError(f"v{champion} is not the platform's own model: the drill trains its architecture")
    root = champion
    while parent := version_tags(s, root).get("parent_version"):
        root = parent
    tags = version_tags(s, root)
    window = Window(datetime.fromisoformat(tags["data_start"]), datetime.fromisoformat(tags["data_end"]))
    ex, times = training_set(s, window, s.streaming.sequence_length, s.ranker.scenario)
    train, _, test, spans = chronological_split(ex, times)
    rng = np.random.default_rng([seed, 69])
    model = CtrModel(served.spec)
    model.adapt(train)
    t0 = time.monotonic()
    model.fit(shuffled(train, rng), progress=False)
    say(f"trained v{root}'s window ({window}, {len(train):,} examples) with its labels shuffled in "
        f"{time.monotonic() - t0:.0f} s")
    keep = ("kind", "data_start", "data_end")
    connect(s)
    mlflow.set_experiment(s.ranker.experiment)
    with mlflow.start_run(run_name="drill-shuffled"), tempfile.TemporaryDirectory() as tmp:
        version = log_model(s, model.save(Path(tmp) / "model"),
                            {k: v for k, v in tags.items() if k in keep} | {
                                "eval_start": spans["test"].split(" .. ")[0],
                                "eval_end": spans["test"].split(" .. ")[1], "parent_version": "", "drill": SHUFFLED})
    return version, gate(s, version, model, shuffled(test, rng), f"test window {spans['test']}, labels shuffled")


def run(s: Settings, within_s: float = 300.0, seed: int = 0, say: Callable[[str], None] = print) -> str:
    """The drill on the running stack of `s`; returns its line. WorldDrillError when it fails."""
    from flywheel.demo.loop import pause_when_idle
    from flywheel.demo.plan import LoopError
    from flywheel.demo.drills import wait_rolled_back
    from flywheel.world_traffic import WorldTraffic
    from infra.airflow_api import AirflowClient
    from infra.stack import unarchived
    from models.registry import CHAMPION, CONTROL, alias_version, aliases, connect, rollback, version_tags
    from serving.outcomes import RANK, auc_by_version, endpoints, served_outcomes
    from streaming.world import WORLD_FILE, World, load_world

    world = World(load_world(s.spec.path.parent / WORLD_FILE))
    if not s.canary.enabled:
        raise WorldDrillError("the canary is off (canary.enabled): the gate would give the regression every user "
                              "and nothing would judge it on live traffic")
    if CHAMPION not in aliases(connect(s), s.ranker.name):
        raise WorldDrillError(f"{s.ranker.name} has no @champion: the drill needs one serving (`make bench-drift`)")
    airflow = AirflowClient(s)
    was_paused = airflow.wait_for_dag("incremental_training")["is_paused"]
    pause_when_idle(airflow, "incremental_training", say)  # no version learnt from the regression's traffic
    at_s = max((c.at_s for c in world.spec.changes), default=0.0) + 1.0
    traffic = WorldTraffic(s, world, f"http://{s.serving.host}:{s.serving.port}", seed, at_s=at_s)
    traffic.thread.start()
    t0_ms = int(time.time() * 1000)
    say(f"the world's users at {traffic.rate:g}/s (world time {at_s:.0f} s on)")

    def alive() -> None:
        if traffic.error is not None:
            raise WorldDrillError(f"the traffic stopped: {type(traffic.error).__name__}: {traffic.error}")

    try:
        deadline = time.monotonic() + within_s  # a canary left without traffic ends under it
        while CONTROL in (named := aliases(connect(s), s.ranker.name)):
            if time.monotonic() > deadline:
                raise WorldDrillError(f"v{named[CHAMPION]}'s canary against v{named[CONTROL]} did not end within "
                                      f"{within_s:.0f} s of traffic: `flywheel logs canary-analyst`")
            alive()
            time.sleep(1)
        champion = named[CHAMPION]
        say(f"champion v{champion}, no canary in flight")
        bad, decision = register_shuffled(s, champion, seed, say)
        if not decision.promoted:
            raise WorldDrillError(f"the gate refused v{bad} ({decision.reason}): the drill needs a version it "
                                  "promotes")
        promoted_at = datetime.fromisoformat(version_tags(s, bad)["gate_at"])
        say(f"v{bad} ({SHUFFLED}) promoted by the gate: {decision.reason}; in its canary against v{champion}")
        try:
            tags = wait_rolled_back(s, bad, within_s, alive)
            alive()
        except BaseException as exc:  # the drill's version never stays in charge, whatever stopped the wait
            if alias_version(connect(s), s.ranker.name, CHAMPION) == bad:
                why = str(exc) or type(exc).__name__
                rollback(s, f"world-drill stopped: {why}", to=champion, who="world-drill")
                say(f"v{bad} rolled back to v{champion} by the drill itself: {why}")
            if isinstance(exc, LoopError):
                raise WorldDrillError(str(exc)) from None
            raise
    finally:
        traffic.stop.set()
        traffic.thread.join()
        airflow.set_paused("incremental_training", was_paused)
    rolled_back_at = datetime.fromisoformat(tags["rolled_back_at"])
    seconds = (rolled_back_at - promoted_at).total_seconds()
    unarchived(s, wait_s=60)
    served = served_outcomes(s, t0_ms, int(rolled_back_at.timestamp() * 1000))
    rank = served[(endpoints(served) == RANK) & (served["served_at"] >= promoted_at.timestamp() * 1000)] \
        if len(served) else served
    ctr = {row["model_version"]: row for row in auc_by_version(rank).to_dict("records")}
    control = tags["rolled_back_to"]
    for v in (bad, control):
        row = ctr.get(v)
        say(f"v{v} in the canary: " + ("no /rank list served" if row is None else
                                       f"{row['requests']:,} /rank lists, CTR {row['ctr']:.4f}, AUC per list "
                                       f"{row['list_auc']:.4f}"))
    say(f"the canary analysis: {tags.get('rolled_back_reason', '')}")
    b, c = (ctr[v]["ctr"] if v in ctr else float("nan") for v in (bad, control))
    return (f"world-drill: v{bad} (labels shuffled) rolled back {seconds:.0f} s after its promotion; served CTR "
            f"v{bad} {b:.4f} control v{control} {c:.4f} (ratio {b / c if c else float('nan'):.3f})")
