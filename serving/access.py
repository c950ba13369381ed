"""The model-access layer's decisions: which model scores a user, whether a request is mirrored to
the shadow, and how much compute a request gets at the current load.

Routing is by a stable hash of the user id, so a user sees one model for the whole canary (no
flip-flopping between versions), and raising the percentage only moves users one way. Two canaries, each
its own hash: a refused version's (@challenger, `serving.canary_percent` of users) and a new champion's
(the registry's `champion_percent` of the champion's users while @control, the champion before, serves
the rest: serving/canary.py). An experiment's frozen arm is decided before both, by a hash of its own: its users
(`holdout_percent`, the registry's experiment) see @holdout whatever canaries run, and the canaries split the
others as they would without it.

Compute allocation by value tier (JD's dynamic power allocation). Load is the fill of the admission
bound (candidate rows admitted and not yet answered / `serving.max_inflight_rows`). As it rises:

    fill      high            normal                       low
    < 0.25    full            full                         full
    >= 0.25   full            full                         short sequences
    >= 0.5    full            short sequences              short sequences + fewer candidates
    >= 0.75   full            short sequences              shed (503)
    full      a request that does not fit is shed, whatever its tier

(thresholds: `serving.degrade_low_at`, `degrade_normal_at`, `shed_low_at`). "Short sequences" keeps
the newest `degraded_sequence_length` behaviors (a smaller sequence bucket, fewer attention rows);
"fewer candidates" scores the first `degraded_max_candidates` (clients send candidates best-recalled
first) and returns the rest unscored (`null`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from infra.settings import ServingSettings
from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT

TIERS = ("high", "normal", "low")


def _bucket(key: str) -> float:
    """A stable number in [0, 100) for `key`."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 10_000 / 100


def frozen_arm(user_id: str, holdout_percent: float, salt: str = "") -> bool:
    """Whether the user is in an experiment's frozen arm (@holdout): a hash apart from the canaries', so the arm
    holds the same users through every canary and promotion, salted by the experiment (each its own users)."""
    return _bucket(f"holdout:{salt}:{user_id}") < holdout_percent


def decide(user_id: str, canary_percent: float, held: frozenset[str], champion_percent: float = 100.0,
           holdout_percent: float = 0.0, holdout_salt: str = "") -> str:
    """The route that scores `user_id` given the routes a worker `held` (loaded now): @holdout for the experiment's
    frozen arm; else @challenger for the refused version's canary share, else the new champion's canary (@champion
    for its share, @control for the others); @champion where the route chosen holds no version."""
    if HOLDOUT in held and frozen_arm(user_id, holdout_percent, holdout_salt):
        return HOLDOUT
    chosen = route(user_id, canary_percent)
    if chosen == CHALLENGER and CHALLENGER in held:
        return CHALLENGER
    if CONTROL in held:
        return champion_route(user_id, champion_percent)
    return CHAMPION


def route(user_id: str, canary_percent: float) -> str:
    """@challenger for the users whose hash falls under the canary percentage, else @champion."""
    return CHALLENGER if _bucket(f"canary:{user_id}") < canary_percent else CHAMPION


def champion_route(user_id: str, champion_percent: float) -> str:
    """@champion for the users whose hash falls under its canary share, else @control."""
    return CHAMPION if _bucket(f"champion:{user_id}") < champion_percent else CONTROL


def shadowed(request_id: str, shadow_percent: float) -> bool:
    """Whether a (champion-routed) request is also scored by @challenger, logged and not returned."""
    return _bucket(f"shadow:{request_id}") < shadow_percent


@dataclass(frozen=True)
class Allocation:
    """What a request gets: None = no limit."""

    shed: bool = False
    sequence_length: int | None = None
    max_candidates: int | None = None

    @property
    def degraded(self) -> bool:
        return self.sequence_length is not None or self.max_candidates is not None


def allocate(tier: str, fill: float, sv: ServingSettings) -> Allocation:
    """The compute a request of `tier` gets when the admission queue is `fill` (0..1) full."""
    short = sv.degraded_sequence_length
    if tier == "high":
        return Allocation()
    if tier == "normal":
        return Allocation(sequence_length=short) if fill >= sv.degrade_normal_at else Allocation()
    if fill >= sv.shed_low_at:
        return Allocation(shed=True)
    if fill >= sv.degrade_normal_at:
        return Allocation(sequence_length=short, max_candidates=sv.degraded_max_candidates)
    return Allocation(sequence_length=short) if fill >= sv.degrade_low_at else Allocation()
