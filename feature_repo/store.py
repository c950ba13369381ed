"""The Feast store, configured from settings: Redis online, Parquet files read by DuckDB offline, a
file registry."""

from __future__ import annotations

import hashlib
import warnings
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

from feast import FeatureStore, RepoConfig

from feature_repo.definitions import (
    BATCH_VIEWS, GRAPH_VIEWS, BatchView, definitions, offline_rows, offline_schema)
from feature_repo.files import offline_dir, view_dir, write_atomic
from feature_repo.online import PROJECT, write_layout
from infra.settings import Settings, redis_password
from streaming.features import STREAM_VIEWS


# Feast's DuckDB store calls an ibis method that warns on every query; not ours to fix.
warnings.filterwarnings("ignore", message="fetch_arrow_table", category=DeprecationWarning)


def redis_connection_string(s: Settings) -> str:
    """Feast's `host:port,db=N[,password=...][,ssl=true]` form of settings.redis.url, or for a Redis Cluster
    `host:port,host:port,...[,password=...][,ssl=true]` of redis.cluster_nodes."""
    url = urlsplit(s.redis.url)
    parts = ([f"{host}:{port}" for host, port in s.redis.nodes] if s.redis.cluster_nodes else
             [f"{url.hostname}:{url.port or 6379}", f"db={int(url.path.strip('/') or 0)}"])
    if s.redis.username:
        parts.append(f"username={s.redis.username}")
    if password := redis_password(s):
        parts.append(f"password={password}")
    if url.scheme == "rediss":
        parts.append("ssl=true")
    return ",".join(parts)


def repo_config(s: Settings) -> RepoConfig:
    registry = s.paths.service_dir("feast") / "registry.db"
    registry.parent.mkdir(parents=True, exist_ok=True)
    return RepoConfig(
        project=PROJECT,
        provider="local",
        registry={"registry_type": "file", "path": str(registry), "cache_ttl_seconds": 60},
        # Rows of one entity arrive in order on one partition, so the newest write is the newest row:
        # the per-row timestamp check (an extra round trip, and it drops same-millisecond updates of
        # the behavior sequence) is not needed.
        online_store={"type": "redis", "connection_string": redis_connection_string(s), "skip_dedup": True,
                      "redis_type": "redis_cluster" if s.redis.cluster_nodes else "redis"},
        # DuckDB, not the file (dask) store: the latter can join an older row when a view's rows span
        # several Parquet files, which breaks point-in-time correctness.
        offline_store={"type": "duckdb"},
        entity_key_serialization_version=3,
        repo_path=str(offline_dir(s)),
    )


def feature_store(s: Settings) -> FeatureStore:
    return FeatureStore(config=repo_config(s))


def apply(s: Settings) -> FeatureStore:
    """Register every definition (idempotent) and return the store."""
    store = feature_store(s)
    store.apply(definitions(s))
    write_layout(s, {service.name: [(tuple(store.get_feature_view(p.name).join_keys), p.name_to_use(),
                                     [f.name for f in p.features]) for p in service.feature_view_projections]
                     for service in store.list_feature_services()})
    for spec in (*STREAM_VIEWS, *BATCH_VIEWS, *GRAPH_VIEWS):
        # A zero-row file with the view's schema: a training set over a view with no rows yet gets
        # missing values (the documented defaults) instead of a "no files found" error.
        empty = view_dir(s, spec.name) / "schema.parquet"
        if not empty.exists():
            write_atomic(offline_schema(spec).empty_table(), empty)
    return store


def online_row(store: FeatureStore, features: list[str], entity_row: dict[str, str]) -> dict:
    """`get_online_features` for one entity, as {name: value} (None where nothing is stored)."""
    got = store.get_online_features(features=features, entity_rows=[entity_row]).to_dict()
    return {name: values[0] for name, values in got.items()}


def write_rows(s: Settings, spec: BatchView, rows: list[dict], as_of: datetime) -> Path:
    """Rows computed outside the stream job (item neighbours from the graph), valid from `as_of`: one
    Parquet file in the view's offline directory, for point-in-time training sets, and the same rows
    online. Writing the same rows again rewrites the same file."""
    table = offline_rows(spec, rows, as_of)
    keys = "\n".join(str(r[k]) for r in rows for k in spec.keys).encode()
    path = write_atomic(table, view_dir(s, spec.name) /
                        f"{as_of:%Y%m%dT%H%M%S%f}-{hashlib.sha256(keys).hexdigest()[:12]}.parquet")
    if rows:
        feature_store(s).write_to_online_store(spec.name, table.to_pandas())
    return path
