"""The server's dialects, and the one list of calls their routes make on the engine process.

``DIALECTS`` is every HTTP API the server speaks: a dialect in this package is its own module (or
package) plus one line here (docs/architecture.md, "Adding an HTTP dialect"). ``CALLS`` joins
their calls; from it come ``Local`` (the calls bound to the ``Service`` of this process: what the
routes call without fronts, and what the link serves to fronts) and the fronts'
``RemoteService`` (``server/front.py``). So the routes see the same names in process and across
the link, and a call no dialect declares fails either way.

A dialect that lives elsewhere (a plugin, a test) is served beside these without an edit here:
``create_app(service, dialects=with_dialects(...))`` in one process, and ``fronts.serve(...,
dialects=["module"])`` with front processes, each of which imports the module (its ``DIALECT``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from types import MethodType
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..runtime import NoRoom, SessionGone
from . import daytona, e2b, modelapi, native, sandboxfusion
from .dialect import Dialect
from .service import CALLER_JOB, BadRequest, Conflict, Forbidden, NotFound, Overloaded, Service, Unavailable

DIALECTS: tuple[Dialect, ...] = (sandboxfusion.DIALECT, native.DIALECT, e2b.DIALECT, modelapi.DIALECT,
                                 daytona.DIALECT)


def joined(dialects: Sequence[Dialect]) -> dict[str, Callable[..., Any]]:
    """The calls of ``dialects``, by name (a name two of them declare is a ``ValueError``)."""
    out: dict[str, Callable[..., Any]] = {}
    for d in dialects:
        for name, fn in d.calls.items():
            if name in out or name in ("start", "stop"):  # the last two: the fronts' RemoteService's own
                raise ValueError(f"dialect {d.name}: call {name!r} is taken")
            out[name] = fn
    return out


#: name -> ``fn(service, *args)``, run in the engine process
CALLS = joined(DIALECTS)

#: the errors ``server/app.py`` maps to a status: they cross the front link as themselves (each
#: dialect adds its own: ``Dialect.relayed``)
SERVICE_ERRORS: tuple[type[BaseException], ...] = (Overloaded, NotFound, BadRequest, Conflict, Forbidden, Unavailable,
                                                   NoRoom, SessionGone)


def relayed(dialects: Sequence[Dialect]) -> tuple[type[BaseException], ...]:
    """The errors that cross the front link as themselves for a server of ``dialects``."""
    return SERVICE_ERRORS + tuple(e for d in dialects for e in d.relayed)


RELAYED = relayed(DIALECTS)


def with_dialects(modules: Sequence[str] = (), settings: Mapping[str, Mapping[str, Any]] | None = None,
                  ) -> tuple[Dialect, ...]:
    """``DIALECTS`` and the dialect of each module named (its ``DIALECT``), imported here; a
    dialect named in ``settings`` (by its name) is built over its settings (``Dialect.configure``)."""
    dialects = DIALECTS + tuple(importlib.import_module(m).DIALECT for m in modules)
    if not settings:
        return dialects
    unknown = set(settings) - {d.name for d in dialects if d.configure is not None}
    if unknown:
        raise ValueError(f"settings for dialects that take none: {sorted(unknown)}")
    return tuple(d.configure(settings[d.name]) if d.configure is not None and d.name in settings else d
                 for d in dialects)


def calls_of(dialects: Sequence[Dialect]) -> Mapping[str, Callable[..., Any]]:
    """The calls of ``dialects``: ``CALLS`` itself for the server's own (one dict, which the
    benches may instrument), else joined anew."""
    return CALLS if tuple(dialects) == DIALECTS else joined(dialects)


class RemoteCalls(Protocol):
    """The engine process's calls as another process sees them (``front.RemoteService``): each
    call by name, and the link's own start and stop."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
#: the link's call for a call made by a request with a job's API key (``scoped`` below)
SCOPED = "scoped"


class Local:
    """The calls of ``dialects`` bound to ``service``: each one attribute, a bound method (no cost
    per call). A call that answers later (``link.answers_later``) is bound as ``_Later``: a route
    awaits it as any other; the link (``REPLIES``) hands it the reply callback itself."""

    def __init__(self, service: Service, dialects: Sequence[Dialect] = DIALECTS) -> None:
        for name, fn in calls_of(dialects).items():
            bound = MethodType(fn, service)
            setattr(self, name, _Later(bound) if getattr(fn, "answers_later", False) else bound)

    @property
    def REPLIES(self) -> frozenset[str]:  # noqa: N802 (the name the link reads, ``link.Hub``)
        return frozenset(name for name, call in vars(self).items() if isinstance(call, _Later))

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
