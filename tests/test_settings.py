from pathlib import Path

import pytest

from infra.settings import RANKER, RETRIEVAL, RegisteredModel, SettingsError, load_settings, to_environ


def test_defaults_bind_every_service_to_loopback(tmp_path: Path) -> None:
    s = load_settings({}, config_file=None)
    for host_port in (s.kafka.host_port, s.redis.host_port, s.mlflow.host_port, s.airflow.host_port):
        assert host_port[0] == "127.0.0.1"
    assert s.airflow.password == ""  # no credential has a default in code


def test_environment_overrides_config_file_which_overrides_defaults(tmp_path: Path) -> None:
    config = tmp_path / "flywheel.toml"
    config.write_text('[kafka]\nbootstrap_servers = "kafka-1:9093,kafka-2:9093"\npartitions = 12\n'
                      '[stack]\nservices = ["mlflow", "airflow"]\n')
    s = load_settings({"FLYWHEEL_KAFKA_PARTITIONS": "24", "FLYWHEEL_MODELS_GATE_CALIBRATION": "0.8,1.25"},
                      config_file=config)
    assert s.models.gate_calibration == (0.8, 1.25)  # a pair of numbers from one variable
    assert s.kafka.bootstrap_servers == "kafka-1:9093,kafka-2:9093"
    assert s.kafka.host_port == ("kafka-1", 9093)
    assert s.kafka.partitions == 24
    assert s.stack.services == ("mlflow", "airflow")


def test_config_file_is_found_through_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "prod.toml"
    config.write_text('[mlflow]\ntracking_uri = "https://mlflow.internal:443"\n')
    assert load_settings({"FLYWHEEL_CONFIG": str(config)}).mlflow.tracking_uri == "https://mlflow.internal:443"


def test_kafka_credentials_come_from_the_environment() -> None:
    s = load_settings({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "FLYWHEEL_KAFKA_SASL_MECHANISM": "PLAIN",
                       "FLYWHEEL_KAFKA_SASL_USERNAME": "svc", "FLYWHEEL_KAFKA_SASL_PASSWORD": "from-env"},
                      config_file=None)
    config = s.kafka.client_options("kafka-python")
    assert config["security_protocol"] == "SASL_SSL"
    assert (config["sasl_plain_username"], config["sasl_plain_password"]) == ("svc", "from-env")
    rd = s.kafka.client_options("librdkafka")
    assert (rd["security.protocol"], rd["sasl.username"], rd["sasl.password"]) == ("SASL_SSL", "svc", "from-env")


def test_the_flink_connector_gets_the_same_credentials_as_a_jaas_line() -> None:
    s = load_settings({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                       "FLYWHEEL_KAFKA_SASL_USERNAME": "svc", "FLYWHEEL_KAFKA_SASL_PASSWORD": 'p"w\\d'},
                      config_file=None)
    java = s.kafka.client_options("java")
    assert java["security.protocol"] == "SASL_SSL" and java["sasl.mechanism"] == "SCRAM-SHA-512"
    assert java["sasl.jaas.config"] == ('org.apache.kafka.common.security.scram.ScramLoginModule required '
                                        'username="svc" password="p\\"w\\\\d";')
    plain = load_settings({"FLYWHEEL_STACK_SERVICES": "redis"}, config_file=None).kafka.client_options("java")
    assert plain == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "PLAINTEXT"}


def test_the_local_broker_gives_each_role_its_own_generated_scram_password(tmp_path: Path) -> None:
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=None)
    producer, stream = s.kafka.client_options("librdkafka"), s.kafka.client_options("librdkafka", "stream")
    assert (producer["security.protocol"], producer["sasl.mechanism"]) == ("SASL_PLAINTEXT", "SCRAM-SHA-512")
    assert (producer["sasl.username"], stream["sasl.username"]) == ("producer", "stream")
    assert producer["sasl.password"] != stream["sasl.password"]
    secret = tmp_path / "kafka" / "credentials" / "producer"
    assert secret.read_text() == producer["sasl.password"] and secret.stat().st_mode & 0o777 == 0o600
    # the same password in a child process, which gets the settings through its environment
    again = load_settings(to_environ(s), config_file=None).kafka.client_options("librdkafka")
    assert again["sasl.password"] == producer["sasl.password"]
    with pytest.raises(ValueError, match="unknown Kafka role 'root'"):
        s.kafka.client_options("librdkafka", "root")


@pytest.mark.parametrize("environ, config, message", [
    ({"FLYWHEEL_KAFKA_PARTITIONS": "many"}, "", "FLYWHEEL_KAFKA_PARTITIONS"),
    ({}, "[kafka]\nbootstrap = 'x'\n", "unknown keys ['bootstrap']"),
    ({}, "[kafak]\n", "unknown sections ['kafak']"),
    ({}, "[kafka\n", "flywheel.toml"),
    ({"FLYWHEEL_STACK_SERVICES": "kafka,zookeeper"}, "", "unknown services ['zookeeper']"),
])
def test_bad_settings_are_clear_errors(tmp_path: Path, environ: dict, config: str, message: str) -> None:
    path = tmp_path / "flywheel.toml"
    path.write_text(config)
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_settings(environ, config_file=path)


def test_the_documented_example_config_for_real_clusters_loads() -> None:
    from infra.settings import REPO_ROOT

    s = load_settings({"FLYWHEEL_KAFKA_SASL_PASSWORD": "secret"}, config_file=REPO_ROOT / "flywheel.example.toml")
    assert s.stack.services == ("airflow",)
    assert s.kafka.client_options("kafka-python")["sasl_plain_password"] == "secret"
    assert s.redis.url.startswith("rediss://")


def test_the_airflow_password_comes_from_the_environment_or_is_generated_once(tmp_path: Path) -> None:
    from infra.settings import airflow_password

    given = load_settings({"FLYWHEEL_AIRFLOW_PASSWORD": "from-env", "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)},
                          config_file=None)
    assert airflow_password(given) == "from-env"
    assert not any(tmp_path.rglob("admin-password"))

    local = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=None)
    generated = airflow_password(local)
    assert len(generated) >= 16 and airflow_password(local) == generated  # kept across calls
    secret = tmp_path / "airflow" / "admin-password"
    assert secret.read_text() == generated and secret.stat().st_mode & 0o077 == 0


def test_mlflow_credentials_come_from_mlflows_own_variables_unless_ours_are_set() -> None:
    theirs = {"MLFLOW_TRACKING_USERNAME": "ana", "MLFLOW_TRACKING_PASSWORD": "theirs"}
    s = load_settings(theirs, config_file=None)
    assert (s.mlflow.username, s.mlflow.password) == ("ana", "theirs")
    assert load_settings(theirs | {"FLYWHEEL_MLFLOW_PASSWORD": "ours"}, config_file=None).mlflow.password == "ours"
    assert load_settings({}, config_file=None).mlflow.password == ""


def test_settings_reach_a_child_process_through_the_environment(tmp_path: Path) -> None:
    from infra.settings import to_environ

    s = load_settings({"FLYWHEEL_KAFKA_PARTITIONS": "9", "FLYWHEEL_STACK_SERVICES": "kafka,pipeline",
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=None)
    environ = to_environ(s)
    assert environ["FLYWHEEL_KAFKA_PARTITIONS"] == "9" and "FLYWHEEL_REDIS_URL" not in environ
    assert load_settings(environ, config_file=None) == s


def test_the_cluster_profile_lies_under_the_config_file_and_the_environment(tmp_path: Path) -> None:
    from infra.settings import REPO_ROOT, to_environ

    config = tmp_path / "flywheel.toml"
    config.write_text('[stack]\nprofile = "cluster"\n[flink]\ntarget = "local"\n')  # a profile key set back to its default
    s = load_settings({"FLYWHEEL_STREAMING_PARALLELISM": "4"}, config_file=config)
    assert s.paths.data_dir == REPO_ROOT / ".flywheel-cluster"  # relative to the repository, not the caller
    assert len(s.redis.nodes) == 3 and s.graph.redis_url and s.airflow.executor == "CeleryExecutor"
    assert (s.flink.target, s.streaming.parallelism) == ("local", 4)
    # A child process reads the profile again: what overrides it must reach the child too.
    assert load_settings(to_environ(s)) == s
    assert load_settings({"FLYWHEEL_STACK_PROFILE": "cluster"}, config_file=None).flink.target == "remote"


def test_an_unknown_profile_and_a_sharded_graph_are_refused() -> None:
    with pytest.raises(SettingsError, match="no profile 'big'.*cluster"):
        load_settings({"FLYWHEEL_STACK_PROFILE": "big"}, config_file=None)
    with pytest.raises(SettingsError, match="graph store cannot shard"):
        load_settings({"FLYWHEEL_REDIS_CLUSTER_NODES": "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003"},
                      config_file=None)


def test_status_of_a_stack_that_never_started_shows_no_password_and_makes_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from flywheel.cli import main
    from infra.settings import get_settings

    monkeypatch.setenv("FLYWHEEL_CONFIG", "/dev/null")
    monkeypatch.setenv("FLYWHEEL_PATHS_DATA_DIR", str(tmp_path / "never-started"))
    get_settings.cache_clear()
    try:
        out = CliRunner().invoke(main, ["status", "--show-secrets"]).output
    finally:
        get_settings.cache_clear()
    assert f"login: admin / no password: the stack of {tmp_path / 'never-started'} never started" in out
    assert not list(tmp_path.rglob("admin-password"))  # a UI login printed for a stack it is not


def test_a_registered_model_is_named_once_and_found_by_name() -> None:
    """What registers, gates, follows or rolls back a version is handed its model; the names come from the
    settings alone, and a run may name a model of its own (a benchmark's), trained and gated as a ranker."""
    s = load_settings({"FLYWHEEL_MODELS_NAME": "shop-ranker", "FLYWHEEL_MODELS_EXPERIMENT": "shop",
                       "FLYWHEEL_RETRIEVAL_NAME": "shop-recall"}, config_file=None)
    assert (s.ranker.name, s.ranker.experiment, s.ranker.role) == ("shop-ranker", "shop", RANKER)
    assert (s.retriever.name, s.retriever.role) == ("shop-recall", RETRIEVAL)
    assert s.registered_models == (s.ranker, s.retriever)
    assert s.registered_model(None) == s.registered_model("shop-ranker") == s.ranker
    assert s.registered_model("shop-recall") == s.retriever
    assert s.registered_model("trial") == RegisteredModel("trial", "shop", RANKER)
