"""A Ray node as the head sees it, and how the head waits on its agent's answers.

Shared by the head's managers (``RemoteSandboxes`` for cores, ``RemoteModels`` for GPUs): an
answer that does not come because the node (or its agent) died ends the action ``infra_error``
with ``NodeLost`` as its result, which the runtime re-runs once elsewhere if it is a one-shot.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.action import Action, Allocation, Outcome
from ..core.seam import Completion

if TYPE_CHECKING:
    from .ray_runtime import RayRuntime


class RayUnavailable(RuntimeError):
    """Ray is missing or its cluster cannot be reached; the message names the fix."""


@dataclass(frozen=True, slots=True)
class NodeLost:
    """The result of an action whose node died under it."""

    node: str


@dataclass(eq=False)
class Node:
    """A Ray node as the head sees it."""

    ray_id: str
    address: str
    cores: int
    gpus: int
    handle: Any = None  # the agent actor
    index: int | None = None  # in the engine's CPU pool, once it serves sandboxes
    info: dict = field(default_factory=dict)
    state: str = "starting"  # starting | alive | draining | drained | dead
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    running: set[str] = field(default_factory=set)
    gpu_index: int | None = None  # in the engine's GPU pool, once it serves models
    died_at: float | None = None  # monotonic time it was lost (its raylet may live on)
    rejoins: int = 0  # new agents started on this Ray node after its agent died
    adopted: bool = False  # its agent outlived an earlier head and is taken over (``NodeAgent.attach``)

    @property
    def name(self) -> str:
        return self.ray_id[:12]

    @property
    def serving(self) -> bool:
        """Its agent is up: alive, or draining/drained (it still finishes and hands over its work)."""
        return self.state in ("alive", "draining", "drained")


def ray_module():
    """The ``ray`` package, or ``RayUnavailable`` naming the install line."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("Ray is not installed: pip install 'arl-tangram[ray]'") from None
    return ray


def agent_gone() -> tuple[type[BaseException], ...]:
    """What Ray raises when the actor an answer was to come from (a node's agent) is gone."""
    e = ray_module().exceptions
    return (e.RayActorError, e.NodeDiedError, e.WorkerCrashedError, e.ObjectLostError)


async def run_on_node(runtime: "RayRuntime", node: Node, action: Action, allocation: Allocation) -> Completion:
    """Run ``action`` on ``node``'s agent (``allocation`` in the node's own unit ids) and await its
    ``Completion`` unless ``node`` is lost first; then the action ends ``infra_error`` with
    ``NodeLost`` as its result, which the runtime re-runs once elsewhere if it is a one-shot
    (``RayRuntime._retry``). The agent's ``run`` serves sandboxes and models alike."""
    node.running.add(action.id)
    lost = asyncio.ensure_future(node.lost.wait())
    answer = asyncio.ensure_future(_agent_run(node, action, allocation))
    try:
        await asyncio.wait({lost, answer}, return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            try:
                return answer.result()
            except agent_gone() as e:
                runtime.node_lost(node, f"its agent failed ({type(e).__name__})")
        answer.cancel()
        return _lost(runtime, node, action)
    finally:
        lost.cancel()
        node.running.discard(action.id)


async def _agent_run(node: Node, action: Action, allocation: Allocation) -> Completion:
    return await node.handle.run.remote(action, allocation)


def cancel_on_nodes(runtime: "RayRuntime", action_id: str) -> None:
    """Tell the live agent running ``action_id`` to cancel it (wherever it runs)."""
    for node in runtime.nodes_by_id.values():
        if action_id in node.running and node.serving:
            node.handle.cancel.remote(action_id)


def _lost(runtime: "RayRuntime", node: Node, action: Action) -> Completion:
    if action.trajectory is not None:
        why = runtime.lost_reason(action.trajectory, node)
        return Completion(action.id, Outcome.INFRA_ERROR, message=why, result=NodeLost(node.name))
    return Completion(action.id, Outcome.INFRA_ERROR, message=f"node {node.name} was lost while the action ran",
                      result=NodeLost(node.name))
