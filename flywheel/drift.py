"""Does minute-level learning pay? (`flywheel drift --dataset world`; `make bench-drift` on the bundled world, ~30
min on 2 cores.) A dataset's simulated world (world.toml beside its spec) on a fresh stack: after a warm-up of
learning, half of its users held on the champion of that moment (a frozen arm) while the other half follow
@champion as incremental_training (at its default cadence) promotes and the canary analysis ramps.

1. History into Kafka and Flink/Feast, the first champion trained through Airflow on all of it and served.
2. The world's users (flywheel/world_traffic.py) at the world's rate until `after_s` seconds past its first
   scheduled change, incremental_training learning from them from the start. Past `warmup_s` and once a version
   learnt from them has passed its canary (the first ones lift CTR by 8-12% on a world that has not changed: the
   history's lists were a logger's, the traffic's the model's own), an experiment (`flywheel experiment start
   --percent 50`) holds the champion of that moment: both arms serve one version until the learning arm's next.
3. From the prediction archive joined to the clicks (serving/experiments.py), /rank lists only: each arm's CTR
   from the experiment's start to the change and over the `after_s` seconds after it, the learning arm's over the
   frozen arm's with its 95% interval (clustered by user); per minute after the change, when the learning arm is
   back to 90% of its CTR before; clicks on the launched items in each arm (the arms are the same size at 50%);
   model freshness (the newest event a promoted version trained on -> its first served list, the median over the
   run's versions); the incremental versions promoted and served and how many the canary analysis rolled back; the first
   champion's AUC on the lists it served in the warm-up beside its AUC on its offline test part, both pooled over
   items (as the test AUC is) and the mean over lists with a click and a pass (as the canary judges).

Writes drift.png (CTR per arm per minute) and drift.json, and ends with one line: `drift: frozen CTR before F0 after
F1; learning before L0 after L1; ratio after R (95% CI LO-HI); learning recovered to P% of before in T s;
launched-item clicks learning A frozen B; model freshness M s`.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd

from infra.settings import Settings

RECOVERED = 0.9  # of the learning arm's CTR before the change


@dataclass(frozen=True)
class Drift:
    """The run's figures (CTRs: clicks per /rank item shown; NaN where an arm served nothing)."""

    frozen_before: float
    frozen_before_ci: tuple[float, float]
    learning_before: float
    learning_before_ci: tuple[float, float]
    frozen_after: float
    learning_after: float
    ratio_before: tuple[float, float, float]  # ratio, 95% low, high
    ratio_after: tuple[float, float, float]
    recovered_in_s: float | None  # from then on every minute of the learning arm at >= RECOVERED of its CTR before
    # (0: it never fell below; None: still below at the end)
    recovered_share: float  # the learning arm's CTR from then on (all of after when never back) over before
    launched_clicks: dict[str, int]  # per arm, after the change
    requests_before: dict[str, int]  # /rank requests per arm
    requests_after: dict[str, int]
    crossed: dict[str, int]  # after the change


def analyse(outcomes: pd.DataFrame, running, change_ms: int, end_ms: int, launched: set[str],
            bucket_s: float = 60.0) -> tuple[Drift, pd.DataFrame]:
    """The figures of /rank `outcomes` (serving/outcomes.py) of experiment `running` (models/registry.Experiment),
    its world changed at `change_ms`, measured until `end_ms`; and per arm per `bucket_s` (t: ms since the
    change)."""
    from serving.experiments import FROZEN, LEARNING, arms_of, compare, over_time

    before = outcomes[outcomes["served_at"] < change_ms]
    after = outcomes[(outcomes["served_at"] >= change_ms) & (outcomes["served_at"] < end_ms)]
    arms_before, ratio_before = compare(before, running)
    arms_after, ratio_after = compare(after, running)
    buckets = over_time(outcomes[outcomes["served_at"] < end_ms].assign(
        served_at=outcomes["served_at"] - change_ms), running, bucket_s)
    minutes = buckets[(buckets["arm"] == LEARNING) & (buckets["t"] >= 0)].sort_values("t")
    level = arms_before[LEARNING].ctr
    below = minutes[minutes["ctr"] < RECOVERED * level]["t"]
    back_s = (0.0 if not len(below) else None if below.iloc[-1] == minutes["t"].iloc[-1]
              else below.iloc[-1] / 1000 + bucket_s)
    since_back = after if back_s is None else after[after["served_at"] >= change_ms + back_s * 1000]
    back_ctr = compare(since_back, running)[0][LEARNING].ctr
    arm = arms_of(after, running) if len(after) else pd.Series(dtype=object)
    clicked = after[after["item_id"].isin(launched) & (after["label"] > 0)]
    return Drift(
        arms_before[FROZEN].ctr, (arms_before[FROZEN].low, arms_before[FROZEN].high),
        level, (arms_before[LEARNING].low, arms_before[LEARNING].high),
        arms_after[FROZEN].ctr, arms_after[LEARNING].ctr,
        (ratio_before.ratio, ratio_before.low, ratio_before.high),
        (ratio_after.ratio, ratio_after.low, ratio_after.high),
        back_s, back_ctr / level if level > 0 else float("nan"),
        {name: int((arm[clicked.index] == name).sum()) if len(clicked) else 0 for name in (LEARNING, FROZEN)},
        {name: arms_before[name].requests for name in (LEARNING, FROZEN)},
        {name: arms_after[name].requests for name in (LEARNING, FROZEN)},
        {name: a.crossed for name, a in arms_after.items()}), buckets


def headline(d: Drift, freshness_s: float | None) -> str:
    r, p = d.ratio_after, d.recovered_in_s
    fresh = "none promoted" if freshness_s is None else f"{freshness_s:.0f} s"
    return (f"drift: frozen CTR before {d.frozen_before:.4f} after {d.frozen_after:.4f}; learning before "
            f"{d.learning_before:.4f} after {d.learning_after:.4f}; ratio after {r[0]:.3f} (95% CI {r[1]:.3f}-"
            f"{r[2]:.3f}); learning recovered to {d.recovered_share:.1%} of before in "
            f"{'inf' if p is None else f'{p:.0f}'} s; launched-item clicks learning {d.launched_clicks['learning']} "
            f"frozen {d.launched_clicks['frozen']}; model freshness {fresh}")


class DriftError(RuntimeError):
    """The run could not measure what it set out to (no change in the world, the traffic stopped)."""


def _freshness(s, outcomes: pd.DataFrame) -> dict[str, float]:
    """Per incremental version promoted and served in `outcomes`: its first served list - its data's end."""
    from models.registry import list_versions, version_tags

    first = outcomes.groupby("model_version")["served_at"].min().to_dict() if len(outcomes) else {}
    out = {}
    for row in list_versions(s):
        tags = version_tags(s, row["version"])
        if row["parent"] and row["gate"] == "promoted" and not row["drill"] and row["version"] in first \
                and tags.get("eval_end"):
            out[row["version"]] = first[row["version"]] / 1000 - datetime.fromisoformat(tags["eval_end"]).timestamp()
    return out


def _promotions(s, first: str, served: set[str]) -> dict[str, list[str]]:
    """The incremental versions after `first` that their gate promoted and that served in the run (`served`: so that
    its canary judged them), and those the canary analysis rolled back (honest versions all: a run registers no
    drill)."""
    from models.registry import list_versions

    promoted = [r for r in list_versions(s) if int(r["version"]) > int(first) and r["parent"]
                and r["gate"] == "promoted" and not r["drill"] and r["version"] in served]
    return {"promoted": sorted((r["version"] for r in promoted), key=int),
            "rolled_back": sorted((r["version"] for r in promoted if r["rolled_back_by"] == "canary-analysis"),
                                  key=int)}


def offline_aucs(s, version: str) -> dict[str, float]:
    """The version's AUC on its own test part (the history's lists of its `eval_start`..`eval_end`, scored as
    served: at no position): pooled over the items (its test AUC) and the mean over the lists with a click and a
    pass (serving/outcomes.list_aucs, as the served one is), with how many lists judged it."""
    from contract.transform import to_examples
    from models.dataset import Window, training_frame
    from models.metrics import auc
    from models.registry import load_version, version_tags
    from serving.outcomes import list_aucs

    tags = version_tags(s, version)
    window = Window(datetime.fromisoformat(tags["eval_start"]),
                    datetime.fromisoformat(tags["eval_end"]) + timedelta(milliseconds=1))
    imps, joined = training_frame(s, window)
    labels = imps[[s.spec.objective_column(o.name) for o in s.spec.objectives] or ["label"]].to_numpy()
    examples = to_examples(joined, imps["request_time"].to_numpy(), labels, s.streaming.sequence_length)
    scores = np.asarray(load_version(s, version).predict(examples), float)
    lists = list_aucs(pd.DataFrame({"model_version": version, "route": "offline", "sources": None,
                                    "request_id": imps["request_id"].to_numpy(), "label": examples.labels,
                                    "score": scores}))
    return {"auc": auc(examples.labels, scores), "list_auc": float(lists["auc"].mean()), "judged": len(lists),
            "items": len(examples)}


def _learned(s, first: str) -> str | None:
    """The version an experiment would hold now (models/registry.start_experiment: @control's while a canary runs,
    else @champion's) once it is one after `first`, else None."""
    from models.registry import CHAMPION, CONTROL, aliases, connect

    named = aliases(connect(s), s.ranker.name)
    held = named.get(CONTROL) or named.get(CHAMPION)
    return held if held is not None and int(held) > int(first) else None


def json_ready(value: object) -> object:
    """NaN and infinities as null and numpy's numbers as JSON's, so that any JSON parser reads the output."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _plot(buckets: pd.DataFrame, change_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, colour in (("frozen", "tab:grey"), ("learning", "tab:blue")):
        rows = buckets[buckets["arm"] == arm].sort_values("t")
        minutes = (rows["t"] / 1000 + change_s) / 60
        ax.plot(minutes, rows["ctr"], marker="o", color=colour, label=f"{arm} arm")
        ax.fill_between(minutes, rows["low"], rows["high"], color=colour, alpha=0.2)
    ax.axvline(change_s / 60, color="tab:red", linestyle=":", label="the world changes")
    ax.set(xlabel="minutes of traffic", ylabel="served CTR per minute (95% CI)",
           title="A frozen champion vs the champion as it learns, the same world")
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def _traffic_until(traffic, until_s: float, say: Callable[[str], None],
                   ready: Callable[[], bool] = lambda: False) -> None:
    """The traffic on until `until_s` world seconds or until `ready()` (asked each second), a line a minute."""
    while traffic.now_s() < until_s and not ready():
        if traffic.error is not None:
            raise DriftError(f"the traffic stopped: {type(traffic.error).__name__}: {traffic.error}")
        minute = int(traffic.now_s() // 60)
        time.sleep(1.0)
        if int(traffic.now_s() // 60) > minute:
            ok = sum(r.status == 200 for r in traffic.results)
            say(f"{minute + 1:>2} min: {ok:,} answered, {len(traffic.results) - ok:,} refused; events "
                f"{dict(traffic.events)}")


def run(s: Settings, percent: float = 50.0, after_s: float = 600.0, warmup_s: float = 240.0, out: Path | None = None,
        say: Callable[[str], None] = print) -> str:
    """The run on the stack of `s` (its data directory empty or stopped and emptied first), left up; the figures
    in `out` (default `<data_dir>/drift`); returns the headline."""
    from flywheel.demo.loop import first_champion, history_events, pause_when_idle
    from flywheel.demo.plan import LoopPlan, Summary
    from flywheel.demo.probes import wait_serving
    from flywheel.world_traffic import WorldTraffic
    from infra.airflow_api import AirflowClient
    from infra.stack import unarchived, up
    from models.registry import experiment, start_experiment, stop_experiment
    from serving.outcomes import RANK, auc_by_version, endpoints, served_outcomes
    from streaming.history import history_events as past_events
    from streaming.world import WORLD_FILE, World, load_world

    t_start, out = time.monotonic(), out or s.paths.data_dir / "drift"
    world = World(load_world(s.spec.path.parent / WORLD_FILE))
    if not world.spec.changes:
        raise DriftError(f"{world.spec.path}: no [[changes]] to measure learning against")
    change_s = world.spec.changes[0].at_s
    if change_s < warmup_s + 120:
        raise DriftError(f"{world.spec.path}: its first change at {change_s:.0f} s leaves under 2 minutes after a "
                         f"warm-up of {warmup_s:.0f} s to measure the arms before it")
    launched = set(world.item_ids[np.isfinite(world.launch_at)])
    say(f"stack up: started {', '.join(up(s, say=say)) or 'nothing'}; data in {s.paths.data_dir}")
    last_ms = max(e.event_time for e in past_events(s))
    split = datetime.fromtimestamp(last_ms // 86_400_000 * 86_400, UTC) + timedelta(days=1)  # all of the history
    plan, summary = LoopPlan.of(s, split), Summary()
    history_events(s, plan, summary, say)
    airflow = AirflowClient(s)
    champion = first_champion(s, plan, airflow, summary, say)
    server = f"http://{s.serving.host}:{s.serving.port}"
    wait_serving(server, champion, 300, say)
    airflow.set_paused("incremental_training", False)
    traffic = WorldTraffic(s, world, server)
    traffic.thread.start()
    t0_ms, until_s = int(traffic.started * 1000), change_s + after_s
    say(f"the world's users at {traffic.rate:g}/s for {until_s:.0f} s, incremental_training every "
        f"{s.airflow.incremental_training_minutes} min; it changes at {change_s:.0f} s: "
        + ", ".join(str(c.what) for c in world.spec.changes if c.at_s == change_s))
    try:
        _traffic_until(traffic, warmup_s, say)
        _traffic_until(traffic, change_s - 120, say, lambda: _learned(s, champion) is not None)
        if _learned(s, champion) is None:
            raise DriftError(f"no version learnt from the traffic passed a canary within {change_s - 120:.0f} s: "
                             "`flywheel versions`, `flywheel logs canary-analyst`")
        running = start_experiment(s, percent)
        exp_ms = int(running.started_at.timestamp() * 1000)
        say(f"experiment at {traffic.now_s():.0f} s: @holdout v{running.version} on {running.percent:g}% of users, "
            "the others on @champion as it learns")
        _traffic_until(traffic, until_s, say)
    finally:  # the stack left as the demo leaves it: no traffic, no learning from none, every user on @champion
        traffic.stop.set()
        traffic.thread.join()
        try:
            if experiment(s) is not None:
                stop_experiment(s)
        finally:
            pause_when_idle(airflow, "incremental_training", say)
    end_ms = t0_ms + int(until_s * 1000)
    unarchived(s, wait_s=60)
    served = served_outcomes(s, t0_ms, end_ms)
    rank = served[endpoints(served) == RANK] if len(served) else served
    drift, buckets = analyse(rank[rank["served_at"] >= exp_ms], running, t0_ms + int(change_s * 1000), end_ms,
                             launched)
    if not all(drift.requests_before.values()) or not all(drift.requests_after.values()):
        raise DriftError(f"an arm served no /rank list to measure: before the change {drift.requests_before}, "
                         f"after {drift.requests_after} (the prediction archive of {s.paths.data_dir})")
    fresh, versions = _freshness(s, served), _promotions(s, champion, set(served["model_version"]))
    warm = rank[(rank["served_at"] < exp_ms) & (rank["model_version"] == champion)]
    first = auc_by_version(warm).to_dict("records")
    out.mkdir(parents=True, exist_ok=True)
    _plot(buckets, change_s, out / "drift.png")
    record = {"drift": asdict(drift), "freshness_s": fresh, "buckets": buckets.to_dict("records"),
              "first_champion": {"version": champion, "served": first},
              "versions": versions, "holdout": running.version, "percent": running.percent,
              "experiment_at_s": (exp_ms - t0_ms) / 1000, "change_s": change_s, "after_s": after_s,
              "minutes": (time.monotonic() - t_start) / 60}

    def write() -> None:
        (out / "drift.json").write_text(json.dumps(json_ready(record), indent=1, default=str, allow_nan=False))

    write()  # the run's record kept whatever the offline scoring below does
    offline = record["first_champion"]["offline"] = offline_aucs(s, champion)
    write()
    for row in first:
        say(f"first champion v{champion}: served /rank AUC {row['auc']:.4f} pooled, {row['list_auc']:.4f} per list "
            f"({row['judged']:,} judged of its {row['requests']:,} lists in the warm-up); on its offline test part "
            f"{offline['auc']:.4f} pooled, {offline['list_auc']:.4f} per list ({offline['judged']:,} judged)")
    b, a = drift.ratio_before, drift.requests_after
    say(f"from the experiment to the change: learning / frozen {b[0]:.3f} (95% CI {b[1]:.3f}-{b[2]:.3f}); frozen "
        f"CTR 95% {drift.frozen_before_ci[0]:.4f}-{drift.frozen_before_ci[1]:.4f}, learning "
        f"{drift.learning_before_ci[0]:.4f}-{drift.learning_before_ci[1]:.4f}")
    per = {arm: 1000 * drift.launched_clicks[arm] / a[arm] for arm in a}
    say(f"after: /rank requests learning {a['learning']:,} frozen {a['frozen']:,}; launched-item clicks per 1,000 "
        f"requests learning {per['learning']:.1f} frozen {per['frozen']:.1f}; items served by the other arm's model "
        f"{drift.crossed}; model freshness per version " + (", ".join(f"v{v} {f:.0f} s" for v, f in fresh.items())
                                                             or "none"))
    say(f"incremental versions promoted and served {len(versions['promoted'])} "
        f"(v{', v'.join(versions['promoted']) or '-'}), "
        f"rolled back by the canary analysis {len(versions['rolled_back'])}"
        + (f" (v{', v'.join(versions['rolled_back'])})" if versions["rolled_back"] else ""))
    say(f"figures in {out}; whole run {record['minutes']:.1f} min")
    return headline(drift, statistics.median(fresh.values()) if fresh else None)
