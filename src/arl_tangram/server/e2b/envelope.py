"""Connect-RPC's framing, as E2B's envd speaks it with the JSON codec.

A server-streaming call's request and response bodies are *envelopes*: one byte of flags, four
bytes of big-endian length, then that many bytes of JSON. The response ends with an end-of-stream
envelope (flags ``0x02``) whose JSON is ``{}`` or ``{"error": {"code", "message"}}``. A unary call
is plain JSON both ways; its error is an HTTP status with ``{"code", "message"}``, the code a
Connect code name (``not_found``). Flag ``0x01`` marks a gzip-compressed payload.
"""

from __future__ import annotations

import json
import struct
import zlib

COMPRESSED = 0x01
END_STREAM = 0x02

#: Connect code -> the HTTP status of a unary error (the Connect protocol's table)
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


CODE_OF_STATUS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                  409: "already_exists", 413: "resource_exhausted", 429: "resource_exhausted",
                  501: "unimplemented", 502: "unavailable", 503: "unavailable", 504: "deadline_exceeded"}


class E2bError(Exception):
    """An error in E2B's terms: ``status`` for HTTP (REST and envd's HTTP API: ``{"code": status,
    "message"}``), ``code`` the Connect code of the same error on envd's RPC routes (by default
    the one for ``status``). 502 is what E2B's proxy answers for a sandbox that is gone, on every
    route: its clients turn it into "sandbox not running"."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or CODE_OF_STATUS.get(status, "internal")

    def __reduce__(self):  # crosses the front link (link.py) as itself
        return E2bError, (self.status, self.message, self.code)

    def rpc(self) -> dict:
        return {"code": self.code, "message": self.message}

    def rest(self) -> dict:
        return {"code": self.status, "message": self.message}


def frame(message: dict | bytes, flags: int = 0) -> bytes:
    payload = message if isinstance(message, bytes) else json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def end(error: E2bError | None = None) -> bytes:
    return frame({"error": error.rpc()} if error is not None else {}, END_STREAM)


def gunzip(data: bytes, limit: int, what: str = "body") -> bytes:
    """``data`` gzip-inflated, to at most ``limit`` bytes: a 413 past it (a 32 MB body of zeros
    inflates to 32 GB: the server's memory went to 1 GB on 150 MB, and the sandbox was lost), a
    400 for what is not gzip."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflate.decompress(data, limit + 1)
    except zlib.error:
        raise E2bError(400, f"{what}: Content-Encoding is gzip but the data is not") from None
    if len(out) > limit or inflate.unconsumed_tail:
        raise E2bError(413, f"{what}: more than the server's body limit ({limit >> 20} MB) once decompressed")
    if not inflate.eof:
        raise E2bError(400, f"{what}: a gzip stream cut short")
    return out


#: a body's limit where the app does not say its own (``create_app``'s ``max_body_bytes``, the default)
BODY_LIMIT = 32 << 20


def messages(body: bytes, limit: int = BODY_LIMIT) -> list[dict]:
    """The JSON messages of an enveloped request body; ``E2bError`` for a malformed one (each
    compressed one inflated to ``limit`` bytes at most)."""
    out, at = [], 0
    while at < len(body):
        if len(body) - at < 5:
            raise E2bError(400, "request: truncated envelope header")
        flags, size = struct.unpack_from(">BI", body, at)
        payload = body[at + 5:at + 5 + size]
        if len(payload) != size:
            raise E2bError(400, "request: truncated envelope")
        at += 5 + size
        if flags & END_STREAM:
            continue
        if flags & COMPRESSED:
            payload = gunzip(payload, limit, "request")
        out.append(decode(payload))
    return out


def decode(payload: bytes) -> dict:
    try:
        value = json.loads(payload or b"{}")
    except ValueError as e:
        raise E2bError(400, f"request: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise E2bError(400, "request: a JSON object is expected")
    return value
