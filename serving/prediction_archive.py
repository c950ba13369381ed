"""The offline prediction log: every record the ranking server logged (`serving.prediction_log`), served
and shadow, as Parquet partitioned by the date it was served.

Kafka keeps a topic for its retention; this archive keeps for good the record of what each version served, with the scores and the raw features it scored, which the outcome join
(serving/outcomes.py) and audits read. Written like the event log: one file per micro-batch and Kafka
partition, named by the batch's first record, offsets committed only after the file is in place.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import pyarrow as pa
import pyarrow.compute as pc

from feature_repo.event_log import archive
from feature_repo.files import day, offline_dir, part_name, read_days, write_atomic
from infra.progress import ledger_path
from infra.settings import Settings, get_settings
from streaming.consumer import Consumed, EventConsumer
from streaming.events import InvalidEvent
from streaming.topics import ensure_topics

log = logging.getLogger("flywheel.prediction-archive")
GROUP, SERVICE = "flywheel-prediction-archive", "prediction-archive"
SCHEMA = pa.schema([
    ("request_id", pa.string()), ("user_id", pa.string()), ("model_name", pa.string()),
    ("model_version", pa.string()), ("route", pa.string()), ("shadow", pa.bool_()), ("tier", pa.string()),
    ("served_at", pa.int64()), ("items", pa.list_(pa.string())), ("categories", pa.list_(pa.string())),
    ("scores", pa.list_(pa.float64())),  # null: a candidate the request's deadline left unscored
    ("features", pa.string()),  # the raw feature values as read (JSON): what the model saw
    ("sources", pa.list_(pa.list_(pa.string()))),  # /recommend: per item, the candidate sources; null for /rank
    ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
])
_FIELDS = [f.name for f in SCHEMA][:-2]  # the record's own; then where it was read


def archive_dir(s: Settings) -> Path:
    return offline_dir(s) / "predictions"


class Prediction(msgspec.Struct, forbid_unknown_fields=False):
    """A prediction record's fields, as serving/inference.py logs them (their types checked on decode)."""

    request_id: str
    user_id: str
    model_name: str
    model_version: str | int
    route: str
    shadow: bool
    tier: str
    served_at: int
    items: list[str]
    categories: list[str | None]
    scores: list[float | None]
    # Kept as the server wrote it (JSON), not parsed: parsing it and writing it out again was ~90 % of
    # the archive's CPU (a record holds every candidate's features).
    features: msgspec.Raw
    sources: list[list[str]] | None = None


def decode_prediction(value: bytes | None) -> dict[str, Any]:
    """A prediction record as the server wrote it, or InvalidEvent (dead-lettered with the reason): a
    record the archive could not write must not stop it."""
    try:
        record = msgspec.structs.asdict(msgspec.json.decode(value or b"", type=Prediction))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidEvent(f"malformed prediction record: {exc}") from None
    features = bytes(record["features"]).decode()
    if not features.lstrip().startswith("{"):
        raise InvalidEvent("malformed prediction record: features: expected an object")
    return record | {"features": features}


def write_batch(s: Settings, batch: list[Consumed]) -> int:
    """Write records to their date partitions; returns the number of files written."""
    groups: dict[tuple[str, int], list[Consumed]] = defaultdict(list)
    for c in batch:
        groups[(day(c.event["served_at"]), c.partition)].append(c)
    for (date, partition), items in groups.items():
        columns: dict[str, list] = {f: [c.event[f] for c in items] for f in _FIELDS}
        columns["model_version"] = [str(v) for v in columns["model_version"]]
        columns["kafka_partition"] = [c.partition for c in items]
        columns["kafka_offset"] = [c.offset for c in items]
        table = pa.table({name: pa.array(values, SCHEMA.field(name).type) for name, values in columns.items()},
                         schema=SCHEMA)
        name = part_name(partition, items[0].offset, items[0].event["request_id"].encode())
        write_atomic(table, archive_dir(s) / f"date={date}" / name)
    return len(groups)


def read_predictions(s: Settings, start_ms: int | None = None, end_ms: int | None = None,
                     columns: list[str] | None = None) -> pa.Table:
    """The archive's records served in start_ms <= served_at < end_ms (all when not given); `columns`:
    only those (`served_at` among them when a period is given)."""
    # A file is written after the records in it were served: one older than start_ms holds none after it.
    table = read_days(archive_dir(s), SCHEMA, start_ms, end_ms, columns, written_since_ms=start_ms)
    if start_ms is not None:
        table = table.filter(pc.field("served_at") >= start_ms)
    return table.filter(pc.field("served_at") < end_ms) if end_ms is not None else table


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    topic = s.serving.predictions_topic
    ensure_topics(s, [topic])
    with EventConsumer(s, GROUP, topic, decoder=decode_prediction, count_lost=True,
                       ledger=ledger_path(s, SERVICE)) as consumer:
        log.info("archiving %s to %s", topic, archive_dir(s))
        archive(s, SERVICE, consumer, write_batch, max_records=1_000)


if __name__ == "__main__":
    main()
