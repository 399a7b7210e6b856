"""Sessions at rest: an idle session's state on disk instead of in processes.

An awake idle session costs ~11-13 MB in processes (its cgroup's charge: the runner, its zygote, the
session's interpreter, bubblewrap, kernel objects). An interpreter's private dirty pages alone are
several times the 1.5 MB an idle session may cost, so sharing pages with a warm zygote cannot get
there; ending the processes can. So a session idle for ``rest_after_s``, or the least recently
used when more than ``max_awake_sessions`` are awake, is *put to rest* (``resting.py`` says when):
its interpreter packs its namespace (pickled: functions and classes defined in the session by their
code, modules by name) and its tmpfs files (the workspace, /tmp) into one blob
(``inside.rest.op_rest``), the host fetches it in chunks and writes it here, and the sandbox is reset
for another session (below) or killed. An image session's workspace is on disk already: its root
stays mounted and only /tmp goes into the blob. The next step *wakes* it: a sandbox from the
sessions' pool (or the session's own root) loads the blob (``inside.rest.op_wake``).

A session's python runs in its own interpreter, a child forked from the sandbox's zygote
(``inside.sessions.SessionChild``), never in the runner: so once the session has left (put to rest, or
closed) its sandbox is reset exactly as a one-shot's is (the child and the shell killed, every
writable place wiped, IPC and keyrings emptied, the runner's and zygote's rlimits and affinity
checked: ``recycle.Recycler.session_verdict``) and goes back to the sessions' pool
(``sessionpool.py``). An open or a wake then costs a fork of a warm zygote and a cell, not a new
sandbox (bubblewrap, an interpreter: 27-50 ms of CPU). Only a default session's sandbox is reused
(its root is the host's, read-only; a fork's or a restore's workspace has layers under it); an
image session's is not (its root is writable). An awake session keeps its zygote: without it, its
sandbox could not be reset for another session (the next interpreter must come from a zygote that
never held a request), and an interpreter restarted after a crash would fork from the runner,
whose heap has relayed earlier sessions' cells.

A wake's latency: the step that wakes a session rides on the wake's last request
(``load(then=...)``), and a blob up to 256 KB on the rest's own answer, one round trip fewer each;
the warm sandbox's zygote has imported pickle and what a first cell needs (``op_warm``), so every
session interpreter forked from it shares them; and the interpreter forked ahead warms itself
(``inside.cells.session_warm``: a load and a cell of its own before the session's first request), which
moves CPU off the revisit's path.

What a rest carries: the values a step can hold (ints, strings, lists, dicts, functions and
classes defined in the session, by their code; modules, by name: re-imported at the wake, so an
attribute the session patched in a module is not carried), the files of the workspace and /tmp,
the directory, environment and ``sys.path``, and a bash shell's variables, functions, aliases,
options and directory. Not carried, and named in ``dropped``: open files and sockets, threads,
generators, locks, running processes. A session whose interpreter had ended before its rest (it
exited, was killed, ignored its cell's timeout) carries no namespace, and the wake says
``(namespace)``: never an empty namespace passed off as its own.

The host never unpickles or unmarshals a blob: it is the session's own bytes, loaded only inside
the session's next sandbox. What a sandbox could not carry is said in the answers (``dropped``:
name -> why), and the step after the wake reports it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from .sandbox import Sandbox, SandboxDied

#: seconds a sandbox may take to pack or load its state before it is declared dead
REST_TIMEOUT_S = 60.0
#: bytes of blob per wake request (the runner's answers carry 4 MB per line the other way)
WAKE_CHUNK = 4 << 20


@dataclass
class Rested:
    """A session at rest: its blob at ``path`` (``size`` bytes), what it could not carry, and,
    for an image session, its still-mounted root (``rootfs.RootFs``)."""

    path: str
    size: int
    dropped: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    rootfs: object | None = None


class RestStore:
    """The directory of rested sessions' blobs; ``used`` bytes in it."""

    def __init__(self, directory: str | None) -> None:
        self.owned = directory is None  # a temporary one goes with the manager
        self.dir = directory or tempfile.mkdtemp(prefix="tangram-rest-")
        os.makedirs(self.dir, exist_ok=True)
        self.used = 0

    def path(self, trajectory: str) -> str:
        return os.path.join(self.dir, hashlib.sha256(trajectory.encode()).hexdigest()[:40] + ".rest")

    def write(self, trajectory: str, blob: bytes) -> str:
        """Write atomically (a killed server leaves the old blob or the new one, never half of
        one). Not synced: the journal that records the rest promises as much (``synchronous=
        NORMAL``: a killed process, not a power cut), and a session whose blob a power cut lost
        is reported gone when the server starts again (``adopt_rested``). An fsync per rest would
        add a commit of the file system's journal to every wake past ``max_awake_sessions``."""
        path = self.path(trajectory)
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
        self.used += len(blob)
        return path

    def read(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def forget(self, rested: Rested) -> None:
        self.used = max(0, self.used - rested.size)
        try:
            os.unlink(rested.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)


async def pack(sb: Sandbox, roots: list[str]) -> tuple[bytes, dict[str, str], list[str]]:
    """The sandbox's state as one blob, what it could not carry, and the modules its namespace
    holds (for ``op_warm``); the sandbox runs on."""
    r = await sb.request({"op": "rest", "roots": roots}, REST_TIMEOUT_S)
    if "error" in r:
        raise RestFailed(f"the sandbox could not pack its state: {r['error']}")
    size = int(r["size"])
    parts: list[bytes] = []
    got = 0
    if r.get("data"):  # a small blob came with the answer (inside.rest.REST_INLINE)
        parts.append(base64.b64decode(r["data"]))
        got = len(parts[0])
    while got < size:
        c = await sb.request({"op": "rest_chunk", "offset": got}, REST_TIMEOUT_S)
        data = base64.b64decode(c.get("data") or "")
        if not data:
            raise RestFailed(f"the sandbox's state ended at {got} of {size} bytes")
        parts.append(data)
        got += len(data)
    return b"".join(parts), dict(r.get("dropped") or {}), list(r.get("modules") or [])


async def load(sb: Sandbox, blob: bytes, then: dict | None = None) -> tuple[dict[str, str], dict | None]:
    """Load a blob into a fresh sandbox; returns what was dropped (at rest and now) and, with
    ``then`` (a ``cell`` request; its ``_timeout`` is the host's wait for it), that cell's answer,
    run by the same request once the state is loaded (``inside.rest.op_wake``)."""
    off = 0
    while True:
        chunk = blob[off:off + WAKE_CHUNK]
        off += len(chunk)
        last = off >= len(blob)
        req = {"op": "wake", "data": base64.b64encode(chunk).decode(), "last": last}
        timeout_s = REST_TIMEOUT_S
        if last and then is not None:
            req["then"] = {k: v for k, v in then.items() if k != "_timeout"}
            timeout_s += float(then.get("_timeout") or 0)
        r = await sb.request(req, timeout_s)
        if "error" in r:
            raise SandboxDied(f"the sandbox could not load the session's state: {r['error']}")
        if last:
            answer = r.get("then")
            return dict(r.get("dropped") or {}), (answer if isinstance(answer, dict) else None)


class RestFailed(RuntimeError):
    """A session could not be put to rest (it stays awake, its state untouched)."""
