"""The head's ``Pool.GPU`` manager on Ray: model calls and copies go to the agent of their node.

The head may have no GPU and never loads weights: each GPU node's agent loads every service into
its own host memory and reports its GPUs (discovered on the node) and the services' sizes; the
engine's GPU pool numbers all nodes' GPUs globally (``Engine.add_gpu_node``), and this manager maps
a global id to (node, the node's own GPU id). A batch started on a copy, a prefetch, an eviction
go to that node's agent with the node's ids; a batch's answer is its ``Completion``, a prefetch
ends in ``Loaded`` once the agent says the copy is resident.

A node lost with batches running: they end ``infra_error`` with ``NodeLost`` (``run_on_node``) and
the runtime re-runs each once elsewhere under the same id (``RayRuntime._retry``); its prefetches
were dropped by the engine and report nothing. Requests are checked here, before anything crosses
to a node, against the services' cards the first GPU node sent (``spec.call_problem``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from ..core.action import Action, Allocation
from ..core.records import Load, Loaded
from ..core.seam import Sink
from ..managers.models.spec import ModelCard, ModelServiceConfig, call_problem
from ..managers.tasks import TaskSet
from .agent import Replaced
from .ray_nodes import Head, Node, agent_gone, cancel_on_nodes, run_on_node

if TYPE_CHECKING:
    from ..engine import Engine

log = logging.getLogger(__name__)


class ModelsHead(Head, Protocol):
    """The head as ``RemoteModels`` sees it: a ``Head`` with its engine (whose ``loading`` says
    whether a prefetch still counts)."""

    engine: Engine


class RemoteModels:
    """Implements ``core.seam.ModelHost`` for the head; the model services' catalogue for the
    API and the server (``services``, ``loaded``, ``failed``, ``validate``, as ``ModelManager``)."""

    def __init__(self, runtime: ModelsHead, sink: Sink, services: list[ModelServiceConfig]) -> None:
        self.runtime = runtime
        self.sink = sink
        self.tasks = TaskSet(sink, "gpu-nodes")
        self.services = {s.name: s for s in services}
        self.loaded: dict[str, ModelCard] = {}  # what the first GPU node loaded
        self.failed: dict[str, str] = {}
        self.homes: dict[int, tuple[Node, int]] = {}  # global GPU id -> (its node, the node's own id)

    # -- membership (``RayRuntime`` calls these) ---------------------------------------------------
    def learn(self, info: dict) -> None:
        """The services as the first GPU node loaded them (every node loads the same configs)."""
        if not self.loaded and not self.failed:
            self.loaded = dict(info.get("model_cards") or {})
            self.failed = dict(info.get("model_failed") or {})

    def attach(self, node: Node, first_gpu: int, gpus: int) -> None:
        """``node``'s GPUs are global ids ``first_gpu`` .. ``first_gpu + gpus - 1``."""
        for local in range(gpus):
            self.homes[first_gpu + local] = (node, local)

    def validate(self, model: str, op: str, tokens: Any, min_len: int) -> str | None:
        if model in self.services and not self.loaded and not self.failed:
            return f"service: model {model!r} is not loaded yet: no GPU node has joined the cluster"
        return call_problem(self.loaded, self.failed, model, op, tokens, min_len)

    # -- the ModelHost protocol --------------------------------------------------------------------
    def _node(self, gpus: tuple[int, ...]) -> Node:
        return self.homes[gpus[0]][0]

    def _local(self, gpus: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.homes[g][1] for g in gpus)

    def start(self, action: Action, allocation: Allocation) -> None:
        node = self._node(allocation.units)
        local = replace(allocation, units=self._local(allocation.units),
                        evict=tuple((m, self._local(g)) for m, g in allocation.evict))
        self.tasks.run(action, lambda: run_on_node(self.runtime, node, action, local))

    def cancel(self, action_id: str) -> None:
        cancel_on_nodes(self.runtime, action_id)

    def prefetch(self, load: Load) -> None:
        node = self._node(load.block)
        self.tasks.spawn(self._prefetch(node, load.key, load.model, self._local(load.block), load.per_gpu_gb))

    async def _prefetch(self, node: Node, key: str, model: str, block: tuple[int, ...], per_gpu_gb: float) -> None:
        lost = asyncio.ensure_future(node.lost.wait())
        copy = asyncio.ensure_future(node.handle.prefetch.remote(key, model, block, per_gpu_gb, self.runtime.owner))
        try:
            await asyncio.wait({lost, copy}, return_when=asyncio.FIRST_COMPLETED)
            error = copy.exception() if copy.done() else None
            if isinstance(error, agent_gone()):  # the node's copies and loads leave the engine with it
                self.runtime.node_lost(node, f"its agent failed ({type(error).__name__})")
            elif isinstance(error, Replaced):  # another head took the agent over: not our node any more
                self.runtime.node_lost(node, str(error).strip().splitlines()[-1])
            elif error is not None:  # the first call that needs the copy makes it, and reports
                log.error("prefetching %s onto node %s's GPUs %s failed: %s", model, node.name, block, error)
        finally:
            lost.cancel()
            copy.cancel()
        if key in self.runtime.engine.loading:  # else its node was lost, and the engine dropped it
            self.sink(Loaded(key))

    def evict(self, model: str, gpus: tuple[int, ...]) -> None:
        node = self._node(gpus)
        if node.state == "alive":
            node.handle.evict.remote(model, self._local(gpus), self.runtime.owner)

    def close_session(self, trajectory: str) -> None:
        pass

    async def start_up(self) -> None:
        pass  # copies are placed as GPU nodes join (RayRuntime._join)

    async def shut_down(self) -> None:
        await self.tasks.close()
