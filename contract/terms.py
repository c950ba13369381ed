"""A model version's terms: what it was trained with, recorded with it, and checked by a server before
it serves the version. A version whose event types, numeric inputs or attribute tokens the server's
online features do not offer (another dataset spec, a view since removed) is refused with the reason:
its type embedding or its inputs would be silently wrong.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from contract.inputs import CONTEXT_TOKEN_FIELDS, NUMERIC_FEATURES, TOKENS
from streaming.events import dataset_spec


@dataclass(frozen=True)
class Terms:
    dataset: str  # the spec's [dataset] name
    event_types: tuple[str, ...]  # the behaviors' vocabulary, in the spec's order (the type ids)
    numeric_features: tuple[str, ...]
    # "<entity>_tokens:<prefix>" of each attribute that gives tokens, "context_tokens:<name>" of each context field
    tokens: tuple[str, ...]

    @property
    def digest(self) -> str:
        """Twelve hex digits of the terms, as a version's `contract` tag records them."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


CONTEXT_TOKENS = "context_tokens"


def token_prefixes() -> tuple[str, ...]:
    return (*(f"{column}:{prefix}" for column, pairs in TOKENS.items() for prefix, _ in pairs),
            *(f"{CONTEXT_TOKENS}:{name}" for name in CONTEXT_TOKEN_FIELDS))


def context_fields(tokens: tuple[str, ...]) -> tuple[str, ...]:
    """The context fields a version reads as tokens, from its terms' tokens (`token_prefixes`)."""
    return tuple(t.partition(":")[2] for t in tokens if t.partition(":")[0] == CONTEXT_TOKENS)


def offered() -> Terms:
    """What this process's dataset spec and stream views give a model."""
    spec = dataset_spec()
    return Terms(spec.name, spec.type_names, NUMERIC_FEATURES, token_prefixes())


def unmet(wanted: Terms, have: Terms | None = None) -> list[str]:
    """What of `wanted` (a version's terms) `have` (default: `offered()`) lacks, one reason each; empty:
    servable. Terms a version predates (recorded empty) are not checked."""
    have = have or offered()
    reasons = []
    if wanted.event_types and wanted.event_types != have.event_types:
        reasons.append(f"trained on event types {list(wanted.event_types)} (dataset {wanted.dataset or '?'}), the "
                       f"stream's are {list(have.event_types)} (dataset {have.dataset})")
    if missing := [f for f in wanted.numeric_features if f not in have.numeric_features]:
        reasons.append(f"expects numeric features the online features do not hold: {missing}")
    if missing := [t for t in wanted.tokens if t not in have.tokens]:
        reasons.append(f"expects attribute tokens the catalog does not declare: {missing}")
    return reasons
