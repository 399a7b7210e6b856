"""``tangram bench spawn``: a sandbox's start from a large server process, by the loop's fork
against by vfork (``managers/sandbox/spawn.py``).

In one process on uvloop (the server's loop), holding ``ballast_mb`` of memory beside its own,
real sandboxes are started one at a time through ``SandboxManager`` (isolation, cgroups and the
runner as a server starts them; ready once the runner answers its ping) and killed, the two ways
alternating ``rounds`` times: ``fork``, uvloop's ``subprocess_exec`` (libuv forks the whole
process), and ``vfork``, ``start_process``. Per start: the starter's CPU and page
faults until the sandbox is ready, then the CPU and faults of writing the ballast once (what a
server's next full garbage collection or its own work costs after a fork: its pages were marked
copy-on-write), the wall time to ready, and the loop's longest stall (a 1 ms ticker's lateness).
Medians of the rounds, and ``vfork_vs_fork`` as ratios.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from typing import Any, Callable

from ..managers.sandbox import sandbox as sandbox_module
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spawn import loop_subprocess, start_process
from ..managers.sandbox.spec import SandboxConfig

WAYS = ("fork", "vfork")


def _touch(ballast: bytearray) -> None:
    """Write one byte of each of the ballast's pages."""
    for i in range(0, len(ballast), 4096):
        ballast[i] = (ballast[i] + 1) & 0xFF


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


async def _measure(manager: SandboxManager, way: str, starts: int, ballast: bytearray) -> dict[str, float]:
    sandbox_module.start_process = start_process if way == "vfork" else loop_subprocess  # type: ignore[assignment]
    stall = [0.0]

    async def tick() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stall[0] = max(stall[0], time.perf_counter() - t - 0.001)

    rows: list[tuple[float, float, float, float, float]] = []
    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        for _ in range(starts):
            _touch(ballast)  # the ballast's pages present and the process's own before the start
            await asyncio.sleep(0.01)
            c0, f0 = _usage()
            t0 = time.perf_counter()
            sb = await manager.pool.spawn(warm=False)
            wall = time.perf_counter() - t0
            c1, f1 = _usage()
            _touch(ballast)
            c2, f2 = _usage()
            rows.append(((c1 - c0) * 1000, f1 - f0, (c2 - c1) * 1000, f2 - f1, wall * 1000))
            await sb.kill()
    finally:
        ticker.cancel()
    cols = list(zip(*rows))
    return {"start_cpu_ms": round(statistics.median(cols[0]), 2),
            "start_faults": round(statistics.median(cols[1])),
            "after_cpu_ms": round(statistics.median(cols[2]), 2),
            "after_faults": round(statistics.median(cols[3])),
            "ready_p50_ms": round(statistics.median(cols[4]), 1),
            "loop_stall_max_ms": round(stall[0] * 1000, 1)}


def run(ballast_mb: int = 100, starts: int = 20, rounds: int = 3,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    import uvloop

    ballast = bytearray(ballast_mb << 20)
    _touch(ballast)  # present, not only reserved
    rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    mode: list[str] = []

    async def main() -> dict[str, list[dict[str, float]]]:
        manager = SandboxManager(SandboxConfig(warm_pool=0))
        await manager.start_up()
        mode.append(manager.mode.value if manager.mode is not None else "none")
        got: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
        try:
            for r in range(rounds):
                for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    m = await _measure(manager, way, starts, ballast)
                    got[way].append(m)
                    log(f"round {r + 1} {way:>5}: start {m['start_cpu_ms']} ms CPU, {m['start_faults']} faults; "
                        f"then writing the ballast {m['after_cpu_ms']} ms, {m['after_faults']} faults; ready in "
                        f"{m['ready_p50_ms']} ms; the loop stalled up to {m['loop_stall_max_ms']} ms")
        finally:
            sandbox_module.start_process = start_process  # type: ignore[assignment]
            await manager.shut_down()
        return got

    got = uvloop.run(main())
    out: dict[str, Any] = {"ballast_mb": ballast_mb, "rss_mb": rss_mb, "starts": starts, "rounds": rounds,
                           "isolation": mode[0] if mode else None}
    for way in WAYS:
        out[way] = {k: round(statistics.median(m[k] for m in got[way]), 2) for k in got[way][0]}
    out["vfork_vs_fork"] = {k: round(out["vfork"][k] / out["fork"][k], 3) if out["fork"][k] else None
                            for k in out["fork"]}
    return out
