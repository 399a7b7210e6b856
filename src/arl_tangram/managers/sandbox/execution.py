"""Running a payload in its sandbox: one handler per payload type, chosen from a table.

``Execution.handlers`` maps each payload type of ``spec.py`` (``RunCode``, ``Exec``, ``Files``,
``FsCall``, ``Fork``, ``Snapshot``) to the coroutine that carries it out in a sandbox it is given;
``Execution.direct`` those that need no sandbox (``Restore``: a root mounted for a new session). A
new payload type is a handler and a line in the table. The requests are the runner's wire format
(``op`` and its fields); the answers become an ``Outcome`` and a ``SandboxResult`` here.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ...core.action import Action, Outcome
from . import envops, languages
from .host import SandboxHost
from .images import ImageError, resolve_in
from .isolation import Isolation
from .livestdin import LiveStdin
from .rootfs import RootFs, overlay_supported
from .sandbox import Sandbox, Turn
from .sessions import SessionBook
from .spec import (CommandResult, Exec, Files, Fork, FsCall, Restore, RunCode, SandboxResult, Snapshot,
                   cut_files_note)

log = logging.getLogger(__name__)

#: seconds a workspace file transfer (put/get) may take before the sandbox is declared dead
FILES_TIMEOUT_S = 30.0

Done = tuple[Outcome, SandboxResult]


@dataclass(slots=True)
class Step:
    """How one payload runs beside its sandbox: its cores; ``on_output``: a listener of its output
    (``SandboxManager.listen``); ``turn``: wait for it (a one-shot's first request is written by
    its opener: ``lease.py``); ``riding``: a one-shot's reset, sent with its run
    (``Recycler.riding``); ``stdin``: a shell step's live stdin (``SandboxManager.feed``)."""

    cores: tuple[int, ...]
    on_output: Callable[[str, bytes], None] | None = None
    turn: Turn | None = None
    riding: dict | None = None
    stdin: LiveStdin | None = None

    async def ready(self) -> None:
        """Wait for the turn, for a payload whose first request does not (all but ``RunCode``)."""
        if self.turn is not None:
            await self.turn.wait()


class Execution:
    """Carries out payloads in sandboxes (and ``Restore`` without one)."""

    def __init__(self, host: SandboxHost, book: SessionBook) -> None:
        self.host = host
        self.book = book
        self.handlers: dict[type, Callable[[Sandbox, Any, Step], Awaitable[Done]]] = {
            RunCode: self.run_code, Exec: self.exec, Files: self.files, FsCall: self.fs, Fork: self.fork,
            Snapshot: self.snapshot}
        self.direct: dict[type, Callable[[Action], Awaitable[Done]]] = {Restore: self.restore}

    async def execute(self, sb: Sandbox, payload: object, step: Step) -> Done:
        handler = self.handlers.get(type(payload))
        if handler is None:
            handler = next((h for t, h in self.handlers.items() if isinstance(payload, t)), self.unknown)
        return await handler(sb, payload, step)

    async def unknown(self, sb: Sandbox, payload: object, step: Step) -> Done:
        await step.ready()
        return Outcome.REJECTED, SandboxResult(message=f"payload: {type(payload).__name__} is not a sandbox request")

    def base(self, cores: tuple[int, ...], sb: Sandbox | None = None) -> dict:
        """What every request of a run carries: its environment, its output cap and, without
        cgroups, the CPUs the runner pins it to."""
        env = request_env(cores)
        if sb is not None and sb.rootfs is not None:
            env = {**sb.rootfs.image.env, **env}
        req = {"env": env, "max_output": self.host.config.max_output_bytes}
        if self.host.root is None:
            req["cpus"] = list(cores)
        return req

    def cell_request(self, cores: tuple[int, ...], sb: Sandbox, p: Exec) -> dict:
        """A python step's request to its sandbox (run on its own, or riding on a wake's)."""
        return {**self.base(cores, sb), "op": "cell", "code": p.python, "timeout_s": p.timeout_s, "jupyter": p.jupyter}

    async def drop_broken(self, sb: Sandbox, r: dict) -> None:
        """A step's answer says ``broken`` (its zygote is gone, so no python can run in ``sb`` any
        more): the sandbox is killed, and the session's next step takes a new one, saying it
        restarted, rather than failing every later python step."""
        if r.get("broken"):
            log.warning("session sandbox %s replaced: %s", sb.id, str(r["broken"])[:300])
            await sb.kill()

    async def run_code(self, sb: Sandbox, p: RunCode, step: Step) -> Done:
        grace = self.host.config.grace_s
        turn = step.turn
        try:
            if sb.rootfs is not None and not sb.rootfs.workspace_only:
                lang = languages.resolve(p.language, which=lambda exe: which_in(sb.rootfs, exe))
            else:
                lang = languages.resolve(p.language, ":".join(self.host.config.ro_binds))
        except (languages.UnknownLanguage, languages.MissingToolchain) as e:
            return Outcome.REJECTED, SandboxResult(message=str(e))
        files = {**{k: b64(v) for k, v in p.files.items()}}
        if not lang.in_interpreter:
            files[lang.source] = b64(p.code.encode())
        base = self.base(step.cores, sb)
        if p.memory_as_rlimit and p.memory_mb:
            base["as_bytes"] = p.memory_mb << 20
        result = SandboxResult()
        # the files ride on the first command and fetched files on the last: one round trip per command
        if lang.compile:
            r = await sb.request({**base, "op": "run", "argv": list(lang.compile), "timeout_s": p.compile_timeout_s,
                                  "files": files}, p.compile_timeout_s + grace, turn=turn)
            files, turn = {}, None
            if "files_error" in r:
                return Outcome.FAILED, SandboxResult(message=f"files: {r['files_error']}")
            result.compile = CommandResult.from_wire(r) if "error" not in r else None
            if "error" in r:
                return Outcome.INFRA_ERROR, SandboxResult(message=f"compile: {r['error']}")
            if result.compile.timed_out:
                result.message = "compile timed out"
                return Outcome.TIMEOUT, result
            if result.compile.exit_code != 0:
                result.message = "compile error"
                return Outcome.FAILED, result
        if lang.in_interpreter:
            req = {**base, "op": "python", "code": p.code}
        else:
            req = {**base, "op": "run", "argv": list(lang.run)}
        r = await sb.request({**req, "stdin": b64(p.stdin), "timeout_s": p.run_timeout_s, "files": files,
                              "fetch": list(p.fetch_files)}, p.run_timeout_s + grace, turn=turn, then=step.riding)
        if "files_error" in r:
            return Outcome.FAILED, SandboxResult(message=f"files: {r['files_error']}")
        if "error" in r:
            return Outcome.INFRA_ERROR, SandboxResult(message=f"run: {r['error']}")
        run = result_of(r)
        result.run, result.message = run.run, run.message
        if p.fetch_files:
            fr = r.get("fetched") or {}
            result.files = {k: base64.b64decode(v) for k, v in fr.get("files", {}).items()}
            result.missing = fr.get("missing", list(p.fetch_files))
            if fr.get("cut"):  # past the size limits: said (SandboxFusion's message names them)
                result.info = {**result.info, "cut_files": list(fr["cut"])}
                result.message = join(result.message, cut_files_note(fr["cut"]))
        return outcome_of(r), result

    async def exec(self, sb: Sandbox, payload: Exec, step: Step) -> Done:
        """A session's step: a python cell in its interpreter, or a command of its shell."""
        await step.ready()
        grace = self.host.config.grace_s
        on_output, stdin = step.on_output, step.stdin
        if payload.python is not None:
            req = self.cell_request(step.cores, sb, payload)
            if on_output is not None:
                req["stream"] = True
        elif payload.command is not None:  # a step of the session's persistent shell
            req = {**self.base(step.cores, sb), "op": "shell", "command": payload.command,
                   "timeout_s": payload.timeout_s, "stdin": b64(payload.stdin)}
            if on_output is not None:
                req["stream"] = True
            if stdin is not None:
                req["stdin_live"] = True
        else:
            return Outcome.REJECTED, SandboxResult(message="exec: give a command or a python cell")
        if payload.python is not None:
            stdin = None  # (Session.exec refuses a live stdin for a cell)
        if "stream" not in req:  # + the shell's own kill window
            r = await sb.request(req, payload.timeout_s + grace + 1.0, stdin=stdin)
            await self.drop_broken(sb, r)
            return outcome_of(r), result_of(r)
        assert on_output is not None
        streamed = {"stdout": 0, "stderr": 0}

        def counted(stream: str, data: bytes) -> None:
            streamed[stream] += len(data)
            on_output(stream, data)

        r = await sb.request(req, payload.timeout_s + grace + 1.0, counted, stdin=stdin)
        await self.drop_broken(sb, r)
        for stream in ("stdout", "stderr"):  # what the step had not sent before it ended
            data = base64.b64decode(r.get(stream) or "")
            if len(data) > streamed[stream]:
                on_output(stream, data[streamed[stream]:])
        return outcome_of(r), result_of(r)

    async def files(self, sb: Sandbox, payload: Files, step: Step) -> Done:
        """Workspace files written, then read, by the runner."""
        await step.ready()
        grace = self.host.config.grace_s
        out = SandboxResult()
        if payload.put:
            r = await sb.request({"op": "write", "files": {k: b64(v) for k, v in payload.put.items()}},
                                 FILES_TIMEOUT_S + grace)
            if "error" in r:
                return Outcome.FAILED, SandboxResult(message=f"files: {r['error']}")
        if payload.get:
            r = await sb.request({"op": "read", "paths": list(payload.get)}, FILES_TIMEOUT_S + grace)
            out.files = {k: base64.b64decode(v) for k, v in r.get("files", {}).items()}
            out.missing = r.get("missing", [])
        return Outcome.OK, out

    async def fs(self, sb: Sandbox, payload: FsCall, step: Step) -> Done:
        await step.ready()
        return fs_outcome(payload, await sb.request(payload.request(), FILES_TIMEOUT_S + self.host.config.grace_s))

    async def snapshot(self, sb: Sandbox, payload: Snapshot, step: Step) -> Done:
        await step.ready()
        if sb.rootfs is None:
            return Outcome.REJECTED, envops.not_layered("snapshot", self.why_not_layered())
        return Outcome.OK, await envops.snapshot(sb.rootfs, payload.path)

    async def fork(self, sb: Sandbox, fork: Fork, step: Step) -> Done:
        """Fork (``envops`` says how): the source's processes stop, its files become a shared layer
        under fresh roots for it and each child; all start their processes on their next action."""
        await step.ready()
        if sb.rootfs is None:
            return Outcome.REJECTED, envops.not_layered("fork", self.why_not_layered())
        book, boxes = self.book, self.host.imageboxes
        taken = [c for c in fork.children if book.exists(c)]
        if taken or fork.source in fork.children or len(set(fork.children)) != len(fork.children):
            return Outcome.REJECTED, SandboxResult(message=f"fork: child ids must be new and distinct ({taken or 'dup'})")
        t0 = time.perf_counter()
        src = await boxes.stop_processes(sb)
        book.awake.pop(fork.source, None)
        t1 = time.perf_counter()
        try:
            roots = await asyncio.to_thread(envops.stack, boxes, src, len(fork.children) + 1)
        except OSError as e:
            return Outcome.INFRA_ERROR, SandboxResult(message=f"fork: {e} (the source session's state is lost)")
        t2 = time.perf_counter()
        for traj, root in zip((fork.source, *fork.children), roots):
            book.adopt(traj, root)
        return Outcome.OK, SandboxResult(
            message=f"forked into {len(fork.children)}; processes (python interpreter, shell) restart on next use",
            info={"children": list(fork.children), "pause_s": t1 - t0, "cow_s": t2 - t1, "fork_s": t2 - t0,
                  "layers": len(roots[0].session_layers)})

    async def restore(self, action: Action) -> Done:
        """Make the action's trajectory a new session whose files are those of a snapshot (its
        processes start on its first step); ``rejected`` saying why a snapshot cannot be."""
        trajectory, restore, book = action.trajectory, action.payload, self.book
        try:
            if self.host.mode is not Isolation.BWRAP:
                raise ImageError("restore: sandboxes from images need bubblewrap isolation")
            if trajectory is None or book.exists(trajectory):
                raise ImageError(f"restore: session {trajectory!r} already exists" if trajectory else
                                 "restore: the action names no trajectory (the new session)")
            root = await asyncio.to_thread(envops.restore, self.host.imageboxes, trajectory, restore.path)
        except ImageError as e:
            return Outcome.REJECTED, SandboxResult(message=str(e))
        if book.exists(trajectory):  # made meanwhile
            await asyncio.to_thread(self.host.imageboxes.drop, root)
            return Outcome.REJECTED, SandboxResult(message=f"restore: session {trajectory!r} already exists")
        book.adopt(trajectory, root)
        return Outcome.OK, SandboxResult(info={"image": None if root.workspace_only else root.image.name})

    def why_not_layered(self) -> str:
        mode = self.host.mode
        if mode is not Isolation.BWRAP:
            return f"sandboxes here use {mode.value if mode else 'no'} isolation, layers need bubblewrap"
        return overlay_supported() or "the session's sandbox was started without layers"


def request_env(cores: tuple[int, ...]) -> dict[str, str]:
    """The environment every run gets: its cores' count, for the code and its thread pools."""
    n = str(len(cores))
    return {"TANGRAM_NUM_CPUS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def fs_outcome(call: FsCall, r: dict) -> Done:
    """A filesystem call's answer (``inside.fsops.op_fs``): the caller's failure is ``FAILED`` with its
    code in ``info["error"]``; an answer of neither shape (the runner's own failure) is
    ``infra_error``, never the caller's."""
    err, got = r.get("fs_error"), r.get("fs")
    if isinstance(err, list) and len(err) == 2:
        return Outcome.FAILED, SandboxResult(message=str(err[1]), info={"error": str(err[0])})
    if not isinstance(got, dict):
        return Outcome.INFRA_ERROR, SandboxResult(message=f"{call.call}: {r.get('error') or 'the sandbox did not answer'}")
    if call.call == "read":
        return Outcome.OK, SandboxResult(files={call.path: base64.b64decode(got.get("data") or "")},
                                         info={"cut": bool(got.get("cut"))})
    return Outcome.OK, SandboxResult(info=got)


def which_in(rootfs: RootFs, exe: str) -> str | None:
    path = rootfs.image.env.get("PATH") or languages.SANDBOX_PATH
    for d in path.split(":"):
        if d and resolve_in(rootfs.root, f"{d}/{exe}") is not None:
            return f"{d}/{exe}"
    return None


def b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode() if data else None


def join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def outcome_of(r: dict) -> Outcome:
    if "error" in r:
        return Outcome.INFRA_ERROR
    if r.get("timed_out"):
        return Outcome.TIMEOUT
    return Outcome.OK if r.get("exit_code") == 0 else Outcome.FAILED


def result_of(r: dict) -> SandboxResult:
    if "error" in r:
        return SandboxResult(message=f"runner: {r['error']}")
    run = CommandResult.from_wire(r)
    notes = []
    if run.truncated:
        notes.append("output truncated")
    if run.timed_out:
        notes.append("timed out")
    if run.note:
        notes.append(run.note)
    return SandboxResult(run=run, message=join(*notes))
