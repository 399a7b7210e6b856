"""The pool of one-shot sandboxes: taken by a run, reset and put back (``recycle.py``), refilled.

A one-shot takes a warm sandbox of the default image, so no action pays isolation or interpreter
start-up; after its run the recycler resets it (about a millisecond) and puts it back, where a new
sandbox would cost 10-50 ms of CPU. The refill (``OneShots.refill``) keeps this pool and the
sessions' pool (``sessionpool.py``) full. ``placement`` says where a run goes on the host's CPUs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
from collections import Counter
from typing import Awaitable, Callable, Protocol

from .host import SandboxHost
from .images import ImageError
from .isolation import Isolation, command
from .lease import Lease
from .recycle import Recycler
from .sandbox import Limits, Sandbox, SandboxDied

log = logging.getLogger(__name__)

_SANDBOX_IDS = itertools.count()

#: sandbox spawns the refill keeps in flight per core: a spawn mostly waits on the kernel
#: (namespaces, mounts), not on a CPU (on 2 cores: 17.5 spawns/s with 1 in flight, 57 with 4)
SPAWNS_PER_CORE = 4

#: seconds a run (or a new session) waits for a sandbox being reset when its pool is empty, before
#: it starts one of its own: a reset takes a few milliseconds, a start 50-140 ms
RETURN_WAIT_S = 0.05


class Spares(Protocol):
    """A pool the refill keeps full (``sessionpool.SessionPool``; ``OneShots`` itself)."""

    idle: list[Sandbox]

    def wanted(self) -> int:
        """How many the pool should hold."""

    def coming_back(self) -> int:
        """Sandboxes on their way back to it (they count as there)."""

    def spawn(self) -> Awaitable[Sandbox]:
        """A new sandbox for it."""


class OneShots:
    """The warm sandboxes one-shots of the default image take, and what became of them."""

    def __init__(self, host: SandboxHost, lease: Lease) -> None:
        self.host = host
        self.lease = lease
        self.idle: list[Sandbox] | None = None  # oldest first; made at start
        #: one-shot sandboxes of the default image started afresh: for the pool ("pool"), and for a
        #: run that found it empty with none being reset ("run")
        self.fresh: Counter[str] = Counter()
        self.owed = 0  # recycled sandboxes discarded and not replaced yet (``lost``)

    def recycler(self, enabled: bool) -> Recycler:
        """The recycler that resets this pool's sandboxes and puts them back (``enabled``: where
        the config and the isolation allow it; without, each is killed after its run)."""
        c = self.host.config
        return Recycler(enabled, self.put_back, self.host.tasks.spawn, c.recycle_max_uses, ahead=c.fork_ahead,
                        settled=self.settled, lost=self.lost)

    def start(self) -> None:
        self.idle = []

    def wanted(self) -> int:
        return self.host.config.warm_pool

    def coming_back(self) -> int:
        """Sandboxes being reset, and those followers hold (each comes back after its run)."""
        return self.host.recycler.resetting + self.lease.followers

    async def spawn(self, warm: bool = True) -> Sandbox:
        """A new sandbox of the default image; ``warm``: for the pool (``op_warm`` first), not for
        a caller that waits for it (a one-shot would pay the imports for nothing)."""
        host, c = self.host, self.host.config
        if c.image is not None:  # the warm pool holds sandboxes of the default image
            return await host.imageboxes.spawn(c.image)
        sid = f"sb-{next(_SANDBOX_IDS)}-{os.urandom(3).hex()}"  # unique across managers of a process
        workspace = None
        if host.mode is Isolation.NONE:
            workspace = tempfile.mkdtemp(prefix="tangram-ws-")
            host.hostdirs.append(workspace)
        argv = command(host.mode, host.layout, workspace=workspace)
        limits = Limits(c.memory_mb << 20, c.pids_max)
        sb = await Sandbox.spawn(sid, argv, host.root, limits, cwd=workspace)
        sb.recyclable = True  # our own tree (isolation.WRITABLE is all it can write), not an image's
        if not warm:
            return sb
        try:  # what a wake needs, imported now rather than on the woken session's step
            await sb.request({"op": "warm", "modules": host.warm_modules()}, 20.0)
        except SandboxDied:
            await sb.kill()
            raise
        return sb

    async def refill(self, sessions: Spares) -> None:
        """Refill the sessions' pool and this one, ``SPAWNS_PER_CORE`` spawns in flight per core
        (within the pools' sizes), sleeping until a sandbox is taken when they are full.

        The sessions' pool comes first: a session's first step otherwise pays a layered spawn
        while one-shot sandboxes fill, and a one-shot without a warm sandbox pays less (a plain
        spawn, no layered root). A take wakes the loop even while spawns are in flight, so that
        back-to-back opens do not drain the sessions' pool and start sandboxes of their own."""
        host = self.host
        in_flight: dict[asyncio.Task, list[Sandbox]] = {}
        parallel = max(1, SPAWNS_PER_CORE * len(host.host_cpus))
        oneshots = self.idle
        assert oneshots is not None and host.taken is not None  # (made by ``start`` before this task)
        pools: list[tuple[list[Sandbox], int, Callable[[], Awaitable[Sandbox]], Callable[[], int]]] = [
            (sessions.idle, sessions.wanted(), sessions.spawn, sessions.coming_back),
            (oneshots, self.wanted(), self.spawn, self.coming_back)]
        # sandboxes on their way back to a pool count as there: a session's sandbox comes back a
        # few ms after its session is put to rest, a one-shot's from its reset within a millisecond,
        # and a spawn started meanwhile (~50 ms of CPU: bubblewrap, an interpreter, the warm-up)
        # would mostly be waste
        loop = asyncio.get_running_loop()
        taken: asyncio.Task | None = None

        def coming(pool: list[Sandbox]) -> int:
            """A pool's sandboxes, and those being started for it."""
            return len(pool) + sum(p is pool for p in in_flight.values())

        try:
            while not host.closing:
                host.taken.clear()
                for pool, size, spawn, back in pools:
                    while len(in_flight) < parallel and coming(pool) + back() < size:
                        in_flight[loop.create_task(spawn())] = pool
                        if pool is oneshots:
                            self.fresh["pool"] += 1
                while self.owed and len(in_flight) < parallel:  # one-shot sandboxes lost from circulation
                    self.owed -= 1
                    # owed only while the followers' sandboxes hide the pool's shortfall from the rule
                    # above (under load), and within the idle cap: otherwise that rule refilled already
                    have = coming(oneshots) + host.recycler.resetting
                    if have >= min(self.idle_cap(), host.config.warm_pool + self.lease.followers):
                        continue
                    in_flight[loop.create_task(self.spawn())] = oneshots
                    self.fresh["pool"] += 1
                if taken is None or taken.done():
                    taken = loop.create_task(host.taken.wait())
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

    def idle_cap(self) -> int:
        """How many idle one-shot sandboxes the pool keeps at most."""
        c = self.host.config
        return min(max(c.recycle_pool_max, c.warm_pool), c.max_idle_sandboxes)

    def put_back(self, sb: Sandbox) -> bool:
        """A recycled sandbox joins the pool (False: the pool is full or closing)."""
        if self.host.closing or self.idle is None or len(self.idle) >= self.idle_cap():
            return False
        self.idle.append(sb)
        return True

    async def take(self, image: str | None = None, cores: tuple[int, ...] | None = None) -> Sandbox:
        """A prepared sandbox from the pool, or a fresh one when the pool is empty (an image's
        from the image sandboxes). One already pinned to ``cores`` is preferred: moving a group to
        other cores is a cgroup write per one-shot, and a core freed by a one-shot is most often
        the next one's, so its sandbox comes back from recycling to the pool just in time."""
        host = self.host
        if image is not None and image != host.config.image:
            if host.mode is not Isolation.BWRAP:
                raise ImageError(f"image: sandboxes from images need bubblewrap isolation (this host uses "
                                 f"{host.mode.value})")
            return host.imageboxes.take(image) or await host.imageboxes.spawn(image)
        host.want_spares()
        deadline = asyncio.get_running_loop().time() + RETURN_WAIT_S
        pool = self.idle
        while True:
            while pool:
                i = next((k for k in range(len(pool) - 1, -1, -1) if pool[k].cpus == cores), 0) if cores else 0
                sb = pool.pop(i)
                if not sb.dead and sb.proc.returncode is None:
                    return sb
                if host.recycler.circulates(sb):  # died idle
                    self.lost()
            # one being reset is back within a millisecond; a fresh one takes 10-50 ms of CPU
            if not host.recycler.resetting or not await host.returned_by(deadline):
                break
        self.fresh["run"] += 1
        return await host.made_for_action(self.spawn(warm=False))

    def settled(self) -> None:
        """A one-shot sandbox's reset ended (in the pool, or discarded): a ``take`` waiting for
        one looks again, and so does the refill when the pool is short (the refill counted the
        reset as coming back, and a discarded one does not)."""
        self.host.sandbox_returned()
        if self.idle is not None and len(self.idle) < self.host.config.warm_pool:
            self.host.want_spares()

    async def kill_unreset(self, sb: Sandbox, traj: str | None) -> None:
        """Kill an action's sandbox outside the recycler's verdict (its run cancelled or failed); a
        one-shot's is replaced as the recycler's discards are (``lost``)."""
        await sb.kill()
        if traj is None and self.host.recycler.circulates(sb):
            self.lost()

    def lost(self) -> None:
        """A recycled one-shot sandbox was discarded (worn out, unclean, dead): start another for
        the pool now. The refill's own rule never would under load: it counts the sandboxes that
        followers hold, which cover the warm pool's size whenever every core has a follower, so
        the sandboxes in circulation (three a busy core: its run's, its follower's, the last one
        being reset) would dwindle with each discard until runs found the pool empty and started
        their own, on the latency path. The replacement is started only while that rule is blind
        (the pool, its spawns and resets below the warm size plus the followers' sandboxes) and
        within the idle cap: at a light load the rule has refilled for the run already."""
        if self.host.closing or self.idle is None:
            return
        self.owed += 1
        self.host.want_spares()

    def stats(self) -> dict[str, int]:
        """What became of one-shot sandboxes since start (``SandboxManager.one_shot_sandboxes``)."""
        rec = self.host.recycler
        return {"started_for_pool": self.fresh["pool"], "started_for_run": self.fresh["run"],
                "recycled": rec.recycled, "discarded": sum(rec.discarded.values()), "over_cap": rec.over_cap}

    @property
    def shares_cpus(self) -> bool:
        """Whether one-shots run on any of the host CPUs (``one_shots_share_cpus``) here: only
        where cgroups bound their CPU time (the cpu controller's quota). Without cgroups they are
        pinned by affinity: hostile code may widen its own, but code that sizes itself by its
        affinity (Go, Java, ``os.sched_getaffinity``) stays on its cores."""
        host = self.host
        return host.config.one_shots_share_cpus and host.root is not None and host.root.bounds_cpu_time

    def placement(self, cores: tuple[int, ...], one_shot: bool) -> tuple[tuple[int, ...], int | None]:
        """Where a run on ``cores`` goes: (CPUs, quota in CPUs' worth of time or None).

        A one-shot shares the host's CPUs, bounded to ``len(cores)`` CPUs' time: pinned, a
        one-shot whose CPU ran something else (the server's own processes, the last run's reset,
        a zygote's fork) would wait for it while other CPUs idle. A session stays pinned: its
        processes outlive the action, and its cores are what ``resize`` takes back."""
        if one_shot and self.shares_cpus:
            return self.host.host_cpus, len(cores)
        return cores, None
