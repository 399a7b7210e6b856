"""The ``shell`` operation: a step of the session's persistent shell (``Shell``), loaded on the
first shell step (one-shot sandboxes never pay for it).

One bash (``--noprofile --norc``; an image without bash gets its ``/bin/sh``) lives for the whole
session, so ``cd``, exported variables, shell functions and ``set`` options carry over from step to
step. Each step is written to a file and sourced in the shell's own process by a one-line wrapper::

    { . STEP; } <IN >OUT 2>ERR 3>&-; echo "NONCE $?" >&3

OUT and ERR are FIFOs the agent reads while the step runs (stdout and stderr stay apart, each
capped like every other step's output; a ``stream`` request also forwards what it keeps to the
host while the step runs, ``inside.COALESCE_S`` at a time); the step's exit status comes back on a
private pipe (fd 3, closed for the step itself) behind a per-step random nonce. The agent also holds
a writer of each FIFO open, so a step's end is never mistaken for the start of the next one. The
files are made as ``shellio`` says.

A step with a live stdin (``stdin_live``: E2B's ``send_stdin`` while the command runs) reads a
FIFO instead of a file: the agent holds it open read-write (so the step's open never blocks and
sees no end until the agent closes it) and writes into it what the host sends on the agent's
request channel while the step runs (``{"op": "stdin", "data", "eof"}`` messages, no answer);
``eof`` closes it. What the step has not read is held by the agent up to ``shellio.STDIN_HELD``
bytes, past which it stops reading the channel, so the host's sender waits instead of anyone's
memory growing.

A step past its timeout: every process of the sandbox but the shell (and the agent) is killed;
the shell then reports the killed command's status and lives on. A step that is busy in the shell
itself (``while :; do :; done``) cannot be stopped that way: the shell is killed too, and the
result says that the next step starts a fresh shell. A step that exits the shell (``exit 3``)
returns that status and says the same. Not ``bash -c`` per step (no state would carry over), nor a
pty (it merges stdout with stderr and echoes input).
"""

import binascii
import os
import select
import time

from . import COALESCE_S, b64, chunk_line, read_message, unb64, write_all
from .procs import env_for, reap_strays
from .shellio import DIR, LiveIn, ShellDir, Tampered

#: what a shell file's making fails with when something else was put in its way (the shell is then
#: started afresh); anything else (ENOSPC: /tmp full) fails the step and keeps the shell
REPLACED = (2, 17, 20, 21, 40)  # ENOENT, EEXIST, ENOTDIR, EISDIR, ELOOP
RESTARTED = "the previous shell had died: a new one was started (cwd, variables and functions reset)"


def op_shell(st, req):
    """A step of the session's persistent shell, started on first use."""
    if not req.get("prestart"):
        st.shell_used = True
    if st.shell is None:
        st.shell = Shell(st)
    return st.shell.step(req)


def _quote(v):
    return "'" + str(v).replace("'", "'\\''") + "'"


def _which_shell():
    for path in ("/bin/bash", "/usr/bin/bash"):
        if os.access(path, os.X_OK):
            return path, [path, "--noprofile", "--norc"], "bash"
    return "/bin/sh", ["/bin/sh"], "sh"


class Shell:
    """The session's shell process and the agent's ends of its pipes and FIFOs."""

    def __init__(self, st):
        self.st = st
        self.dir = ShellDir()
        self.pid = self.cmd = self.ctl = self.out = self.err = self.live = None
        self.name = ""

    def alive(self):
        if self.pid is None:
            return False
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return done == 0

    def stop(self):
        """Kill the shell and forget it (the next step starts a fresh one)."""
        pid = self.pid
        if pid is not None:
            try:
                os.killpg(pid, 9)  # the shell and whatever of the step still runs (its own session)
            except OSError:
                pass
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for key in ("cmd", "ctl"):
            fd = getattr(self, key)
            if fd is not None:
                os.close(fd)
                setattr(self, key, None)
        for key in ("out", "err"):
            fds = getattr(self, key)
            if fds is not None:
                for fd in fds:
                    os.close(fd)
                setattr(self, key, None)
        self.dir.close()
        self.pid = None
        self.st.keep.clear()

    def start(self, env):
        self.stop()
        st = self.st
        exe, argv, name = _which_shell()
        (out_r, out_w), (err_r, err_w) = self.dir.fifos()
        cmd_r, cmd_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                os.dup2(cmd_r, 0)
                os.dup2(ctl_w, 3)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 1)
                os.dup2(null, 2)
                for fd in (null, cmd_r, cmd_w, ctl_r, ctl_w, out_r, out_w, err_r, err_w, st.proto_in, st.proto_out):
                    if fd > 3:
                        os.close(fd)
                os.chdir(st.workspace)
                os.execve(exe, argv, env)
            finally:
                os._exit(127)
        os.close(cmd_r)
        os.close(ctl_w)
        self.pid, self.cmd, self.ctl, self.name = pid, cmd_w, ctl_r, name
        self.out, self.err = (out_r, out_w), (err_r, err_w)
        st.keep[:] = [pid]
        return name

    def step(self, req):
        """Run one shell step; the result has the same fields as a ``run`` request's."""
        try:
            return self._step(req, env_for(self.st, req), bool(req.get("stdin_live")))
        finally:
            live_in, self.live = self.live, None
            if live_in is not None:  # what the step never read goes with it, as a pipe's would
                live_in.close()

    def _not_run(self, e, started, notes=()):
        """A step whose shell files could not be made (/tmp full, or the sandbox's code keeps
        replacing them): it fails as a command that could not run (126), saying why; the sandbox
        and the agent go on."""
        out = {"stdout": "", "stderr": binascii.b2a_base64(
                   f"tangram: the shell's files in {DIR} could not be made ({e.strerror or e}): nothing ran\n".encode(),
                   newline=False).decode(),
               "truncated": False, "timed_out": False, "duration_s": time.monotonic() - started, "exit_code": 126,
               "shell": self.name or _which_shell()[2]}
        if notes:
            out["note"] = "; ".join(notes)
        return out

    def _step(self, req, env, live):
        st = self.st
        started = time.monotonic()
        notes = []
        for attempt in (0, 1):
            try:
                if self.pid is None or not self.alive():
                    if self.pid is not None:
                        notes.append(RESTARTED)
                    self.start(env)
                self.dir.intact({"out": self.out[0], "err": self.err[0]})
                self.dir.write("step", (req["command"] + "\n").encode("utf-8", "surrogateescape"))
                if live:
                    first = unb64(req.get("stdin"))  # (before the FIFO: nothing left open in PID 1 if it fails)
                    self.live = LiveIn(self.dir.live_in(), st.proto_in, read_message, st.held.append, first)
                else:
                    self.dir.write("in", unb64(req.get("stdin")))
                break
            except OSError as e:  # its files removed or replaced by the sandbox's code (``rm -rf /tmp/.*``)
                if attempt or not (isinstance(e, Tampered) or e.errno in REPLACED):  # a full /tmp, no descriptors
                    return self._not_run(e, started, notes)                       # left: the shell lives on
                self.stop()
                notes.append(f"the shell's files in {DIR} had been removed or replaced: a new shell was started (cwd, "
                             "variables and functions reset)")
        limit = int(req.get("max_output") or 1 << 20)
        timeout_s = float(req.get("timeout_s") or 10)
        nonce = binascii.hexlify(os.urandom(8)).decode()
        inp = os.path.join(DIR, "in")
        exports = "".join(f"export {k}={_quote(v)}; " for k, v in (req.get("env") or {}).items()
                          if k.replace("_", "a").isalnum())
        # bash: forget the step's background jobs (they are reaped after the step), or their "Killed"
        # notices would land in the next step's stderr
        forget = " disown -a 2>/dev/null;" if self.name == "bash" else ""
        if self.live is None:
            line = (f"{exports}{{ . {DIR}/step; }} <{inp} >{DIR}/out 2>{DIR}/err 3>&-; "
                    f"echo \"{nonce} $?\" >&3;{forget}\n").encode()
        else:  # the FIFO opened, the shell says so first (``LiveIn.opened``)
            line = (f"{exports}{{ echo \"{nonce} open\" >&3; {{ . {DIR}/step; }} 3>&-; }} <{inp} >{DIR}/out "
                    f"2>{DIR}/err; echo \"{nonce} $?\" >&3;{forget}\n").encode()
        for fd in (self.out[0], self.err[0]):
            _drain(fd, bytearray(), 0)  # late writes of an earlier step's (since reaped) background jobs
        try:
            os.write(self.cmd, line)
        except BrokenPipeError:  # it died between steps: start another, once
            notes.append(RESTARTED)
            try:
                self.start(env)
            except OSError as e:
                return self._not_run(e, started)
            try:
                os.write(self.cmd, line)
            except BrokenPipeError:
                self.stop()
                return {"error": "the shell dies as soon as it starts"}
        out_fd, err_fd, ctl = self.out[0], self.err[0], self.ctl
        bufs = {out_fd: bytearray(), err_fd: bytearray()}
        # a streamed step (``stream``): its output also goes to the host as it comes, on the agent's
        # answer channel (a blocking write: a host that reads slowly slows the step down, it never
        # makes this process hold more)
        emit = (lambda name, data: write_all(st.proto_out, chunk_line(name, data))) if req.get("stream") else None
        names = {out_fd: "stdout", err_fd: "stderr"}
        sent = {out_fd: 0, err_fd: 0}  # bytes of each stream emitted so far
        unsent_since = None  # when output not yet emitted first came
        ctl_buf = b""
        truncated = timed_out = False
        status = None
        shell_gone = None
        busy = False
        poll = select.poll()
        for fd in (out_fd, err_fd, ctl):
            poll.register(fd, select.POLLIN)
        live_in = self.live
        if live_in is not None:
            live_in.register(poll)
        # a step fed as it runs is answering someone who waits for its output (a REPL's turn): sent
        # as read (a burst still goes as one chunk a poll), not held for more
        coalesce = 0.0 if live_in is not None else COALESCE_S
        deadline = started + timeout_s
        killed_at = None
        while status is None:
            left = deadline - time.monotonic()
            if left <= 0 and killed_at is None:
                timed_out = True
                killed_at = time.monotonic()
                _kill_descendants(self.pid)  # the step's processes; the shell survives
                reap_strays(st, st.keep)  # and, in a PID namespace, whatever escaped from its tree
                deadline = killed_at + 1.0
                continue
            if left <= 0:  # the shell itself is busy with the step: it has to go
                busy = True
                notes.append("timed out inside the shell itself: the shell was killed; the next step starts a new "
                             "one (cwd, variables and functions reset)")
                status = -9
                break
            wait = left if unsent_since is None else min(left, unsent_since + coalesce - time.monotonic())
            for fd, ev in poll.poll(max(0.0, wait) * 1000):
                if fd == ctl:
                    chunk = os.read(ctl, 4096)
                    if not chunk:  # the shell exited (`exit N`), or was replaced (`exec prog`)
                        shell_gone = _exit_status(self.pid)
                        status = shell_gone
                        break
                    ctl_buf += chunk
                    for text in ctl_buf.decode(errors="replace").splitlines():
                        word, _, code = text.partition(" ")
                        if word == nonce and code.strip().lstrip("-").isdigit():
                            status = int(code)
                        elif word == nonce and code.strip() == "open" and live_in is not None and not live_in.opened:
                            live_in.opened = True
                            live_in.update(poll)
                elif live_in is not None and fd == live_in.channel:
                    live_in.on_channel(poll)
                elif live_in is not None and fd == live_in.fd:
                    live_in.update(poll)
                elif fd in bufs and _drain(fd, bufs[fd], limit):
                    truncated = True
            if emit is not None and status is None and (len(bufs[out_fd]) > sent[out_fd] or
                                                        len(bufs[err_fd]) > sent[err_fd]):
                now = time.monotonic()
                if unsent_since is None:
                    unsent_since = now
                if now - unsent_since >= coalesce:
                    for fd in (out_fd, err_fd):
                        if len(bufs[fd]) > sent[fd]:
                            emit(names[fd], bytes(bufs[fd][sent[fd]:]))
                            sent[fd] = len(bufs[fd])
                    unsent_since = None
        for fd in (out_fd, err_fd):
            if _drain(fd, bufs[fd], limit):
                truncated = True
        if busy:
            self.stop()
        if shell_gone is not None:
            self.stop()
            notes.append(f"the shell exited (status {shell_gone}): the next step starts a new one (cwd, variables "
                         "and functions reset)")
        result = {"stdout": b64(bytes(bufs[out_fd])), "stderr": b64(bytes(bufs[err_fd])), "truncated": truncated,
                  "timed_out": timed_out, "duration_s": time.monotonic() - started, "exit_code": status,
                  "shell": self.name or _which_shell()[2]}
        if notes:
            result["note"] = "; ".join(notes)
        return result


def _drain(fd, buf, limit):
    """Read what is there now; returns whether anything was dropped for the cap."""
    dropped = False
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return dropped
        if not chunk:
            return dropped
        room = limit - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            dropped = True


def _kill_descendants(root):
    """SIGKILL every process below ``root`` (not ``root`` itself), found through /proc. (This
    package runs inside the sandbox with the standard library only, so it cannot share the host
    side's ``sandbox._descendants``.)"""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def _exit_status(pid):
    """The status of the shell that closed its status pipe; a program it was replaced by
    (``exec sleep 100``) gets 50 ms to finish, then is killed."""
    for _ in range(10):
        try:
            done, st = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return -9
        if done:
            return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
        time.sleep(0.005)
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
    try:
        _, st = os.waitpid(pid, 0)
    except ChildProcessError:
        return -9
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
