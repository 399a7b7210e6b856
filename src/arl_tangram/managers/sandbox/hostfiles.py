"""A session's workspace files, read and written from the engine process (no runner round trip).

Why: a file action through the sandbox's runner carries the bytes base64 in JSON over its pipe
both ways; for a 1 MB ``files.write`` + ``read`` through E2B's SDK that is 100-150 ms p50 on a
loaded 2-core host, most of it the encoding and the pipe. The workspace is a tmpfs in the sandbox's
mount namespace, which this process reaches as ``/proc/<runner>/root/workspace``: opened once
(``open_workspace``) and kept as a directory fd, the files under it are plain ``openat`` calls.

Safety, since the sandbox's code is hostile and owns that tree: every path is resolved one
component at a time from the workspace's fd with ``O_NOFOLLOW`` (a directory: ``O_DIRECTORY``
too), so a symlink planted anywhere on the path is refused (``Unsafe``), never followed out to a
host file; a file that is not a regular one (a FIFO: ``O_NONBLOCK`` keeps its open from
blocking) is refused outright (``NotRegular``). For a symlink the caller falls back to the runner,
inside the sandbox, where a symlink can only reach what the sandbox sees anyway. The fd is of the sandbox's own tmpfs: a
runner that dies and whose pid is reused cannot redirect it. The caller holds the session's step
lock (nothing of the sandbox runs meanwhile: it is frozen between steps).
"""

from __future__ import annotations

import errno
import os
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Unsafe(Exception):
    """A path through a symlink (or with ``..``): leave it to the runner, inside the sandbox."""


class NotRegular(OSError):
    """A FIFO, a socket, a device: refused here and not handed to the runner (whose ``open``
    would block on a FIFO until the file action's timeout)."""


def runner_pid(sandbox_pid: int) -> int | None:
    """The sandbox's runner, the process whose root is the sandbox's: bwrap's child (``--as-pid-1``)."""
    kids = []
    try:
        for name in os.listdir(f"/proc/{sandbox_pid}/task"):
            try:
                with open(f"/proc/{sandbox_pid}/task/{name}/children") as fh:
                    kids += [int(x) for x in fh.read().split()]
            except OSError:
                pass
    except OSError:
        return None
    if not kids:  # no /proc/.../children (CONFIG_PROC_CHILDREN): scan
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as fh:
                        if int(fh.read().rsplit(")", 1)[1].split()[1]) == sandbox_pid:
                            kids.append(int(name))
                except (OSError, IndexError, ValueError):
                    continue
    return kids[0] if len(kids) == 1 else None


def open_workspace(sandbox_pid: int) -> int | None:
    """A directory fd of the sandbox's ``/workspace``, or None (no isolation, no such process)."""
    pid = runner_pid(sandbox_pid)
    if pid is None:
        return None
    try:
        fd = os.open(f"/proc/{pid}/root/workspace", _DIR)
    except OSError:
        return None
    try:  # the sandbox's own tree, never this host's root
        if os.fstat(fd).st_dev == os.stat("/").st_dev:
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return fd


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise Unsafe(rel)
    return parts


def _parent(root: int, parts: list[str], create: bool) -> int:
    """An fd of the directory holding ``parts[-1]``, walked without following anything."""
    fd = os.open(".", _DIR, dir_fd=root)
    try:
        for p in parts[:-1]:
            try:
                nfd = os.open(p, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(p, 0o755, dir_fd=fd)
                nfd = os.open(p, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink, a file where a directory should be
                    raise Unsafe(p) from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open(dir_fd: int, name: str, flags: int) -> int:
    try:
        fd = os.open(name, flags | _FILE, 0o644, dir_fd=dir_fd)
    except IsADirectoryError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink
            raise Unsafe(name) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise NotRegular(errno.EINVAL, f"{name} is not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, f"{name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def write(root: int, rel: str, data: bytes) -> None:
    """Create or replace the workspace file ``rel`` (its directories made as needed)."""
    parts = _parts(rel)
    d = _parent(root, parts, create=True)
    try:
        fd = _open(d, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    finally:
        os.close(d)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read(root: int, rel: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the workspace file ``rel``; None when there is none."""
    parts = _parts(rel)
    try:
        d = _parent(root, parts, create=False)
    except FileNotFoundError:
        return None
    try:
        fd = _open(d, parts[-1], os.O_RDONLY)
    except (FileNotFoundError, IsADirectoryError):
        return None
    finally:
        os.close(d)
    try:
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
