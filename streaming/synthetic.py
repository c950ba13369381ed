"""A synthetic event stream with a click signal a model can learn, for load tests at any rate.

Items have a Zipf popularity and a category; each user belongs to an interest cluster that prefers
some categories. A request shows `slate_size` items drawn by popularity; each impression is clicked
with probability sigmoid(base_logit + affinity_weight * affinity(user, item)), where affinity is
+1 for a preferred category and -1 otherwise, so user x item-category interactions predict clicks.
Clicked items are purchased with probability `purchase_rate`.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from infra.dataset import SCENARIO_FIELD
from streaming.events import TEST_TRAFFIC, Event, dataset_spec

SOURCE = "synthetic"


@dataclass(frozen=True)
class SyntheticConfig:
    users: int = 10_000
    items: int = 5_000
    categories: int = 20
    clusters: int = 8
    preferred_per_cluster: int = 3
    zipf_exponent: float = 1.1
    slate_size: int = 5
    base_logit: float = -2.5  # CTR of a non-preferred item ~ sigmoid(-3.5) = 3 %
    affinity_weight: float = 1.0  # preferred ~ sigmoid(-1.5) = 18 %
    purchase_rate: float = 0.1
    seed: int = 7
    # Marked as test traffic (context `test_traffic`): load tests, which training must not learn from.
    # False: a world for a model to learn, as the tests and benchmarks of training use it.
    test_traffic: bool = True
    # The scenarios (surfaces) requests are served on, in turn (context `scenario`); none: no scenario named.
    scenarios: tuple[str, ...] = ()


class SyntheticGenerator:
    def __init__(self, config: SyntheticConfig = SyntheticConfig()):
        self.config = c = config
        self.rng = random.Random(c.seed)
        self.item_category = [self.rng.randrange(c.categories) for _ in range(c.items)]
        self.user_cluster = [self.rng.randrange(c.clusters) for _ in range(c.users)]
        self.cluster_prefs = [frozenset(self.rng.sample(range(c.categories), c.preferred_per_cluster))
                              for _ in range(c.clusters)]
        weights = [1.0 / (rank + 1) ** c.zipf_exponent for rank in range(c.items)]
        self._cum_weights = list(itertools.accumulate(weights))
        # Content is reproducible per seed; ids are unique per run, so a second run is new traffic.
        self._run = uuid.uuid4().hex[:12]
        self._counter = itertools.count()

    def affinity(self, user: int, item: int) -> float:
        preferred = self.item_category[item] in self.cluster_prefs[self.user_cluster[user]]
        return 1.0 if preferred else -1.0

    def click_probability(self, user: int, item: int) -> float:
        c = self.config
        return 1.0 / (1.0 + math.exp(-(c.base_logit + c.affinity_weight * self.affinity(user, item))))

    def _new_id(self) -> str:
        return f"{SOURCE}:{self._run}:{next(self._counter)}"

    def events(self, now_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> Iterator[Event]:
        """An endless stream: per request, the slate's impressions then their clicks and purchases."""
        c, rng, spec = self.config, self.rng, dataset_spec()
        # The spec's first exposure, its first label, and its strongest positive as the purchase.
        exposure, click, purchase = spec.exposures[0], spec.labels[0], spec.positives[-1]
        for n in itertools.count():
            user = rng.randrange(c.users)
            request_id = self._new_id()
            slate = rng.choices(range(c.items), cum_weights=self._cum_weights, k=c.slate_size)
            t = now_ms()
            follow_ups: list[Event] = []
            surface = {SCENARIO_FIELD: c.scenarios[n % len(c.scenarios)]} if c.scenarios else {}
            for position, item in enumerate(slate):
                ctx = {"source": SOURCE, "position": position, spec.key: str(self.item_category[item])} | \
                    ({TEST_TRAFFIC: True} if c.test_traffic else {}) | surface
                yield self._event(user, item, exposure, request_id, t, ctx)
                if rng.random() < self.click_probability(user, item):
                    follow_ups.append(self._event(user, item, click, request_id, t, ctx))
                    if rng.random() < c.purchase_rate:
                        follow_ups.append(self._event(user, item, purchase, request_id, t, ctx))
            yield from follow_ups

    def _event(self, user: int, item: int, kind: str, request_id: str, t: int, ctx: dict) -> Event:
        return Event(event_id=self._new_id(), user_id=f"u{user}", item_id=f"i{item}",
                     event_type=kind, request_id=request_id, event_time=t, context=ctx)

