"""A session's interpreter, seen from the agent: started (``SessionChild``, forked by the zygote),
asked (``child_call``), checked (``op_cell``) and ended (``end_child``); and ``warm``, a session
sandbox made ready before it is taken.

A session's cells run in a child forked from the zygote (``Zygote.serve``'s ``s``), not in the
agent: the agent and the zygote then never run the session's code, and once the session has left
(put to rest, ``rest.op_rest`` + ``reset.op_reset``) the sandbox is reset exactly as a one-shot's
is and serves the next session. The child gets two pipes (requests in, answers out) and nothing
else of the agent's; it answers JSON lines, which the agent parses with ``json`` (safe on hostile
bytes), checks field by field and sends on in its own framing: nothing the session writes reaches
the host's channel as it wrote it. Each request carries a nonce its answer must repeat
(``child_call``). A child that dies, answers nonsense or out of turn, writes between requests or
runs past its cell's timeout is ended, and the next step says its variables are gone
(``State.lost``). A cell can still forge its *own* step's answer (it runs in the process that
answers): that is no more than printing what it likes; no other step's answer is ever affected.
"""

import binascii
import marshal
import os
import select
import sys
import time

from . import COALESCE_S, SIGKILL, b64, chunk_line, unb64, write_all
from .procs import process_state

try:
    import _socket
except ImportError:  # an image's minimal python: no zygote there (``inside.LIBC`` is None)
    _socket = None

CHILD_GRACE_S = 1.0  # past a cell's own timeout (its alarm, in the child), the agent ends the child
CHILD_LINE_MAX = 1 << 30  # a pack's answer (the namespace, fetched by the host in chunks) longer than this is nonsense
# a cell's answer longer than this could not reach the host anyway (it reads lines up to 64 MB): the
# agent stops buffering there (a cell writing 700 MB without a newline would otherwise grow the agent
# to its sandbox's memory limit, and its end would be the host's error)
CELL_LINE_MAX = 60 << 20
REST_CHILD_S = 50.0  # packing or loading a namespace (the host gives the whole rest 60 s: rest.REST_TIMEOUT_S)
LATE_CELL = "did not stop at its cell's timeout and was ended"
LATE_PACK = "did not pack or load its state in time and was ended"
CELL_FIELDS = {"stdout": str, "stderr": str, "truncated": bool, "timed_out": bool, "exit_code": int,
               "duration_s": (int, float), "display": list, "raised": list}


class SessionChild:
    """In the agent: the session's interpreter and the agent's ends of its pipes."""

    def __init__(self, st):
        req_r, self.req_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        z = st.zygote
        if z is not None:
            z.settle()
            if z.ahead is not None:
                z.drop_ahead()
            fds = (req_r, ans_w)
            anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))]
            pid = z.reply("P", 10.0) if z.send(b"s", anc) else None
        else:  # no zygote (no bubblewrap, or an image's python without ctypes): never recycled
            pid = os.fork()
            if pid == 0:
                for fd in (self.req_w, self.ans_r, st.proto_in, st.proto_out):
                    os.close(fd)
                st.close_held()
                from .cells import session_main
                session_main(st, req_r, ans_w)
        os.close(req_r)
        os.close(ans_w)
        if pid is None:
            self.close()
            raise RuntimeError(f"zygote: {z.broken}")
        self.zygote = z
        self.pid = pid
        self.buf = bytearray()
        self.scanned = 0  # how much of ``buf`` holds no newline: each read is searched once
        self.used = False  # a request of the session's has reached it (a preforked one holds nothing yet)

    def stray(self):
        """Whether it wrote to the agent outside a request: a cell's own process holds the answer
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
        if self.zygote is not None:
            return self.zygote.reply("S", 2.0)  # (a one-shot's owed status was settled before this child was forked)
        try:
            return os.waitpid(self.pid, 0)[1]
        except ChildProcessError:
            return None


def start_child(st):
    """The session's interpreter, started if none lives; the note a step reports when an earlier
    one had ended (its variables with it)."""
    note = ""
    if st.child is None:
        if st.lost:
            note = f"a new python interpreter: the session's earlier one {st.lost}, its variables are gone"
            st.lost = ""
        if "json" not in sys.modules:
            import json  # noqa: F401  (the child's answers are parsed with it: once per sandbox)
        st.child = SessionChild(st)
    return note


def prefork_child(st):
    """Fork the next session's interpreter now, in a sandbox no session holds (after a verified
    reset, or a fresh sandbox's warm-up): it holds only the zygote's memory until the session's
    first cell or wake. Returns what went wrong (a list, empty when nothing did)."""
    if st.child is not None or st.zygote is None or not st.session:
        return []
    try:
        start_child(st)
    except (OSError, RuntimeError) as e:
        return [f"session interpreter: {e}"]
    return []


def end_child(st, why, kill=True):
    """End the session's interpreter (``why`` it ended: kept for the next step); its status."""
    child, st.child = st.child, None
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
    st.lost = why
    return status


def _running(pid, grace_s=0.1):
    """``pid`` still runs ``grace_s`` after its channel closed (a process that exits closes its
    descriptors a moment before it becomes a zombie; the session's interpreter is the zygote's
    child, so the agent cannot wait for it without blocking on the zygote's report)."""
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
    bytes a stream (its ``Capture`` keeps as much) and at most every ``COALESCE_S``, all kept
    bytes in order. The cell can write chunk lines on its answer pipe itself, past Capture's cap
    and coalescing; relayed one by one, each would cost the engine process a parse and a decode
    on its event loop: what passes here is bounded whatever the interpreter sends."""

    def __init__(self, st, limit):
        self.out = st.proto_out
        self.limit = limit
        self.sent = {"stdout": 0, "stderr": 0}
        self.pending = {"stdout": bytearray(), "stderr": bytearray()}
        self.held = False  # bytes are pending
        self.last = -COALESCE_S  # when chunks last went out: the first go at once (the usual cell's
        # one chunk, read just before its answer, is not held back)

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
        return self.last + COALESCE_S - time.monotonic() if self.held else None

    def flush(self):
        for name, data in self.pending.items():
            if data:
                write_all(self.out, chunk_line(name, bytes(data)))
                data.clear()
        if self.held:
            self.held, self.last = False, time.monotonic()


def child_call(st, req, timeout_s, relay=None, late=LATE_CELL, line_max=CELL_LINE_MAX):
    """``req`` to the session's interpreter; its answer (a dict), its streamed chunks sent on to
    the host through ``relay`` (a ``Relay``) if given. None when it died, answered nonsense or ran
    past ``timeout_s`` (it is then ended and ``st.lost`` says why).

    The cell's code runs in that process and can write lines of its own on the answer pipe, even
    well-formed ones carrying this request's nonce (it can read its own request): such a line is
    taken as *this* request's answer only (the user's own step, as if it had printed it). Its real
    answer then comes with a nonce no later request has, or lies in the pipe before the next
    request: either ends the interpreter (else a forged answer would shift every later answer of
    the session by one step). So no step ever gets another step's answer."""
    child = st.child
    child.used = True
    if child.stray():
        end_child(st, "wrote to the runner outside its answers")
        return None
    nonce = os.urandom(8).hex()
    data = marshal.dumps({**req, "nonce": nonce}, 4)
    data = memoryview(len(data).to_bytes(4, "little") + data)
    deadline = time.monotonic() + timeout_s
    os.set_blocking(child.req_w, False)
    while data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [child.req_w], [], left)[1]:
            end_child(st, "did not read its request in time")
            return None
        try:
            data = data[os.write(child.req_w, data[:1 << 20]):]
        except BlockingIOError:
            continue
        except OSError:  # it is gone
            end_child(st, "", kill=False)
            return None
    try:
        return _answer(st, child, nonce, deadline, relay, late, line_max)
    finally:
        if relay is not None:  # what the cell wrote before its end (or its timeout) goes before the answer
            relay.flush()


def _answer(st, child, nonce, deadline, relay, late, line_max):
    """``child_call``'s answer to the request ``nonce`` (or None, the child ended)."""
    while True:
        nl = child.buf.find(b"\n", child.scanned)
        child.scanned = len(child.buf) if nl < 0 else 0
        if nl >= 0:
            line = bytes(child.buf[:nl])
            del child.buf[:nl + 1]
            msg = _json_line(line)
            if msg is None:
                end_child(st, "answered what is not an answer")
                return None
            if "stream" in msg:
                name, chunk = msg.get("stream"), msg.get("data")
                if name not in ("stdout", "stderr") or not isinstance(chunk, str):
                    end_child(st, "sent a malformed output chunk")
                    return None
                if relay is not None:
                    try:
                        relay.add(name, unb64(chunk))
                    except binascii.Error:  # not base64: the interpreter's fault, never the agent's error
                        end_child(st, "sent a malformed output chunk")
                        return None
                continue
            if msg.get("nonce") != nonce:  # an answer to an earlier request (or none): out of turn
                end_child(st, "answered out of turn")
                return None
            return msg
        due = None if relay is None else relay.due()
        if due is not None and due <= 0:
            relay.flush()
            due = None
        left = deadline - time.monotonic()
        if left <= 0:
            end_child(st, late)
            return None
        if not select.select([child.ans_r], [], [], left if due is None else min(left, due))[0]:
            continue
        chunk = os.read(child.ans_r, 1 << 20)
        if not chunk:
            end_child(st, "", kill=False)
            return None
        child.buf += chunk
        if len(child.buf) > line_max:
            end_child(st, "answered more than the runner takes")
            return None


def _text(value):
    """``value`` if it is a str, made encodable (a lone surrogate would fail the answer's encode)."""
    if not isinstance(value, str):
        raise ValueError("not a str")
    return value.encode("utf-8", "replace").decode("utf-8")


def _cell_parts(display, raised):
    """A cell answer's ``display`` and ``raised``, rebuilt element by element in the only shapes
    a cell makes (``cells.cell_here``): display items are dicts of str to str, a raised exception
    is ``ename``, ``evalue`` and a traceback as a list of str. Anything else (a non-dict item, a
    value nested so deep that the agent's recursive ``to_json`` would overflow) raises ValueError;
    nothing the interpreter wrote reaches the host as it wrote it."""
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


def _zygote_ended(st):
    """Whether the zygote was ended or stopped: in a session's sandbox only the session's own
    code can do that (a signal to its interpreter's parent, or the memory it used)."""
    try:
        pid, _ = os.waitpid(st.zygote.pid, os.WNOHANG)
        return bool(pid) or process_state(st, st.zygote.pid)["stopped"]
    except (ChildProcessError, OSError, IndexError):  # reaped (reap_strays), or gone
        return True


def _no_interpreter(st, why, start):
    """A cell's answer when no session interpreter can be started here (the session's code killed
    the zygote). It says ``broken``: the host replaces the sandbox, and the session's next step
    starts anew, saying its state was lost (else every later python step would be the agent's
    error, forever). The step is the user's failure when the session ended or stopped the zygote,
    the agent's error (infra_error) when the zygote lives but stopped answering."""
    if st.zygote is not None and _zygote_ended(st):
        return {"stdout": "", "stderr": "", "truncated": False, "timed_out": False, "exit_code": 1,
                "duration_s": time.monotonic() - start, "display": [], "raised": [], "broken": why,
                "note": "the session's code ended its sandbox's zygote (the template its python interpreters are "
                        "forked from): no python can run there; the next step starts in a new sandbox, "
                        "its files and variables are gone"}
    return {"error": f"RuntimeError: {why}", "broken": why}


def op_cell(st, req):
    """A step of the session's python: relayed to its interpreter, its answer checked field by
    field and rebuilt (``_cell_parts``): what reaches the host has only the shapes a cell makes."""
    start = time.monotonic()
    if st.child is not None and st.child.stray():  # (``child_call``) a fresh interpreter runs this cell
        end_child(st, "wrote to the runner outside its answers")
    try:
        note = start_child(st)
    except RuntimeError as e:  # the zygote is broken: no interpreter can be started in this sandbox
        return _no_interpreter(st, str(e), start)
    timeout_s = float(req.get("timeout_s") or 10)
    r = child_call(st, {k: v for k, v in req.items() if k not in ("id", "files", "fetch")}, timeout_s + CHILD_GRACE_S,
                   relay=Relay(st, int(req.get("max_output") or 1 << 20)) if req.get("stream") else None)
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
            end_child(st, "answered a malformed result")
            r = None
    if r is not None and "error" in r:
        end_child(st, "failed: " + str(r.get("error"))[:300])
        r = None
    if r is None:  # it ended: the step says so, and the next says its variables are gone
        timed_out = st.lost == LATE_CELL
        result = {"stdout": "", "stderr": "", "truncated": False, "timed_out": timed_out,
                  "exit_code": 1, "duration_s": time.monotonic() - start, "display": [], "raised": []}
        note = (note + "; " if note else "") + f"the session's python interpreter {st.lost}: its variables are gone"
    if note:
        result["note"] = note
    return result


def op_warm(st, req):
    """Import what a session's first cell and a wake need, and the modules rested sessions use
    most, before this sandbox is taken: in a session sandbox into its zygote (every session
    interpreter forked from it shares them), elsewhere into the agent."""
    z = st.zygote
    if st.session and z is not None and not z.broken:
        z.settle()
        data = marshal.dumps([str(m) for m in req.get("modules") or ()], 4)
        failed = z.reply("W", 20.0) if z.send(b"w" + len(data).to_bytes(4, "little") + data) else None
        if failed is None:
            raise RuntimeError(f"zygote: {z.broken}")
        if "json" not in sys.modules:
            import json  # noqa: F401  (the agent parses its session interpreter's answers with it)
        if req.get("prefork"):
            why = prefork_child(st)
            if why:
                raise RuntimeError("; ".join(why))
        return {"failed": failed}
    import _ast  # noqa: F401  (these and the package's own: what a session's first cell imports, op_cell)
    import importlib
    import pickle  # noqa: F401
    import threading  # noqa: F401
    from . import cells  # noqa: F401
    failed = []
    for name in req.get("modules") or ():
        try:
            importlib.import_module(name)
        except BaseException:
            failed.append(name)
    return {"failed": failed}
