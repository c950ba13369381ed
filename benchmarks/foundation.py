"""Foundation benchmarks: producer throughput (replay, generator) and the stack's cold start and memory.

Run: `make bench` (= `.venv/bin/python -m benchmarks.foundation`). Prints Markdown for
docs/benchmarks.md. Every figure comes with a baseline measured in the same run:
- producer rates are compared with a raw producer (same client, same options) sending the same
  pre-encoded bytes, so the ratio is the cost of building and validating events;
- start-up times are compared with starting a bare Python interpreter that imports nothing.
"""

from __future__ import annotations

import itertools
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import confluent_kafka
import psutil

from infra import stack
from infra.process import read_pidfile
from infra.services import enabled_services
from infra.settings import Settings, load_settings
from streaming.movielens import replay_events
from streaming.produce import produce
from streaming.producer import PRODUCER_OPTIONS, EventProducer
from streaming.synthetic import SyntheticGenerator
from streaming.topics import ensure_topics


def bench_settings(data_dir: Path, services: str) -> Settings:
    environ = stack.side_by_side_environ(data_dir) | {"FLYWHEEL_STACK_SERVICES": services}
    return load_settings(environ, config_file=None)


def raw_producer_rate(s: Settings, topic: str, payloads: list[tuple[bytes, bytes]]) -> float:
    """The same client and options as EventProducer (to a topic of its own: as the admin), sending bytes
    encoded beforehand."""
    producer = confluent_kafka.Producer(s.kafka.client_options("librdkafka", "admin") | PRODUCER_OPTIONS)
    start = time.monotonic()
    for key, value in payloads:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    producer.flush()
    return len(payloads) / (time.monotonic() - start)


def producer_rates(root: Path) -> list[tuple[str, float]]:
    s = bench_settings(root / "producer", "kafka")
    stack.up(s)
    try:
        ensure_topics(s, ["raw", "replay", "synthetic"])
        events = list(replay_events(s))
        payloads = [(e.key, e.encode(s.kafka.max_event_bytes)) for e in events]
        baseline = raw_producer_rate(s, "raw", payloads)
        with EventProducer(s, "replay") as producer:
            replay = produce(replay_events(s), producer, desc="replay")
        with EventProducer(s, "synthetic") as producer:
            synthetic = produce(SyntheticGenerator().events(), producer, limit=len(events), desc="synthetic")
    finally:
        stack.down(s)
    return [("raw confluent-kafka producer, pre-encoded bytes (baseline)", baseline),
            (f"MovieLens-100k replay ({replay.total:,} events)", replay.rate),
            (f"synthetic generator ({synthetic.total:,} events)", synthetic.rate)]


def tree_rss_mb(pid: int) -> float:
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
    except psutil.Error:
        return float("nan")


def cold_starts(root: Path) -> tuple[float, list[tuple[str, float]], float, list[tuple[str, float]]]:
    start = time.monotonic()
    subprocess.run([sys.executable, "-S", "-c", "pass"], check=True)
    interpreter = time.monotonic() - start
    per_group = []
    for group in ("kafka", "redis", "mlflow", "airflow"):
        s = bench_settings(root / f"cold-{group}", group)
        start = time.monotonic()
        stack.up(s)
        per_group.append((group, time.monotonic() - start))
        stack.down(s)
    s = bench_settings(root / "cold-all", ",".join(g for g, _ in per_group))
    start = time.monotonic()
    stack.up(s)
    whole = time.monotonic() - start
    time.sleep(10)  # let the services settle before reading memory
    rss = [(svc.name, tree_rss_mb(read_pidfile(stack.pidfile(s, svc)).pid)) for svc in enabled_services(s)]
    stack.down(s)
    return interpreter, per_group, whole, rss


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-") as tmp:
        root = Path(tmp)
        rates = producer_rates(root)
        interpreter, per_group, whole, rss = cold_starts(root)
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    print(f"Machine: {psutil.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"Python {platform.python_version()}\n")
    print("| producer | events/s | vs baseline |\n|---|---:|---:|")
    for name, rate in rates:
        print(f"| {name} | {rate:,.0f} | {rate / rates[0][1]:.2f} |")
    print(f"\nBaseline for start-up: bare `python -S -c pass` = {interpreter * 1000:.0f} ms.\n")
    print("| cold start (fresh data dir, until healthy) | seconds | vs bare interpreter |\n|---|---:|---:|")
    for name, seconds in itertools.chain(per_group, [("whole stack, services started together", whole)]):
        print(f"| {name} | {seconds:.1f} | {seconds / interpreter:,.0f}x |")
    print("\n| service (process tree, 10 s after healthy) | RSS MiB |\n|---|---:|")
    for name, mb in rss:
        print(f"| {name} | {mb:,.0f} |")
    print(f"| total | {sum(mb for _, mb in rss):,.0f} |")


if __name__ == "__main__":
    main()
