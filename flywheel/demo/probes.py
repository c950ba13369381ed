"""Watching the pipeline and the server from outside, as a user would: online features after the
history, feature freshness of live events, the version the ranking server serves."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from feature_repo.definitions import USER_PROFILE
from feature_repo.store import online_row
from flywheel.demo.plan import LoopError, Say
from infra.settings import Settings
from streaming.events import dataset_spec
from streaming.features import STREAM_VIEWS

# What the demo shows of a user after the history: every user-keyed stream feature and the profile (the
# dataset spec's user table).
HISTORY_FEATURES = [*(f"{v.name}:{name}" for v in (*STREAM_VIEWS, USER_PROFILE) if v.keys == ("user_id",)
                      for name, _ in v.columns)]


def online_user(store, user: str) -> dict:
    return online_row(store, HISTORY_FEATURES, {"user_id": user})


def await_features(store, events: list, expected: int, timeout: float) -> dict:
    """Wait until the stream job and the ingestor have caught up with the history: the running total
    of its last user is `expected` (what was online before plus that user's impressions in it). Returns
    the online features of one of the most active users whose behavior sequence is online (the other
    views' topics can be a little behind `user_total`)."""
    impressions = Counter(e.user_id for e in events if e.event_type in dataset_spec().exposures)
    last, deadline = events[-1].user_id, time.monotonic() + timeout
    while (got := online_user(store, last)["user_impressions_total"] or 0) < expected:
        if time.monotonic() > deadline:
            raise LoopError(f"after {timeout:.0f}s user {last} has {got} of {expected} impressions online; "
                            "see `flywheel logs stream-job` and `flywheel logs feast-ingestor`")
        time.sleep(2)
    settle = time.monotonic() + 60  # the other views' topics can lag a little behind `user_total`
    while time.monotonic() < settle:
        for user, _ in impressions.most_common(20):
            if (row := online_user(store, user))["seq_item_ids"] is not None:
                return row
        time.sleep(2)
    return online_user(store, impressions.most_common(1)[0][0])


def serving(server: str) -> dict:
    return httpx.get(f"{server}/models", timeout=10).json()["serving"]


def wait_serving(server: str, version: str, timeout_s: float, say: Say | None = None) -> float:
    """Seconds until the ranking server serves `version` as champion."""
    t0, deadline = time.monotonic(), time.monotonic() + timeout_s
    while True:
        try:
            if serving(server).get("champion") == version:
                break
        except httpx.HTTPError:
            pass  # not up yet
        if time.monotonic() > deadline:
            raise LoopError(f"the ranking server at {server} does not serve v{version} after {timeout_s:.0f}s; "
                            "see `flywheel logs ranking-server`")
        time.sleep(0.2)
    if say:
        say(f"ranking server: serving v{version} as @champion ({time.monotonic() - t0:.1f}s after it was set)")
    return time.monotonic() - t0


def wait_retrieval(s: Settings, version: str, timeout_s: float) -> float:
    """Seconds until /recommend uses retrieval `version` (the user embedder made it current)."""
    from serving.nearline import Keys, redis_client

    t0, current, client = time.monotonic(), Keys(s.retrieval.key_prefix).current, redis_client(s)
    while (client.get(current) or b"").decode() != version:
        if time.monotonic() - t0 > timeout_s:
            raise LoopError(f"retrieval v{version} is not current after {timeout_s:.0f}s; see `flywheel logs "
                            "user-embedder`")
        time.sleep(0.2)
    return time.monotonic() - t0


class FreshnessProbes:
    """Feature freshness of live traffic: the time from a user's events being sent to their running
    total online. One probe in flight, every 5 s or more, of a user with no events in the last 30 s
    (whose running total is then settled before the probed request's impressions)."""

    def __init__(self, store) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(1)  # one thread owns the feature store: probes are serialized
        self.seconds: list[float] = []
        self.timed_out = 0  # not online within 60 s
        # Read and written by the traffic's event loop only, but `_probing`, which the probe's thread clears.
        self._probing, self._last_probe, self._last_sent = False, 0.0, {}

    def total(self, user: str) -> int:
        return online_row(self.store, ["user_total:user_impressions_total"], {"user_id": user})[
            "user_impressions_total"] or 0

    def claim(self, user: str) -> bool:
        """Whether to probe `user`'s next events (then the caller reads `total` first, and `start`s)."""
        now = time.monotonic()
        if self._probing or now - self._last_probe <= 5 or now - self._last_sent.get(user, -1e9) <= 30:
            return False
        self._probing, self._last_probe = True, now
        return True

    def sent(self, user: str) -> None:
        self._last_sent[user] = time.monotonic()

    def start(self, user: str, expected: int) -> None:
        """Time until `user`'s running total reaches `expected`, in the background."""
        self.pool.submit(self._wait_online, user, expected, time.monotonic())

    def _wait_online(self, user: str, expected: int, sent: float) -> None:
        try:
            deadline = sent + 60
            while time.monotonic() < deadline:
                if self.total(user) >= expected:
                    self.seconds.append(time.monotonic() - sent)
                    return
                time.sleep(0.05)
            self.timed_out += 1
        finally:
            self._probing = False

    def close(self) -> None:
        self.pool.shutdown(wait=True)
