"""The live load: the history's sessions after the split (streaming/live.py) as ranking requests
(every `recommend_every`th a recommendation request for the session's user instead), and what the users
do with the lists they are served (exposures in rank order, their actions on what they are shown) into
Kafka."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator

from feature_repo.store import feature_store
from flywheel.demo.plan import LoopPlan
from flywheel.demo.probes import FreshnessProbes
from streaming.live import Live, Session
from infra.settings import Settings
from serving.client import Served, endpoint, open_loop
from streaming.producer import EventProducer


class Traffic:
    """Sessions -> /rank -> shown items -> exposures and actions into Kafka, on a thread of its own;
    probes of feature freshness on the way."""

    def __init__(self, s: Settings, plan: LoopPlan, server: str) -> None:
        self.live = Live(s, plan.split)
        self.sessions = self.live.sessions[: plan.sessions]
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
                self._by_id[request_id] = self.live.judged[sess.user_id]
                yield {"user_id": sess.user_id, "request_id": request_id, "k": 20, "tier": "high"}
                continue
            self._by_id[request_id] = sess
            keys = self.live.keys
            yield {"user_id": sess.user_id, "request_id": request_id, "tier": "high",
                   "candidates": [{"item_id": i, "category": keys.get(i, "")} for i in sess.candidates]}

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
        events = self.live.served_events(sess, request_id, shown, int(time.time() * 1000), ranker_version(body))
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
