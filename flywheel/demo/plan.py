"""What a run of the loop is asked to do (LoopPlan), what it found (Summary), and how it fails."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from infra.settings import Settings

Say = Callable[[str], None]


class LoopError(RuntimeError):
    """A stage of the loop did not have its effect; the message says which and where to look."""


@dataclass(frozen=True)
class LoopPlan:
    split: datetime = datetime(1998, 3, 1, tzinfo=UTC)  # ratings before: history; from then on: live traffic
    history_from: datetime = datetime(1997, 9, 1, tzinfo=UTC)  # offline training window start
    history_limit: int | None = None  # replay at most this many history ratings (a shortened loop)
    sessions: int | None = None  # the first N live sessions (None: all after `split`), replayed in a cycle
    rate: float = 2.0  # live requests per second
    recommend_every: int = 4  # every Nth live request asks /recommend for the session's user (0: none)
    tail_s: float = 30.0  # live traffic kept up after the rollback is served
    # After the drills, one incremental run learns the traffic from the rolled-back-to champion (loop.catch_up):
    # on a loaded 2-core machine 5-15 min more. The shortened loop of the tests leaves it out.
    catch_up: bool = True
    feature_timeout_s: float = 900.0
    training_timeout_s: float = 1800.0
    live_timeout_s: float = 1800.0

    @classmethod
    def of(cls, s: Settings, split: datetime | None = None, **kw) -> LoopPlan:
        """The plan for the spec's data: `split` (else the spec's `[demo] split`, else the day by which 90% of
        the history had happened), the first champion trained on `[demo] train_days` before it (else on
        everything before it)."""
        demo = s.spec.demo
        split = split or demo.split
        if split is None or demo.train_days is None:
            from streaming.history import history_events

            times = np.array([e.event_time for e in history_events(s)], np.int64)
            day = lambda ms: datetime.fromtimestamp(ms // 86_400_000 * 86_400, UTC)  # noqa: E731
            split = split or day(int(np.quantile(times, 0.9)))
            first = day(int(times.min()))
        start = split - timedelta(days=demo.train_days) if demo.train_days else first
        return cls(split=split, history_from=start, **kw)


@dataclass
class Summary:
    history_events: dict[str, int] = field(default_factory=dict)
    live_events: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    predictions_logged: int = 0
    feature_freshness_s: list[float] = field(default_factory=list)
    feature_probes_timed_out: int = 0  # not online within 60 s
    first_champion: str = ""
    user_features: dict[str, object] = field(default_factory=dict)  # one user's online features after the history
    recommended: dict[str, object] = field(default_factory=dict)  # one /recommend answer: the user, the items
    ranker_auc: dict[str, float] = field(default_factory=dict)  # test AUC of the first champion and the baselines
    offline_training_s: float = 0.0
    first_served_s: float = 0.0  # offline_training run finished -> its champion served
    statuses: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)  # POST /rank
    recommend_latency_ms: dict[str, float] = field(default_factory=dict)
    # What users did with /recommend's lists, per candidate source: impressions, clicks, CTR (the archives)
    recommend_sources: dict[str, dict[str, float]] = field(default_factory=dict)
    retrieval: dict[str, object] = field(default_factory=dict)  # the first retrieval version and its gate
    requests: int = 0
    versions: list[dict] = field(default_factory=list)  # registry rows, newest first
    served: list[dict] = field(default_factory=list)  # per version on live traffic: requests, items, auc, ...
    auc_over_time: list[dict] = field(default_factory=list)
    model_freshness_s: dict[str, float] = field(default_factory=dict)  # newest event in its data -> served
    incremental_promoted: list[str] = field(default_factory=list)
    refused_drill: dict[str, str] = field(default_factory=dict)
    rollback: dict[str, object] = field(default_factory=dict)
    live_regression: dict[str, object] = field(default_factory=dict)  # promoted, rolled back by the canary analysis
    canaries: list[dict] = field(default_factory=list)  # every promoted version's canary: decision, by whom
    catch_up: dict[str, object] = field(default_factory=dict)  # incremental_training after the rollback
    seconds: float = 0.0
