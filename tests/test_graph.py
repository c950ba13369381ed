"""The behavior graph in a real FalkorDB: exact decayed edge weights and neighbour scores for a known
event set, published online; incremental runs touch only what changed; an interrupted run is
finished exactly once."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from feature_repo.files import view_dir
from feature_repo.event_log import write_batch
from feature_repo.store import apply, feature_store, online_row
from infra.settings import Settings, override
from models import graph
from streaming.consumer import Consumed
from streaming.events import Event

pytestmark = pytest.mark.stack

T0 = 1_700_000_000_000
DAY = graph.DAY_MS
NEIGHBOURS = ["item_neighbours:neighbour_ids", "item_neighbours:neighbour_scores"]


class EventLog:
    """Writes events to the offline event log the way the event-log service does."""

    def __init__(self, s: Settings) -> None:
        self.s, self.offset = s, 0

    def add(self, *events: tuple[str, str, str, int], event_id: str | None = None) -> None:
        batch = []
        for user, item, kind, t in events:
            self.offset += 1
            event = Event(event_id=event_id or f"e{self.offset}", user_id=user, item_id=item, event_type=kind,
                          request_id=f"r{self.offset}", event_time=t)
            batch.append(Consumed(event, partition=0, offset=self.offset))
        write_batch(self.s, batch)


@pytest.fixture
def s(redis_stack: Settings, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    """The session's Redis, a graph of this test's own, one-day half life, no lateness allowance."""
    settings = override(redis_stack, "paths", data_dir=tmp_path)
    settings = override(settings, "graph", name=f"test-{request.node.name}", half_life_days=1.0,
                        allowed_lateness_s=0.0)
    apply(settings)
    return settings


def edges(s: Settings) -> dict[tuple[str, str], dict]:
    rows = graph.connect(s).query("MATCH (u:User)-[e:BEHAVED]->(i:Item) "
                                  "RETURN u.id, i.id, e.weight, e.at, e.events, e.until").result_set
    return {(u, i): {"weight": w, "at": at, "events": n, "until": until} for u, i, w, at, n, until in rows}


def nodes(s: Settings) -> dict[tuple[str, str], tuple]:
    rows = graph.connect(s).query("MATCH (n) WHERE n:User OR n:Item "
                                  "RETURN labels(n), n.id, n.until, n.neighbours_at").result_set
    return {(sorted(set(labels) - {"Stale"})[0], id_): (sorted(labels), until, at) for labels, id_, until, at in rows}


def neighbours_online(s: Settings, item: str) -> tuple[list, list]:
    row = online_row(feature_store(s), NEIGHBOURS, {"item_id": item})
    return row["neighbour_ids"], row["neighbour_scores"]


def test_known_events_give_exact_decayed_weights_and_neighbours(s: Settings) -> None:
    log = EventLog(s)
    log.add(("u1", "i1", "click", T0), ("u1", "i1", "purchase", T0 + DAY),
            ("u1", "i2", "click", T0 + DAY), ("u2", "i1", "click", T0 + 2 * DAY),
            ("u2", "i3", "add_to_cart", T0 + 2 * DAY), ("u3", "i1", "impression", T0 + 2 * DAY))
    log.add(("u2", "i1", "click", T0 + 2 * DAY), event_id="e4")  # the same event logged twice

    added = graph.add_edges(s)
    assert (added.events, added.edges, added.users, added.items) == (5, 4, 2, 3)
    assert added.until_ms == T0 + 2 * DAY
    got = edges(s)
    assert set(got) == {("u1", "i1"), ("u1", "i2"), ("u2", "i1"), ("u2", "i3")}  # impressions add no edge
    # click at T0 decayed one half life by the purchase (4.0) a day later
    assert got["u1", "i1"]["weight"] == pytest.approx(0.5 * 1.0 + 4.0, rel=1e-12)
    assert (got["u1", "i1"]["at"], got["u1", "i1"]["events"]) == (T0 + DAY, 2)
    assert got["u2", "i1"]["weight"] == pytest.approx(1.0) and got["u2", "i1"]["events"] == 1
    assert got["u2", "i3"]["weight"] == pytest.approx(2.0)

    refreshed = graph.refresh_neighbours(s)
    assert (refreshed.items, refreshed.with_neighbours) == (3, 3)
    # at T0+2d: w(u1,i1) = 4.5 * 0.5, w(u1,i2) = 1 * 0.5, w(u2,i1) = 1, w(u2,i3) = 2
    ids, scores = neighbours_online(s, "i1")
    assert ids == ["i3", "i2"] and scores == pytest.approx([1.0 * 2.0, 2.25 * 0.5], rel=1e-12)
    assert neighbours_online(s, "i2") == (["i1"], pytest.approx([0.5 * 2.25], rel=1e-12))
    assert neighbours_online(s, "i3") == (["i1"], pytest.approx([2.0], rel=1e-12))
    offline = pq.read_table(view_dir(s, "item_neighbours")).to_pandas().set_index("item_id")
    assert list(offline.loc["i1", "neighbour_ids"]) == ["i3", "i2"]
    assert offline.loc["i1", "event_timestamp"].value // 1_000_000 == T0 + 2 * DAY  # valid from the watermark


def test_runs_are_incremental_and_touch_only_new_behavior(s: Settings) -> None:
    log = EventLog(s)
    log.add(("u1", "i1", "purchase", T0 + DAY), ("u1", "i2", "click", T0 + DAY),
            ("u2", "i1", "click", T0 + 2 * DAY), ("u2", "i3", "click", T0 + 2 * DAY))
    graph.add_edges(s)
    graph.refresh_neighbours(s)
    before_edges, before_nodes, before_i1 = edges(s), nodes(s), neighbours_online(s, "i1")

    again = graph.add_edges(s)  # nothing new
    assert (again.events, again.edges, again.until_ms) == (0, 0, T0 + 2 * DAY)
    assert graph.refresh_neighbours(s).items == 0
    assert edges(s) == before_edges and nodes(s) == before_nodes

    log.add(("u1", "i2", "click", T0 + 3 * DAY), ("u3", "i4", "click", T0 + 3 * DAY))
    added = graph.add_edges(s)
    assert (added.start_ms, added.until_ms, added.events, added.edges) == (T0 + 2 * DAY, T0 + 3 * DAY, 2, 2)
    after = edges(s)
    changed = {pair for pair in after if after[pair] != before_edges.get(pair)}
    assert changed == {("u1", "i2"), ("u3", "i4")}
    assert after["u1", "i2"]["weight"] == pytest.approx(1.0 * 0.25 + 1.0, rel=1e-12)  # decayed two days, plus 1
    assert after["u1", "i2"]["events"] == 2
    touched = {key for key, (_, until, _) in nodes(s).items() if until == T0 + 3 * DAY}
    assert touched == {("User", "u1"), ("Item", "i2"), ("User", "u3"), ("Item", "i4")}

    refreshed = graph.refresh_neighbours(s)
    assert (refreshed.items, refreshed.with_neighbours, refreshed.as_of_ms) == (2, 1, T0 + 3 * DAY)
    # at T0+3d: w(u1,i2) = 1.25, w(u1,i1) = 4 * 0.25
    assert neighbours_online(s, "i2") == (["i1"], pytest.approx([1.25 * 1.0], rel=1e-12))
    assert neighbours_online(s, "i4") == ([], [])
    assert neighbours_online(s, "i1") == before_i1  # not touched: not recomputed


def test_an_interrupted_run_is_finished_exactly_once(s: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    log = EventLog(s)
    log.add(("u1", "i1", "click", T0), ("u1", "i2", "click", T0), ("u1", "i3", "click", T0))
    upserts, real_query = [], graph.falkordb.Graph.query

    def crash_on_second_upsert(self, q, params=None, *args, **kwargs):
        if q == graph.UPSERT_EDGES:
            upserts.append(1)
            if len(upserts) == 2:
                raise ConnectionError("the graph store went away")
        return real_query(self, q, params, *args, **kwargs)

    monkeypatch.setattr(graph.falkordb.Graph, "query", crash_on_second_upsert)
    with pytest.raises(ConnectionError):
        graph.add_edges(override(s, "graph", batch_size=1))
    monkeypatch.undo()
    assert graph.watermark(graph.connect(s)) == (None, T0)  # the window is pending
    assert set(edges(s)) == {("u1", "i1")}

    log.add(("u1", "i4", "click", T0 + DAY))  # arrives before the retry
    retry = graph.add_edges(s)
    assert (retry.start_ms, retry.until_ms) == (None, T0)  # the interrupted window, no more
    got = edges(s)
    assert set(got) == {("u1", "i1"), ("u1", "i2"), ("u1", "i3")}
    assert all(e["events"] == 1 and e["weight"] == pytest.approx(1.0) for e in got.values())  # none twice
    assert graph.add_edges(s).until_ms == T0 + DAY and set(edges(s)) == {*got, ("u1", "i4")}
