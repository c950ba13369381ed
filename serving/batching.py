"""Request aggregation (JD's TensorBatch): concurrent requests are merged into one batch, run once,
and their results handed back to each caller.

    submit(payload, rows, deadline) -> Future
        │ admission: queued rows + rows <= max_queue_rows, else Overloaded at once (503 + Retry-After)
        ▼
    queue of requests
        ▼
    N executor threads: a free executor takes what is queued as its batch, up to max_batch_rows rows,
    waiting for more only until max_delay_s after the first request was queued; drops requests past
    their deadline (DeadlineExceeded, never run), then run(payloads) -> one result per payload; if
    the run raises, each of its requests runs again alone, so an exception fails only the request
    that raises it

A batch is formed when an executor is free, not ahead of it: requests that arrive while every
executor is busy join the next batch instead of waiting behind one formed early (a collector thread
that closed batches on its own clock held them for two batch runs under load).

`run` owns what a batch means (concatenating rows, padding to a compiled shape, splitting the
scores back): this module only decides who runs with whom, and when. Executors are threads: the
dense step releases the GIL inside TensorFlow, so N of them overlap (CUDA streams on a GPU).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # a request's payload
R = TypeVar("R")  # its result


class Overloaded(RuntimeError):
    """The queue is full: answer at once (503 + Retry-After) instead of queueing more work."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed while it waited: it was dropped without running."""


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request ran."""


@dataclass
class _Request(Generic[P]):
    payload: P
    rows: int
    deadline: float  # time.monotonic() after which the request is dropped
    queued: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


@dataclass
class BatcherStats:
    """Counters for the metrics endpoint; read without a lock (each is one int)."""

    batches: int = 0
    requests: int = 0
    rows: int = 0
    overloaded: int = 0
    expired: int = 0
    failed_batches: int = 0
    queued_rows: int = 0  # admitted and not yet run
    batch_rows: list[int] = field(default_factory=list)  # of the last 1,000 batches

    def record_batch(self, rows: int) -> None:
        self.batches += 1
        self.batch_rows = [*self.batch_rows[-999:], rows]


class Batcher(Generic[P, R]):
    def __init__(self, run: Callable[[Sequence[P]], Sequence[R]], *, max_batch_rows: int, max_delay_s: float,
                 max_queue_rows: int, executors: int = 1, name: str = "batcher"):
        if max_batch_rows < 1 or max_queue_rows < max_batch_rows or executors < 1 or max_delay_s < 0:
            raise ValueError("need max_batch_rows >= 1, max_queue_rows >= max_batch_rows, executors >= 1, "
                             "max_delay_s >= 0")
        self._run, self.max_batch_rows, self.max_delay_s = run, max_batch_rows, max_delay_s
        self.max_queue_rows = max_queue_rows
        self.stats = BatcherStats()
        self._admit = threading.Lock()
        self._incoming: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._threads = [threading.Thread(target=self._execute, name=f"{name}-executor-{i}", daemon=True)
                         for i in range(executors)]
        for t in self._threads:
            t.start()

    def submit(self, payload: P, rows: int, timeout_s: float) -> Future:
        """Queue a request of `rows` rows that must start within `timeout_s`; its Future gets the result.
        Raises Overloaded at once when the queue holds too many rows."""
        with self._admit:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if self.stats.queued_rows + rows > self.max_queue_rows:
                self.stats.overloaded += 1
                raise Overloaded(f"{self.stats.queued_rows} rows queued; {rows} more would pass {self.max_queue_rows}")
            self.stats.queued_rows += rows
        request = _Request(payload, rows, time.monotonic() + timeout_s)
        self._incoming.put(request)
        return request.future

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, run what was admitted, stop the threads."""
        with self._admit:
            self._closed = True
        self._incoming.put(None)
        for t in self._threads:
            t.join(timeout_s)

    def _release(self, requests: list[_Request]) -> None:
        with self._admit:
            self.stats.queued_rows -= sum(r.rows for r in requests)

    def _next_batch(self, carry: _Request | None) -> tuple[list[_Request], _Request | None]:
        """What is queued, up to max_batch_rows, waiting for more until max_delay_s after the first was
        queued: the batch (empty once closed) and a request that did not fit it."""
        first = carry or self._incoming.get()
        if first is None:
            self._incoming.put(None)  # every executor stops
            return [], None
        batch, rows = [first], first.rows
        closes = first.queued + self.max_delay_s
        while rows < self.max_batch_rows:
            try:
                nxt = self._incoming.get(timeout=max(0.0, closes - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                self._incoming.put(None)  # stop after this batch
                break
            if rows + nxt.rows > self.max_batch_rows:
                return batch, nxt
            batch.append(nxt)
            rows += nxt.rows
        return batch, None

    def _execute(self) -> None:
        carry: _Request | None = None
        while True:
            batch, carry = self._next_batch(carry)
            if not batch:
                break
            now, live = time.monotonic(), []
            for r in batch:
                if not r.future.set_running_or_notify_cancel():
                    continue  # the caller gave up on it
                if r.deadline < now:
                    self.stats.expired += 1
                    r.future.set_exception(DeadlineExceeded("dropped: its deadline passed while it was queued"))
                else:
                    live.append(r)
            try:
                if live and not self._try(live) and len(live) > 1:
                    for r in live:  # which request fails it? Each alone: the others still get their results
                        self._try([r])
            finally:
                self._release(batch)

    def _try(self, live: list[_Request]) -> bool:
        """Run `live` as one batch and hand out the results; False (each caller has the exception when it
        is a lone request) if the run raised."""
        try:
            results = self._run([r.payload for r in live])
            if len(results) != len(live):
                raise RuntimeError(f"run returned {len(results)} results for {len(live)} requests")
        except Exception as exc:  # noqa: BLE001 - the callers get the error; the server goes on
            self.stats.failed_batches += 1
            if len(live) == 1:
                live[0].future.set_exception(exc)
            return False
        for r, result in zip(live, results):
            r.future.set_result(result)
        self.stats.record_batch(sum(r.rows for r in live))
        self.stats.requests += len(live)
        self.stats.rows += sum(r.rows for r in live)
        return True
