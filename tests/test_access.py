"""The access layer's decisions: stable canary routing and the value-tier compute allocation."""

from __future__ import annotations

from infra.settings import ServingSettings
from models.registry import CHALLENGER, CHAMPION
from serving.access import allocate, route

SV = ServingSettings()


def test_canary_routing_is_stable_and_grows_one_way() -> None:
    users = [f"u{i}" for i in range(5000)]
    at10 = {u for u in users if route(u, 10.0) == CHALLENGER}
    at30 = {u for u in users if route(u, 30.0) == CHALLENGER}
    assert 0.08 < len(at10) / len(users) < 0.12 and 0.27 < len(at30) / len(users) < 0.33
    assert at10 <= at30  # raising the percentage only moves users to the challenger
    assert all(route(u, 10.0) == route(u, 10.0) for u in users[:100])
    assert {route(u, 0.0) for u in users} == {CHAMPION} and {route(u, 100.0) for u in users} == {CHALLENGER}


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
