"""The running tasks of one manager, and the one place their completions are reported.

Every real manager runs an action as an asyncio task whose body returns a ``Completion``. This
helper owns those tasks: it reports each body's completion to the manager's sink exactly once,
turns a bug in the body into ``infra_error`` (never the user's fault, never a silent loss), turns
``cancel(id)`` into a ``cancelled`` completion, and on ``close`` cancels what is left without
reporting (the runtime is going away; the journal re-runs or ends those actions on restart).
It also keeps background tasks (loads, kills) alive until they finish, so that every manager
writes this bookkeeping once, here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ..core.action import Action, Outcome
from ..core.seam import Completion, Report, Sink

log = logging.getLogger(__name__)


class TaskSet:
    def __init__(self, sink: Sink, name: str) -> None:
        self.sink = sink
        self.name = name
        self.actions: dict[str, asyncio.Task] = {}
        self.background: set[asyncio.Task] = set()
        self._cancelling: set[str] = set()
        self._started: set[str] = set()  # actions whose guard has begun
        self.closing = False

    def run(self, action: Action, body: Callable[[], Awaitable[Completion]]) -> None:
        """Run ``body()`` for ``action`` and report what it returns."""
        task = asyncio.get_running_loop().create_task(self._guard(action, body))
        self.actions[action.id] = task

    async def _guard(self, action: Action, body: Callable[[], Awaitable[Completion]]) -> None:
        self._started.add(action.id)
        try:
            c = await body()
        except asyncio.CancelledError:
            if action.id not in self._cancelling or self.closing:
                raise  # shutting down: nothing is reported
            c = Completion(action.id, Outcome.CANCELLED, message="cancelled while running")
        except Exception as e:  # a bug of ours: never the user's fault, never a silent loss
            log.exception("%s: action %s failed inside the manager", self.name, action.id)
            c = Completion(action.id, Outcome.INFRA_ERROR, message=f"internal error: {type(e).__name__}: {e}")
        finally:
            self.actions.pop(action.id, None)
            self._cancelling.discard(action.id)
            self._started.discard(action.id)
        self.sink(c)

    def cancel(self, action_id: str) -> None:
        task = self.actions.get(action_id)
        if task is None or task.done():
            return
        if action_id not in self._started:
            # cancelled in the loop pass that started it: the task's body never runs, so its
            # guard cannot report; report here (else the action never ends and holds its cores)
            del self.actions[action_id]
            task.cancel()
            self.sink(Completion(action_id, Outcome.CANCELLED, message="cancelled before it started running"))
            return
        self._cancelling.add(action_id)
        task.cancel()

    def spawn(self, coro: Awaitable, report: Callable[[], Report] | None = None) -> asyncio.Task:
        """A background task kept alive until done; ``report()`` is sent to the sink after it
        ends, unless the set is closing."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)

        def done(t: asyncio.Task) -> None:
            self.background.discard(t)
            if report is not None and not self.closing and not t.cancelled():
                self.sink(report())

        task.add_done_callback(done)
        return task

    async def close(self, *, cancel_background: bool = True) -> None:
        """Cancel the running actions (unreported) and, unless told not to, background tasks."""
        self.closing = True
        tasks = list(self.actions.values())
        if cancel_background:
            tasks += list(self.background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not cancel_background:
            await asyncio.gather(*list(self.background), return_exceptions=True)
