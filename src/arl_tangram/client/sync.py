"""The synchronous client: carries out ``base``'s plans with ``httpx.Client`` and ``time.sleep``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterable, Iterator

import httpx

from ..api import v1
from .base import Methods, Plan, RetryPolicy, SessionMethods, Sleep, Walk, headers


class TangramClient(Methods):
    """``with TangramClient("http://127.0.0.1:8080") as c: c.run_code("print(1)")``; every method
    of ``Methods`` returns its result."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", token: str | None = None, timeout_s: float = 600,
                 retries: int = 4, backoff_s: float = 0.25,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.http = httpx.Client(base_url=base_url, headers=headers(token), timeout=timeout_s, transport=transport)
        self.policy = RetryPolicy(retries, backoff_s)

    def _carry_out(self, plan: Plan[Any]) -> Any:
        walk = Walk(plan)
        while (step := walk.next()) is not None:
            if isinstance(step, Sleep):
                time.sleep(step.seconds)
                continue
            try:
                walk.reply = self.http.request(**step.args())
            except httpx.TransportError as e:
                walk.error = e
        return walk.value

    def _session(self, info: v1.SessionInfo) -> "Session":
        return Session(self, info.session_id, info.job)

    def run_batch(self, programs: Iterable[dict], concurrency: int = 32) -> Iterator[v1.ActionResult]:
        """``run_code`` for many keyword sets on ``concurrency`` threads; yields results as they finish."""
        with ThreadPoolExecutor(concurrency) as pool:
            for f in as_completed([pool.submit(lambda p=p: self.run_code(**p)) for p in programs]):
                yield f.result()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "TangramClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(SessionMethods):
    """A session of a ``TangramClient`` (``with c.session() as s: s.exec(python="x = 1")``)."""

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
