"""The separate Flink environment and its Kafka connector jars, as setup installs them."""

import os
import subprocess
from pathlib import Path

import pytest

from infra import maven
from infra.flink_jars import CONNECTOR, install_connector_jars
from infra.kafka_broker import JARS, jars_dir
from infra.maven import ChecksumMismatch, Jar, verify
from infra.settings import load_settings
from infra.wheels import sha256


def test_the_connector_jars_are_installed_with_their_pinned_checksums() -> None:
    s = load_settings()
    pinned = maven.jar_set(CONNECTOR).jars
    jars = install_connector_jars(s)
    assert [j.name for j in jars] == [jar.file_name for jar in pinned]
    assert [sha256(j) for j in jars] == [jar.sha256 for jar in pinned]
    # the official connector for this Flink, beside the kafka-clients it was built with
    assert [jar.coordinate for jar in pinned] == ["org.apache.flink:flink-connector-kafka:5.0.0-2.2",
                                                  "org.apache.kafka:kafka-clients:4.2.0"]


def test_the_brokers_jars_are_installed_with_their_pinned_checksums() -> None:
    s = load_settings()
    broker = maven.jar_set(JARS).jars
    assert "org.apache.kafka:kafka_2.13:4.4.0" in {jar.coordinate for jar in broker}
    assert all(sha256(jars_dir(s) / jar.file_name) == jar.sha256 for jar in broker)


def test_a_jar_with_another_checksum_is_refused(tmp_path: Path) -> None:
    jar = tmp_path / "flink-connector-kafka.jar"
    jar.write_bytes(b"not the connector")
    with pytest.raises(ChecksumMismatch, match="does not match the pinned"):
        verify(jar, maven.jar_set(CONNECTOR).jars[0].sha256)


def test_a_tampered_downloaded_jar_is_an_error_and_removed(tmp_path: Path) -> None:
    pinned = maven.jar_set(CONNECTOR).jars[1]
    (tmp_path / pinned.file_name).write_bytes(b"tampered")
    with pytest.raises(ChecksumMismatch):
        maven.fetch(pinned, tmp_path)
    assert not (tmp_path / pinned.file_name).exists()  # the next setup downloads it again
    forged = Jar(pinned.coordinate, "0" * 64)  # Maven Central's bytes, another pin: refused, not kept
    with pytest.raises(ChecksumMismatch):
        maven.fetch(forged, tmp_path)
    assert not (tmp_path / pinned.file_name).exists()


def test_the_flink_environment_runs_pyflink_2_3_apart_from_the_platform() -> None:
    s = load_settings()
    probe = ("import pyflink.version, google.protobuf, kafka; "
             "print(pyflink.version.__version__, google.protobuf.__version__.split('.')[0], kafka.__version__)")
    out = subprocess.run([str(s.paths.flink_python), "-c", probe], capture_output=True, text=True, check=True)
    flink, protobuf_major, kafka = out.stdout.split()
    assert (flink, kafka) == ("2.3.0", "3.0.12")
    assert int(protobuf_major) < 6  # the reason it is a separate environment


def test_the_planner_accepts_every_stream_view_query_into_its_declared_sink(tmp_path: Path) -> None:
    """Each view's query fits the sink built from its own declaration (keys, event_time, columns, upsert or
    append): Flink's planner refuses a column mismatch, and an updating query into an append-only sink."""
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)})
    script = """
from infra.settings import get_settings
from streaming.features import topics
from streaming.job import build, feature_queries
s = get_settings()
statements = build(s, events_topic_id="no-broker-needed").create_statement_set()
for query in feature_queries(s):
    statements.add_insert_sql(query)
plan = statements.explain()
print("SINKS", *sorted(topic for topic in topics() if f"default_database.{topic}]" in plan))
"""
    out = subprocess.run([str(s.paths.flink_python), "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent,
                         env=dict(os.environ, FLYWHEEL_PATHS_DATA_DIR=str(tmp_path)))
    sinks = next((line.split()[1:] for line in out.stdout.splitlines() if line.startswith("SINKS")), None)
    assert sinks is not None, out.stderr[-3000:]
    from streaming.features import STREAM_VIEWS

    assert sinks == sorted({v.topic for v in STREAM_VIEWS})


def test_the_flink_environment_fetches_a_dataset_wheel_on_a_fresh_machine(tmp_path: Path) -> None:
    """The stream job reads the catalog's item keys at start, on a fresh machine before anything else fetched
    the data, in an environment built without pip."""
    s = load_settings()
    probe = ("import sys; from pathlib import Path; from infra.wheels import download_wheel; "
             "print(download_wheel('recbole==1.2.1', Path(sys.argv[1])).name)")
    out = subprocess.run([str(s.paths.flink_python), "-c", probe, str(tmp_path)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip().startswith("recbole-1.2.1-")
