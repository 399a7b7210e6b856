"""Task images on a Ray cluster, the head's side.

Every node pulls for itself: a step naming an image runs on its node's agent, whose own
``SandboxManager`` pulls it into the node's own image store with the ``[[registries]]`` config
the head hands every agent in its sandbox config (``pulls.py``: the step waits for the pull as
part of its run, every action of that node waiting for one image shares one pull, a failed
pull ends the step naming the reference, ``rejected`` or ``infra_error`` as on one machine).

The head learns at every look (``ray_nodes.look_at_agents``, ``NodeAgent.take_news``) which
images each node holds or is pulling (listed again only when they changed), which of its
actions wait for a pull (shown by ``RayRuntime.why_waiting`` as "pulling IMAGE: N of M MB",
as one machine shows it) and its pull counts (``/metrics``, summed over the nodes). From
these it places: a new session whose first step names an image is homed, before that step is
scheduled, on a node that holds the image and has room for the step (``imageplace``: a pure
decision; the home is the engine's own, ``Engine.adopt_session``, so the policy then starts the
step there as any step of a homed session); when no such node has room it is placed as any new
session, and its node pulls. Work the head has just sent a node counts as held there for
``SENT_S`` (its pull starts there before the next look could say so). A prewarm takes a node
count: the image is pulled and its sandboxes started on that many nodes, those holding it first.

The engine knows a pre-homed session as one that lives on its node already, so its first step's
allocation says ``thaw``; the step is sent as the new session's ``create`` it is (``first_step``),
or the node's manager would report a session whose sandbox was lost. One-shots naming an image
go where the engine puts them (it has no home for them to prefer), and their node pulls.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Protocol

from ..core.action import CPU, Action, Allocation, Setup
from ..engine import Engine
from ..managers.sandbox.imagebox import Prewarmed
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.pulls import as_reference, stored_names
from ..managers.sandbox.spec import Exec, Files, FsCall, RunCode
from .imageplace import NodeRoom, holds, prewarm_nodes, session_node
from .ray_nodes import Node

#: seconds a node counts as holding an image the head has just sent work naming: its pull starts
#: there, and its agent's news (every ``MEMBERSHIP_POLL_S``) then lists it, or no longer
SENT_S = 10.0
#: the payloads that name an image (``image``: None for the default one)
IMAGED = (Exec, RunCode, Files, FsCall)


class Head(Protocol):
    """What this part needs of the runtime it serves (``RayRuntime`` is one): a protocol, so that
    this module need not import ``ray_runtime``, which imports it."""

    owner: str
    engine: Engine
    by_index: dict[int, Node]
    nodes_by_id: dict[str, Node]


def image_of(action: Action) -> str | None:
    """The image ``action`` names, if it names one."""
    payload = action.payload
    return payload.image if isinstance(payload, IMAGED) else None


class ClusterImages:
    """What the head knows and does about images on its nodes (the module docstring)."""

    def __init__(self, runtime: Head) -> None:
        self.runtime = runtime
        self.fresh: set[str] = set()  # sessions homed on a node by their image, their first step not sent yet

    # -- what the nodes say ------------------------------------------------------------------------
    def learn(self, node: Node, news: dict | None) -> None:
        """A look's news from ``node``'s agent (``NodeAgent.take_news``)."""
        if not news:
            return
        images = news.get("images")
        if images is not None:
            node.images_mark, names = images
            node.images = frozenset(names)
        node.pulling = dict(news.get("pulling") or {})
        if news.get("image_stats") is not None:
            node.image_stats = news["image_stats"]
        now = time.monotonic()
        for name in [n for n, at in node.sent.items() if now - at >= SENT_S]:
            del node.sent[name]
        self._tell_engine(node)

    def _tell_engine(self, node: Node) -> None:
        """The engine's placement of one-shots and new sessions prefers a node holding their image
        (``CpuPool.hold_images``): what the node holds, and what was just sent there (its pull
        starts before the next look says so)."""
        if node.index is not None and node.state == "alive":
            self.runtime.engine.cpu.hold_images(node.index, node.images | node.sent.keys())

    def names_of(self, action: Action) -> tuple[str, ...]:
        """The names ``action``'s image may be held under in a node's store (``CpuPool.image_names``:
        ``python:3.12`` is held as ``docker.io/library/python:3.12``)."""
        image = image_of(action)
        return tuple(stored_names(image)) if image is not None else ()

    def holds(self, node: Node, names: list[str], now: float) -> bool:
        return holds(names, node.images) or any(now - node.sent.get(n, -math.inf) < SENT_S for n in names)

    def rooms(self, names: list[str]) -> list[NodeRoom]:
        """Every node that takes new work, with its room and whether it holds an image of ``names``."""
        pool = self.runtime.engine.cpu
        now = time.monotonic()
        return [NodeRoom(i, pool.nfree(i), pool.free_mem[i], self.holds(node, names, now))
                for i, node in self.runtime.by_index.items()
                if node.state == "alive" and pool.alive[i] and i not in pool.draining]

    def pulling(self, action_id: str) -> str | None:
        """"pulling IMAGE: N of M MB" while ``action_id`` waits on its node for its image's pull."""
        for node in self.runtime.nodes_by_id.values():
            if action_id in node.running:
                return node.pulling.get(action_id)
        return None

    def stats(self) -> dict | None:
        """The nodes' pull counts and stores' disk use summed (None before any node told)."""
        told = [n.image_stats for n in self.runtime.nodes_by_id.values() if n.serving and n.image_stats]
        if not told:
            return None
        out: dict[str, Any] = {}
        for stats in told:
            for key, value in stats.items():
                if value is None:
                    out.setdefault(key, None)
                else:
                    out[key] = (out.get(key) or 0) + value
        return out

    # -- placement ---------------------------------------------------------------------------------
    def place(self, action: Action) -> int | None:
        """Home a new session whose step ``action`` names an image on a node that holds it and has
        room for the step (``imageplace.session_node``); the node's index, or None (placed as any
        new session)."""
        traj = action.trajectory
        image = image_of(action)
        if traj is None or image is None:
            return None
        engine = self.runtime.engine
        if traj in engine.cpu.homes:  # it lives on a node already (or a step of it was placed)
            return None
        names = stored_names(image)
        node = session_node(self.rooms(names), action.demand.ranges[CPU][0], engine.costs.session_mem_gb)
        if node is not None:
            engine.adopt_session(traj, node)
            self.fresh.add(traj)
        return node

    def unplace(self, action: Action) -> None:
        """``action`` was homed by ``place`` and never queued (refused at once): its home goes."""
        traj = action.trajectory
        if traj in self.fresh:
            self.fresh.discard(traj)
            self.runtime.engine.cpu.detach(traj)

    def first_step(self, node: Node, action: Action, allocation: Allocation) -> Allocation:
        """``action`` is sent to ``node``: an image it names counts as held there (``SENT_S``), and
        the first step of a session ``place`` homed goes as the new session's ``create``."""
        image = image_of(action)
        if image is not None:
            now = time.monotonic()
            new = False
            for name in stored_names(image):
                new = new or name not in node.sent
                node.sent[name] = now
            if new:
                self._tell_engine(node)
        traj = action.trajectory
        if traj is None or traj not in self.fresh:
            return allocation
        self.fresh.discard(traj)
        if allocation.setup is Setup.CREATE:
            return allocation
        return Allocation(allocation.pool, allocation.node, allocation.units, Setup.CREATE, allocation.evict,
                          allocation.reservation, allocation.unmanaged, allocation.share)

    def forget(self, trajectory: str) -> None:
        self.fresh.discard(trajectory)

    def node_lost(self, index: int) -> None:
        """Node ``index`` is lost: the sessions homed there by their image whose first step has not
        been sent lose nothing with it; they are placed again, as any new session."""
        homes = self.runtime.engine.cpu.homes
        for traj in [t for t in self.fresh if homes.get(t) == index]:
            self.fresh.discard(traj)
            self.runtime.engine.cpu.detach(traj)

    # -- names, pulls and prewarms ---------------------------------------------------------------
    def check(self, image: str) -> None:
        """``ImageError`` unless some node holds an image named ``image`` (imported there, say) or
        it is a registry reference (each node its session lands on pulls it)."""
        now = time.monotonic()
        names = [image]
        if any(self.holds(n, names, now) for n in self.runtime.by_index.values() if n.serving):
            return
        as_reference(image, "on any node")

    def prefetch(self, image: str) -> None:
        """A session naming ``image`` was opened: its pull starts now on the node its first step
        will prefer (one that holds it already: nothing to do), so that the step waits for less.
        A failure is met again, and said, by that step."""
        names = stored_names(image)
        rooms = self.rooms(names)
        if any(r.holds for r in rooms):
            return
        chosen = prewarm_nodes(rooms, 1)
        if not chosen:
            return
        node = self.runtime.by_index[chosen[0]]
        for name in names:
            node.sent[name] = time.monotonic()
        node.handle.pull_image.remote(image, self.runtime.owner)

    def _chosen(self, image: str, count: int | None) -> list[Node]:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"nodes: {count!r} is not a positive whole number of nodes")
        rooms = self.rooms(stored_names(image))
        want = 1 if count is None else count
        if want > len(rooms):
            raise ValueError(f"nodes: {want} asked, and the cluster has {len(rooms)} node(s) taking new sandboxes "
                             "(GET /v1/cluster lists them)")
        return [self.runtime.by_index[i] for i in prewarm_nodes(rooms, want)]

    async def _on_nodes(self, nodes: list[Node], image: str, call) -> list[Any]:
        """``call(node)`` (an agent call answering ``("ok", value, _)`` or ``("error", message,
        infra)``) on every node at once; their values, or the first ``ImageError`` naming its node."""
        answers = await asyncio.gather(*(call(n) for n in nodes), return_exceptions=True)
        values = []
        for node, answer in zip(nodes, answers):
            if isinstance(answer, BaseException):  # the agent is gone, or a bug: ours, not the request's
                e = ImageError(f"image: node {node.name} could not take {image!r}: {type(answer).__name__}: "
                               f"{str(answer).strip().splitlines()[-1] if str(answer).strip() else ''}")
                e.infra = True
                raise e
            kind, value, infra = answer
            if kind != "ok":
                e = ImageError(f"{value} (on node {node.name})")
                e.infra = bool(infra)
                raise e
            for name in stored_names(image):
                node.sent[name] = time.monotonic()
            values.append(value)
        return values

    async def pull(self, image: str) -> str:
        """Have ``image`` on one node (one that holds it, else the emptiest), which new sessions
        naming it then prefer; the store's name for it."""
        self.check(image)
        nodes = self._chosen(image, 1)
        owner = self.runtime.owner
        (name,) = await self._on_nodes(nodes, image, lambda n: n.handle.pull_image.remote(image, owner))
        return name

    async def prewarm(self, image: str, n: int, nodes: int | None = None) -> Prewarmed:
        """``image`` pulled on ``nodes`` nodes (default one; those holding it first) and ``n``
        sandboxes of it started on each, within each node's ``max_idle_sandboxes``; the counts
        summed over those nodes. ``ValueError`` naming ``nodes`` when the cluster has fewer."""
        self.check(image)
        chosen = self._chosen(image, nodes)
        owner = self.runtime.owner
        done = await self._on_nodes(chosen, image, lambda node: node.handle.prewarm.remote(image, n, owner))
        parts = [f"node {node.name}: {p.ready} started" + (f" ({p.message})" if p.message else "")
                 for node, p in zip(chosen, done)]
        return Prewarmed(done[0].image, sum(p.requested for p in done), sum(p.ready for p in done),
                         sum(p.idle_total for p in done), sum(p.cap for p in done),
                         f"{n} on each of {len(chosen)} node(s); " + "; ".join(parts))
