"""Run several policies on one workload side by side, and search the smallest pool per policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.cluster import Cluster, scale_cluster
from ..policy import InfeasiblePolicy, make_policy
from .metrics import summarize
from ..waits import DEFAULT_MAX_QUEUE_S
from .simulator import Deadlock, SimResult, Simulator
from .workload import Workload

BASELINES = ("trajectory-static", "task-isolated", "fifo")


@dataclass
class PolicyRun:
    name: str
    summary: dict
    result: SimResult | None


def run_policy(workload: Workload, cluster: Cluster, policy: str, seed: int = 0,
               progress: Callable[[int], None] | None = None,
               max_queue_s: float | None = DEFAULT_MAX_QUEUE_S, **sim_options) -> PolicyRun:
    """One simulation; a policy that cannot run here — a static plan that cannot be laid out, or
    a run that stalls with actions no allocation can ever serve — comes back as ``infeasible``
    with the reason, so a comparison of several policies always completes."""
    try:
        r = Simulator(workload, cluster, make_policy(policy), seed=seed, progress=progress,
                      max_queue_s=max_queue_s, **sim_options).run()
    except (InfeasiblePolicy, Deadlock) as e:
        r = SimResult(policy, workload.name, cluster, [], [], 0.0, 0.0, 0.0, [], infeasible=str(e))
        return PolicyRun(policy, summarize(r), None)
    return PolicyRun(policy, summarize(r), r)


def comparison(rows: list[dict]) -> dict:
    """Tangram against every baseline that ran: ratios > 1 mean Tangram is better by that factor."""
    by = {r["policy"]: r for r in rows}
    t = by.get("tangram")
    if t is None or t.get("avg_act_s") is None:
        return {}
    out = {}
    for name, r in by.items():
        if name == "tangram":
            continue
        if r.get("avg_act_s") is None:
            out[name] = {"infeasible": r.get("infeasible")}
            continue
        out[name] = {
            "act_ratio": r["avg_act_s"] / t["avg_act_s"] if t["avg_act_s"] else None,
            "step_ratio": r["avg_step_s"] / t["avg_step_s"] if t["avg_step_s"] else None,
            "tangram_act_no_worse": t["avg_act_s"] <= r["avg_act_s"],
            "tangram_step_no_worse": t["avg_step_s"] <= r["avg_step_s"],
        }
    return out


def min_scale(workload: Workload, cluster: Cluster, policy: str, target_step_s: float, *, seed: int = 0,
              lo: float = 0.05, hi: float = 2.0, iterations: int = 8,
              on_try: Callable[[str, float, float | None], None] | None = None, **sim_options) -> float | None:
    """Smallest scale in [lo, hi] at which ``policy``'s average step time is within ``target``,
    by bisection (step time falls as pools grow; noise makes the answer good to ~1/2**iterations).
    None when even ``hi`` does not match."""

    def step_at(scale: float) -> float | None:
        run = run_policy(workload, scale_cluster(cluster, scale), policy, seed, **sim_options)
        step = run.summary.get("avg_step_s")
        if on_try is not None:
            on_try(policy, scale, step)
        return step

    def ok(step: float | None) -> bool:
        return step is not None and step <= target_step_s * (1 + 1e-9)

    if not ok(step_at(1.0)):
        if not ok(step_at(hi)):
            return None
        good, bad = hi, 1.0
    else:
        good, bad = 1.0, lo
        if ok(step_at(lo)):
            return lo
    for _ in range(iterations):
        mid = (good + bad) / 2
        if ok(step_at(mid)):
            good = mid
        else:
            bad = mid
    return round(good, 4)
