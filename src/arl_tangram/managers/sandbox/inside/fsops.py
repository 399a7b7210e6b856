"""The ``fs`` operation: one filesystem call for the host (the E2B API's files,
``server/e2b/files.py``) on an absolute path as the sandbox sees it.

Carried out here, in the sandbox's trusted agent, never in the session's interpreter or shell: the
user's code runs there and can replace what runs (a cell that patched ``os.lstat``, or a shell
function named ``base64``, would answer every later call). Files are opened as the host's reads and
writes are (``files.open_plain``); nothing on a pseudo file system is shown (``fs_node``).
"""

import os

from . import b64, shown, unb64, write_all
from .files import READ_TOTAL, NotPlain, open_no_magic, open_plain, pseudo_devs, read_past

#: the most entries one ``list`` answers, and the most bytes of their names (the answer is one line
#: of the host's channel, 64 MiB: 10,000 links of 4 KB targets under a deep path would overflow it)
LIST_MAX = 10000
LIST_BYTES = 32 << 20


class FsError(Exception):
    """A filesystem call's failure that is the caller's: ``(code, message)``."""


def fs_node(st, path, follow=False):
    """An ``O_PATH`` descriptor of ``path`` (of a link itself unless ``follow``), reached without
    magic links and refused on a pseudo file system: nothing of /proc/1 the sandbox's own code
    could not see (``list /proc/1/map_files`` or ``stat /proc/1/fd/4`` through this process)."""
    return not_pseudo(st, open_no_magic(st, path, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), 0),
                      path)


def not_pseudo(st, fd, path):
    """``fd``, or ``NotPlain`` (``fd`` closed) when it is on a pseudo file system."""
    if os.fstat(fd).st_dev in pseudo_devs(st):
        os.close(fd)
        raise NotPlain(1, "on /proc or /sys: not shown through this API (a command can look)", path)
    return fd


def fs_entry(st, path):
    """What the host shows of ``path``: a link is listed as itself, with the kind, size and
    mode of what it points to when that can be reached."""
    fd = fs_node(st, path)
    try:
        got = os.fstat(fd)
        link = None
        if (got.st_mode & 0o170000) == 0o120000:
            link = shown(os.readlink("", dir_fd=fd))
            try:
                target = fs_node(st, path, follow=True)
            except OSError:
                pass
            else:
                got = os.fstat(target)
                os.close(target)
    finally:
        os.close(fd)
    return {"path": shown(path), "mode": got.st_mode, "size": got.st_size, "mtime": got.st_mtime, "link": link}


def fs_stat(st, req, path):
    return {"entry": fs_entry(st, path)}


def fs_list(st, req, path):
    """Entries to ``depth`` levels, walked level by level (no recursion: a tree a thousand deep
    would be a RecursionError), each directory opened as ``fs_node`` reaches it and never one on
    a pseudo file system."""
    depth, found, size = max(1, int(req.get("depth") or 1)), [], 0
    todo = [(path, 1)]
    while todo:
        d, level = todo.pop()
        try:
            fd = not_pseudo(st, open_no_magic(st, d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0), d)
        except NotADirectoryError:
            if level == 1:  # the path asked for (only it is at level 1)
                raise FsError("invalid", f"path {shown(path)} is not a directory") from None
            continue
        except OSError:  # (NotPlain among them: below, a pseudo file system is skipped)
            if level == 1:
                raise
            continue
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        below = []
        for name in names:
            full = os.path.join(d, name)
            try:
                e = fs_entry(st, full)
            except OSError:  # gone meanwhile, or on a pseudo file system
                continue
            size += len(e["path"]) + len(e["link"] or "") + 120
            if len(found) == LIST_MAX or size > LIST_BYTES:
                raise FsError("too_many", f"path {shown(path)}: more than {LIST_MAX} entries or {LIST_BYTES >> 20} MB "
                                          "of names, list it with a smaller depth")
            found.append(e)
            if level < depth and e["link"] is None and (e["mode"] & 0o170000) == 0o040000:
                below.append((full, level + 1))
        todo.extend(reversed(below))
    return {"entries": found}


def fs_mkdir(st, req, path):
    if os.path.lexists(path):
        raise FsError("exists", f"path {shown(path)} already exists")
    os.makedirs(path)
    return {"entry": fs_entry(st, path)}


def fs_remove(st, req, path):
    fd = fs_node(st, path)
    try:
        is_dir = (os.fstat(fd).st_mode & 0o170000) == 0o040000
    finally:
        os.close(fd)
    if not is_dir:
        os.unlink(path)
        return {}
    top = open_no_magic(st, path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0)
    stack = [(top, None, None, os.listdir(top))]  # (directory, its parent's descriptor, its name there, left)
    try:
        while stack:
            fd, up, here, left = stack[-1]
            if left:  # one entry at a time, a directory one level down (no recursion: a tree a
                name = left.pop()  # thousand deep would be a RecursionError, the tree left half removed)
                if (os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode & 0o170000) != 0o040000:
                    os.unlink(name, dir_fd=fd)
                    continue
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                stack.append((sub, fd, name, None))
                stack[-1] = (sub, fd, name, os.listdir(sub))
                continue
            stack.pop()
            os.close(fd)
            if up is not None:
                os.rmdir(here, dir_fd=up)
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)
    os.rmdir(path)
    return {}


def fs_move(st, req, path):
    dst = req.get("destination")
    if not isinstance(dst, str) or not dst.startswith("/"):
        raise FsError("invalid", "destination: an absolute path is expected")
    os.close(fs_node(st, path))  # it exists, and not on /proc or /sys
    parent = os.path.dirname(dst)
    if parent:
        os.makedirs(parent, exist_ok=True)
    os.rename(path, dst)
    return {"entry": fs_entry(st, dst)}


def fs_read(st, req, path):
    if os.path.isdir(path):
        raise FsError("invalid", f"path {shown(path)} is a directory")
    limit = min(int(req.get("max_bytes") or 1 << 24), READ_TOTAL)  # one answer line carries this much
    fd = open_plain(st, path, os.O_RDONLY)
    try:
        data = read_past(fd, limit)
    finally:
        os.close(fd)
    return {"data": b64(data[:limit]), "cut": len(data) > limit}


def fs_write(st, req, path):
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fd = open_plain(st, path, os.O_WRONLY | os.O_CREAT, truncate=True)
    try:
        write_all(fd, unb64(req.get("data")))
    finally:
        os.close(fd)
    return {"entry": fs_entry(st, path)}


FS_CALLS = {"stat": fs_stat, "list": fs_list, "mkdir": fs_mkdir, "remove": fs_remove, "move": fs_move,
            "read": fs_read, "write": fs_write}


def op_fs(st, req):
    """The call ``req["call"]`` on ``req["path"]``. The answer is ``{"fs": ...}``, or
    ``{"fs_error": [code, message]}`` for a failure that is the caller's."""
    call, path = FS_CALLS.get(req.get("call")), req.get("path")
    if call is None or not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        return {"fs_error": ["invalid", f"no filesystem call {req.get('call')!r} on {path!r}"]}
    try:
        return {"fs": call(st, req, path)}
    except FsError as e:
        return {"fs_error": list(e.args)}
    except FileNotFoundError as e:
        return {"fs_error": ["not_found", f"path {shown(str(e.filename or path))} does not exist"]}
    except FileExistsError as e:
        return {"fs_error": ["exists", f"path {shown(str(e.filename or path))} already exists"]}
    except NotPlain as e:
        return {"fs_error": ["invalid", f"path {shown(path)}: {e.strerror}"]}
    except PermissionError as e:
        return {"fs_error": ["denied", f"path {shown(str(e.filename or path))}: {e.strerror}"]}
    except OSError as e:
        return {"fs_error": ["invalid", f"path {shown(str(e.filename or path))}: {e.strerror or e}"]}
