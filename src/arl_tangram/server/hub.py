"""The engine process's end of the front link: answers ``Service`` calls from front processes.

Only the methods in ``CALLS`` can be called (what the HTTP routes use). A call that awaits runs
as a task, so one front's slow action never holds up another's quick read; each answer is sent
when its call ends. An error the routes map to a status (``relayed()``) crosses the link as itself;
any other is logged here with its traceback and crosses as ``RemoteFault`` naming its type.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
from typing import Any

from .wire import FrameProtocol, RemoteFault

log = logging.getLogger(__name__)

CALLS = frozenset({
    "sf_run_code", "sf_run_jupyter", "submit", "status", "cancel", "open_session", "exec", "put_files",
    "get_files", "fork", "prewarm", "close_session", "model_call", "all_jobs", "job_stats", "cluster",
    "health", "metrics_text",
})


def relayed() -> tuple[type[BaseException], ...]:
    """The errors that cross as themselves (imported late: the runtime imports this module too)."""
    from ..runtime import NoRoom, SessionGone
    from .service import BadRequest, NotFound, Overloaded
    return (Overloaded, NotFound, BadRequest, NoRoom, SessionGone)


class Hub:
    """Serves ``service`` on a Unix socket at ``path`` to any number of fronts (or, with ``calls``,
    another object's methods: a sandbox worker serves its agent this way, ``runtime/workers.py``)."""

    def __init__(self, service: Any, calls: frozenset[str] = CALLS) -> None:
        self.service = service
        self.calls = calls
        self.replies = frozenset(getattr(service, "REPLIES", ()))  # answered through a reply callback
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._links: set[FrameProtocol] = set()

    async def listen(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._link, path)

    async def attach(self, sock) -> None:
        """Serve one already-connected socket (one end of a socket pair)."""
        await asyncio.get_running_loop().connect_accepted_socket(self._link, sock)

    @property
    def links(self) -> int:
        return len(self._links)

    def _link(self) -> FrameProtocol:
        proto: FrameProtocol

        def on_frame(msg: tuple[int, str, tuple]) -> None:
            self._call(proto, *msg)

        def on_lost(exc: Exception | None) -> None:
            self._links.discard(proto)

        proto = FrameProtocol(on_frame, on_lost)
        self._links.add(proto)
        return proto

    def _call(self, proto: FrameProtocol, rid: int, method: str, args: tuple[Any, ...]) -> None:
        if method not in self.calls:
            proto.send((rid, False, RemoteFault("UnknownCall", f"no such call {method!r}")))
            return
        fn = getattr(self.service, method)
        try:
            if method in self.replies:  # the method answers later through ``reply``
                fn(*args, reply=lambda ok, value: _send(proto, rid, method, ok,
                                                         value if ok else _relayable(method, value)))
                return
            value = fn(*args)
        except Exception as e:
            proto.send((rid, False, _relayable(method, e)))
            return
        if not inspect.isawaitable(value):
            _send(proto, rid, method, True, value)
            return
        task = asyncio.ensure_future(value)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._answered(proto, rid, method, t))

    def _answered(self, proto: FrameProtocol, rid: int, method: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            proto.send((rid, False, RemoteFault("CancelledError", "the engine process is shutting down")))
            return
        err = task.exception()
        _send(proto, rid, method, *((True, task.result()) if err is None else (False, _relayable(method, err))))

    async def close(self) -> None:
        """Stop listening and drop the links (fronts still waiting get ``EngineGone``)."""
        if self._server is not None:
            self._server.close()
        for proto in list(self._links):
            if proto.transport is not None:
                proto.transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


def _send(proto: FrameProtocol, rid: int, method: str, ok: bool, value: Any) -> None:
    try:
        proto.send((rid, ok, value))
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a bug, never a hung caller
        proto.send((rid, False, _relayable(method, e)))


def _relayable(method: str, e: BaseException) -> BaseException:
    if isinstance(e, relayed()):
        return e
    log.error("%s failed in the engine process", method, exc_info=e)
    return RemoteFault(type(e).__name__, str(e))
