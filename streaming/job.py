"""The Flink stream job: behavior events in, one feature-update topic per stream view out.

Runs in the Flink environment (`.venv-flink`), in a local MiniCluster by default:
    .venv-flink/bin/python -m streaming.job        (or `flywheel up`, which manages it)
On a session cluster (`flink.target = "remote"`, the cluster profile): the same command submits the job,
with the connector jars and the functions jar, to the JobManager at `flink.api_url` and follows it.
Either way the process serves Flink's web UI, read-only, at `flink.rest_url` (infra/flink_rest.py).

No Python in the per-event path: records are parsed and checked once, in the JVM, by the schema's Java
twin (streaming/java, the rules and reasons of streaming/events.py), and Flink SQL does the aggregation
(a row per event by default, one per key per mini-batch with `streaming.mini_batch_ms`). Invalid records
go to the dead-letter topic with their reason, source topic, partition and offset, and original size; an
oversized one keeps only its first `kafka.max_event_bytes`. An event whose context lacks the spec's key
takes the item's from the catalog (the file `streaming/history.py: write_item_keys` writes at the job's
start and at each `flywheel catalog`, read again by the job when it changes).

Late events: nothing waits for a watermark. Windows, totals, category counts and the interest histogram
are updating aggregates that include a late event in every window it belongs to; the behavior sequence
is in arrival order. A late event is valid, so it is not dead-lettered, and it stays in the offline
event log for training.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from pathlib import Path

from pyflink.common import Configuration
from pyflink.datastream import StreamExecutionEnvironment
from pyflink.java_gateway import get_gateway
from pyflink.table import Schema, StreamTableEnvironment, Table

from infra import flink_rest
from infra.dataset import JVM_SEPARATOR
from infra.flink_cluster import EVENTS_TOPIC_ID, rest_options
from infra.flink_jars import connector_jars, udf_jar
from infra.progress import topic_id
from infra.settings import Settings, get_settings
from streaming.events import DLQ_OFFSET, DLQ_ORIGINAL_SIZE, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC
from streaming.features import StreamView, row_schema, topics
from streaming.history import item_keys_path, write_item_keys

log = logging.getLogger("flywheel.stream-job")


def latest_checkpoint(s: Settings) -> Path | None:
    """The newest completed checkpoint of an earlier run, to resume from."""
    done = [m.parent for m in s.paths.checkpoints_dir.glob("*/chk-*/_metadata")]
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def table_environment(s: Settings, events_topic_id: str) -> StreamTableEnvironment:
    jars = ";".join(f"file://{jar}" for jar in
                    [*connector_jars(s), udf_jar(s)])
    tmp = s.paths.service_dir("flink") / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    options = {
        "pipeline.name": s.streaming.job_name,
        **rest_options(s),
        # The JVM's other servers (the blob server among them) bind to every interface unless told.
        "jobmanager.bind-host": s.flink.api_host_port[0],
        "taskmanager.bind-host": s.flink.api_host_port[0],
        "pipeline.jars": jars,
        "parallelism.default": str(s.streaming.parallelism),
        "io.tmp.dirs": str(tmp),
        "execution.checkpointing.interval": f"{s.streaming.checkpoint_interval_ms} ms",
        "execution.checkpointing.dir": f"file://{s.paths.checkpoints_dir}",
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.num-retained": "2",
        # SQL operators never hold on to a record they passed on: no defensive copy between chained ones.
        "pipeline.object-reuse": "true",
        # A network buffer goes out when full or after this long: the default 100 ms, paid at the shuffle,
        # was most of an event's way to the online store on a stream that does not fill buffers.
        "execution.buffer-timeout.interval": "25 ms",
        # Upsert sinks get their key from GROUP BY; the window views' key is the entity while their
        # aggregate's is (entity, window end), and the writer keeps the newest row per key anyway:
        # materializing would keep every row of history in state.
        "table.exec.sink.upsert-materialize": "NONE",
        # Every operator of the SQL plan gets a UID of its own ("<plan node id>_<transformation>", the same
        # for the same queries), not one hashed from its inputs: the source's UID can then change with its
        # topic without moving any aggregate's state.
        "table.exec.uid.generation": "ALWAYS",
        # No record can fail the job (an invalid one is dead-lettered), so repeated failures mean a broken
        # environment: stop after 10 in 10 minutes instead of replaying forever.
        "restart-strategy.type": "failure-rate",
        "restart-strategy.failure-rate.max-failures-per-interval": "10",
        "restart-strategy.failure-rate.failure-rate-interval": "10 min",
        "restart-strategy.failure-rate.delay": "2 s",
        # The dataset spec's vocabulary, for the functions that parse events and rank their types.
        "pipeline.global-job-parameters": _job_parameters(s, events_topic_id),
    }
    if s.streaming.mini_batch_ms > 0:  # one update per key per batch, combined before the shuffle
        options |= {"table.exec.mini-batch.enabled": "true",
                    "table.exec.mini-batch.allow-latency": f"{s.streaming.mini_batch_ms} ms",
                    "table.exec.mini-batch.size": "10000", "table.optimizer.agg-phase-strategy": "TWO_PHASE"}
    resume = latest_checkpoint(s)
    if resume is not None:
        # The source's state (its offsets) is claimed only by a source of the same topic incarnation
        # (`events_source`): a recreated topic is read from its start, the aggregates kept.
        options |= {"execution.state-recovery.path": f"file://{resume}",
                    "execution.state-recovery.ignore-unclaimed-state": "true"}
        log.info("resuming from checkpoint %s", resume)
    config = Configuration()
    for key, value in options.items():
        config.set_string(key, value)
    # In a MiniCluster PyFlink starts a server for Python workers on [::] (every interface), unasked. The
    # job runs no Python function; were one added, 'process' mode starts its workers without that server.
    os.environ.setdefault("_python_worker_execution_mode", "process")
    if s.flink.target == "local":
        return StreamTableEnvironment.create(StreamExecutionEnvironment.get_execution_environment(config))
    # get_execution_environment runs a job in a local MiniCluster whatever execution.target says: the
    # environment's constructor keeps the remote target, and submits to the session cluster at api_url.
    config.set_string("execution.target", "remote")
    remote = get_gateway().jvm.org.apache.flink.streaming.api.environment.StreamExecutionEnvironment(
        config._j_configuration)
    return StreamTableEnvironment.create(StreamExecutionEnvironment(remote))


def _job_parameters(s: Settings, events_topic_id: str) -> str:
    """`pipeline.global-job-parameters`: the spec's event types in order, its exposures ('|'-separated;
    spec names hold no separator: infra/dataset.py), the context fields of the events' keys, the file of the
    catalog's item keys (`write_item_keys`), the keys' defaults where a context key declares one, and the id of
    the events topic the job reads (the stack's health check compares it with the broker's)."""
    sep, keys = JVM_SEPARATOR, str(item_keys_path(s))
    if any(c in keys for c in ",:'\""):  # the parameters' own separators: Flink would split the path
        raise ValueError(f"paths.data_dir: the stream job cannot be given a path with , : ' or \" ({keys})")
    defaults = [s.spec.key_default(k) for k in s.spec.keys]  # spec-checked: no separator in them
    given = f",flywheel.key-defaults:{sep.join(defaults)}" if any(defaults) else ""
    return (f"flywheel.event-types:{sep.join(s.spec.type_names)},"
            f"flywheel.exposure-types:{sep.join(s.spec.exposures)},flywheel.key-field:{sep.join(s.spec.keys)}{given},"
            f"flywheel.item-keys:{keys},{EVENTS_TOPIC_ID}:{events_topic_id}")


def _in(names: tuple[str, ...]) -> str:
    return f"event_type IN ({', '.join(_sql_string(n) for n in names)})"


# --- tables ------------------------------------------------------------------------------------

def _kafka(s: Settings, topic: str) -> str:
    """Connector options for `topic`, with the same connection settings as every other client."""
    options = {"topic": topic} | {f"properties.{k}": v for k, v in s.kafka.client_options("java", "stream").items()}
    return ", ".join(f"'{k}' = {_sql_string(v)}" for k, v in options.items())


def _sql_string(value: object) -> str:
    return "'" + str(value).replace("'", "''") + "'"


# Producer batching for the sinks: without a linger every row wakes the producer's sender thread and
# goes out in a request of its own (profiled: most of the job's CPU at a few thousand events/s).
SINK_PRODUCER = "'properties.linger.ms' = '20', 'properties.batch.size' = '262144'"


def sink_ddl(s: Settings, topic: str, views: tuple[StreamView, ...]) -> str:
    """The sink table of `topic`, written by the query of `views` (one view, or views sharing it): the
    keys as the record key, the row (`row_schema`, a JSON array from `json_row`) as its value."""
    keys = views[0].keys
    columns = ", ".join(f"`{k}` STRING" for k in keys)
    value = f"'value.format' = 'raw', 'value.fields-include' = 'EXCEPT_KEY', {SINK_PRODUCER}"
    if views[0].upsert:
        key_format = "raw" if len(keys) == 1 else "json"  # raw holds one field
        primary = ", ".join(f"`{k}`" for k in keys)
        return (f"CREATE TABLE `{topic}` ({columns}, `row` BYTES, PRIMARY KEY ({primary}) NOT ENFORCED) "
                f"WITH ('connector' = 'upsert-kafka', {_kafka(s, topic)}, 'key.format' = '{key_format}', {value})")
    return (f"CREATE TABLE `{topic}` ({columns}, `row` BYTES) WITH ('connector' = 'kafka', {_kafka(s, topic)}, "
            f"'key.format' = 'raw', 'key.fields' = '{keys[0]}', {value})")


def sink_query(s: Settings, views: tuple[StreamView, ...]) -> str:
    """The query of `views` as their sink's columns: the keys, and the whole row as one JSON array of
    the declared types (the planner checks the query against them)."""
    schema = row_schema(views)
    fields = [f"c{i}" for i in range(len(schema))]
    row = ", ".join(f"CAST({f} AS {sql_type})" for f, (_, sql_type) in zip(fields, schema))
    return (f"SELECT {', '.join(fields[:len(views[0].keys)])}, json_row({row}) "
            f"FROM ({views[0].query(s)}) AS Q({', '.join(fields)})")


PARSED = "reason, event_id, user_id, item_id, event_type, event_time, category, keys"
# How ParseEvent joins the values of the keys after the first, and marks a missing one.
KEYS_SEPARATOR, MISSING_KEY = 31, 30


def key_columns(s: Settings) -> str:
    """`valid_events`' column of each key after the first (named as the key), split from the parsed `keys`."""
    return "".join(f", NULLIF(SPLIT_INDEX(keys, CHR({KEYS_SEPARATOR}), {i}), CHR({MISSING_KEY})) AS `{k}`"
                   for i, k in enumerate(s.spec.group_by))


def _properties(s: Settings):
    """The Kafka clients' options as a java.util.Properties (the Java connector's and admin's builders)."""
    props = get_gateway().jvm.java.util.Properties()
    for key, value in s.kafka.client_options("java", "stream").items():
        props.setProperty(key, str(value))
    return props


def events_source(env: StreamTableEnvironment, s: Settings, events_topic_id: str) -> Table:
    """The events topic as a table of key, payload, topic, partition and offset, read by a Kafka source
    whose UID names the topic's id. Its offsets are checkpointed under that UID: after the topic was
    recreated (a broker that lost it) the job resumes its aggregates and reads the new topic from its
    start, where offsets restored from the old one would point past the new one's end, and the embedded
    broker answers a fetch there with nothing, not an error, so the job would wait forever."""
    jvm = get_gateway().jvm
    kafka = jvm.org.apache.flink.connector.kafka.source
    topic = s.kafka.events_topic
    # The group's committed offsets (committed at each checkpoint); a new group, or a new broker, from the start.
    start = kafka.enumerator.initializer.OffsetsInitializer.committedOffsets(
        jvm.org.apache.kafka.clients.consumer.OffsetResetStrategy.EARLIEST)
    source = (kafka.KafkaSource.builder().setProperties(_properties(s))
              .setTopics(jvm.java.util.Collections.singletonList(topic)).setGroupId(s.streaming.consumer_group)
              .setStartingOffsets(start).setDeserializer(jvm.flywheel.EventRecords()).build())
    stream = (env._j_tenv.execEnv().fromSource(source, jvm.org.apache.flink.api.common.eventtime.WatermarkStrategy
                                               .noWatermarks(), topic)
              .uid(f"source-{topic}-{events_topic_id}"))
    log.info("reading %s, topic id %s", topic, events_topic_id)
    return Table(env._j_tenv.fromDataStream(stream), env)


def create_tables(env: StreamTableEnvironment, s: Settings, events_topic_id: str) -> None:
    topic = s.kafka.events_topic
    env.create_temporary_view("events_raw", events_source(env, s, events_topic_id))
    env.execute_sql(f"""
        CREATE TABLE events_dlq (kafka_key BYTES, payload BYTES, headers MAP<STRING, BYTES> METADATA)
        WITH ('connector' = 'kafka', {_kafka(s, s.kafka.dlq_topic(topic))},
          'key.format' = 'raw', 'key.fields' = 'kafka_key', 'value.format' = 'raw',
          'value.fields-include' = 'EXCEPT_KEY')""")
    for topic, views in topics().items():
        env.execute_sql(sink_ddl(s, topic, views))
    # Parsed once for every query: through a DataStream, which the planner cannot see into (a view would
    # be inlined into each query, and the parse repeated per view). Only a dead letter carries its payload on.
    parsed = env.sql_query(f"""
        SELECT kafka_key, CASE WHEN reason IS NULL THEN CAST(NULL AS BYTES) ELSE payload END AS payload,
               source_topic, source_partition, source_offset, {PARSED}
        FROM events_raw, LATERAL TABLE(parse_event(payload, {s.kafka.max_event_bytes})) AS T({PARSED})""")
    env.create_temporary_view("parsed", _materialized(env, parsed))
    # The counts' "impressions" and "clicks": the spec's exposures and the positives that label the ranker; a
    # negative (a hide) is an action of the sequences, never a sign of interest.
    env.execute_sql(f"""
        CREATE TEMPORARY VIEW valid_events AS
        SELECT event_id, user_id, item_id, event_type, event_time, category{key_columns(s)}, proctime,
               CASE WHEN {_in(s.spec.exposures)} THEN 1 ELSE 0 END AS is_impression,
               CASE WHEN {_in(s.spec.labels)} THEN 1 ELSE 0 END AS is_click,
               {f"CASE WHEN {_in(s.spec.negatives)} THEN 1 ELSE 0 END" if s.spec.negatives else "0"} AS is_negative
        FROM parsed WHERE reason IS NULL""")


def _materialized(env: StreamTableEnvironment, table: Table) -> Table:
    """`table` through a DataStream of Flink's internal rows (RowData), with a processing-time column:
    the planner cannot see into it, so every query reads it without computing it again, and no record
    is converted to and from external Rows on the way (PyFlink's to/from_data_stream would: profiled,
    a quarter of the job's CPU)."""
    jvm = get_gateway().jvm
    internal = table._j_table.getResolvedSchema().toPhysicalRowDataType().bridgedTo(
        jvm.org.apache.flink.table.data.RowData._java_lang_class)
    stream = env._j_tenv.toDataStream(table._j_table, internal)
    schema = Schema.new_builder().column_by_expression("proctime", "PROCTIME()").build()
    return Table(env._j_tenv.fromDataStream(stream, schema._j_schema), env)


# --- the feature queries -----------------------------------------------------------------------

def feature_queries(s: Settings) -> list[str]:
    """Every stream view's query into its topic, and invalid events into the dead-letter topic."""
    def header(sql: str) -> str:
        return f"CAST(COALESCE(CAST({sql} AS STRING), '') AS BYTES)"

    return [*(f"INSERT INTO `{topic}` {sink_query(s, views)}" for topic, views in topics().items()), f"""
        INSERT INTO events_dlq
        SELECT kafka_key, truncate_bytes(payload, {s.kafka.max_event_bytes}),
               MAP['{DLQ_REASON}', {header('reason')}, '{DLQ_TOPIC}', {header('source_topic')},
                   '{DLQ_PARTITION}', {header('source_partition')}, '{DLQ_OFFSET}', {header('source_offset')},
                   '{DLQ_ORIGINAL_SIZE}', {header('byte_length(payload)')}]
        FROM parsed WHERE reason IS NOT NULL"""]


def build(s: Settings, events_topic_id: str | None = None) -> StreamTableEnvironment:
    """The job's tables and functions, reading the events topic of `events_topic_id`: the broker's is asked
    for when none is given (given, the plan is built without a broker)."""
    events_topic_id = events_topic_id or topic_id(s, s.kafka.events_topic, "stream")
    if events_topic_id is None:
        raise RuntimeError(f"the broker at {s.kafka.bootstrap_servers} does not describe the events topic "
                           f"{s.kafka.events_topic!r}")
    env = table_environment(s, events_topic_id)
    env.create_java_temporary_function("parse_event", "flywheel.ParseEvent")
    env.create_java_temporary_function("truncate_bytes", "flywheel.Truncate")
    env.create_java_temporary_function("byte_length", "flywheel.ByteLength")
    env.create_java_temporary_function("window_counts", "flywheel.WindowCounts")
    env.create_java_temporary_function("json_row", "flywheel.JsonRow")
    env.create_java_temporary_function("long_history", "flywheel.LongHistory")
    create_tables(env, s, events_topic_id)
    return env


def checkpoint_now(s: Settings, jid: str, timeout_s: float = 15.0) -> bool:
    """Take a checkpoint and wait for it to complete: a job stopped after this resumes with every event it
    processed, not only those up to its last periodic checkpoint. False when it did not complete in time."""
    try:
        trigger = flink_rest.call(s, f"/jobs/{jid}/checkpoints", "POST", {})["request-id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = flink_rest.call(s, f"/jobs/{jid}/checkpoints/{trigger}")
            if status.get("status", {}).get("id") == "COMPLETED":
                failure = (status.get("operation") or {}).get("failure-cause")
                return failure is None
            time.sleep(0.1)
    except OSError as exc:  # the REST endpoint gone: nothing more to keep
        log.warning("no final checkpoint: %s", exc)
    return False


def _cancel_running(s: Settings) -> None:
    """On a session cluster: cancel the jobs of this name still running (their client stopped; checkpoints
    are retained on cancellation, and the new job resumes from the latest)."""
    for job in flink_rest.call(s, "/jobs/overview").get("jobs", []):
        if job.get("name") == s.streaming.job_name and job.get("state") in ("RUNNING", "CREATED", "RESTARTING"):
            log.info("cancelling job %s, left running on the cluster", job["jid"])
            flink_rest.call(s, f"/jobs/{job['jid']}?mode=cancel", "PATCH")
            while flink_rest.call(s, f"/jobs/{job['jid']}").get("state") not in ("CANCELED", "FAILED", "FINISHED"):
                time.sleep(0.2)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    flink_rest.start_front(s)  # the web UI, read-only, also while the job starts
    if s.flink.target == "remote":
        _cancel_running(s)
    log.info("%d items' %s from the catalog for events without it", write_item_keys(s), s.spec.key)
    # No cyclic collection while the job is planned. Calcite finds its metadata provider in a thread-local
    # that the planner sets on the JVM thread that builds it (FLINK-23020), and py4j serves each of its
    # connections on a JVM thread of its own. A collection run by the front's thread (a health probe's
    # request) frees py4j proxies over a connection of its own; the next call of this thread can then
    # take that connection, and planning there failed with "NullPointerException: metadataHandlerProvider".
    gc.disable()
    try:
        env = build(s)
        statements = env.create_statement_set()
        for query in feature_queries(s):
            statements.add_insert_sql(query)
        result = statements.execute()
    finally:
        gc.enable()
    log.info("job %s submitted to %s; topics: %s", s.streaming.job_name,
             s.flink.api_url if s.flink.target == "remote" else "a local MiniCluster", ", ".join(topics()))
    # This process follows the job. The stack stops it with SIGINT, which the JVM PyFlink started ignores
    # (it inherits SIG_IGN): a last checkpoint is taken first, then the job is cancelled on a session
    # cluster; locally the MiniCluster ends with this process.
    jid = str(result.get_job_client().get_job_id())
    signal.signal(signal.SIGINT, lambda *_: _stop(s, jid))
    signal.signal(signal.SIGTERM, lambda *_: _stop(s, jid))
    result.wait()


def _stop(s: Settings, jid: str) -> None:
    started = time.monotonic()
    kept = checkpoint_now(s, jid)
    log.info("stopping: final checkpoint %s in %.1fs", "taken" if kept else "NOT taken", time.monotonic() - started)
    if s.flink.target == "remote":
        flink_rest.call(s, f"/jobs/{jid}?mode=cancel", "PATCH")
    raise SystemExit(0)


if __name__ == "__main__":
    main()
