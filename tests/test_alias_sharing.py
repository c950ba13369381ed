"""Following a registered model's aliases (serving/aliases.py), for the ranker's workers and the retrieval
model's embedder alike. The server's workers share one registry poll through a file: an answer that comes back
late must not replace one another worker asked for later, or a rollback is undone for a poll interval (a worker
would swap back to the version just rolled back from)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.settings import load_settings
from models.registry import RegistryError, Routing
from serving import aliases, lifecycle, nearline


def test_a_slow_registry_answer_does_not_replace_a_later_one(tmp_path: Path, monkeypatch) -> None:
    s = load_settings({"FLYWHEEL_SERVING_POLL_INTERVAL_S": "30"}, config_file=None)
    shared = tmp_path / "aliases.json"
    slow, fast = lifecycle.ModelFollower(s, None, shared), lifecycle.ModelFollower(s, None, shared)
    slow._client, fast._client = "slow", "fast"  # stand-ins for the registry clients
    asked, answer = threading.Event(), threading.Event()

    def registry_routing(client: str, name: str) -> Routing:
        if client == "slow":  # asked before the rollback, answers after it: the old champion in a canary
            asked.set()
            answer.wait(10)
            return Routing({"champion": "2", "control": "1"}, 50.0, "2")
        return Routing({"champion": "1"})

    monkeypatch.setattr(aliases, "routing", registry_routing)
    late = threading.Thread(target=slow._routing)
    late.start()
    assert asked.wait(10)
    time.sleep(0.05)
    assert fast._routing() == Routing({"champion": "1"})  # asked later: the rollback
    answer.set()
    late.join(10)
    # Every worker reading the shared answer now gets the later one, share included.
    assert slow._routing() == fast._routing() == Routing({"champion": "1"}, 100.0)


class _Registry:
    """A stand-in registry client that can be down."""

    def __init__(self) -> None:
        self.down = False

    def get_registered_model(self, name: str) -> object:
        if self.down:
            raise ConnectionError("connection refused")
        return object()


def _ranker(s):
    return lifecycle.ModelFollower(s, None, None)


def _retrieval(s):
    return nearline.RetrievalFollower(s, switch=None)


@pytest.mark.parametrize("make", [_ranker, _retrieval], ids=["ranker", "retrieval"])
def test_a_registry_outage_mid_fetch_does_not_refuse_the_version(make, monkeypatch) -> None:
    """A version whose artifacts cannot be fetched because the registry went away is tried again at the
    next answered poll (not refused for RETRY_REFUSED_S); one that fails with the registry up is refused, and
    the version before keeps serving: the same for the ranker's workers and the retrieval model's embedder."""
    s = load_settings({"FLYWHEEL_MODELS_NAME": "ranks", "FLYWHEEL_RETRIEVAL_NAME": "recalls"}, config_file=None)
    follower, registry = make(s), _Registry()
    follower._client = registry
    asked: list[str] = []

    def routing_of(answer: dict[str, str]):
        def routing(client, name: str) -> Routing:
            asked.append(name)
            return Routing(answer)
        return routing

    monkeypatch.setattr(aliases, "routing", routing_of({"champion": "3"}))

    def obtain(version: str) -> object:
        if registry.down:
            raise ConnectionError("artifact download failed")
        if version == "4":
            raise ValueError("non-finite scores")
        return SimpleNamespace(version=version, loaded_by="full")
    monkeypatch.setattr(follower, "obtain", obtain)
    registry.down = True
    with pytest.raises(RegistryError):
        follower.poll_once()
    assert follower.served["champion"] is None and follower.refused == {}
    registry.down = False
    follower.poll_once()
    assert follower.served["champion"].version == "3"
    monkeypatch.setattr(aliases, "routing", routing_of({"champion": "4"}))
    follower.poll_once()
    assert follower.served["champion"].version == "3" and "non-finite" in follower.refused["4"]
    # Each follows its own registered model, by the name its settings give.
    assert set(asked) == {"ranks" if make is _ranker else "recalls"}
