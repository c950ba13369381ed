"""The compiled dense runner: bucket padding scores exactly like the unpadded model, buckets are
compiled by warm-up and never on the request path, an out-of-bucket shape is served at once and
compiled in the background, and one compiled function serves every version's weights (its non-trainable
ones too)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import tensorflow as tf

from contract.examples import PAD, concat
from models.ctr import CtrModel
from models.networks import scorer
from serving.dense import DenseRunner
from tests.ctr_data import SPEC, synthetic, with_buys


def _weights(model: CtrModel) -> list[tf.Tensor]:
    return [tf.constant(w) for w in model.dense_weights()]


def test_padded_buckets_score_like_the_model_and_compile_only_at_warm_up() -> None:
    model = CtrModel(SPEC)
    model.fit(synthetic(2000, seed=1), progress=False)
    runner = DenseRunner(model, row_buckets=(16, 64), sequence_buckets=(4, 10))
    ex = synthetic(300, seed=2)
    runner.warm(_weights(model), model.scoring_inputs(ex.take(slice(0, 4))))
    assert runner.stats.warm == 4 and runner.compiled_shapes() == {(16, 4), (16, 10), (64, 4), (64, 10)}
    for n in (1, 7, 16, 50):
        part = ex.take(slice(0, n))
        np.testing.assert_allclose(runner.run(_weights(model), model.scoring_inputs(part)), model.predict(part),
                                   rtol=1e-5, atol=1e-6)
    assert runner.stats.warm == 4 and runner.stats.background == 0 and runner.stats.uncompiled_runs == 0


def test_requests_pass_their_sequence_once_and_score_like_the_model_in_parts_of_groups() -> None:
    model = CtrModel(SPEC)
    model.fit(synthetic(2000, seed=7), progress=False)
    ex = synthetic(1000, seed=8)
    seen = {tuple(seq): n for n, seq in enumerate(ex.sequences)}  # the last row of each distinct sequence
    ex = ex.take(np.array(sorted(seen.values())[-40:]))
    # 40 requests of 1-3 candidates each; every candidate row of a request carries the user's sequence
    requests = [ex.take(np.full(1 + r % 3, r)) for r in range(40)]
    for r, request in enumerate(requests):
        request.item_ids = np.array([f"i{(r * 7 + j) % 200}" for j in range(len(request))], object)
    batch = concat(requests)
    inputs = model.scoring_inputs(batch)
    assert len(inputs["sequence"]) == 40 and len(inputs["owner"]) == len(batch) == 79
    runner = DenseRunner(model, row_buckets=(16, 128), sequence_buckets=(10,), groups=8)
    runner.warm(_weights(model), model.scoring_inputs(ex.take(slice(0, 20))))
    np.testing.assert_allclose(runner.run(_weights(model), inputs), model.predict(batch), rtol=1e-5, atol=1e-6)
    assert runner.stats.uncompiled_runs == 0  # 40 sequences > 8: five runs of <= 8 sequences, all compiled


def test_one_compiled_function_serves_every_version(tmp_path: Path) -> None:
    spec = replace(SPEC, numeric_bins=4)  # each version's numeric bins travel with its weights, untrained
    a, b = CtrModel(spec), CtrModel(spec)
    train = synthetic(1000, seed=3)
    b.adapt(train)
    edges = b.network.numeric_encoding.lower.numpy()
    b.fit(train, progress=False)
    assert not np.array_equal(edges, a.network.numeric_encoding.lower.numpy())
    b = CtrModel.load(b.save(tmp_path / "b"))
    np.testing.assert_array_equal(b.network.numeric_encoding.lower.numpy(), edges)  # fit moved none of them
    runner = DenseRunner(a, row_buckets=(16,), sequence_buckets=(10,))
    ex = synthetic(10, seed=4)
    runner.warm(_weights(a), a.scoring_inputs(ex))
    runner.warm(_weights(b), b.scoring_inputs(ex))  # a later version: nothing to compile
    np.testing.assert_allclose(runner.run(_weights(b), b.scoring_inputs(ex)), b.predict(ex), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runner.run(_weights(a), a.scoring_inputs(ex)), a.predict(ex), rtol=1e-5, atol=1e-6)
    assert runner.stats.warm == 1 and len(runner.compiled_shapes()) == 1


def test_an_out_of_bucket_shape_is_served_at_once_and_compiled_in_the_background() -> None:
    model = CtrModel(SPEC)
    runner = DenseRunner(model, row_buckets=(16,), sequence_buckets=(10,))
    ex = synthetic(40, seed=5)
    runner.warm(_weights(model), model.scoring_inputs(ex.take(slice(0, 2))))
    first = runner.run(_weights(model), model.scoring_inputs(ex))  # 40 rows > the largest bucket
    np.testing.assert_allclose(first, model.predict(ex), rtol=1e-5, atol=1e-6)
    assert runner.stats.uncompiled_runs == 1
    deadline = time.monotonic() + 60
    while (40, 10) not in runner.compiled_shapes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.stats.background == 1 and (40, 10) in runner.compiled_shapes()  # rows exact, sequence padded
    again = runner.run(_weights(model), model.scoring_inputs(ex))
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-6)
    assert runner.stats.uncompiled_runs == 1  # the compiled function took over
    runner.close()


def test_without_buckets_each_new_shape_compiles_on_the_request_path() -> None:
    model = CtrModel(SPEC)
    runner = DenseRunner(model, row_buckets=(16,), sequence_buckets=(10,), buckets=False)
    ex = synthetic(30, seed=6)
    runner.warm(_weights(model), model.scoring_inputs(ex.take(slice(0, 2))))
    assert runner.stats.warm == 0
    shapes = set()
    for n in (3, 5, 3, 30):
        inputs = model.scoring_inputs(ex.take(slice(0, n)))
        shapes.add((len(inputs["owner"]), inputs["sequence_mask"].shape[1]))
        runner.run(_weights(model), inputs)
    assert runner.stats.request_path == len(shapes) == len(runner.compiled_shapes()) >= 3


def test_user_attributes_and_long_history_lists_pass_once_and_score_like_the_model_in_halves() -> None:
    model = CtrModel(SPEC)
    model.fit(synthetic(2000, seed=11, long_history=True), progress=False)
    base = synthetic(30, seed=12, long_history=True)
    base.sequences[:] = PAD  # two users with the same (empty) recent sequence: only their attributes differ
    base.long_sequences = np.array([[f"i{(j * 7 + k) % 200}" for k in range(5)] for j in range(30)], object)
    requests = []
    for user, token in (("u1", "category:c1"), ("u2", "category:c2")):
        request = base.take(np.arange(30))
        request.user_ids[:] = user
        request.user_tokens = np.full((30, 1), token, object)
        requests.append(request)
    batch = concat(requests)
    inputs = model.scoring_inputs(batch)
    assert len(inputs["user_tokens"]) == 2 and len(inputs["long_sequence"]) == 30
    per_row = model._gathered(model._lookup(batch, train=False), batch)
    np.testing.assert_array_equal(inputs["long_sequence"][inputs["long_owner"]], per_row["long_sequence"])
    # 30 lists > the 16 a 64-row shape holds: scored in halves, each in a compiled shape
    runner = DenseRunner(model, row_buckets=(16, 64), sequence_buckets=(10,), groups=4)
    runner.warm(_weights(model), inputs)
    scores = runner.run(_weights(model), inputs)
    np.testing.assert_allclose(scores, model.predict(batch), rtol=1e-5, atol=1e-6)
    assert not np.allclose(scores[:30], scores[30:])  # the same candidates, told apart by the user's attributes
    assert runner.stats.uncompiled_runs == 0


def test_a_version_with_a_position_bias_serves_the_items_score_without_its_rank() -> None:
    """The position bias is a training input only: the server passes no rank, and scores as the model does."""
    model = CtrModel(replace(SPEC, position_slots=5))
    data = synthetic(2000, seed=1)
    model.fit(replace(data, positions=np.arange(len(data), dtype=np.int32) % 8), progress=False)
    assert model.network.bias.numpy()[1:].any()  # trained
    runner = DenseRunner(model, row_buckets=(16, 64), sequence_buckets=(4, 10))
    part = synthetic(40, seed=2)
    np.testing.assert_allclose(runner.run(_weights(model), model.scoring_inputs(part)), model.predict(part),
                               rtol=1e-5, atol=1e-6)


def test_a_version_of_two_objectives_serves_each_objectives_probability() -> None:
    """A network per objective under a position bias: trained through every objective (the bias too), served by the
    compiled functions with each objective's probability as the model predicts it (the first's its scores), another
    version of the same shape by the same functions with its own weights; its output layer negated (the drills'
    inverted version), every score is reversed."""
    spec = replace(SPEC, position_slots=5, objectives=(("click", ""), ("buy", "click")))
    model, untrained = CtrModel(spec), CtrModel(spec)
    data = with_buys(synthetic(2000, seed=1), seed=1)
    model.fit(replace(data, positions=np.arange(len(data), dtype=np.int32) % 8), progress=False)
    assert model.network.bias.numpy()[1:].any()
    runner = DenseRunner(model, row_buckets=(16, 64), sequence_buckets=(4, 10))
    part = synthetic(40, seed=2)
    runner.warm(_weights(model), model.scoring_inputs(part))
    served = runner.run(_weights(model), model.scoring_inputs(part))
    np.testing.assert_allclose(served, model.predict_objectives(part), rtol=1e-5, atol=1e-6)
    scores = served[:, 0]
    np.testing.assert_allclose(scores, model.predict(part), rtol=1e-5, atol=1e-6)
    assert (served[:, 1] <= scores + 1e-6).all() and served[:, 1].std() > 0  # a buy over the clicks
    other = runner.run(_weights(untrained), untrained.scoring_inputs(part))
    np.testing.assert_allclose(other, untrained.predict_objectives(part), rtol=1e-5, atol=1e-6)
    assert not np.allclose(other, served, atol=1e-3) and runner.stats.uncompiled_runs == 0
    runner.close()
    for variable in scorer(model.network).trainable_variables[-2:]:  # the drills' inverted version: its scores'
        variable.assign(-variable)
    np.testing.assert_allclose(model.predict(part), 1 - scores, atol=1e-5)
