"""A stream feature view is declared once (streaming/features.py); the Feast definitions and the model's
inputs derive from the declaration, whatever the view is called."""

from __future__ import annotations

from datetime import timedelta

import pytest

from contract.inputs import COUNTS, DERIVED, NUMERIC_FEATURES, RATES
from feature_repo.definitions import definitions, stream_feature_view
from infra.settings import load_settings
from streaming.features import BIGINT, DOUBLE, STREAM_VIEWS, StreamView, topics, total_view, window_view


def test_every_stream_view_is_a_feast_view_with_its_declared_ttl_schema_and_push_source() -> None:
    s = load_settings({}, config_file=None)
    feast_views = {d.name: d for d in definitions(s) if d.name in {v.name for v in STREAM_VIEWS}}
    assert set(feast_views) == {v.name for v in STREAM_VIEWS}
    for view in STREAM_VIEWS:
        fv = feast_views[view.name]
        assert fv.ttl == view.ttl
        assert {f.name for f in fv.features} == {name for name, _ in view.columns}
        assert fv.stream_source.name == view.push_source


def test_a_new_declaration_is_all_the_store_needs() -> None:
    s = load_settings({}, config_file=None)
    view = StreamView("session_depth", ("user_id",), (("pages_seen", BIGINT), ("dwell_share", DOUBLE)),
                      timedelta(minutes=30), upsert=True, query=lambda _: "SELECT ...")
    fv = stream_feature_view(s, view)
    assert (fv.name, fv.ttl, fv.entities) == ("session_depth", timedelta(minutes=30), ["user"])
    assert window_view("item", "1h").ttl == timedelta(hours=1)  # the window's length, not parsed from the name


def test_the_model_takes_every_scalar_stream_column_scaled_by_its_type() -> None:
    scalars = {name: t for view in STREAM_VIEWS for name, t in view.columns if t in (BIGINT, DOUBLE)}
    assert set(COUNTS) == {n for n, t in scalars.items() if t == BIGINT}
    assert set(RATES) == {n for n, t in scalars.items() if t == DOUBLE}
    assert set(NUMERIC_FEATURES) == set(scalars) | {"user_age", "item_release_year", *DERIVED}


def test_an_entitys_windows_and_total_share_one_topic_and_sharing_views_must_agree() -> None:
    shared = topics()
    assert [v.name for v in shared["features.user_counts"]] == ["user_5m", "user_1h", "user_total"]
    assert [v.name for v in shared["features.user_sequence"]] == ["user_sequence"]
    odd = StreamView("user_odd", ("user_id", "category"), (("odd", BIGINT),), timedelta(hours=1), upsert=True,
                     query=lambda _: "SELECT ...", shared_topic="user_counts")
    with pytest.raises(ValueError, match="features.user_counts"):
        topics((window_view("user", "5m"), total_view("user"), odd))
