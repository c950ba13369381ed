"""The loop's stages in order (see the package's docstring): history, the first champion, live traffic
with the drills, the summary. Each stage that does not have its effect raises LoopError naming it."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from datetime import UTC, datetime

from feature_repo.catalog import load_catalog, materialize
from feature_repo.store import feature_store
from flywheel.datasets import stop_command
from flywheel.demo.drills import drills
from flywheel.demo.plan import LoopError, LoopPlan, Say, Summary
from flywheel.demo.probes import await_features, online_user, serving, wait_retrieval, wait_serving
from flywheel.demo.summary import report
from flywheel.demo.traffic import Traffic
from infra.airflow_api import AirflowClient
from infra.settings import Settings
from models.graph import graph_size
from models.metrics import RANKING_BASELINES
from models.registry import CHAMPION, CONTROL, alias_version, connect, list_versions, rollback, version_tags
from serving.client import endpoint
from serving.outcomes import percentiles
from streaming.history import history_events as past_events
from streaming.produce import count_landed, produce
from streaming.producer import EventProducer
from streaming.topics import end_offsets, ensure_topics


def run_loop(s: Settings, plan: LoopPlan, say: Say = print) -> Summary:
    """The whole loop on the running stack; raises LoopError naming the stage that failed. Whatever stops
    it, @champion is left on a version that passed (leave_last_good) and the way on is said."""
    try:
        return _run_loop(s, plan, say)
    except BaseException:  # an interrupt too: never a drill's inverted model left serving
        try:
            say(f"the demo stopped: {leave_last_good(s)}. The stack is still up: `flywheel versions` lists "
                f"the versions, `flywheel rollback --to N` moves @champion, `{stop_command(s)}` stops it")
        except Exception as exc:  # noqa: BLE001 - the registry away: the stage's own error is what to read
            say(f"the demo stopped, and @champion could not be checked: {type(exc).__name__}: {exc}")
        raise


def leave_last_good(s: Settings) -> str:
    """@champion on a version that passed: a drill's version (its output inverted) or one in its canary goes
    back to @control, else to the newest champion before it that is no drill. Says what it did."""
    client, name = connect(s), s.ranker.name
    champion = alias_version(client, name, CHAMPION)
    if champion is None:
        return "no @champion yet"
    drill = lambda v: version_tags(s, v).get("drill", "")  # noqa: E731
    control = alias_version(client, name, CONTROL)
    if not drill(champion) and control is None:
        return f"@champion v{champion} serves every user"
    target = control if control is not None and not drill(control) else champion
    while target and drill(target):
        target = version_tags(s, target).get("previous_champion", "")
    if not target:
        return f"@champion v{champion} ({drill(champion)}) has no earlier champion to go back to"
    what = f"the drill's model, {drill(champion)}" if drill(champion) else "in its canary"
    rollback(s, f"the demo stopped with v{champion} serving ({what})", to=target, who="flywheel-demo")
    return f"@champion v{champion} ({what}) rolled back to v{target}, which serves every user"


def _run_loop(s: Settings, plan: LoopPlan, say: Say) -> Summary:
    started, summary = time.monotonic(), Summary()
    server = f"http://{s.serving.host}:{s.serving.port}"
    history_end = history_events(s, plan, summary, say)
    airflow = AirflowClient(s)
    champion = first_champion(s, plan, airflow, summary, say)
    summary.first_served_s = wait_serving(server, champion, 300, say)
    first_retrieval(s, plan, history_end, airflow, summary, say)
    since_ms = int(time.time() * 1000)
    live(s, plan, server, airflow, summary, say)
    report(s, since_ms, summary)
    summary.seconds = time.monotonic() - started
    out = s.paths.data_dir / "demo"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=1, default=str))
    return summary


# --- 1. history ---------------------------------------------------------------------------------

def history_events(s: Settings, plan: LoopPlan, summary: Summary, say: Say) -> datetime:
    """Replays the history; returns the end of its event times (exclusive)."""
    topic = s.kafka.events_topic
    ensure_topics(s, [topic])
    events = list(past_events(s, plan.history_limit, int(plan.split.timestamp())))  # the spec's [events.history]
    store = feature_store(s)
    last = events[-1].user_id
    expected = (online_user(store, last)["user_impressions_total"] or 0) + sum(
        e.user_id == last and e.event_type in s.spec.exposures for e in events)
    start = end_offsets(s, topic)
    t0 = time.monotonic()
    with EventProducer(s, topic) as producer:
        sent = produce(events, producer, desc="history")
    landed = count_landed(s, topic, start, end_offsets(s, topic))
    if landed != sent.by_type:
        raise LoopError(f"Kafka topic {topic!r} holds {dict(landed)} of the history, the replay sent "
                        f"{dict(sent.by_type)}")
    summary.history_events = dict(landed)
    say(f"history: {sent.total:,} past events before {plan.split:%Y-%m-%d} in Kafka "
        f"({dict(sorted(landed.items()))}) in {sent.seconds:.1f}s")
    say(f"catalog (batch features) in the offline store and online: {load_catalog(s)}; "
        f"materialized {materialize(s)}")
    row = await_features(store, events, expected, plan.feature_timeout_s)
    say(f"Flink -> Feast caught up with the history {time.monotonic() - t0:.0f}s after the replay began. "
        f"Online features of user {row['user_id']}:")
    summary.user_features = row
    for name, value in row.items():
        if isinstance(value, list) and len(value) > 5:  # sequences: the newest 5; rankings: the top 5
            newest = name.startswith("seq_")
            value = f"{value[-5:] if newest else value[:5]} ({'newest' if newest else 'top'} 5 of {len(value)})"
        say(f"  {name:24} {value}")
    return datetime.fromtimestamp((max(e.event_time for e in events) + 1) / 1000, UTC)


# --- 2. the first champion ------------------------------------------------------------------------

def first_champion(s: Settings, plan: LoopPlan, airflow: AirflowClient, summary: Summary, say: Say) -> str:
    conf = {"data_start": plan.history_from.isoformat(), "data_end": plan.split.isoformat(), "baselines": True}
    t0 = time.monotonic()
    run_id = airflow.trigger("offline_training", conf)
    say(f"offline_training: run {run_id} triggered through Airflow with {conf} "
        f"({s.airflow.api_url}/dags/offline_training/runs/{run_id})")
    state = airflow.wait("offline_training", run_id, plan.training_timeout_s)
    if state != "success":
        raise LoopError(f"offline_training run {run_id} {state}: {airflow.task_states('offline_training', run_id)}; "
                        "see its task logs in the Airflow UI")
    trained = airflow.xcom("offline_training", run_id, "train")
    summary.offline_training_s = time.monotonic() - t0
    champion = alias_version(connect(s), s.ranker.name, CHAMPION)
    if champion is None:
        raise LoopError(f"offline_training registered v{trained['version']} but {s.ranker.name} has no @champion")
    summary.first_champion = champion
    metrics = {"ranker": "test_auc"} | {name: f"test_auc_{key}" for name, key in RANKING_BASELINES.items()}
    summary.ranker_auc = {name: trained[key] for name, key in metrics.items() if key in trained}
    say(f"offline_training: v{trained['version']} registered in {summary.offline_training_s:.0f}s "
        f"(test AUC {', '.join(f'{k} {v:.4f}' for k, v in summary.ranker_auc.items())}); @champion is v{champion}")
    return champion


def first_retrieval(s: Settings, plan: LoopPlan, history_end: datetime, airflow: AirflowClient, summary: Summary,
                    say: Say) -> None:
    """The recall sources of /recommend, from the history: graph_update (the behavior graph and its item
    neighbours; unpaused, it runs every `airflow.graph_update_minutes` after) and retrieval_training,
    side by side. A promoted retrieval version is indexed by the near-line embedder, then /recommend uses
    it; one the gate refuses leaves /recommend on graph and popularity recall."""
    conf = {"data_start": plan.history_from.isoformat(), "data_end": history_end.isoformat()}
    t0 = time.monotonic()
    runs = {"graph_update": airflow.trigger("graph_update"),
            "retrieval_training": airflow.trigger("retrieval_training", conf)}
    for dag_id, run_id in runs.items():
        state = airflow.wait(dag_id, run_id, plan.training_timeout_s)
        if state != "success":
            raise LoopError(f"{dag_id} run {run_id} {state}: {airflow.task_states(dag_id, run_id)}; see its task logs "
                            "in the Airflow UI")
    edges, items = graph_size(s)  # the run's own figures may be nothing: its scheduled run may come first
    say(f"graph_update: the behavior graph holds {edges:,} user-item edges; neighbours of {items:,} items "
        f"published ({s.airflow.api_url}/dags/graph_update)")
    run_id = runs["retrieval_training"]
    trained, gate = (airflow.xcom("retrieval_training", run_id, task) for task in ("train", "gate"))
    summary.retrieval = {"version": trained["version"], "recall": trained["recall"], "ndcg": trained["ndcg"],
                         "users": trained["users"], "promoted": gate["promoted"], "reason": gate["reason"],
                         "baselines": trained.get("baselines", {}), "seconds": time.monotonic() - t0}
    say(f"retrieval_training: v{trained['version']} of {s.retriever.name} in {time.monotonic() - t0:.0f}s, "
        f"recall@{s.retrieval.gate_k} {trained['recall']:.4f} on {trained['users']} users' next positives ("
        + ", ".join(f"{k} {b['recall']:.4f}" for k, b in summary.retrieval["baselines"].items())
        + f"); gate: {'promoted' if gate['promoted'] else 'refused'} ({gate['reason']})")
    if gate["promoted"]:
        summary.retrieval["current_s"] = wait_retrieval(s, trained["version"], 300)
        say(f"  the user embedder indexed it and embedded the users: /recommend uses v{trained['version']} "
            f"{summary.retrieval['current_s']:.0f}s after the gate")


# --- 3. live traffic and the drills -----------------------------------------------------------------

def live(s: Settings, plan: LoopPlan, server: str, airflow: AirflowClient, summary: Summary, say: Say) -> None:
    traffic = Traffic(s, plan, server)
    say(f"live: {len(traffic.sessions):,} sessions after {plan.split:%Y-%m-%d} as ranking requests at "
        f"{plan.rate:g}/s through {server}/rank (every {plan.recommend_every}th: /recommend for the session's user); "
        f"incremental_training every "
        f"{s.airflow.incremental_training_minutes} min")
    airflow.set_paused("incremental_training", False)
    traffic.thread.start()
    known = {r["version"] for r in list_versions(s)}
    deadline, tail_until, last_note = time.monotonic() + plan.live_timeout_s, None, time.monotonic()
    drilled = datetime.now(UTC)  # when the drills ended
    try:
        while tail_until is None or time.monotonic() < tail_until:
            if traffic.error is not None:
                raise LoopError(f"the live traffic stopped: {type(traffic.error).__name__}: {traffic.error}")
            if time.monotonic() > deadline:
                raise LoopError(f"live phase over {plan.live_timeout_s:.0f}s: incremental versions promoted "
                                f"{summary.incremental_promoted or 'none'}, rollback {summary.rollback or 'not done'}; "
                                f"see `flywheel versions` and the incremental_training runs at {s.airflow.api_url}")
            for row in list_versions(s):
                if row["version"] not in known and row["gate"]:
                    known.add(row["version"])
                    say(f"  v{row['version']} registered ({row['kind']}, parent v{row['parent'] or '-'}, data "
                        f"{row['data']}): gate {row['gate']}: {row['reason']}")
                    if row["parent"] and row["gate"] == "promoted" and not row["drill"]:
                        summary.incremental_promoted.append(row["version"])
            champion = alias_version(connect(s), s.ranker.name, CHAMPION)
            # The drills wait until live responses name the incremental champion (its AUC on served traffic).
            if tail_until is None and champion in summary.incremental_promoted and \
                    serving(server).get("champion") == champion and champion in traffic.served_versions():
                say(f"  ranking server follows: serving v{champion} (trained incrementally from served traffic)")
                drills(s, server, airflow, champion, summary, known, say)
                drilled, tail_until = datetime.now(UTC), time.monotonic() + plan.tail_s
            if time.monotonic() - last_note > 30:
                last_note = time.monotonic()
                ok = sum(r.status == 200 for r in traffic.results)
                say(f"  live: {len(traffic.results):,} requests answered ({ok:,} ok), serving "
                    f"{sorted(traffic.served_versions())}, {sum(traffic.events.values()):,} events sent")
            time.sleep(2)
        if plan.catch_up:
            catch_up(s, airflow, drilled, summary, say)
        # No version trained on the traffic after it: the demo's traffic ends, and a version promoted then
        # would wait in its canary for traffic to judge it by (two models on every batch meanwhile).
        pause_when_idle(airflow, "incremental_training", say)
        settle_canary(s, summary, say)  # judged on live traffic: it keeps flowing until then
    finally:
        traffic.stop.set()
        traffic.thread.join()
    summary.live_events = dict(traffic.events)
    summary.feature_freshness_s = traffic.probes.seconds
    summary.feature_probes_timed_out = traffic.probes.timed_out
    summary.requests = len(traffic.results)
    summary.statuses = {str(k): v for k, v in Counter(
        r.status if r.status != 503 else f"503 {r.body.get('reason')}" for r in traffic.results).items()}
    summary.latency_ms = percentiles([r.seconds for r in traffic.results if r.status == 200
                                      and endpoint(r.request) == "/rank"])
    answered = [r for r in traffic.results if r.status == 200 and endpoint(r.request) == "/recommend"]
    if answered:
        summary.recommended = {"user_id": answered[-1].request["user_id"],
                               "items": [x["item_id"] for x in answered[-1].body["items"][:10]]}
    summary.recommend_latency_ms = percentiles([r.seconds for r in traffic.results if r.status == 200
                                                and endpoint(r.request) == "/recommend"])


def catch_up(s: Settings, airflow: AirflowClient, since: datetime, summary: Summary, say: Say,
             timeout_s: float = 1200.0) -> None:
    """The rollback drill left @champion behind the live traffic, which the next scheduled run would learn
    minutes after the demo ends. An incremental_training run learns it now: the first to start after the
    drills (`since`), the scheduler's when it made one (one triggered beside a queued run would wait behind
    it: runs never overlap), else one triggered once the runs before are done. The stack the demo leaves
    is caught up, and a run after it has only what came later."""
    dag, deadline = "incremental_training", time.monotonic() + timeout_s
    run_id = None
    while run_id is None or airflow.run_state(dag, run_id) == "queued":  # its champion: the one it will find
        if time.monotonic() > deadline:
            raise LoopError(f"no {dag} run started within {timeout_s:.0f}s of the drills; see its runs in the "
                            "Airflow UI")
        runs = airflow.runs(dag)  # newest first
        after = [r for r in runs if r["state"] == "queued"
                 or r.get("start_date") and datetime.fromisoformat(r["start_date"]) >= since]
        if after:
            run_id = after[-1]["dag_run_id"]
        elif not any(r["state"] in ("queued", "running") for r in runs):
            airflow.trigger(dag)  # picked on the next pass, or a scheduled run queued before it is
            continue
        time.sleep(2)
    champion = alias_version(connect(s), s.ranker.name, CHAMPION)
    say(f"  catching up after the rollback: incremental_training run {run_id} from v{champion}")
    state = airflow.wait(dag, run_id, timeout_s)  # its own time: the runs before it may have taken much
    train = airflow.task_states(dag, run_id).get("train")
    if state != "success":
        raise LoopError(f"incremental_training run {run_id} after the rollback {state} (train {train}); see its "
                        f"task logs in the Airflow UI")
    newest = list_versions(s)[0]
    learned = newest if newest["parent"] == champion and newest["gate"] else None
    summary.catch_up = {"from": champion, "state": state, "train": train,
                        "version": learned["version"] if learned else None,
                        "gate": learned["gate"] if learned else None}
    say(f"  after the rollback: incremental_training from v{champion} {state} (train {train})"
        + (f": v{learned['version']} {learned['gate']}" if learned else ""))


def pause_when_idle(airflow: AirflowClient, dag_id: str, say: Say, tries: int = 3) -> None:
    """Pause the DAG with no run in flight. Airflow schedules no task of a paused DAG's running run: one the
    scheduler started just before the pause would register its version and never gate it. Such a run is
    dropped when none of its tasks has started, else let finish (unpaused meanwhile) and the pause taken
    again."""
    for _ in range(tries):
        airflow.set_paused(dag_id, True)
        running = []
        for run_id in airflow.active_runs(dag_id):
            if airflow.drop_unstarted(dag_id, run_id, "stopped before any task began: the demo paused the DAG "
                                                      "as its traffic ended"):
                say(f"  {dag_id} run {run_id}, made as the DAG was paused, dropped before it began")
            else:
                running.append(run_id)
        if not running:
            return
        airflow.set_paused(dag_id, False)
        for run_id in running:
            say(f"  waiting for {dag_id} run {run_id}, started as it was paused, to finish")
            airflow.wait(dag_id, run_id, 600)
    airflow.set_paused(dag_id, True)


def settle_canary(s: Settings, summary: Summary, say: Say, timeout_s: float = 90.0) -> None:
    """Wait until no canary runs (@control gone: the newest champion ramped to all traffic, or rolled back),
    so the stack the demo leaves serves one champion to everyone. Past `timeout_s` the canary lacks evidence
    (an honest version ramps after hundreds of judged lists a side, docs/concepts.md "Canary analysis":
    often more than the demo's traffic brings) and its traffic has ended, so no evidence will come: @champion
    goes back to @control, the last version that passed, which serves everyone; the summary says so. (A
    canary left running kept two models on every batch and the analyst re-reading the archives under any
    later load: serve-capacity fell from about 70,000 to 13,449 candidates/s.)"""
    client, t0 = connect(s), time.monotonic()
    while alias_version(client, s.ranker.name, CONTROL) is not None and time.monotonic() - t0 < timeout_s:
        time.sleep(2)
    control = alias_version(client, s.ranker.name, CONTROL)
    champion = alias_version(client, s.ranker.name, CHAMPION)
    tags = dict(client.get_model_version(s.ranker.name, champion).tags) if champion else {}
    said = tags.get("canary_decision") or tags.get("canary_status") or "none (no champion before)"
    if control is not None and champion not in (None, control):
        rollback(s, f"the demo's traffic ended before its canary had evidence: {said}", to=control, who="flywheel-demo")
        said = f"ended with the demo's traffic, v{champion} back to @control v{control}: {said}"
    summary.catch_up["canary"] = said
    say(f"  canary of v{champion}: {said} ({time.monotonic() - t0:.0f}s)")