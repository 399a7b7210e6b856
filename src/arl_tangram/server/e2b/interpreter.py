"""The code interpreter (port 49999): ``/execute`` runs a cell in the sandbox's python interpreter
(the session's); ``/contexts`` name contexts, which share that interpreter (README)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...runtime import SessionGone
from ..service import NotFound, Service
from .envelope import E2bError
from .sandboxes import GONE, VARIABLE, abs_path, boxes, callers_error, poll, step_s, strings


log = logging.getLogger(__name__)


@dataclass
class Cell:
    """A running ``/execute``: its output so far (capped as a step's), its result once done."""

    done: asyncio.Future
    out: dict[str, bytearray] = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def output(self, stream: str, data: bytes) -> None:
        self.out[stream] += data
        self.changed.set()


#: running cells by id, in the engine process (each is dropped once its result is taken, or
#: ``UNTAKEN_S`` after it ended)
CELLS: dict[str, Cell] = {}
UNTAKEN_S = 60.0


def e2b_cell_start(service: Service, sid: str, token: str | None, body: dict) -> str:
    """``POST /execute``, streamed: the cell starts; its output (``e2b_cell_output``) and its
    result (``e2b_cell_result``) are taken by its id."""
    boxes(service).envd(sid, token)
    cell = Cell(asyncio.get_running_loop().create_future())
    cid = f"{sid}/{uuid.uuid4().hex}"

    async def run() -> None:
        try:
            cell.done.set_result(await e2b_execute(service, sid, token, body, cell.output))
        except BaseException as e:
            cell.done.set_exception(e)
            if not isinstance(e, Exception):
                raise
        finally:
            cell.changed.set()

    CELLS[cid] = cell
    cell.task = asyncio.get_running_loop().create_task(run())
    # a caller gone is no error of the server's; its cell is forgotten a while after it ends
    cell.done.add_done_callback(lambda f: f.cancelled() or f.exception())
    cell.done.add_done_callback(lambda _: asyncio.get_running_loop().call_later(UNTAKEN_S, CELLS.pop, cid, None))
    return cid


def _cell(cid: str, sid: str) -> Cell:
    cell = CELLS.get(cid) if cid.startswith(sid + "/") else None
    if cell is None:
        raise E2bError(404, "execution not found")
    return cell


async def e2b_cell_output(service: Service, sid: str, token: str | None, cid: str, sent: tuple[int, int],
                          wait_s: float) -> tuple[bytes, bytes, bool]:
    """A cell's output past ``sent``, as ``processes.e2b_proc_output`` (a long poll)."""
    boxes(service).envd(sid, token)
    cell = _cell(cid, sid)
    return await poll(cell.out, cell.changed, cell.done, sent, wait_s)


async def e2b_cell_result(service: Service, sid: str, token: str | None, cid: str) -> dict:
    """The cell's result (as ``e2b_execute``'s) once it has run; the cell is then forgotten."""
    boxes(service).envd(sid, token)
    cell = _cell(cid, sid)
    try:
        return await asyncio.shield(cell.done)
    finally:
        if cell.done.done():
            CELLS.pop(cid, None)


async def e2b_execute(service: Service, sid: str, token: str | None, body: dict,
                      on_output: Callable[[str, bytes], None] | None = None) -> dict:
    """``POST /execute`` (port 49999): a cell in the sandbox's python interpreter (run by
    ``e2b_cell_start``'s task, its output streamed to ``on_output``)."""
    box = boxes(service).envd(sid, token)
    code = body.get("code")
    if not isinstance(code, str):
        raise E2bError(400, "code: a string is expected")
    ctx = body.get("context_id")
    if ctx is not None and ctx not in box.contexts:
        raise E2bError(404, f"context {ctx!r} not found")
    language = body.get("language") or (box.contexts[ctx]["language"] if ctx else "python")
    if language not in ("python", "python3"):
        raise E2bError(400, f"language: {language!r} is not supported (python only)")
    if body.get("env_vars"):
        strings(body.get("env_vars"), "env_vars")
    s = service.sessions.get(sid)
    if s is None:
        raise E2bError(502, GONE.format(id=sid))
    own = strings(body.get("env_vars"), "env_vars")
    for k in own:
        if not VARIABLE.fullmatch(k):
            raise E2bError(400, f"env_vars: {k!r} is not a variable name")
    want = ctx or ""
    # journaled as a command is (``processes``), answered once its outcome is on disk
    step = service.step(s.job, {"command": None, "python": code, "e2b": True}, "e2b", id=f"x-{uuid.uuid4().hex}",
                        rejects=callers_error)
    try:
        async with step, box.lock:
            base = {"HOME": HOME_ALIAS, "USER": "user", **box.env}
            if not box.cell_env:  # once per interpreter: the sandbox's environment, as commands get it
                await _set_env(s, base)
                box.cell_env = True
            if want != box.cell_ctx:  # another context's cell ran last: this one starts in its own cwd
                await _chdir(s, box.contexts[ctx]["cwd"] if ctx else HOME_ALIAS)
                box.cell_ctx = want
            if own:
                await _set_env(s, own)
            r = None
            try:
                r = await s.exec(python=code, timeout_s=step_s(box, None), jupyter=True, operation="run_code",
                                 on_output=on_output, id=step.id)
            finally:
                if own:  # this run's variables: back to the sandbox's (or unset)
                    try:
                        await _set_env(s, {k: base.get(k) for k in own})
                    except E2bError:
                        if r is None:
                            raise
                        box.cell_env = False  # the cell ran: its result stands; the next cell sets the envs again
                        log.warning("sandbox %s: the run's env_vars could not be taken back after its cell", sid)
            step.record(r)
    except (SessionGone, NotFound):
        raise E2bError(502, GONE.format(id=sid)) from None
    box.used_at = time.time()
    message = r.message or (r.result.message if r.result is not None else "")
    if VARIABLES_GONE in message:  # a new interpreter: without the sandbox's envs (they were lost after
        box.cell_env = False         # it), in the home directory
        box.cell_ctx = ""
    if r.outcome in (Outcome.INFRA_ERROR, Outcome.REJECTED, Outcome.CANCELLED):
        raise E2bError(503, f"{r.outcome.value}: {message}")
    box.executions += 1
    run = r.result.run
    out: dict = {"stdout": run.stdout if run else "", "stderr": run.stderr if run else "",
                 "results": [], "error": None, "execution_count": box.executions,
                 "truncated": bool(run is not None and run.truncated)}
    for d in (run.display if run else []):
        if "text/plain" in d:
            out["results"].append({"text": d["text/plain"], "is_main_result": True})
    if run is not None and run.error:
        e = run.error[0]
        tb = e.get("traceback")
        out["error"] = {"name": e.get("ename", "Error"), "value": e.get("evalue", ""),
                        "traceback": "\n".join(tb) if isinstance(tb, list) else str(tb or "")}
    elif r.outcome is Outcome.TIMEOUT or (run is not None and run.timed_out):
        out["error"] = {"name": "TimeoutError", "value": "the cell ran past its timeout", "traceback": ""}
    elif r.outcome is Outcome.OOM:
        out["error"] = {"name": "MemoryError", "value": "the cell ran out of memory and was killed", "traceback": ""}
    elif DIED_IN_CELL in message:  # os._exit: an error, not a success with none
        out["error"] = {"name": "InterpreterExited", "value": message, "traceback": ""}
    elif run is not None and run.exit_code not in (0, None):  # sys.exit(3): a notebook reports it
        out["error"] = {"name": "SystemExit", "value": str(run.exit_code), "traceback": ""}
    return out


#: the runner's notes on a session's interpreter: ended in this step (``op_cell``), or replaced
#: before it; either way the next cell needs the sandbox's environment again
DIED_IN_CELL = "the session's python interpreter "
VARIABLES_GONE = "its variables are gone"


ENV_STEP = ("__import__('builtins').exec('import os, json\\nfor k, v in json.loads(ENV).items():\\n"
            "    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)', {{'ENV': {env!r}}})")


async def _set_env(s, env: dict[str, str | None]) -> None:
    """Set (None: unset) variables in the interpreter's ``os.environ``: a python step of its own
    (the session's variables untouched)."""
    r = await s.exec(python=ENV_STEP.format(env=json.dumps(env)), timeout_s=10.0, jupyter=True, operation="env")
    if r.outcome is not Outcome.OK:
        raise E2bError(503, f"env_vars: could not be set ({r.outcome.value}: {r.message or r.result.message})")


CHDIR_STEP = "__import__('os').chdir({path!r})"


async def _chdir(s, path: str) -> None:
    """Move the interpreter to ``path``: contexts share the one interpreter, so a context's cell
    after one of another context's starts in its own ``cwd`` (the default context's: the home
    directory); a directory its cells moved to holds until another context's cell runs."""
    r = await s.exec(python=CHDIR_STEP.format(path=path), timeout_s=10.0, jupyter=True, operation="cwd")
    if r.outcome is Outcome.FAILED:
        raise E2bError(400, f"cwd: {path!r} cannot be the cell's directory "
                            f"({(r.result.run.error[0].get('evalue') if r.result.run and r.result.run.error else '')})")
    if r.outcome is not Outcome.OK:
        raise E2bError(503, f"cwd: {r.outcome.value}: {r.message or r.result.message}")


def e2b_context(service: Service, sid: str, token: str | None, op: str, body: dict | None,
                context_id: str | None) -> Any:
    """``/contexts``: create, list, remove. Every context of a sandbox shares its one python
    interpreter (see the README's E2B section)."""
    box = boxes(service).envd(sid, token, required=False)
    if op == "create":
        body = body or {}
        language = body.get("language") or "python"
        if language not in ("python", "python3"):
            raise E2bError(400, f"language: {language!r} is not supported (python only)")
        cwd = body.get("cwd") or HOME_ALIAS
        ctx = {"id": uuid.uuid4().hex, "language": "python", "cwd": abs_path(cwd, "cwd")}
        box.contexts[ctx["id"]] = ctx
        return ctx
    if op == "list":
        return list(box.contexts.values())
    if op == "remove":
        if box.contexts.pop(context_id or "", None) is None:
            raise E2bError(404, f"context {context_id!r} not found")
        return None
    raise E2bError(501, f"contexts: {op} is not supported by this server")


CALLS = {"e2b_context": e2b_context, "e2b_cell_start": e2b_cell_start,
         "e2b_cell_output": e2b_cell_output, "e2b_cell_result": e2b_cell_result}
