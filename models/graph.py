"""The user-item behavior graph in FalkorDB, and the item neighbours derived from it for recall.

    (:User {id})-[:BEHAVED {weight, at, events, until}]->(:Item {id})

An edge's `weight` is the sum of its events' behavior weights (settings.graph), each decayed by
2^-(age / half life), as of `at`, its newest event. At a later time T it is worth
weight * 2^-((T - at) / half life): decay needs no rewrite, only new behavior does.

Incremental, exactly once: a run adds the offline event log's events in (watermark, until], where
`until` is the newest logged event time minus the allowed lateness. The window is recorded as
pending before the first write and the watermark moves only after the last; a run that died midway
is finished with the same window, and an edge already stamped with that window is skipped. An
event logged after its window was added (later than the allowed lateness) stays out of the graph;
the event log keeps it.

Neighbours: every item that gained behavior is marked :Stale. The refresh scores each stale item's
co-interaction with the items its users also touched, score(i, j) = sum over users u of
w(u, i) * w(u, j), both decayed to the watermark; keeps the best `graph.neighbours`; publishes them as
the `item_neighbours` feature (online and offline) and clears the mark. Items not touched keep their
lists: decaying every weight to a later time scales all of an item's scores alike, so their order
holds until new behavior reaches them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import falkordb
import numpy as np
import pandas as pd
from redis.exceptions import ResponseError

from feature_repo.definitions import ITEM_NEIGHBOURS
from feature_repo.event_log import read_event_log
from feature_repo.store import write_rows
from infra.redis_clients import credentials, graph_url
from infra.settings import Settings

log = logging.getLogger("flywheel.graph")
DAY_MS = 86_400_000
WATERMARK = "behavior_edges"
NEIGHBOUR_BATCH = 100  # stale items scored per query

UPSERT_EDGES = """
UNWIND $rows AS r
MERGE (u:User {id: r.u})
MERGE (i:Item {id: r.i})
MERGE (u)-[e:BEHAVED]->(i)
ON CREATE SET e.weight = 0.0, e.at = r.t, e.events = 0, e.until = -1
WITH r, u, i, e WHERE e.until < $until
WITH r, u, i, e, CASE WHEN r.t > e.at THEN r.t ELSE e.at END AS t
SET e.weight = e.weight * 2 ^ ((e.at - t) / $half_life) + r.w * 2 ^ ((r.t - t) / $half_life),
    e.at = t, e.events = e.events + r.n, e.until = $until, u.until = $until, i.until = $until, i:Stale
RETURN count(e)
"""

# Cost: one path per (user of i, other item of that user); w(u, i) is decayed once per user, not per path.
NEIGHBOURS = """
UNWIND $items AS item
MATCH (i:Item {id: item})<-[a:BEHAVED]-(u:User)
WITH i, u, a.weight * 2 ^ ((a.at - $at) / $half_life) AS wa
MATCH (u)-[b:BEHAVED]->(j:Item)
WHERE j <> i
WITH i, j, sum(wa * b.weight * 2 ^ ((b.at - $at) / $half_life)) AS score
ORDER BY score DESC, j.id
WITH i, collect([j.id, score]) AS ranked
RETURN i.id, ranked[0..$k]
"""


@dataclass(frozen=True)
class EdgeUpdate:
    """What one run added: events in (start_ms, until_ms] as `edges` user-item upserts."""

    start_ms: int | None
    until_ms: int | None  # the watermark after the run; None while the graph is empty
    events: int
    edges: int
    users: int
    items: int
    seconds: float


@dataclass(frozen=True)
class NeighbourUpdate:
    items: int  # stale items refreshed and published
    with_neighbours: int
    as_of_ms: int | None
    seconds: float


def connect(s: Settings) -> falkordb.Graph:
    """The behavior graph, with the id indexes its upserts and lookups need."""
    db = falkordb.FalkorDB.from_url(graph_url(s), **credentials(s))
    graph = db.select_graph(s.graph.name)
    for label in ("User", "Item"):
        try:
            graph.create_node_range_index(label, "id")
        except ResponseError as exc:
            if "already indexed" not in str(exc):
                raise
    return graph


def behavior_weights(s: Settings) -> dict[str, float]:
    """Each positive's edge weight (the dataset spec's); exposures are not interest and add no edge."""
    return s.spec.weights


def half_life_ms(s: Settings) -> float:
    return s.graph.half_life_days * DAY_MS


def watermark(graph: falkordb.Graph) -> tuple[int | None, int | None]:
    """(event time up to which the graph holds every event, the window end of an unfinished run)."""
    rows = graph.query("MATCH (m:Watermark {name: $name}) RETURN m.until, m.pending", {"name": WATERMARK}).result_set
    return (rows[0][0], rows[0][1]) if rows else (None, None)


def edge_rows(s: Settings, events: pd.DataFrame, start_ms: int | None, until_ms: int) -> list[dict]:
    """The events in (start_ms, until_ms] as one row per user-item pair: u, i, w (decayed weight as of
    t), t (newest event time), n (events)."""
    weights = behavior_weights(s)
    keep = events["event_type"].isin(list(weights)) & (events["event_time"] <= until_ms)
    if start_ms is not None:
        keep &= events["event_time"] > start_ms
    df = events[keep].drop_duplicates("event_id")  # a producer's retry can log an event twice
    if df.empty:
        return []
    newest = df.groupby(["user_id", "item_id"])["event_time"].transform("max")
    decayed = df["event_type"].map(weights) * np.exp2((df["event_time"] - newest) / half_life_ms(s))
    pairs = df.assign(w=decayed, t=newest).groupby(["user_id", "item_id"], sort=True).agg(
        w=("w", "sum"), t=("t", "max"), n=("w", "size")).reset_index()
    return [{"u": u, "i": i, "w": float(w), "t": int(t), "n": int(n)}
            for u, i, w, t, n in pairs.itertuples(index=False)]


def _batches(rows: Sequence, size: int) -> Iterator[Sequence]:
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


def add_edges(s: Settings) -> EdgeUpdate:
    """Add the behavior logged since the watermark to the graph (see the module docstring)."""
    started = time.perf_counter()
    graph = connect(s)
    start, pending = watermark(graph)
    logged = read_event_log(s, start_ms=start).to_pandas()
    if pending is None:
        newest = int(logged["event_time"].max()) if len(logged) else None
        until = None if newest is None else newest - int(s.graph.allowed_lateness_s * 1000)
        if until is None or (start is not None and until <= start):
            return EdgeUpdate(start, start, 0, 0, 0, 0, time.perf_counter() - started)
        graph.query("MERGE (m:Watermark {name: $name}) SET m.pending = $until", {"name": WATERMARK, "until": until})
    else:
        until = pending
        log.info("finishing the window (%s, %s] of an interrupted run", start, until)
    rows = edge_rows(s, logged, start, until)
    for batch in _batches(rows, s.graph.batch_size):
        graph.query(UPSERT_EDGES, {"rows": list(batch), "until": until, "half_life": half_life_ms(s)})
    graph.query("MATCH (m:Watermark {name: $name}) SET m.until = $until, m.pending = NULL",
                {"name": WATERMARK, "until": until})
    events = sum(r["n"] for r in rows)
    return EdgeUpdate(start, until, events, len(rows), len({r["u"] for r in rows}), len({r["i"] for r in rows}),
                      time.perf_counter() - started)


def refresh_neighbours(s: Settings) -> NeighbourUpdate:
    """Recompute, publish and unmark the neighbours of every stale item."""
    started = time.perf_counter()
    graph = connect(s)
    at, _ = watermark(graph)
    stale = [row[0] for row in graph.query("MATCH (i:Stale) RETURN i.id ORDER BY i.id").result_set]
    if at is None or not stale:
        return NeighbourUpdate(0, 0, at, time.perf_counter() - started)
    rows = []
    for batch in _batches(stale, NEIGHBOUR_BATCH):
        ranked = dict(graph.query(NEIGHBOURS, {"items": list(batch), "at": at, "half_life": half_life_ms(s),
                                               "k": s.graph.neighbours}).result_set)
        rows += [{"item_id": item, "neighbour_ids": [j for j, _ in ranked.get(item, [])],
                  "neighbour_scores": [float(score) for _, score in ranked.get(item, [])]} for item in batch]
    write_rows(s, ITEM_NEIGHBOURS, rows, datetime.fromtimestamp(at / 1000, UTC))
    for batch in _batches(stale, NEIGHBOUR_BATCH):
        graph.query("UNWIND $items AS item MATCH (i:Item {id: item}) REMOVE i:Stale SET i.neighbours_at = $at",
                    {"items": list(batch), "at": at})
    return NeighbourUpdate(len(rows), sum(1 for r in rows if r["neighbour_ids"]), at, time.perf_counter() - started)


def graph_size(s: Settings) -> tuple[int, int]:
    """(user-item edges in the graph, items with neighbours published)."""
    graph = connect(s)
    edges = graph.query("MATCH ()-[e:BEHAVED]->() RETURN count(e)").result_set[0][0]
    items = graph.query("MATCH (i:Item) WHERE i.neighbours_at IS NOT NULL RETURN count(i)").result_set[0][0]
    return edges, items
