"""The service, its journal and both clients, served over the in-process sandbox double: these run
on any Linux host, bubblewrap or not (the real-sandbox twins are in test_server.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sqlite3
import time

import httpx
import pytest

from arl_tangram.client import AsyncTangramClient, TangramClient, TangramError

from servers import Server


REAL = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module", params=["double", "double-fronts", pytest.param("real", marks=REAL)])
def server(request, tmp_path_factory):
    """Over the double in one process, over the double with two HTTP front processes (every
    call crosses the front link, and consecutive requests land on different fronts), and over
    real sandboxes."""
    double = request.param.startswith("double")
    s = Server(tmp_path_factory.mktemp(f"serve-{request.param}"), double=double,
               args=("--fronts", "2") if request.param.endswith("fronts") else ())
    s.double = double
    yield s
    s.stop()


def test_both_clients_see_the_same_service(server):
    with TangramClient(server.url) as c:
        r = c.run_code("print(input()[::-1])", stdin="olleh", job="svc")
        assert (r.outcome, r.run.stdout) == ("ok", "hello\n")
        s = c.session(job="svc")
        s.exec(python="x = 20")
        assert s.exec(python="print(x * 2)").run.stdout == "40\n"
        s.put_files({"in.txt": b"hello"})
        assert s.exec("wc -c < in.txt").run.stdout.strip() == "5"
        assert s.get_files(["in.txt", "absent"]) == {"in.txt": b"hello"}
        s.close()
        with pytest.raises(TangramError) as e:
            s.exec("ls")
        assert e.value.status == 404
        health = c.health()
        assert (health["isolation"] is None) == server.double and health["queued"] == 0
        # where one-shots run: on this host's cgroups with the cpu hierarchy, sharing the CPUs
        if server.double:
            assert health["one_shot_cpus"] is None
        else:
            from arl_tangram.managers.sandbox.cgroups import open_root
            probe = open_root(tag=f"tangram-probe-{os.getpid()}")
            if probe is not None:
                probe.cleanup()
            assert health["one_shot_cpus"] == ("shared" if probe is not None and probe.bounds_cpu_time else "pinned")
        # each core's wait between one-shots: kept by a real sandbox manager, none over the double
        assert (health["core_waits"] is None) == server.double
        if not server.double:
            assert health["core_waits"]["n"] >= 0 and "p50_ms" in health["core_waits"]
        # and what became of one-shot sandboxes: the one-shot above was recycled (or is being reset)
        assert (health["one_shot_sandboxes"] is None) == server.double
        if not server.double:
            assert set(health["one_shot_sandboxes"]) == {"started_for_pool", "started_for_run", "recycled",
                                                          "discarded", "over_cap"}
            assert health["one_shot_sandboxes"]["started_for_pool"] > 0

    async def main():
        async with AsyncTangramClient(server.url) as c:
            r = await c.run_code("print(6 * 7)", job="svc")
            stats = await c.stats("svc")
            return r, stats

    r, stats = asyncio.run(main())
    assert r.run.stdout == "42\n"
    assert stats.outcomes["ok"] == 6  # two one-shots, three session steps, one file upload
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'tangram_actions_total{outcome="ok",service="exec"}' in metrics
    # one machine: no nodes to move sessions between, so no move figures (the Ray head's, test_moves)
    info = httpx.get(f"{server.url}/v1/cluster").json()
    assert info["backend"] == "local" and info["moves"] is None and info["move_p50_s"] is None, info


def test_an_id_is_an_idempotency_key(server):
    body = {"id": "idem-1", "job": "svc", "action": {"code": "import random; print(random.random())"}}
    first = httpx.post(f"{server.url}/v1/actions", json=body, timeout=30).json()
    again = httpx.post(f"{server.url}/v1/actions", json=body, timeout=30).json()
    assert first["outcome"] == "ok" and again == first


@pytest.mark.parametrize("fronts", [0, 2])
def test_a_full_queue_answers_429(tmp_path, fronts):
    s = Server(tmp_path, config={"max_queue": 1, "cores": 1}, double=True, args=("--fronts", str(fronts)))
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(f"{s.url}/run_code", json={
                    "code": "import time\ntime.sleep(0.5)", "language": "python"}) for _ in range(6)))

        answers = asyncio.run(main())
        codes = [r.status_code for r in answers]
        assert 429 in codes and 200 in codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["retry-after"] == "1" and "queue is full" in refused.json()["message"]
    finally:
        s.stop()


def _step_on_disk(journal) -> bool:
    """Whether a session step's acceptance is committed (its row, not done yet)."""
    try:
        db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    except sqlite3.Error:
        return False
    try:
        return db.execute("SELECT COUNT(*) FROM actions WHERE kind='exec' AND state != 'done'").fetchone()[0] > 0
    except sqlite3.Error:  # (the table not made yet)
        return False
    finally:
        db.close()


@pytest.mark.parametrize("double,n", [(True, 24), pytest.param(False, 200, marks=[pytest.mark.slow, REAL])],
                         ids=["double", "real"])
def test_kill_9_loses_no_accepted_action(tmp_path, double, n):
    """Recovery: one-shots accepted but unfinished are re-run, the session step in flight ends
    infra_error, a resubmission returns the stored result (over the double on any host; over
    real sandboxes with 200 in flight where bubblewrap is installed)."""
    journal = tmp_path / "crash.sqlite3"
    s = Server(tmp_path, journal=journal, double=double)
    ids = [f"crash-{i}" for i in range(n)]

    async def submit_all():
        async with httpx.AsyncClient(timeout=60) as c:
            acks = await asyncio.gather(*(c.post(f"{s.url}/v1/actions", json={
                "id": i, "wait": False, "job": "crash", "action": {"code": "import time\ntime.sleep(0.5)\nprint('done')"}})
                for i in ids))
            sess = (await c.post(f"{s.url}/v1/sessions", json={"job": "crash"})).json()["session_id"]
            step = asyncio.ensure_future(c.post(f"{s.url}/v1/sessions/{sess}/exec", json={"command": "sleep 20"}))
            for _ in range(600):  # the step accepted and on disk before the kill, however loaded the host
                await asyncio.sleep(0.05)
                if _step_on_disk(journal):
                    break
            assert not step.done()
            return acks

    acks = asyncio.run(submit_all())
    assert all(r.status_code in (200, 202) for r in acks)
    s.stop(signal.SIGKILL)
    s2 = Server(tmp_path, journal=journal, double=double)
    try:
        final: dict = {}
        deadline = time.time() + 120
        while len(final) < len(ids) and time.time() < deadline:
            for i in ids:
                if i not in final:
                    r = httpx.get(f"{s2.url}/v1/actions/{i}").json()
                    if r["state"] == "done":
                        final[i] = r
            time.sleep(0.2)
        assert len(final) == len(ids), "an acknowledged action was lost"
        assert {r["outcome"] for r in final.values()} <= {"ok", "infra_error"}
        if double:  # the double cannot fail: every re-run succeeds
            assert {r["outcome"] for r in final.values()} == {"ok"}
        again = httpx.post(f"{s2.url}/v1/actions", json={"id": ids[0], "job": "crash", "action": {
            "code": "import time\ntime.sleep(0.5)\nprint('done')"}}, timeout=30).json()
        assert again == final[ids[0]], "a resubmission ran the action twice"
        other = httpx.post(f"{s2.url}/v1/actions", json={"id": ids[0], "job": "crash", "action": {
            "code": "print('second run')"}}, timeout=30)  # another program under the id: never its old result
        assert other.status_code == 409 and "action.code" in other.json()["message"]
        assert httpx.get(f"{s2.url}/healthz").json()["recovered"]["infra_error"] == 1
    finally:
        s2.stop()
    db = sqlite3.connect(journal)
    assert db.execute("SELECT COUNT(*) FROM actions WHERE state != 'done'").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM actions WHERE kind='exec' AND outcome='infra_error'").fetchone()[0] == 1


def test_an_expired_session_is_404_with_the_reason(tmp_path):
    s = Server(tmp_path, config={"sandbox": {"session_idle_expiry_s": 0.5}}, double=True)
    try:
        with TangramClient(s.url) as c:
            sess = c.session(job="exp")
            sess.exec(python="x = 1")
            time.sleep(2.0)
            with pytest.raises(TangramError) as e:
                sess.exec(python="print(x)")
            assert e.value.status == 404 and "expired" in e.value.message
            assert c.health()["sessions"] == 0
    finally:
        s.stop()


def test_a_served_run_is_recorded_and_replays_in_the_simulator(tmp_path):
    import json
    import subprocess
    import sys

    trace = tmp_path / "served.jsonl"
    s = Server(tmp_path, config={"record": str(trace)}, double=True)
    try:
        with TangramClient(s.url) as c:
            for i in range(3):
                assert c.run_code(f"print({i})", job="rec").outcome == "ok"
            sess = c.session(job="rec")
            sess.exec(python="x = 1")
            sess.exec("true")
            sess.close()
    finally:
        s.stop()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == 5 and all(r["service"] == "sandbox" and r["outcome"] == "ok" for r in rows)
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "simulate", "--trace", str(trace), "--policy",
                        "tangram", "--json", str(tmp_path / "replay.json")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    replay = json.loads((tmp_path / "replay.json").read_text())
    assert replay["num_actions"] == 5


def test_remaining_turns_travel_from_the_client_and_bad_ones_name_the_field(server):
    with TangramClient(server.url) as c:
        assert c.run_code("print(1)", job="turns", remaining_turns=3).outcome == "ok"
        s = c.session(job="turns")
        assert s.exec("true", remaining_turns=0).outcome == "ok"
        s.close()
    bad = httpx.post(f"{server.url}/v1/actions", json={"hints": {"remaining_turns": -1}, "action": {"code": "1"}})
    assert bad.status_code == 422 and "remaining_turns" in bad.json()["message"]


def test_a_client_re_run_id_is_one_the_server_accepts(server):
    """Bug: re-runs of an infra_error one-shot were sent as ``ID~N``, which the server's id
    pattern refuses (422), so no re-run ever ran."""
    from arl_tangram.client.base import attempt_id

    rid = attempt_id(attempt_id("first.id", 1), 2)
    r = httpx.post(f"{server.url}/v1/actions", json={"id": rid, "action": {"code": "print(1)"}}, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == rid == "first.id:retry-2"


def test_a_queued_action_says_what_it_waits_for(server):
    cores = httpx.get(f"{server.url}/healthz").json()["cores"]
    hold = {"action": {"code": "import time; time.sleep(3)", "timeout_s": 10}, "cpus": [cores, cores], "wait": False}
    first = httpx.post(f"{server.url}/v1/actions", json=hold, timeout=30).json()
    second = httpx.post(f"{server.url}/v1/actions", json={**hold, "cpus": [1, 1]}, timeout=30).json()
    try:
        deadline = time.time() + 10
        while httpx.get(f"{server.url}/v1/actions/{first['id']}").json()["state"] != "running":
            assert time.time() < deadline, "the first action never started"
            time.sleep(0.05)
        got = httpx.get(f"{server.url}/v1/actions/{second['id']}").json()
        assert got["state"] == "queued" and got["message"].startswith("waiting for 1 free core(s)"), got
    finally:
        for a in (second, first):
            httpx.post(f"{server.url}/v1/actions/{a['id']}/cancel", timeout=30)


def test_the_engine_process_checks_a_translated_one_shots_job_against_the_key():
    """A dialect's route (a front, with fronts) builds the one-shot's action, job included; the
    engine process still checks that job against the request's key before anything is journaled."""
    from arl_tangram.runtime.api import one_shot
    from arl_tangram.server.service import CALLER_JOB, Forbidden, Service

    svc = object.__new__(Service)  # nothing past the check is reached
    token = CALLER_JOB.set("job-a")
    try:
        with pytest.raises(Forbidden, match="job-a"):
            svc.run_oneshot(one_shot("x", "print(1)", job="job-b"), "{}", reply=lambda ok, value: None)
    finally:
        CALLER_JOB.reset(token)


def test_a_one_shot_whose_result_cannot_be_recorded_ends_as_infra_error_not_rerun(tmp_path, monkeypatch):
    """A fault of ours after the run (building the result's record) answers the caller with the
    error and finishes the journal's entry as infra_error: a restart must not run it again."""
    from arl_tangram.api import sandboxfusion as sf
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import service as service_module
    from arl_tangram.server.calls import Local
    from arl_tangram.server.journal import Journal
    from arl_tangram.server.sandboxfusion import run_code_action

    from doubles import InProcessSandboxes

    async def main():
        svc = service_module.Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1),
                                     Journal(str(tmp_path / "j.sqlite3")))
        await svc.start()
        action, text = run_code_action(sf.RunCodeRequest(code="print(1)", language="python"))

        def broken(c):
            raise ValueError("boom")

        monkeypatch.setattr(service_module, "_command", broken)
        with pytest.raises(ValueError, match="boom"):
            await Local(svc).run_oneshot(action, text)
        await svc.journal.durable()
        entry = svc.journal.get(action.id)
        unfinished = [e.id for e in svc.journal.unfinished()]
        await svc.stop()
        return entry, unfinished

    entry, unfinished = asyncio.run(main())
    assert (entry.state, entry.outcome) == ("done", "infra_error") and "ValueError" in entry.response["message"]
    assert unfinished == []


def test_a_one_shot_is_answered_before_its_commit_only_when_none_of_it_was_on_disk(tmp_path):
    """A SandboxFusion one-shot whose acceptance is still queued when it ends is answered at once:
    its row, written done, is committed right after (a crash in between leaves no row, so nothing
    runs twice). One whose acceptance reached disk meanwhile (another write's commit) is answered
    only once its result is on disk too: answered before, a crash would leave it accepted and a
    restart would run it again."""
    import sqlite3

    from arl_tangram.api import sandboxfusion as sf
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import service as service_module
    from arl_tangram.server.journal import Journal
    from arl_tangram.server.sandboxfusion import run_code_action

    from doubles import InProcessSandboxes

    path = str(tmp_path / "j.sqlite3")

    def on_disk(id: str) -> str | None:
        db = sqlite3.connect(path)
        try:
            row = db.execute("SELECT state FROM actions WHERE id=?", (id,)).fetchone()
            return row[0] if row else None
        finally:
            db.close()

    async def one(svc, code: str, flush_after_s: float | None) -> tuple[str, str | None, str | None]:
        action, text = run_code_action(sf.RunCodeRequest(code=code, language="python"))
        answered: asyncio.Future = asyncio.get_running_loop().create_future()
        svc.run_oneshot(action, text, reply=lambda ok, value: answered.set_result((ok, on_disk(action.id))))
        if flush_after_s is not None:
            await asyncio.sleep(flush_after_s)
            svc.journal.flush()  # what another action's commit would do: its acceptance on disk
            assert on_disk(action.id) == "accepted"
        ok, at_answer = await asyncio.wait_for(answered, 30)
        assert ok
        await svc.journal.durable()
        return action.id, at_answer, on_disk(action.id)

    async def main():
        svc = service_module.Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), Journal(path))
        await svc.start()
        try:
            unseen = await one(svc, "print(1)", None)
            seen = await one(svc, "import time; time.sleep(0.5); print(2)", 0.2)
        finally:
            await svc.stop()
        return unseen, seen

    (_, unseen_at_answer, unseen_after), (_, seen_at_answer, seen_after) = asyncio.run(main())
    assert (unseen_at_answer, unseen_after) == (None, "done")  # answered first (fails if it waited for the commit)
    assert (seen_at_answer, seen_after) == ("done", "done")  # (fails if answered before its result's commit)


def test_a_one_shot_cut_by_the_servers_stop_is_told_to_retry_and_never_re_run(tmp_path):
    """A SandboxFusion one-shot still running when the server stops: its caller is told to retry
    (503) and its acceptance, still queued (it goes to disk with its result), is taken back: the
    next server finds nothing to run again, so a retried one runs once more, not twice."""
    from arl_tangram.api import sandboxfusion as sf
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import service as service_module
    from arl_tangram.server.calls import Local
    from arl_tangram.server.journal import Journal
    from arl_tangram.server.sandboxfusion import run_code_action

    from doubles import InProcessSandboxes

    path = str(tmp_path / "j.sqlite3")

    async def main():
        svc = service_module.Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), Journal(path))
        await svc.start()
        action, text = run_code_action(sf.RunCodeRequest(code="import time; time.sleep(30)", language="python"))
        call = asyncio.ensure_future(Local(svc).run_oneshot(action, text))
        await asyncio.sleep(0.5)
        assert svc.journal.get(action.id).state == "accepted"  # queued, readable
        await svc.stop()
        with pytest.raises(service_module.Unavailable, match="retry"):
            await asyncio.wait_for(call, 10)
        return action.id

    cut = asyncio.run(main())
    again = Journal(path)
    try:
        assert again.get(cut) is None and again.unfinished() == []  # (fails if close committed it)
    finally:
        again.close()


def test_an_e2b_command_is_answered_once_its_result_is_on_disk(tmp_path):
    """An E2B command's step (``e2b.processes._exec``) answers only after the journal's commit of
    its result, as a native step does: a crash just after the answer finds it done, never re-ends
    it as ``infra_error`` (review of issue 26, L5)."""
    from arl_tangram.api import v1
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import service as service_module
    from arl_tangram.server.e2b.processes import _exec
    from arl_tangram.server.e2b.sandboxes import Box
    from arl_tangram.server.journal import Journal, new_id

    from doubles import InProcessSandboxes

    path = str(tmp_path / "j.sqlite3")

    async def main():
        svc = service_module.Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), Journal(path))
        await svc.start()
        try:
            sid = (await svc.open_session(v1.SessionRequest(job="e2b"))).session_id
            box = Box(id=sid, job="e2b", template="base", metadata={}, env={}, token="", started_at=0.0, end_at=0.0)
            id = new_id("x")
            out = await _exec(svc, box, "echo hi", None, 10.0, id, "/bin/bash")
            db = sqlite3.connect(path)  # at once, before the loop runs anything else
            try:
                row = db.execute("SELECT state, outcome FROM actions WHERE id=?", (id,)).fetchone()
            finally:
                db.close()
            return out, row
        finally:
            await svc.stop()

    out, row = asyncio.run(main())
    assert out["exit_code"] == 0 and out["stdout"] == "hi\n", out
    assert row == ("done", "ok"), row  # (fails when the answer goes before the commit)


def test_an_e2b_commands_stdin_is_given_whole_where_its_session_runs_elsewhere(tmp_path):
    """Where sessions do not run in the engine's process (Ray's nodes; here the in-process test
    double, which has no ``SandboxManager`` either), a ``stdin=True`` command cannot be fed as it
    runs: it starts at ``close_stdin`` with everything sent, in order, as before live stdin."""
    import base64

    from arl_tangram.api import v1
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import service as service_module
    from arl_tangram.server.e2b import processes
    from arl_tangram.server.e2b.sandboxes import Box, boxes

    from doubles import InProcessSandboxes

    async def main():
        svc = service_module.Service(LocalRuntime(sandboxes=InProcessSandboxes.factory(), cores=1), None)
        await svc.start()
        try:
            sid = (await svc.open_session(v1.SessionRequest(job="e2b"))).session_id
            assert not svc.sessions[sid].live_stdin_here
            boxes(svc).boxes[sid] = Box(id=sid, job="e2b", template="base", metadata={}, env={}, token="t",
                                        started_at=0.0, end_at=0.0)
            pid = processes.e2b_proc_start(svc, sid, "t", {"stdin": True, "process": {
                "cmd": "/bin/bash", "args": ["-l", "-c", "cat; echo end"], "cwd": str(tmp_path)}}, 30.0)
            proc = boxes(svc).boxes[sid].procs[pid]
            for piece in (b"one\n", b"two\n"):
                processes.e2b_proc_input(svc, sid, "t", {"pid": pid}, base64.b64encode(piece).decode())
            started_before_close = proc.task is not None
            processes.e2b_proc_close_stdin(svc, sid, "t", {"pid": pid})
            return started_before_close, await processes.e2b_proc_wait(svc, sid, "t", pid)
        finally:
            await svc.stop()

    started_before_close, out = asyncio.run(main())
    assert not started_before_close
    assert (out["exit_code"], out["stdout"]) == (0, "one\ntwo\nend\n"), out
