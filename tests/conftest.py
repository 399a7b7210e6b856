"""Shared test harness: the real engine and policies on a manual clock, with managers that only
record what they were asked to start (test doubles at the manager seam)."""

from __future__ import annotations

import os

import pytest

# before anything imports Ray (verl does): keep every address of test clusters on 127.0.0.1
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from arl_tangram.core import Action, Allocation, Demand, ManualClock, Outcome
from arl_tangram.core.records import Load
from arl_tangram.core.seam import Completion, Pool
from arl_tangram.engine import Engine


class Recorder:
    def __init__(self) -> None:
        self.started: list[tuple[Action, Allocation]] = []
        self.closed: list[str] = []
        self.loading: list[str] = []
        self.cancelled: list[str] = []
        self.evicted: list[tuple[str, tuple]] = []
        self.resized: list[tuple[str, tuple[int, ...]]] = []
        self.log: list[tuple[str, str]] = []  # ("start" | "resize", action id), in the order asked

    def start(self, action: Action, allocation: Allocation) -> None:
        self.started.append((action, allocation))
        self.log.append(("start", action.id))

    def resize(self, action_id: str, allocation: Allocation) -> None:
        self.resized.append((action_id, allocation.units))
        self.log.append(("resize", action_id))

    def close_session(self, trajectory: str) -> None:
        self.closed.append(trajectory)

    def cancel(self, action_id: str) -> None:
        self.cancelled.append(action_id)

    def prefetch(self, load: Load) -> None:
        self.loading.append(load.key)

    def evict(self, model: str, gpus) -> None:
        self.evicted.append((model, tuple(gpus)))

    async def start_up(self) -> None:
        pass

    async def shut_down(self) -> None:
        pass


class Chaining:
    """A CPU manager double that chains (``core.seam.Chainer``) over a ``Recorder``: it records
    what it was asked to follow, takes it while ``take`` says so, and says it could chain the
    runs ``can`` accepts."""

    def __init__(self, rec: Recorder, take: bool = True, can=lambda action: True) -> None:
        self.rec = rec
        self.take = take
        self.can = can
        self.followed: list[tuple[str, tuple[int, ...], str]] = []

    def start(self, action: Action, allocation: Allocation) -> None:
        self.rec.start(action, allocation)

    def cancel(self, action_id: str) -> None:
        self.rec.cancel(action_id)

    def close_session(self, trajectory: str) -> None:
        self.rec.close_session(trajectory)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        self.rec.resize(action_id, allocation)

    def chains(self, action: Action) -> bool:
        return self.can(action)

    def follow(self, action: Action, allocation: Allocation, after: str) -> bool:
        self.followed.append((action.id, allocation.units, after))
        return self.take


class Harness:
    def __init__(self, cluster, policy, **engine_kwargs) -> None:
        self.clock = ManualClock()
        self.rec = Recorder()
        self.engine = Engine(cluster, policy, {pool: self.rec for pool in Pool}, self.clock,
                             **engine_kwargs)
        self.finished = []
        self.engine.listeners.append(self.finished.append)
        self._seen = 0

    def submit(self, id: str, service: str = "sandbox", cpu=None, gpu=None, **kw) -> Action:
        ranges = {}
        if cpu is not None:
            ranges["cpu"] = (cpu, cpu) if isinstance(cpu, int) else cpu
        if gpu is not None:
            ranges["gpu"] = (gpu, gpu) if isinstance(gpu, int) else gpu
        a = Action(id, service, Demand(ranges), **kw)
        self.engine.submit(a)
        return a

    def schedule(self) -> dict[str, Allocation]:
        """Run a round; the allocations of the actions it started, by id."""
        self.engine.schedule()
        new = self.rec.started[self._seen:]
        self._seen = len(self.rec.started)
        return {a.id: alloc for a, alloc in new}

    def complete(self, id: str, exec_s: float = 1.0, outcome: Outcome = Outcome.OK):
        return self.engine.complete(Completion(id, outcome, exec_s=exec_s))

    def finish_loads(self) -> None:
        """Complete every prefetch the engine asked for."""
        while self.rec.loading:
            self.engine.loaded(self.rec.loading.pop())

    def advance(self, dt: float) -> None:
        self.clock.advance_to(self.clock.now() + dt)

    def allocation(self, id: str) -> Allocation:
        return self.engine.running[id].allocation


@pytest.fixture
def harness():
    return Harness
