"""A Ray node as the head sees it, and how the head sends its agent work and waits on the answers.

Shared by the head's managers (``RemoteSandboxes`` for cores, ``RemoteModels`` for GPUs). Each run
goes over the node's link (``agentlink``): an answer that does not come because the node (or its
agent) died ends the action ``infra_error`` with ``NodeLost`` as its result, which the runtime
re-runs once elsewhere if it is a one-shot. So does a link closed under it: its agent died, or
another head took it over, and the node is lost to this one.

**Looks at the agents** (``look_at_agents``: the head's membership loop, every poll): each agent's
lease is renewed and its expired and rested sessions collected, all agents at once, each under a
timeout, so that one agent whose event loop hung (Ray still lists it alive) cannot stall every
renewal: after ``lease_s`` every other agent would orphan itself, taking every session of the
cluster with it. A call that times out stays pending and is awaited again at the next look (no
second call piles up behind it); a serving node whose agent has not answered for ``lease_s``
since the last renewal it did answer is lost (its lease has run out: whatever it still holds, it
closes). A node still starting (a GPU node loading its weights) is renewed too, never lost for
silence: Ray may not have placed its agent yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..core.action import Action, Allocation, Outcome
from ..core.seam import Completion
from ..link import Caller, PeerGone
from .agent import Replaced
from .agentlink import ignore


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
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set when lost: its Ray calls in flight end
    link: Caller | None = None  # the head's end of its link to the agent (``agentlink``), once it joined
    running: set[str] = field(default_factory=set)
    gpu_index: int | None = None  # in the engine's GPU pool, once it serves models
    died_at: float | None = None  # monotonic time it was lost (its raylet may live on)
    rejoins: int = 0  # new agents started on this Ray node after its agent died
    adopted: bool = False  # its agent outlived an earlier head and is taken over (``NodeAgent.attach``)
    look: asyncio.Future | None = None  # the look at its agent still unanswered (``look_at_agents``)
    renewed_at: float | None = None  # monotonic time the last renewal it answered was sent
    why: str = ""  # why it was lost (``/v1/cluster`` shows it)
    # its images, as its agent last told (``NodeAgent.take_news``; ``ray_images``)
    images: frozenset[str] = frozenset()  # the store's names of the images it holds or is pulling
    images_mark: object = None  # the agent's mark of them: sent back, unchanged ones are not listed again
    pulling: dict[str, str] = field(default_factory=dict)  # action id -> "pulling IMAGE: N of M MB"
    image_stats: dict | None = None  # its pulls' counts and its store's disk use
    sent: dict[str, float] = field(default_factory=dict)  # image name -> when the head last sent work naming it

    @property
    def name(self) -> str:
        return self.ray_id[:12]

    @property
    def serving(self) -> bool:
        """Its agent is up: alive, or draining/drained (it still finishes and hands over its work)."""
        return self.state in ("alive", "draining", "drained")


class Head(Protocol):
    """What the head's managers need of the runtime they serve (``RayRuntime`` is one): who the
    head is, its nodes, and how it counts one lost. A protocol, so that this module and
    ``ray_models`` need not import ``ray_runtime``, which imports them."""

    owner: str
    nodes_by_id: dict[str, Node]
    closing: bool  # shutting down: answers that come now are not reported (the journal re-runs those)

    def node_lost(self, node: Node, why: str) -> None: ...

    def lost_reason(self, session: str, node: Node) -> str: ...


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


#: seconds a look waits for one agent's answer before it goes on without it (the call stays pending)
LOOK_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


@dataclass
class Look:
    """What one look at a node's agent found: sessions it expired, sessions it rested or woke
    (``take_rested``), its images' news (``NodeAgent.take_news``), or why the node is lost to
    this head."""

    node: Node
    expired: list[str] = field(default_factory=list)
    rested: list[tuple[str, str | None]] = field(default_factory=list)
    lost: str | None = None
    news: dict | None = None


async def look_at_agents(nodes: list[Node], lease_s: float, owner: str | None, timeout_s: float) -> list[Look]:
    """Renew the lease of every node's agent and collect its news, all at once, each waited for
    at most ``timeout_s`` (the module docstring)."""
    return list(await asyncio.gather(*(_look(n, lease_s, owner, timeout_s) for n in nodes)))


async def _look(node: Node, lease_s: float, owner: str | None, timeout_s: float) -> Look:
    call = node.look
    if call is None:
        call = node.look = asyncio.ensure_future(_ask(node, lease_s, owner))
        # a look that outlives its wait may end with no one to read it (the head shutting down)
        call.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        sent, expired, news = await asyncio.wait_for(asyncio.shield(call), timeout_s)
    except asyncio.TimeoutError:
        silent = time.monotonic() - node.renewed_at if node.renewed_at is not None else 0.0
        if node.serving and silent > lease_s:
            return Look(node, lost=f"its agent has not answered for {silent:.0f} s: its lease ran out")
        return Look(node)
    except Replaced as e:
        return Look(node, lost=str(e).strip().splitlines()[-1])
    except PeerGone:
        return Look(node, lost="its link closed: its agent died, or another head took it over")
    except agent_gone() as e:
        return Look(node, lost=f"its agent is gone ({type(e).__name__})")
    except Exception as e:  # a bug, a call Ray could not make: looked at again next time
        log.warning("node %s: looking at its agent failed: %s: %s", node.name, type(e).__name__, e)
        return Look(node)
    finally:
        if call.done():
            node.look = None
    node.renewed_at = max(node.renewed_at or sent, sent)
    return Look(node, expired, list(news.get("rested") or ()), news=news)


async def _ask(node: Node, lease_s: float, owner: str | None) -> tuple[float, list[str], dict]:
    """One look (``NodeAgent.look``: the lease renewed, the news taken): over the node's link once
    it has one, over Ray while its agent starts."""
    sent = time.monotonic()
    if node.link is not None:
        expired, news = await node.link.call("look", lease_s, node.images_mark)
    else:
        expired, news = await node.handle.look.remote(lease_s, node.images_mark, owner)
    return sent, list(expired), dict(news)


def send_run(runtime: Head, node: Node, action: Action, allocation: Allocation,
             done: Callable[[Completion], None], after: str | None = None) -> None:
    """Send ``action`` to ``node``'s agent over its link (``allocation`` in the node's own unit ids)
    and call ``done(completion)`` as its answer is read: no task, no future. A link that closes
    under it (the agent died, or another head took it over) loses the node, and the action ends
    ``infra_error`` with ``NodeLost`` as its result, which the runtime re-runs once elsewhere if
    it is a one-shot (``RayRuntime._retry``); so it does when the runtime loses the node for any
    other reason (``node_lost`` closes the link). The agent's run serves sandboxes and models
    alike. ``after``: a one-shot running there on these cores, which this one follows (the lease:
    ``agentlink``)."""
    link = node.link
    if link is None or link.gone is not None:
        done(_lost(runtime, node, action))
        return
    node.running.add(action.id)

    def answered(ok: bool, value: Any) -> None:
        node.running.discard(action.id)
        if runtime.closing:
            return
        if ok:
            done(value)
        elif isinstance(value, PeerGone):
            runtime.node_lost(node, "its link closed: its agent died, or another head took it over")
            done(_lost(runtime, node, action))
        else:  # a bug on either side: never the program's failure
            log.error("node %s: action %s failed in its agent: %r", node.name, action.id, value)
            done(Completion(action.id, Outcome.INFRA_ERROR,
                            message=f"internal error on node {node.name}: {type(value).__name__}: {value}"))

    try:
        if after is None:
            link.request_cb("run", (action, allocation), answered)
        else:
            link.request_cb("follow", (action, allocation, after), answered)
    except Exception as e:  # it could not be sent (pickled): ours, not the program's
        node.running.discard(action.id)
        log.exception("node %s: action %s could not be sent to its agent", node.name, action.id)
        done(Completion(action.id, Outcome.INFRA_ERROR, message=f"internal error: {type(e).__name__}: {e}"))


async def run_on_node(runtime: Head, node: Node, action: Action, allocation: Allocation) -> Completion:
    """``send_run``, awaited: the ``Completion``."""
    answer: asyncio.Future = asyncio.get_running_loop().create_future()
    send_run(runtime, node, action, allocation, lambda c: answer.done() or answer.set_result(c))
    return await answer


def tell(node: Node, method: str, *args: Any) -> None:
    """Call ``method`` on ``node``'s agent over its link for its effect (cancel, resize, close)."""
    if node.link is not None and node.serving:
        node.link.request_cb(method, args, ignore)


def cancel_on_nodes(runtime: Head, action_id: str) -> None:
    """Tell the live agent running ``action_id`` to cancel it (wherever it runs)."""
    for node in runtime.nodes_by_id.values():
        if action_id in node.running:
            tell(node, "cancel", action_id)


def _lost(runtime: Head, node: Node, action: Action) -> Completion:
    if action.trajectory is not None:
        why = runtime.lost_reason(action.trajectory, node)
        return Completion(action.id, Outcome.INFRA_ERROR, message=why, result=NodeLost(node.name))
    return Completion(action.id, Outcome.INFRA_ERROR, message=f"node {node.name} was lost while the action ran",
                      result=NodeLost(node.name))
