"""Every endpoint, port, path and credential source of Flywheel, in one place.

Precedence, lowest to highest: the defaults below, a TOML config file (``$FLYWHEEL_CONFIG``, else
``flywheel.toml`` in the repository root if present), then environment variables named
``FLYWHEEL_<SECTION>_<FIELD>`` (for example ``FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS``).

Standard library only: the Flink job's environment imports this module too.
Secrets are never given defaults here; they come from the config file or the environment, and the
local Airflow admin password, when unset, is generated once into the data directory.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from infra.dataset import SCENARIO_SECTIONS, DatasetSpec, SpecError, load_spec

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "FLYWHEEL_"
# Every service group the local stack can run; the default profile runs DEFAULT_SERVICES. "postgres",
# "s3" and "flink" (a session cluster) back the distributed forms of the cluster profile.
LOCAL_SERVICES = ("kafka", "redis", "postgres", "s3", "mlflow", "airflow", "flink", "pipeline", "serving",
                  "prometheus")
DEFAULT_SERVICES = ("kafka", "redis", "mlflow", "airflow", "pipeline", "serving", "prometheus")
PROFILES_DIR = REPO_ROOT / "infra" / "profiles"  # <name>.toml: a config file layered under the user's


KafkaClient = Literal["kafka-python", "librdkafka", "java"]


class SettingsError(ValueError):
    """A setting could not be read or has an invalid value."""


@dataclass(frozen=True)
class PathSettings:
    data_dir: Path = REPO_ROOT / ".flywheel"  # services' data, logs and PID files
    cache_dir: Path = Path.home() / ".cache" / "flywheel"  # downloads (data sets, wheels)
    platform_python: Path = REPO_ROOT / ".venv" / "bin" / "python"
    flink_python: Path = REPO_ROOT / ".venv-flink" / "bin" / "python"
    flink_jars_dir: Path = REPO_ROOT / ".venv-flink" / "connector-jars"
    dags_dir: Path = REPO_ROOT / "dags"

    def service_dir(self, service: str) -> Path:
        return self.data_dir / service

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def checkpoints_dir(self) -> Path:
        """The stream job's checkpoints (Kafka offsets and operator state)."""
        return self.data_dir / "flink" / "checkpoints"


@dataclass(frozen=True)
class StackSettings:
    # A named configuration, infra/profiles/<profile>.toml, read under the config file (which may set
    # this too): "cluster" runs each engine in its distributed form. Empty: the defaults below.
    profile: str = ""
    # Services `flywheel up` starts locally. Drop one when its endpoint points at a real cluster.
    # "pipeline" is the stream job (in a local Flink MiniCluster, or submitted to flink.rest_url with
    # flink.target "remote"), the Feast ingestor and the event log.
    services: tuple[str, ...] = DEFAULT_SERVICES
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0
    # A consumer (Feast ingestor, event log) that has not polled for this long, or is behind and has not
    # written for this long, is unhealthy in `flywheel status` (infra/progress.py).
    stall_after_s: float = 30.0


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str = "127.0.0.1:9092"
    events_topic: str = "events"
    dlq_suffix: str = ".dlq"
    partitions: int = 4
    replication_factor: int = 1
    # Replicas that must have a record before it is acknowledged (producers send acks=all): with 3 replicas
    # and 2, a node may fail without an acknowledged record being lost or producing stopping.
    min_insync_replicas: int = 1
    max_event_bytes: int = 64 * 1024  # larger events are refused (producer) or dead-lettered (consumer)
    # Each platform client connects as its role's principal (infra/kafka_auth.py). The local stack's broker
    # asks for SCRAM-SHA-512: unset here, each role logs in as a user of its name with the password in
    # `credentials_dir`/<role> (generated, mode 600). For a cluster of your own, set the mechanism and
    # either one user for every role (sasl_username/sasl_password) or `credentials_dir` with a file per role.
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = ""  # from config/env only
    credentials_dir: str = ""
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 2000
    # How long the broker holds a fetch of the stream's own consumers (the feature ingestor, the near-line
    # embedder) when there is nothing new: a quiet stream's freshness grows by up to this.
    fetch_wait_ms: int = 100
    # The local broker (Apache Kafka in KRaft mode, infra/kafka_broker.py): its JVM heap, and how often its
    # log is fsynced (records acknowledged but not yet synced are lost to a power cut, not to a crash of
    # the process: the OS holds them).
    broker_heap: str = "512m"
    flush_interval_ms: int = 1000

    def dlq_topic(self, topic: str) -> str:
        return topic + self.dlq_suffix

    def stream_consumer(self, group: str, role: str = "pipeline") -> dict[str, Any]:
        """librdkafka options of a consumer of the platform's topics that commits its own offsets after
        writing (the ingestor, the embedder, the archives): from the earliest record, fetches held
        `fetch_wait_ms`."""
        return self.client_options("librdkafka", role) | {
            "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": self.fetch_wait_ms, "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": self.heartbeat_interval_ms}

    def credentials(self, role: str) -> tuple[str, str]:
        """(user, password) of `role` (infra/kafka_auth.py), or of the one configured user."""
        from infra.kafka_auth import ROLES

        if role not in ROLES:
            raise ValueError(f"unknown Kafka role {role!r}; known: {list(ROLES)}")
        if not self.credentials_dir:
            return self.sasl_username, self.sasl_password
        return role, local_secret(Path(self.credentials_dir) / role)

    def client_options(self, client: KafkaClient, role: str = "producer") -> dict[str, Any]:
        """Connection and security options of `role`'s principal (by default an outside producer of
        events), in the spelling of `client`: "kafka-python" (consumers, admin tools), "librdkafka"
        (confluent-kafka producers, where throughput matters) or "java" (Apache Kafka client properties:
        the Flink connector prefixes them with `properties.`)."""
        if client not in ("kafka-python", "librdkafka", "java"):
            raise ValueError(f"unknown Kafka client {client!r}")
        user, password = self.credentials(role)
        if client == "kafka-python":
            config: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers.split(","),
                                      "security_protocol": self.security_protocol}
            if self.sasl_mechanism:  # kafka-python names the SCRAM credentials "plain" too
                config |= {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": user,
                           "sasl_plain_password": password}
            return config
        config = {"bootstrap.servers": self.bootstrap_servers, "security.protocol": self.security_protocol}
        if not self.sasl_mechanism:
            return config
        if client == "librdkafka":
            return config | {"sasl.mechanism": self.sasl_mechanism, "sasl.username": user, "sasl.password": password}
        module = "plain.PlainLoginModule" if self.sasl_mechanism == "PLAIN" else "scram.ScramLoginModule"
        user, password = (v.replace("\\", "\\\\").replace('"', '\\"') for v in (user, password))
        return config | {"sasl.mechanism": self.sasl_mechanism, "sasl.jaas.config":
                         f'org.apache.kafka.common.security.{module} required username="{user}" password="{password}";'}

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [_host_port(a, default_port=9092) for a in self.bootstrap_servers.split(",")]

    @property
    def host_port(self) -> tuple[str, int]:
        return self.addresses[0]


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    password: str = ""  # from config/env; unset: the local stack's Redis gets a generated one (redis_password)
    # An ACL user to log in as; empty: the default user. The local servers then give the default user, with
    # no password, only PING and CLUSTER INFO: health probes need no credentials, everything else does.
    username: str = ""
    # A Redis Cluster: "host:port" of its nodes, which clients start from (the local stack runs a master on
    # each). Empty: the one server at `url`. The graph store cannot shard (graph.redis_url).
    cluster_nodes: tuple[str, ...] = ()

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [_host_port(n, default_port=6379) for n in self.cluster_nodes]

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.url, default_port=6379)


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str = "http://127.0.0.1:5000"
    workers: int = 1
    # The registry refuses every call without credentials (MLflow's basic-auth app). The local stack's
    # admin gets a generated password (mlflow_password); for an external server, set both.
    username: str = "admin"
    password: str = ""  # from config/env only
    # The local server's stores: "sqlite" (a file in the data directory) or "postgres" (database `mlflow` on
    # settings.postgres); artifacts in the data directory, or under an s3:// URI on settings.s3.
    backend_store: str = "sqlite"
    artifacts_uri: str = ""

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.tracking_uri, default_port=5000)


@dataclass(frozen=True)
class AirflowSettings:
    api_url: str = "http://127.0.0.1:8080"
    username: str = "admin"
    password: str = ""  # from config/env; if empty the local stack generates and keeps one
    parallelism: int = 4
    # "LocalExecutor", or "CeleryExecutor": tasks go through a broker (celery_broker_url; empty: database 1
    # of the graph store's Redis) to `celery_workers` worker processes, each running `parallelism` tasks.
    executor: str = "LocalExecutor"
    celery_broker_url: str = ""
    celery_workers: int = 1
    metadata_db: str = "sqlite"  # or "postgres": database `airflow` on settings.postgres
    # CPU priority of the scheduler, the DAG processor and so of every task they start (nice(1)).
    # Training and graph runs are batch work: on a host they share with the ranking server and the
    # stream job, they take the cores those leave idle, not the ones a request is waiting for. 19, the
    # lowest: at 10 a training task (TensorFlow, ~1.5 cores) still took a tenth of the CPU a waiting
    # request wanted and set the serving checks' p99 (docs/benchmarks.md, seventh session).
    niceness: int = 19
    # DAG cadences. Minutes, not seconds: each Airflow run costs seconds of scheduling and process
    # start-up, and a training run needs enough new labelled impressions to move the model.
    full_training_schedule: str = "@daily"  # cron or preset; empty: only when triggered
    incremental_training_minutes: int = 2
    graph_update_minutes: int = 10
    materialization_minutes: int = 60
    consistency_minutes: int = 60  # feature_consistency: served features vs trained on, each period's lists
    consistency_requests: int = 300  # the newest /rank lists of each period it compares (~80 s a run on 2 cores)
    full_training_days: int = 30  # offline_training's default window: the days before the run

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.api_url, default_port=8080)


@dataclass(frozen=True)
class PostgresSettings:
    """The database server of the cluster profile's Airflow and MLflow (airflow.metadata_db,
    mlflow.backend_store): databases `airflow` and `mlflow`, owned by `username`."""

    url: str = "postgresql://127.0.0.1:5432"
    username: str = "flywheel"
    password: str = ""  # from config/env; unset: the local server gets a generated one

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.url, default_port=5432)

    def database_url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        """A SQLAlchemy URL without the password: clients get it as PGPASSWORD (libpq reads it), so it is in
        no URL, command line or log."""
        host, port = self.host_port
        return f"{driver}://{quote(self.username)}@{host}:{port}/{database}"


@dataclass(frozen=True)
class S3Settings:
    """An S3-compatible object store (mlflow.artifacts_uri s3://...). The local stack's is SeaweedFS: its
    S3 gateway on endpoint_url, and the master, volume, filer and admin servers it runs on store_ports
    (each also uses its port + 10000 for gRPC)."""

    endpoint_url: str = "http://127.0.0.1:8333"
    region: str = "us-east-1"
    access_key_id: str = "flywheel"
    secret_access_key: str = ""  # from config/env; unset: the local store gets a generated one
    store_ports: tuple[int, ...] = (9333, 8380, 8888, 23646)

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.endpoint_url, default_port=8333)


@dataclass(frozen=True)
class DatasetSettings:
    # What the data means (event types, catalog tables, past events): one file, docs/dataset-spec.md.
    spec: Path = REPO_ROOT / "datasets" / "movielens" / "dataset.toml"


@dataclass(frozen=True)
class MovielensSettings:
    wheel: str = "recbole==1.2.1"  # ships ml-100k; downloaded at run time, never committed
    click_min_rating: int = 4


@dataclass(frozen=True)
class FlinkSettings:
    # The job's web UI and REST API, read-only (GET): a front of api_url that anyone on the host may read.
    rest_url: str = "http://127.0.0.1:8081"
    # Flink's REST API itself, over mutual TLS: only the platform (the stack's client certificate) reaches
    # it, to submit, checkpoint and cancel (infra/flink_rest.py).
    api_url: str = "https://127.0.0.1:8082"
    # "local": the stream job runs in a MiniCluster in its own process; "remote": it is submitted to the
    # session cluster whose JobManager serves rest_url (the local stack's "flink" service, or a real one).
    target: str = "local"
    # The local session cluster: its JobManager's RPC port, TaskManagers (one slot each) and their memory.
    rpc_port: int = 6123
    taskmanagers: int = 2
    process_memory: str = "1g"

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.rest_url, default_port=8081)

    @property
    def api_host_port(self) -> tuple[str, int]:
        return _host_port(self.api_url, default_port=8082)


@dataclass(frozen=True)
class StreamingSettings:
    job_name: str = "flywheel-features"
    consumer_group: str = "flywheel-stream-job"
    parallelism: int = 1
    # 0: every event emits its views' updated rows, so the offline store holds a snapshot as of each
    # event (exact point-in-time training features, also when a backlog is replayed at full speed).
    # > 0: aggregates buffer input this long and emit one update per key (Flink's mini-batch): far fewer
    # rows downstream, at the cost of this much freshness and of snapshots only per batch.
    mini_batch_ms: int = 0
    checkpoint_interval_ms: int = 5000
    # CPU priority of the offline event log (nice(1)): it is not on the path to the online features, so
    # under a burst it takes the cores the stream job and the ingestor leave and catches up after.
    event_log_niceness: int = 10
    sequence_length: int = 50  # last-N behaviors kept per user
    # The long history: the newest N behaviors per user, condensed as they change into the user's most
    # frequent categories, each with its newest items (a fixed-size input, SIM's search by category).
    history_length: int = 1000
    history_categories: int = 8
    history_per_category: int = 20
    history_emit_every: int = 16  # the condensed row is updated on every action, and after this many exposures
    interest_half_life_hours: float = 168.0  # decay of the long-term category interest
    interest_top_k: int = 10
    interest_epoch_ms: int = 1_325_376_000_000  # 2012-01-01: weights are summed relative to it (streaming/features.py)
    ctr_prior: float = 0.05  # smoothed CTR = (clicks + w * prior) / (impressions + w)
    ctr_prior_weight: float = 10.0
    # The ingestor writes a Parquet file per micro-batch (freshness: ~10 a second under live traffic) and
    # rewrites a partition's files of this long as one (17,000 files a view made each training scan 16 s).
    offline_merge_after_s: float = 60.0


@dataclass(frozen=True)
class ModelsSettings:
    name: str = "flywheel-ctr"  # the registered model
    experiment: str = "flywheel-ctr"
    # The gate (models/registry.py): a candidate becomes @champion only on an evaluation window with at
    # least gate_min_examples examples and gate_min_clicks clicks, with its mean predicted CTR within
    # gate_calibration times the observed one, and unless its AUC is below the champion's minus
    # max_auc_drop with one-sided significance gate_alpha (DeLong's test on the same window).
    max_auc_drop: float = 0.0
    gate_min_examples: int = 200
    gate_min_clicks: int = 20
    gate_calibration: tuple[float, float] = (0.5, 2.0)
    gate_alpha: float = 0.05
    # The ranker's network: a name of models/architectures.py (ranker, ranker-v1, logreg) or a user's by import
    # path, "package.module:attribute" (an Architecture record or a builder: ModelSpec -> keras.Model).
    architecture: str = "ranker"
    embedding_dim: int = 16
    admit_after: int = 2  # times an id must be seen in training to get its own embedding row
    evict_after_steps: int = 0  # 0 = never evict
    sparse_learning_rate: float = 0.1
    dense_learning_rate: float = 0.001
    batch_size: int = 256
    # The ranker's numeric features also enter as 8 piecewise-linear bins each (models/layers.py
    # PiecewiseLinear): Instacart test AUC 0.847 -> 0.858 (three seeds each), MovieLens unchanged.
    numeric_bins: int = 8
    max_epochs: int = 3  # full training stops earlier when the validation AUC stops improving
    request_timeout_s: float = 30.0  # MLflow HTTP calls; an unreachable server fails fast


@dataclass(frozen=True)
class GraphSettings:
    """The user-item behavior graph (FalkorDB on settings.redis) and the item neighbours from it."""

    name: str = "behavior"  # the graph's key
    # The graph's Redis (with the FalkorDB module); empty: the online store's (redis.url). A graph is one key
    # of a module type, which a Redis Cluster cannot shard: the cluster profile gives it a server of its own.
    redis_url: str = ""
    half_life_days: float = 30.0  # an edge's weight halves in this time without new behavior
    neighbours: int = 20  # item-item neighbours kept per item
    batch_size: int = 2000  # edges per Cypher upsert
    # A run takes events up to the newest one in the log minus this, so events this late still
    # arrive before their window is added.
    allowed_lateness_s: float = 60.0


@dataclass(frozen=True)
class RetrievalSettings:
    """Candidate retrieval for `POST /recommend`: the two-tower model (models/retrieval.py), its ANN index
    and the near-line user embeddings (serving/nearline.py), the merge of the candidate sources."""

    name: str = "flywheel-retrieval"  # the registered model (its own @champion, rollback like the ranker's)
    experiment: str = "flywheel-retrieval"
    training_schedule: str = "@daily"  # the retrieval_training DAG; empty: only when triggered
    training_days: int = 180  # the DAG's default window: the days before the run
    dim: int = 32
    sequence_length: int = 20  # recent positive items the user tower reads
    epochs: int = 8
    # Training draws examples by 2^(-age / half-life) at the newest (models/retrieval.py); 0: each once.
    recency_half_life_days: float = 30.0
    # The two-tower source's score: cos(u, i) / T + popularity_prior x ln(max(decayed positives of i now,
    # prior_floor)), the decay the popularity source's (models/recall.py PopularityPrior); 0: the model alone.
    # 4 and 30 days: the best of the grids on the validation window before `make bench-retrieval`'s split
    # (docs/benchmarks.md, issue 40).
    popularity_prior: float = 4.0
    prior_floor: float = 0.1
    prior_step: float = 0.5  # the near-line index rewrites an item when its prior moved this much (13% at 4)
    # The gate: recall@gate_k on each user's next gate_next clicks in the last eval_days of the window (the
    # second half of a shorter window; the model is trained on what came before), against @champion on the
    # same window; promoted unless worse by more than max_recall_drop, and only with at least gate_min_users
    # users to judge on.
    eval_days: float = 14.0
    gate_k: int = 20
    gate_next: int = 20  # as `make bench-retrieval` judges
    gate_min_users: int = 30
    max_recall_drop: float = 0.01
    # Serving: each source's top `per_source` items are merged (reciprocal-rank fusion) into at most
    # `candidates`, which the ranker scores; graph recall follows the newest `graph_seeds` positives.
    per_source: int = 60
    candidates: int = 100
    graph_seeds: int = 5
    # The popularity source: positives weighted 2^(-age / half-life) (models/recall.py recently_popular), so
    # it follows what is popular now; 7 days: the best of 3, 7, 14, 30 and 60 on the 28 days before
    # `make bench-retrieval`'s split (docs/benchmarks.md, issue 40).
    popularity_half_life_days: float = 7.0
    # The repeat source (a spec with `[events] repeats`): each user's own positives weighted 2^(-age /
    # half-life), at most `repeat_items` of them kept per user (the heaviest).
    repeat_half_life_days: float = 30.0
    repeat_items: int = 200
    # The merge's weight of each source (> 0; models/recall.py SOURCES' order: two-tower, graph, popularity,
    # repeat): the weights `make bench-retrieval` tunes on its validation window (docs/benchmarks.md).
    source_weights: tuple[float, ...] = (4.0, 1.0, 0.25, 4.0)
    key_prefix: str = "retrieval"  # Redis keys of the index, the user embeddings, recent positives
    poll_interval_s: float = 1.0  # the near-line embedder's look at the retrieval @champion


@dataclass(frozen=True)
class SparseTierSettings:
    """The embedding tables in Redis (models/embedding_store.py): the online store's server or cluster holds
    every version's rows; each serving worker keeps the hot ones. Off: each worker holds whole tables.
    docs: docs/concepts.md "The sparse tier"."""

    enabled: bool = False
    redis_url: str = ""  # a Redis of its own (credentials: redis.username/password); empty: the online store's
    key_prefix: str = "emb"
    max_lineage: int = 8  # a version whose parent chain would pass this is written in full (reads ask each)
    keep_versions: int = 4  # besides the aliased versions (and their lineages), the newest kept in the store
    cache_rows: int = 200_000  # per served version and worker: the hot rows (CLOCK eviction)
    timeout_ms: float = 30.0  # a batch's read of its missing rows; past it they score with the default row
    retry_after_s: float = 1.0  # after a failed read, the default rows at once for this long (no waiting)
    deltas_topic: str = "embedding-deltas"
    delta_part_rows: int = 8000  # rows per message (~0.6 MB at 16 dims: under Kafka's 1 MB default)


@dataclass(frozen=True)
class ServingSettings:
    """The ranking server (serving/): its endpoint, batching, shape buckets, traffic policy, model
    following. docs: docs/concepts.md "Serving: rank and recommend"."""

    host: str = "127.0.0.1"
    port: int = 8500
    # Request aggregation: a free executor takes what is queued as its batch, up to max_batch_rows
    # candidate rows, waiting for more until max_delay_ms after the first was queued; executors run
    # batches in parallel.
    max_batch_rows: int = 1024
    max_delay_ms: float = 2.0
    # Serving processes: each binds the port (SO_REUSEPORT: the kernel spreads connections across them)
    # and runs its own copy of everything below; one per core, as each is bound by one GIL, up to 4
    # (~1 GB each).
    workers: int = max(1, min(4, os.cpu_count() or 1))
    executors: int = 1  # per worker: batches scored in parallel (XLA's own threads use the cores)
    fetch_threads: int = 2  # online feature reads in parallel
    # Item features are shared by every user's requests: kept this long in the process (0 = read every
    # request), at the cost of item counts up to this much older than the online store's.
    item_features_ttl_ms: float = 1000.0
    item_features_cache_size: int = 100_000
    batching: bool = True  # off: every request runs alone (the benchmark's baseline)
    # Shape buckets: batch rows and sequence lengths are padded up to the nearest bucket; every
    # bucket is compiled before the server is ready. Off: every new exact shape compiles on the
    # request path (the baseline).
    buckets: bool = True
    row_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # x2 steps: at most half is padding
    sequence_buckets: tuple[int, ...] = (10, 25, 50)
    # The compiled buckets (XLA executables) are kept under paths.cache_dir/xla, per TensorFlow version
    # and CPU: a restart or a replaced worker loads them instead of compiling (~55 s of CPU per worker).
    compile_cache: bool = True
    # Admission: candidate rows in flight (fetching features, queued or scoring) are bounded; a request
    # that would pass the bound is refused at once with 503 + Retry-After. Size it by Little's law:
    # the rows/s the server sustains x the deadline (docs/benchmarks.md has this machine's figures).
    max_inflight_rows: int = 4096  # ~20,000 rows/s x the 200 ms deadline: 8 clients of mixed sizes fit
    retry_after_s: int = 1
    # /healthz says "degraded" while a worker answered over half of its last window's requests (20 or
    # more) with 503: alive processes that refuse their traffic are not serving it.
    refused_window_s: float = 60.0
    default_deadline_ms: float = 200.0  # a request may ask for less (never more)
    max_candidates: int = 1000  # larger lists are refused (413); at most max_inflight_rows
    # Compute allocation by value tier (serving/access.py): the queue fill at which low-value
    # requests are degraded and then shed; "high" requests keep full quality until the queue is full.
    degrade_low_at: float = 0.25
    degrade_normal_at: float = 0.5
    shed_low_at: float = 0.75
    degraded_sequence_length: int = 10
    degraded_max_candidates: int = 100
    # Routing: users whose hash falls under canary_percent are scored by @challenger; shadow_percent
    # of the others are also scored by @challenger, logged and never returned.
    canary_percent: float = 0.0
    shadow_percent: float = 0.0
    # Model following: aliases are polled this often; versions kept loaded and warm.
    poll_interval_s: float = 0.5  # one registry call per poll: the aliases of the model
    keep_warm: int = 3
    predictions_topic: str = "predictions"
    # CPU priority of the prediction archive (nice(1)): off the request path, it catches up after a burst.
    archive_niceness: int = 10


@dataclass(frozen=True)
class CanarySettings:
    """Canary analysis of a promoted ranker (serving/canary.py): the new @champion first serves
    `ramp_percent[0]` % of users (by a stable hash), the champion before it (@control) the others; their
    served outcomes on the same period are compared by a sequential test (mSPRT) on each /rank list's AUC.
    Shown worse: rolled back at once, the reason on the version. Shown not worse than the control by
    `margin` (a sequential non-inferiority decision, false ramps at most `ramp_alpha`): the next step, then
    all traffic. Otherwise the share stays, however long. docs: docs/concepts.md "Canary analysis"."""

    enabled: bool = True
    ramp_percent: tuple[float, ...] = (50.0,)  # the new champion's shares before all traffic
    min_requests: int = 20  # judged /rank lists (a click and a non-click among the shown) a side before any verdict
    # The test's false-alarm rate: a version as good as its control is rolled back with probability at most
    # alpha per canary, however often the analysis looks (mSPRT: Johari, Pekelis & Walsh 2017).
    alpha: float = 0.01
    # A version whose mean list AUC is below its control's by more than `margin` ramps with probability at
    # most `ramp_alpha` a step. 0.05 catches a version 10 % worse at the demo's list AUC (0.60 -> 0.54); an
    # honest one ramps after about 436 judged lists a side at their sd 0.22 (serving/canary.py ramp_lists).
    margin: float = 0.05
    ramp_alpha: float = 0.05
    mixture_sd: float = 0.2  # the mSPRT's normal mixture over the AUC difference: the size of regression it is tuned to
    interval_s: float = 5.0  # how often the analysis reads the archives


@dataclass(frozen=True)
class PrometheusSettings:
    """Monitoring (infra/monitoring.py): Prometheus scrapes the ranking server and the platform's exporter
    (infra/exporter.py: the pipeline's consumers, the Flink job, Redis, the registry's aliases, DAG runs),
    evaluates the alert rules and serves the dashboard (/consoles/flywheel.html). Only Prometheus reads
    the stages: none of them waits on it."""

    url: str = "http://127.0.0.1:9090"
    exporter_url: str = "http://127.0.0.1:9464"
    scrape_interval_s: float = 5.0  # also the rules' evaluation interval
    # Airflow's DAG runs and the registry's aliases are asked of their servers, less often.
    slow_scrape_interval_s: float = 30.0
    retention: str = "15d"

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.url, default_port=9090)

    @property
    def exporter_host_port(self) -> tuple[str, int]:
        return _host_port(self.exporter_url, default_port=9464)


RANKER, RETRIEVAL = "ranker", "retrieval"  # the roles of a registered model: what trains and gates it


@dataclass(frozen=True)
class RegisteredModel:
    """One model under its name in the MLflow registry: its versions, aliases (@champion, @challenger,
    @control) and canary. Passed to whatever registers, gates, follows or rolls back its versions; the
    declared ones are `Settings.ranker` and `Settings.retriever`, and `Settings.registered_model` finds one by
    name."""

    name: str
    experiment: str  # where its training runs are logged
    role: str  # RANKER or RETRIEVAL
    # A ranker of a declared scenario (`[scenarios.<name>]` in the dataset spec): trained on the exposures whose
    # context names it, served to the requests that name it. None: every exposure, the requests naming none.
    scenario: str | None = None


# What a scenario may set for itself, by section (infra/dataset.py SCENARIO_SECTIONS): how its canaries are
# judged and ramped (not how often: one analysis looks at every ranker), and its experiment's splits.
SCENARIO_KEYS = {"canary": tuple(f.name for f in dataclasses.fields(CanarySettings) if f.name != "interval_s"),
                 "serving": ("canary_percent", "shadow_percent")}


@dataclass(frozen=True)
class Settings:
    paths: PathSettings = field(default_factory=PathSettings)
    stack: StackSettings = field(default_factory=StackSettings)
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    airflow: AirflowSettings = field(default_factory=AirflowSettings)
    dataset: DatasetSettings = field(default_factory=DatasetSettings)
    movielens: MovielensSettings = field(default_factory=MovielensSettings)
    flink: FlinkSettings = field(default_factory=FlinkSettings)
    postgres: PostgresSettings = field(default_factory=PostgresSettings)
    s3: S3Settings = field(default_factory=S3Settings)
    streaming: StreamingSettings = field(default_factory=StreamingSettings)
    models: ModelsSettings = field(default_factory=ModelsSettings)
    graph: GraphSettings = field(default_factory=GraphSettings)
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)
    sparse_tier: SparseTierSettings = field(default_factory=SparseTierSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    prometheus: PrometheusSettings = field(default_factory=PrometheusSettings)
    canary: CanarySettings = field(default_factory=CanarySettings)

    @property
    def spec(self) -> DatasetSpec:
        """The dataset spec at `dataset.spec` (read once per process)."""
        return load_spec(self.dataset.spec)

    @property
    def ranker(self) -> RegisteredModel:
        """The ranking model `/rank` serves (`models.name`)."""
        return RegisteredModel(self.models.name, self.models.experiment, RANKER)

    @property
    def retriever(self) -> RegisteredModel:
        """The two-tower retrieval model `/recommend` recalls with (`retrieval.name`)."""
        return RegisteredModel(self.retrieval.name, self.retrieval.experiment, RETRIEVAL)

    @property
    def scenarios(self) -> dict[str, RegisteredModel]:
        """The ranker of each scenario the dataset spec declares, by scenario."""
        return {sc.name: RegisteredModel(sc.model or f"{self.models.name}-{sc.name}", self.models.experiment, RANKER,
                                         sc.name) for sc in self.spec.scenarios}

    def scenario_model(self, scenario: str | None) -> RegisteredModel:
        """The ranker serving `scenario` (None or "": the platform's ranker); an undeclared one is refused, naming
        the declared ones."""
        if not scenario:
            return self.ranker
        declared = self.scenarios
        if scenario not in declared:
            raise SettingsError(f"unknown scenario {scenario!r}: the dataset spec ({self.dataset.spec}) declares "
                                f"{', '.join(map(repr, declared)) or 'none'}")
        return declared[scenario]

    @property
    def registered_models(self) -> tuple[RegisteredModel, ...]:
        """Every model this deployment declares (the rankers first): what the exporter reports and
        `registered_model` finds."""
        models = (self.ranker, *self.scenarios.values(), self.retriever)
        names = [m.name for m in models]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise SettingsError(f"the registered model {twice[0]!r} is declared twice (models.name, retrieval.name "
                                "and each scenario's model must differ)")
        return models

    @property
    def rankers(self) -> tuple[RegisteredModel, ...]:
        """The platform's ranker, then each scenario's: what the ranking server follows and the canary judges."""
        return tuple(m for m in self.registered_models if m.role == RANKER)

    def registered_model(self, name: str | None) -> RegisteredModel:
        """The declared model called `name` (None: the ranker). Another name is a ranker of that name, logged to
        the ranker's experiment: a run may train and gate a model of its own (a benchmark's, a user's trial)."""
        if not name:
            return self.ranker
        declared = {m.name: m for m in self.registered_models}
        return declared.get(name) or RegisteredModel(name, self.models.experiment, RANKER)

    def for_model(self, model: RegisteredModel | None) -> Settings:
        """The settings `model` is promoted, canaried and routed under: its scenario's own `[scenarios.<name>.canary]`
        and `[scenarios.<name>.serving]` over the platform's (these settings themselves for any other model)."""
        if model is None or not model.scenario:
            return self
        spec, out = next((sc for sc in self.spec.scenarios if sc.name == model.scenario), None), self
        for section in SCENARIO_SECTIONS if spec is not None else ():
            if own := spec.section(section):
                where, current = f"[scenarios.{spec.name}.{section}]", getattr(self, section)
                if bad := sorted(set(own) - set(SCENARIO_KEYS[section])):
                    raise SettingsError(f"dataset.spec: {where}: a scenario may set {', '.join(SCENARIO_KEYS[section])}"
                                        f", not {', '.join(bad)}")
                out = override(out, section, **{k: _convert(v, getattr(current, k), f"{where} {k}")
                                                for k, v in own.items()})
        return out

    def model_for(self, name: str | None, scenario: str | None) -> RegisteredModel:
        """The model a command or a run names: its scenario's ranker, else `name`'s model (the platform's ranker
        where it names neither). A scenario with another model's name is refused: the platform's ranker's name
        with a scenario is a default (a DAG's parameter), not a choice."""
        named = self.registered_model(name)
        if not scenario:
            return named
        model = self.scenario_model(scenario)
        if named not in (model, self.ranker):
            raise SettingsError(f"scenario {scenario!r} (model {model.name}) and model {named.name!r} both named: "
                                "name one")
        return model


def peer_port(port: int) -> int:
    """A server's second port (a Redis Cluster node's bus, a SeaweedFS server's gRPC): its port + 10,000, as
    both default to, or - 10,000 where that would leave the port range."""
    return port + 10000 if port + 10000 <= 65535 else port - 10000


def _host_port(endpoint: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(endpoint if "://" in endpoint else f"tcp://{endpoint}")
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _convert(value: Any, like: Any, name: str) -> Any:
    """Coerce a config/env value to the type of the default it replaces."""
    try:
        if isinstance(like, bool):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(like, Path):
            return Path(os.path.expanduser(str(value))).resolve()
        if isinstance(like, tuple):
            items = value.split(",") if isinstance(value, str) else list(value)
            if like and isinstance(like[0], (int, float)):  # a tuple of numbers (shape buckets, bounds)
                return tuple(type(like[0])(i) for i in items if str(i).strip() != "")
            return tuple(i.strip() if isinstance(i, str) else tuple(i) for i in items if i != "")
        if isinstance(like, (int, float)):
            return type(like)(value)
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(f"setting {name}: cannot read {value!r} as {type(like).__name__}") from None


def _section(cls: type, name: str, file_values: dict[str, Any], environ: dict[str, str]) -> Any:
    defaults = cls()
    values: dict[str, Any] = {}
    unknown = set(file_values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise SettingsError(f"config section [{name}]: unknown keys {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        env_name = f"{ENV_PREFIX}{name}_{f.name}".upper()
        if env_name in environ:
            values[f.name] = _convert(environ[env_name], default, env_name)
        elif f.name in file_values:
            values[f.name] = _convert(file_values[f.name], default, f"[{name}] {f.name}")
    return cls(**values)


# MLflow's client reads its credentials from these; set, they are mlflow.username/password (unless ours are).
MLFLOW_CLIENT_ENV = {"MLFLOW_TRACKING_USERNAME": f"{ENV_PREFIX}MLFLOW_USERNAME",
                     "MLFLOW_TRACKING_PASSWORD": f"{ENV_PREFIX}MLFLOW_PASSWORD"}


def load_settings(environ: dict[str, str] | None = None, config_file: Path | None = None) -> Settings:
    """Build Settings from defaults, the config file and the environment."""
    environ = dict(os.environ if environ is None else environ)
    for theirs, ours in MLFLOW_CLIENT_ENV.items():  # what MLflow's users already export stands for ours
        if environ.get(theirs) and ours not in environ:
            environ[ours] = environ[theirs]
    if config_file is None:
        configured = environ.get(f"{ENV_PREFIX}CONFIG")
        config_file = Path(configured) if configured else REPO_ROOT / "flywheel.toml"
        if not configured and not config_file.exists():
            config_file = None
    file_values = _read_toml(config_file) if config_file is not None else {}
    file_values = _layered(_spec_values(file_values, environ), file_values)
    profile = environ.get(f"{ENV_PREFIX}STACK_PROFILE", file_values.get("stack", {}).get("profile", ""))
    if profile:
        file_values = _layered(_profile_values(profile), file_values)
    sections = {f.name: f.type for f in dataclasses.fields(Settings)}
    unknown = set(file_values) - set(sections)
    if unknown:
        raise SettingsError(f"config file {config_file}: unknown sections {sorted(unknown)}")
    built = {
        f.name: _section(type(getattr(Settings(), f.name)), f.name, file_values.get(f.name, {}), environ)
        for f in dataclasses.fields(Settings)
    }
    settings = _with_local_kafka_credentials(Settings(**built))
    if settings.redis.cluster_nodes and not settings.graph.redis_url:
        raise SettingsError("redis.cluster_nodes: the graph store cannot shard; give it a Redis of its own "
                            "(graph.redis_url, a server with the FalkorDB module)")
    try:  # the spec is checked whole before anything starts
        load_spec(settings.dataset.spec)
    except SpecError as exc:
        raise SettingsError(f"dataset.spec: {exc}") from None
    for model in settings.scenarios.values():  # a scenario's own settings, checked with the others
        settings.for_model(model)
    bad = set(settings.stack.services) - set(LOCAL_SERVICES)
    if bad:
        raise SettingsError(f"stack.services: unknown services {sorted(bad)}; known: {list(LOCAL_SERVICES)}")
    return settings


def _with_local_kafka_credentials(s: Settings) -> Settings:
    """The local stack's broker asks every client for SCRAM credentials of its role, kept in its data
    directory, unless the config names a mechanism of its own."""
    if "kafka" not in s.stack.services or s.kafka.sasl_mechanism or s.kafka.credentials_dir:
        return s
    return override(s, "kafka", security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                    credentials_dir=str(s.paths.service_dir("kafka") / "credentials"))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: {exc}") from None


def profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


# The sections a dataset spec may tune (`[settings.<section>]`): how its models learn and serve, not where
# services run or their credentials.
SPEC_SECTIONS = ("models", "retrieval", "graph", "streaming", "canary")


def _spec_values(file_values: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    """The settings the dataset spec carries (none where the spec cannot be read: checked below, whole)."""
    spec = _section(DatasetSettings, "dataset", file_values.get("dataset", {}), environ).spec
    try:
        values = load_spec(spec).settings
    except SpecError:
        return {}
    bad = sorted(set(values) - set(SPEC_SECTIONS))
    if bad:
        raise SettingsError(f"dataset.spec: {spec} [settings]: a spec may tune {', '.join(SPEC_SECTIONS)}, "
                            f"not {', '.join(bad)}")
    return values


def _profile_values(name: str) -> dict[str, Any]:
    """A profile's values; its relative paths are relative to the repository, wherever the caller runs."""
    path = PROFILES_DIR / f"{name}.toml"
    if not path.exists():
        raise SettingsError(f"stack.profile: no profile {name!r}; known: {profiles()}")
    values = _read_toml(path)
    values["paths"] = {k: str(REPO_ROOT / v) for k, v in values.get("paths", {}).items()}
    return values


def _layered(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Config sections of `over`, key by key over those of `under`."""
    return {name: under.get(name, {}) | over.get(name, {}) for name in {*under, *over}}


def local_secret(path: Path, nbytes: int = 32) -> str:
    """A random secret generated on first use and kept at `path` (mode 600). Created whole or not at
    all (a hard link of a finished file), so a process starting alongside never reads half of one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.touch(mode=0o600)
        tmp.write_text(secrets.token_urlsafe(nbytes))
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: theirs counts
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def _stack_password(s: Settings, service: str) -> str | None:
    """<service>.password from config/env, else, for the stack's own service, one generated once into its
    data directory (mode 600); None for an external service configured without one."""
    section = getattr(s, service)
    configured: str = section.secret_access_key if service == "s3" else section.password
    if configured:
        return configured
    return local_secret(password_file(s, service), nbytes=12) if service in s.stack.services else None


def password_file(s: Settings, service: str) -> Path:
    return s.paths.service_dir(service) / "admin-password"


def password_source(s: Settings, service: str) -> str:
    """Where a service's password is, never what it is (terminal output ends up in logs)."""
    return f"the setting {service}.password" if getattr(s, service).password else str(password_file(s, service))


def redis_password(s: Settings) -> str | None:
    """The online store's password, which every Redis client uses."""
    return _stack_password(s, "redis")


def mlflow_password(s: Settings) -> str | None:
    """The registry's password for `mlflow.username`, which every MLflow client uses (models.registry)."""
    return _stack_password(s, "mlflow")


def postgres_password(s: Settings) -> str | None:
    """The password of `postgres.username`, which Airflow and MLflow use for their databases."""
    return _stack_password(s, "postgres")


def s3_secret_key(s: Settings) -> str | None:
    """The secret key of `s3.access_key_id`, with which the MLflow server reads and writes artifacts."""
    return _stack_password(s, "s3")


def airflow_password(s: Settings) -> str:
    """The Airflow admin's password (the REST API and the UI)."""
    return _stack_password(s, "airflow") or ""


def to_environ(settings: Settings) -> dict[str, str]:
    """The environment variables that reproduce `settings` in a child process: the non-defaults, and
    no config file (its values are already in `settings`, or were overridden). The child reads the profile
    again: every key the profile sets is passed too, a default that overrides it included."""
    environ: dict[str, str] = {f"{ENV_PREFIX}CONFIG": os.devnull}
    profiled = settings.stack.profile and _profile_values(settings.stack.profile)
    for section in dataclasses.fields(Settings):
        value, default = getattr(settings, section.name), getattr(Settings(), section.name)
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v == getattr(default, f.name) and f.name not in (profiled or {}).get(section.name, {}):
                continue
            if isinstance(v, tuple) and any(isinstance(i, tuple) for i in v):
                raise SettingsError(f"{section.name}.{f.name} cannot be passed as an environment variable")
            text = ",".join(map(str, v)) if isinstance(v, tuple) else str(v).lower() if isinstance(v, bool) else str(v)
            environ[f"{ENV_PREFIX}{section.name}_{f.name}".upper()] = text
    return environ


def override(settings: Settings, section: str, **values: Any) -> Settings:
    """`settings` with some fields of one section replaced (a DAG run's parameters, for example)."""
    return dataclasses.replace(settings, **{section: dataclasses.replace(getattr(settings, section), **values)})


def setting_from_environ(section: str, key: str, environ: dict[str, str] | None = None) -> Any:
    """One setting as the environment gives it (`FLYWHEEL_<SECTION>_<KEY>`), else its default; no config
    file is read. For what Airflow must know while it parses DAG files (schedules, parameter defaults),
    which must stay cheap: the stack hands its Airflow every non-default setting in the environment
    (`to_environ`); an Airflow deployed elsewhere sets those variables. Tasks call `get_settings()`."""
    environ = os.environ if environ is None else environ
    default = getattr(getattr(Settings(), section), key)
    name = f"{ENV_PREFIX}{section}_{key}".upper()
    return _convert(environ[name], default, name) if name in environ else default


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return load_settings()
