"""``tangram bench e2b``: E2B's own SDK against ``tangram serve`` on this machine.

A server is started on a free loopback port and the official ``e2b`` / ``e2b-code-interpreter``
SDKs are pointed at it the way a user would (``E2B_API_URL``, ``E2B_SANDBOX_URL``,
``E2B_API_KEY``). The host's 1-minute load average before and after is printed beside the
figures (on a shared machine they move with it). Measured, one call at a time (latency as the SDK's caller sees it, HTTP and
the SDK's own work included): create + the first command; ``commands.run("true")``; a streamed
command's first line (``on_stdout``) and its end (a line, 0.2 s asleep, a line); a 1 MB
``files.write`` + ``files.read``; ``files.list``, ``files.exists`` and a read outside the home
directory (``fs_calls``); a line sent to a running command's stdin until it comes back
(``stdin_turns``); ``run_code``. Then ``open`` sandboxes are created at once from
asyncio (``open_concurrency`` being created at a time), each given a small state (a file and a
command), all kept open (what the server holds then is printed), then killed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Callable

from ..sim.metrics import percentile
from .sessions import _Server


#: the streamed command: a line, this long quiet, a line (the first should come long before its end)
STREAM_SLEEP_S = 0.2


def _p(xs: list[float]) -> dict:
    ms = sorted(x * 1000 for x in xs)
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p90_ms": round(percentile(ms, 90), 2)}


def run(n: int = 30, open_n: int = 200, log: Callable[[str], None] = lambda m: None,
        open_concurrency: int = 50) -> dict:
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
            first, whole = [], []  # streaming: the first line's arrival, the call's end
            for _ in range(max(1, n // 3)):
                seen: list[float] = []
                t = time.perf_counter()
                sb.commands.run(f"echo a; sleep {STREAM_SLEEP_S}; echo b",
                                on_stdout=lambda _: seen.append(time.perf_counter()))
                whole.append(time.perf_counter() - t)
                first.append(seen[0] - t)
            mb = os.urandom(1 << 20)
            files = []
            for i in range(n):
                t = time.perf_counter()
                sb.files.write(f"/home/user/blob{i % 3}", mb)
                back = sb.files.read(f"/home/user/blob{i % 3}", format="bytes")
                files.append(time.perf_counter() - t)
                assert back == mb
            fs = fs_calls(sb, n)
            turns = asyncio.run(stdin_turns(AsyncSandbox, sb.sandbox_id, n))
            code = []
            sb.run_code("x = 1")
            for _ in range(n):
                t = time.perf_counter()
                ex = sb.run_code("x + 1")
                code.append(time.perf_counter() - t)
                assert ex.text == "2"
            sb.kill()
            log(f"opening {open_n} sandboxes at once ({open_concurrency} being created at a time)")
            opened = asyncio.run(_open_many(AsyncSandbox, open_n, open_concurrency, server))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            server.stop()
    return {"create_and_first_command": _p(create), "commands_run_true": _p(true),
            "write_and_read_1mb": _p(files), **fs, "stdin_turn": turns, "run_code": _p(code), "open_at_once": opened,
            "stream_first_line": _p(first), "stream_whole_command": _p(whole), "stream_sleep_ms": STREAM_SLEEP_S * 1000,
            "e2b_published_start_ms": 150, "cpus": os.cpu_count(),
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "note": "E2B's own service publishes ~150 ms sandbox starts (its docs); ours are on loopback, "
                    "sandboxes without network, on this machine"}


async def stdin_turns(cls, sandbox_id: str, n: int) -> dict:
    """An interactive command's turn, as an agent driving a REPL sees it: a line sent to a running
    ``cat`` (``send_stdin``) until it comes back (``on_stdout``), one at a time (the async SDK:
    its handle hears output while the caller goes on)."""
    sb = await cls.connect(sandbox_id)
    seen: list[str] = []
    h = await sb.commands.run("cat", stdin=True, background=True, on_stdout=seen.append, timeout=120)
    turns = []
    for i in range(n):
        line = f"turn {i}\n"
        t = time.perf_counter()
        await sb.commands.send_stdin(h.pid, line)
        while not "".join(seen).endswith(line):
            await asyncio.sleep(0.0005)
        turns.append(time.perf_counter() - t)
    await sb.commands.close_stdin(h.pid)
    await h.wait()
    return _p(turns)


def fs_calls(sb, n: int) -> dict:
    """The filesystem calls the sandbox's agent answers (``inside.fsops.op_fs``): ``files.list`` of the
    home directory (a few entries), ``files.exists``, and a small read outside the home directory
    (``/tmp``), one at a time."""
    sb.files.write("/tmp/small.txt", "small")
    listed, exists, read = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        names = [e.name for e in sb.files.list("/home/user")]
        listed.append(time.perf_counter() - t)
        t = time.perf_counter()
        there = sb.files.exists("/tmp/small.txt")
        exists.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = sb.files.read("/tmp/small.txt")
        read.append(time.perf_counter() - t)
        assert there and got == "small" and names, (there, got, names)
    return {"files_list": _p(listed), "files_exists": _p(exists), "read_outside_home": _p(read)}


async def _open_many(cls, n: int, concurrency: int, server) -> dict:
    """``n`` sandboxes open at once: created ``concurrency`` at a time (all ``n`` at once queued
    their first steps past the SDK's 60 s request timeout on 2 cores: 0 of 1,000 opened), each
    given a file and a command, all kept open; then, with all of them open, what the server holds
    (its process's RSS and file descriptors, the sessions' measured memory, how many are at rest),
    a command in each again, and the listing's count; then all are killed."""
    import httpx

    t = time.perf_counter()
    gate = asyncio.Semaphore(concurrency)
    took: list[float] = []

    async def one(i: int):
        async with gate:
            t0 = time.perf_counter()
            sb = await cls.create(metadata={"bench": "open"}, timeout=3600)  # 300 s: the first end early
            await sb.files.write("/home/user/state.txt", f"state {i}")
            r = await sb.commands.run("cat /home/user/state.txt")
            assert r.stdout == f"state {i}"
            took.append(time.perf_counter() - t0)
            return sb

    boxes = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    opened_s = time.perf_counter() - t
    ok = [b for b in boxes if not isinstance(b, BaseException)]
    errors = sorted({f"{type(b).__name__}: {b}"[:200] for b in boxes if isinstance(b, BaseException)})
    held = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        h = (await client.get("/healthz")).json()
        held = {"sessions": h.get("sessions"), "session_mem_used_mb": h.get("session_mem_used_mb"),
                "at_rest": (h.get("rest") or {}).get("at_rest"), "awake": (h.get("rest") or {}).get("awake")}
    try:
        held["server_rss_mb"] = round(_rss_mb(server.proc.pid), 1)
        held["server_fds"] = len(os.listdir(f"/proc/{server.proc.pid}/fd"))
    except OSError:
        pass
    listed = 0
    pager = cls.list(limit=100)
    while True:
        listed += len(await pager.next_items())
        if not pager.has_next:
            break
    t2 = time.perf_counter()

    async def again(i: int, sb):
        async with gate:
            r = await sb.commands.run("cat /home/user/state.txt")
            assert r.stdout == f"state {i}"

    again_errors = [r for r in await asyncio.gather(*(again(i, b) for i, b in enumerate(boxes)
                                                      if not isinstance(b, BaseException)), return_exceptions=True)
                    if isinstance(r, BaseException)]
    again_s = time.perf_counter() - t2
    errors += sorted({f"again: {type(e).__name__}: {e}"[:200] for e in again_errors})
    await asyncio.gather(*(b.kill() for b in ok), return_exceptions=True)
    return {"requested": n, "open": len(ok), "concurrency": concurrency, "seconds": round(opened_s, 2),
            "each": _p(took), "listed": listed, "held_while_open": held,
            "command_in_each_again_s": round(again_s, 2), "again_errors": len(again_errors), "errors": errors[:5]}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
