"""What every real runtime shares: the engine and a driver on an asyncio loop, the managers'
sink, and the futures of submitted actions.

A runtime subclass only builds its cluster and managers (``LocalRuntime``: this machine;
``RayRuntime``: a Ray cluster's nodes) and hands them to ``_build``. Everything else — submitting,
reports coming back, the scheduling loop, cancelling, the snapshot the server reads — is here once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Protocol

from ..core.action import CPU, Action, Finished, InvalidAction, Outcome, by_fields
from ..core.cluster import Cluster
from ..core.seam import Completion, Manager, Pool, Report
from ..driver import Driver
from ..engine import Engine
from ..waits import DEFAULT_MAX_QUEUE_S
from ..managers.models.spec import ModelServiceConfig
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.spec import SandboxConfig, SandboxResult
from ..policy import Costs, Policy, Profile, Wait, make_policy

if TYPE_CHECKING:
    from ..managers.sandbox.imagebox import Prewarmed
    from ..managers.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass
class ActionResult:
    """An action's terminal outcome with what it produced and its timings."""

    id: str
    outcome: Outcome
    result: Any  # SandboxResult for sandbox actions, the value for model and API calls
    act_s: float
    queue_s: float
    setup_s: float
    exec_s: float
    cores: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def stdout(self) -> str:
        return self.result.run.stdout if isinstance(self.result, SandboxResult) and self.result.run else ""

    @property
    def stderr(self) -> str:
        return self.result.run.stderr if isinstance(self.result, SandboxResult) and self.result.run else ""

    @classmethod
    def rejected(cls, id: str, message: str) -> "ActionResult":
        return cls(id, Outcome.REJECTED, None, 0.0, 0.0, 0.0, 0.0, 0, message)

    def __reduce__(self):  # field by field: a one-shot's answer to an HTTP front (server/service.py)
        return by_fields(self)


def _resolve(fut: asyncio.Future, r: "ActionResult | None") -> None:
    """``submit``'s wait told by ``submit_cb``: its result, or cancelled when the runtime closed."""
    if fut.done():
        return
    if r is None:
        fut.cancel()
    else:
        fut.set_result(r)


@dataclass(frozen=True)
class Snapshot:
    """What a server or a dashboard may read of a runtime at one instant."""

    queued: int
    running: int
    cores: int
    gpus: int
    cores_held: int
    gpus_held: int
    isolation: str | None
    # session density: where sessions are, the memory they use and reserve
    sessions: int = 0  # sessions with state on a node
    session_mem_used_gb: float = 0.0  # what idle sessions were measured to use
    session_mem_reserved_gb: float = 0.0  # what the engine reserves for sessions
    memory_gb: float = 0.0  # memory of the CPU nodes the engine plans with
    head_waited_s: float = 0.0  # how long the head of the queue has waited
    head_waits_for: str = ""  # and what for ("" when nothing is queued)


#: how many ended sessions a runtime remembers, to tell a late caller why its session is gone
ENDED_SESSIONS_KEPT = 100_000


class NoRoom(RuntimeError):
    """A new session is refused: no memory for it (``limit`` names the limit that is reached).
    Raised at once rather than letting the session's first step queue with no end in sight."""

    def __init__(self, limit: str, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses the server's front link (link.py) as itself
        return NoRoom, (self.limit, str(self), self.retry_after_s)


class SessionGone(LookupError):
    """A call on a session that has ended; ``reason`` says how (closed, expired, lost with its node)."""

    def __init__(self, session: str, reason: str) -> None:
        super().__init__(reason)
        self.session = session
        self.reason = reason

    def __reduce__(self):
        return SessionGone, (self.session, self.reason)


class ModelServices(Protocol):
    """What the embedded API and the service read of a runtime's model manager (``ModelManager``
    on one machine, ``RemoteModels`` on Ray)."""

    services: Mapping[str, ModelServiceConfig]

    def validate(self, model: str, op: str, tokens: Any, min_len: int) -> str | None:
        """Why a call cannot run (an unknown model or operation, bad tokens), or None."""
        ...


class Runtime:
    """The engine on this asyncio loop. Subclasses build the cluster and managers."""

    backend = "local"
    cluster: Cluster
    engine: Engine
    policy: Policy
    managers: Mapping[Pool, Manager]
    #: the model services this runtime schedules (None: none)
    models: "ModelServices | None" = None

    def __init__(self) -> None:
        #: per action in flight, who waits for its result (``submit_cb``'s callback)
        self._waiting: dict[str, Callable[[ActionResult | None], None]] = {}
        self._results: dict[str, Any] = {}
        self._wake: asyncio.TimerHandle | None = None
        self._ids = itertools.count()
        self.ended: OrderedDict[str, str] = OrderedDict()  # session -> why it ended
        self.session_listeners: list[Callable[[str, str], None]] = []  # (session, reason) when one ends
        # (session, its blob's path) when one is put to rest, (session, None) when it wakes
        self.rest_listeners: list[Callable[[str, str | None], None]] = []
        #: awaited after a session is recorded at rest and before its processes end (the server's
        #: journal commit): a crash between them then leaves a session that wakes from its state
        self.rest_barriers: list[Callable[[], Awaitable[None]]] = []
        self._recorders: list = []  # TraceRecorders, closed with the runtime
        self._first_submitted: dict[str, float] = {}  # re-run actions: when the first run was submitted
        self._round_due = False  # a round is asked for at the end of this loop pass (``tick_soon``)

    def _build(self, cluster: Cluster, policy: str | Policy, managers: Mapping[Pool, Manager], costs: Costs,
               profile: Profile | None, *, max_queue_s: float | None = DEFAULT_MAX_QUEUE_S,
               session_headroom_gb: float = 0.0) -> None:
        self.cluster = cluster
        self.managers = dict(managers)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.engine = Engine(cluster, self.policy, managers, MonotonicClock(), costs=costs, profile=profile,
                             max_queue_s=max_queue_s, session_headroom_gb=session_headroom_gb)
        self.engine.listeners.append(self._finished)
        self.driver = Driver(self.engine, self._arm)

    # -- the loop --------------------------------------------------------------------------------
    def tick(self) -> None:
        """A scheduling round now (after anything changed that is not a report or a submission:
        those ask for ``tick_soon``)."""
        self._round_due = False
        self.driver.tick()

    def tick_soon(self) -> None:
        """One scheduling round for everything this loop pass brings (the completions read from
        every worker's link and every local sandbox, the submissions), run once its callbacks are
        done: the reports are applied to the engine as they come (their futures resolve, their
        cores go back to the ledger at once) and one ``schedule()`` then hands the freed cores on,
        as vLLM's engine core applies a step's outputs and then schedules once. A freed core waits
        only for the rest of the pass, never for an idle ``epoll`` (coalescing reports over a wait
        did not pay: docs/performance.md). A round that is due runs at most once; ``tick()`` in
        between makes it a no-op round, not a lost one."""
        if self._round_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool, a test calling the sink by hand): at once
            self.tick()
            return
        self._round_due = True
        loop.call_soon(self._due_round)

    def _due_round(self) -> None:
        if self._round_due:
            self.tick()

    def _arm(self, at: float) -> None:
        if self._wake is not None:
            self._wake.cancel()
        self._wake = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._woken)

    def _woken(self) -> None:
        """The armed wake-up fired. asyncio may run a timer up to its clock resolution early;
        the driver must then arm the same instant again, not take it for still armed, or a queue
        deadline a hair in the future never fires."""
        self._wake = None
        self.driver.armed_at = None
        self.tick()

    def report(self, r: Report) -> None:
        """The managers' sink: an action ended or a model copy is resident."""
        if isinstance(r, Completion):
            self._results[r.action_id] = r.result
        self.engine.report(r)
        self.tick_soon()

    def _finished(self, f: Finished) -> None:
        result = self._results.pop(f.action.id, None)
        if f.action.id in self._waiting and self._retry(f, result):
            self._first_submitted.setdefault(f.action.id, f.submitted_at)
            return
        done = self._waiting.pop(f.action.id, None)
        first = self._first_submitted.pop(f.action.id, f.submitted_at)
        if done is None:
            return
        if result is None and f.action.pool == CPU:
            result = SandboxResult(message=f.message)
        try:
            done(ActionResult(f.action.id, f.outcome, result, f.finished_at - first, f.queue_s, f.setup_s, f.exec_s,
                              f.units, f.message))
        except Exception:  # the engine's listener must go on for every other action
            log.exception("the callback of action %s failed", f.action.id)

    def _retry(self, f: Finished, result: Any) -> bool:
        """Whether to run the action again instead of answering (a runtime whose nodes can die
        re-runs a one-shot once); the caller then waits for the new run, ACT counted from the
        first submission."""
        return False

    # -- inputs ----------------------------------------------------------------------------------
    async def submit(self, action: Action) -> ActionResult:
        """Schedule ``action`` and wait for its one terminal outcome. An id already in flight
        raises ``InvalidAction`` and leaves the first caller's wait untouched."""
        fut = asyncio.get_running_loop().create_future()
        self.submit_cb(action, lambda r: _resolve(fut, r))
        return await fut

    def submit_cb(self, action: Action, done: Callable[[ActionResult | None], None]) -> None:
        """``submit`` without a coroutine: ``done`` gets the one terminal outcome, from the engine's
        listener itself (``Service.run_oneshot``: no task per one-shot in the engine process), or
        None if the runtime closes first (the action has no outcome; ``submit``'s wait is then
        cancelled). Raises as ``submit`` does, before anything is scheduled."""
        if action.id in self._waiting:
            raise InvalidAction("id", f"action {action.id!r} is already in flight")
        self._waiting[action.id] = done
        try:
            self.engine.submit(action)  # a rejection reaches ``done`` through the listener
        except BaseException:
            self._waiting.pop(action.id, None)
            raise
        if not self._round_due:  # else it rides on the round already due this pass
            self.tick()  # at once: deferred to the pass's end, a lone one-shot would wait a loop pass

    def cancel(self, action_id: str) -> bool:
        """Cancel a queued or running action; False if it is not in flight here."""
        if action_id not in self._waiting:
            return False
        self.engine.cancel(action_id)
        self.tick()
        return True

    def state_of(self, action_id: str) -> str | None:
        """``queued``, ``running`` or None (not in flight)."""
        if action_id in self.engine.pending:
            return "queued"
        if action_id in self.engine.running or action_id in self.engine.following:
            return "running"  # a follower: its manager starts it the moment the action before it ends
        return None

    def why_waiting(self, action_id: str) -> Wait | None:
        """Why a queued action has not started, as the policy says; None when it is not queued."""
        action = self.engine.pending.get(action_id)
        return self.engine.why_waiting(action) if action is not None else None

    def end_session(self, trajectory: str, reason: str = "") -> None:
        """The session ends (its owner closed it, it expired, its node died): its state goes, and
        later calls on it raise ``SessionGone`` with ``reason``."""
        if trajectory in self.ended:
            return
        self.engine.end_trajectory(trajectory)
        self.ended[trajectory] = reason or f"session {trajectory} was closed"
        while len(self.ended) > ENDED_SESSIONS_KEPT:
            self.ended.popitem(last=False)
        for listener in self.session_listeners:
            listener(trajectory, self.ended[trajectory])

    def session_rested(self, trajectory: str, path: str | None) -> None:
        """The sandbox manager put a session to rest (its state in the file at ``path``) or woke it
        (None). At rest it holds no memory: its reservation drops to nothing (its next step
        reserves its estimate again, as any step does)."""
        if path is not None:
            self.engine.cpu.settle_session(trajectory, 0.0, 0.0)
            self.tick()
        for listener in self.rest_listeners:
            listener(trajectory, path)

    async def warm_up(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until new sessions find warm sandboxes; False if they do not
        yet (this runtime keeps none here: True)."""
        return True

    async def rest_recorded(self) -> None:
        """Return once what ``rest_listeners`` were told is durable (``rest_barriers``)."""
        for barrier in self.rest_barriers:
            await barrier()

    def session_state(self, trajectory: str) -> str | None:
        """Where a session's state is (``SandboxManager.session_state``); None where unknown here."""
        return None

    def rest_stats(self) -> dict | None:
        """Counts and limits of sessions at rest (``SandboxManager.rest_stats``); None where none rest here."""
        return None

    def move_stats(self) -> dict | None:
        """Sessions moved between nodes since the start (``moves``), how long the last 4,096 of
        them took (``move_p50_s``, ``move_max_s``: None before the first), and what the policy
        prices a move for balance at now (``move_price_s``); None where there are no nodes to move
        between."""
        return None

    def image_stats(self) -> dict | None:
        """Image pulls and the image store's disk (``SandboxManager.image_stats``: pulls, bytes
        pulled, pull seconds, cache hits, evictions, disk used and its bound); None where no
        sandbox manager of this process pulls."""
        return None

    def adopt_rested(self, trajectory: str, path: str, image: str | None) -> None:
        """A session an earlier server put to rest wakes here on its next step."""
        raise LookupError("this runtime cannot wake sessions put to rest by an earlier server")

    def prune_rested(self) -> int:
        """Once the sessions at rest are adopted: remove rested state no session owns (how many)."""
        return 0

    def adopt_live(self, trajectory: str, image: str | None) -> bool:
        """A session an earlier server left awake is re-attached where it still lives (a node
        agent that outlived the head, on Ray); False where it did not survive."""
        return False

    def prune_live(self) -> int:
        """Once the journal's sessions are re-attached: close the live sessions nobody owns (how many)."""
        return 0

    def check_session(self, trajectory: str) -> None:
        """Raise ``SessionGone`` if the session has ended."""
        reason = self.ended.get(trajectory)
        if reason is not None:
            raise SessionGone(trajectory, reason)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    def snapshot(self) -> Snapshot:
        e = self.engine
        head = e.queue_head()
        now = e.clock.now()
        return Snapshot(len(e.pending), len(e.running) + len(e.following), self.cluster.total_cores,
                        self.cluster.total_gpus,
                        e.cpu.meter.held, e.gpu.meter.held, self.isolation(), len(e.cpu.homes),
                        e.cpu.session_used_gb(), e.cpu.session_reserved_gb(),
                        sum(n.memory_gb for n in self.cluster.cpu_nodes),
                        now - head.submitted_at if head is not None else 0.0,
                        str(e.why_waiting(head)) if head is not None else "")

    # -- admitting sessions ----------------------------------------------------------------------
    def admit_session(self) -> None:
        """Raise ``NoRoom`` if a new session's first step could not find memory: no CPU node has
        room for its estimate (``Costs.session_mem_gb``) after what open sessions reserve (a step
        running now counts as its idle session, ``Engine.session_room_gb``).
        Runtimes add what their hosts really have (``LocalRuntime``: ``MemAvailable``)."""
        e = self.engine
        need = e.costs.session_mem_gb
        if not e.cpu.nodes:
            return  # no sandboxes here: the first step is rejected with its own message
        best = e.session_room_gb()
        if best < need:
            raise NoRoom("memory", f"no room for a new session: it needs {need * 1024:.0f} MB for its first step and "
                                   f"the most any node has left is {max(0.0, best) * 1024:.0f} MB "
                                   f"({len(e.cpu.homes)} sessions reserve {e.cpu.session_reserved_gb():.1f} GB of "
                                   f"{sum(n.memory_gb for n in self.cluster.cpu_nodes):.1f} GB); close sessions or "
                                   "retry later")

    def sandbox_manager(self) -> "SandboxManager | None":
        """The sandbox manager of this process, for what only it does (images, prewarming); None
        where there is none (no sandboxes, a test double) or sandboxes live on other nodes."""
        return None

    # -- images ----------------------------------------------------------------------------------
    def _image_sandboxes(self, what: str) -> "SandboxManager":
        sb = self.sandbox_manager()
        if sb is None:
            raise ImageError(f"{what}: this runtime has no image-capable sandboxes")
        return sb

    def check_image(self, image: str) -> None:
        """``ImageError`` unless ``image`` is in the image store or a registry reference; a
        reference not here starts to be pulled (``SandboxManager.check_image``; on Ray, on the
        node the session's first step will prefer)."""
        self._image_sandboxes("image").check_image(image)

    async def pull_image(self, image: str) -> str:
        """The store's name for ``image``, pulled now if it is a reference not here."""
        return await self._image_sandboxes("pull").pull_image(image)

    async def prewarm(self, image: str, n: int, nodes: int | None = None) -> "Prewarmed":
        """``n`` sandboxes of ``image`` started now (pulled first if it is a reference not here);
        ``nodes``: on how many nodes (this machine is one: more is a ``ValueError`` naming it)."""
        if nodes is not None and nodes != 1:
            raise ValueError(f"nodes: {nodes!r} asked, and this server runs on one machine (only a Ray cluster "
                             "prewarms on several nodes)")
        return await self._image_sandboxes("prewarm").prewarm(image, n)

    def sandbox_workers(self) -> tuple[int, int] | None:
        """Sandbox worker processes (up, started); None where one-shots run in this process."""
        return None

    def sandbox_config(self) -> SandboxConfig | None:
        """The config of the sandboxes this process schedules (limits, idle expiry); None where
        this runtime has none of its own."""
        return None

    def session_usage(self, trajectory: str) -> tuple[int, float] | None:
        """A session's memory (bytes) and CPU time (seconds) now, from its sandbox's cgroup;
        None before its sandbox has started, without a cgroup, or where the sandbox lives in
        another process."""
        return None

    def interrupt_step(self, trajectory: str) -> bool:
        """Kill what the running step of a session started, the session's sandbox living on
        (``Sandbox.interrupt_step``); False where this process does not hold that sandbox."""
        return False

    async def core_waits(self) -> dict | None:
        """Each core's wait between two one-shots, counted since start (``corewaits.summary``);
        None where this process keeps no count (the Ray runtime's nodes do their own)."""
        return None

    async def one_shot_sandboxes(self) -> dict[str, int] | None:
        """What became of one-shot sandboxes since start (``SandboxManager.one_shot_sandboxes``);
        None where this process keeps no count."""
        return None

    def isolation(self) -> str | None:
        return None

    def cgroups(self) -> str | None:
        """``v1``/``v2`` where sandbox limits use cgroups, None where they fall back."""
        return None

    def one_shot_cpus(self) -> str | None:
        """Where one-shots run: ``shared`` (any of the host's CPUs, their cores' worth of CPU time
        as a cgroup quota) or ``pinned`` (their cores' CPUs), as this process's sandbox manager
        decided at start (``SandboxManager.shares_cpus``; its workers run the same config on the
        same host); None where this process has none."""
        return None

    def drain_node(self, node_id: str) -> dict:
        """Take a node out of service, moving its sessions elsewhere (``RayRuntime``); a runtime
        of one machine has nowhere to move them: ``ValueError`` saying so."""
        raise ValueError(f"node: {self.backend} runs on one machine; only a Ray cluster's nodes can be drained "
                         f"(its sessions need another node to move to)")

    def nodes(self) -> list[dict]:
        """The nodes this runtime schedules (``GET /v1/cluster``)."""
        pool = self.engine.cpu
        running: dict[int | None, list[str]] = {}
        for r in self.engine.running.values():
            running.setdefault(r.allocation.node, []).append(r.action.id)
        out = [{"id": n.name, "name": n.name, "address": "127.0.0.1", "state": "alive" if pool.alive[i] else "dead",
                "cores": n.cores, "cores_free": pool.nfree(i), "gpus": 0, "islands": [], "memory_gb": n.memory_gb,
                "sandboxes": True, "isolation": self.isolation(), "cgroups": self.cgroups(), "problem": "",
                "running": sorted(running.get(i, [])),
                "sessions": sum(1 for home in pool.homes.values() if home == i)}
               for i, n in enumerate(pool.nodes)]
        gpool = self.engine.gpu
        for gi, g in enumerate(self.cluster.gpu_nodes):
            ids = [k for k, gpu in enumerate(gpool.gpus) if gpu.node == gi]
            out.append({"id": g.name, "name": g.name, "address": "127.0.0.1", "state": "alive", "cores": 0,
                        "cores_free": 0, "gpus": g.gpus, "islands": [list(i) for i in gpool.islands
                                                                   if i and gpool.gpus[i[0]].node == gi],
                        "memory_gb": None, "sandboxes": False, "isolation": None, "cgroups": None, "problem": "",
                        "running": sorted({gpool.gpus[k].busy for k in ids if gpool.gpus[k].busy}),
                        "sessions": 0})
        return out

    def record(self, path) -> None:
        """Write every finished action to ``path`` in the public trace format (JSONL), so the run
        can be replayed under every policy (``tangram simulate --trace``); closed with the runtime."""
        from ..sim.record import TraceRecorder

        recorder = TraceRecorder(path, self.cluster.quotas, self.cluster.models)
        self.engine.listeners.append(recorder)
        self._recorders.append(recorder)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the managers, then a first round (it lets the policy prefetch models)."""
        for manager in self.managers.values():
            await manager.start_up()
        self.tick()

    async def close(self) -> None:
        for aid in list(self.engine.pending):
            self.engine.cancel(aid)
        await self._shut_down_managers()
        waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            try:
                done(None)
            except Exception:
                log.exception("a callback failed as the runtime closed")
        for recorder in self._recorders:
            recorder.close()

    async def _shut_down_managers(self) -> None:
        for manager in self.managers.values():
            await manager.shut_down()

    async def __aenter__(self) -> "Runtime":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
