"""Turn a simulation's records into the figures docs/design.md asks for ("What we measure")."""

from __future__ import annotations

import math

from ..core.action import CPU, GPU, Outcome
from .simulator import SimResult, outcome_counts


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (``q`` in 0..100)."""
    if not sorted_values:
        return math.nan
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(r: SimResult) -> dict:
    """One row of ``tangram simulate --json``'s ``results``."""
    if r.infeasible:
        return {"policy": r.policy, "infeasible": r.infeasible, "num_actions": 0, "avg_act_s": None,
                "p50_act_s": None, "p99_act_s": None, "avg_step_s": None, "cpu_core_seconds_held": None,
                "cpu_core_seconds_busy": None, "gpu_seconds_held": None, "gpu_seconds_busy": None,
                "cpu_utilization": None, "gpu_utilization": None}
    done = [f for f in r.finished if f.outcome is not Outcome.REJECTED]
    acts = sorted(f.act_s for f in done)
    cpu_busy = sum(f.exec_s * f.units for f in done if f.action.pool == CPU)
    gpu_busy = sum(f.exec_s * f.units for f in done if f.action.pool == GPU)
    steps = [end - start for _, _, start, end in r.steps]
    cores = r.cluster.total_cores
    gpus = r.cluster.total_gpus
    span = r.makespan_s or 1.0
    n = len(done) or 1
    return {
        "policy": r.policy,
        "num_actions": len(done),
        "avg_act_s": sum(acts) / n,
        "p50_act_s": percentile(acts, 50),
        "p99_act_s": percentile(acts, 99),
        "avg_queue_s": sum(f.queue_s for f in done) / n,
        "avg_setup_s": sum(f.setup_s for f in done) / n,
        "avg_exec_s": sum(f.exec_s for f in done) / n,
        "avg_step_s": sum(steps) / len(steps) if steps else 0.0,
        "makespan_s": r.makespan_s,
        "cpu_core_seconds_held": r.cpu_held_s,
        "cpu_core_seconds_busy": cpu_busy,
        "gpu_seconds_held": r.gpu_held_s,
        "gpu_seconds_busy": gpu_busy,
        "cpu_utilization": cpu_busy / (cores * span) if cores else None,
        "gpu_utilization": gpu_busy / (gpus * span) if gpus else None,
        "cpu_held_utilization": cpu_busy / r.cpu_held_s if r.cpu_held_s else None,
        "gpu_held_utilization": gpu_busy / r.gpu_held_s if r.gpu_held_s else None,
        "outcomes": outcome_counts(r.finished),
        "api_rejections": r.api_rejections,
        "events": r.events,
    }
