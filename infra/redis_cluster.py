"""Forms the local stack's Redis Cluster (`python -m infra.redis_cluster`, once its nodes run): the 16,384
hash slots split evenly over the masters of `redis.cluster_nodes`, which then meet. Idempotent: a cluster
already formed is left as it is."""

from __future__ import annotations

import time

import redis

from infra.redis_clients import credentials
from infra.settings import Settings, get_settings, peer_port

SLOTS = 16384


def node(s: Settings, host: str, port: int) -> redis.Redis:
    return redis.Redis(host=host, port=port, **credentials(s), socket_timeout=5, decode_responses=True)


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO of one node (redis-py parses it into a dict, or returns the text, by version)."""
    info = client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return {k: str(v) for k, v in info.items()}
    return dict(line.split(":", 1) for line in info.splitlines() if ":" in line)


def cluster_state(client: redis.Redis) -> str:
    return cluster_info(client).get("cluster_state", "?")


def form(s: Settings, timeout_s: float = 60.0) -> None:
    nodes = [node(s, host, port) for host, port in s.redis.nodes]
    if len(nodes) < 3:
        raise SystemExit(f"redis.cluster_nodes: a Redis Cluster needs at least 3 masters, got {len(nodes)}")
    if any(cluster_info(n).get("cluster_slots_assigned", "0") != "0" for n in nodes):
        print("cluster already formed")
    else:
        for i, n in enumerate(nodes):
            n.execute_command("CLUSTER ADDSLOTSRANGE", i * SLOTS // len(nodes), (i + 1) * SLOTS // len(nodes) - 1)
        for host, port in s.redis.nodes[1:]:
            nodes[0].execute_command("CLUSTER MEET", host, port, peer_port(port))
    deadline = time.monotonic() + timeout_s
    while (states := [cluster_state(n) for n in nodes]) != ["ok"] * len(nodes):
        if time.monotonic() > deadline:
            raise SystemExit(f"Redis Cluster not ok after {timeout_s:.0f}s: cluster_state {states}")
        time.sleep(0.2)
    print(f"Redis Cluster ok: {len(nodes)} masters")


if __name__ == "__main__":
    form(get_settings())
