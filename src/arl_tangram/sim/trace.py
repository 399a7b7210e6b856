"""The JSONL trace format: one action per line, so users can replay their own logs (docs/design.md,
"Workloads and traces").

Required: ``step``, ``trajectory``, ``seq``, ``service``, ``gap_s``, ``work_s``. Optional:
``job`` (default ``"default"``), ``demand`` (``{"cpu": [min, max]}`` / ``{"gpu": [n, n]}``),
``parallel_fraction``, ``weights_gb`` (model services), ``operation``, ``hint_s``, ``timeout_s``,
and for ``api:<name>`` services ``quota`` (``{"rate_per_s": .., "concurrency": ..}``, once per API).
A recorded run (``sim/record.py``) adds what it measured — ``outcome``, ``act_s``, ``setup_s`` —
which the replay ignores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..core.action import InvalidAction, pool_of
from ..core.cluster import ApiQuota, ModelSpec, uniform_cluster
from .workload import ActionSpec, JobSpec, TrajectorySpec, Workload


class TraceError(ValueError):
    """A trace that cannot be replayed; names the line (1-based) and the field."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.line = line


class QuotaLine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rate_per_s: float = Field(gt=0)
    concurrency: int = Field(ge=1)
    burst: float = Field(default=0.0, ge=0)


class TraceLine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str = Field(default="default", min_length=1)
    step: int = Field(ge=0)
    trajectory: str = Field(min_length=1)
    seq: int = Field(ge=0)
    service: str
    gap_s: float = Field(ge=0, allow_inf_nan=False)
    work_s: float = Field(ge=0, allow_inf_nan=False)
    demand: dict[Literal["cpu", "gpu"], tuple[int, int]] = Field(default_factory=dict)
    parallel_fraction: float = Field(default=0.0, ge=0, le=1)
    weights_gb: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    operation: str = ""
    hint_s: float | None = Field(default=None, ge=0)
    timeout_s: float | None = Field(default=None, gt=0)
    quota: QuotaLine | None = None
    outcome: Literal["ok", "failed", "timeout", "oom", "rejected", "cancelled", "infra_error"] | None = None
    act_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    setup_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("service")
    @classmethod
    def _service(cls, v: str) -> str:
        try:
            pool_of(v)
        except InvalidAction as e:
            raise ValueError(e.message) from None
        return v

    @field_validator("demand")
    @classmethod
    def _demand(cls, v: dict) -> dict:
        for kind, (lo, hi) in v.items():
            if lo < 1 or hi < lo:
                raise ValueError(f"{kind}: need 1 <= min <= max, got [{lo}, {hi}]")
        return v


def _describe(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "line"
    return f"{where}: {err['msg']}"


def load_trace(path: str | Path) -> Workload:
    """Parse and check a trace; raises ``TraceError`` on the first bad line."""
    path = str(path)
    jobs: dict[str, dict[int, dict[str, dict[int, tuple[int, ActionSpec]]]]] = {}
    models: dict[str, tuple[int, ModelSpec]] = {}
    quotas: dict[str, tuple[int, ApiQuota]] = {}
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(path, 0, f"cannot open: {e.strerror}") from None
    with fh:
        for no, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(path, no, f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, no, "each line must be a JSON object")
            try:
                line = TraceLine.model_validate(obj)
            except ValidationError as e:
                raise TraceError(path, no, _describe(e)) from None
            pool = pool_of(line.service)
            demand = dict(line.demand)
            if pool == "cpu":
                if "gpu" in demand:
                    raise TraceError(path, no, "demand.gpu: sandbox actions run on CPUs")
                demand.setdefault("cpu", (1, 1))
            elif pool == "gpu":
                g = demand.setdefault("gpu", (1, 1))
                if g[0] != g[1]:
                    raise TraceError(path, no, "demand.gpu: a model instance has a fixed size (min == max)")
                if line.weights_gb <= 0:
                    raise TraceError(path, no, "weights_gb: model services need their weights' size (> 0)")
                name = line.service[len("model:"):]
                spec = ModelSpec(name, line.weights_gb, g[0])
                seen = models.setdefault(name, (no, spec))
                if seen[1] != spec:
                    raise TraceError(path, no, f"weights_gb/demand: model {name!r} was declared differently "
                                               f"on line {seen[0]}")
            else:
                if demand:
                    raise TraceError(path, no, "demand: API actions take one quota slot, no cpu/gpu demand")
                name = line.service[len("api:"):]
                if line.quota is not None:
                    q = ApiQuota(name, line.quota.rate_per_s, line.quota.concurrency, line.quota.burst)
                    seen_q = quotas.setdefault(name, (no, q))
                    if seen_q[1] != q:
                        raise TraceError(path, no, f"quota: API {name!r} was given another quota on line {seen_q[0]}")
            spec_a = ActionSpec(line.seq, line.service, line.gap_s, line.work_s, demand, line.parallel_fraction,
                                line.weights_gb, line.operation, line.hint_s, line.timeout_s)
            traj = jobs.setdefault(line.job, {}).setdefault(line.step, {}).setdefault(line.trajectory, {})
            if line.seq in traj:
                raise TraceError(path, no, f"seq: {line.trajectory!r} already has seq {line.seq} "
                                           f"(line {traj[line.seq][0]})")
            traj[line.seq] = (no, spec_a)
    if not jobs:
        raise TraceError(path, 0, "the trace holds no actions")
    used_apis = {a.service[len("api:"):] for st in jobs.values() for ts in st.values() for t in ts.values()
                 for _, a in t.values() if a.service.startswith("api:")}
    missing = sorted(used_apis - set(quotas))
    if missing:
        raise TraceError(path, 0, f"quota: no line gives a quota for API {missing[0]!r}")
    job_specs = []
    for job, steps in jobs.items():
        step_list = []
        for step in sorted(steps):
            trajs = []
            for tid, acts in steps[step].items():
                actions = [acts[s][1] for s in sorted(acts)]
                trajs.append(TrajectorySpec(f"{job}/{step}/{tid}", actions))
            step_list.append(trajs)
        job_specs.append(JobSpec(job, step_list))
    model_specs = tuple(m for _, m in models.values())
    quota_specs = tuple(q for _, q in quotas.values())
    wl = Workload(Path(path).stem, job_specs, quota_specs, model_specs)
    wl.default_cluster = default_cluster_for(wl)
    return wl


def default_cluster_for(wl: Workload):
    """A sensible pool for a trace: 2 cores per concurrent sandbox trajectory (64-core nodes) and
    enough 8-GPU nodes for one instance of every model service, at least 64 GPUs."""
    sandbox_trajs = sum(max((sum(1 for t in s if any(a.service == "sandbox" for a in t.actions)) for s in j.steps),
                            default=0) for j in wl.jobs)
    cpus = max(64, 2 * sandbox_trajs) if sandbox_trajs else 0
    need = sum(m.gpus for m in wl.models)
    gpus = max(64, 8 * math.ceil(need / 8)) if wl.models else 0
    return uniform_cluster(cpus=cpus, cpu_nodes=max(1, cpus // 64), gpus=gpus, gpus_per_node=8,
                           quotas=wl.quotas, models=wl.models)


def dump_trace(wl: Workload, path: str | Path) -> int:
    """Write ``wl`` as JSONL; returns the number of lines."""
    quota_of = {q.name: q for q in wl.quotas}
    quota_written: set[str] = set()
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for job in wl.jobs:
            for step_no, step in enumerate(job.steps):
                for t in step:
                    for a in t.actions:
                        line: dict = {"job": job.name, "step": step_no, "trajectory": t.id, "seq": a.seq,
                                      "service": a.service, "gap_s": round(a.gap_s, 6), "work_s": round(a.work_s, 6)}
                        if a.demand:
                            line["demand"] = {k: list(v) for k, v in a.demand.items()}
                        if a.parallel_fraction:
                            line["parallel_fraction"] = round(a.parallel_fraction, 6)
                        if a.weights_gb:
                            line["weights_gb"] = a.weights_gb
                        if a.operation:
                            line["operation"] = a.operation
                        if a.hint_s is not None:
                            line["hint_s"] = a.hint_s
                        if a.timeout_s is not None:
                            line["timeout_s"] = a.timeout_s
                        api = a.service[len("api:"):] if a.service.startswith("api:") else None
                        if api and api not in quota_written and api in quota_of:
                            q = quota_of[api]
                            line["quota"] = {"rate_per_s": q.rate_per_s, "concurrency": q.concurrency, "burst": q.burst}
                            quota_written.add(api)
                        fh.write(json.dumps(line, separators=(",", ":")) + "\n")
                        n += 1
    return n
