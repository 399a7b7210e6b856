"""Processes: a one-shot's child and its output, the ``run`` operation, the bash started ahead,
the reaping of whatever a request left running, and what ``/proc`` says of a process.

A run's process group. Each run's process (a python one-shot's child, a bash, a program) leads a
process group of its own, which is what a timeout kills, in the agent's session (bubblewrap's
``--new-session``: no controlling terminal). It leads no session of its own: Linux gives every new
session an autogroup, a scheduler task group with a run queue entity on every CPU of the host, each
CPU's run queue locked to bring it online (whatever ``kernel.sched_autogroup_enabled`` says), which
on a many-CPU host made the most contended lock of a busy server. A group (``setpgid``) has none of
it. What the program can tell: ``os.getsid(0)`` is the agent's, and ``os.setsid()`` fails (a group
leader may not make a session). The sandbox boundary is the same either way: the reset kills every
process but the agent and the zygote, whatever group or session it is in.

A bash started ahead. A trivial bash one-shot (``bash main.sh``) spends most of its latency in
bash's exec, dynamic linking and start-up. The reset of a recycled sandbox whose last one-shot was
such a run therefore starts the next one's bash *ahead*, with the same argv and environment, and
holds it where a non-interactive bash reads its ``BASH_ENV`` file: before it opens its script. Its
``BASH_ENV`` is a pipe (``/dev/fd/3``) that the agent writes only when a run with exactly that argv,
environment, working directory and address space cap comes (the cap, SandboxFusion's
``memory_limit_MB``, is set on it by ``prlimit`` as it starts); what it writes (``bash_prologue``)
unsets ``BASH_ENV``, closes the pipe, restarts ``SECONDS`` and puts back ``$_``, so that the script
starts as under a fresh ``bash main.sh``: the same argv and ``$0``, the same environment for itself
and its children, stdin, cwd, process group (its own), signals, exit status, timeout and output cap.
(Its initial environment block, ``/proc/$$/environ``, still shows the ``BASH_ENV``: only the
shell's own, never what it exports.) Any other request first kills it. It is started after the
reset's checks and holds nothing of any run (a fresh exec, a workspace already wiped); it is spared
by the reaping as the zygote's child forked ahead is. An environment bash would read differently at
start (``BASH_ENV``, ``ENV``, ``POSIXLY_CORRECT``, ``SHELLOPTS``, ``BASHOPTS``, exported functions)
is never started ahead.
"""

import _signal
import os
import select
import time

from . import SIGINT, SIGKILL, SIGPIPE, SIGXFSZ, b64, print_exc, unb64, write_all

# what an exec'd program starts with at its default disposition, as Python's subprocess does
# (restore_signals): the agent ignores SIGINT (``inside.boot``) and SIGPIPE (Python's start-up),
# and `yes | head -1` must end quietly, as in a terminal and under SandboxFusion
RESTORED = (SIGINT, SIGPIPE, SIGXFSZ)
BASH_AHEAD_FD = 3
BASH_NOT_AHEAD = ("BASH_ENV", "ENV", "POSIXLY_CORRECT", "SHELLOPTS", "BASHOPTS", "PS4", "LOCPATH", "GCONV_PATH")
PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the process is exiting (bench/cpu.py's ``_exiting`` reads
# the same three signs on the host: this package runs alone inside a sandbox and shares no import)
SIGKILL_BIT = 1 << (SIGKILL - 1)  # in a mask of pending signals


def reap_strays(st, keep=()):
    """Kill every process of this sandbox but pid 1 (the namespace's init), the agent, the zygote
    (and its child forked ahead), the session's interpreter and shell and the bash started ahead;
    True when none is left (a fork bomb can outrun a few passes: the host then discards the sandbox
    instead of recycling it).

    While a session's interpreter lives (a session's step; never a reset, which ends the session
    first and promises the next user no process at all), a process found again after the first
    pass's SIGKILL that is irrevocably dying and whose parent is one of those kept here, not the
    agent, no longer counts (``dying``): it runs no code again, and as a zombie it goes only when
    that parent reaps it, which no retry here can hasten (a cell's ``Popen`` never waited for:
    every later step spun ~0.42 s on it and said False). What the agent itself reaps (its own
    children, and orphans, the agent being the namespace's init) is still waited for and reaped
    here, so none is left to the next step."""
    if not st.reap:
        return True
    z = st.zygote
    keep = {1, os.getpid(), *((z.pid, z.ahead, z.owed) if z else ()), *st.keep, *keep,  # owed: killed, exiting
            *((st.child.pid,) if st.child is not None else ()),
            *((st.bash_ahead[0],) if st.bash_ahead is not None else ())}
    parents = keep - {os.getpid()} if st.child is not None else None
    for attempt in range(20):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                if pid not in keep:
                    try:
                        os.kill(pid, SIGKILL)
                    except OSError:
                        pass
                    # (the first pass reads no stat: nothing it finds had been sent a SIGKILL yet)
                    if not (attempt and parents and dying(pid, parents)):
                        found = True
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not found:
            return True
        if parents and attempt == 0:  # the second pass comes at once: what the first found may be dying already
            continue
        time.sleep(0.002 * (attempt + (0 if parents else 1)))
    return False


def dying(pid, parents):
    """Whether ``pid`` is a child of one of ``parents`` that can never run code again: a zombie,
    exiting (``PF_EXITING``), or with a SIGKILL pending (sent, and the process not yet run to act
    on it: it dies before it returns to its code), and it has no other thread (a process whose
    main thread has exited while others run on reads as a zombie, its leader with the flag); or
    gone. Read from ``/proc/<pid>/stat`` after the last ``)`` (the name before it may hold spaces
    and parentheses): the state, the parent, the flags, the thread count and the thread's own
    pending signals (a SIGKILL to its process is put there for every thread)."""
    try:
        f = read_proc(None, f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
        return (int(f[1]) in parents and int(f[17]) <= 1
                and (f[0] in (b"Z", b"X", b"x") or bool(int(f[6]) & PF_EXITING) or bool(int(f[28]) & SIGKILL_BIT)))
    except (OSError, IndexError, ValueError):
        return True


def collect(child, out_fd, err_fd, in_fd, stdin, timeout_s, max_output, wait=None):
    """Feed stdin, read both streams up to the cap, kill the group at the deadline; ``wait``
    returns the child's wait status (default: waitpid, for the agent's own children). ``child``:
    the pid, or a call that returns it (asked only at the deadline: ``Zygote.run``)."""
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
    """What the agent does once the child exists, however it was made: drop the child's ends of
    the pipes, feed its stdin, read its output up to the cap until it ends or times out."""
    in_r, in_w, out_r, out_w, err_r, err_w = fds
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return finish(req, start, *collect(pid, out_r, err_r, in_w, unb64(req.get("stdin")),
                                       float(req.get("timeout_s") or 10), int(req.get("max_output") or 1 << 20)))


def spawn(st, req, body):
    """Fork a child in its own process group with fresh pipes; ``body`` runs in the child."""
    fds = in_r, in_w, out_r, out_w, err_r, err_w = pipes()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)  # a group of its own, not a session (the module's docstring)
            _signal.signal(SIGINT, _signal.SIG_DFL)
            if req.get("cpus"):  # no cgroups on the host: pin by affinity instead of cpuset
                os.sched_setaffinity(0, req["cpus"])
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, st.proto_in, st.proto_out):
                os.close(fd)
            st.close_held()  # (a python run without a zygote runs here, with no exec)
            os.chdir(req.get("cwd") or st.workspace)
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
    machine has is no limit (past 2**63 bytes ``setrlimit`` overflows, and the program failed)."""
    if limit and limit < 1 << 62:
        import resource
        for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            resource.setrlimit(res, (limit, resource.getrlimit(res)[1]))


def env_for(st, req):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": st.workspace, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    env.update(req.get("env") or {})
    return env


def op_run(st, req):
    argv = req["argv"]
    env = env_for(st, req)
    here = not (req.get("cpus") or req.get("cwd") not in (None, st.workspace))  # no per-run settings but rlimits
    limit = req.get("as_bytes") or None
    st.last_run = (list(argv), env, limit) if here and bash_ahead_fits(st, argv, env) else None
    if st.bash_ahead is not None:  # started by the reset for a run like the last one: this one, if it is
        result = take_bash_ahead(st, req, argv, env, limit) if here else drop_bash_ahead(st)
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

    return spawn(st, req, body)


def resolve(name, path):
    """``name`` looked up on the request's ``PATH`` (as ``execvpe`` does; ``posix_spawnp`` would
    use the agent's own PATH, which in an image's sandbox is not the image's)."""
    if "/" in name:
        return name
    for d in path.split(":"):
        full = os.path.join(d or ".", name)
        if os.access(full, os.X_OK) and not os.path.isdir(full):
            return full
    return None


def spawn_exec(req, argv, env):
    """``spawn`` for a program without per-run process settings, by ``posix_spawn``: glibc's
    vfork-and-exec copies none of this interpreter's page tables, which a ``fork`` does. None
    when it cannot be used here (the caller forks instead, which then reports whatever the
    failure was exactly as a fork does)."""
    path = resolve(argv[0], env.get("PATH", "")) if hasattr(os, "posix_spawn") else None
    if path is None:  # not found (or no posix_spawn): the fork path reports it
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


# -- a bash started ahead (the module's docstring) ---------------------------------------------------

def bash_ahead_fits(st, argv, env):
    """Whether a run of ``argv`` under ``env`` could be started ahead: bash running a script, in a
    one-shot sandbox of its own PID namespace, under an environment its start-up reads as usual."""
    return (st.reap and not st.session and len(argv) >= 2 and os.path.basename(argv[0]) == "bash"
            and not argv[1].startswith("-") and hasattr(os, "posix_spawn")
            and not any(k in BASH_NOT_AHEAD or k.startswith(("BASH_FUNC_", "LD_")) for k in env))


def bash_prologue(argv, env):
    """What the bash started ahead reads as its ``BASH_ENV``: undo what starting it ahead changed."""
    underscore = env.get("_", argv[0])  # $_ at a script's start: the environment's, else argv[0]
    return ("builtin unset BASH_ENV; exec %d<&-; SECONDS=0; : '%s'\n"
            % (BASH_AHEAD_FD, underscore.replace("'", "'\\''"))).encode()


def start_bash_ahead(st, argv, env, limit=None):
    """Start the next run's bash now, held before its script; nothing when it cannot be.
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
    st.bash_ahead = (pid, list(argv), dict(env), limit, in_w, out_r, err_r, ctl_w)
    if limit:
        try:
            import resource
            for res in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
                resource.prlimit(pid, res, (limit, resource.getrlimit(res)[1]))
        except (ImportError, OSError, ValueError):
            drop_bash_ahead(st)


def drop_bash_ahead(st):
    """Kill the bash started ahead (another request comes, or a reset starts another); None."""
    ahead, st.bash_ahead = st.bash_ahead, None
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


def take_bash_ahead(st, req, argv, env, limit):
    """Run this request in the bash started ahead if it is the same run and still waits; None
    otherwise (it is killed, and the caller starts one as usual)."""
    pid, a_argv, a_env, a_limit, in_w, out_r, err_r, ctl_w = st.bash_ahead
    try:
        waiting = a_argv == argv and a_env == env and a_limit == limit and os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        waiting = False
    if not waiting:
        return drop_bash_ahead(st)
    start = time.monotonic()
    try:
        write_all(ctl_w, bash_prologue(argv, env))
    except OSError:  # it ended meanwhile: killed, and this run is started as usual
        return drop_bash_ahead(st)
    st.bash_ahead = None  # this run's now
    os.close(ctl_w)
    return finish(req, start, *collect(pid, out_r, err_r, in_w, unb64(req.get("stdin")),
                                       float(req.get("timeout_s") or 10), int(req.get("max_output") or 1 << 20)))


# -- /proc --------------------------------------------------------------------------------------------
# The files the reset reads after every one-shot (the agent's and the zygote's stat and limits, the
# zygote's status) are held open by path: a read is then one ``pread`` at offset 0 (the kernel
# writes the text afresh at every read) instead of an open, two reads and a close. A held file
# belongs to the process it was opened for: once that one has ended its reads fail (ESRCH), where
# opening the path again could reach a process that has taken the number since. Never in a process
# forked from the agent (``State.close_held``): they are close-on-exec, and the forks that run no
# exec (the zygote, a run's child without one, a session's interpreter without one) close them.

def read_proc(st, path, hold=False):
    """A ``/proc`` file's bytes, read raw (``open()``'s text stack costs more: the reset reads five
    of them per one-shot); ``hold``: from a descriptor kept open (``State.proc_held``)."""
    if hold:
        fd = st.proc_held.get(path)
        if fd is None:
            fd = st.proc_held[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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


def process_state(st, pid):
    """What a same-uid process could change about ``pid`` without ptrace: rlimits (prlimit),
    nice and scheduling policy, CPU affinity; whether it is stopped; and whether it is on its way
    out (a one-shot's ``kill -9 -1`` kills the zygote, and the reset right after its answer may
    still find it in /proc, a SIGKILL pending or exiting: kept, the next python one-shot there
    would fail)."""
    f = read_proc(st, f"/proc/{pid}/stat", hold=True).rsplit(b")", 1)[1].split()
    return {"limits": read_proc(st, f"/proc/{pid}/limits", hold=True), "nice": f[16], "policy": f[38],
            "cpus": sorted(os.sched_getaffinity(pid)), "stopped": f[0] in (b"T", b"t"),
            # from the same read; a SIGKILL pending is one more (``sigkill_pending``), asked by the
            # reset for the zygote only: the agent, reading, has none
            "ending": f[0] in (b"Z", b"X", b"x") or bool(int(f[6]) & PF_EXITING)}


def sigkill_pending(st, pid):
    """Whether a SIGKILL waits for ``pid`` (its thread's or its process's pending signals)."""
    for line in read_proc(st, f"/proc/{pid}/status", hold=True).splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & (1 << (SIGKILL - 1)):
            return True
    return False
