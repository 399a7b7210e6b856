"""A session's interpreter: the child that holds the session's namespace and runs its cells.

Forked from the zygote (``Zygote.serve``'s ``s``), never the agent itself: the agent and the
zygote then never run the session's code, and once the session has left the sandbox can be reset
as a one-shot's is and serve the next session. It talks to the agent on its own two pipes
(requests in, JSON answers out: ``session_main``); the agent checks every answer
(``sessions``). Imported in the zygote of a session's sandbox (``session_preload``), else by the
interpreter itself.
"""

import _signal
import marshal
import os
import select
import sys
import time

from . import COALESCE_S, PR_SET_DUMPABLE, b64, chunk_line, print_exc, read_message, stream, to_json, write_all
from .pickling import load_here, pack_here, rest_dump


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
        # a streamed cell's output goes out ``COALESCE_S`` after its first unsent byte, as a shell
        # step's does: forwarded at each read (a byte, for ``os.write(1, b"x")`` in a loop) it would
        # cost the engine process a JSON line, a decode and a listener call per byte
        pending, since = bytearray(), 0.0
        while True:
            if pending:
                wait = since + COALESCE_S - time.monotonic()
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


def chunk_writer(st):
    """A streamed request's output chunks, sent while it runs as a shell step's are (a chunk line
    each, ``inside.chunk_line``), from the capture threads (one lock: lines whole); to ``st.out``:
    the agent's pipe, in a session's interpreter."""
    import threading
    lock = threading.Lock()
    out = st.out

    def emit(name, data):
        line = chunk_line(name, data)
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


def cell_here(st, req):
    """A python cell in this process's namespace (``st.namespace``)."""
    limit = int(req.get("max_output") or 1 << 20)
    saved = os.dup(1), os.dup(2)
    caps = []
    emit = chunk_writer(st) if req.get("stream") else None
    for fd in (1, 2):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        cap = Capture(r, limit, emit, "stdout" if fd == 1 else "stderr")
        cap.start()
        caps.append(cap)
    sys.stdout, sys.stderr = stream(1, "w"), stream(2, "w")
    sys.stderr.reconfigure(errors="backslashreplace")  # as Python's own: a traceback never fails to print
    # the C modules under ``signal`` and ``ast``: those pull in enum, contextlib and collections at
    # every session's start, for names these already have
    import _ast
    start = time.monotonic()
    exit_code, timed_out = 0, False
    namespace = st.namespace
    _signal.signal(_signal.SIGALRM, _alarm)
    _signal.setitimer(_signal.ITIMER_REAL, float(req.get("timeout_s") or 10))
    display, raised = [], []
    try:
        try:
            tree = compile(req["code"], "<cell>", "exec", _ast.PyCF_ONLY_AST)  # what ast.parse does
            last = tree.body[-1] if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
            if last is not None:  # like a notebook: the value of a final expression is displayed
                tree.body.pop()
            exec(compile(tree, "<cell>", "exec"), namespace)
            if last is not None:
                value = eval(compile(_ast.Expression(last.value), "<cell>", "eval"), namespace)
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


def session_preload(st):
    """What a session's interpreter needs, imported once in the zygote (shared by every child
    forked from it): the cell's ``_ast``, its output threads, pickle for rest and wake."""
    import _ast  # noqa: F401
    import importlib  # noqa: F401
    import pickle  # noqa: F401
    import threading  # noqa: F401
    import types  # noqa: F401
    try:  # a cell's own steps once, on /dev/null: what they make lazily is then made here, not per child
        for _ in range(3):
            cell_here(st, {"code": "_ = [i for i in range(3)]\ndel _", "timeout_s": 5, "max_output": 1024})
    except Exception:  # a saving only
        pass


def session_warm(st, fd_in):
    """In an interpreter forked ahead (a reset's prefork: no request waits for it yet), a wake's
    own steps once, a blob loaded and a cell run, so that its first writes to the zygote's pages (the
    copy-on-write faults of refcounts and lazily made state) are taken now, off the path of the
    session it will hold. Leaves nothing: the namespace, environment, path and directory are as
    they were, and nothing is written to the agent. Skipped when a request already waits (an
    interpreter started for a step: the step must not wait for it)."""
    if select.select([fd_in], [], [], 0)[0]:
        return
    namespace = st.namespace
    names, environ, path, cwd = dict(namespace), dict(os.environ), list(sys.path), os.getcwd()
    try:
        load_here(st, {"state": marshal.dumps({"ns": rest_dump(st, {"x": list(range(1000)), "y": "warm"}), "cwd": cwd,
                                               "environ": environ, "path": path}, 4)})
        cell_here(st, {"code": "_ = [i for i in range(3)]\ndel _\n1 + 1", "timeout_s": 5, "max_output": 1024})
    except BaseException:  # a saving only
        pass
    finally:
        namespace.clear()
        namespace.update(names)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        try:
            os.chdir(cwd)
        except OSError:
            pass


def session_main(st, fd_in, fd_out):
    """The session's interpreter (in the child): one request at a time from the agent, until
    the pipe closes. Never returns."""
    try:
        st.out = fd_out
        os.setsid()
        os.chdir(st.workspace)
        if st.libc is not None:
            st.libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # an ordinary process of the user's, as one-shots are
        ops = {"cell": cell_here, "pack": pack_here, "load": load_here}
        session_warm(st, fd_in)
        while True:
            req = read_message(fd_in)
            if req is None:
                break
            try:
                result = ops[req["op"]](st, req)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"[:1000]}
            result["nonce"] = req.get("nonce")  # whose answer this is (``sessions.child_call`` checks it)
            # "replace": a lone surrogate (``raise ValueError('\ud800')``) would fail this encode and
            # end the interpreter; it is a "?"
            write_all(fd_out, (to_json(result) + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(0)
