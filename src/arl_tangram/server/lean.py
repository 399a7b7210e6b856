"""The hot routes' requests without FastAPI's per-request machinery.

``LeanRoute`` is the app router's route class. A route it can serve lean (an endpoint of one
pydantic body model and nothing else, dependencies that take only the ``Request``, the default
JSON response with at most a ``response_model``) is still a FastAPI route: routing, OpenAPI, the
middleware and the exception handlers are FastAPI's. Only a well-formed request's way through
the route is shorter: the body read, ``json.loads`` and ``Model.model_validate`` (what FastAPI
does with it), the dependencies awaited, the endpoint called, the answer validated into the
response model and written by pydantic's ``dump_json`` (FastAPI's own fast path since 0.120 makes
the same bytes). Anything else (another content type, a body that does not parse or validate, an
endpoint returning a ``Response``) goes to FastAPI's own handler with the body replayed, so every
error a client sees is FastAPI's, field names and all.

FastAPI's handler (telemetry hooks, a content-type parse by ``email.message``, the dependency
solver, two exit stacks) costs several times the work itself on a request as small as a
``/run_code``'s (docs/performance.md).
"""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any, Awaitable, Callable

from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import Response

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Plan:
    """What a lean request of one route does: the body's model and the endpoint's name for it,
    the dependencies (each ``fn(request)``), the response's adapter and status."""

    def __init__(self, body_name: str, body_model: type[BaseModel], deps: list[Callable[[Request], Any]],
                 response: TypeAdapter[Any], status: int) -> None:
        self.body_name, self.body_model, self.deps = body_name, body_model, deps
        self.response, self.status = response, status


def _one_parameter(fn: Callable[..., Any]) -> tuple[str, Any] | None:
    """``fn``'s only parameter (plain or keyword-only, no default) and its annotation, resolved;
    None for anything else (the endpoint's body model, a dependency's ``Request``)."""
    try:
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters.values())
    except Exception:
        return None
    if (len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_OR_KEYWORD, params[0].KEYWORD_ONLY)
            or params[0].default is not inspect.Parameter.empty):
        return None
    return params[0].name, hints.get(params[0].name)


def _plan(route: APIRoute) -> _Plan | None:
    """The lean plan for ``route``, or None when FastAPI's own handler must serve it: anything
    beyond one body model, request-only dependencies and a plain JSON response."""
    body = _one_parameter(route.endpoint)
    if body is None or not (isinstance(body[1], type) and issubclass(body[1], BaseModel)):
        return None
    if not inspect.iscoroutinefunction(route.endpoint) or not isinstance(route.response_class, DefaultPlaceholder):
        return None
    if (route.response_model_include or route.response_model_exclude or route.response_model_exclude_unset
            or route.response_model_exclude_defaults or route.response_model_exclude_none
            or not route.response_model_by_alias):
        return None
    deps: list[Callable[[Request], Any]] = []
    for d in route.dependencies:
        fn = d.dependency
        if fn is None or not inspect.iscoroutinefunction(fn):
            return None
        param = _one_parameter(fn)
        if param is None or param[1] is not Request:
            return None
        deps.append(fn)
    if route.response_model is None:  # FastAPI's jsonable_encoder then: not the hot routes' way
        return None
    return _Plan(body[0], body[1], deps, TypeAdapter(route.response_model), route.status_code or 200)


def _json_content(scope: dict[str, Any]) -> bool:
    """Whether the request says its body is JSON, as FastAPI decides it (``application/json`` or
    ``application/*+json``, parameters aside)."""
    for k, v in scope["headers"]:
        if k == b"content-type":
            kind = v.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return False


class LeanRoute(APIRoute):
    """A FastAPI route whose well-formed requests skip FastAPI's per-request machinery (module
    docstring); the rest, and every route it cannot plan, are FastAPI's as before."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.lean = _plan(self)
        if self.lean is not None:
            self.full = self.app
            self.app = self._lean_app

    def _overridden(self) -> bool:
        """Whether the app overrides a dependency (tests do): FastAPI resolves overrides per
        request, so such a request takes its handler."""
        return bool(getattr(self.dependency_overrides_provider, "dependency_overrides", None))

    async def _lean_app(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        plan = self.lean
        assert plan is not None
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body came: FastAPI's
                # handler sees the part that came as unfinished, then the disconnect (a partial body
                # that happens to parse must never run)
                return await self.full(scope, _replay(b"".join(chunks), receive, message, more=True), send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if not body or not _json_content(scope) or self._overridden():
            return await self.full(scope, _replay(body, receive), send)
        try:
            value = plan.body_model.model_validate(json.loads(body))
        except Exception:  # FastAPI's handler says what is wrong, its way (a RecursionError of a body
            return await self.full(scope, _replay(body, receive), send)  # nested too deep included)
        request = Request(scope, receive)
        for dep in plan.deps:
            await dep(request)
        answer = await self.endpoint(**{plan.body_name: value})
        if isinstance(answer, Response):
            return await answer(scope, receive, send)
        # as FastAPI's ``serialize_response``: validated (attributes read too), then dumped by alias
        data = plan.response.dump_json(plan.response.validate_python(answer, from_attributes=True), by_alias=True)
        await send({"type": "http.response.start", "status": plan.status,
                    "headers": [(b"content-length", str(len(data)).encode()),
                                (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def _replay(body: bytes, receive: Receive, last: dict[str, Any] | None = None, more: bool = False) -> Receive:
    """A ``receive`` that gives ``body`` once (whole, or with ``more`` as a part of a body still
    coming), then ``last`` if the client had left, then the connection's own messages."""
    queued = [{"type": "http.request", "body": body, "more_body": more}, *([last] if last is not None else [])]

    async def replayed() -> dict[str, Any]:
        return queued.pop(0) if queued else await receive()

    return replayed
