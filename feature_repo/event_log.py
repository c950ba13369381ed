"""The offline event log: every valid event as Parquet, partitioned by event date.

The source of training labels and of the behavior graph. One file per micro-batch and Kafka
partition, named by the batch's first record (`files.part_name`), so a batch replayed after a crash
overwrites itself.
"""

from __future__ import annotations

import json
import logging
import signal
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pyarrow as pa

from feature_repo.files import MergingWriter, day, last_day_write, offline_dir, part_name, read_days, write_atomic
from infra.progress import ProgressReport, ledger_path
from infra.settings import Settings, get_settings
from streaming.consumer import Consumed, EventConsumer

log = logging.getLogger("flywheel.event-log")
GROUP, SERVICE = "flywheel-event-log", "event-log"
SCHEMA = pa.schema([
    ("event_id", pa.string()), ("user_id", pa.string()), ("item_id", pa.string()), ("event_type", pa.string()),
    ("request_id", pa.string()), ("event_time", pa.int64()), ("context", pa.string()),
    ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
])


def event_log_dir(s: Settings) -> Path:
    return offline_dir(s) / "events"


def write_batch(s: Settings, batch: list[Consumed], offline: MergingWriter | None = None) -> int:
    """Write events to their date partitions; returns the number of files written."""
    groups: dict[tuple[str, int], list[Consumed]] = defaultdict(list)
    for c in batch:
        groups[(day(c.event.event_time), c.partition)].append(c)
    for (date, partition), items in groups.items():
        events = [c.event for c in items]
        columns = {"event_id": [e.event_id for e in events], "user_id": [e.user_id for e in events],
                   "item_id": [e.item_id for e in events], "event_type": [e.event_type for e in events],
                   "request_id": [e.request_id for e in events], "event_time": [e.event_time for e in events],
                   "context": [json.dumps(e.context, sort_keys=True) for e in events],
                   "kafka_partition": [c.partition for c in items], "kafka_offset": [c.offset for c in items]}
        table = pa.table({name: pa.array(values, SCHEMA.field(name).type) for name, values in columns.items()},
                         schema=SCHEMA)
        name = part_name(partition, items[0].offset, items[0].event.event_id.encode())
        if offline is None:
            write_atomic(table, event_log_dir(s) / f"date={date}" / name)
        else:  # a day's files of the last minute merged into one (feature_repo/files.py)
            offline.write(event_log_dir(s) / f"date={date}", name, partition, table)
    return len(groups)


def read_event_log(s: Settings, start_ms: int | None = None, end_ms: int | None = None,
                   columns: list[str] | None = None, written_since_ms: int | None = None) -> pa.Table:
    """The log's date partitions that can hold events with start_ms <= event_time < end_ms (all when
    not given); rows are not filtered, so the caller also sees the rest of those days. `columns` and
    `written_since_ms`: files.read_days."""
    return read_days(event_log_dir(s), SCHEMA, start_ms, end_ms, columns, written_since_ms)


def last_write(s: Settings) -> datetime | None:
    """When the log last took a file (None: empty)."""
    return last_day_write(event_log_dir(s))


def archive(s: Settings, service: str, consumer: EventConsumer,
            write: Callable[[Settings, list[Consumed], MergingWriter], int], max_records: int) -> None:
    """Until SIGTERM: poll, write the batch, then commit (at-least-once; files named by their first record
    make a replayed batch overwrite itself), reporting progress as `service` (infra/progress.py)."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    progress = ProgressReport(s, service, consumer.group, [consumer.topic])
    offline = MergingWriter(s.streaming.offline_merge_after_s)
    while not stopping:
        batch = consumer.poll(timeout_ms=500, max_records=max_records)
        if batch:
            write(s, batch, offline)
        consumer.commit()
        progress.beat(wrote=bool(batch), lost=consumer.lost, lost_at=consumer.lost_at)
    offline.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    with EventConsumer(s, GROUP, dead_letter=False, count_lost=True, ledger=ledger_path(s, SERVICE)) as consumer:
        log.info("logging %s to %s", consumer.topic, event_log_dir(s))
        archive(s, SERVICE, consumer, write_batch, max_records=20_000)


if __name__ == "__main__":
    main()
