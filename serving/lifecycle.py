"""Following the MLflow aliases: versions are loaded and warmed in the background, then swapped in
atomically between batches; recent versions stay warm so a rollback swaps back at once.

A version that fails to load or warm (missing artifact, a spec the server cannot feed, non-finite
scores) is refused: logged, counted, retried only every RETRY_REFUSED_S, and the current one keeps
serving. A fetch that fails while the registry does not answer is an outage, not a bad version: retried
at the next poll that is answered. An incremental version whose parent is loaded is built from the
parent plus its sparse delta (`sparse_delta` tag): only the changed rows are downloaded, and nothing is
compiled.

Once the first champion serves, what the worker holds (the libraries, that version) is frozen out of
the cyclic GC (`gc.freeze`, no collection: nothing waits on it): its full collections otherwise walked
~620k long-lived objects with the GIL held, 0.4-0.5 s every few seconds of load, the /rank p99.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import numpy as np
import redis
import tensorflow as tf
from mlflow import MlflowClient

from contract.examples import Examples
from contract.terms import unmet
from infra.settings import Settings
from models import sparse_tier
from models.ctr import CtrModel, ModelSpec
from models.embedding_store import MissingVersion
from models.foreign import ForeignModel
from models.registry import CHALLENGER, CHAMPION, CONTROL, RegistryError, Routing, connect, load_version, routing
from serving import metrics
from serving.dense import DenseRunner
from serving.sparse_tier import Breaker, DeltaListener, RowCache, TieredTables, settle

log = logging.getLogger(__name__)
ROUTES = (CHAMPION, CHALLENGER, CONTROL)  # @control: the champion before, during the new one's canary
RETRY_REFUSED_S = 300.0  # a refused version is tried again this long after (a cause may have been transient)
READ_SHARED_S = 0.1  # how often a worker reads the aliases another worker polled (a file read)


@dataclass(frozen=True)
class ServedModel:
    """One loaded, warm version: its sparse tables (CPU) and dense weights, run by its architecture's
    shared compiled runner."""

    version: str
    model: CtrModel | ForeignModel
    weights: list[tf.Tensor]
    runner: DenseRunner | None  # None: a model of another flavor, scored by its own predict
    loaded_by: str  # "full", "delta" or "store" (the sparse tier: rows read per batch)
    tiered: TieredTables | None = None

    def inputs(self, ex: Examples) -> dict[str, np.ndarray]:
        if self.tiered is None:
            return self.model.scoring_inputs(ex)
        groups = self.model.groups(ex)
        tables = self.tiered.tables_for(self.model.table_ids(ex, groups))
        try:
            return self.model.with_tables(tables).scoring_inputs(ex, groups)
        finally:
            settle(tables)  # the store's reply taken even when scoring failed: its connection back in the pool

    def score(self, ex: Examples) -> np.ndarray:
        """Click probabilities [N]; unknown ids use the default row."""
        if self.runner is None:  # the generic path: the whole batch through the pyfunc, no XLA
            with metrics.FOREIGN_SECONDS.time():
                return self.model.predict(ex)
        return self.runner.run(self.weights, self.inputs(ex))


def shape_key(spec: ModelSpec) -> tuple:
    """What fixes the dense network's shapes: versions alike in this share compiled functions."""
    return (spec.kind, spec.hidden, len(spec.numeric_features), spec.numeric_bins, spec.sparse.dim, spec.long_length,
            spec.token_length)


class ModelFollower:
    """Holds the served versions of @champion, @challenger and @control and keeps them current, with the
    champion's share of users while @control serves (`champion_percent`)."""

    def __init__(self, s: Settings, warm_example: Examples, shared: Path | None = None) -> None:
        self.s = s
        # The server's workers share one registry poll per `serving.poll_interval_s` through this file
        # (each call costs the MLflow server ~20 ms of CPU): whichever worker finds it older polls and
        # rewrites it; the others read it.
        self.shared = shared
        self.warm_example = warm_example  # a few real-looking rows every new version must score
        self.runners: dict[tuple, DenseRunner] = {}
        self.served: dict[str, ServedModel | None] = dict.fromkeys(ROUTES)
        self.warm: OrderedDict[str, ServedModel] = OrderedDict()  # version -> model, most recent last
        self.champion_percent = 100.0
        self.refused: dict[str, str] = {}  # version -> why
        self._refused_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: MlflowClient | None = None
        # The registry as the last poll found it: None until the first poll; an error while it is unreachable
        # (the routes keep the versions they serve: an outage is not an alias change).
        self.registry_reachable: bool | None = None
        self.registry_error = ""
        self.registry_since = time.time()
        # The sparse tier: versions read from the embedding store, each with its cache of hot rows.
        self.caches: dict[str, RowCache] = {}
        self.deltas: DeltaListener | None = None
        if s.sparse_tier.enabled:
            timeout = s.sparse_tier.timeout_ms / 1000
            self.store = sparse_tier.store(s, socket_timeout=5, socket_connect_timeout=5)  # swaps: meta, dense weights
            self.batch_store = sparse_tier.store(s, socket_timeout=timeout, socket_connect_timeout=timeout)
            self.breaker = Breaker(s.sparse_tier.retry_after_s)
            self.deltas = DeltaListener(s, self.caches)

    # --- what the executors read (one attribute read: a swap is atomic) -------------------------

    def current(self, route: str) -> ServedModel | None:
        return self.served[route]

    @property
    def ready(self) -> bool:
        return self.served[CHAMPION] is not None

    # --- following ------------------------------------------------------------------------------

    def _registry(self) -> MlflowClient:
        if self._client is None:  # connecting costs the registry a call: once, not every poll
            self._client = connect(self.s)
        return self._client

    def _routing(self) -> Routing:
        """The registry's aliases and the champion's share, at most `serving.poll_interval_s` old: one
        registry call, or the shared file when another worker made it recently."""
        if self.shared is not None:
            try:
                if time.time() - self.shared.stat().st_mtime < self.s.serving.poll_interval_s:
                    return Routing(**json.loads(self.shared.read_text()))
            except (OSError, ValueError, TypeError):  # absent, mid-replace, or written by an older version
                pass
        asked_at = time.time()
        found = routing(self._registry(), self.s.models.name)
        if self.shared is not None:
            tmp = self.shared.with_name(f"{self.shared.name}.{os.getpid()}")
            tmp.write_text(json.dumps(asdict(found)))
            os.utime(tmp, (asked_at, asked_at))  # the answer's age counts from the question
            try:  # a slow answer must not replace one another worker asked for later (a rollback undone)
                newer = self.shared.stat().st_mtime > asked_at
            except OSError:
                newer = False
            if newer:
                tmp.unlink()
            else:
                tmp.replace(self.shared)
        return found

    def _registry_state(self, error: str | None) -> None:
        """Record a poll's outcome; log once per change of reachability, not once per poll."""
        reachable = error is None
        self.registry_error = error or ""
        if reachable == self.registry_reachable:
            return
        now = time.time()
        if reachable and self.registry_reachable is False:
            log.info("registry reachable again after %.0fs; following the aliases", now - self.registry_since)
        elif not reachable:
            routes = {r: (m.version if m else None) for r, m in self.served.items()}
            log.warning("registry unreachable (%s); serving the last known aliases %s until it answers", error, routes)
        self.registry_reachable, self.registry_since = reachable, now
        metrics.REGISTRY_REACHABLE.set(int(reachable))

    def poll_once(self) -> None:
        """Read the aliases; load, warm and swap in any version that changed."""
        found = self._routing()
        named = found.aliases
        self.champion_percent = found.champion_percent
        for route in ROUTES:
            version = named.get(route)
            current = self.served[route]
            if version == (current.version if current else None):
                continue
            if version is None:
                if route == CHAMPION:  # never stop serving: keep the last champion
                    log.warning("@%s was removed; still serving v%s", route, current.version)
                    continue
                self.served[route] = None  # canary and shadow traffic stop
                metrics.set_version(route, None)
                log.info("@%s removed", route)
                continue
            if time.monotonic() - self._refused_at.get(version, -RETRY_REFUSED_S) < RETRY_REFUSED_S:
                continue
            started = time.monotonic()
            try:
                model = self._obtain(version)
            except Exception as exc:  # noqa: BLE001 - any failure refuses the version, never the server
                if not self._registry_answers():  # an outage mid-fetch: the version is not at fault
                    raise RegistryError(f"v{version} not fetched, the registry does not answer: {exc}") from exc
                self.refused[version] = f"{type(exc).__name__}: {exc}"
                self._refused_at[version] = time.monotonic()
                metrics.MODEL_REFUSED.inc()
                log.error("refused v%s for @%s: %s; still serving %s", version, route, self.refused[version],
                          f"v{current.version}" if current else "nothing")
                continue
            self.served[route] = model  # the swap: batches started after this use the new version
            metrics.MODEL_SWAPS.labels(route).inc()
            metrics.SWAP_SECONDS.observe(time.monotonic() - started)
            metrics.set_version(route, version)
            metrics.WORKER_READY.set(int(self.ready))
            log.info("@%s now v%s (%s, %.2fs)", route, version, model.loaded_by, time.monotonic() - started)

    def _registry_answers(self) -> bool:
        try:
            self._registry().get_registered_model(self.s.models.name)
        except Exception:  # noqa: BLE001 - whatever the client raises, it did not answer
            return False
        return True

    def _obtain(self, version: str) -> ServedModel:
        if version in self.warm:
            self.warm.move_to_end(version)
            return self.warm[version]
        served = self._from_store(version) if self.deltas is not None else None
        if served is None:
            tags = dict(self._registry().get_model_version(self.s.models.name, version).tags)
            parent = self.warm.get(tags.get("parent_version", ""))
            if parent is not None and parent.tiered is None and tags.get("sparse_delta"):
                with tempfile.TemporaryDirectory() as tmp:
                    delta = Path(mlflow.artifacts.download_artifacts(tags["sparse_delta"], dst_path=tmp))
                    model, how = parent.model.with_delta(delta), "delta"
            else:
                model, how = load_version(self.s, version), "full"
            served = self._warmed(version, model, how)
        self.warm[version] = served
        serving = {m.version for m in self.served.values() if m is not None}
        for old in [v for v in self.warm if v not in serving and v != version][
                : max(0, len(self.warm) - max(2, self.s.serving.keep_warm))]:
            del self.warm[old]  # the least recently used first; a version serving a route stays
            self.caches.pop(old, None)
        return served

    def _from_store(self, version: str) -> ServedModel | None:
        """The version served from the embedding store, or None (logged) when the store does not hold it
        or does not answer: the version is then loaded whole from the registry."""
        try:
            lineage = self.store.lineage(version)
            spec, dense = self.store.model_of(version)
        except (MissingVersion, redis.RedisError, OSError) as exc:
            log.warning("v%s not read from the embedding store (%s: %s): loading it whole", version,
                        type(exc).__name__, exc)
            return None
        cache = self.deltas.take(version) or RowCache(self.s.sparse_tier.cache_rows, lineage[0].dim)
        tiered = TieredTables(self.batch_store, lineage, cache, self.breaker)
        served = self._warmed(version, CtrModel.from_parts(spec, dense), "store", tiered)
        self.caches[version] = cache
        return served

    def _warmed(self, version: str, model: CtrModel | ForeignModel, how: str, tiered: TieredTables | None = None
                ) -> ServedModel:
        if isinstance(model, ForeignModel):
            served = ServedModel(version, model, [], None, how)
            if not np.all(np.isfinite(served.score(self.warm_example))):
                raise ValueError(f"v{version} gives non-finite scores")
            return served
        # Any subset of the numeric inputs, in any order, is served (each version takes its own columns);
        # another dataset's event types or inputs are not.
        if reasons := unmet(model.spec.terms):
            raise ValueError(f"v{version} cannot be served on these online features: {'; '.join(reasons)}")
        key = shape_key(model.spec)
        runner = self.runners.get(key)
        if runner is None:
            sv = self.s.serving
            runner = DenseRunner(model, sv.row_buckets, sv.sequence_buckets, sv.buckets,
                                 on_compile=lambda where: metrics.COMPILES.labels(where).inc())
            self.runners[key] = runner
        served = ServedModel(version, model, [tf.constant(w) for w in model.dense_weights()], runner, how, tiered)
        runner.warm(served.weights, served.inputs(self.warm_example))
        if not np.all(np.isfinite(served.score(self.warm_example))):
            raise ValueError(f"v{version} gives non-finite scores")
        return served

    def start(self) -> None:
        """Poll in a background thread every `serving.poll_interval_s` (the first poll at once), or every
        READ_SHARED_S when the aliases are shared; after a failed poll, `serving.poll_interval_s` (an
        unreachable registry is not tried more often than without the sharing)."""
        def loop() -> None:
            shared_every = min(READ_SHARED_S, self.s.serving.poll_interval_s)
            frozen = False
            while not self._stop.is_set():
                wait = shared_every if self.shared is not None else self.s.serving.poll_interval_s
                try:
                    self.poll_once()
                    self._registry_state(None)
                    if self.ready and not frozen:
                        gc.freeze()  # moves the tracked objects aside (list splices): no pause
                        frozen = True
                except Exception as exc:  # noqa: BLE001 - the registry being down must not stop serving
                    metrics.REGISTRY_ERRORS.inc()
                    self._registry_state(f"{type(exc).__name__}: {exc}")
                    wait = self.s.serving.poll_interval_s
                self._stop.wait(wait)

        self._thread = threading.Thread(target=loop, name="model-follower", daemon=True)
        self._thread.start()
        if self.deltas is not None:
            self.deltas.start()

    def stop(self) -> None:
        self._stop.set()
        if self.deltas is not None:
            self.deltas.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for runner in self.runners.values():
            runner.close()
