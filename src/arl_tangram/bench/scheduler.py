"""How many actions per second the policy + engine can push through at a given queue depth.

The pool (``nodes`` x 64 cores) is kept full and the queue at a fixed depth; each iteration a
running action completes, a new one is submitted and a scheduling round starts the best waiting
one — submit, prioritise, place (with session stickiness), start and complete: the whole cost an
action adds to the engine. Managers record starts and do nothing else.
"""

from __future__ import annotations

import time
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


def measure(depth: int, nodes: int = 1000, seconds: float = 2.0) -> float:
    sessions = nodes * 32  # sandbox sessions whose memory the nodes hold comfortably
    clock = ManualClock()
    cluster = uniform_cluster(cpus=nodes * 64, cpu_nodes=nodes)
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
    if len(engine.pending) != depth:
        raise RuntimeError(f"queue depth drifted to {len(engine.pending)} (expected {depth})")
    return done / elapsed


def run(nodes: int = 1000, seconds: float = 2.0, log: Callable[[str], None] | None = None) -> dict:
    rates = {}
    for depth in DEPTHS:
        rates[str(depth)] = round(measure(depth, nodes, seconds))
        if log:
            log(f"queue depth {depth:>7,}: {rates[str(depth)]:>9,} actions/s")
    return {"actions_per_s": rates, "nodes": nodes, "cores": nodes * 64, "policy": "tangram",
            "seconds_per_depth": seconds}
