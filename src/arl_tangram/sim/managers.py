"""Simulated managers: they turn an allocation into a completion time instead of a process.

They model the costs that make placement matter: a session's create / thaw / restore, a model's
host-to-GPU load (weights per GPU / bandwidth, on every GPU of the block in parallel), and an
external API that enforces its own quota, rejecting over-limit calls that clients then retry with
exponential backoff. Each reports to the sink it was built with, as the real managers do.
"""

from __future__ import annotations

import random
from typing import Callable

from ..core.action import Action, Allocation, Outcome, Setup
from ..core.clock import Clock
from ..core.cluster import ApiQuota, Cluster
from ..core.pools import GpuPool, QuotaPool
from ..core.records import Load
from ..core.seam import Completion, Loaded, Sink
from ..policy.base import Costs

#: ``at(t, fn)`` runs ``fn()`` at virtual time ``t``
Scheduler = Callable[[float, Callable[[], None]], None]


class _SimManager:
    """What every simulated manager shares: completions due at a virtual time, reported to the
    sink unless the action was cancelled first (then ``cancelled`` is reported at once)."""

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink) -> None:
        self.at = at
        self.clock = clock
        self.sink = sink
        self._live: set[str] = set()

    def _finish_at(self, action: Action, setup: float, exec_s: float) -> None:
        outcome = Outcome.OK
        if action.timeout_s is not None and exec_s > action.timeout_s:
            exec_s, outcome = action.timeout_s, Outcome.TIMEOUT
        self._report_at(self.clock.now() + setup + exec_s, Completion(action.id, outcome, setup, exec_s))

    def _report_at(self, t: float, c: Completion) -> None:
        self._live.add(c.action_id)

        def due() -> None:
            if c.action_id in self._live:
                self._live.discard(c.action_id)
                self.sink(c)

        self.at(t, due)

    def cancel(self, action_id: str) -> None:
        if action_id in self._live:
            self._live.discard(action_id)
            self.sink(Completion(action_id, Outcome.CANCELLED, message="cancelled while running"))

    def close_session(self, trajectory: str) -> None:
        pass

    async def start_up(self) -> None:  # the seam's lifecycle: nothing to start or stop in a simulation
        pass

    async def shut_down(self) -> None:
        pass


class SimSandboxManager(_SimManager):
    """Sessions cost ``Costs`` to create, thaw or restore; work shrinks with cores (Amdahl)."""

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink, costs: Costs = Costs()) -> None:
        super().__init__(at, clock, sink)
        self.setup_s = {Setup.CREATE: costs.session_create_s, Setup.THAW: costs.session_thaw_s,
                        Setup.RESTORE: costs.session_restore_s}

    def start(self, action: Action, allocation: Allocation) -> None:
        setup = self.setup_s.get(allocation.setup, 0.0)
        exec_s = action.payload.work_s * action.speed_factor(len(allocation.units))
        self._finish_at(action, setup, exec_s)


class SimModelManager(_SimManager):
    """A copy's load takes its weights per GPU over the node's host-to-GPU bandwidth."""

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink, cluster: Cluster) -> None:
        super().__init__(at, clock, sink)
        self.cluster = cluster
        self.gpus = GpuPool(cluster.gpu_nodes)  # for the bandwidth of each GPU only

    def start(self, action: Action, allocation: Allocation) -> None:
        setup = 0.0
        if allocation.setup is Setup.LOAD:
            block = allocation.units
            per_gpu = self.cluster.per_gpu_gb(action.model or "", action.weights_gb, len(block))
            setup = self.gpus.load_s(block, per_gpu)
        self._finish_at(action, setup, action.payload.work_s)

    def prefetch(self, load: Load) -> None:
        self.at(self.clock.now() + self.gpus.load_s(load.block, load.per_gpu_gb), lambda: self.sink(Loaded(load.key)))

    def evict(self, model: str, gpus: tuple[int, ...]) -> None:
        pass  # dropping a copy costs nothing; its next load is charged when it happens


class SimApiManager(_SimManager):
    """The external APIs themselves, each enforcing its own quota (``QuotaPool`` as its limiter).

    A call that finds no token or no free slot is answered 429 after ``reject_s``; the client
    backs off ``base * 2**n`` seconds (capped, with jitter) and tries again. Calls admitted by our
    scheduler against the same quota never see a 429.
    """

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink, quotas: tuple[ApiQuota, ...], seed: int = 0,
                 reject_s: float = 0.05, backoff_base_s: float = 0.25, backoff_cap_s: float = 8.0) -> None:
        super().__init__(at, clock, sink)
        self.limits = {f"api:{q.name}": QuotaPool(q) for q in quotas}
        self.rng = random.Random(seed)
        self.reject_s = reject_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.rejections = 0

    def start(self, action: Action, allocation: Allocation) -> None:
        self._live.add(action.id)
        self._attempt(action, self.clock.now(), 0)

    def _attempt(self, action: Action, first_at: float, tries: int) -> None:
        if action.id not in self._live:
            return  # cancelled while backing off
        now = self.clock.now()
        limit = self.limits[action.pool]
        if limit.available(now):
            limit.admit(now)
            exec_s = action.payload.work_s
            out = Outcome.OK
            e = exec_s
            if action.timeout_s is not None and exec_s > action.timeout_s:
                e, out = action.timeout_s, Outcome.TIMEOUT

            def done() -> None:
                limit.release()
                if action.id in self._live:
                    self._live.discard(action.id)
                    self.sink(Completion(action.id, out, now - first_at, e))

            self.at(now + min(exec_s, action.timeout_s or exec_s), done)
            return
        self.rejections += 1
        backoff = min(self.backoff_cap_s, self.backoff_base_s * 2 ** tries) * self.rng.uniform(0.5, 1.5)
        self.at(now + self.reject_s + backoff, lambda: self._attempt(action, first_at, tries + 1))
