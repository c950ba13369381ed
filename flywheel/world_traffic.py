"""The world's users as live traffic on a running stack (streaming/world.py holds the world): each request a user of
the world; /rank over the world's candidates for a recall that knows nothing of the user, showing the best
`[traffic] shown` (every 1/`recommend_share`-th a /recommend of that many instead); the list shown in the order
served; the user's clicks and purchases drawn by the world from the items and the positions they were shown at, at
the world's time; and every exposure, click and purchase sent to Kafka with the request id, the position and the
item's category, as any client of the platform would (docs/world.md: the protocol).

World time is the seconds since the traffic started (plus `at_s`, where it starts): the world's scheduled changes
happen then.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np

from flywheel.demo.traffic import ranker_version
from infra.settings import Settings
from serving.client import Served, endpoint, open_loop
from streaming.events import Event
from streaming.producer import EventProducer
from streaming.world import CLICK, IMPRESSION, PURCHASE, World


class WorldTraffic:
    """Requests at the world's rate (or `rate`) until stopped, on a thread of its own; `results` every answer,
    `events` what was sent by type, `error` what stopped it."""

    def __init__(self, s: Settings, world: World, server: str, seed: int = 0, rate: float | None = None,
                 at_s: float = 0.0) -> None:
        self.s, self.world, self.server = s, world, server
        self.rate = rate or world.spec.traffic.rate
        self.draws = np.random.default_rng([world.spec.truth.seed, 4, seed])  # who asks, and their candidates
        self.reactions = np.random.default_rng([world.spec.truth.seed, 5, seed])  # what they do with a list
        self.users, self.items = world.user_ids, world.item_ids
        self.user_number = {user: n for n, user in enumerate(self.users)}
        self.number = {item: n for n, item in enumerate(self.items)}
        self.categories = world.items_table()["category"].to_numpy()
        self.producer: EventProducer | None = None  # connected when the traffic starts
        self.started = time.time() - at_s  # world time 0
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.results: list[Served] = []
        self.events: Counter = Counter()
        self.thread = threading.Thread(target=self._run, name="world-traffic")

    def now_s(self) -> float:
        return time.time() - self.started

    def requests(self) -> Iterator[dict]:
        tr = self.world.spec.traffic
        for n in itertools.count(1):
            user = self.users[int(self.draws.integers(len(self.users)))]
            request_id = f"world:{user}:{n}@{int(time.time() * 1000)}"
            if int(n * tr.recommend_share) > int((n - 1) * tr.recommend_share):  # that share, evenly spread
                yield {"user_id": user, "request_id": request_id, "k": tr.shown, "tier": "high"}
                continue
            items = self.world.candidates(self.draws, self.now_s())
            yield {"user_id": user, "request_id": request_id, "tier": "high", "top_k": tr.shown,
                   "candidates": [{"item_id": self.items[i], "category": self.categories[i]} for i in items]}

    def _run(self) -> None:
        try:
            self.producer = EventProducer(self.s)
            asyncio.run(open_loop(self.server, self.requests(), self.rate, after=self._after, stop=self.stop.is_set))
            self.producer.flush()
        except Exception as exc:  # noqa: BLE001 - handed to whoever runs the traffic
            self.error = exc

    async def _after(self, served: Served) -> None:
        self.results.append(served)
        if served.status != 200:
            return  # nothing was shown
        try:
            for event in self.shown_events(served, self.now_s(), int(time.time() * 1000)):
                self.producer.send(event)
                self.events[event.event_type] += 1
        except Exception as exc:  # noqa: BLE001 - stops the traffic with its cause
            self.error = exc
            self.stop.set()

    def shown(self, served: Served) -> list[str]:
        """The items the answer shows, in the order served."""
        if endpoint(served.request) == "/recommend":
            return [x["item_id"] for x in served.body["items"]]
        return [served.request["candidates"][i]["item_id"] for i in served.body["top"]]

    def shown_events(self, served: Served, t_s: float, t_ms: int) -> list[Event]:
        """An exposure of each item shown (its position in the list) at `t_ms`, then the user's clicks and purchases
        a millisecond apart, as the history's follow their lists."""
        shown = self.shown(served)
        user, request_id = served.request["user_id"], served.request["request_id"]
        numbers = np.array([self.number[i] for i in shown], dtype=int)
        clicked, bought = self.world.react(self.user_number[user], numbers, t_s, self.reactions)
        served_by, key = ranker_version(served.body), self.s.spec.key
        out = []
        for after_ms, (kind, flags) in enumerate(((IMPRESSION, np.ones(len(shown), bool)), (CLICK, clicked),
                                                  (PURCHASE, bought))):
            for position in np.flatnonzero(flags):
                item = shown[position]
                out.append(Event(event_id=f"{request_id}:{item}:{kind}", user_id=user, item_id=item, event_type=kind,
                                 request_id=request_id, event_time=t_ms + after_ms,
                                 context={key: self.categories[self.number[item]], "position": int(position),
                                          "served_by": served_by}))
        return out
