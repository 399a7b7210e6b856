"""The node agent: one per node of a multi-node deployment, owning that node's sandboxes.

The head's engine decides; the agent carries out what it started on this node with the node's own
``SandboxManager`` (bubblewrap + cgroups, as on one machine) and answers each ``run`` with the
action's ``Completion``. All process, pipe and file work happens here, never in the head's event
loop: the head moves decisions and small results.

The class knows nothing of Ray (``RayRuntime`` wraps it as an actor pinned to its node), so it is
tested like any manager. Sessions the manager expires are collected here and picked up by the
head's membership loop (``take_expired``), which ends them in the engine.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Callable

from ..core.action import Action, Allocation
from ..core.seam import Completion, Report
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spec import SandboxConfig
from .host import host_cpus, memory_gb


class NodeAgent:
    """Runs sandbox actions on this node for a remote engine. ``cores``: what the cluster gives
    this node (Ray's ``CPU`` resource); ``cpu_offset`` spreads several agents of one machine (test
    clusters) over its CPUs."""

    def __init__(self, name: str, cores: int, config: SandboxConfig | None = None, cpu_offset: int = 0,
                 cpus: tuple[int, ...] | None = None) -> None:
        """``cpus``: exactly these host CPUs (a sandbox worker of one machine uses its engine's)."""
        self.name = name
        self.cores = cores
        self.config = config or SandboxConfig()
        self.cpu_offset = cpu_offset
        self.cpus = cpus
        self.manager: SandboxManager | None = None
        self._waiting: dict[str, Callable[[Completion], None]] = {}  # action id -> where its completion goes
        self._expired: list[str] = []
        self.problem = ""

    async def start(self) -> dict:
        """Start the sandbox manager; returns what the head shows of this node. A node where
        sandboxes cannot run (no bubblewrap, say) reports why and gets no sandbox actions."""
        mine = host_cpus()
        cpus = self.cpus or tuple(mine[(self.cpu_offset + i) % len(mine)] for i in range(max(1, self.cores)))
        config = self.config.model_copy(update={"cpus": cpus})
        info = {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "cores": self.cores,
                "memory_gb": round(memory_gb(), 1), "host_cpus": list(cpus)}
        try:
            self.manager = SandboxManager(config, self._report, self._expired.append)
            await self.manager.start_up()
        except Exception as e:  # isolation unavailable: the node serves no sandboxes, and says why
            self.manager = None
            self.problem = f"{type(e).__name__}: {e}"
            return {**info, "sandboxes": False, "isolation": None, "cgroups": None, "problem": self.problem}
        root = self.manager.root
        return {**info, "sandboxes": True, "isolation": self.manager.mode.value,
                "cgroups": ("v2" if root.v2 else "v1") if root is not None else None, "problem": ""}

    def _report(self, r: Report) -> None:
        if isinstance(r, Completion):
            done = self._waiting.pop(r.action_id, None)
            if done is not None:
                done(r)

    def run_cb(self, action: Action, allocation: Allocation, done: Callable[[Completion], None]) -> None:
        """``run`` that calls ``done(completion)`` from the manager's report itself (a sandbox
        worker answers its engine a loop pass sooner than through a future)."""
        if self.manager is None:
            raise RuntimeError(f"node {self.name} runs no sandboxes: {self.problem}")
        self._waiting[action.id] = done
        self.manager.start(action, allocation)

    async def run(self, action: Action, allocation: Allocation) -> Completion:
        """Run one action the head's engine started on this node; its ``Completion``."""
        fut = asyncio.get_running_loop().create_future()
        self.run_cb(action, allocation, lambda c: fut.done() or fut.set_result(c))  # done: the caller gave up
        return await fut

    def cancel(self, action_id: str) -> None:
        if self.manager is not None:
            self.manager.cancel(action_id)

    def close_session(self, trajectory: str) -> None:
        if self.manager is not None:
            self.manager.close_session(trajectory)

    def take_expired(self) -> list[str]:
        out, self._expired[:] = list(self._expired), []
        return out

    def sessions(self) -> list[str]:
        return list(self.manager.sessions) if self.manager is not None else []

    def reset(self) -> int:
        """Close every session this agent holds (a new head does this to an agent it inherits:
        the old head's sessions are not its own). Returns how many were closed."""
        held = self.sessions()
        for traj in held:
            self.close_session(traj)
        return len(held)

    async def shut_down(self) -> None:
        if self.manager is not None:
            await self.manager.shut_down()
