"""The serving path's direct reader of Feast's Redis layout returns exactly what Feast's own
`get_online_features` returns, for every feature type the views use, for present, partly written and
unknown entities."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd
import pytest

from feature_repo.definitions import BATCH_VIEWS, GRAPH_VIEWS, TIMESTAMP_FIELD
from feature_repo.online import OnlineReader, decode
from feature_repo.store import apply
from infra.settings import Settings
from streaming.features import STREAM_VIEWS

pytestmark = pytest.mark.stack

SAMPLES = {  # per SQL type: values that exercise the encodings (zero, negative, large, empty)
    "BIGINT": [0, 7, -3, 2**40 + 1],
    "DOUBLE": [0.0, 0.25, -1.5, 1e-300],
    "STRING": ["", "Comedy", "ünïcødé", "x" * 300],
    "ARRAY<STRING>": [["a"], [], ["Drama", "Film-Noir", "ü"], ["z"] * 60],
    "ARRAY<BIGINT>": [[1], [], [-5, 0, 2**40], list(range(60))],
    "ARRAY<DOUBLE>": [[0.5], [], [-0.25, 3.0], [float(i) / 7 for i in range(12)]],
}
VIEWS = (*STREAM_VIEWS, *BATCH_VIEWS, *GRAPH_VIEWS)


def test_the_reader_equals_get_online_features_for_every_view_and_type(redis_stack: Settings) -> None:
    store = apply(redis_stack)
    entities = {keys: [tuple(f"{k}-{i}" for k in keys) for i in range(4)]
                for keys in {v.keys for v in VIEWS}}
    for view in VIEWS:
        rows = []
        for i, entity in enumerate(entities[view.keys][:3]):  # the fourth entity is never written
            samples = {name: SAMPLES[t][(i + j) % 4] for j, (name, t) in enumerate(view.columns)}
            rows.append(dict(zip(view.keys, entity)) | samples | {TIMESTAMP_FIELD: datetime.now(UTC)})
        store.write_to_online_store(view.name, pd.DataFrame(rows))

    reader = OnlineReader(redis_stack, timeout_s=2.0)
    for keys, ents in entities.items():
        refs = [(v.name, name) for v in VIEWS if v.keys == keys for name, _ in v.columns]
        expected = store.get_online_features(features=[f"{view}:{name}" for view, name in refs],
                                             entity_rows=[dict(zip(keys, e)) for e in ents]).to_dict()
        got = reader.read(keys, ents, refs)
        for j, (_, name) in enumerate(refs):
            assert [row[j] for row in got] == expected[name], name
        assert all(value is None for value in got[3])  # an unknown entity: nothing stored


def test_decoding_of_the_hand_parsed_scalars_matches_protobuf() -> None:
    from feast.protos.feast.types.Value_pb2 import Value

    for value in (0, 1, -1, 127, 128, 2**63 - 1, -(2**63)):
        assert decode(Value(int64_val=value).SerializeToString()) == value
    for value in (0.0, -0.0, 1.5, -1e300, float("inf")):
        assert decode(Value(double_val=value).SerializeToString()) == value
    assert decode(b"") is None and decode(None) is None
    assert decode(Value(string_list_val={"val": ["a", "b"]}).SerializeToString()) == ["a", "b"]
    assert decode(Value(string_val="é").SerializeToString()) == "é"
