"""The agent inside every sandbox: it runs what the host asks, one request at a time.

Runs under the sandbox's interpreter with the standard library only, importing as little as it
can: its start-up is the cost of every fresh sandbox. Requests come from the (trusted) host as
length-prefixed ``marshal`` dicts; answers go back as JSON lines, which the host parses safely
even if the user's code has taken this process over. Both descriptors are moved out of the way at
start so nothing the user's code prints can corrupt the channel. Requests:

* ``run``    fork+exec ``argv`` (a shell command, a compiled binary) in its own process group
* ``python`` run ``code`` in a forked child of this warm interpreter (a one-shot python action
             without paying interpreter start-up)
* ``cell``   run ``code`` in the session's persistent namespace: in its own interpreter, a child
             forked from the zygote that lives across steps (``SessionChild``), never in this runner
* ``write`` / ``read`` files in the workspace (``run`` and ``python`` also take ``files`` to write
             first and ``fetch`` paths to read afterwards: one round trip for a whole one-shot)

* ``reset``  make a used one-shot sandbox pristine for the next one (see ``op_reset``) and say
             whether that could be verified

Every child gets ``timeout_s``; output is captured up to ``max_output`` bytes per stream (the rest
is drained and dropped, and flagged). After each request every other process in the sandbox is
killed, so nothing an action started outlives it (the runner itself is the persistent state).

Recycling one-shot sandboxes means hostile code must not be able to reach anything that outlives
its run. The runner is PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``), so nothing
inside can kill or stop it, and it is non-dumpable, so nothing inside can ptrace it or open its
``/proc`` files. Python one-shots are not forked from the runner itself, whose heap holds earlier
requests' code, stdin and output (a child could read them back from its copy), but from a
*zygote* forked before the first request: it receives only descriptors, and the child reads its
own request after the fork.
"""

import _signal
import _thread
import binascii
import io
import marshal
import os
import select
import sys
import time

SIGKILL = 9  # Linux numbers: importing signal pulls in enum, a fifth of our start-up
SIGINT = 2
SIGPIPE = 13
SIGXFSZ = 25
# what an exec'd program starts with at its default disposition, as Python's subprocess does
# (restore_signals): this interpreter ignores SIGINT (see below) and SIGPIPE (Python's start-up),
# and `yes | head -1` must end quietly, as in a terminal and under SandboxFusion
RESTORED = (SIGINT, SIGPIPE, SIGXFSZ)
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
try:  # an image's minimal python may lack these: then no zygote and no verified reset (no recycling)
    import _socket
    import ctypes
    LIBC = ctypes.CDLL(None, use_errno=True)
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/<pid>/mem|fd from inside
except (ImportError, OSError, AttributeError):
    _socket = ctypes = LIBC = None
_signal.signal(SIGINT, _signal.SIG_IGN)  # Python's KeyboardInterrupt handler would let a child stop us
try:  # POSIX message queues outlive their processes and cannot be listed without mounting mqueue
    import resource
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
except (ImportError, ValueError, OSError):
    pass
PROTO_IN = os.dup(0)
PROTO_OUT = os.dup(1)
OUT = [PROTO_OUT]  # where answers and streamed chunks go (a session's interpreter: its pipe to the runner)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
os.close(_null)
sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)


def stream(fd, mode):
    """A text stream on ``fd`` that never closes it (replaced streams are collected, and a
    stream owning the descriptor would close it under its successor)."""
    raw = os.fdopen(fd, mode + "b", buffering=0, closefd=False) if mode == "w" else os.fdopen(fd, "rb", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", write_through=(mode == "w"))

NAMESPACE = {"__name__": "__main__", "__builtins__": __builtins__}
WORKSPACE = sys.argv[sys.argv.index("--workspace") + 1] if "--workspace" in sys.argv else "/workspace"


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unb64(text):
    return binascii.a2b_base64(text) if text else b""


_ESC = {i: "\\u%04x" % i for i in range(32)}
_ESC.update({ord('"'): '\\"', ord("\\"): "\\\\"})


def to_json(obj):
    """JSON for the few shapes we answer with (json's import costs more than this whole file)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, (int, float)):
        return repr(obj)
    if isinstance(obj, str):
        if not obj.isascii():  # a name that is not UTF-8 (a lone surrogate): U+FFFD, as ``shown``
            try:                 # does, or the whole answer could not be sent
                obj.encode()
            except UnicodeEncodeError:
                try:
                    obj = shown(obj)  # the bytes os kept as surrogates
                except UnicodeEncodeError:  # any other lone surrogate: "?", as a cell's answer has it
                    obj = obj.encode("utf-8", "replace").decode()
        return '"' + obj.translate(_ESC) + '"'
    if isinstance(obj, dict):
        return "{" + ",".join(to_json(str(k)) + ":" + to_json(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in obj) + "]"
    return to_json(str(obj))


def print_exc(quiet=False):
    """The traceback of the user's code, without the runner's own frames; printed to stderr
    unless ``quiet``, returned as lines either way."""
    import traceback
    etype, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    lines = traceback.format_exception(etype, value, tb)
    if not quiet:
        sys.stderr.write("".join(lines))
    return [line.rstrip("\n") for line in lines]


# Only in a PID namespace of our own (the host passes --reap, and we double-check that we are
# one of its first processes): outside one, "every other process" would be the host's.
REAP = "--reap" in sys.argv and os.getpid() <= 3
#: a session's sandbox (the host passes --session): its zygote forks session interpreters (never
#: one-shots) and imports what they need first (``session_preload``, ``op_warm``)
SESSION = "--session" in sys.argv


KEEP = []  # the session's persistent shell (shell.py fills it): spared by reap_strays
#: whether the last request was a one-shot whose strays were all killed after its answer: nothing
#: can have started a process since (the zygote forks only when asked, the run's child is killed),
#: so the reset that follows does not scan /proc again (~38 us of CPU a one-shot at c=8)
REAPED = [False]


def reap_strays(keep=()):
    """Kill every process of this sandbox but pid 1 (the namespace's init), this runner, the
    zygote and the persistent shell; True when none is left (a fork bomb can outrun a few
    passes: the host then discards the sandbox instead of recycling it)."""
    if not REAP:
        return True
    keep = {1, os.getpid(), *((ZYGOTE.pid, ZYGOTE.ahead, ZYGOTE.owed) if ZYGOTE else ()), *KEEP, *keep,  # owed: killed, exiting
            *((CHILD[0].pid,) if CHILD[0] is not None else ()),
            *((BASH_AHEAD[0][0],) if BASH_AHEAD[0] is not None else ())}
    for attempt in range(20):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                if pid not in keep:
                    found = True
                    try:
                        os.kill(pid, SIGKILL)
                    except OSError:
                        pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not found:
            return True
        time.sleep(0.002 * (attempt + 1))
    return False


def collect(child, out_fd, err_fd, in_fd, stdin, timeout_s, max_output, wait=None):
    """Feed stdin, read both streams up to the cap, kill the group at the deadline; ``wait``
    returns the child's wait status (default: waitpid, for our own children). ``child``: the
    pid, or a call that returns it (asked only at the deadline: ``Zygote.run``)."""
    poll = select.poll()
    open_fds = {out_fd, err_fd}
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = False
    for fd in (out_fd, err_fd):
        poll.register(fd, select.POLLIN)
    pending = memoryview(stdin or b"")
    if in_fd is not None:
        if pending:
            os.set_blocking(in_fd, False)
            poll.register(in_fd, select.POLLOUT)
            open_fds.add(in_fd)
        else:
            os.close(in_fd)
            in_fd = None
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poll.poll(left * 1000):
            if fd == in_fd:
                try:
                    n = os.write(fd, pending[:65536])
                    pending = pending[n:]
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    poll.unregister(fd)
                    open_fds.discard(fd)
                    os.close(fd)
                    in_fd = None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poll.unregister(fd)
                open_fds.discard(fd)
                continue
            buf = bufs[fd]
            room = max_output - len(buf)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > room:
                truncated = True
    if timed_out:
        try:
            os.killpg(child() if callable(child) else child, SIGKILL)
        except (OSError, TypeError):  # (TypeError: no pid, the zygote broken: the reset discards it all)
            pass
    for fd in (out_fd, err_fd) + ((in_fd,) if in_fd is not None else ()):
        try:
            os.close(fd)
        except OSError:
            pass
    status = wait() if wait is not None else os.waitpid(child, 0)[1]
    return bufs[out_fd], bufs[err_fd], truncated, timed_out, status


def pipes():
    """stdin, stdout and stderr pipes for a child: (in_r, in_w, out_r, out_w, err_r, err_w)."""
    return (*os.pipe(), *os.pipe(), *os.pipe())


def parent_side(req, start, pid, fds):
    """What the runner does once the child exists, however it was made: drop the child's ends of
    the pipes, feed its stdin, read its output up to the cap until it ends or times out."""
    in_r, in_w, out_r, out_w, err_r, err_w = fds
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return finish(req, start, *collect(pid, out_r, err_r, in_w, unb64(req.get("stdin")),
                                       float(req.get("timeout_s") or 10), int(req.get("max_output") or 1 << 20)))


# A run's process group. Each run's process (a python one-shot's child, a bash, a program) leads a
# process group of its own, which is what a timeout kills, in the runner's session (bubblewrap's
# ``--new-session``: no controlling terminal). It used to lead a session of its own (``setsid``),
# and Linux gives every new session an autogroup: a scheduler task group with a run queue entity
# on every CPU of the host, each CPU's run queue locked to bring it online, and freed after an RCU
# grace period. Whatever the host's ``kernel.sched_autogroup_enabled`` (it only decides whether
# autogroups are used; they are made either way), on a 32-CPU host that was the most contended lock
# of the whole server at 16 cores (a third of the kernel's lock contention events, python c=256;
# docs/performance.md, issue 26's seventh round). A group (``setpgid``) has none of it. What the
# program can tell: ``os.getsid(0)`` is the runner's, and ``os.setsid()`` fails as it did (a group
# leader may not make a session). The sandbox boundary is unchanged: the reset kills every process
# but the runner and the zygote, whatever group or session it is in.


def spawn(req, body):
    """Fork a child in its own process group with fresh pipes; ``body`` runs in the child."""
    fds = in_r, in_w, out_r, out_w, err_r, err_w = pipes()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)  # a group of its own, not a session ("A run's process group")
            _signal.signal(SIGINT, _signal.SIG_DFL)
            if req.get("cpus"):  # no cgroups on the host: pin by affinity instead of cpuset
                os.sched_setaffinity(0, req["cpus"])
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, PROTO_IN, PROTO_OUT):
                os.close(fd)
            close_held()  # (a python run without a zygote runs here, with no exec)
            os.chdir(req.get("cwd") or WORKSPACE)
            cap_address_space(req.get("as_bytes"))
            body()
        except SystemExit as e:
            code = e.code
            os._exit(code if isinstance(code, int) else (0 if code is None else 1))
        except BaseException:
            print_exc()
            os._exit(1)
        os._exit(0)
    return parent_side(req, start, pid, fds)


def finish(req, start, out, err, truncated, timed_out, status):
    result = {"stdout": b64(bytes(out)), "stderr": b64(bytes(err)), "truncated": truncated,
              "timed_out": timed_out, "duration_s": time.monotonic() - start}
    if status is None:  # the zygote did not report (it was tampered with): the sandbox is discarded
        result["exit_code"] = None
    elif os.WIFSIGNALED(status):
        result["signal"] = os.WTERMSIG(status)
        result["exit_code"] = -os.WTERMSIG(status)
    else:
        result["exit_code"] = os.WEXITSTATUS(status)
    return result


def cap_address_space(limit):
    """SandboxFusion's memory limit: address space and data segment capped, so allocations fail
    inside the program (python raises MemoryError) instead of the kernel killing it. A limit no
    machine has is no limit (past 2**63 bytes ``setrlimit`` overflowed, and the program failed)."""
    if limit and limit < 1 << 62:
        import resource
        for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            resource.setrlimit(res, (limit, resource.getrlimit(res)[1]))


def env_for(req):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    env.update(req.get("env") or {})
    return env


def op_run(req):
    argv = req["argv"]
    env = env_for(req)
    here = not (req.get("cpus") or req.get("cwd") not in (None, WORKSPACE))  # no per-run settings but rlimits
    limit = req.get("as_bytes") or None
    LAST_RUN[0] = (list(argv), env, limit) if here and bash_ahead_fits(argv, env) else None
    if BASH_AHEAD[0] is not None:  # started by the reset for a run like the last one: this one, if it is
        result = take_bash_ahead(req, argv, env, limit) if here else drop_bash_ahead()
        if result is not None:
            return result
    if here and limit is None:
        result = spawn_exec(req, argv, env)
        if result is not None:
            return result

    def body():
        for sig in RESTORED:
            _signal.signal(sig, _signal.SIG_DFL)
        os.execvpe(argv[0], argv, env)

    return spawn(req, body)


def resolve(name, path):
    """``name`` looked up on the request's ``PATH`` (as ``execvpe`` does; ``posix_spawnp`` would
    use this runner's own PATH, which in an image's sandbox is not the image's)."""
    if "/" in name:
        return name
    for d in path.split(":"):
        full = os.path.join(d or ".", name)
        if os.access(full, os.X_OK) and not os.path.isdir(full):
            return full
    return None


def spawn_exec(req, argv, env):
    """``spawn`` for a program without per-run process settings, by ``posix_spawn``: glibc's
    vfork-and-exec copies none of this interpreter's page tables, which a ``fork`` does (measured
    inside a sandbox on the 2-core VM: /bin/true 0.85 ms of CPU against 1.25 ms; a trivial bash
    one-shot ~1 ms less). None when it cannot be used here (the caller forks instead, which then
    reports whatever the failure was exactly as before)."""
    path = resolve(argv[0], env.get("PATH", "")) if hasattr(os, "posix_spawn") else None
    if path is None:  # not found (or no posix_spawn): the fork path reports it as it always did
        return None
    fds = in_r, _, _, out_w, _, err_w = pipes()
    start = time.monotonic()
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    try:
        pid = os.posix_spawn(path, argv, env, file_actions=actions, setpgroup=0, setsigdef=RESTORED)
    except (OSError, ValueError, TypeError, NotImplementedError):
        for fd in fds:
            os.close(fd)
        return None
    return parent_side(req, start, pid, fds)


# -- a bash started ahead ---------------------------------------------------------------------------
# Issue 26: a trivial bash one-shot (``bash main.sh``, ``echo 1``) spent most of its latency in
# bash's exec, dynamic linking and start-up (~1.7 ms of the bash process's CPU at c=8 on the
# 2-core VM, against ~0.25 ms for the runner's whole run op). The reset of a recycled sandbox whose
# last one-shot was such a run therefore starts the next one's bash *ahead*, with the same argv and
# environment, and holds it where a non-interactive bash reads its ``BASH_ENV`` file: before it opens
# its script. Its ``BASH_ENV`` is a pipe (``/dev/fd/3``) that the runner writes only when a run with
# exactly that argv, environment, working directory and address space cap comes (the cap, SandboxFusion's
# ``memory_limit_MB``, is set on it by ``prlimit`` as it starts); what it writes (``bash_prologue``)
# unsets ``BASH_ENV``, closes the pipe, restarts ``SECONDS`` and puts back ``$_``, so that the
# script starts as under a fresh ``bash main.sh``: the same argv and ``$0``, the same environment
# for itself and its children, stdin, cwd, process group (its own), signals, exit status,
# timeout and output cap. (Its initial environment block, ``/proc/$$/environ``, still shows the
# ``BASH_ENV``: only the shell's own, never what it exports.) Any other request first kills it. It
# is started after the reset's checks and holds nothing of any run (a fresh exec, a workspace
# already wiped); it is spared by the reaping as the zygote's child forked ahead is. An environment
# bash would read differently at start (``BASH_ENV``, ``ENV``, ``POSIXLY_CORRECT``, ``SHELLOPTS``,
# ``BASHOPTS``, exported functions) is never started ahead.

#: the run's (argv, env, address space cap) when it could be started ahead next time (``bash_ahead_fits``)
LAST_RUN = [None]
#: a bash started ahead: (pid, argv, env, address space cap, stdin's write end, stdout's and stderr's read
#: ends, the BASH_ENV pipe)
BASH_AHEAD = [None]
BASH_AHEAD_FD = 3
BASH_NOT_AHEAD = ("BASH_ENV", "ENV", "POSIXLY_CORRECT", "SHELLOPTS", "BASHOPTS", "PS4", "LOCPATH", "GCONV_PATH")


def bash_ahead_fits(argv, env):
    """Whether a run of ``argv`` under ``env`` could be started ahead: bash running a script, in a
    one-shot sandbox of its own PID namespace, under an environment its start-up reads as usual."""
    return (REAP and not SESSION and len(argv) >= 2 and os.path.basename(argv[0]) == "bash"
            and not argv[1].startswith("-") and hasattr(os, "posix_spawn")
            and not any(k in BASH_NOT_AHEAD or k.startswith(("BASH_FUNC_", "LD_")) for k in env))


def bash_prologue(argv, env):
    """What the bash started ahead reads as its ``BASH_ENV``: undo what starting it ahead changed."""
    underscore = env.get("_", argv[0])  # $_ at a script's start: the environment's, else argv[0]
    return ("builtin unset BASH_ENV; exec %d<&-; SECONDS=0; : '%s'\n"
            % (BASH_AHEAD_FD, underscore.replace("'", "'\\''"))).encode()


def start_bash_ahead(argv, env, limit=None):
    """Start the next run's bash now, held before its script (see above); nothing when it cannot be.
    ``limit``: the run's address space cap (SandboxFusion's ``memory_limit_MB``), set on it with
    ``prlimit`` as it starts (a fresh run's is set before its exec)."""
    path = resolve(argv[0], env.get("PATH", ""))
    if path is None:
        return
    fds = in_r, in_w, out_r, out_w, err_r, err_w = pipes()
    ctl_r, ctl_w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2),
               (os.POSIX_SPAWN_DUP2, ctl_r, BASH_AHEAD_FD)]
    try:
        if ctl_r == BASH_AHEAD_FD:  # (a dup2 onto itself would keep it close-on-exec)
            raise OSError("the BASH_ENV pipe is on its own target")
        pid = os.posix_spawn(path, argv, {**env, "BASH_ENV": "/dev/fd/%d" % BASH_AHEAD_FD}, file_actions=actions,
                             setpgroup=0, setsigdef=RESTORED)
    except (OSError, ValueError, TypeError, NotImplementedError):
        for fd in (*fds, ctl_r, ctl_w):
            os.close(fd)
        return
    for fd in (in_r, out_w, err_w, ctl_r):
        os.close(fd)
    BASH_AHEAD[0] = (pid, list(argv), dict(env), limit, in_w, out_r, err_r, ctl_w)
    if limit:
        try:
            import resource
            for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
                resource.prlimit(pid, res, (limit, resource.getrlimit(res)[1]))
        except (ImportError, OSError, ValueError):
            drop_bash_ahead()


def drop_bash_ahead():
    """Kill the bash started ahead (another request comes, or a reset starts another); None."""
    ahead, BASH_AHEAD[0] = BASH_AHEAD[0], None
    if ahead is None:
        return None
    pid = ahead[0]
    for fd in ahead[4:]:
        os.close(fd)
    try:
        os.kill(pid, SIGKILL)
        os.waitpid(pid, 0)
    except (OSError, ChildProcessError):  # already reaped (reap_strays' waitpid(-1))
        pass
    return None


def take_bash_ahead(req, argv, env, limit):
    """Run this request in the bash started ahead if it is the same run and still waits; None
    otherwise (it is killed, and the caller starts one as usual)."""
    pid, a_argv, a_env, a_limit, in_w, out_r, err_r, ctl_w = BASH_AHEAD[0]
    try:
        waiting = a_argv == argv and a_env == env and a_limit == limit and os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        waiting = False
    if not waiting:
        return drop_bash_ahead()
    start = time.monotonic()
    try:
        write_all(ctl_w, bash_prologue(argv, env))
    except OSError:  # it ended meanwhile: killed, and this run is started as usual
        return drop_bash_ahead()
    BASH_AHEAD[0] = None  # this run's now
    os.close(ctl_w)
    return finish(req, start, *collect(pid, out_r, err_r, in_w, unb64(req.get("stdin")),
                                       float(req.get("timeout_s") or 10), int(req.get("max_output") or 1 << 20)))


def python_body(code, env, streams_made=False):
    """What a python one-shot child runs (after its descriptors are in place). ``streams_made``:
    ``sys.stdin``/``stdout``/``stderr`` are already streams on descriptors 0-2, made by ``warm``
    on pipes as the run's are (so not remade: ~9 system calls, half of a trivial run's stream
    setup, and their objects)."""
    os.environ.clear()
    os.environ.update(env)
    if not streams_made:
        sys.stdin = stream(0, "r")
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), encoding="utf-8")
        sys.stderr = stream(2, "w")
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass


# a python one-shot in a new interpreter: its code comes on the descriptor named in argv[1]; a
# traceback starts at the program's own frames, as a one-shot's from the zygote does
FRESH_BOOT = """import os, sys
with os.fdopen(int(sys.argv[1]), "rb") as f:
    code = f.read()
sys.argv = ["main.py"]
def hook(t, v, tb, orig=sys.excepthook):
    if tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
        v = v.with_traceback(tb)  # (what Python 3.11's default hook prints)
    orig(t, v, tb)
sys.excepthook = hook
del os, f, hook
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def python_fresh(req):
    """A python one-shot run by a new interpreter (a fork of this runner that execs at once: none
    of the runner's memory reaches the program). For a session's sandbox whose interpreter holds
    the zygote: a child forked from the runner itself read what the runner's heap still held of
    the sessions before (their cells' requests and answers, rest blobs: review H3)."""
    if not sys.executable:
        raise RuntimeError("no python executable to start a fresh interpreter with")
    code = req["code"].encode("utf-8", "surrogateescape")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("main.py", 0)  # close-on-exec, made inheritable in the child only
    else:
        import tempfile
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    try:
        write_all(fd, code)
        os.lseek(fd, 0, os.SEEK_SET)
        argv = [sys.executable, "-c", FRESH_BOOT, str(fd)]
        env = env_for(req)

        def body():
            for sig in RESTORED:
                _signal.signal(sig, _signal.SIG_DFL)
            os.set_inheritable(fd, True)
            os.execve(sys.executable, argv, env)

        return spawn(req, body)
    finally:
        os.close(fd)


def op_python(req):
    if CHILD[0] is not None:  # a session's sandbox (a python one-shot with a trajectory: rare)
        if not CHILD[0].used:  # one forked ahead holds nothing: the zygote is needed for this run
            end_child("")
            LOST[0] = ""
        else:  # the zygote waits on the session's interpreter: a new interpreter runs it, and the
            # sandbox is never reused
            TAINTED[0] = "a python one-shot was forked from the runner (the session's interpreter held the zygote)"
            return python_fresh(req)
    if ZYGOTE is not None and CHILD[0] is None:
        return ZYGOTE.run(req)
    code = req["code"]
    env = env_for(req)
    return spawn(req, lambda: python_body(code, env))


class Zygote:
    """A clean template for python one-shots: forked before this runner reads any request, it
    forks one child per run and reports the child's pid and wait status; the child reads its own
    request from the socket, so no request ever enters the zygote's (or a later child's) memory.

    The next run's child may be forked *ahead* (``fork_ahead``, asked by the reset of a recycled
    sandbox whose last run was python, ``SandboxConfig.fork_ahead``): it waits on the socket for its descriptors and
    request, so the fork and the ~200 page faults of a forked interpreter's way back from
    ``fork`` (Python's at-fork handlers included: a third of a ~2.3 ms child's CPU) are paid off
    the run's latency path (measured on the 2-core VM, side by side with the runner before it:
    HTTP python c=1 p50 0.63x, c=8 throughput 1.33x at load 5). It is forked after the reset's checks, from the
    zygote, and holds nothing but the zygote's memory; a non-python request kills it first, so no
    other run ever sees it. Messages to the runner are tagged (``P`` pid, ``S`` status, ``A`` taken): one
    out of turn breaks the zygote, and a broken zygote fails the reset (the sandbox is discarded).

    Issue 26, a trivial run's way through this class timed on the 2-core VM (print(1), forked
    ahead, p50): 2.7 ms before, of which 0.9 ms was the child's exit (its address space torn
    down before its pipes closed), 0.9 ms its first writes to the zygote's pages, 0.4 ms a round
    trip for the request; ~1.0 ms after three changes: the child reports its end on a status pipe
    and closes its streams before it exits (``child``), a child forked ahead warms itself before
    it waits (``warm``), and the request travels with the run's descriptors in one message (the
    zygote reads only the byte that carries them; anything else there ends it).

    Measured and dropped (issue 26, 2-core VM): fork copies no page table entries of a read-only
    file mapping (the kernel leaves the child to fault them in), and ~75 of a print(1) child's
    ~400 faults were such (``perf record -e page-faults -d``, by mapping; the rest: ~250 writes
    to the zygote's heap, arenas and the interpreter's static data, the same pages every run).
    Giving each such mapping of the zygote an anonymous page (write permission added for one
    write of a byte onto itself, then taken back) makes fork copy their entries: the child's
    faults fell 15%, but the CPU of the zygote and its children per run did not (copied / not,
    medians of six alternating rounds of 1,000: 1.07x on demand, 1.03x ahead under pyenv's
    python with its libpython; 0.78-0.99x on demand and ~0.95x ahead under Debian's static
    python3), the fork's extra copies and the exit's extra unmapping costing what the faults did.
    Also dropped: a child forked ahead taking its session, SIGINT handler and dumpability (and its
    first steps after the wait) before it waits: this class's run 0.83-0.90x, but python c=1 over
    HTTP 1.07-1.10x, the work moved into the time the answer travels and the next request comes
    (on 2 cores it took their CPU; docs/performance.md, sixth round)."""

    def __init__(self):
        here, there = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            here.close()
            for fd in (PROTO_IN, PROTO_OUT):
                os.close(fd)
            close_held()
            try:
                self.serve(there)
            finally:
                os._exit(0)
        there.close()
        self.pid, self.sock = pid, here
        self.ahead = None  # the pid of a child forked ahead, waiting for its run
        self.broken = ""  # why the zygote cannot be trusted any more (the reset then fails)
        self.owed = None  # a child that reported its own end: the zygote's status for it is still to read
        self.tag = ""
        self.taken = None  # the pid ``taken_by`` read for this run

    # -- in the zygote ---------------------------------------------------------------------------
    @staticmethod
    def serve(sock):
        rehearse()
        if SESSION:
            session_preload()
        while True:
            msg, anc, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(RUN_FDS * 4))
            if not msg:
                return
            fds = receive_fds(anc)
            if msg == b"w" and not fds:  # a session sandbox's warm-up: modules its sessions' interpreters will share
                Zygote.warm(sock)
                continue
            session = msg == b"s" and len(fds) == 2  # a session's interpreter, with its two pipes
            if not session and not _in_turn(msg, fds, b"fg"):  # out of protocol (stale bytes of a lost
                for fd in fds:                                  # request): end, so the runner's next read
                    os.close(fd)                                # finds the zygote broken
                return
            pid = os.fork()
            if pid == 0:
                if msg == b"s":  # a session's interpreter: it talks to the runner on its own pipes
                    sock.close()
                    session_main(*fds)
                if msg == b"f":  # forked ahead: the run's descriptors come later, to the child itself
                    warm()
                    msg, anc, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(RUN_FDS * 4))
                    fds = receive_fds(anc)
                    if not _in_turn(msg, fds, b"g"):
                        os._exit(0)
                    sock.sendall(b"A" + os.getpid().to_bytes(4, "little"))  # "mine": the runner knows who runs it
                Zygote.child(sock, fds)
            for fd in fds:
                os.close(fd)
            sock.sendall(b"P" + pid.to_bytes(4, "little"))
            _, status = os.waitpid(pid, 0)
            sock.sendall(b"S" + status.to_bytes(4, "little", signed=True))

    @staticmethod
    def warm(sock):
        """Import the standard library modules the host names (those rested sessions use most:
        ``manager.WARM_MODULES``), so that every session's interpreter forked later shares them
        instead of importing them itself; answers ``W`` and how many failed."""
        import importlib
        names = read_message(sock.fileno())
        failed = 0
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                failed += 1
        sock.sendall(b"W" + failed.to_bytes(4, "little"))

    @staticmethod
    def child(sock, fds):
        """A run's child: its stdin, stdout, stderr and status pipe are ``fds``; its request is
        next on ``sock`` (sent with the descriptors, in the same message). It says how it ended
        on the status pipe and closes its streams *before* it exits: a forked interpreter's exit
        tears down its address space (~0.9 ms for the zygote's ~15 MB on the 2-core VM, the
        largest part of a trivial run), which then happens after the runner has answered. The
        code it reports is what the program could make its exit status anyway; a child that
        dies by a signal reports nothing and its wait status comes from the zygote, as before.

        It then waits for the runner to have read that (``status`` closes the pipe's read end, then
        kills it) instead of exiting at once (issue 26): in a sandbox
        pinned to one core (a one-core action's cpuset) the child went on to its exit once its
        streams were closed, and the runner, woken by their end, ran only after the teardown:
        ``runner.Zygote`` outside a sandbox pinned to one core (``taskset -c 1``), print(1)
        forked ahead, a run's p50 from the runner's send to its collected answer 1.15-1.20 ms
        before, 0.81-0.85 after (0.85-0.95 unpinned, 0.95-1.2 before). Not when the program left
        threads running (``_thread._count()``): those must end with it, as ``os._exit`` ends them;
        nor in a copy the program forked that returns here (it exits at once, as before: a parent
        waiting for it would otherwise wait for the runner, which waits for the parent's end).
        Tried and dropped: ``nice 19`` before its end (no wait): the runner then preempted it
        between its stdout and stderr closing, 1.24-1.54 ms."""
        code = 1
        status_fd = fds[3]
        me = os.getpid()  # (a copy the program forks returns through here too: it never waits below)
        try:
            os.set_inheritable(status_fd, False)  # not into programs the user's code execs
            os.setpgid(0, 0)  # a group of its own, not a session ("A run's process group")
            _signal.signal(SIGINT, _signal.default_int_handler)
            for target, fd in zip((0, 1, 2), fds):
                os.dup2(fd, target)
                os.close(fd)
            req = read_message(sock.fileno())
            sock.close()
            LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the user's process is ordinary again (zygote: LIBC is set)
            if req.get("cpus"):
                os.sched_setaffinity(0, req["cpus"])
            os.chdir(req.get("cwd") or WORKSPACE)
            cap_address_space(req.get("as_bytes"))
            python_body(req["code"], env_for(req), WARMED[0])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            try:
                print_exc()
            except BaseException:  # stderr gone: the exit status still says it failed
                pass
        try:
            os.write(status_fd, (code & 0xFF).to_bytes(4, "little"))
            for fd in (0, 1, 2):
                os.close(fd)
            if os.getpid() == me and not _thread._count():  # no thread of the program's left to run on:
                waiting = select.poll()                     # wait until the runner has read the status (it
                waiting.register(status_fd, 0)              # closes its end: POLLERR here) or kills us
                waiting.poll(LINGER_S * 1000)
        except BaseException:
            pass
        os._exit(code)

    # -- in the runner ---------------------------------------------------------------------------
    def reply(self, tags, timeout_s):
        """The next message from the zygote's side, whose tag must be one of ``tags`` (``P``
        pid, ``S`` status, ``A`` a child forked ahead took its run; ``self.tag`` says which);
        None, and the zygote broken, when none comes in ``timeout_s`` or it is out of turn."""
        self.tag = ""
        if not select.select([self.sock], [], [], timeout_s)[0]:
            self.broken = self.broken or f"no {tags!r} from the zygote in {timeout_s} s"
            return None
        try:
            data = read_exact(self.sock.fileno(), 5)
        except OSError:  # the zygote is gone
            data = None
        if not data or data[:1].decode("latin-1") not in tags:
            # the zygote gone (its child may kill it: a user's program) is ``broken``, never a crash
            # of this method, which would report the user's run as the runner's failure
            said = f"sent {data[:1]!r}" if data else "is gone"
            self.broken = self.broken or f"the zygote {said} where {tags!r} was due"
            return None
        self.tag = data[:1].decode("latin-1")
        return int.from_bytes(data[1:], "little", signed=True)

    def send(self, data, anc=()):
        """Send to the zygote's side; False, and the zygote broken, when it is gone."""
        try:
            sent = self.sock.sendmsg([data], anc)
            if sent < len(data):
                self.sock.sendall(data[sent:])
            return True
        except OSError as e:
            self.broken = self.broken or f"the zygote is gone ({e.strerror or e})"
            return False

    def settle(self):
        """Read the wait status the zygote owes for a child that reported its own end (its exit
        ran on after the runner's answer): before anything else is asked of the zygote."""
        if self.owed is not None:
            self.owed = None
            self.reply("S", 2.0)

    def fork_ahead(self):
        """Have the next run's child forked now (off the latency path)."""
        self.settle()
        if self.ahead is not None or self.broken:
            return
        if self.send(b"f"):
            self.ahead = self.reply("P", 2.0)

    def drop_ahead(self):
        """Kill the child forked ahead (a request of another kind comes, or a session's first step)."""
        self.settle()
        pid, self.ahead = self.ahead, None
        if pid is None:
            return
        try:
            os.kill(pid, SIGKILL)
        except OSError:
            pass
        self.reply("S", 2.0)

    def run(self, req):
        self.settle()
        if self.broken:
            raise RuntimeError(f"zygote: {self.broken}")
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        start = time.monotonic()
        fds = (in_r, out_w, err_w, st_w)
        # (the request's own values first: nothing may fail between the send and the reading of
        # who took it, or the zygote's messages would be read out of step by the next call)
        stdin, timeout_s, max_output = unb64(req.get("stdin")), float(req.get("timeout_s") or 10), \
            int(req.get("max_output") or 1 << 20)
        ahead, self.ahead = self.ahead, None
        data = marshal.dumps({"code": req["code"], "env": req.get("env"), "cpus": req.get("cpus"),
                              "cwd": req.get("cwd"), "as_bytes": req.get("as_bytes")}, 4)
        # the descriptors and the request in one message: to the child forked ahead if it is
        # there, else to the zygote, which reads the one byte that carries the descriptors and
        # forks a child that reads the rest (the request never enters the zygote's memory)
        anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))]
        msg = b"g" + len(data).to_bytes(4, "little") + data
        del data
        ok = self.send(msg, anc)
        del msg
        for fd in fds:
            os.close(fd)
        if not ok:
            for fd in (in_w, out_r, err_r, st_r):
                os.close(fd)
            raise RuntimeError(f"zygote: {self.broken}")
        self.taken, first = None, ("P" if ahead is None else "AS")
        who = lambda wait_s=10.0: self.taken_by(first, wait_s)  # noqa: E731
        try:
            os.set_blocking(st_r, False)
            out = collect(lambda: who(TAKEN_LATE_S), out_r, err_r, in_w, stdin, timeout_s, max_output,
                          wait=lambda: None if who() is None else self.status(who(), st_r))
        except BaseException:  # whatever the zygote still owes for this run is unread: never reused
            self.broken = self.broken or "a run ended before its replies were read"
            raise
        if who() is None:  # no child took it (the zygote broke): the runner's failure, as before
            os.close(st_r)
            raise RuntimeError(f"zygote: {self.broken}")
        return finish(req, start, *out)

    def taken_by(self, first, wait_s):
        """Who runs the request just sent (``first``: the tags of what says so first): a child forked
        ahead, which says "A" (and its pid) as it takes it, or, had it died idle ("S"), the one the
        zygote forks for it ("P"); with none ahead, the one the zygote forks ("P"). Read once the
        run's output has ended (or at its deadline, to kill it), not before reading that output
        (issue 26, seventeenth round): the runner was woken by that message and went back to sleep
        before the output came, a wake-up more on a python one-shot's way than on a bash one's.
        Only the zygote and a child before its program write on the socket (a child closes it
        before the program runs), so what is read here later is theirs. ``wait_s``: how long to
        wait for it (at the deadline, ``TAKEN_LATE_S``: by then it is long due, and the host's own
        deadline for the answer is near). None when the zygote is broken (``run`` then fails, as
        the runner's error)."""
        if self.taken is not None or self.broken:
            return self.taken
        child = self.reply(first, wait_s)
        if self.tag == "S":
            child = self.reply("P", wait_s)
        self.taken = child
        return child

    def status(self, child, st_r):
        """The child's wait status once its streams are closed: what it reported on its status
        pipe (a normal end; the zygote's own report is then read later, ``settle``), else the
        zygote's (a signal, or a child that closed the pipe)."""
        try:
            said = os.read(st_r, 8)
        except OSError:  # nothing written (it still holds the pipe): not a normal end
            said = b""
        os.close(st_r)
        if len(said) == 4 and not self.broken:
            self.owed = child
            try:  # it has nothing left to do but exit: one that lingers is killed, never waited for
                os.kill(child, SIGKILL)
            except OSError:
                pass
            return int.from_bytes(said, "little") << 8  # a wait status: exited with this code
        return self.reply("S", 2.0)


RUN_FDS = 4  # a run's stdin, stdout, stderr and status pipe
#: at a run's deadline, how long its child's pid may still take to come (``Zygote.taken_by``): well
#: within the host's grace past the deadline (``SandboxConfig.grace_s``, 5 s), so a zygote that
#: never said is the runner's error, not the host's kill of a run that timed out
TAKEN_LATE_S = 2.0
LINGER_S = 1.0  # how long a child that reported its end waits for the runner's kill before it exits


def _in_turn(msg, fds, tags):
    """Whether a message to the zygote is one it expects: ``f`` (fork ahead) without descriptors,
    ``g`` (a run) with its four."""
    return len(msg) == 1 and msg in tags and len(fds) == (RUN_FDS if msg == b"g" else 0)


#: in a child forked ahead: whether ``warm`` left its streams on descriptors 0-2 for the run
WARMED = [False]


#: the environment every one-shot gets beside its request's own (``SandboxManager._request_env``):
#: a warm-up sets the same names, so the run's environment grows no new entries (tests compare them)
RUN_ENV = {"TANGRAM_NUM_CPUS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def warm():
    """In a child forked ahead, before it waits for its run: a run's own steps once on a pipe,
    so the pages they write (reference counts, the allocator's pools, the streams) are copied
    from the zygote now instead of on the run's latency path. The streams it makes stay: the
    run's descriptors replace the pipe under them (``dup2`` onto 0-2), and a pipe's streams are
    what a run's would be (not seekable, not a terminal, the same block size), so the run does
    not make them again (on /dev/null, which is seekable, they could not be kept).

    The steps ``Zygote.child`` takes around the program are rehearsed too, each on something of
    the warm-up's own or as a no-op: a request read from the pipe, the environment's names, the
    status written, ``prctl``'s read of dumpability, the workspace as working directory (the
    process group and SIGINT's handler are only looked up). Issue 26, seventeenth round: a
    print(1) run's copy-on-write faults from its request to its end 66-77 -> 26-37, the zygote's
    and its children's per run ~413 -> 416-431 (``/proc/<child>/stat``, ``tangram bench
    zygote``; ``runner.Zygote`` outside a sandbox on the 2-core VM, where a fault costs ~4 us;
    that total moves by ~10 with where the runner's own objects happen to lie, edit to edit), the
    run's p50 0.76-0.88x. Its program prints an empty line, as the zygote's rehearsal's does
    (most one-shots print what they found, and ``print``'s way through the streams is then taken
    once in the zygote, its pages shared): the run's faults 30-35 -> 22-25 more, its p50
    0.73-0.82 -> 0.68-0.71 ms (docs/performance.md, seventeenth round)."""
    r, w = os.pipe()
    try:
        os.dup2(r, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.set_inheritable(w, False)
        data = marshal.dumps({"code": "print()", "env": RUN_ENV, "cpus": None, "cwd": None, "as_bytes": None}, 4)
        os.write(w, len(data).to_bytes(4, "little") + data)
        req = read_message(r)
        cap_address_space(req.get("as_bytes"))
        python_body(req["code"], env_for(req))
        WARMED[0] = True
        os.write(w, (0).to_bytes(4, "little"))
        os.read(r, 8)
        if LIBC is not None:
            LIBC.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        done = (os.setpgid, _signal.signal, _signal.default_int_handler, os.sched_setaffinity, os.getpid,
                _thread._count, select.poll().register, os._exit)
        del done
        os.chdir(req.get("cwd") or WORKSPACE)
    except Exception:  # only a saving
        pass
    finally:
        os.close(r)
        os.close(w)


def receive_fds(anc):
    return [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for level, kind, data in anc
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS for i in range(0, len(data), 4)]


def rehearse():
    """Run a one-shot child's own steps once in the zygote, on /dev/null, before any fork: the
    lazily made state they touch (codec lookups, the adaptive interpreter's specialised code,
    interned names, the modules a traceback needs) is then made once here instead of in every
    child, whose first writes to each page cost a copy-on-write fault (measured: ~45 fewer faults
    per child of ~470; a failing program's child 7.6 -> 2.7 ms of CPU: docs/performance.md). The
    passing program prints an empty line (``warm``'s docstring says what that saves)."""
    null = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    environ = dict(os.environ)
    streams = sys.stdin, sys.stdout, sys.stderr
    try:
        for _ in range(8):
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            python_body("print()", env_for({}))
            try:  # a failing program's way too: its traceback (importing traceback, linecache, tokenize)
                python_body("raise ValueError('rehearsal')", env_for({}))
            except ValueError:
                print_exc()
            marshal.loads(marshal.dumps({"code": "", "env": {}, "cpus": None, "cwd": None, "as_bytes": None}, 4))
    except Exception:  # an image's minimal python may lack a module: a rehearsal is only a saving
        pass
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
        sys.stdin, sys.stdout, sys.stderr = streams


def read_exact(fd, n):
    """``n`` bytes from descriptor ``fd`` (a pipe or a socket), or None at its end."""
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_message(fd):
    """One framed message (4-byte length, then marshal) from ``fd``; None at its end."""
    head = read_exact(fd, 4)
    return None if head is None else marshal.loads(read_exact(fd, int.from_bytes(head, "little")))


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


#: how long a streamed cell's output may wait to go out with more (shell.py's COALESCE_S)
CELL_COALESCE_S = 0.005


class Capture:
    """Drain one pipe into a capped buffer in a thread, so a blocked cell cannot stall it;
    ``emit(name, data)``: a streamed cell's forwarder of what is kept (``chunk_writer``)."""

    def __init__(self, fd, limit, emit=None, name=""):
        import threading
        self.fd, self.limit, self.buf, self.truncated = fd, limit, bytearray(), False
        self.emit, self.name = emit, name
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.thread.start()

    def join(self):
        self.thread.join()

    def run(self):
        # a streamed cell's output goes out ``CELL_COALESCE_S`` after its first unsent byte, as a
        # shell step's does: forwarding each read (a byte, for ``os.write(1, b"x")`` in a loop)
        # cost the engine process a JSON line, a decode and a listener call per byte (review:
        # 100k one-byte writes, ~37k chunks, 1.1-1.5 s of engine CPU)
        pending, since = bytearray(), 0.0
        while True:
            if pending:
                wait = since + CELL_COALESCE_S - time.monotonic()
                if wait <= 0 or not select.select([self.fd], [], [], wait)[0]:
                    self.emit(self.name, bytes(pending))
                    pending.clear()
                    continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
                if self.emit is not None:
                    if not pending:
                        since = time.monotonic()
                    pending += chunk[:room]
            if len(chunk) > room:
                self.truncated = True
        if pending:  # the cell's end: the rest before its answer
            self.emit(self.name, bytes(pending))
        os.close(self.fd)


def chunk_writer():
    """A streamed request's output chunks, sent while it runs as ``shell.py``'s are (a JSON line
    ``{"stream", "data"}`` each, no ``id``), from the capture threads (one lock: lines whole); to
    ``OUT[0]``: the host's channel in the runner, the runner's in a session's interpreter."""
    import threading
    lock = threading.Lock()
    out = OUT[0]

    def emit(name, data):
        line = ('{"stream":"' + name + '","data":"' + b64(data) + '"}\n').encode()
        with lock:
            write_all(out, line)

    return emit


class CellTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise CellTimeout()


def quieted(code, last):
    """The cell's final expression ends with ``;``: a notebook then shows nothing (``5;``).
    The AST's end column counts UTF-8 bytes."""
    lines = code.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # the line ends python's parser counts
    if last.end_lineno is None or last.end_lineno > len(lines):
        return False
    tail = lines[last.end_lineno - 1].encode("utf-8", "surrogatepass")[last.end_col_offset or 0:]
    return tail.lstrip().startswith(b";")


def cell_here(req):
    """A python cell in this process's namespace: in the session's interpreter (``SessionChild``)."""
    limit = int(req.get("max_output") or 1 << 20)
    saved = os.dup(1), os.dup(2)
    caps = []
    emit = chunk_writer() if req.get("stream") else None
    for fd in (1, 2):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        cap = Capture(r, limit, emit, "stdout" if fd == 1 else "stderr")
        cap.start()
        caps.append(cap)
    sys.stdout, sys.stderr = stream(1, "w"), stream(2, "w")
    sys.stderr.reconfigure(errors="backslashreplace")  # as Python's own: a traceback never fails to print
    # the C modules under ``signal`` and ``ast``: those pull in enum, contextlib and collections,
    # ~5 ms of CPU at every session's start (python -X importtime), for names these already have
    import _ast
    start = time.monotonic()
    exit_code, timed_out = 0, False
    _signal.signal(_signal.SIGALRM, _alarm)
    _signal.setitimer(_signal.ITIMER_REAL, float(req.get("timeout_s") or 10))
    display, raised = [], []
    try:
        try:
            tree = compile(req["code"], "<cell>", "exec", _ast.PyCF_ONLY_AST)  # what ast.parse does
            last = tree.body[-1] if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
            if last is not None:  # like a notebook: the value of a final expression is displayed
                tree.body.pop()
            exec(compile(tree, "<cell>", "exec"), NAMESPACE)
            if last is not None:
                value = eval(compile(_ast.Expression(last.value), "<cell>", "eval"), NAMESPACE)
                if value is not None and not quieted(req["code"], last):
                    display.append({"text/plain": repr(value)})
        finally:
            _signal.setitimer(_signal.ITIMER_REAL, 0)
    except CellTimeout:
        exit_code, timed_out = 1, True
        print("cell timed out", file=sys.stderr)
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        exit_code = 1
        # a notebook (SandboxFusion's /run_jupyter) reports the traceback in the cell's error, not stderr
        lines = print_exc(quiet=bool(req.get("jupyter")))
        raised.append({"ename": type(e).__name__, "evalue": str(e), "traceback": lines})
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    for cap in caps:
        cap.join()
    return {"stdout": b64(bytes(caps[0].buf)), "stderr": b64(bytes(caps[1].buf)),
            "truncated": caps[0].truncated or caps[1].truncated, "timed_out": timed_out,
            "exit_code": exit_code, "duration_s": time.monotonic() - start, "display": display, "raised": raised}


# -- files the runner opens for the host: plain ones only --------------------------------------
# A path the host names (op_write, op_read, op_fs) may pass through links the sandbox's code
# planted, and this process follows them with its own rights: to its own descriptors through
# /proc/1/fd (a workspace link to /proc/1/fd/4, written through, put the caller's bytes on the
# runner's answer channel to the host: found by a probe on 2026-11-29), to its memory map, its
# limits. So a path is opened without magic links (openat2's RESOLVE_NO_MAGICLINKS, Linux 5.6+;
# without it, the file must not be one this process holds open), and only a regular file outside
# the kernel's pseudo file systems is read or written.
SYS_OPENAT2 = 437  # one number on every architecture (it came after the tables were unified)
RESOLVE_NO_MAGICLINKS = 0x02
OPENAT2 = [LIBC is not None]
PSEUDO_FS = frozenset(("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf", "configfs",
                       "binfmt_misc", "fusectl", "pstore", "efivarfs", "mqueue", "devpts"))
PSEUDO_DEVS = []


class NotPlain(OSError):
    """Not a regular file of an ordinary file system: never read or written for the host."""


def pseudo_devs():
    """The devices of the pseudo file systems this sandbox has mounted (read once: nothing in
    the sandbox can change this process's mounts)."""
    if not PSEUDO_DEVS:
        devs = set()
        try:
            with open("/proc/self/mountinfo", "rb") as f:
                for line in f.read().decode("utf-8", "replace").splitlines():
                    head, _, tail = line.partition(" - ")
                    fields = head.split()
                    if len(fields) > 2 and tail.split(" ", 1)[0] in PSEUDO_FS:
                        major, _, minor = fields[2].partition(":")
                        devs.add(os.makedev(int(major), int(minor)))
        except (OSError, ValueError):  # no /proc mounted: none of its files to keep from the host
            pass                       # (not /sys's device by its path: an empty /sys on the root tmpfs
        PSEUDO_DEVS.append(frozenset(devs))  # made every link there look like a pseudo file's)
    return PSEUDO_DEVS[0]


def open_no_magic(path, flags, mode):
    if "\0" in path:  # (ctypes would cut the path there, where os.open refuses it)
        raise ValueError(f"{path!r}: a path with a NUL byte")
    if OPENAT2[0]:
        call = openat2_call()
        how = HOWS.get((flags, mode))
        if how is None:  # a handful of (flags, mode): made once (with the prototype, 2.4 us over os.open, not 3.2)
            how = HOWS[(flags, mode)] = HOWS["struct"](flags, mode if flags & os.O_CREAT else 0, RESOLVE_NO_MAGICLINKS)
        fd = call(SYS_OPENAT2, -100, os.fsencode(path), ctypes.addressof(how), 24)  # sizeof(struct open_how)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == 40:  # ELOOP: what RESOLVE_NO_MAGICLINKS answers (or a loop of links)
            raise NotPlain(err, "a link into a process's own files (/proc/<pid>/fd...), or a loop of links", path)
        if err not in (38, 1):  # ENOSYS: an older kernel; EPERM: a container's filter that refuses it (then
            raise OSError(err, os.strerror(err), path)  # every open goes the other way, ``held_here``)
        OPENAT2[0] = False
    return os.open(path, flags, mode)


def held_here(fd, st):
    """``st`` is a file this process holds open under another descriptor."""
    for name in os.listdir("/proc/self/fd"):
        if name == str(fd):
            continue
        try:
            other = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if other.st_ino == st.st_ino and other.st_dev == st.st_dev:
            return True
    return False


def open_plain(path, flags, mode=0o666, truncate=False):
    """``path`` opened for the host (``flags``: O_RDONLY, or O_WRONLY and O_CREAT; ``truncate``:
    emptied once it is known to be plain, never at the open), or ``NotPlain``/``OSError``."""
    fd = open_no_magic(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, mode)
    try:
        st = os.fstat(fd)
        if ((st.st_mode & 0o170000) != 0o100000 or st.st_dev in pseudo_devs()
                or (not OPENAT2[0] and held_here(fd, st))):
            raise NotPlain(22, "not a plain file (a regular file outside /proc and /sys)", path)
        if truncate and st.st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


HOWS = {}  # (flags, mode) -> its struct open_how; "call": the typed syscall (made on first use: ~55 us of
          # ctypes that a sandbox's start would otherwise pay before its first request)


def openat2_call():
    call = HOWS.get("call")
    if call is None:
        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

        # syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how)
        call = HOWS["call"] = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_char_p,
                                               ctypes.c_void_p, ctypes.c_size_t, use_errno=True)(("syscall", LIBC))
        HOWS["struct"] = OpenHow
    return call


def inside(path):
    full = os.path.normpath(os.path.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


def op_write(req):
    """Write files into the workspace (their directories made first). Raw descriptors, and no
    directory made for a file directly in the workspace (a bash one-shot's ``main.sh``: the
    runner's CPU before a bash run's op, this write most of it, 77 -> 43 us per run at c=8 on
    the 2-core VM, issue 26); the mode of ``open(path, "wb")``, a regular file only (``open_plain``),
    truncated once that is known."""
    for path, data in (req.get("files") or {}).items():
        full = inside(path)
        parent = os.path.dirname(full)
        if parent != WORKSPACE:
            os.makedirs(parent, exist_ok=True)
        fd = open_plain(full, os.O_WRONLY | os.O_CREAT, truncate=True)
        try:
            write_all(fd, unb64(data))
        finally:
            os.close(fd)
    return {}


#: all the files one read returns, together (each is capped at ``max_bytes``, 16 MiB): the answer is
#: one line of the host's channel (64 MiB), base64 a third larger; four 14 MiB files overflowed it,
#: and the run a program's own files made ended ``infra_error``
READ_TOTAL = 40 << 20


def read_past(fd, limit):
    """At most ``limit`` + 1 bytes of ``fd``: the byte past ``limit`` says whether it was cut."""
    chunks, got = [], 0
    while got <= limit:
        chunk = os.read(fd, limit + 1 - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def op_read(req):
    """The files at ``paths`` (workspace-relative), each cut at ``max_bytes`` and all of them at
    ``READ_TOTAL`` together (``cut`` names those cut); what is not a regular file is ``missing``,
    never read (a FIFO blocked the read until the run's deadline, /dev/zero gave 16 MiB)."""
    limit = int(req.get("max_bytes") or 1 << 24)
    left = READ_TOTAL
    files, missing, cut = {}, [], []
    for path in req.get("paths") or []:
        try:
            fd = open_plain(inside(path), os.O_RDONLY)  # a FIFO, a device, a link to /proc/1: missing
        except (OSError, ValueError):
            missing.append(path)
            continue
        try:
            want = min(limit, left)
            data = read_past(fd, want)
            if len(data) > want:
                data = data[:want]
                cut.append(path)
            left -= len(data)
            files[path] = b64(data)
        except OSError:
            missing.append(path)
        finally:
            os.close(fd)
    return {"files": files, "missing": missing, **({"cut": cut} if cut else {})}


#: the most entries one ``fs`` list answers, and the most bytes of their names (the answer is one
#: line of the host's channel, 64 MiB: 10,000 links of 4 KB targets under a deep path overflowed it)
LIST_MAX = 10000
LIST_BYTES = 32 << 20


class FsError(Exception):
    """A filesystem call's failure that is the caller's: ``(code, message)``."""


def shown(name):
    """A name as the host shows it: bytes that are not UTF-8 (kept by ``os`` as lone surrogates)
    become U+FFFD, as envd's JSON has them (an answer with a lone surrogate could not be sent at
    all: a file named b'bad\\xff' made the whole workspace unlistable)."""
    return name if name.isascii() else name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def fs_node(path, follow=False):
    """An ``O_PATH`` descriptor of ``path`` (of a link itself unless ``follow``), reached without
    magic links and refused on a pseudo file system: nothing of /proc/1 the sandbox's own code
    could not see (``list /proc/1/map_files``, ``stat /proc/1/fd/4`` did, through this process)."""
    return not_pseudo(open_no_magic(path, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), 0), path)


def not_pseudo(fd, path):
    """``fd``, or ``NotPlain`` (``fd`` closed) when it is on a pseudo file system."""
    if os.fstat(fd).st_dev in pseudo_devs():
        os.close(fd)
        raise NotPlain(1, "on /proc or /sys: not shown through this API (a command can look)", path)
    return fd


def fs_entry(path):
    """What the host shows of ``path``: a link is listed as itself, with the kind, size and
    mode of what it points to when that can be reached."""
    fd = fs_node(path)
    try:
        st = os.fstat(fd)
        link = None
        if (st.st_mode & 0o170000) == 0o120000:
            link = shown(os.readlink("", dir_fd=fd))
            try:
                target = fs_node(path, follow=True)
            except OSError:
                pass
            else:
                st = os.fstat(target)
                os.close(target)
    finally:
        os.close(fd)
    return {"path": shown(path), "mode": st.st_mode, "size": st.st_size, "mtime": st.st_mtime, "link": link}


def fs_stat(req, path):
    return {"entry": fs_entry(path)}


def fs_list(req, path):
    """Entries to ``depth`` levels, walked level by level (no recursion: a tree a thousand deep
    was a RecursionError), each directory opened as ``fs_node`` reaches it and never one on a
    pseudo file system."""
    depth, found, size = max(1, int(req.get("depth") or 1)), [], 0
    todo = [(path, 1)]
    while todo:
        d, level = todo.pop()
        try:
            fd = not_pseudo(open_no_magic(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0), d)
        except NotADirectoryError:
            if level == 1:  # the path asked for (only it is at level 1)
                raise FsError("invalid", f"path {shown(path)} is not a directory") from None
            continue
        except OSError:  # (NotPlain among them: below, a pseudo file system is skipped)
            if level == 1:
                raise
            continue
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        below = []
        for name in names:
            full = os.path.join(d, name)
            try:
                e = fs_entry(full)
            except OSError:  # gone meanwhile, or on a pseudo file system
                continue
            size += len(e["path"]) + len(e["link"] or "") + 120
            if len(found) == LIST_MAX or size > LIST_BYTES:
                raise FsError("too_many", f"path {shown(path)}: more than {LIST_MAX} entries or {LIST_BYTES >> 20} MB "
                                          "of names, list it with a smaller depth")
            found.append(e)
            if level < depth and e["link"] is None and (e["mode"] & 0o170000) == 0o040000:
                below.append((full, level + 1))
        todo.extend(reversed(below))
    return {"entries": found}


def fs_mkdir(req, path):
    if os.path.lexists(path):
        raise FsError("exists", f"path {shown(path)} already exists")
    os.makedirs(path)
    return {"entry": fs_entry(path)}


def fs_remove(req, path):
    fd = fs_node(path)
    try:
        is_dir = (os.fstat(fd).st_mode & 0o170000) == 0o040000
    finally:
        os.close(fd)
    if not is_dir:
        os.unlink(path)
        return {}
    top = open_no_magic(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0)
    stack = [(top, None, None, os.listdir(top))]  # (directory, its parent's descriptor, its name there, left)
    try:
        while stack:
            fd, up, here, left = stack[-1]
            if left:  # one entry at a time, a directory one level down (no recursion: a tree a
                name = left.pop()  # thousand deep was a RecursionError, the tree left half removed)
                if (os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode & 0o170000) != 0o040000:
                    os.unlink(name, dir_fd=fd)
                    continue
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                stack.append((sub, fd, name, None))
                stack[-1] = (sub, fd, name, os.listdir(sub))
                continue
            stack.pop()
            os.close(fd)
            if up is not None:
                os.rmdir(here, dir_fd=up)
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)
    os.rmdir(path)
    return {}


def fs_move(req, path):
    dst = req.get("destination")
    if not isinstance(dst, str) or not dst.startswith("/"):
        raise FsError("invalid", "destination: an absolute path is expected")
    os.close(fs_node(path))  # it exists, and not on /proc or /sys
    parent = os.path.dirname(dst)
    if parent:
        os.makedirs(parent, exist_ok=True)
    os.rename(path, dst)
    return {"entry": fs_entry(dst)}


def fs_read(req, path):
    if os.path.isdir(path):
        raise FsError("invalid", f"path {shown(path)} is a directory")
    limit = min(int(req.get("max_bytes") or 1 << 24), READ_TOTAL)  # one answer line carries this much
    fd = open_plain(path, os.O_RDONLY)
    try:
        data = read_past(fd, limit)
    finally:
        os.close(fd)
    return {"data": b64(data[:limit]), "cut": len(data) > limit}


def fs_write(req, path):
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fd = open_plain(path, os.O_WRONLY | os.O_CREAT, truncate=True)
    try:
        write_all(fd, unb64(req.get("data")))
    finally:
        os.close(fd)
    return {"entry": fs_entry(path)}


FS_CALLS = {"stat": fs_stat, "list": fs_list, "mkdir": fs_mkdir, "remove": fs_remove, "move": fs_move,
            "read": fs_read, "write": fs_write}


def op_fs(req):
    """One filesystem call for the host (the E2B API's files: ``server/e2b/files.py``) on an
    absolute path as the sandbox sees it, carried out here, in the sandbox's trusted agent. Not in
    the session's interpreter or shell: the user's code runs there and can replace what runs
    (a cell that patched ``os.lstat``, or a shell function named ``base64``, answered every later
    call). Files are opened as the host's reads and writes are (``open_plain``). The answer is
    ``{"fs": ...}``, or ``{"fs_error": [code, message]}`` for a failure that is the caller's."""
    call, path = FS_CALLS.get(req.get("call")), req.get("path")
    if call is None or not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        return {"fs_error": ["invalid", f"no filesystem call {req.get('call')!r} on {path!r}"]}
    try:
        return {"fs": call(req, path)}
    except FsError as e:
        return {"fs_error": list(e.args)}
    except FileNotFoundError as e:
        return {"fs_error": ["not_found", f"path {shown(str(e.filename or path))} does not exist"]}
    except FileExistsError as e:
        return {"fs_error": ["exists", f"path {shown(str(e.filename or path))} already exists"]}
    except NotPlain as e:
        return {"fs_error": ["invalid", f"path {shown(path)}: {e.strerror}"]}
    except PermissionError as e:
        return {"fs_error": ["denied", f"path {shown(str(e.filename or path))}: {e.strerror}"]}
    except OSError as e:
        return {"fs_error": ["invalid", f"path {shown(str(e.filename or path))}: {e.strerror or e}"]}


SHELL = {}


SHELL_USED = []  # a step of the session's own ran in the shell (not only the pool's ``prestart``)


def op_shell(req):
    """A step of the session's persistent shell (shell.py, loaded on first use)."""
    if not req.get("prestart") and not SHELL_USED:
        SHELL_USED.append(True)
    if not SHELL:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shell.py")
        with open(path) as fh:
            exec(compile(fh.read(), path, "exec"), SHELL)
        SHELL["STATE"]["keep"] = KEEP
    return SHELL["step"](req, env_for(req), WORKSPACE, (PROTO_IN, PROTO_OUT), reap_strays, b64, unb64,
                         read_message, HELD.append)


# -- recycling --------------------------------------------------------------------------------------

SNAPSHOT = {}
MACHINE = os.uname().machine
#: seccomp's view of the architecture (``AUDIT_ARCH_*``) and the keyring system calls' numbers there
KEYRING_CALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}
#: the 32-bit calls the same kernel takes: i386's (int 0x80) on x86_64, AArch32's (EABI) on aarch64
COMPAT_CALLS = {"x86_64": (0x40000003, (286, 287, 288)), "aarch64": (0x40000028, (309, 310, 311))}
SECCOMP_CALL = {"x86_64": 317, "aarch64": 277}  # seccomp(2): for SECCOMP_FILTER_FLAG_SPEC_ALLOW
X32_BIT = 0x40000000  # x32 system calls on x86_64: refused whole (no interpreter here uses them)
KEYCTL = KEYRING_CALLS[MACHINE][1][2] if MACHINE in KEYRING_CALLS else None  # keyctl(2) here, if known


#: the ``/proc`` files the reset reads after every one-shot (the runner's and the zygote's stat and
#: limits, the zygote's status), held open by path: a read is then one ``pread`` at offset 0 (the
#: kernel writes the text afresh at every read) instead of an open, two reads and a close: a bash
#: one-shot's system calls in the runner 108 -> 93 (issue 26, seventeenth round). A held file belongs to
#: the process it was opened for: once that one has ended its reads fail (ESRCH), where opening the
#: path again could reach a process that has taken the number since. Never in a process forked
#: from this runner (``close_held``): they are close-on-exec, and the forks that run no exec (the
#: zygote, a run's child without one, a session's interpreter without one) close them.
PROC_HELD = {}


def close_held():
    """In a child forked from the runner that does not exec: the runner's held ``/proc`` files go."""
    for fd in PROC_HELD.values():
        os.close(fd)
    PROC_HELD.clear()


def read_proc(path, hold=False):
    """A ``/proc`` file's bytes, read raw (``open()``'s text stack cost ~7 us more a file: the
    reset reads five of them per one-shot); ``hold``: from a descriptor kept open (``PROC_HELD``)."""
    if hold:
        fd = PROC_HELD.get(path)
        if fd is None:
            fd = PROC_HELD[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        data = os.pread(fd, 65536, 0)
        if len(data) < 65536:  # (all of it: none of these files is near that long)
            return data
    fd = os.open(path, os.O_RDONLY)
    try:
        data = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return data
            data += chunk
    finally:
        os.close(fd)


def process_state(pid):
    """What a same-uid process could change about ``pid`` without ptrace: rlimits (prlimit),
    nice and scheduling policy, CPU affinity; whether it is stopped; and whether it is on its way
    out. A one-shot's ``kill -9 -1`` killed the zygote, and the reset right after its answer still
    found it in /proc (a SIGKILL pending, or exiting): the sandbox was kept, and the next python
    one-shot there failed ``infra_error`` ("the zygote is gone")."""
    f = read_proc(f"/proc/{pid}/stat", hold=True).rsplit(b")", 1)[1].split()
    return {"limits": read_proc(f"/proc/{pid}/limits", hold=True), "nice": f[16], "policy": f[38],
            "cpus": sorted(os.sched_getaffinity(pid)), "stopped": f[0] in (b"T", b"t"),
            # from the same read; a SIGKILL pending is one more (``sigkill_pending``), asked by the
            # reset for the zygote only: this runner, reading, has none
            "ending": f[0] in (b"Z", b"X", b"x") or bool(int(f[6]) & PF_EXITING)}


PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the process is exiting (bench/cpu.py's ``_exiting`` reads
# the same three signs on the host: this module runs alone inside a sandbox and shares no import)


def sigkill_pending(pid):
    """Whether a SIGKILL waits for ``pid`` (its thread's or its process's pending signals)."""
    for line in read_proc(f"/proc/{pid}/status", hold=True).splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & (1 << (SIGKILL - 1)):
            return True
    return False


def snapshot():
    SNAPSHOT[os.getpid()] = process_state(os.getpid())


def wipe(path):
    """Remove everything under ``path`` (entries the user's code made unreadable included);
    whether there was anything to remove."""
    found = False
    for entry in os.scandir(path):
        found = True
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            wipe(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)
    return found


#: (cmd, offset of the count in the answer): SHM_INFO's ``used_ids``, MSG_INFO's ``msgpool``,
#: SEM_INFO's ``semusz``: how many objects of each kind this IPC namespace holds
IPC_COUNTS = (("shm", 14, 0), ("msg", 12, 0), ("sem", 19, 28))
IPC_BUF = [None]


def ipc_count():
    """How many System V IPC objects this IPC namespace holds (three system calls: a reset after
    a run that made none reads no ``/proc/sysvipc`` file); None when it cannot be told."""
    if LIBC is None:
        return None
    buf = IPC_BUF[0] = IPC_BUF[0] or ctypes.create_string_buffer(256)  # the kernel writes each answer whole
    total = 0
    for kind, cmd, at in IPC_COUNTS:
        if kind == "sem":
            ret = LIBC.semctl(0, 0, cmd, buf)
        else:
            ret = (LIBC.shmctl if kind == "shm" else LIBC.msgctl)(0, cmd, buf)
        if ret < 0:
            return None
        total += int.from_bytes(buf.raw[at:at + 4], "little")
    return total


def ipc_clear():
    """Remove every System V IPC object of this sandbox's IPC namespace (they outlive processes).
    Counted first (``ipc_count``): nothing to remove when the namespace holds none, which is
    every reset but those after a run that made some (issue 26: the three ``/proc/sysvipc``
    reads were ~90 us of the reset's ~440 us of CPU per trivial one-shot at c=8, the counts
    cost ~2 us)."""
    if LIBC is None:
        return 1  # cannot look: not verifiably clean
    if ipc_count() == 0:
        return 0
    left = 0
    for kind, ctl in (("shm", LIBC.shmctl), ("msg", LIBC.msgctl), ("sem", LIBC.semctl)):
        try:
            rows = read_proc(f"/proc/sysvipc/{kind}").decode("ascii", "replace").splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            ident = int(row.split()[1])
            if (ctl(ident, 0, 0, 0) if kind == "sem" else ctl(ident, 0, None)) != 0:  # IPC_RMID
                left += 1
    return left or (ipc_count() or 0)


KEYS_GC_S = 1.0  # how long a reset waits for the keys it unlinked to be destroyed


#: the user and user-session keyrings' serials (KEYCTL_GET_KEYRING_ID): fixed for the sandbox's user
#: namespace, asked once
RING_IDS = {}


#: whether this sandbox's processes are refused the keyring system calls (``deny_keyrings``)
KEYS_DENIED = [False]


def deny_keyrings():
    """Refuse ``add_key``, ``request_key`` and ``keyctl`` (EPERM) to this process and everything
    it starts, by a seccomp filter installed before the zygote exists. The kernel's keyrings are
    not namespaced and every sandbox runs as the same host user: a key one sandbox added was
    listed (description, serial) in ``/proc/keys`` of every sandbox running at the same time, a
    channel between concurrent one-shots that no reset can close; container runtimes' default
    seccomp profiles refuse these calls for the same reason. The filter checks the native calls,
    the 32-bit ones the same kernel takes (i386's, AArch32's) and x32's; it refuses every call of
    an architecture it does not know. True when it is in place (a machine not listed here, or a
    kernel without seccomp: False, and the reset goes on emptying the keyrings as before)."""
    if LIBC is None:
        return False
    import struct
    arch = KEYRING_CALLS.get(MACHINE)
    if arch is None:
        return False
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM

    def calls(numbers, x32):
        """nr (loaded) in ``numbers`` (or an x32 call): deny, else allow."""
        out = [(jge, 0, 1, X32_BIT), (ret, 0, 0, deny)] if x32 else []
        for k, n in enumerate(numbers):
            out.append((jeq, len(numbers) - k, 0, n))  # to the deny at the end
        return out + [(ret, 0, 0, allow), (ret, 0, 0, deny)]

    compat = COMPAT_CALLS[MACHINE]
    native = [(ld, 0, 0, 0)] + calls(arch[1], MACHINE == "x86_64")
    other = [(ld, 0, 0, 0)] + calls(compat[1], False)
    # native calls, then the same kernel's 32-bit ones; any other architecture (none a program here
    # can use) is refused whole rather than let through unchecked
    program = ([(ld, 0, 0, 4), (jeq, 0, len(native), arch[0])] + native
               + [(jeq, 0, len(other), compat[0])] + other + [(ret, 0, 0, deny)])
    blob = b"".join(struct.pack("=HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(blob, len(blob))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(program), ctypes.addressof(buf))
    ul = ctypes.c_ulong
    if LIBC.prctl(ctypes.c_int(38), ul(1), ul(0), ul(0), ul(0)) != 0:  # PR_SET_NO_NEW_PRIVS: required unprivileged
        return False
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_SPEC_ALLOW: before Linux 5.16 installing a
    # filter also forced the speculative store bypass mitigation on every process of the sandbox
    # (slower user code); the flag keeps the host's choice. Without the seccomp call, prctl's.
    if LIBC.syscall(ctypes.c_long(SECCOMP_CALL[MACHINE]), ul(1), ul(1 << 2), ctypes.c_void_p(ctypes.addressof(prog))) == 0:
        return True
    return LIBC.prctl(ctypes.c_int(22), ul(2), ctypes.c_void_p(ctypes.addressof(prog)), ul(0),
                      ul(0)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def keys_clear():
    """Empty the keyrings that outlive a process: the user's, the user-session and persistent ones.
    Each is read first and cleared only when it holds something (the user's holds the persistent
    one once it was asked for, and a fresh sandbox's holds nothing: it is cleared after every run);
    the keys a clear unlinked are then waited for until the kernel's key garbage collector has
    destroyed them (``keys_gone``)."""
    if KEYS_DENIED[0]:
        return True  # no process of this sandbox could add a key (``deny_keyrings``)
    if LIBC is None or KEYCTL is None:
        return False  # cannot clear them here (no ctypes, or an architecture we have no syscall number for)
    ok = True
    c = ctypes.c_long
    op, read = c(KEYCTL), c(11)
    rings = []
    persistent = LIBC.syscall(op, c(22), c(-1), c(-4))  # KEYCTL_GET_PERSISTENT, linked to @u
    if persistent > 0:
        rings.append(persistent)
    rings += [-4, -5]  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    unlinked = []
    ours = None
    for ring in rings:
        size = LIBC.syscall(op, read, c(ring), None, c(0))  # KEYCTL_READ: 4 bytes a linked key
        if size == 0:  # empty: nothing to clear
            continue
        if ours is None:  # (the persistent one is by its serial: not searchable, it has no ID to ask)
            if not RING_IDS:
                RING_IDS.update({r: LIBC.syscall(op, c(0), c(r), c(0)) & 0xFFFFFFFF for r in (-4, -5)})
            ours = {persistent & 0xFFFFFFFF, *RING_IDS.values()}
        if size > 0:
            buf = ctypes.create_string_buffer(size)
            got = LIBC.syscall(op, read, c(ring), buf, c(size))
            unlinked += [int.from_bytes(buf.raw[i:i + 4], sys.byteorder) for i in range(0, max(0, min(got, size)), 4)]
        if LIBC.syscall(op, c(7), c(ring)) != 0 and ctypes.get_errno() not in (38, 1, 13, 126):
            ok = False  # KEYCTL_CLEAR failed for another reason than "no keyrings here"
        size = LIBC.syscall(op, read, c(ring), None, c(0))
        if size > 0:
            ok = False
    # the keyrings themselves are linked into each other (the user's into the user-session one, the
    # persistent one into the user's by KEYCTL_GET_PERSISTENT above): they live on, only what a run
    # added must go
    unlinked = [serial for serial in unlinked if serial not in (ours or ())]
    return ok and (not unlinked or keys_gone(unlinked))


def keys_gone(serials, timeout_s=KEYS_GC_S):
    """Whether the keys ``serials`` are gone from ``/proc/keys``, waiting for it. An unlinked key
    is destroyed by the kernel's garbage collector, asynchronously: on the 2-core VM it stayed
    listed 10-20 ms after its keyring's clear, its description readable there by the next run
    (tests/test_rest.py's recycled-session test failed 5 of 12 runs on main for it)."""
    wanted = {b"%08x" % serial for serial in serials}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = {row.split(None, 1)[0] for row in read_proc("/proc/keys").splitlines() if row}
        except OSError:  # no /proc/keys here: nothing lists them
            return True
        if not wanted & listed:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)


def op_reset(req):
    """Make this one-shot sandbox pristine for the next one, and check it: no process but us and
    the zygote, every writable place (``req["dirs"]``: path -> mode) empty with its mode back and
    no extended attributes, no System V IPC object, empty keyrings, and our and the zygote's
    rlimits, priority and affinity as they were at start. ``clean`` False: discard the sandbox."""
    why = []
    drop_bash_ahead()  # (a reset with no run since the last: a new one is started below)
    end_session()  # a session's sandbox: its interpreter and shell go first (nothing in a one-shot's)
    if TAINTED[0]:
        why.append(TAINTED[0])
    reaped, REAPED[0] = REAPED[0], False
    if not reaped and not reap_strays():
        why.append("processes survived the reaping")
    for path, mode in (req.get("dirs") or {}).items():
        try:
            os.chmod(path, mode)
            had = wipe(path)
            for name in os.listxattr(path):
                os.removexattr(path, name)
            os.utime(path)
            if had and os.listdir(path):  # (no process is left to make an entry since wipe's scan)
                why.append(f"{path} is not empty")
        except OSError as e:
            why.append(f"{path}: {e}")
    if ipc_clear():
        why.append("System V IPC objects are left")
    if not keys_clear():
        why.append("keyrings could not be emptied")
    for pid, want in SNAPSHOT.items():
        if ZYGOTE is None and pid != os.getpid():
            continue
        try:
            now = process_state(pid)
        except OSError:
            why.append(f"process {pid} is gone")
            continue
        if now["cpus"] != want["cpus"]:
            try:
                os.sched_setaffinity(pid, want["cpus"])
                now["cpus"] = want["cpus"]
            except OSError:
                pass
        if not want["ending"] and (now["ending"] or pid != os.getpid() and sigkill_pending(pid)):
            why.append(f"process {pid} was killed")
        changed = [k for k in want if now[k] != want[k] and k != "ending"]
        if changed:
            why.append(f"process {pid}: {', '.join(changed)} changed")
    if ZYGOTE is not None and ZYGOTE.broken:
        why.append(f"zygote: {ZYGOTE.broken}")
    if not why and req.get("prefork"):  # a session's sandbox: the next session's interpreter, forked now
        why += prefork_child()
    # the next is likely python too; never in a session's sandbox, whose zygote waits on the next
    # session's interpreter (review L1: asked to fork ahead then, it could not answer: discarded)
    if not why and ZYGOTE is not None and LAST[0] == "python" and req.get("ahead") and not SESSION:
        ZYGOTE.fork_ahead()
        if ZYGOTE.broken:
            why.append(f"zygote: {ZYGOTE.broken}")
    if not why and LAST[0] == "run" and LAST_RUN[0] is not None and req.get("ahead"):  # likewise a bash one-shot's
        start_bash_ahead(*LAST_RUN[0])
    return {"clean": not why, "why": "; ".join(why)}


# -- a session's interpreter: a child holding the namespace, so that the sandbox can be reused ------
# A session's cells run in a child forked from the zygote (``Zygote.serve``'s ``s``), not in this
# runner: the runner and the zygote then never run the session's code, and once the session has
# left (put to rest, ``op_rest`` + ``op_reset``) the sandbox is reset exactly as a one-shot's is and
# serves the next session (recycle.py, manager.py). The child gets two pipes (requests in, answers
# out) and nothing else of ours; it answers JSON lines, which this runner parses with ``json``
# (safe on hostile bytes), checks field by field and sends on in its own framing: nothing the
# session writes reaches the host's channel as it wrote it. Each request carries a nonce its answer
# must repeat (``child_call``). A child that dies, answers nonsense or out of turn, writes between
# requests or runs past its cell's timeout is ended, and the next step says its variables are gone
# (``LOST``). A cell can still forge its *own* step's answer (it runs in the process that answers):
# that is no more than printing what it likes; no other step's answer is ever affected.

CHILD = [None]  # the session's interpreter (a SessionChild), when one lives
LOST = [""]  # why the session's last interpreter ended, until a step has said so
TAINTED = [""]  # why this sandbox must never be reset for reuse (op_python), once it is so
CHILD_GRACE_S = 1.0  # past a cell's own timeout (its alarm, in the child), the runner ends the child
CHILD_LINE_MAX = 1 << 30  # a pack's answer (the namespace, fetched by the host in chunks) longer than this is nonsense
# a cell's answer longer than this could not reach the host anyway (it reads lines up to 64 MB): the
# runner stops buffering there (review M1: a cell writing 700 MB without a newline grew the runner to
# its sandbox's memory limit, OOM-killed: infra_error)
CELL_LINE_MAX = 60 << 20
REST_CHILD_S = 50.0  # packing or loading a namespace (the host gives the whole rest 60 s: rest.REST_TIMEOUT_S)
LATE_CELL = "did not stop at its cell's timeout and was ended"
LATE_PACK = "did not pack or load its state in time and was ended"
CELL_FIELDS = {"stdout": str, "stderr": str, "truncated": bool, "timed_out": bool, "exit_code": int,
               "duration_s": (int, float), "display": list, "raised": list}


def session_preload():
    """What a session's interpreter needs, imported once in the zygote (shared by every child
    forked from it): the cell's ``_ast``, its output threads, pickle for rest and wake."""
    import _ast  # noqa: F401
    import importlib  # noqa: F401
    import pickle  # noqa: F401
    import threading  # noqa: F401
    import types  # noqa: F401
    try:  # a cell's own steps once, on /dev/null: what they make lazily is then made here, not per child
        for _ in range(3):
            cell_here({"code": "_ = [i for i in range(3)]\ndel _", "timeout_s": 5, "max_output": 1024})
    except Exception:  # a saving only
        pass


def session_warm(fd_in):
    """In an interpreter forked ahead (a reset's prefork: no request waits for it yet), a wake's
    own steps once, a blob loaded and a cell run, so that its first writes to the zygote's pages (the
    copy-on-write faults of refcounts and lazily made state) are taken now, off the path of the
    session it will hold: a woken session's cell cost 1.0-1.6 ms in a just-forked interpreter
    against 0.7 ms in a warm one. Leaves nothing: the namespace, environment, path and directory
    are as they were, and nothing is written to the runner. Skipped when a request already waits
    (an interpreter started for a step: the step must not wait for it)."""
    if select.select([fd_in], [], [], 0)[0]:
        return
    names, environ, path, cwd = dict(NAMESPACE), dict(os.environ), list(sys.path), os.getcwd()
    try:
        load_here({"state": marshal.dumps({"ns": _rest_dump({"x": list(range(1000)), "y": "warm"}), "cwd": cwd,
                                            "environ": environ, "path": path}, 4)})
        cell_here({"code": "_ = [i for i in range(3)]\ndel _\n1 + 1", "timeout_s": 5, "max_output": 1024})
    except BaseException:  # a saving only
        pass
    finally:
        NAMESPACE.clear()
        NAMESPACE.update(names)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        try:
            os.chdir(cwd)
        except OSError:
            pass


def session_main(fd_in, fd_out):
    """The session's interpreter (in the child): one request at a time from the runner, until
    the pipe closes. Never returns."""
    try:
        OUT[0] = fd_out
        os.setsid()
        os.chdir(WORKSPACE)
        if LIBC is not None:
            LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # an ordinary process of the user's, as one-shots are
        ops = {"cell": cell_here, "pack": pack_here, "load": load_here}
        session_warm(fd_in)
        while True:
            req = read_message(fd_in)
            if req is None:
                break
            try:
                result = ops[req["op"]](req)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"[:1000]}
            result["nonce"] = req.get("nonce")  # whose answer this is (``child_call`` checks it)
            # "replace": a lone surrogate (``raise ValueError('\ud800')``) failed this encode and
            # ended the interpreter; it is now a "?"
            write_all(fd_out, (to_json(result) + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(0)


class SessionChild:
    """In the runner: the session's interpreter and the runner's ends of its pipes."""

    def __init__(self):
        req_r, self.req_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        if ZYGOTE is not None:
            ZYGOTE.settle()
            if ZYGOTE.ahead is not None:
                ZYGOTE.drop_ahead()
            fds = (req_r, ans_w)
            anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))]
            pid = ZYGOTE.reply("P", 10.0) if ZYGOTE.send(b"s", anc) else None
        else:  # no zygote (no bubblewrap, or an image's python without ctypes): never recycled
            pid = os.fork()
            if pid == 0:
                for fd in (self.req_w, self.ans_r, PROTO_IN, PROTO_OUT):
                    os.close(fd)
                close_held()
                session_main(req_r, ans_w)
        os.close(req_r)
        os.close(ans_w)
        if pid is None:
            self.close()
            raise RuntimeError(f"zygote: {ZYGOTE.broken}")
        self.pid = pid
        self.buf = bytearray()
        self.scanned = 0  # how much of ``buf`` holds no newline: each read is searched once
        self.used = False  # a request of the session's has reached it (a preforked one holds nothing yet)

    def stray(self):
        """Whether it wrote to the runner outside a request: a cell's own process holds the answer
        pipe and can write lines on it (a legitimate interpreter writes nothing between requests)."""
        return bool(self.buf) or bool(select.select([self.ans_r], [], [], 0)[0])

    def close(self):
        for fd in (self.req_w, self.ans_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait(self, kill):
        """Its wait status once it has ended (killed first with ``kill``); None if unknown."""
        if kill:
            try:
                os.kill(self.pid, SIGKILL)
            except OSError:
                pass
        if ZYGOTE is not None:
            return ZYGOTE.reply("S", 2.0)  # (a one-shot's owed status was settled before this child was forked)
        try:
            return os.waitpid(self.pid, 0)[1]
        except ChildProcessError:
            return None


def start_child():
    """The session's interpreter, started if none lives; the note a step reports when an earlier
    one had ended (its variables with it)."""
    note = ""
    if CHILD[0] is None:
        if LOST[0]:
            note = f"a new python interpreter: the session's earlier one {LOST[0]}, its variables are gone"
            LOST[0] = ""
        if "json" not in sys.modules:
            import json  # noqa: F401  (the child's answers are parsed with it: once per sandbox)
        CHILD[0] = SessionChild()
    return note


def prefork_child():
    """Fork the next session's interpreter now, in a sandbox no session holds (after a verified
    reset, or a fresh sandbox's warm-up): it holds only the zygote's memory until the session's
    first cell or wake. Returns what went wrong (a list, empty when nothing did)."""
    if CHILD[0] is not None or ZYGOTE is None or not SESSION:
        return []
    try:
        start_child()
    except (OSError, RuntimeError) as e:
        return [f"session interpreter: {e}"]
    return []


def end_child(why, kill=True):
    """End the session's interpreter (``why`` it ended: kept for the next step); its status."""
    child, CHILD[0] = CHILD[0], None
    if child is None:
        return None
    child.close()
    if not kill and _running(child.pid):  # it closed its end of the channel but lives on
        kill, why = True, "closed its channel to the runner and was ended"
    status = child.wait(kill)
    if not kill:
        if status is None:
            why = "ended"
        elif os.WIFSIGNALED(status):
            why = f"was killed by signal {os.WTERMSIG(status)}"
        else:
            why = f"exited with code {os.WEXITSTATUS(status)}"
    LOST[0] = why
    return status


def _running(pid, grace_s=0.1):
    """``pid`` still runs ``grace_s`` after its channel closed (a process that exits closes its
    descriptors a moment before it becomes a zombie; the session's interpreter is the zygote's
    child, so the runner cannot wait for it without blocking on the zygote's report)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return False
        except (OSError, IndexError):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.002)


def _json_line(line):
    import json

    def no_constant(name):
        raise ValueError(name)

    try:
        msg = json.loads(line, parse_constant=no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) else None


class Relay:
    """A streamed cell's output chunks, from its interpreter on to the host: at most ``limit``
    bytes a stream (its ``Capture`` keeps as much) and at most every ``CELL_COALESCE_S``, all
    kept bytes in order. The cell can write chunk lines on its answer pipe itself, past Capture's
    cap and coalescing: the runner relayed each one and the engine process parsed and decoded
    each on its event loop (review M3: 200k forged lines, 1.69 s of its CPU in 1.76 s); what
    passes here is bounded whatever the interpreter sends."""

    def __init__(self, limit):
        self.limit = limit
        self.sent = {"stdout": 0, "stderr": 0}
        self.pending = {"stdout": bytearray(), "stderr": bytearray()}
        self.held = False  # bytes are pending
        self.last = -CELL_COALESCE_S  # when chunks last went out: the first go at once (the usual
        # cell's one chunk, read just before its answer: held back, its streamed p50 was ~1.15x)

    def add(self, name, data):
        room = self.limit - self.sent[name]
        if room > 0 and data:
            data = data[:room]
            self.sent[name] += len(data)
            self.pending[name] += data
            self.held = True
            if self.due() <= 0:
                self.flush()

    def due(self):
        """Seconds until the pending bytes may go (None: none pending)."""
        return self.last + CELL_COALESCE_S - time.monotonic() if self.held else None

    def flush(self):
        for name, data in self.pending.items():
            if data:
                write_all(PROTO_OUT, (to_json({"stream": name, "data": b64(bytes(data))}) + "\n").encode())
                data.clear()
        if self.held:
            self.held, self.last = False, time.monotonic()


def child_call(req, timeout_s, relay=None, late=LATE_CELL, line_max=CELL_LINE_MAX):
    """``req`` to the session's interpreter; its answer (a dict), its streamed chunks sent on to
    the host through ``relay`` (a ``Relay``) if given. None when it died, answered nonsense or ran
    past ``timeout_s`` (it is then ended and ``LOST`` says why).

    The cell's code runs in that process and can write lines of its own on the answer pipe, even
    well-formed ones carrying this request's nonce (it can read its own request): such a line is
    taken as *this* request's answer only (the user's own step, as if it had printed it). Its real
    answer then comes with a nonce no later request has, or lies in the pipe before the next
    request: either ends the interpreter (review M4: a forged answer used to shift every later
    answer of the session by one step). So no step ever gets another step's answer."""
    child = CHILD[0]
    child.used = True
    if child.stray():
        end_child("wrote to the runner outside its answers")
        return None
    nonce = os.urandom(8).hex()
    data = marshal.dumps({**req, "nonce": nonce}, 4)
    data = memoryview(len(data).to_bytes(4, "little") + data)
    deadline = time.monotonic() + timeout_s
    os.set_blocking(child.req_w, False)
    while data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [child.req_w], [], left)[1]:
            end_child("did not read its request in time")
            return None
        try:
            data = data[os.write(child.req_w, data[:1 << 20]):]
        except BlockingIOError:
            continue
        except OSError:  # it is gone
            end_child("", kill=False)
            return None
    try:
        return _answer(child, nonce, deadline, relay, late, line_max)
    finally:
        if relay is not None:  # what the cell wrote before its end (or its timeout) goes before the answer
            relay.flush()


def _answer(child, nonce, deadline, relay, late, line_max):
    """``child_call``'s answer to the request ``nonce`` (or None, the child ended)."""
    while True:
        nl = child.buf.find(b"\n", child.scanned)
        child.scanned = len(child.buf) if nl < 0 else 0
        if nl >= 0:
            line = bytes(child.buf[:nl])
            del child.buf[:nl + 1]
            msg = _json_line(line)
            if msg is None:
                end_child("answered what is not an answer")
                return None
            if "stream" in msg:
                name, chunk = msg.get("stream"), msg.get("data")
                if name not in ("stdout", "stderr") or not isinstance(chunk, str):
                    end_child("sent a malformed output chunk")
                    return None
                if relay is not None:
                    try:
                        relay.add(name, unb64(chunk))
                    except binascii.Error:  # review M2: it escaped op_cell, the user's step became infra_error
                        end_child("sent a malformed output chunk")
                        return None
                continue
            if msg.get("nonce") != nonce:  # an answer to an earlier request (or none): out of turn
                end_child("answered out of turn")
                return None
            return msg
        due = None if relay is None else relay.due()
        if due is not None and due <= 0:
            relay.flush()
            due = None
        left = deadline - time.monotonic()
        if left <= 0:
            end_child(late)
            return None
        if not select.select([child.ans_r], [], [], left if due is None else min(left, due))[0]:
            continue
        chunk = os.read(child.ans_r, 1 << 20)
        if not chunk:
            end_child("", kill=False)
            return None
        child.buf += chunk
        if len(child.buf) > line_max:
            end_child("answered more than the runner takes")
            return None


def _text(value):
    """``value`` if it is a str, made encodable (a lone surrogate would fail the answer's encode)."""
    if not isinstance(value, str):
        raise ValueError("not a str")
    return value.encode("utf-8", "replace").decode("utf-8")


def _cell_parts(display, raised):
    """A cell answer's ``display`` and ``raised``, rebuilt element by element in the only shapes
    a cell makes (``cell_here``): display items are dicts of str to str, a raised exception is
    ``ename``, ``evalue`` and a traceback as a list of str. Anything else (a non-dict item, a
    value nested 600 deep that overflowed the runner's recursive ``to_json``: review H2) raises
    ValueError; nothing the interpreter wrote reaches the host as it wrote it."""
    shown, errors = [], []
    for d in display:
        if not isinstance(d, dict):
            raise ValueError("display")
        shown.append({_text(k): _text(v) for k, v in d.items()})
    for e in raised:
        if (not isinstance(e, dict) or set(e) != {"ename", "evalue", "traceback"}
                or not isinstance(e["traceback"], list)):
            raise ValueError("raised")
        errors.append({"ename": _text(e["ename"]), "evalue": _text(e["evalue"]),
                       "traceback": [_text(line) for line in e["traceback"]]})
    return shown, errors


def _zygote_ended():
    """Whether the zygote was ended or stopped: in a session's sandbox only the session's own
    code can do that (a signal to its interpreter's parent, or the memory it used)."""
    try:
        pid, _ = os.waitpid(ZYGOTE.pid, os.WNOHANG)
        return bool(pid) or process_state(ZYGOTE.pid)["stopped"]
    except (ChildProcessError, OSError, IndexError):  # reaped (reap_strays), or gone
        return True


def _no_interpreter(why, start):
    """A cell's answer when no session interpreter can be started here (review M5: the session's
    code killed the zygote, and every later python step was the runner's error, forever). It says
    ``broken``: the host replaces the sandbox, and the session's next step starts anew, saying its
    state was lost. The step is the user's failure when the session ended or stopped the zygote,
    the runner's error (infra_error) when the zygote lives but stopped answering."""
    if ZYGOTE is not None and _zygote_ended():
        return {"stdout": "", "stderr": "", "truncated": False, "timed_out": False, "exit_code": 1,
                "duration_s": time.monotonic() - start, "display": [], "raised": [], "broken": why,
                "note": "the session's code ended its sandbox's zygote (the template its python interpreters are "
                        "forked from): no python can run there; the next step starts in a new sandbox, "
                        "its files and variables are gone"}
    return {"error": f"RuntimeError: {why}", "broken": why}


def op_cell(req):
    """A step of the session's python: relayed to its interpreter, its answer checked field by
    field and rebuilt (``_cell_parts``): what reaches the host has only the shapes a cell makes."""
    start = time.monotonic()
    if CHILD[0] is not None and CHILD[0].stray():  # (``child_call``) a fresh interpreter runs this cell
        end_child("wrote to the runner outside its answers")
    try:
        note = start_child()
    except RuntimeError as e:  # the zygote is broken: no interpreter can be started in this sandbox
        return _no_interpreter(str(e), start)
    timeout_s = float(req.get("timeout_s") or 10)
    r = child_call({k: v for k, v in req.items() if k not in ("id", "files", "fetch")}, timeout_s + CHILD_GRACE_S,
                   relay=Relay(int(req.get("max_output") or 1 << 20)) if req.get("stream") else None)
    if r is not None and "error" not in r:
        try:
            for k, kind in CELL_FIELDS.items():
                if not isinstance(r.get(k), kind) or (kind is int and type(r[k]) is not int):
                    raise ValueError(k)
            result = {k: r[k] for k in CELL_FIELDS}
            result["stdout"], result["stderr"] = b64(unb64(r["stdout"])), b64(unb64(r["stderr"]))
            result["display"], result["raised"] = _cell_parts(r["display"], r["raised"])
            if not abs(r["duration_s"]) < 1e9:  # 1e400 parses as inf, which no JSON can carry to the host
                raise ValueError("duration_s")
        except (ValueError, TypeError, binascii.Error):
            end_child("answered a malformed result")
            r = None
    if r is not None and "error" in r:
        end_child("failed: " + str(r.get("error"))[:300])
        r = None
    if r is None:  # it ended: the step says so, and the next says its variables are gone
        timed_out = LOST[0] == LATE_CELL
        result = {"stdout": "", "stderr": "", "truncated": False, "timed_out": timed_out,
                  "exit_code": 1, "duration_s": time.monotonic() - start, "display": [], "raised": []}
        note = (note + "; " if note else "") + f"the session's python interpreter {LOST[0]}: its variables are gone"
    if note:
        result["note"] = note
    return result


# -- rest and wake: a session's python state and files to bytes, and back ---------------------------
# A session idle long enough is put to rest by its host (manager.py): ``rest`` packs its
# interpreter's namespace (``pack_here``, in the child: pickled; functions and classes defined in
# the session by their code, modules by name) and the sandbox's tmpfs files into one blob the host
# fetches in chunks and keeps on disk; the sandbox is then reset for another session (or killed).
# ``wake``, in a sandbox of the same kind, loads it back (the files here, the namespace in a new
# child). Only the standard library of the sandbox's own python is used: an image's python may not
# be the server's. What pickle cannot carry (open files, sockets, threads, generators, running
# processes) is named in ``dropped`` and is missing after the wake, never silently different.
# The runner never unpickles or unmarshals what the child packed: it carries it as bytes.

REST = {"blob": b"", "modules": set()}
REST_SKIP = ("__builtins__",)
REST_INLINE = 256 << 10  # a blob up to this size rides on the rest's own answer
REST_CHUNK = 4 << 20  # bytes per answer line (base64: ~5.6 MB; the host reads lines up to 64 MB)
# bash prints a script that re-creates its state: variables (not bash's own or read-only ones),
# functions, aliases, options, the directory. Traps and the job table are not carried (a step's
# background jobs are reaped when it ends anyway).
SHELL_SAVE = r"""for __v in $(compgen -v); do
  case $__v in BASH*|PPID|SHLVL|RANDOM|SRANDOM|SECONDS|LINENO|HISTCMD|FUNCNAME|GROUPS|PIPESTATUS|_|PWD|OLDPWD|\
    EPOCH*|UID|EUID|SHELLOPTS|COMP*|DIRSTACK|__v|__d|__f) continue;; esac
  __d=$(declare -p "$__v" 2>/dev/null) || continue
  __f=${__d#declare }; __f=${__f%% *}
  case $__f in *r*) continue;; esac
  printf '%s\n' "$__d"
done
declare -f; alias -p; shopt -p; set +o | grep -v -e monitor -e history -e emacs -e vi
printf 'cd -- %q\n' "$PWD"
"""


def _rest_fn(code, name, qualname, ncells):
    import types
    cells = tuple(types.CellType() for _ in range(ncells)) if ncells else None
    f = types.FunctionType(marshal.loads(code), NAMESPACE, name, None, cells)
    f.__qualname__ = qualname
    return f


def _rest_fn_fill(f, state):
    defaults, kwdefaults, cells, fdict, module, doc = state
    f.__defaults__, f.__kwdefaults__, f.__module__, f.__doc__ = defaults, kwdefaults, module, doc
    for cell, (full, value) in zip(f.__closure__ or (), cells):
        if full:
            cell.cell_contents = value
    f.__dict__.update(fdict)


def _rest_cls(meta, name, bases, slots):
    ns = {"__module__": "__main__"}
    if slots is not None:
        ns["__slots__"] = slots
    return meta(name, bases, ns)


def _rest_cls_fill(cls, attrs):
    for k, v in attrs.items():
        setattr(cls, k, v)


def _rest_pickler(buf):
    import pickle
    import types

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            t = type(obj)
            if t is types.ModuleType:
                REST["modules"].add(obj.__name__)
                return __import__("importlib").import_module, (obj.__name__,)
            if t is types.FunctionType and obj.__globals__ is NAMESPACE:
                cells = []
                for c in obj.__closure__ or ():
                    try:
                        cells.append((True, c.cell_contents))
                    except ValueError:
                        cells.append((False, None))
                return (_rest_fn, (marshal.dumps(obj.__code__), obj.__name__, obj.__qualname__, len(cells)),
                        (obj.__defaults__, obj.__kwdefaults__, tuple(cells), dict(obj.__dict__), obj.__module__,
                         obj.__doc__), None, None, _rest_fn_fill)
            if (isinstance(obj, type) and obj.__module__ == "__main__"
                    and getattr(sys.modules.get("__main__"), obj.__qualname__, None) is not obj):
                slots = obj.__dict__.get("__slots__")
                slots = (slots,) if isinstance(slots, str) else (tuple(slots) if slots is not None else None)
                attrs = {k: v for k, v in obj.__dict__.items()
                         if k not in ("__dict__", "__weakref__", "__slots__", "__module__") and k not in (slots or ())}
                return (_rest_cls, (type(obj), obj.__name__, obj.__bases__, slots), attrs, None, None, _rest_cls_fill)
            return NotImplemented

    return Pickler(buf, 4)


def _rest_dump(value):
    buf = io.BytesIO()
    _rest_pickler(buf).dump(value)
    return buf.getvalue()


#: the deepest directory a rest packs (the walk holds a descriptor per level): deeper is dropped, named
PACK_DEPTH = 256
_AT = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # an entry opened under its directory


def _pack(root):
    """The files under ``root``: [(relative path, kind, mode, mtime, data)], and what was left out.

    Walked by directory descriptors, each entry opened under its directory never following a link
    (``_AT``) and checked to be what its ``lstat`` said: the session's interpreter runs while its
    sandbox is packed, and a directory swapped for a link to /proc/1/fd between the listing and
    the read led this process (PID 1) into its own descriptors; a file leased by the sandbox's
    code is skipped (non-blocking), not waited on for the kernel's 45 s (an audit, 2026-11-29).
    Iterative: a tree a thousand directories deep is packed to ``PACK_DEPTH``, not a
    RecursionError that left the session awake for good."""
    import stat
    entries, skipped = [], {}
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return entries, {".": f"{type(e).__name__}: {e}"}
    stack = [(top, "", None)]
    while stack:
        fd, rel, names = stack[-1]
        if names is None:
            try:
                names = sorted(os.listdir(fd))
            except OSError as e:
                skipped[rel or "."] = f"{type(e).__name__}: {e}"
                names = []
            if not rel and root == "/tmp":  # the persistent shell's pipes (shell.DIR), whatever is there
                names = [n for n in names if n != ".tangram-shell"]
            names.reverse()
            stack[-1] = (fd, rel, names)
        if not names:
            os.close(fd)
            stack.pop()
            continue
        name = names.pop()
        path = f"{rel}/{name}" if rel else name
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                entries.append((path, "d", mode, st.st_mtime, b""))
                if len(stack) > PACK_DEPTH:
                    skipped[path + "/"] = f"deeper than {PACK_DEPTH} directories"
                    continue
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=fd)
                if _same(sub, st):
                    stack.append((sub, path, None))
                else:
                    os.close(sub)
                    skipped[path] = "changed while it was packed"
            elif stat.S_ISLNK(st.st_mode):
                entries.append((path, "l", mode, st.st_mtime, os.fsencode(os.readlink(name, dir_fd=fd))))
            elif stat.S_ISREG(st.st_mode):
                entries.append((path, "f", mode, st.st_mtime, _read_entry(fd, name, st)))
            else:
                skipped[path] = "not a regular file, directory or link"
        except OSError as e:
            skipped[path] = f"{type(e).__name__}: {e}"
    return entries, skipped


def _same(fd, st):
    """The descriptor is of the file ``st`` describes (nothing was swapped in between)."""
    got = os.fstat(fd)
    return got.st_ino == st.st_ino and got.st_dev == st.st_dev and (got.st_mode & 0o170000) == (st.st_mode & 0o170000)


def _read_entry(dir_fd, name, st):
    """A regular file's bytes, opened under its directory (made readable for the owner first if it
    was not, through a descriptor of the file itself, never a path)."""
    if not st.st_mode & 0o400:
        where = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not _same(where, st):
                raise OSError(16, "changed while it was packed", name)
            os.chmod(f"/proc/self/fd/{where}", (st.st_mode & 0o7777) | 0o400)
        finally:
            os.close(where)
    fd = os.open(name, os.O_RDONLY | _AT, dir_fd=dir_fd)
    try:
        if not _same(fd, st):
            raise OSError(16, "changed while it was packed", name)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _unpack(root, entries):
    """The packed files back under ``root``; what could not be made, by path.

    Made under directory descriptors, never through a link: directories and files first, each
    file created afresh (``O_EXCL``, not following a link), the links last, then the
    directories' modes, deepest first (a read-only directory after its files). A blob whose
    file sits under an entry packed as a link (a tree swapped while it was packed, or a blob
    of a runner before this check) had that file written through the link, into /proc/1/fd/4,
    the answer channel (an audit): such a file is now dropped, named."""
    import stat
    dropped, dirs, links = {}, [], []
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    opened = {"": top}

    def parent(path):
        """The descriptor of ``path``'s directory, each level opened without following a link."""
        head, _, name = path.rpartition("/")
        fd = opened.get(head)
        if fd is None:
            up, base = parent(head)
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=up)
            if len(opened) > 64:  # a descriptor per directory, not a thousand at once
                for k in [k for k in opened if k]:
                    os.close(opened.pop(k))
            opened[head] = fd
        return fd, name

    def clear(fd, name):
        """What the fresh sandbox has at ``name`` gives way (a directory stays: it is merged)."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=fd)

    try:
        for rel, kind, mode, mtime, data in entries:
            try:
                fd, name = parent(rel)
                if kind == "d":
                    clear(fd, name)
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    dirs.append((rel, mode, mtime))
                elif kind == "l":
                    links.append((rel, data))
                else:
                    clear(fd, name)
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _AT, 0o600, dir_fd=fd)
                    try:
                        write_all(f, data)
                        os.fchmod(f, mode)
                        os.utime(f, (mtime, mtime))
                    finally:
                        os.close(f)
            except (OSError, ValueError) as e:
                dropped[rel] = f"not restored: {type(e).__name__}: {e}"
        for rel, target in links:
            try:
                fd, name = parent(rel)
                clear(fd, name)
                os.symlink(os.fsdecode(target), name, dir_fd=fd)
            except (OSError, ValueError) as e:
                dropped[rel] = f"not restored: {type(e).__name__}: {e}"
        for rel, mode, mtime in reversed(dirs):
            try:
                fd, name = parent(rel)
                d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=fd)
                try:
                    os.fchmod(d, mode)
                    os.utime(d, (mtime, mtime))
                finally:
                    os.close(d)
            except (OSError, ValueError) as e:
                dropped.setdefault(rel, f"mode not restored: {type(e).__name__}: {e}")
    finally:
        for fd in opened.values():
            os.close(fd)
    return dropped


def _rest_root(token):
    """``workspace`` is this sandbox's workspace (its path differs between sandboxes without isolation)."""
    return WORKSPACE if token == "workspace" else token


def pack_here(req):
    """In the session's interpreter: its namespace, directory, environment and ``sys.path`` as
    one marshal blob (opaque to the runner), what could not be carried and the modules it holds."""
    state = {k: v for k, v in NAMESPACE.items() if k not in REST_SKIP}
    dropped = {}
    REST["modules"] = set()
    try:
        ns = _rest_dump(state)
    except BaseException:  # one value cannot be carried: find which, keep the others together
        keep = {}
        for k, v in state.items():
            try:
                _rest_dump(v)
                keep[k] = v
            except BaseException as e:
                dropped[k] = f"{type(e).__name__}: {e}"[:300]
        ns = _rest_dump(keep)
    blob = marshal.dumps({"ns": ns, "cwd": os.getcwd(), "environ": dict(os.environ), "path": list(sys.path)}, 4)
    return {"state": b64(blob), "dropped": dropped, "modules": sorted(REST["modules"])}


def load_here(req):
    """In a new session interpreter: a ``pack_here`` blob back in place."""
    state = marshal.loads(req["state"])
    dropped = {}
    try:
        import pickle
        ns = pickle.loads(state["ns"])
    except BaseException as e:
        ns = {}
        dropped["(namespace)"] = f"could not be loaded: {type(e).__name__}: {e}"[:300]
    NAMESPACE.update(ns)
    os.environ.clear()
    os.environ.update(state["environ"])
    sys.path[:] = state["path"]
    try:
        os.chdir(state["cwd"])
    except OSError as e:
        dropped["(cwd)"] = f"{state['cwd']}: {e}"
    return {"dropped": dropped, "names": len(ns)}


def _str_dict(value):
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def op_rest(req):
    """Pack this session (``roots``: the tmpfs directories whose files go with it, ``workspace``
    for the workspace) and answer its size and what cannot be carried; the host then fetches the
    blob with ``rest_chunk``. A session whose interpreter had ended packs no namespace and says so
    (``dropped["(namespace)"]``): its wake never looks like the state it lost."""
    dropped = {}
    child_state, modules = None, []
    if CHILD[0] is not None and CHILD[0].used:  # (one forked ahead holds nothing of the session's)
        r = child_call({"op": "pack"}, REST_CHILD_S, late=LATE_PACK, line_max=CHILD_LINE_MAX)
        ok = (r is not None and isinstance(r.get("state"), str) and _str_dict(r.get("dropped"))
              and isinstance(r.get("modules"), list) and all(isinstance(m, str) for m in r["modules"]))
        if ok:
            try:
                child_state = unb64(r["state"])
            except binascii.Error:
                ok = False
        if ok:
            dropped.update(r["dropped"])
            modules = r["modules"]
        else:
            if CHILD[0] is not None:
                end_child("answered a malformed state")
            child_state = None
    if child_state is None and LOST[0]:
        dropped["(namespace)"] = f"the session's python interpreter {LOST[0]} before its rest: its variables were lost"
    files = {}
    for token in req.get("roots") or ():
        root = _rest_root(token)
        entries, skipped = _pack(root)
        files[token] = entries
        for rel, why in skipped.items():
            dropped[os.path.join(root, rel)] = why
    shell = None
    if SHELL and SHELL_USED and SHELL["alive"]():  # a shell no step of the session used holds nothing
        if SHELL["STATE"]["name"] == "bash":
            r = op_shell({"command": SHELL_SAVE, "timeout_s": 10, "max_output": 16 << 20})
            if r.get("exit_code") == 0 and not r.get("truncated"):
                shell = unb64(r["stdout"])
        if shell is None:
            dropped["(shell)"] = "the persistent shell's variables, functions and directory end with its process"
    blob = marshal.dumps({"v": 2, "child": child_state, "files": files, "dropped": dropped, "shell": shell}, 4)
    REST["blob"] = blob
    answer = {"size": len(blob), "dropped": dropped, "modules": modules}
    if len(blob) <= REST_INLINE:  # most sessions: the blob in this answer, no ``rest_chunk`` round trip
        answer["data"] = b64(blob)
    return answer


def op_rest_chunk(req):
    off = int(req["offset"])
    return {"data": b64(REST["blob"][off:off + REST_CHUNK])}


def op_wake(req):
    """Append a chunk of a rested session's blob; with ``last``, load it: the files back in their
    tmpfs, the namespace in a new session interpreter (and what could not be carried, named)."""
    start = time.monotonic()
    REST["blob"] += unb64(req.get("data"))
    if not req.get("last"):
        return {}
    blob, REST["blob"] = REST["blob"], b""
    state = marshal.loads(blob)
    dropped = dict(state["dropped"])
    for token, entries in state["files"].items():
        root = _rest_root(token)
        dropped.update({os.path.join(root, rel): why for rel, why in _unpack(root, entries).items()})
    child_state = state.get("child")
    if "ns" in state:  # a blob of a runner before sessions had their own interpreter
        child_state = marshal.dumps({k: state[k] for k in ("ns", "cwd", "environ", "path")}, 4)
    names = 0
    if child_state is not None:
        if CHILD[0] is not None and CHILD[0].used:  # a sandbox for a wake is pristine: only defence
            end_child("was replaced by a woken session's")
        LOST[0] = ""
        start_child()
        r = child_call({"op": "load", "state": child_state}, REST_CHILD_S, late=LATE_PACK)
        if r is None or not _str_dict(r.get("dropped")) or type(r.get("names")) is not int:
            if CHILD[0] is not None:
                end_child("answered a malformed load")
            LOST[0] = ""  # said here, in what the wake dropped
            dropped["(namespace)"] = "could not be loaded: the session's python interpreter ended while loading it"
        else:
            dropped.update(r["dropped"])
            names = r["names"]
    if state.get("shell"):  # a new bash, brought to where the old one was
        r = op_shell({"command": state["shell"].decode("utf-8", "surrogateescape"), "timeout_s": 10})
        if r.get("error") or r.get("exit_code") != 0:
            why = r.get("error") or unb64(r.get("stderr")).decode(errors="replace").strip()[-300:]
            dropped["(shell)"] = f"its state was not restored in full: {why or r.get('note') or r.get('exit_code')}"
    answer = {"dropped": dropped, "names": names, "load_s": time.monotonic() - start}
    if req.get("then"):  # the step that woke the session: its cell, without another round trip
        answer["then"] = op_cell(req["then"])
        reap_strays()
    return answer


def op_warm(req):
    """Import what a session's first cell and a wake need, and the modules rested sessions use
    most, before this sandbox is taken: in a session sandbox into its zygote (every session
    interpreter forked from it shares them), elsewhere into this runner."""
    if SESSION and ZYGOTE is not None and not ZYGOTE.broken:
        ZYGOTE.settle()
        data = marshal.dumps([str(m) for m in req.get("modules") or ()], 4)
        failed = ZYGOTE.reply("W", 20.0) if ZYGOTE.send(b"w" + len(data).to_bytes(4, "little") + data) else None
        if failed is None:
            raise RuntimeError(f"zygote: {ZYGOTE.broken}")
        if "json" not in sys.modules:
            import json  # noqa: F401  (the runner parses its session interpreter's answers with it)
        if req.get("prefork"):
            why = prefork_child()
            if why:
                raise RuntimeError("; ".join(why))
        return {"failed": failed}
    import _ast  # noqa: F401  (these two: what a session's first cell imports, op_cell)
    import importlib
    import pickle  # noqa: F401
    import threading  # noqa: F401
    failed = []
    for name in req.get("modules") or ():
        try:
            importlib.import_module(name)
        except BaseException:
            failed.append(name)
    return {"failed": failed}


def end_session():
    """A session leaves this sandbox (``op_reset``): its interpreter, its shell and its packed
    blob go, and nothing of it is remembered (the next session starts as in a fresh sandbox)."""
    end_child("")
    LOST[0] = ""
    if SHELL:
        SHELL["stop"]()
    SHELL_USED.clear()
    REST["blob"] = b""
    REST["modules"] = set()
    if SESSION:  # (a one-shot sandbox's reset reads it next: its fork-ahead)
        LAST[0] = ""  # the last run's op: nothing of a session's leads the next session's sandbox


OPS = {"run": op_run, "shell": op_shell, "python": op_python, "cell": op_cell, "write": op_write, "read": op_read,
       "fs": op_fs, "reset": op_reset, "rest": op_rest, "rest_chunk": op_rest_chunk, "wake": op_wake,
       "warm": op_warm,
       "ping": lambda req: {"pid": os.getpid()}}


ZYGOTE = None
#: a request read by a shell step with a live stdin while it ran (the host never sends one then:
#: held all the same, to be the next one read)
HELD = []
LAST = [""]  # the last run's op: a reset after a python run forks the next child ahead
AHEAD_STAYS = ("python", "reset", "ping")  # requests that leave a child forked ahead alive


def batch():
    """Run this sandbox's processes (this runner, the zygote, every child: the policy is
    inherited, and the reset checks it is still this) as ``SCHED_BATCH``: same CPU share, but a
    wake-up of theirs never preempts the process that woke them. The host's process that writes
    a request to this runner (a sandbox worker, the engine process) runs unpinned; without this,
    when it ran on the CPU this sandbox is pinned to, the write handed that CPU to the sandbox at
    once, and the host's process, with every other sandbox it serves, waited for the run to end:
    a sandbox worker's request write took 1.2 ms of wall time for 25 us of CPU (2-core VM, 2
    workers, python one-shots at c=32). Where the scheduler ignores the policy, nothing changes."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def main():
    global ZYGOTE
    os.chdir(WORKSPACE)
    batch()
    if REAP:  # a sandbox (no isolation: the server's own user, whose keyrings are its business)
        KEYS_DENIED[0] = deny_keyrings()
    snapshot()
    if REAP and LIBC is not None:  # a session's sandbox too: its interpreter forks from it (SessionChild)
        ZYGOTE = Zygote()
        SNAPSHOT[ZYGOTE.pid] = process_state(ZYGOTE.pid)
    then = None
    while True:
        # a one-shot's reset may ride on its run (``then``): it runs right after the run's answer and
        # the reaping, answered under its own id, before anything else is read (issue 26: the host's
        # request for it cost the engine process a write and this runner a wake-up per one-shot)
        req, then = (then, None) if then is not None else (HELD.pop(0) if HELD else read_message(PROTO_IN), None)
        if req is None:
            return
        if req["op"] == "stdin":  # input for a step that has ended (it came as the step did): dropped,
            continue              # as a pipe's unread input is when its reader exits; never answered
        result = None
        if ZYGOTE is not None:  # the last python run's exit is over before anything else runs here
            ZYGOTE.settle()  # (its pid is spared by the reaping only until then)
        if ZYGOTE is not None and ZYGOTE.ahead is not None and req["op"] not in AHEAD_STAYS:
            ZYGOTE.drop_ahead()  # only a python run (its own child) may ever see it
        if BASH_AHEAD[0] is not None and req["op"] not in ("run", "reset", "ping"):
            drop_bash_ahead()  # likewise a bash started ahead: only the run it was started for (op_run)
        if req["op"] != "reset":
            REAPED[0] = False
        if req["op"] in ("run", "python"):
            LAST[0] = req["op"]
        if req.get("files") and req["op"] in ("run", "python"):  # one round trip: write, then run
            try:
                op_write(req)
            except Exception as e:
                result = {"files_error": f"{type(e).__name__}: {e}"}
        if result is None:
            try:
                result = OPS[req["op"]](req)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"}
        reap = req.get("reap", True) and req["op"] in ("run", "python", "cell", "shell")
        # a one-shot's strays are killed once its answer is out (issue 26: ~50 us of CPU off its
        # latency path), before this runner reads anything else; a session's, and those of a run
        # whose files are fetched, before it (its memory is measured after the step; the fetched
        # files are what the run left, not what its strays went on to write)
        late = reap and not SESSION and req["op"] in ("run", "python") and not req.get("fetch")
        if reap and not late:
            reap_strays()
        if req.get("fetch") and "error" not in result and "files_error" not in result:
            result["fetched"] = op_read({"paths": req["fetch"]})
        result["id"] = req.get("id")
        try:  # an answer that cannot be written is the runner's failure, said as such: never its end
            line = (to_json(result) + "\n").encode()  # (review H2: a RecursionError here ended PID 1)
        except Exception as e:
            line = (to_json({"error": f"answer not encodable: {type(e).__name__}", "id": req.get("id")}) + "\n").encode()
        write_all(PROTO_OUT, line)
        then = req.get("then") if req["op"] in ("run", "python") else None
        if not (isinstance(then, dict) and then.get("op") == "reset"):  # only a one-shot's reset rides
            then = None
        # a python child's pid is spared (``owed``) until the reset settles it, and a stray could
        # take that pid once the child is gone (review of issue 26, M2): the reset then reaps again,
        # after the settle. So this scan counts for the reset only if no pid was spared, and when
        # one was and the reset rides, it is left to the reset alone, right after (the same /proc
        # scan twice a python one-shot, ~38 us of CPU: 6 of the runner's ~91 system calls)
        if late and not (then is not None and ZYGOTE is not None and ZYGOTE.owed is not None):
            REAPED[0] = reap_strays() and (ZYGOTE is None or ZYGOTE.owed is None)


if __name__ == "__main__":
    main()
