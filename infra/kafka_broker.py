"""The local stack's broker: Apache Kafka in KRaft mode, a node per address of `kafka.bootstrap_servers`
(each one process, broker and controller: one node by default, a quorum of three in the cluster profile),
its log on disk in the data directory, SASL/SCRAM-SHA-512 on the client listener and ACLs
(infra/kafka_auth.py).

- Listeners, both on the endpoint's host: the client one (`kafka.bootstrap_servers`, SASL_PLAINTEXT with
  SCRAM-SHA-512) and the controller one (its peer port, SASL_PLAINTEXT with PLAIN: the controller reads
  the SCRAM users from the metadata log, so its own listener cannot use them). Each node logs in to the
  controller as `controller`, to brokers as `broker`; both are super users, as is the role `admin`.
- The storage is formatted once, with a SCRAM user per role (`kafka-storage format --add-scram`), from
  passwords generated into the data directory (mode 600); the config holding the controller's password
  is mode 600 too.
- Durability: a record acknowledged is in the OS's page cache, so a crash of the process loses nothing;
  the log is fsynced every `kafka.flush_interval_ms`, which bounds what a power cut can lose.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra import maven
from infra.kafka_auth import ROLES, superusers
from infra.settings import Settings, get_settings, local_secret, peer_port

JARS = "kafka-broker"  # the set in infra/jars.toml
CONTROLLER_USER, BROKER_USER = "controller", "broker"


@dataclass(frozen=True)
class Node:
    """One Kafka process: broker and controller, at one address of `kafka.bootstrap_servers`."""

    id: int
    host: str
    port: int
    name: str  # its service's: "kafka" alone, "kafka-<id>" in a cluster

    @property
    def controller_port(self) -> int:
        return peer_port(self.port)


def nodes(s: Settings) -> list[Node]:
    """A node per address of `kafka.bootstrap_servers` (the cluster profile's three: a KRaft quorum of 3)."""
    addresses = s.kafka.addresses
    return [Node(i, host, port, "kafka" if len(addresses) == 1 else f"kafka-{i}")
            for i, (host, port) in enumerate(addresses, start=1)]


def jars_dir(s: Settings) -> Path:
    return s.paths.cache_dir / "maven" / JARS


def classpath(s: Settings) -> str:
    return ":".join(str(jars_dir(s) / jar.file_name) for jar in maven.jar_set(JARS).jars)


def shared_dir(s: Settings) -> Path:
    """What every node shares: the cluster's id and the internal users' passwords."""
    return s.paths.service_dir("kafka")


def node_dir(s: Settings, node: Node) -> Path:
    return s.paths.service_dir(node.name)


def log_dir(s: Settings, node: Node) -> Path:
    return node_dir(s, node) / "log"


def _secret(s: Settings, user: str) -> str:
    return local_secret(shared_dir(s) / "internal-credentials" / user)


def _jaas(module: str, user: str, password: str, extra: str = "") -> str:
    return f'org.apache.kafka.common.security.{module} required username="{user}" password="{password}"{extra};'


def server_properties(s: Settings, node: Node) -> dict[str, str]:
    cluster = nodes(s)
    controller = _secret(s, CONTROLLER_USER)
    internal = [CONTROLLER_USER, BROKER_USER, *superusers()]
    replicas = str(min(3, len(cluster)))  # the internal topics' (consumer offsets, transactions)
    return {
        "process.roles": "broker,controller",
        "node.id": str(node.id),
        "controller.quorum.voters": ",".join(f"{n.id}@{n.host}:{n.controller_port}" for n in cluster),
        "listeners": f"CLIENT://{node.host}:{node.port},CONTROLLER://{node.host}:{node.controller_port}",
        "advertised.listeners": f"CLIENT://{node.host}:{node.port}",
        "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": "CLIENT",
        "controller.listener.names": "CONTROLLER",
        "listener.name.client.sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.client.scram-sha-512.sasl.jaas.config":
            _jaas("scram.ScramLoginModule", BROKER_USER, _secret(s, BROKER_USER)),
        "listener.name.controller.plain.sasl.jaas.config":
            _jaas("plain.PlainLoginModule", CONTROLLER_USER, controller, f' user_{CONTROLLER_USER}="{controller}"'),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": ";".join(f"User:{u}" for u in internal),
        "log.dirs": str(log_dir(s, node)),
        "num.partitions": str(s.kafka.partitions),
        "default.replication.factor": str(s.kafka.replication_factor),
        "min.insync.replicas": str(s.kafka.min_insync_replicas),
        "offsets.topic.replication.factor": replicas,
        "offsets.topic.num.partitions": "8",  # 50 by default: 50 logs to open and load for a few groups
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": str(s.kafka.min_insync_replicas),
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": str(s.kafka.min_insync_replicas),
        # A node restarted after a crash is unfenced once its old session has expired (9 s by default: the
        # most of a 13 s restart here), and a dead node of a cluster is fenced, its partitions led by
        # others, after as long.
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "1000",
        "unclean.leader.election.enable": "false",  # an out-of-sync replica never leads: nothing acked lost
        "group.initial.rebalance.delay.ms": "0",
        # A consumer's session may be as short as the settings make it (6 s by default, 2 s in the tests);
        # the broker's floor is 6 s by default and refuses a shorter one at JoinGroup.
        "group.min.session.timeout.ms": "1000",
        "auto.create.topics.enable": "false",  # topics come with their partitions (streaming/topics.py)
        "log.flush.interval.ms": str(s.kafka.flush_interval_ms),
        "log.flush.scheduler.interval.ms": str(s.kafka.flush_interval_ms),
        "num.network.threads": "2",
        "num.io.threads": "2",
    }


LOG4J = """rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
"""


def write_config(s: Settings, node: Node) -> Path:
    """server.properties (mode 600: it holds the controller's password) and the log4j2 config."""
    node_dir(s, node).mkdir(parents=True, exist_ok=True)
    config = node_dir(s, node) / "server.properties"
    config.touch(mode=0o600)
    config.write_text("".join(f"{k}={v}\n" for k, v in server_properties(s, node).items()))
    (node_dir(s, node) / "log4j2.properties").write_text(LOG4J)
    return config


# C1 only and the serial collector: on 2 cores the broker's JIT (C2: 6.7 s of CPU in its first minute) and
# G1's threads took CPU from the stream job; while a 100,000-event backlog drained, the broker's share of a
# core fell from 29 % to 18 % with these (`make bench-streaming`, docs/benchmarks.md).
def _java(config_dir: Path, main: str, *args: str, classpath: str, heap: str = "64m") -> list[str]:
    java = shutil.which("java", path=os.path.join(os.environ.get("JAVA_HOME", ""), "bin")) or "java"
    return [java, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={config_dir / 'log4j2.properties'}", "-cp", classpath, main, *args]


def command(s: Settings, node: Node) -> list[str]:
    return _java(node_dir(s, node), "kafka.Kafka", str(write_config(s, node)), classpath=classpath(s),
                 heap=s.kafka.broker_heap)


def cluster_id(s: Settings) -> str:
    """The cluster's id, made once (every node is formatted with it): 16 random bytes in Kafka's base64."""
    path = shared_dir(s) / "cluster-id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:  # Kafka's own ids never start with "-" (a command-line flag)
            text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
            if not text.startswith("-"):
                break
        path.write_text(text)
    return path.read_text().strip()


def format_storage(s: Settings) -> list[str]:
    """Format each node's log directory not yet formatted, with a SCRAM user per role; the nodes formatted."""
    # On the command line for the 3 s the tool runs, once (the tool takes them no other way).
    passwords = {BROKER_USER: _secret(s, BROKER_USER)} | {role: s.kafka.credentials(role)[1] for role in ROLES}
    scram = [arg for user, password in passwords.items()
             for arg in ("--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]")]
    formatted = []
    for node in nodes(s):
        if (log_dir(s, node) / "meta.properties").exists():
            continue
        config = write_config(s, node)
        done = subprocess.run(_java(node_dir(s, node), "kafka.tools.StorageTool", "format", "-t", cluster_id(s),
                                    "-c", str(config), *scram, classpath=classpath(s)),
                              capture_output=True, text=True)
        if done.returncode != 0:  # its output lists the SCRAM salts and keys: only its error is shown
            raise RuntimeError(f"kafka-storage format of {node.name} failed: "
                               f"{done.stderr.strip()[-2000:] or done.stdout[-500:]}")
        formatted.append(node.name)
    return formatted


if __name__ == "__main__":
    settings = get_settings()
    if sys.argv[1:] == ["install"]:
        print(f"ok  the Kafka broker's {len(maven.install(JARS, jars_dir(settings)))} jars in {jars_dir(settings)}")
    elif sys.argv[1:] == ["format"]:
        print(f"formatted: {', '.join(format_storage(settings)) or 'nothing (every node was)'}")
    else:
        sys.exit("usage: python -m infra.kafka_broker install|format")
