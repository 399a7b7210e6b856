"""What every part of the sandbox manager shares: the host's side of its sandboxes.

``SandboxHost`` holds the config, the isolation mode and cgroup root found at start, the host's
CPUs, the task set, the image sandboxes and the recycler, and the two signals between the parts:
a sandbox taken from a pool (the refill looks again) and one back in a pool (a take waiting for
one looks again). ``SandboxManager`` is one; its parts (``pool``, ``sessionpool``, ``sessions``,
``resting``, ``execution``, ``runs``, ``lease``) are handed it and read these names, never each
other's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from typing import Awaitable

from ...core.action import Allocation
from ...core.seam import Sink
from ..tasks import TaskSet
from .cgroups import CgroupRoot
from .imagebox import ImageSandboxes
from .images import ImageStore
from .isolation import Isolation, Layout
from .recycle import Recycler
from .sandbox import Sandbox
from .spec import SandboxConfig

log = logging.getLogger(__name__)

#: the most open files asked for where the hard limit is unlimited (the kernel's usual ``nr_open``)
MAX_OPEN_FILES = 1 << 20


def open_files_to_hard_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the limit now. Every awake
    session holds a few descriptors (its channel's pipes, its cgroup's freezer, memory and events
    files), and the default cap of awake sessions (640) passes the common soft limit of 1,024. The
    hard limit, which bounds what a sandbox may open (it inherits the soft one and may raise it
    itself), is unchanged."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # past the kernel's nr_open: kept as it was
            log.warning("could not raise the open files limit from %d to %d: %s", soft, want, e)
    return soft


#: modules a fresh warm-pool sandbox imports before it is taken (``inside.sessions.op_warm``): those rested
#: sessions use most, up to this many
WARM_MODULES = 8


class SandboxHost:
    """The host's side shared by the sandbox manager's parts."""

    recycler: Recycler  # resets used one-shot sandboxes (``pool.OneShots`` builds it: it owns the pool)

    def __init__(self, config: SandboxConfig | None = None, sink: Sink | None = None) -> None:
        self.config = config or SandboxConfig()
        c = self.config
        self.layout = Layout(c.interpreter, tuple(c.interpreter_args), tuple(c.ro_binds), c.workspace_mb << 20,
                             c.tmp_mb << 20)
        self.mode: Isolation | None = None
        self.root: CgroupRoot | None = None
        self.host_cpus = tuple(c.cpus) if c.cpus else tuple(sorted(os.sched_getaffinity(0)))
        self.tasks = TaskSet(sink or _unwired, "sandboxes")
        self.images = ImageStore(c.image_store, durable=c.image_durable)
        self.imageboxes: ImageSandboxes | None = None
        self.layered = False  # default sessions get a copy-on-write workspace (bwrap, overlays)
        self.closing = False
        self.hostdirs: list[str] = []  # directories made on the host, removed at shutdown
        self.busy: set[Sandbox] = set()  # sandboxes running an action right now
        #: modules in rested sessions' namespaces: what a fresh sandbox imports ahead (``warm_modules``)
        self.module_uses: Counter[str] = Counter()
        self.taken: asyncio.Event | None = None  # set when the refill should look again (made at start)
        self.returned: asyncio.Event | None = None  # set when a sandbox is put back in a pool

    def cores(self, allocation: Allocation) -> tuple[int, ...]:
        """The host cores an allocation's units name."""
        return tuple(self.host_cpus[u % len(self.host_cpus)] for u in allocation.units) or self.host_cpus[:1]

    def warm_modules(self) -> list[str]:
        """The standard-library modules sessions use most (seen in two or more rested namespaces)."""
        return [m for m, n in self.module_uses.most_common(WARM_MODULES) if n >= 2]

    def want_spares(self) -> None:
        """A sandbox was taken from a pool, or one in circulation was lost: the refill looks again."""
        if self.taken is not None:
            self.taken.set()

    def sandbox_returned(self) -> None:
        """A sandbox came back to a pool: a take waiting for one (``returned_by``) looks again."""
        if self.returned is not None:
            self.returned.set()

    async def returned_by(self, deadline: float) -> bool:
        """Wait until a sandbox comes back to a pool, or until ``deadline`` (the loop's time);
        False if the deadline had passed already."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        if self.returned is None:
            self.returned = asyncio.Event()
        self.returned.clear()
        try:
            await asyncio.wait_for(self.returned.wait(), left)
        except asyncio.TimeoutError:
            pass
        return True

    async def made_for_action(self, spawn: Awaitable[Sandbox]) -> Sandbox:
        """A sandbox made for an action, shielded from the action's cancel: a cancel that lands
        inside the process's start would leave a half-started process whose exit nobody waits
        for, and its caller hung. The spawn finishes in the background; a sandbox nobody wants any
        more is killed."""
        task = self.tasks.spawn(spawn)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._kill_unwanted)
            raise

    def _kill_unwanted(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self.kill_later(task.result())

    def kill_later(self, sb: Sandbox) -> None:
        """Kill ``sb`` in the background (shutdown waits for it)."""
        self.tasks.spawn(sb.kill())


def _unwired(report) -> None:
    raise RuntimeError("this SandboxManager was built without a sink")
