"""Fixtures that start real services on free loopback ports, each run in its own data directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from infra import stack
from infra.settings import MLFLOW_CLIENT_ENV, Settings, load_settings, mlflow_password, override, redis_password

REPO = Path(__file__).resolve().parent.parent
FLYWHEEL = [sys.executable, "-m", "flywheel.cli"]


def stack_environ(data_dir: Path, profile: str = "", **extra: str) -> dict[str, str]:
    """An environment whose settings point every service at a fresh port and `data_dir` (of `profile`'s stack)."""
    config = data_dir / "flywheel.toml"
    data_dir.mkdir(parents=True, exist_ok=True)
    config.write_text("")  # isolates tests from a developer's own flywheel.toml
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") and k not in MLFLOW_CLIENT_ENV}
    return environ | stack.side_by_side_environ(data_dir, profile) | {
        "FLYWHEEL_CONFIG": str(config),
        "FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS": "2000",
        "FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
    } | extra


def run_cli(environ: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FLYWHEEL, *args], env=environ, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def running_stack(data_dir: Path, services: str, **extra: str) -> Iterator[Settings]:
    """For a fixture's lifetime: `services` started in their own data directory on free ports."""
    settings = load_settings(stack_environ(data_dir, FLYWHEEL_STACK_SERVICES=services, **extra))
    # Passwords explicit: settings derived with another data directory or service list keep them.
    if "redis" in settings.stack.services:
        settings = override(settings, "redis", password=redis_password(settings))
    if "mlflow" in settings.stack.services:
        settings = override(settings, "mlflow", password=mlflow_password(settings))
    stack.up(settings)
    try:
        yield settings
    finally:
        stack.down(settings)


def broker_environ(broker: Settings) -> dict[str, str]:
    """Settings (environment variables) of a client of `broker`'s Kafka from another data directory: its
    address, and where its roles' credentials are."""
    k = broker.kafka
    return {"FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": k.bootstrap_servers,
            "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": k.security_protocol, "FLYWHEEL_KAFKA_SASL_MECHANISM": k.sasl_mechanism,
            "FLYWHEEL_KAFKA_CREDENTIALS_DIR": k.credentials_dir}


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A real Kafka broker (Apache Kafka, SCRAM and ACLs) for the whole session; settings point at it."""
    yield from running_stack(tmp_path_factory.mktemp("broker"), "kafka")


@pytest.fixture(scope="session")
def redis_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A real Redis (the Feast online store) for the whole session, with its own data directory."""
    yield from running_stack(tmp_path_factory.mktemp("redis"), "redis")


def answered(url: str, body: dict, tries: int = 5) -> dict:
    """POST `body` as a client of the serving API should: a 503 (shed under load, with Retry-After) is
    sent again after the time it names, at most `tries` times. The answer must then be a 200."""
    for _ in range(tries):
        r = httpx.post(url, json=body, timeout=30)
        if r.status_code != 503:
            break
        time.sleep(min(float(r.headers.get("retry-after", 1)), 2.0))
    assert r.status_code == 200, r.text
    return r.json()


class FaultTable:
    """The fault suite's findings (`pytest -m chaos`, `make chaos`; part of `make test`): each test that
    injects a fault records what must hold and what it saw; the run ends with them as one table."""

    KEY = pytest.StashKey[list[tuple[str, str, str, bool]]]()

    def __init__(self, config: pytest.Config) -> None:
        self.rows = config.stash.setdefault(self.KEY, [])

    def record(self, fault: str, must_hold: str, seen: str, held: bool) -> bool:
        self.rows.append((fault, must_hold, seen, held))
        return held


@pytest.fixture(scope="session")
def faults(pytestconfig: pytest.Config) -> FaultTable:
    return FaultTable(pytestconfig)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    rows = config.stash.get(FaultTable.KEY, [])
    if rows:
        terminalreporter.section("faults injected, and what held")
        terminalreporter.write_line("| fault | must hold | seen | held |\n|---|---|---|---|")
        for fault, must_hold, seen, held in rows:
            terminalreporter.write_line(f"| {fault} | {must_hold} | {seen} | {'yes' if held else 'NO'} |")


def wait_for(check: Callable, timeout_s: float = 90.0):
    """Retry `check` until it stops raising AssertionError (the last one is raised at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)

