"""The near-line long-term interest: an exponentially decayed category histogram per user.

Each action adds 1 to its category; every weight halves per half-life. Updating needs only the
current histogram (never the history), so its cost does not grow with how long a user has been
active. Weights are kept as of the newest event seen; an older event arriving late is added with
its decay already applied, so the result does not depend on arrival order.
"""

from __future__ import annotations

import math


class InterestHistogram:
    def __init__(self, half_life_ms: float):
        self.rate = math.log(2) / half_life_ms
        self.weights: dict[str, float] = {}
        self.as_of: int | None = None  # ms; the weights are valid at this time

    def add(self, category: str, event_time: int) -> None:
        if self.as_of is None or event_time >= self.as_of:
            if self.as_of is not None:
                decay = math.exp(-self.rate * (event_time - self.as_of))
                self.weights = {c: w * decay for c, w in self.weights.items()}
            self.as_of = event_time
            self.weights[category] = self.weights.get(category, 0.0) + 1.0
        else:
            self.weights[category] = self.weights.get(category, 0.0) + math.exp(-self.rate * (self.as_of - event_time))

    def top(self, k: int) -> tuple[list[str], list[float]]:
        """The k heaviest categories (ties by name) and their weights as of `as_of`."""
        ranked = sorted(self.weights.items(), key=lambda cw: (-cw[1], cw[0]))[:k]
        return [c for c, _ in ranked], [w for _, w in ranked]
