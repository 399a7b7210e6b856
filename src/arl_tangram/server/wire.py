"""The link between HTTP front processes and the engine process: calls of ``Service`` methods.

A front (``server/front.py``) parses HTTP, validates the body into the API's pydantic models and
serialises the answer; the engine process (``server/hub.py``) runs the one ``Service`` — engine,
journal, sandboxes, sessions — and answers the calls. Each call is one frame each way over a
Unix socket: a 4-byte big-endian length, then a pickle of ``(call id, method, args)`` or
``(call id, ok, value)``. Calls are multiplexed on one connection per front and answered in the
order they finish.

Why pickle: both ends are this package, started by the same server, over a socket in a directory
only its owner can enter (never a network address), and the link carries mixed values (the API's
pydantic models, ids, lists, dicts, exceptions) that pickle takes as they are. Measured (this
2-core VM): a trivial ``RunCodeResponse`` frame round-trips in ~18 us, a ``RunCodeRequest`` in ~7 us,
against a budget near 700 us a request for the engine process. Dropped: a ``copyreg`` reducer
sending models as pydantic JSON (its Rust core is quick) saved ~10 us on a response but cost ~4 us
on a request; msgpack would need a schema of its own on both sides.

Errors keep their type across the link where the routes map it to a status (``RELAYED``);
anything else becomes ``RemoteFault`` naming the original type (a 500 that says what failed),
and the engine process logs the traceback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from typing import Any, Callable

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 31  # a body is at most max_body_mb; this only guards against a corrupt length


class RemoteFault(Exception):
    """An error inside the engine process that has no HTTP meaning of its own (a 500)."""

    def __init__(self, type_name: str, message: str = "") -> None:
        super().__init__(message or type_name)
        self.type_name = type_name

    def __reduce__(self):
        return RemoteFault, (self.type_name, str(self))


class EngineGone(ConnectionError):
    """The engine process went away; the front cannot answer (503, retry)."""


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class FrameProtocol(asyncio.Protocol):
    """Length-prefixed pickles in, ``on_frame(obj)`` out; ``send(obj)`` writes one."""

    def __init__(self, on_frame: Callable[[Any], None], on_lost: Callable[[Exception | None], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._batching = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME:
                log.error("frame of %d bytes on the front link: closing it", n)
                self.transport.close()
                return
            if end - pos - 4 < n:
                break
            obj = pickle.loads(memoryview(buf)[pos + 4:pos + 4 + n])
            pos += 4 + n
            self._on_frame(obj)
        if pos:
            del buf[:pos]

    def send(self, obj: Any) -> None:
        """Send one frame: the first of a loop pass leaves at once (a quiet link adds no pass of
        latency), the others of the same pass leave together in one write right after it (one
        system call instead of one each: under load dozens of answers end in the same pass)."""
        data = frame(obj)  # pickling errors surface here, to the caller
        if self.transport is None or self.transport.is_closing():
            return
        if self._batching:
            self._out.append(data)
            return
        self.transport.write(data)
        self._batching = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._batching = False
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


def _guarded(callback: Callable[[bool, Any], None], ok: bool, value: Any) -> None:
    try:
        callback(ok, value)
    except Exception:
        log.exception("a link callback failed")


class Caller:
    """The front's end: ``await call(method, *args)`` returns the engine process's answer or
    raises its error."""

    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        """``on_lost``: called once when the link goes down (its peer stopped or died)."""
        self.on_lost = on_lost
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future | Callable[[bool, Any], None]] = {}
        self._proto: FrameProtocol | None = None
        self.gone: Exception | None = None

    async def connect(self, path: str | None = None, sock=None) -> None:
        """Over the Unix socket at ``path``, or over a connected socket (one end of a pair)."""
        loop = asyncio.get_running_loop()
        _, self._proto = await loop.create_unix_connection(lambda: FrameProtocol(self._answer, self._lost),
                                                           path, sock=sock)

    async def call(self, method: str, *args: Any) -> Any:
        return await self.request(method, *args)

    def request(self, method: str, *args: Any) -> asyncio.Future:
        """``call`` without a coroutine: the frame is queued now; the future holds the answer."""
        fut = asyncio.get_running_loop().create_future()
        if self.gone is not None or self._proto is None:
            fut.set_exception(EngineGone("the engine process is not reachable (it stopped or restarts): retry"))
            return fut
        rid = next(self._ids)
        self._waiting[rid] = fut
        self._proto.send((rid, method, args))
        return fut

    def request_cb(self, method: str, args: tuple, done: Callable[[bool, Any], None]) -> None:
        """``request`` with a callback, called as the answer is read: ``done(True, value)`` or
        ``done(False, error)``. A future's callbacks run a loop pass later; a sandbox worker's
        answer frees a core, and every pass in between keeps it held (issue 10)."""
        if self.gone is not None or self._proto is None:
            done(False, EngineGone("the link is down (its peer stopped or died)"))
            return
        rid = next(self._ids)
        self._waiting[rid] = done
        self._proto.send((rid, method, args))

    def _answer(self, msg: tuple[int, bool, Any]) -> None:
        rid, ok, value = msg
        waiter = self._waiting.pop(rid, None)
        if waiter is None:
            return
        if not isinstance(waiter, asyncio.Future):
            _guarded(waiter, ok, value)  # a raise here would close the link under every other call
        elif waiter.done():
            return
        elif ok:
            waiter.set_result(value)
        else:
            waiter.set_exception(value)

    def _lost(self, exc: Exception | None) -> None:
        self.gone = EngineGone("the engine process closed the link (it stopped or died): retry")
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not isinstance(waiter, asyncio.Future):
                _guarded(waiter, False, self.gone)  # one that raises must not strand the rest
            elif not waiter.done():
                waiter.set_exception(self.gone)
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
