"""The offline prediction log: every record the ranking server logged (`serving.prediction_log`), served
and shadow, as Parquet partitioned by the date it was served.

Kafka keeps a topic for its retention; this archive keeps for good the record of what each version served, with the scores and the raw features it scored, which the outcome join
(serving/outcomes.py) and audits read. Written like the event log: one file per micro-batch and Kafka
partition, named by the batch's first record, offsets committed only after the file is in place.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import msgspec
import msgspec.structs
import pyarrow as pa

from feature_repo.event_log import archive
from feature_repo.files import MergingWriter, day, part_name, write_atomic
from feature_repo.predictions import SCHEMA, archive_dir
from infra.progress import ledger_path
from infra.settings import Settings, get_settings
from streaming.consumer import Consumed, EventConsumer
from streaming.events import InvalidEvent
from streaming.topics import ensure_topics

log = logging.getLogger("flywheel.prediction-archive")
GROUP, SERVICE = "flywheel-prediction-archive", "prediction-archive"
_FIELDS = [f.name for f in SCHEMA][:-2]  # the record's own; then where it was read


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


def write_batch(s: Settings, batch: list[Consumed], offline: MergingWriter | None = None) -> int:
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
        if offline is None:
            write_atomic(table, archive_dir(s) / f"date={date}" / name)
        else:  # a day's files of the last minute merged into one (feature_repo/files.py)
            offline.write(archive_dir(s) / f"date={date}", name, partition, table)
    return len(groups)


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
