"""Sandbox latencies and throughput on this machine, through the real local runtime.

* cold: every action spawns its own sandbox (isolation + interpreter start-up in the ACT)
* warm: the action takes a prepared sandbox from the pool (measured with the pool full), both
  with a fresh sandbox per one-shot (``fresh``) and with used ones reset and reused (``recycled``)
* session exec: a python cell in a live session (thaw, run, freeze); a shell step with and without
  a listener of its output (``on_output``: what streaming costs, as a ratio of one run)
* throughput: trivial one-shots at a concurrency of 4 per core, the pool refilling as it goes
* interpreter start-up: what starting each candidate interpreter costs, for choosing one
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from typing import Callable

from ..managers.sandbox.spec import SandboxConfig
from ..runtime import Tangram


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values)) - 1))]


def interpreter_startup_ms(candidates: list[list[str]], runs: int = 15) -> dict[str, float]:
    out = {}
    for argv in candidates:
        if not os.path.exists(argv[0]):
            continue
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run([*argv, "-c", "pass"], check=True)
            times.append((time.perf_counter() - t) * 1000)
        out[" ".join(argv)] = round(statistics.median(times), 1)
    return out


async def _wait_pool(tg: Tangram, size: int) -> None:
    pool = tg.runtime.sandboxes.pool.idle
    for _ in range(2000):
        if len(pool) >= size:
            return
        await asyncio.sleep(0.005)


async def _measure(samples: int, log: Callable[[str], None]) -> dict:
    cores = len(os.sched_getaffinity(0))
    result: dict = {"cores": cores}
    async with Tangram.local(sandbox=SandboxConfig(warm_pool=0, recycle=False)) as tg:
        await tg.run("pass")
        cold = []
        for _ in range(samples):
            t = time.perf_counter()
            r = await tg.run("print('hi')")
            cold.append((time.perf_counter() - t) * 1000)
            assert r.ok, r.message
        result["cold_p50_ms"] = round(_pct(cold, 50), 2)
        result["isolation"] = tg.runtime.sandboxes.mode.value
    log(f"cold one-shot p50 {result['cold_p50_ms']} ms")
    pool = max(4, 2 * cores)
    for mode, recycle in (("fresh", False), ("recycled", True)):
        result[mode] = await _warm(samples, pool, cores, recycle, lambda m: log(f"{mode}: {m}"))
    return result


async def _warm(samples: int, pool: int, cores: int, recycle: bool, log: Callable[[str], None]) -> dict:
    result: dict = {}
    async with Tangram.local(sandbox=SandboxConfig(warm_pool=pool, recycle=recycle)) as tg:
        warm, python_op = [], []
        for _ in range(samples):
            await _wait_pool(tg, pool)
            t = time.perf_counter()
            r = await tg.run("print('hi')")
            warm.append((time.perf_counter() - t) * 1000)
            python_op.append(r.result.run.duration_s * 1000)
            assert r.ok and r.stdout == "hi\n", r.message
        result["warm_p50_ms"] = round(_pct(warm, 50), 2)
        result["warm_p99_ms"] = round(_pct(warm, 99), 2)
        result["in_sandbox_python_p50_ms"] = round(_pct(python_op, 50), 2)
        log(f"warm one-shot p50 {result['warm_p50_ms']} ms, p99 {result['warm_p99_ms']} ms")
        s = await tg.session()
        await s.exec(python="x = 0")
        execs = []
        for _ in range(samples * 3):
            t = time.perf_counter()
            r = await s.exec(python="x += 1")
            execs.append((time.perf_counter() - t) * 1000)
        # a shell step nobody listens to, and one streamed to a listener (alternating, one run)
        shell: dict[bool, list[float]] = {False: [], True: []}
        for i in range(samples * 2):
            heard = bool(i % 2)
            t = time.perf_counter()
            r = await s.exec("echo hi", on_output=(lambda k, d: None) if heard else None)
            shell[heard].append((time.perf_counter() - t) * 1000)
            assert r.stdout == "hi\n", r.message
        await s.close()
        result["session_exec_p50_ms"] = round(_pct(execs, 50), 2)
        result["session_exec_p99_ms"] = round(_pct(execs, 99), 2)
        result["session_shell_p50_ms"] = round(_pct(shell[False], 50), 2)
        result["session_shell_streamed_p50_ms"] = round(_pct(shell[True], 50), 2)
        result["streamed_vs_plain_shell_p50"] = round(_pct(shell[True], 50) / _pct(shell[False], 50), 3)
        log(f"session exec p50 {result['session_exec_p50_ms']} ms")
        await _wait_pool(tg, pool)
        concurrency = 4 * cores
        total = 40 * cores
        sem = asyncio.Semaphore(concurrency)
        lat: list[float] = []

        async def one() -> bool:
            async with sem:
                t0 = time.perf_counter()
                ok = (await tg.run("print('hi')")).ok
                lat.append((time.perf_counter() - t0) * 1000)
                return ok

        t = time.perf_counter()
        ok = await asyncio.gather(*(one() for _ in range(total)))
        elapsed = time.perf_counter() - t
        result["throughput_per_s"] = round(sum(ok) / elapsed, 1)
        result["throughput_p50_ms"] = round(_pct(lat, 50), 2)
        result["throughput_p99_ms"] = round(_pct(lat, 99), 2)
        result["concurrency"] = concurrency
        result["throughput_actions"] = total
        result["recycler"] = tg.runtime.sandboxes.recycler.stats()
        log(f"throughput {result['throughput_per_s']} trivial actions/s at concurrency {concurrency}")
    return result


def run(samples: int = 30, log: Callable[[str], None] = lambda m: None) -> dict:
    result = asyncio.run(_measure(samples, log))
    result["interpreter_startup_ms"] = interpreter_startup_ms(
        [["/usr/bin/python3", "-I"], ["/usr/bin/python3", "-I", "-S"], [os.path.realpath(os.sys.executable)]])
    return result
