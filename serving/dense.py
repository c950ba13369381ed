"""The dense network on the request path: XLA-compiled per shape bucket, shared by every version.

The weights are an argument of the compiled function (`keras.Model.stateless_call`), not captured
variables, so one compiled function per (architecture, shape) serves every version of that
architecture: loading, swapping or rolling back a version compiles nothing.

Shapes: a batch of R rows whose longest behavior sequence is L is padded up to the smallest row
bucket >= R and sequence bucket >= L, its distinct sequences and user attributes (one per request:
`owner` maps rows to them) up to `groups` (or R if fewer), and its distinct long-history lists (one
per user x category: `long_owner`) up to `long_groups(R)`; a batch with more distinct sequences runs
in parts of `groups`, a part with more long-history lists in halves. Every bucket is compiled and run
once by `warm` before the server reports ready. A shape beyond the largest buckets runs at once on the
uncompiled (eager) path while one background thread compiles it; the compiled function takes over
when done. With buckets off, every new exact shape is compiled on the request path (what a naive
server does: the baseline).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from models.ctr import CtrModel, probabilities
from models.networks import DENSE_INPUTS

log = logging.getLogger(__name__)
Shape = tuple[int, int]  # (rows, sequence length)


@dataclass
class CompileStats:
    """Counters for the metrics endpoint: compiles by where they ran, runs on the eager path."""

    warm: int = 0  # before the architecture served anything
    background: int = 0  # out-of-bucket shapes, off the request path
    request_path: int = 0  # buckets off: a request waited for it
    uncompiled_runs: int = 0


class DenseRunner:
    """Scores padded inputs with any version's weights for one model architecture."""

    def __init__(self, template: CtrModel, row_buckets: Sequence[int], sequence_buckets: Sequence[int],
                 buckets: bool = True, on_compile: Callable[[str], None] | None = None, groups: int = 16) -> None:
        self.network = template.network  # only its structure is used; weights come with each call
        self.chain = template.spec.chain  # several objectives: how their logits chain into probabilities
        self.row_buckets, self.sequence_buckets = sorted(row_buckets), sorted(sequence_buckets)
        self.buckets, self.groups = buckets, groups
        self.stats = CompileStats()
        self._on_compile = on_compile or (lambda where: None)
        self._compiled: dict[Shape, Callable] = {}
        self._pending: set[Shape] = set()
        self._lock = threading.Lock()  # guards _pending; _compiled is replaced, never mutated
        self._warming = threading.Lock()  # one warm at a time: two rankers' versions of one shape compile once
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="xla-compile")

    def _forward(self, weights: list[tf.Tensor], inputs: dict[str, tf.Tensor]) -> tf.Tensor:
        """Probabilities [B] of the one objective, or [B, K] of each of several (`CtrModel.predict_objectives`)."""
        if not self.chain:
            trainable = len(self.network.trainable_variables)  # `CtrModel.dense_weights`: trained ones first
            logits, _ = self.network.stateless_call(weights[:trainable], weights[trainable:], inputs)
            return tf.sigmoid(logits)
        variables = [*self.network.trainable_variables, *self.network.non_trainable_variables]
        with keras.StatelessScope(state_mapping=list(zip(variables, weights, strict=True))):  # stateless_call's way
            return probabilities(self.network.heads(inputs), self.chain)

    def _function_for(self, weights: list[tf.Tensor], inputs: dict[str, tf.Tensor]) -> Callable:
        """The XLA function of these inputs' shape (compiled on its first run). One tf.function per shape:
        compiling one never holds the lock of another being called. Its concrete function is what is
        kept: calling the tf.function costs ~0.7 ms of Python per call to find it."""
        return tf.function(lambda w, x: self._forward(w, x), jit_compile=True).get_concrete_function(weights, inputs)

    def bucket_shapes(self) -> list[Shape]:
        return [(r, s) for r in self.row_buckets for s in self.sequence_buckets]

    def shape_for(self, rows: int, length: int) -> tuple[Shape, bool]:
        """The padded shape of a batch and whether it is a bucket. A dimension past its largest
        bucket keeps its exact size (the other is still padded to its bucket)."""
        if not self.buckets:
            return (rows, length), False
        r = bisect.bisect_left(self.row_buckets, rows)
        s = bisect.bisect_left(self.sequence_buckets, length)
        shape = (self.row_buckets[r] if r < len(self.row_buckets) else rows,
                 self.sequence_buckets[s] if s < len(self.sequence_buckets) else length)
        return shape, r < len(self.row_buckets) and s < len(self.sequence_buckets)

    def warm(self, weights: list[tf.Tensor], example: dict[str, np.ndarray]) -> None:
        """Compile every bucket not compiled yet and run it with `weights`; raises if any score is not
        finite. `example` holds rows of inputs (`CtrModel.scoring_inputs`); each shape scores those that
        fit it, zero-padded. A later version of the architecture runs nothing here: the weights are the
        compiled functions' inputs, so there is nothing to warm, and running all the buckets again
        (~0.8 s of both cores when the workers swap at once) made requests miss their deadlines."""
        with self._warming:
            self._warm(weights, example)

    def _warm(self, weights: list[tf.Tensor], example: dict[str, np.ndarray]) -> None:
        for shape in (self.bucket_shapes() if self.buckets else []):
            if shape in self._compiled:
                continue
            groups = min(self.groups, shape[0])
            fit = min(shape[0], int(np.searchsorted(example["owner"], groups)))
            inputs = _tensors(_pad(_part(example, 0, fit), *shape, groups, self.long_groups(shape[0])))
            fn = self._function_for(weights, inputs)
            self._publish(shape, fn)
            self.stats.warm += 1
            self._on_compile("warm")
            scores = fn(weights, inputs)
            if not np.all(np.isfinite(scores.numpy())):
                raise ValueError(f"non-finite scores on shape {shape}")

    def long_groups(self, rows: int) -> int:
        """How many long-history lists a shape of `rows` rows holds (a request's candidates share one
        per category: far fewer than rows)."""
        return min(rows, max(2 * self.groups, rows // 4))

    def run(self, weights: list[tf.Tensor], inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Probabilities [rows] (several objectives: [rows, K]) of `inputs` (as `CtrModel.scoring_inputs` gives:
        `owner` non-decreasing)."""
        owner = inputs["owner"]
        if len(owner) and owner[-1] >= self.groups:  # too many sequences for one run: parts of `groups`
            cuts = np.searchsorted(owner, np.arange(self.groups, owner[-1] + 1, self.groups))
            return np.concatenate([self._fitted(weights, _part(inputs, a, b))
                                   for a, b in zip([0, *cuts], [*cuts, len(owner)])])
        return self._fitted(weights, inputs)

    def _fitted(self, weights: list[tf.Tensor], inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Scores of `inputs`, in halves while their long-history lists are more than their shape holds."""
        rows = len(inputs["owner"])
        shape, in_bucket = self.shape_for(rows, inputs["sequence_mask"].shape[1])
        if len(inputs["long_mask"]) <= self.long_groups(shape[0]):
            return self._run(weights, inputs, shape, in_bucket)
        half = rows // 2
        return np.concatenate([self._fitted(weights, _part(inputs, 0, half)),
                               self._fitted(weights, _part(inputs, half, rows))])

    def _run(self, weights: list[tf.Tensor], inputs: dict[str, np.ndarray], shape: Shape, in_bucket: bool
             ) -> np.ndarray:
        rows = len(inputs["owner"])
        padded = _tensors(_pad(inputs, *shape, min(self.groups, shape[0]), self.long_groups(shape[0])))
        fn = self._compiled.get(shape)
        if fn is None and not self.buckets:
            fn = self._function_for(weights, padded)
            out = fn(weights, padded)  # compiles here, on the request path
            self._publish(shape, fn)
            self.stats.request_path += 1
            self._on_compile("request_path")
            return out.numpy()[:rows]
        if fn is None:
            if in_bucket:
                log.warning("bucket %s was not warmed; compiling it in the background", shape)
            self._compile_later(shape, weights, padded)
            self.stats.uncompiled_runs += 1
            return self._forward(weights, padded).numpy()[:rows]
        return fn(weights, padded).numpy()[:rows]

    def _compile_later(self, shape: Shape, weights: list[tf.Tensor], padded: dict[str, tf.Tensor]) -> None:
        with self._lock:
            if shape in self._pending:
                return
            self._pending.add(shape)

        def compile_shape() -> None:
            try:
                fn = self._function_for(weights, padded)
                fn(weights, padded)
                self._publish(shape, fn)
                self.stats.background += 1
                self._on_compile("background")
            except Exception:  # noqa: BLE001 - the eager path keeps serving the shape
                log.exception("background compile of shape %s failed", shape)
            finally:
                with self._lock:
                    self._pending.discard(shape)

        self._compiler.submit(compile_shape)

    def _publish(self, shape: Shape, fn: Callable) -> None:
        # Readers look up without a lock: publish a new dict instead of mutating the one they read.
        self._compiled = self._compiled | {shape: fn}

    def compiled_shapes(self) -> set[Shape]:
        return set(self._compiled)

    def close(self) -> None:
        self._compiler.shutdown(wait=True, cancel_futures=True)


_SEQUENCE_INPUTS = {i.name for i in DENSE_INPUTS if i.sequence_axis}  # [U, L, ...]: one per distinct sequence
_GROUP_INPUTS = {i.name for i in DENSE_INPUTS if i.per == "owner"}  # [U, ...]: one per owner
_LONG_INPUTS = {i.name for i in DENSE_INPUTS if i.per == "long_owner"}  # [G, ...]: one per long_owner


def _part(inputs: dict[str, np.ndarray], a: int, b: int) -> dict[str, np.ndarray]:
    """Rows a..b of `inputs`, with only their owners' groups and their long-history lists."""
    owner = inputs["owner"][a:b]
    first, last = int(owner[0]), int(owner[-1]) + 1
    used, long_owner = np.unique(inputs["long_owner"][a:b], return_inverse=True)
    return {name: value[first:last] if name in _GROUP_INPUTS else value[used] if name in _LONG_INPUTS
            else owner - first if name == "owner" else long_owner.astype(np.int32) if name == "long_owner"
            else value[a:b] for name, value in inputs.items()}


def _pad(inputs: dict[str, np.ndarray], rows: int, length: int, groups: int, long_groups: int) -> dict[str, np.ndarray]:
    """Zero rows (they score and are cut off; their owners are group 0), zero groups, zero long-history
    lists and zero-mask sequence slots (the attention ignores them) up to the shape."""
    out = {}
    for name, value in inputs.items():
        shape = ((groups, length, *value.shape[2:]) if name in _SEQUENCE_INPUTS else
                 (groups, *value.shape[1:]) if name in _GROUP_INPUTS else
                 (long_groups, *value.shape[1:]) if name in _LONG_INPUTS else (rows, *value.shape[1:]))
        value = value[tuple(slice(0, d) for d in shape)]
        if value.shape != shape:
            padded = np.zeros(shape, value.dtype)
            padded[tuple(slice(0, d) for d in value.shape)] = value
            value = padded
        out[name] = value
    return out


_INT_INPUTS = ("owner", "long_owner", "sequence_types", "long_types")


def _tensors(inputs: dict[str, np.ndarray]) -> dict[str, tf.Tensor]:
    return {name: tf.constant(value, tf.int32 if name in _INT_INPUTS else tf.float32) for name, value in inputs.items()}
