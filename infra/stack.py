"""Start, check and stop the local stack. `up` is idempotent; `down` stops only what `up` started."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra import process
from infra.progress import progress_path, wait_caught_up
from infra.services import Health, Service, all_services, enabled_services, used_groups
from infra.settings import Settings, peer_port, to_environ


# Set in the environment of every process the stack starts; its descendants inherit it, so `down`
# finds even those that left their process group.
STACK_TAG = "FLYWHEEL_STACK_DIR"


class StackError(RuntimeError):
    """The stack could not be started as asked."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    state: str  # healthy | unhealthy | stopped | external
    pid: int | None
    url: str
    detail: str


def pidfile(s: Settings, svc: Service) -> Path:
    return s.paths.run_dir / f"{svc.name}.json"


def logfile(s: Settings, svc: Service) -> Path:
    return s.paths.logs_dir / f"{svc.name}.log"


def _running(s: Settings, svc: Service) -> int | None:
    tracked = process.read_pidfile(pidfile(s, svc))
    return tracked.pid if tracked and tracked.process() else None


def _check_ports(s: Settings, services: list[Service]) -> None:
    """Refuse to start anything if a port a stopped service needs is taken by someone else."""
    taken = [f"port {port} on {host} (needed by {svc.name}) is already in use by another process"
             for svc in services if _running(s, svc) is None
             for host, port in svc.ports if process.port_open(host, port)]
    if taken:
        raise StackError("; ".join(taken) + ". Stop that process or choose another port in settings.")


def side_by_side_environ(data_dir: Path, profile: str = "") -> dict[str, str]:
    """Settings (as environment variables) for another stack in `data_dir` on free loopback ports; with
    `profile` "cluster", that profile's stack."""
    taken: set[int] = set()

    def port() -> int:
        """A free port whose peer port (a server's second: a Kafka node's controller listener, a Redis
        Cluster bus) is free too, neither handed out before, so one server's second port is never
        another's first."""
        while True:
            p = process.free_port()
            pair = {p, peer_port(p)}
            if not pair & taken and not process.port_open("127.0.0.1", peer_port(p), timeout_s=0.1):
                taken.update(pair)
                return p

    environ = {
        "FLYWHEEL_PATHS_DATA_DIR": str(data_dir),
        "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port()}",
        "FLYWHEEL_REDIS_URL": f"redis://127.0.0.1:{port()}/0",
        "FLYWHEEL_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port()}",
        "FLYWHEEL_AIRFLOW_API_URL": f"http://127.0.0.1:{port()}",
        "FLYWHEEL_FLINK_REST_URL": f"http://127.0.0.1:{port()}",
        "FLYWHEEL_FLINK_API_URL": f"https://127.0.0.1:{port()}",
        "FLYWHEEL_SERVING_PORT": str(port()),
        "FLYWHEEL_PROMETHEUS_URL": f"http://127.0.0.1:{port()}",
        "FLYWHEEL_PROMETHEUS_EXPORTER_URL": f"http://127.0.0.1:{port()}",
    }
    if profile != "cluster":
        return environ
    nodes = [f"127.0.0.1:{port()}" for _ in range(3)]
    return environ | {
        "FLYWHEEL_STACK_PROFILE": profile,
        "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": ",".join(f"127.0.0.1:{port()}" for _ in range(3)),
        "FLYWHEEL_REDIS_URL": f"redis://{nodes[0]}/0",
        "FLYWHEEL_REDIS_CLUSTER_NODES": ",".join(nodes),
        "FLYWHEEL_GRAPH_REDIS_URL": f"redis://127.0.0.1:{port()}/0",
        "FLYWHEEL_POSTGRES_URL": f"postgresql://127.0.0.1:{port()}",
        "FLYWHEEL_S3_ENDPOINT_URL": f"http://127.0.0.1:{port()}",
        "FLYWHEEL_S3_STORE_PORTS": ",".join(str(port()) for _ in range(4)),
        "FLYWHEEL_FLINK_RPC_PORT": str(port()),
    }


def _run_steps(s: Settings, services: list[Service], step: str) -> None:
    """Each distinct command of `step` ("setup", "after_start") of `services`, once, to completion."""
    done: set[tuple[str, ...]] = set()
    for svc in services:
        make = getattr(svc, step)
        command = make() if make is not None else None
        if command is None or tuple(command) in done:
            continue
        done.add(tuple(command))
        log = s.paths.logs_dir / f"{svc.group}-{step.replace('_', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            finished = subprocess.run(command, env=svc.env() | to_environ(s), cwd=s.paths.data_dir,
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      umask=process.PRIVATE_UMASK)
        if finished.returncode != 0:
            raise StackError(f"{step} of {svc.group} ({' '.join(command[1:])}) failed (exit {finished.returncode}):\n"
                             f"--- last lines of {log}:\n{process.tail(log, 20)}")


def wait_healthy(s: Settings, services: list[Service], timeout_s: float,
                 tolerated: frozenset[str] = frozenset()) -> dict[str, Health]:
    """Poll every service until all are healthy or `timeout_s` passes; the last health of each. Raises at
    the timeout unless every service still unhealthy is `tolerated`."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Health] = {}
    pending = list(services)
    with ThreadPoolExecutor(max_workers=max(1, len(services))) as pool:
        while pending:
            results = dict(zip([p.name for p in pending], pool.map(lambda p: p.health(), pending)))
            last |= results
            for svc in list(pending):
                if results[svc.name].ok:
                    pending.remove(svc)
                elif _running(s, svc) is None:
                    raise StackError(f"{svc.name} exited during start-up: {results[svc.name].detail}\n"
                                     f"--- last lines of {logfile(s, svc)}:\n"
                                     f"{process.tail(logfile(s, svc), 20)}")
            if pending and time.monotonic() > deadline:
                if all(p.name in tolerated for p in pending):
                    break
                names = ", ".join(f"{p.name} ({last[p.name].detail})" for p in pending)
                raise StackError(f"not healthy after {timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(0.5)
    return last


def dataset_record(s: Settings) -> Path:
    """Which dataset spec the data directory's data were made with (written by the first `up`)."""
    return s.paths.data_dir / "dataset.json"


def check_dataset(s: Settings) -> None:
    """Refuse to start on data of another dataset spec: the old events, features and versions would be read
    with the new vocabulary. The first `up` on a data directory records the spec it starts with."""
    spec, record = s.spec, dataset_record(s)
    if record.exists():
        held = json.loads(record.read_text())
        if held["digest"] != spec.digest:
            raise StackError(
                f"the data directory {s.paths.data_dir} holds data of dataset {held['name']!r} (spec {held['spec']}, "
                f"digest {held['digest']}), but dataset.spec is now {spec.path} ({spec.name!r}, digest {spec.digest}). "
                f"Give the new dataset a data directory of its own (paths.data_dir), or set dataset.spec back; if "
                f"the change is one the data can take (a weight, a type added), accept it by deleting {record}.")
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"name": spec.name, "spec": str(spec.path), "digest": spec.digest}))


def _restart_reason(s: Settings, svc: Service) -> str:
    """Why `up` restarts a running service ("" for none): it is supervised and unhealthy after running for
    `stack.stall_after_s` (not one still starting)."""
    tracked = process.read_pidfile(pidfile(s, svc))
    proc = tracked.process() if tracked else None
    if svc.supervised and proc is not None and time.time() - proc.create_time() > s.stack.stall_after_s and not (
            health := svc.health()).ok:
        return f"unhealthy ({health.detail})"
    return ""


def up(s: Settings, say: Callable[[str], None] = lambda _: None) -> list[str]:
    """Start every enabled service that is not running, then wait until all are healthy.

    Phase by phase: infrastructure, the pipeline, serving; a phase's setup commands run before its
    processes start. A running service is restarted (and `say` tells why) when it is supervised and
    unhealthy. Returns the names of the services this call
    started. One that was running before, and that this call left as it was, is waited for too but never
    fails the start of the others: still unhealthy at the timeout, it is named in a StackError raised once
    every phase is up, what this call started left running.
    """
    check_dataset(s)
    s.paths.data_dir.chmod(0o700)  # created by check_dataset; one of an earlier version may be 755
    services = enabled_services(s)
    _check_ports(s, services)
    started: list[str] = []
    left_unhealthy: list[str] = []
    try:
        for phase in sorted({svc.phase for svc in services}):
            batch = [svc for svc in services if svc.phase == phase]
            for svc in batch:  # restarted below, and named among those this call started
                if _running(s, svc) is not None and (why := _restart_reason(s, svc)):
                    say(f"restarting {svc.name}: {why}")
                    process.stop(pidfile(s, svc), s.stack.stop_timeout_s, svc.stop_signal)
            _run_steps(s, [svc for svc in batch if _running(s, svc) is None], "setup")
            for svc in batch:
                if _running(s, svc) is None:
                    # the service reads the same settings as this process, however they were given
                    env = svc.env() | to_environ(s) | {STACK_TAG: str(s.paths.data_dir)}
                    progress_path(s, svc.name).unlink(missing_ok=True)  # an earlier run's, not this one's
                    process.spawn(svc.command(), pidfile(s, svc), logfile(s, svc), env, cwd=s.paths.data_dir,
                                  nice=svc.nice)
                    started.append(svc.name)
            found = frozenset(svc.name for svc in batch if svc.name not in started)  # running, left as they were
            health = wait_healthy(s, batch, s.stack.start_timeout_s, tolerated=found)
            left_unhealthy += [f"{name} ({health[name].detail})" for name in sorted(found) if not health[name].ok]
            _run_steps(s, [svc for svc in batch if svc.name in started], "after_start")
    except BaseException:  # leave nothing half-started behind, whatever interrupted us
        for svc in reversed(services):
            if svc.name in started:
                process.stop(pidfile(s, svc), s.stack.stop_timeout_s, svc.stop_signal)
        raise
    if left_unhealthy:
        raise StackError(f"started {', '.join(started) or 'nothing'}; running before this `up` and still unhealthy "
                         f"after {s.stack.start_timeout_s:.0f}s: {', '.join(left_unhealthy)}")
    return started


ARCHIVES = ("event-log", "prediction-archive")  # consumers that keep a topic's records offline


def unarchived(s: Settings, wait_s: float = 10.0) -> dict[str, int]:
    """Per running archive (ARCHIVES): records in Kafka it has not written yet, once it has had up to
    `wait_s` to catch up (a summary of what is offline waits for them). Empty when there is nothing to
    tell (no local broker, no archive running, or the broker did not answer)."""
    if "kafka" not in s.stack.services:
        return {}
    running = [svc.name for svc in enabled_services(s) if svc.name in ARCHIVES and _running(s, svc) is not None]
    lags = {name: wait_caught_up(s, name, wait_s) for name in running}
    return {name: lag for name, lag in lags.items() if lag}


def down(s: Settings) -> list[str]:
    """Stop every service this data directory's PID files name; returns those that were running."""
    stopped = []
    for svc in reversed(enabled_services(s)):
        if process.stop(pidfile(s, svc), s.stack.stop_timeout_s, svc.stop_signal):
            stopped.append(svc.name)
    process.kill_all(process.tagged(STACK_TAG, str(s.paths.data_dir)), s.stack.stop_timeout_s)
    return stopped


def status(s: Settings) -> list[ServiceStatus]:
    """Health of every service; those not run locally (real clusters) are checked at their endpoint."""
    def one(svc: Service) -> ServiceStatus:
        if svc.group not in s.stack.services:
            health = svc.health()
            return ServiceStatus(svc.name, "external", None, svc.url,
                                 ("reachable: " if health.ok else "UNREACHABLE: ") + health.detail)
        pid = _running(s, svc)
        if pid is None:
            return ServiceStatus(svc.name, "stopped", None, svc.url, "")
        health = svc.health()
        return ServiceStatus(svc.name, "healthy" if health.ok else "unhealthy", pid, svc.url, health.detail)

    services = [svc for svc in all_services(s) if svc.group in used_groups(s)]
    with ThreadPoolExecutor(max_workers=len(services)) as pool:
        return list(pool.map(one, services))
