"""The Airflow DAGs: they parse without importing the heavy packages, and each one, run with
`dag.test()` against the real stack (broker, stream job, feature store, MLflow, FalkorDB), has its
effect; offline training also runs through Airflow's REST API, scheduler and executor.

The tests of this module share one stack and run in order: synthetic traffic for training, a first
champion, traffic after it for incremental training, then rollback, materialization and the graph.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from feature_repo.catalog import write_snapshot
from feature_repo.definitions import ITEM_ATTRIBUTES
from feature_repo.event_log import read_event_log
from feature_repo.store import feature_store, online_row
from infra.airflow_api import AirflowApiError, AirflowClient
from infra.services import airflow_env
from infra.settings import Settings, override, to_environ
from models import graph
from models.registry import CHAMPION, alias_version, connect, list_versions, version_tags
from streaming.events import Event
from streaming.producer import EventProducer
from streaming.synthetic import SyntheticConfig, SyntheticGenerator
from tests.conftest import REPO, run_cli, running_stack, stack_environ, wait_for
from tests.ctr_data import write_user_nets

MINUTE = 60_000
STEP_MS = 3_000  # event time between synthetic requests
TRAFFIC = SyntheticConfig(users=200, items=150, categories=6, clusters=3, preferred_per_cluster=2,
                          base_logit=-1.5, affinity_weight=1.5, seed=11,
                          test_traffic=False,  # traffic to learn from
                          scenarios=("home", "browse"))  # requests served on two surfaces in turn
SCENARIOS = '\n[scenarios.home]\n\n[scenarios.browse]\n'  # each with a ranker of its own


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def run_dag(environ: dict[str, str], dag_id: str, conf: dict | None = None, **extra: str) -> dict:
    """One `dag.test()` run in a child process: {"state", "tasks": {id: state}, "values": {id: return}}."""
    done = subprocess.run([sys.executable, "-m", "tests.run_dag", dag_id, json.dumps(conf or {})],
                          env=environ | extra, cwd=REPO, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"{dag_id}: no result (exit {done.returncode})\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(results[-1][len("RESULT "):])


def test_dags_parse_fast_without_heavy_imports(tmp_path: Path) -> None:
    environ = stack_environ(tmp_path) | {"AIRFLOW_HOME": str(tmp_path / "airflow")}
    done = subprocess.run([sys.executable, "-m", "tests.run_dag", "--parse"], env=environ, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    parsed = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert parsed["errors"] == {}
    assert parsed["dags"] == ["feature_consistency", "feature_materialization", "graph_update", "incremental_training",
                              "model_rollback", "offline_training", "retrieval_training"]
    assert parsed["heavy"] == []  # TensorFlow, MLflow, Feast, ... load in tasks, not while parsing
    assert parsed["settings_loaded"] is False  # nor are the settings: no config file is read while parsing


def test_dag_schedules_and_defaults_follow_the_settings_the_stack_hands_airflow(tmp_path: Path) -> None:
    environ = stack_environ(tmp_path) | {"AIRFLOW_HOME": str(tmp_path / "airflow"),
                                         "FLYWHEEL_AIRFLOW_INCREMENTAL_TRAINING_MINUTES": "7",
                                         "FLYWHEEL_MODELS_NAME": "ctr-elsewhere"}
    done = subprocess.run([sys.executable, "-c", """
import json
from airflow.dag_processing.dagbag import BundleDagBag
from infra.settings import setting_from_environ
dags = setting_from_environ("paths", "dags_dir")
dag = BundleDagBag(dag_folder=str(dags), bundle_path=dags).dags["incremental_training"]
print("RESULT " + json.dumps([str(dag.timetable.delta), dag.params["model_name"]]))
"""], env=environ, cwd=REPO, capture_output=True, text=True, timeout=120)
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    assert json.loads(result[7:]) == ["0:07:00", "ctr-elsewhere"], done.stderr[-2000:]


def test_trigger_refuses_bad_parameters_and_reports_an_unreachable_airflow(tmp_path: Path) -> None:
    environ = stack_environ(tmp_path)
    bad = run_cli(environ, "trigger", "offline_training", "--conf", "[1]")
    assert bad.returncode == 2 and "must be a JSON object" in bad.stderr
    down = run_cli(environ, "trigger", "offline_training")
    assert down.returncode == 1 and "unreachable" in down.stderr and "Traceback" not in down.stderr
    unknown = run_cli(environ, "trigger", "offline_training", "--scenario", "checkout")
    assert unknown.returncode == 2 and "checkout" in unknown.stderr and "Traceback" not in unknown.stderr


def test_a_scheduled_incremental_run_continues_each_ranker_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """With scenarios declared, scheduled runs continue the ranker waiting longest among those with new events:
    every ranker in turn, none that has nothing new or no champion to continue."""
    from infra.settings import RANKER, RegisteredModel

    monkeypatch.syspath_prepend(str(REPO / "dags"))  # as the task runner imports it
    from task_settings import due

    platform, home, browse = (RegisteredModel(n, "e", RANKER, sc) for n, sc in (("r", None), ("r-home", "home"),
                                                                                  ("r-browse", "browse")))
    at = lambda minute: datetime(2026, 1, 1, 0, minute, tzinfo=UTC)  # noqa: E731
    assert due({platform: at(4), home: at(2), browse: None}, at(5)) == home  # browse: no champion yet
    assert due({platform: at(4), home: at(6), browse: at(3)}, at(5)) == browse  # home: nothing since its watermark
    assert due({platform: at(4), home: at(4), browse: at(4)}, at(5)) == platform  # a tie: in the declared order
    assert due({platform: at(6), home: at(6)}, at(5)) is None and due({platform: at(1)}, None) is None


@dataclass
class Platform:
    s: Settings
    environ: dict[str, str]  # for `dag.test()` runs: the stack's settings, an Airflow database of their own
    start_ms: int  # first synthetic event
    produced: list[Event]
    generator: SyntheticGenerator

    def produce(self, start_ms: int, requests: int) -> int:
        """`requests` synthetic requests from start_ms, STEP_MS apart; waits until the event log and the
        online store have them all.
        Returns the first event time after the traffic."""
        times: list[int] = []

        def clock() -> int:
            times.append(start_ms + len(times) * STEP_MS)
            return times[-1]

        events = []
        for e in self.generator.events(now_ms=clock):
            if len(times) > requests:
                break
            events.append(e)
        end = start_ms + requests * STEP_MS
        with EventProducer(self.s) as producer:
            for e in events:
                producer.send(e)
        self.produced += events
        last = events[-1].user_id
        impressions = sum(e.user_id == last and e.event_type == "impression" for e in self.produced)
        store = feature_store(self.s)

        def caught_up() -> None:
            assert online_row(store, ["user_total:user_impressions_total"], {"user_id": last})[
                "user_impressions_total"] == impressions

        wait_for(caught_up, timeout_s=300)
        return end + 10 * MINUTE


def test_the_api_client_asks_again_after_airflows_database_was_locked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On SQLite a write of the API server fails with "Database error" when the scheduler holds the lock
    for over 5 s; the request rolled back, so the client repeats it. Any other error is raised at once."""
    answers = {"/api/v2/dags/a": [500, 500, 200], "/api/v2/dags/b": [500] * 5, "/api/v2/dags/c": [404, 200]}
    calls: Counter = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        status = answers[request.url.path][calls[request.url.path]]
        calls[request.url.path] += 1
        body = {"detail": {"reason": "Database error"}} if status == 500 else {"is_paused": False}
        return httpx.Response(status, json=body)

    monkeypatch.setattr("infra.airflow_api.time.sleep", lambda s: None)
    client = AirflowClient.__new__(AirflowClient)
    client.http = httpx.Client(base_url="http://airflow/api/v2", transport=httpx.MockTransport(handler))
    assert client._call("PATCH", "/dags/a", json={"is_paused": False}) == {"is_paused": False}
    with pytest.raises(AirflowApiError, match="HTTP 500"):
        client._call("PATCH", "/dags/b", json={"is_paused": False})
    with pytest.raises(AirflowApiError, match="HTTP 404"):
        client._call("GET", "/dags/c")
    assert calls == {"/api/v2/dags/a": 3, "/api/v2/dags/b": 4, "/api/v2/dags/c": 1}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data = tmp_path_factory.mktemp("platform")
    patch = pytest.MonkeyPatch()  # a user's package of networks, importable in the stack's processes
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(data / "nets"), os.environ.get("PYTHONPATH")])))
    write_user_nets(data / "nets")
    # No scheduled training: unpausing offline_training for the REST test would start a daily run too.
    spec = data / "dataset.toml"  # the default dataset, with the traffic's two scenarios declared
    spec.write_text((REPO / "datasets" / "movielens" / "dataset.toml").read_text() + SCENARIOS)
    services = running_stack(data, "kafka,redis,mlflow,airflow,pipeline", FLYWHEEL_GRAPH_ALLOWED_LATENESS_S="0",
                             FLYWHEEL_AIRFLOW_FULL_TRAINING_SCHEDULE="", FLYWHEEL_DATASET_SPEC=str(spec))
    s = next(services)
    try:
        home = data / "airflow-dag-test"  # away from the running scheduler's database
        # no FLYWHEEL_* of the developer (stack_environ), this stack's settings (to_environ)
        environ = (stack_environ(data) | airflow_env(s) | to_environ(s) |
                   {"AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db"})
        subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=environ, check=True,
                       capture_output=True, timeout=300)
        start = int(datetime.now(UTC).timestamp() * 1000) - 6 * 60 * MINUTE
        yield Platform(s, environ, start, [], SyntheticGenerator(TRAFFIC))
    finally:
        services.close()  # stops the stack
        patch.undo()


@pytest.fixture(scope="module")
def first_window(platform: Platform) -> tuple[int, int]:
    """An hour of traffic (1200 requests), logged and online; the window that holds it."""
    end = platform.produce(platform.start_ms, requests=1200)
    return platform.start_ms, end + MINUTE


@pytest.fixture(scope="module")
def later_traffic(platform: Platform, first_window: tuple[int, int]) -> int:
    """Half an hour more, after the first window; returns its first event time."""
    start = first_window[1] + 5 * MINUTE
    platform.produce(start, requests=600)
    return start



@pytest.mark.stack
def test_offline_training_registers_and_promotes_the_first_champion(platform: Platform, first_window) -> None:
    s, (start, end) = platform.s, first_window
    run = run_dag(platform.environ, "offline_training", {"data_start": iso(start), "data_end": iso(end)})
    assert run["state"] == "success", run
    assert run["tasks"] == {"train": "success", "promotion_asked": "success", "gate": "success"}
    version = run["values"]["train"]["version"]
    assert version == "1" and run["values"]["train"]["test_auc"] > 0.6  # users' category preferences learnt
    assert run["values"]["gate"]["promoted"] is True
    assert alias_version(connect(s), s.models.name, CHAMPION) == "1"
    tags = version_tags(s, "1")
    assert (tags["data_start"], tags["data_end"], tags["gate_decision"]) == (iso(start), iso(end), "promoted")


@pytest.mark.stack
def test_each_scenarios_ranker_is_trained_by_the_dag_on_its_own_traffic(platform: Platform, first_window) -> None:
    """A run naming a scenario trains, registers and gates that scenario's ranker on the exposures served on its
    surface: the two scenarios' training sets split the window's exposures between them. The platform's ranker
    is untouched."""
    from models.dataset import Window, labelled_impressions

    s, (start, end) = platform.s, first_window
    conf = {"data_start": iso(start), "data_end": iso(end)}
    # One epoch each: what is asserted is whose exposures each ranker trains on, not how well it learns them.
    runs = {sc: run_dag(platform.environ, "offline_training", conf | {"scenario": sc}, FLYWHEEL_MODELS_MAX_EPOCHS="1")
            for sc in ("home", "browse")}
    for scenario, run in runs.items():
        model = s.scenarios[scenario]
        assert run["tasks"] == {"train": "success", "promotion_asked": "success", "gate": "success"}, run
        assert run["values"]["train"]["version"] == "1" and run["values"]["gate"]["promoted"], run["values"]
        assert alias_version(connect(s), model.name, CHAMPION) == "1"
        assert version_tags(s, "1", model)["scenario"] == scenario
    window = Window(datetime.fromtimestamp(start / 1000, UTC), datetime.fromtimestamp(end / 1000, UTC))
    every = len(labelled_impressions(s, window))
    home, browse = (runs[sc]["values"]["train"]["examples"] for sc in ("home", "browse"))
    assert home + browse == every and abs(home - browse) <= TRAFFIC.slate_size, (home, browse, every)
    assert [v["version"] for v in list_versions(s)] == ["1"]  # the platform's ranker: its own first champion only


@pytest.mark.stack
def test_incremental_training_skips_when_there_is_no_new_data(platform: Platform, first_window) -> None:
    run = run_dag(platform.environ, "incremental_training")
    assert run["state"] == "success"
    assert run["tasks"] == {"train": "skipped", "promotion_asked": "skipped", "gate": "skipped"}  # one task started
    assert [v["version"] for v in list_versions(platform.s)] == ["1"]  # nothing registered


@pytest.mark.stack
def test_incremental_training_continues_the_champion_and_publishes_its_delta(platform: Platform, later_traffic: int,
                                                                             tmp_path: Path) -> None:
    """With the sparse tier on for this run and v1 in the embedding store as registration writes it, the run
    continues v1 from the store (only its window's rows) and registers its delta, which MLflow resolves
    through v1: the version is v1 continued whole on the same window."""
    import numpy as np

    from models.dataset import Window, training_set
    from models.registry import load_version
    from models.sparse_tier import publish, store

    s = platform.s
    tier = override(s, "sparse_tier", enabled=True)
    publish(tier, "1", "", load_version(s, "1").save(tmp_path / "v1"), None, keep={"1"})
    # A tolerance that admits any candidate, so this run is promoted and the rollback below has a
    # previous champion to return to.
    run = run_dag(platform.environ, "incremental_training", FLYWHEEL_MODELS_MAX_AUC_DROP="1.0",
                  FLYWHEEL_SPARSE_TIER_ENABLED="true")
    assert run["tasks"] == {"train": "success", "promotion_asked": "success", "gate": "success"}, run
    tags = version_tags(s, "2")
    assert tags["parent_version"] == "1" and tags["data_start"] == version_tags(s, "1")["data_end"]
    assert datetime.fromisoformat(tags["eval_start"]).timestamp() * 1000 >= later_traffic
    assert tags["sparse_delta"].startswith("runs:/") and tags["sparse_delta"].endswith("/delta")
    assert tags["previous_champion"] == "1" and alias_version(connect(s), s.models.name, CHAMPION) == "2"
    client = connect(s)
    params = client.get_run(client.get_model_version(s.models.name, "2").run_id).data.params
    assert params["warm_start"] == "store" and tags["sparse_base"] == "1" and store(tier).info("2").parent == "1"
    window = Window(datetime.fromisoformat(tags["data_start"]), datetime.fromisoformat(tags["data_end"]))
    ex, _ = training_set(s, window, s.streaming.sequence_length)
    whole = load_version(s, "1")
    whole.fit(ex.take(slice(0, int(len(ex) * 0.8))), progress=False)  # train_incremental's training part
    np.testing.assert_allclose(load_version(s, "2").predict(ex), whole.predict(ex), rtol=0, atol=1e-6)


@pytest.mark.stack
def test_model_rollback_moves_the_alias_back_or_refuses(platform: Platform, later_traffic: int) -> None:
    s = platform.s
    refused = run_dag(platform.environ, "model_rollback", {"version": "99", "reason": "no such version"})
    assert refused["state"] == "failed" and refused["tasks"]["rollback"] == "failed"
    assert alias_version(connect(s), s.models.name, CHAMPION) == "2"

    run = run_dag(platform.environ, "model_rollback", {"version": "previous", "reason": "CTR dropped in the canary"})
    assert run["tasks"] == {"rollback": "success", "verify": "success"}
    assert run["values"]["rollback"] == {"from": "2", "to": "1"}
    assert alias_version(connect(s), s.models.name, CHAMPION) == "1"
    tags = version_tags(s, "2")
    assert tags["rolled_back_reason"] == "CTR dropped in the canary" and tags["rolled_back_by"].startswith("airflow:")


@pytest.mark.stack
def test_retrieval_training_registers_gates_on_recall_and_rolls_back(platform: Platform, first_window,
                                                                     later_traffic: int) -> None:
    s, name = platform.s, platform.s.retrieval.name
    end = later_traffic + 31 * MINUTE
    conf = {"data_start": iso(first_window[0]), "data_end": iso(end)}
    judged_on_later = {"FLYWHEEL_RETRIEVAL_EVAL_DAYS": str(32 / 1440), "FLYWHEEL_RETRIEVAL_GATE_MIN_USERS": "10"}
    run = run_dag(platform.environ, "retrieval_training", conf, **judged_on_later)
    assert run["tasks"] == {"train": "success", "promotion_asked": "success", "gate": "success"}, run
    trained = run["values"]["train"]
    assert trained["version"] == "1" and trained["users"] >= 10 and trained["recall"] > 0
    assert run["values"]["gate"]["promoted"] and alias_version(connect(s), name, CHAMPION) == "1"
    tags = connect(s).get_model_version(name, "1").tags
    assert datetime.fromisoformat(tags["eval_start"]).timestamp() * 1000 < later_traffic
    assert tags["kind"] == "two-tower" and tags["gate_decision"] == "promoted"

    # The gate compares with the champion on the same window: no tolerance refuses a worse version.
    again = run_dag(platform.environ, "retrieval_training", conf, **judged_on_later,
                    FLYWHEEL_RETRIEVAL_MAX_RECALL_DROP="-1.0")
    assert again["values"]["gate"]["promoted"] is False and "champion v1's" in again["values"]["gate"]["reason"]
    promoted = run_dag(platform.environ, "retrieval_training", conf, **judged_on_later,
                       FLYWHEEL_RETRIEVAL_MAX_RECALL_DROP="1.0")
    assert promoted["values"]["gate"]["promoted"] and alias_version(connect(s), name, CHAMPION) == "3"
    assert connect(s).get_model_version(name, "3").tags["previous_champion"] == "1"

    back = run_dag(platform.environ, "model_rollback", {"model_name": name, "reason": "recall dropped online"})
    assert back["values"]["rollback"] == {"from": "3", "to": "1"}
    assert alias_version(connect(s), name, CHAMPION) == "1" and alias_version(connect(s), s.models.name, CHAMPION) == "1"
    listed = run_cli(platform.environ, "versions", "--model", name)
    assert listed.returncode == 0 and "v1    @champion" in listed.stdout and "recall dropped online" in listed.stdout


@pytest.mark.stack
def test_feature_materialization_brings_a_new_snapshot_online(platform: Platform, first_window) -> None:
    s = platform.s
    write_snapshot(s, ITEM_ATTRIBUTES, [{"item_id": "i7", "item_genres": ["Drama", "War"], "item_release_year": 1957}])
    run = run_dag(platform.environ, "feature_materialization")
    assert run["tasks"] == {"materialize": "success"}
    assert run["values"]["materialize"] == ["item_attributes", "user_profile"]
    got = online_row(feature_store(s), ["item_attributes:item_genres", "item_attributes:item_release_year"],
                     {"item_id": "i7"})
    assert (got["item_genres"], got["item_release_year"]) == (["Drama", "War"], 1957)


def reference_edges(s: Settings, until_ms: int) -> dict[tuple[str, str], tuple[float, int]]:
    """Decayed edge weights computed directly from the event log: (u, i) -> (weight as of at, at)."""
    weights, half_life = graph.behavior_weights(s), graph.half_life_ms(s)
    events = defaultdict(list)
    seen = set()
    for e in read_event_log(s).to_pylist():
        if e["event_type"] in weights and e["event_time"] <= until_ms and e["event_id"] not in seen:
            seen.add(e["event_id"])
            events[e["user_id"], e["item_id"]].append((e["event_time"], weights[e["event_type"]]))
    out = {}
    for pair, behaviors in events.items():
        at = max(t for t, _ in behaviors)
        out[pair] = (sum(w * 2 ** ((t - at) / half_life) for t, w in behaviors), at)
    return out


@pytest.mark.stack
def test_graph_update_adds_decayed_edges_and_publishes_neighbours(platform: Platform, later_traffic: int) -> None:
    s = platform.s
    run = run_dag(platform.environ, "graph_update")
    assert run["tasks"] == {"add_edges": "success", "refresh_neighbours": "success"}
    added = run["values"]["add_edges"]
    until = added["until_ms"]
    assert until == int(read_event_log(s).column("event_time").to_numpy().max())  # no lateness allowed here
    expected = reference_edges(s, until)
    rows = graph.connect(s).query("MATCH (u:User)-[e:BEHAVED]->(i:Item) RETURN u.id, i.id, e.weight, e.at").result_set
    got = {(u, i): (w, at) for u, i, w, at in rows}
    assert set(got) == set(expected) and added["edges"] == len(expected)
    for pair, (weight, at) in expected.items():
        assert got[pair][1] == at and got[pair][0] == pytest.approx(weight, rel=1e-9)

    # The most co-interacted item's published neighbours, against a brute-force computation.
    half_life = graph.half_life_ms(s)
    now = {pair: w * 2 ** ((at - until) / half_life) for pair, (w, at) in expected.items()}
    by_user = defaultdict(dict)
    for (u, i), w in now.items():
        by_user[u][i] = w
    item = Counter(i for (_, i) in expected).most_common(1)[0][0]
    scores = Counter()
    for items in by_user.values():
        if item in items:
            for j, w in items.items():
                if j != item:
                    scores[j] += items[item] * w
    published = online_row(feature_store(s), ["item_neighbours:neighbour_ids", "item_neighbours:neighbour_scores"],
                           {"item_id": item})
    ids, values = published["neighbour_ids"], published["neighbour_scores"]
    assert len(ids) == min(s.graph.neighbours, len(scores)) and values == sorted(values, reverse=True)
    assert values == pytest.approx([scores[j] for j in ids], rel=1e-9)
    assert math.isclose(values[0], max(scores.values()), rel_tol=1e-9)
    assert run["values"]["refresh_neighbours"]["items"] == len({i for (_, i) in expected})


@pytest.mark.stack
def test_offline_training_through_the_rest_api(platform: Platform, first_window) -> None:
    """The way an operator or a CI job starts a run: Airflow's REST API with the configured credentials;
    the scheduler and the LocalExecutor run it, here of a user's network from a package outside the
    platform's, named by its import path."""
    s, (start, end) = platform.s, first_window
    client = AirflowClient(s)
    kind = "user_nets.nets:build"
    run_id = client.trigger("offline_training", {"data_start": iso(start), "data_end": iso(end), "kind": kind,
                                                 "model_name": "flywheel-ctr-api", "promote": False})
    assert client.wait("offline_training", run_id, timeout_s=600) == "success", client.task_states(
        "offline_training", run_id)
    # Registered under the model the run named, not promoted: the gate was skipped.
    assert client.task_states("offline_training", run_id) == {"train": "success", "promotion_asked": "success",
                                                                "gate": "skipped"}
    assert client.xcom("offline_training", run_id, "train")["version"] == "1"
    tags = version_tags(s, "1", s.registered_model("flywheel-ctr-api"))
    assert (tags["kind"], tags["data_end"]) == (kind, iso(end)) and "gate_decision" not in tags
    assert alias_version(connect(s), "flywheel-ctr-api", CHAMPION) is None


@pytest.mark.stack
def test_a_run_of_a_paused_dag_that_never_began_is_dropped(platform: Platform) -> None:
    """What the demo does as its traffic ends: the DAG paused, a run made meanwhile will never start a task,
    and is dropped rather than left queued or waited for."""
    client, dag = AirflowClient(platform.s), "graph_update"
    was = client.set_paused(dag, True)
    try:
        queued = client._call("POST", f"/dags/{dag}/dagRuns", json={"logical_date": None})["dag_run_id"]
        assert client.run_state(dag, queued) == "queued" and client.active_runs(dag) == [queued]
        assert client.drop_unstarted(dag, queued, "dropped by the test")
        assert queued not in [r["dag_run_id"] for r in client.runs(dag)] and client.active_runs(dag) == []
    finally:
        client.set_paused(dag, was)


@pytest.mark.stack
def test_a_failed_run_says_why(platform: Platform) -> None:
    """`flywheel trigger` of a run whose task fails prints the task's exception, not only "failed"."""
    empty = {"data_start": "2001-01-01T00:00:00+00:00", "data_end": "2001-02-01T00:00:00+00:00",
             "model_name": "flywheel-ctr-api", "promote": False}
    done = run_cli(platform.environ, "trigger", "offline_training", "--conf", json.dumps(empty), timeout=600)
    assert done.returncode == 1 and "offline_training: failed" in done.stdout, (done.stdout, done.stderr)
    assert "train failed: NoImpressions: no impressions in [2001-01-01T00:00:00+00:00, " in done.stderr, done.stderr
