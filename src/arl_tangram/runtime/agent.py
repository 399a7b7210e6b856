"""The node agent: one per node of a multi-node deployment, owning that node's sandboxes and GPUs.

The head's engine decides; the agent carries out what it started on this node with the node's own
``SandboxManager`` (bubblewrap + cgroups, as on one machine) and, on a GPU node, its own
``ModelManager`` (the services' weights in this node's host memory, copies on this node's GPUs,
which it discovers itself: NVML islands, as on one machine), and answers each ``run`` with the
action's ``Completion``. All process, pipe, file and tensor work happens here, never in the head's
event loop: the head moves decisions and small results. GPU ids the agent sees are this node's
own (0..n-1); the head maps its global ids to them (``RemoteModels``).

The class knows nothing of Ray (``RayRuntime`` wraps it as an actor pinned to its node), so it is
tested like any manager. Sessions the manager expires are collected here and picked up by the
head's membership loop (``take_expired``), which ends them in the engine; so are the sessions it
rested and the node's images: those its store holds or is pulling, the actions waiting for a pull
and the pull counts (``take_news``: the head places sessions by them, ``ray_images``). The node
pulls its images itself, into its own store, with the head's ``[[registries]]`` config (part of
the sandbox config every agent gets).

**A lease**: on Ray the agent outlives the head that started it (a detached actor), so
its sessions, files and processes both, survive a head restart. The head renews the lease at each
look at the agent (``take_expired(lease_s, owner)``); a restarted head takes the agent over
(``attach``: what it runs for the dead head is cancelled, the head journals those as ended; its
sessions are listed) and says which sessions it owns (``keep``: the others are closed). An agent
whose lease runs out with no head closes everything it holds and, on Ray, exits: nothing is left
that nobody owns.

The lease is armed when ``start`` returns, never before: a GPU agent loads every service's weights
in ``start`` (minutes for big models, longer than ``lease_s``), and a lease running meanwhile
would orphan the agent in its own start. A renewal during ``start`` only
records the head's ``lease_s``; the lease runs ``lease_s`` from the end of ``start``.

**The link.** A head sends each action's run, and gets its answer, over a connection of its own
to the agent (``open_link``, ``agentlink``): Ray carries the rest. A take-over closes the earlier
head's link.

**Owners.** A head names itself (``owner``: ``tangram serve``'s is a UUID stored in its journal
file, so the same file is the same head across restarts and another host's journal another head).
Only the owner, or any head once the lease ran out, takes the agent over; every call that acts
for a head (``take_expired``, ``run``, ``keep``, ``cancel``, ``resize``, ``close_session``,
``prefetch``, ``evict``, ``export_session``, ``import_session``, ``pull_image``, ``prewarm``) carries its name, and a head that
was replaced gets ``Replaced`` from it and treats the node as lost: it cannot cancel, close or
evict what the new head runs. In practice a head whose lease ran out mostly finds the agent gone
instead: the agent's watch orphans it within ~50 ms of the lease's end (it closes everything and
exits), so another head can take it over only in that moment or before the lease was first armed;
both end as a lost node for the old head. A taken-over agent's one-shots of the dead head are
cancelled and ``attach`` returns once they ended, so a re-run with the same id (the new head's
journal re-runs them) never meets the cancelled run's completion.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import uuid
from typing import Callable

from typing import Any

from ..core.action import CPU, GPU, Action, Allocation, Outcome
from ..core.cluster import DEFAULT_H2D_GBPS, GpuNode
from ..core.pools import Instance
from ..core.records import Load
from ..core.seam import Completion, Loaded, Report
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spec import Restore, SandboxConfig, Snapshot
from . import agentlink
from .host import LocalHost, host_cpus, memory_gb


class HeldElsewhere(RuntimeError):
    """Another head, alive (its lease runs), holds this agent: it is not taken over."""


class Replaced(RuntimeError):
    """The head calling was replaced: another head took this agent over (``attach``). The node is
    not the caller's any more; it treats it as lost."""


#: seconds ``attach`` waits for the one-shots it cancelled to end (a sandbox run is killed in
#: milliseconds; a model batch ends at its next step); a re-run of one still ending waits in ``run``
ATTACH_CANCEL_WAIT_S = 10.0


class NodeAgent:
    """Runs sandbox actions on this node for a remote engine. ``cores``: what the cluster gives
    this node (Ray's ``CPU`` resource); ``cpu_offset`` spreads several agents of one machine (test
    clusters) over its CPUs."""

    def __init__(self, name: str, cores: int, config: SandboxConfig | None = None, cpu_offset: int = 0,
                 cpus: tuple[int, ...] | None = None, *, sandboxes: bool = True, models: list | None = None,
                 gpus: int | None = None, gpu_memory_gb: float | None = None, gpu_island_size: int | None = None,
                 model_device: str = "auto", exit_when_orphaned: bool = False) -> None:
        """``cpus``: exactly these host CPUs (a sandbox worker of one machine uses its engine's);
        ``sandboxes``: False on a node without cores for them. ``models``: the
        ``ModelServiceConfig``s this node serves on its GPUs (discovered; ``gpus``,
        ``gpu_memory_gb``, ``gpu_island_size`` override, as ``LocalHost.detect``), or on ``gpus``
        CPU "devices" without CUDA (``model_device``). ``exit_when_orphaned``: once its lease
        runs out with no head renewing it, the process exits after closing what it holds (a
        detached Ray actor; a sandbox worker has no lease)."""
        self.name = name
        self.cores = cores
        self.config = config or SandboxConfig()
        self.cpu_offset = cpu_offset
        self.cpus = cpus
        self.serve_sandboxes = sandboxes
        self.model_configs = list(models or [])
        self.gpu_options = {"gpus": gpus, "gpu_memory_gb": gpu_memory_gb, "gpu_island_size": gpu_island_size}
        self.model_device = model_device
        self.manager: SandboxManager | None = None
        self.models: Any = None  # the node's ModelManager, once its weights are in host memory
        self._waiting: dict[str, Callable[[Completion], None]] = {}  # action id -> where its completion goes
        self._step_of: dict[str, str] = {}  # action id -> its session, for session steps waiting here
        self._leftover: dict[str, asyncio.Future] = {}  # session -> its step a dead head started, until it ends
        self._dying: dict[str, asyncio.Future] = {}  # action id -> resolved when its cancelled run (``attach``) ended
        self._epoch = 0  # ``attach``es so far: a step of a replaced head not yet started never starts
        self._loading: dict[str, asyncio.Future] = {}  # prefetch key -> resolved when resident
        self._expired: list[str] = []
        self._rested: dict[str, str | None] = {}  # session -> its blob here (None: woken) since the head last asked
        self.problem = ""
        self.model_problem = ""
        self.info: dict | None = None  # what ``start`` returned: a head that takes the agent over gets it again
        self.exit_when_orphaned = exit_when_orphaned
        self.lease_until: float | None = None  # monotonic; None: no lease (never renewed)
        self.owner: str | None = None  # the head holding the lease (a restarted one says the same)
        self._lease_task: asyncio.Task | None = None
        self._lease_s: float | None = None  # the head's lease, armed when ``start`` returns
        self._armed = False  # ``start`` returned: renewals from now on start the lease's watch
        self.orphaned = False  # the lease ran out: everything was closed
        self._hub: Any = None  # the link's listening end (``open_link``), its head's alone
        self._linked: set[asyncio.Task] = set()  # linked runs that wait for a dead head's run first

    async def start(self, lease_s: float | None = None, owner: str | None = None) -> dict:
        """Start the sandbox manager and the model host; returns what the head shows of this
        node. A node where sandboxes cannot run (no bubblewrap, say) reports why and gets no
        sandbox actions; one whose model services cannot load reports why and gets no GPU work.
        ``lease_s``: the head's lease, ``owner`` that head (the module docstring); the lease runs
        from when ``start`` returns, never during it."""
        self.owner = owner
        if lease_s is not None:
            self._lease_s = lease_s
        try:
            info = await self._start_sandboxes()
            if self.model_configs:
                info.update(await self._start_models())
            self.info = info
        finally:  # armed even if start failed: an agent nobody renews must not live on
            self._armed = True
            if self._lease_s is not None:
                self.renew(self._lease_s)
        return info

    async def _start_sandboxes(self) -> dict:
        mine = host_cpus()
        cpus = self.cpus or tuple(mine[(self.cpu_offset + i) % len(mine)] for i in range(max(1, self.cores)))
        config = self.config.model_copy(update={"cpus": cpus})
        info = {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "cores": self.cores,
                "memory_gb": round(memory_gb(), 1), "host_cpus": list(cpus)}
        if not self.serve_sandboxes:
            return {**info, "sandboxes": False, "isolation": None, "cgroups": None, "problem": "no cores for sandboxes"}
        try:
            self.manager = SandboxManager(config, self._report, self._expired.append)
            self.manager.on_rest = self._rested.__setitem__
            await self.manager.start_up()
        except Exception as e:  # isolation unavailable: the node serves no sandboxes, and says why
            self.manager = None
            self.problem = f"{type(e).__name__}: {e}"
            return {**info, "sandboxes": False, "isolation": None, "cgroups": None, "problem": self.problem}
        root = self.manager.root
        return {**info, "sandboxes": True, "isolation": self.manager.mode.value,
                "cgroups": ("v2" if root.v2 else "v1") if root is not None else None, "problem": ""}

    async def _start_models(self) -> dict:
        """Load every service into this node's host memory and find this node's GPUs (or CPU
        devices): the head's engine gets them as one GPU node, and the services' sizes."""
        try:
            from ..managers.models.spec import require_torch

            require_torch()
            from ..managers.models.manager import ModelManager

            mm = ModelManager(self.model_configs, self._report, self.model_device)
            specs = await asyncio.to_thread(mm.load_all)
            opts = self.gpu_options
            host = LocalHost.detect(sandboxes=False, models=True, cuda=mm.cuda, gpus=opts["gpus"],
                                    gpu_memory_gb=opts["gpu_memory_gb"], gpu_island_size=opts["gpu_island_size"])
        except Exception as e:  # no torch, a model directory that is not there: no GPU work here
            self.model_problem = f"{type(e).__name__}: {e}"
            return {"gpu_node": None, "model_problem": self.model_problem}
        self.models = mm
        node = GpuNode(self.name, host.gpus, host.gpu_memory_gb, max(map(len, host.gpu_islands), default=host.gpus),
                       DEFAULT_H2D_GBPS, groups=host.gpu_islands)
        return {"gpu_node": node, "model_specs": specs, "model_cards": mm.cards(), "model_failed": dict(mm.failed),
                "cuda": mm.cuda, "model_problem": ""}

    def _report(self, r: Report) -> None:
        if isinstance(r, Completion):
            self._step_of.pop(r.action_id, None)
            done = self._waiting.pop(r.action_id, None)
            if done is not None:
                done(r)
        elif isinstance(r, Loaded):
            fut = self._loading.pop(r.key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def run_cb(self, action: Action, allocation: Allocation, done: Callable[[Completion], None],
               after: str | None = None) -> None:
        """``run`` that calls ``done(completion)`` from the manager's report itself (a sandbox
        worker answers its engine a loop pass sooner than through a future). ``after``: a run
        started here that this one follows on its cores (``SandboxManager.start``)."""
        manager: Any = self.manager
        if allocation is not None and allocation.pool == GPU:
            manager = self.models
            if manager is None:
                raise RuntimeError(f"node {self.name} serves no models: {self.model_problem}")
        elif manager is None:
            raise RuntimeError(f"node {self.name} runs no sandboxes: {self.problem}")
        self._waiting[action.id] = done
        if action.trajectory is not None:
            self._step_of[action.id] = action.trajectory
        try:
            if after is None:
                manager.start(action, allocation)
            else:
                manager.start(action, allocation, after=after)
        except BaseException:
            del self._waiting[action.id]
            self._step_of.pop(action.id, None)
            raise

    async def prefetch(self, key: str, model: str, block: tuple[int, ...], per_gpu_gb: float,
                       owner: str | None = None) -> None:
        """Copy ``model`` onto this node's GPUs ``block``; returns once it is resident (or once
        the copy failed: the first call that needs it then makes it, and reports)."""
        self._check_owner(owner)
        if self.models is None:
            raise RuntimeError(f"node {self.name} serves no models: {self.model_problem}")
        fut = self._loading[key] = asyncio.get_running_loop().create_future()
        self.models.prefetch(Load(key, model, block, per_gpu_gb, Instance(model, block, per_gpu_gb)))
        await fut

    def resident(self) -> list[tuple[str, tuple[int, ...]]]:
        """The copies on this node's GPUs: (model, this node's GPU ids)."""
        return sorted(self.models.instances) if self.models is not None else []

    def evict(self, model: str, block: tuple[int, ...], owner: str | None = None) -> None:
        self._check_owner(owner)
        if self.models is not None:
            self.models.evict(model, block)

    async def run(self, action: Action, allocation: Allocation, owner: str | None = None) -> Completion:
        """Run one action the head's engine started on this node; its ``Completion``. A session's
        step waits for the step a dead head left running in it (``attach``); a re-run of a one-shot
        ``attach`` cancelled waits for the cancelled run to end (same id). ``owner``: the head
        asking (``Replaced`` if another took the agent over; None: no check, as in a sandbox
        worker). A step that waited here when another head took the agent over never starts: it
        ends ``cancelled`` (its head is gone; the new head's journal ends it)."""
        self._check_owner(owner)
        epoch = self._epoch
        dying = self._dying.get(action.id)
        if dying is not None:
            try:
                await asyncio.wait_for(asyncio.shield(dying), ATTACH_CANCEL_WAIT_S)
            except asyncio.TimeoutError:  # never met: it would take this run's answer
                return Completion(action.id, Outcome.INFRA_ERROR, message=f"node {self.name}: the cancelled run of "
                                  f"{action.id} did not end in {ATTACH_CANCEL_WAIT_S:g} s; try again")
        left = self._leftover.get(action.trajectory) if action.trajectory is not None else None
        if left is not None:
            await asyncio.shield(left)
        if self._epoch != epoch:
            return Completion(action.id, Outcome.CANCELLED,
                              message=f"node {self.name}'s agent was taken over by another head before it ran")
        fut = asyncio.get_running_loop().create_future()
        self.run_cb(action, allocation, lambda c: fut.done() or fut.set_result(c))  # done: the caller gave up
        return await fut

    def run_linked(self, action: Action, allocation: Allocation, reply: Callable[[bool, Any], None]) -> None:
        """``run`` for the head's link: ``reply(True, completion)`` from the manager's report
        itself, with no task, unless the run must first wait for a run a dead head left (then as
        ``run``). The owner is not checked: the link is its head's (a take-over closes it)."""
        traj = action.trajectory
        if action.id in self._dying or (traj is not None and traj in self._leftover):
            task = asyncio.ensure_future(self.run(action, allocation))
            self._linked.add(task)

            def ran(t: asyncio.Task) -> None:
                self._linked.discard(t)
                if not t.cancelled():
                    err = t.exception()
                    reply(err is None, t.result() if err is None else err)

            task.add_done_callback(ran)
            return
        self.run_cb(action, allocation, lambda c: reply(True, c))

    def follow_linked(self, action: Action, allocation: Allocation, after: str,
                      reply: Callable[[bool, Any], None]) -> None:
        """``run_linked`` of a one-shot that starts on the cores of ``after`` as ``after``'s sandbox
        answers (the lease: ``SandboxManager.start``)."""
        self.run_cb(action, allocation, lambda c: reply(True, c), after=after)

    async def open_link(self, host: str, token: bytes, owner: str | None = None) -> int:
        """Listen for the head's link on ``host`` (this node's address as Ray knows it), for a
        caller that sends ``token`` first; returns the port. A link opened earlier is closed."""
        self._check_owner(owner)
        await self.close_link()
        self._hub, port = await agentlink.serve(self, host, token)
        return port

    async def close_link(self) -> None:
        hub, self._hub = self._hub, None
        if hub is not None:
            await hub.close()

    async def look(self, lease_s: float | None = None, images_seen: object = None,
                   owner: str | None = None) -> tuple[list[str], dict]:
        """One look of the head's membership loop: ``take_expired`` (the lease renewed) and
        ``take_news``, in one call."""
        return await self.take_expired(lease_s, owner), await self.take_news(images_seen)

    def cancel(self, action_id: str, owner: str | None = None) -> None:
        self._check_owner(owner)
        for manager in (self.manager, self.models):
            if manager is not None:
                manager.cancel(action_id)

    def resize(self, action_id: str, allocation: Allocation, owner: str | None = None) -> None:
        """The engine took cores back from a sandbox run here (``SandboxManager.resize``)."""
        self._check_owner(owner)
        if self.manager is not None:
            self.manager.resize(action_id, allocation)

    def close_session(self, trajectory: str, owner: str | None = None) -> None:
        self._check_owner(owner)
        if self.manager is not None:
            self.manager.close_session(trajectory)

    async def export_session(self, trajectory: str, owner: str | None = None,
                             whole: bool = False) -> tuple[dict | None, bytes | None]:
        """A session as what a move carries to another node (through the object store): its meta
        (None: it has nothing here, never ran a step or already closed) and its bytes. A default
        session goes as its rest blob (put to rest here first: its interpreter's state, shell and
        files; ``kind`` ``rest``), and wakes there as a rested session wakes. One whose state a blob
        cannot hold (an image session's root is not in it) goes as a snapshot of its files (``kind``
        ``files``; ``restarted``: its processes held state, which is lost). ``whole``: a move for
        balance, carried only if nothing is lost (``kind`` ``stay``, ``why``: not moved, nothing
        touched). Taken after the session's running step (the head holds its lock)."""
        self._check_owner(owner)
        m = self.manager
        if m is None or not m.has_session(trajectory):
            return None, None
        book = m.book
        while trajectory in book.moving:  # being put to rest by the manager: its blob then
            await asyncio.shield(book.moving[trajectory])
        sb = book.awake.get(trajectory)
        if sb is not None and not sb.dead and (sb.rootfs is None or sb.rootfs.workspace_only):
            m.resting.not_whole.pop(trajectory, None)
            await m.resting.rest(trajectory, whole=whole)
        rested = book.rested.get(trajectory)
        if rested is not None and rested.rootfs is None:
            blob = await asyncio.to_thread(m.store.read, rested.path)
            return {"kind": "rest", "dropped": dict(rested.dropped)}, blob
        live = trajectory in book.awake or trajectory in book.rested  # processes whose state a snapshot loses
        if whole and live:
            lost = m.resting.not_whole.pop(trajectory, None)
            why = ("it holds what cannot be carried: " + "; ".join(f"{k} ({v})" for k, v in lost.items()) if lost
                   else "its interpreter's state cannot be carried to another node")
            return {"kind": "stay", "why": why}, None
        fd, path = tempfile.mkstemp(prefix="tangram-move-", suffix=".tar")
        os.close(fd)
        try:
            done = await self.run(Action(f"move-out-{uuid.uuid4().hex}", "sandbox", trajectory=trajectory,
                                         operation="snapshot", payload=Snapshot(trajectory, path)), Allocation(CPU))
            if done.outcome is not Outcome.OK:
                raise RuntimeError(f"snapshot of session {trajectory} on node {self.name}: {done.message}")
            with open(path, "rb") as fh:
                return {"kind": "files", "restarted": live}, fh.read()
        finally:
            os.unlink(path)

    async def import_session(self, trajectory: str, data: bytes | None, owner: str | None = None,
                             meta: dict | None = None) -> bool:
        """Make ``trajectory`` a session here from ``export_session``'s ``(meta, data)``: at rest
        (kind ``rest``: its next step wakes it), or from a snapshot of its files (its processes
        start on its next step); False when there was nothing to carry."""
        self._check_owner(owner)
        if data is None:
            return False
        if self.manager is None:
            raise RuntimeError(f"node {self.name} runs no sandboxes: {self.problem}")
        if meta is not None and meta.get("kind") == "rest":
            await self.manager.resting.arrive(trajectory, data, dict(meta.get("dropped") or {}))
            return True
        fd, path = tempfile.mkstemp(prefix="tangram-move-", suffix=".tar")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            done = await self.run(Action(f"move-in-{uuid.uuid4().hex}", "sandbox", trajectory=trajectory,
                                         operation="restore", payload=Restore(path)), Allocation(CPU))
        finally:
            os.unlink(path)
        if done.outcome is not Outcome.OK:
            raise RuntimeError(f"restore of session {trajectory} on node {self.name}: {done.message}")
        return True

    async def take_expired(self, lease_s: float | None = None, owner: str | None = None) -> list[str]:
        """The sessions the manager expired since the last call; ``lease_s`` renews the lease
        (the head's membership loop calls this at each look, so a live head keeps its agents).
        ``owner``: the head renewing; ``Replaced`` if another head took the agent over."""
        self._check_owner(owner)
        if lease_s is not None:
            self.renew(lease_s)
        out, self._expired[:] = list(self._expired), []
        return out

    def take_rested(self) -> list[tuple[str, str | None]]:
        """Sessions put to rest here (their blob's path on this node) or woken (None) since the
        last call, the latest news of each: the head drops a rested one's memory reservation."""
        out = list(self._rested.items())
        self._rested.clear()
        return out

    async def take_news(self, images_seen: object = None) -> dict:
        """What the head's look collects besides expiries: ``rested`` (``take_rested``); the images
        this node holds or is pulling (``images``: ``(mark, names)``, or None when the mark is
        ``images_seen``, the one the head has: unchanged); the actions waiting here for a pull,
        each with its "pulling IMAGE: N of M MB" (``pulling``); and the pull counts and disk use
        (``image_stats``). The images are listed again only when they may have changed
        (``Pulls.present``)."""
        news: dict = {"rested": self.take_rested(), "images": None, "pulling": {}, "image_stats": None}
        m = self.manager
        if m is not None and m.mode is not None:
            mark, names = await m.pulls.present()
            if mark != images_seen:
                news["images"] = (mark, sorted(names))
            news["pulling"] = m.pulls.waits()
            news["image_stats"] = m.image_stats()
        return news

    async def pull_image(self, image: str, owner: str | None = None) -> tuple[str, str, bool]:
        """Have ``image`` in this node's store (pulled with this node's ``[[registries]]`` config
        if it is a reference not here): ``("ok", the store's name, False)``, or ``("error",
        message, infra)`` for an ``ImageError`` (its kind kept: a registry that did not answer is
        ``infra``), which then crosses to the head as plain data."""
        self._check_owner(owner)
        try:
            return "ok", await self._image_manager().pull_image(image), False
        except ImageError as e:
            return "error", str(e), e.infra

    async def prewarm(self, image: str, n: int, owner: str | None = None) -> tuple[str, Any, bool]:
        """``n`` sandboxes of ``image`` started here for new sessions and one-shots, the image
        pulled first if it is not here: ``("ok", Prewarmed, False)`` or ``("error", message,
        infra)`` as ``pull_image``."""
        self._check_owner(owner)
        try:
            return "ok", await self._image_manager().prewarm(image, n), False
        except ImageError as e:
            return "error", str(e), e.infra

    def _image_manager(self) -> SandboxManager:
        if self.manager is None:
            raise ImageError(f"image: node {self.name} runs no sandboxes: {self.problem}")
        return self.manager

    def sessions(self) -> list[str]:
        """Every session held here: awake, at rest, or made by a fork and not stepped yet."""
        m = self.manager
        if m is None:
            return []
        return sorted({*m.sessions, *m.rested, *m.pending_roots})

    # -- the lease: outliving a head ----------------------------------------------------------
    def renew(self, lease_s: float) -> None:
        """The head is alive: the agent holds on to its work for ``lease_s`` more seconds (called
        from the agent's event loop). The watch starts with the first renewal after ``start``
        returned: one during ``start`` only sets the lease that ``start`` arms."""
        self.lease_until = time.monotonic() + lease_s
        if not self._armed:
            self._lease_s = lease_s
            return
        if self._lease_task is None and not self.orphaned:
            self._lease_task = asyncio.get_running_loop().create_task(self._watch_lease())

    def _check_owner(self, owner: str | None) -> None:
        if owner is not None and self.owner is not None and owner != self.owner:
            raise Replaced(f"node {self.name}'s agent was taken over by another head ({self.owner}): "
                           "one head per Ray cluster")

    async def attach(self, lease_s: float, owner: str | None = None) -> dict | None:
        """A restarted head takes this agent over: its lease renewed, the one-shots it runs for
        the dead head cancelled (nobody awaits their answers; the new head's journal re-runs
        them), resident model copies dropped (the new engine starts with empty GPUs), and what
        ``start`` said, with ``sessions`` (``sessions()``) and ``cancelled``. Only the head that
        held it (``owner``: a restarted head names itself as before) or any head once the lease ran
        out may: ``HeldElsewhere`` otherwise (a second head on the cluster). A session's step in
        flight runs to its end, its answer lost (the journal ends it, saying so): cancelling it
        would kill the session's processes, the Python state a re-attach keeps; the session's
        next step waits for it. None when the agent cannot be taken over (it never started, or
        its lease ran out and it closed everything).

        Returns once the cancelled one-shots ended (at most ``ATTACH_CANCEL_WAIT_S``): their ids
        come back as the journal's re-runs, which must not get the cancelled run's completion (the
        old run's bookkeeping would drop the re-run's). Attached twice while a dead head's step
        still runs, the session keeps the one wait for it (a second wait replacing the first would
        leave a step waiting on the first forever); a step of an earlier head still waiting here
        when another takes over never starts (``cancelled``)."""
        if self.info is None or self.orphaned:
            return None
        if self.owner != owner and self.lease_until is not None and time.monotonic() < self.lease_until:
            raise HeldElsewhere(f"node {self.name}'s agent is held by another head ({self.owner}) whose lease "
                                f"runs {self.lease_until - time.monotonic():.0f} s more: one head per Ray cluster")
        self.owner = owner
        self._epoch += 1
        self.renew(lease_s)
        await self.close_link()  # the earlier head's: the new head opens its own
        loop = asyncio.get_running_loop()
        cancelled = sorted(aid for aid in self._waiting if aid not in self._step_of and aid not in self._dying)
        for aid in cancelled:
            dying = self._dying[aid] = loop.create_future()

            def died(c: Completion, aid: str = aid, dying: asyncio.Future = dying,
                     answer: Callable[[Completion], None] = self._waiting[aid]) -> None:
                answer(c)  # to the dead head's call (on Ray: nobody awaits it any more)
                if not dying.done():
                    dying.set_result(None)
                if self._dying.get(aid) is dying:
                    del self._dying[aid]

            self._waiting[aid] = died
        for aid in cancelled:
            self.cancel(aid)
        for aid, traj in self._step_of.items():
            if traj in self._leftover:  # an earlier attach's: its waiters (and ours) wait for the same end
                continue
            left = self._leftover[traj] = loop.create_future()

            def ended(c: Completion, left: asyncio.Future = left, traj: str = traj) -> None:
                if not left.done():
                    left.set_result(None)
                if self._leftover.get(traj) is left:
                    del self._leftover[traj]

            self._waiting[aid] = ended
        if self.models is not None:
            for model, block in self.resident():
                self.models.evict(model, block)
        dying = [self._dying[a] for a in cancelled if a in self._dying]
        if dying:  # a re-run with the same id must not meet the cancelled run's completion (M1)
            await asyncio.wait(dying, timeout=ATTACH_CANCEL_WAIT_S)
        return {**self.info, "sessions": self.sessions(), "cancelled": cancelled}

    def keep(self, sessions: list[str], owner: str | None = None) -> list[str]:
        """The head owns ``sessions``; every other session here is closed (it belonged to a head
        that died and whose journal no longer lists it). Returns those closed. ``owner``: the head
        saying so (``Replaced`` if another took the agent over)."""
        self._check_owner(owner)
        owned = set(sessions)
        gone = [s for s in self.sessions() if s not in owned]
        for s in gone:
            self.close_session(s)
        return gone

    async def _watch_lease(self) -> None:
        while True:
            until = self.lease_until
            now = time.monotonic()
            if until is not None and now >= until:
                break
            await asyncio.sleep(min(1.0, max(0.05, (until or now + 1.0) - now)))
        await self.orphan()

    async def orphan(self) -> None:
        """The lease ran out with no head renewing it: close everything (running actions, sessions,
        the managers) and, on Ray, exit, so that nothing is left running that nobody owns."""
        self.orphaned = True
        await self.close_link()
        for aid in list(self._waiting):
            self.cancel(aid)
        self.reset()
        await self.shut_down()
        for aid, done in list(self._waiting.items()):  # a manager shutting down reports nothing more
            del self._waiting[aid]
            done(Completion(aid, Outcome.CANCELLED, message=f"node {self.name}'s agent lost its head (its lease ran out)"))
        if self.exit_when_orphaned:
            os._exit(0)  # a detached actor's process: Ray then lists the actor dead and frees its name

    def reset(self) -> int:
        """Close every session this agent holds (a new head does this to an agent it inherits:
        the old head's sessions are not its own). Returns how many were closed."""
        held = self.sessions()
        for traj in held:
            self.close_session(traj)
        return len(held)

    async def shut_down(self) -> None:
        task, self._lease_task = self._lease_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        await self.close_link()
        if self.manager is not None:
            await self.manager.shut_down()
        if self.models is not None:
            await self.models.shut_down()
