"""``tangram bench agentic``: the paper's evaluation for real, both halves at once on one host.

One seeded GRPO-style step (``agentic_workload``: sandbox steps on CPUs, teacher and reward
models on a GPU or the CPU, a judge API behind a quota) runs for real under ``tangram`` and under
the static baseline frameworks run, ``trajectory-static`` (``agentic_run`` says how each lays out
the same cores and device), then:

* **resources at equal step time**: Tangram's sandbox cores are cut (bisection over whole cores,
  ``--search-runs`` real runs at most) until its step is no longer within the baseline's step on
  all the cores; the fewest cores that still were is the figure, beside the GPU-seconds each holds;
* **the simulator against it**: the Tangram run's recorded trace is replayed by the simulator
  under every policy, on the cluster and costs that policy's real run had, and under Tangram on
  each core count the search tried; each simulated figure stands next to the measured one with
  its relative error. Each run's own trace replayed under its own policy (``simulated_own``)
  tells the simulator's error on a run apart from the two runs' differences.

The report (``--json``; ``--out DIR``: results.json, report.md/.html and plots in ``tangram
evaluate``'s style) holds ``{"policies": {NAME: {"measured": {...}, "simulated": {...},
"error": {...}}}}`` with ``avg_act_s``, ``p99_act_s``, ``step_s``, ``core_s``, ``gpu_s`` and the
same per resource kind (``cpu_avg_act_s``, ...). docs/evaluation.md says how to read it.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..core.action import Outcome
from ..sim.replay import act_figures, replay, shift_first_gaps, step_s as sim_step_s, with_cores
from .agentic_report import FIGURES, errors, flat, quantiles, write_report
from .agentic_run import Measured, calibrate_unit_s, measure
from .agentic_workload import SIZES, describe, plan

BASELINE = "trajectory-static"
POLICIES = ("tangram", BASELINE)
#: the issue's targets on a 16-core H100 host (the paper's 4.3x / 1.5x / -71.2% are the anchors)
TARGETS = {"step_ratio": 1.3, "act_ratio": 3.0, "resources_saved": 0.5, "simulator_error": 0.15}
#: which framework runs which baseline (docs/evaluation.md has the sources)
FRAMEWORKS = {
    BASELINE: "a sandbox (container) per trajectory held for its whole life with a fixed CPU share, as "
              "SWE-style agent RL runs do (rLLM/DeepSWE and SkyRL over per-trajectory Docker environments, "
              "verl's agent loop with a sandbox per rollout); each reward or teacher model in its own fixed "
              "GPU allocation for the whole run (verl's and OpenRLHF's reward-model worker groups on "
              "resource pools; Ray fractional GPUs); API calls straight from each rollout, retried on 429",
}


def _sim_figures(result, gpu_scale: float) -> dict:
    f = act_figures(result.finished)
    f.update(step_s=sim_step_s(result), core_s=result.cpu_held_s, gpu_s=result.gpu_held_s * gpu_scale,
             api_rejections=result.api_rejections)
    return f


def _search(trajs, sizes, device: str, cores: int, target_s: float, runs: int, seed: int, tmp: Path,
            log: Callable[[str], None], failures: list[str]) -> list[Measured]:
    """Tangram on fewer cores, by bisection over [1, cores): each try a real run. Stops after
    ``runs`` tries, when the interval closes, or at a try that fails (its reason in
    ``failures``: the runs before it still count)."""
    tries: list[Measured] = []
    good, bad = cores, 0  # Tangram met the target on all cores (checked by the caller); 0 cores cannot
    while len(tries) < runs and good - bad > 1:
        mid = (good + bad) // 2
        try:
            m = measure("tangram", trajs, sizes, device, mid, tmp / f"tangram-{mid}.jsonl", seed, log)
        except RuntimeError as e:
            failures.append(f"tangram on {mid} cores: {e}")
            log(failures[-1])
            break
        tries.append(m)
        if m.figures["step_s"] <= target_s:
            good = mid
        else:
            bad = mid
    return tries


def _judge_work(trajs, policy: str) -> dict[tuple[str, int], float]:
    """Each judge call's own answer time, by (trajectory, seq) in ``policy``'s trace: a call
    turned away with a 429 is recorded with its client's backoff in its time, which a replay
    under a policy that calls unscheduled would charge a second time."""
    return {(f"{policy}-{t.id}", i): s.service_s for t in trajs for i, s in enumerate(t.steps) if s.kind == "judge"}


def _sim_search(trace: Path, base, costs, cores: int, target_s: float, seed: int) -> tuple[int, dict[int, float]]:
    """The same question asked of the simulator, to the core: the fewest cores at which the
    replay of Tangram's trace under Tangram keeps its step within ``target_s``."""
    steps: dict[int, float] = {}

    def step_at(c: int) -> float:
        if c not in steps:
            steps[c] = sim_step_s(replay(trace, with_cores(base, c), "tangram", costs=costs, seed=seed))
        return steps[c]

    if step_at(cores) > target_s:
        return cores, steps
    good, bad = cores, 0
    while good - bad > 1:
        mid = (good + bad) // 2
        if step_at(mid) <= target_s:
            good = mid
        else:
            bad = mid
    return good, steps


def _ratio(a, b):
    return a / b if a is not None and b else None


def _saved(part, whole):
    return 1 - part / whole if part is not None and whole else None


def run(device: str = "cpu", groups: int | None = None, k: int | None = None, turns: int | None = None, seed: int = 0,
        cores: int | None = None, search_runs: int = 3, out: str | Path | None = None,
        log: Callable[[str], None] = lambda m: None) -> dict:
    """Measure, search, replay; the report as a dict (and its files under ``out``)."""
    if device not in SIZES:
        raise ValueError(f"device: cpu or cuda, got {device!r}")
    if search_runs < 0:
        raise ValueError(f"search_runs: must be >= 0, got {search_runs}")
    host_cores = len(os.sched_getaffinity(0))
    cores = cores or host_cores
    if not 1 <= cores <= host_cores:
        raise ValueError(f"cores: 1..{host_cores} (this machine's), got {cores}")
    sizes = SIZES[device]
    k = k or (2 if device == "cpu" else 4)
    groups = groups or max(1, 2 * cores // k)
    t0 = time.monotonic()
    unit_s = calibrate_unit_s()
    trajs = plan(groups, k, seed, sizes, cores, unit_s, turns)
    log(f"plan: {groups} groups x {k} on {cores} cores, {describe(trajs)['actions']} actions; "
        f"a unit of test work takes {unit_s * 1e3:.1f} ms here")
    with tempfile.TemporaryDirectory(prefix="tangram-agentic-") as tmp_dir:
        tmp = Path(tmp_dir) if out is None else Path(out) / "traces"
        tmp.mkdir(parents=True, exist_ok=True)
        runs = {p: measure(p, trajs, sizes, device, cores, tmp / f"{p}.jsonl", seed, log) for p in POLICIES}
        t, s = runs["tangram"], runs[BASELINE]
        target = s.figures["step_s"]
        failures: list[str] = []
        tries = _search(trajs, sizes, device, cores, target, search_runs, seed, tmp, log, failures) \
            if t.figures["step_s"] <= target else []
        trace = tmp / "tangram-replay.jsonl"
        shift_first_gaps(t.trace, trace, t.figures["first_submission_s"], _judge_work(trajs, "tangram"))
        report: dict = {"bench": "agentic", "device": _device_name(device),
                        "host": {"cpus": os.cpu_count(), "sandbox_cores": cores, "python": platform.python_version()},
                        "plan": {"groups": groups, "k": k, "turns": turns or sizes.turns, "seed": seed,
                                 "test_unit_s": unit_s,
                                 **describe(trajs), "teachers": [x.name for x in sizes.teachers],
                                 "reward_model": sizes.reward.name,
                                 "judge": {"rate_per_s": sizes.judge_rate_per_s,
                                           "concurrency": sizes.judge_concurrency}},
                        "baseline": BASELINE, "frameworks": FRAMEWORKS, "policies": {}}
        sims = {}
        for name, m in runs.items():
            sims[name] = replay(trace, m.cluster, name, costs=m.costs, seed=seed)
            own = tmp / f"{name}-own.jsonl"
            shift_first_gaps(m.trace, own, m.figures["first_submission_s"], _judge_work(trajs, name))
            measured = flat(m.figures)
            simulated = flat(_sim_figures(sims[name], m.gpu_scale))
            simulated_own = flat(_sim_figures(replay(own, m.cluster, name, costs=m.costs, seed=seed), m.gpu_scale))
            report["policies"][name] = {
                "measured": measured, "simulated": simulated, "error": errors(measured, simulated),
                "simulated_own": simulated_own, "error_own": errors(measured, simulated_own),
                "details": {k2: v for k2, v in m.figures.items() if k2 not in ("by_kind",) and k2 not in measured},
                "act_quantiles": {"measured": quantiles(m.acts), "simulated": quantiles(
                    [f.act_s for f in sims[name].finished if f.outcome is not Outcome.REJECTED])}}
        sim_target = report["policies"][BASELINE]["simulated"]["step_s"]
        sim_min, sim_steps = _sim_search(trace, t.cluster, t.costs, cores, sim_target, seed)
        report["equal_step"] = _equal_step(runs, tries, cores, target, sim_min, sim_steps, sim_target)
        report["equal_step"]["failed_tries"] = failures
        report["comparison"] = _comparison(report["policies"])
        report["targets"] = _targets(report)
        report["wall_s"] = time.monotonic() - t0
        if out is not None:
            try:
                report["files"] = [str(p) for p in write_report(report, Path(out))]
            except ModuleNotFoundError as e:  # the figures are in the JSON: a missing plotting library costs only files
                report["files"] = f"not written: needs {e.name}"
    return report


def _equal_step(runs: dict[str, Measured], tries: list[Measured], cores: int, target: float, sim_min: int,
                sim_steps: dict[int, float], sim_target: float) -> dict:
    t, s = runs["tangram"], runs[BASELINE]
    points = [t, *tries]
    ok = [m for m in points if m.figures["step_s"] <= target]
    best = min(ok, key=lambda m: m.figures["cores"]) if ok else None
    out: dict = {
        "how": "Tangram's sandbox cores cut by bisection (each try a real run) while its step stays within "
               "trajectory-static's on all the cores; the GPU is the same device under both",
        "target_step_s": target, "baseline_cores": cores,
        "tries": [{"cores": m.figures["cores"], "step_s": m.figures["step_s"], "core_s": m.figures["core_s"],
                   "gpu_s": m.figures["gpu_s"], "avg_act_s": m.figures["avg_act_s"],
                   "simulated_step_s": sim_steps.get(m.figures["cores"])} for m in points],
        "measured": None, "simulated": {"min_cores": sim_min, "cores_saved": 1 - sim_min / cores,
                                        "target_step_s": sim_target}}
    if best is not None:
        b = best.figures
        out["measured"] = {"min_cores": b["cores"], "cores_saved": 1 - b["cores"] / cores,
                           "core_s_saved": _saved(b["core_s"], s.figures["core_s"]),
                           "gpu_s_saved": _saved(b["gpu_s"], s.figures["gpu_s"]),
                           "step_s": b["step_s"], "core_s": b["core_s"], "gpu_s": b["gpu_s"]}
        out["measured"]["resources_saved"] = min(x for x in (out["measured"]["cores_saved"],
                                                             out["measured"]["gpu_s_saved"]) if x is not None)
    out["simulated"]["error_min_cores"] = (sim_min / best.figures["cores"] - 1) if best is not None else None
    return out


def _comparison(policies: dict) -> dict:
    out: dict = {}
    for side in ("measured", "simulated"):
        t, s = policies["tangram"][side], policies[BASELINE][side]
        out[side] = {f"{f}_ratio": _ratio(s.get(f), t.get(f)) for f in FIGURES if f.endswith("act_s")}
        out[side]["step_ratio"] = _ratio(s["step_s"], t["step_s"])
        out[side]["act_ratio"] = out[side].pop("avg_act_s_ratio")
        out[side]["core_s_saved"] = _saved(t["core_s"], s["core_s"])
        out[side]["gpu_s_saved"] = _saved(t["gpu_s"], s["gpu_s"])
    return out


def _targets(report: dict) -> dict:
    c = report["comparison"]["measured"]
    eq = report["equal_step"]["measured"] or {}
    worst = max((abs(e) for p in report["policies"].values() for e in p["error"].values() if e is not None),
                default=None)
    worst_own = max((abs(e) for p in report["policies"].values() for e in p["error_own"].values() if e is not None),
                    default=None)
    return {"given_for": "a 16-core host with one H100", "targets": TARGETS,
            "step_ratio": c["step_ratio"], "act_ratio": c["act_ratio"],
            "resources_saved": eq.get("resources_saved"), "worst_simulator_error": worst,
            "worst_simulator_error_own_trace": worst_own,
            "met": {"step_ratio": (c["step_ratio"] or 0) >= TARGETS["step_ratio"],
                    "act_ratio": (c["act_ratio"] or 0) >= TARGETS["act_ratio"],
                    "resources_saved": (eq.get("resources_saved") or 0) >= TARGETS["resources_saved"],
                    "simulator_error": worst is not None and worst <= TARGETS["simulator_error"]}}


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return "cpu"


def main() -> None:
    """``python -m arl_tangram.bench.agentic``: the same as ``tangram bench agentic``, for hosts
    without the CLI's own dependencies (typer)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=sorted(SIZES))
    ap.add_argument("--groups", type=int, default=None, help="GRPO groups (default: 2 x cores / k)")
    ap.add_argument("--k", type=int, default=None, help="trajectories per group (default: 2 on cpu, 4 on cuda)")
    ap.add_argument("--turns", type=int, default=None, help="turns per trajectory, give or take one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, default=None, help="sandbox cores (default: this process's CPUs)")
    ap.add_argument("--search-runs", type=int, default=3, help="real runs of the equal-step search at most")
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--out", default=None, help="a directory: results.json, report.md/.html, plots, traces")
    args = ap.parse_args()
    result = run(args.device, args.groups, args.k, args.turns, args.seed, args.cores, args.search_runs, args.out,
                 log=lambda m: print(m, flush=True))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
