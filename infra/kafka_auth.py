"""Who may do what on the platform's Kafka: one principal per role, and the ACLs each role is granted.

Every Kafka client of the platform names its role (`KafkaSettings.client_options(client, role)`); on the
local stack each role is a SCRAM-SHA-512 user of the same name, created when the broker's storage is
formatted, with a password generated into the stack's data directory (mode 600). The broker runs
`StandardAuthorizer` with `allow.everyone.if.no.acl.found=false`: a role can do only what is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.settings import Settings

# Topic and group kinds a role is granted by; `topics_of` and `groups_of` name them.
Kind = str


@dataclass(frozen=True)
class KafkaRole:
    doc: str
    reads: tuple[Kind, ...] = ()
    writes: tuple[Kind, ...] = ()
    groups: tuple[Kind, ...] = ()  # consumer groups it may join
    superuser: bool = False  # topics, ACLs and every group's offsets (health, status, lag)


ROLES: dict[str, KafkaRole] = {
    "producer": KafkaRole("outside producers of events: a company's services, the demo's traffic",
                          writes=("events",)),
    "stream": KafkaRole("the stream job (Flink): events in, feature rows and dead letters out",
                        reads=("events",), writes=("features", "events.dlq"), groups=("stream-job",)),
    "pipeline": KafkaRole("the feature ingestor, the near-line embedder, the event log and the prediction "
                          "archive: consumers that dead-letter what they cannot read",
                          reads=("events", "features", "predictions"), writes=("features.dlq", "predictions.dlq"),
                          groups=("platform",)),
    "serving": KafkaRole("the serving tier: its prediction log, and the sparse tier's deltas it follows",
                         reads=("deltas",), writes=("predictions",), groups=("sparse-deltas",)),
    "trainer": KafkaRole("training: a version's sparse-tier delta announced to the servers", writes=("deltas",)),
    "admin": KafkaRole("the platform's administration: topics, ACLs, health and lag", superuser=True),
}


def groups_of(s: Settings, kind: Kind) -> tuple[str, str]:
    """(pattern type, name) of a group kind: "PREFIXED" is every group whose id starts with the name."""
    return {
        "stream-job": ("LITERAL", s.streaming.consumer_group),
        "platform": ("PREFIXED", "flywheel-"),
        "sparse-deltas": ("PREFIXED", "sparse-deltas-"),
    }[kind]


def topics_of(s: Settings, kind: Kind, feature_topics: list[str]) -> list[str]:
    dlq = s.kafka.dlq_topic
    return {
        "events": [s.kafka.events_topic],
        "events.dlq": [dlq(s.kafka.events_topic)],
        "features": feature_topics,
        "features.dlq": [dlq(t) for t in feature_topics],
        "predictions": [s.serving.predictions_topic],
        "predictions.dlq": [dlq(s.serving.predictions_topic)],
        "deltas": [s.sparse_tier.deltas_topic],
    }[kind]


@dataclass(frozen=True)
class Acl:
    principal: str  # "User:<name>"
    resource: str  # "TOPIC" or "GROUP"
    pattern: str  # "LITERAL" or "PREFIXED"
    name: str
    operation: str  # "READ", "WRITE", "DESCRIBE"


def acls(s: Settings, feature_topics: list[str]) -> list[Acl]:
    """Every ACL of every non-superuser role (a write implies describe; a read, describe too)."""
    out: list[Acl] = []
    for name, role in ROLES.items():
        principal = f"User:{name}"
        for operation, kinds in (("READ", role.reads), ("WRITE", role.writes)):
            out += [Acl(principal, "TOPIC", "LITERAL", topic, operation)
                    for kind in kinds for topic in topics_of(s, kind, feature_topics)]
        out += [Acl(principal, "GROUP", *groups_of(s, kind), "READ") for kind in role.groups]
    return out


def superusers() -> list[str]:
    return [name for name, role in ROLES.items() if role.superuser]
