"""envd's ``process.Process`` calls: each E2B process is one shell step of the sandbox's session,
run as a task so that a background one can be re-attached to, waited for, fed stdin, killed."""

from __future__ import annotations

import asyncio
import base64
import binascii
import posixpath
import shlex
import time
import uuid
from typing import Any

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.livestdin import LiveStdin, StdinClosed, StdinFull
from ..service import Service
from .envelope import E2bError
from .sandboxes import DEFAULT_TEMPLATES, GONE, VARIABLE, Box, Proc, boxes, callers_error, poll, step_s, translate


#: ended processes kept per sandbox for streams still reading them (each holds its capped output)
ENDED_KEPT = 4


def _shell(box: Box, config: dict) -> str:
    """The session step of one E2B process: its argv, in its cwd, with the sandbox's and its own
    environment, in a subshell (the session's shell keeps no trace of it)."""
    cmd = config.get("cmd")
    args = config.get("args") or []
    envs = config.get("envs") or {}
    cwd = config.get("cwd") or HOME_ALIAS
    if not isinstance(cmd, str) or not cmd:
        raise E2bError(400, "process.cmd: a command is expected")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise E2bError(400, "process.args: a list of strings is expected")
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise E2bError(400, "process.envs: an object of string values is expected")
    if not isinstance(cwd, str):
        raise E2bError(400, "process.cwd: a path is expected")
    for k in list(box.env) + list(envs):
        if not VARIABLE.fullmatch(k):
            raise E2bError(400, f"process.envs: {k!r} is not a variable name")
    env = {"HOME": HOME_ALIAS, "USER": "user", **box.env, **envs}
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    if cmd == "/bin/bash" and len(args) == 3 and args[:2] == ["-l", "-c"] and box.template in DEFAULT_TEMPLATES:
        # what the SDK sends for every command: run in a subshell of the session's own bash (no
        # profile in the default sandbox to log in with), sparing a bash start per command
        return f"( cd -- {shlex.quote(cwd)} && export {assigns} && eval {shlex.quote(args[2])} )"
    argv = " ".join(shlex.quote(a) for a in [cmd, *args])
    return f"( cd -- {shlex.quote(cwd)} && exec env -- {assigns} {argv} )"


def e2b_proc_start(service: Service, sid: str, token: str | None, request: dict,
                   timeout_s: float | None) -> int:
    """``process.Process/Start``: the process's pid (its result: ``e2b_proc_wait``)."""
    box = boxes(service).envd(sid, token)
    config = request.get("process")
    if not isinstance(config, dict):
        raise E2bError(400, "process: a process config is expected")
    if request.get("pty"):
        raise E2bError(501, "pty: terminals are not supported by this server (commands only)")
    shell = _shell(box, config)
    pid = box.next_pid
    box.next_pid += 1
    tag = request.get("tag")
    # stdin=True: fed while the command runs where its session runs in this process (E2B's way);
    # elsewhere (Ray's nodes) given whole when it is closed, the command starting then
    session = service.sessions.get(box.id)
    live = bool(request.get("stdin")) and session is not None and session.live_stdin_here
    proc = Proc(pid, {"cmd": config.get("cmd"), "args": config.get("args") or [], "envs": config.get("envs") or {},
                      **({"cwd": config["cwd"]} if config.get("cwd") else {})}, tag if isinstance(tag, str) else None,
                shell, step_s(box, timeout_s), bytearray() if request.get("stdin") and not live else None,
                asyncio.get_running_loop().create_future(), live=LiveStdin() if live else None)
    box.procs[pid] = proc
    proc.done.add_done_callback(_retrieved)
    proc.done.add_done_callback(lambda _: proc.changed.set())
    if proc.stdin is None:
        _launch(service, box, proc)
    return pid


def _retrieved(f: asyncio.Future) -> None:
    """A background process's error nobody waits for is not an error of the server's."""
    if not f.cancelled():
        f.exception()


def _launch(service: Service, box: Box, proc: Proc, stdin: bytes | None = None) -> None:
    proc.action_id = f"x-{uuid.uuid4().hex}"
    proc.task = asyncio.get_running_loop().create_task(_run(service, box, proc, stdin))


async def _run(service: Service, box: Box, proc: Proc, stdin: bytes | None) -> None:
    try:
        try:
            result = await _exec(service, box, proc.shell, stdin, proc.timeout_s, proc.action_id,
                                 proc.config.get("cmd") or "shell", proc=proc)
        finally:
            if proc.live is not None:  # (its step's end did it too, unless it never ran: then input is refused,
                proc.live.end()        # not kept)
        if proc.killed:
            result = {"exit_code": -1, "exited": False, "status": "signal: killed", "stdout": result.get("stdout", ""),
                      "stderr": result.get("stderr", "")}
        if not proc.done.done():
            proc.done.set_result(result)
    except BaseException as e:
        if not proc.done.done():
            proc.done.set_exception(translate(e, box.id))
        if not isinstance(e, Exception):
            raise


async def _exec(service: Service, box: Box, command: str | None, stdin: bytes | None, timeout_s: float, id: str,
                operation: str, python: str | None = None, proc: "Proc | None" = None) -> dict:
    """One shell step of the sandbox's session, journaled and counted as the native API's are.
    What the command did is the answer (its exit code, output); what the infrastructure did
    (``infra_error``, ``rejected``) is an ``E2bError``, never an exit code."""
    s = service.sessions.get(box.id)
    if s is None:
        raise E2bError(502, GONE.format(id=box.id))
    # answered once its outcome is on disk, as the native API's steps are
    async with service.step(s.job, {"command": command, "python": python, "e2b": True}, "e2b", id=id,
                            rejects=callers_error) as step:
        async with box.lock:
            if proc is not None:
                if proc.killed:  # killed while it waited for the sandbox: it never runs
                    step.unrun("cancelled", "killed before it started")
                    return {"exit_code": -1, "exited": False, "status": "signal: killed", "stdout": "", "stderr": ""}
                proc.running = True
            r = await s.exec(command, python=python, stdin=stdin, timeout_s=timeout_s, id=id,
                             jupyter=python is not None, operation=posixpath.basename(operation),
                             on_output=proc.output if proc is not None else None,
                             live_stdin=proc.live if proc is not None else None)
        step.record(r)
        box.used_at = time.time()
    return _command_result(r, box.id)


def _command_result(r, sid: str) -> dict:
    run = r.result.run if r.result is not None else None
    if r.outcome in (Outcome.INFRA_ERROR, Outcome.REJECTED) or (r.outcome is not Outcome.CANCELLED and run is None
                                                               and r.outcome is not Outcome.TIMEOUT):
        if sid and r.outcome is Outcome.INFRA_ERROR and "closed" in (r.message or ""):
            raise E2bError(502, GONE.format(id=sid))
        status = 429 if r.outcome is Outcome.REJECTED else 503
        raise E2bError(status, f"{r.outcome.value}: {r.message or 'the step did not run'}",
                       "resource_exhausted" if status == 429 else "unavailable")
    stdout, stderr = (run.stdout, run.stderr) if run is not None else ("", "")
    if r.outcome is Outcome.CANCELLED:
        return {"exit_code": -1, "exited": False, "status": "signal: killed", "stdout": stdout, "stderr": stderr}
    if r.outcome is Outcome.TIMEOUT or (run is not None and run.timed_out):
        # as the SDK's own deadline does: its TimeoutException (E2B leaves the process running;
        # here every process of a step ends with it)
        raise E2bError(504, "the command ran past its timeout and was killed: pass a longer 'timeout' (0: "
                            "no limit)", "deadline_exceeded")
    code = run.exit_code if run.exit_code is not None else -1
    out = {"exit_code": code, "exited": run.exit_code is not None, "status": f"exit status {code}",
           "stdout": stdout, "stderr": stderr}
    if r.outcome is Outcome.OOM:
        out["error"] = "the command ran out of memory and was killed"
    elif run.truncated:
        out["error"] = "output past the server's cap was dropped"
    return out


def _proc(box: Box, process: Any) -> Proc:
    sel = process if isinstance(process, dict) else {}
    if "pid" in sel:
        proc = box.procs.get(sel["pid"]) if isinstance(sel["pid"], int) else None
        if proc is None:
            raise E2bError(404, f"process with pid {sel['pid']} not found")
        return proc
    if "tag" in sel:
        for proc in box.procs.values():
            if proc.tag == sel["tag"]:
                return proc
        raise E2bError(404, f"process with tag {sel['tag']!r} not found")
    raise E2bError(400, "process: a pid or a tag is expected")


def e2b_proc_find(service: Service, sid: str, token: str | None, process: Any) -> int:
    """``process.Process/Connect``'s first half: the pid of a running process."""
    return _proc(boxes(service).envd(sid, token), process).pid


async def e2b_proc_wait(service: Service, sid: str, token: str | None, pid: int) -> dict:
    """The result of process ``pid`` once it has ended (its output, then its exit)."""
    box = boxes(service).envd(sid, token)
    proc = _streamed(box, pid)
    try:
        return await asyncio.shield(proc.done)
    finally:
        if proc.done.done() and box.procs.pop(pid, None) is not None:
            box.ended[pid] = proc
            while len(box.ended) > ENDED_KEPT:
                del box.ended[next(iter(box.ended))]


def _streamed(box: Box, pid: int) -> Proc:
    """Process ``pid``, running or recently ended (a stream of it may still be reading)."""
    proc = box.procs.get(pid) or box.ended.get(pid)
    if proc is None:
        raise E2bError(404, f"process with pid {pid} not found")
    return proc


async def e2b_proc_output(service: Service, sid: str, token: str | None, pid: int, sent: tuple[int, int],
                          wait_s: float) -> tuple[bytes, bytes, bool]:
    """Process ``pid``'s output past ``sent`` (bytes of stdout, of stderr a stream has sent),
    once there is some, or it has ended (the third item: then its result is ``e2b_proc_wait``'s),
    or ``wait_s`` has passed (a keepalive's turn). A long poll: one call per batch of output, so
    the stream works through the fronts' link (request and answer) as in process."""
    box = boxes(service).envd(sid, token)
    proc = _streamed(box, pid)
    return await poll(proc.out, proc.changed, proc.done, sent, wait_s)


def e2b_proc_list(service: Service, sid: str, token: str | None) -> list[dict]:
    box = boxes(service).envd(sid, token)
    return [{"config": p.config, "pid": p.pid, **({"tag": p.tag} if p.tag else {})}
            for p in box.procs.values() if not p.done.done()]


def e2b_proc_input(service: Service, sid: str, token: str | None, process: Any, data: str) -> None:
    """Input for a process started with ``stdin=True``: written to its stdin as it runs (a live
    stdin), or kept for its start (where its stdin is given whole)."""
    box = boxes(service).envd(sid, token)
    proc = _proc(box, process)
    if proc.stdin is None and proc.live is None:
        raise E2bError(400, f"process {proc.pid}: its stdin is not open (start it with stdin=True)",
                       "failed_precondition")
    try:
        raw = base64.b64decode(data or "", validate=True)
    except (binascii.Error, ValueError):
        raise E2bError(400, "input.stdin: not valid base64") from None
    if proc.live is None:
        proc.stdin += raw
        return
    try:
        proc.live.send(raw)
    except StdinClosed as e:
        raise E2bError(400, f"process {proc.pid}: {e}", "failed_precondition") from None
    except StdinFull as e:
        raise E2bError(429, f"process {proc.pid}: {e}", "resource_exhausted") from None


def e2b_proc_close_stdin(service: Service, sid: str, token: str | None, process: Any) -> None:
    """End of file for the process's stdin once it has read what was sent (a live stdin); where
    stdin is given whole, the process starts now, with what was sent."""
    box = boxes(service).envd(sid, token)
    proc = _proc(box, process)
    if proc.live is not None:
        try:
            proc.live.close()
        except StdinClosed:  # the sandbox went meanwhile: the process's end says so
            pass
        return
    if proc.stdin is None:
        return
    data, proc.stdin = bytes(proc.stdin), None
    _launch(service, box, proc, data)


def e2b_proc_signal(service: Service, sid: str, token: str | None, process: Any, signal: Any) -> None:
    """SIGKILL and SIGTERM end the process: everything its step started is killed."""
    box = boxes(service).envd(sid, token)
    proc = _proc(box, process)
    if signal not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM", 9, 15):
        raise E2bError(400, f"signal: {signal!r} is not SIGKILL or SIGTERM")
    proc.killed = True
    if proc.task is None:  # never started (stdin still open)
        proc.stdin = None
        if not proc.done.done():
            proc.done.set_result({"exit_code": -1, "exited": False, "status": "signal: killed", "stdout": "",
                                  "stderr": ""})
        return
    if not proc.running or proc.done.done():
        return  # waiting for the sandbox (it will not run) or over already
    if service.runtime.state_of(proc.action_id) == "queued":
        service.runtime.cancel(proc.action_id)  # waiting for a core: it ends without starting
        return
    # running: its processes are killed inside the sandbox, which lives on (cancelling the action
    # would kill the whole sandbox, and a default sandbox's files with it)
    if not service.runtime.interrupt_step(sid):
        raise E2bError(501, "SendSignal: this server cannot stop a running command of this sandbox (it runs "
                            "elsewhere); it ends at its timeout", "unimplemented")


CALLS = {
    "e2b_proc_start": e2b_proc_start, "e2b_proc_find": e2b_proc_find, "e2b_proc_wait": e2b_proc_wait,
    "e2b_proc_output": e2b_proc_output,
    "e2b_proc_list": e2b_proc_list, "e2b_proc_input": e2b_proc_input, "e2b_proc_close_stdin": e2b_proc_close_stdin,
    "e2b_proc_signal": e2b_proc_signal,
}
