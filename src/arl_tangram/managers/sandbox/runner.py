"""The agent inside every sandbox: it runs what the host asks, one request at a time.

Runs under the sandbox's interpreter with the standard library only, importing as little as it
can: its start-up is the cost of every fresh sandbox. Requests come from the (trusted) host as
length-prefixed ``marshal`` dicts; answers go back as JSON lines, which the host parses safely
even if the user's code has taken this process over. Both descriptors are moved out of the way at
start so nothing the user's code prints can corrupt the channel. Requests:

* ``run``    fork+exec ``argv`` (a shell command, a compiled binary) in its own process group
* ``python`` run ``code`` in a forked child of this warm interpreter (a one-shot python action
             without paying interpreter start-up)
* ``cell``   run ``code`` in this process's persistent namespace (a stateful python session)
* ``write`` / ``read`` files in the workspace

Every child gets ``timeout_s``; output is captured up to ``max_output`` bytes per stream (the rest
is drained and dropped, and flagged). After each request every other process in the sandbox is
killed, so nothing an action started outlives it (the runner itself is the persistent state).
"""

import binascii
import io
import marshal
import os
import select
import sys
import time

SIGKILL = 9  # Linux numbers: importing signal pulls in enum, a fifth of our start-up
PROTO_IN = os.dup(0)
PROTO_OUT = os.dup(1)
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
        return '"' + obj.translate(_ESC) + '"'
    if isinstance(obj, dict):
        return "{" + ",".join(to_json(str(k)) + ":" + to_json(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in obj) + "]"
    return to_json(str(obj))


def print_exc():
    """The traceback of the user's code, without the runner's own frames."""
    import traceback
    etype, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(etype, value, tb)


# Only in a PID namespace of our own (the host passes --reap, and we double-check that we are
# one of its first processes): outside one, "every other process" would be the host's.
REAP = "--reap" in sys.argv and os.getpid() <= 3


KEEP = []  # the session's persistent shell (shell.py fills it): spared by reap_strays


def reap_strays(keep=()):
    """Kill every process of this sandbox but pid 1 (the namespace's init), this runner and the
    persistent shell."""
    if not REAP:
        return
    me = os.getpid()
    for _ in range(3):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                if pid not in (1, me) and pid not in KEEP:
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
            return
        time.sleep(0.002)


def collect(child, out_fd, err_fd, in_fd, stdin, timeout_s, max_output):
    """Feed stdin, read both streams up to the cap, kill the group at the deadline."""
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
            os.killpg(child, SIGKILL)
        except OSError:
            pass
    for fd in (out_fd, err_fd) + ((in_fd,) if in_fd is not None else ()):
        try:
            os.close(fd)
        except OSError:
            pass
    _, status = os.waitpid(child, 0)
    return bufs[out_fd], bufs[err_fd], truncated, timed_out, status


def spawn(req, body):
    """Fork a child in its own process group with fresh pipes; ``body`` runs in the child."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if req.get("cpus"):  # no cgroups on the host: pin by affinity instead of cpuset
                os.sched_setaffinity(0, req["cpus"])
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w, PROTO_IN, PROTO_OUT):
                os.close(fd)
            os.chdir(req.get("cwd") or WORKSPACE)
            body()
        except SystemExit as e:
            code = e.code
            os._exit(code if isinstance(code, int) else (0 if code is None else 1))
        except BaseException:
            print_exc()
            os._exit(1)
        os._exit(0)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    out, err, truncated, timed_out, status = collect(
        pid, out_r, err_r, in_w, unb64(req.get("stdin")), float(req.get("timeout_s") or 10), int(req.get("max_output")
                                                                                               or 1 << 20))
    result = {"stdout": b64(bytes(out)), "stderr": b64(bytes(err)), "truncated": truncated,
              "timed_out": timed_out, "duration_s": time.monotonic() - start}
    if os.WIFSIGNALED(status):
        result["signal"] = os.WTERMSIG(status)
        result["exit_code"] = -os.WTERMSIG(status)
    else:
        result["exit_code"] = os.WEXITSTATUS(status)
    return result


def env_for(req):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    env.update(req.get("env") or {})
    return env


def op_run(req):
    argv = req["argv"]
    env = env_for(req)

    def body():
        os.execvpe(argv[0], argv, env)

    return spawn(req, body)


def op_python(req):
    code = req["code"]
    env = env_for(req)

    def body():
        os.environ.clear()
        os.environ.update(env)
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

    return spawn(req, body)


class Capture:
    """Drain one pipe into a capped buffer in a thread, so a blocked cell cannot stall it."""

    def __init__(self, fd, limit):
        import threading
        self.fd, self.limit, self.buf, self.truncated = fd, limit, bytearray(), False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.thread.start()

    def join(self):
        self.thread.join()

    def run(self):
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > room:
                self.truncated = True
        os.close(self.fd)


class CellTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise CellTimeout()


def op_cell(req):
    limit = int(req.get("max_output") or 1 << 20)
    saved = os.dup(1), os.dup(2)
    caps = []
    for fd in (1, 2):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        cap = Capture(r, limit)
        cap.start()
        caps.append(cap)
    sys.stdout, sys.stderr = stream(1, "w"), stream(2, "w")
    import signal
    start = time.monotonic()
    exit_code, timed_out = 0, False
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, float(req.get("timeout_s") or 10))
    display, raised = [], []
    try:
        try:
            import ast
            tree = ast.parse(req["code"], "<cell>")
            last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            if last is not None:  # like a notebook: the value of a final expression is displayed
                tree.body.pop()
            exec(compile(tree, "<cell>", "exec"), NAMESPACE)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), NAMESPACE)
                if value is not None:
                    display.append({"text/plain": repr(value)})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CellTimeout:
        exit_code, timed_out = 1, True
        print("cell timed out", file=sys.stderr)
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        exit_code = 1
        print_exc()
        raised.append({"ename": type(e).__name__, "evalue": str(e)})
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


def inside(path):
    full = os.path.normpath(os.path.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


def op_write(req):
    for path, data in (req.get("files") or {}).items():
        full = inside(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as fh:
            fh.write(unb64(data))
    return {}


def op_read(req):
    limit = int(req.get("max_bytes") or 1 << 24)
    files, missing = {}, []
    for path in req.get("paths") or []:
        try:
            with open(inside(path), "rb") as fh:
                files[path] = b64(fh.read(limit))
        except (OSError, ValueError):
            missing.append(path)
    return {"files": files, "missing": missing}


SHELL = {}


def op_shell(req):
    """A step of the session's persistent shell (shell.py, loaded on first use)."""
    if not SHELL:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shell.py")
        with open(path) as fh:
            exec(compile(fh.read(), path, "exec"), SHELL)
        SHELL["STATE"]["keep"] = KEEP
    return SHELL["step"](req, env_for(req), WORKSPACE, (PROTO_IN, PROTO_OUT), reap_strays, b64, unb64)


OPS = {"run": op_run, "shell": op_shell, "python": op_python, "cell": op_cell, "write": op_write, "read": op_read,
       "ping": lambda req: {"pid": os.getpid()}}


def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(PROTO_IN, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main():
    os.chdir(WORKSPACE)
    while True:
        head = read_exact(4)
        if head is None:
            return
        req = marshal.loads(read_exact(int.from_bytes(head, "little")))
        try:
            result = OPS[req["op"]](req)
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        if req.get("reap", True) and req["op"] in ("run", "python", "cell", "shell"):
            reap_strays()
        result["id"] = req.get("id")
        data = (to_json(result) + "\n").encode()
        while data:
            data = data[os.write(PROTO_OUT, data):]


if __name__ == "__main__":
    main()
