"""Bounded queue time.

Every accepted action gets a deadline ``submitted_at + max_queue_s``; past it, if it has not
started, the engine ends it ``rejected`` with a message naming what it waited for (the policy
says: ``Policy.why_waiting``). This lives in the engine (not in a runtime's timers) so the
simulator and every runtime apply the same rule and policies are compared under it.

Deadlines sit in a FIFO with lazy deletion (see ``QueueDeadlines``), so nothing is scanned per
round. (A scan of ``pending`` per round was the alternative: O(queue) each round.)
"""

from __future__ import annotations

from collections import deque

from .core.action import Action

#: the default bound on queue time: minutes, long enough that the built-in simulated workloads
#: never reach it, short enough that a client learns why instead of timing out
DEFAULT_MAX_QUEUE_S = 600.0


class QueueDeadlines:
    """The deadlines of queued actions, earliest first.

    The bound is one constant and the clock never goes back, so deadlines come in submission
    order: a FIFO of the actions themselves (a deadline is ``submitted_at + max_queue_s``).
    Actions that started are dropped when they reach the front, each once: amortised O(1) per
    action, and nothing is kept past the oldest action still waiting, nor allocated per action
    (a heap or a FIFO of tuples cost the engine 10-24% of its decisions/s: docs/performance.md).
    """

    __slots__ = ("max_queue_s", "_fifo")

    def __init__(self, max_queue_s: float | None) -> None:
        if max_queue_s is not None and not max_queue_s > 0:
            raise ValueError(f"max_queue_s: must be positive (or None for no bound), got {max_queue_s!r}")
        self.max_queue_s = max_queue_s
        self._fifo: deque[Action] = deque()

    def add(self, action: Action) -> None:
        if self.max_queue_s is not None:
            self._fifo.append(action)

    def earliest(self, pending: dict[str, Action]) -> float | None:
        """The earliest deadline of an action still in ``pending`` (started ones are dropped)."""
        fifo = self._fifo
        max_queue_s = self.max_queue_s
        if max_queue_s is None:  # nothing was queued
            return None
        while fifo:
            a = fifo[0]
            if pending.get(a.id) is a:
                return a.submitted_at + max_queue_s
            fifo.popleft()
        return None

    def due(self, pending: dict[str, Action], now: float, eps: float) -> list[Action]:
        """Remove and return the actions of ``pending`` whose deadline is at or before ``now``."""
        out: list[Action] = []
        fifo = self._fifo
        max_queue_s = self.max_queue_s
        if max_queue_s is None:
            return out
        until = now + eps - max_queue_s
        while fifo and fifo[0].submitted_at <= until:
            a = fifo.popleft()
            if pending.get(a.id) is a:
                out.append(a)
        return out
