"""The dense networks the platform trains and serves, as records: a registry by name, and a user's own
network by import path.

A version's `ModelSpec.kind` names its architecture: a name of ARCHITECTURES, or `package.module:attribute`,
where the attribute is an `Architecture` (a user's record, with its own inputs and defaults) or a builder
(`ModelSpec -> keras.Model`, every input, the platform's defaults). A network takes the inputs documented in
models/networks.py (a dict of tensors: embeddings [B, D], sequences [B, L, D] with masks, numeric [B, F]),
returns click logits [B], and may have `adapt(numeric [N, F])`, called with the training part's numeric
features before the first step. Where the dataset declares several objectives (`[objectives]`), the builder is
called once per objective, each network's logits one objective's (models/networks.py Objectives). The same module
must import wherever the version is trained and served: the DAG trains it, the gate judges it, the ranking server
compiles it on the batched XLA path as any other.

Standard library and the contract only: the CLI and the DAGs read the names without loading TensorFlow.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from contract.inputs import LONG_HISTORY_FEATURES, NUMERIC_FEATURES, V1_NUMERIC_FEATURES

if TYPE_CHECKING:
    import keras

    from models.ctr import ModelSpec


@dataclass(frozen=True)
class Architecture:
    """A dense network and the inputs it declares."""

    name: str
    network: str  # "package.module:attribute": called with the version's ModelSpec, returns its keras.Model
    description: str = ""
    numeric_features: tuple[str, ...] = NUMERIC_FEATURES  # its numeric inputs, in order (a subset of these)
    long_history: bool = True  # the long history's behaviors in the candidate's category (long_sequence)
    embedding_dim: int | None = None  # fixed (the logistic baseline: 1), else `models.embedding_dim`
    numeric_bins: bool = False  # takes `models.numeric_bins` piecewise-linear bins per numeric feature

    def build(self, spec: ModelSpec) -> keras.Model:
        """The network (one per objective where the version has several: `spec.objectives`), inside a position bias
        where the version learns one (`spec.position_slots`)."""
        from models.networks import Objectives, PositionBias  # keras: only where a network is built

        build = _attribute(self.network)
        network = Objectives([build(spec) for _ in spec.objectives]) if len(spec.objectives) > 1 else build(spec)
        return PositionBias(network, spec.position_slots) if spec.position_slots else network

    def without_long_history(self) -> Architecture:
        """The same network with none of the long history's inputs (the ablation)."""
        return replace(self, numeric_features=tuple(f for f in self.numeric_features if f not in LONG_HISTORY_FEATURES),
                       long_history=False)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("ranker", "models.networks:ranker", "target attention over the recent behaviors and the long "
                 "history in the candidate's category, attributes, numeric features binned", numeric_bins=True),
    Architecture("ranker-v1", "models.networks:ranker_v1", "the previous DIN ranker: 50 recent behaviors, the "
                 "stream's counts and rates, the user's numbers", V1_NUMERIC_FEATURES, long_history=False),
    Architecture("logreg", "models.networks:logistic_regression", "the logistic-regression baseline: a weight "
                 "per id and per numeric feature", long_history=False, embedding_dim=1),
)}


class ArchitectureError(ValueError):
    pass


def _attribute(path: str) -> Any:
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ArchitectureError(f"{path!r} is not an import path: write package.module:attribute")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ArchitectureError(f"the network {path!r} does not import: {exc}") from exc


def architecture(kind: str) -> Architecture:
    """The architecture a version's `kind` names: a registered one, or a user's by import path."""
    if kind in ARCHITECTURES:
        return ARCHITECTURES[kind]
    if ":" not in kind:
        raise ArchitectureError(f"unknown architecture {kind!r}: use one of {', '.join(ARCHITECTURES)} or a "
                                "network by import path, package.module:attribute")
    found = _attribute(kind)
    if isinstance(found, Architecture):
        unknown = [f for f in found.numeric_features if f not in NUMERIC_FEATURES]
        if unknown:
            raise ArchitectureError(f"{kind!r} declares numeric features the dataset has not: {', '.join(unknown)} "
                                    f"(it has: {', '.join(NUMERIC_FEATURES)})")
        return replace(found, name=kind)  # the version's spec keeps the path: it resolves wherever it is served
    if not callable(found):
        raise ArchitectureError(f"{kind!r} is a {type(found).__name__}: expected an Architecture or a builder "
                                "(ModelSpec -> keras.Model)")
    return Architecture(kind, kind, f"a user's network ({kind})")
