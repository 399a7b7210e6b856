"""What the model protocols' routes share: their error, each protocol's error body, and the
routes themselves as plain Starlette endpoints.

A route here is a Starlette ``Route`` over ``async fn(request) -> Response`` rather than a
FastAPI route: it parses its body itself, so that a body FastAPI would answer with its own 422
is answered in the protocol's error shape instead (OpenAI's SDK reads ``{"error": {...}}``), and
a request pays no FastAPI handler on top of what the native call costs. The server's token and
API keys are checked by the same dependency the other dialects' routes carry (``guarded``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import secrets
import time
from typing import Any, Awaitable, Callable, Sequence

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ...link import PeerGone, RemoteFault
from ..service import Overloaded

log = logging.getLogger(__name__)

#: a log-probability JSON cannot carry (-inf: a token the model gives no mass) goes out as this, as
#: vLLM sends it
NEG_INF = -9999.0


class ApiError(Exception):
    """A request the model protocols answer with ``status`` (a 4xx for the caller's input, naming
    the field in ``param``; 429 with ``retry_after_s``; a 5xx only for a fault of ours)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.retry_after_s = kind, retry_after_s

    def __reduce__(self):  # crosses the front link as itself (``Dialect.relayed``)
        return _rebuild, (self.status, self.message, self.param, self.code, self.kind, self.retry_after_s)


def _rebuild(status, message, param, code, kind, retry_after_s) -> ApiError:
    return ApiError(status, message, param=param, code=code, kind=kind, retry_after_s=retry_after_s)


def bad(message: str, param: str | None = None) -> ApiError:
    """The caller's input (400), naming the field."""
    return ApiError(400, message, param=param)


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "RequestTooLarge", 422: "UnprocessableEntityError",
          429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_body(protocol: str, status: int, message: str, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> dict:
    """The error body of ``protocol``: OpenAI's (``{"error": {"message", "type", "param",
    "code"}}``, its type and code strings), vLLM's (the same keys, the status as code, an
    exception's name as type), SGLang's native ``/generate`` (``{"error": {"message"}}``)."""
    if protocol == "openai":
        if kind is None:
            kind = ("invalid_request_error" if status < 500 and status not in (429,) else
                    "rate_limit_exceeded" if status == 429 else "server_error")
        if code is None:
            code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else None,
                    429: "rate_limit_exceeded"}.get(status)
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if protocol == "sglang":
        return {"error": {"message": message}}
    return {"error": {"message": message, "type": _TYPES.get(status, "InternalServerError" if status >= 500
                                                             else "BadRequestError"),
                      "param": param, "code": status}}


try:  # a log-probability answer is thousands of numbers: orjson writes them ~10x faster, where installed
    import orjson

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)
except ImportError:  # pragma: no cover - the standard library's, same bytes but for spacing
    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def json_response(value: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(value), status, headers, media_type="application/json")


def error_response(protocol: str, e: ApiError) -> Response:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return json_response(error_body(protocol, e.status, e.message, e.param, e.code, e.kind), e.status, headers)


def lp(x: float | None) -> float | None:
    """A log-probability as JSON carries it."""
    if x is None:
        return None
    return x if math.isfinite(x) else NEG_INF


async def body_of(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body validated into ``model``; a 400 in the protocol's shape naming the
    first field that is wrong. Parsed and validated in one pass by pydantic's own JSON parser: the
    standard library's ``json.loads`` alone took twice what the whole pass does."""
    raw = await request.body()
    if not raw:
        raise bad("body: must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        kind = first.get("type")
        if kind == "json_invalid":
            raise bad("body: not valid JSON") from None
        if kind == "model_type" and not first.get("loc"):
            raise bad("body: must be a JSON object") from None
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise bad(f"{where or 'body'}: {first.get('msg', 'invalid')}", where.split(".")[0] or None) from None


Endpoint = Callable[[Request], Awaitable[Response]]


def as_api_error(e: Exception, what: str) -> ApiError:
    """An exception as the protocols answer it: their own as it is, the key check's 401, a full
    queue's 429, a lost engine process's 503, and anything else a 500 of ours (logged)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, HTTPException):  # 401 from the key check
        return ApiError(e.status_code, str(e.detail))
    if isinstance(e, Overloaded):
        return ApiError(429, str(e), retry_after_s=e.retry_after_s)
    if isinstance(e, PeerGone):
        return ApiError(503, str(e), retry_after_s=1)
    if isinstance(e, RemoteFault):  # a fault of ours, never the caller's input; logged where it happened
        return ApiError(500, f"internal error: {e.type_name}")
    log.error("%s failed", what, exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}")


def route(router: Any, path: str, methods: Sequence[str], protocol: str, guarded: Sequence[Any],
          fn: Endpoint) -> None:
    """Add ``fn`` at ``path`` of ``router`` (the protocols' ``Table``): the token or API key
    checked first (``guarded``: the dependencies every dialect's routes carry, each ``async
    fn(request)``), every failure answered in ``protocol``'s error shape."""
    checks = [d.dependency for d in guarded]

    async def endpoint(request: Request) -> Response:
        try:
            for check in checks:
                await check(request)
            return await fn(request)
        except Exception as e:
            return error_response(protocol, as_api_error(e, f"{request.method} {path}"))

    router.add_route(path, endpoint, methods=list(methods), name=f"{protocol} {path}")


#: answers' ids: a random part drawn once per process and a count (a draw per answer is a syscall)
_ID_BASE = secrets.token_hex(6)
_ID_COUNT = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_BASE}{next(_ID_COUNT):012x}"


def now() -> int:
    return int(time.time())
