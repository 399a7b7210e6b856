"""The E2B dialect's routes: E2B's control plane (REST), envd (Connect-RPC with the JSON codec,
and its ``/files`` and ``/health``), and the code interpreter (``/execute``, ``/contexts``), all
on the server's one port. The SDKs send a sandbox's requests to the server's URL with
``E2b-Sandbox-Id`` (and ``E2b-Sandbox-Port``: 49983 envd, 49999 the code interpreter) and its
``X-Access-Token``; the paths of envd and the interpreter do not collide, so the path picks the
handler and the header the sandbox. Every error is E2B's shape: ``{"code": int, "message"}`` on
REST and HTTP routes, a Connect error (``{"code": "not_found", ...}``, or an end-of-stream
frame) on RPC routes, and a plain 502 for a sandbox that is gone, as E2B's proxy answers.

These routes parse their own bodies (no FastAPI models) so that a bad one is answered in E2B's
shape; they are left out of the OpenAPI (it documents the native API; E2B documents its own).
"""

from __future__ import annotations

import base64
import codecs
import json
import logging
import time
import urllib.parse
from typing import Any, Callable, Sequence

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ...link import PeerGone, RemoteFault
from ..dialect import answer
from ..forms import form_parts, json_object
from . import envelope
from .envelope import E2bError

log = logging.getLogger(__name__)

SANDBOX_ID = "e2b-sandbox-id"
ACCESS_TOKEN = "x-access-token"
#: seconds between keepalive events of a quiet process stream (the client asks for at most 50)
KEEPALIVE_S = 30.0
CHUNK = 1 << 16  # bytes of output per data event
#: the stream's own deadline ends this much before the client's (which counts from its send)
DEADLINE_MARGIN_S = 0.1
PAGE_MAX = 100
#: a cell's partial line (no newline yet) goes out after the cell has been quiet this long
PARTIAL_S = 0.2


def is_e2b(request: Request) -> bool:
    """A request E2B's clients made (a sandbox's, or the control plane's): its errors are in E2B's
    shape, routing errors included (``server/app.py``)."""
    p = request.url.path
    return SANDBOX_ID in request.headers or p.startswith(("/sandboxes", "/v2/sandboxes", "/templates"))


def _fault(e: BaseException) -> E2bError:
    """What an unexpected failure is, in E2B's terms: never the caller's fault."""
    if isinstance(e, E2bError):
        return e
    if isinstance(e, PeerGone):
        return E2bError(503, str(e), "unavailable")
    name = e.type_name if isinstance(e, RemoteFault) else type(e).__name__
    if not isinstance(e, RemoteFault):
        log.error("E2B route failed", exc_info=e)
    return E2bError(500, f"internal error: {name}", "internal")


async def _call(fn: Callable[[], Any]) -> Any:
    return await answer(fn())


async def _rest(fn: Callable[[], Any], status: int = 200, shape: Callable[[Any], Any] | None = None) -> Response:
    try:
        value = await _call(fn)
    except Exception as e:
        err = _fault(e)
        return JSONResponse(err.rest(), status_code=err.status)
    if status == 204:
        return Response(status_code=204)
    return JSONResponse(shape(value) if shape else value, status_code=status)


async def _rest_body(request: Request, fn: Callable[[dict], Any], status: int = 200) -> Response:
    """``_rest`` of a call that takes the request's JSON body (a body that is not a JSON object is
    a 400 naming it, before any call)."""
    try:
        body = await _json(request)
    except E2bError as e:
        return JSONResponse(e.rest(), status_code=e.status)
    return await _rest(lambda: fn(body), status)


def _rpc_error(err: E2bError) -> Response:
    if err.status == 502:  # the sandbox is gone: E2B's proxy answers, not envd
        return JSONResponse(err.rest(), status_code=502)
    return JSONResponse(err.rpc(), status_code=envelope.HTTP_STATUS.get(err.code, 500))


async def _json(request: Request) -> dict:
    return await json_object(request, E2bError)


def _sid(request: Request) -> str:
    sid = request.headers.get(SANDBOX_ID)
    if not sid:
        raise E2bError(400, "E2b-Sandbox-Id: the header naming the sandbox is missing")
    return sid


def _token(request: Request) -> str | None:
    return request.headers.get(ACCESS_TOKEN)


def _timeout_header(request: Request) -> float | None:
    raw = request.headers.get("connect-timeout-ms")
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise E2bError(400, "Connect-Timeout-Ms: an integer is expected") from None
    return ms / 1000 if ms > 0 else None


def routes(router: APIRouter, calls: Any, guarded: Sequence[Any]) -> None:
    def rest(path: str, method: str, status: int = 200):
        def add(fn):
            router.add_api_route(path, fn, methods=[method], dependencies=list(guarded), include_in_schema=False,
                                 status_code=status)
            return fn
        return add

    # -- the control plane ---------------------------------------------------------------------
    async def create(request: Request) -> Response:
        return await _rest_body(request, lambda body: calls.e2b_create(body), 201)

    rest("/v2/sandboxes", "POST", 201)(create)
    rest("/sandboxes", "POST", 201)(create)

    @rest("/sandboxes/{sid}", "GET")
    async def get(sid: str) -> Response:
        return await _rest(lambda: calls.e2b_get(sid))

    async def listing(request: Request, v2: bool) -> Response:
        q = request.query_params
        try:
            metadata = dict(urllib.parse.parse_qsl(q.get("metadata") or "", keep_blank_values=True))
            metadata = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in metadata.items()}
            states = [s for raw in q.getlist("state") for s in raw.split(",") if s] if v2 else ["running"]
            limit = int(q.get("limit") or PAGE_MAX) if v2 else 1 << 30
            if v2 and not 1 <= limit <= PAGE_MAX:
                raise ValueError
        except ValueError:
            err = E2bError(400, f"limit: an integer from 1 to {PAGE_MAX} is expected")
            return JSONResponse(err.rest(), status_code=400)
        token = q.get("nextToken") if v2 else None
        try:
            items, more = await _call(lambda: calls.e2b_list(metadata, states, limit, token))
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        return JSONResponse(items, headers={"x-next-token": more} if more else None)

    @rest("/v2/sandboxes", "GET")
    async def list_v2(request: Request) -> Response:
        return await listing(request, True)

    @rest("/sandboxes", "GET")
    async def list_v1(request: Request) -> Response:
        return await listing(request, False)

    @rest("/sandboxes/{sid}", "DELETE", 204)
    async def kill(sid: str) -> Response:
        return await _rest(lambda: calls.e2b_kill(sid), 204)

    @rest("/sandboxes/{sid}/timeout", "POST", 204)
    async def set_timeout(sid: str, request: Request) -> Response:
        try:
            body = await _json(request)
            if "timeout" not in body:
                raise E2bError(400, "timeout: required")
        except E2bError as e:
            return JSONResponse(e.rest(), status_code=e.status)
        return await _rest(lambda: calls.e2b_set_timeout(sid, body["timeout"]), 204)

    async def connect(sid: str, request: Request) -> Response:
        try:
            body = await _json(request)
            sandbox, resumed = await _call(lambda: calls.e2b_connect(sid, body.get("timeout")))
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        return JSONResponse(sandbox, status_code=201 if resumed else 200)

    rest("/sandboxes/{sid}/connect", "POST")(connect)
    rest("/v2/sandboxes/{sid}/connect", "POST")(connect)
    rest("/sandboxes/{sid}/resume", "POST", 201)(connect)

    @rest("/sandboxes/{sid}/pause", "POST", 204)
    async def pause(sid: str) -> Response:
        return await _rest(lambda: calls.e2b_pause(sid), 204)

    @rest("/sandboxes/{sid}/fork", "POST", 201)
    async def fork(sid: str, request: Request) -> Response:
        return await _rest_body(request, lambda body: calls.e2b_fork(sid, body), 201)

    @rest("/sandboxes/{sid}/snapshots", "POST", 201)
    async def snapshot(sid: str, request: Request) -> Response:
        return await _rest_body(request, lambda body: calls.e2b_snapshot(sid, body), 201)

    @rest("/templates/{name:path}", "DELETE", 204)
    async def delete_template(name: str) -> Response:
        return await _rest(lambda: calls.e2b_delete_template(name), 204)

    @rest("/sandboxes/{sid}/metrics", "GET")
    async def metrics(sid: str) -> Response:
        return await _rest(lambda: calls.e2b_metrics(sid))

    @rest("/sandboxes/{sid}/refreshes", "POST", 204)
    async def refresh(sid: str, request: Request) -> Response:  # older SDKs' keep-alive
        return await _rest_body(request, lambda body: calls.e2b_connect(sid, body.get("duration")), 204)

    # -- envd: Connect-RPC ---------------------------------------------------------------------
    async def process_rpc(method: str, request: Request) -> Response:
        try:
            sid, token = _sid(request), _token(request)
            if method in ("Start", "Connect"):
                msgs = envelope.messages(await request.body(), _body_limit(request))
                if len(msgs) != 1:
                    raise E2bError(400, "request: exactly one message is expected")
                msg = msgs[0]
                if method == "Start":
                    pid = await _call(lambda: calls.e2b_proc_start(sid, token, msg, _timeout_header(request)))
                else:
                    pid = await _call(lambda: calls.e2b_proc_find(sid, token, msg.get("process")))
                # a stream that started its process kills it at its deadline (one re-attached leaves it)
                kill = ((lambda: calls.e2b_proc_signal(sid, token, {"pid": pid}, "SIGNAL_SIGKILL"))
                        if method == "Start" else None)
                return StreamingResponse(
                    _events(pid, lambda sent, wait_s: calls.e2b_proc_output(sid, token, pid, sent, wait_s),
                            lambda: calls.e2b_proc_wait(sid, token, pid), request, kill),
                    media_type="application/connect+json")
            msg = envelope.decode(await request.body())
            if method == "List":
                procs = await _call(lambda: calls.e2b_proc_list(sid, token))
                return JSONResponse({"processes": procs})
            if method == "SendInput":
                data = (msg.get("input") or {}).get("stdin", "")
                if (msg.get("input") or {}).get("pty"):
                    raise E2bError(501, "input.pty: terminals are not supported by this server")
                await _call(lambda: calls.e2b_proc_input(sid, token, msg.get("process"), data))
                return JSONResponse({})
            if method == "CloseStdin":
                await _call(lambda: calls.e2b_proc_close_stdin(sid, token, msg.get("process")))
                return JSONResponse({})
            if method == "SendSignal":
                await _call(lambda: calls.e2b_proc_signal(sid, token, msg.get("process"), msg.get("signal")))
                return JSONResponse({})
            raise E2bError(501, f"process.Process/{method} is not supported by this server")
        except Exception as e:
            return _rpc_error(_fault(e))

    @router.post("/process.Process/{method}", include_in_schema=False)
    async def process(method: str, request: Request) -> Response:
        return await process_rpc(method, request)

    FS = {"Stat": ("stat", ("path",)), "ListDir": ("list", ("path", "depth")), "MakeDir": ("mkdir", ("path",)),
          "Remove": ("remove", ("path",)), "Move": ("move", ("source", "destination"))}

    @router.post("/filesystem.Filesystem/{method}", include_in_schema=False)
    async def filesystem(method: str, request: Request) -> Response:
        try:
            sid, token = _sid(request), _token(request)
            if method not in FS:
                raise E2bError(501, f"filesystem.Filesystem/{method} is not supported by this server")
            op, names = FS[method]
            msg = envelope.decode(await request.body())
            args = {k: msg.get(k) for k in names if k in msg or k != "depth"}
            out = await _call(lambda: calls.e2b_fs(sid, token, op, args))
            return JSONResponse(out)
        except Exception as e:
            return _rpc_error(_fault(e))

    # -- envd: HTTP ----------------------------------------------------------------------------
    @router.get("/files", include_in_schema=False)
    async def download(request: Request) -> Response:
        try:
            sid, token = _sid(request), _token(request)
            path = request.query_params.get("path")
            if not path:
                raise E2bError(400, "path: required")
            data = await _call(lambda: calls.e2b_read(sid, token, path))
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        return Response(data, media_type="application/octet-stream")  # never compressed: loopback

    @router.post("/files", include_in_schema=False)
    async def upload(request: Request) -> Response:
        try:
            sid, token = _sid(request), _token(request)
            files = _uploaded(request, await request.body())
            out = await _call(lambda: calls.e2b_write(sid, token, files))
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        return JSONResponse(out)

    @router.get("/health", include_in_schema=False)
    async def health(request: Request) -> Response:
        try:
            sid = _sid(request)
            await _call(lambda: calls.e2b_health(sid))
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        return Response(status_code=204)

    # -- the code interpreter ------------------------------------------------------------------
    @router.post("/execute", include_in_schema=False)
    async def execute(request: Request) -> Response:
        try:
            sid, token = _sid(request), _token(request)
            body = await _json(request)
            cid = await _call(lambda: calls.e2b_cell_start(sid, token, body))
            # the answer waits for the cell's first output or its end: a cell that fails before
            # it prints (a bad field, the sandbox gone) is still an HTTP error in E2B's shape
            sent = (0, 0)
            first: tuple[bytes, bytes] = (b"", b"")
            while True:
                out, err, done = await _call(lambda: calls.e2b_cell_output(sid, token, cid, sent, KEEPALIVE_S))
                if out or err or done:
                    first = (out, err)
                    break
            result = await _call(lambda: calls.e2b_cell_result(sid, token, cid)) if done else None
        except Exception as e:
            err = _fault(e)
            return JSONResponse(err.rest(), status_code=err.status)
        poll = lambda sent, wait_s: calls.e2b_cell_output(sid, token, cid, sent, wait_s)  # noqa: E731
        return StreamingResponse(_cell_lines(first, result, poll, lambda: calls.e2b_cell_result(sid, token, cid)),
                                 media_type="application/x-ndjson")

    @router.post("/contexts", include_in_schema=False)
    async def create_context(request: Request) -> Response:
        try:
            body = await _json(request)
        except E2bError as e:
            return JSONResponse(e.rest(), status_code=e.status)
        return await _rest(lambda: calls.e2b_context(_sid(request), _token(request), "create", body, None))

    @router.get("/contexts", include_in_schema=False)
    async def list_contexts(request: Request) -> Response:
        return await _rest(lambda: calls.e2b_context(_sid(request), _token(request), "list", None, None))

    @router.delete("/contexts/{context_id}", include_in_schema=False)
    async def remove_context(context_id: str, request: Request) -> Response:
        return await _rest(lambda: calls.e2b_context(_sid(request), _token(request), "remove", None, context_id), 204)

    @router.post("/contexts/{context_id}/restart", include_in_schema=False)
    async def restart_context(context_id: str, request: Request) -> Response:
        return await _rest(lambda: calls.e2b_context(_sid(request), _token(request), "restart", None, context_id))


async def _events(pid: int, output: Callable[[tuple[int, int], float], Any], wait: Callable[[], Any],
                  request: Request, kill: Callable[[], Any] | None = None):
    """A process's event stream: start (its pid), its output as the command writes it (a long poll
    of ``e2b_proc_output``: a data event per batch, at most ``CHUNK`` bytes each; a re-attached
    stream (``Connect``) gets the output so far first), keepalives while it is quiet, its end, then
    the end of the stream (carrying the error, if it did not run to an end). At the stream's
    ``Connect-Timeout-Ms`` (a little before: the client's own deadline counts from its send) the
    stream ends with ``deadline_exceeded`` and, when ``kill`` is given (the stream that started
    it), the process is killed first, queued or running,
    before the client gives up on a response still in flight (an HTTP/1.1 connection then stays
    clean for its next call)."""
    yield envelope.frame({"event": {"start": {"pid": pid}}})
    try:
        interval = min(KEEPALIVE_S, float(request.headers.get("keepalive-ping-interval") or KEEPALIVE_S))
    except ValueError:
        interval = KEEPALIVE_S
    limit = _timeout_header(request)
    deadline = time.monotonic() + max(0.05, limit - DEADLINE_MARGIN_S) if limit else None
    sent = [0, 0]
    try:
        while True:
            left = deadline - time.monotonic() if deadline is not None else None
            if left is not None and left <= 0:
                # killed here, as the stream says: the step's own timeout counts from its start, and a
                # command queued behind another would run after its caller was told it was killed
                if kill is not None:
                    try:
                        await _call(kill)
                    except E2bError as e:  # (a sandbox on another node: its step's own timeout ends it)
                        log.warning("could not kill process %s at its stream's deadline: %s", pid, e.message)
                raise E2bError(504, f"the command ran past its timeout ({limit:g} s) and was killed: pass a longer "
                                    "'timeout' (0: no limit)", "deadline_exceeded")
            out, err, done = await _call(lambda: output((sent[0], sent[1]), max(0.01, min(
                max(1.0, interval), left if left is not None else interval))))
            for i, (stream, data) in enumerate((("stdout", out), ("stderr", err))):
                sent[i] += len(data)
                for frame in _data(stream, data):
                    yield frame
            if done:
                break
            if not out and not err and (deadline is None or time.monotonic() < deadline):
                yield envelope.frame({"event": {"keepalive": {}}})
        result = await _call(wait)
    except Exception as e:
        yield envelope.end(_fault(e))
        return
    for i, stream in enumerate(("stdout", "stderr")):
        if not sent[i]:  # not streamed (a sandbox on another node): all of it, now
            for frame in _data(stream, result.get(stream, "").encode()):
                yield frame
    endev: dict = {"exitCode": result["exit_code"], "exited": result["exited"], "status": result["status"]}
    if result.get("error"):
        endev["error"] = result["error"]
    yield envelope.frame({"event": {"end": endev}})
    yield envelope.end()


def _data(stream: str, data: bytes):
    for at in range(0, len(data), CHUNK):
        yield envelope.frame({"event": {"data": {stream: base64.b64encode(data[at:at + CHUNK]).decode()}}})


async def _cell_lines(first: tuple[bytes, bytes], result: dict | None, poll: Callable[[tuple[int, int], float], Any],
                      take: Callable[[], Any]):
    """A cell's NDJSON lines: its output as it comes (a ``stdout``/``stderr`` line per batch,
    ``first`` the batch that started the answer), then its results, its error, the execution
    count. Whole lines go out as they come (``print`` writes its text and its newline apart: a
    Jupyter kernel's stream gives them as one message, and the SDK's ``logs`` show them so); a
    partial line goes out once the cell has been quiet for ``PARTIAL_S``, or at its end. An
    infrastructure failure after output went out cuts the stream (the SDK raises), rather than
    become an error of the user's code."""
    decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}
    held = {"stdout": "", "stderr": ""}
    sent = [0, 0]

    def lines(out: bytes, err: bytes, flush: bool = False, final: bool = False):
        # ``flush``: a partial line goes out too; only at the ``final`` end may the decoder give up
        # on a character cut between batches (a quiet poll that did so split one into two U+FFFD)
        for i, (stream, data) in enumerate((("stdout", out), ("stderr", err))):
            sent[i] += len(data)
            text = held[stream] + decoders[stream].decode(data, final)
            cut = len(text) if flush or final else text.rfind("\n") + 1
            held[stream] = text[cut:]
            if cut:
                yield json.dumps({"type": stream, "text": text[:cut], "timestamp": time.time_ns()}) + "\n"

    for line in lines(*first):
        yield line
    while result is None:
        out, err, done = await _call(lambda: poll((sent[0], sent[1]), PARTIAL_S if any(held.values())
                                                  else KEEPALIVE_S))
        for line in lines(out, err, flush=not out and not err):
            yield line
        if done:
            result = await _call(take)
    for line in lines(b"", b"", final=True):
        yield line
    now = time.time_ns()
    rest = []
    for i, stream in enumerate(("stdout", "stderr")):
        if not sent[i] and result[stream]:  # not streamed (a sandbox on another node): now
            rest.append({"type": stream, "text": result[stream], "timestamp": now})
    if result.get("truncated"):  # said where the SDK's caller reads the output (the cell itself did not fail)
        rest.append({"type": "stderr", "text": TRUNCATED_NOTE, "timestamp": now})
    for r in result["results"]:
        rest.append({"type": "result", **r})
    if result["error"]:
        rest.append({"type": "error", **result["error"]})
    rest.append({"type": "number_of_executions", "execution_count": result["execution_count"]})
    for line in rest:
        yield json.dumps(line) + "\n"


#: the last line of a cell's stderr when its output passed the server's cap (``max_output_bytes``)
TRUNCATED_NOTE = "[tangram: this cell's output passed the server's cap; the rest was dropped]\n"


def _form_files(ctype: str, body: bytes) -> list[tuple[str | None, bytes]]:
    """The ``file`` parts of a multipart form: (file name, bytes)."""
    return [(p.filename, p.data) for p in form_parts(ctype, body, E2bError) if p.name == "file"]


def _body_limit(request: Request) -> int:
    """The server's body limit (``max_body_mb``), which a compressed body is held to inflated."""
    return getattr(request.app.state, "max_body_bytes", envelope.BODY_LIMIT)


def _uploaded(request: Request, body: bytes) -> list[tuple[str, bytes]]:
    """The files of a ``POST /files``: an octet-stream body (the ``path`` parameter names it) or a
    multipart form of ``file`` parts (each part's file name is its path; ``path`` names a
    single one)."""
    if request.headers.get("content-encoding", "").lower() == "gzip":
        body = envelope.gunzip(body, _body_limit(request))
    ctype = request.headers.get("content-type", "")
    path = request.query_params.get("path")
    if ctype.startswith("multipart/form-data"):
        parts = _form_files(ctype, body)
        if not parts:
            raise E2bError(400, "file: no file part in the form")
        out = []
        for filename, data in parts:
            name = path if path and len(parts) == 1 else filename
            if not name:
                raise E2bError(400, "file: a part has no file name (its path)")
            out.append((name, data))
        return out
    if not path:
        raise E2bError(400, "path: required for an octet-stream upload")
    return [(path, body)]
