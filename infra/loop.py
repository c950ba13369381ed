"""The platform's main job: the whole loop on the running stack (`flywheel demo`).

1. History: MovieLens-100k's ratings before `split` go into Kafka; the Flink job turns them into online
   features (waited for); the catalog (batch features) is loaded.
2. `offline_training` through Airflow on the history: the first @champion, which the ranking server
   (a stack service following the registry) loads by itself.
3. Live: the rest of MovieLens as traffic through the ranking API, one request per session (a user's
   ratings close together in time, as candidates), at `rate` requests/s. The scored items are shown in
   rank order: impressions, and clicks on those the user rated >= 4, go to Kafka now, with the request
   id (the prediction log joins them). `incremental_training` runs on its Airflow cadence from this
   served traffic, promotes versions that pass the gate, and the server follows.
4. Drills, once an incremental version serves: a deliberately bad version (the champion with its
   output inverted) is refused by the gate; the `model_rollback` DAG moves @champion back and the
   server follows.
5. The summary: events, feature freshness, versions and gate decisions, each version's AUC on the
   traffic it served, model freshness, serving latency. Also written to `<data_dir>/demo/`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from infra.airflow_api import AirflowClient
from infra.settings import Settings

if TYPE_CHECKING:
    from models.registry import Decision
    from serving.client import Served
    from serving.outcomes import Period
    from streaming.movielens import Session

Say = Callable[[str], None]
HISTORY_FEATURES = ["user_total:user_impressions_total", "user_total:user_clicks_total",
                    "user_total:user_ctr_total", "user_sequence:seq_item_ids", "user_interest:interest_categories",
                    "user_interest:interest_weights", "user_profile:user_age", "user_profile:user_occupation"]


class LoopError(RuntimeError):
    """A stage of the loop did not have its effect; the message says which and where to look."""


@dataclass(frozen=True)
class LoopPlan:
    split: datetime = datetime(1998, 3, 1, tzinfo=UTC)  # ratings before: history; from then on: live traffic
    history_from: datetime = datetime(1997, 9, 1, tzinfo=UTC)  # offline training window start
    history_limit: int | None = None  # replay at most this many history ratings (a shortened loop)
    sessions: int | None = None  # the first N live sessions (None: all after `split`), replayed in a cycle
    rate: float = 2.0  # live requests per second
    tail_s: float = 30.0  # live traffic kept up after the rollback is served
    feature_timeout_s: float = 900.0
    training_timeout_s: float = 1800.0
    live_timeout_s: float = 1800.0


@dataclass
class Summary:
    history_events: dict[str, int] = field(default_factory=dict)
    live_events: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    predictions_logged: int = 0
    feature_freshness_s: list[float] = field(default_factory=list)
    feature_probes_timed_out: int = 0  # not online within 60 s
    first_champion: str = ""
    offline_training_s: float = 0.0
    first_served_s: float = 0.0  # offline_training run finished -> its champion served
    statuses: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    versions: list[dict] = field(default_factory=list)  # registry rows, newest first
    served: list[dict] = field(default_factory=list)  # per version on live traffic: requests, items, auc, ...
    auc_over_time: list[dict] = field(default_factory=list)
    model_freshness_s: dict[str, float] = field(default_factory=dict)  # newest event in its data -> served
    incremental_promoted: list[str] = field(default_factory=list)
    refused_drill: dict[str, str] = field(default_factory=dict)
    rollback: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0


def run_loop(s: Settings, plan: LoopPlan, say: Say = print) -> Summary:
    """The whole loop on the running stack; raises LoopError naming the stage that failed."""
    from serving.outcomes import Period

    started, summary = time.monotonic(), Summary()
    server = f"http://{s.serving.host}:{s.serving.port}"
    history_events(s, plan, summary, say)
    airflow = AirflowClient(s)
    champion = first_champion(s, plan, airflow, summary, say)
    summary.first_served_s = wait_serving(server, champion, 300, say)
    period = Period.now(s)
    live(s, plan, server, airflow, summary, say)
    report(s, period, summary)
    summary.seconds = time.monotonic() - started
    out = s.paths.data_dir / "demo"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=1, default=str))
    return summary


# --- 1. history ---------------------------------------------------------------------------------

def history_events(s: Settings, plan: LoopPlan, summary: Summary, say: Say) -> None:
    from feature_repo.catalog import load_movielens, materialize
    from feature_repo.store import feature_store
    from streaming.movielens import replay_events
    from streaming.produce import count_landed, produce
    from streaming.producer import EventProducer
    from streaming.topics import end_offsets, ensure_topics

    topic = s.kafka.events_topic
    ensure_topics(s, [topic])
    events = list(replay_events(s, plan.history_limit, int(plan.split.timestamp())))
    store = feature_store(s)
    last = events[-1].user_id
    expected = (_online(store, last)["user_impressions_total"] or 0) + sum(
        e.user_id == last and e.event_type.value == "impression" for e in events)
    start = end_offsets(s, topic)
    t0 = time.monotonic()
    with EventProducer(s, topic) as producer:
        sent = produce(events, producer, desc="history")
    landed = count_landed(s, topic, start, end_offsets(s, topic))
    if landed != sent.by_type:
        raise LoopError(f"Kafka topic {topic!r} holds {dict(landed)} of the history, the replay sent "
                        f"{dict(sent.by_type)}")
    summary.history_events = dict(landed)
    say(f"history: {sent.total:,} events of the ratings before {plan.split:%Y-%m-%d} in Kafka "
        f"({dict(sorted(landed.items()))}) in {sent.seconds:.1f}s")
    say(f"catalog (batch features) in the offline store and online: {load_movielens(s)}; "
        f"materialized {materialize(s)}")
    row = await_features(store, events, expected, plan.feature_timeout_s)
    say(f"Flink -> Feast caught up with the history {time.monotonic() - t0:.0f}s after the replay began. "
        f"Online features of user {row['user_id']}:")
    for name, value in row.items():
        if isinstance(value, list) and len(value) > 5:  # sequences: the newest 5; rankings: the top 5
            newest = name.startswith("seq_")
            value = f"{value[-5:] if newest else value[:5]} ({'newest' if newest else 'top'} 5 of {len(value)})"
        say(f"  {name:24} {value}")


def _online(store, user: str) -> dict:
    from feature_repo.store import online_row

    return online_row(store, HISTORY_FEATURES, {"user_id": user})


def await_features(store, events: list, expected: int, timeout: float) -> dict:
    """Wait until the stream job and the ingestor have caught up with the history: the running total
    of its last user is `expected` (what was online before plus that user's impressions in it). Returns
    the online features of one of the most active users whose behavior sequence is online (the newest
    events' windows and sequences wait for the watermark, which the partition with the oldest last
    event holds back)."""
    impressions = Counter(e.user_id for e in events if e.event_type.value == "impression")
    last, deadline = events[-1].user_id, time.monotonic() + timeout
    while (got := _online(store, last)["user_impressions_total"] or 0) < expected:
        if time.monotonic() > deadline:
            raise LoopError(f"after {timeout:.0f}s user {last} has {got} of {expected} impressions online; "
                            "see `flywheel logs stream-job` and `flywheel logs feast-ingestor`")
        time.sleep(2)
    settle = time.monotonic() + 60  # the other views' topics can lag a little behind `user_total`
    while time.monotonic() < settle:
        for user, _ in impressions.most_common(20):
            if (row := _online(store, user))["seq_item_ids"] is not None:
                return row
        time.sleep(2)
    return _online(store, impressions.most_common(1)[0][0])


# --- 2. the first champion ------------------------------------------------------------------------

def first_champion(s: Settings, plan: LoopPlan, airflow: AirflowClient, summary: Summary, say: Say) -> str:
    from models.registry import CHAMPION, alias_version, connect

    conf = {"data_start": plan.history_from.isoformat(), "data_end": plan.split.isoformat()}
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
    champion = alias_version(connect(s), s.models.name, CHAMPION)
    if champion is None:
        raise LoopError(f"offline_training registered v{trained['version']} but {s.models.name} has no @champion")
    summary.first_champion = champion
    say(f"offline_training: v{trained['version']} registered in {summary.offline_training_s:.0f}s "
        f"(test AUC {trained.get('test_auc', float('nan')):.4f}); @champion is v{champion}")
    return champion


def serving(server: str) -> dict:
    return httpx.get(f"{server}/models", timeout=10).json()["serving"]


def wait_serving(server: str, version: str, timeout_s: float, say: Say | None = None) -> float:
    """Seconds until the ranking server serves `version` as champion."""
    t0, deadline = time.monotonic(), time.monotonic() + timeout_s
    while True:
        try:
            if serving(server).get("champion") == version:
                break
        except httpx.HTTPError:
            pass  # not up yet
        if time.monotonic() > deadline:
            raise LoopError(f"the ranking server at {server} does not serve v{version} after {timeout_s:.0f}s; "
                            "see `flywheel logs ranking-server`")
        time.sleep(0.2)
    if say:
        say(f"ranking server: serving v{version} as @champion ({time.monotonic() - t0:.1f}s after it was set)")
    return time.monotonic() - t0


# --- 3. live traffic -------------------------------------------------------------------------------

class Traffic:
    """The live replay: sessions -> /rank -> shown items -> impressions and clicks into Kafka; and
    probes of feature freshness (a user's events sent -> their running total online)."""

    def __init__(self, s: Settings, plan: LoopPlan, server: str) -> None:
        from feature_repo.store import feature_store
        from streaming.movielens import dataset_dir, load_item_categories, load_ratings, sessions
        from streaming.producer import EventProducer

        data = dataset_dir(s)
        split = int(plan.split.timestamp())
        self.sessions = sessions([r for r in load_ratings(data / "ml-100k.inter") if r.timestamp >= split]
                                 )[: plan.sessions]
        self.categories = load_item_categories(data / "ml-100k.item")
        self.s, self.plan, self.server = s, plan, server
        self.producer = EventProducer(s)
        self.store = feature_store(s)
        self.feast = ThreadPoolExecutor(1)  # one thread owns the feature store: probes are serialized
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.results: list[Served] = []  # in answer order
        self.events: Counter = Counter()
        self.freshness: list[float] = []
        self.probes_timed_out = 0
        self._probing, self._last_probe, self._last_sent = False, 0.0, {}
        self._by_id: dict[str, Session] = {}  # request id -> session, while in flight
        self.thread = threading.Thread(target=self._run, name="live-traffic")

    def requests(self) -> Iterator[dict]:
        """The sessions in order, then again from the first (new request ids) until stopped: the drills
        and the tail after them need traffic however long training took."""
        for sess in itertools.cycle(self.sessions):
            items = list(dict.fromkeys(r.item_id for r in sess.ratings))
            request_id = sess.request_id(int(time.time() * 1000))
            self._by_id[request_id] = sess
            yield {"user_id": sess.user_id, "request_id": request_id, "tier": "high",
                   "candidates": [{"item_id": i, "category": self.categories.get(i, "")} for i in items]}

    def _run(self) -> None:
        from serving.client import open_loop

        try:
            asyncio.run(open_loop(self.server, self.requests(), self.plan.rate, after=self._after,
                                  stop=self.stop.is_set))
            self.producer.flush()
        except Exception as exc:  # noqa: BLE001 - handed to the controller, which stops the loop with it
            self.error = exc
        finally:
            self.feast.shutdown(wait=True)

    async def _after(self, served: Served) -> None:
        try:
            await self._show(served)
        except Exception as exc:  # noqa: BLE001 - handed to the controller at once, which stops the loop with it
            self.error = exc
            self.stop.set()

    async def _show(self, served: Served) -> None:
        from streaming.movielens import served_events

        self.results.append(served)
        request_id = served.request["request_id"]
        sess = self._by_id.pop(request_id)
        if served.status != 200:
            return  # nothing was shown
        body = served.body
        shown = [item for _, item in sorted(((-score, item) for item, score in zip(
            (c["item_id"] for c in served.request["candidates"]), body["scores"]) if score is not None))]
        now = time.monotonic()
        # One probe in flight, every 5 s or more, of a user with no events in the last 30 s (whose
        # running total online is then settled before this request's impressions).
        probe = not self._probing and now - self._last_probe > 5 and now - self._last_sent.get(sess.user_id, -1e9) > 30
        if probe:
            self._probing, self._last_probe = True, now
            before = await asyncio.get_running_loop().run_in_executor(self.feast, self._total, sess.user_id)
        events = served_events(sess, request_id, shown, int(time.time() * 1000), self.s.movielens.click_min_rating,
                               self.categories, str(body["model_version"]))
        for event in events:
            self.producer.send(event)
            self.events[event.event_type.value] += 1
        self._last_sent[sess.user_id] = now
        if probe:
            self.feast.submit(self._wait_online, sess.user_id, (before or 0) + len(shown), time.monotonic())

    def _total(self, user: str) -> int | None:
        from feature_repo.store import online_row

        return online_row(self.store, ["user_total:user_impressions_total"], {"user_id": user})[
            "user_impressions_total"]

    def _wait_online(self, user: str, expected: int, sent: float) -> None:
        try:
            deadline = sent + 60
            while time.monotonic() < deadline:
                if (self._total(user) or 0) >= expected:
                    self.freshness.append(time.monotonic() - sent)
                    return
                time.sleep(0.05)
            self.probes_timed_out += 1
        finally:
            self._probing = False

    def served_versions(self) -> set[str]:
        return {str(r.body["model_version"]) for r in self.results[-50:] if r.status == 200}


def live(s: Settings, plan: LoopPlan, server: str, airflow: AirflowClient, summary: Summary, say: Say) -> None:
    from models.registry import CHAMPION, alias_version, connect, list_versions

    traffic = Traffic(s, plan, server)
    say(f"live: {len(traffic.sessions):,} sessions after {plan.split:%Y-%m-%d} as ranking requests at "
        f"{plan.rate:g}/s through {server}/rank; incremental_training every "
        f"{s.airflow.incremental_training_minutes} min")
    airflow.set_paused("incremental_training", False)
    traffic.thread.start()
    known = {r["version"] for r in list_versions(s)}
    deadline, tail_until, last_note = time.monotonic() + plan.live_timeout_s, None, time.monotonic()
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
            champion = alias_version(connect(s), s.models.name, CHAMPION)
            # The drills wait until live responses name the incremental champion (its AUC on served traffic).
            if tail_until is None and champion in summary.incremental_promoted and \
                    serving(server).get("champion") == champion and champion in traffic.served_versions():
                say(f"  ranking server follows: serving v{champion} (trained incrementally from served traffic)")
                drills(s, server, airflow, champion, summary, known, say)
                tail_until = time.monotonic() + plan.tail_s
            if time.monotonic() - last_note > 30:
                last_note = time.monotonic()
                ok = sum(r.status == 200 for r in traffic.results)
                say(f"  live: {len(traffic.results):,} requests answered ({ok:,} ok), serving "
                    f"{sorted(traffic.served_versions())}, {sum(traffic.events.values()):,} events sent")
            time.sleep(2)
    finally:
        traffic.stop.set()
        traffic.thread.join()
    for run_id in airflow.active_runs("incremental_training"):  # it trains on this traffic: let it finish
        say(f"  waiting for incremental_training run {run_id} to finish")
        airflow.wait("incremental_training", run_id, 600)
    summary.live_events = dict(traffic.events)
    summary.feature_freshness_s = traffic.freshness
    summary.feature_probes_timed_out = traffic.probes_timed_out
    summary.requests = len(traffic.results)
    summary.statuses = {str(k): v for k, v in Counter(
        r.status if r.status != 503 else f"503 {r.body.get('reason')}" for r in traffic.results).items()}
    from serving.outcomes import percentiles

    summary.latency_ms = percentiles([r.seconds for r in traffic.results if r.status == 200])


# --- 4. drills -----------------------------------------------------------------------------------

def drills(s: Settings, server: str, airflow: AirflowClient, champion: str, summary: Summary, known: set[str],
           say: Say) -> None:
    from models.registry import version_tags

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
    on inverted labels would rank) under the champion's own evaluation window, and run the gate."""
    import mlflow

    from models.registry import connect, load_version, log_model, version_tags
    from models.train import gate_version

    model = load_version(s, champion)
    for variable in model.network.trainable_variables[-2:]:  # the output layer's kernel and bias
        variable.assign(-variable)
    tags = {k: v for k, v in version_tags(s, champion).items()
            if k in ("kind", "data_start", "data_end", "eval_start", "eval_end")}
    connect(s)
    mlflow.set_experiment(s.models.experiment)
    with mlflow.start_run(run_name="drill-inverted"), tempfile.TemporaryDirectory() as tmp:
        version = log_model(s, model.save(Path(tmp) / "model"),
                            tags | {"parent_version": champion, "drill": "output inverted"})
    return version, gate_version(s, version)


# --- 5. the summary --------------------------------------------------------------------------------

def report(s: Settings, period: Period, summary: Summary) -> None:
    from models.registry import list_versions, version_tags
    from serving.outcomes import auc_by_version, auc_over_time, served_outcomes
    from streaming.topics import end_offsets

    outcomes = served_outcomes(s, period)
    summary.predictions_logged = outcomes["request_id"].nunique() if len(outcomes) else 0
    by_version = auc_by_version(outcomes)
    summary.served = by_version.to_dict("records")
    summary.auc_over_time = auc_over_time(outcomes, 30).to_dict("records")
    summary.versions = list_versions(s)
    for row in summary.served:
        tags = version_tags(s, row["model_version"])
        if tags.get("parent_version") and tags.get("eval_end") and "drill" not in tags:
            newest = datetime.fromisoformat(tags["eval_end"]).timestamp()
            summary.model_freshness_s[row["model_version"]] = row["first_served"] / 1000 - newest
    try:
        summary.dead_letters = sum(end_offsets(s, s.kafka.dlq_topic(s.kafka.events_topic)).values())
    except LookupError:
        summary.dead_letters = 0


def summary_lines(s: Settings, summary: Summary) -> list[str]:
    from serving.outcomes import percentiles

    def events(counts: dict[str, int]) -> str:
        return f"{sum(counts.values()):,} ({', '.join(f'{k} {v:,}' for k, v in sorted(counts.items()))})"

    fresh = percentiles(summary.feature_freshness_s, (50, 99))
    lines = [
        "", "=== Flywheel: the loop, summary ===",
        f"events into Kafka: history {events(summary.history_events)}; live {events(summary.live_events)}; "
        f"dead-lettered {summary.dead_letters}",
        f"live requests: {summary.requests:,} ({summary.statuses}); predictions logged and joined to clicks: "
        f"{summary.predictions_logged:,} requests",
        f"feature freshness (live events sent -> the user's running total online): p50 {fresh['p50'] / 1000:.2f}s, "
        f"p99 {fresh['p99'] / 1000:.2f}s ({len(summary.feature_freshness_s)} probes; "
        f"{summary.feature_probes_timed_out} not online within 60 s)",
        "serving latency (client side, 200s): " + ", ".join(f"{q} {ms:.1f} ms" for q, ms in summary.latency_ms.items()),
        f"offline_training (Airflow) -> first @champion v{summary.first_champion}: {summary.offline_training_s:.0f}s; "
        f"served {summary.first_served_s:.1f}s after the run finished",
        "model versions (newest first):"]
    served = {row["model_version"]: row for row in summary.served}
    for v in summary.versions:
        kind = (f"drill: {v['drill']}" if v["drill"] else f"incremental from v{v['parent']}" if v["parent"]
                else f"full ({v['kind']})")
        lines.append(f"  v{v['version']:<3} {('@' + v['aliases']) if v['aliases'] else '':<12} {kind:<22} "
                     f"gate {v['gate'] or '-'}: {v['reason'] or '-'}")
        if v["rolled_back"]:
            lines.append(f"       rolled back: {v['rolled_back']}")
        if (row := served.get(v["version"])) is not None:
            fresh_s = summary.model_freshness_s.get(v["version"])
            lines.append(f"       served {row['requests']:,} requests / {row['items']:,} items, CTR {row['ctr']:.3f}, "
                         f"AUC on the traffic it served {row['auc']:.4f}"
                         + (f"; model freshness (newest event in its data -> served) {fresh_s:.0f}s"
                            if fresh_s is not None else ""))
    if summary.refused_drill:
        d = summary.refused_drill
        lines.append(f"bad-model drill: v{d['version']} (output inverted) {d['gate']} by the gate: {d['reason']}")
    if summary.rollback:
        r = summary.rollback
        lines.append(f"rollback drill: model_rollback DAG v{r['from']} -> v{r['to']} in {r['dag_s']:.1f}s, served "
                     f"{r['served_after_dag_s']:.1f}s later")
    lines += [f"whole loop: {summary.seconds / 60:.1f} min",
              f"Airflow UI: {s.airflow.api_url} (user {s.airflow.username}; its password: `flywheel status`)",
              f"MLflow UI:  {s.mlflow.tracking_uri}/#/models/{s.models.name}",
              f"Ranking API: http://{s.serving.host}:{s.serving.port}/docs",
              f"Summary as JSON: {s.paths.data_dir / 'demo' / 'summary.json'}",
              "The stack keeps running (incremental_training on its cadence); stop it with `make down`."]
    return lines
