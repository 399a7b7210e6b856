"""The Daytona dialect's routes: the control plane under ``/api`` (``DAYTONA_API_URL`` is the
server's URL followed by ``/api``, as Daytona's own ends in ``/api``), each sandbox's toolbox under
``/api/toolbox/{id}`` (the ``toolboxProxyUrl`` a sandbox is answered with points there, at the
address the request came to), the streamed logs of a command and the SDK's event connection
(``/api/socket.io/``) as WebSockets. Every error is Daytona's shape (``errors.py``).

These routes parse their own bodies (no FastAPI models) so that a bad one is answered in
Daytona's shape; they are left out of the OpenAPI (it documents the native API). They are plain
Starlette routes in one route of the app's router, first in it (``table.py``): a toolbox call is
matched in a few steps, without FastAPI's per-request machinery.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Sequence

from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.websockets import WebSocketDisconnect

from ... import __version__
from ...link import PeerGone, RemoteFault
from ...managers.sandbox.isolation import HOME_ALIAS
from ..dialect import answer
from ..forms import json_object
from ..service import BadRequest, Conflict, Forbidden, NotFound, Overloaded, Unavailable
from . import forms, socketio
from .errors import DaytonaApiError, daemon
from .sandboxes import PAGE_MAX, parse_labels
from .table import Table

log = logging.getLogger(__name__)

PREFIX = "/api"
TOOLBOX = PREFIX + "/toolbox"
#: the streamed logs' markers before each chunk (the SDK's demultiplexer reads them)
MARKS = {"stdout": b"\x01\x01\x01", "stderr": b"\x02\x02\x02"}
#: each long poll of a streamed command's output waits at most this long
POLL_S = 20.0
SERVICE_ERRORS = ((NotFound, 404), (Forbidden, 403), (Conflict, 409), (BadRequest, 400), (Overloaded, 429),
                  (Unavailable, 503), (PeerGone, 503))


def is_daytona(request: Request) -> bool:
    """A request of Daytona's clients: its errors are in Daytona's shape, routing errors
    included."""
    return request.url.path.startswith(PREFIX + "/")


def _fault(e: BaseException) -> DaytonaApiError:
    """What a failure is, in Daytona's terms: an unexpected one is never the caller's fault."""
    if isinstance(e, DaytonaApiError):
        return e
    for kind, status in SERVICE_ERRORS:
        if isinstance(e, kind):
            return DaytonaApiError(status, str(e))
    name = e.type_name if isinstance(e, RemoteFault) else type(e).__name__
    if not isinstance(e, RemoteFault):
        log.error("Daytona route failed", exc_info=e)
    return DaytonaApiError(500, f"internal error: {name}")


def _error(request: Request, e: BaseException) -> JSONResponse:
    err = _fault(e)
    return JSONResponse(err.body(request.url.path, request.method), status_code=err.status)


async def _refuse(ws: WebSocket, err: DaytonaApiError) -> None:
    """A WebSocket refused before its handshake: the error as an HTTP answer in Daytona's shape
    where the server can send one (uvicorn's ``websockets`` implementations), else a close
    saying why."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(err.body(ws.url.path, "GET"), status_code=err.status))
    else:
        await ws.close(code=1008, reason=err.message[:120])


def _base(request: Request | WebSocket) -> str:
    """The toolbox's URL at the address this request came to."""
    scheme = {"ws": "http", "wss": "https"}.get(request.url.scheme, request.url.scheme)
    host = request.headers.get("host") or f"{request.url.hostname}:{request.url.port}"
    return f"{scheme}://{host}{TOOLBOX}"


def _sandbox(request: Request | WebSocket, value: dict) -> dict:
    return {**value, "toolboxProxyUrl": _base(request)}


async def _json(request: Request) -> dict:
    return await json_object(request, DaytonaApiError)


def _int(raw: str | None, name: str, default: int | None = None, low: int = 0, high: int = 1 << 31) -> int | None:
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise DaytonaApiError(400, f"{name}: an integer from {low} to {high} is expected")
    return value


def routes(router: APIRouter, calls: Any, guarded: Sequence[Any]) -> None:
    """The dialect's routes, as one route first in ``router`` (``table.Table``), the toolbox's
    commands and files first among them."""
    auth = guarded[0].dependency if guarded else None
    table = Table(PREFIX, auth)

    def add(path: str, method: str):
        def wrap(fn):
            table.add(PREFIX + path, method, fn)
            return fn
        return wrap

    async def reply(request: Request, fn: Callable[[], Any], status: int = 200,
                    shaped: Callable[[Any], Any] | None = None) -> Response:
        try:
            value = await answer(fn())
        except Exception as e:
            return _error(request, e)
        if value is None:
            return Response(status_code=status)
        return JSONResponse(shaped(value) if shaped else value, status_code=status)

    async def with_body(request: Request, fn: Callable[[dict], Any], status: int = 200,
                        shaped: Callable[[Any], Any] | None = None) -> Response:
        try:
            body = await _json(request)
        except DaytonaApiError as e:
            return _error(request, e)
        return await reply(request, lambda: fn(body), status, shaped)

    # a route made in a loop binds what it serves by a closure: its function is given only its
    # path's parameters, by name
    def unsupported_route(message: str, error: Callable[[str], DaytonaApiError]) -> Callable[..., Any]:
        async def unsupported(request: Request) -> Response:
            return _error(request, error(f"{message}: not supported by this server (docs/daytona.md)"))
        return unsupported

    # -- a sandbox's toolbox: /api/toolbox/{id}/..., as the SDK's toolbox client calls it --------
    def tb(path: str, method: str):
        return add("/toolbox/{sid}" + path, method)

    # -- process -------------------------------------------------------------------------------
    @tb("/process/execute", "POST")
    async def execute(sid: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_exec(sid, body))

    @tb("/process/code-run", "POST")
    async def code_run(sid: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_code_run(sid, body))

    @tb("/process/session", "POST")
    async def create_session(sid: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_session(sid, "create", body.get("sessionId")), 201)

    @tb("/process/session", "GET")
    async def list_sessions(sid: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_session(sid, "list", None))

    @tb("/process/session/entrypoint/logs", "GET")
    async def entrypoint_logs(sid: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_session(sid, "get", "entrypoint"),
                           shaped=lambda _: {"output": "", "stdout": "", "stderr": ""})

    @tb("/process/session/{session}", "GET")
    async def get_session(sid: str, session: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_session(sid, "get", session))

    @tb("/process/session/{session}", "DELETE")
    async def delete_session(sid: str, session: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_session(sid, "delete", session), 204)

    @tb("/process/session/{session}/exec", "POST")
    async def session_exec(sid: str, session: str, request: Request) -> Response:
        try:
            body = await _json(request)
            value, run_async = await answer(calls.daytona_session_exec(sid, session, body))
        except Exception as e:
            return _error(request, e)
        return JSONResponse(value, status_code=202 if run_async else 200)

    @tb("/process/session/{session}/command/{command}", "GET")
    async def get_command(sid: str, session: str, command: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_command(sid, session, command))

    @tb("/process/session/{session}/command/{command}/logs", "GET")
    async def command_logs(sid: str, session: str, command: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_command_logs(sid, session, command))

    @tb("/process/session/{session}/command/{command}/input", "POST")
    async def command_input(sid: str, session: str, command: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_command_input(sid, session, command,
                                                                                 body.get("data")), 204)

    for path, what in (("/process/pty", "PTY sessions"), ("/process/pty/{rest:path}", "PTY sessions"),
                       ("/process/interpreter/{rest:path}", "the stateful code interpreter"),
                       ("/computeruse/{rest:path}", "computer use"), ("/lsp/{rest:path}", "language servers")):
        table.add(PREFIX + "/toolbox/{sid}" + path, ["GET", "POST", "DELETE"],
                  unsupported_route(what, lambda m: daemon(501, m, "NOT_IMPLEMENTED")))

    # -- the control plane ---------------------------------------------------------------------
    @add("/sandbox", "POST")
    async def create(request: Request) -> Response:
        return await with_body(request, calls.daytona_create, shaped=lambda v: _sandbox(request, v))

    @add("/sandbox", "GET")
    async def listing(request: Request) -> Response:
        q = request.query_params
        try:
            query = {"labels": parse_labels(q.get("labels")), "states": q.getlist("states"), "id": q.get("id"),
                     "name": q.get("name"), "snapshots": q.getlist("snapshots"), "sort": q.get("sort"),
                     "order": q.get("order"), "cursor": _int(q.get("cursor"), "cursor", 0),
                     "limit": _int(q.get("limit"), "limit", None, 1, PAGE_MAX)}
        except DaytonaApiError as e:
            return _error(request, e)

        def shaped(page: dict) -> dict:
            return {**page, "items": [_sandbox(request, b) for b in page["items"]]}
        return await reply(request, lambda: calls.daytona_list(query), shaped=shaped)

    @add("/sandbox/{key}", "GET")
    async def get(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_get(key), shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}", "DELETE")
    async def delete(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_delete(key), shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/start", "POST")
    async def start(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_start(key), shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/stop", "POST")
    async def stop(key: str, request: Request) -> Response:
        force = request.query_params.get("force") == "true"
        return await reply(request, lambda: calls.daytona_stop(key, force), shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/labels", "PUT")
    async def labels(key: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_labels(key, body))

    def interval_route(kind: str) -> Callable[..., Awaitable[Response]]:
        async def interval(key: str, value: str, request: Request) -> Response:
            minutes = lambda: _int(value, f"{kind} interval", 0, -1)  # noqa: E731
            return await reply(request, lambda: calls.daytona_interval(key, kind, minutes()),
                               shaped=lambda v: _sandbox(request, v))
        return interval

    for kind in ("autostop", "autodelete", "autoarchive", "autopause"):
        table.add(PREFIX + f"/sandbox/{{key}}/{kind}/{{value}}", "POST", interval_route(kind))

    @add("/sandbox/{key}/ttl/{value}", "POST")
    async def ttl(key: str, value: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_interval(key, "ttl", _int(value, "ttlMinutes", 0)),
                           shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/fork", "POST")
    async def fork(key: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_fork(key, body),
                               shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/snapshot", "POST")
    async def snapshot_sandbox(key: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_snapshot_sandbox(key, body),
                               shaped=lambda v: _sandbox(request, v))

    @add("/sandbox/{key}/toolbox-proxy-url", "GET")
    async def toolbox_url(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_get(key), shaped=lambda _: {"url": _base(request)})

    for what in ("pause", "archive", "resize", "recover", "backup", "public/{value}", "network-settings",
                 "ssh-access", "ports/{port}/preview-url", "ports/{port}/signed-preview-url"):
        table.add(PREFIX + f"/sandbox/{{key}}/{what}", ["POST", "GET"],
                  unsupported_route(what.split("/")[0], lambda m: DaytonaApiError(501, m, "NOT_IMPLEMENTED")))

    # -- snapshots -----------------------------------------------------------------------------
    @add("/snapshots", "GET")
    async def snapshots(request: Request) -> Response:
        q = request.query_params
        try:
            page, limit = _int(q.get("page"), "page", 1, 1), _int(q.get("limit"), "limit", 100, 1, PAGE_MAX)
        except DaytonaApiError as e:
            return _error(request, e)
        return await reply(request, lambda: calls.daytona_snapshots(page, limit))

    @add("/snapshots", "POST")
    async def create_snapshot(request: Request) -> Response:
        return await with_body(request, calls.daytona_snapshot_create)

    @add("/snapshots/{key}", "GET")
    async def get_snapshot(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_snapshot_get(key))

    @add("/snapshots/{key}", "DELETE")
    async def delete_snapshot(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_snapshot_delete(key))

    @add("/snapshots/{key}/activate", "POST")
    async def activate(key: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_snapshot_get(key))

    # -- files ---------------------------------------------------------------------------------
    def query(request: Request, *names: str) -> dict:
        q = request.query_params
        out: dict = {n: q.get(n) for n in names if q.get(n) is not None}
        if "depth" in out:
            out["depth"] = _int(out["depth"], "depth", 1, 1, 1 << 16)
        if "recursive" in out:
            out["recursive"] = out["recursive"] == "true"
        return out

    def files_route(op: str, names: tuple[str, ...]) -> Callable[..., Awaitable[Response]]:
        # op and names bound by a closure, not as defaults: FastAPI would read a defaulted parameter
        # as part of the request (a tuple as form data, which needs python-multipart)
        async def files_call(sid: str, request: Request) -> Response:
            try:
                args = query(request, *names)
            except DaytonaApiError as e:
                return _error(request, e)
            return await reply(request, lambda: calls.daytona_fs(sid, op, args),
                               201 if op == "mkdir" else 204 if op == "delete" else 200)
        return files_call

    for path, method, op, names in (("/files", "GET", "list", ("path", "depth")),
                                    ("/files", "DELETE", "delete", ("path", "recursive")),
                                    ("/files/info", "GET", "info", ("path",)),
                                    ("/files/folder", "POST", "mkdir", ("path", "mode")),
                                    ("/files/move", "POST", "move", ("source", "destination")),
                                    ("/files/find", "GET", "find", ("path", "pattern")),
                                    ("/files/search", "GET", "search", ("path", "pattern")),
                                    ("/files/permissions", "POST", "chmod", ("path", "mode", "owner", "group"))):
        table.add(PREFIX + "/toolbox/{sid}" + path, method, files_route(op, names))

    @tb("/files/replace", "POST")
    async def replace(sid: str, request: Request) -> Response:
        return await with_body(request, lambda body: calls.daytona_fs(sid, "replace", body))

    async def upload(sid: str, request: Request) -> Response:
        try:
            files = forms.uploads(request.headers.get("content-type", ""), await request.body())
            if not files:
                raise daemon(400, "files: no file in the form")
        except Exception as e:
            return _error(request, e)
        return await reply(request, lambda: calls.daytona_upload(sid, files))

    tb("/files/bulk-upload", "POST")(upload)
    tb("/files/upload", "POST")(upload)

    @tb("/files/bulk-download", "POST")
    async def bulk_download(sid: str, request: Request) -> Response:
        try:
            body = await _json(request)
            paths = body.get("paths")
            if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
                raise daemon(400, "paths: a list of paths is expected")
            results = await answer(calls.daytona_download(sid, paths))
        except Exception as e:
            return _error(request, e)
        data, ctype = forms.downloads(results)
        return Response(data, media_type=ctype)

    @tb("/files/download", "GET")
    async def download(sid: str, request: Request) -> Response:
        try:
            path = request.query_params.get("path")
            if not path:
                raise daemon(400, "path: required", "INVALID_FILE_PATH")
            [(_, data, error)] = await answer(calls.daytona_download(sid, [path]))
        except Exception as e:
            return _error(request, e)
        if error is not None:
            return JSONResponse(error, status_code=error["statusCode"])
        return Response(data, media_type="application/octet-stream")

    # -- git -----------------------------------------------------------------------------------
    def git_route(op: str, queried: bool) -> Callable[..., Awaitable[Response]]:
        async def git_call(sid: str, request: Request) -> Response:
            if queried:
                return await reply(request, lambda: calls.daytona_git(sid, op, {"path": request.query_params.get(
                    "path")}))
            return await with_body(request, lambda body: calls.daytona_git(sid, op, body),
                                   201 if op in ("create_branch", "init") else 204 if op == "delete_branch" else 200)
        return git_call

    for path, method, op in (("/git/clone", "POST", "clone"), ("/git/add", "POST", "add"),
                             ("/git/commit", "POST", "commit"), ("/git/checkout", "POST", "checkout"),
                             ("/git/branches", "POST", "create_branch"), ("/git/branches", "DELETE", "delete_branch"),
                             ("/git/init", "POST", "init"), ("/git/pull", "POST", "pull"),
                             ("/git/push", "POST", "push")):
        table.add(PREFIX + "/toolbox/{sid}" + path, method, git_route(op, False))

    for path, op in (("/git/status", "status"), ("/git/branches", "branches")):
        table.add(PREFIX + "/toolbox/{sid}" + path, "GET", git_route(op, True))

    # -- where things are ----------------------------------------------------------------------
    for path in ("/user-home-dir", "/work-dir"):
        async def where(sid: str, request: Request) -> Response:
            return await reply(request, lambda: calls.daytona_session(sid, "list", None),
                               shaped=lambda _: {"dir": HOME_ALIAS})
        table.add(PREFIX + "/toolbox/{sid}" + path, "GET", where)

    @tb("/version", "GET")
    async def version(sid: str, request: Request) -> Response:
        return await reply(request, lambda: calls.daytona_session(sid, "list", None),
                           shaped=lambda _: {"version": f"tangram-{__version__}"})


    # -- WebSockets: the streamed logs, the event connection -----------------------------------
    async def authorized(ws: WebSocket, token: str | None = None) -> str | None:
        """The app's own credential check, on a WebSocket's request (or on the token the event
        connection sends): None when it passes (the task then acts as its key's job), else why
        not."""
        if auth is None:
            return None
        scope = dict(ws.scope, type="http")
        if token is not None:
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k != b"authorization"]
            scope["headers"].append((b"authorization", f"Bearer {token}".encode()))
        try:
            await auth(Request(scope))
        except StarletteHTTPException as e:
            return str(e.detail)
        return None

    async def logs(ws: WebSocket, sid: str, session: str, command: str) -> None:
        why = await authorized(ws)
        if why is not None:
            await _refuse(ws, DaytonaApiError(401, why))
            return
        if ws.query_params.get("follow") != "true":
            await _refuse(ws, daemon(400, "follow: a WebSocket follows the logs (follow=true)"))
            return
        try:
            await answer(calls.daytona_command(sid, session, command))
        except Exception as e:
            await _refuse(ws, _fault(e))
            return
        await ws.accept()
        sent = 0
        try:
            while True:
                chunks, done = await answer(calls.daytona_command_poll(sid, session, command, sent, POLL_S))
                for stream, data in chunks:
                    await ws.send_bytes(MARKS[stream] + data)
                sent += len(chunks)
                if done:
                    break
        except WebSocketDisconnect:
            return
        except Exception as e:
            await ws.close(code=1011, reason=_fault(e).message[:120])
            return
        await ws.close(code=1000)

    table.add_websocket(TOOLBOX + "/{sid}/process/session/{session}/command/{command}/logs", logs)

    async def pty(ws: WebSocket) -> None:
        await _refuse(ws, daemon(501, "PTY sessions: not supported by this server (docs/daytona.md)",
                                 "NOT_IMPLEMENTED"))

    table.add_websocket(TOOLBOX + "/{sid}/process/pty/{rest:path}", pty)

    async def events(ws: WebSocket) -> None:
        await socketio.serve(ws, lambda token: authorized(ws, token),
                             lambda after, wait_s: answer(calls.daytona_events(after, wait_s)),
                             lambda data: ({**data, "sandbox": _sandbox(ws, data["sandbox"])}
                                           if isinstance(data.get("sandbox"), dict) else data))

    table.add_websocket(PREFIX + "/socket.io/", events)
    table.add_websocket(PREFIX + "/socket.io", events)
    router.routes.insert(0, table)  # every path under /api/ matched in one step, before the others' routes

