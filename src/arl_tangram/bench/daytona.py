"""``tangram bench daytona``: Daytona's own SDK against ``tangram serve`` on this machine, beside
its floor and beside the native API doing the same work.

A server is started on a free loopback port and the official ``daytona`` SDK is pointed at it the
way a user would (``DAYTONA_API_URL`` = the server's URL + ``/api``, ``DAYTONA_API_KEY``). The
host's 1-minute load average before and after is printed beside the figures (on a shared machine
they move with it).

``side_by_side``: create + the first ``process.exec("true")``, ``process.exec("true")``,
``process.code_run`` of a line of python, ``process.exec("/bin/true")`` (a program, not a shell
builtin) and a process session's command (``true``), each measured three ways, one call at a time
with the sync SDK (latency as its caller sees it): ``daytona``, the SDK against our server;
``floor``, the same SDK calls against a server that answers them at once without doing anything
(``floor_app``: the same HTTP server as ours, uvicorn, and the same event connection, so what is
left is the SDK's own work and loopback HTTP); ``native``, the same work through our native API and
its own client (``TangramClient``: open a session + its first command; a command; the python line
run in the session; the program; a command, the native session keeping its state itself). The three
alternate call by call (their order rotating), so a load that comes and goes weighs on each alike;
each figure gives the p50 ratios ``vs_floor`` and ``vs_native``, and the CPU time each server
process spent per call (``server_cpu_ms``, its own threads: what the route costs, whatever the load
does to the latency).

Then, ours only: a 1 MB ``fs.upload_file`` + ``download_file``; ``fs.list_files``. Then ``open``
sandboxes are created at once from the async SDK (``open_concurrency`` being created at a time),
each given a file and a command, all kept open (what the server holds then is printed), a command
in each again, then all deleted; errors are counted, never waited out.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

import httpx

from .e2b import _p, _rss_mb
from .server import free_port, stop_process, wait_up
from .sessions import _Server

#: the figures measured three ways, and their targets (p50, ms; None: no target)
TARGETS_MS = {"create_and_first_exec": 15, "exec_true": 5, "code_run": 5, "exec_bin_true": None,
              "session_command": None}
CODE = "x = 1 + 1"


def run(n: int = 30, open_n: int = 200, log: Callable[[str], None] = lambda m: None,
        open_concurrency: int = 50) -> dict:
    try:
        from daytona import AsyncDaytona, Daytona, DaytonaConfig
    except ImportError:
        raise RuntimeError("bench daytona needs Daytona's SDK: pip install daytona") from None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        server = _Server(tmp, {"sandbox": {"warm_pool": 4}})
        config = DaytonaConfig(api_key="dtn_bench", api_url=f"{server.url}/api")
        try:
            log(f"server at {server.url}; {n} samples per figure")
            d = Daytona(config)
            sb = d.create()
            template = httpx.get(f"{server.url}/api/sandbox/{sb.id}", headers={"Authorization": "Bearer dtn_bench"},
                                 timeout=30).json()  # the floor answers with our sandbox, as it is on the wire
            sb.delete()
            floor = _Floor(tmp, template)
            try:
                log(f"floor at {floor.url}")
                figures = side_by_side(d, Daytona(DaytonaConfig(api_key="dtn_bench", api_url=f"{floor.url}/api")),
                                       server, floor, n)
            finally:
                floor.stop()
            ours = _ours_only(d, n)
            log(f"opening {open_n} sandboxes at once ({open_concurrency} being created at a time)")
            opened = asyncio.run(_open_many(AsyncDaytona, config, open_n, open_concurrency, server))
        finally:
            server.stop()
    return {"summary": summary(figures), "side_by_side": figures, **ours, "open_at_once": opened,
            "targets_ms": TARGETS_MS,
            "cpus": os.cpu_count(), "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "note": "sandboxes on loopback, without network, on this machine; the sync SDK's own work included; "
                    "native: the native API through TangramClient (httpx)"}


def side_by_side(ours, floor_client, server, floor: "_Floor", n: int) -> dict:
    """Each figure of ``TARGETS_MS`` as ``daytona``, ``floor`` and ``native`` (the module's
    docstring), alternating call by call."""
    from ..client.sync import TangramClient

    native = TangramClient(server.url)
    pids = {"daytona": server.proc.pid, "floor": floor.proc.pid, "native": server.proc.pid}
    out: dict[str, Any] = {}
    try:
        boxes = {"daytona": ours.create(), "floor": floor_client.create()}
        session = native.session(job="bench")
        for b in boxes.values():  # first calls: the interpreter's start, the connections
            b.process.exec("true")
            b.process.code_run("pass")
            b.process.create_session("bench")
        session.exec("true")
        session.exec(python="pass")

        def create_daytona(client) -> Callable[[], Callable[[], None]]:
            def timed() -> Callable[[], None]:
                sb = client.create()
                sb.process.exec("true")
                return sb.delete
            return timed

        def create_native() -> Callable[[], None]:
            s = native.session(job="bench")
            s.exec("true")
            return s.close

        cases = {
            "create_and_first_exec": {"daytona": create_daytona(ours), "floor": create_daytona(floor_client),
                                      "native": create_native},
            "exec_true": {"daytona": lambda: boxes["daytona"].process.exec("true"),
                          "floor": lambda: boxes["floor"].process.exec("true"),
                          "native": lambda: session.exec("true")},
            "code_run": {"daytona": lambda: _code_run(boxes["daytona"]),
                         "floor": lambda: boxes["floor"].process.code_run(CODE),
                         "native": lambda: _python(session)},
            # a program, not a builtin: its own process, in each
            "exec_bin_true": {"daytona": lambda: boxes["daytona"].process.exec("/bin/true"),
                              "floor": lambda: boxes["floor"].process.exec("/bin/true"),
                              "native": lambda: session.exec("/bin/true")},
            # a process session's command (its directory and variables kept): the native
            # session keeps them itself
            "session_command": {"daytona": lambda: _session_command(boxes["daytona"]),
                                "floor": lambda: _session_command(boxes["floor"]),
                                "native": lambda: session.exec("true")},
        }
        for name, sides in cases.items():
            out[name] = _alternate(sides, pids, n, settle_s=0.05 if name.startswith("create") else 0.0)
            if TARGETS_MS[name] is not None:
                out[name]["target_ms"] = TARGETS_MS[name]
        for b in boxes.values():
            b.delete()
        session.close()
    finally:
        native.close()
    return out


def summary(figures: dict) -> dict:
    """Each figure's p50 (ms) three ways, beside its target and whether ours meets it."""
    out = {}
    for name, fig in figures.items():
        row = {k: fig[k]["p50_ms"] for k in ("daytona", "floor", "native") if k in fig}
        if fig.get("target_ms") is not None:
            row["target_ms"] = fig["target_ms"]
            row["met"] = row.get("daytona", float("inf")) <= fig["target_ms"]
        out[name] = row
    return out


def _code_run(sb) -> None:
    r = sb.process.code_run(CODE)
    assert r.exit_code == 0, r.result


def _session_command(sb) -> None:
    from daytona import SessionExecuteRequest

    r = sb.process.execute_session_command("bench", SessionExecuteRequest(command="true"))
    assert r.exit_code == 0


def _python(session) -> None:
    r = session.exec(python=CODE)
    assert r.outcome == "ok", r


def _alternate(sides: dict[str, Callable[[], Any]], pids: dict[str, int], n: int, settle_s: float) -> dict:
    """``n`` calls of each side, one at a time, the sides alternating (each round in another
    order); a call that returns a callable has it called untimed after (a delete), then
    ``settle_s`` asleep (the warm pool refills: a steady rate, not a burst)."""
    names = list(sides)
    took: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, float] = {k: 0.0 for k in names}
    for i in range(n):
        for k in names[i % len(names):] + names[:i % len(names)]:
            c0 = _cpu_s(pids[k])
            t = time.perf_counter()
            after = sides[k]()
            took[k].append(time.perf_counter() - t)
            cpu[k] += _cpu_s(pids[k]) - c0
            if callable(after):
                after()
                time.sleep(settle_s)
    out: dict[str, Any] = {k: {**_p(took[k]), "server_cpu_ms": round(cpu[k] / n * 1000, 2)} for k in names}
    p50 = {k: out[k]["p50_ms"] for k in names}
    for other in ("floor", "native"):
        if "daytona" in p50 and p50.get(other):
            out[f"vs_{other}"] = round(p50["daytona"] / p50[other], 2)
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (its own threads), from ``/proc``: the scheduler's
    nanoseconds of each thread where the kernel keeps them, else the clock ticks."""
    total, seen = 0, False
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
                seen = True
        except (OSError, ValueError, IndexError):  # a thread gone, or no scheduler statistics
            continue
    if seen:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ours_only(d, n: int) -> dict:
    sb = d.create()
    files, listed = [], []
    mb = os.urandom(1 << 20)
    for i in range(n):
        t = time.perf_counter()
        sb.fs.upload_file(mb, f"blob{i % 3}")
        back = sb.fs.download_file(f"blob{i % 3}")
        files.append(time.perf_counter() - t)
        assert back == mb
    for _ in range(n):
        t = time.perf_counter()
        names = [f.name for f in sb.fs.list_files("/home/user")]
        listed.append(time.perf_counter() - t)
        assert names
    sb.delete()
    return {"upload_and_download_1mb": _p(files), "list_files": _p(listed)}


# -- the floor: Daytona's calls answered at once -----------------------------------------------------

class _Floor:
    """``floor_app`` under uvicorn in a subprocess, on a free loopback port."""

    def __init__(self, tmp: str, template: dict) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.path.join(tmp, f"floor-{self.port}.json")
        with open(path, "w") as fh:
            json.dump({**template, "toolboxProxyUrl": f"{self.url}/api/toolbox"}, fh)
        log = os.path.join(tmp, f"floor-{self.port}.log")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", "import sys\nfrom arl_tangram.bench.daytona import "
                                          "serve_floor\nserve_floor(int(sys.argv[1]), sys.argv[2])",
                                          str(self.port), path], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_up(self.url, timeout_s=60, proc=self.proc, log=log)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc, 30)


def serve_floor(port: int, template_path: str) -> None:
    """The floor server (``_Floor``'s process): ``floor_app`` as ``tangram serve`` runs its app."""
    import uvicorn

    from ..server.app import KEEP_ALIVE_S

    with open(template_path) as fh:
        template = json.load(fh)
    uvicorn.run(floor_app(template), host="127.0.0.1", port=port, log_level="warning",
                timeout_keep_alive=KEEP_ALIVE_S)


def floor_app(template: dict) -> Callable[..., Any]:
    """A bare ASGI app answering what the bench's calls ask at once: a sandbox (``template`` under
    a new id) for a create, a get or a delete; exit code 0 and no output for an ``exec`` or a
    ``code_run``; the event connection as ours serves it (``socketio.serve``) with no events."""
    from starlette.websockets import WebSocket

    from ..server.daytona import socketio

    answers = {"execute": {"exitCode": 0, "result": ""},
               "code-run": {"exitCode": 0, "result": "", "artifacts": {"charts": []}},
               "session": {},  # a process session made
               "exec": {"cmdId": "floor", "output": "", "stdout": "", "stderr": "", "exitCode": 0}}

    async def nobody(token: str | None) -> None:
        return None

    async def no_events(after: int | None, wait_s: float) -> tuple[list, int]:
        await asyncio.sleep(wait_s)
        return [], 0

    async def app(scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] == "websocket":
            await socketio.serve(WebSocket(scope, receive, send), nobody, no_events, lambda data: data)
            return
        while (await receive()).get("more_body"):
            pass
        path, method = scope["path"], scope["method"]
        status, value = 200, answers.get(path.rsplit("/", 1)[-1]) if path.startswith("/api/toolbox/") else None
        if path == "/api/sandbox" and method == "POST":
            value = {**template, "id": str(uuid.uuid4())}
        elif path.startswith("/api/sandbox/") and path.count("/") == 3:
            value = {**template, "id": path.rsplit("/", 1)[-1]}
        elif path == "/healthz":
            value = {"status": "ok"}
        if value is None:
            status, value = 404, {"statusCode": 404, "message": f"{path}: not the floor's", "code": "NOT_FOUND"}
        body = json.dumps(value).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


# -- many at once ------------------------------------------------------------------------------------

async def _open_many(cls, config, n: int, concurrency: int, server) -> dict:
    """``n`` sandboxes open at once, created ``concurrency`` at a time, each given a file and a
    command; then, with all of them open, what the server holds, a command in each again, the
    listing's count; then all are deleted. A create past the server's capacity is refused (503,
    saying which limit), counted in ``errors``."""
    gate = asyncio.Semaphore(concurrency)
    took: list[float] = []
    t = time.perf_counter()
    async with cls(config) as d:
        async def one(i: int):
            async with gate:
                t0 = time.perf_counter()
                sb = await d.create(timeout=600)
                await sb.fs.upload_file(f"state {i}".encode(), "state.txt")
                r = await sb.process.exec("cat state.txt")
                assert r.result == f"state {i}", r.result
                took.append(time.perf_counter() - t0)
                return sb

        boxes = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        opened_s = time.perf_counter() - t
        ok = [b for b in boxes if not isinstance(b, BaseException)]
        errors = sorted({f"{type(b).__name__}: {b}"[:200] for b in boxes if isinstance(b, BaseException)})
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            h = (await client.get("/healthz")).json()
        held = {"sessions": h.get("sessions"), "session_mem_used_mb": h.get("session_mem_used_mb"),
                "at_rest": (h.get("rest") or {}).get("at_rest"), "awake": (h.get("rest") or {}).get("awake")}
        try:
            held["server_rss_mb"] = round(_rss_mb(server.proc.pid), 1)
        except OSError:
            pass
        listed = len([s async for s in d.list()])
        t2 = time.perf_counter()

        async def again(i: int, sb):
            async with gate:
                r = await sb.process.exec("cat state.txt")
                assert r.result == f"state {i}"

        again_errors = [r for r in await asyncio.gather(*(again(i, b) for i, b in enumerate(boxes)
                                                          if not isinstance(b, BaseException)),
                                                        return_exceptions=True) if isinstance(r, BaseException)]
        again_s = time.perf_counter() - t2
        errors += sorted({f"again: {type(e).__name__}: {e}"[:200] for e in again_errors})

        async def gone(sb):
            async with gate:
                await sb.delete()

        await asyncio.gather(*(gone(b) for b in ok), return_exceptions=True)
    return {"requested": n, "open": len(ok), "concurrency": concurrency, "seconds": round(opened_s, 2),
            "each": _p(took), "listed": listed, "held_while_open": held, "exec_in_each_again_s": round(again_s, 2),
            "again_errors": len(again_errors), "errors": errors[:5]}
