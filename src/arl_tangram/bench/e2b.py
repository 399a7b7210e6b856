"""``tangram bench e2b``: E2B's own SDK against ``tangram serve`` on this machine (issue #22).

A server is started on a free loopback port and the official ``e2b`` / ``e2b-code-interpreter``
SDKs are pointed at it the way a user would (``E2B_API_URL``, ``E2B_SANDBOX_URL``,
``E2B_API_KEY``). The host's 1-minute load average before and after is printed beside the
figures (on a shared machine they move with it). Measured, one call at a time (latency as the SDK's caller sees it, HTTP and
the SDK's own work included): create + the first command; ``commands.run("true")``; a 1 MB
``files.write`` + ``files.read``; ``run_code``. Then ``open`` sandboxes are created at once from
asyncio, each given a small state (a file and a command), all kept open, then killed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Callable

from ..sim.metrics import percentile
from .sessions import _Server


def _p(xs: list[float]) -> dict:
    ms = sorted(x * 1000 for x in xs)
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p90_ms": round(percentile(ms, 90), 2)}


def run(n: int = 30, open_n: int = 200, log: Callable[[str], None] = lambda m: None) -> dict:
    try:
        from e2b import AsyncSandbox, Sandbox
        from e2b_code_interpreter import Sandbox as CodeSandbox
    except ImportError:
        raise RuntimeError("bench e2b needs E2B's SDKs: pip install e2b e2b-code-interpreter") from None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        server = _Server(tmp, {"sandbox": {"warm_pool": 4}})
        saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
        os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY="e2b_bench")
        try:
            log(f"server at {server.url}; {n} samples per figure")
            create = []
            for _ in range(n):
                t = time.perf_counter()
                sb = Sandbox.create()
                sb.commands.run("true")
                create.append(time.perf_counter() - t)
                sb.kill()
                time.sleep(0.05)  # let the warm pool refill: a steady rate, not a burst
            sb = CodeSandbox.create()
            true = []
            for _ in range(n):
                t = time.perf_counter()
                sb.commands.run("true")
                true.append(time.perf_counter() - t)
            mb = os.urandom(1 << 20)
            files = []
            for i in range(n):
                t = time.perf_counter()
                sb.files.write(f"/home/user/blob{i % 3}", mb)
                back = sb.files.read(f"/home/user/blob{i % 3}", format="bytes")
                files.append(time.perf_counter() - t)
                assert back == mb
            code = []
            sb.run_code("x = 1")
            for _ in range(n):
                t = time.perf_counter()
                ex = sb.run_code("x + 1")
                code.append(time.perf_counter() - t)
                assert ex.text == "2"
            sb.kill()
            log(f"opening {open_n} sandboxes at once")
            opened = asyncio.run(_open_many(AsyncSandbox, open_n))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            server.stop()
    return {"create_and_first_command": _p(create), "commands_run_true": _p(true),
            "write_and_read_1mb": _p(files), "run_code": _p(code), "open_at_once": opened,
            "e2b_published_start_ms": 150, "cpus": os.cpu_count(),
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "note": "E2B's own service publishes ~150 ms sandbox starts (its docs); ours are on loopback, "
                    "sandboxes without network, on this machine"}


async def _open_many(cls, n: int) -> dict:
    t = time.perf_counter()

    async def one(i: int):
        sb = await cls.create(metadata={"bench": "open"})
        await sb.files.write("/home/user/state.txt", f"state {i}")
        r = await sb.commands.run("cat /home/user/state.txt")
        assert r.stdout == f"state {i}"
        return sb

    boxes = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    took = time.perf_counter() - t
    ok = [b for b in boxes if not isinstance(b, BaseException)]
    errors = sorted({f"{type(b).__name__}: {b}"[:200] for b in boxes if isinstance(b, BaseException)})
    listed = len(await (cls.list(limit=100)).next_items()) if ok else 0
    await asyncio.gather(*(b.kill() for b in ok), return_exceptions=True)
    return {"requested": n, "open": len(ok), "seconds": round(took, 2), "first_page_listed": listed,
            "errors": errors[:5]}
