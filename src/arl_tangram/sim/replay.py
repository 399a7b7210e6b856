"""A recorded real run replayed under any policy, with the figures a real run reports beside it.

``validate.replay_error`` compares one policy's ACTs action by action; a benchmark that measured
several policies for real (``tangram bench agentic``) needs the same figures from both sides:
ACT per resource kind, step time, resource-seconds held. ``figures`` computes them from
``Finished`` records, which the simulator and a real runtime's engine both produce, so the two
columns of a report come from one formula.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..core.action import CPU, GPU, Finished, Outcome
from ..core.cluster import Cluster
from ..policy import Costs, make_policy
from .metrics import percentile
from .simulator import SimResult, Simulator
from .trace import load_trace

#: resource kinds of a report: an action's pool (``api:<name>`` counts as ``api``)
KINDS = ("cpu", "gpu", "api")

#: host-to-GPU bandwidth that makes a load take no time (``resident``)
_INSTANT_GBPS = 1e9


def kind_of(pool: str) -> str:
    return pool if pool in (CPU, GPU) else "api"


def act_figures(finished: list[Finished]) -> dict:
    """Average, p50 and p99 ACT of the actions that ran (rejected ones carry no work), overall
    and per resource kind (``by_kind``: only kinds that had actions)."""

    def stats(acts: list[float]) -> dict:
        xs = sorted(acts)
        return {"n": len(xs), "avg_act_s": sum(xs) / len(xs), "p50_act_s": percentile(xs, 50),
                "p99_act_s": percentile(xs, 99)}

    done = [f for f in finished if f.outcome is not Outcome.REJECTED]
    if not done:
        return {"n": 0, "avg_act_s": None, "p50_act_s": None, "p99_act_s": None, "by_kind": {}}
    by: dict[str, list[float]] = {}
    for f in done:
        by.setdefault(kind_of(f.action.pool), []).append(f.act_s)
    return {**stats([f.act_s for f in done]), "by_kind": {k: stats(by[k]) for k in KINDS if k in by}}


def shift_first_gaps(src: str | Path, dst: str | Path, offset_s: float,
                     work: dict[tuple[str, int], float] | None = None) -> int:
    """Copy the trace ``src`` to ``dst`` with ``offset_s`` added to the gap of every trajectory's
    first action; returns the lines written. A recorder takes a step's start to be its earliest
    submission; a run that knows when its step really began (the trajectories' first generation
    before any action) gives the difference here, so that a replay's step time counts from the
    same instant as the measured one. ``work``: (trajectory, seq) -> the work of that action
    instead of the recorded one (an API call whose recorded time holds the client's retries,
    which a replay under a policy that lets calls fail models again)."""
    if offset_s < 0:
        raise ValueError(f"offset_s: must be >= 0, got {offset_s}")
    work = work or {}
    n = 0
    with open(src, encoding="utf-8") as fh, open(dst, "w", encoding="utf-8") as out:
        for raw in fh:
            if not raw.strip():
                continue
            line = json.loads(raw)
            if line.get("seq") == 0:
                line["gap_s"] = round(line["gap_s"] + offset_s, 6)
            w = work.get((line.get("trajectory"), line.get("seq")))
            if w is not None:
                line["work_s"] = round(w, 6)
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
            n += 1
    return n


def with_cores(cluster: Cluster, cores: int) -> Cluster:
    """``cluster`` with its CPU nodes cut (from the last) to ``cores`` in all; GPUs and quotas as
    they are: the pool a search for resources at equal step time shrinks."""
    if cores < 1:
        raise ValueError(f"cores: need at least 1, got {cores}")
    nodes, left = [], cores
    for n in cluster.cpu_nodes:
        if left <= 0:
            break
        nodes.append(replace(n, cores=min(n.cores, left)))
        left -= nodes[-1].cores
    return replace(cluster, cpu_nodes=tuple(nodes))


def replay(trace: str | Path, cluster: Cluster, policy: str, *, costs: Costs | None = None, seed: int = 0,
           resident: bool = True, client_remaining: bool = True) -> SimResult:
    """Replay ``trace`` on ``cluster`` under ``policy``. ``resident``: model copies load in no
    time, for a run that loaded every copy before its step began (its trace then holds no load,
    and charging the first call of each model one would be the replay's error, not the run's)."""
    if resident and cluster.gpu_nodes:
        cluster = replace(cluster, gpu_nodes=tuple(replace(n, h2d_gbps=_INSTANT_GBPS) for n in cluster.gpu_nodes))
    wl = load_trace(trace)
    return Simulator(wl, cluster, make_policy(policy), seed=seed, costs=costs or Costs(),
                     client_remaining=client_remaining).run()


def step_s(result: SimResult) -> float:
    """The replay's longest step (one step: its duration)."""
    return max((end - start for _, _, start, end in result.steps), default=0.0)
