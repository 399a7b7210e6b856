"""The asynchronous client: carries out ``base``'s plans with ``httpx.AsyncClient`` and
``asyncio.sleep``."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable

import httpx

from ..api import v1
from .base import Methods, Plan, RetryPolicy, SessionMethods, Sleep, Walk, headers


class AsyncTangramClient(Methods):
    """``async with AsyncTangramClient(url) as c: await c.run_code("print(1)")``; every method of
    ``Methods`` returns an awaitable of its result. Use it from one event loop."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", token: str | None = None, timeout_s: float = 600,
                 retries: int = 4, backoff_s: float = 0.25, max_connections: int = 256,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers(token), timeout=timeout_s, transport=transport,
                                      limits=httpx.Limits(max_connections=max_connections))
        self.policy = RetryPolicy(retries, backoff_s)

    async def _carry_out(self, plan: Plan[Any]) -> Any:
        walk = Walk(plan)
        while (step := walk.next()) is not None:
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
                continue
            try:
                walk.reply = await self.http.request(**step.args())
            except httpx.TransportError as e:
                walk.error = e
        return walk.value

    def _session(self, info: v1.SessionInfo) -> "AsyncSession":
        return AsyncSession(self, info.session_id, info.job)

    async def run_batch(self, programs: Iterable[dict], concurrency: int = 64) -> AsyncIterator[v1.ActionResult]:
        """``run_code`` for many keyword sets, ``concurrency`` at a time; yields results as they finish."""
        sem = asyncio.Semaphore(concurrency)

        async def one(p: dict) -> v1.ActionResult:
            async with sem:
                return await self.run_code(**p)

        for fut in asyncio.as_completed([one(p) for p in programs]):
            yield await fut

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncTangramClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSession(SessionMethods):
    """A session of an ``AsyncTangramClient`` (``async with await c.session() as s: ...``)."""

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
