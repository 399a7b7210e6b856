"""envd's files: ``/files`` (write, read) and ``filesystem.Filesystem`` (``fsops``), and ``/health``."""

from __future__ import annotations

import base64
import posixpath
import shlex
import time
import uuid

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.spec import Files
from ...runtime import SessionGone
from ..service import NotFound, Service
from . import fsops
from .envelope import E2bError
from .processes import _exec
from .sandboxes import GONE, READ_CAP, _path, boxes


def _in_home(path: str) -> str | None:
    """The workspace-relative name of ``path`` when it is under the home directory."""
    if path.startswith(HOME_ALIAS + "/"):
        return path[len(HOME_ALIAS) + 1:]
    return None


async def e2b_fs(service: Service, sid: str, token: str | None, op: str, args: dict) -> dict:
    """``filesystem.Filesystem``'s Stat, ListDir, MakeDir, Remove, Move: one python step in the
    sandbox (``fsops``)."""
    box = boxes(service).envd(sid, token)
    clean = {}
    for k, v in args.items():
        clean[k] = _path(v, k) if k in ("path", "source", "destination") else v
    depth = clean.get("depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise E2bError(400, "depth: a non-negative integer is expected")
    r = await _exec(service, box, None, None, 60.0, f"x-{uuid.uuid4().hex}", "files", python=fsops.cell(op, clean))
    try:
        out = fsops.answer(r["stdout"])
    except (ValueError, IndexError):
        raise E2bError(500, f"{op}: the sandbox's python did not answer (exit {r['exit_code']}: "
                            f"{r['stderr'].strip()[-300:]})", "internal") from None
    if "error" in out:
        code, message = out["error"]
        status = {"not_found": 404, "already_exists": 409, "permission_denied": 403}.get(code, 400)
        raise E2bError(status, message, code)
    return out


async def e2b_write(service: Service, sid: str, token: str | None, files: list[tuple[str, bytes]]) -> list[dict]:
    """``POST /files``: under the home directory as one files action (no cores); elsewhere as a
    shell step that writes its stdin."""
    box = boxes(service).envd(sid, token)
    paths = [(_path(p), data) for p, data in files]
    home = {rel: data for p, data in paths if (rel := _in_home(p)) is not None}
    s = service.sessions.get(sid)
    if s is None:
        raise E2bError(502, GONE.format(id=sid))
    if home:
        try:
            async with box.lock:
                r = await s.files(Files(put=home))
        except (SessionGone, NotFound):
            raise E2bError(502, GONE.format(id=sid)) from None
        box.used_at = time.time()
        if r.outcome is not Outcome.OK:
            if r.outcome is Outcome.FAILED:
                raise E2bError(400, r.message or r.result.message)
            raise E2bError(503, f"{r.outcome.value}: {r.message or r.result.message}")
    for p, data in paths:
        if _in_home(p) is None:
            q = shlex.quote(p)
            res = await _exec(service, box, f"mkdir -p -- \"$(dirname -- {q})\" && cat > {q}", data, 60.0,
                              f"x-{uuid.uuid4().hex}", "files")
            if res["exit_code"] != 0:
                raise E2bError(400, f"path {p}: {res['stderr'].strip() or 'could not be written'}")
    return [{"name": posixpath.basename(p), "type": "file", "path": p} for p, _ in paths]


async def e2b_read(service: Service, sid: str, token: str | None, path: str) -> bytes:
    box = boxes(service).envd(sid, token)
    p = _path(path)
    rel = _in_home(p)
    s = service.sessions.get(sid)
    if s is None:
        raise E2bError(502, GONE.format(id=sid))
    if rel is not None:
        try:
            async with box.lock:
                r = await s.files(Files(get=[rel]))
        except (SessionGone, NotFound):
            raise E2bError(502, GONE.format(id=sid)) from None
        box.used_at = time.time()
        if r.outcome is Outcome.FAILED:  # not a regular file
            raise E2bError(400, f"path {p}: {r.message or r.result.message}")
        if r.outcome is not Outcome.OK:
            raise E2bError(503, f"{r.outcome.value}: {r.message or r.result.message}")
        if rel in r.result.files:
            data = r.result.files[rel]
            if len(data) >= READ_CAP:  # the runner reads this much and no more
                raise E2bError(507, f"path {p}: {READ_CAP >> 20} MB or larger, more than one read carries")
            return data
    q = shlex.quote(p)
    res = await _exec(service, box, f"if [ -d {q} ]; then echo 'is a directory' >&2; exit 2; fi; base64 -w0 -- {q}",
                      None, 60.0, f"x-{uuid.uuid4().hex}", "files")
    if res["exit_code"] != 0:
        if "No such file" in res["stderr"]:
            raise E2bError(404, f"path {p} does not exist")
        raise E2bError(400, f"path {p}: {res['stderr'].strip()}")
    if res.get("error"):
        raise E2bError(507, f"path {p}: too large to read outside {HOME_ALIAS} ({res['error']})")
    return base64.b64decode(res["stdout"])


def e2b_health(service: Service, sid: str) -> None:
    box = boxes(service).boxes.get(sid)
    if box is None or box.paused:
        raise E2bError(502, GONE.format(id=sid))


CALLS = {"e2b_fs": e2b_fs, "e2b_write": e2b_write, "e2b_read": e2b_read, "e2b_health": e2b_health}
