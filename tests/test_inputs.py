"""Model inputs from feature rows (`contract.transform.to_examples`, shared by training and serving): each
candidate gets the long history of its own category, its category's shares, the recent behaviors
with their types, and the catalog's attributes as tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from contract.examples import PAD
from contract.inputs import NUMERIC_FEATURES, RAW_FEATURES, TOKENS
from contract.transform import entity_tokens, to_examples
from feature_repo.definitions import TIMESTAMP_FIELD, offline_schema
from feature_repo.files import MergingWriter, view_dir
from infra.settings import load_settings
from models.dataset import as_of, long_history_as_of
from streaming.features import LONG_HISTORY_VIEW, STREAM_VIEWS


def test_each_candidate_gets_its_categorys_long_history_shares_and_attributes() -> None:
    n = 3
    user = {  # one object per value, as a request's rows share the user's (serving)
        "history_length": 3, "history_categories": ["Drama", "Comedy"], "history_category_counts": [2, 1],
        "history_item_ids": ["d2", "d1", PAD, "c1", PAD, PAD],
        "history_event_types": ["click", "impression", PAD, "purchase", PAD, PAD],
        "interest_categories": ["Comedy", "Drama"], "interest_weights": [3.0, 1.0],
        "seq_item_ids": ["c1", "d1", "d2"], "seq_event_types": ["click", "purchase", "click"],
        "seq_event_times": [100, 200, 900], "user_age": 25, "user_gender": "F", "user_occupation": "writer"}
    columns = {name: [None] * n for name in RAW_FEATURES} | {name: [v] * n for name, v in user.items()} | {
        "user_id": ["u1"] * n, "item_id": ["i1", "i2", "i3"], "category": ["Drama", "Comedy", "Horror"],
        "item_genres": [["Drama", "Romance"], ["Comedy"], None], "item_release_year": [1995, None, 1931]}
    ex = to_examples(columns, np.full(n, 500), np.zeros(n), sequence_length=4)

    assert ex.long_sequences.tolist() == [["d2", "d1"], ["c1", PAD], [PAD, PAD]]
    assert ex.long_types.tolist() == [["click", "impression"], ["purchase", PAD], [PAD, PAD]]
    share = NUMERIC_FEATURES.index("history_category_share")
    interest = NUMERIC_FEATURES.index("interest_category_share")
    np.testing.assert_allclose(ex.numeric[:, share], [2 / 3, 1 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(ex.numeric[:, interest], [0.25, 0.75, 0.0], rtol=1e-6)
    np.testing.assert_allclose(ex.numeric[:, NUMERIC_FEATURES.index("history_length")], np.log1p(3), rtol=1e-6)
    # behaviors before the request (t = 500), newest first, with their types
    assert ex.sequences[0].tolist() == ["d1", "c1", PAD, PAD]
    assert ex.sequence_types[0].tolist() == ["purchase", "click", PAD, PAD]
    # how often those behaviors are the candidate (a reorder's signal): d2 came after the request
    again = to_examples(columns | {"item_id": ["d1", "d2", "c1"]}, np.full(n, 500), np.zeros(n), sequence_length=4)
    np.testing.assert_allclose(again.numeric[:, NUMERIC_FEATURES.index("user_item_repeats")], np.log1p([1, 0, 1]))
    assert ex.numeric[:, NUMERIC_FEATURES.index("user_item_repeats")].tolist() == [0.0] * n
    assert [[t for t in row if t] for row in ex.item_tokens] == [
        ["genre:Drama", "genre:Romance", "year:1990s"], ["genre:Comedy"], ["year:1930s"]]
    assert [t for t in ex.user_tokens[0] if t] == ["gender:F", "occupation:writer", "age:20s"]
    # serving builds each entity's tokens once (`entity_tokens`) and passes them: the same rows
    given = columns | {column: [entity_tokens(column, {f: columns[f][r] for _, f in pairs}) for r in range(n)]
                       for column, pairs in TOKENS.items()}
    again = to_examples(given, np.full(n, 500), np.zeros(n), sequence_length=4)
    assert again.item_tokens.tolist() == ex.item_tokens.tolist()
    assert again.user_tokens.tolist() == ex.user_tokens.tolist()
    assert ex.numeric_names == NUMERIC_FEATURES
    # a training frame holds each row's own copy of the user's lists (serving's rows share one, computed
    # once per request and category): the same inputs either way
    copied = {name: [list(v) if isinstance(v, list) else v for v in values] for name, values in columns.items()}
    own = to_examples(copied, np.full(n, 500), np.zeros(n), sequence_length=4)
    for part in ("categories", "numeric", "sequences", "sequence_types", "long_sequences", "long_types",
                 "item_tokens", "user_tokens"):
        assert getattr(own, part).tolist() == getattr(ex, part).tolist(), part
    # the training join's label_weight (a label's declared value over its window's mean): each example's weight in
    # the loss; a frame without it (serving's, a spec declaring none) weighs each 1
    weighed = to_examples(columns | {"label_weight": [2.5, 1.0, 0.5]}, np.full(n, 500), np.ones(n), sequence_length=4)
    assert weighed.weights.tolist() == [2.5, 1.0, 0.5] and ex.weights.tolist() == [1.0] * n


def test_training_rows_read_the_long_history_point_in_time_and_only_their_category(tmp_path: Path) -> None:
    (tmp_path / "flywheel.toml").write_text("")
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=tmp_path / "flywheel.toml")
    at = pd.Timestamp("2026-01-01", tz="UTC")

    def history(user: str, seconds: int, length: int, items: list[str]) -> dict:
        return {"user_id": user, "history_length": length, "history_categories": ["c1", "c2"],
                "history_category_counts": [length - 1, 1], "history_item_ids": items,
                "history_event_types": ["click"] * 4, TIMESTAMP_FIELD: at + pd.Timedelta(seconds=seconds)}

    rows = [history("u1", 10, 5, ["a", "b", "x", PAD]), history("u1", 20, 7, ["c", "a", "y", PAD]),
            history("u1", 400 * 86_400, 9, ["d", "c", "y", PAD])]  # a row of the future
    directory = view_dir(s, LONG_HISTORY_VIEW.name)
    directory.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=offline_schema(LONG_HISTORY_VIEW)), directory / "0.parquet")
    entities = pd.DataFrame({"row": range(5), "user_id": ["u1", "u1", "u1", "u2", "u1"],
                             "category": ["c1", "c2", "c1", "c1", "c1"],
                             "event_timestamp": [at + pd.Timedelta(seconds=t) for t in (15, 25, 5, 25, 380 * 86_400)]})
    got = long_history_as_of(s, entities).set_index("row")

    assert got.loc[0, "history_length"] == 5 and list(got.loc[0, "history_item_ids"]) == ["a", "b"]
    assert list(got.loc[0, "history_categories"]) == ["c1"] and list(got.loc[0, "history_category_counts"]) == [4]
    assert got.loc[1, "history_length"] == 7 and list(got.loc[1, "history_item_ids"]) == ["y", PAD]
    assert list(got.loc[1, "history_event_types"]) == ["click", "click"]
    for row in (2, 3, 4):  # before the first row; another user; the newest row before is past its TTL
        assert pd.isna(got.loc[row, "history_length"]) and pd.isna(got.loc[row, "history_item_ids"])


def test_training_rows_read_each_views_newest_row_before_them_within_its_ttl_the_last_written_of_a_tie(
        tmp_path: Path) -> None:
    (tmp_path / "flywheel.toml").write_text("")
    s = load_settings({"FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)}, config_file=tmp_path / "flywheel.toml")
    at = pd.Timestamp("2026-01-01", tz="UTC")
    views = {v.name: v for v in STREAM_VIEWS}

    def write(view: str, name: str, rows: list[dict]) -> None:
        directory = view_dir(s, view)
        directory.mkdir(parents=True, exist_ok=True)
        full = [r | {TIMESTAMP_FIELD: at + pd.Timedelta(seconds=r.pop("t"))} for r in rows]
        pq.write_table(pa.Table.from_pylist(full, schema=offline_schema(views[view])), directory / name)

    def counts(user: str, t: int, imps: int, **keys: str) -> dict:
        return {"user_id": user, **keys, "t": t, **dict(zip(
            ("category_impressions", "category_clicks", "category_ctr") if keys else
            ("user_impressions_5m", "user_clicks_5m", "user_ctr_5m"), (imps, 0, 0.0)))}

    # Three updates in the same millisecond: the count after all of them is the last written.
    write("user_5m", "part-0000-000000000000-a.parquet",
          [counts("u1", 10, 1), counts("u1", 20, 2), counts("u1", 20, 3)])
    write("user_5m", "part-0000-000000000003-b.parquet", [counts("u1", 20, 4), counts("u1", 600, 9)])
    write("user_category", "part-0000-000000000000-c.parquet",
          [counts("u1", 10, 5, category="c1"), counts("u1", 12, 6, category="c2")])
    entities = pd.DataFrame({"row": range(5), "user_id": ["u1", "u1", "u1", "u2", "u1"],
                             "item_id": ["i1"] * 5, "category": ["c1", "c2", "c1", "c1", "c2"],
                             "event_timestamp": [at + pd.Timedelta(seconds=x) for x in (15, 25, 5, 25, 500)]})
    got = as_of(s, entities).set_index("row")

    assert got.loc[0, "user_impressions_5m"] == 1 and got.loc[1, "user_impressions_5m"] == 4
    assert got.loc[0, "category_impressions"] == 5 and got.loc[1, "category_impressions"] == 6  # by both keys
    for row in (2, 3):  # before the first row; another user
        assert pd.isna(got.loc[row, "user_impressions_5m"]) and pd.isna(got.loc[row, "category_impressions"])
    assert pd.isna(got.loc[4, "user_impressions_5m"])  # the newest row before is past the view's 5 minutes
    assert got.loc[4, "category_impressions"] == 6  # a year's TTL
    assert got["item_ctr_total"].isna().all() and list(got["user_id"]) == list(entities["user_id"])  # no rows

    # The ingestor's merge of its small files (one per micro-batch) changes no answer: ties stay in written order.
    offline = MergingWriter(merge_after_s=3600, max_rows=35)
    for k in range(40):  # a partition's many small files, a tie across two of them at t=700
        row = counts("u3", 700 if k >= 38 else 650 + k, k)
        row[TIMESTAMP_FIELD] = at + pd.Timedelta(seconds=row.pop("t"))
        offline.write(view_dir(s, "user_5m"), f"part-0000-{10 + k:012d}-x.parquet", 0,
                      pa.Table.from_pylist([row], schema=offline_schema(views["user_5m"])))
    later = pd.DataFrame({"row": range(3), "user_id": ["u3", "u3", "u1"], "item_id": ["i1"] * 3,
                          "category": ["c1"] * 3, "event_timestamp": [at + pd.Timedelta(seconds=x)
                                                                        for x in (670, 800, 25)]})
    unmerged = as_of(s, later).set_index("row")
    assert offline.merged == 34  # 35 rows: written as one file
    offline.close()  # the last 5 as one more
    assert offline.merged == 38 and sorted(p.name for p in view_dir(s, "user_5m").glob("*.parquet")) == [
        "part-0000-000000000000-a.parquet", "part-0000-000000000003-b.parquet",
        "part-0000-000000000010-x.parquet", "part-0000-000000000045-x.parquet"]
    merged = as_of(s, later).set_index("row")
    pd.testing.assert_frame_equal(unmerged, merged)
    assert list(merged["user_impressions_5m"]) == [20, 39, 4]  # at t=700 the last written of the tie


def test_a_batch_read_again_never_merges_away_the_file_it_rewrites(tmp_path: Path) -> None:
    """A commit not taken: the ingestor reads a batch again and writes it under its name, inside a run of
    files not merged yet. Every row stays on disk; the run before it is left as it was."""
    offline = MergingWriter(merge_after_s=3600)
    for name in ("a", "b", "c", "a", "d"):  # "a" again: the records after it follow again
        offline.write(tmp_path, f"part-0000-{name}.parquet", 0, pa.table({"x": [name]}))
    offline.close()
    files = sorted(tmp_path.glob("*.parquet"))
    assert [(f.name, pq.read_table(f)["x"].to_pylist()) for f in files] == [
        ("part-0000-a.parquet", ["a", "d"]), ("part-0000-b.parquet", ["b"]), ("part-0000-c.parquet", ["c"])]


def test_a_scan_the_writer_merges_under_reads_every_row_once(tmp_path: Path) -> None:
    """A reader pins its files (feature_repo/files.py: pinned): a merge while it reads (the first file
    rewritten, the rest removed) changes nothing it reads, whether DuckDB scans them (training's joins) or
    Arrow does (the logs' read_days); the next listing finds the merged file with the same rows."""
    import duckdb

    from feature_repo.files import pinned, read_days
    from models.dataset import newest_per_time

    offline = MergingWriter(merge_after_s=3600)
    day = tmp_path / "date=2026-12-05"
    for k in range(6):  # the key u1 written at t=1 twice: the second write is its newest
        offline.write(day, f"part-0000-{k:012d}-x.parquet", 0,
                      pa.table({"user_id": [f"u{k % 3}", "u1"], "t": [k, 1], "n": [k, 10 + k]}))
    listing = lambda: sorted(day.glob("*.parquet"))  # noqa: E731
    with pinned(listing) as files, duckdb.connect() as con:
        offline.close()  # merged as the reader holds the six files
        assert len(listing()) == 1 and offline.merged == 5
        held = con.sql(f"SELECT user_id, t, n FROM ({newest_per_time(files, ('user_id',), 't')}) ORDER BY n").fetchall()
        assert con.sql(f"SELECT count(*) FROM read_parquet({files!r})").fetchall() == [(12,)]
        logged = read_days(tmp_path, pa.schema([("user_id", pa.string()), ("t", pa.int64()), ("n", pa.int64())]))
    assert logged.num_rows == 12
    with pinned(listing) as files, duckdb.connect() as con:
        assert con.sql(f"SELECT user_id, t, n FROM ({newest_per_time(files, ('user_id',), 't')}) ORDER BY n"
                       ).fetchall() == held
    assert ("u1", 1, 15) in held and ("u1", 1, 11) not in held  # a tie: the last written
