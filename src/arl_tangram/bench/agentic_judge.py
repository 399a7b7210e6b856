"""The judge API of ``tangram bench agentic``: an external API that enforces its own quota.

The judge itself is remote (an LLM behind a provider's API): its answer takes the planned
``service_s``. What is measured is what a quota does to the callers. The API keeps its own token
bucket and concurrency limit (``QuotaPool``, the limiter the engine and the simulator use) and
answers a call over them at once with a 429; the client backs off exponentially with jitter and
tries again. Under Tangram the engine admits a call only within the same quota, so it never sees
a 429; under trajectory-static every trajectory calls directly, as frameworks do. The 429's
latency and the client's backoff are the simulator's (``SimApiManager``'s defaults, read from its
signature), so a replay models the same client.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from dataclasses import dataclass

from ..core.cluster import ApiQuota
from ..core.pools import QuotaPool
from ..sim.managers import SimApiManager

_DEFAULTS = {k: p.default for k, p in inspect.signature(SimApiManager.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}
REJECT_S: float = _DEFAULTS["reject_s"]
BACKOFF_BASE_S: float = _DEFAULTS["backoff_base_s"]
BACKOFF_CAP_S: float = _DEFAULTS["backoff_cap_s"]


@dataclass(frozen=True)
class JudgeCall:
    """One call's payload: how long the judge takes to answer it."""

    service_s: float


class JudgeApi:
    """The remote judge and its limiter; ``rejections`` counts the 429s it answered."""

    def __init__(self, quota: ApiQuota) -> None:
        self.limit = QuotaPool(quota, time.monotonic())
        self.rejections = 0
        self.calls = 0

    async def call(self, service_s: float) -> bool:
        """True once answered; False for a 429 (after ``REJECT_S``, its round trip)."""
        now = time.monotonic()
        if not self.limit.available(now):
            self.rejections += 1
            await asyncio.sleep(REJECT_S)
            return False
        self.limit.admit(now)
        try:
            await asyncio.sleep(service_s)
        finally:
            self.limit.release()
        self.calls += 1
        return True


class JudgeClient:
    """The caller's side: the API manager's handler (``apis={"judge": (quota, client)}``); retries
    every 429 after ``min(cap, base * 2**n)`` seconds times a jitter in [0.5, 1.5)."""

    def __init__(self, api: JudgeApi, seed: int = 0) -> None:
        self.api = api
        self.rng = random.Random(seed)

    async def __call__(self, payload: JudgeCall) -> float:
        tries = 0
        while not await self.api.call(payload.service_s):
            await asyncio.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** tries) * self.rng.uniform(0.5, 1.5))
            tries += 1
        return 1.0
