"""CPU time of one tangram server by part (engine process, HTTP fronts, sandbox workers, sandboxes),
for ``tangram bench server --cpu``: where a one-shot's CPU goes at a given load.

Processes are read from ``/proc`` (user + system time of the engine process and of each of its
children, a front or a worker by its command line); sandboxes from their control groups (the
``tangram-<pid>`` group each manager makes under its own, read as ``cpu.stat``'s ``usage_usec``
on cgroup v2 or ``cpuacct.usage`` on v1; both count the whole subtree, so a one-shot's forked
children are in it once they end). Their total is never summed from ``/proc``: a sandbox
started and discarded between two readings would be missing there.

Each part's system time is beside it (``sys``: the kernel's share, page faults and system calls
among it; sampled at clock ticks, the kernel's own split), and the sandboxes' CPU is split by process
(``in_sandboxes``) for the sandboxes alive at the second reading, each known by its bwrap
monitor's pid and start time (a child of the process that manages it; the runner under it, the
namespace's init, whose ``cutime`` holds the bash it spawned and any process orphaned there; the
zygote, whose ``cutime`` holds every python child it reaped): where the sandboxes' CPU per
one-shot grows between 2 and 16 cores, by process, user or kernel.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from ..sim.metrics import percentile

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = CGROUP_V2 / "cpuacct"
PARTS = ("engine", "fronts", "workers", "sandboxes")
#: the sandboxes' processes: bwrap's monitor outside the namespace; the runner (its init) and what
#: it reaped (the bash it spawned, and any process orphaned in the sandbox); the zygote and the
#: python children it reaped. ``_sys``: the system part of the two long-lived ones (a short
#: child's split is scaled from the clock ticks it was sampled in, most often none: not reported)
IN_SANDBOX = ("monitor", "runner", "runner_sys", "runner_children", "zygote", "zygote_sys", "zygote_children")


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _proc_times(pid: int) -> tuple[str, list[float], int]:
    """A process's name; its user, system, children's user and children's system seconds; and
    its start time (clock ticks since boot: with the pid, who it is, as pids are reused)."""
    name, fields = _stat(pid)
    return name, [int(f) / _ticks() for f in fields[11:15]], int(fields[19])


def _stat(pid: int) -> tuple[str, list[str]]:
    """A process's name and the fields of ``/proc/<pid>/stat`` after it (state first)."""
    with open(f"/proc/{pid}/stat") as fh:
        text = fh.read()
    return text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()


def _sandbox_procs(owner: int) -> dict[tuple[int, int], dict[str, float]]:
    """CPU seconds of the persistent processes of each sandbox ``owner`` manages (``IN_SANDBOX``),
    by its bwrap monitor's pid and start time."""
    out: dict[tuple[int, int], dict[str, float]] = {}
    for monitor in _children(owner):
        try:
            name, (u, s, _, _), started = _proc_times(monitor)
            if name != "bwrap":
                continue
            rec = {"monitor": u + s}
            for runner in _children(monitor):
                name, (u, s, cu, cs), _ = _proc_times(runner)
                rec.update(runner=u + s, runner_sys=s, runner_children=cu + cs)
                # the zygote: the runner's first child of its own interpreter (a bash started ahead,
                # a fresh interpreter's run or a session's are other children)
                same = sorted((t[2], t[1]) for t in map(_proc_times, _children(runner)) if t[0] == name)
                if same:
                    (u, s, cu, cs) = same[0][1]
                    rec.update(zygote=u + s, zygote_sys=s, zygote_children=cu + cs)
        except OSError:  # gone while read: counted as neither reading
            continue
        out[(monitor, started)] = rec
    return out


PF_EXITING = 0x4  # the kernel's task flag for a task in its exit (``/proc/<pid>/stat``'s ninth field)
SIGKILL_BIT = 1 << 8  # signal 9 in ``/proc/<pid>/status``'s pending masks


def _exiting(pid: int) -> bool:
    """Whether ``pid`` is killed and not yet reaped: a zombie, a task in its exit, or one with
    SIGKILL pending (sent, and the task not yet run to act on it). Its CPU is in its parent's
    ``cutime`` only once reaped. A process already gone is not exiting."""
    try:
        _, fields = _stat(pid)
        if fields[0] in "ZXx" or int(fields[6]) & PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as fh:
            return any(int(line.split()[1], 16) & SIGKILL_BIT for line in fh
                       if line.startswith(("SigPnd:", "ShdPnd:")))
    except (OSError, IndexError, ValueError):
        return False


def _sandbox_exiting(owner: int) -> int:
    """How many processes of the sandboxes ``owner`` manages are exiting (``_exiting``): the
    runner's children and theirs (a bash run, the zygote's python children)."""
    return sum(_exiting(p) for monitor in _children(owner) for runner in _children(monitor)
               for kid in _children(runner) for p in (kid, *_children(kid)))


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    return kids


def _kind(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return None
    if b"arl_tangram.runtime.worker_process" in argv:
        return "workers"
    if any(b"front" in a for a in argv[1:4]) or b"arl_tangram.server.front" in argv:
        return "fronts"
    return None


def _sandbox_groups(pids: set[int]) -> list[Path]:
    """The ``tangram-<pid>`` control groups of these processes (a depth-bounded walk of the
    cpuacct hierarchy on cgroup v1, of the unified one on v2)."""
    names = {f"tangram-{p}" for p in pids}
    root = CGROUP_V1 if CGROUP_V1.is_dir() else CGROUP_V2
    found: list[Path] = []
    for d, dirs, _ in os.walk(root):
        here = Path(d)
        if here.name in names:
            found.append(here)
            dirs[:] = []
        elif len(here.parts) - len(root.parts) >= 6:
            dirs[:] = []
    return found


def _group_cpu_s(group: Path) -> tuple[float, float]:
    """A control group's CPU seconds, all and the system part (v2's ``cpu.stat``; v1's cpuacct
    files, where a ``cpu.stat`` beside them is the cpu controller's throttling counts)."""
    stat = group / "cpu.stat"
    usec = dict(line.split() for line in stat.read_text().splitlines() if line.count(" ") == 1) if stat.exists() else {}
    if "usage_usec" in usec:
        return int(usec["usage_usec"]) / 1e6, int(usec.get("system_usec", 0)) / 1e6
    usage = group / "cpuacct.usage"
    if usage.exists():
        ticks = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
        return int(usage.read_text()) / 1e9, int(ticks.get("system", 0)) / _ticks()
    return 0.0, 0.0


class CpuMeter:
    """CPU seconds of a server's parts; ``read()`` twice and ``per_request`` of the difference."""

    def __init__(self, engine_pid: int) -> None:
        self.engine = engine_pid

    def read(self, settle_s: float = 0.0) -> dict:
        """The parts' CPU seconds (``PARTS``, each with its ``.sys``), and ``sandbox_procs``: each
        sandbox's processes by its monitor's pid and start time.

        ``settle_s``: first wait, that long at most, until no sandbox process is exiting
        (``exiting``: how many still were). A one-shot's child is killed as its answer goes out and
        ends after it (its exit off the latency path: ``inside.zygote.Zygote.child``); until the zygote
        reaps it, its CPU is in neither the zygote's ``cutime`` nor, for its exit, the control
        group. A reading right after a level's last answer can miss it: on a loaded machine a
        child ends up to ~0.5 s after its answer."""
        out: dict = (dict.fromkeys(PARTS, 0.0) | {f"{k}.sys": 0.0 for k in PARTS}
                     | {"sandbox_procs": {}, "exiting": 0})
        kinds = {kid: kind for kid in _children(self.engine) if (kind := _kind(kid)) is not None}
        owners = {self.engine, *kinds}
        if settle_s > 0:
            deadline = time.monotonic() + settle_s
            while (left := sum(map(_sandbox_exiting, owners))) and time.monotonic() < deadline:
                time.sleep(0.002)
            out["exiting"] = left
        try:
            _, (u, s, _, _), _ = _proc_times(self.engine)
        except OSError:
            return out
        out["engine"], out["engine.sys"] = u + s, s
        for kid, kind in kinds.items():
            try:
                _, (u, s, _, _), _ = _proc_times(kid)
            except OSError:
                continue
            out[kind] += u + s
            out[f"{kind}.sys"] += s
        for g in _sandbox_groups(owners):
            used, system = _group_cpu_s(g)
            out["sandboxes"] += used
            out["sandboxes.sys"] += system
        for owner in owners:
            out["sandbox_procs"].update(_sandbox_procs(owner))
        return out

    @staticmethod
    def per_request(before: dict, after: dict, n: int) -> dict:
        """Milliseconds of CPU per request by part and their total; ``sys``: each part's system
        time; ``in_sandboxes``: the sandboxes' processes (``IN_SANDBOX``; a sandbox started
        between the readings counts from its start, its bwrap and interpreter's start-up
        included, as in the control groups; one gone between them is missing: its time after
        the first reading is not read; ``exiting``: processes still exiting at the second
        reading, their CPU missing too: ``read``'s ``settle_s``)."""
        def per(seconds: float) -> float:
            return round(seconds * 1000 / max(1, n), 3)
        ms: dict = {k: per(after[k] - before[k]) for k in PARTS}
        ms["total"] = round(sum(ms[k] for k in PARTS), 3)
        ms["sys"] = {k: per(after[f"{k}.sys"] - before[f"{k}.sys"]) for k in PARTS}
        was, now = before.get("sandbox_procs", {}), after.get("sandbox_procs", {})
        ms["in_sandboxes"] = {k: per(sum(now[sid].get(k, 0.0) - was.get(sid, {}).get(k, 0.0) for sid in now))
                              for k in IN_SANDBOX} | {"sandboxes_new": len(set(now) - set(was)),
                                                "sandboxes_gone": len(set(was) - set(now)),
                                                "exiting": after.get("exiting", 0)}
        return ms


def cpu_ticks(cpus: set[int] | None = None) -> tuple[int, int]:
    """(idle, total) clock ticks of ``cpus`` (all of them if None) since boot, from ``/proc/stat``
    (idle includes iowait). Two readings give how busy a server's CPUs were over a level: a
    one-shot's wait for its core is either those CPUs doing other work or their idleness, and this
    tells which."""
    idle = total = 0
    with open("/proc/stat") as fh:
        for line in fh:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if cpus is not None and int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
    return idle, total


def _read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


class RunQueue:
    """The host's runnable tasks sampled over a level (``/proc/loadavg``'s fourth field, the
    kernel's ``nr_running`` over all CPUs, read by a thread every ``every_s``), and the CPU
    pressure over the same span (``/proc/pressure/cpu``'s ``some`` total: the share of the time
    at least one task waited for a CPU; None where the kernel has no PSI). Beside the server's
    CPUs' idle share they tell why CPUs idle: too few runnable tasks (the work is short), or
    many runnable while CPUs idle (the kernel left waiting tasks on busy CPUs).

    Both are the host's: a load generator on the same host counts in them (and this sampler, in
    the runnable count), and the count includes the tasks running."""

    def __init__(self, every_s: float = 0.005, read: Callable[[str], str] = _read_text,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._read, self._clock = every_s, read, clock
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._psi0: int | None = None
        self._t0 = 0.0

    def _runnable(self) -> int:
        return int(self._read("/proc/loadavg").split()[3].split("/")[0])

    def _pressure_us(self) -> int | None:
        try:
            for line in self._read("/proc/pressure/cpu").splitlines():
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1])
        except (OSError, IndexError, ValueError):
            pass
        return None

    def sample(self) -> None:
        """One reading of the runnable tasks (the thread's; tests call it directly)."""
        try:
            self._samples.append(self._runnable())
        except (OSError, IndexError, ValueError):
            pass

    def start(self, thread: bool = True) -> None:
        self._psi0, self._t0 = self._pressure_us(), self._clock()
        if thread:
            self._thread = threading.Thread(target=self._run, name="run queue sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def halt(self) -> None:
        """End the sampling thread, if it runs (``stop`` does, and reports)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stop(self) -> dict:
        """``runnable`` p10/p50/p90 and how many samples, ``cpu_pressure`` (share of the span)."""
        self.halt()
        span_us = (self._clock() - self._t0) * 1e6
        psi1 = self._pressure_us()
        s = sorted(self._samples)
        out: dict = {"samples": len(s)}
        if s:
            out.update({f"runnable_p{q}": percentile(s, q) for q in (10, 50, 90)})
        out["cpu_pressure"] = (round(min(1.0, (psi1 - self._psi0) / span_us), 3)
                               if psi1 is not None and self._psi0 is not None and span_us > 0 else None)
        return out


# -- a head and the Ray processes of a loopback cluster ------------------------------------------
#: the head process's threads: its main thread (the event loop: engine, service, journal, Ray's
#: Python side of every call); Ray's own threads (named by Ray: gRPC, io, the task event buffer:
#: the link's transport); the other threads (Python's, and threads gone between two readings)
HEAD_THREADS = ("main", "ray_threads", "other_threads")
#: Ray's processes by kind: each node's raylet, the GCS, Ray's workers that are not a node agent
#: (idle workers, each raylet's dashboard and runtime-env agents), its head services (dashboard,
#: monitor, log monitor: Python programs of the ``ray`` package)
RAY_PARTS = ("raylet", "gcs", "ray_workers", "ray_services")
#: a Ray worker's process title while it is a node agent (``ray::NodeAgent``, ``ray::NodeAgent.run``)
AGENT_TITLE = b"ray::NodeAgent"
#: a thread whose name is the interpreter's, or a Ray worker's title (a thread takes its process's
#: name when it starts): one Python started (Ray names its C++ threads)
_PY_THREAD_NAMES = ("python", "python3", "ray::")


def _cpu_s(pid: int) -> float:
    """A process's own CPU seconds (user + system, its reaped children not counted)."""
    _, (u, s, _, _), _ = _proc_times(pid)
    return u + s


def _threads(pid: int) -> dict[str, float]:
    """``HEAD_THREADS`` of ``pid``: CPU seconds by thread kind (``/proc/<pid>/task``); the other
    threads are the process's total less the two named kinds, so a thread that ended is in them.
    ``main.sys`` and ``ray_threads.sys``: the kernel's part of those two (system calls: the
    loop's waits and wake-ups, the sockets)."""
    total = _cpu_s(pid)
    main = ray = main_sys = ray_sys = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / _ticks()
        if int(tid) == pid:
            main, main_sys = used, int(fields[12]) / _ticks()
        elif not name.startswith(_PY_THREAD_NAMES):
            ray += used
            ray_sys += int(fields[12]) / _ticks()
    return {"main": main, "ray_threads": ray, "other_threads": max(0.0, total - main - ray),
            "main.sys": main_sys, "ray_threads.sys": ray_sys}


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _ray_kind(pid: int) -> str | None:
    """``agent`` (a node agent), one of ``RAY_PARTS``, or None (not Ray's)."""
    argv = _argv(pid)
    if not argv:
        return None
    first = argv[0]
    if first.startswith(AGENT_TITLE):
        return "agent"
    if first.startswith(b"ray::"):
        return "ray_workers"
    name = os.path.basename(first.split(b" ")[0])
    if name == b"raylet":
        return "raylet"
    if name == b"gcs_server":
        return "gcs"
    if any(b"/ray/" in a for a in argv[:3]):
        return "ray_services"
    return None


def _descendants_of(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _io_write_bytes(pid: int) -> int:
    """Bytes ``pid`` caused to be written to storage (``/proc/<pid>/io``'s ``write_bytes``; 0 where
    unreadable): the journal's WAL and checkpoints, for a head."""
    try:
        with open(f"/proc/{pid}/io") as fh:
            for line in fh:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class ClusterCpuMeter:
    """CPU seconds of a head (``tangram serve``, with or without Ray) and of the loopback Ray
    cluster it runs on, by part: ``read()`` twice and ``per_action`` of the difference.

    * the head: its process by thread (``HEAD_THREADS``), its fronts and sandbox workers (its
      children, as ``CpuMeter``), the bytes it wrote to storage;
    * each node's agent (a Ray worker titled ``ray::NodeAgent``), by pid, and by thread;
    * Ray's own processes (``RAY_PARTS``): the descendants of ``ray_root`` (the process that
      started the loopback cluster's nodes) that are Ray's and not an agent;
    * the sandboxes: the control groups of the agents and of the head and its workers (as
      ``CpuMeter``: a sandbox started and discarded between readings is counted there);
    * the load generator (``client_pid``) and the whole machine's busy CPU (``/proc/stat``): what
      the parts do not add up to is the host's other work (kernel threads, the loopback network's
      soft interrupts, anything else running).

    A process started between the readings counts from its start (a Ray worker, an agent); one
    gone between them is missing."""

    def __init__(self, head_pid: int, ray_root: int | None = None, client_pid: int | None = None) -> None:
        self.head = head_pid
        self.ray_root = ray_root
        self.client = client_pid

    def read(self) -> dict:
        out: dict = {"head": dict.fromkeys(HEAD_THREADS, 0.0) | {"fronts": 0.0, "workers": 0.0, "main.sys": 0.0,
                                                                  "ray_threads.sys": 0.0},
                     "agents": {}, "ray": dict.fromkeys(RAY_PARTS, 0.0), "sandboxes": 0.0, "client": 0.0,
                     "head_write_bytes": 0, "machine_busy": 0.0}
        idle, total = cpu_ticks()
        out["machine_busy"] = (total - idle) / _ticks()
        try:
            out["head"].update(_threads(self.head))
        except OSError:
            pass
        out["head_write_bytes"] = _io_write_bytes(self.head)
        owners = {self.head}
        for kid in _children(self.head):
            kind = _kind(kid)
            if kind is None:
                continue
            owners.add(kid)
            try:
                out["head"][kind] += _cpu_s(kid)
            except OSError:
                continue
        if self.ray_root is not None:
            mine = {self.head, *_descendants_of(self.head)}
            skip: set[int] = set()
            for pid in _descendants_of(self.ray_root):
                if pid in mine or pid in skip:
                    continue
                kind = _ray_kind(pid)
                if kind is None:
                    continue
                try:
                    used = _cpu_s(pid)
                except OSError:
                    continue
                if kind == "agent":
                    try:
                        out["agents"][pid] = {"total": used, **_threads(pid)}
                    except OSError:
                        continue
                    owners.add(pid)
                    skip.update(_descendants_of(pid))  # its sandboxes: their control groups count them
                else:
                    out["ray"][kind] += used
        if self.client is not None:
            try:
                out["client"] = _cpu_s(self.client)
            except OSError:
                pass
        for g in _sandbox_groups(owners):
            out["sandboxes"] += _group_cpu_s(g)[0]
        return out

    @staticmethod
    def per_action(before: dict, after: dict, n: int) -> dict:
        """Milliseconds of CPU per action by part: ``head`` (each thread kind, fronts, workers,
        ``total``; ``sys``: the kernel's part of the main thread's and Ray's threads'), ``agents`` (``each``: one figure per agent alive at both readings, ``total``),
        ``ray`` (``RAY_PARTS``, ``total``), ``sandboxes``, ``client``; ``all``: their sum (the client
        left out), ``machine``: the host's busy CPU, ``unattributed``: machine less all and client;
        ``head_write_kb``: storage written by the head per action (KB)."""
        def per(seconds: float) -> float:
            return round(seconds * 1000 / max(1, n), 3)

        head = {k: per(after["head"][k] - before["head"][k]) for k in (*HEAD_THREADS, "fronts", "workers")}
        head["total"] = round(sum(head.values()), 3)
        head["sys"] = {k: per(after["head"][f"{k}.sys"] - before["head"][f"{k}.sys"]) for k in ("main", "ray_threads")}
        was, now = before["agents"], after["agents"]
        zero = dict.fromkeys(("total", *HEAD_THREADS), 0.0)
        both = sorted(set(was) & set(now))
        new = sorted(set(now) - set(was))
        pairs = [(was[p], now[p]) for p in both] + [(zero, now[p]) for p in new]
        each = [per(b["total"] - a["total"]) for a, b in pairs]
        agents = {"each": each, "total": round(sum(each), 3), "started_between": len(new),
                  "threads": {k: per(sum(b[k] - a[k] for a, b in pairs)) for k in HEAD_THREADS}}
        ray = {k: per(after["ray"][k] - before["ray"][k]) for k in RAY_PARTS}
        ray["total"] = round(sum(ray.values()), 3)
        sandboxes = per(after["sandboxes"] - before["sandboxes"])
        client = per(after["client"] - before["client"])
        everything = round(head["total"] + agents["total"] + ray["total"] + sandboxes, 3)
        machine = per(after["machine_busy"] - before["machine_busy"])
        return {"head": head, "agents": agents, "ray": ray, "sandboxes": sandboxes, "client": client,
                "all": everything, "machine": machine,
                "unattributed": round(machine - everything - client, 3),
                "head_write_kb": round((after["head_write_bytes"] - before["head_write_bytes"]) / 1024 / max(1, n), 3)}
