"""``tangram bench sessions``: session density over HTTP.

A server is started on a free loopback port with sessions past ``max_awake`` (256: ~3.4 GB awake,
bounded on a shared host) or idle ``rest_after_s`` (30) put to rest (state on disk, no
processes); ``--max-awake`` above ``n`` keeps them all awake (no rest).
``n`` sessions are opened at ``concurrency`` clients, each running one step that leaves a state
(three imports, a list of 1,000 ints, a variable); then every session is revisited one at a time
(a step that checks its state exactly; latency per step over HTTP, most of them waking a rested
session), and again at ``concurrency`` clients (throughput). Idle memory per session is measured
four ways: what the sessions' cgroups are charged (the scheduler's figure; a rested session has
none), the proportional set size of the sandbox processes (shared pages split among their
users), the drop of the host's ``MemAvailable`` (includes the server's own growth and the
kernel's; noisy on a shared host) and the server's own growth; and the disk rested sessions use.

Then a second server with little memory for sessions (``memory_gb`` of 1 GB: the machine's real
capacity is not filled, so as not to starve its other users) is pushed past it at the same
concurrency: every attempt must end in a session that works, a 503 naming the limit, or a step
``rejected`` after ``max_queue_s``; a request still unanswered after ``hang_s`` counts as a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

from ..managers.sandbox.sandbox import _descendants
from ..runtime.host import mem_available_mb
from ..sim.metrics import percentile
from .server import free_port, stop_process, wait_up

FIRST = "import json, re, collections\nxs = list(range(1000))\nstate = {{'i': {i}}}"
CHECK = ("assert state['i'] == {i} and set(state) <= {{'i', 'visits'}}, state\nassert xs == list(range(1000))\n"
         "state['visits'] = state.get('visits', 0) + 1\nprint(len(xs))")


class _Server:
    """``tangram serve`` in a subprocess with ``config``."""

    def __init__(self, tmp: str, config: dict, sources: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.path.join(tmp, f"config-{self.port}.json")
        with open(path, "w") as fh:
            json.dump(config, fh)
        log = os.path.join(tmp, f"server-{self.port}.log")  # shown by wait_up if it does not come up
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(self.port),
                                          "--journal", os.path.join(tmp, f"journal-{self.port}.sqlite3"), "--config",
                                          path], stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": sources} if sources else None)
        try:
            wait_up(self.url, timeout_s=60, proc=self.proc, log=log)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc, 60)


def _pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total / 1024


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except OSError:
        return 0.0


def _lat(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {"n": len(lat), "p50_ms": round(percentile(lat, 50) * 1000, 2) if lat else None,
            "p99_ms": round(percentile(lat, 99) * 1000, 2) if lat else None}


async def _open(c: httpx.AsyncClient, i: int) -> tuple[str | None, str]:
    """Open a session and run its first step: (session id, "ok") or (None, what happened)."""
    r = await c.post("/v1/sessions", json={"job": "density"})
    if r.status_code != 201:
        return None, f"http {r.status_code}: {r.json().get('message', '')[:200]}"
    sid = r.json()["session_id"]
    r = await c.post(f"/v1/sessions/{sid}/exec", json={"python": FIRST.format(i=i), "timeout_s": 30})
    body = r.json()
    if r.status_code != 200 or body.get("outcome") != "ok":
        return None, f"step {r.status_code} {body.get('outcome')}: {str(body.get('message', ''))[:200]}"
    return sid, "ok"


async def _visit(c: httpx.AsyncClient, sid: str, i: int, woken: list[int] | None = None) -> bool:
    r = await c.post(f"/v1/sessions/{sid}/exec", json={"python": CHECK.format(i=i), "timeout_s": 30})
    body = r.json()
    if woken is not None and body.get("woken"):
        woken.append(i)
    return (r.status_code == 200 and body.get("outcome") == "ok" and not body.get("dropped")
            and ((body.get("run") or {}).get("stdout") or "").strip() == "1000")


async def _density(url: str, n: int, concurrency: int, log: Callable[[str], None],
                   measure: Callable[[int], dict]) -> tuple[dict, list[str]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    out: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)
        sids: list[str | None] = [None] * n
        failures: dict[str, int] = {}

        async def open_one(i: int) -> None:
            async with sem:
                sid, what = await _open(c, i)
                sids[i] = sid
                if sid is None:
                    failures[what] = failures.get(what, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(open_one(i) for i in range(n)))
        open_s = time.perf_counter() - t0
        opened = [(i, s) for i, s in enumerate(sids) if s is not None]
        out["open"] = {"sessions": n, "concurrency": concurrency, "opened": len(opened), "seconds": round(open_s, 2),
                       "sessions_per_s": round(len(opened) / open_s, 1), "failures": failures}
        log(f"opened {len(opened)}/{n} sessions (first step run) in {open_s:.1f} s at {concurrency} clients")
        await asyncio.sleep(2.0)  # the last rests under way finish
        out["idle_memory_after_open"] = await asyncio.to_thread(measure, len(opened))
        log(f"idle memory per session after opening: {out['idle_memory_after_open']}")

        lat: list[float] = []
        correct = 0
        woken: list[int] = []
        lat_woken: list[float] = []
        lat_awake: list[float] = []
        for i, sid in opened:  # one at a time
            t = time.perf_counter()
            before = len(woken)
            ok = await _visit(c, sid, i, woken)
            el = time.perf_counter() - t
            lat.append(el)
            (lat_woken if len(woken) > before else lat_awake).append(el)
            correct += ok
        # the two kinds apart: a step that wakes its session (most of them past max_awake) and
        # one whose session was awake
        out["revisit_sequential"] = {**_lat(lat), "state_intact": correct, "woken_from_rest": len(woken),
                                     "woken": _lat(lat_woken), "awake": _lat(lat_awake)}
        log(f"revisited one at a time: p50 {out['revisit_sequential']['p50_ms']} ms, p99 "
            f"{out['revisit_sequential']['p99_ms']} ms, {correct}/{len(opened)} with their state")

        lat = []
        correct = 0

        async def visit(i: int, sid: str) -> None:
            nonlocal correct
            async with sem:
                t = time.perf_counter()
                ok = await _visit(c, sid, i)
                lat.append(time.perf_counter() - t)
                correct += ok

        t0 = time.perf_counter()
        await asyncio.gather(*(visit(i, s) for i, s in opened))
        el = time.perf_counter() - t0
        out["revisit_concurrent"] = {**_lat(lat), "concurrency": concurrency, "state_intact": correct,
                                     "steps_per_s": round(len(lat) / el, 1)}
        log(f"revisited at {concurrency} clients: {out['revisit_concurrent']['steps_per_s']} steps/s, p50 "
            f"{out['revisit_concurrent']['p50_ms']} ms, {correct}/{len(opened)} with their state")
    return out, [s for _, s in opened]


async def _past_capacity(url: str, attempts: int, concurrency: int, hang_s: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    counts = {"working": 0, "refused_503": 0, "rejected_after_queueing": 0, "hangs": 0, "other": 0}
    limits_named: dict[str, int] = {}
    example = ""
    async with httpx.AsyncClient(base_url=url, timeout=hang_s, limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            nonlocal example
            async with sem:
                try:
                    r = await c.post("/v1/sessions", json={"job": "over"})
                    if r.status_code == 503:
                        counts["refused_503"] += 1
                        limit = r.json().get("limit", "")
                        limits_named[limit] = limits_named.get(limit, 0) + 1
                        example = example or r.json().get("message", "")
                        return
                    sid = r.json()["session_id"]
                    r = await c.post(f"/v1/sessions/{sid}/exec", json={"python": FIRST.format(i=i)})
                    outcome = r.json().get("outcome")
                    key = {"ok": "working", "rejected": "rejected_after_queueing"}.get(outcome, "other")
                    counts[key] += 1
                except httpx.TimeoutException:
                    counts["hangs"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(attempts)))
        el = time.perf_counter() - t0
    return {"attempts": attempts, "concurrency": concurrency, "hang_timeout_s": hang_s, **counts,
            "limits_named": limits_named, "seconds": round(el, 2), "example_refusal": example}


def _cgroups_mb(pids: list[int]) -> float:
    """The memory charge summed over the cgroups of ``pids``, each counted once (v2's
    ``memory.current``, else v1's ``memory.usage_in_bytes``)."""
    groups = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cgroup") as fh:
                for line in fh:
                    _, controllers, path = line.strip().split(":", 2)
                    if controllers == "" and path != "/":
                        groups.add(f"/sys/fs/cgroup{path}/memory.current")
                    elif "memory" in controllers.split(",") and path != "/":
                        groups.add(f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
        except (OSError, ValueError):
            pass
    total = 0
    for g in groups:
        try:
            with open(g) as fh:
                total += int(fh.read())
        except (OSError, ValueError):
            pass
    return total / (1 << 20)


def _density_run(tmp: str, n: int, concurrency: int, log: Callable[[str], None], max_awake: int,
                  rest_after_s: float, sources: str | None = None) -> dict:
    """One server (from ``sources``, another checkout's ``src``, when given) through the density run."""
    result: dict = {"sources": "baseline" if sources else "this", "load_avg_1m_before": round(os.getloadavg()[0], 2)}
    avail0 = mem_available_mb()
    server = _Server(tmp, {"sandbox": {"session_idle_expiry_s": 3600, "warm_pool": 8,
                                       "max_awake_sessions": max_awake, "rest_after_s": rest_after_s}}, sources)
    try:
        time.sleep(1.0)
        rss0 = _rss_mb(server.proc.pid)
        avail1 = mem_available_mb()

        def measure(k: int) -> dict:
            """Idle memory per session now (MB), and where the sessions are."""
            k = max(1, k)
            health = httpx.get(f"{server.url}/healthz", timeout=30).json()
            sandboxes = [p for p in _descendants(server.proc.pid) if p != server.proc.pid]
            avail2 = mem_available_mb()
            rest = health.get("rest") or {}
            return {"cgroup_charge": round(health["session_mem_used_mb"] / k, 3),
                    "sandbox_cgroups_now": round(_cgroups_mb(sandboxes) / k, 3),
                    "sandbox_pss": round(_pss_mb(sandboxes) / k, 3),
                    "server_rss_growth": round((_rss_mb(server.proc.pid) - rss0) / k, 3),
                    "host_available_drop": round((avail1 - avail2) / k, 3) if avail1 and avail2 else None,
                    "goal": 1.5, "sessions": k, "awake": rest.get("awake"), "at_rest": rest.get("at_rest"),
                    "rest_disk_per_session_kb": round(rest.get("rest_bytes", 0) / k / 1024, 1),
                    "sandbox_processes": len(sandboxes), "load_avg_1m": round(os.getloadavg()[0], 2)}

        density, sids = asyncio.run(_density(server.url, n, concurrency, log, measure))
        result.update(density)
        time.sleep(1.0)
        result["idle_memory_per_session_mb"] = measure(len(sids))
        health = httpx.get(f"{server.url}/healthz", timeout=30).json()
        result["rest"] = health.get("rest")
        result["server"] = {"sessions_placed": health["sessions_placed"],
                            "session_mem_reserved_mb": health["session_mem_reserved_mb"],
                            "session_mem_used_mb": health["session_mem_used_mb"],
                            "host_available_mb_before": avail0}
        result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
        log(f"idle memory per session after revisits: {result['idle_memory_per_session_mb']}")
    finally:
        server.stop()
    return result


def _ratios(this: dict, base: dict) -> dict:
    """This run's figures over the baseline's (above 1: more opens per second, longer latencies)."""
    def r(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {"opens_per_s": r(this["open"]["sessions_per_s"], base["open"]["sessions_per_s"]),
            "revisit_p50": r(this["revisit_sequential"]["p50_ms"], base["revisit_sequential"]["p50_ms"]),
            "revisit_p99": r(this["revisit_sequential"]["p99_ms"], base["revisit_sequential"]["p99_ms"]),
            "concurrent_steps_per_s": r(this["revisit_concurrent"]["steps_per_s"],
                                        base["revisit_concurrent"]["steps_per_s"]),
            "idle_mb_per_session": r(this["idle_memory_per_session_mb"]["sandbox_cgroups_now"],
                                     base["idle_memory_per_session_mb"]["sandbox_cgroups_now"])}


def run(n: int = 1000, concurrency: int = 16, over_attempts: int = 150, log: Callable[[str], None] = lambda m: None,
        max_awake: int = 256, rest_after_s: float = 30.0, baseline: str | None = None) -> dict:
    """The density run and the past-capacity run; with ``baseline`` (another checkout's ``src``
    directory) the density run goes first against a server from those sources, and ``ratios``
    compares the two (the same machine within minutes: its load is printed beside each)."""
    result: dict = {"cores": len(os.sched_getaffinity(0)), "sessions_target": n,
                    "load_avg_1m_before": round(os.getloadavg()[0], 2),
                    "max_awake_sessions": max_awake, "rest_after_s": rest_after_s}
    with tempfile.TemporaryDirectory() as tmp:
        if baseline is not None:
            log(f"baseline: a server from {baseline}")
            base = _density_run(tmp, n, concurrency, log, max_awake, rest_after_s, baseline)
            log("this checkout's server")
        result.update(_density_run(tmp, n, concurrency, log, max_awake, rest_after_s))
        if baseline is not None:
            result["baseline"] = base
            result["ratios"] = _ratios(result, base)
            log(f"this / baseline: {result['ratios']}")
        small = _Server(tmp, {"memory_gb": 1.0, "max_queue_s": 20,
                              "sandbox": {"session_idle_expiry_s": 3600, "warm_pool": 4}})
        try:
            result["past_capacity"] = {"memory_gb": 1.0, "max_queue_s": 20,
                                       **asyncio.run(_past_capacity(small.url, over_attempts, concurrency, 120.0))}
            log(f"past capacity: {result['past_capacity']}")
        finally:
            small.stop()
    return result
