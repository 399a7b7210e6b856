"""Starting a sandbox's process from a large server process without copying the server.

uvloop, the server's event loop, starts a subprocess with libuv's ``fork()``: the kernel copies
the page tables of the whole server process, and every page the server writes afterwards takes a
write-protect fault (the child has long exec'd by then, but the server's pages were marked
copy-on-write at the fork). CPython's own ``subprocess`` starts it with ``vfork()`` (the child
borrows the parent's memory until it execs; ``_posixsubprocess`` does so when no ``preexec_fn``,
user, group or groups are asked for), which copies nothing: from a process holding ~100 MB, a
start costs its starter ~20 ms of CPU and ~15,000 page faults through uvloop, 3-4 ms and two
through ``subprocess`` (``tangram bench spawn`` measures the sandboxes' own start). The fork also
stalls the loop, and every request in flight with it, while the tables are copied.

``start_process`` runs ``subprocess.Popen`` and gives the process what ``Sandbox`` uses of
``asyncio.subprocess.Process``: asyncio streams on its three pipes and an exit the loop learns of
through a pidfd (readable once the process has ended; then reaped by ``Popen.poll``, so the
``Popen`` and its ``returncode`` stay the one account of the child). The pipes are read and
written by the loop's own ``add_reader`` / ``add_writer`` on descriptors this module owns and
closes: uvloop's ``connect_read_pipe`` closes a file object's descriptor in libuv and then the
file object again (an ``EBADF`` it ignores, or another thread's descriptor opened in between).
Where there is no ``os.pidfd_open`` (not Linux, or a kernel before 5.3) it is
``asyncio.create_subprocess_exec``, as before.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
from typing import Any, Protocol

READ_CHUNK = 1 << 18  # bytes read from a pipe per readiness: a runner's answer line is mostly one read


class Process(Protocol):
    """What a sandbox uses of its process (``asyncio.subprocess.Process`` has it too)."""

    pid: int
    stdin: Any
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


class _Reading:
    """A pipe fed into a ``StreamReader`` from the loop's readiness callbacks: what the reader's
    flow control calls a transport (``pause_reading`` past twice its limit, ``resume_reading``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, reader: asyncio.StreamReader) -> None:
        self._loop, self._fd, self._reader = loop, fd, reader
        os.set_blocking(fd, False)
        reader.set_transport(self)  # type: ignore[arg-type]
        loop.add_reader(fd, self._readable)
        self._paused = False

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._reader.set_exception(e)
            self.close()
            return
        if data:
            self._reader.feed_data(data)
            return
        self._reader.feed_eof()
        self.close()

    def pause_reading(self) -> None:
        if not self._paused and self._fd >= 0:
            self._paused = True
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if self._paused and self._fd >= 0:
            self._paused = False
            self._loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        """Stop reading: the reader sees the stream end after what it holds (a read waiting on a
        sandbox killed while a process inside still held the pipe ends now, as a dead sandbox's
        read must; without it, it waited for the request's own timeout)."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self._reader.at_eof():
            self._reader.feed_eof()

    def is_closing(self) -> bool:
        return self._fd < 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def __del__(self) -> None:  # only reachable unregistered (paused): the loop holds a registered one
        if self._fd >= 0:
            os.close(self._fd)


class _Writing:
    """A pipe written without blocking the loop: ``write`` sends what the pipe takes now and keeps
    the rest for the loop's writability callbacks; ``drain`` returns once nothing is kept. A pipe
    whose reader is gone fails the write (and every later one) with ``BrokenPipeError``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop, self._fd = loop, fd
        os.set_blocking(fd, False)
        self._kept = bytearray()
        self._error: OSError | None = None
        self._drained: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        if not self._kept:
            try:
                sent = os.write(self._fd, data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._fail(e)
                raise self._error from e
            data = data[sent:]
            if not data:
                return
            self._loop.add_writer(self._fd, self._writable)
        self._kept += data

    def _writable(self) -> None:
        try:
            sent = os.write(self._fd, self._kept)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        del self._kept[:sent]
        if not self._kept:
            self._loop.remove_writer(self._fd)
            self._wake()

    def _fail(self, e: OSError) -> None:
        self._error = e if isinstance(e, ConnectionError) else BrokenPipeError(str(e))
        self.close()

    def _wake(self) -> None:
        if self._drained is not None and not self._drained.done():
            if self._error is not None:
                self._drained.set_exception(self._error)
            else:
                self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._kept:
            return
        if self._drained is None:
            self._drained = self._loop.create_future()
            # (a drain cancelled meanwhile leaves it to fail unseen: not "never retrieved" in the log)
            self._drained.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.shield(self._drained)

    def close(self) -> None:
        """Close the pipe (the process ended, or the sandbox is killed): what it kept is dropped,
        and a write or a drain, waiting or to come, fails with ``BrokenPipeError``, as asyncio's
        transport fails it once the last reader is gone (a sandbox killed during a step whose
        request was still being written: without this its ``drain`` waited for good)."""
        if self._error is None:
            self._error = BrokenPipeError("the sandbox's input is closed")
        self._kept.clear()
        if self._fd >= 0:
            self._loop.remove_writer(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._wake()

    def is_closing(self) -> bool:
        return self._fd < 0

    def kept(self) -> int:
        """Bytes written and not yet taken by the pipe."""
        return len(self._kept)


class Child:
    """A process started by ``start_process``: its pipes as asyncio streams, its exit watched by a pidfd."""

    def __init__(self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen, pidfd: int, limit: int) -> None:
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        self._loop, self._popen, self._pidfd = loop, popen, pidfd
        self.pid = popen.pid
        # the descriptors move out of Popen's file objects (which would close them again)
        fds: list[int] = []
        try:
            for f in (popen.stdin, popen.stdout, popen.stderr):
                fds.append(os.dup(f.fileno()))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        for f in (popen.stdin, popen.stdout, popen.stderr):
            f.close()
        popen.stdin = popen.stdout = popen.stderr = None
        self.stdin = _Writing(loop, fds[0])
        self.stdout = asyncio.StreamReader(limit=limit, loop=loop)
        self.stderr = asyncio.StreamReader(limit=limit, loop=loop)
        self._reading = [_Reading(loop, fds[1], self.stdout), _Reading(loop, fds[2], self.stderr)]
        self._ended: asyncio.Future[int] = loop.create_future()
        loop.add_reader(pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self) -> None:
        if self._popen.poll() is None:  # (readable only once it ended: never, but a poll costs nothing)
            return
        self._drop_pidfd()
        self.stdin.close()
        if not self._ended.done():
            self._ended.set_result(self._popen.returncode)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL, as ``asyncio.subprocess.Process.kill``: ``ProcessLookupError`` once it is reaped
        (its pid may be another process's by then); until then a zombie takes it harmlessly."""
        if self._popen.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def close(self) -> None:
        """Release its descriptors (``Sandbox.kill``, once it has ended): the pipes, even one whose
        reading is paused (output nobody read past twice the limit), and the pidfd if the exit
        was not seen yet."""
        self.stdin.close()
        for r in self._reading:
            r.close()
        self._drop_pidfd()

    def _drop_pidfd(self) -> None:
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


async def start_process(argv: list[str], env: dict[str, str], cwd: str | None, limit: int) -> Process:
    """Start ``argv`` in a session of its own with ``env`` in ``cwd``, its stdin, stdout and stderr
    piped (each stream's buffer bounded by ``limit``, as ``asyncio``'s)."""
    if not hasattr(os, "pidfd_open"):
        return await loop_subprocess(argv, env, cwd, limit)
    loop = asyncio.get_running_loop()
    popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, cwd=cwd, env=env, bufsize=0)
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError as e:
        _discard(popen)
        if e.errno != errno.ENOSYS:
            raise
        # a kernel before 5.3 under a Python built for a later one: as before
        return await loop_subprocess(argv, env, cwd, limit)
    try:
        return Child(loop, popen, pidfd, limit)
    except BaseException:  # (descriptors ran out): nothing of it stays, the process included
        _discard(popen)
        os.close(pidfd)
        raise


async def loop_subprocess(argv: list[str], env: dict[str, str], cwd: str | None, limit: int) -> Process:
    """``start_process`` by the loop's own subprocess (the way before; under uvloop, libuv's fork
    of this whole process): where there is no pidfd, and ``tangram bench spawn``'s comparison."""
    return await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, cwd=cwd, env=env, limit=limit)


def _discard(popen: subprocess.Popen) -> None:
    """Kill a process just started, close what is left of its pipes, reap it (at once: SIGKILL)."""
    popen.kill()
    for f in (popen.stdin, popen.stdout, popen.stderr):
        if f is not None:
            f.close()
    popen.wait()
