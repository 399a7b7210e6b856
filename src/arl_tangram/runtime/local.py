"""The embedded local runtime: the engine and a policy on an asyncio loop, real sandboxes.

The same engine and policy as the simulator, but time is the monotonic clock and the CPU pool is
this machine (or the CPUs configured). Usage::

    async with Tangram.local() as tg:
        r = await tg.run("print('hi')")                 # one-shot, any registered language
        s = await tg.session()                          # a trajectory's stateful sandbox
        await s.exec(python="x = 41")
        r = await s.exec(python="print(x + 1)")
        await s.put({"data.txt": b"..."}); files = await s.get(["data.txt"])
        await s.close()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass

from ..core.action import Action, Demand, Finished, Outcome
from ..core.cluster import Cluster, CpuNode
from ..engine import Engine
from ..managers.sandbox.manager import Exec, Files, RunCode, SandboxConfig, SandboxManager, SandboxResult
from ..policy import Costs, Policy, Profile, make_policy

log = logging.getLogger(__name__)


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass
class ActionResult:
    """An action's terminal outcome with what it produced and its timings."""

    id: str
    outcome: Outcome
    result: SandboxResult
    act_s: float
    queue_s: float
    setup_s: float
    exec_s: float
    cores: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def stdout(self) -> str:
        return self.result.run.stdout if self.result.run else ""

    @property
    def stderr(self) -> str:
        return self.result.run.stderr if self.result.run else ""


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 8.0


class LocalRuntime:
    """Owns the engine, the sandbox manager and the futures of submitted actions."""

    def __init__(self, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
                 cores: int | None = None, memory_gb: float | None = None, profile: Profile | None = None) -> None:
        self.sandboxes = SandboxManager(sandbox)
        n = cores or len(self.sandboxes.host_cpus)
        self.cluster = Cluster(cpu_nodes=(CpuNode("local", n, memory_gb or _memory_gb()),))
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.sandboxes.on_done = self._done
        self.sandboxes.on_expire = self.end_session
        costs = Costs(session_create_s=0.01, session_thaw_s=0.001, session_restore_s=0.01,
                      session_mem_gb=self.sandboxes.config.memory_mb / 1024)
        self.engine = Engine(self.cluster, self.policy, {"cpu": self.sandboxes}, MonotonicClock(), costs=costs,
                             profile=profile)
        self.engine.listeners.append(self._finished)
        self._futures: dict[str, asyncio.Future] = {}
        self._results: dict[str, SandboxResult] = {}
        self._wake: asyncio.TimerHandle | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> "LocalRuntime":
        await self.sandboxes.start_up()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for aid in list(self.engine.pending):
            self.engine.cancel(aid)
        await self.sandboxes.shut_down()
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()

    # -- submitting ------------------------------------------------------------------------------
    async def submit(self, action: Action) -> ActionResult:
        """Schedule ``action`` and wait for its one terminal outcome."""
        fut = asyncio.get_running_loop().create_future()
        self._futures[action.id] = fut
        self.engine.submit(action)  # a rejection resolves the future through the listener
        self._schedule()
        return await fut

    def _done(self, action_id: str, outcome: Outcome, setup_s: float, exec_s: float, message: str,
              result: SandboxResult) -> None:
        self._results[action_id] = result
        self.engine.complete(action_id, outcome, setup_s=setup_s, exec_s=exec_s, message=message)
        self._schedule()

    def _finished(self, f: Finished) -> None:
        fut = self._futures.pop(f.action.id, None)
        result = self._results.pop(f.action.id, None) or SandboxResult(message=f.message)
        if fut is not None and not fut.done():
            fut.set_result(ActionResult(f.action.id, f.outcome, result, f.act_s, f.queue_s, f.setup_s, f.exec_s,
                                        f.units, f.message))

    def _schedule(self) -> None:
        self.engine.schedule()
        wake = self.engine.next_wakeup()
        if wake is not None:
            loop = asyncio.get_running_loop()
            if self._wake is not None:
                self._wake.cancel()
            self._wake = loop.call_later(max(0.0, wake - time.monotonic()), self._schedule)

    def end_session(self, trajectory: str) -> None:
        self.engine.end_trajectory(trajectory)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"


class Session:
    """A trajectory's stateful sandbox; each call is one action (cores only while it runs)."""

    def __init__(self, runtime: LocalRuntime, trajectory: str, job: str) -> None:
        self.runtime = runtime
        self.id = trajectory
        self.job = job
        self.closed = False

    async def exec(self, command: str | None = None, *, python: str | None = None, stdin: bytes | None = None,
                   timeout_s: float = 10.0, cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0,
                   hint_s: float | None = None, operation: str = "", memory_mb: int | None = None,
                   id: str | None = None) -> ActionResult:
        """Run a shell ``command`` in the workspace, or a ``python`` cell in the session's
        interpreter (its variables carry over from call to call)."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        if (command is None) == (python is None):
            raise ValueError("exec: give exactly one of command or python")
        rng = (cpus, cpus) if isinstance(cpus, int) else cpus
        payload = Exec(command=command, python=python, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        action = Action(id or self.runtime.new_id("x"), "sandbox", Demand({"cpu": rng}), job=self.job,
                        trajectory=self.id,
                        operation=operation or ("python" if python is not None else command.split()[0]
                                                if command.split() else "shell"),
                        hint_s=hint_s, parallel_fraction=parallel_fraction, timeout_s=timeout_s + 30,
                        payload=payload)
        return await self.runtime.submit(action)

    async def put(self, files: dict[str, bytes], id: str | None = None) -> ActionResult:
        return await self.files(Files(put=files), id)

    async def get(self, paths: list[str]) -> dict[str, bytes]:
        r = await self.files(Files(get=paths))
        return r.result.files

    async def files(self, files: Files, id: str | None = None) -> ActionResult:
        """Put and/or get workspace files as one action (``result.files``, ``result.missing``)."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        action = Action(id or self.runtime.new_id("f"), "sandbox", job=self.job, trajectory=self.id,
                        operation="files", hint_s=0.005, payload=files)
        return await self.runtime.submit(action)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.runtime.end_session(self.id)


class Tangram:
    """The embedded API: ``async with Tangram.local() as tg: ...``."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime

    @classmethod
    def local(cls, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
              cores: int | None = None, profile: Profile | None = None) -> "Tangram":
        return cls(LocalRuntime(policy, sandbox, cores, profile=profile))

    async def __aenter__(self) -> "Tangram":
        await self.runtime.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runtime.close()

    async def run(self, code: str, language: str = "python", *, stdin: bytes | str | None = None,
                  files: dict[str, bytes] | None = None, fetch_files: list[str] | None = None,
                  timeout_s: float = 10.0, compile_timeout_s: float = 10.0, memory_mb: int | None = None,
                  cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0, job: str = "default",
                  hint_s: float | None = None, id: str | None = None, operation: str = "") -> ActionResult:
        """Run a one-shot program in a fresh sandbox."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        rng = (cpus, cpus) if isinstance(cpus, int) else cpus
        payload = RunCode(code, language, stdin, dict(files or {}), list(fetch_files or []), compile_timeout_s,
                          timeout_s, memory_mb)
        action = Action(id or self.runtime.new_id("r"), "sandbox", Demand({"cpu": rng}), job=job,
                        operation=operation or language,
                        hint_s=hint_s, parallel_fraction=parallel_fraction,
                        timeout_s=timeout_s + compile_timeout_s + 30, payload=payload)
        return await self.runtime.submit(action)

    async def session(self, job: str = "default", trajectory: str | None = None) -> Session:
        return Session(self.runtime, trajectory or self.runtime.new_id("s"), job)
