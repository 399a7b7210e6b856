"""`tangram serve` as clients meet it: a real server process on loopback, the real
`sandbox-fusion` client package, our own clients, and a crash in the middle of work."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from servers import Server

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


# -- the real sandbox-fusion client ----------------------------------------------------------------

def test_sandbox_fusion_client_works_unchanged(server):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code, set_endpoint

    set_endpoint(server.url)
    ok = run_code(RunCodeRequest(code="print(input()[::-1])", language="python", stdin="abc"))
    assert ok.status == RunStatus.Success and ok.run_result.stdout == "cba\n" and ok.compile_result is None
    sh = run_code(RunCodeRequest(code="echo hi; exit 2", language="bash"))
    assert sh.status == RunStatus.Failed and sh.run_result.return_code == 2 and sh.run_result.stdout == "hi\n"
    cpp = run_code(RunCodeRequest(code='#include <iostream>\nint main(){int a;std::cin>>a;std::cout<<a*2;}',
                                  language="cpp", stdin="21"))
    assert cpp.status == RunStatus.Success and cpp.run_result.stdout == "42" and cpp.compile_result.return_code == 0
    bad = run_code(RunCodeRequest(code="int main( {", language="cpp"))
    assert bad.status == RunStatus.Failed and bad.run_result is None and bad.compile_result.return_code != 0
    crash = run_code(RunCodeRequest(code="1/0", language="python"))
    assert crash.status == RunStatus.Failed and crash.run_result.return_code == 1
    assert "ZeroDivisionError" in crash.run_result.stderr
    slow = run_code(RunCodeRequest(code="import time\ntime.sleep(30)", language="python", run_timeout=1))
    assert slow.status == RunStatus.Failed and slow.run_result.status == "TimeLimitExceeded"
    files = run_code(RunCodeRequest(code="open('b.txt','w').write(open('a.txt').read()*2)", language="python",
                                    files={"a.txt": base64.b64encode(b"xy").decode()}, fetch_files=["b.txt"]))
    assert files.status == RunStatus.Success and base64.b64decode(files.files["b.txt"]) == b"xyxy"


def test_many_megabytes_of_output_come_back_capped_and_flagged(server):
    t = time.time()
    r = httpx.post(f"{server.url}/run_code", json={"code": "print('z' * (8 << 20))", "language": "python"},
                   timeout=60).json()
    assert time.time() - t < 10
    assert r["status"] == "Success" and "truncated" in r["message"]
    assert len(r["run_result"]["stdout"]) == 1 << 20


def test_jupyter_cells_share_one_kernel(server):
    r = httpx.post(f"{server.url}/run_jupyter", json={"cells": ["a = 123", "a", "print(a + 1)",
                                                                  "raise RuntimeError('x')"]}, timeout=60).json()
    assert r["status"] == "Success"
    assert r["cells"][1]["display"] == [{"text/plain": "123"}]
    assert r["cells"][2]["stdout"] == "124\n"
    assert r["cells"][3]["error"][0]["ename"] == "RuntimeError"
    # a final expression ending in ';' shows nothing, as in a notebook; a ';' inside it does not count
    cells = ["x = 'é'", "x;", "x ;  # quiet", "'a;'", "(x,\n x);", "y = 1\rx;", "x"]
    r = httpx.post(f"{server.url}/run_jupyter", json={"cells": cells}, timeout=60).json()
    assert [c["display"] for c in r["cells"]] == [[], [], [], [{"text/plain": "'a;'"}], [], [],
                                                  [{"text/plain": "'é'"}]]


def test_unknown_language_is_422_and_missing_toolchain_says_so(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "x", "language": "klingon"})
    assert r.status_code == 422 and r.json()["message"].startswith("language")
    r = httpx.post(f"{server.url}/run_code", json={"code": "x", "language": "racket"}).json()
    assert r["status"] == "SandboxError" and "toolchain" in r["message"]
    # every field of SandboxFusion's response, as its clients read it (the engine process answers a dict that
    # the route's response model completes)
    assert {k: r[k] for k in ("compile_result", "run_result", "executor_pod_name", "files")} == {
        "compile_result": None, "run_result": None, "executor_pod_name": None, "files": {}}


# -- native API and errors ------------------------------------------------------------------------

def test_submissions_are_idempotent(server):
    body = {"id": "idem-1", "job": "idem", "action": {"code": "import random\nprint(random.random())"}}
    first = httpx.post(f"{server.url}/v1/actions", json=body, timeout=30).json()
    second = httpx.post(f"{server.url}/v1/actions", json=body, timeout=30).json()
    assert first["outcome"] == "ok" and first == second
    assert httpx.get(f"{server.url}/v1/jobs/idem/stats").json()["actions"] == 1
    assert httpx.get(f"{server.url}/v1/actions/idem-1").json()["run"]["stdout"] == first["run"]["stdout"]



def test_an_id_reused_for_another_request_is_a_conflict_not_the_first_result(server):
    """An id is the idempotency key: an id reused across epochs with another program got the
    first program's result back, silently. ``wait`` alone may differ (submit, then wait)."""
    url = f"{server.url}/v1/actions"
    body = {"id": "idem-2", "job": "idem2", "action": {"code": "print(1)"}}
    first = httpx.post(url, json=body, timeout=30).json()
    assert first["outcome"] == "ok"
    assert httpx.post(url, json={**body, "wait": True}, timeout=30).json() == first
    r = httpx.post(url, json={**body, "action": {"code": "print(2)"}}, timeout=30)
    assert r.status_code == 409 and "action.code" in r.json()["message"], r.text
    r = httpx.post(url, json={**body, "cpus": [1, 2]}, timeout=30)
    assert r.status_code == 409 and "cpus" in r.json()["message"]
    slow = {"id": "idem-3", "job": "idem2", "wait": False, "action": {"code": "import time\ntime.sleep(2)"}}
    assert httpx.post(url, json=slow, timeout=30).status_code < 300
    r = httpx.post(url, json={**slow, "action": {"code": "print(3)"}}, timeout=30)  # while it runs
    assert r.status_code == 409, r.text
    assert httpx.post(url, json={**slow, "wait": True}, timeout=30).json()["outcome"] == "ok"
    assert httpx.get(f"{server.url}/v1/jobs/idem2/stats").json()["actions"] == 2



def test_session_fs_calls_are_carried_out_by_the_sandboxs_agent(server):
    """``POST /v1/sessions/{id}/fs``: anywhere the session's commands see, by the runner."""
    url = server.url
    sid = httpx.post(f"{url}/v1/sessions", json={"job": "fs"}, timeout=30).json()["session_id"]
    fs = f"{url}/v1/sessions/{sid}/fs"
    try:
        w = httpx.post(fs, json={"call": "write", "path": "/tmp/d/a.txt", "data": "aGk="}, timeout=30)
        assert w.status_code == 200 and w.json()["entry"]["size"] == 2, w.text
        assert httpx.post(fs, json={"call": "read", "path": "/tmp/d/a.txt"}, timeout=30).json()["data"] == "aGk="
        cut = httpx.post(fs, json={"call": "read", "path": "/tmp/d/a.txt", "max_bytes": 1}, timeout=30).json()
        assert (cut["data"], cut["cut"]) == ("aA==", True)
        r = httpx.post(f"{url}/v1/sessions/{sid}/exec", json={"command": "cat /tmp/d/a.txt; ln -s /proc/1/fd/4 /tmp/d/l"},
                       timeout=30).json()
        assert r["run"]["stdout"] == "hi"
        listed = httpx.post(fs, json={"call": "list", "path": "/tmp/d"}, timeout=30).json()["entries"]
        assert sorted(e["path"] for e in listed) == ["/tmp/d/a.txt", "/tmp/d/l"]
        assert httpx.post(fs, json={"call": "move", "path": "/tmp/d/a.txt", "destination": "/tmp/e/b.txt"},
                          timeout=30).json()["entry"]["path"] == "/tmp/e/b.txt"
        errors = {
            "missing": httpx.post(fs, json={"call": "stat", "path": "/tmp/nowhere"}, timeout=30),
            "exists": httpx.post(fs, json={"call": "mkdir", "path": "/tmp/e"}, timeout=30),
            "magic": httpx.post(fs, json={"call": "write", "path": "/tmp/d/l", "data": "eA=="}, timeout=30),
            "proc": httpx.post(fs, json={"call": "list", "path": "/proc/1/fd"}, timeout=30),
            "relative": httpx.post(fs, json={"call": "stat", "path": "tmp"}, timeout=30),
            "no_destination": httpx.post(fs, json={"call": "move", "path": "/tmp/e"}, timeout=30),
        }
        assert {k: r.status_code for k, r in errors.items()} == {
            "missing": 404, "exists": 409, "magic": 422, "proc": 422, "relative": 422, "no_destination": 422}
        assert errors["relative"].json()["message"].startswith("path")
        assert httpx.post(fs, json={"call": "remove", "path": "/tmp/e"}, timeout=30).json() == {
            "entry": None, "entries": None, "data": None, "cut": False}
        assert httpx.post(fs, json={"call": "stat", "path": "/tmp/e"}, timeout=30).status_code == 404
        from arl_tangram.client import TangramClient, TangramError

        with TangramClient(url) as c:  # the client's session: the same call
            sess = c.session(job="fs")
            assert sess.fs("write", "/tmp/c.txt", data=b"from the client").entry.size == 15
            assert base64.b64decode(sess.fs("read", "/tmp/c.txt").data) == b"from the client"
            with pytest.raises(TangramError) as e:
                sess.fs("stat", "/tmp/none")
            assert e.value.status == 404
            sess.close()
    finally:
        httpx.delete(f"{url}/v1/sessions/{sid}", timeout=30)

def test_an_unknown_language_is_a_422_naming_the_field(server):
    r = httpx.post(f"{server.url}/v1/actions", json={"action": {"code": "x", "language": "klingon"}}, timeout=30)
    assert r.status_code == 422 and r.json()["message"].startswith("action.language: unknown 'klingon'"), r.text

def test_errors_are_json_and_name_the_problem(server):
    r = httpx.post(f"{server.url}/v1/actions", json={"action": {"code": "x", "timeout_s": -1}})
    assert r.status_code == 422 and r.json()["message"].startswith("action.timeout_s")
    r = httpx.get(f"{server.url}/v1/actions/nope")
    assert r.status_code == 404 and "nope" in r.json()["message"]
    r = httpx.post(f"{server.url}/v1/sessions/nope/exec", json={"command": "ls"})
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/run_code", content=b"{" + b" " * (40 << 20) + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["message"]
    r = httpx.post(f"{server.url}/v1/actions", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "message" in r.json()


def test_async_client_batches_yield_as_they_finish(server):
    from arl_tangram.client import AsyncTangramClient

    async def main():
        async with AsyncTangramClient(server.url) as c:
            progs = [{"code": f"import time\ntime.sleep({3 if i == 0 else 0})\nprint({i})"} for i in range(6)]
            return [r.run.stdout.strip() async for r in c.run_batch(progs, concurrency=6)]

    order = asyncio.run(main())
    assert sorted(order) == [str(i) for i in range(6)] and order[-1] == "0"


def test_full_queue_answers_429_with_retry_after(tmp_path):
    s = Server(tmp_path, config={"max_queue": 1, "cores": 1})
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(*(c.post(f"{s.url}/run_code", json={
                    "code": "import time\ntime.sleep(0.5)", "language": "python"}) for _ in range(8)))
                return rs

        rs = asyncio.run(main())
        codes = [r.status_code for r in rs]
        assert 429 in codes and 200 in codes
        busy = next(r for r in rs if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and "queue is full" in busy.json()["message"]
    finally:
        s.stop()


def test_a_token_is_required_when_configured(tmp_path):
    s = Server(tmp_path, token="s3cret")
    try:
        assert httpx.post(f"{s.url}/run_code", json={"code": "1", "language": "python"}).status_code == 401
        ok = httpx.post(f"{s.url}/run_code", json={"code": "1", "language": "python"},
                        headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
    finally:
        s.stop()
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "serve", "--host", "0.0.0.0"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and "token" in p.stderr


def test_api_keys_in_the_config_are_checked_field_by_field(tmp_path):
    from arl_tangram.server.config import ConfigError, load

    def cfg(keys):
        path = tmp_path / "keys.json"
        path.write_text(json.dumps({"api_keys": keys}))
        return path

    with pytest.raises(ConfigError, match="api_keys.0.key: .*at least 16"):
        load(cfg([{"key": "short", "job": "a"}]))
    with pytest.raises(ConfigError, match="api_keys.0.job: Field required"):
        load(cfg([{"key": "k" * 16}]))
    with pytest.raises(ConfigError, match="api_keys: .*the same key is given twice"):
        load(cfg([{"key": "k" * 16, "job": "a"}, {"key": "k" * 16, "job": "b"}]))
    assert load(cfg([{"key": "k" * 16, "job": "a"}])).keys() == {"k" * 16: "a"}


def test_a_second_server_on_a_busy_journal_refuses_to_start_and_the_first_runs_its_job_once(tmp_path):
    """Two servers on one journal ran a job twice: the second "recovered" the first one's running
    action. Now the second refuses, naming the journal, the holder's pid and ``--journal``."""
    a = Server(tmp_path)
    try:
        r = httpx.post(f"{a.url}/v1/actions", json={"id": "slow-once", "wait": False, "action": {
            "code": "import time\ntime.sleep(3)\nprint('done')", "language": "python"}}, timeout=30)
        assert r.status_code in (200, 202), r.text
        second = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "serve", "--port", "9",
                                 "--journal", a.journal], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        err = " ".join((second.stdout + second.stderr).split())
        assert a.journal in err and f"pid {a.proc.pid}" in err and "--journal" in err, err
        deadline = time.time() + 30
        while (r := httpx.get(f"{a.url}/v1/actions/slow-once").json())["state"] != "done" and time.time() < deadline:
            time.sleep(0.2)
        assert r["outcome"] == "ok" and r["run"]["stdout"] == "done\n", r
    finally:
        a.stop()
    db = sqlite3.connect(a.journal)
    try:
        assert db.execute("SELECT count(*) FROM actions WHERE id='slow-once'").fetchone() == (1,)
    finally:
        db.close()
    b = Server(tmp_path, journal=a.journal)  # the lock went with the first server: a restart is not blocked
    try:
        assert httpx.get(f"{b.url}/healthz").json()["recovered"] == {"rerun": 0, "infra_error": 0, "rejected": 0}
    finally:
        b.stop()


# -- load and crash ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_thousand_concurrent_clients_all_get_their_results(server):
    async def main():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            async def one(i):
                r = await c.post(f"{server.url}/run_code", json={"code": f"print({i})", "language": "python"})
                return r.status_code, r.json()
            return await asyncio.gather(*(one(i) for i in range(1000)))

    results = asyncio.run(main())
    assert all(code == 200 for code, _ in results)
    assert [body["run_result"]["stdout"] for _, body in results] == [f"{i}\n" for i in range(1000)]


def test_top_shows_the_jobs_of_a_live_server(server):
    httpx.post(f"{server.url}/run_code", json={"code": "print(1)", "language": "python"}, timeout=30)
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "top", "--url", server.url, "--once"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert p.returncode == 0, p.stderr
    assert "sandboxfusion" in p.stdout and "queued" in p.stdout
    cores = httpx.get(f"{server.url}/healthz").json()["cores"]
    assert "local cluster" in p.stdout and f"{cores}/{cores}" in p.stdout and "alive" in p.stdout
    # not on a terminal (a pipe, a log file): plain timestamped snapshots, one per interval, as it goes
    try:  # it runs until stopped: what it printed in 4 s
        out = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "top", "--url", server.url, "--interval", "0.2"],
                             capture_output=True, text=True, timeout=4, env={**os.environ, "COLUMNS": "160"}).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    lines = out.splitlines()
    frames = [line for line in lines if line.startswith("--- ") and server.url in line]
    assert len(frames) >= 2 and any("queued" in line for line in lines), "".join(lines)[-2000:]
    down = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "top", "--url", "http://127.0.0.1:9", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 2 and "cannot reach" in down.stderr


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=20), lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=12)
snippets = st.sampled_from(["print(1)", "", "1/0", "import sys; sys.exit(3)", "print('é' * 10)", "x = (",
                            "int main(){}", "echo hi", "\x00", "print(input())"])


@st.composite
def bodies(draw):
    """Mostly well-formed bodies with one field broken, and some plain garbage."""
    base = {"code": draw(snippets), "language": draw(st.sampled_from(["python", "bash", "cpp", "go", "x", 7, None])),
            "run_timeout": draw(st.sampled_from([1, 0.5, -1, 0, "x", None, 1e308])),
            "stdin": draw(st.one_of(st.none(), st.text(max_size=20), st.integers())),
            "files": draw(st.one_of(st.just({}), st.dictionaries(st.text(max_size=5), st.one_of(
                st.none(), st.text(max_size=8)), max_size=2), json_values)),
            "fetch_files": draw(st.one_of(st.just([]), st.lists(st.text(max_size=10), max_size=3), json_values))}
    if draw(st.booleans()):
        base[draw(st.sampled_from(list(base)))] = draw(json_values)
    return draw(st.one_of(st.just(base), json_values))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(path=st.sampled_from(["/run_code", "/v1/actions", "/run_jupyter", "/v1/sessions", "/v1/sessions/x/exec"]),
       body=bodies())
def test_fuzzing_the_api_finds_no_500(server, path, body):
    if path == "/v1/actions" and isinstance(body, dict):
        body = {"action": {k: v for k, v in body.items() if k in ("code", "language", "stdin", "files")},
                "id": body.get("stdin"), "job": body.get("language")}
    if path == "/run_jupyter" and isinstance(body, dict):
        body = {"cells": [body.get("code")], "total_timeout": body.get("run_timeout"), "files": body.get("files")}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    assert "message" in r.json() or r.status_code in (200, 201, 202)


def test_model_services_over_http(tmp_path):
    pytest.importorskip("torch")
    from arl_tangram.client import TangramClient, TangramError

    s = Server(tmp_path, config={"models": [
        {"name": "rm", "loader": "arl_tangram.managers.models.tiny:reward_model"},
        {"name": "teacher", "loader": "arl_tangram.managers.models.tiny:teacher_model", "kwargs": {"seed": 3}}]})
    try:
        with TangramClient(s.url) as c:
            r = c.score("rm", [1, 2, 3])
            assert r.outcome == "ok" and isinstance(r.value, float)
            lp = c.logprobs("teacher", [5, 6, 7, 8])
            assert lp.outcome == "ok" and len(lp.value) == 3 and all(v < 0 for v in lp.value)
            with pytest.raises(TangramError, match="out of range"):
                c.score("rm", [1, 10**9])
        for body, named in (({"tokens": [1, 10**9]}, "tokens: id 1000000000 out of range"),
                            ({"tokens": []}, "tokens: empty")):
            r = httpx.post(f"{s.url}/v1/models/rm/score", json=body)
            assert r.status_code == 422 and r.json()["message"].startswith(named), r.text
        r = httpx.post(f"{s.url}/v1/models/teacher/logprobs", json={"tokens": [5]})
        assert r.status_code == 422 and r.json()["message"].startswith("tokens:"), r.text
        assert httpx.post(f"{s.url}/v1/models/ghost/score", json={"tokens": [1]}).status_code == 404
        assert httpx.post(f"{s.url}/v1/models/rm/score", json={"tokens": "abc"}).status_code == 422
    finally:
        s.stop()


def test_sandboxfusion_runs_are_journaled_whole_for_recovery(server):
    files = {"in.txt": base64.b64encode(b"data").decode()}
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(open('in.txt').read())", "language": "python",
                                                   "files": files}, timeout=30).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "data\n"
    db = sqlite3.connect(server.journal)
    deadline = time.monotonic() + 10  # a one-shot is answered before its row's commit (journal.COMMIT_LATER_S)
    while True:
        row = db.execute("SELECT job, request FROM actions WHERE id LIKE 'sf-%' AND request LIKE '%in.txt%' "
                         "ORDER BY accepted_at DESC LIMIT 1").fetchone()
        if row is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert row is not None, "the run's row never reached the journal"
    job, request = row
    assert job == "sandboxfusion"
    spec = json.loads(request)
    assert spec["job"] == "sandboxfusion" and spec["action"]["files"] == files  # a re-run is the same program


def test_bad_cpu_ranges_are_422_naming_the_field_and_never_journaled(server, tmp_path):
    for body in ({"action": {"code": "print(1)"}, "cpus": [3, 1]},
                 {"action": {"code": "print(1)"}, "cpus": [0, 0]},
                 {"action": {"code": "print(1)"}, "cpus": [10_000, 10_000]},
                 {"id": "too-many-cores", "action": {"code": "print(1)"}, "cpus": [4000, 4000]}):
        r = httpx.post(f"{server.url}/v1/actions", json=body, timeout=30)
        assert r.status_code == 422, r.text
        assert r.json()["message"].startswith("cpus"), r.text
    assert httpx.get(f"{server.url}/v1/actions/too-many-cores").status_code == 404  # not journaled
    sid = httpx.post(f"{server.url}/v1/sessions", json={}).json()["session_id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"command": "true", "cpus": [2, 1]})
    assert r.status_code == 422 and r.json()["message"].startswith("cpus"), r.text
    httpx.delete(f"{server.url}/v1/sessions/{sid}")


def test_recovery_finishes_what_it_cannot_run_with_its_reason(tmp_path):
    from arl_tangram.server.journal import Journal
    path = tmp_path / "journal.sqlite3"
    j = Journal(str(path))
    j.accept("bad-range", "j", "run_code", {"action": {"code": "print(1)"}, "cpus": [3, 1]}, True)
    j.accept("bad-file", "j", "run_code", {"action": {"code": "print(1)", "files": {"a": "%%%"}}}, True)
    j.accept("fine", "j", "run_code", {"id": "fine", "action": {"code": "print(6 * 7)"}}, True)
    j.close()
    s = Server(tmp_path, journal=path)
    try:
        assert httpx.get(f"{s.url}/healthz").json()["recovered"] == {"rerun": 1, "infra_error": 0, "rejected": 2}
        for id, field in (("bad-range", "cpus"), ("bad-file", "action.files.a")):
            r = httpx.get(f"{s.url}/v1/actions/{id}").json()
            assert r["state"] == "done" and r["outcome"] == "rejected" and field in r["message"], r["message"]
        deadline = time.time() + 30
        while (r := httpx.get(f"{s.url}/v1/actions/fine").json())["state"] != "done" and time.time() < deadline:
            time.sleep(0.1)
        assert r["outcome"] == "ok" and r["run"]["stdout"] == "42\n", r
    finally:
        s.stop()
    assert "never retrieved" not in (tmp_path / f"server-{s.port}.log").read_text()
    s2 = Server(tmp_path, journal=path)  # nothing is left to recover a second time
    try:
        assert httpx.get(f"{s2.url}/healthz").json()["recovered"] == {"rerun": 0, "infra_error": 0, "rejected": 0}
    finally:
        s2.stop()


# -- SandboxFusion's exact answers (read from its source: sandbox/server/sandbox_api.py's
# parse_run_status, runners/base.py's run_command_bare, runtime/jupyter/main.py) -----------------------

def test_sandboxfusion_timeout_answer(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "print('started', flush=True)\nwhile True: pass",
                                                   "language": "python", "run_timeout": 0.5}, timeout=60).json()
    assert r["status"] == "Failed" and r["message"] == ""
    run = r["run_result"]
    assert run["status"] == "TimeLimitExceeded" and run["return_code"] is None and run["stdout"] == "started\n"
    assert r["compile_result"] is None


def test_sandboxfusion_memory_limit_is_a_memory_error_inside_the_program(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "x = bytearray(400 << 20)\nprint('no')",
                                                   "language": "python", "memory_limit_MB": 128}, timeout=60).json()
    assert r["status"] == "Failed" and r["message"] == ""
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] == 1
    assert r["run_result"]["stderr"].rstrip().endswith("MemoryError"), r["run_result"]["stderr"]
    ok = httpx.post(f"{server.url}/run_code", json={"code": "x = bytearray(16 << 20)\nprint('yes')",
                                                    "language": "python", "memory_limit_MB": 128}, timeout=60).json()
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "yes\n", ok


def test_what_json_carries_but_no_program_can_take_is_422_naming_the_field(server):
    """From an audit: a lone surrogate in the code or stdin was a 500 (the journal's JSON could not
    hold it), a memory limit past 2**63 bytes made ``print(1)`` fail with the harness's own
    OverflowError, and /run_jupyter's too-small limit was an internal error."""
    raw = {"content-type": "application/json"}
    for path, body, field in [
            ("/run_code", b'{"code":"\\ud800","language":"python"}', "code"),
            ("/run_code", b'{"code":"print(1)","language":"python","stdin":"\\udfff"}', "stdin"),
            ("/v1/actions", b'{"action":{"code":"print(1)\\n#\\ud800"}}', "action.code"),
            ("/run_jupyter", b'{"cells":["print(1)","\\ud800"]}', "cells.1")]:
        r = httpx.post(f"{server.url}{path}", content=body, headers=raw, timeout=30)
        assert r.status_code == 422 and r.json()["message"].startswith(field), (path, r.text)
    for path, body, field in [
            ("/run_code", {"code": "print(1)", "language": "python", "memory_limit_MB": 9 * 10**12}, "memory_limit_MB"),
            ("/v1/actions", {"action": {"code": "print(1)", "memory_mb": 10**30}}, "action.memory_mb"),
            ("/run_jupyter", {"cells": ["print(1)"], "memory_limit_MB": 8}, "memory_limit_MB")]:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 422 and r.json()["message"].startswith(field), (path, r.text)


def test_a_file_the_run_cannot_be_given_is_failed_saying_why_on_both_dialects(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(1)", "language": "python",
                                                   "files": {"/etc/passwd": "eA=="}}, timeout=60).json()
    assert r["status"] == "Failed" and "outside the workspace" in r["message"] and r["run_result"] is None, r
    r = httpx.post(f"{server.url}/run_jupyter", json={"cells": ["print(1)"], "files": {"../../etc/x": "eA=="}},
                   timeout=60).json()
    assert r["status"] == "Failed" and "outside the workspace" in r["message"], r  # the caller's, not ours


def test_fetched_files_are_bounded_together_and_never_block(server):
    """Four 14 MiB files overflowed the sandbox's answer line (``infra_error``); a FIFO blocked the
    fetch until the run's deadline; /dev/zero read 16 MiB. Now: cut together at 40 MiB and said
    so, and what is not a regular file is not fetched."""
    code = "for i in range(4): open(f'f{i}', 'wb').write(b'a' * (14 << 20))"
    r = httpx.post(f"{server.url}/run_code", json={"code": code, "language": "python",
                                                   "fetch_files": ["f0", "f1", "f2", "f3"]}, timeout=120).json()
    assert r["status"] == "Success", r["message"]
    sizes = {k: len(base64.b64decode(v)) for k, v in r["files"].items()}
    assert sizes == {"f0": 14 << 20, "f1": 14 << 20, "f2": 12 << 20, "f3": 0}, sizes
    assert r["message"] == "fetched files cut at their size limit: f2, f3"
    code = "import os\nos.mkfifo('fifo')\nos.symlink('/dev/zero', 'zero')\nprint('done')"
    t = time.monotonic()
    r = httpx.post(f"{server.url}/run_code", json={"code": code, "language": "python", "run_timeout": 5,
                                                   "fetch_files": ["fifo", "zero"]}, timeout=60).json()
    assert time.monotonic() - t < 4 and r["status"] == "Success" and r["run_result"]["stdout"] == "done\n", r
    assert r["files"] == {}


def test_sandboxfusion_notebook_errors_go_in_the_cell_error_not_stderr(server):
    r = httpx.post(f"{server.url}/run_jupyter", json={"cells": ["print('before')\n1 / 0", "print('after')"]},
                   timeout=60).json()
    assert r["status"] == "Success" and r["message"] == ""
    first, second = r["cells"]
    assert first["stdout"] == "before\n" and first["stderr"] == ""
    err = first["error"][0]
    assert err["ename"] == "ZeroDivisionError" and err["evalue"] == "division by zero"
    assert any("ZeroDivisionError" in line for line in err["traceback"])
    assert second["stdout"] == "after\n"  # later cells still run, as in SandboxFusion


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ toolchain")
def test_sandboxfusion_compile_error_answer(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "int main() { return x; }", "language": "cpp"},
                   timeout=60).json()
    assert r["status"] == "Failed" and r["message"] == "" and r["run_result"] is None
    c = r["compile_result"]
    assert c["status"] == "Finished" and c["return_code"] != 0 and "error" in c["stderr"]


def test_http_method_and_route_errors_have_fastapis_body(server):
    r = httpx.get(f"{server.url}/run_code")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = httpx.get(f"{server.url}/no/such/route")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_names_that_become_paths_are_4xx_naming_the_field_and_unknown_fields_are_named(server):
    """A NUL byte in an image or file name reached ``os`` (a 500, or a run ``Failed`` with no
    record of why); a misspelled native field (``timeout`` for ``timeout_s``) was ignored."""
    cases = [("/v1/sessions", {"image": "a\u0000b"}, "image"),
             ("/v1/pools/prewarm", {"image": "../x", "n": 1}, "image"),
             ("/run_code", {"code": "print(1)", "language": "python", "files": {"a\u0000b": "aGk="}}, "files"),
             ("/run_code", {"code": "print(1)", "language": "python", "fetch_files": ["x\u0000"]}, "fetch_files"),
             ("/run_jupyter", {"cells": ["1"], "files": {"\u0000": None}}, "files"),
             ("/v1/actions", {"action": {"code": "print(1)", "files": {"a\u0000b": "aGk="}}}, "action.files"),
             ("/v1/actions", {"action": {"code": "print(1)", "timeout": 3}}, "unknown field: action.timeout"),
             ("/v1/sessions", {"imag": "x", "jb": "y"}, "unknown fields: imag, jb")]
    for path, body, named in cases:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 422 and r.json()["message"].startswith(named), (path, r.status_code, r.text)
    sid = httpx.post(f"{server.url}/v1/sessions", json={}).json()["session_id"]
    try:
        r = httpx.get(f"{server.url}/v1/sessions/{sid}/files", params={"path": "a\u0000b"})
        assert r.status_code == 422 and r.json()["message"].startswith("path:"), r.text
    finally:
        httpx.delete(f"{server.url}/v1/sessions/{sid}")
    # SandboxFusion's routes keep SandboxFusion's behaviour: its request models ignore unknown fields
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(6*7)", "language": "python", "bogus": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
