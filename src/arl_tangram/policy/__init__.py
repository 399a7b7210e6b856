"""Scheduling policies: decisions only. ``make_policy(name)`` builds one by its registry name."""

from __future__ import annotations

from typing import Callable

from .action_level import FIFO, TANGRAM, ActionLevelPolicy, Options, fifo_policy, tangram_policy
from .base import (MOVE_S, Costs, Decision, EngineView, Evict, Follow, Grow, Policy, Prefetch, Profile, Release, Reserve,
                   Shrink, Start, Wait, pool_wait)
from .predictor import DurationPredictor
from .static import InfeasiblePolicy, TaskIsolatedPolicy, TrajectoryStaticPolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    "tangram": tangram_policy,
    "trajectory-static": TrajectoryStaticPolicy,
    "task-isolated": TaskIsolatedPolicy,
    "fifo": fifo_policy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None


__all__ = [
    "FIFO", "MOVE_S", "POLICIES", "TANGRAM", "ActionLevelPolicy", "Costs", "Decision", "DurationPredictor", "EngineView",
    "Evict", "Follow", "Grow", "InfeasiblePolicy", "Options", "Policy", "Prefetch", "Profile", "Release", "Reserve",
    "Shrink", "Start", "TaskIsolatedPolicy", "TrajectoryStaticPolicy", "Wait", "fifo_policy", "make_policy", "pool_wait",
    "tangram_policy",
]
