"""The MLflow model registry: every trained model is a version with its lineage; `@champion` moves only
through the promotion gate or a recorded rollback.

Lineage lives in version tags: `data_start`/`data_end` (the training window; `data_end` is the
watermark incremental training continues from), `eval_start`/`eval_end` (the window the gate
compares on), `parent_version` (incremental runs), `sparse_base` (an incremental run continued from the
embedding store: its export holds only its delta, which loading applies to the parent's), `kind`. Gate
decisions and rollbacks are tags too (`gate_decision`, `gate_reason`, `gate_guardrail` of a refusal,
`previous_champion`, `rolled_back_*`).

A promoted ranker starts a canary (settings.canary, serving/canary.py): @control names the champion before
it, which keeps serving the users outside the new champion's share (the registered model's tag
`champion_canary`, "<version>:<percent>": a share for that version alone, so a @champion moved by hand
serves everyone at once) until the analysis ramps the new one to all traffic (@control removed) or rolls it
back. The canary's state is on the version: `canary_started_at`, `canary_status`, `canary_decision`.

An experiment pins a share of users to @holdout, a version that never moves while @champion learns (the
registered model's tag `experiment`, "<percent>:<started at>"): a frozen arm to measure learning against, served
whatever canaries run for the others (serving/access.py).
"""

from __future__ import annotations

import functools
import getpass
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING

import mlflow
import numpy as np
import pandas as pd
import redis
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from contract.examples import Examples, from_frame
from infra.settings import MLFLOW_CLIENT_ENV, ModelsSettings, RegisteredModel, Settings, mlflow_password
from models.foreign import ForeignModel
from models.metrics import auc, auc_difference, calibration

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # TensorFlow takes seconds to import: only the calls that score load it
    from models.ctr import CtrModel

CHAMPION, CHALLENGER, CONTROL, HOLDOUT = "champion", "challenger", "control", "holdout"
BASE_FILE = "base-model.txt"  # in a delta's export: the parent's model URI
RAMPED = "ramped to all traffic"  # the start of `canary_decision` on a version that passed its canary
CANARY_TAG = "champion_canary"  # registered-model tag "<version>:<percent>": a new champion's share in its canary
EXPERIMENT_TAG = "experiment"  # registered-model tag "<percent>:<started at, ISO>": the users @holdout serves
LAST_EXPERIMENT_TAG = "experiment_last"  # "<version>:<percent>:<started at>": the one that ran before, once stopped


class RegistryError(RuntimeError):
    """The registry is unreachable, or a registry operation cannot be done as asked."""


def connect(s: Settings) -> MlflowClient:
    """A client of the configured MLflow server; fails at once, clearly, when it is unreachable."""
    # MLflow retries a refused connection for minutes by default.
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(s.models.request_timeout_s))
    # MLflow's client takes credentials only from the environment (its REST calls, artifact uploads).
    if password := mlflow_password(s):
        os.environ |= dict(zip(MLFLOW_CLIENT_ENV, (s.mlflow.username, password)))
    mlflow.set_tracking_uri(s.mlflow.tracking_uri)
    mlflow.set_registry_uri(s.mlflow.tracking_uri)
    client = MlflowClient(s.mlflow.tracking_uri, s.mlflow.tracking_uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot use the registry"
        if "401" in str(exc):
            raise RegistryError(f"MLflow at {s.mlflow.tracking_uri} refused user '{s.mlflow.username}' (HTTP 401): "
                                "check mlflow.username and mlflow.password") from None
        raise RegistryError(f"MLflow at {s.mlflow.tracking_uri} is unreachable ({type(exc).__name__}); "
                            "is the stack up (`flywheel status`)?") from None
    return client


class CtrPyfunc(mlflow.pyfunc.PythonModel):
    """`models:/<name>@<alias>` as a pyfunc: scores a frame in `contract.examples.to_frame`'s layout."""

    def load_context(self, context) -> None:
        from models.ctr import CtrModel

        export = Path(context.artifacts["model"])
        base = export / BASE_FILE
        if base.exists():  # a delta: the parent's model (resolved the same way) patched by it
            parent = mlflow.pyfunc.load_model(base.read_text().strip()).unwrap_python_model().model
            self.model = parent.with_delta(export)
        else:
            self.model = CtrModel.load(export)

    def predict(self, context, model_input: pd.DataFrame, params=None):
        spec = self.model.spec
        return self.model.predict(from_frame(model_input, spec.numeric_features, spec.sequence_length))


def log_model(s: Settings, export_dir: Path, tags: dict[str, str], delta_dir: Path | None = None,
              base: str | None = None, model: RegisteredModel | None = None) -> str:
    """Log the export as the active run's pyfunc model and register it; returns the new version. `base`: the
    export is a delta (`CtrModel.save_delta`) of that version, which loading resolves first. With the
    sparse tier on, its tables (only `delta_dir`'s rows where the store holds its parent) are written to
    the embedding store too; a version the store refuses is tagged `sparse_tier_refused` and raises."""
    import tensorflow as tf

    name = (model or s.ranker).name
    if scenario := (model or s.ranker).scenario:  # what it was trained on, and serves
        tags = tags | {"scenario": scenario}
    if base is not None:
        (export_dir / BASE_FILE).write_text(f"models:/{name}/{base}\n")
        tags = tags | {"sparse_base": base}

    info = mlflow.pyfunc.log_model(
        name="model", python_model=CtrPyfunc(), artifacts={"model": str(export_dir)},
        pip_requirements=[f"tensorflow-cpu=={tf.__version__}", f"mlflow=={mlflow.__version__}"],
        registered_model_name=name)
    version = str(info.registered_model_version)
    client = connect(s)
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if s.sparse_tier.enabled:
        from models import sparse_tier  # Kafka and Redis clients: only where the tier is on

        newest = sorted((int(v.version) for v in client.search_model_versions(f"name='{name}'")),
                        reverse=True)[: s.sparse_tier.keep_versions]
        keep = set(aliases(client, name).values()) | {str(v) for v in newest}
        try:
            sparse_tier.publish(s, version, tags.get("parent_version", ""), export_dir, delta_dir, keep, model)
        except sparse_tier.StoreFull as exc:
            client.set_model_version_tag(name, version, "sparse_tier_refused", str(exc))
            raise
        except (redis.RedisError, sparse_tier.MissingVersion) as exc:  # the store away, or its parent gone from it:
            # servers load this version whole, as without the tier
            log.warning("v%s not written to the embedding store (%s: %s); servers will load it whole", version,
                        type(exc).__name__, exc)
            client.set_model_version_tag(name, version, "sparse_tier_error", f"{type(exc).__name__}: {exc}")
    return version


def alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def aliases(client: MlflowClient, name: str) -> dict[str, str]:
    """Every alias of a registered model and the version it names, in one registry call ({} if the
    model is not registered yet). Raises RegistryError when the registry does not answer: an outage is
    not "no aliases" (a server reading it so would drop its challenger for the outage)."""
    try:
        return {alias: str(version) for alias, version in client.get_registered_model(name).aliases.items()}
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        said = " ".join(str(exc.message).split())  # a refused connection's cause is at the end of a long line
        said = said if len(said) < 200 else f"{said[:90]} ... {said[-100:]}"
        raise RegistryError(f"aliases of {name!r} not read: {said}") from exc


@dataclass(frozen=True)
class Routing:
    """What the ranking server follows: the aliases, @champion's share of users while @control serves
    the others (100: no canary, or one for another version than @champion, which a hand moved), and the share of
    users @holdout serves (0: no experiment) with the experiment's salt of their hash."""

    aliases: dict[str, str]
    champion_percent: float = 100.0
    canary_version: str | None = None  # the version the canary tag names, whether or not it is @champion
    holdout_percent: float = 0.0
    holdout_salt: str = ""


@dataclass(frozen=True)
class Experiment:
    """An experiment: @holdout's `version` serves `percent` of users since `started_at`."""

    version: str
    percent: float
    started_at: datetime

    @property
    def salt(self) -> str:
        """Part of the users' hash: each experiment holds out users of its own, not the last one's again."""
        return self.started_at.isoformat()


def canary_tag(version: str, percent: float) -> str:
    return f"{version}:{percent:g}"


def _experiment(version: str | None, tag: str) -> Experiment | None:
    percent, _, started = tag.partition(":")
    try:
        return None if version is None else Experiment(version, float(percent), datetime.fromisoformat(started))
    except ValueError:  # a tag a hand broke: no experiment
        return None


def _running(named: dict[str, str], tags: dict[str, str]) -> Experiment | None:
    return _experiment(named.get(HOLDOUT), tags.get(EXPERIMENT_TAG, ""))


def routing(client: MlflowClient, name: str) -> Routing:
    """The aliases, the champion's canary share and the holdout's share in one registry call (raises
    RegistryError as `aliases`)."""
    try:
        model = client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return Routing({})
        return Routing(aliases(client, name))  # raises the RegistryError that says why
    named = {alias: str(version) for alias, version in model.aliases.items()}
    running = _running(named, model.tags)
    held = (running.percent, running.salt) if running else (0.0, "")
    version, _, percent = model.tags.get(CANARY_TAG, "").partition(":")
    try:
        share = float(percent)
    except ValueError:
        return Routing(named, 100.0, None, *held)
    applies = CONTROL in named and version == named.get(CHAMPION)
    return Routing(named, share if applies else 100.0, version or None, *held)


def _registered(client: MlflowClient, name: str):
    """The registered model, None when it is not registered yet (RegistryError when the registry does not answer)."""
    try:
        return client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        aliases(client, name)  # raises the RegistryError that says why
        raise


def experiment(s: Settings, model: RegisteredModel | None = None, last: bool = False) -> Experiment | None:
    """The experiment running on `model` (the ranker by default); with `last`, else the last one that ran."""
    held = _registered(connect(s), (model or s.ranker).name)
    if held is None:
        return None
    running = _running({alias: str(v) for alias, v in held.aliases.items()}, held.tags)
    if running is not None or not last:
        return running
    version, _, tag = held.tags.get(LAST_EXPERIMENT_TAG, "").partition(":")
    return _experiment(version or None, tag)


def start_experiment(s: Settings, percent: float, version: str | None = None,
                     model: RegisteredModel | None = None) -> Experiment:
    """Pin `percent` of users (a stable hash of the user id, salted per experiment) to `version` as @holdout: a
    frozen arm beside the champion as it learns. By default the version that passed the last canary: @control's
    while a new champion is in its canary, else @champion's. Both arms' traffic trains; the holdout never moves."""
    if not 0 < percent < 100:
        raise RegistryError(f"an experiment's holdout share is a percentage of users in (0, 100), not {percent:g}")
    client, name = connect(s), (model or s.ranker).name
    running = experiment(s, model)
    if running is not None:
        raise RegistryError(f"an experiment runs already on {name} (v{running.version} holds {running.percent:g}% "
                            f"of users since {running.started_at:%Y-%m-%d %H:%M:%S} UTC): stop it first")
    named = aliases(client, name)
    version = version or named.get(CONTROL) or named.get(CHAMPION)
    if version is None:
        raise RegistryError(f"{name} has no @champion to hold out; name a version")
    try:
        client.get_model_version(name, version)
    except MlflowException:
        raise RegistryError(f"{name} has no version {version}") from None
    if HOLDOUT in named:  # left by a hand without its tag: it must not serve the new share meanwhile
        client.delete_registered_model_alias(name, HOLDOUT)
    started = datetime.now(UTC)
    client.set_registered_model_tag(name, EXPERIMENT_TAG, f"{percent:g}:{started.isoformat()}")
    client.set_registered_model_alias(name, HOLDOUT, version)  # last: the share applies once @holdout names it
    return Experiment(version, percent, started)


def stop_experiment(s: Settings, model: RegisteredModel | None = None) -> Experiment:
    """Every user back to the champion's routes (and its canary's, while one runs); returns the experiment that ran,
    which `experiment(last=True)` still reads."""
    client, name = connect(s), (model or s.ranker).name
    running = experiment(s, model)
    if running is None:
        raise RegistryError(f"no experiment runs on {name}")
    client.delete_registered_model_alias(name, HOLDOUT)  # first: the holdout's users go back at once
    client.set_registered_model_tag(name, LAST_EXPERIMENT_TAG,
                                    f"{running.version}:{running.percent:g}:{running.started_at.isoformat()}")
    client.delete_registered_model_tag(name, EXPERIMENT_TAG)
    return running


def start_canary(s: Settings, version: str, previous: str, model: RegisteredModel | None = None) -> None:
    """`version` is about to become @champion in place of `previous`: @control keeps serving the users
    outside the first share. A canary already running keeps its @control, the last version that passed one."""
    client, name, first = connect(s), (model or s.ranker).name, s.for_model(model).canary.ramp_percent[0]
    if alias_version(client, name, CONTROL) is None:
        client.set_registered_model_alias(name, CONTROL, previous)
    client.set_registered_model_tag(name, CANARY_TAG, canary_tag(version, first))
    client.set_model_version_tag(name, version, "canary_started_at", datetime.now(UTC).isoformat())
    client.set_model_version_tag(name, version, "canary_status",
                                 f"serving {first:g}% of users; @control serves the others")


def end_canary(s: Settings, model: RegisteredModel | None = None) -> None:
    """Every user to @champion: @control and the share removed (a canary ramped, or a rollback)."""
    client, name = connect(s), (model or s.ranker).name
    held = client.get_registered_model(name)
    if CONTROL in held.aliases:
        client.delete_registered_model_alias(name, CONTROL)
    if CANARY_TAG in held.tags:
        client.delete_registered_model_tag(name, CANARY_TAG)


def load_version(s: Settings, version: str, model: RegisteredModel | None = None) -> CtrModel | ForeignModel:
    """The in-memory model of a registered version: the platform's own (its export, as logged), or a
    pyfunc of another flavor over the contract's frame (models/foreign.py)."""
    connect(s)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{(model or s.ranker).name}/{version}")
    try:
        inner = pyfunc.unwrap_python_model()
    except MlflowException:  # another flavor (lightgbm, sklearn, ...): no PythonModel inside
        inner = None
    return inner.model if isinstance(inner, CtrPyfunc) else ForeignModel(pyfunc, version)


def version_tags(s: Settings, version: str, model: RegisteredModel | None = None) -> dict[str, str]:
    return dict(connect(s).get_model_version((model or s.ranker).name, version).tags)


def champion_watermark(s: Settings, model: RegisteredModel | None = None) -> tuple[str, datetime] | None:
    """@champion's version and the end of the data it was trained on (None: no champion yet)."""
    version = alias_version(connect(s), (model or s.ranker).name, CHAMPION)
    return None if version is None else (version,
                                         datetime.fromisoformat(version_tags(s, version, model)["data_end"]))


@dataclass(frozen=True)
class Decision:
    version: str
    promoted: bool
    reason: str
    score: float  # the gate's measure of the candidate: AUC for the ranker, recall@K for retrieval
    champion_version: str | None
    champion_score: float | None  # the champion's, on the same window (None: not compared)
    guardrail: str | None = None  # what refused it: evidence, calibration, auc (recall), objective, floor, lineage


def lacking_evidence(s: Settings, evaluation: Examples) -> str | None:
    """Why `evaluation` is too small to judge a version on (None: it is not)."""
    examples, clicks = len(evaluation), int((evaluation.labels > 0.5).sum())
    if examples < s.models.gate_min_examples or clicks < s.models.gate_min_clicks:
        return (f"{examples} examples with {clicks} clicks; the gate needs at least {s.models.gate_min_examples} "
                f"and {s.models.gate_min_clicks}")
    return None


def _guardrail(s: Settings, evaluation: Examples, candidate: CtrModel | ForeignModel) -> tuple[str, str] | None:
    """The guardrail a candidate fails before any comparison (evidence, calibration), and why. Calibration
    compares the clicks with the probabilities where the items were shown: a model that learns the position
    apart scores every item at the top, 2x the mean CTR of the world's lists of 10."""
    if lacking := lacking_evidence(s, evaluation):
        return "evidence", lacking
    probabilities = candidate.predict_as_shown(evaluation)
    ratio, (low, high) = calibration(evaluation.labels, probabilities), s.models.gate_calibration
    if not low <= ratio <= high:
        return "calibration", (f"mean predicted CTR {float(np.mean(probabilities)):.4f} is {ratio:.2f}x the observed "
                               f"{float(np.mean(evaluation.labels)):.4f}; the gate needs {low}-{high}x")
    return None


def gate(s: Settings, version: str, candidate: CtrModel | ForeignModel, evaluation: Examples, window: str,
         scored: dict[str, np.ndarray] | None = None, model: RegisteredModel | None = None) -> Decision:
    """Promote `version` to @champion unless a guardrail refuses it, otherwise make it @challenger and
    record why. In order: lineage (a version continuing a parent that is no longer the champion), evidence
    (too few examples or clicks in `evaluation` to judge anything), calibration (mean predicted CTR out
    of bounds), auc (worse than the champion's on the same window by more than the tolerance, with
    one-sided significance `gate_alpha` by DeLong's test), objective (a further objective of the spec's
    `[objectives]` predicted worse than the champion predicts it, by the same test on its own labels), floor
    (worse, by the same test, than the last version that passed a canary or the first champion (`floor_version`), or
    than a constant score). A difference the window cannot tell from noise does not hold back a fresher model.
    `scored`: versions' scores of `evaluation` the caller has (an incremental run's parent's), not loaded again.
    `model`: whose version it is (the ranker by default)."""
    client, name, m = connect(s), (model or s.ranker).name, s.models
    probabilities = candidate.predict(evaluation)
    candidate_auc = auc(evaluation.labels, probabilities)  # fails before any alias moves
    champion = alias_version(client, name, CHAMPION)
    parent = client.get_model_version(name, version).tags.get("parent_version")
    champion_auc, guardrail = None, None
    if champion == version:
        reason = f"v{version} is already the champion"
    elif parent and parent != champion:  # e.g. its parent was rolled back while it trained
        guardrail, reason = "lineage", (f"continues v{parent}, which is no longer @champion (v{champion} is); "
                                        f"AUC {candidate_auc:.4f} on {window}")
    elif failed := _guardrail(s, evaluation, candidate):
        guardrail, reason = failed[0], f"{failed[1]}; AUC {candidate_auc:.4f} on {window}"
    else:
        loaded = functools.lru_cache(1)(lambda v: load_version(s, v, model))  # the champion's objectives read it again

        def scores(v: str) -> np.ndarray:
            known = (scored or {}).get(v)
            return known if known is not None else loaded(v).predict(evaluation)

        said = []
        if champion is None:
            said.append(f"first champion (AUC {candidate_auc:.4f} on {window})")
        else:
            champion_scores = scores(champion)
            champion_auc = auc(evaluation.labels, champion_scores)
            worse, verdict = _versus(m, evaluation.labels, probabilities, champion_scores, f"champion v{champion}")
            guardrail = "auc" if worse else None
            said.append(f"{verdict} on {window}")
            if guardrail is None and len(objective_names(candidate)) > 1:
                guardrail = _objectives_versus(s, candidate, lambda: loaded(champion), champion,
                                               evaluation, said)
        # The floor: whatever the champion is (an inverted one that ramped, say), never below the last version
        # that passed a canary (else the first champion), nor below a constant score (chance) on this window.
        if guardrail is None:
            floor = floor_version(client, name)
            references = [(f"floor v{floor}", lambda: scores(floor))] if floor not in (None, champion, version) else []
            references.append(("chance (a constant score)", lambda: np.zeros(len(probabilities))))
            for what, reference in references:
                worse, verdict = _versus(m, evaluation.labels, probabilities, reference(), what)
                if worse or what.startswith("floor"):
                    said.append(verdict)
                if worse:
                    guardrail = "floor"
                    break
        reason = "; ".join(said)
    return decide(s, version, guardrail, reason, candidate_auc, champion, champion_auc,
                  {"gate_auc": f"{candidate_auc:.6f}"}, canary=s.for_model(model).canary.enabled, model=model)


def objective_names(model: CtrModel | ForeignModel) -> tuple[str, ...]:
    """The names of the objectives a version predicts (none declared: one, unnamed)."""
    return tuple(name for name, _ in getattr(getattr(model, "spec", None), "objectives", ()))


def _objectives_versus(s: Settings, candidate: CtrModel, champion_model: Callable[[], CtrModel | ForeignModel],
                       champion: str, evaluation: Examples, said: list[str]) -> str | None:
    """"objective" where the candidate predicts a further objective worse than the champion does (by the AUC test,
    on that objective's labels), else None; each verdict appended to `said`. Judged where the champion predicts the
    same objectives and the evaluation window labels them (a column each, in their order: the spec declares them,
    or none), each on at least `gate_min_clicks` of its positives (fewer: said, not judged)."""
    m, names = s.models, objective_names(candidate)
    declared = tuple(o.name for o in s.spec.objectives)
    reference = champion_model()
    if objective_names(reference) != names:
        said.append(f"objectives not compared: champion v{champion} predicts "
                    f"{', '.join(objective_names(reference)) or 'one'}")
        return None
    if evaluation.objectives.shape[1] != len(names) or (len(declared) > 1 and declared != names):
        said.append(f"objectives not compared: the evaluation window does not label {', '.join(names)}")
        return None
    mine, theirs = candidate.predict_objectives(evaluation), reference.predict_objectives(evaluation)
    for k, name in enumerate(names[1:], 1):
        labels = evaluation.objectives[:, k]
        if labels.sum() < m.gate_min_clicks:
            said.append(f"{name}: {int(labels.sum())} positives, fewer than {m.gate_min_clicks}: not judged")
            continue
        worse, verdict = _versus(m, labels, mine[:, k], theirs[:, k], f"champion v{champion}")
        said.append(f"{name}: {verdict}")
        if worse:
            return "objective"
    return None


def _versus(m: ModelsSettings, labels: np.ndarray, candidate: np.ndarray, reference: np.ndarray, what: str) -> tuple[bool, str]:
    """(shown worse than `reference` beyond the tolerance, why): DeLong's test on the same examples, one-sided
    significance `gate_alpha`. A difference the window cannot tell from noise does not hold back a fresher model."""
    difference, se = auc_difference(labels, candidate, reference)
    shortfall = difference + m.max_auc_drop  # one-sided p of "worse than the reference minus the tolerance"
    p = NormalDist().cdf(shortfall / se) if se > 0 else float(shortfall < 0)
    p_text = f"p = {p:.2g}" if p >= 1e-6 else "p < 1e-6"
    worse = p < m.gate_alpha
    verdict = (f"worse beyond the tolerance {m.max_auc_drop}: {p_text} < {m.gate_alpha}" if worse else
               f"not shown worse beyond the tolerance {m.max_auc_drop}: {p_text} >= {m.gate_alpha}")
    return worse, (f"AUC {auc(labels, candidate):.4f} vs {what}'s {auc(labels, reference):.4f}, difference "
                   f"{difference:+.4f} +- {se:.4f} (DeLong), {verdict}")


def floor_version(client: MlflowClient, name: str) -> str | None:
    """The version the gate never promotes below: the newest that passed a canary (ramped to all traffic),
    else the first champion (None: neither yet)."""
    versions = client.search_model_versions(f"name='{name}'")
    passed = [int(v.version) for v in versions if v.tags.get("canary_decision", "").startswith(RAMPED)]
    first = [int(v.version) for v in versions if v.tags.get("gate_reason", "").startswith("first champion")]
    return str(max(passed)) if passed else str(min(first)) if first else None


def decide(s: Settings, version: str, guardrail: str | None, reason: str, score: float, champion: str | None,
           champion_score: float | None, tags: dict[str, str], canary: bool = False,
           model: RegisteredModel | None = None) -> Decision:
    """Record a gate's decision on `version` of `model` (the ranker by default; tags: decision, reason,
    guardrail, the champion it replaces) and move the alias: @champion unless a guardrail refused it, else
    @challenger. `canary`: a promotion that replaces a champion starts a canary (start_canary) before @champion
    moves."""
    client, name = connect(s), (model or s.ranker).name
    promoted = guardrail is None
    if guardrail:
        reason = f"{guardrail} guardrail: {reason}"
    tags = tags | {"gate_decision": "promoted" if promoted else "refused", "gate_reason": reason,
                   "gate_at": datetime.now(UTC).isoformat()} | ({"gate_guardrail": guardrail} if guardrail else {})
    if promoted and champion not in (None, version):
        tags["previous_champion"] = champion
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if promoted and canary and champion not in (None, version):
        start_canary(s, version, champion, model)  # before @champion moves: no poll sees the new one serve everyone
    client.set_registered_model_alias(name, CHAMPION if promoted else CHALLENGER, version)
    if promoted and alias_version(client, name, CHALLENGER) == version:
        client.delete_registered_model_alias(name, CHALLENGER)
    return Decision(version, promoted, reason, score, champion, champion_score, guardrail)


def rollback(s: Settings, why: str, to: str = "previous", who: str | None = None,
             model: RegisteredModel | None = None) -> tuple[str, str]:
    """Move @champion of `model` (the ranker by default) back to the champion before it (or to version `to`),
    recording who and why. Returns (from version, to version)."""
    if not why.strip():
        raise RegistryError("a rollback needs a reason")
    client, name = connect(s), (model or s.ranker).name
    current = alias_version(client, name, CHAMPION)
    if current is None:
        raise RegistryError(f"{name} has no @champion to roll back")
    target = dict(client.get_model_version(name, current).tags).get("previous_champion") if to == "previous" else to
    if not target:
        raise RegistryError(f"{name} v{current} has no previous champion; name a version")
    try:
        client.get_model_version(name, target)
    except MlflowException:
        raise RegistryError(f"{name} has no version {target}") from None
    client.set_registered_model_alias(name, CHAMPION, target)
    end_canary(s, model)  # the version rolled back to serves everyone
    for key, value in {"rolled_back_to": target, "rolled_back_by": who or getpass.getuser(),
                       "rolled_back_reason": why, "rolled_back_at": datetime.now(UTC).isoformat()}.items():
        client.set_model_version_tag(name, current, key, value)
    if alias_version(client, name, CHAMPION) != target:
        raise RegistryError(f"rollback of {name} to v{target} did not take effect")
    return current, target


def list_versions(s: Settings, model: RegisteredModel | None = None) -> list[dict[str, str]]:
    """Every version of `model` (the ranker by default), newest first, with its aliases, kind, window, parent,
    gate decision, AUC, rollback and canary (its decision, else its status)."""
    client, name = connect(s), (model or s.ranker).name
    try:
        aliases = client.get_registered_model(name).aliases  # alias -> version
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return []
    rows = []
    for v in sorted(versions, key=lambda v: int(v.version), reverse=True):
        t = v.tags
        named = ",".join(sorted(a for a, n in aliases.items() if str(n) == str(v.version)))
        rows.append({"version": str(v.version), "aliases": named, "kind": t.get("kind", ""),
                     "data": f"{t.get('data_start', '')} .. {t.get('data_end', '')}",
                     "parent": t.get("parent_version", ""), "auc": t.get("gate_auc", ""),
                     "recall": t.get("gate_recall", ""),
                     "gate": t.get("gate_decision", ""), "reason": t.get("gate_reason", ""),
                     "rolled_back": t.get("rolled_back_reason", ""), "rolled_back_by": t.get("rolled_back_by", ""),
                     "canary": t.get("canary_decision") or t.get("canary_status", ""), "drill": t.get("drill", "")})
    return rows
