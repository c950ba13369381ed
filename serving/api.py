"""The ranking API (FastAPI; OpenAPI at /docs and /openapi.json), served by each worker process
(serving/supervisor.py); a connection is answered by one of them.

    POST /rank     scores for a user's candidates, the version that scored them, defaulted features
    POST /recommend  a user's best k items from the whole catalogue (serving/recommend.py): each with its
                   ranker score and the candidate sources that retrieved it, and the versions used
    GET  /healthz  the worker is up (HTTP 200); `status` "degraded" with its `problems` while a worker's
                   prediction log is down or it refused most of its last minute's requests (503);
                   `notes`: the registry unreachable (the last aliases serve)
    GET  /readyz   200 once every worker has a champion loaded and every shape bucket compiled and warm
    GET  /models   the answering worker's versions serving each route, warm ones, refused ones and why;
                   `workers`: each worker's readiness and versions serving
    GET  /metrics  Prometheus, summed over the workers (serving/metrics.py)

Errors, never a 500 for bad input: malformed JSON, a field of the wrong type or range (NaN and
Infinity included), text that is not valid Unicode -> 422 with a `detail` list (type, loc, msg of each
error); more than `serving.max_candidates` candidates -> 413; unknown users, items or
categories -> 200, scored with the documented defaults and named in `defaulted_features`. Load ->
503 with Retry-After and `reason` (`queue`, `tier`, `deadline`, `not_ready`; `features` when the online
store did not answer within the request's deadline). A fault of the server's own (anything else raised
while answering) -> 503 `internal`, logged with its traceback and counted in `flywheel_faults`; the
worker goes on serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import tensorflow as tf
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.process import exit_with_parent
from infra.settings import Settings
from models.recall import SOURCES
from serving import metrics
from serving.inference import Inference, NotReady, RankRequest, Shed, UnknownScenario
from serving.recommend import Recommender
from serving.supervisor import ConnectionShares, listening_socket
from streaming.history import ItemKeyFile, item_keys_path

log = logging.getLogger(__name__)


# A request context field's value: its token is logged with every prediction, so a string is bounded.
ContextValue = Annotated[str, Field(max_length=128)] | int | float | bool


class CandidateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item_id: str = Field(min_length=1, max_length=256)
    category: str = Field("", max_length=256, description="The item's category; empty -> the catalog's (an item "
                                                            "it lacks: category features defaulted).")


class RankIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str = Field(min_length=1, max_length=256)
    candidates: list[CandidateIn] = Field(min_length=1, description="Best-recalled first: under load, "
                                                                    "low-tier requests score a prefix.")
    tier: Literal["high", "normal", "low"] = Field("normal", description="Traffic value: compute allocation.")
    deadline_ms: float | None = Field(None, gt=0, allow_inf_nan=False, description="At most "
                                                                                  "serving.default_deadline_ms.")
    request_id: str | None = Field(None, min_length=1, max_length=128)
    scenario: str | None = Field(None, min_length=1, max_length=64,
                                 description="A scenario the dataset spec declares ([scenarios.<name>]): its ranker "
                                             "scores the request. Default: the platform's ranker.")
    top_k: int | None = Field(None, ge=1, description="Only the best k are shown: only they are logged (what the "
                                                      "loop learns from and the served measures judge), listed in "
                                                      "`top`. Default: every candidate is shown.")
    context: dict[str, ContextValue] | None = Field(
        None, max_length=8, description="The request's context (the page, the device): the fields the dataset spec "
                                        "declares ([events.context]), each an input of the ranker; a field it lacks: "
                                        "its declared default. An undeclared field: 422.")


class RankOut(BaseModel):
    request_id: str
    model_version: str
    route: Literal["champion", "challenger", "control", "holdout"] = Field(
        description="The alias that scored it: control is the champion before, during the new one's canary; holdout "
                    "an experiment's frozen version, for the users of its frozen arm.")
    scores: list[float | None] = Field(description="Click probability per candidate, in request order; null "
                                                   "= not scored (degraded under load).")
    defaulted: bool
    defaulted_features: list[str]
    degraded: list[str] = Field(description="`sequence` (shortened behavior sequence), `candidates`.")
    objectives: dict[str, list[float | None]] | None = Field(
        None, description="Where the dataset spec names objectives ([objectives]): each one's probability per "
                          "candidate, as `scores` (the first's); one the version does not predict is absent.")
    values: list[float | None] | None = Field(
        None, description="Where the dataset spec declares a value ([ranking] value): each candidate's, the order "
                          "to serve them in (highest first); null while the version lacks an objective it names.")
    top: list[int] | None = Field(None, description="With top_k: the indices of the candidates to show, best first "
                                                    "(by value where one is declared).")


class RecommendIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str = Field(min_length=1, max_length=256)
    k: int = Field(20, ge=1, le=100, description="Items to return.")
    exclude_seen: bool | None = Field(None, description="Leave out every item the user already clicked (or bought); "
                                                         "default: unless the dataset's items repeat "
                                                         "(its spec's [events] repeats).")
    tier: Literal["high", "normal", "low"] = "normal"
    deadline_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    request_id: str | None = Field(None, min_length=1, max_length=128)
    scenario: str | None = Field(None, min_length=1, max_length=64,
                                 description="A scenario the dataset spec declares ([scenarios.<name>]): its ranker "
                                             "scores the request. Default: the platform's ranker.")
    context: dict[str, ContextValue] | None = Field(
        None, max_length=8, description="The request's context (the page, the device): the fields the dataset spec "
                                        "declares ([events.context]), each an input of the ranker; a field it lacks: "
                                        "its declared default. An undeclared field: 422.")


class RecommendedItem(BaseModel):
    item_id: str
    score: float = Field(description="The ranker's click probability.")
    value: float | None = Field(None, description="Its declared value ([ranking] value), which orders the items; "
                                                  "null: none declared, or the version lacks an objective it names.")
    sources: list[Literal[SOURCES]]  # type: ignore[valid-type]


class RecommendOut(BaseModel):
    request_id: str
    items: list[RecommendedItem] = Field(description="Best first; fewer than k only while the platform knows "
                                                     "fewer items.")
    model_versions: dict[str, str | None] = Field(description="`ranker` and `retrieval` (null: no retrieval "
                                                              "version yet, graph and popularity only).")


class Refusal(BaseModel):
    reason: str
    detail: str


def _printable(part: object) -> object:
    return part.encode("utf-8", "backslashreplace").decode() if isinstance(part, str) else part


async def _watch_answers(recent: metrics.RecentAnswers) -> None:
    while True:
        recent.sample()
        await asyncio.sleep(recent.every_s)


def create_app(s: Settings, inference: Inference) -> FastAPI:
    recommender = Recommender(s, inference)
    # A candidate sent without its category: the catalog's, as the stream counts its events (write_item_keys).
    keys = ItemKeyFile(item_keys_path(s))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.inference = inference  # started by run_worker
        watch = asyncio.create_task(_watch_answers(metrics.RecentAnswers(s.serving.refused_window_s)))
        yield
        watch.cancel()
        recommender.close()
        app.state.inference.close()

    app = FastAPI(title="Flywheel ranking API", version="1", lifespan=lifespan,
                  description="Ranks a user's candidate items with the model in the MLflow registry's "
                              "@champion (or @challenger for the canary's users).")

    def invalid(errors: Sequence[Any]) -> JSONResponse:
        # Unlike FastAPI's own handler, no echo of the input: it may not be JSON (NaN) or UTF-8 (a lone surrogate).
        # Each error's type, location and message are enough to fix the request.
        return JSONResponse({"detail": [{"type": e["type"], "loc": [_printable(part) for part in e["loc"]],
                                         "msg": _printable(e["msg"])} for e in errors]}, status_code=422)

    def unknown_scenario(scenario: str | None) -> JSONResponse | None:
        """A 422 naming the declared scenarios, for a request naming another (before any work for it)."""
        try:
            inference.follower_of(scenario or "")
            return None
        except UnknownScenario as exc:
            metrics.REQUESTS.labels("-", "422").inc()
            return JSONResponse({"detail": [{"type": "unknown_scenario", "loc": ["body", "scenario"],
                                             "msg": _printable(str(exc))}]}, status_code=422)

    def refused_context(context: dict | None) -> JSONResponse | None:
        """A 422 naming the declared context fields, for a request with another, or the kind of a field whose value
        is not of it (before any work for it)."""
        if not context:
            return None
        if wrong := s.spec.undeclared_context(context):
            declared = ", ".join(c.name for c in s.spec.context) or "none"
            kind, name, msg = "undeclared_context", wrong[0], (f"{wrong[0]!r} is not a context field of dataset "
                                                               f"{s.spec.name} (declared: {declared})")
        elif wrong := s.spec.mistyped_context(context):
            field = wrong[0]
            kind, name, msg = "context_type", field.name, (f"{field.name!r} is a {field.kind} context field: expected "
                                                           f"a number, got {type(context[field.name]).__name__}")
        else:
            return None
        metrics.REQUESTS.labels("-", "422").inc()
        return JSONResponse({"detail": [{"type": kind, "loc": ["body", "context", _printable(name)],
                                         "msg": _printable(msg)}]}, status_code=422)

    def refuse(reason: str, detail: str, started: float) -> JSONResponse:
        metrics.REQUESTS.labels("-", "503").inc()
        metrics.LATENCY.labels(reason).observe(time.monotonic() - started)
        return JSONResponse({"reason": reason, "detail": detail}, status_code=503,
                            headers={"Retry-After": str(s.serving.retry_after_s)})

    def fault(path: str, exc: Exception, started: float) -> JSONResponse:
        """An unexpected error while answering: logged once with its traceback, counted, a 503 `internal`."""
        log.error("%s failed", path, exc_info=exc)
        metrics.FAULTS.labels(path, type(exc).__name__).inc()
        return refuse("internal", f"the request failed on the server ({type(exc).__name__}); it was logged", started)

    # The body is parsed and validated in one pass by pydantic's JSON parser (not json.loads, then a
    # Python validator per string), and text that is not valid Unicode (invalid UTF-8, a lone surrogate
    # escape) is invalid JSON there, a 422.
    @app.post("/rank", response_model=RankOut, responses={413: {"model": Refusal}, 503: {"model": Refusal}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/RankIn"}}}}})
    async def rank(request: Request):
        raw = await request.body()
        started = time.monotonic()  # the latency histogram's zero: the whole request is in (its body
        # arrives at the client's pace)
        try:
            body = RankIn.model_validate_json(raw)
        except ValidationError as exc:
            return invalid(exc.errors(include_input=False))
        if (unknown := unknown_scenario(body.scenario) or refused_context(body.context)) is not None:
            return unknown
        if len(body.candidates) > s.serving.max_candidates:
            metrics.REQUESTS.labels("-", "413").inc()
            return JSONResponse({"reason": "too_many_candidates", "detail": f"{len(body.candidates)} candidates; "
                                 f"at most {s.serving.max_candidates} per request"}, status_code=413)
        candidates = body.candidates
        if not all(c.category for c in candidates):
            candidates = [c if c.category else CandidateIn.model_construct(item_id=c.item_id,
                                                                           category=keys.get(c.item_id))
                          for c in candidates]
        req = RankRequest(body.user_id, candidates, body.tier, body.deadline_ms, top_k=body.top_k,
                          scenario=body.scenario or "", context=body.context or {})
        if body.request_id:
            req.request_id = body.request_id
        try:
            result = await request.app.state.inference.rank(req)
        except NotReady as exc:
            return refuse("not_ready", str(exc), started)
        except Shed as exc:
            return refuse(exc.reason, str(exc), started)
        except Exception as exc:  # noqa: BLE001 - a fault of ours: this request fails, the worker serves on
            return fault("/rank", exc, started)
        metrics.REQUESTS.labels(result.route, "200").inc()
        metrics.LATENCY.labels("ok").observe(time.monotonic() - started)
        return RankOut(request_id=result.request_id, model_version=result.model_version, route=result.route,
                       scores=result.scores, defaulted=bool(result.defaulted_features),
                       defaulted_features=result.defaulted_features, degraded=result.degraded,
                       objectives=result.objectives, values=result.values, top=result.top)

    @app.post("/recommend", response_model=RecommendOut, responses={503: {"model": Refusal}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/RecommendIn"}}}}})
    async def recommend(request: Request):
        raw = await request.body()
        started = time.monotonic()
        try:
            body = RecommendIn.model_validate_json(raw)
        except ValidationError as exc:
            return invalid(exc.errors(include_input=False))
        if (unknown := unknown_scenario(body.scenario) or refused_context(body.context)) is not None:
            return unknown
        try:
            exclude = not s.spec.repeats if body.exclude_seen is None else body.exclude_seen
            out = await recommender.recommend(body.user_id, body.k, exclude, body.tier, body.deadline_ms,
                                              body.request_id, body.scenario or "", body.context or {})
        except NotReady as exc:
            return refuse("not_ready", str(exc), started)
        except Shed as exc:
            return refuse(exc.reason, str(exc), started)
        except Exception as exc:  # noqa: BLE001
            return fault("/recommend", exc, started)
        metrics.REQUESTS.labels("recommend", "200").inc()
        return RecommendOut(request_id=out.request_id, model_versions=out.model_versions,
                            items=[RecommendedItem(item_id=i, score=score, sources=names, value=value)
                                   for i, score, names, value in out.items])

    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        workers = metrics.workers(s.ranker.name)
        follower = request.app.state.inference.follower
        down = sorted(pid for pid, w in workers.items() if w["prediction_log_up"] is False)
        unreachable = sorted(pid for pid, w in workers.items() if w["registry_reachable"] is False)
        problems = [f"prediction log down in worker(s) {', '.join(down)}: predictions are not reaching "
                    "Kafka"] * bool(down)
        if refusing := {pid: w["refused_share"] for pid, w in workers.items() if w["refused_share"] > 0.5}:
            problems.append(f"worker(s) {', '.join(sorted(refusing))} answered {max(refusing.values()):.0%} of "
                            f"their requests of the last {s.serving.refused_window_s:g} s with 503 (/metrics: "
                            "flywheel_shed_total and flywheel_faults_total say why)")
        why = follower.registry_error or "see the workers' logs"
        notes = [f"registry unreachable from worker(s) {', '.join(unreachable)} ({why}): serving the last known "
                 "aliases"] * bool(unreachable)
        return {"status": "degraded" if problems else "ok", "problems": problems, "notes": notes}

    @app.get("/readyz")
    async def readyz(request: Request):
        follower = request.app.state.inference.follower
        # Every worker that takes connections must be able to score them (a worker that replaces one
        # that died takes none until it can).
        waiting = [pid for pid, w in metrics.workers(s.ranker.name).items() if w["listening"] and not w["ready"]]
        if not follower.ready or waiting:
            return JSONResponse({"ready": False, "detail": "no champion loaded and warmed yet in "
                                 f"{len(waiting) or 1} worker(s)"}, status_code=503)
        return {"ready": True, "champion": follower.current("champion").version}

    @app.get("/models")
    async def models(request: Request) -> dict:
        follower = request.app.state.inference.follower
        # Snapshots first (one C-level copy each): the follower thread may change these meanwhile.
        served, warm = list(follower.served.items()), list(follower.warm.items())
        runners, refused = list(follower.runners.items()), dict(follower.refused)
        return {"model_name": follower.model.name, "worker": os.getpid(),
                "serving": {route: (m.version if m else None) for route, m in served},
                "champion_percent": follower.champion_percent, "holdout_percent": follower.holdout_percent,
                "warm": [v for v, _ in warm], "loaded_by": {v: m.loaded_by for v, m in warm}, "refused": refused,
                "compiled_shapes": {str(arch): sorted(r.compiled_shapes()) for arch, r in runners},
                "registry": {"reachable": follower.registry_reachable, "error": follower.registry_error or None,
                             "since": datetime.fromtimestamp(follower.registry_since, UTC).isoformat()},
                "scenarios": {name: {"model_name": f.model.name, "champion_percent": f.champion_percent,
                                     "holdout_percent": f.holdout_percent,
                                     "serving": {r: (m.version if m else None) for r, m in list(f.served.items())},
                                     "refused": dict(f.refused)}
                              for name, f in request.app.state.inference.followers.items() if name},
                "workers": metrics.workers(s.ranker.name)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:  # the bodies the routes parse themselves, documented as if FastAPI did
            schema = FastAPI.openapi(app)
            for model in (RankIn, RecommendIn):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schema.setdefault("components", {}).setdefault("schemas", {}).update(body.pop("$defs", {}),
                                                                                     **{model.__name__: body})
        return app.openapi_schema

    app.openapi = openapi
    return app


class Rebalance:
    """ASGI middleware: while this worker holds more than its share of the server's open connections
    (serving/supervisor.py), each response closes its connection, so the client reconnects and the
    kernel hashes the new one to a worker afresh, until the split is even. /metrics answers always close."""

    REFRESH_S = 0.5  # an idle worker's count stays current for the others

    def __init__(self, app: FastAPI, shares: ConnectionShares, slot: int) -> None:
        self.app, self.shares, self.slot = app, shares, slot
        self.connections: set = set()  # uvicorn's open connections (Server.server_state.connections)

    async def _publish(self) -> None:
        while True:
            self.shares.set(self.slot, len(self.connections))
            await asyncio.sleep(self.REFRESH_S)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            publisher = asyncio.ensure_future(self._publish())
            try:
                return await self.app(scope, receive, send)
            finally:
                publisher.cancel()
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        # A scraper's connection (Prometheus keeps one) is not traffic to balance: /metrics always closes it.
        scrape = scope.get("path") == "/metrics"

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start" and (
                    scrape or self.shares.over_share(self.slot, len(self.connections))):
                message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive, sending)


def run_worker(s: Settings, shared: Path | None = None, slot: int = 0) -> None:
    """One serving process (started by serving/supervisor.py): the app on the shared port until stopped.
    `shared`: the directory of the server whose worker `slot` this is (connection counts, aliases)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    exit_with_parent()
    # The workers share the cores: TensorFlow's threads split them too (its pools spin while idle; on
    # 2 cores and 2 workers, one thread each takes 28 % less CPU per dense call than the default, at
    # the same latency: docs/benchmark-notes.md, "Third round").
    threads = max(1, (os.cpu_count() or 1) // s.serving.workers)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    # Built before uvicorn starts, so an unreachable store or registry is one clear error.
    inference = Inference(s, shared)
    app = create_app(s, inference)
    inference.start()  # follows the registry: loads and warms the champion in the background
    if any(w["ready"] for w in metrics.workers(s.ranker.name).values()):
        # The other workers serve (this one replaces a worker that died): it takes connections only once
        # it can score them, so no client sees a 503 `not_ready` from it.
        while not inference.follower.ready:
            time.sleep(0.1)
    # The imports (TensorFlow, MLflow, Feast) leave ~0.5 M long-lived objects: out of the collector's
    # sight, a full collection no longer stalls every thread on the GIL for ~0.3 s (the p99 under load).
    gc.collect()
    gc.freeze()
    # A loaded model adds long-lived objects (its traced functions) that cannot be frozen: an evicted
    # version's cycles must stay collectable. With the default thresholds, the objects in flight
    # under load set off a full collection of them about once a second per worker, each 10-140 ms
    # on the GIL (and finding nothing): the tail of shed and scored requests alike. Rarer young
    # collections make full ones rare (about one in 10 M allocations).
    gc.set_threshold(10_000, 10, 100)
    # Keep-alive longer than a load balancer's idle timeout (60 s is common), so the balancer, not the
    # server, closes idle connections: otherwise a request can race the server's close.
    served = Rebalance(app, ConnectionShares(shared, s.serving.workers), slot) if shared is not None else app
    config = uvicorn.Config(served, log_level="warning", access_log=False, timeout_keep_alive=75)
    server = uvicorn.Server(config)
    if isinstance(served, Rebalance):
        served.connections = server.server_state.connections
    metrics.WORKER_LISTENING.set(1)
    server.run(sockets=[listening_socket(s.serving.host, s.serving.port)])


if __name__ == "__main__":  # a worker of the ranking server: python -m serving.api [SHARED-DIR SLOT]
    from infra.settings import get_settings

    run_worker(get_settings(), *((Path(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else ()))
