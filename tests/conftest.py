"""Fixtures that start real services on free loopback ports, each run in its own data directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import stack
from infra.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
FLYWHEEL = [sys.executable, "-m", "infra.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stack_environ(data_dir: Path, **extra: str) -> dict[str, str]:
    """An environment whose settings point every service at a fresh port and `data_dir`."""
    config = data_dir / "flywheel.toml"
    data_dir.mkdir(parents=True, exist_ok=True)
    config.write_text("")  # isolates tests from a developer's own flywheel.toml
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return environ | {
        "FLYWHEEL_CONFIG": str(config),
        "FLYWHEEL_PATHS_DATA_DIR": str(data_dir),
        "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS": "2000",
        "FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
        "FLYWHEEL_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "FLYWHEEL_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}",
        "FLYWHEEL_AIRFLOW_API_URL": f"http://127.0.0.1:{free_port()}",
    } | extra


def run_cli(environ: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FLYWHEEL, *args], env=environ, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A real Kafka-protocol broker (Tansu) for the whole session; settings point at it."""
    environ = stack_environ(tmp_path_factory.mktemp("broker"), FLYWHEEL_STACK_SERVICES="kafka")
    settings = load_settings(environ)
    stack.up(settings)
    yield settings
    stack.down(settings)
