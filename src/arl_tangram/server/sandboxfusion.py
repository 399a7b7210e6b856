"""SandboxFusion's HTTP dialect: ``POST /run_code``, ``POST /run_jupyter``, ``GET /v1/ping``.

Its routes, and its translation onto the native ``Service``: ``/run_code`` is translated where
the route runs (``run_code_action``; with fronts, in the front process) into the native call
``run_oneshot``; ``/run_jupyter`` is the engine process's call ``sf_run_jupyter``. The wire
schemas are ``api/sandboxfusion.py``; what SandboxFusion itself does, field by field, and where
we differ on purpose is in docs/sandboxfusion.md.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Sequence

from fastapi import APIRouter

from ..api import sandboxfusion as sf
from ..api import v1
from ..core.action import Action, Outcome
from ..managers.sandbox import languages
from ..managers.sandbox.spec import CommandResult, Files, cut_files_note
from ..runtime import ActionResult
from .dialect import Dialect
from .journal import new_id
from .service import BadRequest, Service, decode_files, job_for, oneshot_action


def routes(router: APIRouter, calls: Any, guarded: Sequence[Any]) -> None:
    @router.get("/v1/ping", tags=["sandboxfusion"])
    async def ping() -> str:
        return "pong"

    @router.post("/run_code", response_model=sf.RunCodeResponse, tags=["sandboxfusion"], dependencies=guarded)
    async def run_code(req: sf.RunCodeRequest) -> dict[str, Any]:
        if req.language not in languages.LANGUAGES:
            return {"status": "SandboxError", "message": f"language {req.language!r} is known but this server has "
                                                         "no toolchain for it"}
        action, request = run_code_action(req)
        # a dict, validated into the response model here (``response``)
        return response(await calls.run_oneshot(action, request))

    @router.post("/run_jupyter", response_model=sf.RunJupyterResponse, tags=["sandboxfusion"], dependencies=guarded)
    async def run_jupyter(req: sf.RunJupyterRequest) -> sf.RunJupyterResponse:
        return await calls.sf_run_jupyter(req)


# -- the translation ------------------------------------------------------------------------------

def run_code_action(req: sf.RunCodeRequest) -> tuple[Action, str]:
    """``POST /run_code`` as a native journaled one-shot (re-run after a crash, as a native one):
    its action, and its ``v1.ActionRequest`` as JSON text, journaled whole (files included) so
    that a recovery's re-run is the same program. Built where the route runs (with fronts, in
    the front process: the engine process only journals and schedules, ``Service.run_oneshot``)."""
    _check_memory(req.memory_limit_MB)
    given = {p: d for p, d in req.files.items() if d is not None}
    files = decode_files("files", given)
    spec = v1.ActionRequest(id=new_id("sf"), job=job_for(None, "sandboxfusion"), action=v1.RunCodeAction(
        code=req.code, language=req.language, stdin=req.stdin, files=given, fetch_files=req.fetch_files,
        compile_timeout_s=req.compile_timeout, timeout_s=req.run_timeout,
        memory_mb=req.memory_limit_MB if req.memory_limit_MB > 0 else None, memory_as_rlimit=True))
    return oneshot_action(spec.id, spec, files), spec.model_dump_json()


def _check_memory(mb: int) -> None:
    """SandboxFusion's ``memory_limit_MB``: -1 (or 0) for the default, else at least 16 MB; a
    smaller limit left nothing to start the program in (``/run_jupyter`` answered an internal
    error, EBUSY from the group's memory file)."""
    if 0 < mb < 16:
        raise BadRequest("memory_limit_MB: give -1 (the default limit) or at least 16")


# -- the engine process's calls --------------------------------------------------------------------

async def sf_run_jupyter(service: Service, req: sf.RunJupyterRequest) -> sf.RunJupyterResponse:
    """``POST /run_jupyter``: the cells in one session of their own, closed at the end (not
    journaled: a notebook cut short by a crash is not re-run)."""
    _check_memory(req.memory_limit_MB)
    service.admit()
    files = decode_files("files", {p: d for p, d in req.files.items() if d is not None})
    s = await service.tg.session(job=job_for(None, "sandboxfusion"))
    start = time.monotonic()
    cells: list[sf.CellRunResult] = []
    status, timed_out = sf.RunStatus.Success, False
    try:
        if files:
            r = await s.files(Files(put=files))
            if r.outcome is not Outcome.OK:  # a name outside the workspace is the request's, not ours
                status = sf.RunStatus.Failed if r.outcome is Outcome.FAILED else sf.RunStatus.SandboxError
                return sf.RunJupyterResponse(status=status, message=r.message)
        for code in req.cells:
            left = req.total_timeout - (time.monotonic() - start)
            if left <= 0:
                status, timed_out = sf.RunStatus.Failed, True
                break
            timeout = min(left, req.cell_timeout) if req.cell_timeout > 0 else left
            r = await s.exec(python=code, timeout_s=timeout, operation="jupyter", jupyter=True,
                             memory_mb=req.memory_limit_MB if req.memory_limit_MB > 0 else None)
            if r.outcome in (Outcome.INFRA_ERROR, Outcome.REJECTED):
                return sf.RunJupyterResponse(status=sf.RunStatus.SandboxError, message=r.message,
                                             cells=cells)
            run = r.result.run
            cells.append(sf.CellRunResult(stdout=run.stdout if run else "", stderr=run.stderr if run else "",
                                          display=run.display if run else [], error=run.error if run else []))
            if r.outcome in (Outcome.TIMEOUT, Outcome.OOM):
                status, timed_out = sf.RunStatus.Failed, r.outcome is Outcome.TIMEOUT
                break
        fetched = {}
        if req.fetch_files:
            r = await s.files(Files(get=req.fetch_files))
            fetched = {k: base64.b64encode(v).decode() for k, v in r.result.files.items()}
    finally:
        await s.close()
    # as SandboxFusion: a failed run has an empty message and its driver record says why; the cells
    # that did run are kept (SandboxFusion drops them: see the README's compatibility notes)
    driver = sf.CommandRunResult(status=sf.CommandRunStatus.TimeLimitExceeded if timed_out
                                 else sf.CommandRunStatus.Finished, execution_time=time.monotonic() - start,
                                 return_code=None if timed_out else 0, stdout="", stderr="")
    return sf.RunJupyterResponse(status=status, message="", driver=driver, cells=cells, files=fetched)


def _command(c: CommandResult | None, outcome: Outcome) -> dict[str, Any] | None:
    """SandboxFusion's command record: a command stopped at its time limit has no return code."""
    if c is None:
        return None
    if c.timed_out or outcome is Outcome.TIMEOUT:
        return {"status": "TimeLimitExceeded", "execution_time": c.duration_s, "return_code": None,
                "stdout": c.stdout, "stderr": c.stderr}
    return {"status": "Finished", "execution_time": c.duration_s, "return_code": c.exit_code,
            "stdout": c.stdout, "stderr": c.stderr}


def response(r: ActionResult) -> dict[str, Any]:
    """Our outcome in SandboxFusion's terms, field by field as its ``parse_run_status`` does:
    infrastructure trouble is SandboxError with a message (its clients retry it and never score
    it); anything the code did is Success or Failed with an empty message (but for truncated
    output), the details being in
    the command records (a timeout is a TimeLimitExceeded record without return code, a compile
    error a compile record with the compiler's stderr and no run record).

    ``sf.RunCodeResponse``'s fields as a plain dict, validated into the model by the route's
    ``response_model``. Built where the route runs (with fronts, in the front process, from the
    ``ActionResult`` the engine process answered)."""
    res = r.result
    if r.outcome in (Outcome.INFRA_ERROR, Outcome.REJECTED, Outcome.CANCELLED):
        return {"status": "SandboxError", "message": r.message or r.outcome.value}
    compile_result = _command(res.compile, r.outcome if res.run is None else Outcome.OK)
    run_result = _command(res.run, r.outcome)
    if run_result is None and compile_result is None and r.outcome is Outcome.TIMEOUT:
        run_result = {"status": "TimeLimitExceeded", "execution_time": r.exec_s}
    # the one deliberate difference: output past the cap is flagged (SandboxFusion cuts it silently, and a
    # reward computed on cut output would be wrong without anyone knowing)
    truncated = any(c is not None and c.truncated for c in (res.compile, res.run))
    message = "output truncated" if truncated else ""
    if compile_result is None and run_result is None and r.outcome is not Outcome.OK:
        message = r.message  # nothing ran (a file it could not be given): the message is the only why
    cut = res.info.get("cut_files") if res.info else None
    if cut:  # fetched files past their size limit: cut, and said so (as output past its cap is)
        message = "; ".join(m for m in (message, cut_files_note(cut)) if m)
    return {"status": "Success" if r.outcome is Outcome.OK else "Failed",
            "message": message, "compile_result": compile_result,
            "run_result": run_result, "executor_pod_name": None,
            "files": {k: base64.b64encode(v).decode() for k, v in res.files.items()}}


DIALECT = Dialect("sandboxfusion", {"sf_run_jupyter": sf_run_jupyter}, routes)
