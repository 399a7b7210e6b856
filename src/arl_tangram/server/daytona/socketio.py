"""The SDK's event connection: Socket.IO (protocol 5) over Engine.IO (protocol 4) on a WebSocket,
as much of both as the SDK uses.

The SDK connects to ``/api/socket.io/`` with the WebSocket transport only, sends its API key in
the namespace's CONNECT packet (``auth: {"token"}``), and from then on only listens: the server
pushes ``sandbox.created`` and ``sandbox.state.updated`` events of its organization (here: of
the job its key acts as). Engine.IO's heartbeat is the server's ping (``2``) every
``PING_INTERVAL_S``, the client's pong (``3``). The SDK works without this connection too (it
refreshes a sandbox by polling while it waits for a state): a refused connection costs it one
failed attempt per new sandbox.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any, Awaitable, Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

log = logging.getLogger(__name__)

PING_INTERVAL_S = 25.0
PING_TIMEOUT_S = 20.0
#: how long the server waits for the client's CONNECT after the handshake
CONNECT_WAIT_S = 10.0
#: the events' long poll: each call waits at most this long for one
POLL_S = 20.0


def _namespace_packet(msg: str) -> tuple[str, str, Any] | None:
    """A Socket.IO packet of the default namespace, as (type, namespace, data), from an Engine.IO
    message packet (``4`` stripped); None for anything else."""
    if not msg:
        return None
    kind, rest = msg[0], msg[1:]
    namespace = "/"
    if rest.startswith("/"):
        namespace, _, rest = rest.partition(",")
    data = None
    if rest:
        try:
            data = json.loads(rest)
        except ValueError:
            return None
    return kind, namespace, data


async def serve(ws: WebSocket, authenticate: Callable[[str | None], Awaitable[str | None]],
                events: Callable[[int | None, float], Awaitable[tuple[list, int]]],
                decorate: Callable[[dict], dict]) -> None:
    """One client's connection: the handshake, its CONNECT (``authenticate(token)``: None when
    the token is good, else why not, sent back as ``connect_error``), then the events
    (``events(after, wait_s)``, each one's data passed through ``decorate``) and the heartbeat
    until either side closes."""
    q = ws.query_params
    if q.get("EIO") != "4" or q.get("transport") != "websocket":
        await ws.close(code=1003)
        return
    await ws.accept()
    sent = asyncio.Lock()

    async def send(text: str) -> None:
        async with sent:
            await ws.send_text(text)

    await send("0" + json.dumps({"sid": secrets.token_urlsafe(15), "upgrades": [],
                                 "pingInterval": int(PING_INTERVAL_S * 1000), "pingTimeout": int(PING_TIMEOUT_S * 1000),
                                 "maxPayload": 1_000_000}))
    try:
        first = await asyncio.wait_for(ws.receive_text(), CONNECT_WAIT_S)
    except (asyncio.TimeoutError, WebSocketDisconnect):
        await _close(ws)
        return
    packet = _namespace_packet(first[1:]) if first.startswith("4") else None
    if packet is None or packet[0] != "0":
        await _close(ws)
        return
    namespace = packet[1]
    prefix = "" if namespace == "/" else namespace + ","
    if namespace != "/":
        await send(f"44{prefix}" + json.dumps({"message": "Invalid namespace"}))
        await _close(ws)
        return
    token = packet[2].get("token") if isinstance(packet[2], dict) else None
    why = await authenticate(token if isinstance(token, str) else None)
    if why is not None:
        await send("44" + json.dumps({"message": why}))
        await _close(ws)
        return
    await send("40" + json.dumps({"sid": secrets.token_urlsafe(15)}))
    # whichever ends first ends the connection: the client leaving, or the events failing (the
    # engine process gone): the SDK then reconnects, or polls
    tasks = [asyncio.create_task(_read(ws, send)), asyncio.create_task(_push(send, events, decorate)),
             asyncio.create_task(_ping(send))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(ws)


async def _read(ws: WebSocket, send: Callable[[str], Awaitable[None]]) -> None:
    try:
        while True:
            msg = await ws.receive_text()
            if msg == "2":  # a client's ping (not the SDK's way, but Engine.IO's)
                await send("3")
            elif msg in ("1", "41"):  # the transport closed, or the namespace left
                return
    except (WebSocketDisconnect, KeyError, RuntimeError):  # gone, or a binary frame: not ours to read
        return


async def _ping(send: Callable[[str], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(PING_INTERVAL_S)
        await send("2")


async def _push(send: Callable[[str], Awaitable[None]], events: Callable[[int | None, float], Awaitable[tuple]],
                decorate: Callable[[dict], dict]) -> None:
    try:
        _, after = await events(None, 0.0)
        while True:
            got, after = await events(after, POLL_S)
            for name, data in got:
                await send("42" + json.dumps([name, decorate(data)]))
    except Exception as e:  # the engine process went away, or the socket
        log.info("daytona event connection ends: %r", e)


async def _close(ws: WebSocket) -> None:
    try:
        await ws.close()
    except Exception:  # closed by the client already
        pass
