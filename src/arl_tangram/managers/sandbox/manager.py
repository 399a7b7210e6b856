"""The sandbox manager: carries out the engine's CPU decisions with real sandboxes.

A trajectory's session keeps its sandbox (workspace files, the persistent python interpreter)
for its whole life but holds cores only while an action runs: the sandbox is pinned to the
allocation's cores (cpuset) when an action starts and frozen (cgroup freezer) when it ends.
One-shot runs take a sandbox from a warm pool, so no action pays isolation or interpreter start-up.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Awaitable, Callable

from ...core.action import Action, Allocation, Outcome, Setup
from ...core.seam import Completion, Sink
from ..tasks import TaskSet
from . import envops, hostfiles, languages
from .cgroups import CgroupRoot, open_root
from .corewaits import CoreWaits
from .imagebox import ImageSandboxes, Prewarmed
from .images import ImageError, ImageStore, resolve_in
from .isolation import Isolation, Layout, command, compile_runner, detect
from .livestdin import LiveStdin
from .recycle import Recycler
from .rest import Rested, RestFailed, RestStore, load, pack
from .rootfs import HOST_IMAGE, RootFs, overlay_supported
from .sandbox import Limits, Sandbox, SandboxDied, Turn
from .spec import (CommandResult, Exec, Files, Fork, FsCall, Restore, RunCode, SandboxConfig, SandboxResult, Snapshot,
                   cut_files_note)

__all__ = ["CommandResult", "Exec", "Files", "Fork", "FsCall", "Restore", "RunCode", "SandboxConfig", "SandboxManager",
           "SandboxResult", "Snapshot"]

log = logging.getLogger(__name__)


_SANDBOX_IDS = itertools.count()

#: sandbox spawns the warm pool keeps in flight per core: a spawn mostly waits on the kernel
#: (namespaces, mounts), not on a CPU. Measured on a 2-core host: 17.5 spawns/s with 1 in flight,
#: 28.8 with 2 (the first release's one per core), 57 with 4, 67 with 8.
SPAWNS_PER_CORE = 4

#: seconds a workspace file transfer (put/get) may take before the sandbox is declared dead
READ_MAX = 1 << 24  # the most one read of a file carries (the runner's own cap)
FILES_TIMEOUT_S = 30.0

#: seconds a new session (or a wake) waits for a session sandbox being reset when the sessions'
#: pool is empty, before it starts a sandbox of its own: a reset is ~3-9 ms, a start 50-140 ms
RETURN_WAIT_S = 0.05
#: sessions put to rest at once: a rest is mostly waiting (the runner packing, the disk, the
#: sandbox's death), and a pass that keeps up with new sessions must overlap a few
REST_PARALLEL = 4
#: a rested session's blob up to this size is read by the event loop itself when it wakes
#: (a page-cache read of a few KB: tens of microseconds), larger ones in a thread
INLINE_READ = 256 << 10
#: modules a fresh warm-pool sandbox imports before it is taken (``runner.op_warm``): those rested
#: sessions use most, up to this many; standard library ones only (importing runs a module's code
#: in a sandbox another session will get) and none with side effects
WARM_MODULES = 8
NEVER_WARM = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser", "pydoc",
                        "ensurepip", "venv", "__main__", "builtins", "sys"})


class SandboxManager:
    """Implements the engine's ``Manager`` protocol for ``Pool.CPU``: reports each action's
    ``Completion`` (its ``result`` a ``SandboxResult``) to ``sink``; ``expire(trajectory)`` is
    told when a session has been idle past ``session_idle_expiry_s`` (the runtime ends the
    trajectory in the engine, which then closes the session here)."""

    def __init__(self, config: SandboxConfig | None = None, sink: Sink | None = None,
                 expire: Callable[[str], None] | None = None) -> None:
        self.config = config or SandboxConfig()
        c = self.config
        self.layout = Layout(c.interpreter, tuple(c.interpreter_args), tuple(c.ro_binds), c.workspace_mb << 20,
                             c.tmp_mb << 20)
        self.mode: Isolation | None = None
        self.root: CgroupRoot | None = None
        self.host_cpus = tuple(c.cpus) if c.cpus else tuple(sorted(os.sched_getaffinity(0)))
        self.tasks = TaskSet(sink or _unwired, "sandboxes")
        self.expire = expire
        self.sessions: dict[str, Sandbox] = {}
        self._last_used: dict[str, float] = {}
        self._pool: list[Sandbox] | None = None  # oldest first
        self._session_pool: list[Sandbox] = []  # layered default sandboxes for new sessions
        self._returning = 0  # session sandboxes being reset for the sessions' pool (``_recycle_session``)
        self._releasing: set[Sandbox] = set()  # those sandboxes: a second release of one is refused
        self._returned: asyncio.Event | None = None  # set when one is put back
        #: one-shot sandboxes of the default image started afresh: for the warm pool ("pool"), and for
        #: a run that found it empty with none being reset ("run")
        self.fresh: Counter[str] = Counter()
        self.layered = False  # default sessions get a copy-on-write workspace (bwrap, overlays)
        self._closing = False
        self._fill: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self._hostdirs: list[str] = []
        self._busy: set[Sandbox] = set()  # sandboxes running an action right now
        #: running actions -> [their sandbox once it is pinned (None before), the cores they may
        #: use]: registered at ``start`` so that a ``resize`` before the run is pinned is not lost
        self._pins: dict[str, list] = {}
        #: actions started here whose sandbox has not answered yet (``start``'s ``after``)
        self._unanswered: dict[str, _Unanswered] = {}
        self._followers = 0  # followers whose turn has not come: each holds a sandbox, soon reset
        self._owed = 0  # recycled one-shot sandboxes discarded and not replaced yet (``_lost``)
        self.core_waits = CoreWaits()  # each core's wait between two one-shots (``/healthz`` core_waits)
        self.images = ImageStore(c.image_store)
        self.imageboxes: ImageSandboxes | None = None
        self.pending_roots: dict[str, RootFs] = {}  # forked/restored sessions: root mounted, processes on first use
        self.recycler = Recycler(False, self._put_back, self.tasks.spawn)
        # sessions at rest (rest.py): their state on disk, no processes
        self.rested: dict[str, Rested] = {}
        self.store: RestStore | None = None
        self.on_rest: Callable[[str, str | None], None] | None = None  # (session, blob path; None: woken)
        self.rest_recorded: Callable[[], Awaitable[None]] | None = None  # returns once on_rest's news is durable
        self.rest_counts = {"rests": 0, "wakes": 0, "rest_failures": 0, "wake_failures": 0}
        self._using: set[str] = set()  # sessions a step of which is being carried out: never put to rest
        self._moving: dict[str, asyncio.Future] = {}  # sessions being put to rest now
        self._close_after_rest: set[str] = set()
        self._unrestable: dict[str, float] = {}  # failed to rest when last used at this time: not retried
        self._rester: asyncio.Task | None = None
        self._module_uses: Counter[str] = Counter()  # modules in rested sessions' namespaces
        self._listeners: dict[str, Callable[[str, bytes], None]] = {}  # streamed steps (``listen``)
        self._stdins: dict[str, LiveStdin] = {}  # shell steps with a live stdin (``feed``)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start_up(self) -> None:
        c = self.config
        self.mode = detect(self.config.isolation, self.layout)
        if self.mode is Isolation.BWRAP:  # the runner compiled once, not at every sandbox's start
            cache = tempfile.mkdtemp(prefix="tangram-pyc-")
            self._hostdirs.append(cache)
            if await asyncio.to_thread(compile_runner, c.interpreter, tuple(c.interpreter_args), cache):
                self.layout = dataclasses.replace(self.layout, pycache=cache)
        if self.mode is Isolation.NONE:
            log.warning("sandbox isolation is OFF (isolation: none): only run trusted code")
        self.root = open_root()
        self.store = RestStore(c.rest_dir)
        self.imageboxes = ImageSandboxes(self.images, self.layout, Limits(c.memory_mb << 20, c.pids_max), self.root,
                                         c.interpreter, tuple(c.interpreter_args), c.max_idle_sandboxes)
        if c.image is not None:  # the default image: fail at start, not at every action
            if self.mode is not Isolation.BWRAP:
                raise ImageError(f"sandbox.image: sandboxes from images need bubblewrap isolation (this host uses "
                                 f"{self.mode.value})")
            try:
                self.imageboxes.image(c.image)
            except ImageError as e:
                raise ImageError(f"sandbox.{e}") from None
        self.layered = self.mode is Isolation.BWRAP and c.image is None and overlay_supported() is None
        if self.mode is Isolation.BWRAP and c.image is None and not self.layered:
            log.warning("default sessions cannot fork or snapshot here: %s", overlay_supported())
        self._pool = []
        self._taken = asyncio.Event()
        self._fill = asyncio.get_running_loop().create_task(self._keep_pool_full())
        self._reaper = asyncio.get_running_loop().create_task(self._expire_sessions())
        self.recycler = Recycler(self.config.recycle and self.mode is Isolation.BWRAP, self._put_back,
                                 self.tasks.spawn, self.config.recycle_max_uses, ahead=self.config.fork_ahead,
                                 settled=self._sandbox_back, lost=self._lost)
        log.info("sandboxes: isolation %s, cgroups %s, %d CPUs, warm pool %d, one-shots %s", self.mode.value,
                 "v2" if self.root and self.root.v2 else ("v1" if self.root else "unavailable"), len(self.host_cpus),
                 self.config.warm_pool, "share the CPUs" if self.shares_cpus else "pinned to their cores")

    async def shut_down(self) -> None:
        """Kill every sandbox and remove every cgroup and directory this manager made."""
        self._closing = True
        loops = [t for t in (self._fill, self._reaper, self._rester) if t is not None]
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)  # the refill kills its half-made sandboxes
        # running actions are cancelled (their handlers kill their sandboxes); kills and resets in
        # flight are waited for, never cancelled half-way (a reset that ends now kills its sandbox)
        await self.tasks.close(cancel_background=False)
        doomed = list(self.sessions.values())
        self.sessions.clear()
        if self._pool is not None:
            doomed += self._pool
            self._pool.clear()
        doomed += self._session_pool
        self._session_pool.clear()
        await asyncio.gather(*(sb.kill() for sb in doomed), return_exceptions=True)
        for rootfs in self.pending_roots.values():
            rootfs.release()
        self.pending_roots.clear()
        for rested in self.rested.values():
            if rested.rootfs is not None:
                rested.rootfs.release()
        self.rested.clear()  # their blobs stay in a configured rest_dir (the server's journal knows them)
        if self.store is not None:
            self.store.close()
        if self.imageboxes is not None:
            await self.imageboxes.shut_down()
        if self.root is not None:
            self.root.cleanup()
        for d in self._hostdirs:
            shutil.rmtree(d, ignore_errors=True)

    async def _spawn(self, warm: bool = True) -> Sandbox:
        """A new sandbox of the default image; ``warm``: for the pool (``op_warm`` first), not for
        a caller that waits for it (a one-shot would pay the imports for nothing)."""
        if self.config.image is not None:  # the warm pool holds sandboxes of the default image
            return await self.imageboxes.spawn(self.config.image)
        sid = f"sb-{next(_SANDBOX_IDS)}-{os.urandom(3).hex()}"  # unique across managers of a process
        workspace = None
        if self.mode is Isolation.NONE:
            workspace = tempfile.mkdtemp(prefix="tangram-ws-")
            self._hostdirs.append(workspace)
        argv = command(self.mode, self.layout, workspace=workspace)
        limits = Limits(self.config.memory_mb << 20, self.config.pids_max)
        sb = await Sandbox.spawn(sid, argv, self.root, limits, cwd=workspace)
        sb.recyclable = True  # our own tree (isolation.WRITABLE is all it can write), not an image's
        if not warm:
            return sb
        try:  # what a wake needs, imported now rather than on the woken session's step
            await sb.request({"op": "warm", "modules": self._warm_modules()}, 20.0)
        except SandboxDied:
            await sb.kill()
            raise
        return sb

    def _warm_modules(self) -> list[str]:
        return [m for m, n in self._module_uses.most_common(WARM_MODULES) if n >= 2]

    async def _spawn_session(self) -> Sandbox:
        """A default sandbox whose workspace is copy-on-write layered (``HOST_IMAGE``), for a new
        session: it can fork and snapshot. One-shots keep the plain tmpfs workspace (``_spawn``)."""
        sb = await self.imageboxes.spawn(HOST_IMAGE.name)
        try:  # as a plain one: what a wake and a first cell need, imported now (and the session's
            # interpreter forked from the zygote after them, ahead of the session: ``prefork``)
            modules = self._warm_modules()
            await sb.request({"op": "warm", "modules": modules, "prefork": True}, 20.0)
            sb.warmed = frozenset(modules)
            if self.config.warm_shell:
                # the session's shell, started before the session takes the sandbox: a session's
                # first command was 22-25 ms of which ~20 were starting it (then 2-3 ms a step)
                await sb.request({"op": "shell", "command": ":", "timeout_s": 10.0, "prestart": True}, 20.0)
        except SandboxDied:
            await sb.kill()
            raise
        return sb

    async def sessions_warm(self, timeout_s: float) -> bool:
        """Wait until the sessions' pool is full (False: not within ``timeout_s``). A server waits
        for this before it answers: a session's first step in its first half second otherwise paid
        a layered sandbox's start (50-140 ms on the 2-core VM; 4-5 ms once warm)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self._session_pool) < self._warm_sessions():
            if loop.time() >= deadline or self._closing:
                return False
            await asyncio.sleep(0.01)
        return True

    def _warm_sessions(self) -> int:
        """Layered sandboxes kept ready for new default sessions (within the idle cap)."""
        c = self.config
        return min(c.warm_sessions, max(0, c.max_idle_sandboxes - c.warm_pool)) if self.layered else 0

    async def _keep_pool_full(self) -> None:
        """Refill the sessions' pool and the one-shot pool, ``SPAWNS_PER_CORE`` spawns in flight
        per core (within the pools' sizes), sleeping until a sandbox is taken when they are full.

        The sessions' pool comes first: at start-up a session's first step otherwise paid a
        layered spawn while one-shot sandboxes filled (50-140 ms in the first half second), and
        a one-shot without a warm sandbox pays less (a plain spawn, no layered root). A take wakes
        the loop even while spawns are in flight: it used to wait for one of them to finish, so
        back-to-back creates drained the sessions' pool and most of them started a sandbox of
        their own (issue 22's create + first command under load)."""
        in_flight: dict[asyncio.Task, list[Sandbox]] = {}
        parallel = max(1, SPAWNS_PER_CORE * len(self.host_cpus))
        oneshots = self._pool
        assert oneshots is not None  # (made by ``start`` before this task)
        pools = [(self._session_pool, self._warm_sessions(), self._spawn_session),
                 (oneshots, self.config.warm_pool, self._spawn)]
        # sandboxes on their way back to a pool count as there: a new session takes a sandbox and
        # the one it sends to rest comes back a few ms later, a one-shot's comes back from its reset
        # within a millisecond, and a spawn started meanwhile (~50 ms of CPU: bubblewrap, an
        # interpreter, the warm-up) was mostly waste (measured: 15 spawns for 200 sessions opened
        # one at a time past max_awake_sessions; one-shots: see ``_take``)
        loop = asyncio.get_running_loop()
        taken: asyncio.Task | None = None

        def coming(pool: list[Sandbox]) -> int:
            """A pool's sandboxes, and those being started for it."""
            return len(pool) + sum(p is pool for p in in_flight.values())

        try:
            while not self._closing:
                self._taken.clear()
                for pool, size, spawn in pools:
                    while (len(in_flight) < parallel
                           and coming(pool)
                           + (self._coming_back() if pool is self._session_pool
                              else self.recycler.resetting + self._followers)
                           < size):
                        in_flight[loop.create_task(spawn())] = pool
                        if pool is oneshots:
                            self.fresh["pool"] += 1
                while self._owed and len(in_flight) < parallel:  # one-shot sandboxes lost from circulation
                    self._owed -= 1
                    # owed only while the followers' sandboxes hide the pool's shortfall from the rule
                    # above (under load), and within the idle cap: otherwise that rule refilled already
                    have = coming(oneshots) + self.recycler.resetting
                    if have >= min(self._idle_cap(), self.config.warm_pool + self._followers):
                        continue
                    in_flight[loop.create_task(self._spawn())] = oneshots
                    self.fresh["pool"] += 1
                if taken is None or taken.done():
                    taken = loop.create_task(self._taken.wait())
                done, _ = await asyncio.wait([*in_flight, taken], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is taken:
                        continue
                    pool = in_flight.pop(t)
                    try:
                        pool.append(t.result())
                    except SandboxDied as e:
                        log.error("cannot prepare a sandbox: %s", e)
                        await asyncio.sleep(1.0)
        finally:  # shutting down: let half-made sandboxes finish starting, then kill them
            if taken is not None:
                taken.cancel()
            for t in in_flight:
                try:
                    sb = await t
                except BaseException:
                    continue
                await sb.kill()

    def _idle_cap(self) -> int:
        """How many idle one-shot sandboxes the pool keeps at most."""
        c = self.config
        return min(max(c.recycle_pool_max, c.warm_pool), c.max_idle_sandboxes)

    def _put_back(self, sb: Sandbox) -> bool:
        """A recycled sandbox joins the pool (False: the pool is full or closing)."""
        if self._closing or self._pool is None or len(self._pool) >= self._idle_cap():
            return False
        self._pool.append(sb)
        return True

    async def _take(self, image: str | None = None, cores: tuple[int, ...] | None = None,
                    session: bool = False) -> Sandbox:
        """A prepared sandbox from the pool, or a fresh one when the pool is empty. One already
        pinned to ``cores`` is preferred: moving a group to other cores is a cgroup write per
        one-shot (~9% of the engine process's samples at 1,100 one-shots/s on 16 cores, py-spy),
        and a core freed by a one-shot is most often the next one's, so its sandbox comes back
        from recycling to the pool just in time."""
        if image is not None and image != self.config.image:
            if self.mode is not Isolation.BWRAP:
                raise ImageError(f"image: sandboxes from images need bubblewrap isolation (this host uses "
                                 f"{self.mode.value})")
            return self.imageboxes.take(image) or await self.imageboxes.spawn(image)
        self._taken.set()
        deadline = asyncio.get_running_loop().time() + RETURN_WAIT_S
        if session and self.layered:
            while True:
                while self._session_pool:
                    sb = self._session_pool.pop()
                    if not sb.dead and sb.proc.returncode is None:
                        return sb
                if not self._coming_back() or not await self._returned_by(deadline):
                    break
            return await self._made_for_action(self._spawn_session())
        pool = self._pool
        while True:
            while pool:
                i = next((k for k in range(len(pool) - 1, -1, -1) if pool[k].cpus == cores), 0) if cores else 0
                sb = pool.pop(i)
                if not sb.dead and sb.proc.returncode is None:
                    return sb
                if self.recycler.circulates(sb):  # died idle
                    self._lost()
            # one being reset is back within a millisecond; a fresh one takes 10-50 ms of CPU
            if not self.recycler.resetting or not await self._returned_by(deadline):
                break
        self.fresh["run"] += 1
        return await self._made_for_action(self._spawn(warm=False))

    async def _returned_by(self, deadline: float) -> bool:
        """Wait until a sandbox comes back to a pool, or until ``deadline`` (the loop's time);
        False if the deadline had passed already."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        if self._returned is None:
            self._returned = asyncio.Event()
        self._returned.clear()
        try:
            await asyncio.wait_for(self._returned.wait(), left)
        except asyncio.TimeoutError:
            pass
        return True

    def _sandbox_back(self) -> None:
        """A one-shot sandbox's reset ended (in the pool, or discarded): a ``_take`` waiting for
        one looks again, and so does the refill when the pool is short (the refill counted the
        reset as coming back, and a discarded one does not)."""
        if self._returned is not None:
            self._returned.set()
        if self._pool is not None and len(self._pool) < self.config.warm_pool:
            self._taken.set()

    async def _kill_unreset(self, sb: Sandbox, traj: str | None) -> None:
        """Kill an action's sandbox outside the recycler's verdict (its run cancelled or failed); a
        one-shot's is replaced as the recycler's discards are (``_lost``)."""
        await sb.kill()
        if traj is None and self.recycler.circulates(sb):
            self._lost()

    def _lost(self) -> None:
        """A recycled one-shot sandbox was discarded (worn out, unclean, dead): start another for
        the pool now. The refill's own rule never would under load: it counts the sandboxes that
        followers hold, which cover the warm pool's size whenever every core has a follower, so
        the sandboxes in circulation (three a busy core: its run's, its follower's, the last one
        being reset) dwindled with each discard until runs found the pool empty and started their
        own, on the latency path (2-14 a level of 5,000 one-shots on 12 cores, issue 26's
        eleventh round: docs/performance.md). The replacement is started only while that rule is
        blind (the pool, its spawns and resets below the warm size plus the followers' sandboxes)
        and within the idle cap: at a light load the rule has refilled for the run already."""
        if self._closing or self._pool is None:
            return
        self._owed += 1
        self._taken.set()

    async def _made_for_action(self, spawn) -> Sandbox:
        """A sandbox made for an action, shielded from the action's cancel: a cancel that lands
        inside ``create_subprocess_exec`` makes asyncio kill the half-started process and wait for
        an exit its child watcher may never report (seen: a cancelled one-shot hung its caller for
        good, 2 runs in 10 of test_runtime's cancel test once the sessions' warm pool made one-shots
        spawn their own sandbox more often). The spawn finishes in the background; a sandbox
        nobody wants any more is killed."""
        task = self.tasks.spawn(spawn)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._kill_unwanted)
            raise

    def _kill_unwanted(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self._kill_later(task.result())

    async def _expire_sessions(self) -> None:
        c = self.config
        while not self._closing:
            await asyncio.sleep(min(1.0, c.session_idle_expiry_s / 4, (c.rest_after_s or 4.0) / 4))
            now = time.monotonic()
            self._want_rest()
            for traj, last in list(self._last_used.items()):
                if now - last > self.config.session_idle_expiry_s and traj not in self._using and self._exists(traj):
                    log.info("session %s idle for %.0fs: closing it", traj, now - last)
                    if self.expire is not None:
                        self.expire(traj)
                    else:
                        self.close_session(traj)

    # -- the manager protocol --------------------------------------------------------------------
    def start(self, action: Action, allocation: Allocation, after: str | None = None) -> None:
        """Run ``action``. ``after``: an action started here on the same cores (the lease: the
        engine queued this one behind it): this one takes and prepares its sandbox now and writes
        its request the moment ``after``'s sandbox answers, in that call (``Turn``), or, should
        ``after`` end without an answer (cancelled, its sandbox dead), once it has ended. An
        ``after`` that has answered already, or is not this manager's, holds nothing up. A second
        follower of one action would share its cores: refused (``RuntimeError``)."""
        mine = _Unanswered()
        before = self._unanswered.get(after) if after is not None else None
        if before is not None:
            if before.next is not None:
                raise RuntimeError(f"{after} already has a follower here")
            mine.turn, mine.before, before.next = Turn(), before, mine
            self._followers += 1
        self._unanswered[action.id] = mine
        self._pins[action.id] = [None, self._cores(allocation)]
        self.tasks.run(action, lambda: self._run_pinned(action, allocation, mine))
        # ended in any way, a task cancelled before it ran included: what follows it is not held up for good
        self.tasks.actions[action.id].add_done_callback(lambda _: self._over(action.id, mine))

    def _over(self, action_id: str, mine: _Unanswered) -> None:
        """``action_id``'s sandbox answered, or it ended: its follower's turn. One that ended
        before its own turn came never ran: it leaves its place in the queue to what followed it,
        which waits for what it waited for (else it would share that run's cores)."""
        if mine.done:
            return  # told already
        mine.done = True
        if self._unanswered.get(action_id) is mine:  # else a run of the same id since is another's
            del self._unanswered[action_id]
        if self._pool is not None:  # started up: a follower fewer, so the refill looks again
            self._taken.set()
        if mine.turn is not None and not mine.turn.opened:
            self._followers -= 1
            before, after = mine.before, mine.next
            assert before is not None
            before.next = after
            if after is not None:
                after.before = before
        elif mine.next is not None:
            self._followers -= 1
            mine.next.before = None
            mine.next.turn.open()

    async def _run_pinned(self, action: Action, allocation: Allocation, mine: _Unanswered) -> Completion:
        try:
            return await self._run(action, allocation, mine)
        finally:
            self._pins.pop(action.id, None)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """The engine took cores back from a running action (``Shrink``): before this returns, its
        sandbox's cgroup is pinned to the cores it keeps (a cpuset write; the kernel moves its
        threads off the others at once), or, for a one-shot sharing the host's CPUs, its CPU-time
        quota is lowered to them. A run not placed yet is placed on them when it is. A write the
        group refuses kills the sandbox (the run ends ``infra_error``) rather than letting it keep
        the cores. The process keeps the thread counts it started with (``OMP_NUM_THREADS``...):
        they now share fewer cores. Without cgroups (the rlimits-and-affinity fallback) a running
        process keeps the affinity it started with until it ends."""
        pin = self._pins.get(action_id)
        if pin is None:
            return  # ended, or not ours
        cores = self._cores(allocation)
        pin[1] = cores
        sb = pin[0]
        if sb is not None and not sb.dead:
            try:  # a one-shot sharing the host's CPUs keeps sharing them, with a smaller quota
                sb.set_cpus(*self._placement(cores, sb.cpu_quota is not None))
            except OSError as e:
                # the group is gone (the sandbox died), or would not take the write: the run must
                # not go on using the cores taken back, so it ends as an infrastructure failure
                log.warning("cannot bound sandbox %s to cores %s: %s; killing it", sb.id, cores, e)
                self._kill_later(sb)

    def listen(self, action_id: str, on_output: Callable[[str, bytes], None]) -> Callable[[], None]:
        """Stream the output of step ``action_id`` (a shell command or a python cell; not started
        yet) to ``on_output(stream,
        data)`` while it runs, ``stream`` being ``stdout`` or ``stderr``; returns the call that
        stops it. Bounded as every step's output is: past ``max_output_bytes`` a stream's bytes
        are dropped (never forwarded, never held; the result says ``truncated``). ``on_output`` is
        called on the event loop of this manager's process: it must return at once (hand the
        bytes on, as the E2B API's buffers do), for a slow one stalls every other action of the
        process, not only this step. Chunks come at most every 5 ms per step (the runner
        coalesces). A step nobody listens to pays nothing for this (one dict lookup). The step's
        result still carries its whole (capped) output."""
        cap = self.config.max_output_bytes
        seen = {"stdout": 0, "stderr": 0}

        def capped(stream: str, data: bytes) -> None:  # the runner caps too; this holds if it lies
            room = cap - seen[stream]
            if room > 0:
                seen[stream] += min(room, len(data))
                try:
                    on_output(stream, data[:room])
                except Exception:  # the listener's bug: it hears no more, the step runs on
                    log.exception("output listener of %s failed: it is dropped", action_id)
                    seen[stream] = seen["stdout"] = seen["stderr"] = cap

        def stop() -> None:
            self._listeners.pop(action_id, None)

        self._listeners[action_id] = capped
        return stop

    def feed(self, action_id: str, stdin: LiveStdin) -> Callable[[], None]:
        """Give shell step ``action_id`` (not started yet) a live stdin: what is sent to ``stdin``
        reaches the step while it runs (``livestdin.py``); returns the call that forgets it."""

        def stop() -> None:
            self._stdins.pop(action_id, None)

        self._stdins[action_id] = stdin
        return stop

    def one_shot_sandboxes(self) -> dict[str, int]:
        """Counts since start of what became of one-shot sandboxes (``/healthz``
        ``one_shot_sandboxes``; ``bench server`` reports each level's part): started for the warm
        pool, started by a run that found the pool empty with none being reset, recycled after a
        run, discarded after one (unclean or worn out: killed instead of reused), and killed clean
        because the pool was at its idle cap. A steady load should start next to none: each start
        costs 10-50 ms of CPU, against ~1 ms for a reset."""
        return {"started_for_pool": self.fresh["pool"], "started_for_run": self.fresh["run"],
                "recycled": self.recycler.recycled, "discarded": sum(self.recycler.discarded.values()),
                "over_cap": self.recycler.over_cap}

    def _cores(self, allocation: Allocation) -> tuple[int, ...]:
        """The host cores an allocation's units name."""
        return tuple(self.host_cpus[u % len(self.host_cpus)] for u in allocation.units) or self.host_cpus[:1]

    @property
    def shares_cpus(self) -> bool:
        """Whether one-shots run on any of the host CPUs (``one_shots_share_cpus``) here: only
        where cgroups bound their CPU time (the cpu controller's quota). Without cgroups they are
        pinned by affinity: hostile code may widen its own, but code that sizes itself by its
        affinity (Go, Java, ``os.sched_getaffinity``) stays on its cores."""
        return self.config.one_shots_share_cpus and self.root is not None and self.root.bounds_cpu_time

    def _placement(self, cores: tuple[int, ...], one_shot: bool) -> tuple[tuple[int, ...], int | None]:
        """Where a run on ``cores`` goes: (CPUs, quota in CPUs' worth of time or None).

        A one-shot shares the host's CPUs, bounded to ``len(cores)`` CPUs' time: pinned, a
        one-shot whose CPU ran something else (the server's own processes, the last run's reset,
        a zygote's fork) waited for it while other CPUs idled. At 16 cores the CPUs were 76-86%
        busy pinned and 88-95% shared, 1.11-1.18x one-shots/s (docs/performance.md, tenth round).
        A session stays pinned: its processes outlive the action, and its cores are what
        ``resize`` takes back."""
        if one_shot and self.shares_cpus:
            return self.host_cpus, len(cores)
        return cores, None

    def cancel(self, action_id: str) -> None:
        self._pins.pop(action_id, None)  # a task cancelled before it ran never reaches its ``finally``
        mine = self._unanswered.get(action_id)
        if mine is not None and mine.turn is not None and not mine.turn.opened:
            self._over(action_id, mine)  # its place goes now: the engine may queue another there at once
        self.tasks.cancel(action_id)

    def close_session(self, trajectory: str) -> None:
        sb = self.sessions.pop(trajectory, None)
        self._last_used.pop(trajectory, None)
        self._unrestable.pop(trajectory, None)
        resting = trajectory in self._moving
        if resting:  # being put to rest: its blob goes once it is written
            self._close_after_rest.add(trajectory)
        rested = self.rested.pop(trajectory, None)
        if rested is not None:
            self._forget(rested)
        pending = self.pending_roots.pop(trajectory, None)
        if pending is not None:
            self.imageboxes.drop(pending)
        # a resting session's sandbox is released by ``rest`` alone (review H1: released here too,
        # it was reset twice, put in the sessions' pool twice, and two later sessions shared it)
        if sb is not None and not resting:
            if sb in self._busy or trajectory in self._using:  # a step still runs in it: no reuse
                self._kill_later(sb)
            else:
                self._release_session(sb)

    def _kill_later(self, sb: Sandbox) -> None:
        self.tasks.spawn(sb.kill())

    def _release_session(self, sb: Sandbox) -> None:
        """A session has left ``sb`` (its state packed, or the session closed): reset it for the
        next session and put it in the sessions' pool (``Recycler.session_verdict``: the same wipe
        and checks as a one-shot's), or kill it when that cannot be verified or the pool is full.
        An open or a wake then costs a fork of the sandbox's zygote, not a new sandbox.

        Once per sandbox: one already being reset or back in the pool is refused (logged), so one
        sandbox never ends up in the pool twice, for two sessions (review H1)."""
        if sb in self._releasing or sb in self._session_pool:
            log.warning("session sandbox %s released twice: the second release is ignored", sb.id)
            return
        self._releasing.add(sb)
        self._returning += 1
        self.tasks.spawn(self._recycle_session(sb))

    async def _recycle_session(self, sb: Sandbox) -> None:
        """Reset ``sb``; then, if sessions have come to use modules its zygote has not imported
        (``_warm_modules``), import them there; and fork the next session's interpreter ahead
        (``prefork``), off the next open's or wake's latency path (measured, 200 opens one at a
        time on the 2-core VM: a first cell importing json, re and collections 11.4 ms p50 in a
        recycled sandbox that had not imported them, a wake 7.9 ms)."""
        try:
            await self._reuse_session(sb)
        finally:
            self._releasing.discard(sb)
            self._returning -= 1
            if self._returned is not None:
                self._returned.set()

    async def _reuse_session(self, sb: Sandbox) -> None:
        if not sb.dead and sb.frozen:
            sb.thaw()
        if self._closing or len(self._session_pool) >= self._session_pool_cap():
            await sb.kill()
            return
        modules = self._warm_modules()
        missing = [m for m in modules if m not in sb.warmed]
        if await self.recycler.session_verdict(sb, prefork=not missing) is None:
            try:
                if missing:
                    await sb.request({"op": "warm", "modules": missing, "prefork": True}, 20.0)
                    sb.warmed = sb.warmed | frozenset(missing)
                if self._put_back_session(sb):
                    return
            except SandboxDied as e:
                log.warning("session sandbox %s not recycled: warming it failed: %s", sb.id, e)
        await sb.kill()

    def _coming_back(self) -> int:
        """Session sandboxes on their way to the sessions' pool: being reset, or their session
        being put to rest (most come back; an image session's does not, nor an unclean one)."""
        return self._returning + len(self._moving)

    def _session_pool_cap(self) -> int:
        c = self.config
        return min(max(c.warm_sessions, c.recycle_pool_max), c.max_idle_sandboxes) if self.layered else 0

    def _put_back_session(self, sb: Sandbox) -> bool:
        if sb in self._session_pool:  # (``_release_session`` refuses a second release: never twice here)
            return True
        if self._closing or len(self._session_pool) >= self._session_pool_cap():
            return False
        self._session_pool.append(sb)
        return True

    async def prewarm(self, image: str, n: int) -> Prewarmed:
        """Have ``n`` more sandboxes of ``image`` ready for new sessions and one-shots, within
        ``max_idle_sandboxes`` (the result says how many were started and why not all)."""
        if self.mode is not Isolation.BWRAP:
            raise ImageError(f"image: sandboxes from images need bubblewrap isolation (this host uses "
                             f"{self.mode.value if self.mode else 'none yet'})")
        return await self.imageboxes.prewarm(image, n, (len(self._pool) if self._pool is not None else 0)
                                             + len(self._session_pool))

    async def _restore(self, action: Action, restore: Restore) -> tuple[Outcome, SandboxResult]:
        """Make the action's trajectory a new session whose files are those of a snapshot (its
        processes start on its first step); ``rejected`` saying why a snapshot cannot be."""
        trajectory = action.trajectory
        try:
            if self.mode is not Isolation.BWRAP:
                raise ImageError("restore: sandboxes from images need bubblewrap isolation")
            if trajectory is None or self._exists(trajectory):
                raise ImageError(f"restore: session {trajectory!r} already exists" if trajectory else
                                 "restore: the action names no trajectory (the new session)")
            root = await asyncio.to_thread(envops.restore, self.imageboxes, trajectory, restore.path)
        except ImageError as e:
            return Outcome.REJECTED, SandboxResult(message=str(e))
        if self._exists(trajectory):  # made meanwhile
            await asyncio.to_thread(self.imageboxes.drop, root)
            return Outcome.REJECTED, SandboxResult(message=f"restore: session {trajectory!r} already exists")
        self._adopt(trajectory, root)
        return Outcome.OK, SandboxResult(info={"image": None if root.workspace_only else root.image.name})

    def _why_not_layered(self) -> str:
        if self.mode is not Isolation.BWRAP:
            return f"sandboxes here use {self.mode.value if self.mode else 'no'} isolation, layers need bubblewrap"
        return overlay_supported() or "the session's sandbox was started without layers"

    def has_session(self, trajectory: str) -> bool:
        """A session of that id has state here (a sandbox, or a root waiting for its first step)."""
        return self._exists(trajectory)

    def host_files(self, trajectory: str, files: Files) -> tuple[Outcome, SandboxResult] | None:
        """A session's file action carried out from this process (``hostfiles``: no runner round
        trip, no base64), or None where it cannot be: the session's sandbox has not started, runs
        without isolation, or a path is not plain (a symlink, a FIFO, ``..``): the runner does it
        then, as it does while the session is being put to rest (the action waits for the rest, then
        wakes it: review M6, a file written here after the pack was acknowledged, then lost). The
        caller holds the session's step lock."""
        sb = self.sessions.get(trajectory)
        if sb is None or sb.dead or sb.proc.returncode is not None or trajectory in self._moving:
            return None
        if sb.workspace_fd is None:
            sb.workspace_fd = hostfiles.open_workspace(sb.proc.pid)
            if sb.workspace_fd is None:
                sb.workspace_fd = -1
        if sb.workspace_fd < 0:
            return None
        out = SandboxResult()
        try:
            for rel, data in files.put.items():
                hostfiles.write(sb.workspace_fd, rel, data)
            for rel in files.get:
                got = hostfiles.read(sb.workspace_fd, rel, READ_MAX)
                if got is None:
                    out.missing.append(rel)
                else:
                    out.files[rel] = got
        except hostfiles.Unsafe:
            return None
        except OSError as e:  # the workspace is full, a directory where a file is named
            return Outcome.FAILED, SandboxResult(message=f"files: {e.strerror or e}")
        self._last_used[trajectory] = time.monotonic()
        return Outcome.OK, out

    def _exists(self, trajectory: str) -> bool:
        return trajectory in self.sessions or trajectory in self.pending_roots or trajectory in self.rested

    # -- rest and wake (rest.py) -----------------------------------------------------------------
    def _forget(self, rested: Rested) -> None:
        """A rested session is closed: its blob goes (and its root, for an image session)."""
        if self.store is not None:
            self.store.forget(rested)
        if rested.rootfs is not None and self.imageboxes is not None:
            self.imageboxes.drop(rested.rootfs)

    def _want_rest(self) -> None:
        """Start a pass putting sessions to rest, unless one is running (it loops while there is work)."""
        if self._closing or self.store is None:
            return
        if self._rester is None or self._rester.done():
            self._rester = asyncio.get_running_loop().create_task(self._rest_pass())

    def _to_rest(self) -> list[str]:
        """Idle sessions due for rest, least recently used first: those idle ``rest_after_s``,
        and as many as are awake past ``max_awake_sessions``."""
        c = self.config
        now = time.monotonic()
        idle = []
        for t in self.sessions:  # the awake ones, not the (many more) at rest
            last = self._last_used.get(t, 0.0)
            if t not in self._using and t not in self._moving and self._unrestable.get(t) != last:
                idle.append((last, t))
        idle.sort()
        # sessions a step is making awake (waking, or opening) count as awake already
        coming = sum(1 for t in self._using if t not in self.sessions)
        over = len(self.sessions) + coming - c.max_awake_sessions
        return [t for i, (last, t) in enumerate(idle) if i < over or (c.rest_after_s and now - last >= c.rest_after_s)]

    async def _rest_pass(self) -> None:
        while not self._closing:
            picks = self._to_rest()[:REST_PARALLEL]
            if not picks:
                return
            await asyncio.gather(*(self.rest(t) for t in picks))

    async def rest(self, trajectory: str) -> bool:
        """Put an idle session to rest now (True), or say it cannot be (False: busy, gone, or its
        state could not be packed; it then stays awake, untouched)."""
        sb = self.sessions.get(trajectory)
        if sb is None or sb.dead or trajectory in self._using or trajectory in self._moving or self.store is None:
            return False
        done = asyncio.get_running_loop().create_future()
        self._moving[trajectory] = done
        last = self._last_used.get(trajectory, 0.0)
        try:
            sb.thaw()
            # an image session's root stays mounted (its files are the image's and its own, on disk);
            # a default session's layered workspace goes into the blob like a tmpfs one: a rested
            # session then holds no mount (10,000 of them would slow every sandbox's start) and
            # wakes after a restart too
            keep_root = sb.rootfs is not None and not sb.rootfs.workspace_only
            roots = ["/tmp"] if keep_root else (["workspace"] if self.mode is Isolation.NONE
                                                else ["workspace", "/tmp"])
            try:
                blob, dropped, modules = await pack(sb, roots)
                path = await asyncio.to_thread(self.store.write, trajectory, blob)
            except (RestFailed, OSError) as e:
                log.warning("session %s cannot be put to rest: %s", trajectory, e)
                self.rest_counts["rest_failures"] += 1
                self._unrestable[trajectory] = last
                if trajectory in self._close_after_rest:  # closed meanwhile: its sandbox is ours to let go
                    self._release_session(sb)
                elif not sb.dead:
                    sb.freeze()
                return False
            rested = Rested(path, len(blob), dropped, sb.rootfs.image.name if keep_root else None)
            stdlib = getattr(sys, "stdlib_module_names", frozenset())
            self._module_uses.update(m for m in modules if isinstance(m, str) and m.split(".")[0] in stdlib
                                     and m.split(".")[0] not in NEVER_WARM)
            self.sessions.pop(trajectory, None)
            recorded = trajectory not in self._close_after_rest
            if recorded:
                # recorded (the journal committed) before the processes end: a crash between the two
                # then leaves a session that wakes from its blob, never one marked awake whose
                # processes are gone (the order was the other way round)
                self.rested[trajectory] = rested
                self.rest_counts["rests"] += 1
                if self.on_rest is not None:
                    self.on_rest(trajectory, path)
                if self.rest_recorded is not None:
                    try:
                        await self.rest_recorded()
                    except Exception as e:  # the journal failed: the server reports that itself
                        log.warning("session %s: its rest could not be recorded: %s", trajectory, e)
            if keep_root:  # its files are on disk already: keep the root, end the processes
                rested.rootfs = await self.imageboxes.stop_processes(sb)
            else:  # reset for another session (recycle.py), or killed
                self._release_session(sb)
            if trajectory in self._close_after_rest:
                if recorded:  # closed while it was recorded: close_session forgot it, but not a root kept since
                    self.rested.pop(trajectory, None)
                    if rested.rootfs is not None:
                        self.imageboxes.drop(rested.rootfs)
                else:
                    self._forget(rested)
                return False
            return True
        except SandboxDied as e:  # it died packing: its state is gone, as with any dead sandbox
            log.warning("session %s died while being put to rest: %s", trajectory, e)
            self.rest_counts["rest_failures"] += 1
            self.sessions.pop(trajectory, None)
            self._kill_later(sb)
            return False
        finally:
            self._close_after_rest.discard(trajectory)
            del self._moving[trajectory]
            done.set_result(None)

    async def _wake(self, trajectory: str, rested: Rested, image: str | None, cores: tuple[int, ...],
                    then: Callable[[Sandbox], dict | None] | None = None) -> tuple[Sandbox, dict[str, str], dict | None]:
        """A sandbox with the rested session's state loaded; on failure the session stays at rest
        (nothing is lost: a later step tries again) and ``SandboxDied`` says why. It is pinned to
        the step's ``cores`` before the load runs anything in it (the session's shell replayed, its
        namespace unpickled: the user's code). ``then(sb)``: the step's cell request, if it can
        ride on the wake's last request (``rest.load``; its answer is the third value), the
        sandbox then limited for it first."""
        sb = None
        try:
            # a small blob (most are a few KB) is read here: a hop to a thread costs more, and
            # waits behind whatever else holds the default executor's few threads
            blob = (self.store.read(rested.path) if rested.size <= INLINE_READ
                    else await asyncio.to_thread(self.store.read, rested.path))
            if rested.rootfs is not None:
                sb = await self.imageboxes.spawn(rested.rootfs.image.name, rootfs=rested.rootfs)
            else:
                sb = await self._take(image, session=True)
            sb.set_cpus(cores)
            cell = then(sb) if then is not None else None
            dropped, answer = await load(sb, blob, cell)
        except (OSError, SandboxDied, ImageError) as e:
            self.rest_counts["wake_failures"] += 1
            if sb is not None:
                if rested.rootfs is not None:
                    await self.imageboxes.stop_processes(sb)
                else:
                    await sb.kill()
            self.rested[trajectory] = rested
            raise SandboxDied(f"the session could not be woken from rest ({e}); it is still at rest") from None
        self.store.forget(rested)
        self.rest_counts["wakes"] += 1
        if self.on_rest is not None:
            self.on_rest(trajectory, None)
        return sb, dropped, answer

    def _cell_for_wake(self, action: Action, pin: list) -> Callable[[Sandbox], dict | None] | None:
        """The request of a python step (no listener) that wakes its session, to ride on the wake's
        last request: one round trip host - runner - interpreter fewer (a wake and its cell were two:
        measured p50 ~2-4 ms and ~5 ms of a revisit's ~10 ms on the 2-core VM at load 3-6). Streamed
        steps, shell steps and files keep their own request. The sandbox is pinned and limited
        before (a resize that comes while the cell runs applies from the next step)."""
        p = action.payload
        if not isinstance(p, Exec) or p.python is None or action.id in self._listeners:
            return None

        def cell(sb: Sandbox) -> dict:
            cores = pin[1]
            del pin[2:]
            pin.append(sb.oom_seen)  # what the step's OOM check counts from
            sb.set_cpus(cores)
            sb.set_memory((p.memory_mb or self.config.memory_mb) << 20)
            return {**_cell_request(self._base(cores, sb), p), "_timeout": p.timeout_s + self.config.grace_s + 1.0}

        return cell

    def rest_stats(self) -> dict:
        """What ``/healthz``, ``/metrics`` and ``tangram top`` show of rest (counts since start)."""
        c = self.config
        return {"awake": len(self.sessions), "at_rest": len(self.rested), "resting_now": len(self._moving),
                "rest_bytes": self.store.used if self.store is not None else 0, "rest_disk_mb": c.rest_disk_mb,
                "max_awake_sessions": c.max_awake_sessions, "rest_after_s": c.rest_after_s, **self.rest_counts,
                # session sandboxes reset for another session once theirs left, and those killed instead
                "sandboxes_reused": self.recycler.sessions_recycled,
                "sandboxes_not_reused": sum(self.recycler.sessions_discarded.values()),
                "session_pool": len(self._session_pool)}

    def session_state(self, trajectory: str) -> str | None:
        """``running``, ``awake`` (processes alive, frozen), ``resting`` (being put to rest),
        ``at_rest``, ``pending`` (files ready, processes on first use), or None (unknown here)."""
        if trajectory in self._moving:
            return "resting"
        if trajectory in self._using:
            return "running"
        if trajectory in self.sessions:
            return "awake"
        if trajectory in self.rested:
            return "at_rest"
        if trajectory in self.pending_roots:
            return "pending"
        return None

    def prune_rested(self) -> int:
        """Remove the blobs in a configured ``rest_dir`` that no session at rest here owns (a
        server killed between writing a blob and journaling it leaves one); returns how many."""
        if self.store is None or self.store.owned:
            return 0
        keep = {os.path.basename(r.path) for r in self.rested.values()}
        gone = 0
        for name in os.listdir(self.store.dir):
            if (name.endswith(".rest") or name.endswith(".rest.tmp")) and name not in keep:
                try:
                    os.unlink(os.path.join(self.store.dir, name))
                    gone += 1
                except FileNotFoundError:
                    pass
        return gone

    def adopt_rested(self, trajectory: str, path: str, image: str | None = None) -> None:
        """A session put to rest by an earlier server (its blob at ``path``): it wakes on its next
        step. Raises ``FileNotFoundError`` when the blob is gone, ``ImageError`` for an image
        session (its root was the old server's mount)."""
        if image is not None:
            raise ImageError("image sessions at rest cannot be woken after a restart (their root was mounted by "
                             "the server that stopped)")
        size = os.stat(path).st_size
        self.rested[trajectory] = Rested(path, size)
        if self.store is not None:
            self.store.used += size
        self._last_used[trajectory] = time.monotonic()

    def _adopt(self, trajectory: str, root: RootFs) -> None:
        """``trajectory`` is a session whose root is mounted; its processes start on first use."""
        self.pending_roots[trajectory] = root
        self._last_used[trajectory] = time.monotonic()

    async def _fork(self, sb: Sandbox, fork: Fork) -> tuple[Outcome, SandboxResult]:
        """Fork (``envops`` says how): the source's processes stop, its files become a shared layer
        under fresh roots for it and each child; all start their processes on their next action."""
        taken = [c for c in fork.children if self._exists(c)]
        if taken or fork.source in fork.children or len(set(fork.children)) != len(fork.children):
            return Outcome.REJECTED, SandboxResult(message=f"fork: child ids must be new and distinct ({taken or 'dup'})")
        t0 = time.perf_counter()
        src = await self.imageboxes.stop_processes(sb)
        self.sessions.pop(fork.source, None)
        t1 = time.perf_counter()
        try:
            roots = await asyncio.to_thread(envops.stack, self.imageboxes, src, len(fork.children) + 1)
        except OSError as e:
            return Outcome.INFRA_ERROR, SandboxResult(message=f"fork: {e} (the source session's state is lost)")
        t2 = time.perf_counter()
        for traj, root in zip((fork.source, *fork.children), roots):
            self._adopt(traj, root)
        return Outcome.OK, SandboxResult(
            message=f"forked into {len(fork.children)}; processes (python interpreter, shell) restart on next use",
            info={"children": list(fork.children), "pause_s": t1 - t0, "cow_s": t2 - t1, "fork_s": t2 - t0,
                  "layers": len(roots[0].session_layers)})

    # -- running ---------------------------------------------------------------------------------
    async def _run(self, action: Action, allocation: Allocation, mine: _Unanswered | None = None) -> Completion:
        t0 = time.monotonic()
        if isinstance(action.payload, Restore):  # a root to mount, no sandbox to start
            outcome, result = await self._restore(action, action.payload)
            return Completion(action.id, outcome, 0.0, time.monotonic() - t0, result.message, result)
        pin = self._pins.get(action.id) or [None, self._cores(allocation)]
        cores = pin[1]
        payload = action.payload
        sb = None
        message = ""
        image = getattr(payload, "image", None) or self.config.image
        woke: dict[str, str] | None = None
        answer: dict | None = None  # the step's cell, run by the wake's last request
        traj = action.trajectory
        if traj is not None:
            self._using.add(traj)
            if traj not in self.sessions and len(self.sessions) >= self.config.max_awake_sessions:
                # it is about to be awake (a wake, or a new session): the least recently used goes to
                # rest now, alongside the wake, rather than after the step, when its pack and reset
                # competed with the answer and the next request for the cores
                self._want_rest()
        try:
            if traj is None:
                sb = await self._take(image, self._placement(cores, True)[0])
            else:
                while traj in self._moving:  # being put to rest: wake it once it is
                    await asyncio.shield(self._moving[traj])
                sb = self.sessions.get(action.trajectory)
                if sb is None or sb.dead:
                    pending = self.pending_roots.pop(action.trajectory, None)
                    rested = self.rested.pop(traj, None)
                    if rested is not None:
                        sb, woke, answer = await self._wake(traj, rested, image, pin[1], self._cell_for_wake(action, pin))
                    elif pending is not None:  # a fork child or a restored session: its files are there
                        sb = await self.imageboxes.spawn(pending.image.name, rootfs=pending)
                    else:
                        if allocation.setup not in (Setup.CREATE, Setup.NONE):
                            message = "session restarted: its sandbox had been closed or killed, state was lost"
                        sb = await self._take(image, session=True)
                    self.sessions[action.trajectory] = sb
                sb.thaw()
            cores = pin[1]  # a resize may have come while the sandbox was prepared
            sb.set_cpus(*self._placement(cores, traj is None))
            pin[0] = sb
            memory_mb = getattr(payload, "memory_mb", None)
            sb.set_memory((memory_mb or self.config.memory_mb) << 20)
            setup_s = time.monotonic() - t0
            oom_before = sb.oom_seen  # read after the sandbox's last action
            if answer is not None:  # its cell ran within the wake: OOM counted from before it, its time is exec time
                oom_before = pin[2] if len(pin) > 2 else oom_before
                ran = answer.get("duration_s")
                if isinstance(ran, (int, float)) and 0 <= ran <= setup_s:
                    setup_s -= ran
            t1 = time.monotonic()
            sb.first_written_at = 0.0  # set by this run's first request (``core_waits``)
            self._busy.add(sb)
            try:
                if answer is not None:
                    outcome, result = _outcome(answer), _result(answer)
                    await self._drop_broken(sb, answer)
                else:
                    # a one-shot's reset rides on its run; not under a memory limit of its own below the
                    # default, where the reset's fork ahead could be killed before its OOM count is read
                    riding = (self.recycler.riding(sb) if traj is None and isinstance(payload, RunCode)
                              and (memory_mb or self.config.memory_mb) >= self.config.memory_mb else None)
                    outcome, result = await self._execute(sb, payload, cores, self._listeners.get(action.id),
                                                          mine.turn if mine is not None else None, riding,
                                                          self._stdins.get(action.id))
                    if mine is not None:  # the follower's turn, before this run's bookkeeping and report
                        self._over(action.id, mine)
                    if traj is None and isinstance(payload, RunCode) and sb.first_written_at:
                        self.core_waits.ran(cores, sb.first_written_at, sb.answered_at)
            finally:
                self._busy.discard(sb)
            exec_s = time.monotonic() - t1
            if answer is not None and isinstance(answer.get("duration_s"), (int, float)):
                exec_s += max(0.0, float(answer["duration_s"]))
            if not sb.dead and sb.oom_kills() > oom_before and outcome is not Outcome.TIMEOUT:
                outcome = Outcome.OOM
                result.message = _join(result.message, "killed: out of memory "
                                                       f"(limit {(memory_mb or self.config.memory_mb)} MB)")
        except SandboxDied as e:
            self._ended_unanswered(traj, sb, cores)
            outcome, result = self._died(e, action, sb)
            setup_s, exec_s = time.monotonic() - t0, 0.0
        except ImageError as e:  # an unknown image, or images unsupported here: the request's problem
            outcome, result = Outcome.REJECTED, SandboxResult(message=str(e))
            setup_s, exec_s = time.monotonic() - t0, 0.0
        except asyncio.CancelledError:
            self._ended_unanswered(traj, sb, cores)
            if sb is not None:
                if (mine is not None and mine.turn is not None and not mine.turn.opened and sb.recyclable
                        and self._put_back(sb)):
                    self._sandbox_back()
                    raise  # cancelled while it waited for its turn: nothing ran in it
                await self._kill_unreset(sb, traj)
            raise
        except Exception:
            if sb is not None:
                await self._kill_unreset(sb, traj)
            raise  # the task set reports it as infra_error
        finally:
            if traj is not None:
                self._using.discard(traj)
        if woke is not None:
            result.info = {**result.info, "woken": True, "dropped": woke}
            if woke:
                message = _join(message, "woken from rest without: " + "; ".join(f"{k} ({v})" for k, v in woke.items()))
        result.message = _join(message, result.message)
        session_mem_gb = None
        if sb is not None and not sb.dead and action.trajectory is not None:
            sb.freeze()
            self._last_used[action.trajectory] = time.monotonic()
            session_mem_gb = self._idle_memory_gb(sb)
            if len(self.sessions) > self.config.max_awake_sessions:
                self._want_rest()
        if sb is not None and action.trajectory is None:
            # starts once this task has reported: reset or teardown is not part of the action's ACT
            self.recycler.release(sb)
        return Completion(action.id, outcome, setup_s, exec_s, result.message, result, session_mem_gb)

    def _ended_unanswered(self, traj: str | None, sb: Sandbox | None, cores: tuple[int, ...]) -> None:
        """A one-shot that wrote its request ended with no answer (killed, cancelled): each core's
        next wait counts from now (``core_waits``)."""
        if traj is None and sb is not None and sb.first_written_at:
            self.core_waits.ended(cores, time.monotonic())

    def _idle_memory_gb(self, sb: Sandbox) -> float | None:
        """An idle (frozen) session's memory, for the engine to reserve by use; None under
        ``session_memory = 'limit'`` or when it cannot be read (the reservation then stays)."""
        if self.config.session_memory != "use":
            return None
        try:
            return sb.memory_bytes() / (1 << 30)
        except (OSError, ValueError) as e:
            log.warning("cannot read the memory of sandbox %s: %s", sb.id, e)
            return None

    def _died(self, e: SandboxDied, action: Action, sb: Sandbox | None) -> tuple[Outcome, SandboxResult]:
        if action.trajectory is not None:
            self.sessions.pop(action.trajectory, None)
        if e.deadline:  # the runner could not stop the user's code in time: still the code's timeout
            return Outcome.TIMEOUT, SandboxResult(message=f"timeout: {e}")
        return Outcome.INFRA_ERROR, SandboxResult(message=f"sandbox failure: {e}")

    def _request_env(self, cores: tuple[int, ...]) -> dict[str, str]:
        n = str(len(cores))
        return {"TANGRAM_NUM_CPUS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}

    def _base(self, cores: tuple[int, ...], sb: Sandbox | None = None) -> dict:
        env = self._request_env(cores)
        if sb is not None and sb.rootfs is not None:
            env = {**sb.rootfs.image.env, **env}
        req = {"env": env, "max_output": self.config.max_output_bytes}
        if self.root is None:
            req["cpus"] = list(cores)
        return req

    async def _execute(self, sb: Sandbox, payload, cores: tuple[int, ...],
                       on_output: Callable[[str, bytes], None] | None = None,
                       turn: Turn | None = None, riding: dict | None = None,
                       stdin: LiveStdin | None = None) -> tuple[Outcome, SandboxResult]:
        """``turn``: wait for it; a one-shot's first request is written by its opener. ``riding``:
        a one-shot's reset, sent with its run (``Recycler.riding``). ``stdin``: a shell step's
        live stdin (``feed``)."""
        grace = self.config.grace_s
        if isinstance(payload, RunCode):
            return await self._run_code(sb, payload, cores, turn, riding)
        if turn is not None:
            await turn.wait()
        if isinstance(payload, (Fork, Snapshot)):
            if sb.rootfs is None:
                return Outcome.REJECTED, envops.not_layered("fork" if isinstance(payload, Fork) else "snapshot",
                                                            self._why_not_layered())
            if isinstance(payload, Fork):
                return await self._fork(sb, payload)
            return Outcome.OK, await envops.snapshot(sb.rootfs, payload.path)
        if isinstance(payload, Exec):
            base = self._base(cores, sb)
            if payload.python is not None:
                req = _cell_request(base, payload)
                if on_output is not None:
                    req["stream"] = True
            elif payload.command is not None:  # a step of the session's persistent shell
                req = {**base, "op": "shell", "command": payload.command, "timeout_s": payload.timeout_s,
                       "stdin": _b64(payload.stdin)}
                if on_output is not None:
                    req["stream"] = True
                if stdin is not None:
                    req["stdin_live"] = True
            else:
                return Outcome.REJECTED, SandboxResult(message="exec: give a command or a python cell")
            if payload.python is not None:
                stdin = None  # (Session.exec refuses a live stdin for a cell)
            if "stream" not in req:  # + the shell's own kill window
                r = await sb.request(req, payload.timeout_s + grace + 1.0, stdin=stdin)
                await self._drop_broken(sb, r)
                return _outcome(r), _result(r)
            assert on_output is not None
            streamed = {"stdout": 0, "stderr": 0}

            def counted(stream: str, data: bytes) -> None:
                streamed[stream] += len(data)
                on_output(stream, data)

            r = await sb.request(req, payload.timeout_s + grace + 1.0, counted, stdin=stdin)
            await self._drop_broken(sb, r)
            for stream in ("stdout", "stderr"):  # what the step had not sent before it ended
                data = base64.b64decode(r.get(stream) or "")
                if len(data) > streamed[stream]:
                    on_output(stream, data[streamed[stream]:])
            return _outcome(r), _result(r)
        if isinstance(payload, Files):
            out = SandboxResult()
            if payload.put:
                r = await sb.request({"op": "write", "files": {k: _b64(v) for k, v in payload.put.items()}}, FILES_TIMEOUT_S + grace)
                if "error" in r:
                    return Outcome.FAILED, SandboxResult(message=f"files: {r['error']}")
            if payload.get:
                r = await sb.request({"op": "read", "paths": list(payload.get)}, FILES_TIMEOUT_S + grace)
                out.files = {k: base64.b64decode(v) for k, v in r.get("files", {}).items()}
                out.missing = r.get("missing", [])
            return Outcome.OK, out
        if isinstance(payload, FsCall):
            return _fs_outcome(payload, await sb.request(payload.request(), FILES_TIMEOUT_S + grace))
        return Outcome.REJECTED, SandboxResult(message=f"payload: {type(payload).__name__} is not a sandbox request")

    async def _drop_broken(self, sb: Sandbox, r: dict) -> None:
        """A step's answer says ``broken`` (``runner._no_interpreter``: its zygote is gone, so no
        python can run in ``sb`` any more): the sandbox is killed, and the session's next step takes
        a new one, saying it restarted (review M5: every later python step was infra_error)."""
        if r.get("broken"):
            log.warning("session sandbox %s replaced: %s", sb.id, str(r["broken"])[:300])
            await sb.kill()

    async def _run_code(self, sb: Sandbox, p: RunCode, cores: tuple[int, ...],
                        turn: Turn | None = None, riding: dict | None = None) -> tuple[Outcome, SandboxResult]:
        grace = self.config.grace_s
        try:
            if sb.rootfs is not None and not sb.rootfs.workspace_only:
                lang = languages.resolve(p.language, which=lambda exe: _which_in(sb.rootfs, exe))
            else:
                lang = languages.resolve(p.language, ":".join(self.config.ro_binds))
        except (languages.UnknownLanguage, languages.MissingToolchain) as e:
            return Outcome.REJECTED, SandboxResult(message=str(e))
        files = {**{k: _b64(v) for k, v in p.files.items()}}
        if not lang.in_interpreter:
            files[lang.source] = _b64(p.code.encode())
        base = self._base(cores, sb)
        if p.memory_as_rlimit and p.memory_mb:
            base["as_bytes"] = p.memory_mb << 20
        result = SandboxResult()
        # the files ride on the first command and fetched files on the last: one round trip per command
        if lang.compile:
            r = await sb.request({**base, "op": "run", "argv": list(lang.compile), "timeout_s": p.compile_timeout_s,
                                  "files": files}, p.compile_timeout_s + grace, turn=turn)
            files, turn = {}, None
            if "files_error" in r:
                return Outcome.FAILED, SandboxResult(message=f"files: {r['files_error']}")
            result.compile = CommandResult.from_wire(r) if "error" not in r else None
            if "error" in r:
                return Outcome.INFRA_ERROR, SandboxResult(message=f"compile: {r['error']}")
            if result.compile.timed_out:
                result.message = "compile timed out"
                return Outcome.TIMEOUT, result
            if result.compile.exit_code != 0:
                result.message = "compile error"
                return Outcome.FAILED, result
        if lang.in_interpreter:
            req = {**base, "op": "python", "code": p.code}
        else:
            req = {**base, "op": "run", "argv": list(lang.run)}
        r = await sb.request({**req, "stdin": _b64(p.stdin), "timeout_s": p.run_timeout_s, "files": files,
                              "fetch": list(p.fetch_files)}, p.run_timeout_s + grace, turn=turn, then=riding)
        if "files_error" in r:
            return Outcome.FAILED, SandboxResult(message=f"files: {r['files_error']}")
        if "error" in r:
            return Outcome.INFRA_ERROR, SandboxResult(message=f"run: {r['error']}")
        run = _result(r)
        result.run, result.message = run.run, run.message
        if p.fetch_files:
            fr = r.get("fetched") or {}
            result.files = {k: base64.b64decode(v) for k, v in fr.get("files", {}).items()}
            result.missing = fr.get("missing", list(p.fetch_files))
            if fr.get("cut"):  # past the size limits: said (SandboxFusion's message names them)
                result.info = {**result.info, "cut_files": list(fr["cut"])}
                result.message = _join(result.message, cut_files_note(fr["cut"]))
        return _outcome(r), result


class _Unanswered:
    """An action started here whose sandbox has not answered yet, in its core's queue: the turn
    it waits for (None: none, it ran at once) and the action it waits for, and its follower."""

    __slots__ = ("turn", "before", "next", "done")

    def __init__(self) -> None:
        self.done = False  # its sandbox answered, or it ended (``_over``)
        self.turn: Turn | None = None
        self.before: _Unanswered | None = None
        self.next: _Unanswered | None = None


def _unwired(report) -> None:
    raise RuntimeError("this SandboxManager was built without a sink")


def _fs_outcome(call: FsCall, r: dict) -> tuple[Outcome, SandboxResult]:
    """A filesystem call's answer (``runner.op_fs``): the caller's failure is ``FAILED`` with its
    code in ``info["error"]``; an answer of neither shape (the runner's own failure) is
    ``infra_error``, never the caller's."""
    err, got = r.get("fs_error"), r.get("fs")
    if isinstance(err, list) and len(err) == 2:
        return Outcome.FAILED, SandboxResult(message=str(err[1]), info={"error": str(err[0])})
    if not isinstance(got, dict):
        return Outcome.INFRA_ERROR, SandboxResult(message=f"{call.call}: {r.get('error') or 'the sandbox did not answer'}")
    if call.call == "read":
        return Outcome.OK, SandboxResult(files={call.path: base64.b64decode(got.get("data") or "")},
                                         info={"cut": bool(got.get("cut"))})
    return Outcome.OK, SandboxResult(info=got)


def _which_in(rootfs: RootFs, exe: str) -> str | None:
    path = rootfs.image.env.get("PATH") or languages.SANDBOX_PATH
    for d in path.split(":"):
        if d and resolve_in(rootfs.root, f"{d}/{exe}") is not None:
            return f"{d}/{exe}"
    return None


def _cell_request(base: dict, p: Exec) -> dict:
    """A python step's request to its sandbox (run on its own, or riding on a wake's)."""
    return {**base, "op": "cell", "code": p.python, "timeout_s": p.timeout_s, "jupyter": p.jupyter}


def _b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode() if data else None


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _outcome(r: dict) -> Outcome:
    if "error" in r:
        return Outcome.INFRA_ERROR
    if r.get("timed_out"):
        return Outcome.TIMEOUT
    return Outcome.OK if r.get("exit_code") == 0 else Outcome.FAILED


def _result(r: dict) -> SandboxResult:
    if "error" in r:
        return SandboxResult(message=f"runner: {r['error']}")
    run = CommandResult.from_wire(r)
    notes = []
    if run.truncated:
        notes.append("output truncated")
    if run.timed_out:
        notes.append("timed out")
    if run.note:
        notes.append(run.note)
    return SandboxResult(run=run, message=_join(*notes))
