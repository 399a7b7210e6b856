"""Sandbox workers: one-shot runs carried out by worker processes beside the engine process.

On a many-core machine the engine process limits one-shot throughput: without workers, and with
the HTTP work in front processes, it spends ~93% of a core at 1,440 one-shots/s on 16 cores,
most of it on each sandbox's pipes, the recycling round trip, cgroup files and the result's
parsing — per-action process work that needs no decision. Here that work moves to
``n`` worker processes, each a ``NodeAgent`` (the same class a Ray node runs) with a
``SandboxManager`` of its own over the same CPUs; the engine process keeps every decision and
sends each one-shot to a worker as one frame over a socket pair (``link.py``), getting
its ``Completion`` back the same way.

Sessions stay in the engine process's own manager: their state (files, interpreter, shell) lives
in one sandbox that must be found again by the next step, snapshot, fork or expiry, and a step's
latency matters more there than throughput. So does every one-shot of another image.

A worker that dies ends the one-shots it held as ``infra_error`` (never the program's failure)
and is started again; while none is up, one-shots run in the engine process as without workers.
Workers die with the engine process (``PR_SET_PDEATHSIG``), their sandboxes with them.

The lease: when no core is free, the engine queues a one-shot behind a running one
(``Follow``), and the worker starts it the moment that run's sandbox answers, on its cores,
before the engine has heard of the end (its manager holds the follower's prepared request until
then: ``SandboxManager.start``'s ``after``). Without it each core idles for the report's way to
the engine and the start's way back: 21-23% of 16 cores at 3,356 one-shots/s. The engine stays
the one that decides what runs, in which order, on which cores; the worker only does not wait to
be told when.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from typing import Any

from ..core.action import Action, Allocation, Outcome
from ..core.seam import Completion, Sink
from ..link import Caller, Hub, PeerGone
from ..managers.sandbox.corewaits import merge
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spec import RunCode, SandboxConfig
from ..managers.tasks import TaskSet

log = logging.getLogger(__name__)

ENV = "TANGRAM_SANDBOX_WORKER"  # JSON: fd, index, config, cpus
CALLS = frozenset({"start", "run", "follow", "cancel", "resize", "core_waits", "one_shot_sandboxes", "shut_down"})


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.caller: Caller | None = None
        self.up = False


class SandboxWorkers:
    """The ``Pool.CPU`` manager when there are workers: one-shots of the default image go to a
    worker (chosen by the first core of their allocation, so a core's runs share a worker and its
    pool), everything else to ``local``, whose other methods (sessions, files, fork, prewarm,
    snapshots) are used as they are."""

    def __init__(self, local: SandboxManager, n: int, sink: Sink, cores: int | None = None) -> None:
        self.local = local
        self.n = n
        self.cores = cores  # the cores the engine schedules (None: one per CPU of the host)
        self.sink = sink
        self.tasks = TaskSet(sink, "sandbox workers")
        self.workers = [_Worker(i) for i in range(n)]
        self.where: dict[str, _Worker] = {}
        self._closing = False

    @property
    def config(self) -> SandboxConfig:
        """The engine process's sandbox config (the workers get theirs from it)."""
        return self.local.config

    # -- lifecycle -------------------------------------------------------------------------------
    async def start_up(self) -> None:
        await self.local.start_up()
        await asyncio.gather(*(self._start(w) for w in self.workers))
        log.info("sandbox workers: %d of %d up", sum(w.up for w in self.workers), self.n)

    def _config(self) -> dict:
        """The engine process's sandbox config, its pools split among the workers."""
        c = self.local.config

        def per(v: int) -> int:
            return max(1, v // self.n) if v else v

        # a ready sandbox for each of the worker's cores (those the engine schedules, which may be
        # more than its CPUs, up to two a CPU: a config's cores do not make memory): a run queued
        # behind another (``follow``) starts as that one ends, while the sandbox it ran in is still
        # being reset. Room for three idle a core: the run's, its follower's and the one being
        # reset can all be back at once, and a clean one killed at the idle cap is started anew a
        # moment later (10-50 ms of CPU against ~1 ms for a reset). The default cap (64 over all
        # the workers) grows to that room on hosts with more than ~21 cores (~10 MB of memory an
        # idle sandbox, PSS); a cap, or a pool, the config sets itself is split as it says:
        # memory is the user's to spend.
        cpus = len(self.local.host_cpus)
        cores = -(-min(self.cores or cpus, 2 * cpus) // self.n)
        warm = per(c.warm_pool)
        if warm and "warm_pool" not in c.model_fields_set:
            warm = max(warm, cores)
        idle = per(c.recycle_pool_max)
        if idle and "recycle_pool_max" not in c.model_fields_set:
            idle = max(idle, 3 * cores)
        cap = per(c.max_idle_sandboxes)
        if cap and "max_idle_sandboxes" not in c.model_fields_set:
            cap = max(cap, idle)
        return c.model_copy(update={"cpus": self.local.host_cpus, "warm_pool": warm,
                                    "warm_sessions": 0,  # workers run one-shots; sessions stay here
                                    "recycle_pool_max": idle,
                                    "max_idle_sandboxes": max(cap, warm)}
                            ).model_dump(mode="json")

    async def _start(self, w: _Worker) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env[ENV] = json.dumps({"fd": theirs.fileno(), "index": w.index, "config": self._config()})
        w.proc = subprocess.Popen([sys.executable, "-m", "arl_tangram.runtime.worker_process"], env=env,
                                  pass_fds=(theirs.fileno(),))
        theirs.close()
        w.caller = Caller(on_lost=lambda: self._lost(w), peer=f"sandbox worker {w.index}")  # noticed at once, idle or not
        await w.caller.connect(sock=mine)
        try:
            info = await asyncio.wait_for(w.caller.call("start"), 60)
        except (PeerGone, asyncio.TimeoutError) as e:
            log.error("sandbox worker %d did not start (%s): its one-shots run here", w.index, type(e).__name__)
            self._stop(w)
            return
        if not info.get("sandboxes"):
            log.error("sandbox worker %d cannot run sandboxes: %s", w.index, info.get("problem"))
            self._stop(w)
            return
        w.up = True

    def _stop(self, w: _Worker) -> None:
        w.up = False
        if w.caller is not None:
            w.caller.close()
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()

    async def shut_down(self) -> None:
        self._closing = True
        self.where.clear()  # runs in flight go unreported: the runtime is going away
        await self.tasks.close()
        live = [w for w in self.workers if w.up]
        await asyncio.gather(*(asyncio.wait_for(w.caller.call("shut_down"), 10) for w in live),
                             return_exceptions=True)  # a stuck worker is killed below
        for w in self.workers:
            self._stop(w)
            if w.proc is not None:
                await asyncio.to_thread(w.proc.wait)
        await self.local.shut_down()

    # -- the manager protocol --------------------------------------------------------------------
    def _eligible(self, action: Action) -> bool:
        """A one-shot of the default image: what a worker runs."""
        p = action.payload
        return (action.trajectory is None and isinstance(p, RunCode)
                and (getattr(p, "image", None) or None) == self.local.config.image)

    def chains(self, action: Action) -> bool:
        """``core.seam.Chainer``: a worker would run it (its runs can take a follower)."""
        return self._eligible(action) and any(_live(w) for w in self.workers)

    def _worker_for(self, action: Action, allocation: Allocation) -> _Worker | None:
        if not self._eligible(action):
            return None
        first = allocation.units[0] if allocation.units else 0
        for k in range(self.n):
            w = self.workers[(first + k) % self.n]
            if _live(w):
                return w
        return None

    def start(self, action: Action, allocation: Allocation) -> None:
        """The run's frame is queued now and its answer reported from the future's callback: no
        task per run (each task costs a pass of the loop on the way out and on the way back, and
        the core is held for all of it)."""
        w = self._worker_for(action, allocation)
        if w is None:
            self.local.start(action, allocation)
            return
        self.where[action.id] = w
        w.caller.request_cb("run", (action, allocation), lambda ok, value: self._answered(w, action, ok, value))

    def follow(self, action: Action, allocation: Allocation, after: str) -> bool:
        """``core.seam.Chainer``: the worker running ``after`` starts ``action`` the moment
        ``after`` ends there (at once if it has). Not taken (False) when ``after`` does not run on
        a worker that is up, or ``action`` is not a worker's (then the engine starts it itself)."""
        w = self.where.get(after)
        if w is None or not _live(w) or not self._eligible(action):
            return False
        self.where[action.id] = w
        w.caller.request_cb("follow", (action, allocation, after),
                            lambda ok, value: self._answered(w, action, ok, value))
        return True

    def _answered(self, w: _Worker, action: Action, ok: bool, value: Any) -> None:
        if self.where.pop(action.id, None) is None:
            return  # cancelled (already reported) or shutting down
        if ok:
            c = value
        elif isinstance(value, PeerGone):
            self._lost(w)
            c = Completion(action.id, Outcome.INFRA_ERROR,
                           message=f"sandbox worker {w.index} exited while the action ran (it is restarted)")
        else:  # a bug on either side: never the program's failure
            log.error("sandbox worker %d: action %s failed: %r", w.index, action.id, value)
            c = Completion(action.id, Outcome.INFRA_ERROR, message=f"internal error: {type(value).__name__}: {value}")
        self.sink(c)

    def _lost(self, w: _Worker) -> None:
        if not w.up or self._closing:
            return
        log.error("sandbox worker %d (pid %s) is gone: starting another", w.index, w.proc.pid if w.proc else None)
        self._stop(w)
        self.tasks.spawn(self._start(w))

    def cancel(self, action_id: str) -> None:
        w = self.where.pop(action_id, None)
        if w is None:
            self.local.cancel(action_id)
            return
        self.sink(Completion(action_id, Outcome.CANCELLED, message="cancelled while running"))
        if w.up:  # the worker stops the run; its late answer finds no entry and is dropped
            w.caller.request("cancel", action_id).add_done_callback(_quiet)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """A run on a worker is told in a frame of its own, so its cgroup shrinks a pass of the
        worker's loop after the engine handed the cores on (a start on the same worker comes
        after it on the same link; on another worker or here, it may start first)."""
        w = self.where.get(action_id)
        if w is None:
            self.local.resize(action_id, allocation)
        elif w.up:
            w.caller.request("resize", action_id, allocation).add_done_callback(_quiet)

    def close_session(self, trajectory: str) -> None:
        self.local.close_session(trajectory)

    async def core_waits(self) -> tuple[list[int], float]:
        """Each core's wait between two one-shots (``corewaits``), this process's and every live
        worker's merged."""
        got = await self._from_live("core_waits")
        return merge([self.local.core_waits.state(), *(g for g in got if isinstance(g, tuple))])

    async def one_shot_sandboxes(self) -> dict[str, int]:
        """``SandboxManager.one_shot_sandboxes``, this process's and every live worker's summed."""
        out = Counter(self.local.one_shot_sandboxes())
        for g in await self._from_live("one_shot_sandboxes"):
            if isinstance(g, dict):
                out.update(g)
        return dict(out)

    async def _from_live(self, call: str) -> list:
        """``call``'s answer from every live worker, at once; a worker that does not answer within
        2 s gives its error instead (left out by the callers)."""
        live = [w for w in self.workers if _live(w)]
        return await asyncio.gather(*(asyncio.wait_for(w.caller.call(call), 2.0) for w in live),
                                    return_exceptions=True)

def _live(w: _Worker) -> bool:
    """A worker that is up and whose link has not noticed it gone: one a run may be sent to."""
    return w.up and w.caller is not None and w.caller.gone is None


def _quiet(fut: asyncio.Future) -> None:
    """A fire-and-forget request's answer: read, so a lost worker is not logged twice."""
    if not fut.cancelled():
        fut.exception()


# -- the worker process ------------------------------------------------------------------------------

def main() -> None:
    from .agent import NodeAgent
    from .host import die_with_parent

    die_with_parent("sandbox worker")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine process's to handle
    spec = json.loads(os.environ.pop(ENV))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s worker{spec['index']} %(name)s: "
                                                    "%(message)s")
    config = SandboxConfig.model_validate(spec["config"])
    agent = NodeAgent(f"worker-{spec['index']}", len(config.cpus), config, cpus=tuple(config.cpus))
    sock = socket.socket(fileno=spec["fd"])

    async def serve() -> None:
        done = asyncio.Event()
        hub = Hub(_Served(agent, done), CALLS)
        await hub.attach(sock)
        while not done.is_set() and hub.links:  # the engine process closed the link: nothing to serve
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        if not done.is_set():
            await agent.shut_down()

    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(serve())


class _Served:
    """The agent's calls over the link; ``shut_down`` also ends the process."""

    def __init__(self, agent, done: asyncio.Event) -> None:
        self.agent = agent
        self.done = done
        self.active: set[str] = set()  # the runs started here and not ended

    async def start(self) -> dict:
        return await self.agent.start()

    REPLIES = frozenset({"run", "follow"})  # answered through the hub's reply callback (link.py)

    def run(self, action: Action, allocation: Allocation, reply, after: str | None = None) -> None:
        aid = action.id
        self.active.add(aid)
        try:
            self.agent.run_cb(action, allocation, lambda c: self._ended(aid, c, reply), after=after)
        except BaseException:
            self.active.discard(aid)
            raise

    def _ended(self, aid: str, c: Completion, reply) -> None:
        self.active.discard(aid)
        reply(True, c)

    def follow(self, action: Action, allocation: Allocation, after: str, reply) -> None:
        """Start ``action`` on the cores of ``after`` as soon as ``after``'s sandbox answers: the
        manager takes and prepares its sandbox now and writes its request in the call that reads
        ``after``'s answer (``SandboxManager.start``); at once when ``after`` answered before
        this frame came. The engine hands a follower its cores when its predecessor's end is
        reported, which a cancel reports before the run is killed here, so a follower may be
        followed in turn: that one waits for it, and, should it be cancelled before its turn, for
        what it waited for. A second follower of one run is the engine's bug: refused."""
        try:
            self.run(action, allocation, reply, after)
        except RuntimeError as e:
            reply(False, e)

    def cancel(self, action_id: str) -> None:
        self.agent.cancel(action_id)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        self.agent.resize(action_id, allocation)

    def core_waits(self) -> tuple[list[int], float]:
        manager = self.agent.manager
        return manager.core_waits.state() if manager is not None else ([], 0.0)

    def one_shot_sandboxes(self) -> dict[str, int]:
        manager = self.agent.manager
        return manager.one_shot_sandboxes() if manager is not None else {}

    async def shut_down(self) -> None:
        await self.agent.shut_down()
        asyncio.get_running_loop().call_later(0.05, self.done.set)

