"""The evaluation as a paper would show it: every workload x pool scale x seed x policy.

A *cell* is one simulation (workload, scale, seed, policy); a *search* is the smallest pool at
which one policy matches trajectory-static's step time at scale 1 (``compare.min_scale``). Both
run in worker processes (the simulator is pure Python and single-threaded, so processes are the
only way to use more than one core). Everything a report shows is derived here from the cells'
summaries, and every derived figure carries a sentence saying how it was computed — nothing is
typed in.

Ratios are computed per seed (the baseline's value over Tangram's on the *same* generated
workload) and then averaged over seeds; "spread" is the min..max over seeds. (A ratio of the
means was considered too: it lets one long seed dominate, and hides a seed on which Tangram loses.)
"""

from __future__ import annotations

import math
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from ..core.action import Outcome
from ..core.cluster import scale_cluster
from .compare import BASELINES, min_scale, run_policy
from .workload import Workload
from .workloads import WORKLOADS, generate

POLICIES = ("tangram", *BASELINES)
SCALES = (0.125, 0.25, 0.5, 1.0, 2.0)
SEEDS = (0, 1, 2)
#: the paper's headline figures (Xiao et al., arXiv 2603.13019, abstract): "up to" over their sweep
PAPER = {"act_speedup": 4.3, "step_speedup": 1.5, "resource_savings": 0.712}
#: metrics aggregated over seeds per (workload, scale, policy)
METRICS = ("avg_act_s", "p50_act_s", "p99_act_s", "avg_step_s", "cpu_core_seconds_held", "gpu_seconds_held",
           "cpu_utilization", "gpu_utilization")
CDF_POINTS = 101


@dataclass(frozen=True)
class Plan:
    """What to sweep. ``sizes`` overrides trajectories/steps per workload (``--quick``); a workload
    given as a path is a JSONL trace."""

    workloads: tuple[str, ...] = tuple(WORKLOADS)
    scales: tuple[float, ...] = SCALES
    seeds: tuple[int, ...] = SEEDS
    policies: tuple[str, ...] = POLICIES
    sizes: dict[str, dict] = field(default_factory=dict)
    min_resources: bool = True
    search_iterations: int = 6
    #: simulated clients send each action's exact remaining turns (``Action.remaining_turns``);
    #: off, Tangram does without (policy/critical.py: what it learns instead, and what that costs)
    client_remaining: bool = True
    #: the engine's bound on queue time (``waits.py``); None: unbounded. A sweep measures queueing,
    #: and at small pools static baselines queue past the service's default 600 s, where their
    #: actions would be rejected and drop out of the figures
    max_queue_s: float | None = None

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("workloads: give at least one")
        if not self.seeds:
            raise ValueError("seeds: give at least one")
        if not self.scales or any(not s > 0 for s in self.scales):
            raise ValueError(f"scales: need values > 0, got {self.scales}")
        if "tangram" not in self.policies:
            raise ValueError("policies: tangram must be among them (every ratio is against it)")


QUICK = Plan(scales=(0.25, 1.0), seeds=(0, 1),
             sizes={"code_agent": {"trajectories": 48, "steps": 1}, "mopd": {"trajectories": 128, "steps": 1},
                    "search": {"trajectories": 64, "steps": 1}, "rlvr": {"trajectories": 256, "steps": 1},
                    "mixed": {"trajectories": 24, "steps": 1}},
             search_iterations=4)


def load_workload(name: str, seed: int, sizes: dict[str, dict] | None = None) -> Workload:
    """A built-in workload by name (generated from ``seed``), or a trace by path (seed-free)."""
    if name in WORKLOADS:
        return generate(name, seed=seed, **(sizes or {}).get(name, {}))
    from .trace import load_trace

    return load_trace(name)


def workload_label(name: str) -> str:
    return name if name in WORKLOADS else os.path.splitext(os.path.basename(name))[0]


# -- the work a process does -----------------------------------------------------------------------
def run_cell(name: str, scale: float, seed: int, policy: str, sizes: dict | None = None,
             client_remaining: bool = True, max_queue_s: float | None = None) -> dict:
    """One simulation; its summary plus ACT quantiles (for CDFs) and wall time."""
    t0 = time.perf_counter()
    wl = load_workload(name, seed, sizes)
    run = run_policy(wl, scale_cluster(wl.default_cluster, scale), policy, seed, max_queue_s=max_queue_s,
                     client_remaining=client_remaining)
    quantiles: list[float] = []
    if run.result is not None:
        acts = sorted(f.act_s for f in run.result.finished if f.outcome is not Outcome.REJECTED)
        if acts:
            quantiles = [acts[min(len(acts) - 1, round(i * (len(acts) - 1) / (CDF_POINTS - 1)))]
                         for i in range(CDF_POINTS)]
    summary = {k: v for k, v in run.summary.items() if k != "outcomes"}
    summary["outcomes"] = run.summary.get("outcomes", {})
    return {"workload": workload_label(name), "scale": scale, "seed": seed, "policy": policy, "summary": summary,
            "act_quantiles": quantiles, "wall_s": time.perf_counter() - t0}


def run_search(name: str, seed: int, policy: str, target_step_s: float, iterations: int,
               sizes: dict | None = None, client_remaining: bool = True, max_queue_s: float | None = None) -> dict:
    """The smallest pool scale at which ``policy`` matches ``target_step_s`` (bisection)."""
    t0 = time.perf_counter()
    wl = load_workload(name, seed, sizes)
    s = min_scale(wl, wl.default_cluster, policy, target_step_s, seed=seed, iterations=iterations,
                  max_queue_s=max_queue_s, client_remaining=client_remaining)
    return {"workload": workload_label(name), "seed": seed, "policy": policy, "target_step_s": target_step_s,
            "min_scale": s, "wall_s": time.perf_counter() - t0}


# -- the sweep -------------------------------------------------------------------------------------
@dataclass
class Evaluation:
    plan: dict
    cells: list[dict]
    searches: list[dict]
    wall_s: float
    workers: int
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"plan": self.plan, "workers": self.workers, "wall_s": self.wall_s, "errors": self.errors,
                "aggregate": aggregate(self.cells), "headline": headline(self.cells, self.searches),
                "vs_best_baseline": vs_best_baseline(self.cells),
                "min_resources": summarize_searches(self.searches), "cells": self.cells, "searches": self.searches}


def _cost(name: str, scale: float, policy: str) -> float:
    """A rough running time, so the longest cells start first and the workers finish together."""
    base = {"mixed": 3.0, "code_agent": 2.0}.get(name, 1.0)
    return base / math.sqrt(scale) * (1.5 if policy == "tangram" else 1.0)


def evaluate(plan: Plan, workers: int = 2, progress: Callable[[str, int, int], None] | None = None) -> Evaluation:
    """Run every cell of ``plan`` (then the min-resources searches) in ``workers`` processes.
    ``progress(phase, done, total)`` is called as results come in."""
    t0 = time.perf_counter()
    cells_todo = sorted(((w, s, seed, p) for w in plan.workloads for s in plan.scales for seed in plan.seeds
                         for p in plan.policies), key=lambda c: -_cost(c[0], c[1], c[3]))
    errors: list[str] = []
    cells: list[dict] = []
    searches: list[dict] = []
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(run_cell, *c, plan.sizes, plan.client_remaining, plan.max_queue_s): c
                   for c in cells_todo}
        for f in _collect(futures, "cells", progress, errors):
            cells.append(f)
        if plan.min_resources and "trajectory-static" in plan.policies:
            todo = []
            for w in plan.workloads:
                for seed in plan.seeds:
                    ref = _find(cells, workload_label(w), 1.0, seed, "trajectory-static")
                    target = ref["summary"].get("avg_step_s") if ref else None
                    if target is None:
                        continue
                    todo += [(w, seed, p, target) for p in plan.policies]
            futures = {pool.submit(run_search, *t, plan.search_iterations, plan.sizes, plan.client_remaining,
                                   plan.max_queue_s): t for t in todo}
            for f in _collect(futures, "min-resources", progress, errors):
                searches.append(f)
    order = {(workload_label(w)): i for i, w in enumerate(plan.workloads)}
    cells.sort(key=lambda c: (order[c["workload"]], c["scale"], c["seed"], POLICIES.index(c["policy"])
                              if c["policy"] in POLICIES else 99))
    searches.sort(key=lambda c: (order[c["workload"]], c["seed"], c["policy"]))
    plan_json = asdict(plan)
    plan_json["workloads"] = [workload_label(w) for w in plan.workloads]
    return Evaluation(plan_json, cells, searches, time.perf_counter() - t0, workers, errors)


def _collect(futures: dict, phase: str, progress, errors: list[str]) -> Iterable[dict]:
    total = len(futures)
    if progress is not None:
        progress(phase, 0, total)
    for done, f in enumerate(as_completed(futures), 1):
        try:
            yield f.result()
        except Exception as e:  # a bug in one cell: record it, finish the rest, fail at the end
            errors.append(f"{phase} {futures[f]}: {type(e).__name__}: {e}")
        if progress is not None:
            progress(phase, done, total)


def _find(cells: list[dict], workload: str, scale: float, seed: int, policy: str) -> dict | None:
    for c in cells:
        if c["workload"] == workload and c["scale"] == scale and c["seed"] == seed and c["policy"] == policy:
            return c
    return None


# -- what the report shows -------------------------------------------------------------------------
def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.pstdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def aggregate(cells: list[dict]) -> list[dict]:
    """Per (workload, scale, policy): each metric's mean / min / max / std over seeds, and the
    per-seed ratio baseline / Tangram of ACT and step time (above 1: Tangram better)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["workload"], c["scale"], c["policy"]), []).append(c)
    rows = []
    for (w, scale, policy), cs in groups.items():
        feasible = [c for c in cs if c["summary"].get("avg_act_s") is not None]
        row: dict = {"workload": w, "scale": scale, "policy": policy, "seeds": len(cs),
                     "infeasible": sorted({c["summary"]["infeasible"] for c in cs if c["summary"].get("infeasible")})}
        for m in METRICS:
            vals = [c["summary"][m] for c in feasible if c["summary"].get(m) is not None]
            row[m] = _stats(vals) if vals else None
        for metric, key in (("avg_act_s", "act_ratio"), ("avg_step_s", "step_ratio")):
            ratios = []
            for c in feasible:
                t = _find(cells, w, scale, c["seed"], "tangram")
                tv = t["summary"].get(metric) if t else None
                if tv:
                    ratios.append(c["summary"][metric] / tv)
            row[key] = _stats(ratios) if ratios else None
        rows.append(row)
    return rows


def _best_point(rows: list[dict], key: str, baselines: Iterable[str]) -> dict | None:
    best = None
    for r in rows:
        if r["policy"] in baselines and r.get(key) and (best is None or r[key]["mean"] > best[key]["mean"]):
            best = r
    if best is None:
        return None
    return {"value": best[key]["mean"], "min": best[key]["min"], "max": best[key]["max"],
            "workload": best["workload"], "scale": best["scale"], "baseline": best["policy"], "seeds": best[key]["n"]}


def vs_best_baseline(cells: list[dict]) -> dict[str, list[dict]]:
    """Per (workload, scale): Tangram's ACT and step time against the best baseline of each seed
    (``min`` is the worst seed, ``mean`` the mean over seeds; above 1: Tangram better) — the
    check of the goal "on no workload and no seed behind a baseline by more than 1%"."""
    return {"act": _vs_best_baseline(cells, "avg_act_s"), "step": _vs_best_baseline(cells, "avg_step_s")}


def _vs_best_baseline(cells: list[dict], metric: str) -> list[dict]:
    """Per (workload, scale): Tangram against the best baseline *at that point and seed* (the
    smallest value among the baselines that ran), averaged over seeds."""
    points: dict[tuple, list[float]] = {}
    for t in cells:
        if t["policy"] != "tangram" or not t["summary"].get(metric):
            continue
        others = [c["summary"][metric] for c in cells if c["policy"] != "tangram" and c["workload"] == t["workload"]
                  and c["scale"] == t["scale"] and c["seed"] == t["seed"] and c["summary"].get(metric) is not None]
        if others:
            points.setdefault((t["workload"], t["scale"]), []).append(min(others) / t["summary"][metric])
    return [{"workload": w, "scale": s, **_stats(v)} for (w, s), v in points.items()]


def headline(cells: list[dict], searches: list[dict]) -> dict:
    """The "up to" figures, computed from the sweep, beside the paper's."""
    rows = aggregate(cells)
    out: dict = {"paper": PAPER}
    out["act_vs_trajectory_static"] = _best_point(rows, "act_ratio", ["trajectory-static"])
    out["step_vs_trajectory_static"] = _best_point(rows, "step_ratio", ["trajectory-static"])
    out["act_vs_any_baseline"] = _best_point(rows, "act_ratio", BASELINES)
    out["step_vs_any_baseline"] = _best_point(rows, "step_ratio", BASELINES)
    for metric, key in (("avg_act_s", "act_vs_best_baseline"), ("avg_step_s", "step_vs_best_baseline")):
        pts = _vs_best_baseline(cells, metric)
        if pts:
            top = max(pts, key=lambda p: p["mean"])
            low = min(pts, key=lambda p: p["min"])
            out[key] = {"value": top["mean"], "min": top["min"], "max": top["max"], "workload": top["workload"],
                        "scale": top["scale"], "seeds": top["n"],
                        "worst_seed": {"value": low["min"], "workload": low["workload"], "scale": low["scale"]},
                        "worst_mean": min(p["mean"] for p in pts)}
    res = summarize_searches(searches)
    best = None
    for w, per in res.items():
        t = per.get("tangram")
        rel = per.get("tangram", {}).get("vs_trajectory_static")
        if t and rel and (best is None or rel["mean"] > best["value"]):
            best = {"value": rel["mean"], "min": rel["min"], "max": rel["max"], "workload": w,
                    "min_scale": t["min_scale"]["mean"],
                    "baseline_min_scale": per["trajectory-static"]["min_scale"]["mean"], "seeds": rel["n"]}
    out["resource_savings"] = best
    return out


def summarize_searches(searches: list[dict]) -> dict:
    """Per workload and policy: the smallest pool scale matching trajectory-static's step time at
    scale 1 (mean / min / max over seeds), the savings ``1 - scale`` against the 1x pool, and
    ``vs_trajectory_static``: ``1 - scale / trajectory-static's own smallest scale`` on the same seed
    — resources saved against the baseline at equal step time, the paper's comparison (a workload
    whose step time barely depends on the pool, like rlvr, saves 89% against 1x under *every*
    policy, and 0% against the baseline). None where no scale up to 2x matched."""
    out: dict = {}
    for s in searches:
        out.setdefault(s["workload"], {}).setdefault(s["policy"], []).append(s)
    result: dict = {}
    for w, per in out.items():
        result[w] = {}
        for p, ss in per.items():
            found = [s["min_scale"] for s in ss if s["min_scale"] is not None]
            ref = {s["seed"]: s["min_scale"] for s in per.get("trajectory-static", ())}
            rel = [1 - s["min_scale"] / ref[s["seed"]] for s in ss
                   if s["min_scale"] is not None and ref.get(s["seed"])]
            result[w][p] = {"seeds": len(ss), "matched": len(found),
                            "min_scale": _stats(found) if found else None,
                            "savings": _stats([1 - x for x in found]) if found else None,
                            "vs_trajectory_static": _stats(rel) if rel else None,
                            "target_step_s": _stats([s["target_step_s"] for s in ss])}
    return result


def default_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))
