"""envd's files: ``/files`` (write, read) and ``filesystem.Filesystem`` (``fsops``), and ``/health``.

Under the home directory (the session's workspace) files go as the native API's do (``Files``:
from the server process when the path is plain, ``hostfiles``); everything else is an ``FsCall``
carried out by the sandbox's agent."""

from __future__ import annotations

import posixpath
import time
from typing import Any, Awaitable, Callable

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.spec import Files, FsCall
from ...runtime import ActionResult, SessionGone
from ..service import NotFound, Service
from . import fsops
from .envelope import E2bError
from .sandboxes import GONE, READ_CAP, abs_path, boxes


def _in_home(path: str) -> str | None:
    """The workspace-relative name of ``path`` when it is under the home directory."""
    if path.startswith(HOME_ALIAS + "/"):
        return path[len(HOME_ALIAS) + 1:]
    return None


async def _step(service: Service, sid: str, token: str | None,
                call: Callable[[Any], Awaitable[ActionResult]]) -> ActionResult:
    """``call(session)`` under the sandbox's lock (one thing at a time in a sandbox), the
    sandbox then marked used; a session that is gone is envd's 502."""
    box = boxes(service).envd(sid, token)
    s = service.sessions.get(sid)
    if s is None:
        raise E2bError(502, GONE.format(id=sid))
    try:
        async with box.lock:
            r = await call(s)
    except (SessionGone, NotFound):
        raise E2bError(502, GONE.format(id=sid)) from None
    box.used_at = time.time()
    return r


async def _fs(service: Service, sid: str, token: str | None, call: FsCall) -> ActionResult:
    """One ``FsCall`` of the sandbox's session (``fsops``: by the sandbox's agent, never its
    user's code); a failure that is the caller's is an ``E2bError`` with envd's code."""
    r = await _step(service, sid, token, lambda s: s.fs(call))
    if r.outcome is Outcome.FAILED and r.result is not None and "error" in r.result.info:
        status, code = fsops.STATUS.get(r.result.info["error"], (400, "invalid_argument"))
        raise E2bError(status, r.message or r.result.message, code)
    if r.outcome is not Outcome.OK:
        raise E2bError(503, f"{r.outcome.value}: {r.message or (r.result.message if r.result else '')}", "unavailable")
    return r


async def e2b_fs(service: Service, sid: str, token: str | None, op: str, args: dict) -> dict:
    """``filesystem.Filesystem``'s Stat, ListDir, MakeDir, Remove, Move."""
    clean = {}
    for k, v in args.items():
        clean[k] = abs_path(v, k) if k in ("path", "source", "destination") else v
    depth = clean.get("depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise E2bError(400, "depth: a non-negative integer is expected")
    if op == "move":
        call = FsCall("move", clean["source"], destination=clean["destination"])
    else:
        call = FsCall(op, clean["path"], depth=depth or 1)  # type: ignore[arg-type]
    r = await _fs(service, sid, token, call)
    return fsops.answer(r.result.info)


async def e2b_write(service: Service, sid: str, token: str | None, files: list[tuple[str, bytes]]) -> list[dict]:
    """``POST /files``: under the home directory as one files action (no cores); elsewhere one
    ``FsCall`` a file."""
    boxes(service).envd(sid, token)
    paths = [(abs_path(p), data) for p, data in files]
    home = {rel: data for p, data in paths if (rel := _in_home(p)) is not None}
    if home:
        r = await _step(service, sid, token, lambda s: s.files(Files(put=home)))
        if r.outcome is not Outcome.OK:
            if r.outcome is Outcome.FAILED:
                raise E2bError(400, r.message or r.result.message)
            raise E2bError(503, f"{r.outcome.value}: {r.message or r.result.message}")
    for p, data in paths:
        if _in_home(p) is None:
            await _fs(service, sid, token, FsCall("write", p, data=data))
    return [{"name": posixpath.basename(p), "type": "file", "path": p} for p, _ in paths]


async def e2b_read(service: Service, sid: str, token: str | None, path: str) -> bytes:
    boxes(service).envd(sid, token)
    p = abs_path(path)
    rel = _in_home(p)
    if rel is not None:
        r = await _step(service, sid, token, lambda s: s.files(Files(get=[rel])))
        if r.outcome is Outcome.FAILED:  # not a regular file
            raise E2bError(400, f"path {p}: {r.message or r.result.message}")
        if r.outcome is not Outcome.OK:
            raise E2bError(503, f"{r.outcome.value}: {r.message or r.result.message}")
        if rel in r.result.files:
            return _whole(p, r.result.files[rel])
    r = await _fs(service, sid, token, FsCall("read", p, max_bytes=READ_CAP))  # or why not (a directory...)
    return _whole(p, r.result.files[p])


def _whole(path: str, data: bytes) -> bytes:
    """The file, or a 413 when it may be longer than one read carries (the SDK then raises its
    plain ``SandboxException`` with this message: a 507 was its ``NotEnoughSpaceException``, a
    full disk, which it is not)."""
    if len(data) >= READ_CAP:  # the runner reads this much and no more
        raise E2bError(413, f"path {path}: {READ_CAP >> 20} MB or larger, more than one read carries "
                            "(read it in parts with a command, e.g. split or dd)", "resource_exhausted")
    return data


def e2b_health(service: Service, sid: str) -> None:
    box = boxes(service).boxes.get(sid)
    if box is None or box.paused:
        raise E2bError(502, GONE.format(id=sid))


CALLS = {"e2b_fs": e2b_fs, "e2b_write": e2b_write, "e2b_read": e2b_read, "e2b_health": e2b_health}
