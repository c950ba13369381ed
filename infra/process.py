"""Background processes owned by the stack: each in its own process group, tracked by a PID file.

A PID file records the PID and the process start time, so `stop` never signals an unrelated process
that happens to reuse the PID after a reboot or crash. The start time is the kernel's (clock ticks
since boot, /proc/<pid>/stat): a wall-clock start time adds /proc/stat's boot time, which moves when
the system clock is adjusted, and made live services look dead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

# What the stack's processes create is their owner's alone (mode 600 files, 700 directories): the online
# store's snapshots, the registries' databases and password hashes, the checkpoints.
PRIVATE_UMASK = 0o077


@dataclass(frozen=True)
class Tracked:
    pid: int
    start_ticks: int  # start time in clock ticks since boot
    command: list[str]

    def process(self) -> psutil.Process | None:
        """The live process this record names, or None if it has exited."""
        try:
            proc = psutil.Process(self.pid)
            if start_ticks(self.pid) != self.start_ticks or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            return None


def start_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3


def read_pidfile(path: Path) -> Tracked | None:
    try:
        return Tracked(**json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _lower_priority(nice: int) -> None:
    """In the child, after setsid and before exec: `nice` added to its niceness, and the same for its
    session's scheduling group. Where the kernel groups processes by session (autogroups, on by default
    in most distributions), groups share the CPU at equal weight whatever their processes' niceness: a
    detached service's own niceness alone changes nothing against the other services."""
    niceness = os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(niceness))
    except OSError:  # no autogroups here (kernel option off, or not Linux)
        pass


def spawn(command: list[str], pidfile: Path, logfile: Path, env: dict[str, str], cwd: Path,
          nice: int = 0) -> Tracked:
    """Start `command` detached in a new session, appending stdout/stderr to `logfile`, `nice` added
    to its niceness and its session's (before it starts: every thread and child inherits it)."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(command)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True, preexec_fn=(lambda: _lower_priority(nice)) if nice else None,
            umask=PRIVATE_UMASK,
        )
    tracked = Tracked(popen.pid, start_ticks(popen.pid), command)
    pidfile.write_text(json.dumps(tracked.__dict__))
    return tracked


def stop(pidfile: Path, timeout_s: float, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Stop the process group named by `pidfile` (`sig` to the group, then SIGTERM to every descendant left
    after `timeout_s`, then SIGKILL); True if something was running."""
    tracked = read_pidfile(pidfile)
    proc = tracked.process() if tracked else None
    if proc is None:
        pidfile.unlink(missing_ok=True)
        return False
    # Collect descendants first: some (e.g. forked workers) start sessions of their own.
    family = [proc, *proc.children(recursive=True)]
    _signal_group(proc.pid, sig)
    for p in family:  # descendants that left the group
        try:
            if os.getpgid(p.pid) != proc.pid:
                _signal(p, sig)
        except (ProcessLookupError, psutil.Error):
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    kill_all(alive, timeout_s)
    _signal_group(proc.pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    return True


def tagged(tag: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment has tag=value (children inherit it from what `spawn` started)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(tag) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_all(procs: list[psutil.Process], timeout_s: float) -> None:
    for p in procs:
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def exit_with_parent() -> None:
    """In a worker: be sent SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the supervisor died before the call
        sys.exit(1)


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for tests and benchmarks that run services side by side)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
