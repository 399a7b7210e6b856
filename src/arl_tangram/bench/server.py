"""``/run_code`` over HTTP: tangram's server, optionally beside another SandboxFusion-compatible
endpoint (``--against URL``) measured with the same load generator in the same run.

A tangram server is started on a free loopback port for the measurement and stopped after it.
Cases (each a bounded number of requests at a fixed concurrency, latency percentiles and
completed requests per second):

* ``python`` / ``bash``: trivial programs (``print(i)`` / ``echo i``) at each concurrency level
* ``cpu_200ms``: python burning 200 ms of CPU, ``cpu_jobs`` of them all at once

Per case and level the targets are measured back to back (tangram first, then the peer), so slow
drift of a shared machine hits both alike. Without ``--against`` the same actions also run
in-process through the embedded runtime, to show what HTTP adds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from typing import Callable

import httpx

from ..managers.sandbox import corewaits
from ..managers.sandbox.spec import SandboxConfig
from .cpu import PARTS, CpuMeter, RunQueue, cpu_ticks
from ..runtime import Tangram
from ..sim.metrics import percentile

LEVELS = (1, 8, 32, 1000)
CPU_200MS = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2:\n    pass\nprint('done')"


def _count(concurrency: int) -> int:
    return max(40, 5 * concurrency) if concurrency < 1000 else 1000


def _summary(latencies: list[float], elapsed: float, errors: int) -> dict:
    lat = sorted(latencies)
    if not lat:
        return {"n": 0, "errors": errors, "p50_ms": None, "p99_ms": None, "throughput_per_s": 0.0}
    return {"n": len(lat), "errors": errors, "p50_ms": round(percentile(lat, 50) * 1000, 2),
            "p99_ms": round(percentile(lat, 99) * 1000, 2), "throughput_per_s": round(len(lat) / elapsed, 1)}


def _cpu_line(ms: dict) -> str:
    """``cpu_ms_per_request`` in a line (``bench/cpu.py``): each part's ms of CPU per request and
    the kernel's part of it, then the sandboxes' by process (and how many of their processes the
    reading found still exiting: their CPU is not in it)."""
    parts = ", ".join(f"{k} {ms[k]} ({ms['sys'][k]} kernel)" for k in PARTS if ms.get(k))
    inside = ms.get("in_sandboxes") or {}
    procs = ", ".join(f"{k.replace('_', ' ')} {inside[k]}" for k in ("runner", "runner_children", "zygote",
                                                                      "zygote_children") if inside.get(k))
    late = f" ({inside['exiting']} still exiting after 1 s: their CPU is missing)" if inside.get("exiting") else ""
    return (f"{'':>8} CPU ms/request: {parts or 'none read'}"
            + (f"; in the sandboxes: {procs}{late}" if procs else ""))


def _queue_text(q: dict | None) -> str:
    """``run_queue`` for the level's line: the host's runnable tasks and how long some waited."""
    if not q or not q.get("samples"):
        return ""
    pressure = q.get("cpu_pressure")
    return (f" with {q['runnable_p50']} tasks runnable (p50, host)"
            + (f", some waiting {pressure:.0%} of the time" if pressure is not None else ""))


def _body(case: str, i: int) -> dict:
    if case == "bash":
        return {"code": f"echo {i}", "language": "bash"}
    if case == "cpu_200ms":
        return {"code": CPU_200MS, "language": "python", "run_timeout": 30}
    return {"code": f"print({i})", "language": "python"}


CLIENTS = ("aiohttp", "httpx")


def default_client() -> str:
    """aiohttp where installed: the load generator then costs ~0.1 ms of CPU a request against
    httpx's ~1.6 ms (/v1/ping at 16 concurrent, on a 2-core VM), which on a small
    machine is CPU taken from the servers under test, not a property of either."""
    try:
        import aiohttp  # noqa: F401
        return "aiohttp"
    except ImportError:
        return "httpx"


@asynccontextmanager
async def _poster(kind: str, concurrency: int):
    """``post(url, body) -> (status, its JSON where 2xx, else None)`` over one pooled client of ``kind``."""
    if kind == "aiohttp":
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def post(url: str, body: dict) -> tuple[int, dict | None]:
                try:
                    async with session.post(url, json=body) as r:
                        return r.status, await r.json() if 200 <= r.status < 300 else None
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    return 0, None

            yield post
        return
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def post(url: str, body: dict) -> tuple[int, dict | None]:
            try:
                r = await c.post(url, json=body)
                return r.status_code, r.json() if 200 <= r.status_code < 300 else None
            except httpx.HTTPError:
                return 0, None

        yield post


async def _load(url: str, concurrency: int, case: str, n: int, offset: int = 0,
                client: str = "httpx", start_at: float | None = None
                ) -> tuple[list[float], int, float, float, int, float]:
    """``n`` requests of ``case`` to ``url``/run_code, ``concurrency`` at a time: latencies, errors,
    the wall-clock start and end of the measured part, how many warm-up requests went before it,
    and the CPU seconds this process spent in the measured part (the load generator's own cost:
    a client process busy all of the window is the limit, not the server).

    The warm-up is one request at each of the ``concurrency`` places (one for the 200 ms CPU
    jobs, whose burst is the measurement): the connections open and the server's pools and
    recycling reach the state the measurement runs in. With ``start_at`` (several client
    processes), the measured part starts at that wall-clock time in every process, so that the
    window is not widened by the processes' start-up (on 16 cores a 3,000-request run lasts ~1.5 s).
    ``--cpu``'s meter spans the warm-up and the wait for the common start too, and its figure per
    request counts the warm-up requests: an average over both, not the steady state's alone."""
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    errors = 0
    async with _poster(client, concurrency) as post:
        async def one(i: int) -> None:
            nonlocal errors
            async with sem:
                t = time.perf_counter()
                status, body = await post(f"{url}/run_code", _body(case, i))
                if status == 200 and body is not None and body.get("status") == "Success":
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        warm = 1 if case == "cpu_200ms" else max(1, concurrency)
        await asyncio.gather(*(one(-1 - k) for k in range(warm)))  # outside the measurement
        lat.clear()
        errors = 0
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0, c0 = time.time(), time.process_time()
        await asyncio.gather(*(one(offset + i) for i in range(n)))
        return lat, errors, t0, time.time(), warm, time.process_time() - c0


def _client_cpu(parts: list[tuple], elapsed: float) -> dict:
    """The load generator's CPU: ms per answered request, and its busiest process's share of
    the window (near 1.0: that process, one core's worth of Python, set the pace)."""
    answered = sum(len(p[0]) for p in parts)
    cpu = sum(p[5] for p in parts)
    busiest = max((p[5] / (p[3] - p[2]) for p in parts if p[3] > p[2]), default=0.0)
    return {"client_cpu_ms": round(cpu * 1000 / answered, 3) if answered else None,
            "client_busiest": round(busiest, 2), "client_procs": len(parts)}


def _load_in_process(args: tuple) -> tuple[list[float], int, float, float, int, float]:
    return asyncio.run(_load(*args))


#: seconds from now at which several client processes start their measured requests together
#: (their start and warm-up take well under a second on the hosts measured)
START_TOGETHER_S = 2.0


async def _http_level(url: str, concurrency: int, case: str = "python", n: int | None = None,
                      client_procs: int = 1, client: str = "httpx",
                      server_cpus: set[int] | None | bool = False) -> dict:
    """``n`` requests of ``case`` at ``concurrency``; with ``client_procs`` > 1 the load comes from
    that many processes (one httpx client costs about 1.6 ms of CPU a request, so it tops out
    near 600 requests/s: on a many-core host it, not the server, would set the figure), which
    start their measured requests at one instant (``start_skew_ms``: how far apart they did).
    Unless ``server_cpus`` is False, ``server_cpus_busy`` is the share of those CPUs (None: all of
    the host's) not idle from that instant to the last answer (one process: its warm-up included),
    and ``run_queue`` the host's runnable tasks and CPU pressure over the same span (``RunQueue``)."""
    n = n or _count(concurrency)
    procs = max(1, min(client_procs, concurrency))
    busy: dict = {}
    queue = RunQueue()

    async def meter(at: float) -> tuple[int, int] | None:
        if server_cpus is False:
            return None
        await asyncio.sleep(max(0.0, at - time.time()))
        queue.start()
        return cpu_ticks(server_cpus or None)

    def busy_since(ticks: tuple[int, int] | None) -> None:
        if ticks is not None:
            idle, total = (b - a for a, b in zip(ticks, cpu_ticks(server_cpus or None)))
            busy["server_cpus_busy"] = round(1 - idle / total, 3) if total else None
            busy["run_queue"] = queue.stop()

    try:
        if procs == 1:
            ticks = await meter(0.0)
            part = await _load(url, concurrency, case, n, 0, client)
            busy_since(ticks)
            lat, errors, t0, t1, warm, _ = part
            return {**_summary(lat, t1 - t0, errors), "warmup": warm, **_client_cpu([part], t1 - t0), **busy}
        from concurrent.futures import ProcessPoolExecutor
        start_at = time.time() + START_TOGETHER_S
        at_start = asyncio.ensure_future(meter(start_at))
        shares = [(url, concurrency // procs + (k < concurrency % procs), case, n // procs + (k < n % procs), k * n,
                   client, start_at) for k in range(procs)]
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(procs) as pool:
            parts = await asyncio.gather(*(loop.run_in_executor(pool, _load_in_process, a) for a in shares))
        busy_since(await at_start)
        lat = [x for p in parts for x in p[0]]
        starts = [p[2] for p in parts]
        elapsed = max(p[3] for p in parts) - min(starts)
        return {**_summary(lat, elapsed, sum(p[1] for p in parts)),
                "warmup": sum(p[4] for p in parts), "start_skew_ms": round((max(starts) - min(starts)) * 1000, 1),
                **_client_cpu(parts, elapsed), **busy}
    finally:  # (a level that failed: its sampler stops too)
        queue.halt()


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


def _serve(port: int, journal: str, cpus: str | None = None, fronts: int | None = None,
           workers: int | None = None, src: str | None = None, log: str = os.devnull,
           cores: int | None = None) -> subprocess.Popen:
    """A server; ``src``: another checkout's ``src`` directory, whose code it runs, for an A/B of
    two versions of the code in one run. Both sides run as the bench does: with
    ``ARL_TANGRAM_PURE=1`` set, their sources; without it, each its compiled hot path where it has
    one built (``python setup.py build_ext --inplace`` in that checkout), as an installed package
    runs (the engine process, the limit of one-shot throughput on 16 cores, runs its compiled
    modules there). Its output goes to ``log``, which ``wait_up`` shows where it does not come up."""
    argv = [sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(port), "--journal", journal]
    env = None
    if src is not None:
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join(p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH")) if p))
    if fronts is not None:
        argv += ["--fronts", str(fronts)]
    if workers is not None:
        argv += ["--sandbox-workers", str(workers)]
    if cores is not None:  # a config beside the journal: the cores it schedules
        conf = f"{journal}.cores.json"
        with open(conf, "w") as fh:
            json.dump({"cores": cores}, fh)
        argv += ["--config", conf]
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _health(base: str) -> dict:
    """A tangram server's ``/healthz`` now ({} if it does not answer it)."""
    try:
        return httpx.get(f"{base}/healthz", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _counted_between(before: dict | None, after: dict | None) -> dict | None:
    """What a server counted between two readings of one of its counts (``one_shot_sandboxes``)."""
    if not after:
        return None
    return {k: max(0, v - (before or {}).get(k, 0)) for k, v in after.items()}  # (a worker restarted: never below 0)


_PORTS = random.Random()  # its own: a test that seeds the module's generator must not pick its ports


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server started by a bench or a test), chosen below the
    kernel's ephemeral range: a port the kernel hands out (``bind`` to 0) is also what every
    outgoing connection gets, and Ray opens many, so one of them could take the port between this
    check and the server's own bind. Ray's workers listen on 10002-19999 by default, hence 20000 up."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = _PORTS.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """Stop a server a bench started: SIGTERM, then SIGKILL if it has not exited in ``wait_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_up(url: str, path: str = "/healthz", timeout_s: float = 30.0, proc: subprocess.Popen | None = None,
            log: str | None = None) -> None:
    """Return once ``url + path`` answers 200; ``RuntimeError`` after ``timeout_s``, or as soon as
    ``proc`` (the server) exits, with the end of its output (``log``) in the message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}) before it answered{_tail(log)}")
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout_s:g} s{_tail(log)}")


def _tail(log: str | None, lines: int = 30) -> str:
    """The last ``lines`` of a server's output, for an error message (nothing when it has no log)."""
    if log is None:
        return ""
    try:
        with open(log, errors="replace") as f:
            text = "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""
    return f"; its output ends:\n{text}" if text else "; it printed nothing"


def _median_round(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's figures beside it."""
    ranked = sorted(runs, key=lambda r: r["throughput_per_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["rounds"] = [{"throughput_per_s": r["throughput_per_s"], "p50_ms": r["p50_ms"],
                      "client_busiest": r.get("client_busiest"), "server_cpus_busy": r.get("server_cpus_busy"),
                      **({"engine_cpu_ms": r["cpu_ms_per_request"].get("engine")} if "cpu_ms_per_request" in r else {})}
                     for r in runs]
    return mid


def _ratios(ours: dict, peer: dict) -> dict:
    """``ours`` against ``peer`` level by level: the median rounds' ratios, and with ``--rounds``
    each round's own (``round_throughput_x``, the two measured one right after the other) and their
    median. The paired figure is the one to quote on a drifting host: both servers can lose a fifth
    of their throughput over five rounds, which the ratio of two medians taken from different rounds
    does not cancel."""
    out = {}
    for key in ours:
        a, b = ours[key], peer.get(key)
        if not b:
            continue
        out[key] = {"throughput_x": round(a["throughput_per_s"] / b["throughput_per_s"], 2)
                    if b["throughput_per_s"] else None,
                    "p50_x": round(a["p50_ms"] / b["p50_ms"], 2) if a["p50_ms"] and b["p50_ms"] else None,
                    "p99_x": round(a["p99_ms"] / b["p99_ms"], 2) if a["p99_ms"] and b["p99_ms"] else None}
        each = _round_ratios(a, b)
        if each:
            out[key]["round_throughput_x"] = [round(r, 3) for r in each]
            out[key]["median_round_throughput_x"] = round(statistics.median(each), 3)
    return out


def _round_ratios(a: dict, b: dict) -> list[float]:
    """``a``'s throughput over ``b``'s in each round, the two measured one right after the other;
    empty without two rounds or with a round where ``b`` answered nothing."""
    pairs = list(zip(a.get("rounds", ()), b.get("rounds", ())))
    if len(pairs) < 2 or not all(y["throughput_per_s"] for _, y in pairs):
        return []
    return [x["throughput_per_s"] / y["throughput_per_s"] for x, y in pairs]


def _ratio_text(first: str, name: str, ours: dict, theirs: dict) -> str:
    """``first``'s throughput against ``name``'s (``ours`` and ``theirs``: their levels), a level a
    line: the median rounds' ratio and, with rounds, each round's and their median (the figure that
    cancels a host's drift)."""
    lines = [f"{first} vs {name}, throughput:"]
    for key, a in ours.items():
        b = theirs.get(key)
        if not (isinstance(a, dict) and isinstance(b, dict) and a.get("throughput_per_s") and b.get("throughput_per_s")):
            continue  # (not a level, or nothing answered)
        line = f"  {key:>12}: {a['throughput_per_s'] / b['throughput_per_s']:.2f}x (the median rounds)"
        each = _round_ratios(a, b)
        if each:
            line += f"; each round {', '.join(f'{r:.2f}' for r in each)}: median {statistics.median(each):.2f}x"
        lines.append(line)
    return "\n".join(lines)


def _ceiling_text(first: str, name: str, c: dict) -> str:
    lines = [f"{first} vs {name}, the host's own (median round): "
             + ", ".join(f"{m} {c[m]['median_round_x']:.2f}x" for m in dict.fromkeys(CEILING_MODES.values()) if m in c)]
    for key, share in c.get("of_ceiling", {}).items():
        lines.append(f"  {key:>12}: {share['median_round']:.0%} of {share['against']}'s ratio (median round; each "
                     + ", ".join(f"{x:.0%}" for x in share["round"]) + ")")
    return "\n".join(lines)


Variant = tuple[str, str | None, int | None, int | None, str | None, int | None]


#: the host's own ceiling for each case (``--ceiling``): what a run of it costs, bare (``bench/forkcost.py``)
CEILING_MODES = {"python": "fork", "bash": "spawn", "cpu_200ms": "compute"}


def _ceiling_round(pinned: dict[str, set[int] | None], seconds: float, log: Callable[[str], None]) -> dict:
    """Each pinned server's CPU set's own rate, no server's work in it: one worker a CPU running
    ``forkcost``'s bare loops for ``seconds`` each (a forked child writing 300 of a 16 MB heap's
    pages, as a python one-shot's child does; a bash spawned and reaped; pure computation)."""
    from .forkcost import measure

    time.sleep(0.5)  # the servers' resets and refills after the last level
    out: dict[str, dict[str, float | None]] = {}
    for name, cpus in pinned.items():
        if not cpus:
            continue
        row = out[name] = {}
        for mode in dict.fromkeys(CEILING_MODES.values()):
            r = measure(sorted(cpus), mode, 16, 300 if mode == "fork" else 0, seconds)
            row[mode] = r.get("per_s")
        log(f"{name:>8} host ceiling: " + ", ".join(f"{m} {v:,.0f}/s" if v else f"{m} -" for m, v in row.items()))
    return out


#: the bare process a one-shot of each case has the host make, timed one at a time (``--floor``)
FLOOR_MODES = {"python": "fork", "bash": "spawn"}


def _case_level(key: str, cases: tuple[str, ...]) -> tuple[str, int]:
    """A result's key -> its case and concurrency: ``python@c8`` (several cases, or --against), or
    the level alone (``8``) when only ``cases[0]`` was run."""
    case, at, level = key.partition("@c")
    return (case, int(level)) if at else (cases[0], int(key))


def _floor_round(sets: dict[str, set[int] | None], seconds: float, log: Callable[[str], None]) -> dict:
    """Each server's CPU set's own time for a run's bare process, one at a time, no server's work
    in it: ``forkcost``'s timed loops for ``seconds`` each (a forked child writing 300 of a 16 MB
    heap's pages, as a python one-shot's child does; a bash spawned and reaped; and, for the speed
    of the CPUs at Python, 20,000 additions), p50 and p99 ms."""
    from .forkcost import latency

    time.sleep(0.5)  # the servers' resets and refills after the last level
    out: dict[str, dict[str, dict | None]] = {}
    for name, cpus in sets.items():
        row = out[name] = {}
        allowed = sorted(cpus or os.sched_getaffinity(0))
        for mode in dict.fromkeys([*FLOOR_MODES.values(), "compute"]):
            r = latency(allowed, mode, 16, 300 if mode == "fork" else 0, seconds)
            row[mode] = None if "error" in r else {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}
        log(f"{name:>8} host floor, one at a time: " + ", ".join(
            f"{m} p50 {v['p50_ms']:.2f} ms" if v else f"{m} -" for m, v in row.items()))
    return out


def _floor_figures(name: str, floors: list[dict], every: dict[tuple[str, str], list[dict]],
                   cases: tuple[str, ...]) -> dict:
    """Each c=1 level of ``name`` beside its case's bare process, round by round: our p50 over the
    bare one's (``x``) and the milliseconds ours adds to it (``over_ms``)."""
    out: dict = {}
    for (server, key), runs in every.items():
        case, level = _case_level(key, cases)
        mode = FLOOR_MODES.get(case)
        if server != name or mode is None or level != 1:
            continue
        if len(runs) != len(floors):  # a level or case given twice: the rounds would not pair up
            continue
        # round by round, None where either side has no figure (the rounds keep their places)
        ours = [r.get("p50_ms") or None for r in runs]
        bare = [((f.get(name) or {}).get(mode) or {}).get("p50_ms") for f in floors]
        x = [round(o / b, 3) if o and b else None for o, b in zip(ours, bare)]
        over = [round(o - b, 3) if o and b else None for o, b in zip(ours, bare)]
        if any(v is not None for v in x):
            out[key] = {"against": mode, "bare_p50_ms": bare, "p50_ms": ours, "x_round": x,
                        "median_round_x": round(statistics.median(v for v in x if v is not None), 3),
                        "over_ms_round": over,
                        "median_over_ms": round(statistics.median(v for v in over if v is not None), 3)}
    return out


def _floor_text(name: str, figures: dict) -> str:
    return "\n".join(f"{name} {key} p50 beside a bare {f['against']} (median round): {f['median_round_x']:.2f}x, "
                     f"{f['median_over_ms']:+.2f} ms (bare p50 "
                     + ", ".join(f"{b:.2f}" if b else "-" for b in f["bare_p50_ms"]) + " ms)"
                     for key, f in figures.items())


def _ceiling_ratios(first: str, name: str, rounds: list[dict], ours: dict, theirs: dict,
                    cases: tuple[str, ...]) -> dict:
    """``first`` over ``name`` on the host's bare loops, round by round, and each level's one-shot
    ratio as a share of its case's (``of_ceiling``: 1.0 is all the host's CPUs give a fresh process
    a run; the one-shots' own ratio can pass it where work that makes no process, ours, scales
    better)."""
    out: dict = {}
    for mode in dict.fromkeys(CEILING_MODES.values()):
        each = [r[first][mode] / r[name][mode] for r in rounds
                if r.get(first, {}).get(mode) and r.get(name, {}).get(mode)]
        if each:
            out[mode] = {"round_x": [round(x, 3) for x in each], "median_round_x": round(statistics.median(each), 3)}
    for key, a in ours.items():
        mode = CEILING_MODES.get(_case_level(key, cases)[0])
        b = theirs.get(key)
        if not (isinstance(a, dict) and isinstance(b, dict)) or mode not in out:
            continue
        pairs = list(zip(a.get("rounds") or [a], b.get("rounds") or [b], rounds))
        shares = [x["throughput_per_s"] / y["throughput_per_s"] / (r[first][mode] / r[name][mode])
                  for x, y, r in pairs if y["throughput_per_s"] and r.get(first, {}).get(mode)
                  and r.get(name, {}).get(mode)]
        if shares:
            out.setdefault("of_ceiling", {})[key] = {"against": mode, "round": [round(x, 3) for x in shares],
                                                     "median_round": round(statistics.median(shares), 3)}
    return out


def parse_variant(text: str) -> Variant:
    """``NAME=CPUS:FRONTS[:WORKERS[:CORES]][@SRC]`` (any part may be empty: the server's default;
    ``CORES``: how many cores it schedules, its config's ``cores``, which may be more than its CPUs;
    ``SRC``: another checkout's ``src`` directory, whose code that server runs) -> its parts."""
    text, at, src = text.partition("@")
    name, eq, spec = text.partition("=")
    parts = spec.split(":")
    if not eq or not name or len(parts) not in (2, 3, 4) or any(p and not p.isdigit() for p in parts[1:]) \
            or (at and not src) or (len(parts) == 4 and parts[3] and int(parts[3]) < 1):
        raise ValueError("expected NAME=CPUS:FRONTS[:WORKERS[:CORES]][@SRC] (e.g. two=0-1: or big=:4:4 or "
                         f"main=::@../main/src), got {text + at + src!r}")
    if src and not os.path.isdir(os.path.join(src, "arl_tangram")):
        raise ValueError(f"{src!r} has no arl_tangram package (give a checkout's src directory)")
    cpus, fronts, workers, cores = (parts + ["", ""])[:4]
    return (name, cpus or None, int(fronts) if fronts else None, int(workers) if workers else None, src or None,
            int(cores) if cores else None)


def run(levels: tuple[int, ...] = LEVELS, log: Callable[[str], None] = lambda m: None, against: str | None = None,
        cases: tuple[str, ...] = ("python",), cpu_jobs: int = 32, server_cpus: str | None = None,
        client_procs: int = 1, variants: list[Variant] | None = None,
        requests: int | None = None, client: str | None = None, cpu: bool = False, rounds: int = 1,
        ceiling: float = 0.0, floor: float = 0.0) -> dict:
    """Measure; ``against``: a SandboxFusion-compatible base URL measured beside ours;
    ``variants``: several tangram servers (name, CPUs to pin it to, HTTP fronts, sandbox workers), all running
    at once and measured in turn per case, so that they compare within the same minutes; ``cpu``: each
    tangram result also gets ``cpu_ms_per_request`` by part (engine, fronts, workers, sandboxes: ``bench/cpu.py``);
    ``rounds``: the whole plan that many times, the targets alternating within each and in the reverse
    order every other round (on a shared machine one pass is noise): each result is then the round of
    median throughput, with every round's figures beside it (``rounds``: throughput, p50, and engine
    CPU per request where measured); ``ceiling``: after each round, each pinned server's CPU set's
    own rate for a run's bare process, measured for that many seconds a loop (``_ceiling_round``),
    and each variant's ratio against the first as a share of the host's (``host_ceiling``): the
    host's own 16-vs-2 ratio for a bare process moves from round to round (a bare fork's 5.7-6.7x
    on one host), so a one-shot ratio means little without the host's beside it; ``floor``: after
    each round, each server's CPUs' own time for a run's bare process one at a time (a bash
    spawned and reaped, a python child forked and reaped: ``_floor_round``), and each c=1 level's
    p50 beside it (``host_floor``): where the kernel takes 1.6-4.9 ms to make a process (a nested
    virtual machine), a c=1 target set on another machine says nothing.

    When every tangram server is pinned and CPUs are left over, the load generator runs on those
    (``client_cpus``), as a load generator should: unpinned, its processes and their loopback traffic
    took time on the CPUs of the server under test, which a server pinned to a few CPUs of a large
    host hardly saw and one pinned to most of them did (a 16-vs-2-core ratio measured low)."""
    variants = variants or [("tangram", server_cpus, None, None, None, None)]
    client = client or default_client()
    mine = os.sched_getaffinity(0)
    client_cpus = _spare_cpus([v[1] for v in variants], mine)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)  # the client processes are forked from this one
    try:
        out = _run(levels, log, against, cases, cpu_jobs, server_cpus, client_procs, variants, requests, client, cpu,
                   rounds, ceiling, floor)
    finally:
        if client_cpus:
            os.sched_setaffinity(0, mine)
    return {"cores": len(mine), "client_cpus": _cpu_text(client_cpus) if client_cpus else None, **out}


def _cpu_set(spec: str) -> set[int]:
    """``taskset -c`` syntax (``0-3,8``) -> the CPUs."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _cpu_text(cpus: set[int]) -> str:
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _spare_cpus(pinned: list[str | None], mine: set[int]) -> set[int]:
    """The CPUs of ``mine`` that no server is pinned to, if every server is pinned (else none)."""
    if not pinned or any(not p for p in pinned):
        return set()
    try:
        taken = set().union(*(_cpu_set(p) for p in pinned if p))
    except ValueError:  # a list taskset takes that this does not read (a stride, ``0-6:2``): not pinned
        return set()
    return mine - taken


def _run(levels: tuple[int, ...], log: Callable[[str], None], against: str | None, cases: tuple[str, ...],
         cpu_jobs: int, server_cpus: str | None, client_procs: int, variants: list[Variant],
         requests: int | None, client: str, cpu: bool, rounds: int, ceiling: float, floor: float) -> dict:
    ports = {v[0]: free_port() for v in variants}
    targets = {v[0]: f"http://127.0.0.1:{ports[v[0]]}" for v in variants}
    if against:
        targets["against"] = against.rstrip("/")
    results: dict[str, dict] = {name: {} for name in targets}
    pinned = {v[0]: _cpu_set(v[1]) if v[1] else None for v in variants}
    followed: dict[str, int | None] = {}
    ceilings: list[dict] = []  # a round's host ceiling per pinned server
    floors: list[dict] = []  # a round's host floor per server, one bare process at a time
    scheduled: dict[str, int | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = {v[0]: os.path.join(tmp, f"server-{v[0]}.log") for v in variants}
        procs = [_serve(ports[name], os.path.join(tmp, f"journal-{name}.sqlite3"), cpus, fronts, workers, src,
                        logs[name], cores)
                 for name, cpus, fronts, workers, src, cores in variants]
        try:
            for v, proc in zip(variants, procs):
                wait_up(targets[v[0]], "/healthz", timeout_s=60, proc=proc, log=logs[v[0]])
            if against:
                wait_up(targets["against"], "/v1/ping")
            time.sleep(0.5)  # the warm pool fills
            plan = [(case, c, requests) for case in cases if case != "cpu_200ms" for c in levels]
            if "cpu_200ms" in cases:
                plan.append(("cpu_200ms", cpu_jobs, cpu_jobs))
            meters = {v[0]: CpuMeter(p.pid) for v, p in zip(variants, procs)} if cpu else {}
            every: dict[tuple[str, str], list[dict]] = {}
            for i, (case, c, n) in enumerate(plan * rounds):
                key = f"{case}@c{c}" if against or len(cases) > 1 else str(c)
                # every other round in the reverse order: a server measured right after another
                # shares its cores with what that one still does (resets, refills), so a fixed order
                # can favour the first
                order = list(targets.items())
                for name, base in (order[::-1] if (i // len(plan)) % 2 else order):
                    meter = meters.get(name)
                    before = meter.read() if meter else None
                    health = _health(base) if name != "against" else {}
                    r = results[name][key] = asyncio.run(_http_level(base, c, case, n, client_procs, client,
                                                                       pinned.get(name) if cpu else False))
                    every.setdefault((name, key), []).append(r)
                    if meter is not None and before is not None:
                        r["cpu_ms_per_request"] = CpuMeter.per_request(before, meter.read(settle_s=1.0),
                                                                       r["n"] + r["errors"] + r.get("warmup", 0))
                    if health:  # each core's wait between two one-shots, and the sandboxes started, this level's
                        later = _health(base)
                        if health.get("core_waits") is not None:
                            r["core_wait_ms"] = corewaits.between(health["core_waits"], later.get("core_waits"))
                        if health.get("one_shot_sandboxes") is not None:
                            r["sandboxes"] = _counted_between(health["one_shot_sandboxes"],
                                                              later.get("one_shot_sandboxes"))
                    log(f"{name:>8} {case:>10} c={c:<4}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                        f"{r['throughput_per_s']} req/s, {r['errors']} errors; client {r['client_cpu_ms']} ms "
                        f"CPU/req, busiest process {r['client_busiest']:.0%}"
                        + (f"; server CPUs {r['server_cpus_busy']:.0%} busy" if r.get("server_cpus_busy") else "")
                        + _queue_text(r.get("run_queue"))
                        + (f"; sandboxes started {r['sandboxes']['started_for_pool']} for the pool, "
                           f"{r['sandboxes']['started_for_run']} by runs, {r['sandboxes']['discarded']} discarded, "
                           f"{r['sandboxes'].get('over_cap', 0)} over the idle cap"
                           if r.get("sandboxes") else ""))
                    if r.get("cpu_ms_per_request"):
                        log(_cpu_line(r["cpu_ms_per_request"]))
                    time.sleep(0.3)
                if ceiling and (i + 1) % len(plan) == 0:
                    ceilings.append(_ceiling_round(pinned, ceiling, log))
                if floor and (i + 1) % len(plan) == 0:
                    floors.append(_floor_round(pinned, floor, log))
            if rounds > 1:
                for (name, key), runs in every.items():
                    results[name][key] = _median_round(runs)
            for v in variants:  # one-shots started behind another as it ended (the lease), over the run,
                health = httpx.get(f"{targets[v[0]]}/healthz", timeout=10).json()  # and the cores it scheduled
                followed[v[0]] = health.get("followed")
                scheduled[v[0]] = health.get("cores")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(60)
    out: dict = {"server_cpus": server_cpus, "client_procs": client_procs, "client": client}
    if floors:
        out["host_floor"] = {"seconds": floor, "modes": FLOOR_MODES,
                             "bare": {name: [r.get(name) for r in floors] for name in floors[0]}}
        out["host_floor"]["c1"] = {}
        for v in variants:
            if figures := _floor_figures(v[0], floors, every, cases):
                out["host_floor"]["c1"][v[0]] = figures
                log(_floor_text(v[0], figures))
        if not out["host_floor"]["c1"]:
            log("--floor: no c=1 level of python or bash to give beside it (the bare figures are in host_floor)")
    if len(variants) > 1 or variants[0][0] != "tangram":  # named variants (one named server too)
        first = variants[0][0]
        out["servers"] = {name: {"cpus": cpus, "fronts": fronts, "sandbox_workers": workers, "src": src,
                                 "cores": cores, "scheduled_cores": scheduled.get(name),
                                 "followed": followed.get(name), **results[name]}
                          for name, cpus, fronts, workers, src, cores in variants}
        out[f"vs_{first}"] = {v[0]: _ratios(results[v[0]], results[first]) for v in variants[1:]}
        for v in variants[1:]:
            log(_ratio_text(first, v[0], results[first], results[v[0]]))
        if ceilings:
            out["host_ceiling"] = {"seconds": ceiling, "modes": CEILING_MODES,
                                   "per_s": {name: [r.get(name) for r in ceilings] for name in ceilings[0]}}
            for v in variants[1:]:
                if v[0] in ceilings[0] and first in ceilings[0]:
                    out["host_ceiling"][f"{first}_vs_{v[0]}"] = c = _ceiling_ratios(
                        first, v[0], ceilings, results[first], results[v[0]], cases)
                    log(_ceiling_text(first, v[0], c))
        if against:
            out["against"] = {"url": against, **results["against"]}
            out["vs_against"] = {v[0]: _ratios(results[v[0]], results["against"]) for v in variants}
            for v in variants:
                log(_ratio_text(v[0], "against", results[v[0]], results["against"]))
        return out
    out["followed"] = followed.get("tangram")
    if against:
        out.update({"tangram": results["tangram"], "against": {"url": against, **results["against"]},
                    "tangram_vs_against": _ratios(results["tangram"], results["against"])})
        log(_ratio_text("tangram", "against", results["tangram"], results["against"]))
        return out
    http = results["tangram"]
    out["http"] = http
    if cases == ("python",):
        inproc = asyncio.run(_inproc(levels))
        for c in levels:
            log(f"in-process concurrency {c:>4}: p50 {inproc[str(c)]['p50_ms']} ms, "
                f"{inproc[str(c)]['throughput_per_s']} actions/s")
        out["in_process"] = inproc
        out["overhead_p50_ms"] = {c: round(http[c]["p50_ms"] - inproc[c]["p50_ms"], 2) for c in http}
    return out
