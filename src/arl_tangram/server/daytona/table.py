"""The dialect's routes as one route of the app's router, first in it (``Table``).

Every path under ``/api/`` is the dialect's (no other dialect has one), so the app's router
matches it in one step instead of trying each of its routes, and the dialect's own routes are
tried in the order they were added: the hot ones (a command, a file) first. Each is a plain
Starlette route, its path parameters passed to its function by name and the app's credential
check awaited before it (what FastAPI's route would do with ``dependencies``), without FastAPI's
per-request machinery (its dependency solver, its telemetry hooks, its exit stacks), which the
dialect does not use: it parses its own bodies and answers its own responses. A path under
``/api/`` that none of them matches is left to the app's router (its 404), a known path asked
with another method is a partial match (its 405); both are raised for the app's error handler
(in Daytona's shape, as every error under ``/api/``)."""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

Check = Callable[[Request], Awaitable[None]]


def _names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters ``fn`` takes from the path: all but its request (or WebSocket)."""
    return tuple(p for p in inspect.signature(fn).parameters if p not in ("request", "ws"))


class Table(BaseRoute):
    """The routes under ``prefix``, tried in the order they were added."""

    def __init__(self, prefix: str, check: Check | None) -> None:
        self.prefix, self.check = prefix + "/", check
        self.routes: list[BaseRoute] = []

    def add(self, path: str, method: str | list[str], fn: Callable[..., Awaitable[Response]]) -> None:
        """``fn(request, **path parameters)`` for ``method`` (or each of them) on ``path``, the
        credential check first."""
        names, check = _names(fn), self.check

        async def endpoint(request: Request) -> Response:
            if check is not None:
                await check(request)
            params = request.path_params
            return await fn(request=request, **{n: params[n] for n in names})

        self.routes.append(Route(path, endpoint, methods=[method] if isinstance(method, str) else method,
                                 include_in_schema=False))

    def add_websocket(self, path: str, fn: Callable[..., Awaitable[None]]) -> None:
        """``fn(ws, **path parameters)`` on ``path``: it checks the credentials itself (a
        WebSocket's refusal is its own)."""
        names = _names(fn)

        async def endpoint(ws: WebSocket) -> None:
            params = ws.path_params
            await fn(ws, **{n: params[n] for n in names})

        self.routes.append(WebSocketRoute(path, endpoint))

    # -- a route of the app's router -------------------------------------------------------------
    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(self.prefix):
            return Match.NONE, {}
        partial: tuple[BaseRoute, Scope] | None = None
        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return Match.FULL, {**child, "route": route}
            if match is Match.PARTIAL and partial is None:
                partial = (route, child)
        if partial is not None:  # its own handle answers 405, unless the app has a route for the method
            return Match.PARTIAL, {**partial[1], "route": partial[0]}
        return Match.NONE, {}  # the app's router's 404 (or its redirect to the path with a slash)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await scope["route"].handle(scope, receive, send)

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)
