"""The stack CLI against the real services: up, status, logs, down, and a port that is taken."""

import re
import signal
import socket
import stat
import time
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from kafka import KafkaAdminClient

from infra import monitoring, process, stack
from infra.process import tagged
from infra.redis_clients import online_store
from infra.services import enabled_services
from infra.settings import Settings, load_settings, redis_password
from infra.stack import STACK_TAG
from streaming.topics import prepare_pipeline
from tests.conftest import broker_environ, run_cli, running_stack, stack_environ, wait_for

pytestmark = pytest.mark.stack


def stack_processes(data_dir: Path, service_pids: list[int] = ()) -> set[psutil.Process]:
    """Live processes of the stack of `data_dir`: those carrying its tag, and the services' trees."""
    found = set(tagged(STACK_TAG, str(data_dir)))
    for pid in service_pids:
        try:
            proc = psutil.Process(pid)
            found |= {proc, *proc.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def listening_sockets(proc: psutil.Process) -> list:
    try:
        return [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        return []


def pids(status_output: str) -> dict[str, str]:
    return dict(re.findall(r"^(\S+)\s+healthy\s+pid (\d+)", status_output, re.MULTILINE))


def test_up_is_idempotent_status_reports_health_and_down_leaves_nothing(tmp_path: Path) -> None:
    environ = stack_environ(tmp_path / "data")
    settings = load_settings(environ)
    try:
        first = run_cli(environ, "up")
        assert first.returncode == 0, first.stdout + first.stderr
        services = ["kafka", "redis", "mlflow", "airflow-api-server", "airflow-scheduler", "airflow-dag-processor",
                    "stream-job", "feast-ingestor", "event-log", "prediction-archive", "user-embedder",
                    "canary-analyst", "ranking-server", "metrics-exporter", "prometheus"]
        assert sorted(pids(first.stdout)) == sorted(services)

        # Prometheus scrapes every stage the stack runs, each answering (the exporter's parts ask their sources).
        def all_targets_up() -> None:
            seen = {t["job"]: t["health"] for t in monitoring.targets(settings)}
            assert seen == dict.fromkeys(("prometheus", "ranking-server", "pipeline", "flink", "redis", "registry",
                                          "airflow", "canary", "consistency"), "up"), seen
        wait_for(all_targets_up, timeout_s=90)

        again = run_cli(environ, "up")
        assert again.returncode == 0 and "already running" in again.stdout
        assert pids(again.stdout) == pids(first.stdout)  # nothing restarted

        status = run_cli(environ, "status")
        assert status.returncode == 0
        assert pids(status.stdout) == pids(first.stdout)
        # Where the passwords are, not what they are: terminal output ends up in logs.
        for service in ("airflow", "mlflow", "redis"):
            password_file = settings.paths.data_dir / service / "admin-password"
            assert service == "redis" or f"password in {password_file}" in status.stdout
            assert password_file.read_text().strip() not in first.stdout + status.stdout
            assert oct(password_file.stat().st_mode & 0o777) == "0o600"
        status = run_cli(environ, "status", "--show-secrets")
        login = re.search(r"Airflow UI: (\S+)\s+login: (\S+) / (\S+)", status.stdout)
        assert login and login.group(1) == settings.airflow.api_url
        mlflow_login = re.search(r"MLflow UI: +(\S+)\s+login: (\S+) / (\S+)", status.stdout)
        assert mlflow_login and mlflow_login.group(1) == settings.mlflow.tracking_uri
        search = f"{settings.mlflow.tracking_uri}/api/2.0/mlflow/registered-models/search"
        assert httpx.get(search, auth=(mlflow_login.group(2), mlflow_login.group(3))).status_code == 200
        assert httpx.get(search).status_code == 401
        token = httpx.post(f"{settings.airflow.api_url}/auth/token",
                           json={"username": login.group(2), "password": login.group(3)})
        assert token.status_code in (200, 201) and token.json()["access_token"]
        wrong = httpx.post(f"{settings.airflow.api_url}/auth/token",
                           json={"username": login.group(2), "password": "not-the-password"})
        assert wrong.status_code == 401

        # Redis wants its generated password; every client has it.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(settings.redis.url).ping()
        assert redis.Redis.from_url(settings.redis.url, password=redis_password(settings)).ping()

        logs = run_cli(environ, "logs", "mlflow", "-n", "5")
        assert logs.returncode == 0 and logs.stdout.strip()
        assert all((settings.paths.logs_dir / f"{name}.log").exists() for name in services)

        service_pids = [int(p) for p in pids(first.stdout).values()]
        running = stack_processes(settings.paths.data_dir, service_pids)
        assert len(running) > len(services)  # services and their workers
        # Nothing the stack opens listens beyond this machine: the Flink JVM's servers and PyFlink's included.
        listening = {(proc.name(), conn.laddr) for proc in running for conn in listening_sockets(proc)}
        assert {settings.flink.host_port[1], settings.serving.port, settings.prometheus.host_port[1],
                settings.prometheus.exporter_host_port[1]} <= {a.port for _, a in listening}, listening
        assert all(address.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for _, address in listening), listening
        # Batch work yields the cores: the scheduler (whose executor starts the DAG tasks) and the DAG
        # processor run nicer than the services that answer users.
        nice = {name: psutil.Process(int(pid)).nice() for name, pid in pids(first.stdout).items()}
        base = psutil.Process().nice()
        assert nice["airflow-scheduler"] == nice["airflow-dag-processor"] == min(19, base + settings.airflow.niceness)
        assert nice["ranking-server"] == nice["stream-job"] == base < nice["airflow-scheduler"], nice
        # ... and so does their session's scheduling group, where the kernel groups by session (autogroups):
        # there a process's own niceness counts only within its group.
        autogroup = Path(f"/proc/{pids(first.stdout)['airflow-scheduler']}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == str(nice["airflow-scheduler"]), autogroup.read_text()
    finally:
        down = run_cli(environ, "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    gone, alive = psutil.wait_procs(running, timeout=5)
    assert alive == []
    assert stack_processes(settings.paths.data_dir, service_pids) == set()
    assert "nothing was running" in run_cli(environ, "down").stdout
    stopped = run_cli(environ, "status")
    assert stopped.returncode == 1 and "stopped" in stopped.stdout


def test_a_taken_port_is_reported_with_the_service_that_needs_it(tmp_path: Path) -> None:
    environ = stack_environ(tmp_path / "data")
    settings = load_settings(environ)
    host, port = settings.redis.host_port
    with socket.socket() as squatter:
        squatter.bind((host, port))
        squatter.listen()
        done = run_cli(environ, "up")
    assert done.returncode != 0
    assert f"port {port} on {host} (needed by redis) is already in use" in done.stderr
    assert stack_processes(settings.paths.data_dir) == set()  # nothing was started
    assert not any(settings.paths.run_dir.glob("*.json"))


def test_a_new_events_topic_keeps_the_stream_checkpoints(broker: Settings, tmp_path: Path) -> None:
    """A broker that lost its topics: they are created again, and the job's checkpoints stay (it resumes its
    aggregates and reads the new topic from its start)."""
    s = load_settings(stack_environ(tmp_path, **broker_environ(broker),
                                    FLYWHEEL_KAFKA_EVENTS_TOPIC=f"events-{tmp_path.name}"))
    kept = s.paths.checkpoints_dir / "job" / "chk-7"
    kept.mkdir(parents=True)
    (kept / "_metadata").write_bytes(b"state of the aggregates, offsets of a topic that is gone")
    prepare_pipeline(s)  # creates the events topic
    assert (kept / "_metadata").exists()
    admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", "admin"))
    assert s.kafka.events_topic in admin.list_topics()
    admin.close()


def test_the_online_store_keeps_what_it_took_across_a_crash_and_its_files_are_private(tmp_path: Path) -> None:
    """kill -9 of Redis and `up`: every write acknowledged more than a second before the kill is there
    (append-only file, synced every second; the ingestor commits its offsets once Redis took the rows).
    What the stack writes is its owner's alone: the data directory 700, Redis' files 600."""
    for s in running_stack(tmp_path / "stack", "redis"):
        client = online_store(s)
        with client.pipeline(transaction=False) as pipe:
            for i in range(2000):
                pipe.hset(f"crash-test:{i}", mapping={"clicks": i, "ctr": i / 2000})
            pipe.execute()
        time.sleep(1.2)
        redis_svc = next(svc for svc in enabled_services(s) if svc.name == "redis")
        victim = psutil.Process(process.read_pidfile(stack.pidfile(s, redis_svc)).pid)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        stack.up(s)
        client = online_store(s)
        assert [client.hget(f"crash-test:{i}", "clicks") for i in (0, 999, 1999)] == [b"0", b"999", b"1999"]
        assert sum(1 for _ in client.scan_iter("crash-test:*", count=1000)) == 2000
        assert stat.S_IMODE(s.paths.data_dir.stat().st_mode) == 0o700
        files = [f for f in s.paths.service_dir("redis").rglob("*") if f.is_file()]
        assert any(f.suffix == ".aof" for f in files), files
        assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: "0o600" for f in files}


def test_up_keeps_what_it_started_when_a_service_it_found_running_stays_unhealthy(tmp_path: Path) -> None:
    """`up` after a crash (here: the broker) starts what is gone; a service that was running and stays
    unhealthy (Redis, stopped) is named, but never makes `up` stop the broker it just started."""
    for s in running_stack(tmp_path / "stack", "kafka,redis"):
        pids = {svc.name: process.read_pidfile(stack.pidfile(s, svc)).pid for svc in enabled_services(s)}
        broker = psutil.Process(pids["kafka"])
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        stopped_redis = psutil.Process(pids["redis"])
        stopped_redis.suspend()
        try:
            hurried = replace(s, stack=replace(s.stack, start_timeout_s=5.0))
            with pytest.raises(stack.StackError, match=r"started kafka; running before this `up` and still "
                                                       r"unhealthy after 5s: redis \("):
                stack.up(hurried)
            kafka = next(st for st in stack.status(s) if st.name == "kafka")
            assert kafka.state == "healthy" and kafka.pid != pids["kafka"], kafka
        finally:
            stopped_redis.resume()
        assert stack.up(s) == []  # all running and healthy again: nothing to start
