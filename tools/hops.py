"""Where a c=1 ``/run_code`` goes, hop by hop: ``python tools/hops.py`` (in a checkout, with the
package installed).

The server of ``tangram serve`` (one process, its default on 2 cores) runs in this process on
uvloop, with the functions each hop passes through wrapped to take a timestamp; a child process
sends the requests one at a time (aiohttp, 2 ms apart) and stamps each send and answer. Both
clocks are ``CLOCK_MONOTONIC``, so a request's stamps line up across the two processes. Printed
as JSON: per gap between consecutive hops, p50 / p90 / p99 in ms; and the journal's commits and
the garbage collector's pauses, the two sources of a long tail found here.

The hops: ``client`` (the request sent) -> ``http_in`` (the ASGI app called: uvicorn parsed it)
-> ``sf_in`` (the dialect's translation: FastAPI validated it) -> ``svc_in``
(``Service.run_oneshot``) -> ``submit`` (``Runtime.submit_cb``) -> ``mgr_run`` (the sandbox
manager's task runs) -> ``sb_req`` / ``sb_ans`` (the runner's request and answer) -> ``mgr_done``
-> ``report`` -> ``finished`` (the engine's record, the caller's callback) -> ``svc_out`` (the
answer journaled and durable) -> ``resp_start`` (FastAPI serialised it) -> ``client_end`` (the
client has read it).
A measurement tool, not a server: the wrapping costs a few µs a hop. It wraps private functions of
the server, the runtime and the sandbox manager, so it lives beside the sources as a script, not in
the installed package as a ``tangram bench`` command: it follows the code it measures, whose
private names may change from one commit to the next.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from arl_tangram.sim.metrics import percentile

ORDER = ("client", "http_in", "sf_in", "svc_in", "submit", "mgr_run", "sb_req", "sb_ans", "mgr_done", "report",
         "finished", "svc_out", "resp_start", "client_end")

CLIENT = r'''
import asyncio, json, sys, time
import aiohttp
async def main():
    n, warm, code, lang, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n + warm):
            t0 = time.perf_counter_ns()
            async with s.post(f"http://127.0.0.1:{port}/run_code", json={"code": code, "language": lang}) as r:
                body = await r.json()
            t1 = time.perf_counter_ns()
            if body.get("status") != "Success":
                raise SystemExit(f"request failed: {body}")
            if i >= warm:
                out.append((t0, t1))
            await asyncio.sleep(0.002)
    print(json.dumps(out))
asyncio.run(main())
'''


class _Stamps:
    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = []
        self.commits_ms: list[float] = []
        self.gc: list[list[int]] = []

    def mark(self, label: str) -> None:
        self.marks.append((label, time.perf_counter_ns()))

    def wrap(self, owner: Any, name: str, label: str, after: str | None = None) -> None:
        fn = getattr(owner, name)
        mark = self.mark
        if asyncio.iscoroutinefunction(fn):
            async def wrapped(*a, **k):
                mark(label)
                try:
                    return await fn(*a, **k)
                finally:
                    if after:
                        mark(after)
        else:
            def wrapped(*a, **k):
                mark(label)
                return fn(*a, **k)
        setattr(owner, name, wrapped)

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc.append([time.perf_counter_ns(), info["generation"]])
        elif self.gc:
            self.gc[-1].append(time.perf_counter_ns())


def _action_run() -> tuple[Any, str]:
    """The sandbox manager's method that runs one action, from its report's start to its end:
    ``Runs.run`` in the manager's parts, ``SandboxManager._run`` in a checkout from before them
    (the script measures other checkouts too)."""
    import importlib

    for module, cls, name in (("arl_tangram.managers.sandbox.runs", "Runs", "run"),
                              ("arl_tangram.managers.sandbox.manager", "SandboxManager", "_run")):
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        if hasattr(owner, name):
            return owner, name
    raise RuntimeError("hops: the sandbox manager's run of one action is not where this script looks for it")


def _instrument(s: _Stamps) -> None:
    from arl_tangram.link import answers_later
    from arl_tangram.managers.sandbox import sandbox
    from arl_tangram.runtime import base
    from arl_tangram.server import journal, sandboxfusion, service

    run_oneshot = service.Service.run_oneshot

    def timed_run_oneshot(self, action, request, reply):
        s.mark("svc_in")

        def timed_reply(ok, value):
            s.mark("svc_out")
            reply(ok, value)
        return run_oneshot(self, action, request, reply=timed_reply)

    service.Service.run_oneshot = answers_later(timed_run_oneshot)
    from arl_tangram.server import calls  # its list of calls holds the method as it was when first imported
    calls.CALLS["run_oneshot"] = service.Service.run_oneshot
    s.wrap(base.Runtime, "submit_cb", "submit")
    s.wrap(*_action_run(), "mgr_run", "mgr_done")
    s.wrap(base.Runtime, "report", "report")
    s.wrap(base.Runtime, "_finished", "finished")
    request = sandbox.Sandbox.request

    async def timed_request(self, req, *a, **k):  # the run's own request, not the recycling's
        run = req.get("op") in ("run", "python")
        if run:
            s.mark("sb_req")
        try:
            return await request(self, req, *a, **k)
        finally:
            if run:
                s.mark("sb_ans")

    sandbox.Sandbox.request = timed_request
    commit = journal.Journal._commit

    def timed_commit(self):
        t = time.perf_counter_ns()
        commit(self)
        s.commits_ms.append((time.perf_counter_ns() - t) / 1e6)

    journal.Journal._commit = timed_commit
    translate = sandboxfusion.run_code_action

    def sf_in(req):
        s.mark("sf_in")
        return translate(req)

    sandboxfusion.run_code_action = sf_in
    gc.callbacks.append(s.on_gc)


def _q(values: list[float], q: float) -> float:
    """The ``q``th percentile (0..100) as the other benches take it (``sim.metrics.percentile``)."""
    return round(percentile(sorted(values), q), 3)


def run(requests: int = 500, code: str = "print(1)", language: str = "python", port: int = 18777,
        log: Callable[[str], None] = lambda m: None, server_cpus: set[int] | None = None) -> dict:
    """With ``server_cpus``, the server (this process, its sandboxes with it) runs on those CPUs
    and the client on the others, as ``bench server`` pins them on a large host."""
    import uvicorn
    import uvloop

    from arl_tangram.server.config import ServeConfig, build

    client_cpus = None
    if server_cpus:
        client_cpus = (os.sched_getaffinity(0) - server_cpus) or None
        os.sched_setaffinity(0, server_cpus)  # before the manager reads them: its sandboxes go there too

    s = _Stamps()
    _instrument(s)
    tmp = tempfile.mkdtemp(prefix="tangram-hops-")
    app = build(ServeConfig(), journal=Path(tmp) / "journal.sqlite3")

    async def traced(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/run_code":
            return await app(scope, receive, send)
        s.mark("http_in")

        async def stamped(message):
            if message["type"] == "http.response.start":
                s.mark("resp_start")
            await send(message)

        return await app(scope, receive, stamped)

    async def main() -> list[tuple[int, int]]:
        server = uvicorn.Server(uvicorn.Config(traced, host="127.0.0.1", port=port, log_level="warning",
                                               loop="none", lifespan="on"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the warm pool fills
        s.marks.clear()
        pin = (lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(requests), "50", code, language,
                                                    str(port), stdout=subprocess.PIPE, preexec_fn=pin)
        out, _ = await proc.communicate()
        server.should_exit = True
        await task
        if proc.returncode != 0:
            raise RuntimeError("the hops client failed")
        return json.loads(out)

    windows = uvloop.run(main())
    marks = sorted(s.marks, key=lambda m: m[1])
    gaps: dict[str, list[float]] = {}
    totals: list[float] = []
    gc_in: list[float] = []
    k = 0
    for t0, t1 in windows:
        while k < len(marks) and marks[k][1] < t0:
            k += 1
        first: dict[str, int] = {"client": t0}
        j = k
        while j < len(marks) and marks[j][1] <= t1:
            first.setdefault(marks[j][0], marks[j][1])
            j += 1
        first["client_end"] = t1
        seen = [h for h in ORDER if h in first]
        for a, b in zip(seen, seen[1:]):
            gaps.setdefault(f"{a}->{b}", []).append((first[b] - first[a]) / 1e6)
        totals.append((t1 - t0) / 1e6)
        gc_in.append(sum((g[2] - g[0]) / 1e6 for g in s.gc if len(g) > 2 and t0 <= g[0] <= t1))
    pauses = [(g[2] - g[0]) / 1e6 for g in s.gc if len(g) > 2]
    return {
        "requests": len(windows), "code": code, "language": language,
        "hops_ms": {name: {"p50": _q(v, 50), "p90": _q(v, 90), "p99": _q(v, 99), "mean": round(statistics.mean(v), 3)}
                    for name, v in gaps.items()},
        "total_ms": {"p50": _q(totals, 50), "p90": _q(totals, 90), "p99": _q(totals, 99)},
        "journal_commits": {"n": len(s.commits_ms), "p50_ms": _q(s.commits_ms, 50),
                            "max_ms": round(max(s.commits_ms, default=0.0), 3),
                            "over_1ms": sum(1 for c in s.commits_ms if c > 1)},
        "gc": {"collections": len(s.gc), "gen2": sum(1 for g in s.gc if g[1] == 2),
               "max_pause_ms": round(max(pauses, default=0.0), 3),
               "requests_with_a_pause": sum(1 for g in gc_in if g > 0)},
        "load": os.getloadavg()[0],
        "server_cpus": sorted(os.sched_getaffinity(0)), "client_cpus": sorted(client_cpus) if client_cpus else None,
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--code", default="print(1)")
    ap.add_argument("--language", default="python")
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--server-cpus", help="pin the server to these CPUs (0-1) and the client to the rest")
    args = ap.parse_args()
    cpus = None
    if args.server_cpus:  # ``taskset -c`` syntax
        cpus = set()
        for part in args.server_cpus.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    print(json.dumps(run(args.requests, args.code, args.language, args.port, server_cpus=cpus), indent=2))
