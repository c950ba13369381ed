"""Redis clients made from settings: the online store (one server, or a Redis Cluster when
`redis.cluster_nodes` is set), the embedding store (the online store's unless set apart) and the graph
store's server. Every client of the platform gets its connection here, so the switch to a cluster is the
settings' alone."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from infra.settings import Settings, redis_password

OnlineClient = redis.Redis | RedisCluster


def credentials(s: Settings) -> dict[str, str | None]:
    """What every Redis client of the stack logs in with: redis.username (None: the default user), the password."""
    return {"username": s.redis.username or None, "password": redis_password(s)}


def online_store(s: Settings, **options: Any) -> OnlineClient:
    """A client of the online store. On a Redis Cluster every single-key command, and a pipeline of them,
    goes to the node holding its key; a multi-key command must keep its keys in one slot."""
    if s.redis.cluster_nodes:
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in s.redis.nodes],
                            ssl=urlsplit(s.redis.url).scheme == "rediss", **credentials(s), **options)
    return redis.Redis.from_url(s.redis.url, **credentials(s), **options)


def embedding_store(s: Settings, **options: Any) -> OnlineClient:
    """The embedding store's Redis (the sparse tier): its own server at `sparse_tier.redis_url`, else the
    online store's server or cluster."""
    if s.sparse_tier.redis_url:
        return redis.Redis.from_url(s.sparse_tier.redis_url, **credentials(s), **options)
    return online_store(s, **options)


def graph_url(s: Settings) -> str:
    """The graph store's Redis (FalkorDB): its own server where the online store is a cluster."""
    return s.graph.redis_url or s.redis.url


def graph_store(s: Settings, **options: Any) -> redis.Redis:
    return redis.Redis.from_url(graph_url(s), **credentials(s), **options)
