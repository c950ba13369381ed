"""The ranking server as processes (`flywheel serve`, the stack's `ranking-server`).

A supervisor starts `serving.workers` worker processes (`python -m serving.api`). Each binds the
server's address with SO_REUSEPORT, so the kernel spreads new connections across them, and runs its own
model follower, batcher, executors and prediction log: one GIL per core instead of one per host. They
share a directory: their metrics meet in files there (serving/metrics.py), and so do the registry's
aliases, polled by one worker for all (serving/lifecycle.py). A worker that exits is
started again, after a back-off when it keeps failing; SIGTERM or SIGINT stops them all.

The kernel picks a worker by a hash of the connection's addresses, so a few long-lived connections can
land unevenly (8 clients: 6 on one worker, 2 on the other, which then idles while the first queues).
Each worker publishes its open connections in a shared file (ConnectionShares); a worker holding more
than its share answers with `Connection: close`, and the client's next connection is hashed afresh.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import multiprocess

from infra.settings import Settings

log = logging.getLogger(__name__)
COMPILE_CACHE_DAYS = 30  # a cached executable older than this is dropped (compiled again if still used)
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that ran this long had no start-up failure: its back-off starts over


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to the server's address that every worker can bind as well (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class ConnectionShares:
    """Each worker's open connections: one int64 slot per worker in a file every worker maps."""

    def __init__(self, shared: Path, workers: int) -> None:
        self.workers = workers
        path = shared / "connections"
        if not path.exists() or path.stat().st_size != 8 * workers:
            path.write_bytes(bytes(8 * workers))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8 * workers)

    def set(self, slot: int, connections: int) -> None:
        struct.pack_into("q", self._map, 8 * slot, connections)

    def over_share(self, slot: int, connections: int) -> bool:
        """Publish this worker's count; True if it holds more than an even split of all of them."""
        self.set(slot, connections)
        total = sum(struct.unpack_from(f"{self.workers}q", self._map))
        return connections > math.ceil(total / self.workers)


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.failures = 0
        self.next_start = 0.0


def compile_cache(s: Settings) -> Path:
    """The directory of the workers' compiled shape buckets: one per TensorFlow version and CPU (an
    executable is built for both), entries older than COMPILE_CACHE_DAYS removed."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    cpu_key = hashlib.sha256(f"{os.uname().machine} {cpu}".encode()).hexdigest()[:12]
    directory = s.paths.cache_dir / "xla" / f"tensorflow-{_tensorflow_version()}-{cpu_key}"
    directory.mkdir(parents=True, exist_ok=True)
    stale = time.time() - COMPILE_CACHE_DAYS * 86_400
    for entry in directory.iterdir():
        try:
            if entry.stat().st_mtime < stale:
                entry.unlink()
        except FileNotFoundError:  # another server's worker renamed its temporary file, or pruned it
            continue
    return directory


def _tensorflow_version() -> str:
    """The installed TensorFlow's version (its distribution is `tensorflow-cpu` on CPU-only hosts),
    without importing it."""
    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    dists = importlib.metadata.packages_distributions().get("tensorflow") or ["tensorflow"]
    return importlib.metadata.version(dists[0])  # another build (e.g. tensorflow-intel)


def _worker_env(s: Settings, shared: Path) -> dict[str, str]:
    # Both names: prometheus_client reads the first, Feast (imported by the worker) the second.
    env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(shared), "PROMETHEUS_MULTIPROCESS_DIR": str(shared)}
    if s.serving.compile_cache:
        # TensorFlow writes each entry to a temporary file and renames it: workers compiling the same
        # shape at once each write a whole one. Loading one logs "Error parsing text-format
        # tensorflow.XlaSerializedCacheEntry" (TensorFlow tries text before binary): harmless.
        cache = compile_cache(s)
        env["TF_XLA_FLAGS"] = f"{env.get('TF_XLA_FLAGS', '')} --tf_xla_persistent_cache_directory={cache}".strip()
        log.info("compiled shape buckets cached in %s (delete it if a worker cannot read an entry)", cache)
    return env


def supervise(s: Settings) -> None:
    """Run the workers until SIGTERM or SIGINT."""
    shared = s.paths.run_dir / "ranking-server"
    shutil.rmtree(shared, ignore_errors=True)  # a previous run's workers are gone
    shared.mkdir(parents=True)
    listening_socket(s.serving.host, s.serving.port).close()  # the port is taken by another program: fail now
    env = _worker_env(s, shared)
    workers = [_Worker(i) for i in range(s.serving.workers)]
    shares = ConnectionShares(shared, len(workers))
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    log.info("%d serving worker(s) on %s:%d", len(workers), s.serving.host, s.serving.port)
    try:
        while not stopping:
            now = time.monotonic()
            for w in workers:
                if w.proc is not None and w.proc.poll() is not None:
                    multiprocess.mark_process_dead(w.proc.pid, str(shared))
                    w.failures = 1 if now - w.started >= STABLE_S else w.failures + 1
                    w.next_start = now + min(MAX_BACKOFF_S, 2.0 ** (w.failures - 1))
                    log.error("worker %d (pid %d) exited with code %s; starting it again in %.0f s", w.index,
                              w.proc.pid, w.proc.returncode, w.next_start - now)
                    w.proc = None
                    shares.set(w.index, 0)
                if w.proc is None and now >= w.next_start:
                    w.proc = subprocess.Popen([sys.executable, "-m", "serving.api", str(shared), str(w.index)],
                                              env=env)
                    w.started = now
                    log.info("worker %d: pid %d", w.index, w.proc.pid)
            time.sleep(0.2)
    finally:
        running = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(s.stack.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve(s: Settings) -> None:
    """Set up what the server reads and writes, then run its workers (`flywheel serve`)."""
    from feature_repo.store import apply
    from streaming.topics import ensure_topics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    # The deltas topic before the workers subscribe: a consumer learns of a topic created later only at
    # its next metadata refresh (minutes).
    ensure_topics(s, [s.serving.predictions_topic, *([s.sparse_tier.deltas_topic] if s.sparse_tier.enabled else [])])
    apply(s)  # the feature definitions it reads (idempotent): the server also runs without the pipeline
    supervise(s)


if __name__ == "__main__":  # the stack's `ranking-server` service
    from infra.settings import get_settings

    serve(get_settings())
