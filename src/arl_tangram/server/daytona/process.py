"""The toolbox's ``/process`` calls: ``exec``, ``code-run`` and process sessions, each command one
journaled step of the sandbox's Tangram session (``Service.step``).

``exec`` runs in a subshell of the session's persistent shell (its shell keeps no trace of it),
stdout and stderr as one output, as Daytona answers it; python's ``code-run`` in a child forked by
the session's python interpreter (``CODE_RUN_DEF``), another language's as ``exec``. A process
session keeps its working directory, variables and functions from one command to the next: each
command runs in a subshell that reads them from the session's state files in the sandbox and
writes them back as it exits (``SESSION_STEP``), so the sandbox's one shell serves any number of
process sessions. An
asynchronous command (``runAsync``) runs as a task; its output is kept as it comes (``Command``)
for its logs, plain or streamed, and its stdin is fed while it runs where its session runs in this
process (``send_session_command_input``)."""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...core.action import Outcome
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.livestdin import LiveStdin, StdinClosed, StdinFull
from ...runtime import ActionResult, SessionGone
from ..service import NotFound, Service
from .errors import DaytonaApiError, daemon
from .sandboxes import LANGUAGE_LABEL, MAX_STEP_S, USER, Box, sandboxes, translate, variables

#: a command's timeout when ``exec`` names none (the toolbox API's documented default)
EXEC_TIMEOUT_S = 10.0
#: the interpreters ``code-run`` runs its code with, by the sandbox's language label
INTERPRETERS = {"python": ["python3", "-c"], "javascript": ["node", "-e"],
                "typescript": ["npx", "--yes", "tsx", "-e"]}
#: where a process session keeps its state in the sandbox (a prefix: ``.cwd``, ``.vars``, ``.names``)
STATE_ROOT = "/tmp/.tangram-daytona-"
#: variables a session's state leaves out: the shell's own, and the state step's (``__*``)
NOT_KEPT = ("EUID", "PPID", "SHELLOPTS", "UID", "GROUPS", "FUNCNAME", "PIPESTATUS", "SECONDS", "RANDOM", "SRANDOM",
            "LINENO", "EPOCHREALTIME", "EPOCHSECONDS", "HISTCMD", "DIRSTACK", "COMP_WORDBREAKS", "_", "PWD", "OLDPWD",
            "SHLVL")
NOT_KEPT_PREFIXES = ("BASH", "__")
#: one command of a process session: its state read, the command run, its state written as it
#: exits (an ``exit`` in the command included). Shell builtins and keywords only, so that a
#: ``grep`` or ``mkdir`` the session's commands replaced does not break its state; every name is
#: quoted by the caller. The variables' names are listed into a file (the sandbox's /tmp is in
#: memory) and read back whole (``mapfile``), those left out found by one lookup in an
#: associative array and two prefixes, and those kept printed by one ``declare -p``: no process
#: for the list, no read a byte at a time from a pipe, no pattern list tried on every name, one
#: builtin call (a third of the state's cost of a loop over ``compgen -v`` through a pipe with a
#: ``case`` and a ``declare -p`` a name). Written with ``>|``, so a command's ``set -C`` does not
#: keep its state from being saved; safe under its ``set -u``
SESSION_STEP = ("( __s={state}; {exports}[ -f \"$__s.vars\" ] && . \"$__s.vars\" >/dev/null 2>&1; "
                "if [ -f \"$__s.cwd\" ]; then read -r __c < \"$__s.cwd\"; cd -- \"$__c\" 2>/dev/null; "
                "else cd -- {home}; fi; "
                "trap '__rc=$?; {{ pwd >| \"$__s.cwd\"; compgen -v >| \"$__s.names\"; mapfile -t __vs < \"$__s.names\"; "
                "declare -A __skip=({skip}); __k=(); for __v in \"${{__vs[@]}}\"; do "
                "[[ -n ${{__skip[$__v]-}} {prefixes} ]] || __k+=(\"$__v\"); done; "
                "{{ declare -p \"${{__k[@]}}\"; declare -f; }} >| \"$__s.vars\"; }} 2>/dev/null; "
                "exit $__rc' EXIT; eval {command} )")
#: the names and prefixes left out, as ``SESSION_STEP`` tests them
SKIP = " ".join(f"[{n}]=1" for n in NOT_KEPT)
SKIP_PREFIXES = " ".join(f"|| $__v == {p}*" for p in NOT_KEPT_PREFIXES)


def abs_path(path: Any, name: str = "path", base: str = HOME_ALIAS) -> str:
    """An absolute, normalised path; a relative one is under the sandbox's working directory."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise daemon(400, f"{name}: a path is expected", "INVALID_FILE_PATH")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(base, path))
    return "/" + full.lstrip("/")


def base_env(box: Box) -> dict[str, str]:
    """Every command's variables: the user's home and name, then the sandbox's own."""
    return {"HOME": HOME_ALIAS, "USER": USER, **box.env}


def _exports(env: dict[str, str]) -> str:
    return f"export {' '.join(shlex.quote(f'{k}={v}') for k, v in env.items())} && " if env else ""


def in_subshell(prelude: str, command: str) -> str:
    """``command`` run in a subshell after ``prelude`` (``export``s and a ``cd``, each ending in
    ``&&``), stdout and stderr as one. The command is the subshell's stdin, a here-document that
    it sources (``. /dev/stdin``): parsed as one unit, as ``eval`` would parse it, but the last
    command it runs takes the subshell's own process (bash forks again for a command ``eval``
    runs last in a subshell, not for one a sourced file runs last: one process per external
    command, as the native API's). The shell reads the whole of it before running any, so the
    command's own stdin is empty, as a step's is; the here-document's end is a word the command
    cannot know."""
    mark = f"TANGRAM_{uuid.uuid4().hex}"
    return f"( {prelude}. /dev/stdin ) 2>&1 <<'{mark}'\n{command}\n{mark}"


def callers_error(err: BaseException) -> bool:
    """Whether an exception that stops a journaled step is the caller's (``Service.step``'s
    ``rejects``): a Daytona error of a 4xx; anything else is ours."""
    return isinstance(err, DaytonaApiError) and err.status < 500


class Using:
    """``async with Using(service, sid) as (box, session)``: a toolbox call on a started sandbox,
    counted as in flight (it is not auto-stopped under one) and as its last activity."""

    def __init__(self, service: Service, sid: str) -> None:
        self.box = sandboxes(service).toolbox(sid)
        self.session = service.sessions.get(sid)

    async def __aenter__(self) -> tuple[Box, Any]:
        self.box.busy += 1
        return self.box, self.session

    async def __aexit__(self, *exc: Any) -> None:
        self.box.busy -= 1
        self.box.used_at = self.box.stepped = time.time()


async def step(service: Service, box: Box, s: Any, shell: str | None, timeout_s: float, operation: str,
               command: "Command | None" = None, python: str | None = None) -> ActionResult:
    """One shell step of the sandbox's session, journaled and counted as the native API's are
    (answered once its outcome is on disk); with the sandbox's cores and memory limit."""
    try:
        async with service.step(s.job, {"command": shell, "python": python, "daytona": True}, "daytona",
                                id=f"x-{uuid.uuid4().hex}", rejects=callers_error) as st:
            r = await s.exec(shell, python=python, timeout_s=timeout_s, id=st.id, cpus=box.cpu,
                             memory_mb=box.memory_mb, operation=operation,
                             on_output=command.output if command is not None else None,
                             live_stdin=command.live if command is not None else None)
            st.record(r)
    except (SessionGone, NotFound):
        raise DaytonaApiError(404, f"Sandbox {box.id} not found") from None
    return r


def ran(r: ActionResult, sid: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a step that ran; what the infrastructure did is an error,
    never an exit code (a timeout is the daemon's ``PROCESS_EXECUTION_TIMEOUT``)."""
    run = r.result.run if r.result is not None else None
    if r.outcome is Outcome.TIMEOUT or (run is not None and run.timed_out):
        raise daemon(408, "the command ran past its timeout and was killed (its processes with it): pass a longer "
                          "timeout", "PROCESS_EXECUTION_TIMEOUT")
    if r.outcome in (Outcome.INFRA_ERROR, Outcome.REJECTED, Outcome.CANCELLED) or run is None:
        if r.outcome is Outcome.INFRA_ERROR and "closed" in (r.message or ""):
            raise DaytonaApiError(404, f"Sandbox {sid} not found")
        status = 429 if r.outcome is Outcome.REJECTED else 503
        raise daemon(status, f"{r.outcome.value}: {r.message or 'the command did not run'}")
    if r.outcome is Outcome.OOM:
        return 137, run.stdout, run.stderr + "\n[the command ran out of memory and was killed]\n"
    return (run.exit_code if run.exit_code is not None else -1), run.stdout, run.stderr


def _timeout(value: Any) -> float:
    if value is None or value == 0:
        return EXEC_TIMEOUT_S if value is None else MAX_STEP_S
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise daemon(400, f"timeout: a non-negative integer number of seconds is expected, got {value!r}")
    return min(float(value), MAX_STEP_S)


async def daytona_exec(service: Service, sid: str, body: dict) -> dict:
    """``POST /process/execute``: the command in a subshell, in ``cwd`` (default: the home
    directory), with the sandbox's and its own variables; its output (stdout and stderr as
    one) and exit code."""
    command = body.get("command")
    if not isinstance(command, str):
        raise daemon(400, "command: a string is expected")
    async with Using(service, sid) as (box, s):
        env = {**base_env(box), **variables(body.get("envs"), "envs")}
        cwd = abs_path(body.get("cwd") or HOME_ALIAS, "cwd")
        shell = in_subshell(f"{_exports(env)}cd -- {shlex.quote(cwd)} && ", command)
        r = await step(service, box, s, shell, _timeout(body.get("timeout")),
                       posixpath.basename(command.split()[0]) if command.split() else "shell")
    code, out, err = ran(r, sid)
    return {"exitCode": code, "result": out + err}


#: ``code-run`` of python: a cell of the session's interpreter forks a child that runs the code as
#: ``python3 -c`` would (``__main__``, ``sys.argv``, the variables, the home directory, stdin
#: empty, stdout and stderr as one), the child's output copied into the cell's, its exit code
#: the cell's value (``CODE_RUN_CELL``). The interpreter runs nothing else of the dialect's, so
#: each child starts from the same clean interpreter, at a fork's cost instead of an
#: interpreter's start.
CODE_RUN_DEF = """
def __tangram_code_run(code, argv, env, cwd):
    import os, select, signal, sys
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 70
        try:
            os.setpgid(0, 0)
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(w, 1)
            os.dup2(w, 2)
            for fd in (null, r, w):
                os.close(fd)
            os.chdir(cwd)
            os.environ.update(env)
            import io, types
            sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                          line_buffering=True)
            sys.argv = ["-c", *argv]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            status = 0
            try:
                exec(compile(code, "<string>", "exec"), main.__dict__)
                import threading
                for t in threading.enumerate():
                    if t is not threading.main_thread() and not t.daemon:
                        t.join()
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    status = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    status = 1
            except BaseException as e:
                import traceback
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)
                status = 1
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except BaseException:
                    pass
        finally:
            os._exit(status & 0xFF)
    os.close(w)
    ended = False
    done = os.pidfd_open(pid)
    try:
        while True:
            ready = select.select([r, done], [], [])[0]
            if r in ready:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                os.write(1, chunk)
            elif done in ready:
                ended = True
                if not select.select([r], [], [], 0)[0]:
                    break
        status = os.waitpid(pid, 0)[1]
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if not ended:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
        os.close(r)
        os.close(done)
"""
#: the cell of one ``code-run``: the function defined once an interpreter (again after a rest,
#: whose pickle leaves functions out), then called
CODE_RUN_CELL = ("try:\n    __tangram_code_run\nexcept NameError:\n    exec({define!r})\n"
                 "__tangram_code_run({code!r}, {argv!r}, {env!r}, {cwd!r})")


async def daytona_code_run(service: Service, sid: str, body: dict) -> dict:
    """``POST /process/code-run``: the code run as a new process of its language's interpreter,
    with ``argv`` and ``envs``; its output and exit code. Python's is a child forked by the
    session's interpreter (``CODE_RUN_CELL``); another language's, a command."""
    code = body.get("code")
    if not isinstance(code, str):
        raise daemon(400, "code: a string is expected")
    argv = body.get("argv") or []
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise daemon(400, "argv: a list of strings is expected")
    async with Using(service, sid) as (box, s):
        language = body.get("language") or box.labels.get(LANGUAGE_LABEL) or "python"
        if language not in INTERPRETERS:
            raise daemon(400, f"language: {language!r} is not one of {', '.join(INTERPRETERS)}")
        env = {**base_env(box), **variables(body.get("envs"), "envs")}
        timeout_s = _timeout(body.get("timeout"))
        if language == "python":
            cell = CODE_RUN_CELL.format(define=CODE_RUN_DEF, code=code, argv=argv, env=env, cwd=HOME_ALIAS)
            r = await step(service, box, s, None, timeout_s, "code_run", python=cell)
            return _code_result(r, sid)
        words = " ".join(shlex.quote(w) for w in [*INTERPRETERS[language], code, *argv])
        shell = f"( {_exports(env)}cd -- {shlex.quote(HOME_ALIAS)} && exec {words} ) 2>&1"
        r = await step(service, box, s, shell, timeout_s, "code_run")
    code_, out, err = ran(r, sid)
    return {"exitCode": code_, "result": out + err, "artifacts": {"charts": []}}


def _code_result(r: ActionResult, sid: str) -> dict:
    """A python ``code-run``'s answer from its cell: the child's exit code is the cell's value;
    a cell that failed itself (its interpreter gone) is an error of ours."""
    code, out, err = ran(r, sid)
    if r.outcome is Outcome.OOM:  # the child (or the interpreter with it) was killed for memory
        return {"exitCode": 137, "result": out + err, "artifacts": {"charts": []}}
    run = r.result.run
    value = run.display[0].get("text/plain") if run.display else None
    if code != 0 or value is None or not value.lstrip("-").isdigit():
        raise daemon(503, f"code_run: the sandbox's interpreter failed ({(err or out).strip()[-300:] or code})")
    return {"exitCode": int(value), "result": out, "artifacts": {"charts": []}}


# -- process sessions ------------------------------------------------------------------------------

@dataclass
class Command:
    """One command of a process session: its output as it comes (each chunk with its stream),
    its exit code once it ends."""

    id: str
    command: str
    done: asyncio.Future
    exit_code: int | None = None
    chunks: list[tuple[str, bytes]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    live: LiveStdin | None = None
    echo: bool = True
    task: asyncio.Task | None = None

    def output(self, stream: str, data: bytes) -> None:
        self.chunks.append((stream, data))
        self.changed.set()

    def text(self, stream: str | None = None) -> str:
        return b"".join(d for s, d in self.chunks if stream in (None, s)).decode("utf-8", "replace")

    def shown(self) -> dict:
        return {"id": self.id, "command": self.command, "exitCode": self.exit_code}


@dataclass
class ProcSession:
    id: str
    state_dir: str  # its state files' prefix in the sandbox
    commands: dict[str, Command] = field(default_factory=dict)

    def running(self) -> bool:
        return any(not c.done.done() for c in self.commands.values())

    def gone(self, sid: str) -> None:
        for c in self.commands.values():
            if not c.done.done():
                c.done.set_exception(DaytonaApiError(404, f"Sandbox {sid} not found"))

    def shown(self) -> dict:
        return {"sessionId": self.id, "commands": [c.shown() for c in self.commands.values()]}


def _session(box: Box, session_id: str) -> ProcSession:
    ps = box.sessions.get(session_id)
    if ps is None:
        raise daemon(404, f"session {session_id} not found", "PROCESS_NOT_FOUND")
    return ps


def _command(ps: ProcSession, command_id: str) -> Command:
    c = ps.commands.get(command_id)
    if c is None:
        raise daemon(404, f"command {command_id} not found in session {ps.id}", "PROCESS_NOT_FOUND")
    return c


ENTRYPOINT = "entrypoint"


def daytona_session(service: Service, sid: str, op: str, session_id: str | None) -> Any:
    """Process sessions: create, get, list, delete (the sandbox has no entrypoint process: its
    entrypoint session has no commands)."""
    box = sandboxes(service).toolbox(sid)
    box.used_at = time.time()
    if op == "list":
        return [ps.shown() for ps in box.sessions.values()]
    if not isinstance(session_id, str) or not session_id:
        raise daemon(400, "sessionId: a session id is expected")
    if op == "create":
        if session_id in box.sessions or session_id == ENTRYPOINT:
            raise daemon(409, f"session {session_id} already exists")
        box.sessions[session_id] = ProcSession(session_id, f"{STATE_ROOT}{uuid.uuid4().hex}")
        return None
    if session_id == ENTRYPOINT and op == "get":
        return {"sessionId": ENTRYPOINT, "commands": []}
    ps = _session(box, session_id)
    if op == "get":
        return ps.shown()
    if op == "delete":
        if ps.running():  # its command is killed, as the session's shell would be
            service.runtime.interrupt_step(sid)
        del box.sessions[session_id]
        return None
    raise daemon(400, f"session: no operation {op!r}")


async def daytona_session_exec(service: Service, sid: str, session_id: str, body: dict) -> tuple[dict, bool]:
    """``POST /process/session/{id}/exec``: the command in the process session; synchronous, its
    output and exit code; ``runAsync``, its id at once (202: ``get_session_command`` and the logs
    follow it)."""
    command = body.get("command")
    if not isinstance(command, str):
        raise daemon(400, "command: a string is expected")
    box = sandboxes(service).toolbox(sid)
    ps = _session(box, session_id)
    run_async = bool(body.get("runAsync") or body.get("async"))
    s = service.sessions.get(sid)
    live = run_async and s is not None and s.live_stdin_here
    c = Command(f"{uuid.uuid4()}", command, asyncio.get_running_loop().create_future(),
                live=LiveStdin() if live else None, echo=not body.get("suppressInputEcho"))
    c.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waiting is no error of ours
    c.done.add_done_callback(lambda _: c.changed.set())
    ps.commands[c.id] = c
    shell = SESSION_STEP.format(state=shlex.quote(ps.state_dir), exports=_exports(base_env(box)), skip=SKIP,
                                prefixes=SKIP_PREFIXES,
                                home=shlex.quote(HOME_ALIAS), command=shlex.quote(command))
    c.task = asyncio.get_running_loop().create_task(_run(service, sid, c, shell))
    if run_async:
        return {"cmdId": c.id}, True
    await asyncio.shield(c.done)
    return {"cmdId": c.id, "output": c.text(), "stdout": c.text("stdout"), "stderr": c.text("stderr"),
            "exitCode": c.exit_code}, False


async def _run(service: Service, sid: str, c: Command, shell: str) -> None:
    try:
        async with Using(service, sid) as (box, s):
            try:
                r = await step(service, box, s, shell, MAX_STEP_S, "session", c)
            finally:
                if c.live is not None:
                    c.live.end()
        try:
            code, out, err = ran(r, sid)
        except DaytonaApiError as e:
            if e.code != "PROCESS_EXECUTION_TIMEOUT":
                raise
            code, out, err = 124, "", ""
        if not c.chunks:  # not streamed (a sandbox on another node): all of it, now
            c.output("stdout", out.encode())
            c.output("stderr", err.encode())
        c.exit_code = code
        if not c.done.done():
            c.done.set_result(code)
    except BaseException as e:
        if not c.done.done():
            c.done.set_exception(translate(e, sid))
        if not isinstance(e, Exception):
            raise


def daytona_command(service: Service, sid: str, session_id: str, command_id: str) -> dict:
    box = sandboxes(service).toolbox(sid)
    return _command(_session(box, session_id), command_id).shown()


def daytona_command_logs(service: Service, sid: str, session_id: str, command_id: str) -> dict:
    box = sandboxes(service).toolbox(sid)
    c = _command(_session(box, session_id), command_id)
    return {"output": c.text(), "stdout": c.text("stdout"), "stderr": c.text("stderr")}


async def daytona_command_poll(service: Service, sid: str, session_id: str, command_id: str, sent: int,
                               wait_s: float) -> tuple[list[tuple[str, bytes]], bool]:
    """A command's output chunks past the first ``sent``, once there are some, or it has ended
    (the second item), or ``wait_s`` has passed: a long poll, so the logs stream through the
    fronts' link as in process."""
    box = sandboxes(service).toolbox(sid)
    c = _command(_session(box, session_id), command_id)
    if len(c.chunks) <= sent and not c.done.done():
        c.changed.clear()
        try:
            await asyncio.wait_for(c.changed.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
    return c.chunks[sent:], c.done.done()


def daytona_command_input(service: Service, sid: str, session_id: str, command_id: str, data: Any) -> None:
    """Input for a running asynchronous command: written to its stdin as it runs (and echoed into
    its output unless it was started with ``suppressInputEcho``)."""
    box = sandboxes(service).toolbox(sid)
    c = _command(_session(box, session_id), command_id)
    if not isinstance(data, str):
        raise daemon(400, "data: a string is expected")
    if c.done.done():
        raise daemon(410, f"command {command_id} has already completed", "COMMAND_ALREADY_COMPLETED")
    if c.live is None:
        raise daemon(400, f"command {command_id}: its stdin is not open (only an asynchronous command's is, where its "
                          "sandbox runs in the server's process)")
    try:
        c.live.send(data.encode())
    except StdinClosed:
        raise daemon(410, f"command {command_id} has already completed", "COMMAND_ALREADY_COMPLETED") from None
    except StdinFull as e:
        raise daemon(429, f"command {command_id}: {e}") from None
    if c.echo:
        c.output("stdout", data.encode())


CALLS = {"daytona_exec": daytona_exec, "daytona_code_run": daytona_code_run, "daytona_session": daytona_session,
         "daytona_session_exec": daytona_session_exec, "daytona_command": daytona_command,
         "daytona_command_logs": daytona_command_logs, "daytona_command_poll": daytona_command_poll,
         "daytona_command_input": daytona_command_input}
