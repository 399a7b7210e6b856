"""A miniature code-agent workload on this machine, with real sandboxes, under two policies.

Trajectories alternate an LLM gap (a sleep) with real sandbox actions in their own session: short
commands (listing, grepping, running a small script) and CPU-bound test runs that split their
work over ``$TANGRAM_NUM_CPUS`` processes (elastic, parallel fraction ~0.9). The same seeded
workload runs under Tangram and under trajectory-static (each trajectory holds a sandbox of
cores / trajectories cores, at least one, for its whole life) on the same cores.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from typing import Callable

from ..core.action import Outcome
from ..managers.sandbox.spec import SandboxConfig
from ..policy import Profile
from ..runtime import Tangram
from ..sim.metrics import percentile

SHORT = [
    "ls -la /workspace > /dev/null && echo ok",
    "printf 'def f(x):\\n    return x * 2\\n' > mod.py && grep -c def mod.py",
    "python3 -c 'print(sum(range(100000)))'",
    "cat /etc/hostname 2>/dev/null; echo $((6 * 7))",
]

# CPU-bound "test suite": ``units`` equal chunks shared by $TANGRAM_NUM_CPUS worker processes
TEST = """
import os, sys
n = int(os.environ.get("TANGRAM_NUM_CPUS", "1"))
units = {units}
def work(k):
    s = 0
    for i in range(k * 400000):
        s += i * i
    return s
ks = [units // n + (1 if i < units % n else 0) for i in range(n)]
pids = []
for k in ks[1:]:
    pid = os.fork()
    if pid == 0:
        work(k)
        os._exit(0)
    pids.append(pid)
work(ks[0])
for p in pids:
    os.waitpid(p, 0)
print("passed", units)
"""


@dataclass
class Turn:
    gap_s: float
    command: str
    test: bool


def workload(trajectories: int, turns: int, seed: int) -> list[list[Turn]]:
    rng = random.Random(seed)
    out = []
    for _ in range(trajectories):
        steps = []
        for _ in range(turns):
            gap = rng.uniform(0.2, 1.0)
            if rng.random() < 0.25:
                steps.append(Turn(gap, f"python3 -c '{TEST.format(units=rng.randint(10, 30))}'", True))
            else:
                steps.append(Turn(gap, rng.choice(SHORT), False))
        out.append(steps)
    return out


async def _run_policy(policy: str, plan: list[list[Turn]], cores: int) -> dict:
    records, tests = [], []
    profile = Profile(trajectories=len(plan))
    async with Tangram.local(policy, sandbox=SandboxConfig(warm_pool=2), profile=profile) as tg:
        await asyncio.sleep(0.3)  # let the pool fill, for both policies alike
        engine = tg.runtime.engine
        start = time.monotonic()
        held0 = engine.usage.cpu_held_s

        async def trajectory(i: int, turns: list[Turn]) -> float:
            s = await tg.session(job="e2e", trajectory=f"{policy}-t{i}")
            for turn in turns:
                await asyncio.sleep(turn.gap_s)
                if turn.test:
                    r = await s.exec(turn.command, cpus=(1, cores), parallel_fraction=0.9, operation="test",
                                     timeout_s=120)
                else:
                    r = await s.exec(turn.command, operation="shell", timeout_s=30)
                if r.outcome is not Outcome.OK:
                    raise RuntimeError(f"{policy}: action failed ({r.outcome.value}): {r.message} {r.stderr[-200:]}")
                records.append(r)
                if turn.test:
                    tests.append(r)
            await s.close()
            return time.monotonic()

        ends = await asyncio.gather(*(trajectory(i, t) for i, t in enumerate(plan)))
        step_s = max(ends) - start
        engine.usage.advance(time.monotonic())
        held = engine.usage.cpu_held_s - held0
    acts = sorted(r.act_s for r in records)
    busy = sum(r.exec_s * r.cores for r in records)
    return {
        "policy": policy, "num_actions": len(records), "avg_act_s": sum(acts) / len(acts),
        "p50_act_s": percentile(acts, 50), "p99_act_s": percentile(acts, 99), "avg_step_s": step_s,
        "avg_queue_s": sum(r.queue_s for r in records) / len(records),
        "avg_exec_s": sum(r.exec_s for r in records) / len(records),
        "avg_test_act_s": _mean([r.act_s for r in tests]), "avg_test_cores": _mean([r.cores for r in tests]),
        "cpu_core_seconds_held": held, "cpu_core_seconds_busy": busy,
        "gpu_seconds_held": 0.0, "gpu_seconds_busy": 0.0,
        "cpu_utilization": busy / (cores * step_s), "gpu_utilization": None,
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run(trajectories: int = 6, turns: int = 8, seed: int = 0, log: Callable[[str], None] = lambda m: None) -> dict:
    cores = len(os.sched_getaffinity(0))
    plan = workload(trajectories, turns, seed)
    results = []
    for policy in ("tangram", "trajectory-static"):
        t = time.monotonic()
        results.append(asyncio.run(_run_policy(policy, plan, cores)))
        r = results[-1]
        log(f"{policy}: avg ACT {r['avg_act_s']:.3f}s, step {r['avg_step_s']:.1f}s ({time.monotonic() - t:.0f}s wall)")
    t, s = results
    return {"workload": "e2e-code-agent", "cluster": {"cpus": cores, "trajectories": trajectories, "turns": turns},
            "results": results,
            "comparison": {"trajectory-static": {"act_ratio": s["avg_act_s"] / t["avg_act_s"],
                                                 "step_ratio": s["avg_step_s"] / t["avg_step_s"]}}}
