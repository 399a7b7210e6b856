"""Simulated managers: they turn an allocation into a completion time instead of a process.

They model the costs that make placement matter: a session's create / thaw / restore, a model's
host-to-GPU load (weights per GPU / bandwidth, on every GPU of the block in parallel), and an
external API that enforces its own quota, rejecting over-limit calls that clients then retry with
exponential backoff.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..core.action import Action, Allocation, Outcome
from ..core.cluster import ApiQuota
from ..core.pools import QuotaPool

#: ``at(t, fn)`` runs ``fn()`` at virtual time ``t``
Scheduler = Callable[[float, Callable[[], None]], None]


@dataclass(frozen=True, slots=True)
class SandboxCosts:
    """Seconds of state work before a sandbox action runs.

    create: a fresh session from the warm pool (workspace + namespace set-up, ~1 s for a
    container-style sandbox); thaw: unfreezing a session's processes (cgroup freezer, ms);
    restore: moving a session's workspace snapshot to another node (~2 s for a few hundred MB).
    """

    create_s: float = 1.0
    thaw_s: float = 0.005
    restore_s: float = 2.0


class SimSandboxManager:
    def __init__(self, engine, at: Scheduler, costs: SandboxCosts = SandboxCosts()) -> None:
        self.engine = engine
        self.at = at
        self.costs = costs

    def start(self, action: Action, allocation: Allocation) -> None:
        spec = action.payload
        setup = {"create": self.costs.create_s, "thaw": self.costs.thaw_s,
                 "restore": self.costs.restore_s}.get(allocation.setup, 0.0)
        exec_s = spec.work_s * action.speed_factor(len(allocation.units))
        _finish_at(self, action, setup, exec_s)

    def close_session(self, trajectory: str) -> None:
        pass


class SimModelManager:
    def __init__(self, engine, at: Scheduler) -> None:
        self.engine = engine
        self.at = at

    def start(self, action: Action, allocation: Allocation) -> None:
        setup = 0.0
        if allocation.setup == "load":
            inst = self.engine.running[action.id].instance
            setup = self.engine.gpu.load_s(allocation.units, inst.per_gpu_gb)
        _finish_at(self, action, setup, action.payload.work_s)

    def prefetch(self, key: str, model: str, gpus: tuple[int, ...], per_gpu_gb: float) -> None:
        engine = self.engine
        self.at(engine.clock.now() + engine.gpu.load_s(gpus, per_gpu_gb), lambda: engine.loaded(key))

    def close_session(self, trajectory: str) -> None:
        pass


def _finish_at(mgr, action: Action, setup: float, exec_s: float) -> None:
    outcome = Outcome.OK
    if action.timeout_s is not None and exec_s > action.timeout_s:
        exec_s, outcome = action.timeout_s, Outcome.TIMEOUT
    engine = mgr.engine
    mgr.at(engine.clock.now() + setup + exec_s,
           lambda: engine.complete(action.id, outcome, setup_s=setup, exec_s=exec_s))


class SimApiManager:
    """The external APIs themselves, each enforcing its own quota (``QuotaPool`` as its limiter).

    A call that finds no token or no free slot is answered 429 after ``reject_s``; the client
    backs off ``base * 2**n`` seconds (capped, with jitter) and tries again. Calls admitted by our
    scheduler against the same quota never see a 429.
    """

    def __init__(self, engine, at: Scheduler, quotas: tuple[ApiQuota, ...], seed: int = 0,
                 reject_s: float = 0.05, backoff_base_s: float = 0.25, backoff_cap_s: float = 8.0) -> None:
        self.engine = engine
        self.at = at
        self.limits = {f"api:{q.name}": QuotaPool(q) for q in quotas}
        self.rng = random.Random(seed)
        self.reject_s = reject_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.rejections = 0

    def start(self, action: Action, allocation: Allocation) -> None:
        self._attempt(action, self.engine.clock.now(), 0)

    def _attempt(self, action: Action, first_at: float, tries: int) -> None:
        now = self.engine.clock.now()
        limit = self.limits[action.pool]
        if limit.available(now):
            limit.take(now)
            exec_s = action.payload.work_s
            engine = self.engine

            def done() -> None:
                limit.give()
                out = Outcome.OK
                e = exec_s
                if action.timeout_s is not None and exec_s > action.timeout_s:
                    e, out = action.timeout_s, Outcome.TIMEOUT
                engine.complete(action.id, out, setup_s=now - first_at, exec_s=e)

            self.at(now + min(exec_s, action.timeout_s or exec_s), done)
            return
        self.rejections += 1
        backoff = min(self.backoff_cap_s, self.backoff_base_s * 2 ** tries) * self.rng.uniform(0.5, 1.5)
        self.at(now + self.reject_s + backoff, lambda: self._attempt(action, first_at, tries + 1))

    def close_session(self, trajectory: str) -> None:
        pass
