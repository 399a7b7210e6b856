"""The multi-node runtime on Ray: one engine in the head, one ``NodeAgent`` per node.

Shape (docs/design.md, "Many nodes"): the head process holds the engine and policy (the single
decision maker), the journal and the HTTP server; every Ray node with CPUs gets a ``NodeAgent``
actor pinned to it (node affinity, not soft) that owns the node's sandboxes. The engine's CPU pool
is the union of the agents' cores; an action started on node ``i`` goes to agent ``i``, and the
agent's answer is its ``Completion``. Each action's run and answer cross the node's link, one
connection per node opened as it joins (``agentlink``: a frame each way, no Ray call per action);
Ray places the agents and carries starts, take-overs, moves (through the object store), pulls and
prewarms.

With model services, every node with Ray's ``GPU`` resource gets an agent that holds all of the
node's GPUs (Ray then shows it exactly those) and serves the services there (``ray_models``: the
head's GPU manager, and why the head loads no weights). A model batch is a one-shot: lost with its
node, it re-runs once on another copy.

Membership is polled from Ray's node table: nodes that join get an agent and join the engine's
pool; a node that dies (raylet gone, or its agent gone) leaves the pool at once, its running
one-shots are re-run once on another node (same id: the idempotency key), and its sessions end
``infra_error`` with a reason that later calls get back as ``SessionGone`` (404 over HTTP). A node
whose agent died while its raylet lives gets a new agent later (``REJOIN_AFTER_S``).

**Task images.** A step naming an image (a registry reference, or an image imported on a node)
runs on its node as on one machine: the node's agent pulls it into the node's own store, the step
waiting for the pull, and every step of that node waiting for one image shares one pull. The head
places a new session on a node that holds its image when one has room, shows a step waiting for
its node's pull as one machine does, and prewarms an image on a number of nodes (``ray_images``).

**Drain and move.** ``drain_node`` takes a node out of placement at once (state ``draining``: no
new session or one-shot lands there; the engine decides, ``Engine.drain_cpu_node``); its running
actions finish; then each of its sessions moves to another node between two of its steps
(``Engine.move_session`` picks the node, ``RemoteSandboxes`` carries the session: its rest blob,
made on the old node's agent (the session put to rest there: its interpreter's state, its shell and
its files), passed through Ray's object store to the new node's agent and woken there by its next
step as any rested session wakes; a session a blob cannot hold, an image session, goes as a
snapshot of its files, and its next answer says its interpreter and shell restarted). A step that
arrives meanwhile waits for the move (each session's steps and its move take one lock, in order);
once the node holds no session and runs nothing its state is ``drained``. The same carry makes the
policy's migration real: a step the engine places away from its session's live home node
(``Setup.RESTORE``) brings the session, but only whole: one whose state would lose something (an
open file, a generator, an image session's processes) stays, and the step runs at home, its home
set again in the engine (it shares that node's cores for this step) and pinned there
(``CpuPool.pin``: the policy moves it for balance no more). Only a drain, or the node's loss, takes
such a session off its node.

**The head restarts, sessions stay.** Agents are detached actors named after their node
(``agent_name``): they outlive the head's Ray driver, and with them their sandboxes, files and
processes (a session's Python state included). The head renews each agent's lease at every look
(``MEMBERSHIP_POLL_S``; ``lease_s``, default ``LEASE_S``), every agent at once, each under a timeout
(``ray_nodes.look_at_agents``: one hung agent stalls no other's renewal), agents still starting
included; the looks begin before the first joins end (a GPU node loads its weights in its agent's
start, minutes maybe, while the other nodes' leases, taken-over agents' too, must be renewed). An
agent's lease runs from the end of its start. A restarted head on the same Ray cluster finds each
node's agent by name and takes it over (``NodeAgent.attach``): the one-shots it ran for the dead
head are cancelled (the journal re-runs those whose acceptance it holds), a session's step in flight
runs to its end (the journal ends it ``infra_error``: its answer is lost), and its sessions are an
inventory. The service then re-attaches the journal's open sessions found there (``adopt_live``:
homed on their node again, their next step sees their files and their Python state) and the agent
closes the rest (``prune_live``). A session whose agent died meanwhile ends as before, saying so. An
agent whose lease runs out with no head closes everything and exits: nothing is left that nobody
owns. Heads are told apart by ``owner`` (``tangram serve``: the UUID in its journal): a second head
finds the agents held (``HeldElsewhere``) and uses none of them; a head whose agent another took
over (its lease ran out while it lived: a hung head) hears ``Replaced`` at its next renewal or run
and counts the node lost, the reason in ``/v1/cluster``. The head must join the cluster as a driver
(``ray.init(address=...)`` of a cluster started with ``ray start``), never start one of its own:
that one would die with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from dataclasses import replace
from typing import Any

from ..core.action import Action, Allocation, Finished, Outcome
from ..managers.sandbox.imagebox import Prewarmed
from ..core.cluster import Cluster, CpuNode
from ..core.seam import Completion, Pool, Sink
from ..managers.models.spec import ModelServiceConfig
from ..managers.sandbox.spec import Fork, RunCode, SandboxConfig
from ..managers.tasks import TaskSet
from ..policy import Costs, Policy, Profile, Wait
from ..waits import DEFAULT_MAX_QUEUE_S
from . import agentlink
from .agent import NodeAgent
from .ray_images import ClusterImages
from .ray_nodes import (LOOK_TIMEOUT_S, Node, NodeLost, RayUnavailable, cancel_on_nodes, look_at_agents, ray_module,
                        run_on_node, send_run, tell)

__all__ = ["Node", "NodeLost", "RayRuntime", "RayUnavailable", "RemoteSandboxes", "connect"]
from .base import Runtime

log = logging.getLogger(__name__)

#: seconds between looks at Ray's node table (joins, deaths) and the agents' expired sessions
MEMBERSHIP_POLL_S = 0.5
#: seconds between warnings that a node's agent has not started (a GPU node loads weights first)
AGENT_START_WARN_S = 60.0
#: a node whose agent died while Ray still lists the node gets a new agent this long after, at
#: most ``MAX_REJOINS`` times (an agent killed for memory, say; not one that dies at every start)
REJOIN_AFTER_S = 30.0
MAX_REJOINS = 3
#: the moves whose p50 prices the next move for balance (``RayRuntime.reprice_moves``): enough that one
#: slow carry does not reprice it, few enough to follow a cluster whose load changes
REPRICE_MOVES = 16
#: seconds an agent keeps its work with no head renewing its lease: long enough for a head killed
#: with -9 to be started again (its Python, Ray's connection, the journal: 5-15 s on the loaded
#: 2-core VM), short enough that a head that does not come back leaves nothing running for long
LEASE_S = 60.0


def agent_name(ray_id: str) -> str:
    """The detached agent of a Ray node, by name: a restarted head finds it again."""
    return f"tangram-agent-{ray_id}"


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address`` (``auto`` or ``HOST:PORT``) as a driver; False if this
    process was connected already."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    host, _, port = address.rpartition(":")
    if host and port.isdigit():  # Ray itself retries an unreachable address for two minutes
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError as e:
            raise RayUnavailable(f"--ray {address}: nothing answers there ({e.strerror or e}); start a cluster "
                                 "with `ray start --head` on the head node (and `ray start --address HEAD:6379` "
                                 "on the others), or give the address of a running one") from None
    try:
        ray.init(address=address, namespace="tangram", log_to_driver=False, configure_logging=False)
    except Exception as e:  # unreachable, or no cluster at all
        raise RayUnavailable(f"--ray {address}: cannot reach a Ray cluster ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); start one with `ray start --head` "
                             "on the head node and `ray start --address HEAD:6379` on the others, or give "
                             "the address of a running cluster") from None
    return True


#: what ``RemoteSandboxes.carry`` returns for a move for balance not made (the session stays home)
STAY = "stay"


class RemoteSandboxes:
    """The ``Pool.CPU`` manager of the head: each action goes to the agent of its node; a session
    whose step lands on another node than its files (a move) has them carried there first."""

    def __init__(self, runtime: "RayRuntime", sink: Sink) -> None:
        self.runtime = runtime
        self.sink = sink
        self.tasks = TaskSet(sink, "nodes")
        self.homes: dict[str, Node] = {}  # session -> the node holding its sandbox state
        self._locks: dict[str, asyncio.Lock] = {}  # session -> its steps and moves, one at a time
        self._stepping: dict[str, asyncio.Future | None] = {}  # session -> its step sent without the lock
        self.moves = 0  # sessions carried to another node
        self.move_s: deque[float] = deque(maxlen=4096)  # how long each recent carry took (what a waiting step waited)
        # what each recent move cost whole: its carry and the wake its session's next step paid on
        # the new node (``Completion.setup_s``); the price of a move for balance (``reprice_moves``)
        self.move_cost_s: deque[float] = deque(maxlen=REPRICE_MOVES)
        self._carried: dict[str, float] = {}  # session moved -> its carries' seconds, until its next step ends
        self.stayed: dict[str, str] = {}  # session -> why a move for balance left it home
        self.restarted: dict[str, str] = {}  # session -> what its next answer says of a move that lost its processes

    def start(self, action: Action, allocation: Allocation) -> None:
        node = self.runtime.by_index[allocation.node]
        allocation = self.runtime.images.first_step(node, action, allocation)
        traj = action.trajectory
        if traj is None:  # no task: the answer is reported as the link reads it
            send_run(self.runtime, node, action, allocation, self.sink)
            return
        home = self.homes.setdefault(traj, node)  # where it is until a move says otherwise
        if home is node and self._plain(traj, action):
            # home, nothing to carry or to tell: sent as a one-shot is, no task, no lock; a move
            # or a step that must carry waits for its answer (``_settled``)
            self._stepping[traj] = None
            send_run(self.runtime, node, action, allocation, lambda done: self._stepped(traj, done))
            return
        self.tasks.run(action, lambda: self._step(traj, node, action, allocation))

    def _plain(self, traj: str, action: Action) -> bool:
        lock = self._locks.get(traj)
        return ((lock is None or not lock.locked()) and traj not in self._stepping and traj not in self.restarted
                and not isinstance(action.payload, Fork))

    def _stepped(self, traj: str, done: Completion) -> None:
        waiter = self._stepping.pop(traj, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._carried:  # (a step at home, the usual case, pays no call here)
            self._woken(traj, done)
        self.sink(done)

    def _woken(self, traj: str, done: Completion) -> None:
        """A session's step ended: where it was its first since a move, that move's whole cost is
        known (the carry, then this step's state work: the session woken on its new node)."""
        carried = self._carried.pop(traj, None)
        if carried is not None and done.outcome is Outcome.OK:
            self.move_cost_s.append(carried + done.setup_s)
            self.runtime.reprice_moves()

    async def _settled(self, traj: str) -> None:
        """Wait for ``traj``'s step sent without its lock (the caller holds the lock, so no other
        is sent meanwhile)."""
        while traj in self._stepping:
            waiter = self._stepping[traj]
            if waiter is None:
                waiter = self._stepping[traj] = asyncio.get_running_loop().create_future()
            await waiter

    def chains(self, action: Action) -> bool:
        """``core.seam.Chainer``: a one-shot's run on an agent can take a follower."""
        return action.trajectory is None and isinstance(action.payload, RunCode)

    def follow(self, action: Action, allocation: Allocation, after: str) -> bool:
        """``core.seam.Chainer``: the agent running ``after`` starts ``action`` on its cores the
        moment ``after``'s sandbox answers (``agentlink``). Not taken (False) when ``after`` is not
        running on a live node's agent."""
        node = self.runtime.by_index.get(allocation.node) if allocation.node is not None else None
        if node is None or node.state != "alive" or after not in node.running or not self.chains(action):
            return False
        allocation = self.runtime.images.first_step(node, action, allocation)
        send_run(self.runtime, node, action, allocation, self.sink, after=after)
        return True

    def _lock(self, trajectory: str) -> asyncio.Lock:
        lock = self._locks.get(trajectory)
        if lock is None:
            lock = self._locks[trajectory] = asyncio.Lock()
        return lock

    async def _step(self, traj: str, node: Node, action: Action, allocation: Allocation) -> Completion:
        """A session's step on ``node``, after its move there if its files are elsewhere. A move
        for balance that would lose the session's Python state is not made: the step runs on its
        home node (re-homed there in the engine), sharing cores there for this step."""
        async with self._lock(traj):
            await self._settled(traj)
            old = self.homes.get(traj)
            if old is not None and old is not node and old.state != "dead":
                balance = old.state == "alive"  # a draining home moves its sessions whatever they hold
                problem = await self.carry(traj, old, node, balance=balance)
                if problem is STAY:
                    node = old
                    self._home_again(traj, old)
                elif problem is not None:
                    return Completion(action.id, Outcome.INFRA_ERROR, message=str(problem))
            self.homes[traj] = node
            done = await run_on_node(self.runtime, node, action, allocation)
            self._woken(traj, done)
            note = self.restarted.pop(traj, None)
            if note is not None:  # its files came, its processes' state could not: the answer says so
                done = replace(done, message=f"{note}; {done.message}" if done.message else note)
                if hasattr(done.result, "message"):
                    done.result.message = done.message
            if isinstance(action.payload, Fork) and done.outcome is Outcome.OK:
                for child in action.payload.children:  # made beside their source
                    self.homes[child] = node
            return done

    def _home_again(self, traj: str, home: Node) -> None:
        """The engine placed ``traj`` away but it stays: home again in the engine, so its next
        step is placed (or queued) there."""
        cpu = self.runtime.engine.cpu
        if home.index is None:
            return
        try:
            cpu.attach(traj, home.index, cpu.session_mem.get(traj, self.runtime.engine.costs.session_mem_gb))
        except Exception as e:  # no memory left there in the ledger: the next step is placed anew
            log.info("session %s stays on node %s, but the engine cannot home it there: %s", traj, home.name, e)

    async def move(self, traj: str, node: Node, balance: bool = True) -> str | None:
        """Move session ``traj`` to ``node`` now, between two of its steps (what a step placed
        there does first; the engine is not asked). None when moved; else why not (``balance``:
        a session whose state cannot be carried whole stays)."""
        async with self._lock(traj):
            await self._settled(traj)
            old = self.homes.get(traj)
            if old is None or old is node:
                return None if old is node else f"session {traj} has no home"
            problem = await self.carry(traj, old, node, balance=balance)
            if problem is STAY:
                return self.stayed.get(traj, "it stays")
            if problem is None and node.index is not None:
                self._home_again(traj, node)
            return problem

    async def carry(self, traj: str, old: Node, new: Node, balance: bool = False) -> str | None:
        """Move ``traj`` from ``old`` to ``new`` (the caller holds its lock): its rest blob (its
        Python state and files) or, where a blob cannot hold it, a snapshot of its files, made by
        ``old``'s agent and handed to ``new``'s agent through the object store (never through the
        head), loaded there; then closed on ``old``. None; ``STAY`` when ``balance`` and its state
        cannot be carried whole (nothing moved); or why it failed."""
        t = time.perf_counter()
        try:
            meta_ref, data = old.handle.export_session.options(num_returns=2).remote(traj, self.runtime.owner, balance)
            meta = await meta_ref
            if meta is not None and meta.get("kind") == "stay":
                self.stayed[traj] = str(meta.get("why"))
                self.runtime.engine.cpu.pin(traj)  # the policy moves it for balance no more
                log.info("session %s stays on node %s: %s", traj, old.name, meta.get("why"))
                return STAY
            await new.handle.import_session.remote(traj, data, self.runtime.owner, meta)
        except Exception as e:  # an agent gone, a snapshot that cannot be restored there
            log.error("session %s: cannot move it from node %s to %s: %s", traj, old.name, new.name, e)
            return f"session {traj} could not be moved to node {new.name}: {type(e).__name__}: {e}"
        self.homes[traj] = new
        if self.stayed.pop(traj, None) is not None:
            self.runtime.engine.cpu.unpin(traj)
        if meta is not None and meta.get("restarted"):
            self.restarted[traj] = (f"session moved from node {old.name} to {new.name}: its files came, its python "
                                    "interpreter and shell restarted (their state could not be carried)")
        tell(old, "close_session", traj)
        self.moves += 1
        self.move_s.append(time.perf_counter() - t)
        self._carried[traj] = self._carried.get(traj, 0.0) + self.move_s[-1]  # (moved again before a step: both)
        log.info("session %s moved from node %s to %s in %.3f s (%s)", traj, old.name, new.name, self.move_s[-1],
                 meta.get("kind") if meta else "nothing")
        return None

    async def evacuate(self, traj: str, old: Node) -> None:
        """Move ``traj`` off the draining ``old`` between two of its steps: its running step ends
        first (the lock), the engine picks the node (``move_session``; retried while none has
        room), and a step that arrives meanwhile waits on the lock."""
        engine = self.runtime.engine
        while old.state == "draining":
            async with self._lock(traj):
                await self._settled(traj)
                if self.homes.get(traj, old) is not old or traj in self.runtime.ended:
                    return  # moved by a step placed elsewhere, or ended
                target = engine.move_session(traj)
                if target is not None:
                    new = self.runtime.by_index[target]
                    if new is not old and traj in self.homes:
                        problem = await self.carry(traj, old, new)
                        if problem is not None:
                            self.homes.pop(traj, None)
                            self.runtime.end_session(traj, problem)
                    self.runtime.tick()  # its queued steps may go now
                    return
                if engine.cpu.homes.get(traj) is None and traj not in self.homes:
                    return  # it has no home any more: nothing to move
            await asyncio.sleep(0.5)  # no node has room for it now

    def cancel(self, action_id: str) -> None:
        cancel_on_nodes(self.runtime, action_id)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """Cores taken back from a run (``Shrink``): a call to its node's agent, whose sandbox
        shrinks when the call arrives (a start the engine made on those cores may get there
        first: for that long they are shared)."""
        node = self.runtime.by_index.get(allocation.node) if allocation.node is not None else None
        if node is not None and node.state == "alive" and action_id in node.running:
            tell(node, "resize", action_id, allocation)

    def close_session(self, trajectory: str) -> None:
        node = self.homes.pop(trajectory, None)
        self._locks.pop(trajectory, None)
        self.stayed.pop(trajectory, None)
        self.restarted.pop(trajectory, None)
        self._carried.pop(trajectory, None)
        self.runtime.images.forget(trajectory)
        if node is not None:
            tell(node, "close_session", trajectory)

    async def start_up(self) -> None:
        pass  # the agents start as their nodes join (RayRuntime._join)

    async def shut_down(self) -> None:
        await self.tasks.close()


class RayRuntime(Runtime):
    """One engine for every node of a Ray cluster's sandboxes."""

    backend = "ray"

    def __init__(self, address: str = "auto", policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
                 profile: Profile | None = None, *, poll_s: float = MEMBERSHIP_POLL_S,
                 max_queue_s: float | None = DEFAULT_MAX_QUEUE_S, models: list[ModelServiceConfig] | None = None,
                 gpus_per_node: int | None = None, gpu_memory_gb: float | None = None,
                 gpu_island_size: int | None = None, model_device: str = "auto",
                 rejoin_after_s: float = REJOIN_AFTER_S, move_s: float | None = None,
                 lease_s: float = LEASE_S, owner: str | None = None, resource: str | None = None) -> None:
        """``models``: ``ModelServiceConfig``s served on every GPU node (a node with Ray's ``GPU``
        resource): its agent loads them into the node's host memory and hosts the node's GPUs,
        discovered there (``gpus_per_node``, ``gpu_memory_gb``, ``gpu_island_size`` override, as
        on one machine; ``model_device="cpu"`` serves on CPU "devices" standing in for GPUs).
        ``move_s``: what the policy expects a session's move to another node to cost (default
        ``policy.MOVE_S``, what ``tangram bench cluster`` measured): a step waits for its full
        node rather than move when the wait is predicted shorter. ``lease_s``: how long the agents
        keep their work once this head stops renewing their lease (the module docstring);
        ``owner``: who this head is (``tangram serve``: the UUID kept in its journal file,
        ``journal_owner``), the same across its restarts, so that it takes over its agents at once
        while another head's stay its own; default: a head of its own (it takes over agents only
        once their lease has run out). ``resource``: serve only the Ray nodes that have this custom
        resource (several heads on one Ray cluster, each with its own nodes: ``docs/scale.md``)."""
        super().__init__()
        self.resource = resource
        self._owns_connection = connect(address)
        self.address = address
        self.config = sandbox or SandboxConfig()
        self.poll_s = poll_s
        self.rejoin_after_s = rejoin_after_s
        self.lease_s = lease_s
        self.look_timeout_s = min(LOOK_TIMEOUT_S, lease_s / 4)  # a hung agent holds up no other's renewal
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"
        self.inventory: dict[str, Node] = {}  # sessions found on agents taken over, until adopted or pruned
        self._pruned = False  # the journal's sessions are re-attached: an agent taken over later holds none of ours
        self.reattached = {"agents": 0, "sessions": 0, "pruned": 0, "cancelled": 0}
        self.nodes_by_id: dict[str, Node] = {}
        self.by_index: dict[int, Node] = {}
        self.sandboxes = RemoteSandboxes(self, self.report)
        self.images = ClusterImages(self)  # what each node's store holds; placement by image (ray_images)
        self.model_configs = list(models or [])
        self.model_options = {"gpus": gpus_per_node, "gpu_memory_gb": gpu_memory_gb,
                              "gpu_island_size": gpu_island_size, "model_device": model_device}
        managers: dict[Pool, Any] = {Pool.CPU: self.sandboxes}
        self.models: Any = None
        if self.model_configs:
            from .ray_models import RemoteModels

            self.models = RemoteModels(self, self.report, self.model_configs)
            managers[Pool.GPU] = self.models
        self._retried: set[str] = set()
        self.closing = False  # shutting down (``ray_nodes.Head``)
        self._monitor: asyncio.Task | None = None
        self._joining: set[asyncio.Task] = set()
        self._agent_cls = None
        costs = Costs.ray(self.config.memory_mb / 1024, move_s)
        self.move_price_floor_s = costs.session_restore_s  # ``move_s``: what ``reprice_moves`` never goes below
        self._build(Cluster(), policy, managers, costs, profile, max_queue_s=max_queue_s,
                    session_headroom_gb=self.config.session_headroom_mb / 1024)  # agents measure idle sessions
        # a batch whose last GPU node died waits (max_queue_s) for one to join or come back
        self.engine.gpus_may_join = bool(self.model_configs)
        self.engine.cpu.image_names = self.images.names_of  # nodes holding an image are preferred for it

    @property  # type: ignore[override]
    def cluster(self) -> Cluster:
        """The engine's cluster: nodes and model services join it while the runtime runs."""
        engine = getattr(self, "engine", None)
        return engine.cluster if engine is not None else self._cluster

    @cluster.setter
    def cluster(self, value: Cluster) -> None:
        self._cluster = value

    # -- membership ------------------------------------------------------------------------------
    def _table(self) -> list[dict]:
        return [n for n in ray_module().nodes() if n.get("Alive")]

    def _wanted(self, entry: dict) -> bool:
        """A node gets an agent if it has cores for sandboxes or, with model services, GPUs, and, where
        this head serves only the nodes of a custom resource, that resource."""
        res = entry.get("Resources", {})
        if self.resource is not None and res.get(self.resource, 0) <= 0:
            return False
        return res.get("CPU", 0) >= 1 or (bool(self.model_configs) and res.get("GPU", 0) >= 1)

    def _spawn_agent(self, entry: dict) -> Node:
        """The node as the head sees it, with its agent starting (pinned to it)."""
        ray = ray_module()
        res = entry.get("Resources", {})
        node = Node(entry["NodeID"], entry.get("NodeManagerAddress", ""), int(res.get("CPU", 0)),
                    int(res.get("GPU", 0)))
        self.nodes_by_id[node.ray_id] = node
        try:  # an agent an earlier head started, still there: taken over in ``_join``
            node.handle = ray.get_actor(agent_name(node.ray_id))
            node.adopted = True
            return node
        except ValueError:  # none by that name
            pass
        self._new_agent(node)
        return node

    def _new_agent(self, node: Node) -> None:
        """Start the node's agent: detached (it outlives this head), named after its node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._agent_cls is None:
            self._agent_cls = ray_module().remote(num_cpus=0, max_restarts=0)(NodeAgent)
        offset = sum(n.cores for n in self.nodes_by_id.values() if n is not node)
        hosts_models = bool(self.model_configs) and node.gpus >= 1
        opts = self.model_options
        # the agent holds all of the node's GPUs: Ray then shows it exactly those (CUDA_VISIBLE_DEVICES)
        node.adopted = False
        node.handle = self._agent_cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.ray_id, soft=False), max_concurrency=10_000,
            num_gpus=node.gpus if hosts_models else 0, name=agent_name(node.ray_id), lifetime="detached",
        ).remote(node.name, node.cores, self.config, offset, sandboxes=node.cores >= 1,
                 models=self.model_configs if hosts_models else None, gpus=opts["gpus"] or (node.gpus or None),
                 gpu_memory_gb=opts["gpu_memory_gb"], gpu_island_size=opts["gpu_island_size"],
                 model_device=opts["model_device"], exit_when_orphaned=True)

    async def _take_over(self, node: Node) -> dict | None:
        """Take over the agent an earlier head left on ``node`` (``NodeAgent.attach``): what it
        says of itself and its sessions, or None when it cannot be (then it is replaced)."""
        try:
            info = await node.handle.attach.remote(self.lease_s, self.owner)
        except Exception as e:  # it died meanwhile, is an agent of an older version, or another head's
            if "HeldElsewhere" in f"{type(e).__name__}: {e}":
                node.info = {"problem": str(e).splitlines()[-1]}
                raise

            log.warning("node %s (%s): the agent an earlier head left cannot be taken over (%s: %s); starting "
                        "a new one", node.name, node.address, type(e).__name__, e)
            info = None
        if info is None:
            ray = ray_module()
            try:
                ray.kill(node.handle)
            except Exception:
                pass
            for _ in range(100):  # its name is free once Ray has it dead
                try:
                    ray.get_actor(agent_name(node.ray_id))
                except ValueError:
                    break
                await asyncio.sleep(0.1)
            return None
        self.reattached["agents"] += 1
        self.reattached["cancelled"] += len(info.get("cancelled", ()))
        if self._pruned:  # a node this head lost (its agent silent past its lease) and finds again:
            node.handle.keep.remote([], self.owner)  # its sessions ended with it here; close them there
        else:
            for s in info.get("sessions", ()):
                self.inventory[s] = node
        log.warning("node %s (%s): took over the agent an earlier head left: %d sessions, %d actions in flight "
                    "cancelled", node.name, node.address, len(info.get("sessions", ())),
                    len(info.get("cancelled", ())))
        return info

    async def _join(self, node: Node) -> None:
        """Wait for the node's agent to start, then add what it serves to the engine."""
        if node.adopted:
            try:
                taken = await self._take_over(node)
            except Exception:  # another live head holds it: not ours to use or to replace
                node.state = "dead"
                node.died_at = time.monotonic()
                node.rejoins = MAX_REJOINS
                log.error("node %s (%s): %s", node.name, node.address, node.info.get("problem"))
                return
            if taken is not None:
                node.info = taken
                return await self._joined(node)
            self._new_agent(node)
        try:
            started = asyncio.ensure_future(node.handle.start.remote(self.lease_s, self.owner))
            while not (await asyncio.wait({started}, timeout=AGENT_START_WARN_S))[0]:
                log.warning("node %s (%s): its agent has not started yet (loading the services' weights, or waiting "
                            "for Ray to grant it the node's %d GPUs, which something else may hold)", node.name,
                            node.address, node.gpus)
            node.info = started.result()
        except Exception as e:
            node.state = "dead"
            node.died_at = time.monotonic()
            node.info = {"problem": f"the agent did not start: {type(e).__name__}: {e}"}
            log.error("node %s (%s): %s", node.name, node.address, node.info["problem"])
            return
        if node.state == "dead":  # lost while its agent started
            return
        await self._joined(node)

    async def _open_link(self, node: Node) -> bool:
        """Open the head's link to the node's agent (``agentlink``); False, the node dead and why,
        when it cannot be reached."""
        host = node.address or "127.0.0.1"
        token = agentlink.new_token()
        try:
            port = await node.handle.open_link.remote(host, token, self.owner)
            node.link = await agentlink.connect(host, port, token, lambda: self._link_closed(node),
                                                f"node {node.name}'s agent")
        except Exception as e:
            node.state = "dead"
            node.died_at = time.monotonic()
            node.info = {**node.info, "problem": f"the head cannot reach its agent's link at {host}: "
                                                 f"{type(e).__name__}: {e}"}
            log.error("node %s (%s): %s", node.name, node.address, node.info["problem"])
            return False
        return True

    def _link_closed(self, node: Node) -> None:
        if not self.closing:
            self.node_lost(node, "its link closed: its agent died, or another head took it over")

    async def _joined(self, node: Node) -> None:
        """The node's agent is up (started, or taken over): its link opens, and what it serves
        joins the engine."""
        if node.state == "dead" or not await self._open_link(node):
            return
        if node.state == "dead":  # lost while its link opened
            if node.link is not None:
                node.link.close()
            return
        node.state = "alive"
        node.renewed_at = time.monotonic()  # its start (or attach) just renewed its lease
        if node.info.get("sandboxes"):
            node.index = self.engine.add_cpu_node(CpuNode(node.name, node.cores, node.info.get("memory_gb", 8.0)))
            self.by_index[node.index] = node
            log.info("node %s (%s) joined: %d cores, isolation %s, cgroups %s", node.name, node.address, node.cores,
                     node.info.get("isolation"), node.info.get("cgroups"))
        elif node.cores:
            log.warning("node %s (%s) joined without sandboxes: %s", node.name, node.address,
                        node.info.get("problem"))
        gpu_node = node.info.get("gpu_node")
        if gpu_node is not None and gpu_node.gpus:
            self.models.learn(node.info)
            self.engine.add_models(node.info.get("model_specs") or ())
            node.gpu_index = self.engine.add_gpu_node(replace(gpu_node, name=node.name))
            self.models.attach(node, self.engine.gpu.first_gpu[node.gpu_index], gpu_node.gpus)
            log.info("node %s (%s) joined with %d GPUs (islands %s)", node.name, node.address, gpu_node.gpus,
                     gpu_node.islands())
        elif self.model_configs and node.gpus:
            log.warning("node %s (%s) serves no models: %s", node.name, node.address,
                        node.info.get("model_problem") or "no GPUs found")
        self.tick()

    def _may_rejoin(self, node: Node | None) -> bool:
        """A dead node Ray still lists (its agent died, not its raylet) gets a new agent, after a
        pause and a bounded number of times."""
        return (node is not None and node.state == "dead" and node.died_at is not None
                and node.rejoins < MAX_REJOINS and time.monotonic() - node.died_at >= self.rejoin_after_s)

    def _join_later(self, entry: dict, rejoins: int = 0) -> None:
        """Join a node in the background: a GPU node's agent loads every service's weights first
        (minutes for big models), which must not hold up other nodes or the loss of one. A node
        that rejoins is a new ``Node`` with new indices: nothing of the old agent carries over."""
        node = self._spawn_agent(entry)
        node.rejoins = rejoins
        task = asyncio.get_running_loop().create_task(self._join(node))
        self._joining.add(task)
        task.add_done_callback(self._joining.discard)

    # -- drain ---------------------------------------------------------------------------------
    def drain_node(self, node_id: str) -> dict:
        """Take a node out of service without losing anything: see the module docstring. ``KeyError``
        naming an unknown node (its Ray id or the name ``/v1/cluster`` shows); draining a node
        twice is the first drain."""
        node = self.nodes_by_id.get(node_id) or next(
            (n for n in self.nodes_by_id.values() if n.name == node_id), None)
        if node is None or node.state == "dead":
            raise KeyError(f"node: no live node {node_id!r} (GET /v1/cluster lists them)")
        if node.state == "alive":
            node.state = "draining"
            held = self.engine.drain_cpu_node(node.index) if node.index is not None else []
            held = list(dict.fromkeys([*held, *(s for s, home in self.sandboxes.homes.items() if home is node)]))
            log.info("node %s (%s) draining: %d sessions to move", node.name, node.address, len(held))
            for s in held:
                task = asyncio.get_running_loop().create_task(self.sandboxes.evacuate(s, node))
                self._joining.add(task)
                task.add_done_callback(self._joining.discard)
            self.tick()
        self._settle_drain(node)
        return next(n for n in self.nodes() if n["id"] == node.ray_id)

    def _settle_drain(self, node: Node) -> None:
        """A draining node that holds no session and runs nothing is ``drained``."""
        if node.state != "draining" or node.running:
            return
        if any(home is node for home in self.sandboxes.homes.values()):
            return
        if node.index is not None and node.index in self.engine.cpu.homes.values():
            return
        node.state = "drained"
        log.info("node %s (%s) drained: it holds nothing", node.name, node.address)

    def lost_reason(self, session: str, node: Node) -> str:
        return f"session {session} was lost with its node {node.name} ({node.address}); its state is gone"

    def node_lost(self, node: Node, why: str) -> None:
        """A node died: its capacity leaves now, its running actions end (one-shots re-run once),
        its sessions end with a reason later calls get back."""
        if node.state == "dead":
            return
        node.state = "dead"
        node.died_at = time.monotonic()
        node.why = why
        log.error("node %s (%s) lost: %s", node.name, node.address, why)
        held = [s for s, home in self.sandboxes.homes.items() if home is node]
        if node.index is not None:
            self.images.node_lost(node.index)
            lost = self.engine.remove_cpu_node(
                node.index, f"the session was lost with its node {node.name} ({node.address}); its state is gone")
            held = list(dict.fromkeys([*held, *lost]))
        if node.gpu_index is not None:
            self.engine.remove_gpu_node(node.gpu_index)  # its prefetches end; its copies are placed anew
        node.lost.set()  # its Ray calls in flight end (a prefetch)
        if node.link is not None:
            node.link.close()  # its runs in flight end as its link reports them lost (``send_run``)
        for s in held:
            self.sandboxes.homes.pop(s, None)
            self.end_session(s, self.lost_reason(s, node))
        self.tick()

    async def _watch(self) -> None:
        while True:
            try:
                table = {n["NodeID"]: n for n in await asyncio.to_thread(self._table)}
                for ray_id, entry in table.items():
                    if ray_id not in self.nodes_by_id and self._wanted(entry):
                        self._join_later(entry)
                    elif self._may_rejoin(self.nodes_by_id.get(ray_id)):
                        old = self.nodes_by_id[ray_id]
                        log.warning("node %s (%s): its agent died %.0f s ago and Ray still lists the node: "
                                    "starting a new agent there", old.name, old.address,
                                    time.monotonic() - (old.died_at or 0.0))
                        self._join_later(entry, rejoins=old.rejoins + 1)
                for node in list(self.nodes_by_id.values()):
                    if (node.state == "starting" or node.serving) and node.ray_id not in table:
                        self.node_lost(node, "Ray reports the node dead")
                    self._settle_drain(node)
                # renew every lease (agents still starting too: theirs runs from their start's end;
                # not one being taken over: it is another head's until ``attach`` returns)
                held = [n for n in self.nodes_by_id.values()
                        if n.serving or (n.state == "starting" and not n.adopted and n.handle is not None)]
                for look in await look_at_agents(held, self.lease_s, self.owner, self.look_timeout_s):
                    node = look.node
                    if not node.serving:
                        continue  # starting: its join says if it failed
                    if look.lost is not None:  # gone, replaced by another head, or silent past its lease
                        self.node_lost(node, look.lost)
                        continue
                    self.images.learn(node, look.news)
                    for s in look.expired:
                        self.sandboxes.homes.pop(s, None)
                        self.end_session(s, f"session {s} expired: unused for more than "
                                            f"{self.config.session_idle_expiry_s:g} s; its state is gone")
                    # rests since the last poll: a rested session holds no memory on its node (it
                    # held the head's reservation until its next step); the path names the node, so
                    # a restarted server says why it cannot wake it
                    for s, path in look.rested:
                        if self.sandboxes.homes.get(s) is node:
                            self.session_rested(s, f"{node.name}:{path}" if path else None)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cluster membership check failed; trying again")
            await asyncio.sleep(self.poll_s)

    # -- re-attach after a head restart ---------------------------------------------------------
    def adopt_live(self, trajectory: str, image: str | None) -> bool:
        """The journal's open session ``trajectory`` is re-attached if an agent taken over holds
        it (homed on its node again: its next step runs there, files and processes as they were)."""
        node = self.inventory.pop(trajectory, None)
        if node is None or node.state != "alive" or node.index is None:
            return False
        self.sandboxes.homes[trajectory] = node
        self.engine.adopt_session(trajectory, node.index)
        self.reattached["sessions"] += 1
        return True

    def adopt_rested(self, trajectory: str, path: str, image: str | None) -> None:
        """A session the journal says is at rest on a node (``node:path``): re-attached if that
        node's agent, taken over, still holds it (its next step wakes it there); ``LookupError``
        saying why not otherwise."""
        if not self.adopt_live(trajectory, image):
            node = path.split(":", 1)[0]
            raise LookupError(f"the agent of node {node}, which held it, did not outlive the head (or no longer "
                              "holds it)")
        self.engine.cpu.settle_session(trajectory, 0.0, 0.0)  # at rest: it holds no memory until it wakes

    def prune_live(self) -> int:
        """Close the sessions found on agents taken over that nobody re-attached (how many)."""
        owned: dict[int, list[str]] = {}
        nodes: dict[int, Node] = {}
        for s, node in self.sandboxes.homes.items():
            owned.setdefault(id(node), []).append(s)
        for node in self.inventory.values():
            nodes[id(node)] = node
        gone = len(self.inventory)
        self._pruned = True
        for key, node in nodes.items():
            if node.serving:
                node.handle.keep.remote(owned.get(key, []), self.owner)
        self.inventory.clear()
        self.reattached["pruned"] += gone
        if gone:
            log.warning("closed %d sessions an earlier head left that no open session owned", gone)
        return gone

    # -- images (ray_images) ----------------------------------------------------------------------
    def submit_cb(self, action: Action, done) -> None:
        """As every runtime's, after homing a new session whose first step names an image on a node
        that holds it, where one has room (``ClusterImages.place``)."""
        placed = self.images.place(action) is not None
        try:
            super().submit_cb(action, done)
        except BaseException:
            if placed:
                self.images.unplace(action)
            raise
        if placed and action.id not in self.engine.pending and action.id not in self.engine.running:
            self.images.unplace(action)  # refused at once: the session has no step on its way there

    def why_waiting(self, action_id: str) -> Wait | None:
        """The policy's reason while the action is queued; once started, while its node pulls its
        image, "pulling IMAGE: N of M MB" as that node's agent last told (reason ``image-pull``)."""
        wait = super().why_waiting(action_id)
        if wait is None:
            pulling = self.images.pulling(action_id)
            if pulling is not None:
                return Wait("image-pull", pulling)
        return wait

    def image_stats(self) -> dict | None:
        return self.images.stats()

    def check_image(self, image: str) -> None:
        self.images.check(image)
        self.images.prefetch(image)

    async def pull_image(self, image: str) -> str:
        return await self.images.pull(image)

    async def prewarm(self, image: str, n: int, nodes: int | None = None) -> Prewarmed:
        return await self.images.prewarm(image, n, nodes)

    # -- one re-run of one-shots whose node died -------------------------------------------------
    def _retry(self, f: Finished, result: Any) -> bool:
        a = f.action
        if not isinstance(result, NodeLost) or a.trajectory is not None or a.id in self._retried:
            return False
        self._retried.add(a.id)
        log.warning("re-running %s: %s", a.id, f.message)
        self.engine.submit(replace(a))
        return True

    # -- lifecycle and views ---------------------------------------------------------------------
    async def start(self) -> None:
        """Join every node there is now (agents start, GPU nodes load their weights) while the
        watch already runs: it renews the leases of the agents up (taken over) and starting while
        the others still start."""
        entries = [e for e in await asyncio.to_thread(self._table) if self._wanted(e)]
        for entry in entries:
            self._join_later(entry)
        joins = list(self._joining)
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        await asyncio.gather(*joins, return_exceptions=True)
        await super().start()

    async def _shut_down_managers(self) -> None:
        self.closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for task in list(self._joining):
            task.cancel()
        await asyncio.gather(*self._joining, return_exceptions=True)
        await super()._shut_down_managers()
        alive = [n for n in self.nodes_by_id.values() if n.serving]
        for n in self.nodes_by_id.values():
            if n.link is not None:
                n.link.close()
        await asyncio.gather(*(n.handle.shut_down.remote() for n in alive), return_exceptions=True)
        ray = ray_module()
        for n in alive:
            ray.kill(n.handle)
        if self._owns_connection:
            ray.shutdown()

    def isolation(self) -> str | None:
        modes = {n.info.get("isolation") for n in self.nodes_by_id.values() if n.state == "alive"}
        modes.discard(None)
        return ",".join(sorted(modes)) or None

    def _islands(self, n: Node) -> list[list[int]]:
        """The node's NVLink islands as discovered on it, in the engine's global GPU ids."""
        if n.gpu_index is None:
            return []
        first = self.engine.gpu.first_gpu[n.gpu_index]
        return [[first + g for g in island] for island in self.engine.gpu.nodes[n.gpu_index].islands()]

    def reprice_moves(self) -> None:
        """What the policy weighs a move for balance against (``Costs.session_restore_s``): the
        configured ``move_s``, or the p50 of what the last ``REPRICE_MOVES`` moves made here cost
        whole (``RemoteSandboxes.move_cost_s``: the carry and the wake on the new node) where that
        is more. ``move_s`` is a figure of one machine; where a move costs more, a move priced
        below it is made to save less wait than it costs, and the moved session's step (and those
        queued behind it) pay the difference."""
        recent = sorted(self.sandboxes.move_cost_s)
        price = max(self.move_price_floor_s, recent[len(recent) // 2]) if recent else self.move_price_floor_s
        if price != self.engine.costs.session_restore_s:
            self.engine.costs = replace(self.engine.costs, session_restore_s=price)

    def move_stats(self) -> dict | None:
        took = sorted(self.sandboxes.move_s)
        return {"moves": self.sandboxes.moves, "move_p50_s": round(took[len(took) // 2], 4) if took else None,
                "move_max_s": round(took[-1], 4) if took else None,
                "move_price_s": round(self.engine.costs.session_restore_s, 4)}

    def nodes(self) -> list[dict]:
        pool = self.engine.cpu
        out = []
        for n in self.nodes_by_id.values():
            free = pool.nfree(n.index) if n.index is not None and n.state == "alive" else 0
            gpu_node = n.info.get("gpu_node")
            problem = n.info.get("problem", "") if n.cores else n.info.get("model_problem", "")
            if n.state == "dead" and n.why:
                problem = f"lost: {n.why}"
            out.append({"id": n.ray_id, "name": n.name, "address": n.address, "state": n.state, "cores": n.cores,
                        "cores_free": free, "gpus": gpu_node.gpus if gpu_node is not None else 0,
                        "islands": self._islands(n),
                        "memory_gb": n.info.get("memory_gb"), "sandboxes": bool(n.info.get("sandboxes")),
                        "isolation": n.info.get("isolation"), "cgroups": n.info.get("cgroups"),
                        "problem": problem, "running": sorted(n.running),
                        "sessions": sum(1 for home in self.sandboxes.homes.values() if home is n)})
        return out
