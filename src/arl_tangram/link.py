"""A link between two processes of one server: calls of an object's methods, one frame each way.

Three pairs use it: the HTTP fronts and the engine process (``server/fronts.py``: a front calls the
``Service``), the engine process and its sandbox workers (``runtime/workers.py``: the engine
process calls a worker's node agent), and a Ray head and each node's agent (``runtime/agentlink.py``,
over TCP). ``Caller`` is the calling end, ``Hub`` the answering end; neither knows what it carries.
Each call is one frame each way over a Unix socket (or one end of a socket pair, or a TCP
connection): a 4-byte big-endian length, then a pickle of ``(call id, method, args)`` or
``(call id, ok, value)``. Calls are multiplexed on one connection and answered in the order they
finish.

Why pickle: both ends are this package, started by the same server, and the link carries mixed
values (the API's pydantic models, actions, ids, lists, dicts, exceptions) that pickle takes as they
are; the measurements behind the choice are in docs/performance.md. A Unix socket's ends are in a
directory only its owner can enter. A TCP link is for nodes of one cluster, which Ray's own
connections (pickles too) already trust; still, the listening end unpickles nothing before the
connecting end has sent the link's **token** (random bytes the head handed the agent over Ray):
anyone else who reaches the port is cut off before a byte of theirs is interpreted.

Errors keep their type across the link where the answering end says so (``Hub(relayed=...)``: the
server relays the errors its routes map to a status); anything else becomes ``RemoteFault`` naming
the original type (a 500 that says what failed), and the answering end logs the traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import itertools
import logging
import pickle
import struct
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 31  # a body is at most max_body_mb; this only guards against a corrupt length


class RemoteFault(Exception):
    """An error at the answering end that it does not relay as itself (over HTTP, a 500)."""

    def __init__(self, type_name: str, message: str = "") -> None:
        super().__init__(message or type_name)
        self.type_name = type_name

    def __reduce__(self):
        return RemoteFault, (self.type_name, str(self))


class PeerGone(ConnectionError):
    """The answering end went away (for a front, the engine process: a 503, retry)."""


def answers_later(fn: Callable[..., None]) -> Callable[..., None]:
    """Mark a method that answers through a ``reply(ok, value)`` keyword instead of returning:
    served with no task at all (``Hub``: the service's ``REPLIES`` name such methods)."""
    fn.answers_later = True  # type: ignore[attr-defined]
    return fn


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class FrameProtocol(asyncio.Protocol):
    """Length-prefixed pickles in, ``on_frame(obj)`` out; ``send(obj)`` writes one."""

    def __init__(self, on_frame: Callable[[Any], None], on_lost: Callable[[Exception | None], None], *,
                 greeting: bytes = b"", expect: bytes = b"") -> None:
        """``greeting``: raw bytes sent first (a TCP link's token); ``expect``: the raw bytes the
        peer must send first, before any frame is read (else the connection is closed)."""
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._greeting = greeting
        self._expect = expect
        self._refused = False  # the peer did not send what was expected: nothing of it is read
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._batching = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self._greeting:
            transport.write(self._greeting)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        buf = self._buf
        buf += data
        if self._expect:
            n = len(self._expect)
            if len(buf) < n:
                return
            if not hmac.compare_digest(bytes(buf[:n]), self._expect):
                peer = self.transport.get_extra_info("peername") if self.transport is not None else None
                log.warning("a connection to a link from %s did not present the link's token: closed", peer)
                buf.clear()
                self._refused = True
                self.transport.close()
                return
            del buf[:n]
            self._expect = b""
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME:
                log.error("frame of %d bytes on a link: closing it", n)
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
    """The calling end: ``await call(method, *args)`` returns the answering end's answer or
    raises its error."""

    def __init__(self, on_lost: Callable[[], None] | None = None, peer: str = "the answering process") -> None:
        """``on_lost``: called once when the link goes down (its peer stopped or died); ``peer``:
        what the errors of a link that is down call the other end."""
        self.on_lost = on_lost
        self.peer = peer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future | Callable[[bool, Any], None]] = {}
        self._proto: FrameProtocol | None = None
        self.gone: Exception | None = None

    async def connect(self, path: str | None = None, sock=None) -> None:
        """Over the Unix socket at ``path``, or over a connected socket (one end of a pair)."""
        loop = asyncio.get_running_loop()
        _, self._proto = await loop.create_unix_connection(lambda: FrameProtocol(self._answer, self._lost),
                                                           path, sock=sock)

    async def connect_tcp(self, host: str, port: int, token: bytes) -> None:
        """Over TCP to a ``Hub.listen_tcp`` that expects ``token`` (sent before any frame)."""
        loop = asyncio.get_running_loop()
        _, self._proto = await loop.create_connection(
            lambda: FrameProtocol(self._answer, self._lost, greeting=token), host, port)

    async def call(self, method: str, *args: Any) -> Any:
        return await self.request(method, *args)

    def request(self, method: str, *args: Any) -> asyncio.Future:
        """``call`` without a coroutine: the frame is queued now; the future holds the answer."""
        fut = asyncio.get_running_loop().create_future()
        if self.gone is not None or self._proto is None:
            fut.set_exception(PeerGone(f"{self.peer} is not reachable (it stopped or restarts): retry"))
            return fut
        rid = next(self._ids)
        self._waiting[rid] = fut
        self._proto.send((rid, method, args))
        return fut

    def request_cb(self, method: str, args: tuple, done: Callable[[bool, Any], None]) -> None:
        """``request`` with a callback, called as the answer is read: ``done(True, value)`` or
        ``done(False, error)``. A future's callbacks run a loop pass later; a sandbox worker's
        answer frees a core, and every pass in between keeps it held."""
        if self.gone is not None or self._proto is None:
            done(False, PeerGone("the link is down (its peer stopped or died)"))
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
        self.gone = PeerGone(f"{self.peer} closed the link (it stopped or died): retry")
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not isinstance(waiter, asyncio.Future):
                _guarded(waiter, False, self.gone)  # one that raises must not strand the rest
            elif not waiter.done():
                waiter.set_exception(self.gone)
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        """Close this end. ``on_lost`` is not called: it is for a peer that stopped or died (a
        front stopping on SIGTERM logged the engine process's link as lost, an error, each time)."""
        self.on_lost = None
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()


class Hub:
    """The answering end: serves the methods ``calls`` of ``service``, on a Unix socket at a path
    (``listen``: any number of callers) or on connected sockets (``attach``).

    A call that awaits runs as a task, so one caller's slow call never holds up another's quick
    one; each answer is sent when its call ends. Methods named in the service's ``REPLIES``
    answer later, through a ``reply(ok, value)`` callback, with no task at all. An error of a
    type in ``relayed`` crosses as itself; any other is logged here with its traceback and
    crosses as ``RemoteFault`` naming its type."""

    def __init__(self, service: Any, calls: Iterable[str],
                 relayed: tuple[type[BaseException], ...] = ()) -> None:
        self.service = service
        self.calls = frozenset(calls)
        self.relayed = relayed
        self.replies = frozenset(getattr(service, "REPLIES", ()))  # answered through a reply callback
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._links: set[FrameProtocol] = set()

    async def listen(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._link, path)

    async def listen_tcp(self, host: str, token: bytes, port: int = 0) -> int:
        """Listen on ``host``:``port`` (0: any free port) for callers that send ``token`` first
        (the module docstring); returns the port."""
        if len(token) < 16:
            raise ValueError("token: a TCP link needs at least 16 random bytes")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: self._link(token), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def attach(self, sock) -> None:
        """Serve one already-connected socket (one end of a socket pair)."""
        await asyncio.get_running_loop().connect_accepted_socket(self._link, sock)

    @property
    def links(self) -> int:
        return len(self._links)

    def _link(self, expect: bytes = b"") -> FrameProtocol:
        proto: FrameProtocol

        def on_frame(msg: tuple[int, str, tuple]) -> None:
            self._call(proto, *msg)

        def on_lost(exc: Exception | None) -> None:
            self._links.discard(proto)

        proto = FrameProtocol(on_frame, on_lost, expect=expect)
        self._links.add(proto)
        return proto

    def _call(self, proto: FrameProtocol, rid: int, method: str, args: tuple[Any, ...]) -> None:
        if method not in self.calls:
            proto.send((rid, False, RemoteFault("UnknownCall", f"no such call {method!r}")))
            return
        fn = getattr(self.service, method)
        try:
            if method in self.replies:  # the method answers later through ``reply``
                fn(*args, reply=lambda ok, value: self._send(proto, rid, method, ok,
                                                         value if ok else self._relayable(method, value)))
                return
            value = fn(*args)
        except Exception as e:
            proto.send((rid, False, self._relayable(method, e)))
            return
        if not inspect.isawaitable(value):
            self._send(proto, rid, method, True, value)
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
        self._send(proto, rid, method, *((True, task.result()) if err is None else (False, self._relayable(method, err))))

    async def close(self) -> None:
        """Stop listening and drop the links (callers still waiting get ``PeerGone``)."""
        if self._server is not None:
            self._server.close()
        for proto in list(self._links):
            if proto.transport is not None:
                proto.transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


    def _send(self, proto: FrameProtocol, rid: int, method: str, ok: bool, value: Any) -> None:
        try:
            proto.send((rid, ok, value))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a bug, never a hung caller
            proto.send((rid, False, self._relayable(method, e)))

    def _relayable(self, method: str, e: BaseException) -> BaseException:
        if isinstance(e, self.relayed):
            return e
        log.error("%s failed at the answering end of a link", method, exc_info=e)
        return RemoteFault(type(e).__name__, str(e))
