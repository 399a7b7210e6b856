"""The agent inside every sandbox: it runs what the host asks, one request at a time.

It runs under the sandbox's interpreter with the standard library only (``tests/test_inside.py``
proves it), importing as little as it can: its start-up is the cost of every fresh sandbox, so a
module a one-shot never uses is imported when its first request comes. Requests come from the
(trusted) host as length-prefixed ``marshal`` dicts; answers go back as JSON lines, which the host
parses safely even if the user's code has taken this process over. The operations, by
module (``loop.OPS``):

* ``run``     fork+exec ``argv`` (a shell command, a compiled binary) in its own process group;
              a bash one-shot's successor started ahead (``procs``)
* ``python``  ``code`` in a child of a warm interpreter, forked from a *zygote* that never holds a
              request (``zygote``)
* ``write`` / ``read``  files in the workspace, opened as plain files only (``files``); ``run``
              and ``python`` also take ``files`` to write first and ``fetch`` paths to read after
* ``fs``      one filesystem call for the E2B API (``fsops``)
* ``reset``   make a used sandbox pristine for the next one and say whether that could be
              verified (``reset``: processes, writable places, System V IPC, keyrings, /proc)
* ``cell``    a session's python step, in the session's own interpreter (``sessions`` in this
              process, ``cells`` in that one); ``warm`` prepares a session sandbox
* ``rest`` / ``rest_chunk`` / ``wake``  a session's state to bytes and back (``rest``, and
              ``pickling`` in the session's interpreter)
* ``shell``   a step of the session's persistent shell (``shell``, ``shellio``)

Every child gets ``timeout_s``; output is captured up to ``max_output`` bytes per stream (the rest
is drained and dropped, and flagged). After each request every other process in the sandbox is
killed, so nothing an action started outlives it (the agent itself is the persistent state:
``State``).

Recycling one-shot sandboxes means hostile code must not be able to reach anything that outlives
its run. The agent is PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``), so nothing
inside can kill or stop it, and it is non-dumpable, so nothing inside can ptrace it or open its
``/proc`` files. Python one-shots are not forked from the agent itself, whose heap holds earlier
requests' code, stdin and output (a child could read them back from its copy), but from the
zygote, forked before the first request: it receives only descriptors, and the child reads its
own request after the fork.

This module is the agent's core, which every other one imports (Python imports it first anyway,
and every module is a cost of every sandbox's start): its one state object (``State``), the start
that takes this process over (``boot``) and its wire format. A request (from the trusted host, or
the agent's own to a session's interpreter or zygote) is a 4-byte little-endian length and a
``marshal`` dict. An answer is one JSON line; a streamed request's output also goes out while it
runs as chunk lines (``{"stream", "data"}``, no ``id``). JSON is written here by hand for the few
shapes the agent answers with: importing ``json`` costs more than this whole module. The loop that
reads requests and dispatches them is ``loop``; the agent is started by ``__main__.py`` as a script,
or imported from its compiled copy (``isolation.BOOT``).
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
