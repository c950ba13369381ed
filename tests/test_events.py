import json

import pytest

from streaming.events import Event, InvalidEvent, decode

LIMIT = 64 * 1024


def good() -> dict:
    return {"schema_version": 1, "event_id": "e1", "user_id": "42", "item_id": "1193",
            "event_type": "click", "request_id": "r1", "event_time": 874_965_758_000,
            "context": {"source": "test", "position": 3, "score": 0.5, "logged_in": True}}


def test_an_event_survives_the_wire_unchanged() -> None:
    event = Event(event_id="e1", user_id="42", item_id="1193", event_type="purchase", request_id="r1",
                  event_time=874_965_758_000, context={"position": 2})
    payload = event.encode(LIMIT)
    assert decode(payload, LIMIT) == event
    assert json.loads(payload)["event_type"] == "purchase"
    assert event.key == b"42"


def mutate(**changes) -> bytes:
    record = good() | changes
    return json.dumps({k: v for k, v in record.items() if v is not ...}).encode()


@pytest.mark.parametrize("payload, reason", [
    (b'{"event_id": "e1", ', "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b"[1, 2]", "not a JSON object: got list"),
    (mutate(user_id=...), "missing field(s): user_id"),
    (mutate(extra=1), "unexpected field(s): extra"),
    (mutate(event_time="2024-01-01"), "event_time must be integer milliseconds, got str"),
    (mutate(event_time=True), "event_time must be integer milliseconds, got bool"),
    (mutate(event_time=874_965_758_000_000), "not milliseconds between 1970 and 2100"),
    (mutate(user_id=42), "user_id must be a string, got int"),
    (mutate(item_id=""), "item_id must have 1..128 characters"),
    (mutate(event_type="like"), "unknown event_type 'like'"),
    (mutate(schema_version=2), "unsupported schema_version 2"),
    (mutate(context=[1]), "context must be an object, got list"),
    (mutate(context={"nested": {"a": 1}}), "context['nested'] must be a string, number or boolean"),
    (mutate(context={"blob": "x" * LIMIT}), f"oversized: {len(mutate(context={'blob': 'x' * LIMIT}))} bytes (limit {LIMIT})"),
    (None, "empty record"),
])
def test_invalid_records_are_refused_with_the_reason(payload: bytes | None, reason: str) -> None:
    with pytest.raises(InvalidEvent) as err:
        decode(payload, LIMIT)
    assert reason in err.value.reason


def test_an_invalid_event_cannot_be_encoded() -> None:
    event = Event(event_id="e1", user_id="", item_id="i", event_type="click", request_id="r",
                  event_time=1)
    with pytest.raises(InvalidEvent, match="user_id must have"):
        event.encode(LIMIT)


def test_the_event_log_says_when_it_last_took_a_file(tmp_path) -> None:
    """Incremental training skips a quiet stack by this, before importing TensorFlow: it must move with
    every batch written, whatever day the events are from."""
    from datetime import datetime, timezone

    from feature_repo.event_log import last_write, write_batch
    from infra.settings import Settings, override
    from streaming.consumer import Consumed

    s = override(Settings(), "paths", data_dir=tmp_path)
    assert last_write(s) is None
    before = datetime.now(timezone.utc).replace(microsecond=0)
    old = Event(event_id="e1", user_id="u", item_id="i", event_type="click", request_id="r",
                event_time=880_000_000_000)  # 1997: an old day's partition written now
    write_batch(s, [Consumed(old, partition=0, offset=1)])
    assert last_write(s) >= before


def test_training_sets_skip_test_traffic(tmp_path) -> None:
    """Load-test events (context test_traffic=true) are in the log but label nothing: a load test whose
    clicks do not join cannot teach or judge a model."""
    from datetime import datetime, timezone

    from feature_repo.event_log import write_batch
    from infra.settings import Settings, override
    from models.dataset import Window, labelled_impressions
    from streaming.consumer import Consumed

    s = override(Settings(), "paths", data_dir=tmp_path)
    t = 1_700_000_000_000
    events = []
    for k, marked in enumerate([False, True, False, True]):
        context = {"category": "Drama"} | ({"test_traffic": True} if marked else {})
        for kind in ("impression", "click"):
            events.append(Event(event_id=f"{kind}-{k}", user_id=f"u{k}", item_id="i1", event_type=kind,
                                request_id=f"r{k}", event_time=t + k, context=context))
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    window = Window(datetime.fromtimestamp(t / 1000, timezone.utc), datetime.fromtimestamp(t / 1000 + 1, timezone.utc))
    rows = labelled_impressions(s, window)
    assert list(rows["user_id"]) == ["u0", "u2"] and list(rows["label"]) == [1.0, 1.0]
    assert list(rows["category"]) == ["Drama", "Drama"]
