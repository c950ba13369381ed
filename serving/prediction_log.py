"""Every served prediction to Kafka (`serving.predictions_topic`, keyed by user), so clicks can be
joined to the impressions they follow and to the features and version that scored them.

Asynchronous: the request path only enqueues. A record Kafka does not take (broker down past the
message timeout, local queue full) is counted in `flywheel_prediction_log_errors`, never fails the
request. A record holds every candidate's features (~46 KB of JSON for 145 candidates): records are
lz4-compressed and batched for up to 50 ms, which took the broker from ~11 % to ~7 % of a core under
the serving check's load (the batching did that; compression alone changed nothing measurable).

Not idempotent: an idempotent producer keeps its producer id across a broker restart, and a broker that
lost its state (its log gone) answers UNKNOWN_PRODUCER_ID to every batch
after, forever (seen: no record delivered until the server restarted). A retry may therefore write a
record twice; readers key records by `request_id`. `flywheel_prediction_log_up` is 0 while no broker
answers or deliveries fail, 1 once one succeeds or, with nothing to send, once a broker answers again
(asked every PROBE_S while down): the server's health reads it.
"""

from __future__ import annotations

import logging
import threading
import time

import confluent_kafka
import msgspec

from infra.settings import Settings
from serving import metrics
from streaming.producer import PRODUCER_OPTIONS

log = logging.getLogger(__name__)
PROBE_S = 2.0  # while down, how often a metadata request asks whether a broker answers again


class PredictionLog:
    def __init__(self, s: Settings) -> None:
        self.topic = s.serving.predictions_topic
        options = s.kafka.client_options("librdkafka", "serving") | PRODUCER_OPTIONS
        self._producer = confluent_kafka.Producer(options | {
            "enable.idempotence": False, "queue.buffering.max.messages": 100_000, "compression.type": "lz4",
            "linger.ms": 50, "error_cb": self._error})
        self.up = True
        self._full_said = float("-inf")
        metrics.PREDICTION_LOG_UP.set(1)
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="prediction-log", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        probed = 0.0
        while not self._stop.is_set():
            try:
                self._producer.poll(0.1)
                if not self.up and time.monotonic() - probed > PROBE_S:
                    probed = time.monotonic()
                    self._producer.list_topics(timeout=PROBE_S)  # every topic's: asking for one may create it
                    self._mark(True, "a broker answers")
            except confluent_kafka.KafkaException:
                pass  # no broker yet
            except Exception:  # noqa: BLE001 - the thread that delivers the log must outlive any one fault
                log.exception("prediction log poll failed; polling on")
                self._stop.wait(1.0)

    def _error(self, err: confluent_kafka.KafkaError) -> None:
        """librdkafka's error callback (run inside poll): no broker answering marks the log down until a
        delivery succeeds."""
        if err.code() == confluent_kafka.KafkaError._ALL_BROKERS_DOWN:
            self._mark(False, str(err))

    def _mark(self, up: bool, why: str) -> None:
        """The log's state, logged once per change (an outage fails every record)."""
        if up != self.up:
            self.up = up
            metrics.PREDICTION_LOG_UP.set(int(up))
            log.log(logging.INFO if up else logging.WARNING, "prediction log %s: %s", "up" if up else "down", why)

    def _delivered(self, err: confluent_kafka.KafkaError | None, _msg: object) -> None:
        if err is not None:
            metrics.PREDICTION_LOG_ERRORS.inc()
            self._mark(False, f"records not delivered ({err})")
        elif not self.up:
            self._mark(True, "a record was delivered")

    def write(self, user_id: str, record: dict) -> None:
        try:
            # msgspec: a record holds thousands of floats (features per candidate); json.dumps took a
            # sixth of the server's CPU on them.
            self._producer.produce(self.topic, msgspec.json.encode(record), user_id.encode(),
                                   on_delivery=self._delivered)
        except BufferError:  # the local queue full (a burst the broker takes slower): counted, not "down",
            metrics.PREDICTION_LOG_ERRORS.inc()  # which would flip at every delivery in between
            if time.monotonic() - self._full_said > 60:
                self._full_said = time.monotonic()
                log.warning("prediction log queue full: records dropped (flywheel_prediction_log_errors_total)")
        except confluent_kafka.KafkaException as exc:
            metrics.PREDICTION_LOG_ERRORS.inc()
            self._mark(False, f"records dropped ({exc})")

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._poller.join()
        if unsent := self._producer.flush(timeout_s):
            metrics.PREDICTION_LOG_ERRORS.inc(unsent)
            log.warning("%d prediction records not delivered before shutdown", unsent)
