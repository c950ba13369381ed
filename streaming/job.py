"""The Flink stream job: behavior events in, one feature-update topic per stream view out.

Runs in the Flink environment (`.venv-flink`), in a local MiniCluster by default:
    .venv-flink/bin/python -m streaming.job        (or `flywheel up`, which manages it)
On a cluster: `flink run -py streaming/job.py -pyfs streaming,infra` with the connector jars.

Flink SQL does the aggregation; Python only parses events (the one schema in streaming/events.py)
and keeps the decayed interest histogram.

Late events: the sliding windows and the behavior sequence run on event time with a watermark of
`streaming.watermark_delay_ms`; an event later than that is left out of them. Running totals,
user x category counts and the interest histogram are updating aggregates that include it (and
emit without waiting for the watermark). A late event is valid, so it is not dead-lettered, and it
stays in the offline event log for training.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pyflink.common import Row
from pyflink.table import DataTypes, EnvironmentSettings, TableEnvironment
from pyflink.table.udf import AggregateFunction, udaf, udtf

from infra.settings import Settings, get_settings
from streaming.events import InvalidEvent, decode
from streaming.features import STREAM_VIEWS, StreamView
from streaming.interest import InterestHistogram

log = logging.getLogger("flywheel.stream-job")


def latest_checkpoint(s: Settings) -> Path | None:
    """The newest completed checkpoint of an earlier run, to resume from."""
    done = [m.parent for m in s.paths.checkpoints_dir.glob("*/chk-*/_metadata")]
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def table_environment(s: Settings) -> TableEnvironment:
    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    jars = ";".join(f"file://{s.paths.flink_jars_dir / name}" for name, _ in s.flink.connector_jars)
    tmp = s.paths.service_dir("flink") / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    options = {
        "pipeline.name": s.streaming.job_name,
        "rest.bind-address": s.flink.host_port[0],
        "rest.address": s.flink.host_port[0],
        "rest.port": str(s.flink.host_port[1]),
        "pipeline.jars": jars,
        "python.executable": sys.executable,
        "python.execution-mode": "thread",  # ~20x faster than process mode for Python functions here
        "parallelism.default": str(s.streaming.parallelism),
        "io.tmp.dirs": str(tmp),
        "execution.checkpointing.interval": f"{s.streaming.checkpoint_interval_ms} ms",
        "execution.checkpointing.dir": f"file://{s.paths.checkpoints_dir}",
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.num-retained": "2",
        # Upsert sinks get their key from GROUP BY; the Python aggregate hides it from the planner,
        # whose materialization would otherwise keep every row of history in state.
        "table.exec.sink.upsert-materialize": "NONE",
        "restart-strategy.type": "fixed-delay",
        "restart-strategy.fixed-delay.attempts": "2147483647",
        "restart-strategy.fixed-delay.delay": "2 s",
    }
    if s.streaming.idle_partition_timeout_ms > 0:
        options["table.exec.source.idle-timeout"] = f"{s.streaming.idle_partition_timeout_ms} ms"
    resume = latest_checkpoint(s)
    if resume is not None:
        options["execution.state-recovery.path"] = f"file://{resume}"
        log.info("resuming from checkpoint %s", resume)
    config = env.get_config()
    for key, value in options.items():
        config.set(key, value)
    return env


# --- Python where SQL cannot: parsing with the shared schema, and the decayed histogram ----------

PARSED = [("reason", DataTypes.STRING()), ("event_id", DataTypes.STRING()), ("user_id", DataTypes.STRING()),
          ("item_id", DataTypes.STRING()), ("event_type", DataTypes.STRING()), ("event_time", DataTypes.BIGINT()),
          ("category", DataTypes.STRING())]


def parse_udtf(max_bytes: int):
    @udtf(result_types=[t for _, t in PARSED])
    def parse_event(payload: bytes):
        try:
            e = decode(payload, max_bytes)
        except InvalidEvent as exc:
            yield exc.reason, None, None, None, None, None, None
            return
        category = e.context.get("category")
        yield (None, e.event_id, e.user_id, e.item_id, e.event_type.value, e.event_time,
               None if category in (None, "") else str(category))
    return parse_event


class InterestAggregate(AggregateFunction):
    def __init__(self, half_life_ms: float, top_k: int):
        self.half_life_ms, self.top_k = half_life_ms, top_k

    def create_accumulator(self):
        return Row({}, None)  # weights by category, as-of time (ms)

    def _histogram(self, acc) -> InterestHistogram:
        h = InterestHistogram(self.half_life_ms)
        h.weights, h.as_of = dict(acc[0]), acc[1]
        return h

    def accumulate(self, acc, category: str, event_time: int):
        h = self._histogram(acc)
        h.add(category, event_time)
        acc[0], acc[1] = h.weights, h.as_of

    def get_value(self, acc):
        return Row(*self._histogram(acc).top(self.top_k))

    def get_accumulator_type(self):
        return DataTypes.ROW([DataTypes.FIELD("weights", DataTypes.MAP(DataTypes.STRING(), DataTypes.DOUBLE())),
                              DataTypes.FIELD("as_of", DataTypes.BIGINT())])

    def get_result_type(self):
        return DataTypes.ROW([DataTypes.FIELD("categories", DataTypes.ARRAY(DataTypes.STRING())),
                              DataTypes.FIELD("weights", DataTypes.ARRAY(DataTypes.DOUBLE()))])


# --- tables ------------------------------------------------------------------------------------

def _kafka(s: Settings, topic: str) -> str:
    """Connector options for `topic`, with the same connection settings as every other client."""
    options = {"topic": topic} | {f"properties.{k}": v for k, v in s.kafka.client_options("java").items()}
    return ", ".join(f"'{k}' = {_sql_string(v)}" for k, v in options.items())


def _sql_string(value: object) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def sink_ddl(s: Settings, view: StreamView) -> str:
    columns = ", ".join(f"`{name}` {sql_type}" for name, sql_type in
                        [*((k, "STRING") for k in view.keys), ("event_time", "BIGINT"), *view.columns])
    if view.upsert:
        keys = ", ".join(f"`{k}`" for k in view.keys)
        return (f"CREATE TABLE `{view.topic}` ({columns}, PRIMARY KEY ({keys}) NOT ENFORCED) WITH ("
                f"'connector' = 'upsert-kafka', {_kafka(s, view.topic)}, 'key.format' = 'json', "
                f"'value.format' = 'json', 'value.fields-include' = 'ALL')")
    return (f"CREATE TABLE `{view.topic}` ({columns}) WITH ('connector' = 'kafka', {_kafka(s, view.topic)}, "
            f"'format' = 'json', 'key.format' = 'raw', 'key.fields' = '{view.keys[0]}', "
            f"'value.fields-include' = 'ALL')")


def create_tables(env: TableEnvironment, s: Settings) -> None:
    topic, delay = s.kafka.events_topic, s.streaming.watermark_delay_ms / 1000
    env.execute_sql(f"""
        CREATE TABLE events_raw (
          kafka_key BYTES,
          payload BYTES,
          -- A malformed record has no event time: the epoch keeps it from moving the watermark
          -- (it is dead-lettered, never aggregated).
          rowtime AS COALESCE(TO_TIMESTAMP_LTZ(
              TRY_CAST(JSON_VALUE(CAST(payload AS STRING), '$.event_time') AS BIGINT), 3), TO_TIMESTAMP_LTZ(0, 3)),
          WATERMARK FOR rowtime AS rowtime - INTERVAL '{delay}' SECOND
        ) WITH ('connector' = 'kafka', {_kafka(s, topic)},
          'properties.group.id' = '{s.streaming.consumer_group}', 'scan.startup.mode' = 'group-offsets',
          'properties.auto.offset.reset' = 'earliest',
          'key.format' = 'raw', 'key.fields' = 'kafka_key', 'value.format' = 'raw',
          'value.fields-include' = 'EXCEPT_KEY')""")
    env.execute_sql(f"""
        CREATE TABLE events_dlq (kafka_key BYTES, payload BYTES, headers MAP<STRING, BYTES> METADATA)
        WITH ('connector' = 'kafka', {_kafka(s, s.kafka.dlq_topic(topic))},
          'key.format' = 'raw', 'key.fields' = 'kafka_key', 'value.format' = 'raw',
          'value.fields-include' = 'EXCEPT_KEY')""")
    for view in STREAM_VIEWS:
        env.execute_sql(sink_ddl(s, view))
    names = ", ".join(name for name, _ in PARSED)
    env.execute_sql(f"""
        CREATE TEMPORARY VIEW parsed AS
        SELECT kafka_key, payload, rowtime, {names}
        FROM events_raw, LATERAL TABLE(parse_event(payload)) AS T({names})""")
    env.execute_sql("""
        CREATE TEMPORARY VIEW valid_events AS
        SELECT *, CASE WHEN event_type = 'impression' THEN 1 ELSE 0 END AS is_impression,
                  CASE WHEN event_type = 'click' THEN 1 ELSE 0 END AS is_click
        FROM parsed WHERE reason IS NULL""")


# --- the feature queries -----------------------------------------------------------------------

def feature_queries(s: Settings) -> list[str]:
    """Every stream view's query into its topic, and invalid events into the dead-letter topic."""
    return [*(f"INSERT INTO `{view.topic}` {view.query(s)}" for view in STREAM_VIEWS), """
        INSERT INTO events_dlq
        SELECT kafka_key, payload, MAP['dlq.reason', CAST(reason AS BYTES)] FROM parsed WHERE reason IS NOT NULL"""]


def build(s: Settings) -> TableEnvironment:
    env = table_environment(s)
    env.create_temporary_function("parse_event", parse_udtf(s.kafka.max_event_bytes))
    env.create_temporary_function("interest_histogram", udaf(InterestAggregate(
        s.streaming.interest_half_life_hours * 3_600_000, s.streaming.interest_top_k)))
    create_tables(env, s)
    return env


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = get_settings()
    env = build(s)
    statements = env.create_statement_set()
    for query in feature_queries(s):
        statements.add_insert_sql(query)
    result = statements.execute()
    log.info("job %s submitted; topics: %s", s.streaming.job_name, ", ".join(v.topic for v in STREAM_VIEWS))
    result.wait()


if __name__ == "__main__":
    main()
