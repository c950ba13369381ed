"""A world that answers: users and items with hidden preferences, who click what they are shown by how much they
like it and where it sits in the list. It is a dataset like any other (`datasets/world/dataset.toml`, adapter
"world"): its history is written from the truth in `world.toml` beside the spec, a file the platform never
reads (its models see events, as they would a shop's).

The truth:
- an item has a category and an appeal (a logit, normal of sd `appeal_sd`); a user a taste cluster, and each
  cluster an affinity for each category (normal of sd `affinity_sd`); a user's declared `segment` is their
  cluster with probability `segment_accuracy`, else a random one (a noisy attribute, as a CRM's);
- an item shown at position p (0-based) is clicked with probability
  (1 + p) ** -position_eta * sigmoid(base_logit + affinity[cluster, category] + appeal): a position-based
  click model, so the order served moves the clicks; a click is a purchase with probability `purchase_rate`;
- a request's candidates are drawn as a recall would, knowing nothing of the user: by popularity (Zipf over a
  fixed order of the items) and `uniform_share` of them uniformly;
- scheduled changes, at `at_s` seconds after the live traffic starts (`CHANGES`): a category's promotion (its
  items' logit rises), a rotation of a share of users' tastes (each to another cluster), a retaste (a share of the
  clusters take each other's tastes, their users moving as one: a segment now tells of other tastes), a launch of items
  (in the catalog from the start, as a shop uploads them, but in no candidate list before `at_s`).

The history (`[history]`): `requests` requests over `days` days before the live traffic, each showing the top
`shown` of its candidates as a former ranker ordered them (the true logit plus normal noise of sd
`logger_noise`): the same shape the live traffic has. Everything is drawn from `seed`: a world is the same world
on every machine.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from infra.dataset import MAX_SLOTS, SpecError, _check
from infra.settings import Settings

WORLD_FILE = "world.toml"  # beside the spec
FILES = ("items.csv", "users.csv", "history.csv")
# Part of each world's cache key: a change of how the files are drawn from the truth is another world.
GENERATOR = 1
IMPRESSION, CLICK, PURCHASE = "impression", "click", "purchase"  # the event types datasets/world/dataset.toml declares
FLOAT_OR_INT = (float, int)
MAX_ZIPF = 5.0  # beyond it the tail's weights vanish: fewer drawable items than a list's candidates


@dataclass(frozen=True)
class Promotion:
    """A category's items liked more by everyone: `lift` added to their logit."""

    category: int
    lift: float = 1.0

    def __str__(self) -> str:
        return f"promotion of category c{self.category:02d} (logit {self.lift:+g})"


@dataclass(frozen=True)
class Rotation:
    """A `share` of the users (drawn once from the seed) move to another taste cluster."""

    share: float = 0.5

    def __str__(self) -> str:
        return f"{self.share:.0%} of users' tastes rotate"


@dataclass(frozen=True)
class Retaste:
    """A `share` of the taste clusters (round(share x clusters), at least two, drawn once from the seed) take each
    other's tastes in one cycle: their users move as one, so what they have in common (their declared segment) now
    tells of other tastes, a change a model learns from the whole segment's clicks, not user by user."""

    share: float = 1.0

    def clusters(self, of: int) -> int:
        return max(2, round(self.share * of))

    def __str__(self) -> str:
        return f"{self.share:.0%} of the taste clusters take another's tastes"


@dataclass(frozen=True)
class Launch:
    """`items` items (the catalog's last ones) enter the candidate lists, with appeal `appeal`."""

    items: int = 40
    appeal: float = 1.5

    def __str__(self) -> str:
        return f"{self.items} items launch (appeal {self.appeal:g})"


CHANGES: dict[str, type] = {"promotion": Promotion, "rotate": Rotation, "retaste": Retaste, "launch": Launch}


@dataclass(frozen=True)
class Change:
    at_s: float
    what: Promotion | Rotation | Retaste | Launch


@dataclass(frozen=True)
class Truth:
    """`[world]`: who the users and items are and how they click."""

    seed: int = 7
    users: int = 4000
    items: int = 2000
    categories: int = 20
    clusters: int = 8
    affinity_sd: float = 1.0
    appeal_sd: float = 0.5
    base_logit: float = -2.0
    position_eta: float = 0.7
    purchase_rate: float = 0.2
    segment_accuracy: float = 0.6
    zipf: float = 0.8
    uniform_share: float = 0.3


@dataclass(frozen=True)
class Traffic:
    """`[traffic]`: the live requests (`rate` a second), each ranking `candidates` and showing the top `shown`."""

    rate: float = 16.0
    candidates: int = 40
    shown: int = 10
    recommend_share: float = 0.1
    launched_per_request: int = 3  # after a launch: how many of a request's candidates are launched items


@dataclass(frozen=True)
class History:
    """`[history]`: what the platform starts from."""

    start: str = "2026-01-05"  # the first day (UTC)
    days: int = 7
    requests: int = 20_000
    logger_noise: float = 1.0


@dataclass(frozen=True)
class WorldSpec:
    path: Path
    truth: Truth = Truth()
    traffic: Traffic = Traffic()
    history: History = History()
    changes: tuple[Change, ...] = ()

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{GENERATOR}\n".encode() + self.path.read_bytes()).hexdigest()[:12]


def _record(where: str, cls: type, raw: Any, required: tuple[str, ...] = ()) -> Any:
    """A `cls` from a TOML table: its fields with their types (an int accepted for a float), each refused by
    name when unknown, missing (`required`) or mistyped."""
    hints = typing.get_type_hints(cls)
    kinds = {f.name: FLOAT_OR_INT if hints[f.name] is float else hints[f.name] for f in fields(cls)}
    table = _check(where, raw, {k: kinds[k] for k in required}, {k: v for k, v in kinds.items() if k not in required})
    for k, v in table.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise SpecError(f"{where}.{k}: expected a finite number, got {v!r}")
    return cls(**{k: float(v) if kinds[k] is FLOAT_OR_INT else v for k, v in table.items()})


def _at_least(where: str, record: Any, bounds: dict[str, float]) -> None:
    for name, low in bounds.items():
        if getattr(record, name) < low:
            raise SpecError(f"{where}.{name}: {getattr(record, name)!r} is below {low:g}")


def _share(where: str, record: Any, *names: str) -> None:
    for name in names:
        if not 0.0 <= getattr(record, name) <= 1.0:
            raise SpecError(f"{where}.{name}: {getattr(record, name)!r} is no share between 0 and 1")


def parse_world(text: str, path: Path) -> WorldSpec:
    """The world file's truth, traffic, history and changes, checked whole; SpecError names the file and key."""
    try:
        top = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: {exc}") from None
    _check(str(path), top, {}, {"world": dict, "traffic": dict, "history": dict, "changes": list})
    truth = _record(f"{path} [world]", Truth, top.get("world", {}))
    _at_least(f"{path} [world]", truth, {"users": 2, "items": 2, "categories": 2, "clusters": 1, "affinity_sd": 0,
                                         "appeal_sd": 0, "position_eta": 0, "zipf": 0})
    _share(f"{path} [world]", truth, "purchase_rate", "segment_accuracy", "uniform_share")
    if truth.zipf > MAX_ZIPF:
        raise SpecError(f"{path} [world].zipf: {truth.zipf!r} is above {MAX_ZIPF:g}")
    traffic = _record(f"{path} [traffic]", Traffic, top.get("traffic", {}))
    _at_least(f"{path} [traffic]", traffic, {"rate": 1e-9, "shown": 1, "launched_per_request": 0})
    if traffic.shown > MAX_SLOTS:
        raise SpecError(f"{path} [traffic].shown: {traffic.shown} is above {MAX_SLOTS} (a list's positions)")
    _share(f"{path} [traffic]", traffic, "recommend_share")
    if not traffic.shown <= traffic.candidates <= truth.items:
        raise SpecError(f"{path} [traffic]: expected shown <= candidates <= [world] items, got {traffic.shown}, "
                        f"{traffic.candidates}, {truth.items}")
    history = _record(f"{path} [history]", History, top.get("history", {}))
    _at_least(f"{path} [history]", history, {"days": 1, "requests": 1, "logger_noise": 0})
    try:
        date.fromisoformat(history.start)
    except ValueError:
        raise SpecError(f"{path} [history].start: {history.start!r} is no date (YYYY-MM-DD)") from None
    changes = tuple(_change(f"{path} [[changes]] {n + 1}", raw, truth) for n, raw in enumerate(top.get("changes", [])))
    launched = sum(c.what.items for c in changes if isinstance(c.what, Launch))
    if truth.items - launched < traffic.candidates:
        raise SpecError(f"{path} [[changes]]: {launched} launched items leave fewer than [traffic] candidates "
                        f"({traffic.candidates}) of the {truth.items} items before the launch")
    if launched and traffic.launched_per_request > traffic.candidates:
        raise SpecError(f"{path} [traffic].launched_per_request: more than candidates ({traffic.candidates})")
    return WorldSpec(path, truth, traffic, history, tuple(sorted(changes, key=lambda c: c.at_s)))


def _change(where: str, raw: Any, truth: Truth) -> Change:
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a table, got {type(raw).__name__}")
    kind, at_s = raw.get("kind"), raw.get("at_s")
    if not isinstance(kind, str) or kind not in CHANGES:
        raise SpecError(f"{where}.kind: {kind!r} is none of {', '.join(CHANGES)}")
    if isinstance(at_s, bool) or not isinstance(at_s, FLOAT_OR_INT) or not 0 <= at_s < math.inf:
        raise SpecError(f"{where}.at_s: expected seconds after the traffic starts (>= 0), got {at_s!r}")
    cls = CHANGES[kind]
    what = _record(where, cls, {k: v for k, v in raw.items() if k not in ("kind", "at_s")},
                   required=("category",) if cls is Promotion else ())
    if isinstance(what, Promotion) and not 0 <= what.category < truth.categories:
        raise SpecError(f"{where}.category: {what.category} is not one of the {truth.categories} categories")
    if isinstance(what, Rotation | Retaste):
        _share(where, what, "share")
        if isinstance(what, Retaste) and what.share == 0:
            raise SpecError(f"{where}.share: a retaste moves at least two clusters, got 0")
        if truth.clusters < 2:
            raise SpecError(f"{where}: kind {kind!r} needs [world] clusters >= 2 (a taste to move to)")
    if isinstance(what, Launch):
        _at_least(where, what, {"items": 1})
    return Change(float(at_s), what)


def load_world(path: Path) -> WorldSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: {exc.strerror or exc}") from None
    return parse_world(text, path)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class World:
    """The truth drawn from a spec: every array indexed by user or item number (ids `u00042`, `i00042`)."""

    def __init__(self, spec: WorldSpec) -> None:
        self.spec = spec
        t = spec.truth
        rng = np.random.default_rng([t.seed, 0])
        self.category = rng.integers(0, t.categories, t.items)
        self.appeal = rng.normal(0.0, t.appeal_sd, t.items)
        self.price = np.round(rng.lognormal(2.5, 0.6, t.items), 2)
        self.cluster = rng.integers(0, t.clusters, t.users)
        self.affinity = rng.normal(0.0, t.affinity_sd, (t.clusters, t.categories))
        wrong = (rng.random(t.users) >= t.segment_accuracy) & (t.clusters > 1)
        self.segment = np.where(wrong, (self.cluster + rng.integers(1, max(t.clusters, 2), t.users)) % t.clusters,
                                self.cluster)
        popularity = 1.0 / np.arange(1, t.items + 1) ** t.zipf
        self.popularity = popularity[rng.permutation(t.items)]
        self.launch_at = np.full(t.items, -np.inf)  # when each item enters the candidates
        end = t.items
        for c in spec.changes:
            if isinstance(c.what, Launch):
                launched = slice(end - c.what.items, end)
                self.launch_at[launched], self.appeal[launched] = c.at_s, c.what.appeal
                end -= c.what.items
        self._rotated: list[tuple[float, np.ndarray, np.ndarray]] = []  # (at_s, users, their new cluster)
        current = self.cluster.copy()
        for n, c in enumerate(spec.changes):  # in time order: each rotation moves users from where they are then
            if not isinstance(c.what, Rotation | Retaste):
                continue
            r = np.random.default_rng([t.seed, 1, n])
            if isinstance(c.what, Rotation):
                users = np.flatnonzero(r.random(t.users) < c.what.share)
                current[users] = (current[users] + r.integers(1, t.clusters, len(users))) % t.clusters
            else:  # the clusters of the smallest draws, as many as the share says, in one cycle
                chosen = r.permutation(np.sort(np.argsort(r.random(t.clusters))[:c.what.clusters(t.clusters)]))
                to = np.arange(t.clusters)
                to[chosen] = np.roll(chosen, -1)
                users = np.flatnonzero(np.isin(current, chosen))
                current[users] = to[current[users]]
            self._rotated.append((c.at_s, users, current[users].copy()))

    @property
    def item_ids(self) -> np.ndarray:
        return np.array([f"i{n:05d}" for n in range(self.spec.truth.items)])

    @property
    def user_ids(self) -> np.ndarray:
        return np.array([f"u{n:05d}" for n in range(self.spec.truth.users)])

    def clusters(self, t_s: float) -> np.ndarray:
        """Each user's taste cluster at `t_s` (seconds after the traffic starts; the history is before 0)."""
        cluster = self.cluster.copy()
        for at_s, users, moved in self._rotated:
            if t_s >= at_s:
                cluster[users] = moved
        return cluster

    def logit(self, users: np.ndarray, items: np.ndarray, t_s: float) -> np.ndarray:
        """The true logit of each (user, item) pair (broadcast), before the position's discount."""
        lift = np.zeros(self.spec.truth.categories)
        for c in self.spec.changes:
            if isinstance(c.what, Promotion) and t_s >= c.at_s:
                lift[c.what.category] += c.what.lift
        category = self.category[items]
        # an item not launched yet is of average appeal to a policy frozen before its launch (it knew nothing of it)
        appeal = np.where(self.launch_at[items] <= t_s, self.appeal[items], 0.0)
        return self.spec.truth.base_logit + self.affinity[self.clusters(t_s)[users], category] + appeal + lift[category]

    def click_probability(self, user: int, shown: np.ndarray, t_s: float) -> np.ndarray:
        """Each shown item's click probability in the order given (the first at position 0)."""
        discount = (1.0 + np.arange(len(shown))) ** -self.spec.truth.position_eta
        return discount * _sigmoid(self.logit(np.asarray(user), np.asarray(shown), t_s))

    def candidates(self, rng: np.random.Generator, t_s: float) -> np.ndarray:
        """A request's candidates, as a recall that knows nothing of the user draws them: by popularity, some
        uniformly, and after a launch `launched_per_request` of the launched items."""
        tr = self.spec.traffic
        live = self.launch_at <= t_s
        fresh = np.flatnonzero(live & (self.launch_at > -np.inf))
        k_fresh = min(tr.launched_per_request, len(fresh))
        old = np.flatnonzero(self.launch_at == -np.inf)
        k_uniform = int(round((tr.candidates - k_fresh) * self.spec.truth.uniform_share))
        weights = self.popularity[old] / self.popularity[old].sum()
        popular = rng.choice(old, tr.candidates - k_fresh - k_uniform, replace=False, p=weights)
        rest = np.setdiff1d(old, popular, assume_unique=True)
        picked = [popular, rng.choice(rest, k_uniform, replace=False), rng.choice(fresh, k_fresh, replace=False)]
        return rng.permutation(np.concatenate(picked))

    def react(self, user: int, shown: np.ndarray, t_s: float,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """What the user does with the items shown in this order: (clicked, purchased), one flag per item."""
        clicked = rng.random(len(shown)) < self.click_probability(user, shown, t_s)
        return clicked, clicked & (rng.random(len(shown)) < self.spec.truth.purchase_rate)

    def expected_ctr(self, order: Callable[[int, np.ndarray, float], np.ndarray], t_s: float, requests: int,
                     seed: int = 0) -> float:
        """The clicks per shown item a ranking policy earns at `t_s`, in expectation over `requests` requests
        (the same users and candidates for every policy of one seed): `order(user, candidates, t_s)` gives
        the candidates' scores, the top `shown` are shown."""
        rng = np.random.default_rng([self.spec.truth.seed, 2, seed])
        shown, clicks = self.spec.traffic.shown, 0.0
        for _ in range(requests):
            user = int(rng.integers(self.spec.truth.users))
            items = self.candidates(rng, t_s)
            top = items[np.argsort(-order(user, items, t_s), kind="stable")[:shown]]
            clicks += float(self.click_probability(user, top, t_s).sum())
        return clicks / (requests * shown)

    def oracle(self, at_s: float | None = None) -> Callable[[int, np.ndarray, float], np.ndarray]:
        """The policy that orders by the true logit: of the moment asked, or frozen at `at_s` (stale)."""
        return lambda user, items, t_s: self.logit(np.asarray(user), items, t_s if at_s is None else at_s)

    def history(self) -> pd.DataFrame:
        """The history's events: per request, its shown items' impressions (with their position), then the
        clicks and purchases, in time order."""
        t, h = self.spec.truth, self.spec.history
        rng = np.random.default_rng([t.seed, 3])
        start_ms = int(datetime.combine(date.fromisoformat(h.start), datetime.min.time(), UTC).timestamp() * 1000)
        times = np.sort(rng.integers(0, h.days * 86_400_000 - 60_000, h.requests)) + start_ms
        # the history is before the live traffic: every change still ahead (t_s < 0)
        before = min([0.0, *(c.at_s for c in self.spec.changes)]) - 1.0
        ids, items = self.user_ids, self.item_ids
        rows: list[tuple] = []
        for n, at in enumerate(times):
            user = int(rng.integers(t.users))
            candidates = self.candidates(rng, before)
            logged = self.logit(np.asarray(user), candidates, before) + rng.normal(0, h.logger_noise, len(candidates))
            shown = candidates[np.argsort(-logged, kind="stable")[:self.spec.traffic.shown]]
            clicked, bought = self.react(user, shown, before, rng)
            request, u = f"h{n:06d}", ids[user]
            for p, i in enumerate(shown):
                rows.append((u, items[i], IMPRESSION, int(at) + 100 * p, request, f"c{self.category[i]:02d}", p))
            # a click 5 s after its list, a purchase 30 s: within the minute before the history's end
            for kind, after_ms, flags in ((CLICK, 5_000, clicked), (PURCHASE, 30_000, bought)):
                for p in np.flatnonzero(flags):
                    i = shown[p]
                    rows.append((u, items[i], kind, int(at) + after_ms + 100 * int(p), request,
                                 f"c{self.category[i]:02d}", int(p)))
        frame = pd.DataFrame(rows, columns=["user_id", "item_id", "event_type", "event_time", "request_id",
                                            "category", "position"])
        return frame.sort_values("event_time", kind="stable").reset_index(drop=True)

    def items_table(self) -> pd.DataFrame:
        return pd.DataFrame({"item_id": self.item_ids, "category": [f"c{c:02d}" for c in self.category],
                             "price": self.price})

    def users_table(self) -> pd.DataFrame:
        return pd.DataFrame({"user_id": self.user_ids, "segment": [f"s{c}" for c in self.segment]})


def write(world: World, target: Path) -> Path:
    """The world's tables and history as the spec's FILES in `target`, which appears whole or not at all (a
    process stopped halfway, or another writing the same world at once, leaves no half a history)."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    world.items_table().to_csv(partial / "items.csv", index=False)
    world.users_table().to_csv(partial / "users.csv", index=False)
    world.history().to_csv(partial / "history.csv", index=False)
    try:
        os.rename(partial, target)
    except OSError:  # written meanwhile by another process: the same files
        if not target.is_dir():
            raise
        shutil.rmtree(partial)
    return target


def prepare(s: Settings) -> Path:
    """The adapter: the directory holding FILES for the world beside the spec, written on first use and kept
    per version of the world file (a changed world is another directory)."""
    spec = load_world(s.spec.path.parent / WORLD_FILE)
    target = s.paths.cache_dir / "datasets" / f"world-{spec.digest}"
    if all((target / f).exists() for f in FILES):
        return target
    return write(World(spec), target)
