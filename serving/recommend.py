"""Recommendation: what should this user see, from the whole catalogue.

    candidates  two-tower: the items nearest the user's near-line embedding in the retrieval version's
                ANN index (one VSIM); graph: item neighbours (the behavior graph's `item_neighbours`
                feature) of the user's newest positives; popularity: the live positives, decayed by their
                age (models/recall.py), the fallback that answers a user nobody knows anything of; repeat
                (a spec whose items repeat): the user's own positives, decayed alike
    merge       weighted reciprocal-rank fusion (`retrieval.source_weights`) of each source's top
                `retrieval.per_source` (models/recall.py),
                de-duplicated, the user's own positives left out (`exclude_seen`: by default unless the
                spec says items repeat), at most
                `retrieval.candidates`
    rank        the ranking path of `POST /rank` (features, batching, the @champion ranker, shedding),
                the best k served and logged to the prediction log with their sources

Everything read here was computed before the request (serving/nearline.py): four round trips to Redis,
each of a size that does not depend on the length of the user's history.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis

from feature_repo.definitions import ITEM_NEIGHBOURS
from feature_repo.online import OnlineReader
from infra.settings import Settings
from models.recall import merge, neighbours_of, source_weights
from serving.inference import Inference, RankRequest, Shed, new_request_id
from serving.nearline import Keys, redis_client

NEIGHBOURS = [(ITEM_NEIGHBOURS.name, "neighbour_ids"), (ITEM_NEIGHBOURS.name, "neighbour_scores")]


@dataclass(frozen=True)
class Item:
    item_id: str
    category: str


@dataclass(frozen=True)
class Retrieved:
    items: list[Item]  # merged, best fused first
    sources: list[list[str]]  # per item: the sources that listed it
    version: str | None  # the retrieval version whose index and user embedding were used


@dataclass
class Recommended:
    request_id: str
    # (item, ranker score, sources, declared value or None), best first: by value where the spec declares one
    items: list[tuple[str, float, list[str], float | None]]
    model_versions: dict[str, str | None]


class Recommender:
    def __init__(self, s: Settings, inference: Inference) -> None:
        self.s, self.inference, self.keys = s, inference, Keys(s.retrieval.key_prefix)
        self.weights = source_weights(s.retrieval.source_weights)
        self.repeats = s.spec.repeats  # whether the repeat source lists anything
        timeout = s.serving.default_deadline_ms / 1000
        self.redis = redis_client(s, timeout)
        self.neighbours = OnlineReader(s, timeout)
        self._current: tuple[str, dict[str, str]] | None = None  # the retrieval version seen last, its categories
        self._readers = ThreadPoolExecutor(s.serving.fetch_threads, thread_name_prefix="retrieve")

    def retrieve(self, user_id: str, exclude_seen: bool) -> Retrieved:
        """The merged candidates of the sources (blocking: Redis)."""
        r, k = self.s.retrieval, self.keys
        seen = self._current  # one read: another thread may replace it meanwhile
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(k.current).hget(k.recent, user_id)
        if seen is not None:
            pipe.hget(k.users(seen[0]), user_id)
        current, recent, *vector = pipe.execute()
        current, vector = (current.decode() if current else None), (vector[0] if vector else None)
        if current is not None and (seen is None or seen[0] != current):  # another version is current now
            vector = self.redis.hget(k.users(current), user_id)
            seen = self._current = (current, {i.decode(): c.decode() for i, c in
                                              self.redis.hgetall(k.categories(current)).items()})
        recent = json.loads(recent) if recent else []
        n = 2 * r.per_source  # room for the user's own positives, left out below
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrevrange(k.popular, 0, n - 1)
        if self.repeats:  # the near-line tier keeps a user's own positives only where items repeat
            pipe.zrevrange(k.repeated(user_id), 0, n - 1)
        if current and vector:
            pipe.execute_command("VSIM", k.items(current), "FP32", vector, "COUNT", n)
        popular, *answers = pipe.execute()
        repeated = answers.pop(0) if self.repeats else []
        nearest = answers
        seeds = list(dict.fromkeys(reversed(recent)))[: r.graph_seeds]  # newest first, each once
        rows = self.neighbours.read(("item_id",), [(i,) for i in seeds], NEIGHBOURS) if seeds else []
        graph = {i: list(zip(ids or [], scores or [])) for i, (ids, scores) in zip(seeds, rows)}
        found = {"two-tower": [i.decode() for i in nearest[0]] if nearest else [],
                 "graph": neighbours_of(seeds, graph, n),
                 "popularity": [i.decode() for i in popular], "repeat": [i.decode() for i in repeated]}
        # Only the candidates are looked up in the user's clicked set: the cost does not grow with history.
        listed = list(dict.fromkeys(i for items in found.values() for i in items))
        exclude = set()
        if exclude_seen and listed:
            exclude = {i for i, hit in zip(listed, self.redis.smismember(k.clicked(user_id), listed)) if hit}
        sources = {name: [i for i in items if i not in exclude][: r.per_source] for name, items in found.items()}
        merged = merge(sources, r.candidates, self.weights)
        categories = seen[1] if seen is not None and current is not None else {}
        return Retrieved([Item(i, categories.get(i, "")) for i, _, _ in merged], [names for _, _, names in merged],
                         current)

    async def recommend(self, user_id: str, k: int, exclude_seen: bool, tier: str, deadline_ms: float | None,
                        request_id: str | None, scenario: str = "", context: Mapping[str, object] | None = None
                        ) -> Recommended:
        """The best `k` of the merged candidates, ranked by `scenario`'s ranker ("": the platform's) in the request's
        `context`. Raises what `Inference.rank` raises (NotReady, Shed, UnknownScenario); Shed("features") when
        Redis does not answer."""
        try:
            retrieved = await asyncio.get_running_loop().run_in_executor(self._readers, self.retrieve, user_id,
                                                                         exclude_seen)
        except redis.RedisError as exc:
            raise Shed("features", f"candidates not read from the online store ({type(exc).__name__})") from None
        versions = {"retrieval": retrieved.version, "ranker": None}
        if not retrieved.items:  # nothing is known yet (an empty stack): an empty list, not an error
            return Recommended(request_id or new_request_id(), [], versions)
        req = RankRequest(user_id, retrieved.items, tier, deadline_ms, top_k=k, sources=retrieved.sources,
                          scenario=scenario, context=context or {})
        if request_id:
            req.request_id = request_id
        result = await self.inference.rank(req)
        versions["ranker"] = result.model_version
        items = [(retrieved.items[i].item_id, result.scores[i], retrieved.sources[i],
                  None if result.values is None else result.values[i]) for i in result.top or []]
        return Recommended(result.request_id, items, versions)

    def close(self) -> None:
        self._readers.shutdown(wait=True)
