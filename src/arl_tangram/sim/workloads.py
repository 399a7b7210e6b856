"""Built-in workload generators, parameterised and modelled on public facts (docs/design.md,
"Workloads and traces").

Every number below says where it comes from. They are meant to be *shapes* an RL-infrastructure
engineer recognises, not a claim about any one system; replay your own logs with ``--trace``.
Generation is deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Callable

from ..core.cluster import ApiQuota, Cluster, ModelSpec, uniform_cluster
from .workload import ActionSpec, JobSpec, TrajectorySpec, Workload


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))


def _job(name: str, steps: int, trajectories: int, rng: random.Random,
         actions: Callable[[random.Random], list[ActionSpec]]) -> JobSpec:
    """``steps`` synchronous steps of ``trajectories`` trajectories, each drawn by ``actions``."""
    return JobSpec(name, [[TrajectorySpec(f"{name}-s{s}-t{t}", actions(rng)) for t in range(trajectories)]
                          for s in range(steps)])


@dataclass
class CodeAgentParams:
    """SWE-style agent with tools bash / str_replace / finish.

    * turns: median 30, lognormal sigma 0.5, 5..100 — SWE-agent and OpenHands trajectories on
      SWE-bench take tens of steps (their papers report medians in the 20s-30s and caps of 100).
    * LLM gap: median 6 s, sigma 0.8, 0.5..60 s — a turn decodes a few hundred tokens at tens of
      tokens/s per sequence under batch load; docs/design.md's "seconds to a minute".
    * commands: 80% quick (cat/ls/grep/str_replace: median 0.15 s, 1 core); 12% scripts (median
      2 s, 1..2 cores, parallel fraction 0.3); 8% test runs (median 30 s, sigma 0.8, up to 600 s,
      1..8 cores, parallel fraction 0.7..0.95 — pytest -n / make -j scale sub-linearly);
      the first action sets the repository up (install: median 20 s, 1..4 cores, fraction 0.5).
    * cluster: 2 cores per trajectory on 64-core nodes, the ratio of 2,000 trajectories on 4,096
      cores.
    """

    trajectories: int = 256
    steps: int = 2
    turns_median: float = 30
    gap_median_s: float = 6.0
    quick_fraction: float = 0.80
    script_fraction: float = 0.12
    test_median_s: float = 30.0
    timeout_s: float = 600.0
    cores_per_trajectory: float = 2.0
    job: str = "code-agent"


def code_agent(p: CodeAgentParams, seed: int) -> Workload:
    def trajectory(rng: random.Random) -> list[ActionSpec]:
        n = int(_lognormal(rng, p.turns_median, 0.5, 5, 100))
        actions = [ActionSpec(0, "sandbox", _lognormal(rng, 3.0, 0.5, 0.5, 30), _lognormal(rng, 20, 0.6, 2, 300),
                              {"cpu": (1, 4)}, 0.5, operation="setup", timeout_s=p.timeout_s)]
        for i in range(1, n):
            gap = _lognormal(rng, p.gap_median_s, 0.8, 0.5, 60)
            r = rng.random()
            if r < p.quick_fraction:
                a = ActionSpec(i, "sandbox", gap, _lognormal(rng, 0.15, 0.7, 0.01, 5), {"cpu": (1, 1)}, 0.0,
                               operation="shell", timeout_s=p.timeout_s)
            elif r < p.quick_fraction + p.script_fraction:
                a = ActionSpec(i, "sandbox", gap, _lognormal(rng, 2.0, 0.7, 0.1, 60), {"cpu": (1, 2)}, 0.3,
                               operation="script", timeout_s=p.timeout_s)
            else:
                a = ActionSpec(i, "sandbox", gap, _lognormal(rng, p.test_median_s, 0.8, 2, 600), {"cpu": (1, 8)},
                               rng.uniform(0.7, 0.95), operation="test", timeout_s=p.timeout_s)
            actions.append(a)
        return actions

    job = _job(p.job, p.steps, p.trajectories, random.Random(seed), trajectory)
    cpus = max(64, int(p.trajectories * p.cores_per_trajectory))
    cluster = uniform_cluster(cpus=cpus, cpu_nodes=max(1, cpus // 64))
    return Workload("code_agent", [job], default_cluster=cluster)


#: Twelve teacher / reward services of different sizes, bf16 weights = 2 bytes per parameter;
#: GPUs per instance so that weights fit 80 GB H100s with room for activations.
MOPD_SERVICES: tuple[tuple[str, float, int], ...] = (
    ("math-7b", 15, 1), ("code-7b", 15, 1), ("chat-8b", 16, 1), ("safety-3b", 7, 1), ("tool-8b", 16, 1),
    ("med-14b", 28, 1), ("law-32b", 64, 2), ("finance-32b", 64, 2), ("science-32b", 64, 2),
    ("general-72b", 144, 4), ("reason-72b", 144, 4), ("frontier-235b", 470, 8),
)


@dataclass
class MopdParams:
    """Multi-teacher on-policy distillation (MOPD): every rollout token is scored by the teacher of
    its domain.

    * 12 services (``MOPD_SERVICES``), 1..8 GPUs per instance; domain popularity Zipf(s=1.1) —
      per-service load very uneven, as in multi-domain RL data mixes.
    * turns per trajectory 1..4; LLM gap median 20 s, sigma 0.6 (long reasoning responses).
    * a scoring request is teacher prefill over the turn's tokens (median 4,000, sigma 0.7):
      20k tokens/s per GPU-instance for 7-14B, 10k for 32B on 2 GPUs, 6k for 72B on 4, 4k for 235B
      on 8 (H100 prefill rates of that order), plus 50 ms of overhead.
    * cluster: 8 nodes x 8 H100 (80 GB, one NVLink island each), 25 GB/s host-to-GPU per GPU
      (PCIe Gen5 from pinned memory).
    """

    trajectories: int = 512
    steps: int = 2
    zipf_s: float = 1.1
    gap_median_s: float = 20.0
    tokens_median: float = 4000
    job: str = "mopd"


def _mopd_rate(weights_gb: float) -> float:
    if weights_gb <= 30:
        return 20000.0
    if weights_gb <= 70:
        return 10000.0
    if weights_gb <= 150:
        return 6000.0
    return 4000.0


def mopd(p: MopdParams, seed: int) -> Workload:
    models = tuple(ModelSpec(n, w, g) for n, w, g in MOPD_SERVICES)
    weights = [1.0 / (i + 1) ** p.zipf_s for i in range(len(models))]
    order = list(range(len(models)))
    random.Random(seed + 1).shuffle(order)  # popularity is not tied to size

    def trajectory(rng: random.Random) -> list[ActionSpec]:
        m = models[order[rng.choices(range(len(models)), weights)[0]]]
        actions = []
        for i in range(rng.randint(1, 4)):
            tokens = _lognormal(rng, p.tokens_median, 0.7, 200, 32000)
            actions.append(ActionSpec(i, f"model:{m.name}", _lognormal(rng, p.gap_median_s, 0.6, 2, 200),
                                      0.05 + tokens / _mopd_rate(m.weights_gb), {"gpu": (m.gpus, m.gpus)},
                                      weights_gb=m.weights_gb, operation="logprobs"))
        return actions

    job = _job(p.job, p.steps, p.trajectories, random.Random(seed), trajectory)
    cluster = uniform_cluster(gpus=64, gpus_per_node=8, models=models)
    return Workload("mopd", [job], models=models, default_cluster=cluster)


@dataclass
class SearchParams:
    """Search agent whose tool calls go to a rate-limited web-search API.

    * turns median 8 (2..30), LLM gap median 4 s — short reasoning between searches.
    * 70% ``search`` calls (latency median 0.8 s) and 30% ``browse`` (fetch + extract, median
      2.5 s): commercial search APIs answer in about a second; page fetches take longer.
    * quota: 40 requests/s, 32 in flight — the order of a paid search-API plan; demand exceeds it
      at peak so the quota, not compute, decides ACT.
    """

    trajectories: int = 256
    steps: int = 2
    turns_median: float = 8
    gap_median_s: float = 4.0
    rate_per_s: float = 40.0
    concurrency: int = 32
    job: str = "search"


def search(p: SearchParams, seed: int) -> Workload:
    def trajectory(rng: random.Random) -> list[ActionSpec]:
        actions = []
        for i in range(int(_lognormal(rng, p.turns_median, 0.5, 2, 30))):
            gap = _lognormal(rng, p.gap_median_s, 0.6, 0.3, 60)
            if rng.random() < 0.7:
                work, op = _lognormal(rng, 0.8, 0.5, 0.1, 10), "search"
            else:
                work, op = _lognormal(rng, 2.5, 0.6, 0.3, 20), "browse"
            actions.append(ActionSpec(i, "api:search", gap, work, operation=op, timeout_s=30))
        return actions

    job = _job(p.job, p.steps, p.trajectories, random.Random(seed), trajectory)
    quotas = (ApiQuota("search", p.rate_per_s, p.concurrency),)
    return Workload("search", [job], quotas=quotas, default_cluster=Cluster(quotas=quotas))


@dataclass
class RlvrParams:
    """RLVR on code: one verification run (unit tests) per sample at the end of generation.

    * generation median 30 s, sigma 0.7, 2..600 s — the long tail of response lengths that makes
      RLVR steps wait for stragglers.
    * verification median 1.5 s, sigma 1.0, up to 120 s, 1..4 cores, parallel fraction 0.6
      (test suites of competitive-programming / LeetCode-style tasks).
    * cluster: 2 nodes x 64 cores for 1,024 samples a step.
    """

    trajectories: int = 1024
    steps: int = 2
    gap_median_s: float = 30.0
    verify_median_s: float = 1.5
    cpus: int = 128
    job: str = "rlvr"


def rlvr(p: RlvrParams, seed: int) -> Workload:
    def sample(rng: random.Random) -> list[ActionSpec]:
        return [ActionSpec(0, "sandbox", _lognormal(rng, p.gap_median_s, 0.7, 2, 600),
                           _lognormal(rng, p.verify_median_s, 1.0, 0.05, 120), {"cpu": (1, 4)}, 0.6,
                           operation="verify", timeout_s=300)]

    job = _job(p.job, p.steps, p.trajectories, random.Random(seed), sample)
    cluster = uniform_cluster(cpus=p.cpus, cpu_nodes=max(1, p.cpus // 64))
    return Workload("rlvr", [job], default_cluster=cluster)


@dataclass
class MixedParams:
    """Four jobs sharing one cluster: a code agent, RLVR, MOPD and a search agent (each at a
    quarter to half of its standalone size), so fairness across jobs and all three resource kinds
    matter at once."""

    trajectories: int = 128
    steps: int = 2


def mixed(p: MixedParams, seed: int) -> Workload:
    t = p.trajectories
    parts = [
        code_agent(CodeAgentParams(trajectories=t, steps=p.steps), seed),
        rlvr(RlvrParams(trajectories=4 * t, steps=p.steps), seed + 1),
        mopd(MopdParams(trajectories=2 * t, steps=p.steps), seed + 2),
        search(SearchParams(trajectories=t, steps=p.steps), seed + 3),
    ]
    jobs = [j for w in parts for j in w.jobs]
    quotas = parts[3].quotas
    models = parts[2].models
    cpus = max(64, int(t * 2 + t))
    cluster = uniform_cluster(cpus=cpus, cpu_nodes=max(1, cpus // 64), gpus=64, gpus_per_node=8,
                              quotas=quotas, models=models)
    return Workload("mixed", jobs, quotas=quotas, models=models, default_cluster=cluster)


@dataclass(frozen=True)
class Generator:
    make: Callable
    params: type


WORKLOADS: dict[str, Generator] = {
    "code_agent": Generator(code_agent, CodeAgentParams),
    "mopd": Generator(mopd, MopdParams),
    "search": Generator(search, SearchParams),
    "rlvr": Generator(rlvr, RlvrParams),
    "mixed": Generator(mixed, MixedParams),
}


def generate(name: str, seed: int = 0, **overrides) -> Workload:
    """Build workload ``name``; ``overrides`` set parameters (None values are ignored)."""
    gen = WORKLOADS.get(name)
    if gen is None:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    known = {f.name for f in fields(gen.params)}
    params = gen.params(**{k: v for k, v in overrides.items() if v is not None and k in known})
    return gen.make(params, seed)
