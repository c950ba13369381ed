"""Batch feature views: MovieLens' item attributes and user profiles loaded into the offline store,
materialized into the real Redis, and joined point-in-time correct."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from feature_repo.catalog import load_catalog, materialize, write_snapshot
from feature_repo.definitions import USER_PROFILE
from feature_repo.store import feature_store, online_row
from infra.settings import Settings
from streaming.movielens import dataset_dir

pytestmark = pytest.mark.stack

PROFILE = ["user_profile:user_age", "user_profile:user_gender", "user_profile:user_occupation"]


def _raw(path: Path) -> dict[str, list[str]]:
    """The rows of a MovieLens side file by id, read independently of the loader."""
    with open(path, encoding="latin-1") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    return {row[0]: row for row in rows[1:]}


def _online(s: Settings, features: list[str], **entity: str) -> dict:
    return online_row(feature_store(s), features, entity)


def test_catalog_materializes_online_and_joins_point_in_time(redis_stack: Settings) -> None:
    s = redis_stack
    assert load_catalog(s) == {"item_attributes": 1682, "user_profile": 943}
    assert materialize(s) == ["item_attributes", "user_profile"]

    raw_items = _raw(dataset_dir(s) / "ml-100k.item")
    raw_users = _raw(dataset_dir(s) / "ml-100k.user")
    for item_id in ("1", "267", "1682"):
        _, _, year, genres = raw_items[item_id]
        got = _online(s, ["item_attributes:item_genres", "item_attributes:item_release_year"], item_id=item_id)
        assert got["item_genres"] == genres.split(" ")
        assert got["item_release_year"] == (int(year) if year.isdigit() else None)
    _, age, gender, occupation, _ = raw_users["2"]
    assert _online(s, PROFILE, user_id="2") == {"user_id": "2", "user_age": int(age), "user_gender": gender,
                                                 "user_occupation": occupation}
    assert _online(s, PROFILE, user_id="no-such-user")["user_age"] is None

    assert load_catalog(s) == {"item_attributes": 1682, "user_profile": 943}  # idempotent
    changed = [{"user_id": "2", "user_age": int(age) + 1, "user_gender": gender, "user_occupation": "writer"}]
    with pytest.raises(ValueError, match="not newer than the last materialization"):
        write_snapshot(s, USER_PROFILE, changed, datetime(2020, 1, 1, tzinfo=UTC))

    # A newer snapshot: the next materialization brings it online; training sets keep seeing the
    # old profile before its time.
    changed_at = datetime.now(UTC)
    write_snapshot(s, USER_PROFILE, changed, changed_at)
    materialize(s)
    assert _online(s, PROFILE, user_id="2")["user_occupation"] == "writer"
    labels = pd.DataFrame({"user_id": "2", "event_timestamp": [
        datetime(1997, 1, 1, tzinfo=UTC), datetime(1998, 3, 1, tzinfo=UTC), changed_at + timedelta(seconds=1)]})
    got = feature_store(s).get_historical_features(entity_df=labels, features=PROFILE).to_df()
    got = got.sort_values("event_timestamp").reset_index(drop=True)
    assert pd.isna(got.user_age[0])  # before the catalog existed
    assert (got.user_age[1], got.user_occupation[1]) == (int(age), occupation)
    assert (got.user_age[2], got.user_occupation[2]) == (int(age) + 1, "writer")
