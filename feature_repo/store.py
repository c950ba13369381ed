"""The Feast store, configured from settings: Redis online, Parquet files offline, a file registry."""

from __future__ import annotations

from urllib.parse import urlsplit

from feast import FeatureStore, RepoConfig

from feature_repo.definitions import definitions, offline_dir
from infra.settings import Settings

PROJECT = "flywheel"


def redis_connection_string(s: Settings) -> str:
    """Feast's `host:port,db=N[,password=...][,ssl=true]` form of settings.redis.url."""
    url = urlsplit(s.redis.url)
    parts = [f"{url.hostname}:{url.port or 6379}", f"db={int(url.path.strip('/') or 0)}"]
    if s.redis.password:
        parts.append(f"password={s.redis.password}")
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
        online_store={"type": "redis", "connection_string": redis_connection_string(s), "skip_dedup": True},
        offline_store={"type": "file"},
        entity_key_serialization_version=3,
        repo_path=str(offline_dir(s)),
    )


def feature_store(s: Settings) -> FeatureStore:
    return FeatureStore(config=repo_config(s))


def apply(s: Settings) -> FeatureStore:
    """Register every definition (idempotent) and return the store."""
    store = feature_store(s)
    store.apply(definitions(s))
    return store
