"""The cluster profile (`flywheel up --profile cluster`): every engine in its distributed form on this
machine, and a shortened loop on it: events -> Flink session cluster (parallelism 2) -> features online,
read through the Redis Cluster -> offline_training run by a Celery worker -> the version in MLflow on
PostgreSQL with its artifacts in S3 -> served by the ranking API. Then `down` leaves no process behind."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import psycopg2
import pytest
import redis
from confluent_kafka import Producer
from kafka import KafkaAdminClient

from flywheel.demo import LoopPlan, Summary
from flywheel.demo.loop import first_champion, history_events
from flywheel.demo.probes import wait_serving
from infra import object_store, process, stack
from infra.airflow_api import AirflowClient
from infra.redis_clients import credentials
from infra.settings import Settings, load_settings, postgres_password
from models.registry import connect
from serving.features import OnlineFeatures
from tests.conftest import answered, run_cli, stack_environ, wait_for

pytestmark = [pytest.mark.stack, pytest.mark.cluster, pytest.mark.timeout(1500)]
PLAN = LoopPlan(history_limit=3000, feature_timeout_s=300, training_timeout_s=900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Settings]]:
    data_dir: Path = tmp_path_factory.mktemp("cluster")
    # Only what the test triggers runs: no scheduled training competes for the two cores.
    environ = stack_environ(data_dir, "cluster", FLYWHEEL_AIRFLOW_FULL_TRAINING_SCHEDULE="",
                            FLYWHEEL_RETRIEVAL_TRAINING_SCHEDULE="", FLYWHEEL_SERVING_POLL_INTERVAL_S="1")
    up = run_cli(environ, "up", "--profile", "cluster", timeout=900)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield environ, load_settings(environ)
    finally:
        run_cli(environ, "down", "--profile", "cluster", timeout=300)


@pytest.fixture(scope="module")
def loop(cluster) -> tuple[Settings, Summary, str]:
    """History replayed, the first offline training through Airflow, its champion served."""
    _, s = cluster
    summary = Summary()
    history_events(s, PLAN, summary, print)
    champion = first_champion(s, PLAN, AirflowClient(s), summary, print)
    wait_serving(f"http://{s.serving.host}:{s.serving.port}", champion, 300)
    return s, summary, champion


def _status(environ: dict[str, str], all_healthy: bool = True) -> list[dict]:
    """`status --json`'s rows; it exits 1 while a service is not healthy, so `all_healthy=False` reads them anyway."""
    result = run_cli(environ, "status", "--profile", "cluster", "--json")
    assert result.returncode == 0 or not all_healthy, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_status_names_every_engine_in_its_distributed_form(cluster) -> None:
    environ, s = cluster
    services = {row["name"]: row for row in _status(environ)}
    assert {row["state"] for row in services.values()} == {"healthy"}, services
    assert all(services[name]["pid"] for name in services)
    # Flink: a session cluster of 2 TaskManagers, the feature job RUNNING on it at parallelism 2.
    # Read through the stream job's read-only front; the JobManager's REST API wants the stack's certificate.
    assert services["flink-jobmanager"]["url"] == s.flink.api_url
    flink = services["stream-job"]["url"]
    assert httpx.get(f"{flink}/overview", timeout=5).json()["taskmanagers"] == 2
    jobs = [j for j in httpx.get(f"{flink}/jobs/overview", timeout=5).json()["jobs"] if j["state"] == "RUNNING"]
    assert [j["name"] for j in jobs] == [s.streaming.job_name]
    vertices = httpx.get(f"{flink}/jobs/{jobs[0]['jid']}", timeout=5).json()["vertices"]
    assert {v["parallelism"] for v in vertices} == {2}
    # Redis Cluster: 3 masters, state ok. A probe needs no credentials; anything else does.
    node = redis.Redis.from_url(services["redis-1"]["url"])
    info = node.execute_command("CLUSTER INFO")
    assert info["cluster_state"] == "ok" and info["cluster_known_nodes"] == "3" and info["cluster_size"] == "3"
    with pytest.raises(redis.exceptions.NoPermissionError):
        node.get("anything")
    # PostgreSQL from the stack's data directory; a Celery worker of this stack.
    assert services["postgres"]["url"].startswith("postgresql://")
    postgres = psutil.Process(services["postgres"]["pid"])
    assert postgres.name() == "postgres" and str(s.paths.data_dir) in " ".join(postgres.cmdline())
    worker = " ".join(psutil.Process(services["airflow-worker-1"]["pid"]).cmdline())  # Celery retitles it
    assert "celery" in worker and "worker" in worker, worker


def test_features_of_the_history_are_read_online_through_the_redis_cluster(loop) -> None:
    s, summary, _ = loop
    assert summary.history_events["impression"] == PLAN.history_limit
    # The history's users' rows are spread over the masters, and the server's reader finds them.
    nodes = [redis.Redis(host=host, port=port, **credentials(s)) for host, port in s.redis.nodes]
    assert all(node.dbsize() > 0 for node in nodes)
    reader = OnlineFeatures(s)
    users = {e.user_id for e in _history(s)}
    totals = [reader.entity_features(user, None, None)["user_impressions_total"] for user in sorted(users)[:20]]
    assert all(total and total > 0 for total in totals), totals


def _history(s: Settings) -> list:
    from streaming.movielens import replay_events

    return list(replay_events(s, PLAN.history_limit, int(PLAN.split.timestamp())))


def test_offline_training_ran_on_a_celery_worker(loop) -> None:
    s, _, _ = loop
    conn = psycopg2.connect(host=s.postgres.host_port[0], port=s.postgres.host_port[1], dbname="airflow",
                            user=s.postgres.username, password=postgres_password(s))
    with conn, conn.cursor() as cur:
        # Celery's result backend: one row per task a worker executed.
        cur.execute("SELECT status, count(*) FROM celery_taskmeta GROUP BY status")
        by_status = dict(cur.fetchall())
        cur.execute("SELECT count(*) FROM task_instance WHERE dag_id = 'offline_training' AND state = 'success'")
        succeeded = cur.fetchone()[0]
    conn.close()
    assert succeeded >= 3 and by_status.get("SUCCESS", 0) >= succeeded, (by_status, succeeded)


def test_the_version_is_in_mlflow_on_postgres_with_its_artifacts_in_s3(loop) -> None:
    s, _, champion = loop
    version = connect(s).get_model_version(s.models.name, champion)
    conn = psycopg2.connect(host=s.postgres.host_port[0], port=s.postgres.host_port[1], dbname="mlflow",
                            user=s.postgres.username, password=postgres_password(s))
    with conn, conn.cursor() as cur:
        cur.execute("SELECT version FROM model_versions WHERE name = %s", (s.models.name,))
        assert int(champion) in {row[0] for row in cur.fetchall()}
    conn.close()
    bucket = object_store.ensure_bucket(s)
    keys = [o["Key"] for page in object_store.client(s).get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    model_id = next(part for part in re.split("[/:]", version.source) if part.startswith("m-"))  # its logged model
    assert any(model_id in key and key.endswith("MLmodel") for key in keys), (model_id, keys[:20])
    assert not (s.paths.service_dir("mlflow") / "artifacts").exists()  # nothing kept beside the server


def test_the_champion_is_served_by_the_ranking_api(loop) -> None:
    s, _, champion = loop
    user = _history(s)[-1].user_id
    items = list(dict.fromkeys(e.item_id for e in _history(s)))[:30]
    body = answered(f"http://{s.serving.host}:{s.serving.port}/rank",
                    {"user_id": user, "candidates": [{"item_id": i} for i in items]})
    assert body["model_version"] == champion and len(body["scores"]) == len(items)
    assert all(0.0 < score < 1.0 for score in body["scores"])


def test_a_kafka_node_killed_under_load_loses_nothing_and_up_brings_it_back(cluster, loop) -> None:
    """A KRaft quorum of 3, every topic on 3 replicas with 2 in sync: kill -9 of a node while a plain
    producer (acks=all) sends 300,000 events (stream-throughput's load) loses none of them (every user's
    total online, every acknowledged event counted), with no `up`; status says the cluster is degraded
    until `up` restarts the node and its replicas are in sync again."""
    environ, s = cluster
    assert len(s.kafka.addresses) == 3 and s.kafka.replication_factor == 3
    admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", "admin"))
    events = next(t for t in admin.describe_topics([s.kafka.events_topic]))
    admin.close()
    assert {len(p["replica_nodes"]) for p in events["partitions"]} == {3}
    victim = next(row for row in _status(environ) if row["name"] == "kafka-2")
    producer = Producer(s.kafka.client_options("librdkafka") | {"acks": "all", "linger.ms": 20,
                                                                "enable.idempotence": True})
    acked: list[bytes] = []
    users, n = [f"kafka-kill-{k}" for k in range(50)], 300_000
    for i in range(n):
        user = users[i % len(users)]
        value = json.dumps({"schema_version": 1, "event_id": f"kk-{i}", "user_id": user, "item_id": "1",
                            "event_type": "impression", "request_id": f"kk-r{i}",
                            "event_time": int(time.time() * 1000), "context": {}}).encode()
        while True:
            try:
                producer.produce(s.kafka.events_topic, key=user.encode(), value=value,
                                 on_delivery=lambda err, msg: err or acked.append(msg.key()))
                break
            except BufferError:
                producer.poll(0.05)
        if i == n // 3:
            psutil.Process(victim["pid"]).kill()
    assert producer.flush(120) == 0 and len(acked) == n

    def degraded() -> None:
        rows = {row["name"]: row for row in _status(environ, all_healthy=False)}
        assert rows["kafka-2"]["state"] == "stopped", rows["kafka-2"]
        assert rows["kafka-1"]["state"] == "unhealthy" and "degraded" in rows["kafka-1"]["detail"], rows["kafka-1"]
    wait_for(degraded, timeout_s=60)
    reader = OnlineFeatures(s)

    def all_online() -> None:
        totals = [reader.entity_features(user, None, None)["user_impressions_total"] for user in users]
        assert totals == [n // len(users)] * len(users), totals
    wait_for(all_online, timeout_s=600)
    up = run_cli(environ, "up", "--profile", "cluster", timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    wait_for(lambda: _assert_healthy([r for r in _status(environ, all_healthy=False)
                                      if r["name"].startswith("kafka-")]), 120)


def _assert_healthy(rows: list[dict]) -> None:
    assert len(rows) == 3 and {r["state"] for r in rows} == {"healthy"}, rows
    assert all(" 0 under-replicated" in r["detail"] for r in rows), rows


def test_down_stops_every_process_it_started(cluster, loop) -> None:
    environ, s = cluster
    down = run_cli(environ, "down", "--profile", "cluster", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert process.tagged(stack.STACK_TAG, str(s.paths.data_dir)) == []
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if str(s.paths.data_dir) in " ".join(p.info["cmdline"] or [])]
    assert left == []
