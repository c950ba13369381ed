"""Bundled adapters: `[dataset] adapter = "<name>"` in a spec. An adapter turns data that cannot live in
the repository (licensed, fetched at run time) into the files the spec's sources name, and returns their
directory; the spec then reads them like any company's files. MovieLens predates them: its loader is
the `source = "movielens"` of streaming/movielens.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infra.dataset import SpecError
from infra.settings import Settings
from streaming import instacart, world

ADAPTERS: dict[str, Callable[[Settings], Path]] = {"instacart": instacart.prepare, "world": world.prepare}


def source_path(s: Settings, source: str) -> Path:
    """A table's or the history's file: the adapter's output when the spec names one, else beside the spec."""
    spec = s.spec
    if spec.adapter is None:
        return spec.source_path(source)
    try:
        prepare = ADAPTERS[spec.adapter]
    except KeyError:
        raise SpecError(f"{spec.path} [dataset].adapter: unknown adapter {spec.adapter!r} "
                        f"(bundled: {', '.join(ADAPTERS)})") from None
    return prepare(s) / source
