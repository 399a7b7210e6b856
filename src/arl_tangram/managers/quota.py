"""External APIs as schedulable resources: the engine admits an ``api:<name>`` action only when
the API's token bucket and concurrency allow, so callers wait in our queue instead of hammering
the API; a user-supplied async handler performs the call."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..core.action import Action, Allocation, Outcome

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]


class ApiManager:
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.on_done: Callable[[str, Outcome, float, float, str, Any], None] | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self, action: Action, allocation: Allocation) -> None:
        task = asyncio.get_running_loop().create_task(self._call(action))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, action: Action) -> None:
        name = action.pool[len("api:"):]
        t = time.perf_counter()
        try:
            coro = self.handlers[name](action.payload)
            result = await (asyncio.wait_for(coro, action.timeout_s) if action.timeout_s else coro)
            outcome, message = Outcome.OK, ""
        except asyncio.TimeoutError:
            result, outcome, message = None, Outcome.TIMEOUT, f"api {name} did not answer in {action.timeout_s}s"
        except Exception as e:  # the API failed: retryable, never the caller's fault
            result, outcome, message = None, Outcome.INFRA_ERROR, f"api {name} failed: {type(e).__name__}: {e}"
        if self.on_done is not None:
            self.on_done(action.id, outcome, 0.0, time.perf_counter() - t, message, result)

    def close_session(self, trajectory: str) -> None:
        pass

    def prefetch(self, key: str, model: str, gpus: tuple[int, ...], per_gpu_gb: float) -> None:
        raise RuntimeError("APIs hold no models")

    async def shut_down(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
