"""One Ray action's latency hop by hop (``tangram bench cluster``'s ``hops``), in process.

A head (``Tangram.ray``) whose agents are ``TimedAgent``s, and stamps taken on the head by the
bench alone (instance attributes set on this head's objects: the runtime's code is as deployed):
every point is ``time.monotonic()``, one clock for every process of a loopback cluster.

========================  ====================================================================
hop                       from, to
========================  ====================================================================
``queued``                the client's call (``Tangram.run``) to the engine's start of it on a
                          node (``RemoteSandboxes.start``): submission, the wait for a free
                          core (under load), the scheduling round
``link_out``              that start to the agent's ``run_linked``: the frame's pickle, the
                          node's link (one write per loop pass), the agent's event loop
``agent_in``              the agent's ``run_linked`` to its sandbox manager's ``start``
``sandbox``               that start to the manager's report (the one-shot itself; for a
                          one-shot sent ahead to follow another on its cores, the lease's
                          ``follow``, its wait for that one too: ``followed`` counts them)
``agent_out``             the report to the agent's reply being sent
``link_back``             that reply to the head having the answer (the link's reader calls the
                          manager's sink)
``finish``                the answer to the engine's record of the outcome (the report, the round)
``answer``                that record to the client's call returning
========================  ====================================================================

``alone``: one action at a time (the latency of the path); ``loaded``: ``per_core`` per node core in
flight, the in-process rate beside it, and the bench process's CPU (the head, its Ray threads and
the client, ``cpu.ClusterCpuMeter``) per action. ``message_bytes``: what crosses the link for
one action, pickled (the call's arguments, the answer).

``profiled`` (``profiled`` > 0): that many more under load with the main thread sampled: its CPU
per action (``time.thread_time``) split by ``GROUPS`` in the shares of the samples that found it
busy, and the functions most often found running. Sampled, not traced: ``cProfile`` traces every
call, which inflates code of many small calls against code in C, and on Python 3.12
(``sys.monitoring``) it sees every thread, Ray's too, while its clock is one thread's. Where
``py-spy`` is installed it samples from outside (``SpySampler``: no GIL taken, so no moment of the
main thread is favoured); else a thread of this process does (``MainSampler``), which can read a
frame only when it gets the GIL: under uvloop, which lets the GIL go inside its C loop between
callbacks, most of its samples then land there (``loop_c``), and the split says little. Either
way, time in C code under a Python function (pickling, the compiled engine) goes to that function,
and a sample whose innermost frame is ``asyncio.runners``' is the event loop's C code (uvloop,
libuv, their system calls): ``loop_c``. ``py-spy`` counts a thread that is runnable but waiting
for a core as busy, at the frame it woke in (the loop's wait, mostly): on a host without a spare
core for the head (a 2-core machine) ``loop_c`` and ``asyncio`` include that wait.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable

from ..runtime.agent import NodeAgent
from .cpu import ClusterCpuMeter

HOPS = ("queued", "link_out", "agent_in", "sandbox", "agent_out", "link_back", "finish", "answer")


#: the main thread's code by who owns it, first match of a function's file or built-in's name wins.
#: ``ray`` takes the serialisation Ray does for a call in this process (pickle, msgpack, the check
#: of the call's arguments against the method's signature: ``inspect``), the head calling nothing
#: else that uses them
GROUPS = (("loop_c", ("/asyncio/runners.py",)),
          ("journal", ("/arl_tangram/server/journal.py", "sqlite3")),
          ("service", ("/arl_tangram/server/", "/arl_tangram/api/", "/pydantic/", "pydantic_core")),
          ("ray", ("/ray/", "ray._raylet", "'ray.", "Pickler.dump", "/msgpack/", "/inspect.py", "/pickle.py")),
          ("bench", ("/arl_tangram/bench/",)),
          ("runtime", ("/arl_tangram/runtime/", "/arl_tangram/managers/")),
          ("engine", ("/arl_tangram/", "arl_tangram.", "Engine", "Driver")),
          ("asyncio", ("/asyncio/", "_asyncio.", "select.epoll", "/selectors.py", "_contextvars", "'_asyncio")))


def group_of(key: tuple[str, int, str]) -> str:
    """A function's group (``GROUPS``; ``other`` where none matches) by its file, first line and name."""
    where = f"{key[0]} {key[2]}"
    for name, marks in GROUPS:
        if any(m in where for m in marks):
            return name
    return "other"


class TimedAgent(NodeAgent):
    """A node agent that stamps each action's hops on its node: received, sandbox started,
    sandbox reported, replied (``take_stamps``), and the size of the first actions' messages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stamps: dict[str, list[float]] = {}
        self.sizes: list[tuple[int, int]] = []

    def _timed(self, action, allocation, reply):
        st = self.stamps[action.id] = [time.monotonic(), 0.0, 0.0, 0.0]

        def replied(ok, c, st=st):
            st[3] = time.monotonic()
            if ok and len(self.sizes) < 20:
                self.sizes.append((len(pickle.dumps((action, allocation), 5)), len(pickle.dumps(c, 5))))
            reply(ok, c)

        return replied

    def run_linked(self, action, allocation, reply):
        return super().run_linked(action, allocation, self._timed(action, allocation, reply))

    def follow_linked(self, action, allocation, after, reply):
        return super().follow_linked(action, allocation, after, self._timed(action, allocation, reply))

    def run_cb(self, action, allocation, done, after=None):
        st = self.stamps.get(action.id)
        if st is None:  # a move's snapshot or restore: not timed
            return super().run_cb(action, allocation, done, after)
        st[1] = time.monotonic()

        def reported(c, st=st):
            st[2] = time.monotonic()
            done(c)

        return super().run_cb(action, allocation, reported, after)

    def take_stamps(self) -> tuple[dict[str, list[float]], list[tuple[int, int]]]:
        out, self.stamps = self.stamps, {}
        return out, self.sizes


class HeadStamps:
    """Stamps on the head of one ``Tangram.ray``: the engine's start of an action, its answer read
    from the link (the manager's sink), the engine's record (its listener)."""

    def __init__(self, rt: Any) -> None:
        self.points: dict[str, dict[str, float]] = {}
        sandboxes = rt.sandboxes
        start, follow, sink = sandboxes.start, sandboxes.follow, sandboxes.sink
        self.followed: set[str] = set()

        def timed_start(action, allocation):
            self.points.setdefault(action.id, {})["started"] = time.monotonic()
            return start(action, allocation)

        def timed_follow(action, allocation, after):
            self.points.setdefault(action.id, {})["started"] = time.monotonic()
            taken = follow(action, allocation, after)
            if taken:
                self.followed.add(action.id)
            return taken

        def timed_sink(c):
            self.points.setdefault(c.action_id, {})["answered"] = time.monotonic()
            return sink(c)

        sandboxes.start = timed_start  # this head's instances only
        sandboxes.follow = timed_follow
        sandboxes.sink = timed_sink
        rt.engine.listeners.append(lambda f: self.points.setdefault(f.action.id, {}).__setitem__(
            "finished", time.monotonic()))


def hops_of(client: tuple[float, float], head: dict[str, float], agent: list[float]) -> dict[str, float] | None:
    """One action's hops in ms (None if a point is missing: a re-run, say)."""
    points = [client[0], head.get("started"), *agent, head.get("answered"),
              head.get("finished"), client[1]]
    if any(not p for p in points):
        return None
    return {h: (b - a) * 1000 for h, a, b in zip(HOPS, points, points[1:])}


def _summary(rows: list[dict[str, float]]) -> dict:
    from ..sim.metrics import percentile

    out: dict = {"n": len(rows)}
    for q in (50, 99):
        out[f"p{q}_ms"] = {h: round(percentile(sorted(r[h] for r in rows), q), 3) for h in HOPS} if rows else {}
    if rows:
        out["p50_ms"]["total"] = round(percentile(sorted(sum(r.values()) for r in rows), 50), 3)
    return out


async def _probe(tg: Any, stamps: HeadStamps, n: int, concurrency: int, prefix: str) -> tuple[dict, float]:
    clients: dict[str, tuple[float, float]] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        aid = f"{prefix}-{i}"
        async with gate:
            t = time.monotonic()
            r = await tg.run("pass", id=aid, timeout_s=60)
            if r.ok:
                clients[aid] = (t, time.monotonic())

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return clients, time.perf_counter() - t0


class MainSampler:
    """The main thread's running function every ``every_s`` (a thread reading its frame), its
    group counted; found waiting for events (the kernel's ``wchan`` of the thread names an
    ``epoll`` or ``poll`` wait: uvloop waits in C, below any Python frame; or, where ``wchan``
    says nothing, the frame is ``selectors``' wait) it is idle and not counted. A busy sample whose
    frame is ``asyncio.runners``' is uvloop's own C code (its callbacks' bookkeeping): ``asyncio``."""

    def __init__(self, every_s: float = 0.001) -> None:
        self.every_s = every_s
        self.main = threading.main_thread().ident
        self.wchan = f"/proc/self/task/{threading.main_thread().native_id}/wchan"
        self.groups: Counter = Counter()
        self.functions: Counter = Counter()
        self.idle = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="main thread sampler", daemon=True)
        self._switch = sys.getswitchinterval()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            frame = sys._current_frames().get(self.main)
            if frame is None:
                continue
            code = frame.f_code
            try:
                with open(self.wchan) as fh:
                    waits = "poll" in fh.read()
            except OSError:
                waits = False
            if waits or (code.co_name == "select" and code.co_filename.endswith("selectors.py")):
                self.idle += 1
                continue
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            self.groups[group_of(key)] += 1
            self.functions[key] += 1

    def __enter__(self) -> "MainSampler":
        sys.setswitchinterval(min(self._switch, self.every_s / 2))  # the sampler gets the GIL in time
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def shares(self, cpu_ms_per_action: float, top: int = 12) -> dict:
        """The main thread's CPU per action (ms) split by group in the busy samples' shares, and
        the ``top`` functions most often found running."""
        busy = sum(self.groups.values())

        def ms(k: int) -> float:
            return round(cpu_ms_per_action * k / busy, 4) if busy else 0.0

        return {"samples": busy, "idle_samples": self.idle, "cpu_ms_per_action": round(cpu_ms_per_action, 4),
                "ms_per_action": {g: ms(k) for g, k in self.groups.most_common()},
                "top": [{"function": f"{os.path.basename(f)}:{line} {name}", "group": group_of((f, line, name)),
                         "share": round(k / busy, 4)} for (f, line, name), k in self.functions.most_common(top)]}


class SpySampler:
    """``MainSampler``'s figures read by ``py-spy`` from outside the process (``record --threads
    --nonblocking``, raw stacks): the main thread's innermost frame in each busy sample. ``py-spy``
    leaves idle threads out, so ``idle`` is not known (None). ``pid``: another process (the HTTP
    head's engine process, whose main thread's id is its pid); None, this one."""

    def __init__(self, every_s: float = 0.001, pid: int | None = None) -> None:
        self.rate = max(1, round(1 / every_s))
        self.pid = os.getpid() if pid is None else pid
        self.native_id = threading.main_thread().native_id if pid is None else pid
        self.groups: Counter = Counter()
        self.functions: Counter = Counter()
        self.idle: int | None = None
        self._proc: subprocess.Popen | None = None
        self._out = ""

    @staticmethod
    def available() -> bool:
        """py-spy on the PATH and allowed to read this process (root, or ptrace permitted)."""
        return shutil.which("py-spy") is not None and (os.geteuid() == 0 or _ptrace_scope() == 0)

    def __enter__(self) -> "SpySampler":
        fd, self._out = tempfile.mkstemp(prefix="tangram-spy-", suffix=".txt")
        os.close(fd)
        self._proc = subprocess.Popen(["py-spy", "record", "--pid", str(self.pid), "--rate", str(self.rate),
                                       "--format", "raw", "--output", self._out, "--threads", "--nonblocking",
                                       "--full-filenames"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached before the batch starts
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file as it stops
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        try:
            with open(self._out, errors="replace") as fh:  # (a frame's name may hold any bytes)
                self.read(fh.read())
        finally:
            os.unlink(self._out)
        if not self.groups and err:
            raise RuntimeError(f"py-spy read nothing: {err.decode(errors='replace')[-500:]}")

    def read(self, raw: str) -> None:
        """Count the main thread's lines of ``py-spy``'s raw output (``thread (TID): NAME;frame;...
        COUNT``, a frame ``function (file:line)``)."""
        mine = f"thread ({self.native_id})"
        for line in raw.splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if len(frames) < 2 or not frames[0].startswith(mine) or not count.isdigit():
                continue
            function, _, where = frames[-1].rpartition(" (")
            file, _, lineno = where.rstrip(")").rpartition(":")
            key = (file, int(lineno) if lineno.isdigit() else 0, function.rpartition(".")[2] or function)
            self.groups[group_of(key)] += int(count)
            self.functions[key] += int(count)

    shares = MainSampler.shares


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 0


def hops(address: str, nodes: int, cores: int, alone: int, loaded: int, per_core: int,
         log: Callable[[str], None], profiled: int = 0) -> dict:
    """``alone`` one-shots one at a time, then ``loaded`` at ``per_core`` per node core, through a
    head in this process on the cluster at ``address`` (``nodes`` nodes of ``cores``)."""
    from ..managers.sandbox.spec import SandboxConfig
    from ..runtime.api import Tangram
    from ..runtime.ray_nodes import ray_module

    async def main() -> dict:
        tg = Tangram.ray(address, sandbox=SandboxConfig(warm_pool=2 * cores))
        rt = tg.runtime
        rt._agent_cls = ray_module().remote(num_cpus=0, max_restarts=0)(TimedAgent)
        async with tg:
            stamps = HeadStamps(rt)
            await _probe(tg, stamps, 2 * nodes * cores, nodes * cores, "warm")
            first, _ = await _probe(tg, stamps, alone, 1, "alone")
            meter = ClusterCpuMeter(os.getpid())
            before = meter.read()
            second, span = await _probe(tg, stamps, loaded, per_core * nodes * cores, "loaded")
            cpu = ClusterCpuMeter.per_action(before, meter.read(), len(second))
            shares = None
            sampler: Any = None
            if profiled:
                sampler = SpySampler() if SpySampler.available() else MainSampler()
                try:
                    with sampler:
                        t = time.thread_time()
                        third, _ = await _probe(tg, stamps, profiled, per_core * nodes * cores, "profiled")
                        used = time.thread_time() - t
                    shares = sampler.shares(used * 1000 / max(1, len(third)))
                except RuntimeError as e:  # py-spy could not read this process (no ptrace here, say)
                    log(f"  the profile was not taken: {e}")
            agents: dict[str, list[float]] = {}
            sizes: list[tuple[int, int]] = []
            for node in rt.nodes_by_id.values():
                if node.serving:
                    got, seen = await node.handle.take_stamps.remote()
                    agents.update(got)
                    sizes += seen

        def rows(clients: dict) -> list[dict]:
            out = (hops_of(c, stamps.points.get(a, {}), agents.get(a, [])) for a, c in clients.items())
            return [r for r in out if r is not None]

        head = cpu["head"]
        return {"nodes": nodes, "cores_per_node": cores, "alone": _summary(rows(first)),
                "loaded": {**_summary(rows(second)), "concurrency": per_core * nodes * cores,
                           "followed": sum(1 for a in second if a in stamps.followed),
                           "actions_per_s": round(len(second) / span, 1),
                           "process_cpu_ms_per_action": {k: head[k] for k in ("main", "ray_threads", "other_threads",
                                                                               "total", "sys")}},
                "message_bytes": {"call": max((s[0] for s in sizes), default=None),
                                  "answer": max((s[1] for s in sizes), default=None)},
                **({"profiled": {"n": profiled, "sampler": "py-spy" if isinstance(sampler, SpySampler) else "in-process",
                                 **shares}} if shares is not None else {})}

    try:  # the loop the server's engine process runs on, where installed
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        loop = "uvloop"
    except ImportError:
        runner, loop = asyncio.Runner(), "asyncio"
    with runner:
        r = {"loop": loop, **runner.run(main())}
    a, b = r["alone"].get("p50_ms", {}), r["loaded"].get("p50_ms", {})
    log(f"hops, {nodes} node(s), {loop}, p50 ms alone / loaded: " + ", ".join(
        f"{h} {a.get(h)}/{b.get(h)}" for h in (*HOPS, "total")))
    log(f"  in process: {r['loaded']['actions_per_s']} actions/s loaded; this process's CPU ms/action "
        f"{r['loaded']['process_cpu_ms_per_action']}; message bytes {r['message_bytes']}")
    if "profiled" in r:
        log(f"  main thread sampled, ms/action by group: {r['profiled']['ms_per_action']}")
    return r
