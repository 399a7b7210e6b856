"""``server/lean.py``: a lean route answers exactly as FastAPI's own handler does, byte for byte,
for well-formed requests and for every kind of bad one, and takes the short way only for the
well-formed ones."""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from arl_tangram.server import app as server_app
from arl_tangram.server.lean import LeanRoute


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    n: int = Field(1, ge=0)
    note: Optional[str] = None


class Answer(BaseModel):
    status: str
    echo: str
    n: int
    ratio: float = 0.5


def build(route_class: type[APIRoute]) -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    app.router.route_class = route_class
    seen: list[str] = []

    async def auth(request: Request) -> None:
        if request.headers.get("authorization") == "Bearer bad":
            raise HTTPException(401, "unknown API key")
        seen.append("auth")

    app.state.auth = auth
    @app.post("/run", response_model=Answer, dependencies=[Depends(auth)])
    async def run(req: Body) -> dict[str, Any]:
        seen.append(req.code)
        if req.code == "boom":
            raise HTTPException(409, "in use")
        if req.code == "text":
            return PlainTextResponse("plain")  # type: ignore[return-value]
        if req.code == "wrong":
            return {"status": "x"}  # not an Answer: a response validation error
        return {"status": "ok", "echo": req.code, "n": req.n, "ratio": 1 / 3, "extra": "dropped"}

    @app.post("/items/{item}")
    async def item(item: str, req: Body) -> dict[str, str]:
        return {"item": item}

    return app, seen


CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("ok", json.dumps({"code": "print(1)", "n": 3}).encode(), {"content-type": "application/json"}),
    ("unicode", json.dumps({"code": "print('héllo ☃')"}, ensure_ascii=False).encode(),
     {"content-type": "application/json; charset=utf-8"}),
    ("vendor json", b'{"code": "x"}', {"content-type": "application/vnd.api+json"}),
    ("lax int from string", b'{"code": "x", "n": "4"}', {"content-type": "application/json"}),
    ("missing field", b'{"n": 2}', {"content-type": "application/json"}),
    ("bad value", b'{"code": "x", "n": -1}', {"content-type": "application/json"}),
    ("unknown field", b'{"code": "x", "langauge": "python"}', {"content-type": "application/json"}),
    ("not json", b'{"code": ', {"content-type": "application/json"}),
    ("json not an object", b'[1, 2]', {"content-type": "application/json"}),
    ("empty", b"", {"content-type": "application/json"}),
    ("no content type", b'{"code": "x"}', {}),
    ("text content type", b'{"code": "x"}', {"content-type": "text/plain"}),
    ("401 from the dependency", b'{"code": "x"}', {"content-type": "application/json", "authorization": "Bearer bad"}),
    ("409 from the endpoint", b'{"code": "boom"}', {"content-type": "application/json"}),
    ("a Response returned", b'{"code": "text"}', {"content-type": "application/json"}),
    ("NaN literal", b'{"code": "x", "n": NaN}', {"content-type": "application/json"}),
    ("nested past the recursion limit", b"[" * 100_000, {"content-type": "application/json"}),
]


def answer(client: TestClient, body: bytes, headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
    r = client.post("/run", content=body, headers=headers)
    return r.status_code, sorted(r.headers.items()), r.content


@pytest.mark.parametrize("name,body,headers", CASES, ids=[c[0] for c in CASES])
def test_lean_route_answers_as_fastapi_does(name: str, body: bytes, headers: dict[str, str]) -> None:
    plain, plain_seen = build(APIRoute)
    lean, lean_seen = build(LeanRoute)
    with TestClient(plain, raise_server_exceptions=False) as a, TestClient(lean, raise_server_exceptions=False) as b:
        assert answer(b, body, headers) == answer(a, body, headers)
    assert lean_seen == plain_seen  # the dependency and the endpoint ran alike (once each, or not at all)


def test_only_well_formed_requests_take_the_short_way() -> None:
    app, _ = build(LeanRoute)
    route = next(r for r in app.routes if getattr(r, "path", "") == "/run")
    assert isinstance(route, LeanRoute) and route.lean is not None
    full = route.full
    calls: list[str] = []

    async def counted(scope, receive, send):
        calls.append(scope["path"])
        await full(scope, receive, send)

    route.full = counted
    with TestClient(app) as c:
        assert c.post("/run", json={"code": "x"}).json()["echo"] == "x"
        assert calls == []
        assert c.post("/run", json={"n": 1}).status_code == 422
        assert calls == ["/run"]


def test_a_response_the_model_refuses_is_a_server_error_either_way() -> None:
    for route_class in (APIRoute, LeanRoute):
        app, _ = build(route_class)
        with TestClient(app, raise_server_exceptions=False) as c:
            assert c.post("/run", json={"code": "wrong"}).status_code == 500


def test_routes_beyond_one_body_model_keep_fastapi_s_handler() -> None:
    app, _ = build(LeanRoute)
    route = next(r for r in app.routes if getattr(r, "path", "") == "/items/{item}")
    assert route.lean is None  # a path parameter besides the body
    with TestClient(app) as c:
        assert c.post("/items/a", json={"code": "x"}).json() == {"item": "a"}


def test_the_server_s_hot_routes_are_lean() -> None:
    class Idle:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(name)

    app = server_app.create_app(Idle())  # type: ignore[arg-type]
    lean = {r.path for r in app.routes if getattr(r, "lean", None) is not None}
    assert {"/run_code", "/run_jupyter"} <= lean


def _asgi(app: FastAPI, messages: list[dict]) -> tuple[list[dict], bool]:
    """One raw ASGI request to ``/run`` whose body comes as ``messages``: what was sent back."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/run", "raw_path": b"/run", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "state": {}}
    sent: list[dict] = []
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)

    async def send(m):
        sent.append(m)

    async def main():
        async with app.router.lifespan_context(app):
            try:
                await app(scope, receive, send)
            except Exception:
                return True
        return False

    return sent, asyncio.run(main())


def test_a_client_that_leaves_mid_body_runs_nothing_either_way() -> None:
    """A part of a body that parses, then the client leaves: the endpoint never runs (review M1)."""
    part = [{"type": "http.request", "body": b'{"code": "x1"}', "more_body": True}, {"type": "http.disconnect"}]
    for route_class in (APIRoute, LeanRoute):
        app, seen = build(route_class)
        sent, _ = _asgi(app, list(part))
        assert "x1" not in seen, route_class
        assert not any(m.get("status") == 200 for m in sent), (route_class, sent)


def test_a_dependency_override_is_honoured() -> None:
    async def refuse(request: Request) -> None:
        raise HTTPException(403, "overridden")

    app, seen = build(LeanRoute)
    app.dependency_overrides[app.state.auth] = refuse
    with TestClient(app) as c:
        r = c.post("/run", json={"code": "x"})
    assert r.status_code == 403 and seen == []
