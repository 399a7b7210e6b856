"""Which sessions the sandbox manager holds, and where each one is.

A trajectory's session keeps its sandbox (workspace files, the persistent python interpreter) for
its whole life but holds cores only while an action runs. It is awake (its sandbox frozen between
steps), running a step, being put to rest, at rest (its state in a blob: ``resting.py``), or
pending (a fork's child or a restored session: its root mounted, its processes started on first
use). ``SessionBook`` keeps those states; the parts that move a session between them (``runs``,
``resting``, ``execution``) change them through it.
"""

from __future__ import annotations

import asyncio
import time

from ...core.action import Outcome
from . import hostfiles
from .host import SandboxHost
from .rest import Rested
from .rootfs import RootFs
from .sandbox import Sandbox
from .spec import Files, SandboxResult

READ_MAX = 1 << 24  # the most one read of a file carries (the runner's own cap)


class SessionBook:
    """The sessions held here, by state."""

    def __init__(self, host: SandboxHost) -> None:
        self.host = host
        self.awake: dict[str, Sandbox] = {}  # (``SandboxManager.sessions``)
        self.pending: dict[str, RootFs] = {}  # forked/restored sessions: root mounted, processes on first use
        self.rested: dict[str, Rested] = {}  # at rest: their state on disk, no processes
        self.moving: dict[str, asyncio.Future] = {}  # being put to rest now: done once they are
        self.last_used: dict[str, float] = {}
        self.using: set[str] = set()  # sessions a step of which is being carried out: never put to rest

    def exists(self, trajectory: str) -> bool:
        """A session of that id has state here (a sandbox, a root waiting for its first step, a blob)."""
        return trajectory in self.awake or trajectory in self.pending or trajectory in self.rested

    def adopt(self, trajectory: str, root: RootFs) -> None:
        """``trajectory`` is a session whose root is mounted; its processes start on first use."""
        self.pending[trajectory] = root
        self.last_used[trajectory] = time.monotonic()

    def close(self, trajectory: str) -> Sandbox | None:
        """Forget a session's sandbox and root; returns the sandbox to let go (None: it had none,
        or it is being put to rest, and the rest lets it go: released here too, it would be reset
        twice and end up in the sessions' pool twice, for two sessions)."""
        sb = self.awake.pop(trajectory, None)
        self.last_used.pop(trajectory, None)
        pending = self.pending.pop(trajectory, None)
        if pending is not None:
            self.host.imageboxes.drop(pending)
        return None if trajectory in self.moving else sb

    def state(self, trajectory: str) -> str | None:
        """``running``, ``awake`` (processes alive, frozen), ``resting`` (being put to rest),
        ``at_rest``, ``pending`` (files ready, processes on first use), or None (unknown here)."""
        if trajectory in self.moving:
            return "resting"
        if trajectory in self.using:
            return "running"
        if trajectory in self.awake:
            return "awake"
        if trajectory in self.rested:
            return "at_rest"
        if trajectory in self.pending:
            return "pending"
        return None

    def host_files(self, trajectory: str, files: Files) -> tuple[Outcome, SandboxResult] | None:
        """A session's file action carried out from this process (``hostfiles``: no runner round
        trip, no base64), or None where it cannot be: the session's sandbox has not started, runs
        without isolation, or a path is not plain (a symlink, a FIFO, ``..``): the runner does it
        then. So it does while the session is being put to rest: the action waits for the rest,
        then wakes it (a file written here after the pack was taken would be lost). The caller
        holds the session's step lock."""
        sb = self.awake.get(trajectory)
        if sb is None or sb.dead or sb.proc.returncode is not None or trajectory in self.moving:
            return None
        if sb.workspace_fd is None:
            sb.workspace_fd = hostfiles.open_workspace(sb.proc.pid)
            if sb.workspace_fd is None:
                sb.workspace_fd = -1
        if sb.workspace_fd < 0:
            return None
        out = SandboxResult()
        try:
            for rel, data in files.put.items():
                hostfiles.write(sb.workspace_fd, rel, data)
            for rel in files.get:
                got = hostfiles.read(sb.workspace_fd, rel, READ_MAX)
                if got is None:
                    out.missing.append(rel)
                else:
                    out.files[rel] = got
        except hostfiles.Unsafe:
            return None
        except OSError as e:  # the workspace is full, a directory where a file is named
            return Outcome.FAILED, SandboxResult(message=f"files: {e.strerror or e}")
        self.last_used[trajectory] = time.monotonic()
        return Outcome.OK, out
