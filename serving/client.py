"""Clients of the ranking API that generate load: open loop (a fixed request rate, whatever the answers)
and closed loop (N clients sending back to back). The demo's live replay, the serving tests and the
serving benchmark all send their traffic through these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Served:
    """One `POST /rank` as the client saw it."""

    request: dict
    sent_at: float  # time.monotonic()
    seconds: float  # until the answer (or the failure)
    status: int  # HTTP status; -1 when the connection failed
    body: dict  # the JSON answer; {"error": ...} when the connection failed

    @property
    def rows(self) -> int:
        return len(self.request["candidates"])


def endpoint(request: dict) -> str:
    """The route a request body is for: a list of candidates is ranked, a user alone gets recommendations."""
    return "/rank" if "candidates" in request else "/recommend"


async def rank(http: httpx.AsyncClient, url: str, request: dict) -> Served:
    sent = time.monotonic()
    try:
        r = await http.post(f"{url}{endpoint(request)}", json=request)
    except httpx.TransportError as exc:  # counted as a failure, never raised: load keeps its shape
        return Served(request, sent, time.monotonic() - sent, -1, {"error": repr(exc)})
    try:
        body = r.json()
    except ValueError:  # not JSON (a proxy's or the server's plain-text error page)
        body = {"error": r.text[:500]}
    return Served(request, sent, time.monotonic() - sent, r.status_code, body)


async def open_loop(url: str, requests: Iterable[dict], rate: float,
                    after: Callable[[Served], Awaitable[None]] | None = None,
                    stop: Callable[[], bool] | None = None) -> list[Served]:
    """Send `requests` at `rate` per second, each on time whatever the earlier ones are waiting for;
    `after(served)` runs for each answer. Ends when the requests (or `stop()`) do and all are answered."""
    out: list[Served] = []

    async def one(http: httpx.AsyncClient, request: dict) -> None:
        served = await rank(http, url, request)
        out.append(served)
        if after is not None:
            await after(served)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1000)) as http:
        tasks, start = [], time.monotonic()
        for n, request in enumerate(requests):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            if stop is not None and stop():
                break
            tasks.append(asyncio.create_task(one(http, request)))
        await asyncio.gather(*tasks)
    return out


async def closed_loop(url: str, request: Callable[[int, int], dict], concurrency: int,
                      seconds: float) -> list[Served]:
    """`concurrency` clients, each sending its next request (`request(client, n)`) when the last is
    answered, for `seconds`."""
    out: list[Served] = []
    stop = time.monotonic() + seconds

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            n = 0
            while time.monotonic() < stop:
                out.append(await rank(http, url, request(k, n)))
                n += 1

    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return out
