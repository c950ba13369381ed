"""The inference service: admission, features, batched scoring by the routed version, prediction log.

One server serves every ranker the settings declare: the platform's (requests naming no scenario) and each
scenario's (`[scenarios.<name>]` in the dataset spec), each followed apart (serving/lifecycle.py), with its own
aliases, canary share and logged model name, over one feature read, one batcher and the compiled networks they share.

    rank(request)
      admission: in-flight requests and queued rows bounded; the value tier's allocation at the
                 current load (serving/access.py) may shorten the request or shed it -> Shed (503)
      features:  one batched online read (serving/features.py)
      batch:     Batcher merges concurrent requests; an executor resolves each request's route to the
                 version serving it *at batch start* (swaps land between batches), looks up sparse
                 rows on CPU and runs the compiled dense network (serving/dense.py)
      log:       the prediction, and any shadow prediction, to Kafka
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from contract.examples import Examples, concat
from contract.inputs import NUMERIC_FEATURES
from infra.settings import Settings
from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT, objective_names
from serving import access, metrics
from serving.batching import Batcher, DeadlineExceeded, Overloaded
from serving.features import PER_REQUEST, Candidate, Fetched, OnlineFeatures
from serving.lifecycle import ModelFollower, close_runners
from serving.prediction_log import PredictionLog
from streaming.events import dataset_spec

log = logging.getLogger(__name__)


class Shed(RuntimeError):
    """Answered 503 + Retry-After without scoring: `reason` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class NotReady(RuntimeError):
    """No champion is loaded yet."""


class UnknownScenario(ValueError):
    """The request names a scenario the dataset spec does not declare (a 422)."""


def new_request_id() -> str:
    # 128 random bits as 32 hex digits, like uuid4().hex, without its getrandom(2) call: a system call
    # releases the GIL, and the event loop then waits up to a switch interval (5 ms) to take it back
    # from the batch and feature threads (2 % of a loaded worker's samples were that wait).
    return f"{random.getrandbits(128):032x}"


@dataclass
class RankRequest:
    user_id: str
    candidates: Sequence[Candidate]
    tier: str = "normal"
    deadline_ms: float | None = None
    request_id: str = field(default_factory=new_request_id)
    # Recommendation (serving/recommend.py): only the best `top_k` are served, so only they are logged,
    # each with the candidate sources that retrieved it.
    top_k: int | None = None
    sources: Sequence[Sequence[str]] | None = None
    scenario: str = ""  # a declared scenario's ranker scores it; "": the platform's
    # The request's context as the client sent it (declared fields, of their kinds): the features read each field's
    # value once (`DatasetSpec.context_of`: a bucket, the defaults), an input of every row it scores, logged with
    # the prediction.
    context: Mapping[str, object] = field(default_factory=dict)


@dataclass
class RankResult:
    request_id: str
    model_version: str
    route: str
    scores: list[float | None]  # per candidate, in request order; None = not scored (degraded)
    defaulted_features: list[str]
    degraded: list[str]
    top: list[int] | None = None  # with top_k: the served candidates' indices, best first (by value where declared)
    # Where the spec names objectives: each one's probability the version predicts, per candidate as `scores`
    objectives: dict[str, list[float | None]] | None = None
    # Where the spec declares a value (`[ranking] value`) and the version predicts its objectives: each candidate's
    values: list[float | None] | None = None


@dataclass(frozen=True)
class Scored:
    """A job's probabilities by the version that scored it: [N], or [N, K] of each of its `objectives`."""

    probabilities: np.ndarray
    version: str
    objectives: tuple[str, ...]

    @property
    def scores(self) -> np.ndarray:
        """The first objective's (the click's): what the prediction log, the canary and served AUC read."""
        return self.probabilities[:, 0] if self.probabilities.ndim == 2 else self.probabilities


def best(scores: Sequence[float | None], k: int) -> list[int]:
    """Indices of the k best scores, best first (ties by position); unscored candidates never."""
    return sorted((i for i, v in enumerate(scores) if v is not None), key=lambda i: (-scores[i], i))[:k]


@dataclass(frozen=True)
class _Job:
    scenario: str
    route: str
    examples: Examples


def warm_examples(sequence_length: int, rows: int = 8) -> Examples:
    """Rows every new version must score finitely before it serves, with full-length sequences."""
    def ids(prefix: str, width: int) -> np.ndarray:
        return np.array([[f"{prefix}-{(r + j) % 97}" for j in range(width)] for r in range(rows)], dtype=object)

    label = dataset_spec().labels[0]  # a behavior type the version's type embedding holds

    return Examples(np.array([f"warm-user-{r}" for r in range(rows)], dtype=object),
                    np.array([f"warm-{r}" for r in range(rows)], dtype=object), np.full(rows, "", dtype=object),
                    ids("warm", sequence_length),
                    np.linspace(0, 1, rows * len(NUMERIC_FEATURES), dtype=np.float32).reshape(rows, -1),
                    np.zeros(rows, np.float32), sequence_types=np.full((rows, sequence_length), label, dtype=object),
                    long_sequences=ids("warm", 20), long_types=np.full((rows, 20), label, dtype=object),
                    item_tokens=ids("item:warm", 3), user_tokens=ids("user:warm", 3), numeric_names=NUMERIC_FEATURES)


class Inference:
    def __init__(self, s: Settings, shared: Path | None = None) -> None:
        """`shared`: the directory the server's workers share (serving/supervisor.py), if any."""
        self.s, sv = s, s.serving
        if sv.max_candidates > sv.max_inflight_rows:
            raise ValueError(f"serving.max_candidates ({sv.max_candidates}) must be at most serving.max_inflight_rows "
                             f"({sv.max_inflight_rows}): a full request could never be admitted")
        warm, self._runners = warm_examples(max(sv.sequence_buckets)), {}
        # One follower per ranker, by scenario ("": the platform's), sharing the compiled networks.
        self.followers = {m.scenario or "": ModelFollower(
            s, warm, shared / (f"aliases-{m.scenario}.json" if m.scenario else "aliases.json") if shared else None,
            model=m, runners=self._runners) for m in s.rankers}
        self.follower = self.followers[""]
        # Each ranker's experiment splits: its scenario's own (`[scenarios.<name>.serving]`), else the server's.
        self.splits = {key: s.for_model(f.model).serving for key, f in self.followers.items()}
        self.features = OnlineFeatures(s)
        self.predictions = PredictionLog(s)
        self.batcher: Batcher[_Job, Scored] = Batcher(
            self._run_batch, max_batch_rows=sv.max_batch_rows if sv.batching else 1,
            max_delay_s=sv.max_delay_ms / 1000, max_queue_rows=sv.max_inflight_rows, executors=sv.executors,
            name="rank")
        # Feature reads wait on Redis and decode in Python: a few threads, so the event loop (admission,
        # shedding) and the executors are not starved of the GIL by a crowd of readers.
        self._fetchers = ThreadPoolExecutor(sv.fetch_threads, thread_name_prefix="features")
        self.inflight_rows = 0  # admitted and not answered: fetching features, queued or scoring
        self._admit = threading.Lock()

    # --- load -----------------------------------------------------------------------------------

    def fill(self) -> float:
        """How loaded the server is, 0..1: the share of the in-flight row bound in use."""
        return min(1.0, self.inflight_rows / self.s.serving.max_inflight_rows)

    # --- the request path -----------------------------------------------------------------------

    def follower_of(self, scenario: str) -> ModelFollower:
        """The follower of `scenario`'s ranker ("": the platform's), or UnknownScenario naming the declared ones."""
        follower = self.followers.get(scenario)
        if follower is None:
            raise UnknownScenario(f"unknown scenario {scenario!r}: the dataset spec declares "
                                  f"{', '.join(repr(n) for n in self.followers if n) or 'none'}")
        return follower

    async def rank(self, req: RankRequest) -> RankResult:
        sv = self.s.serving
        started = time.monotonic()
        deadline = started + min(req.deadline_ms or sv.default_deadline_ms, sv.default_deadline_ms) / 1000
        follower = self.follower_of(req.scenario)
        champion = follower.current(CHAMPION)
        if champion is None:
            raise NotReady(f"no model of scenario {req.scenario!r} loaded yet" if req.scenario else
                           "no model loaded yet")
        allocation = access.allocate(req.tier, self.fill(), sv)
        if allocation.shed:
            metrics.SHED.labels(req.tier, "tier").inc()
            raise Shed("tier", f"load is high: {req.tier}-tier requests are shed first")
        rows = min(len(req.candidates), allocation.max_candidates or len(req.candidates))
        with self._admit:
            if self.inflight_rows + rows > sv.max_inflight_rows:
                metrics.SHED.labels(req.tier, "queue").inc()
                raise Shed("queue", f"{self.inflight_rows} candidate rows in flight; {rows} more would pass "
                                    f"{sv.max_inflight_rows}")
            self.inflight_rows += rows
        metrics.INFLIGHT_ROWS.inc(rows)
        try:
            length = champion.model.spec.sequence_length if champion.runner else self.s.streaming.sequence_length
            return await self._rank(req, follower, allocation, length, deadline)
        finally:
            with self._admit:
                self.inflight_rows -= rows
            metrics.INFLIGHT_ROWS.dec(rows)

    async def _rank(self, req: RankRequest, follower: ModelFollower, allocation: access.Allocation,
                    sequence_length: int, deadline: float) -> RankResult:
        scored = req.candidates[: allocation.max_candidates]
        reading = asyncio.get_running_loop().run_in_executor(
            self._fetchers, self.features.fetch, req.user_id, scored, int(time.time() * 1000), sequence_length,
            allocation.sequence_length, req.context)
        try:  # a stalled online store must not hold the request past its deadline
            fetched = await asyncio.wait_for(reading, max(0.0, deadline - time.monotonic()))
        except (TimeoutError, redis.RedisError) as exc:
            metrics.SHED.labels(req.tier, "features").inc()
            raise Shed("features", f"online features not read within the deadline ({type(exc).__name__})") from None
        if fetched.defaulted:
            metrics.DEFAULTED.inc()
        if allocation.degraded:
            metrics.DEGRADED.labels(req.tier).inc()
        split = self.splits[req.scenario]
        held = frozenset(r for r in (CHALLENGER, CONTROL, HOLDOUT) if follower.current(r) is not None)
        route = access.decide(req.user_id, split.canary_percent, held, follower.champion_percent,
                              follower.holdout_percent, follower.holdout_salt)
        result = await self._score(_Job(req.scenario, route, fetched.examples), req.tier, deadline)
        if route == CHAMPION and access.shadowed(req.request_id, split.shadow_percent):
            self._shadow(req, follower, fetched)
        scores, objectives = result.scores, self._objectives(result)
        values = self._values(objectives, fetched.snapshot)
        top = None if req.top_k is None else best((scores if values is None else values).tolist(), req.top_k)
        self._log(req, follower, scored, scores, result.version, route, fetched.snapshot, shadow=False, only=top)
        degraded = [what for what, on in (("sequence", allocation.sequence_length is not None),
                                          ("candidates", len(scored) < len(req.candidates))) if on]
        unscored = [None] * (len(req.candidates) - len(scored))
        return RankResult(req.request_id, result.version, route, scores.tolist() + unscored, fetched.defaulted,
                          degraded, top, None if not self.s.spec.objectives else
                          {name: p.tolist() + unscored for name, p in objectives.items()},
                          None if values is None else values.tolist() + unscored)

    def _objectives(self, result: Scored) -> dict[str, np.ndarray]:
        """Each objective's probabilities by its name; a version of one objective predicts the spec's first."""
        names = result.objectives or tuple(o.name for o in self.s.spec.objectives[:1])
        columns = result.probabilities.T if result.probabilities.ndim == 2 else [result.probabilities]
        return dict(zip(names, columns))

    def _values(self, objectives: dict[str, np.ndarray], snapshot: dict[str, Sequence]) -> np.ndarray | None:
        """The declared value of each candidate, of its objectives' probabilities, its item's numbers and the
        request's (none stored: 0, as is the value); None where none is declared or the version does not predict
        an objective it names (it is ordered by its scores)."""
        value = self.s.spec.value
        if value is None or any(o.name in value.names and o.name not in objectives for o in self.s.spec.objectives):
            return None
        spec, request = self.s.spec, snapshot.get("context", {})
        item = spec.table("item")
        numbers = {a.name: np.array([np.nan if v is None else float(v) for v in snapshot[item.feature(a)]])
                   for a in item.attributes if a.name in value.names and a.name in spec.item_numbers}
        numbers |= {name: np.nan if request.get(name) is None else float(request[name])
                    for name in spec.context_numbers if name in value.names}
        return value(numbers | {name: p for name, p in objectives.items() if name in value.names})

    async def _score(self, job: _Job, tier: str, deadline: float) -> Scored:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            metrics.SHED.labels(tier, "deadline").inc()
            raise Shed("deadline", "the deadline passed before scoring")
        try:
            future = self.batcher.submit(job, len(job.examples), remaining)
        except Overloaded as exc:
            metrics.SHED.labels(tier, "queue").inc()
            raise Shed("queue", str(exc)) from None
        try:
            return await asyncio.wrap_future(future)
        except DeadlineExceeded as exc:
            metrics.SHED.labels(tier, "deadline").inc()
            raise Shed("deadline", str(exc)) from None

    def _shadow(self, req: RankRequest, follower: ModelFollower, fetched: Fetched) -> None:
        """Score on @challenger too, log it, never wait for it or return it; dropped under load."""
        if follower.current(CHALLENGER) is None:
            return
        try:
            future = self.batcher.submit(_Job(req.scenario, CHALLENGER, fetched.examples), len(fetched.examples),
                                         self.s.serving.default_deadline_ms / 1000)
        except Overloaded:
            metrics.SHED.labels(req.tier, "shadow").inc()
            return

        def logged(f) -> None:
            if f.exception() is None:
                result = f.result()
                self._log(req, follower, req.candidates[: len(result.scores)], result.scores, result.version,
                          CHALLENGER, fetched.snapshot, shadow=True)

        future.add_done_callback(logged)

    def _log(self, req: RankRequest, follower: ModelFollower, candidates: Sequence[Candidate], scores: np.ndarray,
             version: str, route: str, snapshot: dict, shadow: bool, only: list[int] | None = None) -> None:
        """One prediction record; `only`: the candidates served (the rest were scored, never shown)."""
        extra = {}
        if only is not None:
            candidates, scores = [candidates[i] for i in only], scores[only]
            snapshot = {name: (values if name in PER_REQUEST else [values[i] for i in only])
                        for name, values in snapshot.items()}
            extra = {"sources": [list(req.sources[i]) for i in only]} if req.sources is not None else {}
        self.predictions.write(req.user_id, {
            "request_id": req.request_id, "user_id": req.user_id, "items": [c.item_id for c in candidates],
            "categories": [c.category for c in candidates], "scores": scores.tolist(),
            "model_name": follower.model.name, "model_version": version, "route": route, "shadow": shadow,
            "tier": req.tier, "served_at": int(time.time() * 1000), "features": snapshot} | extra)

    # --- the executors --------------------------------------------------------------------------

    def _run_batch(self, jobs: Sequence[_Job]) -> list[Scored]:
        """Score a batch: per scenario and route, the version serving it now, all its requests in one run."""
        results: list[Scored | None] = [None] * len(jobs)
        for scenario, route in {(job.scenario, job.route) for job in jobs}:
            follower = self.followers[scenario]
            model = follower.current(route) or follower.current(CHAMPION)
            idx = [i for i, job in enumerate(jobs) if (job.scenario, job.route) == (scenario, route)]
            batch = concat([jobs[i].examples for i in idx])
            probabilities, names = model.score(batch), objective_names(model.model)
            metrics.BATCH_ROWS.observe(len(batch))
            start = 0
            for i in idx:
                n = len(jobs[i].examples)
                results[i] = Scored(probabilities[start:start + n], model.version, names)
                start += n
        metrics.BATCH_REQUESTS.observe(len(jobs))
        return results

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self.features.warm()
        except redis.RedisError as exc:  # requests are shed ("features") until it answers
            log.warning("the online store did not answer the warm-up read: %s", exc)
        for follower in self.followers.values():
            follower.start()

    def close(self) -> None:
        for follower in self.followers.values():
            follower.stop()
        close_runners(self._runners)  # once every follower sharing them stopped
        self._fetchers.shutdown(wait=True)
        self.batcher.close()
        self.predictions.close()

