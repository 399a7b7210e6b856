"""Multipart forms, both ways: the toolbox's uploads come as one (``files[i].path`` and
``files[i].file`` fields), its bulk downloads go back as one (a ``file`` part a path, or an
``error`` part in Daytona's shape). Parsed by the dialects' shared ``server/forms.py``."""

from __future__ import annotations

import json
import re
import secrets
import urllib.parse

from ..forms import Part, form_parts
from .errors import daemon

FIELD = re.compile(r"files\[(\d+)\]\.(path|file)")


def parts(ctype: str, body: bytes) -> list[Part]:
    """The parts of a ``multipart/form-data`` body: (field name, file name, bytes)."""
    if not ctype.lower().startswith("multipart/form-data"):
        raise daemon(400, "body: a multipart/form-data form is expected")
    return form_parts(ctype, body, daemon)


def uploads(ctype: str, body: bytes) -> list[tuple[str, bytes]]:
    """The files of an upload form: each ``files[i].file`` with its ``files[i].path`` (or, for a
    single ``file`` field, its file name)."""
    paths: dict[int, str] = {}
    data: dict[int, bytes] = {}
    plain: list[tuple[str, bytes]] = []
    for name, filename, value in parts(ctype, body):
        m = FIELD.fullmatch(name)
        if m is None:
            if name == "file" and filename:
                plain.append((filename, value))
            continue
        i = int(m.group(1))
        if m.group(2) == "path":
            paths[i] = value.decode("utf-8", "replace")
        else:
            data[i] = value
    missing = sorted(set(data) ^ set(paths))
    if missing:
        raise daemon(400, f"files[{missing[0]}]: a file needs both its path and its data")
    return [(paths[i], data[i]) for i in sorted(data)] + plain


def _disposition(name: str, path: str) -> str:
    plain = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in path)
    return f"form-data; name=\"{name}\"; filename=\"{plain}\"; filename*=utf-8''{urllib.parse.quote(path, safe='')}"


def downloads(results: list[tuple[str, bytes | None, dict | None]]) -> tuple[bytes, str]:
    """A bulk download's answer: a ``file`` part for each path read, an ``error`` part (JSON) for
    each that could not be; each part named by its path as it was asked for."""
    boundary = secrets.token_hex(16)
    out = bytearray()
    for path, data, error in results:
        body = data if data is not None else json.dumps(error).encode()
        ctype = "application/octet-stream" if data is not None else "application/json"
        out += (f"--{boundary}\r\nContent-Disposition: {_disposition('file' if data is not None else 'error', path)}"
                f"\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        out += body + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"
