"""``/run_code`` over HTTP against the same actions run in-process, at several concurrencies.

A server is started on a free loopback port for the measurement and stopped after it. Each level
sends a bounded number of trivial python programs (``print``) and reports latency percentiles and
completed actions per second; the in-process side submits the same programs to an embedded runtime.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

from ..managers.sandbox.manager import SandboxConfig
from ..runtime import Tangram
from ..sim.metrics import percentile

LEVELS = (1, 8, 32, 1000)


def _count(concurrency: int) -> int:
    return max(40, 5 * concurrency) if concurrency < 1000 else 1000


def _summary(latencies: list[float], elapsed: float, errors: int) -> dict:
    lat = sorted(latencies)
    return {"n": len(lat), "errors": errors, "p50_ms": round(percentile(lat, 50) * 1000, 2),
            "p99_ms": round(percentile(lat, 99) * 1000, 2), "throughput_per_s": round(len(lat) / elapsed, 1)}


async def _http_level(url: str, concurrency: int) -> dict:
    n = _count(concurrency)
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one(i: int) -> None:
            nonlocal errors
            async with sem:
                t = time.perf_counter()
                r = await c.post(f"{url}/run_code", json={"code": f"print({i})", "language": "python"})
                ok = r.status_code == 200 and r.json()["status"] == "Success"
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return _summary(lat, time.perf_counter() - t0, errors)


async def _inproc(levels: tuple[int, ...]) -> dict:
    out = {}
    async with Tangram.local(sandbox=SandboxConfig()) as tg:
        await asyncio.sleep(0.5)
        for concurrency in levels:
            n = _count(concurrency)
            sem = asyncio.Semaphore(concurrency)
            lat: list[float] = []
            errors = 0

            async def one(i: int) -> None:
                nonlocal errors
                async with sem:
                    t = time.perf_counter()
                    r = await tg.run(f"print({i})")
                    if r.ok:
                        lat.append(time.perf_counter() - t)
                    else:
                        errors += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            out[str(concurrency)] = _summary(lat, time.perf_counter() - t0, errors)
            await asyncio.sleep(0.5)
    return out


def run(levels: tuple[int, ...] = LEVELS, log: Callable[[str], None] = lambda m: None) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(port), "--journal",
                                 os.path.join(tmp, "journal.sqlite3")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            http = {}
            for c in levels:
                http[str(c)] = asyncio.run(_http_level(url, c))
                log(f"http concurrency {c:>4}: p50 {http[str(c)]['p50_ms']} ms, "
                    f"{http[str(c)]['throughput_per_s']} actions/s")
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(30)
    inproc = asyncio.run(_inproc(levels))
    for c in levels:
        log(f"in-process concurrency {c:>4}: p50 {inproc[str(c)]['p50_ms']} ms, "
            f"{inproc[str(c)]['throughput_per_s']} actions/s")
    return {"http": http, "in_process": inproc, "cores": len(os.sched_getaffinity(0)),
            "overhead_p50_ms": {c: round(http[c]["p50_ms"] - inproc[c]["p50_ms"], 2) for c in http}}
