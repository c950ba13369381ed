"""Every served prediction to Kafka (`serving.predictions_topic`, keyed by user), so clicks can be
joined to the impressions they follow and to the features and version that scored them.

Asynchronous: the request path only enqueues. A record Kafka does not take (broker down past the
message timeout, local queue full) is counted in `flywheel_prediction_log_errors`, never fails the
request. A record holds every candidate's features (~46 KB of JSON for 145 candidates): records are
lz4-compressed and batched for up to 50 ms, which took the broker from ~11 % to ~7 % of a core under
the serving check's load (the batching did that; compression alone changed nothing measurable).
"""

from __future__ import annotations

import logging
import threading

import confluent_kafka
import msgspec

from infra.settings import Settings
from serving import metrics
from streaming.producer import PRODUCER_OPTIONS

log = logging.getLogger(__name__)


class PredictionLog:
    def __init__(self, s: Settings) -> None:
        self.topic = s.serving.predictions_topic
        self._producer = confluent_kafka.Producer(
            s.kafka.client_options("librdkafka") | PRODUCER_OPTIONS | {"queue.buffering.max.messages": 100_000,
                                                                  "compression.type": "lz4", "linger.ms": 50})
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="prediction-log", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    def _delivered(self, err: confluent_kafka.KafkaError | None, _msg: object) -> None:
        if err is not None:
            metrics.PREDICTION_LOG_ERRORS.inc()
            log.warning("prediction record not delivered: %s", err)

    def write(self, user_id: str, record: dict) -> None:
        try:
            # msgspec: a record holds thousands of floats (features per candidate); json.dumps took a
            # sixth of the server's CPU on them.
            self._producer.produce(self.topic, msgspec.json.encode(record), user_id.encode(),
                                   on_delivery=self._delivered)
        except (BufferError, confluent_kafka.KafkaException) as exc:
            metrics.PREDICTION_LOG_ERRORS.inc()
            log.warning("prediction record dropped: %s", exc)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._poller.join()
        self._producer.flush(timeout_s)
