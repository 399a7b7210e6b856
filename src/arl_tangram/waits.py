"""Bounded queue time, and why a queued action is waiting (issue #15).

Every accepted action gets a deadline ``submitted_at + max_queue_s``; past it, if it has not
started, the engine ends it ``rejected`` with a message naming what it waited for. This lives in
the engine (not in a runtime's timers) so the simulator and every runtime apply the same rule and
policies are compared under it. The same explanation is what ``/metrics`` and ``tangram top`` show
for the head of the queue.

Deadlines sit in a FIFO with lazy deletion (see ``QueueDeadlines``), so nothing is scanned per
round. (A scan of ``pending`` per round was the alternative: O(queue) each round.)
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .core.action import CPU, GPU, Action

if TYPE_CHECKING:
    from .engine import Engine

#: the default bound on queue time: minutes, long enough that the built-in simulated workloads
#: never reach it, short enough that a client learns why instead of timing out
DEFAULT_MAX_QUEUE_S = 600.0


class QueueDeadlines:
    """The deadlines of queued actions, earliest first.

    The bound is one constant and the clock never goes back, so deadlines come in submission
    order: a FIFO of the actions themselves (a deadline is ``submitted_at + max_queue_s``).
    Actions that started are dropped when they reach the front, each once: amortised O(1) per
    action, and nothing is kept past the oldest action still waiting. (Measured first and
    dropped: a heap of ``(deadline, action)`` tuples, which kept every started action alive until
    its deadline passed, and a FIFO of ``(deadline, id, submitted_at)`` tuples; both cost the
    engine 10-24% of its decisions/s in ``tangram bench scheduler``, mostly allocation and GC.)
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


def why_waiting(engine: "Engine", a: Action) -> str:
    """What ``a`` is waiting for, in words, from the engine's pools as they are now."""
    if a.pool == CPU:
        cpu = engine.cpu
        lo = a.demand.min(CPU)
        most_free = max((cpu.nfree(i) for i in range(len(cpu.nodes))), default=0)
        if a.trajectory is not None:
            home = cpu.homes.get(a.trajectory)
            if home is not None:
                return f"{lo} free core(s) on its session's node {cpu.nodes[home].name} ({cpu.nfree(home)} free)"
            need = engine.costs.session_mem_gb
            most_mem = max(cpu.free_mem, default=0.0)
            if most_mem < need:
                return (f"memory for a new session: {need * 1024:.0f} MB needed, at most {max(0.0, most_mem) * 1024:.0f} MB"
                        f" free on a node ({len(cpu.homes)} sessions hold {cpu.session_reserved_gb() * 1024:.0f} MB)")
        if most_free < lo:
            return f"{lo} free core(s) on one node (at most {most_free} free, {len(engine.running)} actions running)"
        return f"its turn: {lo} core(s) are free but actions ahead of it come first"
    if a.pool == GPU:
        g = a.demand.min(GPU)
        if g > engine.gpu.max_island:
            return (f"a GPU node to join with {g} GPU(s) in one island for model {a.model or a.service!r} "
                    f"({engine.gpu.capacity} GPUs now, at most {engine.gpu.max_island} in an island)")
        return f"{g} GPU(s) for model {a.model or a.service!r} ({engine.gpu.total_free} GPUs free)"
    quota = engine.quotas.get(a.pool)
    if quota is not None:
        return (f"quota {a.pool}: {quota.in_use} of {quota.quota.concurrency} calls in flight, "
                f"{quota.tokens_at(engine.clock.now()):.1f} tokens")
    return f"capacity in pool {a.pool}"
