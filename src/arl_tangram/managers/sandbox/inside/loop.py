"""The agent's core: its one state object (``State``), the start that takes this process over
(``boot``), its wire format, and its loop (``serve``: read a request, run its operation, answer,
reap).

Everything that outlives a request lives on the ``State``: the zygote, the bash started ahead, the
session's interpreter and shell, the reset's snapshot, and what the kernel is asked only once.
Every operation is handed it (``OPS``: op -> module and function, the module imported when its
first operation comes, so a one-shot sandbox never loads what only sessions use); constants stay
in their modules.

The wire format: a request (from the trusted host, or the agent's own to a session's interpreter
or zygote) is a 4-byte little-endian length and a ``marshal`` dict. An answer is one JSON line; a
streamed request's output also goes out while it runs as chunk lines (``{"stream", "data"}``, no
``id``). JSON is written here by hand for the few shapes the agent answers with: importing
``json`` costs more than this whole module. One module, not three: every module is a cost of
every sandbox's start.
"""

import _signal
import binascii
import io
import marshal
import os
import sys

SIGKILL = 9  # Linux numbers: importing signal pulls in enum, a fifth of the agent's start-up
SIGINT = 2
SIGPIPE = 13
SIGXFSZ = 25
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4

try:  # an image's minimal python may lack these: then no zygote and no verified reset (no recycling)
    import _socket
    import ctypes
    LIBC = ctypes.CDLL(None, use_errno=True)
except (ImportError, OSError, AttributeError):
    _socket = ctypes = LIBC = None


# -- the state ----------------------------------------------------------------------------------------

class State:
    """What the agent holds between requests (one per process; a forked child has its copy).

    ``reap``: only in a PID namespace of the agent's own (the host passes ``--reap``, and it is
    one of the namespace's first processes): outside one, "every other process" would be the
    host's. ``session``: a session's sandbox (the host passes ``--session``): its zygote forks
    session interpreters (never one-shots) and imports what they need first."""

    __slots__ = ("workspace", "reap", "session", "libc", "builtins", "proto_in", "proto_out", "out", "handlers",
                 "namespace", "keep", "reaped", "zygote", "warmed", "last", "last_run", "bash_ahead", "held",
                 "child", "lost", "tainted", "shell", "shell_used", "rest_blob", "rest_modules", "snapshot",
                 "proc_held", "keys_denied", "ring_ids", "ipc_buf", "pseudo_devs", "openat2", "hows")

    def __init__(self, argv, proto_in=0, proto_out=1, libc=None, builtins=None):
        self.workspace = argv[argv.index("--workspace") + 1] if "--workspace" in argv else "/workspace"
        self.reap = "--reap" in argv and os.getpid() <= 3
        self.session = "--session" in argv
        self.libc = libc  # libc through ctypes, once this process is non-dumpable (None: not here)
        #: what a one-shot's and a cell's code sees as ``__builtins__`` (as the agent's own module had it)
        self.builtins = __builtins__ if builtins is None else builtins
        self.proto_in, self.proto_out = proto_in, proto_out  # the host's channel, moved off 0 and 1
        self.out = proto_out  # where answers and streamed chunks go (a session's interpreter: its pipe)
        self.namespace = {"__name__": "__main__", "__builtins__": self.builtins}  # a session's variables
        self.handlers = {}  # op -> its function, once its module is imported (``handler``)
        # -- one-shots ---------------------------------------------------------------------------
        self.keep = []  # the session's persistent shell: spared by ``procs.reap_strays``
        #: the last request was a one-shot whose strays were all killed after its answer: nothing can
        #: have started a process since (the zygote forks only when asked, the run's child is killed),
        #: so the reset that follows does not scan /proc again
        self.reaped = False
        self.zygote = None  # ``zygote.Zygote``: python one-shots' template
        self.warmed = False  # in a child forked ahead: ``zygote.warm`` left its streams on 0-2 for the run
        self.last = ""  # the last run's op: a reset after a python run forks the next child ahead
        #: the last run's (argv, env, address space cap) when it could be started ahead (``procs``)
        self.last_run = None
        #: a bash started ahead: (pid, argv, env, address space cap, stdin's write end, stdout's and
        #: stderr's read ends, the BASH_ENV pipe)
        self.bash_ahead = None
        #: a request read by a shell step with a live stdin while it ran (the host never sends one
        #: then: held all the same, to be the next one read)
        self.held = []
        # -- a session's ---------------------------------------------------------------------------
        self.child = None  # the session's interpreter (``sessions.SessionChild``), when one lives
        self.lost = ""  # why the session's last interpreter ended, until a step has said so
        self.tainted = ""  # why this sandbox must never be reset for reuse (``zygote.op_python``)
        self.shell = None  # the session's persistent shell (``shell.Shell``), from its first step on
        self.shell_used = False  # a step of the session's own ran in the shell (not only a ``prestart``)
        self.rest_blob = b""  # a rest's packed blob, or a wake's chunks so far
        self.rest_modules = set()  # modules a namespace being packed refers to (``pickling``)
        # -- the reset's, and what the kernel is asked once ---------------------------------------
        self.snapshot = {}  # pid -> its state at start (``reset.process_state``)
        self.proc_held = {}  # /proc path -> a descriptor held open on it (``reset.read_proc``)
        self.keys_denied = False  # no process here can use the keyrings (``reset.deny_keyrings``)
        self.ring_ids = {}  # the user and user-session keyrings' serials
        self.ipc_buf = None  # the buffer System V IPC's counts are read into
        self.pseudo_devs = None  # the devices of the pseudo file systems mounted here (``files``)
        self.openat2 = libc is not None  # openat2 is tried (False once the kernel refused it)
        self.hows = {}  # openat2's typed call and its ``struct open_how``s, made on first use

    def close_held(self):
        """In a child forked from the agent that does not exec: the agent's held ``/proc`` files go
        (they belong to the agent; they are close-on-exec for the children that exec)."""
        for fd in self.proc_held.values():
            os.close(fd)
        self.proc_held.clear()


def boot(argv=None, builtins=None):
    """Take this process over as the sandbox's agent and return its state: non-dumpable (no ptrace,
    no ``/proc/<pid>/mem`` or ``fd`` from inside), SIGINT ignored (Python's KeyboardInterrupt
    handler would let a child stop it), no POSIX message queues (they outlive their processes and
    cannot be listed without mounting mqueue), and the host's channel moved off descriptors 0 and
    1 (/dev/null there), so nothing the user's code prints can corrupt it."""
    libc = LIBC
    if libc is not None:
        try:
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        except (OSError, AttributeError):
            libc = None
    _signal.signal(SIGINT, _signal.SIG_IGN)
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
    return State(sys.argv if argv is None else argv, proto_in, proto_out, libc, builtins)


# -- the wire format ----------------------------------------------------------------------------------

#: how long a streamed step's output waits for more before it goes out (a shell step's, a cell's,
#: the relay of a cell's): a step that ends by then sends none (its answer has it all), so a short
#: command costs the host no extra wake-ups, and output written a byte at a time goes out in chunks
COALESCE_S = 0.005

#: the frames of this package (a traceback shown to the user starts at the user's own code)
_HERE = os.path.dirname(__file__) + os.sep


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unb64(text):
    return binascii.a2b_base64(text) if text else b""


_ESC = {i: "\\u%04x" % i for i in range(32)}
_ESC.update({ord('"'): '\\"', ord("\\"): "\\\\"})


def to_json(obj):
    """JSON for the few shapes the agent answers with."""
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


def chunk_line(name, data):
    """A streamed request's output chunk as it goes out: ``{"stream": name, "data": <base64>}``."""
    return ('{"stream":"' + name + '","data":"' + b64(data) + '"}\n').encode()


def shown(name):
    """A name as the host shows it: bytes that are not UTF-8 (kept by ``os`` as lone surrogates)
    become U+FFFD, as envd's JSON has them (an answer with a lone surrogate could not be sent at
    all: one such file name would make a whole directory unlistable)."""
    return name if name.isascii() else name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def print_exc(quiet=False):
    """The traceback of the user's code, without the agent's own frames; printed to stderr
    unless ``quiet``, returned as lines either way."""
    import traceback
    etype, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_HERE):
        tb = tb.tb_next
    lines = traceback.format_exception(etype, value, tb)
    if not quiet:
        sys.stderr.write("".join(lines))
    return [line.rstrip("\n") for line in lines]


def stream(fd, mode):
    """A text stream on ``fd`` that never closes it (replaced streams are collected, and a
    stream owning the descriptor would close it under its successor)."""
    raw = os.fdopen(fd, mode + "b", buffering=0, closefd=False) if mode == "w" else os.fdopen(fd, "rb", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", write_through=(mode == "w"))


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


# -- the loop -----------------------------------------------------------------------------------------

#: op -> (module, function): the table of the agent's operations, each ``function(st, req)``
OPS = {"run": ("procs", "op_run"), "python": ("zygote", "op_python"), "write": ("files", "op_write"),
       "read": ("files", "op_read"), "reset": ("reset", "op_reset"), "fs": ("fsops", "op_fs"),
       "cell": ("sessions", "op_cell"), "warm": ("sessions", "op_warm"), "shell": ("shell", "op_shell"),
       "rest": ("rest", "op_rest"), "rest_chunk": ("rest", "op_rest_chunk"), "wake": ("rest", "op_wake"),
       "ping": ("loop", "op_ping")}
AHEAD_STAYS = ("python", "reset", "ping")  # requests that leave a child forked ahead alive


def handler(st, op):
    """The function of ``op`` (its module imported on first use); KeyError for an unknown op."""
    fn = st.handlers.get(op)
    if fn is None:
        module, name = OPS[op]
        fn = st.handlers[op] = getattr(__import__(module, globals(), None, (name,), 1), name)
    return fn


def op_ping(st, req):
    return {"pid": os.getpid()}


def batch():
    """Run this sandbox's processes (the agent, the zygote, every child: the policy is inherited,
    and the reset checks it is still this) as ``SCHED_BATCH``: same CPU share, but a wake-up of
    theirs never preempts the process that woke them. The host's process that writes a request to
    the agent (a sandbox worker, the engine process) runs unpinned; without this, when it ran on
    the CPU this sandbox is pinned to, the write handed that CPU to the sandbox at once, and the
    host's process, with every other sandbox it serves, waited for the run to end. Where the
    scheduler ignores the policy, nothing changes."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def main(builtins=None):
    """The agent: take this process over, start the zygote, then serve the host until its channel
    closes. ``builtins``: what user code sees as ``__builtins__`` (the entry script's own)."""
    st = boot(builtins=builtins)
    os.chdir(st.workspace)
    batch()
    from . import reset
    if st.reap:  # a sandbox (no isolation: the server's own user, whose keyrings are its business)
        st.keys_denied = reset.deny_keyrings(st)
    reset.snapshot(st)
    if st.reap and st.libc is not None:  # a session's sandbox too: its interpreter forks from it (SessionChild)
        from .zygote import Zygote
        st.zygote = Zygote(st)
        reset.snapshot(st, st.zygote.pid)
    serve(st)


def serve(st):
    """One request at a time from the host's channel, each answered by one JSON line."""
    from .procs import drop_bash_ahead, reap_strays
    then = None
    while True:
        # a one-shot's reset may ride on its run (``then``): it runs right after the run's answer and
        # the reaping, answered under its own id, before anything else is read (the host then spends
        # no write on it, and the agent no wake-up)
        req, then = (then, None) if then is not None else (st.held.pop(0) if st.held else read_message(st.proto_in), None)
        if req is None:
            return
        op = req["op"]
        if op == "stdin":  # input for a step that has ended (it came as the step did): dropped,
            continue       # as a pipe's unread input is when its reader exits; never answered
        result = None
        z = st.zygote
        if z is not None:  # the last python run's exit is over before anything else runs here
            z.settle()  # (its pid is spared by the reaping only until then)
        if z is not None and z.ahead is not None and op not in AHEAD_STAYS:
            z.drop_ahead()  # only a python run (its own child) may ever see it
        if st.bash_ahead is not None and op not in ("run", "reset", "ping"):
            drop_bash_ahead(st)  # likewise a bash started ahead: only the run it was started for (procs.op_run)
        if op != "reset":
            st.reaped = False
        if op in ("run", "python"):
            st.last = op
        if req.get("files") and op in ("run", "python"):  # one round trip: write, then run
            try:
                handler(st, "write")(st, req)
            except Exception as e:
                result = {"files_error": f"{type(e).__name__}: {e}"}
        if result is None:
            try:
                result = handler(st, op)(st, req)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"}
        reap = req.get("reap", True) and op in ("run", "python", "cell", "shell")
        # a one-shot's strays are killed once its answer is out (off its latency path), before the
        # agent reads anything else; a session's, and those of a run whose files are fetched, before
        # it (its memory is measured after the step; the fetched files are what the run left, not
        # what its strays went on to write)
        late = reap and not st.session and op in ("run", "python") and not req.get("fetch")
        if reap and not late:
            reap_strays(st)
        if req.get("fetch") and "error" not in result and "files_error" not in result:
            result["fetched"] = handler(st, "read")(st, {"paths": req["fetch"]})
        result["id"] = req.get("id")
        try:  # an answer that cannot be written is the agent's failure, said as such: never its end
            line = (to_json(result) + "\n").encode()  # (a RecursionError here would end PID 1)
        except Exception as e:
            line = (to_json({"error": f"answer not encodable: {type(e).__name__}", "id": req.get("id")}) + "\n").encode()
        write_all(st.proto_out, line)
        then = req.get("then") if op in ("run", "python") else None
        if not (isinstance(then, dict) and then.get("op") == "reset"):  # only a one-shot's reset rides
            then = None
        # a python child's pid is spared (``owed``) until the reset settles it, and a stray could
        # take that pid once the child is gone: the reset then reaps again, after the settle. So
        # this scan counts for the reset only if no pid was spared, and when one was and the reset
        # rides, it is left to the reset alone, right after (not the same /proc scan twice)
        z = st.zygote
        if late and not (then is not None and z is not None and z.owed is not None):
            st.reaped = reap_strays(st) and (z is None or z.owed is None)
