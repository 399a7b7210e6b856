"""How many actions per second the policy + engine can push through at a given queue depth.

The pool (``nodes`` x 64 cores) is kept full and the queue at a fixed depth; each iteration a
running action completes, a new one is submitted and a scheduling round starts the best waiting
one — submit, prioritise, place (with session stickiness), start and complete: the whole cost an
action adds to the engine. Managers record starts and do nothing else.

Both wall-clock and CPU-time rates are reported: on a shared machine the wall-clock rate measures
the neighbours as much as the scheduler, while this process's CPU time does not count the time it
waited for a core (it still pays for the caches they share).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from collections import deque
from typing import Callable

from ..core.action import Action, Allocation, Demand, Outcome
from ..core.clock import ManualClock
from ..core.cluster import uniform_cluster
from ..core.seam import Completion, Pool
from ..engine import Engine
from ..policy import tangram_policy

DEPTHS = (1_000, 10_000, 100_000)


class _Recorder:
    def __init__(self) -> None:
        self.started: deque[str] = deque()

    def start(self, action: Action, allocation: Allocation) -> None:
        self.started.append(action.id)

    def cancel(self, action_id: str) -> None:
        pass

    def close_session(self, trajectory: str) -> None:
        pass


@dataclass(frozen=True)
class Rate:
    wall_per_s: float  # actions per wall-clock second
    cpu_per_s: float  # actions per CPU second of this process
    open_sessions: int
    queued: int


class _Setup:
    """An engine with the pool full and ``depth`` actions waiting, and the bench's submitter."""

    def __init__(self, depth: int, nodes: int, sessions: int | None, memory_gb_per_core: float) -> None:
        self.sessions = sessions or nodes * 32
        self.clock = ManualClock()
        cluster = uniform_cluster(cpus=nodes * 64, cpu_nodes=nodes, memory_gb_per_core=memory_gb_per_core)
        self.rec = _Recorder()
        self.engine = Engine(cluster, tangram_policy(), {Pool.CPU: self.rec}, self.clock)
        self.n = 0
        for _ in range(cluster.total_cores):
            self.engine.submit(self.action())
        self.engine.schedule()
        for _ in range(depth):
            self.engine.submit(self.action())
        self.engine.schedule()
        assert len(self.engine.pending) == depth, "the pool should be full and the queue at depth"

    def action(self) -> Action:
        """A new action as a server builds one per request (validation included)."""
        i = self.n
        self.n += 1
        return Action(f"a{i}", "sandbox", Demand({"cpu": (1, 4) if i % 10 == 0 else (1, 1)}),
                      trajectory=f"s{i % self.sessions}", operation=_OPS[i % 3], parallel_fraction=0.5)


_OPS = ("shell", "script", "test")


def measure(depth: int, nodes: int = 1000, seconds: float = 2.0, sessions: int | None = None,
            memory_gb_per_core: float = 4.0) -> Rate:
    """Rounds of complete + submit + schedule with the pool full and ``depth`` waiting; every
    action belongs to one of ``sessions`` sessions (default: as many as the nodes' memory holds
    comfortably, 32 a node), sticky to its node."""
    b = _Setup(depth, nodes, sessions, memory_gb_per_core)
    engine, clock, rec = b.engine, b.clock, b.rec

    def submit() -> None:
        engine.submit(b.action())

    done = 0
    t = 0.0
    start = time.perf_counter()
    cpu_start = time.process_time()
    deadline = start + seconds
    while True:
        for _ in range(256):
            t += 1e-4
            clock.advance_to(t)
            engine.complete(Completion(rec.started.popleft(), Outcome.OK, exec_s=1.0))
            submit()
            engine.schedule()
        done += 256
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    if len(engine.pending) != depth:
        raise RuntimeError(f"queue depth drifted to {len(engine.pending)} (expected {depth})")
    return Rate(done / elapsed, done / cpu, len(engine.cpu.homes), len(engine.pending))


def breakdown(depth: int = 10_000, nodes: int = 1000, iterations: int = 50_000) -> dict[str, float]:
    """Microseconds per action of each part of ``measure``'s iteration, timed one by one with
    ``time.perf_counter`` (wall clock: ~0.1 µs a reading is included in each part, and a busy
    machine shows). ``build`` is the bench's own cost (the action a server would build) and
    ``report`` the manager's ``Completion``; the engine and policy are ``complete``, ``submit``
    and ``schedule``."""
    b = _Setup(depth, nodes, None, 4.0)
    engine, clock, started = b.engine, b.clock, b.rec.started
    pc = time.perf_counter
    parts = dict.fromkeys(("report", "complete", "build", "submit", "schedule"), 0.0)
    t = 0.0
    for _ in range(iterations):
        t += 1e-4
        clock.advance_to(t)
        t0 = pc()
        c = Completion(started.popleft(), Outcome.OK, exec_s=1.0)
        t1 = pc()
        engine.complete(c)
        t2 = pc()
        a = b.action()
        t3 = pc()
        engine.submit(a)
        t4 = pc()
        engine.schedule()
        t5 = pc()
        parts["report"] += t1 - t0
        parts["complete"] += t2 - t1
        parts["build"] += t3 - t2
        parts["submit"] += t4 - t3
        parts["schedule"] += t5 - t4
    us = {k: round(v / iterations * 1e6, 2) for k, v in parts.items()}
    us["total"] = round(sum(us.values()), 2)
    return us


def run(nodes: int = 1000, seconds: float = 2.0, log: Callable[[str], None] | None = None) -> dict:
    rates, cpu_rates = {}, {}
    for depth in DEPTHS:
        rate = measure(depth, nodes, seconds)
        rates[str(depth)], cpu_rates[str(depth)] = round(rate.wall_per_s), round(rate.cpu_per_s)
        if log:
            log(f"queue depth {depth:>7,}: {rates[str(depth)]:>9,} actions/s ({cpu_rates[str(depth)]:,} per CPU second)")
    parts = breakdown(10_000, nodes, iterations=max(1_000, int(seconds * 20_000)))
    if log:
        log("µs per action at 10,000 queued: " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    return {"actions_per_s": rates, "actions_per_cpu_s": cpu_rates, "us_per_action_at_10000": parts,
            "nodes": nodes, "cores": nodes * 64, "policy": "tangram", "seconds_per_depth": seconds,
            "python": platform.python_version()}
