"""An in-process sandbox manager: a test double at the manager seam.

It satisfies the same ``Manager`` protocol and reports the same ``Completion`` records (with a
``SandboxResult``) as ``SandboxManager``, but without isolation: one-shot programs and shell steps
run as plain subprocesses in a temporary directory per session, and a session's python cells run
in this process, in one namespace per session. So the runtime, the service, recovery and the
clients can be tested on any Linux host, bubblewrap or not; the real sandboxes keep their own tests.
Never use it for untrusted code.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from arl_tangram.core.action import Action, Allocation, Outcome
from arl_tangram.core.seam import Completion, Sink
from arl_tangram.managers.sandbox.manager import (
    CommandResult, Exec, Files, RunCode, SandboxConfig, SandboxResult,
)
from arl_tangram.managers.tasks import TaskSet

_COMMANDS = {"python": [sys.executable, "-I", "-c"], "bash": ["bash", "-c"]}


class InProcessSandboxes:
    """``SandboxManager``'s seam without its mechanisms (no bubblewrap, no cgroups)."""

    def __init__(self, sink: Sink, expire: Callable[[str], None] | None = None,
                 config: SandboxConfig | None = None, session_mem_mb: float | None = None) -> None:
        """``session_mem_mb``: what each idle session reports it uses (None: not measured, as
        under ``session_memory = 'limit'``)."""
        self.config = config or SandboxConfig()
        self.session_mem_mb = session_mem_mb
        self.mode = None
        self.tasks = TaskSet(sink, "in-process sandboxes")
        self.expire = expire
        self.root = Path(tempfile.mkdtemp(prefix="tangram-double-"))
        self.sessions: dict[str, dict] = {}  # trajectory -> python namespace
        self.started: list[tuple[Action, Allocation]] = []
        self.closed: list[str] = []
        self.last_used: dict[str, float] = {}
        self._reaper: asyncio.Task | None = None

    @classmethod
    def factory(cls, **kwargs):
        return lambda sink, expire: cls(sink, expire, **kwargs)

    async def start_up(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._expire_idle())

    async def _expire_idle(self) -> None:
        """Sessions unused for ``session_idle_expiry_s`` are reported to ``expire``, as the real
        manager does."""
        limit = self.config.session_idle_expiry_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for traj, last in list(self.last_used.items()):
                if now - last > limit and self.expire is not None:
                    self.last_used.pop(traj, None)
                    self.expire(traj)

    async def shut_down(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.tasks.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self, action: Action, allocation: Allocation) -> None:
        self.started.append((action, allocation))
        self.tasks.run(action, lambda: self._run(action))

    def cancel(self, action_id: str) -> None:
        self.tasks.cancel(action_id)

    def close_session(self, trajectory: str) -> None:
        self.closed.append(trajectory)
        self.last_used.pop(trajectory, None)
        self.sessions.pop(trajectory, None)
        shutil.rmtree(self.root / trajectory, ignore_errors=True)

    def workspace(self, key: str) -> Path:
        path = self.root / key
        path.mkdir(exist_ok=True)
        return path

    async def _run(self, action: Action) -> Completion:
        t0 = time.monotonic()
        p = action.payload
        key = action.trajectory or f"one-shot-{action.id}"
        ws = self.workspace(key)
        try:
            if isinstance(p, RunCode):
                if p.language not in _COMMANDS:
                    return Completion(action.id, Outcome.REJECTED,
                                      message=f"language: {p.language!r} is not run by the in-process double")
                for name, data in p.files.items():
                    (ws / name).write_bytes(data)
                outcome, result = await self._process([*_COMMANDS[p.language], p.code], ws, p.stdin, p.run_timeout_s)
                _fetch(ws, p.fetch_files, result)
            elif isinstance(p, Exec) and p.command is not None:
                outcome, result = await self._process(["bash", "-c", p.command], ws, p.stdin, p.timeout_s)
            elif isinstance(p, Exec):
                outcome, result = self._cell(self.sessions.setdefault(key, {}), p.python or "")
            elif isinstance(p, Files):
                for name, data in p.put.items():
                    (ws / name).write_bytes(data)
                result = SandboxResult()
                _fetch(ws, p.get, result)
                outcome = Outcome.OK
            else:
                return Completion(action.id, Outcome.REJECTED, message="payload: not a sandbox request")
        finally:
            if action.trajectory is None:
                shutil.rmtree(ws, ignore_errors=True)
            else:
                self.last_used[action.trajectory] = time.monotonic()
        mem = self.session_mem_mb / 1024 if self.session_mem_mb is not None and action.trajectory else None
        return Completion(action.id, outcome, 0.0, time.monotonic() - t0, result.message, result, mem)

    async def _process(self, argv: list[str], cwd: Path, stdin: bytes | None,
                       timeout_s: float) -> tuple[Outcome, SandboxResult]:
        t = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

        async def talk() -> tuple[bytes, bytes]:
            if stdin:
                try:  # a program may exit before reading its input (uvloop then refuses the write)
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError, RuntimeError):
                    pass
            return await proc.communicate()

        try:
            out, err = await asyncio.wait_for(talk(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            run = CommandResult(None, out.decode(), err.decode(), time.monotonic() - t, timed_out=True)
            return Outcome.TIMEOUT, SandboxResult(run=run, message="timed out")
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        run = CommandResult(proc.returncode, out.decode(), err.decode(), time.monotonic() - t)
        return (Outcome.OK if proc.returncode == 0 else Outcome.FAILED), SandboxResult(run=run)

    def _cell(self, namespace: dict, code: str) -> tuple[Outcome, SandboxResult]:
        t = time.monotonic()
        out, err = io.StringIO(), io.StringIO()
        code_ok = True
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(compile(code, "<cell>", "exec"), namespace)
            except BaseException:  # the cell's own failure, reported like the runner does
                traceback.print_exc()
                code_ok = False
        run = CommandResult(0 if code_ok else 1, out.getvalue(), err.getvalue(), time.monotonic() - t)
        return (Outcome.OK if code_ok else Outcome.FAILED), SandboxResult(run=run)


def _fetch(workspace: Path, names: list[str], into: SandboxResult) -> None:
    for name in names:
        f = workspace / name
        if f.exists():
            into.files[name] = f.read_bytes()
        else:
            into.missing.append(name)
