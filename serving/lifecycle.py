"""The ranker's versions in a ranking worker: following its MLflow aliases (serving/aliases.py), versions are
loaded and warmed in the background, then swapped in atomically between batches; recent versions stay warm so a
rollback swaps back at once.

A version that fails to load or warm (missing artifact, a spec the server cannot feed, non-finite scores) is
refused, counted in `flywheel_model_refused_total`, and the current one keeps serving. An incremental version
whose parent is loaded is built from the parent plus its sparse delta (`sparse_delta` tag): only the changed
rows are downloaded, and nothing is compiled.

Once the first champion serves, what the worker holds (the libraries, that version) is frozen out of
the cyclic GC (`gc.freeze`, no collection: nothing waits on it): its full collections otherwise walked
~620k long-lived objects with the GIL held, 0.4-0.5 s every few seconds of load, the /rank p99.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import redis
import tensorflow as tf

from contract.examples import Examples
from contract.terms import unmet
from infra.settings import RegisteredModel, Settings
from models import sparse_tier
from models.ctr import CtrModel, ModelSpec
from models.embedding_store import MissingVersion
from models.foreign import ForeignModel
from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT, load_version
from serving import metrics
from serving.aliases import AliasFollower
from serving.dense import DenseRunner
from serving.sparse_tier import Breaker, DeltaListener, RowCache, TieredTables, settle

log = logging.getLogger(__name__)
# @control: the champion before, during the new one's canary; @holdout: an experiment's frozen arm
ROUTES = (CHAMPION, CHALLENGER, CONTROL, HOLDOUT)
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
        """Probabilities [N] of the one objective, [N, K] of each of several (`objective_names`); unknown ids use
        the default row."""
        if self.runner is None:  # the generic path: the whole batch through the pyfunc, no XLA
            with metrics.FOREIGN_SECONDS.time():
                return self.model.predict(ex)
        return self.runner.run(self.weights, self.inputs(ex))


def shape_key(spec: ModelSpec) -> tuple:
    """What fixes the dense network's shapes and variables (a position bias, a network per objective): versions alike
    in this share compiled functions."""
    return (spec.kind, spec.hidden, len(spec.numeric_features), spec.numeric_bins, spec.sparse.dim, spec.long_length,
            spec.token_length, spec.position_slots, spec.chain, bool(spec.context),
            len(spec.event_types))


def close_runners(runners: dict[tuple, DenseRunner]) -> None:
    for runner in runners.values():
        runner.close()


class ModelFollower(AliasFollower[ServedModel]):
    """Holds the served versions of the ranker's @champion, @challenger, @control and @holdout and keeps them
    current, with the champion's share of users while @control serves (`champion_percent`) and the holdout's. The
    server's workers share one registry poll per `serving.poll_interval_s` through the file `shared`."""

    def __init__(self, s: Settings, warm_example: Examples, shared: Path | None = None,
                 model: RegisteredModel | None = None, runners: dict[tuple, DenseRunner] | None = None) -> None:
        """`runners`: compiled dense networks by shape (`shape_key`), shared with the followers of the worker's
        other rankers (each compile costs ~55 s of CPU; versions alike in shape share one) and closed by whoever
        handed them over, after every follower sharing them stopped."""
        super().__init__(s, model or s.ranker, ROUTES, s.serving.poll_interval_s, shared)
        self.warm_example = warm_example  # a few real-looking rows every new version must score
        self.runners: dict[tuple, DenseRunner] = {} if runners is None else runners
        self._owns_runners = runners is None
        self.warm: OrderedDict[str, ServedModel] = OrderedDict()  # version -> model, most recent last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The sparse tier: versions read from the embedding store, each with its cache of hot rows.
        self.caches: dict[str, RowCache] = {}
        self.deltas: DeltaListener | None = None
        if s.sparse_tier.enabled:
            timeout = s.sparse_tier.timeout_ms / 1000
            self.store = sparse_tier.store(s, self.model, socket_timeout=5, socket_connect_timeout=5)  # swaps
            self.batch_store = sparse_tier.store(s, self.model, socket_timeout=timeout, socket_connect_timeout=timeout)
            self.breaker = Breaker(s.sparse_tier.retry_after_s)
            self.deltas = DeltaListener(s, self.caches, self.model.name)

    @property
    def ready(self) -> bool:
        return self.served[CHAMPION] is not None

    # --- the follower's hooks: metrics ----------------------------------------------------------

    def swapped(self, alias: str, served: ServedModel | None, seconds: float) -> None:
        metrics.set_version(self.model.name, alias, served.version if served else None)
        if served is None:
            log.info("@%s removed", alias)
            return
        metrics.MODEL_SWAPS.labels(alias).inc()
        metrics.SWAP_SECONDS.observe(seconds)
        if self.model.scenario is None:  # the worker is ready with the platform's ranker; a scenario's may follow
            metrics.WORKER_READY.set(int(self.ready))
        log.info("%s@%s now v%s (%s, %.2fs)", self.model.name, alias, served.version, served.loaded_by, seconds)

    def refusing(self, version: str, alias: str) -> None:
        metrics.MODEL_REFUSED.inc()
        super().refusing(version, alias)

    def reachability(self, reachable: bool) -> None:
        metrics.REGISTRY_REACHABLE.set(int(reachable))

    # --- obtaining a version ----------------------------------------------------------------------

    def obtain(self, version: str) -> ServedModel:
        if version in self.warm:
            self.warm.move_to_end(version)
            return self.warm[version]
        served = self._from_store(version) if self.deltas is not None else None
        if served is None:
            tags = dict(self.registry().get_model_version(self.model.name, version).tags)
            parent = self.warm.get(tags.get("parent_version", ""))
            if parent is not None and parent.tiered is None and tags.get("sparse_delta"):
                with tempfile.TemporaryDirectory() as tmp:
                    delta = Path(mlflow.artifacts.download_artifacts(tags["sparse_delta"], dst_path=tmp))
                    model, how = parent.model.with_delta(delta), "delta"
            else:
                model, how = load_version(self.s, version, self.model), "full"
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
        if runner is None:  # setdefault: the followers of a worker's other rankers may race for the same shape
            sv = self.s.serving
            runner = self.runners.setdefault(key, DenseRunner(
                model, sv.row_buckets, sv.sequence_buckets, sv.buckets,
                on_compile=lambda where: metrics.COMPILES.labels(where).inc()))
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
                    self.registry_state(None)
                    if self.ready and not frozen:
                        gc.freeze()  # moves the tracked objects aside (list splices): no pause
                        frozen = True
                except Exception as exc:  # noqa: BLE001 - the registry being down must not stop serving
                    metrics.REGISTRY_ERRORS.inc()
                    self.registry_state(f"{type(exc).__name__}: {exc}")
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
        if self._owns_runners:
            close_runners(self.runners)
