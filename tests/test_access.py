"""The access layer's decisions: stable canary routing, an experiment's frozen arm, and the value-tier compute
allocation."""

from __future__ import annotations

from infra.settings import ServingSettings
from models.registry import CHALLENGER, CHAMPION, CONTROL, HOLDOUT
from serving import metrics
from serving.access import allocate, champion_route, decide, frozen_arm, route

SV = ServingSettings()


def test_canary_routing_is_stable_and_grows_one_way() -> None:
    users = [f"u{i}" for i in range(5000)]
    at10 = {u for u in users if route(u, 10.0) == CHALLENGER}
    at30 = {u for u in users if route(u, 30.0) == CHALLENGER}
    assert 0.08 < len(at10) / len(users) < 0.12 and 0.27 < len(at30) / len(users) < 0.33
    assert at10 <= at30  # raising the percentage only moves users to the challenger
    assert all(route(u, 10.0) == route(u, 10.0) for u in users[:100])
    assert {route(u, 0.0) for u in users} == {CHAMPION} and {route(u, 100.0) for u in users} == {CHALLENGER}


def test_the_frozen_arm_holds_its_users_through_every_canary_and_the_canaries_split_the_others() -> None:
    users = [f"u{i}" for i in range(20_000)]
    frozen = {u for u in users if frozen_arm(u, 20.0)}
    assert 0.18 < len(frozen) / len(users) < 0.22 and frozen <= {u for u in users if frozen_arm(u, 25.0)}
    everything = frozenset({CHALLENGER, CONTROL, HOLDOUT})
    for canary, champion_percent in ((10.0, 100.0), (30.0, 5.0), (0.0, 50.0)):
        routes = {u: decide(u, canary, everything, champion_percent, 20.0) for u in users}
        assert {u for u, r in routes.items() if r == HOLDOUT} == frozen  # whatever the canaries
        learning = [u for u in users if u not in frozen]
        assert all(routes[u] == CHALLENGER for u in learning if route(u, canary) == CHALLENGER)
        assert all(routes[u] == champion_route(u, champion_percent) for u in learning if route(u, canary) == CHAMPION)
        # Independent hashes: the frozen arm takes its share of the canary's users, not all or none of them.
        in_canary = [u for u in users if route(u, canary) == CHALLENGER]
        if in_canary:
            assert 0.15 < sum(u in frozen for u in in_canary) / len(in_canary) < 0.25
    # Each experiment its own users: another salt holds out others (about the share squared of them in both).
    again = {u for u in users if frozen_arm(u, 20.0, "2026-12-07T10:00:00+00:00")}
    assert 0.18 < len(again) / len(users) < 0.22 and 0.02 < len(again & frozen) / len(users) < 0.06
    assert {u for u in users if decide(u, 10.0, everything, 100.0, 20.0, "2026-12-07T10:00:00+00:00") == HOLDOUT} \
        == again
    # A route a worker does not hold serves nobody: its users fall to the champion.
    assert {decide(u, 30.0, frozenset(), 5.0, 20.0) for u in users} == {CHAMPION}
    assert {decide(u, 30.0, frozenset({CHALLENGER}), 100.0, 0.0) for u in users} == {CHAMPION, CHALLENGER}
    assert HOLDOUT not in {decide(u, 0.0, frozenset({HOLDOUT}), 100.0, 0.0) for u in users}  # the experiment stopped


def test_low_value_traffic_is_degraded_then_shed_first_and_high_value_keeps_full_quality() -> None:
    for fill in (0.0, 0.3, 0.6, 0.8, 0.99):
        assert allocate("high", fill, SV) == allocate("high", 0.0, SV) and not allocate("high", fill, SV).degraded
    assert not allocate("low", 0.1, SV).degraded and not allocate("normal", 0.3, SV).degraded
    assert allocate("low", 0.3, SV).sequence_length == SV.degraded_sequence_length
    assert allocate("low", 0.3, SV).max_candidates is None
    low, normal = allocate("low", 0.6, SV), allocate("normal", 0.6, SV)
    assert low.max_candidates == SV.degraded_max_candidates and normal.sequence_length == SV.degraded_sequence_length
    assert normal.max_candidates is None and not normal.shed
    assert allocate("low", 0.8, SV).shed and not allocate("normal", 0.8, SV).shed


def test_a_worker_is_judged_by_the_share_it_refused_in_the_last_window_only() -> None:
    """/healthz degrades a worker that answered most of its last window's requests 503; the share counts
    only that window, and a trickle too small to judge counts as 0."""
    recent = metrics.RecentAnswers(window_s=60)
    ok, refused = metrics.REQUESTS.labels("champion", "200"), metrics.REQUESTS.labels("-", "503")
    assert recent.sample(now=0) == 0.0
    ok.inc(100)
    assert recent.sample(now=10) == 0.0
    refused.inc(300)
    assert recent.sample(now=20) == 0.75  # 300 of the 400 answered since t=0
    assert recent.sample(now=75) == 1.0  # since t=10, the newest sample a window old: 300 refused of 300
    refused.inc(5)
    assert recent.sample(now=140) == 0.0  # 5 since t=75: too few to judge
