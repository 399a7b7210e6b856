"""What an HTTP dialect is: its routes, and the calls they make on the engine process's side.

A dialect (``server/native.py``, ``server/sandboxfusion.py``) speaks one HTTP API onto the one
native ``Service``, which knows no dialect. It has two halves, because with ``--fronts N`` they
run in different processes:

* ``calls``: name -> ``fn(service, *args)``, run in the engine process (a ``Service`` method, or a
  function translating the dialect's request onto ``Service`` methods and its answer back);
* ``routes(router, calls, guarded)``: adds the dialect's routes to a FastAPI router (the app's
  own), run wherever HTTP is served: they parse, validate and answer, reaching the engine
  process only through ``calls.<name>(...)``; ``guarded`` is the token check to depend on.

Two optional hooks say how a dialect's clients differ at the door (``server/app.py`` asks every
dialect, so it names none): ``key_header``, a header its clients carry their API key in besides
``Authorization: Bearer`` (E2B's ``X-API-Key``), and ``claims`` with ``error``: the requests
whose errors (401, routing 404s) it answers in its own body shape. ``relayed``: the dialect's own
errors, which its calls raise and its routes answer, crossing the front link as themselves.

A call reaches the native ``Service`` through its public methods only: a session's journaled step
is ``Service.step``, a dialect's own state on the service ``Service.dialect_state``, and what it
needs of the runtime a ``Runtime`` method (``service.runtime``).

``server/calls.py`` joins the dialects' calls into the one list that the routes in process, the
fronts' remote service and the engine process's link all come from: adding a call is one entry in
its dialect, and a route that uses a call no dialect declares fails in process as with fronts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fastapi import APIRouter, Request


@dataclass(frozen=True)
class Dialect:
    """One HTTP API: ``calls`` run in the engine process; ``routes`` adds its routes over them."""

    name: str
    calls: Mapping[str, Callable[..., Any]]
    routes: Callable[[APIRouter, Any, Sequence[Any]], None]
    #: a header (lower case) its clients send their API key in, besides ``Authorization: Bearer``
    key_header: str | None = None
    #: whether a request is this dialect's (then ``error`` shapes its error bodies)
    claims: Callable[[Request], bool] | None = None
    #: the body of an error of this dialect: (status, message) -> JSON
    error: Callable[[int, str], Any] | None = None
    #: its own errors that cross the front link as themselves (its routes answer them)
    relayed: tuple[type[BaseException], ...] = ()
    #: the dialect over its settings (its table in the server config, as plain data: it crosses to
    #: the front processes as JSON); None where it has none
    configure: Callable[[Mapping[str, Any]], "Dialect"] | None = None


async def answer(value: Any) -> Any:
    """A call in process answers reads at once; across the front link it always awaits. Routes
    take either."""
    return await value if inspect.isawaitable(value) else value
