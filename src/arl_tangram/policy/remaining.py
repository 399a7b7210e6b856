"""Which trajectories decide when their step ends, from how much of each remains.

A synchronous RL step ends when its last trajectory does, so the trajectory projected to finish
last is the step's critical path: every second its actions wait is a second of step time, while a
trajectory projected to finish well before it has slack. Shortest-first ordering alone (SRPT) is
blind to this and, on a quota-bound pool, moved waiting onto exactly the long trajectories
(search: step time 4-7% behind fifo at 0.5x and 1x; issue 13).

Each action's trajectory gets a projected finish ``now + predicted work + remaining turns x seconds
per turn``:

* remaining turns: the client's ``Action.remaining_turns`` when it sends one; otherwise learned
  per job from the lengths (in turns) of the trajectories that have ended, as the expected residual
  ``E[L - k - 1 | L > k]`` after ``k`` turns; unknown until some trajectory of the job has ended;
* seconds per turn: per job, the mean interval between consecutive submissions of a trajectory
  (LLM gap + the previous action's ACT), decayed so it follows the run.

An action is *critical* when its trajectory's projected finish lies within ``window`` (a fraction of
the step's remaining horizon) of the latest projected finish among its step's trajectories.

Alternatives measured and dropped (issue 13 notes): ordering every action by remaining
trajectory time (``key -= w * remaining``) wrecked SRPT's ACT on code_agent; the earlier
"expected remaining turns" boost without the projected-finish comparison lost to plain SRPT.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from ..core.action import Action


@dataclass(slots=True)
class _Run:
    key: tuple[str, int | None]
    turns: int = 0
    projected: bool = False
    last_submit: float = 0.0
    finish: float = 0.0
    version: int = 0


class CriticalPath:
    __slots__ = ("window", "decay", "_runs", "_steps", "_active", "_projected", "_cycle", "_lengths", "_residual", "_seq")

    def __init__(self, window: float = 0.1, decay: float = 0.02) -> None:
        self.window = window
        self.decay = decay
        self._runs: dict[str, _Run] = {}
        self._steps: dict[tuple[str, int | None], list[tuple[float, int, str, int]]] = {}
        self._active: dict[tuple[str, int | None], int] = {}
        self._projected: dict[tuple[str, int | None], int] = {}  # trajectories with a projected finish
        self._cycle: dict[str, float] = {}
        self._lengths: dict[str, dict[int, int]] = {}
        self._residual: dict[tuple[str, int], float | None] = {}
        self._seq = itertools.count()

    def on_submit(self, a: Action, now: float, predicted_s: float) -> bool:
        """Record ``a``'s turn and say whether its trajectory is on its step's critical path."""
        traj = a.trajectory
        if traj is None:
            return False
        run = self._runs.get(traj)
        job = a.job
        if run is None:
            key = (job, a.step)
            run = self._runs[traj] = _Run(key)
            self._active[key] = self._active.get(key, 0) + 1
        elif run.turns:
            interval = now - run.last_submit
            cycle = self._cycle.get(job)
            self._cycle[job] = interval if cycle is None else cycle + self.decay * (interval - cycle)
        k = run.turns
        run.turns = k + 1
        run.last_submit = now
        remaining = a.remaining_turns if a.remaining_turns is not None else self._learned(job, k)
        cycle = self._cycle.get(job)
        if remaining is None or cycle is None:
            return False
        run.finish = now + predicted_s + remaining * cycle
        run.version += 1
        if not run.projected:
            run.projected = True
            self._projected[run.key] = self._projected.get(run.key, 0) + 1
        heap = self._steps.get(run.key)
        if heap is None:
            heap = self._steps[run.key] = []
        heapq.heappush(heap, (-run.finish, next(self._seq), traj, run.version))
        if self._projected[run.key] < 2:  # the first projection of a step has nothing to be compared with
            return False
        latest = self._latest(heap)
        return run.finish >= latest - self.window * max(0.0, latest - now)

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
        key = (job, k)
        if key in self._residual:
            return self._residual[key]
        lengths = self._lengths.get(job)
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
        if run.projected:
            self._projected[run.key] -= 1
        left = self._active[run.key] - 1
        if left:
            self._active[run.key] = left
        else:
            del self._active[run.key]
            self._steps.pop(run.key, None)
            self._projected.pop(run.key, None)
