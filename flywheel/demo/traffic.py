"""The live load: MovieLens sessions after the split as ranking requests (every `recommend_every`th a
recommendation request for the session's user instead), and what the users do with the lists they are
served (impressions in rank order, clicks on what they rated highly) into Kafka. A recommended item is
clicked when the user rated it highly at any time after the split: what they would have liked."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator

from feature_repo.store import feature_store
from flywheel.demo.plan import LoopPlan
from flywheel.demo.probes import FreshnessProbes
from infra.settings import Settings
from serving.client import Served, endpoint, open_loop
from streaming.movielens import Session, dataset_dir, load_item_categories, load_ratings, served_events, sessions
from streaming.producer import EventProducer


class Traffic:
    """Sessions -> /rank -> shown items -> impressions and clicks into Kafka, on a thread of its own;
    probes of feature freshness on the way."""

    def __init__(self, s: Settings, plan: LoopPlan, server: str) -> None:
        data = dataset_dir(s)
        split = int(plan.split.timestamp())
        live = [r for r in load_ratings(data / "ml-100k.inter") if r.timestamp >= split]
        self.sessions = sessions(live)[: plan.sessions]
        by_user = defaultdict(list)
        for r in live:
            by_user[r.user_id].append(r)
        self.futures = {u: Session(u, split, tuple(ratings)) for u, ratings in by_user.items()}  # all they rate later
        self.categories = load_item_categories(data / "ml-100k.item")
        self.s, self.plan, self.server = s, plan, server
        self.producer = EventProducer(s)
        self.probes = FreshnessProbes(feature_store(s))
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.results: list[Served] = []  # in answer order
        self.events: Counter = Counter()
        self._by_id: dict[str, Session] = {}  # request id -> session, while in flight
        self.thread = threading.Thread(target=self._run, name="live-traffic")

    def requests(self) -> Iterator[dict]:
        """The sessions in order, then again from the first (new request ids) until stopped: the drills
        and the tail after them need traffic however long training took."""
        every = self.plan.recommend_every
        for n, sess in enumerate(itertools.cycle(self.sessions), 1):
            request_id = sess.request_id(int(time.time() * 1000))
            if every and n % every == 0:
                self._by_id[request_id] = self.futures[sess.user_id]
                yield {"user_id": sess.user_id, "request_id": request_id, "k": 20, "tier": "high"}
                continue
            items = list(dict.fromkeys(r.item_id for r in sess.ratings))
            self._by_id[request_id] = sess
            yield {"user_id": sess.user_id, "request_id": request_id, "tier": "high",
                   "candidates": [{"item_id": i, "category": self.categories.get(i, "")} for i in items]}

    def _run(self) -> None:
        try:
            asyncio.run(open_loop(self.server, self.requests(), self.plan.rate, after=self._after,
                                  stop=self.stop.is_set))
            self.producer.flush()
        except Exception as exc:  # noqa: BLE001 - handed to the controller, which stops the loop with it
            self.error = exc
        finally:
            self.probes.close()

    async def _after(self, served: Served) -> None:
        try:
            await self._show(served)
        except Exception as exc:  # noqa: BLE001 - handed to the controller at once, which stops the loop with it
            self.error = exc
            self.stop.set()

    async def _show(self, served: Served) -> None:
        self.results.append(served)
        request_id = served.request["request_id"]
        sess = self._by_id.pop(request_id)
        if served.status != 200:
            return  # nothing was shown
        body = served.body
        if endpoint(served.request) == "/recommend":
            shown = [x["item_id"] for x in body["items"]]
        else:
            shown = [item for _, item in sorted(((-score, item) for item, score in zip(
                (c["item_id"] for c in served.request["candidates"]), body["scores"]) if score is not None))]
        probe = self.probes.claim(sess.user_id)
        if probe:
            before = await asyncio.get_running_loop().run_in_executor(self.probes.pool, self.probes.total,
                                                                      sess.user_id)
        events = served_events(sess, request_id, shown, int(time.time() * 1000), self.s.movielens.click_min_rating,
                               self.categories, ranker_version(body))
        for event in events:
            self.producer.send(event)
            self.events[event.event_type] += 1
        self.probes.sent(sess.user_id)
        if probe:
            self.probes.start(sess.user_id, before + len(shown))

    def served_versions(self) -> set[str]:
        return {ranker_version(r.body) for r in self.results[-50:] if r.status == 200 and ranker_version(r.body)}


def ranker_version(body: dict) -> str:
    """The ranker version that scored an answer of /rank or /recommend ("" when nothing was ranked)."""
    return str(body["model_version"] if "model_version" in body else body["model_versions"]["ranker"] or "")
