"""The clients without a server: httpx's MockTransport is the test double at the transport seam,
so these run on any host. Live-server tests of the clients are in test_server.py."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

import httpx
import pytest

from arl_tangram.api import v1
from arl_tangram.client import AsyncTangramClient, Request, RetryPolicy, TangramClient, TangramError
from arl_tangram.client.base import Methods, SessionMethods, read

URL = "http://tangram.test"


def done(id: str, outcome: str = "ok") -> dict:
    return v1.ActionResult(id=id, state="done", outcome=outcome, act_s=0.01).model_dump()


SNAP = {"snapshot": "snap-" + "0" * 32, "bytes": 10240, "session_id": "t1", "job": "j"}


def server_double(request: httpx.Request) -> httpx.Response:
    """Answers every route of the native API the way ``tangram serve`` does, from canned data."""
    path, method = request.url.path, request.method
    body = json.loads(request.content) if request.content else None
    if path == "/v1/actions" and method == "POST":
        return httpx.Response(200 if body["wait"] else 202, json=done(body["id"]) | (
            {} if body["wait"] else {"state": "queued", "outcome": None}))
    if path.startswith("/v1/actions/"):
        return httpx.Response(200, json=done(path.split("/")[3], "cancelled" if path.endswith("cancel") else "ok"))
    if path == "/v1/sessions":
        return httpx.Response(201, json={"session_id": body["trajectory"], "job": body["job"]})
    if path.endswith("/fork"):
        return httpx.Response(200, json={"outcome": "ok", "session_ids": [f"k{i}" for i in range(body["n"])]})
    if path.endswith("/snapshot"):
        return httpx.Response(201, json=SNAP)
    if path == "/v1/snapshots":
        return httpx.Response(200, json=[SNAP])
    if path == "/v1/images":
        return httpx.Response(200, json=[{"name": "py", "id": "abc", "size_bytes": 3, "created": 1.0, "layers": 2}])
    if path == "/v1/pools/prewarm":
        return httpx.Response(200, json={"image": body["image"], "requested": body["n"], "ready": body["n"],
                                         "idle_total": body["n"], "cap": 64})
    if path.endswith("/exec") or (path.endswith("/files") and method == "PUT"):
        return httpx.Response(200, json=done("x-1"))
    if path.endswith("/files"):
        paths = request.url.params.get_list("path")
        return httpx.Response(200, json={"files": {p: base64.b64encode(b"hi").decode() for p in paths if p != "nope"},
                                         "missing": ["nope"] if "nope" in paths else []})
    if method == "DELETE":
        return httpx.Response(204)
    if path.startswith("/v1/models/"):
        return httpx.Response(200, json={"outcome": "ok", "value": float(len(body["tokens"])), "act_s": 0.1})
    stats = {"job": "j", "actions": 3, "outcomes": {"ok": 3}, "avg_act_s": 0.1}
    if path == "/v1/jobs":
        return httpx.Response(200, json=[stats])
    if path == "/v1/jobs/j/stats":
        return httpx.Response(200, json=stats)
    if path == "/healthz":
        return httpx.Response(200, json={"status": "ok", "queued": 0})
    return httpx.Response(404, json={"message": "Not Found"})


def recording(handler, log: list):
    def record(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        log.append((request.method, request.url.path, str(request.url.params), body))
        return handler(request)
    return httpx.MockTransport(record)


# The whole method set, each as (name, args, kwargs); sessions are exercised through one session.
CALLS = [("run_code", ("print(1)",), {"id": "a1", "stdin": "x", "files": {"f": b"1"}, "cpus": (1, 4)}),
         ("submit", ("print(2)",), {"id": "a2", "job": "j", "timeout_s": 3.0}),
         ("get", ("a2",), {}), ("cancel", ("a2",), {}),
         ("score", ("rm", [1, 2, 3]), {}), ("logprobs", ("teacher", [1, 2]), {"job": "j"}),
         ("stats", ("j",), {}), ("jobs", (), {}), ("health", (), {}), ("snapshots", (), {}),
         ("delete_snapshot", (SNAP["snapshot"],), {}), ("images", (), {}), ("prewarm", ("py", 2), {})]
SESSION_CALLS = [("snapshot", (), {}), ("exec", ("ls",), {}), ("exec", (), {"python": "x = 1", "timeout_s": 2.0}),
                 ("put_files", ({"a.txt": b"hi"},), {}), ("get_files", (["a.txt", "nope"],), {}), ("close", (), {})]


def run_sync(log):
    out = []
    with TangramClient(URL, transport=recording(server_double, log), backoff_s=0) as c:
        out += [getattr(c, name)(*a, **kw) for name, a, kw in CALLS]
        s = c.session(job="j", trajectory="t1")
        out += [getattr(s, name)(*a, **kw) for name, a, kw in SESSION_CALLS]
        with pytest.raises(TangramError) as e:
            c.cluster()
    return out, e.value.status


def run_async(log):
    async def main():
        out = []
        async with AsyncTangramClient(URL, transport=recording(server_double, log), backoff_s=0) as c:
            out += [await getattr(c, name)(*a, **kw) for name, a, kw in CALLS]
            s = await c.session(job="j", trajectory="t1")
            out += [await getattr(s, name)(*a, **kw) for name, a, kw in SESSION_CALLS]
            with pytest.raises(TangramError) as e:
                await c.cluster()
        return out, e.value.status
    return asyncio.run(main())


def test_sync_and_async_clients_send_the_same_requests_and_return_the_same_results():
    sync_log, async_log = [], []
    sync_out, sync_404 = run_sync(sync_log)
    async_out, async_404 = run_async(async_log)
    assert sync_log == async_log and sync_out == async_out and sync_404 == async_404 == 404
    assert len(sync_log) == len(CALLS) + 1 + len(SESSION_CALLS) + 1  # + open session + cluster
    by_name = dict(zip([n for n, _, _ in CALLS] + ["snapshot", "exec", "exec2", "put_files", "get_files", "close"], sync_out))
    assert by_name["run_code"].outcome == "ok" and by_name["submit"].state == "queued"
    assert by_name["cancel"].outcome == "cancelled" and by_name["logprobs"].value == 2.0
    assert by_name["jobs"][0].outcomes == {"ok": 3} and by_name["health"]["status"] == "ok"
    assert by_name["get_files"] == {"a.txt": b"hi"} and by_name["close"] is None
    method, path, _, body = sync_log[0]
    assert (method, path) == ("POST", "/v1/actions") and body["id"] == "a1" and body["cpus"] == [1, 4]
    assert body["action"]["files"] == {"f": base64.b64encode(b"1").decode()} and body["action"]["stdin"] == "x"
    assert ("DELETE", "/v1/sessions/t1", "", None) in sync_log
    assert by_name["snapshot"].snapshot == SNAP["snapshot"] and by_name["snapshots"][0].bytes == 10240
    assert by_name["images"][0].name == "py" and by_name["prewarm"].ready == 2 and by_name["delete_snapshot"] is None
    assert ("GET", "/v1/sessions/t1/files", "path=a.txt&path=nope", None) in sync_log


def test_both_clients_expose_the_complete_method_set():
    wanted = {"run_code", "submit", "get", "cancel", "run_batch", "session", "score", "logprobs", "stats", "jobs",
              "health", "cluster", "close", "restore", "snapshots", "delete_snapshot", "images", "prewarm"}

    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_")} - {"policy"}

    assert wanted <= public(TangramClient) and public(TangramClient) == public(AsyncTangramClient)
    assert {"exec", "put_files", "get_files", "close", "fork", "snapshot"} <= public(SessionMethods)
    for cls in (TangramClient, AsyncTangramClient):  # the method set is inherited, never redefined
        assert not [n for n in vars(cls) if n in vars(Methods) and not n.startswith("_")]


def test_both_clients_fork_and_restore_into_sessions_of_their_own_kind():
    sync_log, async_log = [], []
    with TangramClient(URL, transport=recording(server_double, sync_log)) as c:
        kids = c.session(job="j", trajectory="t1").fork(2)
        back = c.restore(SNAP["snapshot"], job="j", trajectory="t2")
        sync = [(type(k).__name__, k.id, k.job) for k in (*kids, back)]

    async def main():
        async with AsyncTangramClient(URL, transport=recording(server_double, async_log)) as c:
            kids = await (await c.session(job="j", trajectory="t1")).fork(2)
            back = await c.restore(SNAP["snapshot"], job="j", trajectory="t2")
            return [(type(k).__name__, k.id, k.job) for k in (*kids, back)]

    aio = asyncio.run(main())
    assert sync_log == async_log
    assert sync == [("Session", "k0", "j"), ("Session", "k1", "j"), ("Session", "t2", "j")]
    assert aio == [("AsyncSession", "k0", "j"), ("AsyncSession", "k1", "j"), ("AsyncSession", "t2", "j")]
    assert sync_log[1] == ("POST", "/v1/sessions/t1/fork", "", {"n": 2})
    assert sync_log[2][3] == {"job": "j", "trajectory": "t2", "restore": SNAP["snapshot"]}


def test_a_fork_the_server_refused_raises_naming_why():
    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/fork"):
            return httpx.Response(200, json={"outcome": "rejected", "message": "fork: child ids must be new"})
        return server_double(request)

    with TangramClient(URL, transport=httpx.MockTransport(refuse)) as c:
        with pytest.raises(TangramError, match="child ids must be new") as e:
            c.session(trajectory="t").fork(1)
    assert e.value.status == 422


def test_a_new_session_is_named_by_the_client_so_a_retried_open_is_idempotent():
    log = []
    with TangramClient(URL, transport=recording(server_double, log)) as c:
        s = c.session(job="j")
    assert s.id.startswith("s-") and log[0][3] == {"job": "j", "trajectory": s.id}


def flaky(failures: list, log: list):
    """Fails the first requests as ``failures`` says (an exception or a status), then answers."""
    def handle(request: httpx.Request) -> httpx.Response:
        log.append(json.loads(request.content) if request.content else None)
        if failures:
            f = failures.pop(0)
            if isinstance(f, Exception):
                raise f
            return httpx.Response(f, json={"message": "busy"}, headers={"retry-after": "0"})
        return server_double(request)
    return httpx.MockTransport(handle)


@pytest.mark.parametrize("failure,resent", [(httpx.ConnectError("refused"), True), (httpx.ReadError("reset"), False),
                                            (429, True), (503, False)])
def test_exec_is_resent_only_when_it_cannot_have_run(failure, resent):
    log, failures = [], []
    with TangramClient(URL, transport=flaky(failures, log), backoff_s=0) as c:
        s = c.session(trajectory="t")
        log.clear()
        failures.append(failure)
        if resent:
            assert s.exec("echo once").outcome == "ok"
        else:
            with pytest.raises((httpx.ReadError, TangramError)):
                s.exec("echo once")
    assert len(log) == (2 if resent else 1)


@pytest.mark.parametrize("failure", [httpx.ReadError("reset"), 503, 502])
def test_idempotent_requests_are_resent_after_an_unknown_fate(failure):
    log = []
    with TangramClient(URL, transport=flaky([failure, failure], log), backoff_s=0) as c:
        assert c.get("a1").outcome == "ok"
    assert len(log) == 3


def test_retries_end_with_the_servers_error():
    with TangramClient(URL, transport=flaky([503] * 3, []), retries=2, backoff_s=0) as c:
        with pytest.raises(TangramError) as e:
            c.health()
    assert e.value.status == 503 and e.value.message == "busy"


def test_verdict_table():
    p = RetryPolicy(retries=2, backoff_s=1.0)
    get, exec_ = Request("GET", "/x"), Request("POST", "/v1/sessions/s/exec", {}, idempotent=False)
    busy = httpx.Response(429, headers={"retry-after": "7"})
    assert p.verdict(get, 0, busy, None) == 7.0 and p.verdict(exec_, 1, busy, None) == 7.0
    assert p.verdict(get, 2, busy, None) is None  # retries spent
    assert 0.5 <= p.verdict(get, 0, httpx.Response(500), None) <= 1.5
    assert 1.0 <= p.verdict(get, 1, httpx.Response(500), None) <= 3.0  # exponential
    assert p.verdict(exec_, 0, httpx.Response(500), None) is None
    assert p.verdict(get, 0, httpx.Response(404), None) is None and p.verdict(get, 0, httpx.Response(200), None) is None
    assert p.verdict(exec_, 0, None, httpx.ConnectTimeout("t")) is not None
    assert p.verdict(exec_, 0, None, httpx.ReadTimeout("t")) is None


def test_reading_responses():
    assert read(httpx.Response(204)) is None
    assert read(httpx.Response(200, json={"a": 1})) == {"a": 1}
    with pytest.raises(TangramError, match="HTTP 422: action.code: Field required"):
        read(httpx.Response(422, json={"message": "action.code: Field required"}))
    with pytest.raises(TangramError, match="not JSON") as e:
        read(httpx.Response(502, text="<html>bad gateway</html>"))
    assert e.value.status == 502


def test_an_infra_error_run_is_rerun_under_derived_ids_until_it_is_not():
    outcomes, log = ["infra_error", "infra_error", "ok"], []

    def handle(request):
        body = json.loads(request.content)
        log.append(body["id"])
        return httpx.Response(200, json=done(body["id"], outcomes.pop(0)))

    with TangramClient(URL, transport=httpx.MockTransport(handle), backoff_s=0) as c:
        r = c.run_code("print(1)", id="job-7")
    assert r.outcome == "ok" and log == ["job-7", "job-7:retry-1", "job-7:retry-2"]

    outcomes[:] = ["infra_error"] * 3
    log.clear()

    async def main():
        async with AsyncTangramClient(URL, transport=httpx.MockTransport(handle), retries=2, backoff_s=0) as c:
            return await c.run_code("print(1)", id="job-8")

    assert asyncio.run(main()).outcome == "infra_error" and log == ["job-8", "job-8:retry-1", "job-8:retry-2"]


def test_an_unknown_option_names_itself():
    with TangramClient(URL, transport=httpx.MockTransport(server_double)) as c:
        with pytest.raises(TypeError, match="timeout'"):
            c.run_code("print(1)", timeout=3)


def test_transport_errors_are_retried_against_a_closed_port_then_raised():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    t = time.time()
    with TangramClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05) as c:
        with pytest.raises(httpx.ConnectError):
            c.health()
    assert time.time() - t >= 0.05 * 0.5 * (1 + 2)  # two backoffs happened
