"""HTTP front processes (``tangram serve --fronts N``): the link to the engine process, and a
server with fronts surviving what production does to it (restarts of a front, SIGTERM with
requests in flight, kill -9 of the engine process)."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import signal
import time

import httpx
import pytest

from arl_tangram.runtime import NoRoom, SessionGone
from arl_tangram.link import Caller, Hub, PeerGone, RemoteFault
from arl_tangram.server.calls import CALLS, RELAYED
from arl_tangram.server.service import BadRequest, NotFound, Overloaded, Service

from servers import Server, alive, cmdline

REAL = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.mark.parametrize("err", [Overloaded(3), NoRoom("memory", "no room for a session", 7),
                                 SessionGone("s-1", "expired after 60 s idle"), NotFound("no action 'x'"),
                                 BadRequest("cpus: minimum 9 exceeds the largest node (2 cores)"),
                                 RemoteFault("KeyError", "'x'")])
def test_errors_cross_the_link_as_themselves(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)


class _Service:
    """A stand-in at the hub's seam: calls that answer at once, later, or fail."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def health(self) -> dict:
        return {"status": "ok"}

    async def submit(self, req: dict) -> dict:
        if req.get("wait_for_release"):
            await self.release.wait()
        return {"echo": req}

    def status(self, id: str) -> dict:
        raise NotFound(f"no action {id!r}")

    async def cancel(self, id: str) -> dict:
        raise KeyError(id)


def test_calls_are_multiplexed_and_errors_keep_their_meaning(tmp_path):
    async def main():
        service = _Service()
        hub = Hub(service, CALLS, RELAYED)
        path = str(tmp_path / "link.sock")
        await hub.listen(path)
        caller = Caller()
        await caller.connect(path)
        slow = asyncio.ensure_future(caller.call("submit", {"wait_for_release": True}))
        assert await caller.call("submit", {"n": 1}) == {"echo": {"n": 1}}  # answered while the slow one waits
        assert not slow.done()
        service.release.set()
        assert await slow == {"echo": {"wait_for_release": True}}
        assert await caller.call("health") == {"status": "ok"}
        with pytest.raises(NotFound, match="no action 'q'"):
            await caller.call("status", "q")
        with pytest.raises(RemoteFault) as fault:
            await caller.call("cancel", "q")
        assert fault.value.type_name == "KeyError"
        with pytest.raises(RemoteFault, match="no such call"):
            await caller.call("__init__")  # only the routes' calls are served
        lost: list[str] = []
        closer = Caller(on_lost=lambda: lost.append("closer"))  # a caller that closes its own end
        await closer.connect(path)
        assert await closer.call("health") == {"status": "ok"}
        closer.close()
        await asyncio.sleep(0.05)
        assert lost == [], "closing one's own end is not losing the peer"
        caller.on_lost = lambda: lost.append("caller")
        service.release.clear()
        hanging = asyncio.ensure_future(caller.call("submit", {"wait_for_release": True}))
        await asyncio.sleep(0.05)
        assert hub.links == 1
        await hub.close()  # the engine process goes away with a call in flight
        with pytest.raises(PeerGone):
            await hanging
        with pytest.raises(PeerGone):
            await caller.call("health")
        assert lost == ["caller"]

    asyncio.run(main())


def _fronts(server: Server) -> list[int]:
    return [p for p in server.children() if "arl_tangram.server.front" in cmdline(p)]


def test_a_session_is_shared_by_every_front_and_a_dead_front_is_replaced(tmp_path):
    s = Server(tmp_path, double=True, args=("--fronts", "2"))
    try:
        first = _fronts(s)
        assert len(first) == 2
        sid = httpx.post(f"{s.url}/v1/sessions", json={"job": "f"}).json()["session_id"]
        httpx.post(f"{s.url}/v1/sessions/{sid}/exec", json={"python": "x = 41"}, timeout=30)
        # a fresh connection per call: the kernel hands them to either front
        outs = {httpx.post(f"{s.url}/v1/sessions/{sid}/exec", json={"python": "print(x + 1)"},
                           timeout=30).json()["run"]["stdout"] for _ in range(6)}
        assert outs == {"42\n"}
        bad = httpx.post(f"{s.url}/v1/actions", json={"action": {"code": "1"}, "cpus": [3, 1]})
        assert bad.status_code == 422 and bad.json()["message"].startswith("cpus")
        os.kill(first[0], signal.SIGKILL)
        deadline = time.time() + 20
        while time.time() < deadline and not (len(_fronts(s)) == 2 and first[0] not in _fronts(s)):
            time.sleep(0.1)
        assert len(_fronts(s)) == 2 and first[0] not in _fronts(s), "the dead front was not replaced"
        for _ in range(4):
            assert httpx.post(f"{s.url}/run_code", json={"code": "print(1)", "language": "python"},
                              timeout=30).json()["status"] == "Success"
        assert "front 0" in (tmp_path / f"server-{s.port}.log").read_text() or \
               "front 1" in (tmp_path / f"server-{s.port}.log").read_text()
    finally:
        s.stop()


def test_sigterm_finishes_the_requests_in_flight_and_stops_every_front(tmp_path):
    s = Server(tmp_path, double=True, args=("--fronts", "2"))
    fronts = _fronts(s)

    async def main():
        async with httpx.AsyncClient(timeout=30) as c:
            slow = asyncio.ensure_future(c.post(f"{s.url}/run_code", json={
                "code": "import time\ntime.sleep(3.0)\nprint('finished')", "language": "python"}))
            for _ in range(200):  # in flight (through a front) before the signal, however loaded the host
                await asyncio.sleep(0.05)
                if (await c.get(f"{s.url}/healthz")).json()["running"] >= 1:
                    break
            s.proc.send_signal(signal.SIGTERM)
            return await slow

    r = asyncio.run(main())
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "finished\n"
    assert s.proc.wait(30) == 0
    assert not any(alive(p) for p in fronts)
    s.stop()
    log = (tmp_path / f"server-{s.port}.log").read_text()
    assert "ERROR" not in log, log  # a stop is not a front losing the engine process's link


def test_the_fronts_die_with_a_killed_engine_process_and_the_journal_recovers(tmp_path):
    journal = tmp_path / "j.sqlite3"
    s = Server(tmp_path, double=True, journal=journal, args=("--fronts", "2"))
    fronts = _fronts(s)
    ack = httpx.post(f"{s.url}/v1/actions", json={"id": "k9", "wait": False, "action": {
        "code": "import time\ntime.sleep(5)\nprint('done')"}}, timeout=30)
    assert ack.status_code == 202
    s.stop(signal.SIGKILL)
    deadline = time.time() + 15
    while time.time() < deadline and any(alive(p) for p in fronts):
        time.sleep(0.1)
    assert not any(alive(p) for p in fronts), "a front outlived its engine process"
    s2 = Server(tmp_path, double=True, journal=journal, args=("--fronts", "2"))
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            r = httpx.get(f"{s2.url}/v1/actions/k9").json()
            if r["state"] == "done":
                break
            time.sleep(0.2)
        assert (r["state"], r["outcome"], r["run"]["stdout"]) == ("done", "ok", "done\n")
    finally:
        s2.stop()


@REAL
def test_the_token_is_checked_by_every_front(tmp_path):
    s = Server(tmp_path, token="s3cret", args=("--fronts", "2"))
    try:
        for _ in range(4):
            assert httpx.post(f"{s.url}/run_code", json={"code": "print(1)"}).status_code == 401
        ok = httpx.post(f"{s.url}/run_code", json={"code": "print(1)", "language": "python"},
                        headers={"authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "1\n"
        assert all("s3cret" not in cmdline(p) for p in _fronts(s))
    finally:
        s.stop()


@REAL
def test_fronts_and_sandbox_workers_together_and_nothing_outlives_sigterm(tmp_path):
    s = Server(tmp_path, args=("--fronts", "2", "--sandbox-workers", "2"))
    kids = s.children()

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(f"{s.url}/run_code", json={"code": f"print({i})", "language": "python"})
                                        for i in range(24)))
            sid = (await c.post(f"{s.url}/v1/sessions", json={})).json()["session_id"]
            await c.post(f"{s.url}/v1/sessions/{sid}/exec", json={"python": "y = 7"})
            step = (await c.post(f"{s.url}/v1/sessions/{sid}/exec", json={"python": "print(y * 6)"})).json()
            return rs, step

    rs, step = asyncio.run(main())
    health = httpx.get(f"{s.url}/healthz").json()
    assert (health["fronts"], health["sandbox_workers"]) == (2, {"up": 2, "total": 2})
    assert [r.json()["run_result"]["stdout"] for r in rs] == [f"{i}\n" for i in range(24)]
    assert step["run"]["stdout"] == "42\n"
    assert sum("runtime.worker_process" in cmdline(p) for p in kids) == 2
    s.stop()
    assert s.proc.returncode == 0
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    assert not any(alive(p) for p in kids), [cmdline(p) for p in kids if alive(p)]


def test_top_shows_the_helper_processes_and_hides_them_when_there_are_none():
    from rich.console import Console

    from arl_tangram.top import render

    base = {"version": "x", "isolation": "bwrap", "queued": 0, "running": 0, "cores": 16, "sessions": 0,
            "sessions_placed": 0, "session_mem_used_mb": 0.0, "session_mem_reserved_mb": 0.0, "memory_mb": 1000,
            "head_waited_s": 0.0, "head_waits_for": ""}
    for health, line in ((dict(base, fronts=4, sandbox_workers={"up": 3, "total": 4}),
                          "processes: 4 HTTP fronts, sandbox workers 3/4 up"),
                         (dict(base, fronts=0, sandbox_workers=None), None)):
        console = Console(width=200, record=True)
        console.print(render("http://x", health, []))
        text = console.export_text()
        assert (line in text) if line else ("processes:" not in text)


def test_every_call_a_route_makes_is_declared_once_and_reaches_both_sides():
    """The dialects' calls are the one list: the routes use only those (checked in their source,
    so a missing entry fails here, fronts or not), and the calls in process and the fronts'
    remote service have exactly them."""
    import ast
    import inspect

    from arl_tangram.server.calls import CALLS, DIALECTS, Local
    from arl_tangram.server.front import RemoteService

    used = set()
    for dialect in DIALECTS:
        tree = ast.parse(inspect.getsource(dialect.routes))
        used |= {n.attr for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "calls"}
    assert used and used <= set(CALLS), f"routes call what no dialect declares: {used - set(CALLS)}"
    assert set(CALLS) - used == set(), f"declared but no route calls it: {set(CALLS) - used}"
    assert {n for n in vars(Local(object.__new__(Service)))} == set(CALLS)
    assert {n for n in vars(RemoteService("/nonexistent")) if not n.startswith("_") and n != "link"} == set(CALLS)
