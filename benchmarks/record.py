"""Figures a benchmark suite hands to the report (`benchmarks/report.py`) for its plots: JSON files in
the directory `FLYWHEEL_BENCH_OUT` names; nothing when it is unset (a suite run on its own)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "FLYWHEEL_BENCH_OUT"


def record(name: str, data: object) -> None:
    if out := os.environ.get(ENV):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def recorded(out: Path, name: str) -> object | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
