"""Parquet files of the offline store: batch file names and atomic writes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from infra.settings import Settings


def offline_dir(s: Settings) -> Path:
    return s.paths.service_dir("offline")


def view_dir(s: Settings, view: str) -> Path:
    """Where a feature view's offline rows live: a directory of Parquet files."""
    return offline_dir(s) / "features" / view


def part_name(partition: int, first_offset: int, first_record: bytes) -> str:
    """The file of a micro-batch read from Kafka. A batch re-read after a crash gets the same name, so
    rewriting it is idempotent; the digest of its first record keeps a batch of a newer topic (offsets
    start at 0 again on a fresh embedded broker) from overwriting an older file."""
    digest = hashlib.blake2b(first_record, digest_size=4).hexdigest()
    return f"part-{partition:04d}-{first_offset:012d}-{digest}.parquet"


def write_atomic(table: pa.Table, target: Path) -> Path:
    """Write `table` to `target` so that readers see the whole file or none of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(target)
    return target
