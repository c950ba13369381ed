"""`flywheel`: start, check and stop the local stack; produce and inspect events; run the demo.

Heavy libraries (TensorFlow, Airflow, MLflow) are never imported here: the CLI starts fast.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from infra import process
from infra.settings import RegisteredModel, Settings, SettingsError, get_settings

if TYPE_CHECKING:
    from streaming.produce import ProduceReport


def _settings() -> Settings:
    try:
        return get_settings()
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None


class _Cli(click.Group):
    """Turns an unreachable broker into one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            # Only a command that loaded kafka-python can raise its errors: the others do not pay its import.
            errors = sys.modules.get("kafka.errors")
            if errors is None or not isinstance(exc, errors.KafkaError):
                raise
            raise click.ClickException(
                f"Kafka at {_settings().kafka.bootstrap_servers}: {type(exc).__name__}: {exc}. "
                "Is the stack up (`flywheel status`)?") from None


def _use_profile(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:  # as the setting stack.profile, which every process the stack starts inherits
        os.environ["FLYWHEEL_STACK_PROFILE"] = value
        get_settings.cache_clear()


_PROFILE = click.option("--profile", default=None, expose_value=False, is_eager=True, callback=_use_profile,
                        help="A stack profile (infra/profiles/<name>.toml), e.g. 'cluster': every engine in its "
                             "distributed form, in its own data directory. Default: setting stack.profile.")


def _use_dataset(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """`--dataset NAME` (datasets/NAME/dataset.toml) or a spec's path, as the setting dataset.spec, in a data
    directory of its own (<paths.data_dir>-<its name>) unless FLYWHEEL_PATHS_DATA_DIR names one."""
    if value is None:
        return
    from infra.dataset import SpecError, load_spec
    from infra.settings import REPO_ROOT, DatasetSettings

    bundled = sorted(p.parent.name for p in (REPO_ROOT / "datasets").glob("*/dataset.toml"))
    path = Path(value) if value.endswith(".toml") or "/" in value else REPO_ROOT / "datasets" / value / "dataset.toml"
    if not path.exists():
        raise click.BadParameter(f"no spec at {path} (bundled: {', '.join(bundled)}; or a path to a dataset.toml)")
    try:
        name = load_spec(path.resolve()).name
    except SpecError as exc:
        raise click.BadParameter(str(exc)) from None
    data_dir = _settings().paths.data_dir
    os.environ["FLYWHEEL_DATASET_SPEC"] = str(path.resolve())
    get_settings.cache_clear()
    if "FLYWHEEL_PATHS_DATA_DIR" not in os.environ and path.resolve() != DatasetSettings().spec.resolve():
        os.environ["FLYWHEEL_PATHS_DATA_DIR"] = str(data_dir.parent / f"{data_dir.name}-{name}")
        get_settings.cache_clear()


_DATASET = click.option(
    "--dataset", default=None, expose_value=False, callback=_use_dataset,
    help="A bundled dataset (instacart, movielens, world) or the path of a dataset.toml, as the setting dataset.spec. "
         "Another dataset than the default (MovieLens-100k) gets a data directory of its own "
         "(<paths.data_dir>-<name>).")


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@_PROFILE
def main() -> None:
    """Flywheel: a real-time recommendation and ad-CTR platform on one machine."""


# --- the local stack ----------------------------------------------------------------------------

@main.command()
@_PROFILE
@_DATASET
def up() -> None:
    """Start the local stack (idempotent) and wait until every service is healthy."""
    from infra.stack import StackError, up as stack_up

    s = _settings()
    t0 = time.monotonic()
    try:
        started = stack_up(s, say=click.echo)
    except StackError as exc:
        raise click.ClickException(str(exc)) from None
    what = f"started {', '.join(started)}" if started else "already running"
    click.echo(f"stack up ({what}) in {time.monotonic() - t0:.1f}s; data in {s.paths.data_dir}")
    _print_status(s)


@main.command()
@_PROFILE
@_DATASET
def down() -> None:
    """Stop the services `up` started for this data directory."""
    from infra.stack import down as stack_down

    s = _settings()
    stopped = stack_down(s)
    click.echo(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")


@main.command()
@_PROFILE
@_DATASET
@click.option("--show-secrets", is_flag=True, help="Print the UIs' passwords themselves, not where they are.")
@click.option("--json", "as_json", is_flag=True,
              help="A JSON list of the services: name, state, pid, url, detail (no passwords).")
def status(show_secrets: bool, as_json: bool) -> None:
    """Health and URL of each service; exits 1 if a local service is not healthy."""
    from dataclasses import asdict

    from infra.stack import status as stack_status

    s = _settings()
    if as_json:
        rows = stack_status(s)
        click.echo(json.dumps([asdict(r) for r in rows], indent=1))
        healthy = all(r.state in ("healthy", "external") for r in rows)
    else:
        healthy = _print_status(s, show_secrets)
    if not healthy:
        sys.exit(1)


def _print_status(s: Settings, show_secrets: bool = False) -> bool:
    from flywheel.datasets import dataset_flag
    from infra.settings import airflow_password, mlflow_password, password_file, password_source
    from infra.stack import status as stack_status

    rows = stack_status(s)
    for r in rows:
        pid = str(r.pid) if r.pid else "-"
        click.echo(f"{r.name:<22} {r.state:<10} pid {pid:<8} {r.url:<28} {r.detail}")
    for service, label, url, user, password in (
            ("airflow", "Airflow UI:", s.airflow.api_url, s.airflow.username, airflow_password),
            ("mlflow", "MLflow UI: ", s.mlflow.tracking_uri, s.mlflow.username, mlflow_password)):
        if service in s.stack.services:
            where = f"password in {password_source(s, service)} (`flywheel status{dataset_flag(s)} --show-secrets` " \
                    "prints it)"
            if show_secrets:  # never a new one: a stack that never started here has none
                fresh = not getattr(s, service).password and not password_file(s, service).exists()
                where = f"no password: the stack of {s.paths.data_dir} never started" if fresh else password(s)
            click.echo(f"{label} {url}  login: {user} / {where}")
    if any(r.name == "prometheus" and r.state in ("healthy", "external") for r in rows):
        _print_alerts(s)
    return all(r.state in ("healthy", "external") for r in rows)


def _print_alerts(s: Settings) -> None:
    """The alerts firing, each with what it says (infra/monitoring.py: the rules), and the dashboard."""
    import httpx

    from infra.monitoring import firing

    try:
        alerts = firing(s)
    except httpx.HTTPError as exc:
        click.echo(f"Alerts: Prometheus did not answer ({type(exc).__name__})")
        return
    click.echo(f"Dashboard:  {s.prometheus.url}/consoles/flywheel.html   alerts: {s.prometheus.url}/alerts")
    for a in sorted(alerts, key=lambda a: (a["name"], a["summary"])):
        click.echo(f"  FIRING {a['name']:<30} since {a['since'][:19]}  {a['summary']}")


@main.command()
@click.argument("service")
@click.option("-n", "--lines", default=50, show_default=True, help="How many last lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
def logs(service: str, lines: int, follow: bool) -> None:
    """Show a service's log (kafka, redis, mlflow, airflow-api-server, airflow-scheduler, ...)."""
    from infra.services import all_services
    from infra.stack import logfile

    s = _settings()
    services = {svc.name: svc for svc in all_services(s)}
    if service not in services:
        raise click.BadParameter(f"unknown service {service!r}; one of {', '.join(services)}")
    path = logfile(s, services[service])
    click.echo(process.tail(path, lines) or f"(no log yet at {path})")
    if follow:
        with open(path, "rb") as f:
            f.seek(0, 2)
            while True:
                line = f.readline()
                if line:
                    click.echo(line.decode(errors="replace"), nl=False)
                else:
                    time.sleep(0.5)


# --- events ------------------------------------------------------------------------------------

def _end_offsets(s: Settings, topic: str) -> dict[int, int]:
    from streaming.topics import end_offsets

    try:
        return end_offsets(s, topic)
    except LookupError as exc:
        raise click.ClickException(f"{exc}; create it with `flywheel topics`") from None


@main.command()
@click.argument("names", nargs=-1)
def topics(names: tuple[str, ...]) -> None:
    """Create topics (default: the events topic) and their dead-letter topics if missing."""
    from streaming.topics import ensure_topics

    s = _settings()
    wanted = list(names) or [s.kafka.events_topic]
    ensure_topics(s, wanted)
    click.echo(f"topics ready: {', '.join(t for w in wanted for t in (w, s.kafka.dlq_topic(w)))} "
               f"({s.kafka.partitions} partitions each when created here)")


def _preflight(s: Settings, tables: bool = True) -> None:
    """The spec's history file (and with `tables` its tables) against the spec, by their headers: every
    column it names, before any service starts or any event is produced: what to fix, in one line."""
    from feature_repo.tables import CatalogError, check_tables
    from streaming.history import HistoryError, check_history

    try:
        check_history(s)
        if tables:
            check_tables(s)
    except (HistoryError, CatalogError) as exc:
        raise click.ClickException(str(exc)) from None


def _replay(s: Settings, topic: str, limit: int | None, speed: float) -> ProduceReport:
    from streaming.history import HistoryError, history_events
    from streaming.produce import event_time_pace, produce
    from streaming.producer import EventProducer

    with EventProducer(s, topic) as producer:
        try:
            report = produce(history_events(s, limit), producer, pace=event_time_pace(speed),
                             desc=f"replay {s.spec.name}")
        except HistoryError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"replayed {s.spec.name}: {report.total} events ({dict(report.by_type)}) in {report.seconds:.1f}s "
               f"= {report.rate:,.0f} events/s")
    return report


@main.command()
@click.option("--limit", type=int, default=None, help="Replay only the first N ratings (MovieLens) or events (a file).")
@click.option("--speed", type=float, default=0.0, show_default=True,
              help="Event-time speed-up (86400 = a day per second); 0 = as fast as possible.")
@click.option("--topic", default=None, help="Target topic (default: settings kafka.events_topic).")
def replay(limit: int | None, speed: float, topic: str | None) -> None:
    """Replay the dataset spec's past events into Kafka in event-time order (`[events.history]`; MovieLens:
    each rating an impression, >= 4 also a click)."""
    from streaming.topics import ensure_topics

    s = _settings()
    _preflight(s, tables=False)  # a replay reads the history only
    topic = topic or s.kafka.events_topic
    ensure_topics(s, [topic])
    _replay(s, topic, limit, speed)


def _load_catalog(s: Settings) -> None:
    from feature_repo.catalog import load_catalog, materialize
    from feature_repo.tables import CatalogError

    try:
        rows = load_catalog(s)
    except CatalogError as exc:  # a table that does not match the spec: nothing was written
        raise click.ClickException(str(exc)) from None
    materialize(s)
    click.echo(f"catalog in the offline store and materialized online: {rows}")


@main.command()
def catalog() -> None:
    """Load the dataset spec's item and user tables (batch feature views) and materialize them online."""
    _load_catalog(_settings())


@main.command()
@click.option("--rate", type=float, default=0.0, show_default=True, help="Events per second; 0 = max.")
@click.option("--limit", type=int, default=None, help="Stop after N events.")
@click.option("--duration", type=float, default=None, help="Stop after S seconds.")
@click.option("--users", type=int, default=10_000, show_default=True)
@click.option("--items", type=int, default=5_000, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--topic", default=None, help="Target topic (default: settings kafka.events_topic).")
@click.option("--learn-from-it", is_flag=True, help="Ordinary traffic that training uses (default: marked as "
              "test traffic, context test_traffic=true, which training and evaluation skip).")
def generate(rate: float, limit: int | None, duration: float | None, users: int, items: int, seed: int,
             topic: str | None, learn_from_it: bool) -> None:
    """Produce synthetic events with a learnable click signal (load tests)."""
    from streaming.produce import fixed_rate_pace, produce
    from streaming.producer import EventProducer
    from streaming.synthetic import SyntheticConfig, SyntheticGenerator

    if limit is None and duration is None:
        raise click.UsageError("give --limit or --duration")
    from streaming.topics import ensure_topics

    s = _settings()
    topic = topic or s.kafka.events_topic
    ensure_topics(s, [topic])
    generator = SyntheticGenerator(SyntheticConfig(users=users, items=items, seed=seed, test_traffic=not learn_from_it))
    with EventProducer(s, topic) as producer:
        report = produce(generator.events(), producer, pace=fixed_rate_pace(rate), limit=limit,
                         duration_s=duration, desc="synthetic")
    click.echo(f"sent {report.total} events ({dict(report.by_type)}) in {report.seconds:.1f}s "
               f"= {report.rate:,.0f} events/s")


@main.command()
@click.option("--topic", default=None, help="Topic (default: settings kafka.events_topic).")
def count(topic: str | None) -> None:
    """Count the events in a topic by type (invalid records counted apart)."""
    from streaming.produce import count_landed

    s = _settings()
    topic = topic or s.kafka.events_topic
    counts = count_landed(s, topic, {}, _end_offsets(s, topic))
    click.echo(f"{topic}: {sum(counts.values())} records {dict(sorted(counts.items()))}")


@main.command()
@click.option("--topic", default=None, help="Source topic whose dead letters to show.")
@click.option("--limit", type=int, default=20, show_default=True)
def dlq(topic: str | None, limit: int) -> None:
    """Show the last dead-lettered records of a topic with the reason each was refused. A record
    dead-lettered again (the stream job replaying after a restart) is shown once."""
    from streaming.consumer import read_dead_letter
    from streaming.topics import read_range

    s = _settings()
    dlq_topic = s.kafka.dlq_topic(topic or s.kafka.events_topic)
    end = _end_offsets(s, dlq_topic)
    start = {p: max(0, o - 4 * limit) for p, o in end.items()}
    letters = {}  # source (topic, partition, offset) -> letter; unnamed ones are all kept
    for n, d in enumerate(read_dead_letter(r) for r in read_range(s, dlq_topic, start, end)):
        letters.setdefault((d.topic, d.partition, d.offset) if d.offset >= 0 else n, d)
    shown = list(letters.values())[-limit:]
    click.echo(f"{dlq_topic}: {sum(end.values())} dead letters; last {len(shown)} distinct:")
    for d in shown:
        value = (d.value or b"")[:80].decode(errors="replace")
        size = "" if d.original_size is None else f" ({d.original_size} bytes)"
        click.echo(f"  {d.topic}[{d.partition}]@{d.offset}: {d.reason}{size}  value={value!r}")


# --- the platform's main job -------------------------------------------------------------------

# --- models ----------------------------------------------------------------------------------------

_DATE = click.DateTime(["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z"])


def _utc(value: datetime | None) -> datetime | None:
    return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)


def _models_call(fn, *args, **kwargs):
    """Run a models/ operation; its input and registry errors become one clear line."""
    from models.registry import RegistryError

    try:
        return fn(*args, **kwargs)
    except (RegistryError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _echo_outcome(outcome) -> None:
    metrics = ", ".join(f"{k}={v:.4f}" for k, v in outcome.metrics.items())
    click.echo(f"registered v{outcome.version} (data {outcome.window}): {metrics}")
    if outcome.decision:
        verdict = "promoted to @champion" if outcome.decision.promoted else "refused, now @challenger"
        click.echo(f"gate: {verdict}: {outcome.decision.reason}")


def _architecture(ctx: click.Context, param: click.Parameter, kind: str | None) -> str | None:
    """A registered architecture's name or a network's import path, checked before any work."""
    from models.architectures import ArchitectureError, architecture

    try:
        return None if kind is None else architecture(kind).name
    except ArchitectureError as exc:
        raise click.BadParameter(str(exc)) from None


_SCENARIO = click.option("--scenario", default=None,
                          help="A scenario the dataset spec declares ([scenarios.<name>]): its ranker, on its own "
                               "exposures (default: the platform's ranker, on every exposure).")


def _ranker(scenario: str | None) -> tuple[Settings, RegisteredModel]:
    return _registered(None, scenario)


@main.command()
@click.option("--start", type=_DATE, required=True, help="First impression time of the training data (UTC).")
@click.option("--end", type=_DATE, required=True, help="End of the training data (exclusive).")
@click.option("--kind", default=None, callback=_architecture,
              help="The network: ranker, ranker-v1, logreg (models/architectures.py) or a user's by import path, "
                   "package.module:attribute. Default: the setting models.architecture.")
@click.option("--promote/--no-promote", default=True, show_default=True, help="Run the promotion gate.")
@click.option("--without", multiple=True, metavar="NAME",
              help="Leave out the numeric inputs or request context fields this name or pattern matches ('dept_*', "
                   "'page'; repeatable): an ablation, on the same split as a version trained on the same window "
                   "with them.")
@_SCENARIO
def train(start: datetime, end: datetime, kind: str | None, promote: bool, without: tuple[str, ...],
          scenario: str | None) -> None:
    """Full training on a window: chronological split, MLflow run, registered version, gate."""
    from models.dataset import Window
    from models.train import train_full

    s, model = _ranker(scenario)
    _echo_outcome(_models_call(train_full, s, Window(_utc(start), _utc(end)), kind, promote, model=model,
                               without=without))


@main.command("train-incremental")
@click.option("--until", type=_DATE, default=None, help="End of the new data (default: now).")
@click.option("--promote/--no-promote", default=True, show_default=True)
@_SCENARIO
def train_incremental(until: datetime | None, promote: bool, scenario: str | None) -> None:
    """Continue @champion on the events since its data watermark; publish the version and its delta."""
    from models.train import train_incremental as run

    s, model = _ranker(scenario)
    outcome = _models_call(run, s, _utc(until), promote, model=model)
    if outcome is None:
        click.echo("nothing to train: too few new events since the champion's data watermark")
    else:
        _echo_outcome(outcome)


@main.command()
@click.argument("version")
@click.option("--start", type=_DATE, required=True)
@click.option("--end", type=_DATE, required=True)
@_SCENARIO
def evaluate(version: str, start: datetime, end: datetime, scenario: str | None) -> None:
    """Metrics of a registered version on the impressions of a window (a scenario's: of its own exposures)."""
    from models.dataset import Window, training_set
    from models.metrics import evaluate as metrics_of
    from models.registry import load_version

    s, model = _ranker(scenario)

    def run() -> dict[str, float]:
        ex, _ = training_set(s, Window(_utc(start), _utc(end)), s.streaming.sequence_length, model.scenario)
        return metrics_of(ex.labels, load_version(s, version, model).predict(ex))

    click.echo(", ".join(f"{k}={v:.4f}" for k, v in _models_call(run).items()))


@main.command()
@click.argument("version")
@_SCENARIO
def promote(version: str, scenario: str | None) -> None:
    """Run the promotion gate for a registered version on its recorded evaluation window."""
    from models.train import gate_version

    s, model = _ranker(scenario)
    decision = _models_call(gate_version, s, version, model)
    click.echo(f"v{version} {'promoted to @champion' if decision.promoted else 'refused'}: {decision.reason}")


_MODEL = click.option("--model", "model_name", default=None,
                       help="Registered model (default: the ranker, models.name; the retrieval model is "
                            "retrieval.name, flywheel-retrieval).")


def _registered(model_name: str | None, scenario: str | None) -> tuple[Settings, RegisteredModel]:
    s = _settings()
    try:
        return s, s.model_for(model_name, scenario)
    except SettingsError as exc:
        raise click.BadParameter(str(exc), param_hint="--scenario") from None


@main.command()
@click.option("--why", required=True, help="Reason, recorded on the version rolled back from.")
@click.option("--to", "target", default="previous", show_default=True, help="Version, or 'previous'.")
@_MODEL
@_SCENARIO
def rollback(why: str, target: str, model_name: str | None, scenario: str | None) -> None:
    """Move @champion back to the previous champion (or a given version)."""
    from models.registry import rollback as run

    s, model = _registered(model_name, scenario)
    old, new = _models_call(run, s, why, target, model=model)
    click.echo(f"@champion: v{old} -> v{new}")


@main.group()
def experiment() -> None:
    """A share of users pinned to a frozen version (@holdout) beside the champion as it learns, and what each arm
    served."""


@experiment.command("start")
@click.option("--percent", type=click.FloatRange(0, 100, min_open=True, max_open=True), required=True,
              help="The frozen arm's share of users (a stable hash of the user id).")
@click.option("--version", default=None, help="The frozen version (default: the one that passed the last canary: "
                                               "@control's while a new champion is in its canary, else @champion's).")
@_SCENARIO
def experiment_start(percent: float, version: str | None, scenario: str | None) -> None:
    """Pin a share of users to a version that never moves; the others follow @champion and its canaries."""
    from models.registry import start_experiment

    s, model = _ranker(scenario)
    running = _models_call(start_experiment, s, percent, version, model)
    click.echo(f"{model.name}@holdout v{running.version} serves {running.percent:g}% of users from "
               f"{running.started_at:%Y-%m-%d %H:%M:%S} UTC; the others follow @champion")


@experiment.command("stop")
@_SCENARIO
def experiment_stop(scenario: str | None) -> None:
    """The holdout's users back to the champion's routes (`show` still reads the arms it served)."""
    from models.registry import stop_experiment

    s, model = _ranker(scenario)
    ran = _models_call(stop_experiment, s, model)
    click.echo(f"stopped: {model.name}@holdout v{ran.version} served {ran.percent:g}% of users since "
               f"{ran.started_at:%Y-%m-%d %H:%M:%S} UTC; its users follow @champion's routes again")


def _arm_line(name: str, a) -> str:
    crossed = f"; {a.crossed:,} items served by the other arm's model" if a.crossed else ""
    return (f"{name:<9} {a.users:>7,} users {a.requests:>8,} requests {a.items:>9,} items {a.clicks:>7,} clicks  "
            f"CTR {a.ctr:.4f} (95%: {a.low:.4f}-{a.high:.4f}), {a.clicks_per_request:.3f} clicks per request{crossed}")


@experiment.command("show")
@click.option("--since", type=_DATE, default=None, help="First serving time (UTC; default: the experiment's start).")
@click.option("--until", type=_DATE, default=None, help="End of the period (exclusive; default: now).")
@click.option("--endpoint", type=click.Choice(["rank", "recommend"]), default="rank", show_default=True,
              help="The lists measured: /recommend's candidates come from retrieval, which no arm holds out.")
@click.option("--bucket", "bucket_s", type=click.FloatRange(min=1), default=None,
              help="Also each arm per this many seconds of serving.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: arms, ratio and (with --bucket) buckets.")
@_SCENARIO
def experiment_show(since: datetime | None, until: datetime | None, endpoint: str, bucket_s: float | None,
                    as_json: bool, scenario: str | None) -> None:
    """Each arm's served CTR with its 95% interval and the learning arm's over the frozen one's, from the
    prediction archive joined to the event log's clicks: the experiment running, else the last one that ran."""
    from dataclasses import asdict

    from flywheel.drift import json_ready
    from models.registry import experiment as find_experiment
    from serving.experiments import compare, over_time
    from serving.outcomes import endpoints, served_outcomes

    s, model = _ranker(scenario)
    running = _models_call(find_experiment, s, model, last=True)
    if running is None:
        raise click.ClickException(f"no experiment has run on {model.name}: `flywheel experiment start`")
    start = _utc(since) if since is not None else running.started_at
    served = served_outcomes(s, int(start.timestamp() * 1000),
                             None if until is None else int(_utc(until).timestamp() * 1000), model.name)
    served = served[endpoints(served) == endpoint] if len(served) else served
    arms, ratio = compare(served, running)
    buckets = over_time(served, running, bucket_s) if bucket_s else None
    if as_json:
        click.echo(json.dumps(json_ready({
            "model_name": model.name, "holdout": running.version, "percent": running.percent,
            "started_at": running.started_at.isoformat(), "since": start.isoformat(), "endpoint": endpoint,
            "arms": {k: asdict(a) for k, a in arms.items()}, "ratio": asdict(ratio),
            "buckets": None if buckets is None else buckets.to_dict("records")}), allow_nan=False))
        return
    click.echo(f"{model.name}: @holdout v{running.version} on {running.percent:g}% of users from "
               f"{running.started_at:%Y-%m-%d %H:%M:%S} UTC; /{endpoint} lists served since "
               f"{start.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC")
    for name, a in arms.items():
        click.echo(_arm_line(name, a))
    click.echo(f"learning / frozen CTR {ratio.ratio:.3f} (95%: {ratio.low:.3f}-{ratio.high:.3f})")
    for r in [] if buckets is None else buckets.to_dict("records"):
        stamp = datetime.fromtimestamp(r["t"] / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{stamp} {r['arm']:<9} {r['requests']:>6,} requests CTR {r['ctr']:.4f} "
                   f"({r['low']:.4f}-{r['high']:.4f})" + (f"  ratio {r['ratio']:.3f}" if r["arm"] == "learning"
                                                           else ""))


def _offline_features(s, user_id: str, item_id: str | None, category: str | None, context: dict, reader,
                      names: list[str], at: datetime | None) -> dict:
    """`names` (what the online store holds for the same entities) as the offline store's point-in-time join
    gives them at `at` (None: now; models/dataset.py: features_as_of; None: nothing stored, or past its TTL)."""
    import pandas as pd

    from models.dataset import features_as_of

    of_item = {k: v[0] for k, v in reader.groups_of([item_id]).items()} if item_id else {}
    keys = of_item | {k: reader.context_of(context)[k] for k in reader.context_keys}
    entity = pd.DataFrame([{"user_id": user_id, "item_id": item_id or "", "category": category or "", **keys,
                            "event_timestamp": pd.Timestamp(at) if at else pd.Timestamp.now(tz="UTC"), "row": 0}])
    joined = features_as_of(s, entity).iloc[0]
    return {name: _plain(joined[name]) for name in names if name in joined.index}


def _plain(value: object) -> object:
    """A joined value as JSON holds it (numpy lists and numbers as Python's; NaN, NA: None)."""
    import pandas as pd

    value = value.tolist() if hasattr(value, "tolist") else value
    return None if not isinstance(value, list) and pd.isna(value) else value


@main.command()
@click.option("--user", "user_id", required=True, help="The user whose online features to show.")
@click.option("--item", "item_id", default=None, help="Also this item's features.")
@click.option("--category", default=None, help="Also the user x category features (default: the item's category "
              "in the catalog); the user x the item's further keys are the catalog's.")
@click.option("--context", "context", multiple=True, metavar="FIELD=VALUE", help="A request's context field (the "
              "spec's [events.context]): the user x the value of a key that is one (a page; default: its default).")
@click.option("--offline", is_flag=True, help="The offline store's values instead: the point-in-time join a "
              "training set makes for an exposure at --at (a row older than its view's TTL then: null).")
@click.option("--at", type=_DATE, default=None, help="With --offline: the exposure's time (UTC; default: now).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: feature name -> value (missing = null).")
def features(user_id: str, item_id: str | None, category: str | None, context: tuple[str, ...], offline: bool,
             at: datetime | None, as_json: bool) -> None:
    """The online features the ranking server reads for a user (and an item), as stored now; or, with --offline,
    what a training set joins for them."""
    import redis

    from serving.features import OnlineFeatures

    s = _settings()
    if item_id and category is None:
        from streaming.history import ItemKeyFile, item_keys_path

        category = ItemKeyFile(item_keys_path(s)).get(item_id) or None
    given = dict(field.partition("=")[::2] for field in context)
    if undeclared := s.spec.undeclared_context(given):
        raise click.BadParameter(f"{', '.join(undeclared)}: not a context field of dataset {s.spec.name} (declared: "
                                 f"{', '.join(c.name for c in s.spec.context) or 'none'})", param_hint="--context")
    try:
        reader = OnlineFeatures(s)
        values = reader.entity_features(user_id, item_id, category, given)
        if offline:
            values = _offline_features(s, user_id, item_id, category, given, reader, list(values), _utc(at))
    except redis.RedisError as exc:
        raise click.ClickException(f"Redis at {s.redis.url}: {exc}. Is the stack up (`flywheel status`)?") from None
    except ValueError as exc:  # the feature repo was never applied
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(values))
        return
    for name, value in values.items():
        click.echo(f"{name:28} {'-' if value is None else value}")


@main.command()
@click.option("--since", type=_DATE, default=None, help="First serving time (UTC; default: all archived).")
@click.option("--until", type=_DATE, default=None, help="End of the serving period (exclusive).")
@click.option("--json", "as_json", is_flag=True, help="One JSON list: a row per model version and endpoint.")
def outcomes(since: datetime | None, until: datetime | None, as_json: bool) -> None:
    """What each model version served per endpoint (/rank, /recommend) and its AUC on that traffic, pooled
    over the items and per list, from the prediction archive and the event log (offline: survives a
    restart of the broker)."""
    from serving.outcomes import auc_by_version, ctr_by_source, served_outcomes

    ms = lambda d: None if d is None else int(_utc(d).timestamp() * 1000)  # noqa: E731
    served = served_outcomes(_settings(), ms(since), ms(until))
    table = auc_by_version(served)
    if as_json:
        click.echo(table.to_json(orient="records") if len(table) else "[]")  # NaN (no AUC) -> null
        return
    rows = table.to_dict("records")
    if not rows:
        click.echo("no served predictions archived in that period")
    for r in rows:
        first, last = (datetime.fromtimestamp(r[k] / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
                       for k in ("first_served", "last_served"))
        click.echo(f"v{r['model_version']:<4} /{r['endpoint']:<9} served {r['requests']:,} requests / {r['items']:,} "
                   f"items {first} .. {last} UTC, clicks {r['clicks']:,}, CTR {r['ctr']:.4f}, AUC {r['auc']:.4f} "
                   f"pooled, {r['list_auc']:.4f} per list ({r['judged']:,} judged lists)")
    for source, c in ctr_by_source(served).items():
        d = c.get("difference")
        click.echo(f"recommended by {source}: {c['impressions']:,} items shown, clicks {c['clicks']:,}, "
                   f"CTR {c['ctr']:.4f} (95%: {c['low']:.4f}-{c['high']:.4f})"
                   + (f", {d['ctr']:+.4f} ({d['low']:+.4f} to {d['high']:+.4f}) vs popularity" if d else ""))


@main.command()
@click.option("--since", type=_DATE, default=None, help="First serving time (UTC; default: all archived).")
@click.option("--until", type=_DATE, default=None, help="End of the serving period (exclusive).")
@click.option("--requests", type=click.IntRange(1), default=2000, show_default=True,
              help="The newest /rank lists of the period compared.")
@click.option("--json", "as_json", is_flag=True, help="One JSON list: a row per feature.")
def consistency(since: datetime | None, until: datetime | None, requests: int, as_json: bool) -> None:
    """Features served vs features trained on: for the newest served /rank lists, each numeric feature's value
    as the ranking server read it (the prediction archive) against the training join's value for the same
    user, item and time; the mismatch rate per feature and its causes (also the exporter's
    flywheel_feature_mismatch_ratio, until the next report)."""
    from serving.consistency import report, save

    ms = lambda d: None if d is None else int(_utc(d).timestamp() * 1000)  # noqa: E731
    s = _settings()
    table, counts = report(s, ms(since), ms(until), requests)
    save(s, table, counts, ms(since), ms(until))  # /metrics/consistency says the last report
    if as_json:
        click.echo(table.to_json(orient="records") if len(table) else "[]")
        return
    if not len(table):
        click.echo(f"{counts['lists']:,} served /rank lists archived in that period, none of them shown to anyone (a "
                   "load test's?): nothing was trained on them; --since/--until choose another period")
        return
    click.echo(f"{counts['lists']:,} served /rank lists, {counts['served']:,} candidates shown, {counts['compared']:,} "
               "of them in the training set; per feature, served vs the training set (vs a point-in-time join):")
    for r in table.to_dict("records"):
        click.echo(f"  {r['feature']:<26} {r['mismatched']:>6,} of {r['compared']:,} ({r['rate']:.2%}) "
                   f"(point-in-time {r['point_in_time_mismatched']:,}, {r['point_in_time_rate']:.2%}: missing online "
                   f"{r['missing_online']:,}, offline {r['missing_offline']:,})")


@main.command()
def serve() -> None:
    """Run the ranking server (settings [serving]) in the foreground until interrupted."""
    from serving.supervisor import serve as run

    _models_call(run, _settings())


@main.command()
@_MODEL
@_SCENARIO
def versions(model_name: str | None, scenario: str | None) -> None:
    """Registered versions, newest first, with aliases, lineage and gate decisions."""
    from models.registry import list_versions

    s, model = _registered(model_name, scenario)
    rows = _models_call(list_versions, s, model)
    if not rows:
        click.echo("no registered versions")
    for r in rows:
        flags = f"@{r['aliases']}" if r["aliases"] else ""
        parent = f" parent v{r['parent']}" if r["parent"] else ""
        measure = f"recall {r['recall']:<9}" if r["recall"] else f"auc {r['auc'] or '-':<9}"  # retrieval / ranker
        click.echo(f"v{r['version']:<4} {flags:<22} {r['kind']:<7} {measure} {r['gate'] or '-':<9}"
                   f" data {r['data']}{parent}")
        if r["reason"]:
            click.echo(f"      gate: {r['reason']}")
        if r["canary"]:
            click.echo(f"      canary: {r['canary']}")
        if r["rolled_back"]:
            click.echo(f"      rolled back by {r['rolled_back_by'] or '-'}: {r['rolled_back']}")
        if r["drill"]:
            click.echo(f"      drill: {r['drill']}")


@main.command()
@click.argument("dag_id")
@click.option("--conf", default="{}", show_default=True, help="The run's parameters, as a JSON object.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the run finishes.")
@click.option("--scenario", default=None,
              help="A scenario the dataset spec declares: the run's `scenario` parameter (offline_training, "
                   "incremental_training, model_rollback act on its ranker).")
def trigger(dag_id: str, conf: str, wait: bool, scenario: str | None) -> None:
    """Start a run of an Airflow DAG through the REST API, e.g.
    `flywheel trigger model_rollback --conf '{"reason": "bad canary"}'`. Unpauses the DAG."""
    from infra.airflow_api import AirflowApiError, AirflowClient

    try:
        params = json.loads(conf)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--conf") from None
    if not isinstance(params, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--conf")
    if scenario is not None:
        if params.get("scenario", scenario) != scenario:
            raise click.UsageError(f"--scenario {scenario} and the conf's scenario {params['scenario']!r} differ")
        _ranker(scenario)  # a scenario the spec does not declare is refused here, naming the declared ones
        params["scenario"] = scenario
    s = _settings()
    try:
        client = AirflowClient(s)
        run_id = client.trigger(dag_id, params)
        click.echo(f"{dag_id}: run {run_id}  ({s.airflow.api_url}/dags/{dag_id}/runs/{run_id})")
        if not wait:
            return
        state = client.wait(dag_id, run_id)
        for task_id, task_state in client.task_states(dag_id, run_id).items():
            click.echo(f"  {task_id:<20} {task_state}")
        for task_id, error in client.failures(dag_id, run_id).items():
            click.echo(f"{task_id} failed: {error or 'see its log in the Airflow UI'}", err=True)
    except AirflowApiError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{dag_id}: {state}")
    if state != "success":
        sys.exit(1)


@main.command()
@_DATASET
@click.option("--requests", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Requests each policy's clicks are averaged over (the same users and candidates for each).")
@click.option("--live", "live_s", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Instead: the world's users as traffic on the running stack for this long (its changes at their "
                   "times from the start), what they do with what they are shown into Kafka.")
@click.option("--rate", type=click.FloatRange(min=0.1), default=None, help="With --live: requests per second "
                                                                            "(default: the world's [traffic] rate).")
@click.option("--seed", type=int, default=0, show_default=True, help="With --live: the traffic's draws.")
def world(requests: int, live_s: float | None, rate: float | None, seed: int) -> None:
    """What the dataset's simulated world (world.toml beside its spec) offers a ranker: the clicks per shown item
    of the true order, a random one and, after each change, the order the world had before it. Size a world's
    changes here before a run. With --live, its users are the running stack's traffic."""
    import numpy as np

    from infra.dataset import SpecError
    from streaming.world import WORLD_FILE, World, load_world

    s = _settings()
    path = s.spec.path.parent / WORLD_FILE
    if not path.exists():
        raise click.ClickException(f"{s.spec.path}: no {WORLD_FILE} beside it: the dataset declares no world")
    try:
        w = World(load_world(path))
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    if live_s is not None:
        _live_world(s, w, live_s, rate, seed)
        return
    t, h = w.spec.truth, w.spec.history
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    click.echo(f"world {shown}: {t.users:,} users, {t.items:,} items in {t.categories} categories, {t.clusters} "
               f"taste clusters; history {h.requests:,} requests over {h.days} days from {h.start}")

    def random_order(user: int, items: np.ndarray, t_s: float) -> np.ndarray:
        return np.random.default_rng([user, len(items), int(t_s)]).random(len(items))

    def line(at_s: float, stale: float | None) -> str:
        oracle = w.expected_ctr(w.oracle(), at_s, requests)
        before = "" if stale is None else f"  as before {(b := w.expected_ctr(w.oracle(stale), at_s, requests)):.4f}" \
                                          f" ({b / oracle:.2f}x)"
        random = w.expected_ctr(random_order, at_s, requests)
        return f"at {at_s:>6.0f} s: true order {oracle:.4f}{before}  random {random:.4f}"

    click.echo(line(0.0, None))
    for at_s in sorted({c.at_s for c in w.spec.changes}):
        what = ", ".join(str(c.what) for c in w.spec.changes if c.at_s == at_s)
        click.echo(f"change at {at_s:.0f} s: {what}")
        click.echo(line(at_s, at_s - 1.0))
    click.echo("(clicks per shown item, in expectation; the true order knows each user's taste of the moment)")


def _live_world(s: Settings, w, seconds: float, rate: float | None, seed: int) -> None:
    """The world's traffic on the running stack, a line a minute: requests answered, items shown, clicks, CTR."""
    from flywheel.world_traffic import WorldTraffic
    from streaming.world import CLICK, IMPRESSION, PURCHASE

    server = f"http://{s.serving.host}:{s.serving.port}"
    traffic = WorldTraffic(s, w, server, seed, rate)
    click.echo(f"the world's users on {server} at {traffic.rate:g} requests/s for {seconds:.0f} s; changes at "
               + (", ".join(f"{c.at_s:.0f} s ({c.what})" for c in w.spec.changes) or "none"))
    traffic.thread.start()
    reported = 0
    try:
        while traffic.thread.is_alive() and traffic.now_s() < seconds and traffic.error is None:
            time.sleep(1.0)
            if traffic.now_s() >= 60 * (reported + 1) or traffic.now_s() >= seconds:
                reported += 1
                answered, e = sum(r.status == 200 for r in traffic.results), traffic.events
                click.echo(f"{traffic.now_s():>5.0f} s: {answered:,} answered, {len(traffic.results) - answered:,}"
                           f" refused; shown {e[IMPRESSION]:,}, clicks {e[CLICK]:,} (CTR "
                           f"{e[CLICK] / max(e[IMPRESSION], 1):.4f}), purchases {e[PURCHASE]:,}")
    finally:
        traffic.stop.set()
        traffic.thread.join()
    if traffic.error is not None:
        raise click.ClickException(f"the traffic stopped: {traffic.error}")


@main.command()
@_DATASET
@click.option("--percent", type=click.FloatRange(0, 100, min_open=True, max_open=True), default=50.0,
              show_default=True, help="The frozen arm's share of users.")
@click.option("--after", "after_s", type=click.FloatRange(min=60), default=600.0, show_default=True,
              help="Seconds of traffic after the world's first change.")
@click.option("--warmup", "warmup_s", type=click.FloatRange(min=0), default=240.0, show_default=True,
              help="Seconds of traffic everyone learns from before the experiment holds the champion of then "
                   "(once a version learnt from it has passed its canary).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where drift.png and drift.json go (default: <data dir>/drift).")
@click.option("--fresh", is_flag=True, help="Stop the stack of the data directory and empty it first.")
def drift(percent: float, after_s: float, warmup_s: float, out: Path | None, fresh: bool) -> None:
    """Does learning pay? The dataset's world on a fresh stack: the history, the first champion, then its users as
    traffic; after a warm-up of learning, a share of them held on the champion of then while the others follow
    @champion as it learns; each arm's served CTR before and after the world changes. Ends with one line,
    `drift: ...` (flywheel/drift.py)."""
    import shutil

    from flywheel.demo import LoopError
    from flywheel.drift import DriftError, run
    from infra.airflow_api import AirflowApiError
    from infra.settings import REPO_ROOT
    from infra.stack import StackError, down
    from streaming.world import WORLD_FILE

    s = _settings()
    if not (s.spec.path.parent / WORLD_FILE).exists():
        raise click.ClickException(f"{s.spec.path}: no {WORLD_FILE} beside it: the dataset declares no world "
                                   "(`--dataset world`: the bundled one)")
    _preflight(s)
    data = s.paths.data_dir.resolve()
    if data.exists() and any(data.iterdir()):
        if not fresh:
            raise click.ClickException(f"{data} holds a stack's data: the run starts from none (--fresh stops that "
                                       "stack and empties it)")
        if not (data / "run").is_dir() or any(p.is_relative_to(data) for p in (REPO_ROOT, Path.home(),
                                                                                 s.paths.cache_dir.resolve())):
            raise click.ClickException(f"{data} is not a stack's data directory (no run/ in it, or it holds the "
                                       "repository, the cache or your home): --fresh empties only those")
        down(s)
        shutil.rmtree(data)

    def say(line: str) -> None:
        click.echo(f"[{datetime.now(UTC):%H:%M:%S}] {line}")

    try:
        click.echo(_models_call(run, s, percent, after_s, warmup_s, out, say))
    except (DriftError, LoopError, StackError, AirflowApiError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command("world-drill")
@_DATASET
@click.option("--within", "within_s", type=click.FloatRange(min=60), default=300.0, show_default=True,
              help="Seconds after its promotion by which the canary analysis must have rolled the regression back.")
@click.option("--seed", type=int, default=0, show_default=True, help="The shuffle's and the traffic's draws.")
def world_drill(within_s: float, seed: int) -> None:
    """A realistic regression on the running stack's world: a version trained on its champion's history with the
    labels shuffled (gated on a test part shuffled the same way, so the gate promotes it) in its canary while the
    world's users are the traffic; the canary analysis must roll it back by itself. Ends with one line,
    `world-drill: ...` (flywheel/world_drill.py); exits 1 when it is not rolled back in time."""
    from flywheel.world_drill import WorldDrillError, run
    from infra.airflow_api import AirflowApiError
    from streaming.world import WORLD_FILE

    s = _settings()
    if not (s.spec.path.parent / WORLD_FILE).exists():
        raise click.ClickException(f"{s.spec.path}: no {WORLD_FILE} beside it: the dataset declares no world")

    def say(line: str) -> None:
        click.echo(f"[{datetime.now(UTC):%H:%M:%S}] {line}")

    try:
        click.echo(_models_call(run, s, within_s, seed, say))
    except (WorldDrillError, AirflowApiError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@_PROFILE
@_DATASET
@click.option("--split", type=_DATE, default=None,
              help="Events before this date are the history (replayed, trained on); the rest is live traffic. "
                   "Default: the spec's [demo] split, else the day by which 90% of the history had happened.")
@click.option("--history-limit", type=int, default=None, help="Replay at most N history events.")
@click.option("--sessions", type=int, default=None,
              help="Replay only the first N sessions after --split (all by default; they start over if needed).")
@click.option("--rate", type=float, default=None,
              help="Live requests per second. Default: the loop plan's (2).")
@click.option("--tail", type=float, default=30.0, show_default=True,
              help="Seconds of live traffic kept up after the rollback drill is served.")
def demo(split: datetime | None, history_limit: int | None, sessions: int | None, rate: float | None,
         tail: float) -> None:
    """The whole loop on the local stack: history into Kafka and Flink/Feast, offline training through
    Airflow, the first champion served, the rest of the history as live traffic through the ranking API,
    incremental training from it, a refused bad model, a rollback and a live regression the canary analysis
    rolls back; then the summary."""
    import warnings

    from infra.airflow_api import AirflowApiError

    # The drill loads and logs a model in this process: keep TensorFlow's and MLflow's chatter out of the demo.
    for name, value in {"TF_CPP_MIN_LOG_LEVEL": "2", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                        "MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    s = _settings()
    click.echo(f"dataset {s.spec.name} ({s.spec.path}); data in {s.paths.data_dir}")
    _preflight(s)  # before the loop's imports (Feast, MLflow: seconds) and any service
    from flywheel.demo import LoopError, LoopPlan, run_loop, summary_lines

    click.get_current_context().invoke(up)
    plan = LoopPlan.of(s, _utc(split) if split else None, history_limit=history_limit, sessions=sessions, tail_s=tail,
                       **({"rate": rate} if rate else {}))
    try:
        summary = _models_call(run_loop, s, plan, click.echo)
    except (LoopError, AirflowApiError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in summary_lines(s, summary):
        click.echo(line)


if __name__ == "__main__":
    main()
