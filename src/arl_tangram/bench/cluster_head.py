"""The head as deployed, ``tangram serve --ray``, over a loopback Ray cluster, measured over HTTP
(``tangram bench cluster``'s ``head`` rows, its ``local`` row and its ``sessions`` run).

* ``head_row``: trivial one-shots (``/run_code``) at ``per_core`` concurrent requests per node core:
  actions/s, latency percentiles, and the CPU per action of every part (``cpu.ClusterCpuMeter``:
  the head by thread, its fronts, each node's agent, Ray's processes, the sandboxes, the load
  generator, the host's busy CPU), with Ray's and the agents' idle CPU per second beside it and
  their figures net of it (``net_of_idle_ms_per_action``: at a few dozen actions/s, what Ray's
  processes spend anyway is most of their figure per action; at thousands, little of it).
* ``local_row``: the same load on ``tangram serve`` without Ray, pinned (``taskset``) to the cores
  the cluster's nodes gave their sandboxes: what one machine of those cores does.
* ``sessions_run``: ``sessions`` sessions opened over the cluster, each left with a state by a
  first step, then every one revisited (a step that checks its state) at ``per_core`` concurrent
  steps per node core, and a sample revisited one at a time: revisit latency under load and alone,
  how many sessions each node held, and the first failures in a line each (a session the policy
  moved to another node under a queue starts its processes afresh: its Python state is gone).

Where the machine has cores the nodes' sandboxes do not use, the head and the load generator run
on those (Ray's processes and the agents, started before, run anywhere): a head on a host of its
own, as in a real cluster. The local server, pinned to the sandbox cores, has nothing beside them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import httpx

from ..sim.metrics import percentile
from .cpu import ClusterCpuMeter
from .server import _poster, _tail, default_client, free_port, wait_up

#: seconds of quiet over which Ray's processes and the agents are read idle
IDLE_S = 3.0


class Head:
    """``tangram serve`` (``--ray ADDRESS`` when given) in a subprocess, on ``cpus`` (a taskset
    list) if given, with ``config`` (a ServeConfig as JSON)."""

    def __init__(self, tmp: str, config: dict, ray: str | None = None, cpus: str | None = None,
                 tries: int = 3) -> None:
        path = os.path.join(tmp, f"config-{os.getpid()}-{time.monotonic_ns()}.json")
        with open(path, "w") as fh:
            json.dump(config, fh)
        for attempt in range(tries):  # Ray's processes bind ports too: one taken first is tried again
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = os.path.join(tmp, f"server-{self.port}.log")
            argv = [sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(self.port), "--journal",
                    os.path.join(tmp, f"journal-{self.port}.sqlite3"), "--config", path]
            if ray is not None:
                argv += ["--ray", ray]
            if cpus:
                argv = ["taskset", "-c", cpus, *argv]
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            try:
                wait_up(self.url, timeout_s=300, proc=self.proc, log=self.log)
                return
            except RuntimeError as e:
                self.stop()
                if attempt + 1 == tries or "address already in use" not in str(e):
                    raise

    @property
    def pid(self) -> int:
        """The engine process (``taskset`` execs the server in its own process)."""
        return self.proc.pid

    def wait_cores(self, cores: int, timeout_s: float = 300.0) -> dict:
        """Return ``/healthz`` once the head schedules ``cores`` cores (every node joined)."""
        deadline = time.monotonic() + timeout_s
        health: dict = {}
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.url}/healthz", timeout=30).json()
            if health.get("cores", 0) >= cores:
                return health
            time.sleep(0.2)
        raise RuntimeError(f"the head schedules {health.get('cores')} cores, not {cores}, after {timeout_s:g} s"
                           f"{_tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM, then its end (it stops its agents on its way out)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process (the load generator) on ``cpus`` for a while (None: as it is)."""
    if not cpus:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _program(i: int, work_ms: float) -> str:
    if work_ms <= 0:
        return f"print({i})"
    return (f"import time\nt = time.process_time() + {work_ms / 1000}\nwhile time.process_time() < t:\n"
            f"    pass\nprint({i})")


async def _oneshots(url: str, n: int, concurrency: int, work_ms: float, client: str,
                    offset: int = 0) -> tuple[list[float], int, float]:
    """``n`` one-shots over ``/run_code`` at ``concurrency``: latencies, errors, the span."""
    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    errors = 0
    async with _poster(client, concurrency) as post:
        async def one(i: int) -> None:
            nonlocal errors
            async with gate:
                t = time.perf_counter()
                status, body = await post(f"{url}/run_code", {"code": _program(i, work_ms), "language": "python",
                                                              "run_timeout": 60})
                if status == 200 and body is not None and body.get("status") == "Success":
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(offset + i) for i in range(n)))
        return lat, errors, time.perf_counter() - t0


def _ms(xs: list[float], q: float) -> float | None:
    return round(percentile(sorted(xs), q) * 1000, 2) if xs else None


def _idle_per_s(meter: ClusterCpuMeter) -> dict:
    """CPU seconds per second of Ray's processes and of the agents while nothing runs."""
    a = meter.read()
    time.sleep(IDLE_S)
    b = meter.read()
    ray = {k: round((b["ray"][k] - a["ray"][k]) / IDLE_S, 4) for k in b["ray"]}
    agents = sum(b["agents"][p]["total"] - v["total"] for p, v in a["agents"].items() if p in b["agents"])
    return {"ray": ray, "ray_total": round(sum(ray.values()), 4), "agents_total": round(agents / IDLE_S, 4),
            "head": round(sum(b["head"][k] - a["head"][k] for k in b["head"]) / IDLE_S, 4)}


def measure(head: Head, actions: int, concurrency: int, work_ms: float, ray_root: int | None,
            client: str | None = None, profiled: int = 0) -> dict:
    """Warm the head's pools, then ``actions`` one-shots at ``concurrency``, every part's CPU read
    around them (``ClusterCpuMeter``); with ``ray_root``, the idle CPU of Ray and the agents first.
    ``profiled``: that many more with the head's main thread sampled by ``py-spy`` (where it can
    read the head): its CPU per one-shot split by owner (``cluster_hops.GROUPS``: the service,
    the journal, the engine, the runtime and its link, asyncio), the functions most often running."""
    client = client or default_client()
    meter = ClusterCpuMeter(head.pid, ray_root, os.getpid())
    asyncio.run(_oneshots(head.url, max(2 * concurrency, 20), concurrency, 0.0, client, offset=10 ** 6))
    idle = _idle_per_s(meter) if ray_root is not None else None
    before = meter.read()
    lat, errors, span = asyncio.run(_oneshots(head.url, actions, concurrency, work_ms, client))
    after = meter.read()
    row = {"actions": actions, "concurrency": concurrency, "work_ms": work_ms, "errors": errors,
           "actions_per_s": round(len(lat) / span, 1), "p50_ms": _ms(lat, 50), "p99_ms": _ms(lat, 99),
           "client": client, "cpu_ms_per_action": ClusterCpuMeter.per_action(before, after, len(lat))}
    if idle is not None:  # what Ray and the agents spend anyway, over the span: the rest is the actions'
        row["idle_cpu_per_s"] = idle
        cpu = row["cpu_ms_per_action"]
        at_rest = span * 1000 / max(1, len(lat))
        row["net_of_idle_ms_per_action"] = {
            "ray": round(cpu["ray"]["total"] - idle["ray_total"] * at_rest, 3),
            **{k: round(cpu["ray"][k] - v * at_rest, 3) for k, v in idle["ray"].items()},
            "agents": round(cpu["agents"]["total"] - idle["agents_total"] * at_rest, 3)}
    if profiled:
        row["profiled"] = _profiled(head, meter, profiled, concurrency, work_ms, client)
    return row


def _profiled(head: Head, meter: ClusterCpuMeter, n: int, concurrency: int, work_ms: float, client: str) -> dict:
    """``n`` one-shots with the head's main thread sampled from outside (``SpySampler``)."""
    from .cluster_hops import SpySampler

    if not SpySampler.available():
        return {"skipped": "py-spy is not installed or may not read the head (ptrace)"}
    sampler = SpySampler(pid=head.pid)
    try:
        with sampler:
            before = meter.read()
            lat, _, _ = asyncio.run(_oneshots(head.url, n, concurrency, work_ms, client, offset=2 * 10 ** 6))
            after = meter.read()
    except RuntimeError as e:  # py-spy could not read the head
        return {"skipped": str(e)[:300]}
    main = ClusterCpuMeter.per_action(before, after, max(1, len(lat)))["head"]["main"]
    return {"n": n, "sampler": "py-spy", **sampler.shares(main, top=20)}


def cpu_text(cpu: dict) -> str:
    """A row's ``cpu_ms_per_action`` in a line."""
    h = cpu["head"]
    ray = cpu["ray"]
    parts = [f"head {h['total']} (main {h['main']} [{h['sys']['main']} kernel], ray threads {h['ray_threads']} "
             f"[{h['sys']['ray_threads']} kernel], other {h['other_threads']}, "
             f"fronts {h['fronts']}, workers {h['workers']})"]
    if cpu["agents"]["each"]:
        t = cpu["agents"]["threads"]
        parts.append(f"agents {cpu['agents']['total']} ({len(cpu['agents']['each'])} of them; main {t['main']}, ray "
                     f"threads {t['ray_threads']}, python threads {t['other_threads']})")
    if ray["total"]:
        parts.append(f"ray {ray['total']} (raylet {ray['raylet']}, gcs {ray['gcs']}, workers {ray['ray_workers']}, "
                     f"services {ray['ray_services']})")
    parts.append(f"sandboxes {cpu['sandboxes']}; client {cpu['client']}, host busy {cpu['machine']}, "
                 f"unattributed {cpu['unattributed']}")
    return "CPU ms/action: " + ", ".join(parts)


# -- sessions -------------------------------------------------------------------------------------
FIRST = "state = {{'i': {i}, 'visits': 0}}"
CHECK = "state['visits'] += 1\nprint(state['i'])"


async def _sessions(url: str, n: int, concurrency: int, sample: int, log: Callable[[str], None],
                    cores: int | None = None, meter: ClusterCpuMeter | None = None) -> dict:
    """Open ``n`` sessions (each with a state), revisit each once at ``concurrency``, again at one
    per core (``cores``: each core busy, no step queued behind another), then ``sample`` of them one
    at a time; every revisit checks its session's state. ``meter``: every part's CPU per revisit
    of the first two rounds too (``cpu_ms_per_revisit``)."""
    cpu: dict[str, dict] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # the opens and steps (what is timed) through the one-shots' client, aiohttp where installed:
    # httpx costs ~3 ms of CPU a step on a 16-core host, so one process of it capped the revisits
    # at ~320/s and its queue was most of their latency; httpx still reads the cluster and closes
    kind = default_client()
    async with httpx.AsyncClient(timeout=300, limits=limits) as c, _poster(kind, concurrency) as post:
        gate = asyncio.Semaphore(concurrency)

        async def opened(i: int) -> tuple[str | None, float]:
            async with gate:
                t = time.perf_counter()
                status, body = await post(f"{url}/v1/sessions", {"job": "bench"})
                if status not in (200, 201) or not body:
                    return None, 0.0
                sid = body["session_id"]
                status, step = await post(f"{url}/v1/sessions/{sid}/exec", {"python": FIRST.format(i=i)})
                ok = status == 200 and (step or {}).get("outcome") == "ok"
                return (sid if ok else None), time.perf_counter() - t

        t0 = time.perf_counter()
        made = await asyncio.gather(*(opened(i) for i in range(n)))
        open_s = time.perf_counter() - t0
        sids = [(i, sid) for i, (sid, _) in enumerate(made) if sid is not None]
        log(f"sessions: {len(sids)}/{n} opened with a first step in {open_s:.1f} s")

        failures: list[str] = []

        parts: dict[str, list[tuple[float, dict]]] = {}  # round -> (latency, the result's own times)

        async def revisit(i: int, sid: str, gate: asyncio.Semaphore, round_: str = "alone") -> tuple[float, bool]:
            async with gate:
                t = time.perf_counter()
                status, answer = await post(f"{url}/v1/sessions/{sid}/exec", {"python": CHECK})
                took = time.perf_counter() - t
                body = answer or {}
                run = body.get("run") or {}
                good = status == 200 and body.get("outcome") == "ok" and run.get("stdout") == f"{i}\n"
                if not good and len(failures) < 5:  # what went wrong, in a line
                    said = (run.get("stderr") or "").strip().splitlines()[-1:] or [body.get("message") or
                                                                                   "(no answer read)"]
                    failures.append(f"{status} {body.get('outcome')}: {said[0]}")
                parts.setdefault(round_, []).append((took, body))
                return took, good

        seen = (await c.get(f"{url}/v1/cluster")).json()
        nodes = seen.get("nodes", [])
        spread = sorted((n.get("sessions", 0) for n in nodes), reverse=True)
        order = sids[:]
        random.Random(0).shuffle(order)
        t0 = time.perf_counter()
        before = meter.read() if meter else None
        loaded = await asyncio.gather(*(revisit(i, sid, gate, "loaded") for i, sid in order))
        span = time.perf_counter() - t0
        if meter:
            cpu["loaded"] = ClusterCpuMeter.per_action(before, meter.read(), len(loaded))
        loaded_parts = breakdown(parts.get("loaded", []))
        per_core: list[tuple[float, bool]] = []
        per_core_parts: dict = {}
        if cores:
            one_each = asyncio.Semaphore(cores)
            before = meter.read() if meter else None
            t1 = time.perf_counter()
            per_core = await asyncio.gather(*(revisit(i, sid, one_each, "per_core") for i, sid in order))
            per_core_span = time.perf_counter() - t1
            per_core_parts = breakdown(parts.get("per_core", []))
            if meter:
                cpu["per_core"] = ClusterCpuMeter.per_action(before, meter.read(), len(per_core))
        alone = [await revisit(i, sid, asyncio.Semaphore(1)) for i, sid in order[:sample]]
        seen_after = (await c.get(f"{url}/v1/cluster")).json()
        after = seen_after.get("nodes", [])
        homes_after = {n.get("id"): n.get("sessions", 0) for n in after}
        # sessions whose home changed show as a node's count changing (moves each way may cancel out)
        shifted = sum(abs(homes_after.get(n.get("id"), 0) - n.get("sessions", 0)) for n in nodes) // 2
        for _, sid in sids:  # closed, so that the node's memory is free for the next run
            async with gate:
                await c.delete(f"{url}/v1/sessions/{sid}")
    ok = [t for t, good in loaded if good]
    return {"sessions": n, "opened": len(sids), "open_s": round(open_s, 2), "sessions_per_node": spread,
            "sessions_per_node_after": sorted(homes_after.values(), reverse=True), "homes_shifted_at_least": shifted,
            # the head's own count of moves over the revisits' rounds, how long the last carries
            # took, and what the policy prices a move for balance at after them
            "moves_during_revisits": (seen_after["moves"] - seen["moves"]) if seen.get("moves") is not None
            and seen_after.get("moves") is not None else None,
            "move_p50_s": seen_after.get("move_p50_s"), "move_max_s": seen_after.get("move_max_s"),
            "move_price_s": seen_after.get("move_price_s"),
            "open_step_p50_ms": _ms([t for sid, t in made if sid], 50),
            "client": kind, "revisit_concurrency": concurrency, "revisits": len(loaded), "revisits_ok": len(ok),
            "revisit_p50_ms": _ms([t for t, _ in loaded], 50), "revisit_p99_ms": _ms([t for t, _ in loaded], 99),
            "revisits_per_s": round(len(loaded) / span, 1) if span else None,
            "parts": loaded_parts,
            **({"cpu_ms_per_revisit": cpu} if cpu else {}),
            **({"per_core": {"concurrency": cores, "parts": per_core_parts, "revisits": len(per_core),
                             "revisits_ok": sum(good for _, good in per_core),
                             "revisits_per_s": round(len(per_core) / per_core_span, 1) if per_core_span else None,
                             "p50_ms": _ms([t for t, _ in per_core], 50), "p99_ms": _ms([t for t, _ in per_core], 99)}}
               if cores else {}),
            "alone": len(alone), "alone_ok": sum(good for _, good in alone),
            "alone_p50_ms": _ms([t for t, _ in alone], 50), "alone_p99_ms": _ms([t for t, _ in alone], 99),
            "failures": failures}


def breakdown(revisits: list[tuple[float, dict]]) -> dict:
    """Where a round's revisits spent their time, by the result's own parts (``queue_s``: waiting
    for a core, ``setup_s``: the session's wake or move, ``exec_s``: the step), for all of them
    (p50) and for the slowest 1% (their p50): which part a tail is made of. ``woken``: steps that
    found their session at rest; ``rest_ms``: latency the head's parts do not account for (the
    HTTP hop, the front, the link)."""
    def row(xs: list[tuple[float, dict]]) -> dict:
        def p50(key: str) -> float | None:
            vals = [b[key] for _, b in xs if isinstance(b.get(key), (int, float))]
            return _ms(vals, 50)
        rest = [t - sum(b.get(k) or 0.0 for k in ("queue_s", "setup_s", "exec_s")) for t, b in xs]
        return {"n": len(xs), "latency_ms": _ms([t for t, _ in xs], 50), "queue_ms": p50("queue_s"),
                "setup_ms": p50("setup_s"), "exec_ms": p50("exec_s"), "rest_ms": _ms(rest, 50),
                "woken": sum(bool(b.get("woken")) for _, b in xs)}
    if not revisits:
        return {}
    slow = sorted(revisits, key=lambda r: r[0])[-max(1, len(revisits) // 100):]
    return {"all": row(revisits), "slowest_1pct": row(slow)}


def sessions_run(head: Head, sessions: int, concurrency: int, sample: int, log: Callable[[str], None],
                 cores: int | None = None, ray_root: int | None = None) -> dict:
    meter = ClusterCpuMeter(head.pid, ray_root, os.getpid()) if ray_root is not None else None
    return asyncio.run(_sessions(head.url, sessions, concurrency, sample, log, cores, meter))
