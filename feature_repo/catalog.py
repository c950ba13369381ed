"""Slow features from the catalog: item attributes and user profiles, as batch feature views.

They come from side tables, not from events: each load writes one Parquet snapshot per view into the
offline store, stamped with the time from which it holds (by default the time of the load), and
`materialize` copies what is new into the online store (the feature_materialization DAG schedules
it). Materialization goes by that stamp, so a snapshot older than the last materialization would
never reach the online store: writing one is an error.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from feature_repo.definitions import (
    BATCH_VIEWS, ITEM_ATTRIBUTES, USER_PROFILE, BatchView, offline_rows)
from feature_repo.files import view_dir, write_atomic
from feature_repo.store import apply, feature_store
from infra.settings import Settings
from streaming.movielens import dataset_dir, load_ratings, load_side_table

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def snapshot_path(s: Settings, view: BatchView, as_of: datetime) -> Path:
    return view_dir(s, view.name) / f"snapshot-{as_of:%Y%m%dT%H%M%S%f}.parquet"


def write_snapshot(s: Settings, view: BatchView, rows: list[dict], as_of: datetime | None = None) -> Path:
    """Write `rows` (one dict per entity) as the view's snapshot holding from `as_of` (now)."""
    as_of = as_of or datetime.now(UTC)
    materialized = feature_store(s).get_feature_view(view.name).most_recent_end_time
    if materialized and as_of <= materialized:
        raise ValueError(f"{view.name}: a snapshot as of {as_of.isoformat()} is not newer than the last "
                         f"materialization ({materialized.isoformat()}) and would never be served online")
    return write_atomic(offline_rows(view, rows, as_of), snapshot_path(s, view, as_of))


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def load_movielens(s: Settings) -> dict[str, int]:
    """MovieLens-100k's item attributes and user profiles, as of its first rating (the catalog
    exists before any behavior, so every label's point-in-time join sees it). Loading it again
    changes nothing. Returns rows per view."""
    data = dataset_dir(s)
    as_of = datetime.fromtimestamp(load_ratings(data / "ml-100k.inter")[0].timestamp, UTC)
    items = [{"item_id": r["item_id"], "item_genres": r["class"].split(" ") if r.get("class") else [],
              "item_release_year": _int(r.get("release_year", ""))}
             for r in load_side_table(data / "ml-100k.item")]
    users = [{"user_id": r["user_id"], "user_age": _int(r["age"]), "user_gender": r["gender"],
              "user_occupation": r["occupation"]}
             for r in load_side_table(data / "ml-100k.user")]
    apply(s)
    for view, rows in ((ITEM_ATTRIBUTES, items), (USER_PROFILE, users)):
        if not snapshot_path(s, view, as_of).exists():
            write_snapshot(s, view, rows, as_of)
    return {ITEM_ATTRIBUTES.name: len(items), USER_PROFILE.name: len(users)}


def materialize(s: Settings, end: datetime | None = None) -> list[str]:
    """Copy the batch views' rows newer than their last materialization (all on the first run) up to
    `end` (now) into the online store. Returns the views materialized."""
    store = feature_store(s)
    end = end or datetime.now(UTC)
    done = []
    for spec in BATCH_VIEWS:
        view = store.get_feature_view(spec.name)
        # Not materialize_incremental: on a first run it looks back only a year, and catalog
        # snapshots can be older (MovieLens' is from 1997).
        start = view.most_recent_end_time or EPOCH
        store.materialize(start_date=start, end_date=end, feature_views=[spec.name])
        done.append(spec.name)
    return done
