"""Full and incremental training runs: data window -> training set -> model -> MLflow run -> registered
version -> promotion gate.

Full training: a chronological split of the window (train / validation / test = 80/10/10), epochs
until the validation AUC stops improving (at most `models.max_epochs`), the gate on the test window.
Incremental training: warm start from `@champion`, train one pass over the events since its data
watermark (the oldest 80%), gate on the newest 20%; the version also carries the sparse delta
against its parent. With the sparse tier on, the warm start reads only the rows the window touches from
the embedding store (`sparse_tier.pull`), and the version's export is its delta. Nothing moves
`@champion` unless the gate passes.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mlflow
import numpy as np

from contract.examples import Examples
from contract.inputs import CONTEXT, CONTEXT_NUMBERS
from contract.terms import CONTEXT_TOKENS, token_prefixes
from infra.dataset import POSITION_FIELD
from infra.settings import RegisteredModel, Settings
from models import plots
from models.architectures import architecture
from models.ctr import CtrModel, ModelSpec
from models.dataset import Window, chronological_split, training_set
from models.gbdt import gbdt_scores
from models.metrics import RANKING_BASELINES, auc, best_baseline, evaluate
from models.registry import (
    Decision,
    champion_watermark,
    connect,
    gate,
    lacking_evidence,
    load_version,
    log_model,
    version_tags,
)
from models.sparse import SparseConfig

log = logging.getLogger("flywheel.train")


@dataclass(frozen=True)
class TrainOutcome:
    version: str
    decision: Decision | None  # None when promotion was not asked for
    metrics: dict[str, float]
    window: Window
    samples_per_s: float


def model_spec(s: Settings, kind: str | None = None, long_history: bool = True, without: Sequence[str] = ()
               ) -> ModelSpec:
    """The spec of a new model of architecture `kind` (models/architectures.py; None: `models.architecture`)
    with the inputs it declares; without `long_history`, none of the long history's (the ablation); `without`:
    none of the numeric inputs, request context fields or position bias these names or patterns ("dept_*", "page",
    "position") match (ValueError where one matches none)."""
    m, st = s.models, s.streaming
    arch = architecture(kind or m.architecture)
    if not long_history:
        arch = arch.without_long_history()
    numeric, context = arch.numeric_features, CONTEXT
    position = (POSITION_FIELD,) if s.spec.position_slots else ()
    for pattern in without:
        if not fnmatch.filter((*numeric, *context, *position), pattern):
            raise ValueError(f"--without {pattern}: no numeric input, context field or position bias of {arch.name} "
                             f"matches it (its inputs: {', '.join((*numeric, *context, *position))})")
        numeric, context, position = (tuple(n for n in names if not fnmatch.fnmatchcase(n, pattern))
                                      for names in (numeric, context, position))
    dropped = {f"{CONTEXT_TOKENS}:{name}" for name in CONTEXT if name not in context}
    # a number field left out takes its numeric input with it
    numeric = tuple(n for n in numeric if n not in CONTEXT_NUMBERS or CONTEXT_NUMBERS[n] in context)
    return ModelSpec(kind=arch.name, numeric_features=numeric, sequence_length=st.sequence_length,
                     tokens=tuple(t for t in token_prefixes() if t not in dropped),
                     long_length=st.history_per_category if arch.long_history else 0,
                     sparse=SparseConfig(dim=arch.embedding_dim or m.embedding_dim, admit_after=m.admit_after,
                                         evict_after_steps=m.evict_after_steps, learning_rate=m.sparse_learning_rate),
                     learning_rate=m.dense_learning_rate, batch_size=m.batch_size,
                     numeric_bins=m.numeric_bins if arch.numeric_bins else 0,
                     position_slots=s.spec.position_slots if position else 0,
                     objectives=declared_objectives(s))


def declared_objectives(s: Settings) -> tuple[tuple[str, str], ...]:
    """A new version's objectives (`ModelSpec.objectives`): the spec's, where it declares two or more (one is the
    labels, as without any)."""
    return tuple((o.name, o.over) for o in s.spec.objectives) if len(s.spec.objectives) > 1 else ()


def check_labels(ex: Examples, what: str) -> None:
    clicks = int(ex.labels.sum())
    if clicks == 0 or clicks == len(ex):
        raise ValueError(f"{what}: {len(ex)} examples with {clicks} clicks; training needs clicks and non-clicks")


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat()


def train_full(s: Settings, window: Window, kind: str | None = None, promote: bool = True,
               progress: bool = True, long_history: bool = True, baselines: bool = False,
               model: RegisteredModel | None = None, without: Sequence[str] = ()) -> TrainOutcome:
    """A new version of `model` (the ranker by default) of architecture `kind` (None: `models.architecture`),
    without the numeric inputs `without` matches (an ablation: `model_spec`).
    `baselines`: also the test AUC of item popularity (`test_auc_popularity`) and of the logistic baseline
    trained on the same parts (`test_auc_logreg`): what the version must beat, on the same split."""
    registered = model or s.ranker
    kind = architecture(kind or s.models.architecture).name  # an unknown one fails before any work
    spec = model_spec(s, kind, long_history, without)  # and an input `without` names that it lacks
    connect(s)  # fail before any work when the registry is unreachable
    ex, times = training_set(s, window, s.streaming.sequence_length, registered.scenario)
    train, validation, test, spans = chronological_split(ex, times)
    for part, what in ((train, "train split"), (validation, "validation split"), (test, "test split")):
        check_labels(part, f"{what} of {window}")
    mlflow.set_experiment(registered.experiment)
    with mlflow.start_run(run_name=f"full-{kind}"), tempfile.TemporaryDirectory() as tmp:
        model = CtrModel(spec)
        model.adapt(train)
        mlflow.log_params({"kind": kind, "data_start": _iso(window.start), "data_end": _iso(window.end),
                           **{f"split_{k}": v for k, v in spans.items()}, **_spec_params(model.spec),
                           **({"without": ",".join(without)} if without else {})})
        best = Path(tmp) / "best"
        model, losses, val_aucs, seconds = _fit(s, model, train, validation, best, progress, log=True)
        samples_per_s = len(train) * len(losses) / seconds
        metrics = _log_evaluation(model, test, "test") | {"train_samples_per_s": samples_per_s,
                                                           "epochs": float(len(losses)), "examples": float(len(ex))}
        mlflow.log_metric("valued_labels", float((train.weights != 1).sum()))  # examples a label's value weighed
        if baselines:
            metrics |= baseline_aucs(s, train, validation, test, Path(tmp) / "logreg")
            mlflow.log_metrics({k: v for k, v in metrics.items() if k.startswith("test_auc_")})
        mlflow.log_figure(plots.losses(losses, val_aucs), "plots/loss_curves.png")
        strongest = best_baseline({name: metrics[f"test_auc_{key}"] for name, key in RANKING_BASELINES.items()
                                   if f"test_auc_{key}" in metrics})
        version = log_model(s, best, {"kind": kind, "data_start": _iso(window.start), "data_end": _iso(window.end),
                                      "eval_start": spans["test"].split(" .. ")[0],
                                      "eval_end": spans["test"].split(" .. ")[1], "parent_version": "",
                                      **_terms_tags(model.spec),
                                      **({"best_baseline": f"{strongest[0]} {strongest[1]:.4f} (test AUC "
                                                           f"{metrics['test_auc']:.4f})"} if strongest else {})},
                            model=registered)
    decision = (gate(s, version, model, test, f"test window {spans['test']}", model=registered) if promote
                else None)
    return TrainOutcome(version, decision, metrics, window, samples_per_s)


def _fit(s: Settings, model: CtrModel, train: Examples, validation: Examples, best: Path, progress: bool,
         log: bool = False) -> tuple[CtrModel, list[float], list[float], float]:
    """Epochs until the validation AUC stops improving: (the best model, losses, validation AUCs, seconds)."""
    best_auc, losses, val_aucs, seconds = -1.0, [], [], 0.0
    for epoch in range(s.models.max_epochs):
        started = time.perf_counter()
        losses += model.fit(train, progress=progress)
        seconds += time.perf_counter() - started
        val_aucs.append(auc(validation.labels, model.predict(validation)))
        if log:
            mlflow.log_metrics({"train_logloss": losses[-1], "validation_auc": val_aucs[-1]}, step=epoch)
        if val_aucs[-1] <= best_auc:
            break
        best_auc = val_aucs[-1]
        model.save(best)
    return CtrModel.load(best), losses, val_aucs, seconds


def baseline_aucs(s: Settings, train: Examples, validation: Examples, test: Examples, tmp: Path) -> dict[str, float]:
    """Test AUC of the baselines a practitioner tries first: items by their positives before the test part
    (popularity), logistic regression on the ranker's own inputs (one weight per id and token) and
    gradient-boosted trees on them (models/gbdt.py)."""
    seen = np.concatenate([train.item_ids[train.labels > 0], validation.item_ids[validation.labels > 0]])
    ids, counts = np.unique(seen, return_counts=True)
    popularity = dict(zip(ids, counts))
    logreg, _, _, _ = _fit(s, CtrModel(model_spec(s, "logreg")), train, validation, tmp, progress=False)
    scores = {"popularity": np.array([popularity.get(i, 0) for i in test.item_ids], float),
              "logreg": np.asarray(logreg.predict(test)), "gbdt": gbdt_scores(train, validation, test)}
    return {f"test_auc_{key}": auc(test.labels, scores[key]) for key in RANKING_BASELINES.values()}


def train_incremental(s: Settings, until: datetime | None = None, promote: bool = True,
                      progress: bool = True, model: RegisteredModel | None = None) -> TrainOutcome | None:
    """Continue `@champion` of `model` (the ranker by default) on the events since its data watermark. Returns
    None (and trains nothing) when the newest 20% of them, the gate's evaluation window, is too small to judge
    a version on."""
    registered = model or s.ranker
    champion = champion_watermark(s, registered)
    if champion is None:
        raise ValueError(f"{registered.name} has no @champion to continue from: run full training first")
    parent, watermark = champion
    window = Window(watermark, until or datetime.now(UTC))
    try:
        ex, times = training_set(s, window, s.streaming.sequence_length, registered.scenario)
    except ValueError as exc:
        log.info("incremental training skipped: %s", exc)
        return None
    cut = int(len(ex) * 0.8)
    train, evaluation = ex.take(slice(0, cut)), ex.take(slice(cut, None))
    if lacking := lacking_evidence(s, evaluation):  # the gate could not judge it: the next run sees more
        log.info("incremental training skipped: the newest 20%% of %d new examples in %s: %s", len(ex), window,
                 lacking)
        return None
    check_labels(train, f"new events {window}")
    check_labels(evaluation, f"evaluation part of {window}")
    model, pulled = _warm_start(s, parent, ex, registered)
    scored = {parent: model.predict(evaluation)} if promote else {}  # the gate's champion, before any step
    base_versions = model.versions()
    mlflow.set_experiment(registered.experiment)
    with mlflow.start_run(run_name=f"incremental-{model.spec.kind}"), tempfile.TemporaryDirectory() as tmp:
        mlflow.log_params({"kind": model.spec.kind, "parent_version": parent, "data_start": _iso(window.start),
                           "data_end": _iso(window.end), "warm_start": "store" if pulled else "registry",
                           **_spec_params(model.spec)})
        started = time.perf_counter()
        losses = model.fit(train, progress=progress)
        samples_per_s = len(train) / (time.perf_counter() - started)
        mlflow.log_metrics({"train_logloss": losses[-1], "valued_labels": float((train.weights != 1).sum())})
        metrics = _log_evaluation(model, evaluation, "eval") | {"train_samples_per_s": samples_per_s}
        delta = Path(tmp) / "delta"
        changed = model.save_delta(delta, since=base_versions)
        mlflow.log_artifacts(str(delta), "delta")
        mlflow.log_metric("delta_rows", float(sum(changed.values())))
        eval_span = [datetime.fromtimestamp(t / 1000, UTC).isoformat() for t in (times[cut], times[-1])]
        # The delta is published with the version: serving holding the parent applies it in place. A model
        # continued from the store holds only the rows its window touched: its export is that delta.
        version = log_model(s, delta if pulled else model.save(Path(tmp) / "model"), {
            "kind": model.spec.kind, "data_start": _iso(window.start), "data_end": _iso(window.end),
            "eval_start": eval_span[0], "eval_end": eval_span[1], "parent_version": parent,
            "sparse_delta": f"runs:/{mlflow.active_run().info.run_id}/delta", **_terms_tags(model.spec)},
            delta_dir=delta, base=parent if pulled else None, model=registered)
    decision = (gate(s, version, model, evaluation, f"newest 20% of {window}", scored, registered)
                if promote else None)
    return TrainOutcome(version, decision, metrics, window, samples_per_s)


def _warm_start(s: Settings, parent: str, ex: Examples, registered: RegisteredModel) -> tuple[CtrModel, bool]:
    """The model an incremental run on `ex` starts from, and whether it came from the embedding store (only
    the rows `ex` touches, with their training state) rather than the registry (the parent whole)."""
    model, pulled = None, False
    if s.sparse_tier.enabled:
        import redis

        from models import sparse_tier  # Redis and Kafka clients: only where the tier is on

        try:
            model = sparse_tier.pull(s, parent, ex, registered)
        except redis.RedisError as exc:
            log.warning("v%s not continued from the embedding store (%s: %s): loading it whole", parent,
                        type(exc).__name__, exc)
            model = None
        pulled = model is not None
    if model is None:
        model = load_version(s, parent, registered)
    if not isinstance(model, CtrModel):
        raise ValueError(f"@champion v{parent} is a model of another flavor: incremental training continues only "
                         "the platform's own (train a full version, or register the next foreign one)")
    declared = declared_objectives(s)
    if model.spec.objectives != declared:  # its networks would learn other labels than they were trained on
        raise ValueError(f"@champion v{parent} predicts the objectives {_named(model.spec.objectives)}, the spec "
                         f"declares {_named(declared)}: train a full version")
    return model, pulled


def _named(declared: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{name} over {over}" if over else name for name, over in declared) or "(one, unnamed)"


def gate_version(s: Settings, version: str, model: RegisteredModel | None = None) -> Decision:
    """Run the promotion gate for a registered version of `model` (the ranker by default) on its recorded
    evaluation window."""
    tags = version_tags(s, version, model)
    window = Window(datetime.fromisoformat(tags["eval_start"]),
                    datetime.fromisoformat(tags["eval_end"]) + timedelta(milliseconds=1))
    ex, _ = training_set(s, window, s.streaming.sequence_length, (model or s.ranker).scenario)
    return gate(s, version, load_version(s, version, model), ex, f"its evaluation window {window}", model=model)


def _terms_tags(spec: ModelSpec) -> dict[str, str]:
    """The version's terms (contract/terms.py) as registry tags: its dataset, event types and their digest."""
    return {"dataset": spec.dataset, "event_types": json.dumps(spec.event_types), "contract": spec.terms.digest}


def _spec_params(spec: ModelSpec) -> dict[str, object]:
    import tensorflow as tf

    # The dense step runs where TensorFlow puts it (a GPU when one is visible); sparse rows stay on CPU.
    return {"dense_device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU", "embedding_dim": spec.sparse.dim, "admit_after": spec.sparse.admit_after,
            "sparse_learning_rate": spec.sparse.learning_rate, "dense_learning_rate": spec.learning_rate,
            "batch_size": spec.batch_size, "sequence_length": spec.sequence_length, "long_length": spec.long_length,
            "numeric_features": len(spec.numeric_features),
            "hidden": ",".join(map(str, spec.hidden)), "xla": spec.jit_compile,
            **({"objectives": _named(spec.objectives)} if spec.objectives else {})}


def _log_evaluation(model: CtrModel, ex: Examples, prefix: str) -> dict[str, float]:
    probabilities = model.predict(ex)
    metrics = {f"{prefix}_{k}": v for k, v in evaluate(ex.labels, probabilities).items()}
    if len(model.spec.objectives) > 1:  # each objective's AUC over the exposures (the first's is the AUC above)
        metrics |= {f"{prefix}_{name}_auc": auc(ex.objectives[:, k], p) for k, ((name, _), p)
                    in enumerate(zip(model.spec.objectives, model.predict_objectives(ex).T))
                    if 0 < ex.objectives[:, k].sum() < len(ex)}
    mlflow.log_metrics(metrics)
    mlflow.log_figure(plots.roc(ex.labels, probabilities), "plots/roc.png")
    mlflow.log_figure(plots.calibration(ex.labels, np.asarray(probabilities)), "plots/calibration.png")
    return metrics
