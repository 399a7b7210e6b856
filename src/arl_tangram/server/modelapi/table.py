"""The model protocols' routes as one entry of the app's route table, found by a dict look-up.

The app matches a request against its routes one by one, each a regular expression (~2-3 µs a
route); the protocols' routes came after the sandbox dialects' 57, so a request to one paid more
in matching than the native model routes' 24. ``Table`` holds every protocol route and stands
first in the app's table: a request to one of them is found by its path at once, and a request
to any other route pays one dict look-up and two prefix tests here (under a microsecond).

Only the path shapes the protocols use are taken: an exact path, ``/models/{model}/...`` (a
model's own URL) and a trailing ``{name:path}``. No other dialect has a route at these paths (a
reward route's path is kept off the others', ``config.RESERVED``), so standing first changes no
answer: a path that matches with another method is a partial match, as Starlette's own route
gives, and a later route that matches fully still wins; with none, the answer is the 405.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Match, NoMatchFound, request_response
from starlette.types import Receive, Scope, Send

MODEL = "/models/{model}"
NAME = "{name:path}"
#: the scope key the matched entry travels under from ``matches`` to ``handle``
KEY = "tangram.modelapi.route"


@dataclass
class Entry:
    path: str
    methods: frozenset[str]
    endpoint: Callable[..., Any]
    app: Any = field(repr=False)


@dataclass
class _Paths:
    """Exact paths, and prefixes whose rest is the ``name`` path parameter."""

    exact: dict[str, Entry] = field(default_factory=dict)
    named: list[tuple[str, Entry]] = field(default_factory=list)

    def add(self, path: str, entry: Entry) -> None:
        if path.endswith(NAME) and "{" not in path[:-len(NAME)]:
            self.named.append((path[:-len(NAME)], entry))
        elif "{" not in path:
            if path in self.exact:
                raise ValueError(f"two protocol routes at {entry.path}")
            self.exact[path] = entry
        else:
            raise ValueError(f"route {entry.path}: a path shape the protocols' table does not take")

    def find(self, path: str) -> tuple[Entry | None, dict[str, str]]:
        e = self.exact.get(path)
        if e is not None:
            return e, {}
        for prefix, e in self.named:
            if path.startswith(prefix):
                return e, {"name": path[len(prefix):]}
        return None, {}


def _route_path(scope: Scope) -> str:
    """The path below the app's ``root_path``, as Starlette's routes read it."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


class Table(BaseRoute):
    """The protocols' routes, added as to a router (``add_route``), matched by path."""

    def __init__(self) -> None:
        self.root = _Paths()
        self.scoped = _Paths()  # under /models/{model}
        self.prefixes: tuple[str, ...] = ("/models/",)

    def add_route(self, path: str, endpoint: Callable[..., Any], methods: Sequence[str], name: str | None = None,
                  ) -> None:
        ms = {m.upper() for m in methods}
        if "GET" in ms:  # as Starlette's Route: a GET route answers HEAD
            ms.add("HEAD")
        entry = Entry(path, frozenset(ms), endpoint, request_response(endpoint))
        if path.startswith(MODEL + "/"):
            self.scoped.add(path[len(MODEL):], entry)
        else:
            self.root.add(path, entry)
        self.prefixes = ("/models/",) + tuple(sorted({p for p, _ in self.root.named}))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return Match.NONE, {}
        path = _route_path(scope)
        entry = self.root.exact.get(path)
        params: dict[str, str] = {}
        if entry is None:
            if not path.startswith(self.prefixes):
                return Match.NONE, {}
            if path.startswith("/models/"):
                model, sep, rest = path[8:].partition("/")
                if model and sep:
                    entry, params = self.scoped.find("/" + rest)
                    params["model"] = model
            if entry is None:
                entry, params = self.root.find(path)
                if entry is None:
                    return Match.NONE, {}
        path_params = dict(scope.get("path_params", {}))
        path_params.update(params)
        child = {"endpoint": entry.endpoint, "path_params": path_params, KEY: entry}
        return (Match.FULL if scope["method"] in entry.methods else Match.PARTIAL), child

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry: Entry = scope[KEY]
        if scope["method"] not in entry.methods:  # as Starlette's Route answers it
            headers = {"Allow": ", ".join(sorted(entry.methods))}
            if "app" in scope:
                raise HTTPException(status_code=405, headers=headers)
            await PlainTextResponse("Method Not Allowed", status_code=405, headers=headers)(scope, receive, send)
            return
        await entry.app(scope, receive, send)

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)

    def __repr__(self) -> str:
        return f"Table({len(self.root.exact) + len(self.root.named)} routes, {len(self.scoped.exact)} per model)"
