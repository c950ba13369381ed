"""Streaming benchmark: sustained events/s through Kafka -> Flink -> online store, and feature freshness.

Run: `make bench-streaming` (= `.venv/bin/python -m benchmarks.streaming`). Starts Kafka, Redis and
the pipeline in a temporary data directory. Prints Markdown for docs/benchmarks.md.

- Throughput: a backlog of N synthetic events is produced, then the clock runs until the last
  event's running total is online. Baseline in the same run: producing the same backlog alone.
- Profile (during the throughput run): each Flink operator chain's busy and back-pressured time
  (ms per second, from the job's REST API) and the CPU of each pipeline process tree and the broker.
- Freshness: the generator runs at a fixed rate; every 100 ms a probe click for a fresh user is
  produced and its row polled every 5 ms with the serving path's reader of Feast's layout
  (feature_repo/online.py, proven equal to `get_online_features`; cheap enough not to compete with
  the pipeline for the CPU) until visible. Baseline in the same run: one such read. The rate the
  generator reached is reported next to the one asked for.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from feature_repo.online import OnlineReader
from benchmarks.record import record
from infra import process, stack
from infra.services import enabled_services
from infra.settings import Settings, load_settings
from streaming.events import TEST_TRAFFIC, Event, dataset_spec
from streaming.produce import fixed_rate_pace, produce
from streaming.producer import EventProducer
from streaming.synthetic import SyntheticConfig, SyntheticGenerator


def settings(data_dir: Path, profile: str) -> Settings:
    """The stream's stack of `profile` ("default", or "cluster": a Flink session cluster and a Redis Cluster)."""
    services = "kafka,redis,pipeline" if profile == "default" else "kafka,redis,flink,pipeline"
    environ = stack.side_by_side_environ(data_dir, "" if profile == "default" else profile)
    # FLYWHEEL_* variables of the caller apply (a setting to try), but no config file does.
    return load_settings(dict(os.environ) | environ | {"FLYWHEEL_STACK_SERVICES": services}, config_file=None)


def click(user: str) -> Event:
    now = int(time.time() * 1000)
    return Event(event_id=f"probe-{user}", user_id=user, item_id="probe-item", event_type=dataset_spec().labels[0],
                 request_id=f"probe-{user}", event_time=now, context={"category": "probe", TEST_TRAFFIC: True})


def online_total(reader: OnlineReader, user: str):
    return reader.read(("user_id",), [(user,)], [("user_total", "user_clicks_total")])[0][0]


def wait_online(reader: OnlineReader, user: str, timeout_s: float = 600) -> float:
    deadline = time.monotonic() + timeout_s
    while online_total(reader, user) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{user} not online after {timeout_s}s")
        time.sleep(0.005)
    return time.monotonic()


class Profiler(threading.Thread):
    """Samples Flink operator busy/back-pressured time and process-tree CPU every second."""

    def __init__(self, s: Settings) -> None:
        super().__init__(daemon=True)
        self.s, self.stopping = s, threading.Event()
        self.busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def _trees(self) -> dict[str, list[psutil.Process]]:
        trees = {}
        for svc in enabled_services(self.s):  # the broker, Redis, the pipeline, a session cluster's JVMs
            tracked = process.read_pidfile(stack.pidfile(self.s, svc))
            if tracked:
                root = psutil.Process(tracked.pid)
                trees[svc.name] = [root, *root.children(recursive=True)]
        return trees

    def run(self) -> None:
        url = self.s.flink.rest_url
        jid = httpx.get(f"{url}/jobs/overview").json()["jobs"][0]["jid"]
        vertices = httpx.get(f"{url}/jobs/{jid}").json()["vertices"]
        trees = self._trees()
        for procs in trees.values():
            for p in procs:
                p.cpu_percent()
        while not self.stopping.wait(1.0):
            for v in vertices:
                metrics = httpx.get(f"{url}/jobs/{jid}/vertices/{v['id']}/subtasks/metrics",
                                    params={"get": "busyTimeMsPerSecond,backPressuredTimeMsPerSecond"}).json()
                values = {m["id"]: float(m.get("avg", 0.0)) for m in metrics}  # "NaN" for an idle chain
                name = re.sub(r"\[\d+\]", "", v["name"]).split(" -> ")
                label = next((n for n in name if n.startswith("features.")), name[0]).split(":")[0][:60]
                self.busy[label].append((values.get("busyTimeMsPerSecond", 0.0),
                                         values.get("backPressuredTimeMsPerSecond", 0.0)))
            for name, procs in trees.items():
                self.cpu[name].append(sum(p.cpu_percent() for p in procs if p.is_running()))

    def report(self) -> str:
        lines = ["| Flink operator chain (source -> parse, or the sink it feeds) | busy ms/s | back-pressured ms/s |",
                 "|---|---:|---:|"]
        for label, samples in self.busy.items():
            lines.append(f"| {label} | {_mean([b for b, _ in samples]):.0f} | {_mean([p for _, p in samples]):.0f} |")
        lines += ["", "| process tree | CPU % (100 = one core) |", "|---|---:|"]
        lines += [f"| {name} | {_mean(v):.0f} |" for name, v in self.cpu.items()]
        return "\n".join(lines)


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else 0.0


def throughput(s: Settings, n: int) -> tuple[float, float]:
    reader = OnlineReader(s, timeout_s=5)
    gen = SyntheticGenerator(SyntheticConfig(seed=11))
    with EventProducer(s) as producer:
        start = time.monotonic()
        report = produce(gen.events(), producer, limit=n, desc="backlog")
        producer.send(click("marker-end"))
    produced_at = time.monotonic()
    done = wait_online(reader, "marker-end")
    return report.total / (produced_at - start), (report.total + 1) / (done - start)


def freshness(s: Settings, rate: float, seconds: float) -> tuple[list[float], float, float]:
    """Probe latencies (s), one read's time (s) and the load's reached rate (events/s)."""
    reader = OnlineReader(s, timeout_s=5)
    stop = threading.Event()
    reached: list[float] = []

    def load() -> None:
        with EventProducer(s) as producer:
            report = produce(SyntheticGenerator(SyntheticConfig(seed=12)).events(), producer,
                             pace=fixed_rate_pace(rate), duration_s=seconds, desc="load")
        reached.append(report.total / seconds)
        stop.set()

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(3)  # steady state
    latencies = []
    with EventProducer(s) as probes:
        i = 0
        while not stop.is_set():
            user = f"probe-{rate:.0f}-{i}"  # a new user per probe: its first click is what appears online
            probes.send(click(user))
            probes.flush()
            sent = time.monotonic()
            latencies.append(wait_online(reader, user, timeout_s=60) - sent)
            i += 1
            time.sleep(0.1)
    thread.join()
    start = time.monotonic()
    for _ in range(200):
        online_total(reader, f"probe-{rate:.0f}-0")
    return latencies, (time.monotonic() - start) / 200, reached[0]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no extrapolation past the largest sample)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--rates", default="1000,5000", help="generator rates (events/s) for the freshness probes")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--profiles", default="default",
                        help="stack profiles whose throughput to measure, one after the other (e.g. default,cluster); "
                             "freshness is measured on the first")
    args = parser.parse_args()
    rows, reports, probes = [], [], []
    for profile in args.profiles.split(","):
        with tempfile.TemporaryDirectory(prefix="flywheel-bench-stream-") as tmp:
            s = settings(Path(tmp), profile)
            stack.up(s)
            try:
                profiler = Profiler(s)
                profiler.start()
                produce_rate, end_to_end = throughput(s, args.backlog)
                profiler.stopping.set()
                profiler.join()
                rows.append((profile, s.streaming.parallelism, produce_rate, end_to_end))
                reports.append((profile, profiler.report()))
                for rate in (float(r) for r in args.rates.split(",") if r) if not probes else ():
                    time.sleep(30)  # let every view's backlog drain before measuring freshness
                    latencies, fetch, reached = freshness(s, rate, args.seconds)
                    probes.append({"rate": rate, "reached": reached, "seconds": latencies})
            finally:
                stack.down(s)
    if probes:
        record("streaming_freshness", probes)
    print(f"| stream ({args.backlog:,}-event backlog) | profile | parallelism | events/s | vs baseline |\n"
          "|---|---|---:|---:|---:|")
    for profile, parallelism, produce_rate, end_to_end in rows:
        print(f"| producing the backlog into Kafka alone (baseline) | {profile} | - | {produce_rate:,.0f} | 1.00 |")
        print(f"| Kafka -> Flink -> Feast online store, end to end | {profile} | {parallelism} | {end_to_end:,.0f} "
              f"| {end_to_end / produce_rate:.2f} |")
    if probes:
        print("\n| freshness: event produced -> its running total online, under synthetic load | probes | p50 ms "
              "| p99 ms | max ms |\n|---|---:|---:|---:|---:|")
        for p in probes:
            ms = [x * 1000 for x in p["seconds"]]
            print(f"| at {p['rate']:,.0f} events/s (reached {p['reached']:,.0f}) | {len(ms)} | {pct(ms, 50):.0f} "
                  f"| {pct(ms, 99):.0f} | {max(ms):.0f} |")
        print(f"| baseline: one online read round trip | - | {fetch * 1000:.1f} | | |")
    for profile, report in reports:
        print(f"\nProfile while the backlog drains ({profile}):\n\n{report}")


if __name__ == "__main__":
    main()
