"""Request aggregation: concurrent requests share batches and each gets its own result back; a lone
request is not held for a full batch; excess is refused at once; expired requests never run; a
request that fails a batch fails alone; N executors run N batches at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving.batching import Batcher, BatcherClosed, DeadlineExceeded, Overloaded


class Model:
    """Scores each request's rows (a list of ints) as row * 10; records the batches it saw. Can be
    held (executors block until released) and can fail on a poisoned payload."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.release = threading.Event()
        self.release.set()
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def __call__(self, payloads: Sequence[list[int]]) -> list[list[int]]:
        with self.lock:
            self.batches.append(list(payloads))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            self.release.wait(10)
            if any(-1 in p for p in payloads):
                raise ValueError("poisoned row")
            return [[row * 10 for row in p] for p in payloads]
        finally:
            with self.lock:
                self.running -= 1


def batcher(model: Model, **overrides) -> Batcher:
    options = dict(max_batch_rows=16, max_delay_s=0.05, max_queue_rows=64, executors=1) | overrides
    return Batcher(model, **options)


def test_concurrent_requests_share_batches_and_get_their_own_results() -> None:
    model = Model()
    model.release.clear()  # hold the first batch so the others queue up behind it
    b = batcher(model, max_queue_rows=256)
    requests = [[i, i + 1000] for i in range(60)]  # 2 rows each
    futures = [b.submit(r, rows=2, timeout_s=10) for r in requests]
    model.release.set()
    assert [f.result(10) for f in futures] == [[i * 10, (i + 1000) * 10] for i in range(60)]
    b.close()
    sizes = [sum(len(p) for p in batch) for batch in model.batches]
    assert sum(sizes) == 120 and max(sizes) <= 16
    assert len(model.batches) <= 120 // 16 + 2  # merged, not one run per request
    assert b.stats.requests == 60 and b.stats.rows == 120 and b.stats.queued_rows == 0


def test_a_lone_request_is_not_held_for_a_full_batch() -> None:
    model = Model()
    b = batcher(model, max_batch_rows=1000, max_queue_rows=1000, max_delay_s=0.02)
    assert b.submit([7], rows=1, timeout_s=5).result(timeout=2) == [70]  # closes after max_delay_s
    b.close()


def test_excess_is_refused_at_once_and_admitted_work_completes() -> None:
    model = Model()
    model.release.clear()
    b = batcher(model, max_batch_rows=4, max_queue_rows=8)
    admitted = [b.submit([i], rows=1, timeout_s=10) for i in range(8)]
    with pytest.raises(Overloaded, match="8 rows queued"):
        b.submit([99], rows=1, timeout_s=10)
    assert b.stats.overloaded == 1
    model.release.set()
    assert [f.result(10) for f in admitted] == [[i * 10] for i in range(8)]
    assert b.submit([5], rows=1, timeout_s=10).result(10) == [50]  # room again once the queue drained
    b.close()


def test_a_request_past_its_deadline_is_dropped_without_running() -> None:
    model = Model()
    model.release.clear()
    b = batcher(model, max_batch_rows=1, max_delay_s=0.0)
    blocking = b.submit([1], rows=1, timeout_s=10)  # occupies the only executor
    late = b.submit([2], rows=1, timeout_s=0.05)
    threading.Event().wait(0.2)
    model.release.set()
    assert blocking.result(10) == [10]
    with pytest.raises(DeadlineExceeded):
        late.result(10)
    b.close()
    assert [2] not in [p for batch in model.batches for p in batch] and b.stats.expired == 1
    assert b.stats.queued_rows == 0


def test_a_failing_request_fails_alone() -> None:
    model = Model()
    b = batcher(model, max_batch_rows=2, max_delay_s=0.2)
    model.release.clear()
    good, poisoned = b.submit([1], rows=1, timeout_s=10), b.submit([-1], rows=1, timeout_s=10)  # one batch
    later = b.submit([3], rows=1, timeout_s=10)
    model.release.set()
    with pytest.raises(ValueError, match="poisoned"):
        poisoned.result(10)
    # its batch-mate ran again on its own and got its result; the next batch never saw the failure
    assert good.result(10) == [10] and later.result(10) == [30]
    assert [[1]] in model.batches and b.stats.failed_batches == 2 and b.stats.requests == 2
    b.close()
    with pytest.raises(BatcherClosed):
        b.submit([4], rows=1, timeout_s=1)


def test_executors_run_batches_in_parallel() -> None:
    model = Model()
    model.release.clear()
    b = batcher(model, max_batch_rows=1, max_delay_s=0.0, executors=4)
    futures = [b.submit([i], rows=1, timeout_s=10) for i in range(4)]

    def four_running() -> bool:
        for _ in range(200):
            if model.most_running == 4:
                return True
            threading.Event().wait(0.01)
        return False

    assert four_running()
    model.release.set()
    assert sorted(f.result(10)[0] for f in futures) == [0, 10, 20, 30]
    b.close()


def test_many_callers_at_once() -> None:
    model = Model()
    b = batcher(model, max_queue_rows=10_000, max_batch_rows=64, max_delay_s=0.005, executors=2)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: b.submit([i], rows=1, timeout_s=30).result(30), range(2000)))
    b.close()
    assert got == [[i * 10] for i in range(2000)]
    assert b.stats.requests == 2000 and b.stats.batches < 2000
