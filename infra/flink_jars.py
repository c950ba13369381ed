"""Install the Flink Kafka connector (the official connector for this Flink and its kafka-clients, from
Maven Central, pinned by sha256 in infra/jars.toml) and build the stream job's Java functions
(streaming/java) against the Flink in the Flink environment.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from infra import maven
from infra.settings import Settings

CONNECTOR = "flink-connector-kafka"  # the set in infra/jars.toml


def connector_jars(s: Settings) -> list[Path]:
    """Where the connector's jars are installed (the job's classpath)."""
    return [s.paths.flink_jars_dir / jar.file_name for jar in maven.jar_set(CONNECTOR).jars]


def install_connector_jars(s: Settings) -> list[Path]:
    """Every pinned connector jar in settings.paths.flink_jars_dir with its checksum; jars of an earlier
    pin are removed (the functions are compiled against every jar there)."""
    jars = maven.install(CONNECTOR, s.paths.flink_jars_dir)
    for stale in s.paths.flink_jars_dir.glob("*.jar"):
        if stale not in jars and not stale.name.startswith("flywheel-functions-"):
            stale.unlink()
    return jars


JAVA_SOURCES = Path(__file__).resolve().parent.parent / "streaming" / "java"


def udf_jar(s: Settings) -> Path:
    """The jar of the job's Java functions, named by a digest of their sources (a change rebuilds it)."""
    digest = hashlib.sha256()
    for jar in maven.jar_set(CONNECTOR).jars:  # compiled against the connector: a new pin rebuilds it
        digest.update(jar.sha256.encode())
    for source in sorted(JAVA_SOURCES.rglob("*.java")):
        digest.update(source.relative_to(JAVA_SOURCES).as_posix().encode() + b"\0" + source.read_bytes())
    return s.paths.flink_jars_dir / f"flywheel-functions-{digest.hexdigest()[:12]}.jar"


def build_udf_jar(s: Settings, flink_lib: Path) -> Path:
    """Compile streaming/java against the jars in `flink_lib` (pyflink/lib of the Flink environment) and
    the connector jars (installed first: `install_connector_jars`)."""
    target = udf_jar(s)
    if target.exists():
        return target
    javac, jar = shutil.which("javac"), shutil.which("jar")
    if not (javac and jar):
        raise RuntimeError("javac and jar (a JDK 17) are needed to build the stream job's functions")
    for old in s.paths.flink_jars_dir.glob("flywheel-functions-*.jar"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        sources = [str(p) for p in sorted(JAVA_SOURCES.rglob("*.java"))]
        # Against Flink and the Kafka connector (the job's source reads records through one of these classes).
        classpath = f"{flink_lib}/*:{s.paths.flink_jars_dir}/*"
        subprocess.run([javac, "--release", "17", "-nowarn", "-d", tmp, "-cp", classpath, *sources], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([jar, "--create", "--file", str(target), "-C", tmp, "."], check=True)
    return target


if __name__ == "__main__":
    import sys

    from infra.settings import get_settings

    settings = get_settings()
    for jar in install_connector_jars(settings):
        print(f"ok  {jar}")
    if len(sys.argv) > 1:  # the Flink environment's pyflink/lib
        print(f"ok  {build_udf_jar(settings, Path(sys.argv[1]))}")
