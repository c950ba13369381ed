"""The serving path's direct reader of Feast's Redis layout returns exactly what Feast's own
`get_online_features` returns, for every feature type the views use, for present, partly written and
unknown entities; `flywheel features` shows what the server reads."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime

import pandas as pd
import pytest

from feature_repo.definitions import BATCH_VIEWS, GRAPH_VIEWS, TIMESTAMP_FIELD
from feature_repo.online import WRITE_CHUNK, OnlineReader, OnlineWriter, columns_of, decode
from feature_repo.store import apply
from infra.settings import Settings, to_environ
from streaming.features import STREAM_VIEWS
from tests.conftest import run_cli

pytestmark = pytest.mark.stack

SAMPLES = {  # per SQL type: values that exercise the encodings (zero, negative, large, empty)
    "BIGINT": [0, 7, -3, 2**40 + 1],
    "DOUBLE": [0.0, 0.25, -1.5, 1e-300],
    "STRING": ["", "Comedy", "ünïcødé", "x" * 300],
    "ARRAY<STRING>": [["a"], [], ["Drama", "Film-Noir", "ü"], ["z"] * 60],
    "ARRAY<BIGINT>": [[1], [], [-5, 0, 2**40], list(range(60))],
    "ARRAY<DOUBLE>": [[0.5], [], [-0.25, 3.0], [float(i) / 7 for i in range(12)]],
}
VIEWS = (*STREAM_VIEWS, *BATCH_VIEWS, *GRAPH_VIEWS)


def test_the_reader_equals_get_online_features_for_every_view_and_type(redis_stack: Settings) -> None:
    store = apply(redis_stack)
    entities = {keys: [tuple(f"{k}-{i}" for k in keys) for i in range(4)]
                for keys in {v.keys for v in VIEWS}}
    for view in VIEWS:
        rows = []
        for i, entity in enumerate(entities[view.keys][:3]):  # the fourth entity is never written
            samples = {name: SAMPLES[t][(i + j) % 4] for j, (name, t) in enumerate(view.columns)}
            rows.append(dict(zip(view.keys, entity)) | samples | {TIMESTAMP_FIELD: datetime.now(UTC)})
        store.write_to_online_store(view.name, pd.DataFrame(rows))

    reader = OnlineReader(redis_stack, timeout_s=2.0)
    for keys, ents in entities.items():
        refs = [(v.name, name) for v in VIEWS if v.keys == keys for name, _ in v.columns]
        expected = store.get_online_features(features=[f"{view}:{name}" for view, name in refs],
                                             entity_rows=[dict(zip(keys, e)) for e in ents]).to_dict()
        got = reader.read(keys, ents, refs)
        for j, (_, name) in enumerate(refs):
            assert [row[j] for row in got] == expected[name], name
        assert all(value is None for value in got[3])  # an unknown entity: nothing stored


def test_the_ingestors_writer_gives_get_online_features_what_it_wrote(redis_stack: Settings) -> None:
    """The stream ingestor writes Feast's layout itself: Feast reads back every value of every stream view
    and type; an older row never replaces a newer one, and a row as new as the stored one does."""
    store = apply(redis_stack)
    writer = OnlineWriter(redis_stack)
    t = 1_700_000_000_123
    for view in STREAM_VIEWS:
        rows = [dict(zip(view.keys, (f"w{k}-{i}" for k in view.keys)), event_time=t)
                | {name: SAMPLES[sql_type][(i + j) % 4] for j, (name, sql_type) in enumerate(view.columns)}
                for i in range(4)]
        assert writer.write(view.keys, [(view.name, view.columns)], columns_of(rows)) == 4
        older = [r | {"event_time": t - 1, **{name: SAMPLES[c][1] for name, c in view.columns}} for r in rows[:2]]
        assert writer.write(view.keys, [(view.name, view.columns)], columns_of(older)) == 0
        same_time = rows[3] | {name: SAMPLES[c][2] for name, c in view.columns}
        assert writer.write(view.keys, [(view.name, view.columns)], columns_of([same_time])) == 1
        expected_rows = [*rows[:3], same_time]
        got = store.get_online_features(features=[f"{view.name}:{name}" for name, _ in view.columns],
                                        entity_rows=[{k: r[k] for k in view.keys} for r in expected_rows]).to_dict()
        for name, _ in view.columns:
            assert got[name] == [r[name] for r in expected_rows], (view.name, name)


def test_a_batch_over_several_script_calls_still_keeps_the_newer_row_per_entity(redis_stack: Settings) -> None:
    """A batch spans several script calls; each entity is still checked against what is stored."""
    writer, reader = OnlineWriter(redis_stack), OnlineReader(redis_stack, timeout_s=5)
    view = next(v for v in STREAM_VIEWS if v.name == "user_total")
    users = [f"chunked-{i}" for i in range(2 * WRITE_CHUNK + 1)]
    t = 1_700_000_000_000

    def rows(at: list[int], imps: int) -> list[dict]:
        return [{"user_id": u, "event_time": ms, "user_impressions_total": imps, "user_clicks_total": 1,
                 "user_ctr_total": 0.5} for u, ms in zip(users, at)]

    assert writer.write(view.keys, [(view.name, view.columns)], columns_of(rows([t] * len(users), 10))) == len(users)
    mixed = [t + 1 if i % 2 else t - 1 for i in range(len(users))]  # odd users newer, even ones older
    assert writer.write(view.keys, [(view.name, view.columns)], columns_of(rows(mixed, 20))) == WRITE_CHUNK
    got = reader.read(view.keys, [(u,) for u in users], [(view.name, "user_impressions_total")])
    assert [v for (v,) in got] == [20 if i % 2 else 10 for i in range(len(users))]


def test_views_written_together_are_each_checked_against_their_own_stored_row(redis_stack: Settings) -> None:
    """The views sharing a topic are written in one call; a view holding a newer row keeps it while the
    others take the batch's row."""
    writer, reader = OnlineWriter(redis_stack), OnlineReader(redis_stack, timeout_s=5)
    views = [v for v in STREAM_VIEWS if v.topic == "features.user_counts"]
    assert len(views) == 3
    columns = {name: 1 for v in views for name, _ in v.columns}
    t = 1_700_000_000_000
    total = next(v for v in views if v.name == "user_total")
    assert writer.write(total.keys, [(total.name, total.columns)], columns_of([
        {"user_id": "shared", "event_time": t + 5} | columns | {"user_impressions_total": 9}])) == 1
    assert writer.write(total.keys, [(v.name, v.columns) for v in views], columns_of([
        {"user_id": "shared", "event_time": t} | columns | {"user_impressions_total": 4, "user_impressions_5m": 4}])) == 1
    got = reader.read(total.keys, [("shared",)], [("user_total", "user_impressions_total"),
                                                  ("user_5m", "user_impressions_5m")])
    assert got == [(9, 4)]


def test_decoding_of_the_hand_parsed_scalars_matches_protobuf() -> None:
    from feast.protos.feast.types.Value_pb2 import Value

    for value in (0, 1, -1, 127, 128, 2**63 - 1, -(2**63)):
        assert decode(Value(int64_val=value).SerializeToString()) == value
    for value in (0.0, -0.0, 1.5, -1e300, float("inf")):
        assert decode(Value(double_val=value).SerializeToString()) == value
    assert decode(b"") is None and decode(None) is None
    assert decode(Value(string_list_val={"val": ["a", "b"]}).SerializeToString()) == ["a", "b"]
    assert decode(Value(string_val="é").SerializeToString()) == "é"


def test_flywheel_features_shows_what_the_server_reads(redis_stack: Settings) -> None:
    store = apply(redis_stack)
    now = datetime.now(UTC)
    user, item = {"user_id": "cli-user"}, {"item_id": "cli-item"}
    store.write_to_online_store("user_total", pd.DataFrame([user | {
        "user_impressions_total": 3, "user_clicks_total": 1, "user_ctr_total": 1 / 3, TIMESTAMP_FIELD: now}]))
    store.write_to_online_store("user_sequence", pd.DataFrame([user | {
        "seq_item_ids": ["i1", "i2"], "seq_event_types": ["impression", "click"],
        "seq_event_times": [1, 2], TIMESTAMP_FIELD: now}]))
    store.write_to_online_store("item_total", pd.DataFrame([item | {
        "item_impressions_total": 9, "item_clicks_total": 0, "item_ctr_total": 0.0, TIMESTAMP_FIELD: now}]))
    store.write_to_online_store("user_category", pd.DataFrame([user | {
        "category": "Drama", "category_impressions": 2, "category_clicks": 2, "category_ctr": 1.0,
        TIMESTAMP_FIELD: now}]))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")} | to_environ(redis_stack)

    done = run_cli(environ, "features", "--user", "cli-user", "--item", "cli-item", "--category", "Drama", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    expected = store.get_online_features(features=store.get_feature_service("ranking_serving"),
                                         entity_rows=[user | item | {"category": "Drama"}]).to_dict()
    assert got == {name: expected[name][0] for name in got}
    assert got["user_impressions_total"] == 3 and got["seq_item_ids"] == ["i1", "i2"]
    assert got["category_clicks"] == 2 and got["item_impressions_total"] == 9
    assert "user_clicks_5m" in got and got["user_clicks_5m"] is None  # a window without events: null
    only_user = json.loads(run_cli(environ, "features", "--user", "cli-user", "--json").stdout)
    assert only_user == {k: v for k, v in got.items() if not k.startswith(("item_", "category_"))}
    text = run_cli(environ, "features", "--user", "cli-user").stdout
    assert "user_impressions_total" in text and "user_clicks_5m" in text
