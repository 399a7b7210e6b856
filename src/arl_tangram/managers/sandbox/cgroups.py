"""Control groups for sandboxes, on cgroup v1 or v2 hosts.

One ``Group`` per sandbox bounds its memory and process count, pins it to the cores of the
running action (cpuset) or bounds the CPU time it may use to that many CPUs' worth (the cpu
controller's quota, for one-shots that run on any of the host's CPUs), freezes it between actions
(freezer) and kills everything in it at once.
Where the hierarchy is missing or read-only the factory returns ``None`` after one logged warning
and the caller falls back to rlimits, affinity and SIGSTOP, whose caveats it documents.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

V1_CONTROLLERS = ("cpuset", "memory", "pids", "freezer", "cpuacct")
V1_OPTIONAL = ("cpu",)  # CPU time quotas (CFS bandwidth): without it every action is pinned instead
V2_REQUIRED = ("cpuset", "memory", "pids")
V2_WANTED = ("cpu", "cpuset", "memory", "pids")
CPU_PERIOD_US = 100_000  # the kernel's default period: a quota of n periods is n CPUs' worth
LEAF = "tangram-leaf"  # where the processes of our own cgroup go, so that it may have controllers below
#: how long a group asked to freeze from the event loop keeps running first: a thaw within it
#: (a session's next step, back to back) writes nothing, where a freeze and a thaw each step cost
#: ~0.13 ms of the engine's CPU on a quiet host, ~1 ms under load. An idle session runs no longer
#: than this after its step (a frozen session uses no CPU, a test spins a thread to check)
FREEZE_GRACE_S = 0.01


def euid() -> int:
    return os.geteuid()


def _enable(d: Path, controllers: set[str]) -> None:
    on = set((d / "cgroup.subtree_control").read_text().split())
    need = sorted(controllers - on)
    if need:
        (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in need))


def _move(pid: str, dest: Path) -> None:
    (dest / "cgroup.procs").write_text(pid)


def delegate_v2(mount: Path, own: Path, root: bool) -> set[str]:
    """Make our own cgroup a delegated subtree on cgroup v2. As root, enable the controllers in
    every ancestor's ``subtree_control`` from the mount down (where our cgroup lacks them); then
    enable them in our cgroup's own ``subtree_control`` for the groups we create below it. A cgroup
    with processes of its own cannot do that (the no-internal-process rule; the root cgroup is
    exempt), so every process of our cgroup is first moved into a leaf below it. Returns the
    controllers our cgroup has; raises OSError saying why where this is impossible."""
    parts = own.relative_to(mount).parts
    top = set((mount / "cgroup.controllers").read_text().split())
    absent = set(V2_REQUIRED) - top
    if absent:
        raise OSError(f"the kernel offers no {', '.join(sorted(absent))} controller")
    want = set(V2_WANTED) & top
    have = set((own / "cgroup.controllers").read_text().split())
    if set(V2_REQUIRED) - have:
        if not root:
            raise OSError(f"controllers {', '.join(sorted(set(V2_REQUIRED) - have))} are not delegated to us and "
                          "we are not root to delegate them")
        for parent in [mount] + [mount.joinpath(*parts[:i]) for i in range(1, len(parts))]:
            try:
                _enable(parent, want)
            except OSError as e:
                raise OSError(f"cannot enable {', '.join(sorted(want))} in {parent} ({e.strerror or e}): it "
                              "has processes of its own") from e
        have = set((own / "cgroup.controllers").read_text().split())
    want &= have
    if not parts:
        _enable(own, want)
        return have
    try:
        _enable(own, want)
    except OSError:  # processes of our cgroup (us among them) first go to a leaf
        leaf = own / LEAF
        leaf.mkdir(exist_ok=True)
        for _ in range(5):
            pids = (own / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                try:
                    _move(pid, leaf)
                except OSError:
                    pass  # exited meanwhile
        _enable(own, want)
        log.info("cgroups: moved the processes of %s into %s to enable %s below it", own, leaf,
                 ", ".join(sorted(want)))
    return have


class Group:
    """A cgroup (one directory per controller on v1, one directory on v2)."""

    def __init__(self, name: str, dirs: dict[str, Path], v2: bool) -> None:
        self.name = name
        self.dirs = dirs
        self.v2 = v2
        self._events_fd: int | None = None
        self._usage_fd: int | None = None
        #: the freezer's state file, kept open: a write or a read of it is one system call
        self._freezer_fd: int | None = None
        #: a freeze asked from the event loop, due once the grace is over (``FREEZE_GRACE_S``)
        self._freeze_due: asyncio.TimerHandle | None = None

    def _dir(self, controller: str) -> Path:
        return self.dirs["unified" if self.v2 else controller]

    def add(self, pid: int) -> None:
        """Move ``pid`` in; its children inherit the group."""
        for d in ({self.dirs["unified"]} if self.v2 else set(self.dirs.values())):
            (d / "cgroup.procs").write_text(str(pid))

    def set_cpus(self, cores: tuple[int, ...]) -> None:
        value = ",".join(map(str, sorted(cores)))
        (self._dir("cpuset") / "cpuset.cpus").write_text(value)

    def set_cpu_quota(self, cpus: int | None) -> None:
        """Bound the group's CPU time to ``cpus`` CPUs' worth in every 100 ms period (CFS
        bandwidth control: ``cpu.max`` on v2, ``cpu.cfs_quota_us`` on v1), however many
        processes it runs on however many CPUs; ``None``: no bound (a pinned group's cpuset is its
        bound). Only where the root ``bounds_cpu_time``."""
        if self.v2:
            (self.dirs["unified"] / "cpu.max").write_text(f"{cpus * CPU_PERIOD_US} {CPU_PERIOD_US}" if cpus else
                                                          f"max {CPU_PERIOD_US}")
            return
        d = self.dirs["cpu"]
        (d / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        try:
            (d / "cpu.cfs_quota_us").write_text(str(cpus * CPU_PERIOD_US) if cpus else "-1")
        except OSError as e:
            # v1 refuses a quota above an ancestor's (a container limited to fewer CPUs, say),
            # where v2 takes the smaller: the ancestor's, the tighter bound, holds either way
            if e.errno != errno.EINVAL or not cpus:
                raise
            (d / "cpu.cfs_quota_us").write_text("-1")

    def set_memory(self, limit_bytes: int | None) -> None:
        d = self._dir("memory")
        if self.v2:
            (d / "memory.max").write_text(str(limit_bytes) if limit_bytes else "max")
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0" if limit_bytes else "max")
        else:
            # v1 keeps memory+swap >= memory at every instant: raise memsw first, lower it last
            # (writing the memory limit above the old memsw limit fails with EINVAL)
            value = str(limit_bytes) if limit_bytes else "-1"
            mem, sw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
            if not sw.exists():
                mem.write_text(value)
                return
            raising = not limit_bytes or limit_bytes > int(mem.read_text())
            for f in ((sw, mem) if raising else (mem, sw)):
                try:
                    f.write_text(value)
                except OSError:
                    if f is mem:
                        raise

    def set_pids(self, limit: int | None) -> None:
        (self._dir("pids") / "pids.max").write_text(str(limit) if limit else "max")

    def oom_kills(self) -> int:
        """How many times the kernel's OOM killer has acted in this group (or failcnt on old v1).

        Read after every action, so through a descriptor kept open: one ``pread``, where opening
        the file each time takes ~6 system calls, dear at a thousand one-shots a second."""
        d = self._dir("memory")
        name = "memory.events" if self.v2 else "memory.oom_control"
        if self._events_fd is None:
            self._events_fd = os.open(d / name, os.O_RDONLY | os.O_CLOEXEC)
        for line in os.pread(self._events_fd, 4096, 0).decode().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0 if self.v2 else int((d / "memory.failcnt").read_text())

    def _close_events(self) -> None:
        if self._freeze_due is not None:
            self._freeze_due.cancel()
            self._freeze_due = None
        for name in ("_events_fd", "_usage_fd", "_freezer_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def memory_bytes(self) -> int:
        """Memory charged to the group now (``memory.current`` on v2, ``memory.usage_in_bytes``
        on v1): its processes' anonymous memory, its tmpfs files and the page cache it touched
        first. Page cache is reclaimable, so this errs on the safe side. Read after every session
        step, so through a descriptor kept open, as ``oom_kills``."""
        if self._usage_fd is None:
            d = self._dir("memory")
            self._usage_fd = os.open(d / ("memory.current" if self.v2 else "memory.usage_in_bytes"),
                                     os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(self._usage_fd, 64, 0))

    def cpu_seconds(self) -> float:
        if self.v2:
            for line in (self.dirs["unified"] / "cpu.stat").read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "usage_usec":
                    return int(v) / 1e6
            return 0.0
        return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9

    def freeze(self, frozen: bool) -> None:
        """Freeze (``True``) or thaw the group. A freeze asked from the running event loop happens
        ``FREEZE_GRACE_S`` later, and a thaw before then only cancels it; a thaw returns once the
        group runs again."""
        if self._freeze_due is not None:
            self._freeze_due.cancel()
            self._freeze_due = None
            if not frozen:
                return  # never written: it runs still
        if frozen and FREEZE_GRACE_S > 0:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop in this thread: at once
                loop = None
            if loop is not None:
                self._freeze_due = loop.call_later(FREEZE_GRACE_S, self._freeze_now)
                return
        self._write_freezer(frozen)

    def _freeze_now(self) -> None:
        self._freeze_due = None
        try:
            self._write_freezer(True)
        except OSError as e:  # the group is going (killed meanwhile): nothing to hold
            log.debug("cgroup %s: could not be frozen: %s", self.name, e)

    def _write_freezer(self, frozen: bool) -> None:
        if self._freezer_fd is None:
            path = (self.dirs["unified"] / "cgroup.freeze") if self.v2 else (self.dirs["freezer"] / "freezer.state")
            self._freezer_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        fd = self._freezer_fd
        if self.v2:
            os.pwrite(fd, b"1" if frozen else b"0", 0)
            return
        os.pwrite(fd, b"FROZEN" if frozen else b"THAWED", 0)
        if frozen:
            # freezing completes asynchronously on v1 (as on v2, where nobody waits either): an idle
            # session need not be frozen before its step reports, and a thaw written while it is
            # still FREEZING wins. Waiting here would cost ~0.5 ms of every session step's latency.
            return
        for _ in range(1000):  # a thaw must be complete before the session's next request
            if os.pread(fd, 16, 0).strip() == b"THAWED":
                return
            time.sleep(0.0005)

    def pids(self) -> list[int]:
        d = self.dirs["unified"] if self.v2 else self.dirs["pids"]
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]

    def kill_all(self) -> None:
        """SIGKILL everything in the group (daemonised descendants included), thawing first."""
        if self.v2 and (self.dirs["unified"] / "cgroup.kill").exists():
            (self.dirs["unified"] / "cgroup.kill").write_text("1")
            return
        try:
            self.freeze(False)
        except OSError:
            pass
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill_all()
        self._close_events()  # after the kill, whose thaw writes through the freezer's descriptor
        for d in ({self.dirs["unified"]} if self.v2 else set(self.dirs.values())):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes still exiting
                    time.sleep(0.005)


class CgroupRoot:
    """Where this process may create sandbox groups: a ``tangram-<pid>`` parent under our own
    cgroup in each controller."""

    def __init__(self, dirs: dict[str, Path], v2: bool, bounds_cpu_time: bool = False) -> None:
        self.dirs = dirs
        self.v2 = v2
        #: whether its groups take ``set_cpu_quota``: the cpu controller is ours (enabled for our
        #: groups on v2, mounted and writable on v1) with CFS bandwidth control (its quota file)
        self.bounds_cpu_time = bounds_cpu_time

    def create(self, name: str, cpus: str | None = None) -> Group:
        dirs = {}
        for c, parent in self.dirs.items():
            d = parent / name
            d.mkdir(exist_ok=True)
            dirs[c] = d
        g = Group(name, dirs, self.v2)
        if not self.v2:
            cs = dirs["cpuset"]
            (cs / "cpuset.mems").write_text((self.dirs["cpuset"] / "cpuset.mems").read_text().strip())
            (cs / "cpuset.cpus").write_text(cpus or (self.dirs["cpuset"] / "cpuset.cpus").read_text().strip())
        elif cpus:
            g.set_cpus(tuple(int(x) for x in cpus.split(",")))
        return g

    def cleanup(self) -> None:
        """Remove every group left under our parent and the parent itself."""
        for parent in self.dirs.values():
            if not parent.exists():
                continue
            for child in parent.iterdir():
                if child.is_dir():
                    try:
                        for fname, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                            if (child / fname).exists():  # a frozen process cannot die
                                (child / fname).write_text(value)
                        for pid in (child / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        time.sleep(0.01)
                        child.rmdir()
                    except OSError:
                        pass
            try:
                parent.rmdir()
            except OSError:
                pass


def _own_cgroups(proc_self_cgroup: str) -> dict[str, str]:
    """``{controller: path}`` from /proc/self/cgroup text (v2's entry has the key ``""``)."""
    out = {}
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _reap_stale(parent_dir: Path, v2: bool) -> None:
    """Remove the groups of earlier processes that died without cleaning up (a killed server)."""
    for d in parent_dir.glob("tangram-*"):
        pid = d.name[len("tangram-"):]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            CgroupRoot({"x": d}, v2).cleanup()


def open_root(mount: str | Path = "/sys/fs/cgroup", self_cgroup: str | None = None,
              tag: str | None = None) -> CgroupRoot | None:
    """A writable place for sandbox groups, or None (with a warning saying why) where there is none.
    On cgroup v2 our own cgroup is made a delegated subtree first (see ``delegate_v2``)."""
    mount = Path(mount)
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    own = _own_cgroups(self_cgroup)
    tag = tag or f"tangram-{os.getpid()}"
    try:
        if (mount / "cgroup.controllers").exists():  # pure v2
            base = mount / own.get("", "/").lstrip("/")
            if base.name == LEAF:  # started from inside the leaf an earlier server made
                base = base.parent
            available = delegate_v2(mount, base, euid() == 0)
            _reap_stale(base, True)
            parent = base / tag
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in V2_WANTED if c in available))
            # a kernel without CFS bandwidth control has the cpu controller but no quota file
            return CgroupRoot({"unified": parent}, v2=True,
                              bounds_cpu_time="cpu" in available and (parent / "cpu.max").exists())
        dirs = {}
        def ours(c: str) -> Path:
            """Our parent group in controller ``c``'s hierarchy (stale ones of dead servers removed)."""
            mine = mount / c / own.get(c, "/").lstrip("/")
            _reap_stale(mine, False)
            parent = mine / tag
            parent.mkdir(exist_ok=True)
            return parent

        for c in V1_CONTROLLERS:
            if not (mount / c).is_dir():
                raise OSError(f"controller {c} is not mounted at {mount / c}")
            dirs[c] = ours(c)
        for c in V1_OPTIONAL:
            try:
                if (mount / c).is_dir():
                    dirs[c] = ours(c)
            except OSError as e:  # mounted read-only, say: every action is pinned instead
                log.info("cgroups: no CPU time quotas (%s): one-shots are pinned to their cores", e)
        cs = dirs["cpuset"]
        up = cs.parent
        (cs / "cpuset.mems").write_text((up / "cpuset.mems").read_text().strip())
        (cs / "cpuset.cpus").write_text((up / "cpuset.cpus").read_text().strip())
        return CgroupRoot(dirs, v2=False, bounds_cpu_time="cpu" in dirs and (dirs["cpu"] / "cpu.cfs_quota_us").exists())
    except OSError as e:
        log.warning("cgroups unavailable (%s): falling back to rlimits, CPU affinity and SIGSTOP; memory "
                    "limits then bound address space, not resident memory, and a frozen session is "
                    "stopped by signal", e)
        return None
