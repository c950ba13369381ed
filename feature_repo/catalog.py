"""Slow features from the catalog: item attributes and user profiles, as batch feature views.

They come from the item and user tables the dataset spec declares (a CSV or Parquet file, or MovieLens'
files through the bundled loader), one column per declared attribute, not from events. Each load writes
one Parquet snapshot per view into the offline store, stamped with the time from which it holds (by
default the time of the load), and `materialize` copies what is new into the online store (the
feature_materialization DAG schedules it). Materialization goes by that stamp, so a snapshot older than
the last materialization would never reach the online store: writing one is an error.

The views are the process's dataset spec's (feature_repo/definitions.py): load with the settings of
that spec.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from feature_repo.definitions import BATCH_VIEWS, ITEM_ATTRIBUTES, USER_PROFILE, BatchView, offline_rows
from feature_repo.files import view_dir, write_atomic
from feature_repo.store import apply, feature_store
from feature_repo.tables import catalog_rows
from infra.settings import Settings
from streaming.history import write_item_keys
from streaming.movielens import dataset_dir, load_ratings

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


def load_catalog(s: Settings) -> dict[str, int]:
    """The spec's item and user tables as catalog snapshots, every table checked before any is written.
    MovieLens' hold from its first rating, a file's from 1970-01-02: the catalog exists before any behavior,
    so every label's point-in-time join sees it. Loading it again changes nothing. The items' keys go to the
    stream job too (`write_item_keys`: live events without the key take it from there). Returns rows per view."""
    views = ((ITEM_ATTRIBUTES, s.spec.table("item")), (USER_PROFILE, s.spec.table("user")))
    rows = {view: catalog_rows(s, table) for view, table in views}
    if any(table.source == "movielens" for _, table in views):
        as_of = datetime.fromtimestamp(load_ratings(dataset_dir(s) / "ml-100k.inter")[0].timestamp, UTC)
    else:  # just after the first materialization's start (EPOCH), which it must follow
        as_of = EPOCH + timedelta(days=1)
    apply(s)
    for view, _ in views:
        if not snapshot_path(s, view, as_of).exists():
            write_snapshot(s, view, rows[view], as_of)
    write_item_keys(s)
    return {view.name: len(rows[view]) for view, _ in views}


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
