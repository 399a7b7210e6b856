"""The server's dialects, and the one list of calls their routes make on the engine process.

``DIALECTS`` is every HTTP API the server speaks (adding one: docs/architecture.md, "Adding an
HTTP dialect"). ``CALLS`` joins their calls; from it come ``Local`` (the calls bound to the
``Service`` of this process: what the routes call without fronts, and what the link serves to
fronts) and the fronts' ``RemoteService`` (``server/front.py``). So the routes see the same
names in process and across the link, and a call no dialect declares fails either way.
"""

from __future__ import annotations

import asyncio
import inspect
from types import MethodType
from typing import Any, Callable

from ..runtime import NoRoom, SessionGone
from . import e2b, native, sandboxfusion
from .dialect import Dialect
from .service import CALLER_JOB, BadRequest, Conflict, Forbidden, NotFound, Overloaded, Service, Unavailable

DIALECTS: tuple[Dialect, ...] = (sandboxfusion.DIALECT, native.DIALECT, e2b.DIALECT)


def _joined(dialects: tuple[Dialect, ...]) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for d in dialects:
        for name, fn in d.calls.items():
            if name in out or name in ("start", "stop"):  # the last two: the fronts' RemoteService's own
                raise ValueError(f"dialect {d.name}: call {name!r} is taken")
            out[name] = fn
    return out


#: name -> ``fn(service, *args)``, run in the engine process
CALLS = _joined(DIALECTS)

#: the errors ``server/app.py`` maps to a status: they cross the front link as themselves
RELAYED: tuple[type[BaseException], ...] = (Overloaded, NotFound, BadRequest, Conflict, Forbidden, Unavailable, NoRoom,
                                            SessionGone,
                                            e2b.E2bError)
#: the link's call for a call made by a request with a job's API key (``scoped`` below)
SCOPED = "scoped"


class Local:
    """The calls bound to ``service``: each one attribute, a bound method (no cost per call). A
    call that answers later (``link.answers_later``) is bound as ``_Later``: a route awaits it as
    any other; the link (``REPLIES``) hands it the reply callback itself."""

    REPLIES = frozenset(name for name, fn in CALLS.items() if getattr(fn, "answers_later", False))

    def __init__(self, service: Service) -> None:
        for name, fn in CALLS.items():
            setattr(self, name, _Later(MethodType(fn, service)) if name in self.REPLIES else MethodType(fn, service))

    async def scoped(self, job: str, name: str, *args: Any) -> Any:
        """``name(*args)`` as a request carrying ``job``'s API key (a front's call across the link:
        the front checked the key; this task's ``CALLER_JOB`` scopes what the call sees)."""
        CALLER_JOB.set(job)
        value = getattr(self, name)(*args)
        return await value if inspect.isawaitable(value) else value


class _Later:
    """A call answering through ``reply``: called with one, as the link calls it; called without,
    as a route in this process does, it returns a future of the answer."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, reply: Callable[[bool, Any], None] | None = None) -> Any:
        if reply is not None:
            return self.fn(*args, reply=reply)
        fut = asyncio.get_running_loop().create_future()
        self.fn(*args, reply=lambda ok, value: _settle(fut, ok, value))
        return fut


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():  # its caller went away (a client that left)
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
