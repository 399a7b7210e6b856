"""Python one-shots: the ``python`` operation, run in a child of the zygote (``Zygote``), a clean
template forked before the agent reads any request; without one, in a child of the agent or in a
new interpreter."""

import _signal
import _thread
import io
import marshal
import os
import select
import sys
import time

from . import (PR_GET_DUMPABLE, PR_SET_DUMPABLE, SIGINT, SIGKILL, print_exc, read_exact, read_message, stream, unb64,
               write_all)
from .procs import RESTORED, cap_address_space, collect, env_for, finish, spawn

try:
    import _socket
except ImportError:  # an image's minimal python: no zygote there (``inside.LIBC`` is None)
    _socket = None

RUN_FDS = 4  # a run's stdin, stdout, stderr and status pipe
#: at a run's deadline, how long its child's pid may still take to come (``Zygote.taken_by``): well
#: within the host's grace past the deadline (``SandboxConfig.grace_s``, 5 s), so a zygote that
#: never said is the agent's error, not the host's kill of a run that timed out
TAKEN_LATE_S = 2.0
LINGER_S = 1.0  # how long a child that reported its end waits for the agent's kill before it exits

#: the environment every one-shot gets beside its request's own (``SandboxManager._request_env``):
#: a warm-up sets the same names, so the run's environment grows no new entries (tests compare them)
RUN_ENV = {"TANGRAM_NUM_CPUS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

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


def op_python(st, req):
    if st.child is not None:  # a session's sandbox (a python one-shot with a trajectory: rare)
        if not st.child.used:  # one forked ahead holds nothing: the zygote is needed for this run
            from .sessions import end_child
            end_child(st, "")
            st.lost = ""
        else:  # the zygote waits on the session's interpreter: a new interpreter runs it, and the
            # sandbox is never reused
            st.tainted = "a python one-shot was forked from the runner (the session's interpreter held the zygote)"
            return python_fresh(st, req)
    if st.zygote is not None and st.child is None:
        return st.zygote.run(req)
    code = req["code"]
    env = env_for(st, req)
    return spawn(st, req, lambda: python_body(st, code, env))


def python_body(st, code, env, streams_made=False):
    """What a python one-shot child runs (after its descriptors are in place). ``streams_made``:
    ``sys.stdin``/``stdout``/``stderr`` are already streams on descriptors 0-2, made by ``warm``
    on pipes as the run's are (so not remade: half of a trivial run's stream setup)."""
    os.environ.clear()
    os.environ.update(env)
    if not streams_made:
        sys.stdin = stream(0, "r")
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), encoding="utf-8")
        sys.stderr = stream(2, "w")
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": st.builtins})
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass


def python_fresh(st, req):
    """A python one-shot run by a new interpreter (a fork of the agent that execs at once: none
    of the agent's memory reaches the program). For a session's sandbox whose interpreter holds
    the zygote: a child forked from the agent itself could read what the agent's heap still held
    of the sessions before (their cells' requests and answers, rest blobs)."""
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
        env = env_for(st, req)

        def body():
            for sig in RESTORED:
                _signal.signal(sig, _signal.SIG_DFL)
            os.set_inheritable(fd, True)
            os.execve(sys.executable, argv, env)

        return spawn(st, req, body)
    finally:
        os.close(fd)


class Zygote:
    """A clean template for python one-shots: forked before the agent reads any request, it forks
    one child per run and reports the child's pid and wait status; the child reads its own request
    from the socket, so no request ever enters the zygote's (or a later child's) memory.

    The next run's child may be forked *ahead* (``fork_ahead``, asked by the reset of a recycled
    sandbox whose last run was python, ``SandboxConfig.fork_ahead``): it waits on the socket for
    its descriptors and request, so the fork and a forked interpreter's page faults on its way back
    from ``fork`` (Python's at-fork handlers included) are paid off the run's latency path. It is
    forked after the reset's checks, from the zygote, and holds nothing but the zygote's memory; a
    non-python request kills it first, so no other run ever sees it. Messages to the agent are
    tagged (``P`` pid, ``S`` status, ``A`` taken): one out of turn breaks the zygote, and a broken
    zygote fails the reset (the sandbox is discarded).

    A trivial run's way through this class is kept short: the child reports its end on a status
    pipe and closes its streams before it exits (``child``: the teardown of its address space comes
    after the answer), a child forked ahead warms itself before it waits (``warm``), and the request
    travels with the run's descriptors in one message (the zygote reads only the byte that carries
    them; anything else there ends it)."""

    def __init__(self, st):
        here, there = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            here.close()
            for fd in (st.proto_in, st.proto_out):
                os.close(fd)
            st.close_held()
            try:
                self.serve(st, there)
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
    def serve(st, sock):
        rehearse(st)
        if st.session:
            from .cells import session_preload
            session_preload(st)
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
                for fd in fds:                                  # request): end, so the agent's next read
                    os.close(fd)                                # finds the zygote broken
                return
            pid = os.fork()
            if pid == 0:
                if msg == b"s":  # a session's interpreter: it talks to the agent on its own pipes
                    sock.close()
                    from .cells import session_main
                    session_main(st, *fds)
                if msg == b"f":  # forked ahead: the run's descriptors come later, to the child itself
                    warm(st)
                    msg, anc, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(RUN_FDS * 4))
                    fds = receive_fds(anc)
                    if not _in_turn(msg, fds, b"g"):
                        os._exit(0)
                    sock.sendall(b"A" + os.getpid().to_bytes(4, "little"))  # "mine": the agent knows who runs it
                Zygote.child(st, sock, fds)
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
    def child(st, sock, fds):
        """A run's child: its stdin, stdout, stderr and status pipe are ``fds``; its request is
        next on ``sock`` (sent with the descriptors, in the same message). It says how it ended
        on the status pipe and closes its streams *before* it exits: a forked interpreter's exit
        tears down its address space (the largest part of a trivial run), which then happens after
        the agent has answered. The code it reports is what the program could make its exit status
        anyway; a child that dies by a signal reports nothing and its wait status comes from the
        zygote.

        It then waits for the agent to have read that (``status`` closes the pipe's read end, then
        kills it) instead of exiting at once: in a sandbox pinned to one core the child would go on
        to its exit once its streams were closed, and the agent, woken by their end, would run only
        after the teardown. Not when the program left threads running (``_thread._count()``):
        those must end with it, as ``os._exit`` ends them; nor in a copy the program forked that
        returns here (it exits at once: a parent waiting for it would otherwise wait for the agent,
        which waits for the parent's end)."""
        code = 1
        status_fd = fds[3]
        me = os.getpid()  # (a copy the program forks returns through here too: it never waits below)
        try:
            os.set_inheritable(status_fd, False)  # not into programs the user's code execs
            os.setpgid(0, 0)  # a group of its own, not a session (procs: "A run's process group")
            _signal.signal(SIGINT, _signal.default_int_handler)
            for target, fd in zip((0, 1, 2), fds):
                os.dup2(fd, target)
                os.close(fd)
            req = read_message(sock.fileno())
            sock.close()
            st.libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the user's process is ordinary again (zygote: libc is set)
            if req.get("cpus"):
                os.sched_setaffinity(0, req["cpus"])
            os.chdir(req.get("cwd") or st.workspace)
            cap_address_space(req.get("as_bytes"))
            python_body(st, req["code"], env_for(st, req), st.warmed)
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
                waiting = select.poll()                     # wait until the agent has read the status (it
                waiting.register(status_fd, 0)              # closes its end: POLLERR here) or kills us
                waiting.poll(LINGER_S * 1000)
        except BaseException:
            pass
        os._exit(code)

    # -- in the agent ----------------------------------------------------------------------------
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
            # of this method, which would report the user's run as the agent's failure
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
        ran on after the agent's answer): before anything else is asked of the zygote."""
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
        if who() is None:  # no child took it (the zygote broke): the agent's failure
            os.close(st_r)
            raise RuntimeError(f"zygote: {self.broken}")
        return finish(req, start, *out)

    def taken_by(self, first, wait_s):
        """Who runs the request just sent (``first``: the tags of what says so first): a child forked
        ahead, which says "A" (and its pid) as it takes it, or, had it died idle ("S"), the one the
        zygote forks for it ("P"); with none ahead, the one the zygote forks ("P"). Read once the
        run's output has ended (or at its deadline, to kill it), not before reading that output:
        read before, the agent was woken by that message and went back to sleep before the output
        came, a wake-up more on a python one-shot's way than on a bash one's. Only the zygote and a
        child before its program write on the socket (a child closes it before the program runs),
        so what is read here later is theirs. ``wait_s``: how long to wait for it (at the deadline,
        ``TAKEN_LATE_S``: by then it is long due, and the host's own deadline for the answer is
        near). None when the zygote is broken (``run`` then fails, as the agent's error)."""
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


def _in_turn(msg, fds, tags):
    """Whether a message to the zygote is one it expects: ``f`` (fork ahead) without descriptors,
    ``g`` (a run) with its four."""
    return len(msg) == 1 and msg in tags and len(fds) == (RUN_FDS if msg == b"g" else 0)


def warm(st):
    """In a child forked ahead, before it waits for its run: a run's own steps once on a pipe,
    so the pages they write (reference counts, the allocator's pools, the streams) are copied
    from the zygote now instead of on the run's latency path. The streams it makes stay: the
    run's descriptors replace the pipe under them (``dup2`` onto 0-2), and a pipe's streams are
    what a run's would be (not seekable, not a terminal, the same block size), so the run does
    not make them again (on /dev/null, which is seekable, they could not be kept).

    The steps ``Zygote.child`` takes around the program are rehearsed too, each on something of
    the warm-up's own or as a no-op: a request read from the pipe, the environment's names, the
    status written, ``prctl``'s read of dumpability, the workspace as working directory (the
    process group and SIGINT's handler are only looked up). Its program prints an empty line, as
    the zygote's rehearsal's does: most one-shots print what they found, and ``print``'s way
    through the streams is then taken once in the zygote, its pages shared."""
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
        python_body(st, req["code"], env_for(st, req))
        st.warmed = True
        os.write(w, (0).to_bytes(4, "little"))
        os.read(r, 8)
        if st.libc is not None:
            st.libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        done = (os.setpgid, _signal.signal, _signal.default_int_handler, os.sched_setaffinity, os.getpid,
                _thread._count, select.poll().register, os._exit)
        del done
        os.chdir(req.get("cwd") or st.workspace)
    except Exception:  # only a saving
        pass
    finally:
        os.close(r)
        os.close(w)


def receive_fds(anc):
    return [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for level, kind, data in anc
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS for i in range(0, len(data), 4)]


def rehearse(st):
    """Run a one-shot child's own steps once in the zygote, on /dev/null, before any fork: the
    lazily made state they touch (codec lookups, the adaptive interpreter's specialised code,
    interned names, the modules a traceback needs) is then made once here instead of in every
    child, whose first writes to each page cost a copy-on-write fault. The passing program prints
    an empty line (``warm``'s docstring says why)."""
    null = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    environ = dict(os.environ)
    streams = sys.stdin, sys.stdout, sys.stderr
    try:
        for _ in range(8):
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            python_body(st, "print()", env_for(st, {}))
            try:  # a failing program's way too: its traceback (importing traceback, linecache, tokenize)
                python_body(st, "raise ValueError('rehearsal')", env_for(st, {}))
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
