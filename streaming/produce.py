"""Driving an event source into Kafka at a pace: event-time speed-up for replays, a rate for load."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tqdm import tqdm

from infra.settings import Settings
from streaming.events import Event, InvalidEvent, decode
from streaming.producer import EventProducer
from streaming.topics import read_range


@dataclass
class ProduceReport:
    by_type: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.by_type.values())

    @property
    def rate(self) -> float:
        return self.total / self.seconds if self.seconds else 0.0


def event_time_pace(speed: float) -> Callable[[int, Event], float] | None:
    """Wall-clock offset for each event: event-time distance from the first event / `speed`."""
    if speed <= 0:
        return None
    first: list[int] = []

    def offset(_: int, event: Event) -> float:
        if not first:
            first.append(event.event_time)
        return (event.event_time - first[0]) / 1000.0 / speed
    return offset


def fixed_rate_pace(rate: float) -> Callable[[int, Event], float] | None:
    """Wall-clock offset for the i-th event at `rate` events per second."""
    return None if rate <= 0 else (lambda i, _: i / rate)


def produce(events: Iterable[Event], producer: EventProducer, *,
            pace: Callable[[int, Event], float] | None = None, limit: int | None = None,
            duration_s: float | None = None, total: int | None = None, desc: str = "events") -> ProduceReport:
    """Send events until the source, `limit` or `duration_s` ends; waits for every acknowledgement.

    `pace` maps (index, event) to the wall-clock second, from start, at which the event is due;
    None sends as fast as the producer allows.
    """
    report = ProduceReport()
    start = time.monotonic()
    with tqdm(total=limit or total, desc=desc, unit="ev", disable=None, smoothing=0.1) as bar:
        for i, event in enumerate(events):
            if (limit is not None and i >= limit) or (duration_s is not None and time.monotonic() - start >= duration_s):
                break
            if pace is not None:
                delay = start + pace(i, event) - time.monotonic()
                if delay > 0.001:
                    time.sleep(delay)
            producer.send(event)
            report.by_type[event.event_type] += 1
            if i % 1000 == 999:
                bar.update(1000)
        bar.update(report.total - bar.n)
        producer.flush()
    report.seconds = time.monotonic() - start
    return report


def count_landed(s: Settings, topic: str, start: dict[int, int], end: dict[int, int]) -> Counter:
    """Events in `topic` between two end-offset snapshots, by event type ("invalid" for the rest)."""
    counts: Counter = Counter()
    for record in read_range(s, topic, start, end):
        try:
            counts[decode(record.value, s.kafka.max_event_bytes, s.spec.type_names).event_type] += 1
        except InvalidEvent:
            counts["invalid"] += 1
    return counts
