"""One sandbox on the host side: its isolated runner process, its cgroup, and the channel to it."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import marshal
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

from .cgroups import CgroupRoot, Group
from .livestdin import UNSENT_MAX, LiveStdin, StdinClosed, StdinFull
from .spawn import Process, start_process


#: where a kill's cleanup runs (waiting for the group's processes to exit and removing it, polling
#: every few ms; unmounting a root): its own threads, not the loop's default executor, whose few
#: threads (cores + 4) the latency-critical work shares: a wake reading its blob, a spawn mounting a
#: root, a rest writing one. With rests and wakes at a few per second, kills would hold those
#: threads and a wake's read wait behind them.
_CLEANUP = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-cleanup")


#: the largest ``stdin`` message a running step's input goes to its runner in
STDIN_PIECE = 64 << 10


class SandboxDied(RuntimeError):
    """The runner is gone (killed at a hard deadline, crashed, or never started).
    ``deadline`` is set when we killed it for not answering in time (the user's code's timeout)."""

    def __init__(self, message: str, deadline: bool = False) -> None:
        super().__init__(message)
        self.deadline = deadline


class Turn:
    """A core's turn, passed from a one-shot to the one queued behind it (the lease: ``lease.py``):
    it opens once, and what waits for it runs inside ``open``, synchronously. So a follower's
    request, prepared ahead, is written to its sandbox in the very call that saw the run before it
    answer, not a pass or two of a busy worker's loop later (after the answer's bookkeeping, the
    reply to the engine and the follower's task start)."""

    __slots__ = ("opened", "_then")

    def __init__(self) -> None:
        self.opened = False
        self._then: list[Callable[[], None]] = []

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the turn opens (now if it has); ``fn`` must not raise."""
        if self.opened:
            fn()
        else:
            self._then.append(fn)

    def open(self) -> None:
        if self.opened:
            return
        self.opened = True
        then, self._then = self._then, []
        for fn in then:
            fn()

    async def wait(self) -> None:
        """Return once the turn has opened (at once if it has)."""
        if not self.opened:
            opened = asyncio.get_running_loop().create_future()
            self.then(lambda: opened.done() or opened.set_result(None))
            await opened


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = 512 << 20
    pids: int | None = 128


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (for the no-cgroup fallback)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class Sandbox:
    def __init__(self, sid: str, proc: Process, group: Group | None) -> None:
        self.id = sid
        self.proc = proc
        self.group = group
        self.frozen = False
        self._lock = asyncio.Lock()
        self._seq = 0
        self._then = 0  # the id of a request that rode on the last one, its answer not read yet
        self._stderr = bytearray()
        self._stderr_task = asyncio.get_running_loop().create_task(self._drain_stderr())
        self.dead = False
        self.rootfs = None  # an image sandbox's overlay root (rootfs.RootFs)
        self.image: str | None = None
        self.on_kill = None  # called (in a thread) once the processes are gone: releases the root
        self.uses = 0  # one-shots run in it before (recycling)
        self.max_uses: int | None = None  # one-shots it may run in all, drawn by the recycler (``Recycler.limit``)
        self.recyclable = False  # a plain warm-pool sandbox (not an image's): recycling may reuse it
        self.warmed: frozenset[str] = frozenset()  # modules its zygote imported (``inside.sessions.op_warm``)
        self.oom_seen = 0  # the group's OOM-kill count when last read
        self._cpus: tuple[int, ...] | None = None  # what it was last placed on: a group's write costs a
        self._memory: int | None = -1  # cgroupfs round trip per action, and mostly nothing changes
        self._quota: int | None = None  # the CPUs' worth of time it was last bounded to (None: pinned)
        self.workspace_fd: int | None = None  # hostfiles.open_workspace, once a session's files want it (-1: none)
        #: when a run's first request was written (0: none yet; the manager clears it per run) and
        #: the last answer read (``time.monotonic``; ``corewaits``)
        self.first_written_at = 0.0
        self.answered_at = 0.0

    @classmethod
    async def spawn(cls, sid: str, argv: list[str], root: CgroupRoot | None, limits: Limits,
                    cwd: str | None = None, ready_timeout_s: float = 20.0) -> "Sandbox":
        group = root.create(sid) if root is not None else None
        if group is not None:
            group.set_memory(limits.memory_bytes)
            group.set_pids(limits.pids)

        # A two-line shell moves itself into the group (or caps its address space where there are
        # no cgroups) and execs the sandbox: race-free, and much cheaper than a preexec_fn, which
        # forces a full fork of this (large) process.
        if group is not None:
            procs = [str(d / "cgroup.procs") for d in ({group.dirs["unified"]} if group.v2 else
                                                      set(group.dirs.values()))]
            script = 'for p in $TANGRAM_CG; do echo $$ > "$p" || exit 97; done; exec "$@"'
            env = {"TANGRAM_CG": " ".join(procs)}
        else:
            # fallback: caps address space, not resident memory (interpreters reserve more than
            # they touch, hence the slack)
            kb = ((limits.memory_bytes or 0) + (256 << 20)) >> 10
            script = (f'ulimit -v {kb}; ' if limits.memory_bytes else '') + 'exec "$@"'
            env = {}
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        try:
            # by vfork, not the loop's fork of this whole process (``spawn.py``)
            proc = await start_process(["/bin/sh", "-c", script, "sh", *argv], env, cwd, limit=64 << 20)
        except OSError as e:
            if group is not None:
                group.remove()
            raise SandboxDied(f"cannot start sandbox: {e}") from e
        sb = cls(sid, proc, group)
        try:
            await sb.request({"op": "ping"}, ready_timeout_s)
        except SandboxDied:
            await sb.kill()
            raise
        return sb

    async def _drain_stderr(self) -> None:
        while True:
            chunk = await self.proc.stderr.read(4096)
            if not chunk:
                return
            self._stderr += chunk
            del self._stderr[:-4096]

    async def request(self, req: dict, timeout_s: float,
                      on_output: Callable[[str, bytes], None] | None = None, turn: Turn | None = None,
                      then: dict | None = None, stdin: LiveStdin | None = None) -> dict:
        """Send one request and wait for its answer; past ``timeout_s`` the sandbox is killed.
        ``on_output``: the request streams (a shell step or a cell with ``stream``): its output chunks come
        first, each handed to ``on_output(stream, data)`` as it arrives. ``turn``: the request is
        written when it opens, by the call that opens it (its timeout counts from then); cancelled
        before that, nothing reached the sandbox. ``then``: a second request (a one-shot's reset)
        riding on this one: the runner carries it out right after this one's answer, and its
        answer is read by ``then_answer`` (or by the next request, first, whoever comes).
        ``stdin``: the request is a shell step with a live stdin (``livestdin.py``): bound to this
        sandbox from the moment the request is written until its answer (or the sandbox's end)."""
        async with self._lock:
            if self.dead:
                raise SandboxDied("sandbox is closed")
            if self._then:  # a riding reset's answer nobody read: read now, so the channel stays in step
                await self._unread_reset(timeout_s)
            self._seq += 1
            want, riding = self._seq, 0
            req = {**req, "id": want}
            if then is not None:
                self._seq += 1
                riding = self._seq
                req["then"] = {**then, "id": riding}
            try:
                data = marshal.dumps(req, 4)
                data = len(data).to_bytes(4, "little") + data
                if turn is None or turn.opened:
                    self._send(data, riding)
                else:
                    await self._write_in(turn, data, riding)
                if stdin is not None:  # its input follows the request on the channel, never before it
                    stdin.bind(self._stdin_sink)
                await self.proc.stdin.drain()
            except (ConnectionError, BrokenPipeError) as e:
                if stdin is not None:
                    stdin.end()
                await self.kill()
                raise SandboxDied(f"sandbox channel broke: {e}") from None
            try:
                answer = await self._answer(want, timeout_s, on_output)
            finally:
                if stdin is not None:
                    stdin.end()
            self.answered_at = time.monotonic()
            return answer

    def _stdin_sink(self, data: bytes, eof: bool, checked: bool = True) -> None:
        """Write a running step's input (``livestdin.Sink``): ``stdin`` messages of at most
        ``STDIN_PIECE`` bytes on the request channel, which the runner reads while the step runs
        (``shell.LiveIn``: one message is what it may hold past its own bound) and never answers.
        ``checked=False``: the input kept before the request (taken under the same cap); a
        broken channel is then the request's ``ConnectionError``, not the caller's."""
        if self.dead:
            raise StdinClosed("the sandbox is gone")
        writer = self.proc.stdin
        if checked:
            kept = writer.kept() if hasattr(writer, "kept") else writer.transport.get_write_buffer_size()
            if data and kept + len(data) > UNSENT_MAX:
                raise StdinFull(f"{kept} bytes of input already wait for the command to read them (at most "
                                f"{UNSENT_MAX}): send the rest once it reads")
        pieces = [data[i:i + STDIN_PIECE] for i in range(0, len(data), STDIN_PIECE)] or [b""]
        frames = bytearray()
        for i, piece in enumerate(pieces):
            msg = marshal.dumps({"op": "stdin", "data": piece, "eof": eof and i == len(pieces) - 1}, 4)
            frames += len(msg).to_bytes(4, "little") + msg
        try:
            writer.write(bytes(frames))
        except (ConnectionError, BrokenPipeError):
            if not checked:
                raise
            raise StdinClosed("the sandbox's channel is closed") from None

    async def _unread_reset(self, timeout_s: float) -> None:
        """Read a riding reset's answer that nobody read (the caller holds the lock): a sandbox it
        did not find clean, or that does not answer, is killed, as an infrastructure failure
        (never the next request's timeout)."""
        try:
            left = await self._answer(self._then, timeout_s)
        except SandboxDied as e:
            raise SandboxDied(f"the reset riding on the last request failed: {e}") from None
        if not left.get("clean"):
            await self.kill()
            raise SandboxDied(f"the reset riding on the last request found the sandbox unclean: {left.get('why')}")

    @property
    def then_pending(self) -> bool:
        """A request rode on the last one (``request``'s ``then``) and its answer is still to read."""
        return bool(self._then)

    async def then_answer(self, timeout_s: float) -> dict:
        """The answer of the request that rode on the last one (``request``'s ``then``); past
        ``timeout_s`` (counted from now) the sandbox is killed."""
        async with self._lock:
            if self.dead:
                raise SandboxDied("sandbox is closed")
            if not self._then:
                raise RuntimeError("no request rode on the last one")
            return await self._answer(self._then, timeout_s)

    async def _answer(self, want: int, timeout_s: float,
                      on_output: Callable[[str, bytes], None] | None = None) -> dict:
        """Read the answer of request ``want`` (the caller holds the lock); a line that is not
        it, a silent or closed channel, or ``timeout_s`` passed: the sandbox is killed."""
        try:
            async with asyncio.timeout(timeout_s):  # wait_for would make a task (a loop pass) per request
                if on_output is None:
                    line = await self.proc.stdout.readline()
                else:
                    line = await self._chunks(on_output)
        except TimeoutError:
            await self.kill()
            raise SandboxDied(f"sandbox did not answer within {timeout_s:.1f}s and was killed",
                              deadline=True) from None
        except (ConnectionError, BrokenPipeError) as e:
            await self.kill()
            raise SandboxDied(f"sandbox channel broke: {e}") from None
        except (ValueError, asyncio.LimitOverrunError) as e:  # an answer past the channel's line limit
            await self.kill()
            raise SandboxDied(f"sandbox answered more than one answer may carry: {e}") from None
        if want == self._then:
            self._then = 0
        if not line:
            await self.kill()
            raise SandboxDied("sandbox exited: " + self._stderr.decode(errors="replace")[-500:])
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("id") != want:
            # a runner taken over could write lines of its own (a session's code ran in the runner
            # before it had its own interpreter, inside.sessions.SessionChild): one that is
            # not this request's answer would shift every later answer by one step; the
            # channel is broken, so is the sandbox
            await self.kill()
            raise SandboxDied("sandbox answered out of turn (its channel was written to by the code it runs)")
        return answer

    def _send(self, data: bytes, riding: int = 0) -> None:
        """Write one framed request; the run's first is stamped (``first_written_at``). ``riding``:
        the id of a request riding on it, whose answer is owed from the moment it is written."""
        self.proc.stdin.write(data)
        if riding:
            self._then = riding
        self.first_written_at = self.first_written_at or time.monotonic()

    async def _write_in(self, turn: Turn, data: bytes, riding: int = 0) -> None:
        """Write ``data`` when ``turn`` opens, in the opener's call; return once it is written."""
        written = asyncio.get_running_loop().create_future()

        def write() -> None:
            if written.done():  # the request was cancelled while it waited
                return
            try:
                self._send(data, riding)
            except Exception as e:  # a closed pipe: ``request`` reports it dead (never the opener's error)
                written.set_exception(ConnectionError(f"{type(e).__name__}: {e}"))
            else:
                written.set_result(None)

        turn.then(write)
        await written

    async def _chunks(self, on_output: Callable[[str, bytes], None]) -> bytes:
        """Hand a streamed request's chunk lines to ``on_output``; return the first other line (EOF
        included), which ``request`` checks is this request's answer."""
        while True:
            line = await self.proc.stdout.readline()
            if not line.startswith(b'{"stream":'):
                return line
            msg = json.loads(line)
            stream, data = msg.get("stream"), msg.get("data")
            if stream not in ("stdout", "stderr") or not isinstance(data, str):
                raise ConnectionError("bad output chunk from the sandbox")
            on_output(stream, base64.b64decode(data))

    def freeze(self) -> None:
        """Stop every process of the sandbox: it keeps memory and files but uses no CPU."""
        if self.dead or self.frozen:
            return
        if self.group is not None:
            self.group.freeze(True)
        else:
            self._signal_all(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.dead or not self.frozen:
            return
        if self.group is not None:
            self.group.freeze(False)
        else:
            self._signal_all(signal.SIGCONT)
        self.frozen = False

    @property
    def cpus(self) -> tuple[int, ...] | None:
        """The CPUs it was last placed on (None: not yet placed)."""
        return self._cpus

    @property
    def cpu_quota(self) -> int | None:
        """How many CPUs' worth of time it is bounded to where it runs on more CPUs than its
        cores (a one-shot sharing the host's CPUs); None where it is pinned to its cores."""
        return self._quota

    def set_cpus(self, cpus: tuple[int, ...], quota: int | None = None) -> None:
        """Place its runs on ``cpus``; ``quota``: bound them to that many CPUs' worth of time
        (the group's cpu controller) rather than to ``cpus`` alone. Writes only what changed, the
        tighter bound first (a quota before a wider cpuset, a narrower cpuset before no quota), so
        that its processes are never bounded by neither."""
        g = self.group
        if g is None:
            self._cpus, self._quota = cpus, quota
            return
        # what it remembers follows each write that succeeded, so a failure midway leaves it true
        if quota is not None and quota != self._quota:
            g.set_cpu_quota(quota)
            self._quota = quota
        if cpus != self._cpus:
            g.set_cpus(cpus)
            self._cpus = cpus
        if quota is None and self._quota is not None:
            g.set_cpu_quota(None)
            self._quota = None

    def set_memory(self, limit_bytes: int | None) -> None:
        if self.group is not None and limit_bytes != self._memory:
            self.group.set_memory(limit_bytes)
            self._memory = limit_bytes

    def oom_kills(self) -> int:
        """The group's OOM-kill count now (also remembered in ``oom_seen``)."""
        self.oom_seen = self.group.oom_kills() if self.group is not None else 0
        return self.oom_seen

    def memory_bytes(self) -> int:
        """What the sandbox uses now: its cgroup's charge, or (without cgroups) the resident
        memory of its processes (shared library pages then count once per process: an upper
        bound)."""
        if self.group is not None:
            return self.group.memory_bytes()
        page = os.sysconf("SC_PAGE_SIZE")
        return int(self._per_process("statm", lambda text: int(text.split()[1]) * page))

    def cpu_seconds(self) -> float:
        if self.group is not None:
            return self.group.cpu_seconds()
        tick = os.sysconf("SC_CLK_TCK")

        def used(text: str) -> float:
            f = text.rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick  # utime + stime

        return self._per_process("stat", used)

    def _per_process(self, name: str, value: Callable[[str], float]) -> float:
        """``value`` of ``/proc/<pid>/<name>`` summed over the sandbox's processes (without
        cgroups, the only account there is); one that exits meanwhile counts nothing."""
        total = 0.0
        for pid in self._processes():
            try:
                with open(f"/proc/{pid}/{name}") as fh:
                    total += value(fh.read())
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _processes(self) -> list[int]:
        """The sandbox's processes from its monitor down; none once the monitor is reaped (its pid
        may be another process's by then)."""
        return [] if self.proc.returncode is not None else _descendants(self.proc.pid)

    def _signal_all(self, sig: int) -> None:
        for pid in self._processes():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def interrupt_step(self) -> int:
        """Kill what the running shell step of a session started, and nothing else: every process
        below the session's persistent shell (the runner, the shell and the sandbox live on; the
        step then ends with the killed command's status). Returns how many were killed; none once
        the monitor is reaped (without a group, its pid may be another process's by then)."""
        pids = self.group.pids() if self.group is not None else self._processes()
        info: dict[int, tuple[int, int, bytes]] = {}  # host pid -> (parent, pid inside, cmdline)
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if ":" in line)
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read()
                info[pid] = (int(fields["PPid"]), int(fields.get("NSpid", str(pid)).split()[-1]), cmd)
            except (OSError, KeyError, ValueError):
                continue
        runners = {p for p, (_, inside, _) in info.items() if inside == 1}
        runner_cmds = {info[p][2] for p in runners}
        # the runner's children: the shell, and the zygote (a fork of the runner: the same cmdline)
        shells = {p for p, (parent, _, cmd) in info.items() if parent in runners and cmd not in runner_cmds}
        # parents before their children: a process whose child was killed first could run on
        # before its own kill (a step's subshell, woken by its killed ``sleep``, runs its next
        # ``echo``)
        children: dict[int, list[int]] = {}
        for p, (parent, _, _) in info.items():
            children.setdefault(parent, []).append(p)
        below = [p for shell in shells for p in children.get(shell, ())]
        for p in below:  # (grows as it goes: breadth first, each level after the one above it)
            below.extend(children.get(p, ()))
        for p in below:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(below)

    async def kill(self) -> None:
        """Kill everything in the sandbox and release its cgroup; idempotent."""
        if self.dead:
            return
        self.dead = True
        if self.workspace_fd is not None and self.workspace_fd >= 0:
            os.close(self.workspace_fd)
            self.workspace_fd = None
        if self.group is None:
            self._signal_all(signal.SIGCONT)
            self._signal_all(signal.SIGKILL)
        elif self.frozen:
            self.group.freeze(False)  # a frozen process cannot die
        try:
            self.proc.kill()  # bubblewrap's death takes its whole PID namespace with it
        except ProcessLookupError:
            pass
        await self.proc.wait()
        self._stderr_task.cancel()
        close = getattr(self.proc, "close", None)  # (spawn.Child: its pipes and pidfd; asyncio's own
        if close is not None:                      # process, where there is no pidfd, closes its own)
            close()
        loop = asyncio.get_running_loop()
        if self.group is not None:  # stragglers (unshare/none modes) and the directories
            await loop.run_in_executor(_CLEANUP, self.group.remove)
        if self.on_kill is not None:
            hook, self.on_kill = self.on_kill, None
            await loop.run_in_executor(_CLEANUP, hook)
