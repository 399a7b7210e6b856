"""Simulated managers: they turn an allocation into a completion time instead of a process.

They model the costs that make placement matter: a session's create / thaw / restore, a model's
host-to-GPU load (weights per GPU / bandwidth, on every GPU of the block in parallel), and an
external API that enforces its own quota, rejecting over-limit calls that clients then retry with
exponential backoff. Each reports to the sink it was built with, as the real managers do.
"""

from __future__ import annotations

import random
from typing import Callable

from ..core.action import CPU, Action, Allocation, Outcome, Setup
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
    sink unless the action was cancelled first (then ``cancelled`` is reported at once) or its
    completion was moved (a resized run: only the latest one counts)."""

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink) -> None:
        self.at = at
        self.clock = clock
        self.sink = sink
        self._live: dict[str, int] = {}  # running action -> the number of its completion that counts
        self._moves = 0

    def _finish_at(self, action: Action, setup: float, exec_s: float) -> None:
        outcome = Outcome.OK
        if action.timeout_s is not None and exec_s > action.timeout_s:
            exec_s, outcome = action.timeout_s, Outcome.TIMEOUT
        self._report_at(self.clock.now() + setup + exec_s, Completion(action.id, outcome, setup, exec_s))

    def _report_at(self, t: float, c: Completion) -> None:
        self._moves += 1
        token = self._live[c.action_id] = self._moves

        def due() -> None:
            if self._live.get(c.action_id) == token:
                del self._live[c.action_id]
                self._ended(c.action_id)
                self.sink(c)

        self.at(t, due)

    def cancel(self, action_id: str) -> None:
        if self._live.pop(action_id, None) is not None:
            self._ended(action_id)
            self.sink(Completion(action_id, Outcome.CANCELLED, message="cancelled while running"))

    def _ended(self, action_id: str) -> None:
        """The action reported (or was cancelled): forget what a subclass kept of it."""

    def close_session(self, trajectory: str) -> None:
        pass

    async def start_up(self) -> None:  # the seam's lifecycle: nothing to start or stop in a simulation
        pass

    async def shut_down(self) -> None:
        pass


class SimSandboxManager(_SimManager):
    """Sessions cost ``Costs`` to create, thaw or restore; work shrinks with cores (Amdahl). A
    run given fewer cores while it runs (``resize``) does the rest of its work at the new speed."""

    def __init__(self, at: Scheduler, clock: Clock, sink: Sink, costs: Costs = Costs()) -> None:
        super().__init__(at, clock, sink)
        self.setup_s = {Setup.CREATE: costs.session_create_s, Setup.THAW: costs.session_thaw_s,
                        Setup.RESTORE: costs.session_restore_s}
        # running action -> (action, setup_s, when its execution starts, when its speed last
        # changed, fraction of its work done by then, its speed factor since): grown runs only
        self._runs: dict[str, tuple[Action, float, float, float, float, float]] = {}

    def start(self, action: Action, allocation: Allocation) -> None:
        setup = self.setup_s.get(allocation.setup, 0.0)
        speed = action.speed_factor(len(allocation.units))
        self._finish_at(action, setup, action.payload.work_s * speed)
        if len(allocation.units) > action.demand.min(CPU):  # only a grown run can be resized
            t = self.clock.now() + setup
            self._runs[action.id] = (action, setup, t, t, 0.0, speed)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        run = self._runs.get(action_id)
        if run is None:
            return
        action, setup, began, last, done, speed = run
        now = self.clock.now()
        work = action.payload.work_s
        if now > last and work > 0:
            done = min(1.0, done + (now - last) / (work * speed))
        last = max(now, began)
        speed = action.speed_factor(len(allocation.units))
        self._runs[action_id] = (action, setup, began, last, done, speed)
        exec_s = last + (1.0 - done) * work * speed - began
        outcome = Outcome.OK
        if action.timeout_s is not None and exec_s > action.timeout_s:
            exec_s, outcome = action.timeout_s, Outcome.TIMEOUT
        self._report_at(began + exec_s, Completion(action_id, outcome, setup, exec_s))

    def _ended(self, action_id: str) -> None:
        self._runs.pop(action_id, None)


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
        self._live[action.id] = 0
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
                if self._live.pop(action.id, None) is not None:
                    self.sink(Completion(action.id, out, now - first_at, e))

            self.at(now + min(exec_s, action.timeout_s or exec_s), done)
            return
        self.rejections += 1
        backoff = min(self.backoff_cap_s, self.backoff_base_s * 2 ** tries) * self.rng.uniform(0.5, 1.5)
        self.at(now + self.reject_s + backoff, lambda: self._attempt(action, first_at, tries + 1))
