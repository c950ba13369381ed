"""The ranking server with the sparse tier on (`sparse_tier.enabled`), its embedding store a Redis of its own:
registration writes a full version and an incremental one's delta, the server reads them from the store
with the scores of the same version held whole, a delta reaches every worker before the swap, a rollback
is sub-second, a run continued from the store registers only its delta and loads whole, and a kill -9 of
the store under concurrent load answers no 500 (default rows, counted) and recovers when it is back."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import keras
import mlflow
import numpy as np
import pytest

from infra import process, stack
from infra.settings import Settings, override
from models.ctr import CtrModel
from models.registry import CHAMPION, connect, load_version, log_model, version_tags
from models.sparse_tier import announce, export_rows, pull, store
from tests.conftest import running_stack
from tests.test_serving import SPEC, USERS, _examples, _register, _request, _write_features

pytestmark = pytest.mark.stack
WORKERS = 2


@dataclass
class Tier:
    s: Settings
    emb: Settings  # the embedding store's own Redis
    url: str
    versions: dict[str, str]
    delta: Path  # v2's delta export


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    tmp = tmp_path_factory.mktemp("sparse-serving")
    password = secrets.token_hex(12)
    for emb in running_stack(tmp / "emb", "redis", FLYWHEEL_REDIS_PASSWORD=password):
        common = {"FLYWHEEL_REDIS_PASSWORD": password, "FLYWHEEL_SPARSE_TIER_ENABLED": "true",
                  "FLYWHEEL_SPARSE_TIER_REDIS_URL": emb.redis.url, "FLYWHEEL_SERVING_WORKERS": str(WORKERS),
                  "FLYWHEEL_SERVING_POLL_INTERVAL_S": "0.5", "FLYWHEEL_SERVING_DEFAULT_DEADLINE_MS": "1000"}
        for s in running_stack(tmp / "stack", "kafka,redis,mlflow,serving", **common):
            _write_features(s)
            keras.utils.set_random_seed(7)
            model = CtrModel(SPEC)
            model.fit(_examples(3000, seed=1), progress=False)
            v1 = _register(s, "v1", model.save(tmp / "v1"))
            whole = _register(override(s, "sparse_tier", enabled=False), "v1-whole", tmp / "v1")
            connect(s).set_registered_model_alias(s.models.name, CHAMPION, v1)
            url = f"http://127.0.0.1:{s.serving.port}"
            _until(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 180, "the server ready")
            since = model.versions()
            model.fit(_examples(2000, seed=2), progress=False)  # an incremental run: v2 = v1 + delta
            model.save_delta(tmp / "v2-delta", since)
            v2 = _register(s, "v2", model.save(tmp / "v2"), {"parent_version": v1}, delta=tmp / "v2-delta")
            yield Tier(s, emb, url, {"v1": v1, "v1-whole": whole, "v2": v2}, tmp / "v2-delta")


def _until(holds: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


def _workers(t: Tier) -> dict:
    return httpx.get(f"{t.url}/models", timeout=5).json()["workers"]


def _metric(t: Tier, name: str, **labels: str) -> dict[str, float]:
    """Each worker's (pid label) or the summed value of a metric with these labels."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{t.url}/metrics", timeout=5).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            pid = head.split('pid="')[1].split('"')[0] if 'pid="' in head else ""
            out[pid] = out.get(pid, 0.0) + float(value)
    return out


def _scores(t: Tier, requests: list[dict]) -> list[list[float]]:
    with httpx.Client(base_url=t.url, timeout=30) as c:
        return [c.post("/rank", json=r).json()["scores"] for r in requests]


def _serving(t: Tier, label: str) -> None:
    connect(t.s).set_registered_model_alias(t.s.models.name, CHAMPION, t.versions[label])
    version = t.versions[label]
    _until(lambda: [w["serving"].get("champion") for w in _workers(t).values()] == [version] * WORKERS, 120,
           f"every worker serving v{version}")


def test_the_store_serves_the_scores_of_the_version_held_whole(tier: Tier) -> None:
    t = tier
    requests = [_request(u, 5 + u * 7) for u in range(0, USERS, 3)] + [_request(USERS + 5, 20)]  # + an unknown user
    _serving(t, "v1")
    models = httpx.get(f"{t.url}/models", timeout=5).json()
    assert models["loaded_by"].get(t.versions["v1"]) == "store", str(models)[:3000]
    from_store = _scores(t, requests)
    _serving(t, "v1-whole")  # not in the store: each worker loads it whole from the registry
    whole = _scores(t, requests)
    for a, b in zip(from_store, whole):
        assert a == pytest.approx(b, abs=1e-6)
    # Registration wrote v1 in full and v2 as its delta; v1-whole was registered with the tier off.
    emb = store(t.s)
    assert (emb.info(t.versions["v2"]).parent, emb.info(t.versions["v1"]).depth) == (t.versions["v1"], 0)
    assert emb.info(t.versions["v1-whole"]) is None


def test_a_delta_reaches_every_worker_and_a_rollback_is_sub_second(tier: Tier) -> None:
    t = tier
    _serving(t, "v1")
    _scores(t, [_request(u, 30) for u in range(USERS)])  # hot rows in every worker's cache of v1
    emb = store(t.s)
    applied = _metric(t, "flywheel_sparse_delta_seconds_count").get("", 0.0)
    announced = time.monotonic()
    announce(t.s, emb.info(t.versions["v2"]), export_rows(t.delta))  # again: registration announced it once
    _until(lambda: _metric(t, "flywheel_sparse_delta_seconds_count")[""] >= applied + WORKERS, 30,
           "the delta applied by every worker")
    assert time.monotonic() - announced < 10
    assert {v for v in _metric(t, "flywheel_sparse_delta_applied").values()} == {float(t.versions["v2"])}
    _serving(t, "v2")
    v2_scores = _scores(t, [_request(u, 30) for u in range(USERS)])
    started = time.monotonic()
    _serving(t, "v1")  # the rollback: both warm, v1's rows read from the store as they were
    assert time.monotonic() - started < 1.5
    assert _scores(t, [_request(u, 30) for u in range(USERS)]) != v2_scores


def test_a_run_continued_from_the_store_registers_its_delta_and_loads_whole(tier: Tier, tmp_path: Path) -> None:
    """An incremental run continued from the store (only the rows its window touches) registers its delta as
    its export: the store holds it as v2's delta, and MLflow loads it whole through v2, with the scores of the
    same run continued from v2 held whole, on ids outside its window too."""
    t, v2 = tier, tier.versions["v2"]
    window = _examples(60, seed=3)
    whole, pulled = load_version(t.s, v2), pull(t.s, v2, window)
    assert pulled is not None and 0 < len(pulled.tables["item"]) < len(whole.tables["item"])
    since = whole.versions()
    for model in (whole, pulled):
        model.fit(window, progress=False)
    pulled.save_delta(tmp_path / "delta", since)
    mlflow.set_experiment(t.s.models.experiment)
    with mlflow.start_run(run_name="v3-from-store"):
        v3 = log_model(t.s, tmp_path / "delta", {"kind": "ranker", "data_start": "", "data_end": "",
                                                 "parent_version": v2}, delta_dir=tmp_path / "delta", base=v2)
    assert store(t.s).info(v3).parent == v2 and version_tags(t.s, v3)["sparse_base"] == v2
    later = _examples(600, seed=4)
    np.testing.assert_allclose(load_version(t.s, v3).predict(later), whole.predict(later), rtol=0, atol=1e-6)


def test_a_killed_store_under_load_gives_default_rows_never_a_500(tier: Tier) -> None:
    t = tier
    _serving(t, "v1")
    statuses: Counter[int] = Counter()
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(base_url=t.url, timeout=30) as c:
            n = 0
            while not stop.is_set():
                # Heterogeneous: users known and unknown, 1 to 300 candidates, and items never seen before (the
                # caches cannot hold them: each request reads the store).
                body = _request((k * 7 + n) % (USERS + 5), 1 + (k * 37 + n * 11) % 300)
                body["candidates"] += [{"item_id": f"new-{k}-{n}-{j}", "category": "c1"} for j in range(3)]
                r = c.post("/rank", json=body)
                statuses[r.status_code] += 1
                n += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    try:
        time.sleep(2)
        defaults = sum(_metric(t, "flywheel_sparse_rows_total", outcome="default").values())
        pid = process.read_pidfile(t.emb.paths.run_dir / "redis.json").pid
        os.kill(pid, signal.SIGKILL)
        _until(lambda: sum(_metric(t, "flywheel_sparse_rows_total", outcome="default").values()) > defaults, 30,
               "rows scored with the default row once the store is killed")
        time.sleep(3)
        stack.up(t.emb)  # back, with its rows (appendonly)
        stored = sum(_metric(t, "flywheel_sparse_rows_total", outcome="store").values())
        _until(lambda: sum(_metric(t, "flywheel_sparse_rows_total", outcome="store").values()) > stored, 30,
               "rows read from the store once it is back")
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert statuses[200] > 0 and not statuses[500], statuses
    assert set(statuses) <= {200, 503}, statuses
