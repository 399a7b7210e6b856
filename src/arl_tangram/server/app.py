"""The FastAPI application: the dialects' routers (``server/calls.py``) over the ``Service`` of this
process or the engine process's calls across the link, the token and the API keys, the body limit,
and every error as JSON with a message (in the shape of the dialect that claims the request).

Credentials: ``token`` (``--token``) sees every job; ``keys`` (the config's ``api_keys``) maps an
API key to the one job it acts as: the check here sets ``service.CALLER_JOB`` for the request,
and ``Service`` (and each dialect's calls) scope what the request sees by it. A client presents
either as ``Authorization: Bearer`` or in its dialect's own header (``Dialect.key_header``)."""

from __future__ import annotations

import gc
import hashlib
import hmac
from contextlib import asynccontextmanager
from typing import Mapping, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..runtime import NoRoom, SessionGone
from .calls import DIALECTS, Local, RemoteCalls
from .dialect import Dialect
from .lean import LeanRoute
from .service import CALLER_JOB, BadRequest, Conflict, Forbidden, NotFound, Overloaded, Service, Unavailable
from ..link import PeerGone, RemoteFault


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


#: how long an idle HTTP connection stays open (uvicorn's default is 5 s). SDK clients keep pooled
#: connections longer than that (E2B's pyqwest-based client among them): a request sent on one just
#: as the server closed it is reset ("Connection reset by peer"), seen with 20 E2B sandboxes at once
#: in CI. 75 s outlasts the clients' pools, as load balancers' keep-alives are set above their peers'.
KEEP_ALIVE_S = 75


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def create_app(service: Service | RemoteCalls, token: str | None = None, max_body_bytes: int = 32 << 20,
               keys: Mapping[str, str] | None = None, dialects: Sequence[Dialect] = DIALECTS) -> FastAPI:
    """The app over ``service``: this process's ``Service``, or a front's ``RemoteService``;
    ``keys``: API key -> the job it acts as; ``dialects``: the HTTP APIs it speaks (the server's
    own, and any other: ``calls.with_dialects``); a front's ``RemoteService`` carries the same."""
    # looked up by digest: a dict lookup on the key itself would time its prefix
    jobs = {_digest(k): job for k, job in (keys or {}).items()}
    key_headers = [d.key_header for d in dialects if d.key_header]
    shapes = [(d.claims, d.error) for d in dialects if d.claims is not None and d.error is not None]
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        # What start-up made (modules, the app, the pools) lives as long as the process: out of the
        # collector's way, so no full pass over it pauses a request that is waiting
        gc.freeze()
        yield
        await service.stop()

    def presented(request: Request) -> list[str]:
        headers = request.headers
        given = headers.get("authorization", "")
        return ([given[7:]] if given[:7].lower() == "bearer " else []) + [v for h in key_headers if (v := headers.get(h))]

    def is_admin(request: Request) -> bool:
        """Whether the request may see every job's figures (``/metrics``, ``/v1/cluster``,
        ``/healthz``'s details): it carries the token, or the server has neither token nor keys."""
        if token is None and not jobs:
            return True
        return token is not None and any(hmac.compare_digest(c.encode(), token.encode()) for c in presented(request))

    async def auth(request: Request) -> None:  # async: a sync dependency costs a thread hand-off per request
        """The token (every job), a job's API key (that job: ``CALLER_JOB``), or 401. With neither
        configured (loopback only: the CLI refuses otherwise), anything goes, as it always did."""
        if token is None and not jobs:
            return
        presented_ = presented(request)
        for cred in presented_:
            if token is not None and hmac.compare_digest(cred.encode(), token.encode()):
                return
            job = jobs.get(_digest(cred))
            if job is not None:
                CALLER_JOB.set(job)
                return
        raise StarletteHTTPException(401, "unknown API key" if presented_ else "missing bearer token or API key")

    app = FastAPI(title="ARL-Tangram", version=__version__, lifespan=lifespan,
                  description="Action-level resource management for agentic RL: a SandboxFusion-compatible "
                              "code runner and a native API with sessions, job identity and outcomes that "
                              "keep infrastructure errors apart from the code's own failures.")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.is_admin = is_admin  # the server-wide views ask it (``server/native.py``)
    app.state.max_body_bytes = max_body_bytes  # a compressed body is held to it once inflated (e2b)
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
        for claims, error in shapes:  # a dialect with its own error body (E2B's {"code", "message"})
            if claims(request):
                return JSONResponse(error(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                                    headers=exc.headers)
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

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict):
        return JSONResponse({"message": str(exc)}, status_code=409)

    @app.exception_handler(Forbidden)
    async def forbidden(request: Request, exc: Forbidden):
        return JSONResponse({"message": str(exc)}, status_code=403)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return JSONResponse({"message": str(exc)}, status_code=422)

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, exc: Unavailable):
        return JSONResponse({"message": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(PeerGone)
    async def peer_gone(request: Request, exc: PeerGone):
        return JSONResponse({"message": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        name = exc.type_name if isinstance(exc, RemoteFault) else type(exc).__name__
        return JSONResponse({"message": f"internal error: {name}"}, status_code=500)

    app.router.route_class = LeanRoute  # the hot routes' well-formed requests skip FastAPI's handler
    calls = Local(service, dialects) if isinstance(service, Service) else service
    for dialect in dialects:  # on the app's own router: an included router is one more hop per request
        dialect.routes(app.router, calls, guarded)
    return app

