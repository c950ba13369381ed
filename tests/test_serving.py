"""The ranking server (`flywheel serve`: a supervisor and two worker processes) against real Kafka,
Redis (Feast online store) and MLflow: scores equal to the registered model's, bad input never a 500,
the prediction log, canary and shadow routing, alias following with swap and rollback under load, a
bad version refused, overload answered with 503 while admitted requests stay fast, and a worker that
dies replaced while the other serves."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import keras
import mlflow
import mlflow.sklearn
import numpy as np
import pandas as pd
import psutil
import pytest
from kafka import KafkaConsumer

from contract.examples import to_frame
from contract.inputs import NUMERIC_FEATURES, V1_NUMERIC_FEATURES
from contract.transform import to_examples
from feature_repo.online import entity_key, field
from feature_repo.store import apply
from infra import process, stack
from infra.redis_clients import online_store
from infra.services import enabled_services
from infra.settings import REPO_ROOT, Settings, to_environ
from models.ctr import CtrModel, ModelSpec
from models.metrics import auc
from models.registry import (
    CHALLENGER, CHAMPION, CONTROL, HOLDOUT, alias_version, connect, end_canary, gate, load_version, log_model,
    routing, start_canary, start_experiment, stop_experiment, version_tags)
from models.sparse import SparseConfig
from serving import access
from serving.client import Served, closed_loop, open_loop
from tests.conftest import FaultTable, running_stack, wait_for
from tests.ctr_data import TRUSTED, synthetic, trees_pipeline, write_user_nets

pytestmark = pytest.mark.stack
SPEC = ModelSpec(numeric_features=NUMERIC_FEATURES, sequence_length=50, sparse=SparseConfig(dim=8, admit_after=1),
                 hidden=(32, 16), batch_size=128)
USERS, ITEMS = 20, 100
SCENARIOS = ('\n[scenarios.home]\ndescription = "the home page"\n\n[scenarios.browse]\nmodel = "browse-ranker"\n'
             '\n[scenarios.browse.serving]\ncanary_percent = 100\n')  # its experiment: every user to its @challenger
REGISTRY_OUTAGE_S = 60.0
WORKERS = 2


@dataclass
class Platform:
    s: Settings
    url: str
    versions: dict[str, str]  # label -> registered version
    server_pid: int


def _examples(n: int, seed: int):
    ex = synthetic(n, seed, users=USERS, items=ITEMS, length=SPEC.sequence_length)
    numeric = np.random.default_rng(seed).random((n, len(NUMERIC_FEATURES))).astype(np.float32)
    return replace(ex, numeric=numeric, numeric_names=NUMERIC_FEATURES)


def _register(s: Settings, label: str, export: Path, tags: dict[str, str] | None = None,
              delta: Path | None = None) -> str:
    connect(s)
    mlflow.set_experiment(s.models.experiment)
    with mlflow.start_run(run_name=label):
        extra = dict(tags or {})
        if delta is not None:
            mlflow.log_artifacts(str(delta), "delta")
            extra["sparse_delta"] = f"runs:/{mlflow.active_run().info.run_id}/delta"
        return log_model(s, export, {"kind": "ranker", "data_start": "", "data_end": ""} | extra, delta_dir=delta)


def _write_features(s: Settings) -> None:
    store = apply(s)
    now = pd.Timestamp(datetime.now(UTC))
    rng = np.random.default_rng(1)
    users = [f"u{u}" for u in range(USERS)]
    items = [f"i{i}" for i in range(ITEMS)]
    store.write_to_online_store("user_total", pd.DataFrame({
        "user_id": users, "user_impressions_total": rng.integers(1, 500, USERS),
        "user_clicks_total": rng.integers(0, 50, USERS), "user_ctr_total": rng.random(USERS),
        "event_timestamp": now}))
    store.write_to_online_store("item_total", pd.DataFrame({
        "item_id": items, "item_impressions_total": rng.integers(1, 500, ITEMS),
        "item_clicks_total": rng.integers(0, 50, ITEMS), "item_ctr_total": rng.random(ITEMS),
        "event_timestamp": now}))
    base = int(time.time() * 1000) - 3_600_000
    store.write_to_online_store("user_sequence", pd.DataFrame({
        "user_id": users,
        "seq_item_ids": [[f"i{(u * 7 + j) % ITEMS}" for j in range(5 + u * 3)] for u in range(USERS)],
        "seq_event_types": [["click"] * (5 + u * 3) for u in range(USERS)],
        "seq_event_times": [[base + j * 1000 for j in range(5 + u * 3)] for u in range(USERS)],
        "event_timestamp": now}))
    # the long history: categories c0..c3, 3 item slots each
    store.write_to_online_store("user_history", pd.DataFrame({
        "user_id": users, "history_length": [40 + u for u in range(USERS)],
        "history_categories": [[f"c{c}" for c in range(4)]] * USERS,
        "history_category_counts": [[20, 10, 6, 4]] * USERS,
        "history_item_ids": [[f"i{(u + c * 8 + j) % ITEMS}" if j < 3 - c % 2 else "" for c in range(4) for j in range(3)]
                             for u in range(USERS)],
        "history_event_types": [["click" if j % 2 else "impression" for _ in range(4) for j in range(3)]] * USERS,
        "event_timestamp": now}))
    store.write_to_online_store("item_attributes", pd.DataFrame({
        "item_id": items, "item_genres": [["Drama", "Comedy", "War"][: i % 4] for i in range(ITEMS)],
        "item_release_year": [1950 + i % 50 for i in range(ITEMS)], "event_timestamp": now}))
    # users with 0 (none written), 1, 2 or 3 attributes: attribute lists of different widths
    profiled = [u for u in range(USERS) if u % 4]
    store.write_to_online_store("user_profile", pd.DataFrame({
        "user_id": [f"u{u}" for u in profiled], "user_gender": [["F", "M"][u % 2] for u in profiled],
        "user_occupation": [None if u % 4 < 2 else "writer" for u in profiled],
        "user_age": [20 + u if u % 4 == 3 else 0 for u in profiled], "event_timestamp": now}))


def _server_pid(s: Settings) -> int:
    return process.read_pidfile(s.paths.run_dir / "ranking-server.json").pid


def _ready(url: str) -> None:
    try:
        assert httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError as exc:
        raise AssertionError(exc) from None


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """The stack with its ranking server; the server is up but not ready until @champion exists."""
    tmp = tmp_path_factory.mktemp("serving")
    nets = tmp / "nets"
    own_kind = f"{write_user_nets(nets)}:build"  # a user's network, from a package outside the platform's
    with pytest.MonkeyPatch.context() as patch:  # importable here and in the stack's processes
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(nets), os.environ.get("PYTHONPATH")])))
        patch.syspath_prepend(str(nets))
        spec = tmp / "dataset.toml"  # the default dataset, with two scenarios (surfaces) of their own rankers
        spec.write_text((REPO_ROOT / "datasets" / "movielens" / "dataset.toml").read_text() + SCENARIOS)
        for s in running_stack(tmp / "stack", "kafka,redis,mlflow,serving,prometheus", FLYWHEEL_DATASET_SPEC=str(spec),
                               FLYWHEEL_SERVING_CANARY_PERCENT="30", FLYWHEEL_SERVING_SHADOW_PERCENT="50",
                               FLYWHEEL_SERVING_MAX_INFLIGHT_ROWS="1500", FLYWHEEL_SERVING_DEFAULT_DEADLINE_MS="500",
                               FLYWHEEL_SERVING_MAX_CANDIDATES="500", FLYWHEEL_SERVING_WORKERS=str(WORKERS),
                               FLYWHEEL_SERVING_REFUSED_WINDOW_S="10"):
            url = f"http://127.0.0.1:{s.serving.port}"
            assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503  # no model yet
            _write_features(s)
            keras.utils.set_random_seed(7)
            model = CtrModel(SPEC)
            model.fit(_examples(3000, seed=1), progress=False)
            v1 = _register(s, "v1", model.save(tmp / "v1"))
            since = model.versions()
            model.fit(_examples(2000, seed=2), progress=False)  # an incremental run: v2 = v1 + delta
            model.save_delta(tmp / "v2-delta", since)
            v2 = _register(s, "v2", model.save(tmp / "v2"), {"parent_version": v1}, delta=tmp / "v2-delta")
            model.network.set_weights([w * np.nan for w in model.network.get_weights()])
            bad = _register(s, "bad", model.save(tmp / "bad"))
            # trained on another dataset's events (a shop's): its type embedding means other behaviors
            shop = _register(s, "shop", CtrModel(replace(SPEC, dataset="corner-shop",
                                                         event_types=("view", "cart", "order"))).save(tmp / "shop"))
            previous = CtrModel(replace(SPEC, kind="ranker-v1", numeric_features=V1_NUMERIC_FEATURES, long_length=0))
            previous.fit(_examples(2000, seed=3), progress=False)  # the previous architecture: other inputs
            v1_arch = _register(s, "ranker-v1", previous.save(tmp / "ranker-v1"), {"kind": "ranker-v1"})
            own = CtrModel(replace(SPEC, kind=own_kind))
            own.adapt(_examples(2000, seed=4))
            own.fit(_examples(2000, seed=4), progress=False)
            own = _register(s, "own", own.save(tmp / "own"), {"kind": own_kind})
            with mlflow.start_run(run_name="trees"):  # another flavor, on v1's training set, as a user logs it
                trees = str(mlflow.sklearn.log_model(
                    trees_pipeline(_examples(3000, seed=1)), name="model", registered_model_name=s.models.name,
                    pyfunc_predict_fn="predict_proba", skops_trusted_types=TRUSTED).registered_model_version)
            connect(s).set_registered_model_alias(s.models.name, CHAMPION, v1)
            wait_for(lambda: _ready(url), timeout_s=120)
            yield Platform(s, url, {"v1": v1, "v2": v2, "bad": bad, "shop": shop, "ranker-v1": v1_arch, "own": own,
                                    "trees": trees}, _server_pid(s))


def _request(user: int, n: int, **extra) -> dict:
    return {"user_id": f"u{user}", "candidates": [{"item_id": f"i{(user + k) % ITEMS}", "category": f"c{k % 8}"}
                                                  for k in range(n)]} | extra


def _champion_user(p: Platform) -> int:
    return next(u for u in range(USERS) if access.route(f"u{u}", p.s.serving.canary_percent) == CHAMPION)


def _set_alias(p: Platform, alias: str, label: str) -> None:
    connect(p.s).set_registered_model_alias(p.s.models.name, alias, p.versions[label])


def _served(p: Platform) -> dict:
    return httpx.get(f"{p.url}/models", timeout=5).json()


def _everywhere(p: Platform, route: str) -> set[str | None]:
    """The versions serving `route` over all the workers: one once they agree."""
    workers = _served(p)["workers"]
    assert len(workers) == WORKERS, workers
    return {w["serving"].get(route) for w in workers.values()}


def _metric(p: Platform, name: str) -> float:
    """A metric's value summed over the workers and its labels (0 when absent)."""
    lines = httpx.get(f"{p.url}/metrics", timeout=5).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.split(" ")[0].split("{")[0] == name)


def test_scores_equal_the_registered_models(platform: Platform) -> None:
    p = platform
    user = _champion_user(p)
    body = _request(user, 40)
    r = httpx.post(f"{p.url}/rank", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_version"] == p.versions["v1"] and out["route"] == CHAMPION and len(out["scores"]) == 40
    ex = _registered_scores_equal(p, body, out, p.versions["v1"], NUMERIC_FEATURES)
    assert (ex.sequences[0] != "").sum() > 0  # the user's behaviors are in the inputs, and the long history's
    # each candidate of a category in the user's long history (c0..c3) gets that category's behaviors
    in_history = np.isin(ex.categories, ["c0", "c1", "c2", "c3"])
    assert in_history.any() and (ex.long_sequences != "").any(axis=1).tolist() == in_history.tolist()
    assert (ex.item_tokens != "").any(axis=1).all()
    # Features the fixture never wrote are defaulted and named; the ones it wrote are not.
    assert out["defaulted"] and "user_clicks_5m" in out["defaulted_features"]
    assert not {"user_clicks_total", "item_ctr_total", "seq_item_ids"} & set(out["defaulted_features"])


def test_concurrent_heterogeneous_requests_score_as_they_do_alone(platform: Platform) -> None:
    """Requests merged into batches differ in every list width: users with 0-3 attributes, items with 0-3
    genres, sequences of 5-62 behaviors, long histories or none, 1-500 candidates, unknown users and
    items. Each must answer 200 with the scores it gets when it is the only request in the server."""
    p = platform
    rnd = np.random.default_rng(11)

    def body(k: int) -> dict:
        n = int(rnd.choice([1, 2, 3, int(rnd.integers(4, 60)), int(rnd.integers(60, 501))]))
        user = f"u{rnd.integers(USERS)}" if k % 7 else f"new-user-{k}"
        items = [f"i{i}" if i < ITEMS else f"new-item-{i}" for i in rnd.integers(0, ITEMS + 10, n)]
        # tier high: never degraded under load (a shortened sequence scores otherwise, by design)
        return {"user_id": user, "candidates": [{"item_id": i, "category": f"c{rnd.integers(6)}"} for i in items],
                "tier": "high"}

    bodies = [body(k) for k in range(96)]
    start = threading.Barrier(8)

    def post(c: httpx.Client, b: dict) -> httpx.Response:
        while True:  # the fixture admits 1,500 rows at a time: a request past that is shed; the client retries
            r = c.post("/rank", json=b)
            if r.status_code != 503 or r.json()["reason"] != "queue":
                return r
            time.sleep(0.01)

    def client(part: list[dict]) -> list[httpx.Response]:
        with httpx.Client(base_url=p.url, timeout=30) as c:
            start.wait()
            return [post(c, b) for b in part]

    batches_before = _metric(p, "flywheel_batch_requests_count")
    merged_before = _metric(p, "flywheel_batch_requests_sum")
    with ThreadPoolExecutor(8) as pool:
        together = [r for rs in pool.map(client, [bodies[i::8] for i in range(8)]) for r in rs]
    ordered = [b for i in range(8) for b in bodies[i::8]]
    assert [r.status_code for r in together] == [200] * len(ordered), {r.text for r in together if r.status_code != 200}
    # batches held several requests (else this proves nothing about batching)
    runs = _metric(p, "flywheel_batch_requests_count") - batches_before
    assert _metric(p, "flywheel_batch_requests_sum") - merged_before > runs
    for b, r in zip(ordered, together):
        alone = httpx.post(f"{p.url}/rank", json=b, timeout=10).json()
        assert alone["model_version"] == r.json()["model_version"] and not r.json()["degraded"]
        np.testing.assert_allclose(r.json()["scores"], alone["scores"], rtol=1e-5, atol=1e-6)


def test_a_fault_is_a_503_with_a_reason_and_the_worker_serves_on(platform: Platform) -> None:
    p = platform
    # A stored value that does not decode (a truncated varint): an error the server does not expect.
    online_store(p.s).hset(entity_key(("user_id",), ("corrupt-user",)), field("user_total", "user_clicks_total"),
                           b"\x20\x80")
    faults = _metric(p, "flywheel_faults_total")
    broken = httpx.post(f"{p.url}/rank", json={"user_id": "corrupt-user", "candidates": [{"item_id": "i1"}]},
                        timeout=10)
    assert broken.status_code == 503 and broken.json()["reason"] == "internal", broken.text
    assert "IndexError" in broken.json()["detail"] and broken.headers["retry-after"]
    assert _metric(p, "flywheel_faults_total") == faults + 1
    assert httpx.post(f"{p.url}/rank", json=_request(1, 5), timeout=10).status_code == 200


def _registered_scores_equal(p: Platform, body: dict, out: dict, version: str, numeric: tuple[str, ...],
                             model: str | None = None):
    """Asserts the server's scores are the registered version's (of `model`, the platform's ranker by default), as
    MLflow loads it, on the same features read by the test; returns those inputs."""
    store = apply(p.s)
    rows = [{"user_id": body["user_id"], **c} for c in body["candidates"]]
    frame = pd.DataFrame(store.get_online_features(features=store.get_feature_service("ranking_serving"),
                                                   entity_rows=rows).to_dict())
    ex = to_examples(frame, np.full(len(frame), int(time.time() * 1000)), np.zeros(len(frame)), SPEC.sequence_length)
    offline = mlflow.pyfunc.load_model(f"models:/{model or p.s.models.name}/{version}").predict(to_frame(ex, numeric))
    np.testing.assert_allclose(out["scores"], offline, rtol=1e-5, atol=1e-6)
    return ex


def test_a_model_of_another_flavor_is_gated_against_the_champion_and_served_as_its_pyfunc_scores(platform: Platform
                                                                                                 ) -> None:
    p = platform
    trees, v1 = p.versions["trees"], p.versions["v1"]
    pyfunc = mlflow.pyfunc.load_model(f"models:/{p.s.models.name}/{trees}")  # a LightGBM pipeline's predict_proba
    evaluation = _examples(1500, seed=9)
    try:
        decision = gate(p.s, trees, load_version(p.s, trees), evaluation, "a test window")
        assert decision.champion_version == v1 and decision.champion_score is not None, decision
        own = np.asarray(pyfunc.predict(to_frame(evaluation, NUMERIC_FEATURES)))[:, 1]
        assert decision.score == pytest.approx(auc(evaluation.labels, own)), decision
        _forget_gate(p, trees)  # whatever it decided (a canary, @challenger): served below to every user
        _set_alias(p, CHAMPION, "trees")
        wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {trees}), timeout_s=60)
        body = _request(_champion_user(p), 30)
        out = httpx.post(f"{p.url}/rank", json=body, timeout=10).json()
        assert out["model_version"] == trees
        rows = [{"user_id": body["user_id"], **c} for c in body["candidates"]]
        store = apply(p.s)
        frame = pd.DataFrame(store.get_online_features(features=store.get_feature_service("ranking_serving"),
                                                       entity_rows=rows).to_dict())
        ex = to_examples(frame, np.full(len(frame), int(time.time() * 1000)), np.zeros(len(frame)),
                         SPEC.sequence_length)
        offline = np.asarray(pyfunc.predict(to_frame(ex, NUMERIC_FEATURES)))[:, 1]
        np.testing.assert_allclose(out["scores"], offline, rtol=1e-5, atol=1e-6)
        assert _metric(p, "flywheel_foreign_batch_seconds_count") > 0  # its latency apart from the XLA path's
    finally:
        _forget_gate(p, trees)
        _set_alias(p, CHAMPION, "v1")
    wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v1}), timeout_s=30)


def _forget_gate(p: Platform, version: str) -> None:
    """No canary, and `version` not @challenger: what a gate's decision left, undone."""
    end_canary(p.s)
    client = connect(p.s)
    if alias_version(client, p.s.models.name, CHALLENGER) == version:
        client.delete_registered_model_alias(p.s.models.name, CHALLENGER)


@pytest.mark.parametrize("label, numeric", [
    ("ranker-v1", V1_NUMERIC_FEATURES),  # fewer numeric features, no long history, another network
    ("own", NUMERIC_FEATURES),  # a user's network, from a package outside the platform's
])
def test_a_version_with_other_inputs_or_network_is_served_without_code_changes(platform: Platform, label: str,
                                                                               numeric: tuple[str, ...]) -> None:
    p = platform
    version, v1 = p.versions[label], p.versions["v1"]
    _set_alias(p, CHAMPION, label)
    try:
        wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {version}), timeout_s=60)
        body = _request(_champion_user(p), 30)
        out = httpx.post(f"{p.url}/rank", json=body, timeout=10).json()
        assert out["model_version"] == version
        _registered_scores_equal(p, body, out, version, numeric)
    finally:
        _set_alias(p, CHAMPION, "v1")
    wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v1}), timeout_s=30)


def _scenario_serving(p: Platform, model: str, route: str = CHAMPION) -> set[str | None]:
    """The versions of registered model `model` serving `route` over all the workers: one once they agree."""
    workers = _served(p)["workers"]
    assert len(workers) == WORKERS, workers
    return {w["models"].get(model, {}).get(route) for w in workers.values()}


def test_scenarios_are_served_side_by_side_and_rolled_back_apart(platform: Platform, tmp_path: Path) -> None:
    """One server, a ranker per scenario the dataset spec declares: each request is scored by the champion of the
    scenario it names (the platform's ranker when it names none), concurrently, with the scores each version
    gives alone; a rollback of one scenario leaves the others serving what they served; an undeclared scenario
    is a 422 naming the declared ones."""
    p, client = platform, connect(platform.s)
    home, browse = p.s.scenarios["home"], p.s.scenarios["browse"]
    assert (home.name, browse.name) == (f"{p.s.models.name}-home", "browse-ranker")
    versions: dict[tuple[str, str], str] = {}
    for model, labels in ((home, ("own", "v2")), (browse, ("ranker-v1",))):  # other networks than the default's
        mlflow.set_experiment(model.experiment)
        for label in labels:
            export = load_version(p.s, p.versions[label]).save(tmp_path / f"{model.scenario}-{label}")
            with mlflow.start_run(run_name=f"{model.scenario}-{label}"):
                versions[model.scenario, label] = log_model(p.s, export, {"kind": label}, model=model)
    assert version_tags(p.s, versions["home", "own"], home)["scenario"] == "home"
    client.set_registered_model_alias(home.name, CHAMPION, versions["home", "v2"])
    client.set_registered_model_alias(home.name, CHAMPION, versions["home", "own"])  # v2 is the one before
    client.set_registered_model_alias(browse.name, CHAMPION, versions["browse", "ranker-v1"])
    served = {"": p.versions["v1"], "home": versions["home", "own"], "browse": versions["browse", "ranker-v1"]}
    wait_for(lambda: _assert(_scenario_serving(p, home.name) == {served["home"]}
                             and _scenario_serving(p, browse.name) == {served["browse"]}), timeout_s=120)
    models = _served(p)
    assert models["model_name"] == p.s.models.name
    assert models["scenarios"]["home"]["serving"][CHAMPION] == served["home"]
    assert models["scenarios"]["browse"]["model_name"] == browse.name

    rnd = np.random.default_rng(5)
    users = [u for u in range(USERS) if access.route(f"u{u}", p.s.serving.canary_percent) == CHAMPION]
    bodies = [_request(int(rnd.choice(users)), int(rnd.integers(1, 80)), tier="high",
                       **({"scenario": sc} if sc else {})) for sc in ["", "home", "browse"] * 16]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: httpx.post(f"{p.url}/rank", json=b, timeout=30), bodies))
    assert [r.status_code for r in together] == [200] * len(bodies), {r.text for r in together if r.status_code != 200}
    for b, r in zip(bodies, together):
        assert r.json()["model_version"] == served[b.get("scenario", "")], (b.get("scenario"), r.json())
        alone = httpx.post(f"{p.url}/rank", json=b, timeout=10).json()
        np.testing.assert_allclose(r.json()["scores"], alone["scores"], rtol=1e-5, atol=1e-6)
    for scenario, model, label, numeric in (("home", home, "own", NUMERIC_FEATURES),
                                            ("browse", browse, "ranker-v1", V1_NUMERIC_FEATURES)):
        body = next(b for b in bodies if b.get("scenario") == scenario)
        out = httpx.post(f"{p.url}/rank", json=body, timeout=10).json()
        _registered_scores_equal(p, body, out, versions[scenario, label], numeric, model.name)
    recommended = httpx.post(f"{p.url}/recommend", json={"user_id": "u1", "scenario": "browse"}, timeout=10)
    assert recommended.status_code == 200, recommended.text

    unknown = httpx.post(f"{p.url}/rank", json=_request(1, 3, scenario="cart"), timeout=10)
    assert unknown.status_code == 422 and "unknown scenario 'cart'" in unknown.text, unknown.text
    assert "'home', 'browse'" in unknown.json()["detail"][0]["msg"]

    # A rollback of home's ranker: home serves the version before; browse and the platform's ranker are untouched.
    cli = subprocess.run([sys.executable, "-m", "flywheel.cli", "rollback", "--scenario", "home", "--why", "test",
                          "--to", versions["home", "v2"]],
                         env=os.environ | to_environ(p.s), capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and f"v{served['home']} -> v{versions['home', 'v2']}" in cli.stdout, cli.stderr
    wait_for(lambda: _assert(_scenario_serving(p, home.name) == {versions["home", "v2"]}), timeout_s=30)
    assert _scenario_serving(p, browse.name) == {served["browse"]} and _everywhere(p, CHAMPION) == {served[""]}
    for scenario, version in (("home", versions["home", "v2"]), ("browse", served["browse"]), ("", served[""])):
        body = _request(users[0], 5, **({"scenario": scenario} if scenario else {}))
        assert httpx.post(f"{p.url}/rank", json=body, timeout=10).json()["model_version"] == version, scenario

    # browse's own experiment split: once its ranker has a @challenger, it scores every browse request; the
    # same user on the other surfaces stays with their champions (the server's split: 30% of users).
    client.set_registered_model_alias(browse.name, CHALLENGER, served["browse"])
    try:
        wait_for(lambda: _assert(_scenario_serving(p, browse.name, CHALLENGER) == {served["browse"]}), timeout_s=30)
        for scenario, route in (("browse", CHALLENGER), ("home", CHAMPION), ("", CHAMPION)):
            body = _request(users[0], 5, **({"scenario": scenario} if scenario else {}))
            assert httpx.post(f"{p.url}/rank", json=body, timeout=10).json()["route"] == route, scenario
    finally:
        client.delete_registered_model_alias(browse.name, CHALLENGER)


def test_bad_input_gets_a_4xx_and_unknown_ids_defaults(platform: Platform) -> None:
    p = platform
    post = lambda **kw: httpx.post(f"{p.url}/rank", timeout=10, **kw)  # noqa: E731
    assert post(content=b'{"user_id": "u1", "candidates": [', headers={"content-type": "application/json"}
                ).status_code == 422
    assert post(json={"user_id": "u1", "candidates": []}).status_code == 422
    assert post(json={"user_id": "", "candidates": [{"item_id": "i1"}]}).status_code == 422
    assert post(json={"user_id": "u1", "candidates": ["i1"]}).status_code == 422
    assert post(json=_request(1, 3, tier="vip")).status_code == 422
    assert post(json=_request(1, 3, deadline_ms=-5)).status_code == 422
    raw = lambda text: post(content=text.encode(), headers={"content-type": "application/json"})  # noqa: E731
    for body in ('{"user_id": "u1", "candidates": [{"item_id": "i1"}], "deadline_ms": NaN}',
                 '{"user_id": "u1", "candidates": [{"item_id": "i1"}], "deadline_ms": Infinity}',
                 '{"user_id": "\\ud800", "candidates": [{"item_id": "i1"}]}',
                 '{"user_id": "u1", "candidates": [{"item_id": "i\\udfff", "category": "c"}]}',
                 '{"user_id": "u1", "candidates": [{"item_id": "i1"}], "\\ud800": 1}'):
        answer = raw(body)
        assert answer.status_code == 422, (body, answer.status_code, answer.text)
        assert answer.json()["detail"][0]["msg"], body
    too_many = post(json=_request(1, p.s.serving.max_candidates + 1))
    assert too_many.status_code == 413 and "at most 500" in too_many.json()["detail"]
    unknown = post(json={"user_id": "nobody", "candidates": [{"item_id": "no-such-item"}]})
    assert unknown.status_code == 200
    out = unknown.json()
    assert out["defaulted"] and {"user_clicks_total", "item_ctr_total", "seq_item_ids"} <= set(
        out["defaulted_features"])
    assert len(out["scores"]) == 1 and 0.0 < out["scores"][0] < 1.0


def _predictions(p: Platform, request_ids: set[str], timeout_s: float = 30) -> list[dict]:
    consumer = KafkaConsumer(p.s.serving.predictions_topic, **p.s.kafka.client_options("kafka-python", "admin"),
                             auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=1000)
    found: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and {r["request_id"] for r in found} != request_ids:
            for record in consumer:
                value = json.loads(record.value)
                if value["request_id"] in request_ids:
                    found.append(value)
    finally:
        consumer.close()
    return found


def test_every_prediction_is_logged_to_kafka(platform: Platform) -> None:
    p = platform
    user = _champion_user(p)
    ids = {f"log-{user}-{k}" for k in range(3)}
    responses = {i: httpx.post(f"{p.url}/rank", json=_request(user, 5, request_id=i), timeout=10).json() for i in ids}
    records = [r for r in _predictions(p, ids) if not r["shadow"]]
    assert {r["request_id"] for r in records} == ids and len(records) == 3
    for r in records:
        out = responses[r["request_id"]]
        assert r["user_id"] == f"u{user}" and r["items"] == [c["item_id"] for c in _request(user, 5)["candidates"]]
        assert r["scores"] == pytest.approx(out["scores"]) and r["model_version"] == out["model_version"]
        assert len(r["features"]["user_clicks_total"]) == 5 and r["features"]["user_clicks_5m"] == [None] * 5
        assert r["features"]["sequence"]  # the behaviors that were scored


def test_canary_and_shadow_follow_the_challenger(platform: Platform) -> None:
    p = platform
    v1, v2 = p.versions["v1"], p.versions["v2"]
    _set_alias(p, CHALLENGER, "v2")
    try:
        wait_for(lambda: _assert(_everywhere(p, CHALLENGER) == {v2}), timeout_s=30)
        routed = {}
        for u in range(USERS):
            out = httpx.post(f"{p.url}/rank", json=_request(u, 4, request_id=f"canary-{u}"), timeout=10).json()
            routed[u] = (out["route"], out["model_version"])
        expected = {u: (access.route(f"u{u}", 30.0), v2 if access.route(f"u{u}", 30.0) == CHALLENGER else v1)
                    for u in range(USERS)}
        assert routed == expected and 0 < sum(r == CHALLENGER for r, _ in routed.values()) < USERS
        # Shadow: a share of champion-routed requests is also scored by the challenger and logged only.
        ids = {f"canary-{u}" for u, (route, _) in routed.items() if route == CHAMPION}
        shadowed = {i for i in ids if access.shadowed(i, 50.0)}
        assert shadowed and shadowed != ids
        records = _predictions(p, ids)
        shadows = {r["request_id"]: r for r in records if r["shadow"]}
        assert set(shadows) == shadowed and all(r["model_version"] == v2 for r in shadows.values())
    finally:
        connect(p.s).delete_registered_model_alias(p.s.models.name, CHALLENGER)
    wait_for(lambda: _assert(_everywhere(p, CHALLENGER) == {None}), timeout_s=30)


def test_an_experiments_frozen_arm_keeps_its_version_while_the_champion_moves(platform: Platform) -> None:
    """An experiment pins a share of users to @holdout: under concurrent requests of every size, they are scored by
    the frozen version while the champion moves and a challenger takes its canary share of the others; stopped,
    they follow the champion again. Three versions, one per route: a route scored by another's is seen."""
    p = platform
    v1, v2, trees, name = p.versions["v1"], p.versions["v2"], p.versions["trees"], p.s.models.name
    users = range(USERS)
    shown: dict[str, list[str]] = {}  # request id -> the items a request with top_k shows, best first

    def served(tag: str) -> set[tuple[int, str, str]]:
        def one(n: int) -> tuple[int, str, str]:
            u = n % USERS
            body = _request(u, 3 + 7 * (u % 5), request_id=f"{tag}-{n}") | ({"top_k": 2} if u % 3 == 0 else {})
            out = httpx.post(f"{p.url}/rank", json=body, timeout=10).json()
            if u % 3 == 0:
                assert out["top"] == sorted(range(len(out["scores"])), key=lambda i: -out["scores"][i])[:2]
                shown[body["request_id"]] = [body["candidates"][i]["item_id"] for i in out["top"]]
            else:
                assert out["top"] is None
            return u, out["route"], out["model_version"]
        with ThreadPoolExecutor(8) as pool:  # each user twice, concurrently: both answers alike
            return set(pool.map(one, range(2 * USERS)))

    running = start_experiment(p.s, 40.0)  # v1, the champion
    try:
        connect(p.s).set_registered_model_alias(name, CHAMPION, v2)
        _set_alias(p, CHALLENGER, "trees")
        wait_for(lambda: _assert(_everywhere(p, HOLDOUT) == {v1} and _everywhere(p, CHAMPION) == {v2}
                                 and _everywhere(p, CHALLENGER) == {trees}), timeout_s=60)
        assert _served(p)["holdout_percent"] == 40.0
        expected = {u: access.decide(f"u{u}", p.s.serving.canary_percent, frozenset({CHALLENGER, HOLDOUT}), 100.0,
                                     40.0, running.salt) for u in users}
        version = {HOLDOUT: v1, CHAMPION: v2, CHALLENGER: trees}
        assert served("experiment") == {(u, r, version[r]) for u, r in expected.items()}
        assert {HOLDOUT, CHAMPION, CHALLENGER} == set(expected.values())
        logged = [r for r in _predictions(p, {f"experiment-{n}" for n in range(2 * USERS)}) if not r["shadow"]]
        assert {(r["route"], r["model_version"]) for r in logged} == set(version.items())  # what the arms judge
        assert all(r["items"] == shown[r["request_id"]] for r in logged if r["request_id"] in shown)  # only shown
    finally:
        stop_experiment(p.s)
        connect(p.s).delete_registered_model_alias(name, CHALLENGER)
        connect(p.s).set_registered_model_alias(name, CHAMPION, v1)
    wait_for(lambda: _assert(_everywhere(p, HOLDOUT) == {None} and _everywhere(p, CHAMPION) == {v1}), timeout_s=30)
    assert {route for _, route, _ in served("stopped")} == {CHAMPION}


@pytest.mark.chaos
def test_a_promoted_champion_serves_its_canary_share_and_lacking_evidence_keeps_it(platform: Platform,
                                                                                  faults: FaultTable) -> None:
    """A promotion in a canary (models/registry.py: start_canary, as the gate does): the new champion scores
    its share of users by a stable hash, @control (the champion before) the others. With no clicks to judge
    by (this stack has no event log), the analysis neither ramps nor rolls back: the share stays and the
    version says why."""
    p = platform
    v1, v2, name = p.versions["v1"], p.versions["v2"], p.s.models.name
    percent = p.s.canary.ramp_percent[0]
    start_canary(p.s, v2, v1)
    connect(p.s).set_registered_model_alias(name, CHAMPION, v2)
    try:
        wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v2} and _everywhere(p, CONTROL) == {v1}), timeout_s=30)
        routed = {u: (out["route"], out["model_version"]) for u in range(USERS) if (out := httpx.post(
            f"{p.url}/rank", json=_request(u, 4, request_id=f"champion-canary-{u}"), timeout=10).json())}
        expected = {u: (access.champion_route(f"u{u}", percent),
                        v2 if access.champion_route(f"u{u}", percent) == CHAMPION else v1) for u in range(USERS)}
        assert routed == expected and 0 < sum(r == CHAMPION for r, _ in routed.values()) < USERS
        assert {r["route"] for r in _predictions(p, {f"champion-canary-{u}" for u in range(USERS)})} == {
            CHAMPION, CONTROL}  # logged by route: what the analysis compares
        wait_for(lambda: _assert("lacking evidence" in version_tags(p.s, v2).get("canary_status", "")),
                 timeout_s=60)
        time.sleep(3 * p.s.canary.interval_s)  # more looks, still without evidence
        now = routing(connect(p.s), name)
        status = version_tags(p.s, v2)["canary_status"]
        held = (now.aliases.get(CHAMPION), now.aliases.get(CONTROL), now.champion_percent) == (v2, v1, percent)
        faults.record("a canary analysis without evidence (no clicks)",
                      "the share kept (neither ramped nor rolled back); the version says so",
                      f"@champion v{now.aliases.get(CHAMPION)} on {now.champion_percent:g}%, @control "
                      f"v{now.aliases.get(CONTROL)}; on the version: {status[:80]}", held)
        assert held, (now, status)
    finally:
        end_canary(p.s)
        connect(p.s).set_registered_model_alias(name, CHAMPION, v1)
    wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v1} and _everywhere(p, CONTROL) == {None}), timeout_s=30)


def _assert(condition: bool) -> None:
    assert condition


class Load:
    """Closed-loop load from threads until stopped: every response's status and version, in order, and
    the versions each thread (one connection: one worker) was served, in order."""

    def __init__(self, p: Platform, threads: int = 4) -> None:
        self.p, self.results, self._stop = p, [], threading.Event()
        self.by_thread: list[list[str]] = [[] for _ in range(threads)]
        self._threads = [threading.Thread(target=self._loop, args=(k,)) for k in range(threads)]

    def _loop(self, k: int) -> None:
        user = _champion_user(self.p)
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                r = client.post(f"{self.p.url}/rank", json=_request(user, 20 + 10 * k, tier="high"))
                self.results.append((time.monotonic(), r.status_code,
                                     r.json().get("model_version") if r.status_code == 200 else r.text))
                self.by_thread[k].append(self.results[-1][2])

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def first_serving(self, version: str, after: float) -> float:
        return min(t for t, status, v in self.results if t >= after and v == version)


def test_swap_and_rollback_under_load_fail_nothing(platform: Platform) -> None:
    p = platform
    v1, v2 = p.versions["v1"], p.versions["v2"]
    poll = p.s.serving.poll_interval_s
    with Load(p) as load:
        time.sleep(2)
        promoted_at = time.monotonic()
        _set_alias(p, CHAMPION, "v2")  # a promotion: v2 is v1 + a sparse delta
        wait_for(lambda: _assert(any(v == v2 for _, _, v in load.results[-8:])), timeout_s=60)
        time.sleep(2)
        rolled_back_at = time.monotonic()
        _set_alias(p, CHAMPION, "v1")  # the rollback: v1 is still warm
        wait_for(lambda: _assert(any(t > rolled_back_at and v == v1 for t, _, v in load.results)), timeout_s=30)
        time.sleep(1)
    assert {status for _, status, _ in load.results} == {200}, Counter(s for _, s, _ in load.results)
    assert {v for _, _, v in load.results} == {v1, v2}
    swap_s = load.first_serving(v2, promoted_at) - promoted_at
    rollback_s = load.first_serving(v1, rolled_back_at) - rolled_back_at
    assert rollback_s <= poll + 1.0, f"rollback served after {rollback_s:.2f}s; poll interval {poll}s"
    # On a connection (one worker), versions change once each way: no flapping between them.
    changes = [sum(a != b for a, b in zip(seen, seen[1:])) for seen in load.by_thread]
    assert max(changes) <= 2, changes
    wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v1}), timeout_s=10)
    assert set(_served(p)["warm"]) >= {v1, v2}
    # v2 was built from the warm v1 plus its delta, and scores like its full export.
    metrics = httpx.get(f"{p.url}/metrics", timeout=5).text
    assert 'flywheel_compiles_total{where="request_path"}' not in metrics
    assert 'flywheel_compiles_total{where="background"}' not in metrics
    print(f"swap to v2 served after {swap_s:.2f}s, rollback after {rollback_s:.2f}s (poll {poll}s)")


def test_delta_version_scores_like_its_full_export(platform: Platform) -> None:
    p = platform
    v2 = p.versions["v2"]
    _set_alias(p, CHAMPION, "v2")
    try:
        wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {v2}), timeout_s=30)
        assert _served(p)["loaded_by"][v2] == "delta"
        user = _champion_user(p)
        body = _request(user, 30)
        out = httpx.post(f"{p.url}/rank", json=body, timeout=10).json()
        assert out["model_version"] == v2
        _registered_scores_equal(p, body, out, v2, NUMERIC_FEATURES)
    finally:
        _set_alias(p, CHAMPION, "v1")
    wait_for(lambda: _assert(_everywhere(p, CHAMPION) == {p.versions["v1"]}), timeout_s=30)


def test_a_bad_version_is_refused_and_the_champion_keeps_serving(platform: Platform) -> None:
    p = platform
    bad, v1 = p.versions["bad"], p.versions["v1"]
    _set_alias(p, CHAMPION, "bad")
    try:
        wait_for(lambda: _assert(_metric(p, "flywheel_model_refused_total") == WORKERS), timeout_s=60)  # each once
        assert "non-finite" in _served(p)["refused"][bad] and _everywhere(p, CHAMPION) == {v1}
        out = httpx.post(f"{p.url}/rank", json=_request(_champion_user(p), 5), timeout=10)
        assert out.status_code == 200 and out.json()["model_version"] == v1
    finally:
        _set_alias(p, CHAMPION, "v1")


def test_a_version_of_another_dataset_is_refused_with_its_terms(platform: Platform) -> None:
    """A version records the terms it was trained with (contract/terms.py); one the server's online
    features cannot satisfy is refused with the reason, and the champion keeps serving."""
    p = platform
    shop, v1 = p.versions["shop"], p.versions["v1"]
    refused = _metric(p, "flywheel_model_refused_total")
    _set_alias(p, CHAMPION, "shop")
    try:
        wait_for(lambda: _assert(_metric(p, "flywheel_model_refused_total") == refused + WORKERS), timeout_s=60)
        reason = _served(p)["refused"][shop]
        assert "trained on event types ['view', 'cart', 'order'] (dataset corner-shop), the stream's are " \
               "['impression', 'click', 'add_to_cart', 'purchase'] (dataset movielens-100k)" in reason, reason
        out = httpx.post(f"{p.url}/rank", json=_request(_champion_user(p), 5), timeout=10)
        assert out.status_code == 200 and out.json()["model_version"] == v1
    finally:
        _set_alias(p, CHAMPION, "v1")


def _capacity(url: str, seconds: float, concurrency: int) -> float:
    """Requests/s answered 200 by `concurrency` high-tier clients sending back to back."""
    results = asyncio.run(closed_loop(url, lambda k, n: _request(k % USERS, 175, tier="high"), concurrency, seconds))
    return sum(r.status == 200 for r in results) / seconds


def _overload(url: str, seconds: float, rate: float) -> list[Served]:
    """`rate` requests/s whatever the answers (open loop), tiers in turn, 50-300 candidates each."""
    tiers = ("high", "normal", "low")
    requests = (_request(n % USERS, 50 + (n * 53) % 250, tier=tiers[n % 3]) for n in range(int(seconds * rate)))
    return asyncio.run(open_loop(url, requests, rate))


def _server_p99(p: Platform, outcome: str) -> float:
    """The upper bound of the latency bucket holding the server's p99 for responses of `outcome`."""
    buckets = []
    for line in httpx.get(f"{p.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("flywheel_request_seconds_bucket{") and f'outcome="{outcome}"' in line:
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.split()[-1])))
    total = buckets[-1][1]
    return next(le for le, count in sorted(buckets) if count >= 0.99 * total)


def _workers_rss_mb(p: Platform) -> dict[int, float]:
    return {w.pid: w.memory_info().rss / 2**20 for w in psutil.Process(p.server_pid).children()}


def test_overload_is_shed_fast_by_tier_and_admitted_requests_stay_bounded(platform: Platform) -> None:
    p = platform
    capacity = _capacity(p.url, 4, 4)
    rss_before = _workers_rss_mb(p)
    results = _overload(p.url, 10, 4 * capacity)
    rss_after = _workers_rss_mb(p)
    statuses = Counter(r.status for r in results)
    reasons = Counter(r.body["reason"] for r in results if r.status == 503)
    assert set(statuses) <= {200, 503} and statuses[503] > 0 and statuses[200] > 0, (statuses, reasons)
    # Refused at admission (queue full, low tier shed): answered without waiting for scoring, by the
    # server's own latency histogram (the load generator shares the two cores and adds its own queueing
    # to what it sees). The shed path does no I/O; what it waits for is the GIL and a core, shared here
    # with the load generator: tens of milliseconds at the p99, bounded by the scoring p99 bar (100 ms).
    assert _server_p99(p, "queue") <= 0.1 and _server_p99(p, "tier") <= 0.1, (
        _server_p99(p, "queue"), _server_p99(p, "tier"))
    admitted = [r.seconds for r in results if r.status == 200]
    # Admitted requests stay bounded in the server: their deadline (500 ms) is checked before scoring,
    # which then takes tens of milliseconds. (What the client sees adds its own queueing.)
    assert _server_p99(p, "ok") <= 1.5, _server_p99(p, "ok")
    tier = lambda r: r.request["tier"]  # noqa: E731
    rate = {t: sum(r.status == 503 for r in results if tier(r) == t) / sum(tier(r) == t for r in results)
            for t in ("high", "normal", "low")}
    assert rate["low"] > rate["high"], rate  # low-value traffic is shed first
    degraded = Counter(tier(r) for r in results if r.status == 200 and r.body["degraded"])
    assert degraded["low"] > 0 and degraded["high"] == 0, degraded
    assert reasons["tier"] > 0, reasons
    assert set(rss_after) == set(rss_before) and len(rss_after) == WORKERS, (rss_before, rss_after)  # none died
    assert all(rss_after[w] - rss_before[w] < 300 for w in rss_after), (rss_before, rss_after)
    assert _server_pid(p.s) == p.server_pid and httpx.get(f"{p.url}/readyz", timeout=5).status_code == 200
    print(f"capacity {capacity:.0f} req/s, offered {4 * capacity:.0f} req/s: statuses {dict(statuses)}, "
          f"shed rate by tier {rate}, reasons {dict(reasons)}, degraded "
          f"{dict(degraded)}, p99 admitted {np.percentile(admitted, 99) * 1000:.0f} ms (server "
          f"{_server_p99(p, 'ok') * 1000:.0f} ms), queue shed p99 in the server <= "
          f"{_server_p99(p, 'queue') * 1000:.0f} ms (tier <= {_server_p99(p, 'tier') * 1000:.0f} ms), "
          f"workers' RSS {rss_before} -> {rss_after} MB")


def test_a_stalled_online_store_cannot_hold_a_request_past_its_deadline(platform: Platform) -> None:
    p = platform
    redis_server = process.read_pidfile(p.s.paths.run_dir / "redis.json").process()
    body = _request(_champion_user(p), 5, deadline_ms=200)
    redis_server.suspend()
    try:
        started = time.monotonic()
        stalled = httpx.post(f"{p.url}/rank", json=body, timeout=10)
        waited = time.monotonic() - started
    finally:
        redis_server.resume()
    assert stalled.status_code == 503 and stalled.json()["reason"] == "features", stalled.text
    assert "Retry-After" in stalled.headers
    assert waited < 0.2 + 0.3, f"answered after {waited:.2f}s with a 200 ms deadline"
    wait_for(lambda: _assert(httpx.post(f"{p.url}/rank", json=body, timeout=10).status_code == 200), timeout_s=10)


@pytest.mark.chaos
def test_a_server_refusing_most_requests_is_degraded_until_it_serves_again(platform: Platform,
                                                                         faults: FaultTable) -> None:
    """Live workers that answer their traffic 503 (here: the online store stalled) are not serving: the
    server is degraded and unhealthy in status within the window, and ok again, by itself, once the
    cause ends and the window has passed."""
    p = platform
    window = p.s.serving.refused_window_s
    redis_server = process.read_pidfile(p.s.paths.run_dir / "redis.json").process()
    body = _request(_champion_user(p), 5, deadline_ms=100)
    health = lambda: httpx.get(f"{p.url}/healthz", timeout=5).json()  # noqa: E731
    redis_server.suspend()
    stalled = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as pool:
            codes = Counter(pool.map(lambda _: httpx.post(f"{p.url}/rank", json=body, timeout=10).status_code,
                                     range(80)))
        assert codes[503] >= 70, codes
        wait_for(lambda: _assert(health()["status"] == "degraded"), timeout_s=window)
        degraded_s = time.monotonic() - stalled
        server = next(x for x in stack.status(p.s) if x.name == "ranking-server")
        assert server.state == "unhealthy" and "with 503" in server.detail, server
    finally:
        redis_server.resume()
    resumed = time.monotonic()
    assert httpx.post(f"{p.url}/rank", json=body | {"deadline_ms": 500}, timeout=10).status_code == 200
    wait_for(lambda: _assert(health()["status"] == "ok"), timeout_s=window + 30)
    faults.record("ranking server answering mostly 503 (online store stopped)",
                  "status unhealthy within 60 s; healthy again without a human after the cause ends",
                  f"{codes[503]} of 80 requests 503; degraded {degraded_s:.0f} s after the stop; ok "
                  f"{time.monotonic() - resumed:.0f} s after the store resumed (window {window:g} s)",
                  degraded_s <= 60)


def test_item_features_are_cached_no_longer_than_the_ttl(platform: Platform) -> None:
    p = platform
    body = {"user_id": f"u{_champion_user(p)}", "candidates": [{"item_id": "i7", "category": "c1"}]}
    score = lambda: httpx.post(f"{p.url}/rank", json=body, timeout=10).json()["scores"][0]  # noqa: E731
    before = score()
    apply(p.s).write_to_online_store("item_total", pd.DataFrame({
        "item_id": ["i7"], "item_impressions_total": [100_000], "item_clicks_total": [90_000],
        "item_ctr_total": [0.9], "event_timestamp": pd.Timestamp(datetime.now(UTC))}))
    written = time.monotonic()
    wait_for(lambda: _assert(score() != pytest.approx(before)), timeout_s=10)
    assert time.monotonic() - written <= p.s.serving.item_features_ttl_ms / 1000 + 1.5


def test_long_lived_connections_end_up_split_evenly_over_the_workers(platform: Platform) -> None:
    """The kernel spreads connections by a hash: 8 keep-alive clients can land 6 to 2. A worker above
    its share closes connections after answering, and the clients' new ones are spread afresh."""
    p = platform
    clients = [http.client.HTTPConnection("127.0.0.1", p.s.serving.port, timeout=10) for _ in range(8)]

    def answered_by(c: http.client.HTTPConnection) -> tuple[int, bool]:
        c.request("GET", "/models")  # reconnects by itself when the last answer closed the connection
        r = c.getresponse()
        body = json.loads(r.read())
        assert r.status == 200, body
        return body["worker"], r.will_close

    rounds = [[answered_by(c) for c in clients] for _ in range(40)]
    last = Counter(pid for pid, _ in rounds[-1])
    assert sorted(last.values()) == [4, 4], last
    assert not any(closed for _, closed in rounds[-1])  # stable once even: no more reconnects
    for c in clients:
        c.close()


def test_a_worker_that_dies_is_replaced_while_the_other_serves(platform: Platform) -> None:
    p = platform
    workers = _served(p)["workers"]
    assert len(workers) == WORKERS and all(w["ready"] and w["listening"] for w in workers.values()), workers
    victim = psutil.Process(int(min(workers)))
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    # New connections reach the live worker: nothing fails.
    body = _request(_champion_user(p), 5)
    statuses = [httpx.post(f"{p.url}/rank", json=body, timeout=10).status_code for _ in range(20)]
    assert statuses == [200] * 20, statuses
    # The supervisor starts a replacement, which takes connections once its champion is warm.
    wait_for(lambda: _assert(str(victim.pid) not in (w := _served(p)["workers"]) and len(w) == WORKERS
                             and all(x["ready"] and x["listening"] for x in w.values())), timeout_s=180)
    assert httpx.get(f"{p.url}/readyz", timeout=5).status_code == 200
    assert _server_pid(p.s) == p.server_pid


def _service(p: Platform, name: str):
    return next(svc for svc in enabled_services(p.s) if svc.name == name)


@pytest.mark.chaos
def test_a_registry_outage_keeps_every_route_and_is_reported(platform: Platform, faults: FaultTable) -> None:
    """MLflow down for a minute under steady /rank load: nobody gets an error, every route keeps its
    version (canary users the challenger), each failed poll is counted and status says why."""
    p = platform
    _set_alias(p, CHALLENGER, "v2")
    wait_for(lambda: _assert(_everywhere(p, CHALLENGER) == {p.versions["v2"]}), timeout_s=30)
    expected = {u: p.versions["v2" if access.route(f"u{u}", 30.0) == CHALLENGER else "v1"] for u in range(USERS)}
    errors = _metric(p, "flywheel_registry_poll_errors_total")
    mlflow_svc = _service(p, "mlflow")
    try:
        process.stop(stack.pidfile(p.s, mlflow_svc), p.s.stack.stop_timeout_s)
        down = time.monotonic()
        wait_for(lambda: _assert({w["registry_reachable"] for w in _served(p)["workers"].values()} == {False}),
                 timeout_s=30)
        # Every route keeps its version: canary users still get the challenger, nobody an error.
        def load(worker: int) -> tuple[Counter, int]:
            codes, wrong, u = Counter(), 0, worker
            while time.monotonic() - down < REGISTRY_OUTAGE_S:
                r = httpx.post(f"{p.url}/rank", json=_request(u % USERS, 6), timeout=10)
                codes[r.status_code] += 1
                wrong += r.status_code == 200 and r.json()["model_version"] != expected[u % USERS]
                u += 4
            return codes, wrong
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(load, range(4)))
        codes, wrong = sum((c for c, _ in answers), Counter()), sum(w for _, w in answers)
        poll_errors = _metric(p, "flywheel_registry_poll_errors_total") - errors
        server = next(x for x in stack.status(p.s) if x.name == "ranking-server")
        faults.record(f"MLflow down {REGISTRY_OUTAGE_S:.0f} s under /rank load",
                      "/rank 0 non-2xx, challenger route kept, poll errors counted, status says registry unreachable",
                      f"{codes.total()} requests: {dict(codes)}, {wrong} served another version; {poll_errors:.0f} "
                      f"poll errors counted; status: "
                      f"{next((x for x in server.detail.split('; ') if 'registry' in x), server.detail)[:90]}",
                      set(codes) == {200} and not wrong and poll_errors > 0 and "registry unreachable" in server.detail)
        assert set(codes) == {200} and not wrong, (codes, wrong)
        assert poll_errors > 0
        assert _served(p)["registry"]["reachable"] is False and _served(p)["registry"]["error"]
        health = httpx.get(f"{p.url}/healthz", timeout=5).json()
        assert health["status"] == "ok" and "registry unreachable" in health["notes"][0], health
        assert "registry unreachable" in server.detail, server
    finally:
        stack.up(p.s)  # MLflow again, on its data
    wait_for(lambda: _assert({w["registry_reachable"] for w in _served(p)["workers"].values()} == {True}),
             timeout_s=60)
    connect(p.s).delete_registered_model_alias(p.s.models.name, CHALLENGER)
    wait_for(lambda: _assert(_everywhere(p, CHALLENGER) == {None}), timeout_s=30)


@pytest.mark.chaos
def test_prometheus_down_never_touches_serving_and_is_in_status(platform: Platform, faults: FaultTable) -> None:
    """Prometheus scrapes the server; the server never waits on it. kill -9 of Prometheus and its exporter
    under /rank load: every request answered 200, status names both stopped, and `up` brings them back
    scraping the server again."""
    p = platform
    wait_for(lambda: _assert(_target_health(p).get("ranking-server") == "up"), timeout_s=60)
    killed = [psutil.Process(process.read_pidfile(stack.pidfile(p.s, _service(p, name))).pid)
              for name in ("prometheus", "metrics-exporter")]
    for proc in killed:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    start = time.monotonic()

    def load(worker: int) -> Counter:
        codes, u = Counter(), worker
        while time.monotonic() - start < 10:
            codes[httpx.post(f"{p.url}/rank", json=_request(u % USERS, 6 + worker), timeout=10).status_code] += 1
            u += 4
        return codes
    with ThreadPoolExecutor(4) as pool:
        codes = sum(pool.map(load, range(4)), Counter())
    states = {x.name: x.state for x in stack.status(p.s)}
    stack.up(p.s)
    wait_for(lambda: _assert(_target_health(p).get("ranking-server") == "up"), timeout_s=60)
    assert faults.record("Prometheus and its exporter kill -9 under /rank load",
                         "/rank 0 non-2xx; status shows them stopped; `up` brings them back, scraping",
                         f"{codes.total()} requests: {dict(codes)}; status: prometheus {states['prometheus']}, "
                         f"metrics-exporter {states['metrics-exporter']}; the server's target up after `up`",
                         set(codes) == {200} and states["prometheus"] == states["metrics-exporter"] == "stopped")
    assert set(codes) == {200}, codes


def _target_health(p: Platform) -> dict[str, str]:
    from infra.monitoring import targets

    return {t["job"]: t["health"] for t in targets(p.s)}


@pytest.mark.chaos
def test_a_broker_crash_is_reported_and_the_prediction_log_recovers_by_itself(platform: Platform,
                                                                               faults: FaultTable) -> None:
    """kill -9 of the broker under /rank: every record the server could not deliver is counted, the server
    says its log is down, and it logs again once the broker is back, with no restart."""
    p = platform
    user = _champion_user(p)
    undelivered = _metric(p, "flywheel_prediction_log_errors_total")
    broker = psutil.Process(process.read_pidfile(stack.pidfile(p.s, _service(p, "kafka"))).pid)
    broker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    broker.wait(10)
    during = {f"outage-{k}" for k in range(4)}
    for i in during:
        assert httpx.post(f"{p.url}/rank", json=_request(user, 5, request_id=i), timeout=10).status_code == 200
    wait_for(lambda: _assert(httpx.get(f"{p.url}/healthz", timeout=5).json()["status"] == "degraded"), timeout_s=30)
    server = next(x for x in stack.status(p.s) if x.name == "ranking-server")
    assert server.state == "unhealthy" and "prediction log down" in server.detail, server
    unhealthy_s = time.monotonic() - killed
    stack.up(p.s)  # the broker again, its log kept
    back = time.monotonic()
    # Up again with nothing to send: the log asks whether a broker answers (`up` waits for a healthy server).
    wait_for(lambda: _assert(httpx.get(f"{p.url}/healthz", timeout=5).json()["status"] == "ok"), timeout_s=30)
    ok_s = time.monotonic() - back
    after = {f"after-{k}" for k in range(4)}

    def logging_again() -> None:
        for i in after:
            assert httpx.post(f"{p.url}/rank", json=_request(user, 5, request_id=i), timeout=10).status_code == 200
        assert {r["request_id"] for r in _predictions(p, after, timeout_s=5)} >= after
    wait_for(logging_again, timeout_s=90)
    wait_for(lambda: _assert(httpx.get(f"{p.url}/healthz", timeout=5).json()["status"] == "ok"), timeout_s=30)
    # What the outage's requests logged either reached the broker once back or was counted as not delivered.
    delivered = {r["request_id"] for r in _predictions(p, during, timeout_s=5)}
    counted = _metric(p, "flywheel_prediction_log_errors_total") - undelivered
    assert faults.record("dead prediction producer (broker kill -9 under /rank)",
                         "status unhealthy within 60 s; healthy again without a human after the cause ends",
                         f"/rank 200 throughout; server unhealthy (prediction log down) {unhealthy_s:.0f} s after the "
                         f"kill; healthy {ok_s:.0f} s after the broker was back, no restart; {len(delivered)} of "
                         f"{len(during)} outage records delivered, {counted:.0f} counted undelivered",
                         unhealthy_s <= 60 and len(delivered) + counted >= len(during))
