"""Which trajectories decide when their step ends.

A synchronous RL step ends when its last trajectory ends, so the trajectories that will finish last
are its critical path: every second their actions wait is a second of step time, while the others
have slack. Two signals mark an action critical (the policy then boosts its priority):

* *stragglers*: once ``fraction`` of a (job, step)'s trajectories (at least four seen) have ended,
  the ones still running decide the step. Only trajectory identity and end are needed, which every
  client reports (closing a session ends a trajectory).
* *projected last*: each action's trajectory gets a projected finish ``now + predicted work +
  remaining turns x seconds per turn``, and the action is critical when that lies within ``window``
  (a fraction of the step's remaining horizon) of the latest projected finish of its step.
  Remaining turns are the client's ``Action.remaining_turns`` when sent; otherwise learned per job
  from the lengths (in turns) of the trajectories that ended, as the expected residual
  ``E[L - k - 1 | L > k]`` after ``k`` turns (unknown until one has ended). Seconds per turn are
  learned per job: the mean interval between a trajectory's consecutive submissions (LLM gap + the
  previous action's ACT), decayed so that it follows the run.

Why: shortest-first ordering (SRPT) alone is blind to the step and, on a quota-bound pool, moved
waiting onto exactly the long trajectories (search, seeds 0-4: step time up to 7% behind the best
baseline at 0.5x and 1x, issue 13). With the clients' remaining turns it is 4-6% ahead on the worst
seed and 9-12% on the mean, for 1.8% of average ACT on search at 0.5x (0.6% at 1x). A window of
0.05 was kept over 0.1 and 0.2, which gained more step time on search (up to 21%) but gave up ACT
there and on mopd (measured: window 0.2 cost 4% of ACT on search at 0.5x).

Measured and dropped: ordering every action by remaining trajectory time (``key -= w * remaining``)
gives up SRPT's ACT; the learned residual alone cannot tell a long search trajectory from a short
one at its start (lengths are independent of everything a policy sees), so without the client's
count the step time stays behind on search (worst seed 0.93x); a client count blurred by a
lognormal factor (sigma 0.5) also fell to 0.93x, so the signal is only as good as the client's plan.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..core.action import Action

StepKey = tuple[str, "int | None"]
STRAGGLER = 2
PROJECTED = 1


@dataclass(slots=True)
class _Step:
    seen: int = 0
    ended: int = 0
    projected: int = 0  # trajectories with a projected finish
    heap: list = field(default_factory=list)  # (-finish, seq, trajectory, version); stale ones dropped lazily


@dataclass(slots=True)
class _Run:
    key: StepKey
    step: "_Step"
    turns: int = 0
    last_submit: float = 0.0
    finish: float = 0.0
    version: int = 0
    projected: bool = False


class CriticalPath:
    __slots__ = ("straggler_fraction", "window", "use_projection", "decay", "_runs", "_steps", "_cycle",
                 "_lengths", "_residual", "_seq")

    def __init__(self, straggler_fraction: float = 0.8, window: float = 0.05, use_projection: bool = True,
                 decay: float = 0.02) -> None:
        self.straggler_fraction = straggler_fraction
        self.window = window
        self.use_projection = use_projection
        self.decay = decay
        self._runs: dict[str, _Run] = {}
        self._steps: dict[StepKey, _Step] = {}
        self._cycle: dict[str, float] = {}  # job -> seconds per turn
        self._lengths: dict[str, dict[int, int]] = {}  # job -> {turns: trajectories that ended after them}
        self._residual: dict[tuple[str, int], float | None] = {}
        self._seq = itertools.count()

    def on_submit(self, a: Action, now: float, predicted_s: float) -> int:
        """Record ``a``'s turn; whether its trajectory is on its step's critical path: ``STRAGGLER``,
        ``PROJECTED`` (last by its projected finish) or 0."""
        traj = a.trajectory
        if traj is None:
            return 0
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
        if step.seen >= 4 and step.ended >= self.straggler_fraction * step.seen:
            return STRAGGLER
        if not self.use_projection:
            return 0
        remaining = a.remaining_turns if a.remaining_turns is not None else self._learned(job, k)
        cycle = self._cycle.get(job)
        if remaining is None or cycle is None:
            return 0
        run.finish = now + predicted_s + remaining * cycle
        run.version += 1
        if not run.projected:
            run.projected = True
            step.projected += 1
        heapq.heappush(step.heap, (-run.finish, next(self._seq), traj, run.version))
        if step.projected < 2:  # the first projection of a step has nothing to be compared with
            return 0
        latest = self._latest(step.heap)
        return PROJECTED if run.finish >= latest - self.window * max(0.0, latest - now) else 0

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
        """Expected turns left after this one, given ``k`` turns before it, from ended trajectories."""
        lengths = self._lengths.get(job)
        if not lengths:
            return None
        key = (job, k)
        if key in self._residual:
            return self._residual[key]
        value = None
        if lengths:
            longer = [(n, c) for n, c in lengths.items() if n > k]
            total = sum(c for _, c in longer)
            value = sum((n - k - 1) * c for n, c in longer) / total if total else 0.0
        self._residual[key] = value
        return value

    def on_end(self, trajectory: str) -> None:
        run = self._runs.pop(trajectory, None)
        if run is None:
            return
        job = run.key[0]
        lengths = self._lengths.setdefault(job, {})
        lengths[run.turns] = lengths.get(run.turns, 0) + 1
        self._residual = {k: v for k, v in self._residual.items() if k[0] != job}
        step = run.step
        step.ended += 1
        if run.projected:
            step.projected -= 1
        if step.ended == step.seen and self._steps.get(run.key) is step:  # the step is over
            del self._steps[run.key]
