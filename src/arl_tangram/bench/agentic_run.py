"""One measured run of ``tangram bench agentic``: the planned step under one policy, for real.

Both policies run on the same sandbox cores and the same model device (a GPU, or the CPU standing
in for one), with the same judge API, through the same engine; they differ in the policy and in
how the device is laid out for it:

* ``tangram``: the device is one elastic pool (one GPU of the device's memory): every model's
  copy is placed, batched and evicted by the policy, cores are held only while an action runs.
* ``trajectory-static`` (policy/static.py): each trajectory holds cores / trajectories cores from
  its first action to its last; each model owns a fixed slice of the device, the device split in
  as many equal slices as there are models (engine GPUs of 1/N of its memory, all on the one
  device, its copy loaded for the whole step), and judge calls go out unscheduled and back off on
  429. The slices share the device's compute unthrottled, as fractional GPUs do under Ray (verl's
  resource pools, ``num_gpus=0.2``): that gives the baseline more than a hard 1/N slice would.

Before the step, each run loads every model's copy (one call each) and lets the warm sessions
fill, so both start with the same state; a recorder then writes every action of the step to a
trace, and the engine's ``Finished`` records give the figures, as the simulator's give its own.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.action import CPU, Action, Demand, Finished, Outcome
from ..core.cluster import ApiQuota, Cluster
from ..managers.models.spec import ModelCall, ModelServiceConfig
from ..managers.sandbox.spec import SandboxConfig
from ..policy import Costs, Profile
from ..runtime import Tangram
from ..runtime.host import CPU_DEVICE_MEMORY_GB, GPU_MEMORY_USABLE
from ..sim.replay import act_figures
from .agentic_judge import JudgeApi, JudgeCall, JudgeClient
from .agentic_workload import CALIBRATE, Sizes, Step, Teacher, Trajectory

TINY = "arl_tangram.managers.models.tiny"
JOB = "agentic"
#: a test run's own limit; the slowest planned one takes a few seconds on one core
STEP_TIMEOUT_S = 300.0


@dataclass
class Measured:
    """One run: its figures, the cluster and costs its engine had (a replay uses the same) and
    its trace."""

    policy: str
    figures: dict
    cluster: Cluster
    costs: Costs
    trace: Path
    gpu_scale: float  # physical GPUs per engine GPU: 1/N where the device is cut in N slices
    acts: list[float]  # every action's ACT (a CDF)


def calibrate_unit_s() -> float:
    """Seconds of one unit of test work on one core of this machine, in the ``python3`` the
    sandboxes run (their system directories are the host's)."""
    exe = shutil.which("python3") or sys.executable
    out = subprocess.run([exe, "-c", CALIBRATE], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip())


def device_memory_gb(device: str) -> float:
    """The model device's memory as the engine sees one GPU of it (``LocalHost.detect``'s rule)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 1e9 * GPU_MEMORY_USABLE
    return CPU_DEVICE_MEMORY_GB


def services(sizes: Sizes, device: str) -> list[ModelServiceConfig]:
    """The teachers and the reward model: random weights from a seed, nothing downloaded."""
    out = []
    for i, t in enumerate((*sizes.teachers, sizes.reward)):
        out.append(ModelServiceConfig(t.name, f"{TINY}:{'reward_model' if t.op == 'score' else 'teacher_model'}",
                                      _kwargs(t, device, sizes.vocab, i), max_batch=16, max_wait_ms=2.0))
    return out


def _kwargs(t: Teacher, device: str, vocab: int, seed: int) -> dict:
    if device == "cuda":
        from ..managers.models.tiny import TinyConfig

        c = TinyConfig.of_size(t.billions, vocab=vocab, seed=seed)
        return {"vocab": c.vocab, "d_model": c.d_model, "layers": c.layers, "heads": c.heads, "seed": seed,
                "dtype": "bfloat16", "init_device": "cuda"}
    return {"vocab": vocab, "d_model": t.d_model, "layers": 2, "heads": 4, "seed": seed}


def layout(policy: str, n_models: int, device: str) -> tuple[dict, float]:
    """The runtime's GPU arguments for ``policy`` and the physical GPUs per engine GPU."""
    if policy == "tangram":
        return {"gpus": 1, "gpu_memory_gb": device_memory_gb(device)}, 1.0
    return ({"gpus": n_models, "gpu_memory_gb": device_memory_gb(device) / n_models, "gpu_island_size": n_models},
            1.0 / n_models)


async def _run(policy: str, trajs: list[Trajectory], sizes: Sizes, device: str, cores: int, trace: Path,
               seed: int, log: Callable[[str], None]) -> Measured:
    models = services(sizes, device)
    gpu_kw, gpu_scale = layout(policy, len(models), device)
    quota = ApiQuota("judge", sizes.judge_rate_per_s, sizes.judge_concurrency)
    api = JudgeApi(quota)
    config = SandboxConfig(warm_sessions=min(len(trajs), 32))
    finished: list[Finished] = []
    async with Tangram.local(policy, sandbox=config, cores=cores, profile=Profile(trajectories=len(trajs)),
                             models=models, model_device=device, apis={"judge": (quota, JudgeClient(api, seed))},
                             **gpu_kw) as tg:
        rt = tg.runtime
        t0 = time.monotonic()
        await rt.warm_up(60.0)
        weights = {name: ld.weights_gb for name, ld in rt.models.loaded.items()}
        await _warm_models(rt, models, trajs, weights, policy)
        log(f"{policy}: ready in {time.monotonic() - t0:.1f}s ({len(models)} models, {cores} cores)")
        rt.record(trace)
        rt.engine.listeners.append(finished.append)
        loads0, rejections0 = rt.models.loads, api.rejections
        usage = rt.engine.usage
        start = time.monotonic()
        usage.advance(start)
        cpu0, gpu0 = usage.cpu_held_s, usage.gpu_held_s
        ends = await asyncio.gather(*(_trajectory(tg, policy, t, weights) for t in trajs))
        end = max(ends)
        usage.advance(time.monotonic())
        core_s, gpu_s = usage.cpu_held_s - cpu0, (usage.gpu_held_s - gpu0) * gpu_scale
        cluster, costs = rt.cluster, rt.engine.costs
        loads = rt.models.loads - loads0
    figures = act_figures(finished)
    figures.update(step_s=end - start, core_s=core_s, gpu_s=gpu_s,
                   core_s_busy=sum(f.exec_s * f.units for f in finished if f.action.pool == CPU),
                   cores=cores, judge_rejections=api.rejections - rejections0, model_loads_in_step=loads,
                   first_submission_s=min(f.submitted_at for f in finished) - start)
    acts = [f.act_s for f in finished if f.outcome is not Outcome.REJECTED]
    return Measured(policy, figures, cluster, costs, trace, gpu_scale, acts)


async def _warm_models(rt, models: list[ModelServiceConfig], trajs: list[Trajectory], weights: dict[str, float],
                       policy: str) -> None:
    """Every copy loaded before the step, as a deployment between steps has them, and run at each
    length bucket the step will send it (powers of two up to its longest sequence), twice: a
    bucket's first batch runs eagerly and its CUDA graph is captured after it, holding the GPU
    alone, which the step's own batches would otherwise wait for."""
    longest: dict[str, int] = {}
    for t in trajs:
        for st in t.steps:
            if st.model:
                longest[st.model] = max(longest.get(st.model, 2), len(st.tokens))
    for rnd in range(2):
        for m in models:
            op = "score" if m.loader.endswith("reward_model") else "logprobs"
            n = 64
            while True:
                r = await rt.submit(_model_action(rt, m.name, op, [1] * min(n, max(2, longest.get(m.name, 2))),
                                                  weights[m.name], None, None))
                if not r.ok:
                    raise RuntimeError(f"{policy}: warming {m.name} failed ({r.outcome.value}): {r.message}")
                if n >= longest.get(m.name, 2):
                    break
                n *= 2
        if rnd == 0:
            await asyncio.sleep(0.5)  # the captures after the first batches, off the callers' path


def _model_action(rt, model: str, op: str, tokens: list[int], weights_gb: float, trajectory: str | None,
                  remaining: int | None) -> Action:
    return Action(rt.new_id("m"), f"model:{model}", Demand({"gpu": (1, 1)}), job=JOB, trajectory=trajectory,
                  operation=op, payload=ModelCall(op, [tokens]), weights_gb=weights_gb, timeout_s=STEP_TIMEOUT_S,
                  remaining_turns=remaining)


async def _trajectory(tg: Tangram, policy: str, t: Trajectory, weights: dict[str, float]) -> float:
    s = await tg.session(job=JOB, trajectory=f"{policy}-{t.id}")
    left = len(t.steps)
    for st in t.steps:
        left -= 1
        if st.wait_s:
            await asyncio.sleep(st.wait_s)
        r = await _act(tg, s, st, left, weights)
        if not r.ok:
            raise RuntimeError(f"{policy}: {t.id}'s {st.kind} failed ({r.outcome.value}): {r.message} "
                               f"{r.stderr[-300:]}")
    await s.close()
    return time.monotonic()


async def _act(tg: Tangram, s, st: Step, left: int, weights: dict[str, float]):
    rt = tg.runtime
    if st.pool == CPU:
        return await s.exec(st.command, cpus=st.cores, parallel_fraction=st.parallel_fraction, operation=st.kind,
                            timeout_s=STEP_TIMEOUT_S, remaining_turns=left)
    if st.pool == "gpu":
        op = "score" if st.kind == "reward" else "logprobs"
        return await rt.submit(_model_action(rt, st.model, op, list(st.tokens), weights[st.model], s.id, left))
    return await rt.submit(Action(rt.new_id("q"), "api:judge", job=JOB, trajectory=s.id, operation="judge",
                                  timeout_s=STEP_TIMEOUT_S, payload=JudgeCall(st.service_s), remaining_turns=left))


def _release_memory(device: str) -> None:
    """Free this run's host and device copies before the next run builds its own."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def measure(policy: str, trajs: list[Trajectory], sizes: Sizes, device: str, cores: int, trace: Path, seed: int = 0,
            log: Callable[[str], None] = lambda m: None) -> Measured:
    """Run the step under ``policy`` on ``cores`` sandbox cores; its trace goes to ``trace``."""
    t = time.monotonic()
    m = asyncio.run(_run(policy, trajs, sizes, device, cores, trace, seed, log))
    _release_memory(device)
    f = m.figures
    log(f"{policy} on {cores} cores: step {f['step_s']:.2f}s, avg ACT {f['avg_act_s']:.3f}s, "
        f"core-s {f['core_s']:.1f}, GPU-s {f['gpu_s']:.2f} ({time.monotonic() - t:.0f}s wall)")
    return m
