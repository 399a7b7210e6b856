"""``managers/sandbox/spawn.py``: a sandbox's process started by vfork, its pipes and exit on the
loop, under uvloop (the server's loop) and asyncio's own."""

from __future__ import annotations

import asyncio
import os
import resource
import signal

import pytest

from arl_tangram.managers.sandbox.spawn import READ_CHUNK, Child, start_process

uvloop = pytest.importorskip("uvloop")
LOOPS = ["asyncio", "uvloop"]
pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd here: start_process is asyncio's")


def run(loop: str, coro):
    return (uvloop.run if loop == "uvloop" else asyncio.run)(coro)


def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.mark.parametrize("loop", LOOPS)
def test_a_started_process_talks_on_its_pipes_and_its_exit_is_reaped(loop):
    """stdin written and drained, stdout read by line, stderr read, the exit status through the
    pidfd; a kill after the reaping is ``ProcessLookupError`` (the pid may be another's by then)."""
    async def body():
        p = await start_process(["sh", "-c", 'read x; echo "got $x"; echo oops >&2; exit 3'], env(), None, 1 << 16)
        assert isinstance(p, Child) and p.returncode is None
        p.stdin.write(b"hello\n")
        await p.stdin.drain()
        assert await p.stdout.readline() == b"got hello\n"
        assert await p.stderr.read() == b"oops\n"
        assert await asyncio.wait_for(p.wait(), 10) == 3
        assert p.returncode == 3 and await p.stdout.read() == b""
        with pytest.raises(ProcessLookupError):
            p.kill()
    run(loop, body())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_killed_process_ends_by_the_signal_and_a_dead_reader_breaks_the_pipe(loop):
    """``kill`` is SIGKILL, reported as ``-9``; writing to a process that is gone fails with
    ``BrokenPipeError`` (what ``Sandbox.request`` reads as a dead sandbox), at once or at the
    drain, and every write after it too."""
    async def body():
        p = await start_process(["sleep", "30"], env(), None, 1 << 16)
        p.kill()
        assert await asyncio.wait_for(p.wait(), 10) == -signal.SIGKILL
        gone = await start_process(["sh", "-c", "exec 0<&-; sleep 0.2"], env(), None, 1 << 16)
        with pytest.raises(BrokenPipeError):
            gone.stdin.write(b"x" * (4 << 20))  # more than a pipe holds: the rest waits for the reader
            await gone.stdin.drain()
        with pytest.raises(BrokenPipeError):
            gone.stdin.write(b"again")
        await asyncio.wait_for(gone.wait(), 10)
    run(loop, body())


@pytest.mark.parametrize("loop", LOOPS)
def test_big_writes_wait_for_the_reader_and_big_outputs_pause_the_pipe(loop):
    """A write larger than the pipe is kept and sent as the child reads (``drain`` returns once all
    is sent); output past twice the reader's limit pauses reading and resumes as it is consumed,
    nothing lost."""
    async def body():
        p = await start_process(["sh", "-c", "sleep 0.1; wc -c; head -c 3000000 /dev/zero"], env(), None, 4096)
        p.stdin.write(b"y" * (3 << 20))
        await asyncio.wait_for(p.stdin.drain(), 10)
        p.stdin.close()  # the end of its input
        assert (await asyncio.wait_for(p.stdout.readline(), 10)).strip() == str(3 << 20).encode()
        got = 0
        while chunk := await asyncio.wait_for(p.stdout.read(65536), 10):
            got += len(chunk)
        assert got == 3_000_000
        assert await asyncio.wait_for(p.wait(), 10) == 0
    run(loop, body())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_drain_waiting_when_the_process_is_killed_fails(loop):
    """A request still being written when its sandbox is killed: the drain fails with
    ``BrokenPipeError`` once the exit is seen, even while another process of the sandbox still
    holds the pipe's read end (bubblewrap's inner processes outlive its outer one for a moment;
    here a background ``sleep``), so no ``EPIPE`` comes: the review found it waiting for good."""
    async def body():
        p = await start_process(["sh", "-c", "sleep 3 <&0 & exec sleep 30"], env(), None, 1 << 16)
        p.stdin.write(b"z" * (1 << 20))  # more than the pipe holds, and nobody reads it
        drain = asyncio.ensure_future(p.stdin.drain())
        await asyncio.sleep(0.1)
        assert not drain.done()
        p.kill()
        await asyncio.wait_for(p.wait(), 10)
        with pytest.raises(BrokenPipeError):
            await asyncio.wait_for(drain, 2)
        with pytest.raises(BrokenPipeError):
            await p.stdin.drain()  # and any later one
        p.close()
    run(loop, body())


@pytest.mark.parametrize("loop", LOOPS)
def test_unread_output_is_bounded_and_close_releases_every_descriptor(loop):
    """Output nobody reads stops being read past twice the reader's limit: the memory held is
    bounded and the writer waits on the full pipe (hostile code may write without end);
    ``close`` (``Sandbox.kill``'s last step) releases the pipes, the paused one included, and
    nothing of the process stays open."""
    async def body():
        before = len(os.listdir("/proc/self/fd"))
        p = await start_process(["sh", "-c", "head -c 2000000 /dev/zero; exec sleep 30"], env(), None, 4096)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(p.stdout._buffer) > 2 * 4096:
                break
        await asyncio.sleep(0.2)  # more output waits in the pipe and the writer; none is read
        assert 2 * 4096 < len(p.stdout._buffer) <= 2 * 4096 + READ_CHUNK, len(p.stdout._buffer)
        assert p.returncode is None  # still writing: blocked on the pipe, not buffered here
        p.kill()
        await asyncio.wait_for(p.wait(), 10)
        p.close()
        assert len(os.listdir("/proc/self/fd")) == before
    run(loop, body())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_waiting_when_the_process_is_closed_sees_the_end(loop):
    """``Sandbox.kill`` closes the process once its outer process ended, while a process inside
    may still hold the pipe (here a background ``sleep``): a ``readline`` waiting for the run's
    answer then gets the stream's end, what was read before it first. (CI caught it waiting
    for its request's 35 s timeout: a run killed by a refused shrink reported a timeout.)"""
    async def body():
        p = await start_process(["sh", "-c", "echo first; sleep 3 & exec sleep 30"], env(), None, 1 << 16)
        waiting = asyncio.ensure_future(p.stdout.readline())
        assert await asyncio.wait_for(waiting, 10) == b"first\n"
        waiting = asyncio.ensure_future(p.stdout.readline())
        await asyncio.sleep(0.1)
        p.kill()
        await asyncio.wait_for(p.wait(), 10)
        p.close()
        assert await asyncio.wait_for(waiting, 2) == b""
    run(loop, body())


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_starting_a_process_does_not_copy_the_starter():
    """Under uvloop, the server's loop: after ``start_process`` the starter writes its own 40 MB
    without a fault (vfork shares nothing it must copy); after uvloop's own ``subprocess_exec``
    (libuv's fork) the same writes fault on nearly every page, which is what this test tells
    apart."""
    ballast = bytearray(40 << 20)
    pages = len(ballast) // 4096

    def touch() -> int:
        before = _faults()
        for i in range(0, len(ballast), 4096):
            ballast[i] = (ballast[i] + 1) & 0xFF
        return _faults() - before

    async def body() -> tuple[int, int]:
        touch()  # every page present and ours first
        p = await start_process(["true"], env(), None, 1 << 16)
        await p.wait()
        ours = touch()
        forked = await asyncio.create_subprocess_exec("true")
        await forked.wait()
        theirs = touch()
        return ours, theirs

    ours, theirs = uvloop.run(body())
    assert ours < pages // 10, (ours, pages)
    assert theirs > pages // 2, (theirs, pages)  # the test can tell: libuv's fork made them fault


def test_a_sandbox_whose_monitor_is_reaped_signals_and_interrupts_nothing(monkeypatch):
    """Without a control group a sandbox finds its processes from its monitor's pid down; once the
    monitor is reaped that pid may be another process's, so no walk from it may signal anything:
    neither a kill's signals nor a session step's interrupt."""
    from arl_tangram.managers.sandbox import sandbox as sandbox_module

    walked: list[int] = []
    monkeypatch.setattr(sandbox_module, "_descendants", lambda root: walked.append(root) or [root])

    async def main():
        proc = await start_process(["/bin/true"], env(), None, limit=1 << 16)
        assert await proc.wait() == 0
        sb = sandbox_module.Sandbox("reaped", proc, None)
        try:
            sb._signal_all(signal.SIGKILL)
            return sb.interrupt_step()
        finally:
            sb._stderr_task.cancel()
            proc.close()

    assert uvloop.run(main()) == 0
    assert walked == [], "a reaped monitor's pid was walked"
