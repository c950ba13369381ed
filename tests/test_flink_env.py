"""The separate Flink environment and its Kafka connector jars, as setup installs them."""

import subprocess
from pathlib import Path

import pytest

from infra.flink_jars import ChecksumMismatch, install_connector_jars, verify
from infra.settings import load_settings
from infra.wheels import sha256


def test_the_connector_jars_are_installed_with_their_pinned_checksums() -> None:
    s = load_settings()
    jars = install_connector_jars(s)
    assert [j.name for j in jars] == [name for name, _ in s.flink.connector_jars]
    assert [sha256(j) for j in jars] == [digest for _, digest in s.flink.connector_jars]


def test_a_jar_with_another_checksum_is_refused(tmp_path: Path) -> None:
    jar = tmp_path / "flink-connector-kafka.jar"
    jar.write_bytes(b"not the connector")
    with pytest.raises(ChecksumMismatch, match="does not match the pinned"):
        verify(jar, "842885a51c768b2f31c946a2071656c166ee8cc6d3c02fe6c557e134e03bf228")


def test_a_tampered_installed_jar_is_an_error_and_removed(tmp_path: Path) -> None:
    s = load_settings({"FLYWHEEL_PATHS_FLINK_JARS_DIR": str(tmp_path)})
    name, _ = s.flink.connector_jars[0]
    (tmp_path / name).write_bytes(b"tampered")
    with pytest.raises(ChecksumMismatch):
        install_connector_jars(s)
    assert not (tmp_path / name).exists()  # the next setup extracts it again


def test_the_flink_environment_runs_pyflink_2_3_apart_from_the_platform() -> None:
    s = load_settings()
    probe = ("import pyflink.version, google.protobuf, kafka; "
             "print(pyflink.version.__version__, google.protobuf.__version__.split('.')[0], kafka.__version__)")
    out = subprocess.run([str(s.paths.flink_python), "-c", probe], capture_output=True, text=True, check=True)
    flink, protobuf_major, kafka = out.stdout.split()
    assert (flink, kafka) == ("2.3.0", "3.0.12")
    assert int(protobuf_major) < 6  # the reason it is a separate environment
