"""A large layer's checks and unpacking in a child process, fed its compressed bytes through a pipe.

A pull's threads share one interpreter lock: the event loop receiving the blob (httpx's Python
for every 64 KB read) and the unpacking thread (a tar header parsed, checked and written per
member, each system call letting go of the lock and taking it back) wait for each other, so a
pull with cores to spare took about the sum of their Python work, not the longest of them. In a
child the unpacking (and the inflate and diff_id hash beside it) has an interpreter of its own;
the parent only receives, hashes the blob and copies its bytes into a pipe.

With ``inflater`` the decompression runs in a process of its own too (``layertar.inflate_child``):
the parent's pipe feeds it, and its output, the plain tar, is the child's stdin. In the child,
the inflate's return to Python after each 1 MB chunk waits for the parsing thread's turn at the
lock, so inflate and parse ran one after the other (the 16-core host: inflate 0.56 s, with the
parse and checks 0.81 s, the whole unpacking 0.94 s). Apart, they overlap where there are cores
for both; the pipe costs ~0.3 s of CPU for the Debian base's 202 MB (``PullLimits.inflater_cpus``).

``unpack_in_child(stream, dest, where, max_bytes, inflater)`` has ``unpack.check_and_unpack``'s
contract: the bytes ``stream.read`` returns are the layer (its end only once the caller verified
the blob: the inflater, then the child, see their stream's end only after that), ``dest`` is the
caller's fresh hidden directory (named by this process's pid, so a killed pull's is removed as
before), and it returns (sha256 of the uncompressed tar, file bytes) or raises ``ImageError``
naming the layer. Bad compressed data is the layer's error as the inflater words it (as in one
process), before the truncated tar the child then read; an inflater or child that dies is
``ChildFailed`` (ours). The child never makes anything visible: the caller renames ``dest`` into
place. Whatever ends the feed early (``stream.read`` raising) kills the child and the inflater
(one process group, the child's) and waits for them before raising on, so ``dest`` is removed
with nothing still writing into it. A parent killed outright closes the pipe: the inflater ends
at its truncated stream, and then the child.

Starting the child (an interpreter and ``unpack``'s modules) costs tens of milliseconds, so only
layers of at least ``PullLimits.process_unpack_bytes`` go through it; it starts while the
download's first bytes are requested, and the feed holds what arrives meanwhile.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..images import ImageError
from ..layertar import BAD_LAYER_EXIT

_LAYERTAR = str(Path(__file__).resolve().parents[1] / "layertar.py")  # the inflater, run as a script

# the child imports the unpacking alone (not this package: httpx and the rest are not needed there)
_BOOT = "from arl_tangram.managers.sandbox.unpack import unpack_child; unpack_child()"
_PKG_ROOT = str(Path(__file__).resolve().parents[4])  # the directory holding the arl_tangram package
_PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class ChildFailed(ImageError):
    """The unpacking process died without an answer, or the inflater died (killed, out of memory):
    ours, not the layer's."""

    infra = True


def unpack_in_child(stream, dest: Path | str, where: str, max_bytes: int | None,
                    inflater: bool = False) -> tuple[str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH", "")) if p)
    # its stderr (a traceback, warnings) to a file: a pipe nobody reads until the end could fill
    # and stop the child while this side waits to write its stdin
    errors = tempfile.TemporaryFile()
    inflating = tempfile.TemporaryFile() if inflater else None
    try:
        argv = [sys.executable, "-c", _BOOT, str(dest), where, str(-1 if max_bytes is None else max_bytes)]
        return _run(stream, argv + ["plain"] * inflater, env, errors, where, inflating, str(dest))
    finally:
        errors.close()
        if inflating is not None:
            inflating.close()


def _pipe_size(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, _PIPE_BYTES)  # fewer wake-ups of the reading side
    except OSError:
        pass


def _run(stream, argv: list[str], env: dict, errors, where: str, inflating=None, dest: str = "") -> tuple[str, int]:
    tar_r = tar_w = -1  # with an inflater: its output, the child's input
    if inflating is not None:
        tar_r, tar_w = os.pipe()
        _pipe_size(tar_w)
    inf = None
    try:
        proc = subprocess.Popen(argv, stdin=tar_r if inflating is not None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, env=env,
                                close_fds=True, process_group=0)  # its group: the child and the inflater
    except BaseException:
        for fd in (tar_r, tar_w):
            if fd >= 0:
                os.close(fd)
        raise
    try:
        if inflating is not None:
            os.close(tar_r)
            tar_r = -1
            # in the child's group (the child waits for its stdin, so the group is there): killed with it.
            # ``dest`` on its command line names it as the child's names the child (nothing reads it there)
            inf = subprocess.Popen([sys.executable, "-P", _LAYERTAR, dest], stdin=subprocess.PIPE, stdout=tar_w,
                                   stderr=inflating, close_fds=True, process_group=proc.pid)
            os.close(tar_w)  # the inflater's alone now: its end is the end of the child's stdin
            tar_w = -1
        sink = (inf or proc).stdin
        fd = sink.fileno()
        _pipe_size(fd)
        while True:
            data = stream.read(-1)
            if not data:
                break
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except BrokenPipeError:  # the reading side stopped (a bad member, bad data): its verdict follows
                break
        if inf is not None:
            try:
                sink.close()  # the end of the stream: the inflater ends, then the child's stdin
            except BrokenPipeError:
                pass
        out, _ = proc.communicate()  # (without an inflater: closes the pipe, the end of the stream)
        if inf is not None:
            inf.wait()
    except BaseException:
        _kill(proc, inf)
        raise
    finally:
        for fd in (tar_r, tar_w):
            if fd >= 0:
                os.close(fd)
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        errors.seek(0)
        err = errors.read()[-2000:].decode("utf-8", "replace").strip()
        raise ChildFailed(f"{where}: the unpacking process ended ({proc.returncode}) without an answer: {err[-500:]}")
    failed = _inflater_failed(inf, inflating, where) if inf is not None else None
    # the inflater's verdict first where the child had met its stream's end (a tar cut short where
    # the inflater stopped) or had no error (a gzip trailer's CRC is checked after the tar's last
    # block): as in one process, where the inflate's error reaches the reader after every chunk
    # before it, instead of the end, so whatever those chunks held (a bad member) fails it first
    if failed is not None and ("error" not in answer or answer.get("at_end")):
        raise failed
    if "error" in answer:
        raise (ChildFailed if answer.get("infra") else ImageError)(str(answer["error"]))
    return str(answer["digest"]), int(answer["size"])


def _inflater_failed(inf: subprocess.Popen, inflating, where: str) -> ImageError | None:
    """The inflater's error: the layer's (bad data, as ``layertar`` words it), or ours (it died)."""
    if inf.returncode == 0:
        return None
    inflating.seek(0)
    err = inflating.read()[-4000:].decode("utf-8", "replace").strip()
    if inf.returncode == BAD_LAYER_EXIT:
        try:
            return ImageError(f"{where}: {json.loads(err.splitlines()[-1])['error']}")
        except (ValueError, IndexError, KeyError, TypeError):
            pass
    return ChildFailed(f"{where}: the inflater process ended ({inf.returncode}): {err[-500:]}")


def _kill(proc: subprocess.Popen, inf: subprocess.Popen | None = None) -> None:
    """Kill the child and the inflater, and wait until both are gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its group (the child is not waited for yet: the id is its own)
    except ProcessLookupError:
        pass
    proc.wait()
    if inf is not None:
        inf.wait()
    if proc.stdout is not None:
        proc.stdout.close()
