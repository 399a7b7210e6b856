"""A dialect defined here, outside ``src/``: its own module, served by the one supported way of
adding a dialect from outside the package (``create_app(dialects=...)`` in one process,
``fronts.serve(dialects=["module"])`` with front processes), no file of ``src/`` touched. Its call
runs a session's journaled step through the public ``Service.step``, as every dialect's does.

Run as a script (``python tests/test_dialects.py PORT JOURNAL``), it serves this dialect beside the
server's own with two front processes over the in-process sandbox double.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest
from fastapi import APIRouter
from pydantic import BaseModel

from arl_tangram.server.dialect import Dialect, answer
from arl_tangram.server.service import Service

sys.path.insert(0, str(Path(__file__).parent))


# -- the dialect -----------------------------------------------------------------------------------

class EchoRequest(BaseModel):
    command: str


async def echo_run(service: Service, sid: str, command: str) -> dict:
    """One command in session ``sid``: a journaled step of the session, answered once on disk."""
    s = service.session(sid)
    async with service.step(s.job, {"command": command, "dialect": "echo"}, "echo") as step:
        r = await s.exec(command, id=step.id)
        out = step.record(r)
    return {"id": out.id, "outcome": out.outcome, "stdout": out.run.stdout if out.run else ""}


async def echo_fail(service: Service, sid: str) -> None:
    """A step that a bug of the dialect's stops before it has a result."""
    s = service.session(sid)
    async with service.step(s.job, {"fail": True}, "echo", id=f"x-fail-{sid}"):
        raise RuntimeError("a bug in the dialect")


def routes(router: APIRouter, calls: Any, guarded: Sequence[Any]) -> None:
    @router.post("/echo/{sid}", dependencies=guarded)
    async def run(sid: str, req: EchoRequest) -> dict:
        return await answer(calls.echo_run(sid, req.command))

    @router.post("/echo/{sid}/fail", dependencies=guarded)
    async def fail(sid: str) -> None:
        await answer(calls.echo_fail(sid))


DIALECT = Dialect("echo", {"echo_run": echo_run, "echo_fail": echo_fail}, routes)


# -- the tests -------------------------------------------------------------------------------------

def _row(journal: str, id: str) -> tuple:
    db = sqlite3.connect(journal)
    try:
        return db.execute("SELECT kind, state, outcome, request FROM actions WHERE id=?", (id,)).fetchone()
    finally:
        db.close()


def test_a_dialect_from_outside_is_served_in_process_and_its_step_journaled(tmp_path):
    from fastapi.testclient import TestClient

    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server.app import create_app
    from arl_tangram.server.calls import DIALECTS
    from arl_tangram.server.journal import Journal

    from doubles import InProcessSandboxes

    journal = str(tmp_path / "j.sqlite3")
    service = Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), Journal(journal))
    with TestClient(create_app(service, dialects=(*DIALECTS, DIALECT)), raise_server_exceptions=False) as client:
        sid = client.post("/v1/sessions", json={"job": "echoes"}).json()["session_id"]
        r = client.post(f"/echo/{sid}", json={"command": "echo hi"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["outcome"] == "ok" and out["stdout"] == "hi\n", out
        kind, state, outcome, request = _row(journal, out["id"])  # on disk before the answer
        assert (kind, state, outcome) == ("exec", "done", "ok") and json.loads(request)["dialect"] == "echo"
        assert client.get("/v1/jobs/echoes/stats").json()["outcomes"] == {"ok": 1}  # counted as any step
        assert client.post(f"/echo/{sid}/fail").status_code == 500
        assert _row(journal, f"x-fail-{sid}")[1:3] == ("done", "infra_error")  # one outcome, ours
        assert client.post("/echo/nope", json={"command": "true"}).status_code == 404
    plain = Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1))
    with TestClient(create_app(plain)) as client:  # the server's own dialects only
        assert client.post("/echo/x", json={"command": "true"}).status_code == 404


def test_a_step_ends_in_one_outcome_whatever_stops_it(tmp_path):
    """``Service.step``: a result is recorded; a step stopped before it has one ends ``rejected``
    when the caller's error stopped it, else ``infra_error`` (the server stopping included), and
    is never left accepted."""
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server.journal import Journal
    from arl_tangram.server.service import BadRequest

    from doubles import InProcessSandboxes

    journal = str(tmp_path / "j.sqlite3")

    async def main() -> None:
        svc = Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), Journal(journal))
        await svc.start()
        try:
            for id, err in (("x-caller", BadRequest("command: empty")), ("x-bug", KeyError("k"))):
                try:
                    async with svc.step("j", {}, "echo", id=id):
                        raise err
                except type(err):
                    pass

            async def hangs() -> None:
                async with svc.step("j", {}, "echo", id="x-stopped"):
                    await asyncio.sleep(60)

            task = asyncio.ensure_future(hangs())
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            async with svc.step("j", {}, "echo", id="x-unrun") as step:
                step.unrun("cancelled", "killed before it started")
            assert step.ended
        finally:
            await svc.stop()

    asyncio.run(main())
    assert _row(journal, "x-caller")[1:3] == ("done", "rejected")
    assert _row(journal, "x-bug")[1:3] == ("done", "infra_error")
    assert _row(journal, "x-stopped")[1:3] == ("done", "infra_error")
    assert _row(journal, "x-unrun")[1:3] == ("done", "cancelled")


def test_a_dialect_from_outside_is_served_by_front_processes(tmp_path):
    import httpx

    from arl_tangram.bench.server import free_port, wait_up

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                    os.environ.get("PYTHONPATH")])))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(port), str(tmp_path / "j.sqlite3")], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, timeout_s=60, proc=proc, log=str(log))
        sid = httpx.post(f"{url}/v1/sessions", json={"job": "echoes"}, timeout=30).json()["session_id"]
        for _ in range(4):  # whichever front takes the connection has the route
            r = httpx.post(f"{url}/echo/{sid}", json={"command": "echo hi"}, timeout=30)
            assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    from doubles import InProcessSandboxes

    from arl_tangram.server import fronts
    from arl_tangram.server.config import ServeConfig, build_service

    port, journal = int(sys.argv[1]), Path(sys.argv[2])
    service = build_service(ServeConfig(), journal=journal, sandboxes=InProcessSandboxes.factory())
    fronts.serve(service, fronts.listen("127.0.0.1", port), 2, None, 32 << 20, 5.0, dialects=["test_dialects"])


def test_a_dialects_settings_build_it_and_settings_for_a_dialect_that_takes_none_are_refused():
    from arl_tangram.server.calls import DIALECTS, with_dialects
    from arl_tangram.server.config import ServeConfig

    assert with_dialects() == DIALECTS and ServeConfig().dialect_settings() == {}
    cfg = ServeConfig.model_validate({"model_api": {"reward_routes": [
        {"path": "/rm/score", "model": "rm", "shape": "openrlhf"}]}})
    built = with_dialects(settings=cfg.dialect_settings())
    assert [d.name for d in built] == [d.name for d in DIALECTS]
    modelapi = next(d for d in built if d.name == "modelapi")
    assert modelapi is not next(d for d in DIALECTS if d.name == "modelapi")
    assert all(a is b for a, b in zip(built, DIALECTS) if a.name != "modelapi")
    with pytest.raises(ValueError, match="native"):
        with_dialects(settings={"native": {}})
