"""A discrete-event simulator that drives the real engine and policy on a virtual clock."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable

from ..core.action import Action, Demand, Finished, Outcome
from ..core.clock import ManualClock
from ..core.cluster import Cluster
from ..core.seam import Pool, Report
from ..driver import Driver
from ..core.pools import EPS
from ..engine import Engine
from ..waits import DEFAULT_MAX_QUEUE_S
from ..policy import Costs, Policy, Profile
from .managers import SimApiManager, SimModelManager, SimSandboxManager
from .workload import ActionSpec, TrajectorySpec, Workload


class Deadlock(RuntimeError):
    """The simulation ran out of events with actions still waiting: the policy cannot finish this
    workload on this cluster (a session that fits no node's memory, say). ``run_policy`` reports
    it as infeasible with this message instead of aborting a comparison."""


@dataclass
class SimResult:
    policy: str
    workload: str
    cluster: Cluster
    finished: list[Finished]
    steps: list[tuple[str, int, float, float]]  # (job, step, start, end)
    makespan_s: float
    cpu_held_s: float
    gpu_held_s: float
    series: list[tuple[float, int, int, int, int]]
    api_rejections: int = 0
    events: int = 0
    infeasible: str | None = None
    extra: dict = field(default_factory=dict)


class _TrajectoryRun:
    __slots__ = ("spec", "job", "step", "next", "job_index")

    def __init__(self, spec: TrajectorySpec, job: str, step: int, job_index: int) -> None:
        self.spec = spec
        self.job = job
        self.step = step
        self.next = 0
        self.job_index = job_index


class Simulator:
    """Runs ``workload`` on ``cluster`` under ``policy``; deterministic for a given seed.

    ``client_remaining``: the simulated clients send each action's exact remaining turns in its
    trajectory (``Action.remaining_turns``, which Tangram uses to find each step's critical path;
    the baselines ignore it), blurred by a lognormal factor of ``remaining_sigma`` when given.
    Off (``tangram simulate/evaluate --no-client-remaining``), as from SandboxFusion-style clients:
    Tangram then learns what it can per job (policy/critical.py says what each signal costs)."""

    def __init__(self, workload: Workload, cluster: Cluster, policy: Policy, *, seed: int = 0,
                 costs: Costs = Costs(), sample_every_s: float = 1.0,
                 progress: Callable[[int], None] | None = None,
                 max_queue_s: float | None = DEFAULT_MAX_QUEUE_S,
                 client_remaining: bool = True, remaining_sigma: float = 0.0) -> None:
        self.workload = workload
        self.cluster = cluster
        self.policy = policy
        self.clock = ManualClock()
        self._events: list = []
        self._seq = itertools.count()
        self.progress = progress
        self.client_remaining = client_remaining
        self.remaining_sigma = remaining_sigma
        self._remaining_rng = random.Random(seed * 7919 + 1)
        profile = Profile(workload.unit_seconds(), workload.model_seconds(), workload.concurrent_trajectories())
        at, clock, sink = self.at, self.clock, self._report
        self.api = SimApiManager(at, clock, sink, cluster.quotas, seed)
        managers = {Pool.CPU: SimSandboxManager(at, clock, sink, costs),
                    Pool.GPU: SimModelManager(at, clock, sink, cluster), Pool.API: self.api}
        self.engine = Engine(cluster, policy, managers, self.clock, costs=costs, profile=profile,
                             sample_every_s=sample_every_s, max_queue_s=max_queue_s)
        self.driver = Driver(self.engine, self._arm)
        self.engine.listeners.append(self._on_finished)
        self.finished: list[Finished] = []
        self.steps: list[tuple[str, int, float, float]] = []
        self._step_left: list[int] = [0] * len(workload.jobs)
        self._step_no: list[int] = [0] * len(workload.jobs)
        self._step_start: list[float] = [0.0] * len(workload.jobs)
        self._runs: dict[str, _TrajectoryRun] = {}

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _arm(self, t: float) -> None:
        """The driver's wake-up. One armed only for a queue deadline (not the policy's wish) is
        dropped when it comes due with nothing to expire: otherwise the wake-ups of actions that
        did start would add events and stretch the run past its last real event."""
        policy_wake = self.policy.next_wakeup(self.clock.now())
        deadline_only = policy_wake is None or policy_wake > t + EPS
        self.at(t, _deadline if deadline_only else _noop)

    def _report(self, r: Report) -> None:
        """The managers' sink: reports apply at once; the round runs once the instant is over."""
        self.engine.report(r)

    def run(self) -> SimResult:
        for j in range(len(self.workload.jobs)):
            self._start_step(j, 0)
        events = self._events
        engine = self.engine
        clock = self.clock
        tick = self.driver.tick
        n = 0
        progress = self.progress
        due = False  # a real event ran at this instant: a round follows once the instant is over
        while events:
            t, _, fn = heapq.heappop(events)
            if fn is _deadline and ((d := engine.next_deadline()) is None or d > t + EPS):
                if d is not None:  # that action started; the next deadline still needs a wake-up
                    self.at(d, _deadline)
            else:
                clock.advance_to(t)
                fn()
                n += 1
                due = True
                if progress is not None and n % 4096 == 0:
                    progress(len(self.finished))
            if due and (not events or events[0][0] > t):
                tick()
                due = False
        engine.usage.advance(clock.now())
        if progress is not None:
            progress(len(self.finished))
        stuck = len(engine.pending) + len(engine.running)
        if stuck:
            raise Deadlock(f"simulation ended with {len(engine.pending)} actions waiting and "
                               f"{len(engine.running)} running under {self.policy.name}: the policy deadlocked")
        u = engine.usage
        return SimResult(self.policy.name, self.workload.name, self.cluster, self.finished, self.steps, clock.now(),
                         u.cpu_held_s, u.gpu_held_s, u.series, self.api.rejections, n)

    # -- workload driving ------------------------------------------------------------------------
    def _start_step(self, j: int, step: int) -> None:
        job = self.workload.jobs[j]
        if step >= len(job.steps):
            return
        trajs = job.steps[step]
        now = self.clock.now()
        self._step_no[j] = step
        self._step_start[j] = now
        self._step_left[j] = len(trajs)
        if not trajs:
            self.steps.append((job.name, step, now, now))
            self._start_step(j, step + 1)
            return
        for spec in trajs:
            run = _TrajectoryRun(spec, job.name, step, j)
            self._runs[spec.id] = run
            self._next_action(run, now)

    def _next_action(self, run: _TrajectoryRun, now: float) -> None:
        if run.next >= len(run.spec.actions):
            self._end_trajectory(run)
            return
        spec = run.spec.actions[run.next]
        run.next += 1
        self.at(now + spec.gap_s, lambda: self._submit(run, spec))

    def _submit(self, run: _TrajectoryRun, spec: ActionSpec) -> None:
        action = Action(
            id=f"{run.spec.id}#{spec.seq}", service=spec.service, demand=Demand(spec.demand), job=run.job,
            trajectory=run.spec.id, step=run.step, operation=spec.operation, hint_s=spec.hint_s,
            parallel_fraction=spec.parallel_fraction, weights_gb=spec.weights_gb, timeout_s=spec.timeout_s,
            payload=spec, remaining_turns=self._remaining(run))
        self.engine.submit(action)  # a rejection comes back through the listener like any outcome

    def _remaining(self, run: _TrajectoryRun) -> int | None:
        """What the simulated client says is left of its trajectory after this action: nothing,
        or the true count blurred by a lognormal factor of ``remaining_sigma``."""
        if not self.client_remaining:
            return None
        left = len(run.spec.actions) - run.next
        if self.remaining_sigma > 0:
            left = round(left * self._remaining_rng.lognormvariate(0.0, self.remaining_sigma))
        return left

    def _on_finished(self, f: Finished) -> None:
        self.finished.append(f)
        spec = f.action.payload
        if not isinstance(spec, ActionSpec):
            return
        run = self._runs[f.action.trajectory]
        self._next_action(run, f.finished_at)

    def _end_trajectory(self, run: _TrajectoryRun) -> None:
        del self._runs[run.spec.id]
        self.engine.end_trajectory(run.spec.id, run.job, run.step)
        j = run.job_index
        self._step_left[j] -= 1
        if self._step_left[j] == 0:
            now = self.clock.now()
            self.steps.append((run.job, run.step, self._step_start[j], now))
            self._start_step(j, run.step + 1)


def _deadline() -> None:
    """A queue deadline's wake-up (the round after it rejects what waited too long)."""


def _noop() -> None:
    pass


def simulate(workload: Workload, cluster: Cluster, policy: Policy, **kwargs) -> SimResult:
    return Simulator(workload, cluster, policy, **kwargs).run()


def outcome_counts(finished: list[Finished]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in finished:
        out[f.outcome.value] = out.get(f.outcome.value, 0) + 1
    return out


__all__ = ["Deadlock", "SimResult", "Simulator", "outcome_counts", "simulate", "Outcome"]
