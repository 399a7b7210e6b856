"""Bodies the dialects parse themselves: a JSON object, and the parts of a ``multipart/form-data``
form (E2B's and Daytona's file uploads). A form's body is cut at its boundary with ``bytes.find``;
only each part's header block goes through ``email``'s parser, whose feed parser reads a payload
line by line: slow on a large upload. Each dialect passes the error it answers with."""

from __future__ import annotations

import json
from email.parser import BytesParser
from email.policy import HTTP
from typing import Callable, NamedTuple

from fastapi import Request

#: a dialect's error for a bad body: (status, message) -> the exception to raise
BadBody = Callable[[int, str], Exception]


async def json_object(request: Request, error: BadBody) -> dict:
    """The request's body as a JSON object; an empty body is ``{}``."""
    body = await request.body()
    if not body:
        return {}
    try:
        value = json.loads(body)
    except ValueError as e:
        raise error(400, f"body: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(400, "body: a JSON object is expected")
    return value


class Part(NamedTuple):
    name: str
    filename: str | None
    data: bytes


def form_parts(ctype: str, body: bytes, error: BadBody) -> list[Part]:
    """The parts of a ``multipart/form-data`` body, in order."""
    head = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n")
    boundary = head.get_param("boundary")
    if not boundary:
        raise error(400, "body: not a multipart form (no boundary)")
    delim = b"--" + str(boundary).encode()
    at = body.find(delim)
    if at < 0:
        raise error(400, "body: not a multipart form")
    at += len(delim)
    out: list[Part] = []
    while not body.startswith(b"--", at):  # "--" after a delimiter closes the form
        end = body.find(b"\r\n" + delim, at)
        if end < 0:
            raise error(400, "body: the multipart form is cut short")
        first = body.find(b"\n", at) + 1
        split = body.find(b"\r\n\r\n", first, end + 2)
        if split < 0:
            raise error(400, "body: a form part has no header block")
        headers = BytesParser(policy=HTTP).parsebytes(body[first:split + 4], headersonly=True)
        encoding = str(headers.get("content-transfer-encoding", "")).lower()
        if encoding in ("", "binary", "8bit", "7bit"):
            data = body[split + 4:end]  # the one copy of the bytes
        else:  # rare: let email decode it
            data = BytesParser(policy=HTTP).parsebytes(body[first:end]).get_payload(decode=True) or b""
        name = headers.get_param("name", header="content-disposition")
        out.append(Part(str(name or ""), headers.get_filename(), data))
        at = end + 2 + len(delim)
    return out
