"""How many actions per second the policy + engine can push through at a given queue depth.

The pool (``nodes`` x 64 cores) is kept full and the queue at a fixed depth; each iteration a
running action completes, a new one is submitted and a scheduling round starts the best waiting
one — submit, prioritise, place (with session stickiness), start and complete: the whole cost an
action adds to the engine. Managers record starts and do nothing else.

Both wall-clock and CPU-time rates are reported: on a shared machine the wall-clock rate measures
the neighbours as much as the scheduler, while this process's CPU time does not count the time it
waited for a core (it still pays for the caches they share). ``breakdown`` times the parts of one
iteration (the bench's own records, complete, submit, schedule) so a change can be placed.

``floor`` runs the same iteration with the engine and policy reduced to their records and their
dict and heap operations (no validation, prediction, critical path, ledger or managers), as plain
Python: what is left for all the decision logic at 100,000 actions a second, and why the hot path
is compiled (``setup.py``). ``run`` says which build it measured (``compiled``) and, when
compiled, measures the sources too in a child process (``ARL_TANGRAM_PURE=1``) for the ratio.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from collections import deque
from typing import Callable

from .. import build
from ..core.action import CPU, Action, Allocation, Demand, Finished, Outcome, Setup
from ..core.clock import ManualClock
from ..core.cluster import uniform_cluster
from ..core.records import Running
from ..core.seam import Completion, Pool
from ..engine import Engine
from ..policy import Costs, tangram_policy
from ..policy.base import Start

DEPTHS = (1_000, 10_000, 100_000)
COALESCED = (4, 16)  # events per scheduling round, were a runtime to coalesce them


class _Recorder:
    def __init__(self) -> None:
        self.started: deque[str] = deque()

    def start(self, action: Action, allocation: Allocation) -> None:
        self.started.append(action.id)

    def cancel(self, action_id: str) -> None:
        pass

    def close_session(self, trajectory: str) -> None:
        pass

    async def start_up(self) -> None:
        pass

    async def shut_down(self) -> None:
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
        # moves priced 0: a step whose node is full moves to the freed core at once, as every
        # round of this loop needs (one completion, one start); priced, a step waits for its
        # node when that is predicted quicker, and the queue drifts
        self.engine = Engine(cluster, tangram_policy(), {Pool.CPU: self.rec}, self.clock,
                             costs=Costs(session_restore_s=0.0))
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
            memory_gb_per_core: float = 4.0, batch: int = 1) -> Rate:
    """Rounds of complete + submit + schedule with the pool full and ``depth`` waiting; every
    action belongs to one of ``sessions`` sessions (default: as many as the nodes' memory holds
    comfortably, 32 a node), sticky to its node. ``batch``: completions and submissions per
    scheduling round (1: a round per event, as the runtimes do; more: what coalescing the events
    of one loop iteration would gain, which ``Runtime.tick`` says why it does not do)."""
    b = _Setup(depth, nodes, sessions, memory_gb_per_core)
    engine = b.engine
    # the loop's own names bound once (it is the harness, not what is measured)
    complete, submit, schedule, build = engine.complete, engine.submit, engine.schedule, b.action
    ended, advance, ok = b.rec.started.popleft, b.clock.advance_to, Outcome.OK
    done = 0
    t = 0.0
    start = time.perf_counter()
    cpu_start = time.process_time()
    deadline = start + seconds
    rounds = max(1, 256 // batch)
    while True:
        for _ in range(rounds):
            t += 1e-4
            advance(t)
            for _ in range(batch):
                complete(Completion(ended(), ok, exec_s=1.0))
                submit(build())
            schedule()
        done += rounds * batch
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


def floor(depth: int = 10_000, nodes: int = 1000, iterations: int = 100_000) -> float:
    """Microseconds per iteration of ``measure``'s loop with the engine and policy reduced to the
    records they build and their dict and heap operations on structures of the same sizes
    (pending, running, session homes, the queue's heap and deadline FIFO): no validation,
    prediction, critical path, ledger, placement or managers. A lower bound for this data layout
    in CPython, to say how much of an action's cost is decision logic."""
    sessions = nodes * 32
    n = 0

    def action() -> Action:
        nonlocal n
        i = n
        n += 1
        return Action(f"a{i}", "sandbox", Demand({"cpu": (1, 4) if i % 10 == 0 else (1, 1)}),
                      trajectory=f"s{i % sessions}", operation=_OPS[i % 3], parallel_fraction=0.5)

    pending: dict[str, Action] = {}
    running: dict[str, Running] = {}
    homes: dict[str, int] = {}
    heap: list[tuple[float, int, Action]] = []
    fifo: deque[Action] = deque()
    started: deque[str] = deque()
    seq = itertools.count()

    def start(a: Action, now: float) -> None:
        del pending[a.id]
        node = homes.setdefault(a.trajectory or "", len(homes) % nodes)
        running[a.id] = Running(a, Allocation(CPU, node, (0,), Setup.THAW), now)
        started.append(a.id)

    for _ in range(nodes * 64):
        a = action()
        pending[a.id] = a
        start(a, 0.0)
    for _ in range(depth):
        a = action()
        pending[a.id] = a
        fifo.append(a)
        heapq.heappush(heap, (1.0, next(seq), a))
    t = 0.0
    cpu_start = time.process_time()
    for _ in range(iterations):
        t += 1e-4
        c = Completion(started.popleft(), Outcome.OK, exec_s=1.0)
        run = running.pop(c.action_id)
        Finished(run.action, c.outcome, run.action.submitted_at, run.started_at, t, c.setup_s, c.exec_s, 1)
        a = action()
        if a.id in pending or a.id in running:
            raise RuntimeError("ids repeat")
        pending[a.id] = a
        fifo.append(a)
        _ = a.trajectory in homes
        heapq.heappush(heap, (1.0 + 0.1 * t, next(seq), a))
        while fifo and pending.get(fifo[0].id) is not fifo[0]:
            fifo.popleft()
        b = heapq.heappop(heap)[2]
        homes.get(b.trajectory or "")
        start(Start(b, 0, 1).action, t)
    return round((time.process_time() - cpu_start) / iterations * 1e6, 2)


def pure_rates(depth: int, nodes: int, seconds: float, repeats: int) -> list[float]:
    """``measure``'s CPU rates with the sources imported instead of the compiled modules (a child
    process with ``ARL_TANGRAM_PURE=1``: ``arl_tangram.build``)."""
    code = ("import json, sys; from arl_tangram.bench.scheduler import measure; from arl_tangram import build; "
            f"r = [measure({depth}, {nodes}, {seconds}).cpu_per_s for _ in range({repeats})]; "
            "print(json.dumps({'cpu_per_s': r, 'compiled': build.compiled()}))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ARL_TANGRAM_PURE": "1"},
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if got["compiled"]:
        raise RuntimeError("ARL_TANGRAM_PURE=1 still imported the compiled modules")
    return [float(x) for x in got["cpu_per_s"]]


def run(nodes: int = 1000, seconds: float = 2.0, log: Callable[[str], None] | None = None,
        repeats: int = 3) -> dict:
    """Every figure of the module docstring. The rates per queue depth are the median of
    ``repeats`` runs of ``seconds`` each (all of them under ``*_runs``): a shared machine moves a
    single run by +-5%."""
    stale = build.stale()
    if stale:
        raise RuntimeError(f"compiled modules stale or left over would be measured instead of {', '.join(stale)}: "
                           "run `pip install -e .` again, or measure the sources with ARL_TANGRAM_PURE=1")
    compiled = build.compiled()
    if log:
        log("hot path: " + ("compiled (mypyc)" if compiled else "pure Python"))
    rates, cpu_rates, cpu_runs = {}, {}, {}
    for depth in DEPTHS:
        runs = [measure(depth, nodes, seconds) for _ in range(repeats)]
        key = str(depth)
        rates[key] = round(statistics.median(r.wall_per_s for r in runs))
        cpu_rates[key] = round(statistics.median(r.cpu_per_s for r in runs))
        cpu_runs[key] = [round(r.cpu_per_s) for r in runs]
        if log:
            log(f"queue depth {depth:>7,}: {rates[key]:>9,} actions/s ({cpu_rates[key]:,} per CPU second; "
                f"median of {', '.join(f'{x:,}' for x in cpu_runs[key])})")
    coalesced = {}
    for batch in COALESCED:
        rate = measure(10_000, nodes, seconds, batch=batch)
        coalesced[str(batch)] = round(rate.cpu_per_s)
        if log:
            log(f"queue depth  10,000, {batch:>2} events a round: {coalesced[str(batch)]:>9,} actions per CPU second")
    parts = breakdown(10_000, nodes, iterations=max(1_000, int(seconds * 20_000)))
    bound = floor(10_000, nodes, iterations=max(1_000, int(seconds * 40_000)))
    if log:
        log("µs per action at 10,000 queued: " + ", ".join(f"{k} {v}" for k, v in parts.items()))
        log(f"the same loop reduced to its records, dicts and heap: {bound} µs per action (CPU)")
    versus = {}
    if compiled:  # the same figure from the sources, measured right after, for a ratio of one run
        pure_runs = pure_rates(10_000, nodes, seconds, repeats)
        pure = statistics.median(pure_runs)
        versus = {"pure_actions_per_cpu_s_at_10000": round(pure),
                  "pure_actions_per_cpu_s_at_10000_runs": [round(x) for x in pure_runs],
                  "compiled_over_pure_at_10000": round(cpu_rates["10000"] / pure, 2)}
        if log:
            log(f"queue depth  10,000, sources (ARL_TANGRAM_PURE=1): {round(pure):>9,} actions per CPU second "
                f"({versus['compiled_over_pure_at_10000']}x compiled)")
    return {"compiled": compiled, **versus, "actions_per_s": rates, "actions_per_cpu_s": cpu_rates,
            "actions_per_cpu_s_runs": cpu_runs, "repeats": repeats,
            "coalesced_actions_per_cpu_s_at_10000": coalesced, "us_per_action_at_10000": parts,
            "floor_us_per_action_at_10000": bound,
            "nodes": nodes, "cores": nodes * 64, "policy": "tangram", "seconds_per_depth": seconds,
            "python": platform.python_version()}
