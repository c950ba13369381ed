"""The near-line retrieval tier: the user embedder (a stack service) keeps in Redis what `POST /recommend`
reads, so a request computes nothing that depends on history length.

It consumes the stream job's behavior-sequence updates (`features.user_sequence`: a user's last positive
actions, one row per action) and, per user who acted, stores their recent positives, adds the newest
to their clicked set and the live popularity, and recomputes their user-tower embedding with the
retrieval @champion, all within one poll of the action reaching the topic. It follows the retrieval
model's @champion: a new version gets its ANN index of item embeddings (a Redis vector set, cosine)
and every known user's embedding under keys of its own, and only then becomes `current`, so a
request never pairs a user vector of one version with the index of another. Each item's vector
carries its popularity prior (models/recall.py `PopularityPrior`, `IndexFrame`): one VSIM returns the
items by cos(u, i) / T + the prior. An item acted on gets its vector again once its prior moved by
`retrieval.prior_step`, at most `REPRICE_BUDGET` items per poll (the largest moves first; the rest in the
next polls), so a burst of behavior costs Redis a bounded share (a vector set update is ~0.25 ms of
Redis time: HNSW re-links the element); when a prior rises past the frame's headroom (16-fold), every
item's vector is drawn again.
The previous version's keys stay until the next switch (a rollback has them); older ones are deleted.
Offsets are committed after the writes (at-least-once): a batch replayed after a crash rewrites the same
recent lists and sets, and counts its actions in the live popularity twice.

Keys (prefix `retrieval.key_prefix`):
    {p}:current          the version /recommend uses
    {p}:v{V}:items       vector set: item id -> item-tower embedding of version V with its prior
    {p}:v{V}:users       hash: user id -> user-tower embedding (float32 bytes, as a query) of version V
    {p}:v{V}:categories  hash: item id -> its category (the ranker's user x category features)
    {p}:recent           hash: user id -> JSON list of their recent positive items, newest last
    {p}:clicked:{user}   set: every item the user acted on positively (not recommended again, unless
                         the spec says items repeat)
    {p}:repeated:{user}  sorted set (a spec whose items repeat): the user's own items as `popular:decayed`
                         holds everyone's, the heaviest `retrieval.repeat_items` kept: the repeat source
    {p}:popular:decayed  sorted set: per item, log2 of its positive actions' decayed weights' sum
                         (models/recall.py `recently_popular`: the popularity source follows time)

Why a vector set and not an index in each server process: every server worker and replica shares the
one index, the embedder refreshes it once per promotion, and a query is one round trip that the
request makes anyway (docs/benchmarks.md compares it with exact search in process).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from confluent_kafka import Consumer, KafkaException

from infra.progress import ProgressReport
from infra.redis_clients import OnlineClient, online_store
from infra.settings import Settings, get_settings
from models.recall import IndexFrame, PopularityPrior, query_vectors
from models.registry import CHAMPION
from serving.aliases import AliasFollower
from streaming.consumer import commit_written
from streaming.features import row_schema, topics

log = logging.getLogger("flywheel.user-embedder")
GROUP = "flywheel-user-embedder"
SEQUENCE_TOPIC = "features.user_sequence"
BATCH = 1024  # users embedded per model call when a version is switched in
REPRICE_BUDGET = 256  # index vectors rewritten per poll at most, for a moved prior (~65 ms of Redis time)
# Index vectors per pipeline: Redis serves a client's pipeline 16 KB at a time (~85 VADDs, ~25 ms) before
# another client's command, so a /recommend round trip behind a long rewrite would wait that long.
WRITE_CHUNK = 16
_decode_row = msgspec.json.Decoder(list).decode
# An action in the decayed popularity: score <- log2_add(score, t / half-life) (models/recall.py), one key,
# so it also runs on a Redis Cluster.
_ADD_DECAYED = """
local w = tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score then
  local s = tonumber(score)
  local hi, lo = math.max(s, w), math.min(s, w)
  w = hi + math.log(1 + 2 ^ (lo - hi)) / math.log(2)
end
redis.call('ZADD', KEYS[1], w, ARGV[1])
"""


def count_popular(pipe, key: str, acted: Sequence[tuple[str, float]], half_life_s: float) -> None:
    """Queue on `pipe` each (item, time s) positive action into the decayed popularity at `key`. A time in
    the future counts as now: a skewed clock must not rank its item first for good."""
    now = time.time()
    for item, t in acted:
        # EVAL as a plain command: a Redis Cluster pipeline routes it by its key (it has no `eval` method)
        pipe.execute_command("EVAL", _ADD_DECAYED, 1, key, item, repr(min(t, now) / half_life_s))


class Keys:
    """The near-line keys of one deployment (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.current, self.recent = f"{prefix}:current", f"{prefix}:recent"
        self.popular = f"{prefix}:popular:decayed"  # not `:popular`, which held plain counts before

    def items(self, version: str) -> str:
        return f"{self.prefix}:v{version}:items"

    def users(self, version: str) -> str:
        return f"{self.prefix}:v{version}:users"

    def categories(self, version: str) -> str:
        return f"{self.prefix}:v{version}:categories"

    def clicked(self, user_id: str) -> str:
        return f"{self.prefix}:clicked:{user_id}"

    def repeated(self, user_id: str) -> str:
        """The user's own positives, decayed (`[events] repeats` only): the repeat source."""
        return f"{self.prefix}:repeated:{user_id}"


def redis_client(s: Settings, timeout_s: float | None = None) -> OnlineClient:
    return online_store(s, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class ItemIndex:
    """One version's ANN index: its items' vectors with their popularity priors (models/recall.py
    `IndexFrame`), kept current as the live popularity moves."""

    def __init__(self, r: OnlineClient, keys: Keys, prior: PopularityPrior, version: str, item_ids: Sequence[str],
                 vectors: np.ndarray, temperature: float, step: float) -> None:
        self.redis, self.keys, self.prior, self.version, self.step = r, keys, prior, version, step
        self.item_ids, self.vectors = list(item_ids), vectors
        self.rows = {i: n for n, i in enumerate(self.item_ids)}
        at = time.time()
        self.written = self._priors(self.item_ids, at)  # each item's prior as its index vector holds it
        self.frame = IndexFrame.around(self.written, temperature, at, prior.headroom)
        self.pending: set[str] = set()  # acted items not rewritten yet (over the budget)

    def _priors(self, items: Sequence[str], at: float) -> np.ndarray:
        """The items' popularity priors at time `at`, from the live decayed popularity."""
        scores = self.redis.zmscore(self.keys.popular, items) if items else []
        return self.prior.values({i: x for i, x in zip(items, scores) if x is not None}, items, at)

    def write(self, items: Sequence[str] | None = None) -> None:
        """Write the index vectors of `items` (all: None) with their priors as last read, WRITE_CHUNK a round
        trip."""
        items = self.item_ids if items is None else items
        rows = [self.rows[i] for i in items]
        vectors = self.frame.index_vectors(self.vectors[rows], self.written[rows])
        for start in range(0, len(items), WRITE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for item, vector in zip(items[start:start + WRITE_CHUNK], vectors[start:start + WRITE_CHUNK]):
                pipe.execute_command("VADD", self.keys.items(self.version), "FP32", vector.tobytes(), item, "NOQUANT")
            pipe.execute()

    def reprice(self, acted: set[str]) -> None:
        """Rewrite the vectors of the acted items whose prior moved by `step` (at most REPRICE_BUDGET, the
        largest moves first; the others wait for the next call); every item's, in a frame drawn around the
        priors now, when one rose past the frame. Not atomic: a request meanwhile may find some items in the
        old frame, a slightly different order of its candidates."""
        self.pending |= {i for i in acted if i in self.rows}
        if not self.pending:
            return
        items = list(self.pending)
        rows = np.array([self.rows[i] for i in items])
        priors = self._priors(items, self.frame.at)
        if not self.frame.holds(priors):
            at = time.time()
            self.written = self._priors(self.item_ids, at)
            self.frame = IndexFrame.around(self.written, self.frame.temperature, at, self.prior.headroom)
            self.pending.clear()
            log.info("retrieval v%s: a popularity prior outgrew the index's frame; every item redrawn", self.version)
            items = self.item_ids
        else:
            moved = np.abs(priors - self.written[rows])
            order = [k for k in np.argsort(-moved, kind="stable")[:REPRICE_BUDGET] if moved[k] >= self.step]
            self.pending -= {items[k] for k in np.flatnonzero(moved < self.step)}
            self.written[rows[order]] = priors[order]
            items = [items[k] for k in order]
            self.pending -= set(items)
        self.write(items)


@dataclass(frozen=True)
class Indexed:
    """A retrieval version made current: its two-tower model and its item index."""

    version: str
    model: Any  # models.retrieval.TwoTower (TensorFlow loads with the first version, not with this module)
    index: ItemIndex


class RetrievalFollower(AliasFollower[Indexed]):
    """The retrieval model's @champion, made current by `switch` when it moves (serving/aliases.py: a version
    that cannot be switched in is refused and the current one stays)."""

    def __init__(self, s: Settings, switch: Callable[[str], Indexed]) -> None:
        super().__init__(s, s.retriever, (CHAMPION,), s.retrieval.poll_interval_s)
        self._switch = switch

    def obtain(self, version: str) -> Indexed:
        return self._switch(version)


class Embedder:
    def __init__(self, s: Settings, max_records: int = 10_000) -> None:
        self.s, self.max_records = s, max_records
        self.keys = Keys(s.retrieval.key_prefix)
        self.redis = redis_client(s)
        self.follower = RetrievalFollower(s, self.switch)
        self.fields = tuple(name for name, _ in row_schema(topics()[SEQUENCE_TOPIC]))
        self.consumer = Consumer(s.kafka.stream_consumer(GROUP))
        self.consumer.subscribe([SEQUENCE_TOPIC])
        self._followed_at = 0.0

    # --- following the retrieval @champion ------------------------------------------------------

    @property
    def current(self) -> Indexed | None:
        return self.follower.current(CHAMPION)

    def follow(self) -> None:
        """Switch to the retrieval @champion if it moved (at most every `retrieval.poll_interval_s`)."""
        if time.monotonic() - self._followed_at < self.s.retrieval.poll_interval_s:
            return
        self._followed_at = time.monotonic()
        try:
            self.follower.poll_once()
            self.follower.registry_state(None)
        except Exception as exc:  # noqa: BLE001 - the registry away: keep serving the version we have
            self.follower.registry_state(f"{type(exc).__name__}: {exc}")

    def switch(self, version: str) -> Indexed:
        """Index version `version`, embed every known user with it, then make it current."""
        # TensorFlow loads here, not with the module: readers of the keys (the demo's probe) never need it.
        from models.retrieval_train import load_retrieval

        started = time.perf_counter()
        model = load_retrieval(self.s, version)
        k, vectors = self.keys, model.item_embeddings()
        pipe = self.redis.pipeline(transaction=False)
        for key in (k.items(version), k.users(version), k.categories(version)):  # keys of three slots
            pipe.delete(key)
        categories = {i: c for i, c in zip(model.catalogue.item_ids, model.catalogue.categories) if c}
        if categories:
            pipe.hset(k.categories(version), mapping=categories)
        pipe.execute()
        index = ItemIndex(self.redis, self.keys, PopularityPrior.of(self.s.retrieval), version,
                          model.catalogue.item_ids, vectors, model.temperature, self.s.retrieval.prior_step)
        index.write()
        recent = {u.decode(): json.loads(v) for u, v in self.redis.hgetall(k.recent).items()}
        users = list(recent)
        for b in range(0, len(users), BATCH):
            self._embed(model, version, {u: recent[u] for u in users[b:b + BATCH]})
        previous = self.redis.get(k.current)
        self.redis.set(k.current, version)
        self._drop_older(keep={version, previous.decode() if previous else version})
        log.info("retrieval v%s current: %d items indexed, %d users embedded in %.1fs", version, len(vectors),
                 len(users), time.perf_counter() - started)
        return Indexed(version, model, index)

    def _drop_older(self, keep: set[str]) -> None:
        for key in self.redis.scan_iter(f"{self.keys.prefix}:v*"):
            if key.decode().split(":")[-2][1:] not in keep:
                self.redis.delete(key)

    def _embed(self, model, version: str, recent: dict[str, list[str]]) -> None:
        users = list(recent)
        vectors = query_vectors(model.user_embeddings(users, [recent[u] for u in users]))
        self.redis.hset(self.keys.users(version), mapping={u: v.tobytes() for u, v in zip(users, vectors)})

    # --- behavior updates -----------------------------------------------------------------------

    def run_once(self) -> int:
        """One poll: the users who acted, stored and re-embedded; offsets committed after. Returns users."""
        first = self.consumer.poll(0.1)
        polled = [] if first is None else [first, *self.consumer.consume(self.max_records - 1, 0)]
        newest: dict[str, list[str]] = {}  # user -> recent positives, from their newest row in the batch
        # (user, item, time s) of each row's own action; a row without its times is not counted popular
        acted: list[tuple[str, str, float | None]] = []
        for record in polled:
            if record.error():
                if record.error().fatal():
                    raise KafkaException(record.error())
                continue
            try:
                row = dict(zip(self.fields, _decode_row(record.value())))
                user, items = row["user_id"], [str(i) for i in row["seq_item_ids"] or []]
                times = row["seq_event_times"] or []
                t = times[-1] / 1000 if items and len(times) == len(items) else None  # the newest action's (stored in ms)
            except (TypeError, KeyError, msgspec.DecodeError):  # a tombstone or not a row of this view
                continue
            if items:
                newest[user] = items[-self.s.retrieval.sequence_length:]
                acted.append((user, items[-1], t))
        if newest:
            self.store(newest, acted)
        if polled:
            commit_written(self.consumer)
        return len(newest)

    def store(self, recent: dict[str, list[str]], acted: Sequence[tuple[str, str, float | None]]) -> None:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(k.recent, mapping={u: json.dumps(items) for u, items in recent.items()})
        for user, item, _ in acted:
            pipe.sadd(k.clicked(user), item)
        r = self.s.retrieval
        count_popular(pipe, k.popular, [(item, t) for _, item, t in acted if t is not None],
                      r.popularity_half_life_days * 86_400)
        if self.s.spec.repeats:  # each user's own, the heaviest `repeat_items` kept
            for user, item, t in acted:
                if t is not None:
                    count_popular(pipe, k.repeated(user), [(item, t)], r.repeat_half_life_days * 86_400)
                    pipe.zremrangebyrank(k.repeated(user), 0, -r.repeat_items - 1)
        pipe.execute()
        if (current := self.current) is not None:
            self._embed(current.model, current.version, recent)
            current.index.reprice({item for _, item, t in acted if t is not None})

    def close(self) -> None:
        self.consumer.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    embedder = Embedder(s)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    progress = ProgressReport(s, "user-embedder", GROUP, [SEQUENCE_TOPIC])
    try:
        while not stopping:
            embedder.follow()
            progress.beat(wrote=embedder.run_once() > 0)
    finally:
        embedder.close()


if __name__ == "__main__":
    main()
