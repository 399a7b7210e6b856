"""What the simulator replays: jobs made of synchronous steps of trajectories of actions.

Actions of one trajectory are sequential: action ``seq`` is submitted ``gap_s`` after the previous
one finished (the first: ``gap_s`` after the trajectory starts, which is when its step starts). A
step ends when all its trajectories have finished; the job's next step starts then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.action import CPU, GPU
from ..core.cluster import ApiQuota, Cluster, ModelSpec


@dataclass(slots=True)
class ActionSpec:
    seq: int
    service: str
    gap_s: float
    work_s: float
    demand: dict[str, tuple[int, int]] = field(default_factory=dict)
    parallel_fraction: float = 0.0
    weights_gb: float = 0.0
    operation: str = ""
    hint_s: float | None = None
    timeout_s: float | None = None


@dataclass(slots=True)
class TrajectorySpec:
    id: str
    actions: list[ActionSpec]


@dataclass(slots=True)
class JobSpec:
    name: str
    steps: list[list[TrajectorySpec]]


@dataclass(slots=True)
class Workload:
    name: str
    jobs: list[JobSpec]
    quotas: tuple[ApiQuota, ...] = ()
    models: tuple[ModelSpec, ...] = ()
    default_cluster: Cluster | None = None

    @property
    def num_actions(self) -> int:
        return sum(len(t.actions) for j in self.jobs for s in j.steps for t in s)

    def concurrent_trajectories(self) -> int:
        """Trajectories that run at once: every job's largest step, summed."""
        return sum(max((len(s) for s in j.steps), default=0) for j in self.jobs)

    def unit_seconds(self) -> dict[tuple[str, str], float]:
        """Work at minimum demand, in unit-seconds per (job, pool)."""
        out: dict[tuple[str, str], float] = {}
        for j in self.jobs:
            for step in j.steps:
                for t in step:
                    for a in t.actions:
                        if a.service == "sandbox":
                            pool, units = CPU, a.demand.get(CPU, (1, 1))[0]
                        elif a.service.startswith("model:"):
                            pool, units = GPU, a.demand.get(GPU, (1, 1))[0]
                        else:
                            pool, units = a.service, 1
                        out[(j.name, pool)] = out.get((j.name, pool), 0.0) + a.work_s * units
        return out

    def model_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for j in self.jobs:
            for step in j.steps:
                for t in step:
                    for a in t.actions:
                        if a.service.startswith("model:"):
                            name = a.service[len("model:"):]
                            out[name] = out.get(name, 0.0) + a.work_s
        return out
