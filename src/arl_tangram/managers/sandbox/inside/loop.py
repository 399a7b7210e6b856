"""The agent's loop (``serve``): read a request, run its operation (``OPS``: op -> module and
function, the module imported when its first operation comes, so a one-shot sandbox never loads
what only sessions use), answer, reap; and its start (``main``)."""

import os

from . import boot, read_message, to_json, write_all
from .procs import drop_bash_ahead, reap_strays

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
    # a bash one-shot writes its script first: its module is imported before the first request (a
    # warm sandbox's start is off the latency path, its first request is not), after the zygote's
    # fork (the zygote never writes a file for the host)
    from . import files  # noqa: F401
    serve(st)


def serve(st):
    """One request at a time from the host's channel, each answered by one JSON line."""
    then = None
    while True:
        # a one-shot's reset may ride on its run (``then``): it runs right after the run's answer and
        # the reaping, answered under its own id, before anything else is read (the host then spends
        # no write on it, and the agent no wake-up)
        if then is not None:
            req, then = then, None
        else:
            req = st.held.pop(0) if st.held else read_message(st.proto_in)
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
