"""Parquet files of the offline store: batch file names and atomic writes."""

from __future__ import annotations

import hashlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
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
    start at 0 again on a broker that lost its log) from overwriting an older file."""
    digest = hashlib.blake2b(first_record, digest_size=4).hexdigest()
    return f"part-{partition:04d}-{first_offset:012d}-{digest}.parquet"


@contextmanager
def pinned(listing: Callable[[], list[Path]], tries: int = 20) -> Iterator[list[str]]:
    """The files `listing` gives, each held open while the block runs, as paths any reader of this process
    opens (`/proc/self/fd/N`, Linux): a file its writer merges away meanwhile (MergingWriter) stays readable
    and the merged file, opened before, still holds its old rows: a snapshot. A file gone between the
    listing and its opening: listed again (a merge takes milliseconds; a scan took seconds to 16 s)."""
    _open_files_limit()
    for _ in range(tries):
        fds: list[int] = []
        try:
            for path in listing():
                fds.append(os.open(path, os.O_RDONLY))
        except FileNotFoundError:
            for fd in fds:
                os.close(fd)
            continue
        try:
            yield [f"/proc/self/fd/{fd}" for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        return
    raise FileNotFoundError(f"files merged away faster than listed, {tries} times")


def _open_files_limit() -> None:
    """The process's soft limit of open files raised to its hard one: a view holds a file per partition per
    minute of traffic (1,440 a day), a reader pins them all, and a login's soft limit is often 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # the kernel's own ceiling: the soft limit stays
            pass


def write_atomic(table: pa.Table, target: Path) -> Path:
    """Write `table` to `target` so that readers see the whole file or none of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(target)
    return target


class MergingWriter:
    """The ingestor's offline files: each micro-batch's rows written at once (a row is offline before it is
    online), and a partition's small files of the last `merge_after_s` rewritten as one from the rows kept
    in memory, under the first one's name, the rest removed. A reader keeps its semantics (a key's rows in
    the order written: by file name, then row), and a scan reads few files however long the stack runs
    (one a micro-batch made 17,000 a view in a 25-minute test loop: 16 s to scan each, at every training
    run). A reader holds its files open while it reads (`pinned`): a file removed meanwhile is still read; a batch replayed
    after a crash into a removed name writes rows the merged file holds, with the same values; into the
    merged file's own name, it replaces it, and every record after it is read again and written too."""

    SMALL_ROWS = 10_000  # a batch this large (a backlog's) is a file of its own, not merged

    def __init__(self, merge_after_s: float, max_rows: int = 200_000) -> None:
        self.merge_after_s, self.max_rows = merge_after_s, max_rows
        self.runs: dict[tuple[Path, int], tuple[float, list[Path], list[pa.Table]]] = {}
        self.merged = 0  # files removed

    def write(self, directory: Path, name: str, partition: int, table: pa.Table) -> None:
        key = (directory, partition)
        if directory / name in self.runs.get(key, (0.0, [], []))[1]:
            # A batch read again (a commit not taken): what follows it is read again too. The run's files
            # stay as they are on disk, none merged (its first one would be removed with the others).
            del self.runs[key]
        write_atomic(table, directory / name)
        if table.num_rows >= self.SMALL_ROWS:
            self.merge(key)  # files after it are newer: the run before it ends
            return
        started, paths, tables = self.runs.setdefault(key, (time.monotonic(), [], []))
        paths.append(directory / name)
        tables.append(table)
        if time.monotonic() - started >= self.merge_after_s or sum(t.num_rows for t in tables) >= self.max_rows:
            self.merge(key)

    def merge(self, key: tuple[Path, int]) -> None:
        _, paths, tables = self.runs.pop(key, (0.0, [], []))
        if len(paths) > 1:
            write_atomic(pa.concat_tables(tables, promote_options="default"), paths[0])
            for path in paths[1:]:
                path.unlink(missing_ok=True)
            self.merged += len(paths) - 1

    def close(self) -> None:
        for key in list(self.runs):
            self.merge(key)


# --- logs partitioned by date (the event log, the prediction archive) -------------------------------

def day(time_ms: int) -> str:
    """The UTC date partition (`date=YYYY-MM-DD`) a record of this time belongs to."""
    return datetime.fromtimestamp(time_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")


CLOCK_SLACK_MS = 60_000  # `written_since_ms` reads files written up to this much earlier too: other hosts' clocks


def read_days(root: Path, schema: pa.Schema, start_ms: int | None = None, end_ms: int | None = None,
              columns: list[str] | None = None, written_since_ms: int | None = None) -> pa.Table:
    """The date partitions under `root` that can hold records with start_ms <= time < end_ms (all when
    not given); rows are not filtered, so the caller also sees the rest of those days. `columns`: only
    those; `written_since_ms`: only the files written since (a file is written after its records arrive,
    so one older holds nothing that arrived later: a canary's few minutes read a few minutes of files)."""
    first, last = day(start_ms) if start_ms is not None else "", day(end_ms) if end_ms is not None else "~"
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])

    def listing() -> list[Path]:
        files = sorted(f for d in root.glob("date=*") if first <= d.name[5:] <= last for f in d.glob("*.parquet"))
        if written_since_ms is not None:
            files = [f for f in files if f.stat().st_mtime * 1000 >= written_since_ms - CLOCK_SLACK_MS]
        return files

    with pinned(listing) as files:  # a file merged away by its writer while read (MergingWriter): still read
        return pa.concat_tables([pq.read_table(f, schema=schema, columns=columns) for f in files]) if files \
            else schema.empty_table()


def last_day_write(root: Path) -> datetime | None:
    """When a log last took a file (None: empty). A date directory's mtime moves with every file
    renamed into it, so this reads one stat per day, not per file."""
    days = [d.stat().st_mtime for d in root.glob("date=*")]
    return datetime.fromtimestamp(max(days), timezone.utc) if days else None
