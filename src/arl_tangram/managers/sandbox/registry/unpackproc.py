"""A large layer's checks and unpacking in a child process, fed its compressed bytes through a pipe.

A pull's threads share one interpreter lock: the event loop receiving the blob (httpx's Python
for every 64 KB read) and the unpacking thread (a tar header parsed, checked and written per
member, each system call letting go of the lock and taking it back) wait for each other, so a
pull with cores to spare took about the sum of their Python work, not the longest of them. In a
child the unpacking (and the inflate and diff_id hash beside it) has an interpreter of its own;
the parent only receives, hashes the blob and copies its bytes into a pipe.

``unpack_in_child(stream, dest, where, max_bytes)`` has ``unpack.check_and_unpack``'s contract:
the bytes ``stream.read`` returns are the layer (its end only once the caller verified the blob),
``dest`` is the caller's fresh hidden directory (named by this process's pid, so a killed pull's
is removed as before), and it returns (sha256 of the uncompressed tar, file bytes) or raises
``ImageError`` naming the layer; a child that dies without an answer is ``ChildFailed`` (ours).
The child never makes anything visible: the caller renames ``dest`` into place. Whatever ends the
feed early (``stream.read`` raising) kills the child and waits for it before raising on, so
``dest`` is removed with nothing still writing into it (the child forks nothing: killing it is
enough). A parent killed outright closes the pipe, and the child ends at its truncated stream.

Starting the child (an interpreter and ``unpack``'s modules) costs tens of milliseconds, so only
layers of at least ``PullLimits.process_unpack_bytes`` go through it; it starts while the
download's first bytes are requested, and the feed holds what arrives meanwhile.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..images import ImageError

# the child imports the unpacking alone (not this package: httpx and the rest are not needed there)
_BOOT = "from arl_tangram.managers.sandbox.unpack import unpack_child; unpack_child()"
_PKG_ROOT = str(Path(__file__).resolve().parents[4])  # the directory holding the arl_tangram package
_PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class ChildFailed(ImageError):
    """The unpacking process died without an answer (killed, out of memory): ours, not the layer's."""

    infra = True


def unpack_in_child(stream, dest: Path | str, where: str, max_bytes: int | None) -> tuple[str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH", "")) if p)
    # its stderr (a traceback, warnings) to a file: a pipe nobody reads until the end could fill
    # and stop the child while this side waits to write its stdin
    errors = tempfile.TemporaryFile()
    try:
        return _run(stream, [sys.executable, "-c", _BOOT, str(dest), where,
                             str(-1 if max_bytes is None else max_bytes)], env, errors, where)
    finally:
        errors.close()


def _run(stream, argv: list[str], env: dict, errors, where: str) -> tuple[str, int]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env,
                            close_fds=True)
    fd = proc.stdin.fileno()
    try:
        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, _PIPE_BYTES)  # fewer wake-ups of the child
        except OSError:
            pass
        while True:
            data = stream.read(-1)
            if not data:
                break
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except BrokenPipeError:  # the child stopped reading (a bad member): its verdict follows
                break
        out, _ = proc.communicate()  # closes the pipe: the end of the stream
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        errors.seek(0)
        err = errors.read()[-2000:].decode("utf-8", "replace").strip()
        raise ChildFailed(f"{where}: the unpacking process ended ({proc.returncode}) without an answer: {err[-500:]}")
    if "error" in answer:
        raise (ChildFailed if answer.get("infra") else ImageError)(str(answer["error"]))
    return str(answer["digest"]), int(answer["size"])
