"""Sessions at rest: an idle session's state on disk instead of in processes (issue #25).

Measured on the 2-core VM (one session after a step that imports three modules and keeps a list
of 1,000 ints): its cgroup is charged 10.7 MB; of that the runner is 6.4 MB PSS (4.7 MB private
dirty), its zygote 4.2 MB PSS (2.8 MB private dirty), bubblewrap 0.2 MB, the rest kernel objects
(page tables, namespaces, the tmpfs). An interpreter's private dirty pages alone are ~3x the
1.5 MB an idle session may cost, so sharing pages with a warm zygote cannot get there; ending
the processes can. So a session idle for ``rest_after_s``, or the least recently used when more
than ``max_awake_sessions`` are awake, is *put to rest*: its interpreter packs its namespace (pickled:
functions and classes defined in the session by their code, modules by name) and its tmpfs files
(the workspace, /tmp) into one blob (``runner.op_rest``), the host fetches it in chunks and writes
it here, and the sandbox is reset for another session (below) or killed. An image session's
workspace is on disk already: its root stays mounted and only /tmp goes into the blob. The next
step *wakes* it: a sandbox from the sessions' pool (or the session's own root) loads the blob
(``runner.op_wake``).

A session's python runs in its own interpreter, a child forked from the sandbox's zygote
(``runner.SessionChild``), never in the runner: so once the session has left (put to rest, or
closed) its sandbox is reset exactly as a one-shot's is (the child and the shell killed, every
writable place wiped, IPC and keyrings emptied, the runner's and zygote's rlimits and affinity
checked: ``recycle.Recycler.session_verdict``) and goes back to the sessions' pool. An open or
a wake then costs a fork of a warm zygote and a cell, not a new sandbox (bubblewrap, an
interpreter: 27-50 ms of CPU); before this, every wake and every open took a fresh sandbox, and
a stream of them was bounded by how fast the pool refilled (10,000 opens took 1189 s at load
9-16). Only a default session's sandbox is reused (its root is the host's, read-only; a fork's or
a restore's workspace has layers under it); an image session's is not (its root is writable).

Measured over HTTP (``tangram bench sessions --n 1000 --baseline``, 2-core VM, load 4-13): 1,000
sessions opened in 32.7 s against 108.9 s before (3.33x the opens per second), revisits one at a
time p50 14.1 / p99 64 ms against 27.1 / 836 ms, 7.79x the steps per second at 16 clients;
10,000 (``--n 10000``, load 6-8) opened in 136 s (1189 s before), 0.34 MB idle each, revisits
p50 12.8 / p99 73 ms, 10000/10000 states exact. An
awake session costs more (~13 MB against ~7: its sandbox keeps the zygote, and the session's
interpreter is a third process; its cgroup's charge after a step importing three modules: the
runner 5.0 MB private dirty, the zygote 1.5, the interpreter 1.6, bash 0.3, bubblewrap 0.15, the
rest kernel objects), which 256 awake of 10,000 spread to ~0.3 MB a session. Ending an awake
session's zygote would free its 1.5 MB, but then its sandbox could not be reset for another
session (the next interpreter must come from a zygote that never held a request) and an
interpreter restarted after a crash would fork from the runner, whose heap has relayed earlier
sessions' cells: not done. Per
session, one at a time without HTTP (200 sessions past ``max_awake_sessions`` 8, load 3-7): an
open 7-8 ms of sandbox CPU (its first cell 1.8, the reset and the next interpreter's fork 2.4,
the rest of the session it displaces 0.7) and ~3 ms of this process's; a revisit's wake 2 ms.
The step that wakes a session rides on the wake's last request (``load(then=...)``), and a blob up
to 256 KB on the rest's own answer: one round trip fewer each. Past ``max_awake_sessions`` (640 by default: ~8.5 GB of awake sessions) the least
recently used goes to rest as a wake or an open *starts* (``manager._run``), so that its pack
overlaps the wake rather than the step's answer and the next request.

Where a revisit's time goes (issue #25's follow-up; HTTP, 300 sessions revisited one at a time
past ``max_awake_sessions`` 100, 2-core VM at load 1-3): a one-at-a-time scan past the LRU bound
wakes at every step (600 of 600 in ``tangram bench sessions --n 600``), and every wake sends the
least recently used to rest. Per woken step, CPU: the client 2.0 ms, the server 3.4, the sandboxes
5.4; per awake step 2.2, 2.2 and 2.1 (p50 ~9-11 ms against ~6). Of the sandboxes': the wake 2.5-3.4
ms (the interpreter's load 0.5, the cell 1.0-1.6 in an interpreter just forked against 0.7 in one
that has run a cell: its first writes to the zygote's pages), the reset of the displaced session's
sandbox 2.2-3.2 (ending its interpreter 0.8-0.9, forking the next 1.0), its pack 0.6-0.9. On two
cores that work competes with the client and the server, so the p50 moves with the machine's load
more than with any one hop. The interpreter forked ahead warms itself (``runner.session_warm``: a
load and a cell of its own before the session's first request): the wake's CPU 0.4-0.9 ms less, the
reset's 1.5-1.9 more, more CPU in all, but off the revisit's path: ``tangram bench sessions --n 1000
--baseline`` (main's code first, then this, 2-core VM, load 1.5-5.5), revisit p50 7.37 vs 9.45 ms
and 6.74 vs 8.69 ms (0.78x both), p99 0.80x / 1.06x; steps/s at 16 clients 1.09x / 0.76x (the
CPU shows there). Dropped, measured: ``gc.freeze()`` in the zygote: an awake session's charge
unchanged (13.3 MB against 13.2-13.5); the waking cell riding on the interpreter's load request
(one request to it, two answer lines): the sandbox's CPU per wake 3.8-4.7 ms against 4.3-4.5,
within the noise, and not carried over the answers' nonces (``runner.child_call``).

Costs, measured on the 2-core VM shared with other work (load 4-10): packing a small session
(a list of 1,000 ints, three modules; a 2-5 KB blob) 3-12 ms, loading it 0.4-2.5 ms once the
warm sandbox's zygote has imported pickle and what a first cell needs (``op_warm``: into the
zygote, so every session interpreter forked from it shares them). Dropped: keeping the sandbox
and resting only the interpreter (bubblewrap, the runner and the kernel's share stay: ~6 MB).

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
        is reported gone when the server starts again (``adopt_rested``). An fsync per rest was
        0.2 ms of a thread and a commit of the file system's journal on every wake past
        ``max_awake_sessions`` (0.4 ms a write with it, 0.2 without, 2-core VM)."""
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
    if r.get("data"):  # a small blob came with the answer (runner.REST_INLINE)
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
    run by the same request once the state is loaded (``runner.op_wake``)."""
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
