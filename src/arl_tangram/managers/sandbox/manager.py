"""The sandbox manager: carries out the engine's CPU decisions with real sandboxes.

A trajectory's session keeps its sandbox (workspace files, the persistent python interpreter)
for its whole life but holds cores only while an action runs: the sandbox is pinned to the
allocation's cores (cpuset) when an action starts and frozen (cgroup freezer) when it ends.
One-shot runs take a sandbox from a warm pool, so no action pays isolation or interpreter start-up.

``SandboxManager`` is the engine's ``Manager`` for ``Pool.CPU`` and a composition of parts, each
the one owner of its state:

- ``pool.OneShots``: the one-shot sandboxes (take, put back, recycle, refill, placement);
- ``sessionpool.SessionPool``: layered sandboxes for new sessions, and those sessions left;
- ``sessions.SessionBook``: which sessions are held here and in which state (host files too);
- ``resting.Resting``: when sessions rest and wake, and idle expiry;
- ``execution.Execution``: a payload carried out in its sandbox, by a table of payload types;
- ``runs.Runs``: one action's life (its sandbox found, placed, run, reported);
- ``lease.Lease``: one-shots queued behind a running one on its cores;
- ``pulls.Pulls``: images named by a registry reference, pulled on first use; the disk budget.

They share the host's side (``host.SandboxHost``: config, isolation, cgroups, images, recycler),
which this class is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from typing import Awaitable, Callable

from ...core.action import Action, Allocation, Outcome
from ...core.seam import Sink
from .cgroups import open_root
from .execution import Execution
from .host import SandboxHost, open_files_to_hard_limit
from .imagebox import ImageSandboxes, Prewarmed
from .images import ImageError
from .isolation import Isolation, compile_runner, detect
from .lease import Lease
from .livestdin import LiveStdin
from .pool import OneShots
from .pulls import Pulls
from .recycle import Recycler
from .rest import RestStore
from .resting import Resting
from .rootfs import overlay_supported
from .runs import Runs
from .sandbox import Limits, Sandbox
from .sessionpool import SessionPool
from .sessions import SessionBook
from .spec import (CommandResult, Exec, Files, Fork, FsCall, Restore, RunCode, SandboxConfig, SandboxResult,
                   Snapshot)

__all__ = ["CommandResult", "Exec", "Files", "Fork", "FsCall", "Restore", "RunCode", "SandboxConfig", "SandboxManager",
           "SandboxResult", "Snapshot"]

log = logging.getLogger(__name__)


class SandboxManager(SandboxHost):
    """Implements the engine's ``Manager`` protocol for ``Pool.CPU``: reports each action's
    ``Completion`` (its ``result`` a ``SandboxResult``) to ``sink``; ``expire(trajectory)`` is
    told when a session has been idle past ``session_idle_expiry_s`` (the runtime ends the
    trajectory in the engine, which then closes the session here)."""

    def __init__(self, config: SandboxConfig | None = None, sink: Sink | None = None,
                 expire: Callable[[str], None] | None = None) -> None:
        super().__init__(config, sink)
        self.expire = expire
        self.lease = Lease(self.want_spares)
        self.pool = OneShots(self, self.lease)
        self.recycler = Recycler(False, self.pool.put_back, self.tasks.spawn)  # the config's, from start
        self.book = SessionBook(self)
        self.spares = SessionPool(self, self.pool, self.book)
        self.resting = Resting(self, self.book, self.spares, self._expired)
        self.execution = Execution(self, self.book)
        self.pulls = Pulls(self)
        self.runs = Runs(self, self.lease, self.pool, self.spares, self.book, self.resting, self.execution,
                         self.pulls)
        # the parts' state under the names the runtime, the server and the tests read
        self.sessions: dict[str, Sandbox] = self.book.awake
        self.pending_roots = self.book.pending
        self.rested = self.book.rested
        self.fresh = self.pool.fresh
        self.core_waits = self.runs.core_waits
        self.rest_counts = self.resting.counts
        self._fill: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start_up(self) -> None:
        c = self.config
        open_files_to_hard_limit()  # awake sessions hold descriptors past the common soft limit
        self.mode = detect(c.isolation, self.layout)
        if self.mode is Isolation.BWRAP:  # the runner compiled once, not at every sandbox's start
            cache = tempfile.mkdtemp(prefix="tangram-pyc-")
            self.hostdirs.append(cache)
            if await asyncio.to_thread(compile_runner, c.interpreter, tuple(c.interpreter_args), cache):
                self.layout = dataclasses.replace(self.layout, pycache=cache)
        if self.mode is Isolation.NONE:
            log.warning("sandbox isolation is OFF (isolation: none): only run trusted code")
        self.root = open_root()
        self.resting.open_store()
        self.imageboxes = ImageSandboxes(self.images, self.layout, Limits(c.memory_mb << 20, c.pids_max), self.root,
                                         c.interpreter, tuple(c.interpreter_args), c.max_idle_sandboxes)
        await asyncio.to_thread(self.images.check_unsynced)  # before any sandbox mounts a layer
        await self.pulls.start()
        if c.image is not None:  # the default image: fail at start, not at every action
            if self.mode is not Isolation.BWRAP:
                raise ImageError(f"sandbox.image: sandboxes from images need bubblewrap isolation (this host uses "
                                 f"{self.mode.value})")
            try:  # pulled now if it is a reference not here; named as the store names it from now on
                name = await self.pulls.ready(c.image)
                self.imageboxes.image(name)
            except ImageError as e:
                raise ImageError(f"sandbox.image: {str(e).removeprefix('image: ')}") from None
            self.config = c = c.model_copy(update={"image": name})
        self.layered = self.mode is Isolation.BWRAP and c.image is None and overlay_supported() is None
        if self.mode is Isolation.BWRAP and c.image is None and not self.layered:
            log.warning("default sessions cannot fork or snapshot here: %s", overlay_supported())
        self.pool.start()
        self.taken = asyncio.Event()
        self._fill = asyncio.get_running_loop().create_task(self.pool.refill(self.spares))
        self.resting.start()
        self.recycler = self.pool.recycler(c.recycle and self.mode is Isolation.BWRAP)
        log.info("sandboxes: isolation %s, cgroups %s, %d CPUs, warm pool %d, one-shots %s", self.mode.value,
                 "v2" if self.root and self.root.v2 else ("v1" if self.root else "unavailable"), len(self.host_cpus),
                 c.warm_pool, "share the CPUs" if self.shares_cpus else "pinned to their cores")

    async def shut_down(self) -> None:
        """Kill every sandbox and remove every cgroup and directory this manager made."""
        self.closing = True
        await self.pulls.close()
        loops = [t for t in (self._fill, *self.resting.loops()) if t is not None]
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)  # the refill kills its half-made sandboxes
        # running actions are cancelled (their handlers kill their sandboxes); kills and resets in
        # flight are waited for, never cancelled half-way (a reset that ends now kills its sandbox)
        await self.tasks.close(cancel_background=False)
        doomed = list(self.sessions.values())
        self.sessions.clear()
        for idle in (self.pool.idle, self.spares.idle):
            if idle is not None:
                doomed += idle
                idle.clear()
        await asyncio.gather(*(sb.kill() for sb in doomed), return_exceptions=True)
        for rootfs in self.pending_roots.values():
            rootfs.release()
        self.pending_roots.clear()
        self.resting.shut_down()
        if self.imageboxes is not None:
            await self.imageboxes.shut_down()
        if self.root is not None:
            self.root.cleanup()
        for d in self.hostdirs:
            shutil.rmtree(d, ignore_errors=True)

    # -- the manager protocol --------------------------------------------------------------------
    def start(self, action: Action, allocation: Allocation, after: str | None = None) -> None:
        """Run ``action``. ``after``: an action started here on the same cores (the lease: the
        engine queued this one behind it): this one takes and prepares its sandbox now and writes
        its request the moment ``after``'s sandbox answers, in that call (``Turn``), or, should
        ``after`` end without an answer (cancelled, its sandbox dead), once it has ended. An
        ``after`` that has answered already, or is not this manager's, holds nothing up. A second
        follower of one action would share its cores: refused (``RuntimeError``)."""
        self.runs.start(action, allocation, after)

    def cancel(self, action_id: str) -> None:
        self.runs.cancel(action_id)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """The engine took cores back from a running action (``Shrink``): before this returns, its
        sandbox's cgroup is pinned to the cores it keeps (a cpuset write; the kernel moves its
        threads off the others at once), or, for a one-shot sharing the host's CPUs, its CPU-time
        quota is lowered to them. A run not placed yet is placed on them when it is. A write the
        group refuses kills the sandbox (the run ends ``infra_error``) rather than letting it keep
        the cores. The process keeps the thread counts it started with (``OMP_NUM_THREADS``...):
        they now share fewer cores. Without cgroups (the rlimits-and-affinity fallback) a running
        process keeps the affinity it started with until it ends."""
        self.runs.resize(action_id, allocation)

    def close_session(self, trajectory: str) -> None:
        self.resting.closed(trajectory)
        sb = self.book.close(trajectory)
        if sb is not None:
            if sb in self.busy or trajectory in self.book.using:  # a step still runs in it: no reuse
                self.kill_later(sb)
            else:
                self.spares.release(sb)

    def _expired(self, trajectory: str) -> None:
        if self.expire is not None:
            self.expire(trajectory)
        else:
            self.close_session(trajectory)

    # -- what the runtime, the API and the server use --------------------------------------------
    def listen(self, action_id: str, on_output: Callable[[str, bytes], None]) -> Callable[[], None]:
        """Stream the output of step ``action_id`` (a shell command or a python cell; not started
        yet) to ``on_output(stream, data)`` while it runs, ``stream`` being ``stdout`` or
        ``stderr``; returns the call that stops it. Bounded as every step's output is: past
        ``max_output_bytes`` a stream's bytes are dropped (never forwarded, never held; the result
        says ``truncated``). ``on_output`` is called on the event loop of this manager's process:
        it must return at once (hand the bytes on, as the E2B API's buffers do), for a slow one
        stalls every other action of the process, not only this step. Chunks come at most every
        5 ms per step (the runner coalesces). A step nobody listens to pays nothing for this (one
        dict lookup). The step's result still carries its whole (capped) output."""
        return self.runs.listen(action_id, on_output)

    def feed(self, action_id: str, stdin: LiveStdin) -> Callable[[], None]:
        """Give shell step ``action_id`` (not started yet) a live stdin: what is sent to ``stdin``
        reaches the step while it runs (``livestdin.py``); returns the call that forgets it."""
        return self.runs.feed(action_id, stdin)

    def one_shot_sandboxes(self) -> dict[str, int]:
        """Counts since start of what became of one-shot sandboxes (``/healthz``
        ``one_shot_sandboxes``; ``bench server`` reports each level's part): started for the warm
        pool, started by a run that found the pool empty with none being reset, recycled after a
        run, discarded after one (unclean or worn out: killed instead of reused), and killed clean
        because the pool was at its idle cap. A steady load should start next to none: each start
        costs 10-50 ms of CPU, against ~1 ms for a reset."""
        return self.pool.stats()

    @property
    def shares_cpus(self) -> bool:
        """Whether one-shots share the host's CPUs here (``OneShots.shares_cpus``)."""
        return self.pool.shares_cpus

    def has_session(self, trajectory: str) -> bool:
        """A session of that id has state here (a sandbox, or a root waiting for its first step)."""
        return self.book.exists(trajectory)

    def host_files(self, trajectory: str, files: Files) -> tuple[Outcome, SandboxResult] | None:
        """A session's file action carried out from this process, or None where the runner must
        (``SessionBook.host_files``). The caller holds the session's step lock."""
        return self.book.host_files(trajectory, files)

    async def prewarm(self, image: str, n: int) -> Prewarmed:
        """Have ``n`` more sandboxes of ``image`` ready for new sessions and one-shots, within
        ``max_idle_sandboxes`` (the result says how many were started and why not all). An
        image named by a reference not here is pulled first."""
        if self.mode is not Isolation.BWRAP:
            raise ImageError(f"image: sandboxes from images need bubblewrap isolation (this host uses "
                             f"{self.mode.value if self.mode else 'none yet'})")
        name = await self.pulls.ready(image)
        return await self.imageboxes.prewarm(name, n, len(self.pool.idle or ()) + len(self.spares.idle))

    # -- images from registries (pulls.py) -------------------------------------------------------
    def check_image(self, image: str) -> None:
        """``ImageError`` unless ``image`` is here or a registry reference; a reference not here
        starts to be pulled (the session's first step waits for what is left)."""
        self.pulls.check(image)
        if self.mode is not None and not self.closing:
            self.pulls.prefetch(image)

    async def pull_image(self, image: str) -> str:
        """The store's name for ``image``, pulled now if it is a reference not here."""
        return await self.pulls.ready(image)

    def pulling(self, action_id: str) -> str | None:
        """"pulling IMAGE: N of M MB" while an action waits for its image's pull; else None."""
        return self.pulls.pulling(action_id)

    def image_stats(self) -> dict:
        """Pulls, bytes pulled, pull seconds, cache hits, evictions and the store's disk use."""
        return self.pulls.stats()

    async def sessions_warm(self, timeout_s: float) -> bool:
        """Wait until the sessions' pool is full (False: not within ``timeout_s``). A server waits
        for this before it answers: a session's first step otherwise pays a layered sandbox's
        start (50-140 ms, against 4-5 ms from the pool)."""
        return await self.spares.ready(timeout_s)

    # -- sessions at rest (resting.py) -----------------------------------------------------------
    async def rest(self, trajectory: str) -> bool:
        """Put an idle session to rest now (True), or say it cannot be (``Resting.rest``)."""
        return await self.resting.rest(trajectory)

    def rest_stats(self) -> dict:
        """What ``/healthz``, ``/metrics`` and ``tangram top`` show of rest (counts since start)."""
        return self.resting.stats()

    def session_state(self, trajectory: str) -> str | None:
        """``running``, ``awake``, ``resting``, ``at_rest``, ``pending`` or None (``SessionBook.state``)."""
        return self.book.state(trajectory)

    def prune_rested(self) -> int:
        """Remove the blobs in a configured ``rest_dir`` no session at rest here owns; how many."""
        return self.resting.prune()

    def adopt_rested(self, trajectory: str, path: str, image: str | None = None) -> None:
        """A session put to rest by an earlier server wakes on its next step (``Resting.adopt``)."""
        self.resting.adopt(trajectory, path, image)

    @property
    def store(self) -> RestStore | None:
        """Where rested sessions' blobs are (made at start)."""
        return self.resting.store

    @property
    def on_rest(self) -> Callable[[str, str | None], None] | None:
        """Told (session, blob path) when a session is put to rest, (session, None) when it wakes."""
        return self.resting.on_rest

    @on_rest.setter
    def on_rest(self, fn: Callable[[str, str | None], None] | None) -> None:
        self.resting.on_rest = fn

    @property
    def rest_recorded(self) -> Callable[[], Awaitable[None]] | None:
        """Returns once ``on_rest``'s news is durable (a rest waits for it before ending processes)."""
        return self.resting.rest_recorded

    @rest_recorded.setter
    def rest_recorded(self, fn: Callable[[], Awaitable[None]] | None) -> None:
        self.resting.rest_recorded = fn
