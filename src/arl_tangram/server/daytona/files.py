"""The toolbox's ``/files`` calls, carried out as E2B's are: files under the home directory as the
native API's (``Files``: from the server process when the path is plain), everything else one
``FsCall`` of the sandbox's trusted agent, never the session's shell or interpreter, whose code
the sandbox's user can replace. Finding, searching and replacing in files walk and read through
the agent too, and match here: a grader's ``find_files`` is not answered by the sandbox's own
``grep``. Only a file's mode and owner are set by a command in the sandbox (``chmod``,
``chown``): the agent does not change them."""

from __future__ import annotations

import datetime
import fnmatch
import posixpath
import re
import shlex
import stat
from typing import Any

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.spec import Files, FsCall
from ...runtime import SessionGone
from ..service import NotFound, Service
from .errors import DaytonaApiError, daemon
from .process import Using, ran, abs_path, step
from .sandboxes import USER, Box

#: the most a file action reads of one file (the agent's own cap on one answer)
READ_CAP = 1 << 24
#: what ``find_files`` reads at most: files, bytes of one file (larger ones are skipped), matches
FIND_FILES, FIND_FILE_BYTES, FIND_MATCHES = 5000, 1 << 20, 10_000
#: how deep ``find_files`` and ``search_files`` walk
WALK_DEPTH = 32
#: the agent's failure codes as Daytona's daemon answers them
CODES = {"not_found": (404, "FILE_NOT_FOUND"), "exists": (409, "CONFLICT"), "denied": (403, "FILE_ACCESS_DENIED"),
         "invalid": (400, "INVALID_FILE_PATH"), "too_many": (400, "BAD_REQUEST")}
MODE = re.compile(r"[0-7]{3,4}")
OWNER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}|[0-9]{1,10}")


def _in_home(path: str) -> str | None:
    return path[len(HOME_ALIAS) + 1:] if path.startswith(HOME_ALIAS + "/") else None


async def _call(s: Any, box: Box, call: Any) -> Any:
    try:
        r = await (s.fs(call) if isinstance(call, FsCall) else s.files(call))
    except (SessionGone, NotFound):
        raise DaytonaApiError(404, f"Sandbox {box.id} not found") from None
    if r.outcome is Outcome.FAILED and r.result is not None and "error" in r.result.info:
        status, code = CODES.get(r.result.info["error"], (400, "BAD_REQUEST"))
        raise daemon(status, r.message or r.result.message, code)
    if r.outcome is Outcome.FAILED and isinstance(call, Files):
        raise daemon(400, r.message or r.result.message, "INVALID_FILE_PATH")
    if r.outcome is not Outcome.OK:
        raise daemon(503, f"{r.outcome.value}: {r.message or (r.result.message if r.result else '')}")
    return r


def info(e: dict) -> dict:
    """Daytona's ``FileInfo`` of one agent entry (a link shows what it points to, as ``ls -lL``)."""
    mode, path = int(e["mode"]), str(e["path"])
    when = datetime.datetime.fromtimestamp(float(e["mtime"]), datetime.timezone.utc)
    return {"name": posixpath.basename(path.rstrip("/")) or "/", "path": path, "isDir": stat.S_ISDIR(mode),
            "size": int(e["size"]), "mode": stat.filemode(mode), "permissions": f"{stat.S_IMODE(mode):04o}",
            "owner": USER, "group": USER, "modTime": when.strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC"),
            "modifiedAt": when.isoformat().replace("+00:00", "Z")}


async def read(s: Any, box: Box, paths: list[str]) -> dict[str, bytes | DaytonaApiError]:
    """Each file's bytes, or the error reading it: those under the home directory in one files
    action, the rest (and any that action could not read plainly) by the agent."""
    out: dict[str, bytes | DaytonaApiError] = {}
    home = {rel: p for p in paths if (rel := _in_home(p)) is not None}
    if home:
        try:
            r = await _call(s, box, Files(get=list(home)))
            for rel, data in r.result.files.items():
                out[home[rel]] = data
        except DaytonaApiError as e:
            if e.status >= 500 or e.status == 404 and "Sandbox" in e.message:
                raise
    for p in paths:
        if p in out:
            continue
        try:
            r = await _call(s, box, FsCall("read", p, max_bytes=READ_CAP))
        except DaytonaApiError as e:
            if e.status >= 500:
                raise
            out[p] = e
            continue
        data = r.result.files[p]
        out[p] = data if len(data) < READ_CAP else daemon(400, f"{p}: {READ_CAP >> 20} MB or larger, more than one "
                                                               "download carries (read it in parts with a command)")
    return out


async def write(s: Any, box: Box, files: list[tuple[str, bytes]]) -> None:
    home = {rel: data for p, data in files if (rel := _in_home(p)) is not None}
    if home:
        await _call(s, box, Files(put=home))
    for p, data in files:
        if _in_home(p) is None:
            await _call(s, box, FsCall("write", p, data=data))


async def daytona_upload(service: Service, sid: str, files: list[tuple[str, bytes]]) -> dict:
    """``POST /files/bulk-upload`` (and ``/files/upload``): each file written (its directories
    made)."""
    async with Using(service, sid) as (box, s):
        paths = [(abs_path(p), data) for p, data in files]
        await write(s, box, paths)
    return {"files": [{"path": p, "name": posixpath.basename(p), "type": "file"} for p, _ in paths], "errors": []}


async def daytona_download(service: Service, sid: str, paths: list[Any]) -> list[tuple[str, bytes | None, dict | None]]:
    """``POST /files/bulk-download``: each path's bytes, or its error in Daytona's shape."""
    async with Using(service, sid) as (box, s):
        full = [(p, abs_path(p)) for p in paths]
        got = await read(s, box, [f for _, f in full])
    out = []
    for asked, f in full:
        v = got.get(f)
        out.append((asked, None, v.body()) if isinstance(v, DaytonaApiError) else (asked, v, None))
    return out


async def _walk(s: Any, box: Box, path: str) -> list[dict]:
    """Every entry under ``path`` (``WALK_DEPTH`` levels), or ``path`` itself when it is a file."""
    top = (await _call(s, box, FsCall("stat", path))).result.info["entry"]
    if not stat.S_ISDIR(int(top["mode"])):
        return [top]
    return (await _call(s, box, FsCall("list", path, depth=WALK_DEPTH))).result.info["entries"]


def _regex(pattern: Any) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise daemon(400, "pattern: a non-empty pattern is expected")
    try:
        return re.compile(pattern)
    except re.error:
        return re.compile(re.escape(pattern))


async def daytona_fs(service: Service, sid: str, op: str, args: dict) -> Any:
    """The toolbox's other file calls: ``list``, ``info``, ``mkdir``, ``delete``, ``move``,
    ``find`` (files containing a pattern: a regular expression, or the text itself when it is
    not one), ``search`` (names matching a glob), ``replace`` (text, in given files), ``chmod``."""
    async with Using(service, sid) as (box, s):
        path = abs_path(args.get("path") or HOME_ALIAS) if op != "replace" else ""
        if op == "list":
            depth = args.get("depth") or 1
            if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
                raise daemon(400, "depth: a positive integer is expected")
            return [info(e) for e in (await _call(s, box, FsCall("list", path, depth=depth))).result.info["entries"]]
        if op == "info":
            return info((await _call(s, box, FsCall("stat", path))).result.info["entry"])
        if op == "mkdir":
            try:
                await _call(s, box, FsCall("mkdir", path))
            except DaytonaApiError as e:
                entry = (await _call(s, box, FsCall("stat", path))).result.info["entry"] if e.status == 409 else None
                if entry is None or not stat.S_ISDIR(int(entry["mode"])):
                    raise
            mode = args.get("mode")
            if mode and mode not in ("755", "0755"):
                await _chmod(service, s, box, path, mode, None, None)
            return None
        if op == "delete":
            entry = (await _call(s, box, FsCall("stat", path))).result.info["entry"]
            if stat.S_ISDIR(int(entry["mode"])) and entry.get("link") is None and not args.get("recursive"):
                raise daemon(400, f"{path} is a directory: delete it with recursive=True", "INVALID_FILE_PATH")
            await _call(s, box, FsCall("remove", path))
            return None
        if op == "move":
            await _call(s, box, FsCall("move", abs_path(args.get("source"), "source"),
                                       destination=abs_path(args.get("destination"), "destination")))
            return None
        if op == "search":
            pattern = args.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise daemon(400, "pattern: a glob is expected")
            return {"files": [e["path"] for e in await _walk(s, box, path)
                              if fnmatch.fnmatchcase(posixpath.basename(e["path"]), pattern)]}
        if op == "find":
            return await _find(s, box, path, _regex(args.get("pattern")))
        if op == "replace":
            return await _replace_text(s, box, args)
        if op == "chmod":
            await _call(s, box, FsCall("stat", path))
            await _chmod(service, s, box, path, args.get("mode"), args.get("owner"), args.get("group"))
            return None
    raise daemon(400, f"files: no operation {op!r}")


async def _find(s: Any, box: Box, path: str, pattern: re.Pattern) -> list[dict]:
    files = [e["path"] for e in await _walk(s, box, path)
             if e.get("link") is None and stat.S_ISREG(int(e["mode"])) and int(e["size"]) <= FIND_FILE_BYTES]
    matches: list[dict] = []
    for at in range(0, min(len(files), FIND_FILES), 200):
        got = await read(s, box, files[at:at + 200])
        for f in files[at:at + 200]:
            data = got.get(f)
            if not isinstance(data, bytes) or b"\0" in data[:8192]:  # unreadable, or binary: as grep -I
                continue
            for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if pattern.search(line):
                    matches.append({"file": f, "line": n, "content": line})
                    if len(matches) >= FIND_MATCHES:
                        return matches
    return matches


async def _replace_text(s: Any, box: Box, args: dict) -> list[dict]:
    files, pattern, new = args.get("files"), args.get("pattern"), args.get("newValue")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise daemon(400, "files: a list of paths is expected")
    if not isinstance(pattern, str) or not pattern or not isinstance(new, str):
        raise daemon(400, "pattern, newValue: strings are expected (the pattern not empty)")
    paths = [abs_path(f, "files") for f in files]
    got = await read(s, box, paths)
    out, changed = [], []
    for asked, p in zip(files, paths):
        data = got.get(p)
        if isinstance(data, DaytonaApiError):
            out.append({"file": asked, "success": False, "error": data.message})
            continue
        text = data.decode("utf-8", "surrogateescape")
        if pattern in text:
            changed.append((p, text.replace(pattern, new).encode("utf-8", "surrogateescape")))
        out.append({"file": asked, "success": True})
    await write(s, box, changed)
    return out


async def _chmod(service: Service, s: Any, box: Box, path: str, mode: Any, owner: Any, group: Any) -> None:
    """A file's mode and owner, set by ``chmod`` and ``chown`` in the sandbox (as its user: a file
    it does not own, or an owner it may not give, is the command's error)."""
    words = []
    if mode is not None:
        if not isinstance(mode, str) or not MODE.fullmatch(mode):
            raise daemon(400, f"mode: octal digits are expected (755), got {mode!r}")
        words.append(f"chmod {mode} -- {shlex.quote(path)}")
    for name, value in (("owner", owner), ("group", group)):
        if value is not None and (not isinstance(value, str) or not OWNER.fullmatch(value)):
            raise daemon(400, f"{name}: a user or group name is expected, got {value!r}")
    if owner or group:
        words.append(f"chown {owner or ''}{':' + group if group else ''} -- {shlex.quote(path)}")
    if not words:
        return
    r = await step(service, box, s, f"( {' && '.join(words)} ) 2>&1", 30.0, "chmod")
    code, out, err = ran(r, box.id)
    if code != 0:
        raise daemon(403 if "not permitted" in out + err else 400, (out + err).strip() or f"exit {code}",
                     "FILE_ACCESS_DENIED" if "not permitted" in out + err else "BAD_REQUEST")


CALLS = {"daytona_upload": daytona_upload, "daytona_download": daytona_download, "daytona_fs": daytona_fs}
