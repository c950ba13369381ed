"""Jars from Maven Central, each pinned by sha256 in infra/jars.toml and fetched into the tool cache.

A set of jars (the Kafka broker's classpath, the Flink Kafka connector) is declared by its roots; the lock
file lists every jar a set needs with its checksum, so `make setup` downloads exactly those bytes and a
jar with other bytes is refused. `python -m infra.maven lock` resolves the roots again (with Maven) and
rewrites the lock file. Standard library only: the Flink environment imports this module too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.wheels import DownloadError, sha256

LOCK = Path(__file__).resolve().with_name("jars.toml")


class ChecksumMismatch(DownloadError):
    """A jar does not have the pinned sha256."""


@dataclass(frozen=True)
class Jar:
    coordinate: str  # group:artifact:version
    sha256: str

    @property
    def file_name(self) -> str:
        _, artifact, version = self.coordinate.split(":")
        return f"{artifact}-{version}.jar"

    def url(self, repository: str) -> str:
        group, artifact, version = self.coordinate.split(":")
        return f"{repository}/{group.replace('.', '/')}/{artifact}/{version}/{self.file_name}"


@dataclass(frozen=True)
class JarSet:
    name: str
    roots: tuple[str, ...]
    transitive: bool  # the roots' runtime dependencies too (a program), or the roots alone (a plug-in)
    jars: tuple[Jar, ...]


def _lock() -> dict:
    return tomllib.loads(LOCK.read_text())


def jar_set(name: str) -> JarSet:
    entry = _lock()["sets"][name]
    return JarSet(name, tuple(entry["roots"]), entry["transitive"],
                  tuple(Jar(c, digest) for c, digest in entry["jars"]))


def verify(path: Path, expected: str) -> None:
    actual = sha256(path)
    if actual != expected:
        raise ChecksumMismatch(f"{path}: sha256 {actual} does not match the pinned {expected}; "
                               "refusing to use it (delete the file and run setup again)")


def fetch(jar: Jar, dest: Path, tries: int = 3) -> Path:
    """`jar` in `dest`, downloaded unless there, checked against its pinned sha256 (a file with other
    bytes is removed and the error raised: the next setup downloads it again)."""
    target = dest / jar.file_name
    if not target.exists():
        dest.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix(".jar.part")
        url = jar.url(_lock()["repository"])
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
                    shutil.copyfileobj(response, out, 1 << 20)
                break
            except (urllib.error.URLError, OSError) as exc:
                if attempt == tries - 1:
                    raise DownloadError(f"could not download {url}: {exc}") from exc
                time.sleep(2 * (attempt + 1))
        part.replace(target)
    try:
        verify(target, jar.sha256)
    except ChecksumMismatch:
        target.unlink()
        raise
    return target


def install(name: str, dest: Path) -> list[Path]:
    """Every jar of the set `name` in `dest`, checked."""
    return [fetch(jar, dest) for jar in jar_set(name).jars]


def _resolve(roots: tuple[str, ...], transitive: bool) -> list[Jar]:
    """The jars Maven resolves for `roots`: their runtime closure, or the roots alone."""
    with tempfile.TemporaryDirectory() as tmp:
        alone = "<exclusions><exclusion><groupId>*</groupId><artifactId>*</artifactId></exclusion></exclusions>"
        deps = "".join(
            f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version>"
            f"{'' if transitive else alone}</dependency>" for g, a, v in (r.split(":") for r in roots))
        Path(tmp, "pom.xml").write_text(
            '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
            f"<groupId>lock</groupId><artifactId>lock</artifactId><version>0</version><dependencies>{deps}"
            "</dependencies></project>")
        out = Path(tmp, "jars")
        subprocess.run(["mvn", "-q", "-B", "dependency:copy-dependencies", "-DincludeScope=runtime",
                        "-Dmdep.useRepositoryLayout=true", f"-DoutputDirectory={out}"], cwd=tmp, check=True)
        found = []
        for path in sorted(out.rglob("*.jar")):
            version_dir = path.parent
            group = version_dir.parent.parent.relative_to(out).as_posix().replace("/", ".")
            found.append(Jar(f"{group}:{version_dir.parent.name}:{version_dir.name}", sha256(path)))
        return found


def lock() -> None:
    """Resolve every set's roots again and rewrite the lock file with each jar's sha256."""
    current = _lock()
    lines = [line for line in LOCK.read_text().splitlines() if line.startswith("#")]
    lines += ["", f'repository = "{current["repository"]}"']
    for name, entry in current["sets"].items():
        roots = tuple(entry["roots"])
        jars = _resolve(roots, entry["transitive"])
        lines += ["", f"[sets.{name}]", f"roots = [{', '.join(repr(r).replace(chr(39), chr(34)) for r in roots)}]",
                  f"transitive = {str(entry['transitive']).lower()}", "jars = ["]
        lines += [f'  ["{jar.coordinate}", "{jar.sha256}"],' for jar in jars]
        lines += ["]"]
    LOCK.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["lock"]:
        lock()
    else:
        sys.exit("usage: python -m infra.maven lock")
