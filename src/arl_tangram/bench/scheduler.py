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


def measure(depth: int, nodes: int = 1000, seconds: float = 2.0, sessions: int | None = None,
            memory_gb_per_core: float = 4.0) -> Rate:
    """Rounds of complete + submit + schedule with the pool full and ``depth`` waiting; every
    action belongs to one of ``sessions`` sessions (default: as many as the nodes' memory holds
    comfortably, 32 a node), sticky to its node."""
    sessions = sessions or nodes * 32
    clock = ManualClock()
    cluster = uniform_cluster(cpus=nodes * 64, cpu_nodes=nodes, memory_gb_per_core=memory_gb_per_core)
    rec = _Recorder()
    engine = Engine(cluster, tangram_policy(), {Pool.CPU: rec}, clock)
    ops = ("shell", "script", "test")
    n = 0

    def submit() -> None:
        nonlocal n
        i = n
        n += 1
        engine.submit(Action(f"a{i}", "sandbox", Demand({"cpu": (1, 4) if i % 10 == 0 else (1, 1)}),
                             trajectory=f"s{i % sessions}", operation=ops[i % 3], parallel_fraction=0.5))

    for _ in range(cluster.total_cores):
        submit()
    engine.schedule()
    for _ in range(depth):
        submit()
    engine.schedule()
    assert len(engine.pending) == depth, "the pool should be full and the queue at depth"
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


def run(nodes: int = 1000, seconds: float = 2.0, log: Callable[[str], None] | None = None) -> dict:
    rates, cpu_rates = {}, {}
    for depth in DEPTHS:
        rate = measure(depth, nodes, seconds)
        rates[str(depth)], cpu_rates[str(depth)] = round(rate.wall_per_s), round(rate.cpu_per_s)
        if log:
            log(f"queue depth {depth:>7,}: {rates[str(depth)]:>9,} actions/s ({cpu_rates[str(depth)]:,} per CPU second)")
    return {"actions_per_s": rates, "actions_per_cpu_s": cpu_rates, "nodes": nodes, "cores": nodes * 64,
            "policy": "tangram", "seconds_per_depth": seconds}
