"""Which trajectories decide when their step ends, and how much priority that is worth.

A synchronous RL step ends when its last trajectory ends, so every second the longest trajectories
wait is a second of step time, while the others have slack. ``CriticalPath.on_submit`` returns, per
submitted action, seconds of priority (taken off its SRPT key) from two signals:

* *projected last* (the boost): each trajectory gets a projected finish ``now + predicted work +
  remaining turns x seconds per turn``; an action whose trajectory lies within ``window`` (a
  fraction of the step's remaining horizon) of its step's latest projected finish gets
  ``boost_s``. Remaining turns are the client's ``Action.remaining_turns``. Without them, only a
  sandbox action (CPU pool) is projected, from the expected residual ``E[L - k - 1 | L > k]``
  learned per job from the lengths (in turns) of the trajectories that ended. Seconds per turn are
  learned per job: the decayed mean interval between a trajectory's consecutive submissions.
* *waiting credit*: an action on a quota pool (``api:*``) that carries no remaining turns gets
  ``wait_credit`` x its trajectory's mean queue wait per finished action so far. On a quota pool
  every call costs about the same, so SRPT's gain there is small and its price is that some
  trajectories wait much more than others; the step waits for the unluckiest long one. The credit
  hands waiting back to the trajectories that took more than their share, turn by turn.
* *slack order* (``slack_aging``): an action on a quota pool whose client sends its remaining
  turns and whose trajectory is not projected last gets ``-min(predicted x remaining turns,
  aging x slack)`` — it goes behind by the rest of its trajectory's calls (SRPT over
  trajectories), but never by more than its slack (``latest - finish``) converted to key seconds
  (a newer call passes an older one for their key difference / aging seconds), so the delay
  cannot make it the step's last.

Why each signal is where it is: the boost moves forward the trajectories that end the step,
which is what shortens it. The learned projection serves sandbox actions only: on GPU pools
trajectories with equal turn counts have equal residuals, so it boosts the latest submission
(LIFO-like) and costs step time. The waiting credit applies only without counts and only on quota
pools: with counts it fights the boost, and on GPU pools it reorders across models and pays
loads. The slack order exists because a quota's throughput is fixed and the system is closed (a
trajectory waits for its call, thinks, calls again), so the mean ACT is set by how many
trajectories are still calling (Little: R = N / X - Z); finishing those with the fewest calls left
first shrinks that number, and the slack bound keeps the step. No order built only from what was
observed finds search's long trajectories (their hazard is flat after a few turns): the boost is
only as good as the client's counts. docs/performance.md (engine and policy) keeps the figures and
the signals measured and dropped.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..core.action import CPU, GPU, Action, Finished

StepKey = tuple[str, "int | None"]


@dataclass(slots=True)
class _Step:
    seen: int = 0
    ended: int = 0
    projected: int = 0  # trajectories with a projected finish
    heap: list = field(default_factory=list)  # (-finish, seq, trajectory, version); stale ones dropped lazily


@dataclass(slots=True)
class _Run:
    key: StepKey
    step: _Step
    turns: int = 0
    last_submit: float = 0.0
    finish: float = 0.0
    version: int = 0
    projected: bool = False
    waited_s: float = 0.0  # queue time of its finished actions
    finished: int = 0


class CriticalPath:
    __slots__ = ("window", "use_projection", "boost_s", "wait_credit", "decay", "slack_aging", "_runs", "_steps",
                 "_cycle", "_lengths", "_residual", "_seq")

    def __init__(self, window: float = 0.05, use_projection: bool = True, boost_s: float = 30.0,
                 wait_credit: float = 1.0, decay: float = 0.02, slack_aging: float = 0.0) -> None:
        self.window = window
        self.use_projection = use_projection
        self.boost_s = boost_s
        self.wait_credit = wait_credit
        self.decay = decay
        self.slack_aging = slack_aging  # a quota pool's aging (key seconds per second); 0: no slack order
        self._runs: dict[str, _Run] = {}
        self._steps: dict[StepKey, _Step] = {}
        self._cycle: dict[str, float] = {}  # job -> seconds per turn
        self._lengths: dict[str, dict[int, int]] = {}  # job -> {turns: trajectories that ended after them}
        self._residual: dict[str, dict[int, float]] = {}  # job -> {turns done: expected turns left}
        self._seq = itertools.count()

    def on_submit(self, a: Action, now: float, predicted_s: float) -> float:
        """Record ``a``'s turn; the seconds of priority it gets (0.0: none)."""
        traj = a.trajectory
        if traj is None:
            return 0.0
        run = self._runs.get(traj)
        job = a.job
        if run is None:
            key = (job, a.step)
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = _Step()
            step.seen += 1
            run = self._runs[traj] = _Run(key, step)
        else:
            step = run.step
            if run.turns:
                interval = now - run.last_submit
                cycle = self._cycle.get(job)
                self._cycle[job] = interval if cycle is None else cycle + self.decay * (interval - cycle)
        k = run.turns
        run.turns = k + 1
        run.last_submit = now
        remaining: float | None = a.remaining_turns
        if remaining is None:
            pool = a.pool
            if pool == CPU:
                if not self.use_projection or job not in self._lengths:
                    return 0.0
                remaining = self._learned(job, k)  # a trajectory of the job has ended
                if remaining is None:
                    return 0.0
            elif pool == GPU:
                return 0.0
            else:  # a quota pool: the waiting credit
                return self.wait_credit * run.waited_s / run.finished if run.finished else 0.0
        elif not self.use_projection:
            return 0.0
        cycle = self._cycle.get(job)
        if cycle is None:
            return 0.0
        run.finish = now + predicted_s + remaining * cycle
        run.version += 1
        if not run.projected:
            run.projected = True
            step.projected += 1
        heapq.heappush(step.heap, (-run.finish, next(self._seq), traj, run.version))
        if step.projected < 2:  # the first projection of a step has nothing to be compared with
            return 0.0
        latest = self._latest(step.heap)
        if run.finish >= latest - self.window * max(0.0, latest - now):
            return self.boost_s
        if self.slack_aging and a.remaining_turns is not None and a.pool != CPU and a.pool != GPU:
            # the rest of the trajectory's calls, as far back as its slack allows (module docstring)
            return -min(predicted_s * a.remaining_turns, self.slack_aging * (latest - run.finish))
        return 0.0

    def on_finish(self, f: Finished) -> None:
        """Count the queue time of a trajectory's finished call on a quota pool (the waiting
        credit's only input)."""
        a = f.action
        pool = a.pool
        if pool == CPU or pool == GPU or f.started_at is None or a.trajectory is None:
            return
        run = self._runs.get(a.trajectory)
        if run is not None:
            run.waited_s += f.started_at - f.submitted_at
            run.finished += 1

    def on_end(self, trajectory: str) -> None:
        run = self._runs.pop(trajectory, None)
        if run is None:
            return
        job = run.key[0]
        lengths = self._lengths.get(job)
        if lengths is None:
            lengths = self._lengths[job] = {}
        lengths[run.turns] = lengths.get(run.turns, 0) + 1
        self._residual.pop(job, None)
        step = run.step
        step.ended += 1
        if run.projected:
            step.projected -= 1
        if step.ended == step.seen and self._steps.get(run.key) is step:  # the step is over
            del self._steps[run.key]

    def slack(self, trajectory: str | None) -> float | None:
        """Seconds ``trajectory`` may be delayed before it is projected to end its step (its
        latest projected finish minus its own); None until it has a projection."""
        run = self._runs.get(trajectory) if trajectory is not None else None
        if run is None or not run.projected:
            return None
        return max(0.0, self._latest(run.step.heap) - run.finish)

    def _latest(self, heap: list) -> float:
        runs = self._runs
        while heap:
            _, _, traj, version = heap[0]
            run = runs.get(traj)
            if run is not None and run.version == version:
                return -heap[0][0]
            heapq.heappop(heap)
        return float("-inf")

    def _learned(self, job: str, k: int) -> float | None:
        """Expected turns left after this one, given ``k`` turns before it, from the trajectories
        of ``job`` that ended (None until one has)."""
        lengths = self._lengths.get(job)
        if not lengths:
            return None
        cache = self._residual.get(job)
        if cache is None:
            cache = self._residual[job] = {}
        value = cache.get(k)
        if value is None:
            longer = [(n, c) for n, c in lengths.items() if n > k]
            total = sum(c for _, c in longer)
            value = cache[k] = sum((n - k - 1) * c for n, c in longer) / total if total else 0.0
        return value
