"""Where a trivial one-shot's sandbox CPU goes, by process, for ``tangram bench sandbox-cpu``.

Runs trivial one-shots (python ``print(i)``, bash ``echo i``) at a given concurrency through the
real manager (``Tangram.local``, recycling and fork-ahead as configured by default) and reads,
before and after, every pooled or busy sandbox's control group (``cpuacct.usage`` on cgroup v1,
``cpu.stat``'s ``usage_usec`` on v2: the whole sandbox) and ``/proc/<pid>/stat`` of its
persistent processes: the bwrap monitor, the runner (PID 1 of the sandbox; its ``cutime`` holds
the programs it spawns itself: bash), the zygote (its ``cutime`` holds every python child it
reaped: the run's and the one forked ahead, its warm-up included). A child forked ahead and still
waiting is read from ``schedstat`` (nanoseconds: one child's few hundred microseconds are below
``stat``'s clock ticks). Sandboxes made or discarded during the measurement are not counted
(``new``/``gone`` say how many). Figures are ms of CPU per one-shot; the engine process's own
(this process: engine, manager, the recycler's resets) is beside them.

docs/performance.md (one-shots) has its figures, with the reset's parts measured by an
instrumented copy of the runner.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Callable

from .cpu import _children, _ticks


def _stat(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    f = text.rsplit(")", 1)[1].split()
    return {"comm": text[text.index("(") + 1:text.rindex(")")], "self": (int(f[11]) + int(f[12])) / _ticks(),
            "kids": (int(f[13]) + int(f[14])) / _ticks()}


def _sched_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _group_s(sb) -> float | None:
    """The sandbox's control group's CPU seconds (``cgroups.Group.cpu_seconds``), if it has one."""
    if sb.group is None:
        return None
    try:
        return sb.group.cpu_seconds()
    except (OSError, ValueError, KeyError):
        return None


def _snapshot(mgr) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for sb in list(mgr.pool.idle or []) + list(mgr.busy):
        monitor = _stat(sb.proc.pid)
        if monitor is None:
            continue
        rec = {"bwrap": monitor["self"]}
        group = _group_s(sb)
        if group is not None:
            rec["sandbox"] = group
        for runner in _children(sb.proc.pid):
            r = _stat(runner)
            if r is None:
                continue
            rec["runner"], rec["runner_children"] = r["self"], r["kids"]
            for z in _children(runner):
                zs = _stat(z)
                if zs is not None and zs["comm"].startswith("python"):
                    rec["zygote"], rec["zygote_children"] = zs["self"], zs["kids"]
                    rec["waiting_ahead"] = sum(_sched_s(c) for c in _children(z))
        out[sb.id] = rec
    return out


async def _level(tg, case: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            r = await (tg.run(f"print({i})") if case == "python" else tg.run(f"echo {i}", "bash"))
            lat.append((time.perf_counter() - t) * 1000)
            if not r.ok:
                raise RuntimeError(f"a trivial {case} one-shot failed: {r.outcome.value} {r.message}")

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t, sorted(lat)


async def _case(case: str, n: int, concurrency: int, warmup: int) -> dict:
    from ..runtime import Tangram
    async with Tangram.local() as tg:
        mgr = tg.runtime.sandboxes
        await _level(tg, case, warmup, concurrency)
        await asyncio.sleep(0.3)  # the last resets
        before, cpu0 = _snapshot(mgr), os.times()
        elapsed, lat = await _level(tg, case, n, concurrency)
        await asyncio.sleep(0.3)
        after, cpu1 = _snapshot(mgr), os.times()
        kept = set(before) & set(after)
        total: dict[str, float] = {}
        for sid in kept:
            for key, value in after[sid].items():
                if key != "waiting_ahead" and key in before[sid]:
                    total[key] = total.get(key, 0.0) + value - before[sid][key]
        waiting = [rec["waiting_ahead"] for rec in after.values() if rec.get("waiting_ahead")]
        return {"requests": n, "concurrency": concurrency, "isolation": mgr.mode.value,
                "sandboxes": len(kept), "new": len(set(after) - set(before)), "gone": len(set(before) - set(after)),
                "throughput_per_s": round(n / elapsed, 1), "p50_ms": round(statistics.median(lat), 2),
                "cpu_ms_per_one_shot": {k: round(v / n * 1000, 3) for k, v in sorted(total.items())},
                "engine_process_cpu_ms": round((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / n * 1000, 3),
                "child_ahead_before_its_run_ms": round(statistics.median(waiting) * 1000, 3) if waiting else None,
                "recycler": mgr.recycler.stats()}


def run(cases: tuple[str, ...] = ("python", "bash"), requests: int = 1000, concurrency: int = 8,
        warmup: int = 200, log: Callable[[str], None] = lambda m: None) -> dict:
    out: dict = {"cores": len(os.sched_getaffinity(0)), "load_before": os.getloadavg()[0]}
    for case in cases:
        out[case] = asyncio.run(_case(case, requests, concurrency, warmup))
        log(f"{case}: {out[case]['cpu_ms_per_one_shot']} ms of CPU per one-shot")
    out["load_after"] = os.getloadavg()[0]
    return out
