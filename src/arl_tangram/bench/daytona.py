"""``tangram bench daytona``: Daytona's own SDK against ``tangram serve`` on this machine.

A server is started on a free loopback port and the official ``daytona`` SDK is pointed at it the
way a user would (``DAYTONA_API_URL`` = the server's URL + ``/api``, ``DAYTONA_API_KEY``). The
host's 1-minute load average before and after is printed beside the figures (on a shared machine
they move with it). Measured one call at a time with the sync SDK (latency as its caller sees
it, HTTP and the SDK's own work included): create + the first ``process.exec``;
``process.exec("true")``; ``process.code_run`` of a line of python; a process session's command;
a 1 MB ``fs.upload_file`` + ``download_file``; ``fs.list_files``. Then ``open`` sandboxes are
created at once from the async SDK (``open_concurrency`` being created at a time), each given a
file and a command, all kept open (what the server holds then is printed), a command in each
again, then all deleted; errors are counted, never waited out.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Callable

from .e2b import _p, _rss_mb
from .sessions import _Server


def run(n: int = 30, open_n: int = 200, log: Callable[[str], None] = lambda m: None,
        open_concurrency: int = 50) -> dict:
    try:
        from daytona import AsyncDaytona, Daytona, DaytonaConfig, SessionExecuteRequest
    except ImportError:
        raise RuntimeError("bench daytona needs Daytona's SDK: pip install daytona") from None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        server = _Server(tmp, {"sandbox": {"warm_pool": 4}})
        config = DaytonaConfig(api_key="dtn_bench", api_url=f"{server.url}/api")
        try:
            log(f"server at {server.url}; {n} samples per figure")
            d = Daytona(config)
            create = []
            for _ in range(n):
                t = time.perf_counter()
                sb = d.create()
                sb.process.exec("true")
                create.append(time.perf_counter() - t)
                sb.delete()
                time.sleep(0.05)  # let the warm pool refill: a steady rate, not a burst
            sb = d.create()
            true, code, session, files, listed = [], [], [], [], []
            for _ in range(n):
                t = time.perf_counter()
                r = sb.process.exec("true")
                true.append(time.perf_counter() - t)
                assert r.exit_code == 0
            sb.process.code_run("pass")  # the interpreter's start, once
            for _ in range(n):
                t = time.perf_counter()
                r = sb.process.code_run("x = 1 + 1")
                code.append(time.perf_counter() - t)
                assert r.exit_code == 0, r.result
            sb.process.create_session("bench")
            for _ in range(n):
                t = time.perf_counter()
                r = sb.process.execute_session_command("bench", SessionExecuteRequest(command="true"))
                session.append(time.perf_counter() - t)
                assert r.exit_code == 0
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
            log(f"opening {open_n} sandboxes at once ({open_concurrency} being created at a time)")
            opened = asyncio.run(_open_many(AsyncDaytona, config, open_n, open_concurrency, server))
        finally:
            server.stop()
    return {"create_and_first_exec": _p(create), "exec_true": _p(true), "code_run": _p(code),
            "session_command": _p(session), "upload_and_download_1mb": _p(files), "list_files": _p(listed),
            "open_at_once": opened, "targets_ms": {"create_and_first_exec": 15, "exec_true": 5, "code_run": 5},
            "cpus": os.cpu_count(), "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "note": "sandboxes on loopback, without network, on this machine; the sync SDK's own work included"}


async def _open_many(cls, config, n: int, concurrency: int, server) -> dict:
    """``n`` sandboxes open at once, created ``concurrency`` at a time, each given a file and a
    command; then, with all of them open, what the server holds, a command in each again, the
    listing's count; then all are deleted. A create past the server's capacity is refused (503,
    saying which limit), counted in ``errors``."""
    import httpx

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
