"""External APIs as schedulable resources: the engine admits an ``api:<name>`` action only when
the API's token bucket and concurrency allow, so callers wait in our queue instead of hammering
the API; a user-supplied async handler performs the call."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from ..core.action import API_PREFIX, Action, Allocation, Outcome
from ..core.seam import Completion, Sink
from .tasks import TaskSet

Handler = Callable[[Any], Awaitable[Any]]


class ApiManager:
    """Implements the engine's ``Manager`` protocol for ``Pool.API``."""

    def __init__(self, handlers: dict[str, Handler], sink: Sink) -> None:
        self.handlers = handlers
        self.tasks = TaskSet(sink, "apis")

    def start(self, action: Action, allocation: Allocation) -> None:
        self.tasks.run(action, lambda: self._call(action))

    def cancel(self, action_id: str) -> None:
        self.tasks.cancel(action_id)

    def close_session(self, trajectory: str) -> None:
        pass

    async def _call(self, action: Action) -> Completion:
        name = action.pool[len(API_PREFIX):]
        t = time.perf_counter()
        try:
            coro = self.handlers[name](action.payload)
            result = await (asyncio.wait_for(coro, action.timeout_s) if action.timeout_s else coro)
            outcome, message = Outcome.OK, ""
        except asyncio.TimeoutError:
            result, outcome, message = None, Outcome.TIMEOUT, f"api {name} did not answer in {action.timeout_s}s"
        except Exception as e:  # the API failed: retryable, never the caller's fault
            result, outcome, message = None, Outcome.INFRA_ERROR, f"api {name} failed: {type(e).__name__}: {e}"
        return Completion(action.id, outcome, 0.0, time.perf_counter() - t, message, result)

    async def start_up(self) -> None:
        pass  # the handlers are the caller's: nothing to start

    async def shut_down(self) -> None:
        await self.tasks.close()
