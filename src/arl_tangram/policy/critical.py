"""Which trajectories are on a step's critical path.

A synchronous RL step ends when its last trajectory ends. Once most trajectories of a (job, step)
have ended, the ones still running are the stragglers that decide the step time, so their actions
are worth more than those of a job that is mid-step. Only the trajectories' identity and end are
needed, which every client can report (closing a session ends a trajectory).

We also tried learning trajectory-length distributions and boosting by expected remaining turns;
inside one job it lost to plain SRPT with aging on every built-in workload (see the issue notes),
so it is not kept.
"""

from __future__ import annotations

from ..core.action import Action


class StepTracker:
    __slots__ = ("_traj_step", "_counts")

    def __init__(self) -> None:
        self._traj_step: dict[str, tuple[str, int | None]] = {}
        self._counts: dict[tuple[str, int | None], list[int]] = {}  # (job, step) -> [seen, ended]

    def is_straggler(self, a: Action, fraction: float) -> bool:
        """Whether ``a`` belongs to a trajectory still running after ``fraction`` of its step's
        trajectories (at least four seen) have ended."""
        traj = a.trajectory
        if traj is None:
            return False
        key = self._traj_step.get(traj)
        if key is None:
            key = self._traj_step[traj] = (a.job, a.step)
            counts = self._counts.get(key)
            if counts is None:
                counts = self._counts[key] = [0, 0]
            counts[0] += 1
        seen, ended = self._counts[key]
        return seen >= 4 and ended >= fraction * seen

    def on_end(self, trajectory: str) -> None:
        key = self._traj_step.pop(trajectory, None)
        if key is not None:
            self._counts[key][1] += 1
