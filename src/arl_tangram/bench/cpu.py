"""CPU time of one tangram server by part (engine process, HTTP fronts, sandbox workers, sandboxes),
for ``tangram bench server --cpu``: where a one-shot's CPU goes at a given load.

Processes are read from ``/proc`` (user + system time of the engine process and of each of its
children, a front or a worker by its command line); sandboxes from their control groups (the
``tangram-<pid>`` group each manager makes under its own, read as ``cpu.stat``'s ``usage_usec``
on cgroup v2 or ``cpuacct.usage`` on v1; both count the whole subtree, so a one-shot's forked
children are in it once they end). A sandbox's processes are never read from ``/proc``: a
python one-shot's child is reaped by the zygote, which is never reaped while the sandbox lives,
so its time would reach no parent's ``cutime`` there.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = CGROUP_V2 / "cpuacct"
PARTS = ("engine", "fronts", "workers", "sandboxes")


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _ticks()


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


def _group_cpu_s(group: Path) -> float:
    stat = group / "cpu.stat"
    if stat.exists():
        for line in stat.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    usage = group / "cpuacct.usage"
    if usage.exists():
        return int(usage.read_text()) / 1e9
    return 0.0


class CpuMeter:
    """CPU seconds of a server's parts; ``read()`` twice and ``per_request`` of the difference."""

    def __init__(self, engine_pid: int) -> None:
        self.engine = engine_pid

    def read(self) -> dict[str, float]:
        out = dict.fromkeys(PARTS, 0.0)
        try:
            out["engine"] = _proc_cpu_s(self.engine)
        except OSError:
            return out
        owners = {self.engine}
        for kid in _children(self.engine):
            kind = _kind(kid)
            if kind is None:
                continue
            owners.add(kid)
            try:
                out[kind] += _proc_cpu_s(kid)
            except OSError:
                pass
        out["sandboxes"] = sum(_group_cpu_s(g) for g in _sandbox_groups(owners))
        return out

    @staticmethod
    def per_request(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
        """Milliseconds of CPU per request by part, and their total."""
        ms = {k: round((after[k] - before[k]) * 1000 / max(1, n), 3) for k in PARTS}
        ms["total"] = round(sum(ms[k] for k in PARTS), 3)
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
