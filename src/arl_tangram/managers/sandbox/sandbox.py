"""One sandbox on the host side: its isolated runner process, its cgroup, and the channel to it."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
from dataclasses import dataclass

from .cgroups import CgroupRoot, Group


class SandboxDied(RuntimeError):
    """The runner is gone (killed at a hard deadline, crashed, or never started)."""


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
    def __init__(self, sid: str, proc: asyncio.subprocess.Process, group: Group | None) -> None:
        self.id = sid
        self.proc = proc
        self.group = group
        self.frozen = False
        self._lock = asyncio.Lock()
        self._seq = 0
        self._stderr = bytearray()
        self._stderr_task = asyncio.get_running_loop().create_task(self._drain_stderr())
        self.dead = False

    @classmethod
    async def spawn(cls, sid: str, argv: list[str], root: CgroupRoot | None, limits: Limits,
                    cwd: str | None = None, ready_timeout_s: float = 20.0) -> "Sandbox":
        group = root.create(sid) if root is not None else None
        if group is not None:
            group.set_memory(limits.memory_bytes)
            group.set_pids(limits.pids)

        def enter() -> None:  # in the child, before exec: everything it starts inherits this
            if group is not None:
                for d in ({group.dirs["unified"]} if group.v2 else set(group.dirs.values())):
                    with open(d / "cgroup.procs", "w") as fh:
                        fh.write(str(os.getpid()))
            elif limits.memory_bytes:
                # fallback: caps address space, not resident memory (interpreters reserve more
                # than they touch, hence the slack)
                cap = limits.memory_bytes + (256 << 20)
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, preexec_fn=enter, start_new_session=True, cwd=cwd,
                limit=64 << 20)
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

    async def request(self, req: dict, timeout_s: float) -> dict:
        """Send one request and wait for its answer; past ``timeout_s`` the sandbox is killed."""
        async with self._lock:
            if self.dead:
                raise SandboxDied("sandbox is closed")
            self._seq += 1
            req = {**req, "id": self._seq}
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                await self.proc.stdin.drain()
                line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            except asyncio.TimeoutError:
                await self.kill()
                raise SandboxDied(f"sandbox did not answer within {timeout_s:.1f}s and was killed") from None
            except (ConnectionError, BrokenPipeError) as e:
                await self.kill()
                raise SandboxDied(f"sandbox channel broke: {e}") from None
            if not line:
                await self.kill()
                raise SandboxDied("sandbox exited: " + self._stderr.decode(errors="replace")[-500:])
            return json.loads(line)

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

    def set_cpus(self, cpus: tuple[int, ...]) -> None:
        if self.group is not None:
            self.group.set_cpus(cpus)

    def set_memory(self, limit_bytes: int | None) -> None:
        if self.group is not None:
            self.group.set_memory(limit_bytes)

    def oom_kills(self) -> int:
        return self.group.oom_kills() if self.group is not None else 0

    def cpu_seconds(self) -> float:
        if self.group is not None:
            return self.group.cpu_seconds()
        total = 0.0
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _signal_all(self, sig: int) -> None:
        for pid in _descendants(self.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def kill(self) -> None:
        """Kill everything in the sandbox and release its cgroup; idempotent."""
        if self.dead:
            return
        self.dead = True
        if self.group is not None:
            self.group.kill_all()
        else:
            self._signal_all(signal.SIGCONT)
            self._signal_all(signal.SIGKILL)
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        await self.proc.wait()
        self._stderr_task.cancel()
        if self.group is not None:
            self.group.remove()
