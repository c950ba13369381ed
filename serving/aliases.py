"""Following a registered model's aliases, for every model the serving tier holds: the ranker's routes in each
ranking worker (serving/lifecycle.py) and the retrieval @champion in the near-line embedder (serving/nearline.py).

A poll reads the aliases in one registry call (or the answer another worker shared, at most `interval_s` old) and
obtains a version only when its alias moved. A version that fails to load is refused: logged, retried only every
RETRY_REFUSED_S, and the one before keeps serving. A fetch that fails while the registry does not answer is an
outage, not a bad version: retried at the next poll that is answered. @champion is never dropped: a removed
champion alias keeps the last one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from mlflow import MlflowClient

from infra.settings import RegisteredModel, Settings
from models.registry import CHAMPION, RegistryError, Routing, connect, routing

log = logging.getLogger(__name__)
RETRY_REFUSED_S = 300.0  # a refused version is tried again this long after (a cause may have been transient)


class Versioned(Protocol):
    version: str


T = TypeVar("T", bound=Versioned)


class AliasFollower(Generic[T]):
    """Holds what each of `aliases` of `model` names, obtained by `obtain` (a subclass's: load, warm, check),
    and the champion's share of users while a canary runs (`champion_percent`). `shared`: a file through which
    processes following the same model share one registry read per `interval_s` (each read costs the MLflow
    server ~20 ms of CPU): whichever finds it older reads the registry and rewrites it; the others read it."""

    def __init__(self, s: Settings, model: RegisteredModel, aliases: tuple[str, ...], interval_s: float,
                 shared: Path | None = None) -> None:
        self.s, self.model, self.aliases, self.interval_s, self.shared = s, model, aliases, interval_s, shared
        self.served: dict[str, T | None] = dict.fromkeys(aliases)
        self.champion_percent = 100.0
        self.holdout_percent, self.holdout_salt = 0.0, ""
        self.refused: dict[str, str] = {}  # version -> why
        self._refused_at: dict[str, float] = {}
        self._client: MlflowClient | None = None
        # The registry as the last poll found it: None until the first poll; an error while it is unreachable
        # (the aliases keep the versions they serve: an outage is not an alias change).
        self.registry_reachable: bool | None = None
        self.registry_error = ""
        self.registry_since = time.time()

    # --- what a subclass supplies ---------------------------------------------------------------

    def obtain(self, version: str) -> T:
        """Version `version`, ready to serve; raises when it cannot be."""
        raise NotImplementedError

    def swapped(self, alias: str, served: T | None, seconds: float) -> None:
        """`alias` now serves `served` (None: the alias was removed), obtained in `seconds`."""
        if served is None:
            log.info("%s@%s removed", self.model.name, alias)
        else:
            log.info("%s@%s now v%s (%.2fs)", self.model.name, alias, served.version, seconds)

    def refusing(self, version: str, alias: str) -> None:
        """`version` was refused for `alias` (the reason in `self.refused`)."""
        current = self.served[alias]
        log.error("refused %s v%s for @%s: %s; still serving %s", self.model.name, version, alias,
                  self.refused[version], f"v{current.version}" if current else "nothing")

    def reachability(self, reachable: bool) -> None:
        """The registry answered again (True) or stopped answering (False)."""

    # --- following ------------------------------------------------------------------------------

    def current(self, alias: str) -> T | None:
        return self.served[alias]

    def registry(self) -> MlflowClient:
        if self._client is None:  # connecting costs the registry a call: once, not every poll
            self._client = connect(self.s)
        return self._client

    def _routing(self) -> Routing:
        """The registry's aliases and the champion's share, at most `interval_s` old: one registry call, or the
        shared file when another process made it recently."""
        if self.shared is not None:
            try:
                if time.time() - self.shared.stat().st_mtime < self.interval_s:
                    return Routing(**json.loads(self.shared.read_text()))
            except (OSError, ValueError, TypeError):  # absent, mid-replace, or written by an older version
                pass
        asked_at = time.time()
        found = routing(self.registry(), self.model.name)
        if self.shared is not None:
            tmp = self.shared.with_name(f"{self.shared.name}.{os.getpid()}")
            tmp.write_text(json.dumps(asdict(found)))
            os.utime(tmp, (asked_at, asked_at))  # the answer's age counts from the question
            try:  # a slow answer must not replace one another process asked for later (a rollback undone)
                newer = self.shared.stat().st_mtime > asked_at
            except OSError:
                newer = False
            if newer:
                tmp.unlink()
            else:
                tmp.replace(self.shared)
        return found

    def registry_state(self, error: str | None) -> None:
        """Record a poll's outcome; log once per change of reachability, not once per poll."""
        reachable = error is None
        self.registry_error = error or ""
        if reachable == self.registry_reachable:
            return
        now = time.time()
        if reachable and self.registry_reachable is False:
            log.info("registry reachable again after %.0fs; following %s's aliases", now - self.registry_since,
                     self.model.name)
        elif not reachable:
            held = {a: (m.version if m else None) for a, m in self.served.items()}
            log.warning("registry unreachable (%s); serving the last known aliases of %s %s until it answers",
                        error, self.model.name, held)
        self.registry_reachable, self.registry_since = reachable, now
        self.reachability(reachable)

    def poll_once(self) -> None:
        """Read the aliases; obtain and swap in any version that moved."""
        found = self._routing()
        named = found.aliases
        self.champion_percent = found.champion_percent
        self.holdout_percent, self.holdout_salt = found.holdout_percent, found.holdout_salt
        for alias in self.aliases:
            version = named.get(alias)
            current = self.served[alias]
            if version == (current.version if current else None):
                continue
            if version is None:
                if alias == CHAMPION:  # never stop serving: keep the last champion
                    if current is not None:
                        log.warning("%s@%s was removed; still serving v%s", self.model.name, alias, current.version)
                    continue
                self.served[alias] = None  # canary and shadow traffic stop
                self.swapped(alias, None, 0.0)
                continue
            if time.monotonic() - self._refused_at.get(version, -RETRY_REFUSED_S) < RETRY_REFUSED_S:
                continue
            started = time.monotonic()
            try:
                served = self.obtain(version)
            except Exception as exc:  # noqa: BLE001 - any failure refuses the version, never the follower
                if not self._registry_answers():  # an outage mid-fetch: the version is not at fault
                    raise RegistryError(f"v{version} not fetched, the registry does not answer: {exc}") from exc
                self.refused[version] = f"{type(exc).__name__}: {exc}"
                self._refused_at[version] = time.monotonic()
                self.refusing(version, alias)
                continue
            self.served[alias] = served  # the swap: what starts after this uses the new version
            self.swapped(alias, served, time.monotonic() - started)

    def _registry_answers(self) -> bool:
        try:
            self.registry().get_registered_model(self.model.name)
        except Exception:  # noqa: BLE001 - whatever the client raises, it did not answer
            return False
        return True
