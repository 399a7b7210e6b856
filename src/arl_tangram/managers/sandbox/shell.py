"""A session's persistent shell, driven by the runner inside the sandbox (standard library only).

Loaded by the runner on the first shell step (so one-shot sandboxes never pay for it). One bash
(``--noprofile --norc``; an image without bash gets its ``/bin/sh``) lives for the whole session,
so ``cd``, exported variables, shell functions and ``set`` options carry over from step to step.
Each step is written to a file and sourced in the shell's own process by a one-line wrapper::

    { . STEP; } <IN >OUT 2>ERR 3>&-; echo "NONCE $?" >&3

OUT and ERR are FIFOs the runner reads while the step runs (stdout and stderr stay apart, each
capped like every other step's output; a ``stream`` request also forwards what it keeps to the
host while the step runs, ``COALESCE_S`` at a time: ``_emitter``); the step's exit status comes back on a private pipe
(fd 3, closed for the step itself) behind a per-step random nonce. The runner also holds a
writer of each FIFO open, so a step's end is never mistaken for the start of the next one.

A step with a live stdin (``stdin_live``: E2B's ``send_stdin`` while the command runs) reads a
FIFO instead of a file: the runner holds it open read-write (so the step's open never blocks and
sees no end until the runner closes it) and writes into it what the host sends on the runner's
request channel while the step runs (``{"op": "stdin", "data", "eof"}`` messages, no answer);
``eof`` closes it. What the step has not read is held by the runner up to ``STDIN_HELD`` bytes,
past which it stops reading the channel, so the host's sender waits instead of anyone's memory
growing.

A step past its timeout: every process of the sandbox but the shell (and the runner) is killed;
the shell then reports the killed command's status and lives on. A step that is busy in the shell
itself (``while :; do :; done``) cannot be stopped that way: the shell is killed too, and the
result says that the next step starts a fresh shell. A step that exits the shell (``exit 3``)
returns that status and says the same. Alternatives dropped: ``bash -c`` per step (no state
carries over); a pty (merges stdout with stderr and echoes input).
"""

import binascii
import os
import select
import time

DIR = "/tmp/.tangram-shell"
STATE = {"pid": None, "cmd": None, "ctl": None, "out": None, "err": None, "keep": [], "name": "", "dir": None}

# This file runs in the runner, PID 1 of the sandbox, and ``DIR`` is in the sandbox's own /tmp:
# its code can put anything there, a link to /proc/1/fd/4 (the runner's answer channel to the
# host) included, and the runner would follow it with its own rights (a step's command text then
# went to the host as a forged answer: an audit, 2026-11-29). So the runner never opens a path
# there: it holds the directory's descriptor, opened without following a link, and makes each of
# its files afresh under it (unlinked, then created exclusively, never following a link).
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Tampered(OSError):
    """The shell's directory or one of its files was replaced while the runner made it."""


def _dir():
    """The descriptor of ``DIR``, a real directory of this sandbox's (made again if something
    else was put there)."""
    fd = STATE["dir"]
    if fd is not None:
        return fd
    for _ in range(5):
        try:
            fd = os.open(DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                os.mkdir(DIR, 0o700)
            except FileExistsError:
                pass
            continue
        except PermissionError:
            raise
        except OSError:  # a link or a file in its place (ELOOP, ENOTDIR): moved aside
            try:
                os.rename(DIR, _aside(DIR))
            except FileNotFoundError:
                pass
            continue
        STATE["dir"] = fd
        return fd
    raise Tampered(16, "the shell's directory keeps being replaced", DIR)


def _aside(name):
    """A new name to move what took ``name``'s place to (never deleted: it is the sandbox's)."""
    return f"{name}.{binascii.hexlify(os.urandom(4)).decode()}"


def _fresh(name, make):
    """``name`` under the shell's directory, removed and made again by ``make(name, dir_fd)``;
    raises ``Tampered`` when something else keeps taking its place."""
    d = _dir()
    for _ in range(5):
        try:
            os.unlink(name, dir_fd=d)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            os.rename(name, _aside(name), src_dir_fd=d, dst_dir_fd=d)
        try:
            return make(name, d)
        except FileExistsError:
            continue
    raise Tampered(17, "a file of the shell's keeps being replaced", f"{DIR}/{name}")


def _intact():
    """``Tampered`` unless ``DIR`` is still the directory held and its FIFOs the ones the runner
    reads (else the shell would write a step's output where the runner never looks)."""
    d = os.fstat(STATE["dir"])
    there = os.stat(DIR, follow_symlinks=False)
    if (there.st_dev, there.st_ino) != (d.st_dev, d.st_ino):
        raise Tampered(2, "the shell's directory was replaced", DIR)
    for name in ("out", "err"):
        held = os.fstat(STATE[name][0])
        try:
            st = os.stat(name, dir_fd=STATE["dir"], follow_symlinks=False)
        except FileNotFoundError:
            raise Tampered(2, "the shell's FIFO was removed", f"{DIR}/{name}") from None
        if (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
            raise Tampered(2, "the shell's FIFO was replaced", f"{DIR}/{name}")


def _write(name, data):
    """A regular file ``name`` in the shell's directory with ``data``, made afresh."""
    fd = _fresh(name, lambda n, d: os.open(n, _NEW, 0o600, dir_fd=d))
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


#: how the runner opens the shell's FIFOs: never blocking, never through a link
_FIFO = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def _open_fifo(name, access):
    """``name`` in the shell's directory opened with ``access``, checked to be a FIFO (else the
    runner would read or write whatever the sandbox's code put in its place)."""
    fd = os.open(name, access | _FIFO, dir_fd=STATE["dir"])
    if (os.fstat(fd).st_mode & 0o170000) != 0o010000:  # not the FIFO just made (S_IFIFO)
        os.close(fd)
        raise Tampered(17, "the shell's FIFO was replaced", f"{DIR}/{name}")
    return fd


def _live_in():
    """The step's stdin as a FIFO made afresh, held open read-write by the runner (its open by
    the step never blocks, and it ends only when the runner closes it)."""
    _fresh("in", lambda n, d: os.mkfifo(n, 0o600, dir_fd=d))
    return _open_fifo("in", os.O_RDWR)


#: a live stdin's bytes the step has not read yet that the runner holds before it stops reading
#: the host's channel (the host's sender then waits: its own bound says so to its caller); one
#: message more at most (the host's pieces: ``sandbox.STDIN_PIECE``, 64 KiB)
STDIN_HELD = 1 << 20


class LiveIn:
    """A running step's live stdin: the host's ``stdin`` messages read from the runner's request
    channel into the step's FIFO, as the step reads it (non-blocking, never more than
    ``STDIN_HELD`` held). A message that is not ``stdin`` is handed to ``hold`` (for the runner's
    main loop, next) and the channel is read no more during this step."""

    def __init__(self, fd, channel, read_msg, hold, first=b""):
        self.fd, self.channel, self.read_msg, self.hold = fd, channel, read_msg, hold
        self.pending = bytearray(first)
        self.eof = False
        self.reading = True  # the channel is polled (False: paused while full, or done for this step)
        self.done_reading = False
        self.writing = False  # the FIFO is polled for room
        # the step's shell has opened the FIFO (it says so on the status pipe): until then the
        # runner's descriptor is its only one, and closing it for the end of file would drop what
        # is in it and leave the shell's open waiting for a writer for good
        self.opened = False

    def register(self, poll):
        poll.register(self.channel, select.POLLIN)
        self.update(poll)

    def on_channel(self, poll):
        """A message from the host while the step runs."""
        msg = self.read_msg(self.channel)
        if msg is None or msg.get("op") != "stdin":  # the host's end (the main loop reads it too), or a request
            if msg is not None:
                self.hold(msg)
            self.done_reading = True
        else:
            data = msg.get("data") or b""
            if isinstance(data, (bytes, bytearray)) and not self.eof and self.fd is not None:
                self.pending += data
            self.eof = self.eof or bool(msg.get("eof"))
        self.update(poll)

    def update(self, poll):
        """Write what the FIFO takes now; close it once the host's end came and all is written;
        poll the channel and the FIFO for what is wanted next."""
        while self.pending and self.fd is not None:
            try:
                n = os.write(self.fd, self.pending[:65536])
            except BlockingIOError:
                break
            del self.pending[:n]
        if self.eof and not self.pending and self.fd is not None and self.opened:
            if self.writing:
                poll.unregister(self.fd)
                self.writing = False
            os.close(self.fd)
            self.fd = None
        want_out = bool(self.pending) and self.fd is not None
        if want_out != self.writing:
            (poll.register(self.fd, select.POLLOUT) if want_out else poll.unregister(self.fd))
            self.writing = want_out
        want_in = not self.done_reading and len(self.pending) < STDIN_HELD
        if want_in != self.reading:
            (poll.register(self.channel, select.POLLIN) if want_in else poll.unregister(self.channel))
            self.reading = want_in

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _quote(v):
    return "'" + str(v).replace("'", "'\\''") + "'"


def _which_shell():
    for path in ("/bin/bash", "/usr/bin/bash"):
        if os.access(path, os.X_OK):
            return path, [path, "--noprofile", "--norc"], "bash"
    return "/bin/sh", ["/bin/sh"], "sh"


def _fifos():
    fds, held = [], []
    try:
        for name in ("out", "err"):
            _fresh(name, lambda n, d: os.mkfifo(n, 0o600, dir_fd=d))
            held.append(_open_fifo(name, os.O_RDONLY))
            held.append(_open_fifo(name, os.O_WRONLY))  # ours: no EOF between steps
            fds.append((held[-2], held[-1]))
    except BaseException:  # none left open in PID 1 when the making fails part-way
        for fd in held:
            os.close(fd)
        raise
    return fds


def alive():
    pid = STATE["pid"]
    if pid is None:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def stop():
    """Kill the shell and forget it (the next step starts a fresh one)."""
    pid = STATE["pid"]
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
        if STATE[key] is not None:
            os.close(STATE[key])
            STATE[key] = None
    for key in ("out", "err"):
        if STATE[key] is not None:
            for fd in STATE[key]:
                os.close(fd)
            STATE[key] = None
    if STATE["dir"] is not None:
        os.close(STATE["dir"])
        STATE["dir"] = None
    STATE["pid"] = None
    STATE["keep"].clear()


def start(env, workspace, close_fds):
    stop()
    exe, argv, name = _which_shell()
    (out_r, out_w), (err_r, err_w) = _fifos()
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
            for fd in (null, cmd_r, cmd_w, ctl_r, ctl_w, out_r, out_w, err_r, err_w, *close_fds):
                if fd > 3:
                    os.close(fd)
            os.chdir(workspace)
            os.execve(exe, argv, env)
        finally:
            os._exit(127)
    os.close(cmd_r)
    os.close(ctl_w)
    STATE.update(pid=pid, cmd=cmd_w, ctl=ctl_r, out=(out_r, out_w), err=(err_r, err_w), name=name)
    STATE["keep"][:] = [pid]
    return name


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


#: a streamed step's output waits this long for more before it is sent: a step that ends by then
#: sends none (its answer has it all, and the host hands the rest to the listener), so a short
#: command costs no extra wake-ups of the host (measured: 1.25 vs 3.18 ms p50 for `echo hi` at
#: load 17 when every read was sent at once)
COALESCE_S = 0.005


def _emitter(fd, b64):
    """A streamed step's output chunks, sent to the host while the step runs: one JSON line each,
    ``{"stream": "stdout"|"stderr", "data": <base64>}`` (no ``id``: the step's answer, last,
    has one) on the runner's answer channel ``fd``. A blocking write: a host that reads slowly
    slows the step down (backpressure), it never makes this process hold more."""

    def emit(name, data):
        line = ('{"stream":"' + name + '","data":"' + b64(data) + '"}\n').encode()
        while line:
            line = line[os.write(fd, line):]

    return emit


def _kill_descendants(root):
    """SIGKILL every process below ``root`` (not ``root`` itself), found through /proc. (This file
    runs inside the sandbox with the standard library only, so it cannot share the host side's
    ``sandbox._descendants``.)"""
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


#: what a shell file's making fails with when something else was put in its way (the shell is then
#: started afresh); anything else (ENOSPC: /tmp full) fails the step and keeps the shell
REPLACED = (2, 17, 20, 21, 40)  # ENOENT, EEXIST, ENOTDIR, EISDIR, ELOOP


def _not_run(e, started, notes=()):
    """A step whose shell files could not be made (/tmp full, or the sandbox's code keeps
    replacing them): it fails as a command that could not run (126), saying why; the sandbox
    and the runner go on."""
    out = {"stdout": "", "stderr": binascii.b2a_base64(
               f"tangram: the shell's files in {DIR} could not be made ({e.strerror or e}): nothing ran\n".encode(),
               newline=False).decode(),
           "truncated": False, "timed_out": False, "duration_s": time.monotonic() - started, "exit_code": 126,
           "shell": STATE["name"] or _which_shell()[2]}
    if notes:
        out["note"] = "; ".join(notes)
    return out


def step(req, env, workspace, close_fds, reap_others, b64, unb64, read_msg=None, hold=None):
    """Run one shell step; the result has the same fields as a ``run`` request's. ``read_msg`` and
    ``hold``: the runner's reader of its request channel (``close_fds[0]``) and where a request
    read during the step goes, for a step with a live stdin (``stdin_live``)."""
    live = bool(req.get("stdin_live")) and read_msg is not None
    try:
        return _step(req, env, workspace, close_fds, reap_others, b64, unb64, read_msg, hold, live)
    finally:
        live_in = STATE.pop("live", None)
        if live_in is not None:  # what the step never read goes with it, as a pipe's would
            live_in.close()


def _step(req, env, workspace, close_fds, reap_others, b64, unb64, read_msg, hold, live):
    started = time.monotonic()
    notes = []
    for attempt in (0, 1):
        try:
            if STATE["pid"] is None or not alive():
                if STATE["pid"] is not None:
                    notes.append("the previous shell had died: a new one was started (cwd, variables and functions "
                                 "reset)")
                start(env, workspace, close_fds)
            _intact()
            _write("step", (req["command"] + "\n").encode("utf-8", "surrogateescape"))
            if live:
                first = unb64(req.get("stdin"))  # (before the FIFO: nothing left open in PID 1 if it fails)
                STATE["live"] = LiveIn(_live_in(), close_fds[0], read_msg, hold, first)
            else:
                _write("in", unb64(req.get("stdin")))
            break
        except OSError as e:  # its files removed or replaced by the sandbox's code (``rm -rf /tmp/.*``)
            if attempt or not (isinstance(e, Tampered) or e.errno in REPLACED):  # a full /tmp, no descriptors
                return _not_run(e, started, notes)                            # left: the shell lives on
            stop()
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
    forget = " disown -a 2>/dev/null;" if STATE["name"] == "bash" else ""
    if STATE.get("live") is None:
        line = (f"{exports}{{ . {DIR}/step; }} <{inp} >{DIR}/out 2>{DIR}/err 3>&-; "
                f"echo \"{nonce} $?\" >&3;{forget}\n").encode()
    else:  # the FIFO opened, the shell says so first (``LiveIn.opened``)
        line = (f"{exports}{{ echo \"{nonce} open\" >&3; {{ . {DIR}/step; }} 3>&-; }} <{inp} >{DIR}/out 2>{DIR}/err; "
                f"echo \"{nonce} $?\" >&3;{forget}\n").encode()
    for fd in (STATE["out"][0], STATE["err"][0]):
        _drain(fd, bytearray(), 0)  # late writes of an earlier step's (since reaped) background jobs
    try:
        os.write(STATE["cmd"], line)
    except BrokenPipeError:  # it died between steps: start another, once
        notes.append("the previous shell had died: a new one was started (cwd, variables and functions reset)")
        try:
            start(env, workspace, close_fds)
        except OSError as e:
            return _not_run(e, started)
        try:
            os.write(STATE["cmd"], line)
        except BrokenPipeError:
            stop()
            return {"error": "the shell dies as soon as it starts"}
    out_fd, err_fd, ctl = STATE["out"][0], STATE["err"][0], STATE["ctl"]
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    # a streamed step (``stream``): its output also goes to the host as it comes (close_fds[1]
    # is the runner's answer channel)
    emit = _emitter(close_fds[1], b64) if req.get("stream") else None
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
    live_in = STATE.get("live")
    if live_in is not None:
        live_in.register(poll)
    # a step fed as it runs is answering someone who waits for its output (a REPL's turn): sent
    # as read (a burst still goes as one chunk a poll), not held 5 ms for more
    coalesce = 0.0 if live_in is not None else COALESCE_S
    deadline = started + timeout_s
    killed_at = None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0 and killed_at is None:
            timed_out = True
            killed_at = time.monotonic()
            _kill_descendants(STATE["pid"])  # the step's processes; the shell survives
            reap_others(STATE["keep"])  # and, in a PID namespace, whatever escaped from its tree
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
                    shell_gone = _exit_status(STATE["pid"])
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
        stop()
    if shell_gone is not None:
        stop()
        notes.append(f"the shell exited (status {shell_gone}): the next step starts a new one (cwd, variables "
                     "and functions reset)")
    result = {"stdout": b64(bytes(bufs[out_fd])), "stderr": b64(bytes(bufs[err_fd])), "truncated": truncated,
              "timed_out": timed_out, "duration_s": time.monotonic() - started, "exit_code": status,
              "shell": STATE["name"] or _which_shell()[2]}
    if notes:
        result["note"] = "; ".join(notes)
    return result
