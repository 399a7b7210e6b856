"""The FastAPI application: thin routes over ``Service``; every error is JSON with a message."""

from __future__ import annotations

import hmac
import inspect
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..api import sandboxfusion as sf
from ..api import v1
from ..runtime import NoRoom, SessionGone
from .service import BadRequest, NotFound, Overloaded, Service
from ..link import PeerGone, RemoteFault

if TYPE_CHECKING:
    from .front import RemoteService


class BodyLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413 before anything reads them whole."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await _too_large(self.max_bytes, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(self.max_bytes, send)


class _TooLarge(Exception):
    pass


async def _too_large(limit: int, send) -> None:
    body = f'{{"message": "request body larger than {limit} bytes"}}'.encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(service: "Service | RemoteService", token: str | None = None, max_body_bytes: int = 32 << 20) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        yield
        await service.stop()

    async def auth(request: Request) -> None:  # async: a sync dependency costs a thread hand-off per request
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise StarletteHTTPException(401, "missing or wrong bearer token")

    app = FastAPI(title="ARL-Tangram", version=__version__, lifespan=lifespan,
                  description="Action-level resource management for agentic RL: a SandboxFusion-compatible "
                              "code runner and a native API with sessions, job identity and outcomes that "
                              "keep infrastructure errors apart from the code's own failures.")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    guarded = [Depends(auth)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        message = f"{where}: {first.get('msg', 'invalid')}"
        unknown = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in errors
                   if e.get("type") == "extra_forbidden"]
        if unknown:  # every misspelled field at once, not only the first
            message = f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}"
        return JSONResponse({"message": message,
                             "detail": [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in errors]},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code in (404, 405):  # routing errors: FastAPI's (and so SandboxFusion's) exact body
            return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
        return JSONResponse({"message": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded):
        return JSONResponse({"message": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(NoRoom)
    async def no_room(request: Request, exc: NoRoom):
        return JSONResponse({"message": str(exc), "limit": exc.limit}, status_code=503,
                            headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(SessionGone)
    async def session_gone(request: Request, exc: SessionGone):
        return JSONResponse({"message": exc.reason}, status_code=404)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound):
        return JSONResponse({"message": str(exc)}, status_code=404)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return JSONResponse({"message": str(exc)}, status_code=422)

    @app.exception_handler(PeerGone)
    async def peer_gone(request: Request, exc: PeerGone):
        return JSONResponse({"message": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        name = exc.type_name if isinstance(exc, RemoteFault) else type(exc).__name__
        return JSONResponse({"message": f"internal error: {name}"}, status_code=500)

    # -- SandboxFusion-compatible --------------------------------------------------------------------
    @app.get("/v1/ping", tags=["sandboxfusion"])
    async def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=sf.RunCodeResponse, tags=["sandboxfusion"], dependencies=guarded)
    async def run_code(req: sf.RunCodeRequest) -> sf.RunCodeResponse:
        return await service.sf_run_code(req)

    @app.post("/run_jupyter", response_model=sf.RunJupyterResponse, tags=["sandboxfusion"], dependencies=guarded)
    async def run_jupyter(req: sf.RunJupyterRequest) -> sf.RunJupyterResponse:
        return await service.sf_run_jupyter(req)

    # -- native v1 -------------------------------------------------------------------------------------
    @app.post("/v1/actions", response_model=v1.ActionResult, tags=["actions"], dependencies=guarded,
              responses={202: {"model": v1.ActionResult}, 429: {"model": v1.Error}})
    async def submit(req: v1.ActionRequest, response: Response) -> v1.ActionResult:
        result = await service.submit(req)
        if result.state != "done":
            response.status_code = 202
        return result

    @app.get("/v1/actions/{action_id}", response_model=v1.ActionResult, tags=["actions"], dependencies=guarded,
             responses={404: {"model": v1.Error}})
    async def get_action(action_id: str) -> v1.ActionResult:
        return await answer(service.status(action_id))

    @app.post("/v1/actions/{action_id}/cancel", response_model=v1.ActionResult, tags=["actions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def cancel(action_id: str) -> v1.ActionResult:
        return await service.cancel(action_id)

    @app.post("/v1/sessions", response_model=v1.SessionInfo, status_code=201, tags=["sessions"],
              responses={503: {"model": v1.Error, "description": "no memory for a new session (the limit is named)"}},
              dependencies=guarded)
    async def open_session(req: v1.SessionRequest) -> v1.SessionInfo:
        return await service.open_session(req)

    @app.post("/v1/sessions/{session_id}/exec", response_model=v1.ActionResult, tags=["sessions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def exec_(session_id: str, req: v1.ExecRequest) -> v1.ActionResult:
        return await service.exec(session_id, req)

    @app.put("/v1/sessions/{session_id}/files", response_model=v1.ActionResult, tags=["sessions"],
             dependencies=guarded, responses={404: {"model": v1.Error}})
    async def put_files(session_id: str, req: v1.PutFiles) -> v1.ActionResult:
        return await service.put_files(session_id, req)

    @app.get("/v1/sessions/{session_id}/files", response_model=v1.GotFiles, tags=["sessions"],
             dependencies=guarded, responses={404: {"model": v1.Error}})
    async def get_files(session_id: str, path: list[str] = Query(default=[])) -> v1.GotFiles:
        return await service.get_files(session_id, path)

    @app.post("/v1/sessions/{session_id}/fork", response_model=v1.ForkResult, tags=["sessions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def fork(session_id: str, req: v1.ForkRequest) -> v1.ForkResult:
        return await service.fork(session_id, req)

    @app.post("/v1/pools/prewarm", response_model=v1.PrewarmResult, tags=["sessions"], dependencies=guarded,
              responses={422: {"model": v1.Error}})
    async def prewarm(req: v1.PrewarmRequest) -> v1.PrewarmResult:
        return await service.prewarm(req)

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"], dependencies=guarded,
                responses={404: {"model": v1.Error}})
    async def close_session(session_id: str) -> Response:
        await service.close_session(session_id)
        return Response(status_code=204)

    @app.post("/v1/models/{model}/score", response_model=v1.ModelResult, tags=["models"], dependencies=guarded,
              responses={404: {"model": v1.Error}})
    async def score(model: str, req: v1.ModelRequest) -> v1.ModelResult:
        return await service.model_call(model, "score", req)

    @app.post("/v1/models/{model}/logprobs", response_model=v1.ModelResult, tags=["models"], dependencies=guarded,
              responses={404: {"model": v1.Error}})
    async def logprobs(model: str, req: v1.ModelRequest) -> v1.ModelResult:
        return await service.model_call(model, "logprobs", req)

    @app.get("/v1/jobs", response_model=list[v1.JobStats], tags=["stats"], dependencies=guarded)
    async def jobs() -> list[v1.JobStats]:
        return await answer(service.all_jobs())

    @app.get("/v1/jobs/{job}/stats", response_model=v1.JobStats, tags=["stats"], dependencies=guarded,
             responses={404: {"model": v1.Error}})
    async def job_stats(job: str) -> v1.JobStats:
        return await answer(service.job_stats(job))

    @app.get("/v1/cluster", response_model=v1.ClusterInfo, tags=["stats"], dependencies=guarded)
    async def cluster() -> v1.ClusterInfo:
        return await answer(service.cluster())

    @app.get("/metrics", tags=["stats"], dependencies=guarded)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await answer(service.metrics_text()), media_type="text/plain; version=0.0.4")

    @app.get("/healthz", tags=["stats"])
    async def healthz() -> dict:
        return await answer(service.health())

    return app


async def answer(value):
    """The in-process ``Service`` answers reads at once; its twin across the front link
    (``server/front.py``) always awaits. Routes take either."""
    return await value if inspect.isawaitable(value) else value
