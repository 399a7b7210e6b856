"""The native service the HTTP routes call: the runtime, the journal, sessions, stats and metrics.

Routes stay thin (validate, call, serialise); everything with a rule lives here: idempotency,
backpressure, recovery after a crash. It speaks the native API (``api/v1.py``) only: another HTTP
dialect translates onto it in its own module (``server/sandboxfusion.py``; ``server/dialect.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import shutil
import tempfile
import time
import uuid
from collections import deque
from contextvars import ContextVar
from typing import Any, Callable, TypeVar

from pydantic import ValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import __version__

from ..api import v1
from ..core.action import Action, Outcome
from ..link import answers_later
from ..core.names import path_problem
from ..managers.sandbox.spec import CommandResult, Files, FsCall, SandboxResult
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.languages import LANGUAGES
from ..runtime import ActionResult, NoRoom, Runtime, Session, SessionGone, Tangram
from ..runtime.api import SessionError, one_shot
from .journal import Entry, Journal, JournalError, new_id
from .snapshots import Snapshots, UnknownSnapshot

log = logging.getLogger(__name__)
#: seconds a starting server waits for the sessions' warm pool before it answers (runtime.warm_up)
WARM_UP_S = 10.0


class Overloaded(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full: retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses the front link (link.py) as itself
        return Overloaded, (self.retry_after_s,)


class NotFound(LookupError):
    pass


class BadRequest(ValueError):
    pass


class Conflict(ValueError):
    """An id the request chose is in use by what it may not see (HTTP 409): the answer says that
    much and nothing of whose it is or what it holds."""


class Forbidden(PermissionError):
    """A request acting as one job (its API key's) names another (HTTP 403, naming the field)."""


#: the job of the API key the current request carries (``server/app.py`` sets it; across the front
#: link ``Local.scoped`` does), or None: the server's token, or no keys configured, sees every job.
#: A context variable rather than an argument of every call: the scope is the request's, and every
#: dialect's calls honour it without each growing a parameter.
CALLER_JOB: ContextVar[str | None] = ContextVar("tangram_caller_job", default=None)
#: the job the native API's bodies name when the caller names none (``api/v1.py``)
UNNAMED_JOB = "default"


def job_for(named: str | None, default: str, field: str = "job") -> str:
    """The job a request acts as: its API key's, whatever the body says as long as it names that
    job or none (``None``, or the native API's ``default``); ``Forbidden`` when it names another.
    Without a key: what the body names, else ``default``."""
    scope = CALLER_JOB.get()
    if scope is None:
        return named or default
    if named and named != scope and named != UNNAMED_JOB:
        raise Forbidden(f"{field}: this API key acts as job {scope!r}, not {named!r}")
    return scope


def visible(job: str) -> bool:
    """Whether the current request may see what belongs to ``job`` (anything else is a 404)."""
    scope = CALLER_JOB.get()
    return scope is None or scope == job


class Unavailable(RuntimeError):
    """The request was fine; our infrastructure failed it (HTTP 503, never a 4xx)."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.actions = Counter("tangram_actions_total", "Actions finished, by service and outcome",
                               ["service", "outcome"], registry=self.registry)
        self.act = Histogram("tangram_act_seconds", "Action completion time", ["service"], registry=self.registry,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.queue = Gauge("tangram_queue_depth", "Actions waiting", registry=self.registry)
        self.running = Gauge("tangram_running_actions", "Actions running", registry=self.registry)
        self.cores_held = Gauge("tangram_cpu_cores_held", "Cores allocated to running actions", registry=self.registry)
        self.cores = Gauge("tangram_cpu_cores", "Cores in the pool", registry=self.registry)
        self.sessions = Gauge("tangram_sessions", "Open sessions", registry=self.registry)
        # session density: where sessions are and the memory they use and reserve
        self.sessions_placed = Gauge("tangram_sessions_placed", "Sessions with state on a node",
                                     registry=self.registry)
        self.session_mem_used = Gauge("tangram_session_memory_used_bytes", "Memory idle sessions were measured "
                                      "to use", registry=self.registry)
        self.session_mem_reserved = Gauge("tangram_session_memory_reserved_bytes", "Memory the scheduler reserves "
                                          "for sessions (use + headroom idle, the estimate while running)",
                                          registry=self.registry)
        self.memory = Gauge("tangram_cpu_memory_bytes", "Memory of the CPU nodes the scheduler plans with",
                            registry=self.registry)
        self.head_wait = Gauge("tangram_queue_head_wait_seconds", "How long the head of the queue has waited "
                               "(what for: /healthz head_waits_for)", registry=self.registry)
        self.refused = Counter("tangram_sessions_refused_total", "New sessions refused, by the limit reached",
                               ["limit"], registry=self.registry)
        # sessions at rest: state on disk, no processes
        self.sessions_awake = Gauge("tangram_sessions_awake", "Sessions whose processes are alive (running or "
                                    "idle and frozen)", registry=self.registry)
        self.sessions_at_rest = Gauge("tangram_sessions_at_rest", "Sessions at rest: state on disk, no processes",
                                      registry=self.registry)
        self.rest_bytes = Gauge("tangram_rest_disk_bytes", "Disk used by sessions at rest", registry=self.registry)
        self.rest_limit = Gauge("tangram_rest_disk_limit_bytes", "Disk sessions at rest may use "
                                "(sandbox.rest_disk_mb)", registry=self.registry)
        self.rests = Gauge("tangram_session_rests", "Sessions put to rest since start", registry=self.registry)
        self.wakes = Gauge("tangram_session_wakes", "Sessions woken from rest since start", registry=self.registry)
        self.rest_failures = Gauge("tangram_session_rest_failures", "Sessions that could not be put to rest (they "
                                   "stayed awake) since start", registry=self.registry)
        self.moves = Gauge("tangram_session_moves", "Sessions carried to another node since start (a drain, a node "
                           "lost, or for balance)", registry=self.registry)
        self.move_p50 = Gauge("tangram_session_move_p50_seconds", "How long the last 4,096 moves took, p50",
                              registry=self.registry)
        self._children: dict[tuple[str, str], tuple] = {}

    def count(self, service: str, outcome: str, act_s: float) -> None:
        """One finished action (the labelled children are kept: ``labels()`` is a lookup with
        locking and validation, twice per request otherwise)."""
        pair = self._children.get((service, outcome))
        if pair is None:
            pair = self._children[(service, outcome)] = (self.actions.labels(service, outcome),
                                                         self.act.labels(service))
        pair[0].inc()
        pair[1].observe(act_s)


def _reason(err: Exception) -> str:
    """``field: problem`` for a validation error (pydantic's or ours)."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        return f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
    return str(err) or type(err).__name__


def _b64decode(field: str, data: str | None) -> bytes:
    if not data:
        return b""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{field}: not valid base64") from None


def decode_files(field: str, files: dict[str, str]) -> dict[str, bytes]:
    return {p: _b64decode(f"{field}.{p}", d) for p, d in files.items()}


def oneshot_action(id: str, req: v1.ActionRequest, files: dict[str, bytes]) -> Action:
    """The action of a native one-shot request (``files``: its files decoded): what a native
    submit, a recovery's re-run and another dialect's translation all schedule."""
    a = req.action
    return one_shot(id, a.code, a.language, stdin=a.stdin, files=files, fetch_files=a.fetch_files,
                    timeout_s=a.timeout_s, compile_timeout_s=a.compile_timeout_s, memory_mb=a.memory_mb,
                    memory_as_rlimit=a.memory_as_rlimit, cpus=req.cpus, parallel_fraction=req.hints.parallel_fraction,
                    job=req.job, hint_s=req.hints.work_s, operation=req.hints.operation, image=a.image,
                    remaining_turns=req.hints.remaining_turns)


def _check_language(field: str, name: str) -> None:
    """A language the server does not know is the caller's error (a 422 naming the field); one
    it knows but whose toolchain a sandbox lacks stays a ``rejected`` action."""
    if name not in LANGUAGES:
        raise BadRequest(f"{field}: unknown {name!r} (known: {', '.join(sorted(LANGUAGES))})")


def _request_key(req: v1.ActionRequest) -> dict:
    """What identifies a native request for its id: every field but ``wait``, flattened one level
    (``action.code``) so that a conflict names what differs."""
    out: dict = {}
    for k, v in req.model_dump(mode="json", exclude={"wait", "id"}).items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def _command(c: CommandResult | None) -> v1.CommandResult | None:
    if c is None:
        return None
    return v1.CommandResult(exit_code=c.exit_code, stdout=c.stdout, stderr=c.stderr, duration_s=c.duration_s,
                            truncated=c.truncated, timed_out=c.timed_out)


T = TypeVar("T")


def callers_error(err: BaseException) -> bool:
    """Whether an exception that stops a step is the request's own fault (the native API's)."""
    return isinstance(err, (BadRequest, Forbidden, Conflict))


class Step:
    """One journaled step of a session (``Service.step``): admitted and accepted into the journal
    when it is made, then ended by exactly one terminal outcome. Run it inside ``async with``:
    ``record`` its result, or ``unrun`` the outcome it ends with without running. An exception
    that leaves the block first ends it too: ``rejected`` when it is the caller's (``rejects``),
    else ``infra_error`` (a fault of ours, the server stopping included), never an outcome a
    caller would score. Leaving the block once it has ended waits until that outcome is on disk,
    so the answer goes after it and a restart never ends the step a second time."""

    __slots__ = ("id", "job", "label", "ended", "_record", "_unrun", "_durable", "_rejects")

    def __init__(self, id: str, job: str, label: str, record: Callable[[ActionResult, str, str], v1.ActionResult],
                 unrun: Callable[[str, str, str], None], durable: Callable[[], Any],
                 rejects: Callable[[BaseException], bool]) -> None:
        self.id, self.job, self.label = id, job, label
        self.ended = False
        self._record, self._unrun, self._durable, self._rejects = record, unrun, durable, rejects

    def record(self, r: ActionResult) -> v1.ActionResult:
        """The step's result: journaled, counted under its job and label, answered as the native API's."""
        self.ended = True
        return self._record(r, self.job, self.label)

    def unrun(self, outcome: str, message: str) -> None:
        """The step ends with ``outcome`` without having run (killed while it waited, say)."""
        self.ended = True
        self._unrun(self.id, outcome, message)

    async def __aenter__(self) -> "Step":
        return self

    async def __aexit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is not None:
            if not self.ended:
                self.unrun(*self.failure(err))
            return
        if not self.ended:  # a dialect's bug: its step still gets its one outcome
            self.unrun("infra_error", "internal error: the step ended without a result")
        await self._durable()

    def failure(self, err: BaseException) -> tuple[str, str]:
        """The outcome and message of a step that ``err`` stopped before it had a result."""
        if self._rejects(err):
            return "rejected", f"the step did not run: {err}"[:500]
        if isinstance(err, SessionGone):
            return "infra_error", err.reason
        if not isinstance(err, Exception):  # cancelled: only the server's stopping cancels a step
            return "infra_error", "the server stopped before this step ended (retry it)"
        return "infra_error", f"internal error: {type(err).__name__}"


class Service:
    def __init__(self, runtime: Runtime, journal: Journal | None = None, max_queue: int = 10_000,
                 drain_s: float = 10.0, snapshot_dir: str | None = None) -> None:
        self.runtime = runtime
        self.tg = Tangram(runtime)
        runtime.session_listeners.append(self._session_ended)
        runtime.rest_listeners.append(self._session_rested)
        self.journal = journal
        if journal is not None:
            runtime.rest_barriers.append(journal.durable)
        self.max_queue = max_queue
        self.drain_s = drain_s
        self.sessions: dict[str, Session] = {}
        self.metrics = Metrics()
        self._inflight: dict[str, asyncio.Task] = {}
        self._inflight_jobs: dict[str, str] = {}  # action id -> its job, while in flight
        self._requests: dict[str, v1.ActionRequest] = {}  # a caller-chosen id -> its request, while in flight
        self._acts: dict[str, deque[float]] = {}
        self._outcomes: dict[str, dict[str, int]] = {}
        self.started_at = time.time()
        self.recovered = {"rerun": 0, "infra_error": 0, "rejected": 0}
        # sessions of the server before a restart: woken from rest, re-attached live (Ray), lost
        self.recovered_sessions = {"at_rest": 0, "reattached": 0, "lost": 0}
        self.fronts = 0  # HTTP front processes (server/fronts.py sets it; 0: HTTP in this process)
        self.on_stop: list = []  # callables run once the sessions are closed (a dialect's own cleanup)
        if snapshot_dir is None and journal is not None:
            snapshot_dir = f"{journal.path}.snapshots"  # the server's state directory: kept across restarts
        self._snapshot_dir = snapshot_dir
        self._snapshots: Snapshots | None = None
        self._dialect_state: dict[str, Any] = {}

    def dialect_state(self, name: str, make: Callable[["Service"], T]) -> T:
        """Dialect ``name``'s own state on this service (E2B's sandboxes, say), made by
        ``make(service)`` on first use and kept as long as the service: the service knows no
        dialect, and each keeps what it adds here, under its name."""
        state = self._dialect_state.get(name)
        if state is None:
            state = self._dialect_state[name] = make(self)
        return state

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.runtime.start()
        if not await self.runtime.warm_up(WARM_UP_S):
            log.warning("the sessions' warm sandboxes were not ready within %.0f s: serving anyway", WARM_UP_S)
        self.metrics.cores.set(self.runtime.snapshot().cores)
        if self.journal is not None:
            self._recover()
            self._recover_sessions()

    def _recover_sessions(self) -> None:
        """The previous server's open sessions: one at rest is open again (its next step wakes it);
        one that was awake lost its state with its sandbox, and is gone, saying so."""
        for sid, job, image, state, path in self.journal.sessions():
            if state == "at_rest" and path:
                try:
                    self.runtime.adopt_rested(sid, path, image)
                except (OSError, LookupError, ImageError) as e:
                    self._lost(sid, f"session {sid} was at rest when the server restarted but cannot be woken: {e}")
                    continue
                self.sessions[sid] = Session(self.runtime, sid, job, image)
                self.recovered_sessions["at_rest"] += 1
            elif self.runtime.adopt_live(sid, image):  # its node's agent outlived the head (Ray)
                self.sessions[sid] = Session(self.runtime, sid, job, image)
                self.recovered_sessions["reattached"] += 1
            else:
                self._lost(sid, f"session {sid} was awake (not at rest) when the server stopped: its python state "
                                "and files went with its sandbox")
        self.runtime.prune_live()
        self.metrics.sessions.set(len(self.sessions))
        pruned = self.runtime.prune_rested()
        if pruned:
            log.warning("removed %d rested session states that no open session owned", pruned)
        if any(self.recovered_sessions.values()):
            log.warning("sessions after restart: %d at rest (they wake on their next step), %d re-attached live, "
                        "%d lost", self.recovered_sessions["at_rest"], self.recovered_sessions["reattached"],
                        self.recovered_sessions["lost"])

    def _lost(self, sid: str, reason: str) -> None:
        self.runtime.ended[sid] = reason
        self.journal.session_closed(sid)
        self.recovered_sessions["lost"] += 1

    def _recover(self) -> None:
        """Account for what a previous process accepted and never finished: a stateless one-shot
        that still validates is re-run; anything else ends now, with its reason (never left in the
        journal to be "recovered" again at every start)."""
        for e in self.journal.unfinished():
            if e.safe_to_rerun and e.kind == "run_code":
                try:
                    spec = v1.ActionRequest.model_validate(e.request)
                    self._check_cpus("cpus", spec.cpus)
                    files = decode_files("action.files", spec.action.files)
                except (ValueError, BadRequest) as err:  # pydantic's ValidationError is a ValueError
                    reason = _reason(err)
                    self._finish_unrunnable(e.id, "rejected", f"cannot re-run after restart: {reason}")
                    self.recovered["rejected"] += 1
                    continue
                self._launch(e.id, self._run_code(e.id, spec, files), spec.job)
                self.recovered["rerun"] += 1
            else:
                msg = ("the server restarted while this action was in flight (retry it); its session state is gone "
                       "unless the session was re-attached on its node (Ray)")
                self._finish_unrunnable(e.id, "infra_error", msg)
                self.recovered["infra_error"] += 1
        if any(self.recovered.values()):
            log.warning("recovered after restart: %d re-run, %d finished as infra_error, %d rejected",
                        self.recovered["rerun"], self.recovered["infra_error"], self.recovered["rejected"])

    def _finish_unrunnable(self, id: str, outcome: str, message: str) -> None:
        if self.journal is not None:
            self.journal.finish(id, outcome, v1.ActionResult(id=id, state="done", outcome=outcome,
                                                             message=message).model_dump())

    def _check_cpus(self, field: str, cpus: tuple[int, int]) -> None:
        """The cluster-dependent part of a ``cpus`` range (the API model checks its shape)."""
        largest = self.runtime.engine.cpu.max_cores
        if largest and cpus[0] > largest:  # no nodes (yet, on a cluster): the engine's own answer says so
            raise BadRequest(f"{field}: minimum {cpus[0]} exceeds the largest node ({largest} cores)")

    async def stop(self) -> None:
        """Drain: let running actions finish for up to ``drain_s``; what is left ends as cancelled
        (queued) or is handed back by the runtime's shutdown (infra_error in the journal on restart)."""
        if self._inflight:
            await asyncio.wait(list(self._inflight.values()), timeout=self.drain_s)
        for s in list(self.sessions.values()):
            await s.close()
        for fn in self.on_stop:
            fn()
        await self.runtime.close()
        if self.journal is not None:
            self.journal.close()

    # -- actions ---------------------------------------------------------------------------------
    def admit(self) -> None:
        """``Overloaded`` (429) when the queue is full."""
        if len(self.runtime.engine.pending) >= self.max_queue:  # per action: not a whole snapshot
            raise Overloaded(retry_after_s=1)

    def _launch(self, id: str, coro, job: str = UNNAMED_JOB) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._inflight[id] = task
        self._inflight_jobs[id] = job
        task.add_done_callback(lambda t: self._landed(id, t))
        return task

    def _job_of(self, id: str) -> str | None:
        """The job an action id belongs to (in flight, or in the journal); None when unknown."""
        job = self._inflight_jobs.get(id)
        if job is None and self.journal is not None:
            entry = self.journal.get(id)
            job = entry.job if entry is not None else None
        return job

    def _landed(self, id: str, task: asyncio.Task) -> None:
        """Every accepted action ends in one terminal outcome: a fault of ours ends it as infra_error
        in the journal (and is logged), instead of leaving it to be re-run at every start."""
        self._inflight.pop(id, None)
        self._inflight_jobs.pop(id, None)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None and not isinstance(err, BadRequest):
            log.error("action %s failed inside the server: %r", id, err)
            self._finish_unrunnable(id, "infra_error", f"internal error: {type(err).__name__}")

    async def submit(self, req: v1.ActionRequest) -> v1.ActionResult:
        job = job_for(req.job, UNNAMED_JOB)
        if job != req.job:
            req = req.model_copy(update={"job": job})
        id = req.id or new_id("a")
        if req.id and CALLER_JOB.get() is not None and not visible(self._job_of(id) or job):  # another job's id: as if unknown, never its result
            raise Conflict(f"id: {id!r} is in use: choose another (or send none: the server makes one)")
        task = self._inflight.get(id)
        existing = self.journal.get(id) if self.journal and req.id and task is None else None  # ids we make are new
        if req.id:
            self._check_same_request(id, req, existing)
        if task is None:
            # everything that can reject the request is checked before it is journaled
            self._check_cpus("cpus", req.cpus)
            _check_language("action.language", req.action.language)
            files = decode_files("action.files", req.action.files)
            if existing is not None and existing.state == "done":
                await self._durable()  # it may still be queued for this loop pass's commit
                return v1.ActionResult.model_validate(existing.response)
            if existing is None:
                self.admit()
                if self.journal is not None:
                    self.journal.accept(id, req.job, "run_code", req.model_dump_json(), True)
            task = self._inflight.get(id) or self._launch(id, self._run_code(id, req, files), req.job)
            if req.id:
                self._requests[id] = req
                task.add_done_callback(lambda _: self._requests.pop(id, None))
        if not req.wait:
            await self._durable()  # the 202 is an acknowledgement: the action is on disk first
            return self.status(id)
        return await asyncio.shield(task)

    def _check_same_request(self, id: str, req: v1.ActionRequest, existing: Entry | None) -> None:
        """``Conflict`` (409) when the action ``id`` names (in flight, or ``existing`` in the
        journal) was submitted with another request: the id is the idempotency key, and answering a
        different program with the first one's result (an id reused across epochs, say) is a silent
        wrong answer. ``wait`` may differ (submit without waiting, then wait). A journaled request
        this server's schema cannot read any more is not compared. A new id costs nothing here:
        the journal read is ``submit``'s own."""
        first = self._requests.get(id)
        if first is None and existing is not None:
            # only its result queued: the request it was accepted with is on disk (``request_of``)
            accepted = (existing.kind, existing.request) if existing.kind else self.journal.request_of(id)
            if accepted is not None and accepted[0] == "run_code" and isinstance(accepted[1], dict):
                try:
                    first = v1.ActionRequest.model_validate(accepted[1])
                except ValueError:
                    first = None
        if first is None:
            return
        before, now = _request_key(first), _request_key(req)
        if now != before:
            differs = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
            raise Conflict(f"id: {id!r} was submitted before with another request ({', '.join(differs)} "
                           "differ): an id is an idempotency key, so choose a new one for a new action")

    @answers_later
    def run_oneshot(self, action: Action, request: str, reply: Callable[[bool, Any], None]) -> None:
        """A journaled one-shot under a new id (a restart re-runs it if its acceptance reached disk:
        it goes there at the latest with its result, ``Journal.accept``'s ``with_result``), as a dialect's route
        translated it (``server/sandboxfusion.py``): ``action`` built by ``oneshot_action``,
        ``request`` its ``v1.ActionRequest`` as JSON text, the journal's record of it. Answered
        through ``reply(True, ActionResult)``, or ``reply(False, error)``; errors of the request
        itself (a full queue, another job's name) raise here. The answer goes before the result's
        commit when none of the one-shot was on disk (``Journal.finish``: a crash leaves nothing
        to run again, and the answer waits for no commit and no loop pass), else once the result
        is on disk.

        The route builds both halves (with fronts, in the front process) and this process only
        journals and schedules: no request model is validated, dumped or unpickled here, and no
        task or coroutine runs per one-shot (the engine's listener calls back, the journal's
        commit calls back; a request with an API key crosses the front link as ``scoped``, which
        still runs as a task), since the engine process's CPU bounds how many one-shots a second
        the server runs (docs/performance.md)."""
        scope = CALLER_JOB.get()
        if scope is not None and action.job != scope:  # the front checked the key; this is the engine's own check
            raise Forbidden(f"job: this API key acts as job {scope!r}, not {action.job!r}")
        self.admit()
        if self.journal is not None:
            self.journal.accept(action.id, action.job, "run_code", request, True, with_result=True)
        try:
            self.runtime.submit_cb(action, lambda r: self._oneshot_ended(action, r, reply))
        except Exception as e:
            self._finish_unrunnable(action.id, "infra_error", f"internal error: {type(e).__name__}")
            raise

    def _oneshot_ended(self, action: Action, r: ActionResult | None, reply: Callable[[bool, Any], None]) -> None:
        if r is None:  # the runtime closed first: the caller is told to retry, so a restart must not run it
            if self.journal is not None:  # again where it can help it (its acceptance still queued)
                self.journal.forget(action.id)
            reply(False, Unavailable("the server stopped before this one-shot ended: retry"))
            return
        try:
            _, unseen = self._record_as(r, action.job, "run_code")
        except Exception as e:  # never a caller left waiting, nor an entry a restart would run again
            log.exception("one-shot %s: recording its result failed", action.id)
            try:
                self._finish_unrunnable(action.id, "infra_error", f"internal error: {type(e).__name__}")
            except JournalError:
                pass  # the journal itself failed: nothing more can be written
            reply(False, e)
            return
        if self.journal is None or unseen:  # unseen: no row yet, so no restart can run it again (its
            reply(True, r)                    # row, written done, goes with the next commit, right after)
            return
        # its acceptance may be on disk: answered only once its result is too, or a restart would run it again
        self.journal.when_durable(lambda err: reply(True, r) if err is None else reply(False, err))

    async def _run_code(self, id: str, req: v1.ActionRequest,
                        files: dict[str, bytes] | None = None) -> v1.ActionResult:
        return (await self._execute(id, req, files))[1]

    async def _execute(self, id: str, req: v1.ActionRequest,
                       files: dict[str, bytes] | None = None) -> tuple[ActionResult, v1.ActionResult]:
        """Run a journaled one-shot (native, another dialect's or recovered) and record its outcome."""
        if files is None:
            files = decode_files("action.files", req.action.files)
        r = await self.runtime.submit(oneshot_action(id, req, files))
        out = self._record(r, req.job, "run_code")
        await self._durable()  # answered only once the result is on disk: a restart cannot run it again
        return r, out

    async def _durable(self) -> None:
        if self.journal is not None:
            await self.journal.durable()

    def _record(self, r: ActionResult, job: str, service: str) -> v1.ActionResult:
        return self._record_as(r, job, service)[0]

    def _record_as(self, r: ActionResult, job: str, service: str) -> tuple[v1.ActionResult, bool]:
        """``_record``, and whether none of the action was on disk before this (``Journal.finish``)."""
        out = v1.ActionResult(
            id=r.id, state="done", outcome=r.outcome.value, message=r.message or r.result.message,
            run=_command(r.result.run), compile=_command(r.result.compile),
            files={k: base64.b64encode(v).decode() for k, v in r.result.files.items()}, act_s=r.act_s,
            queue_s=r.queue_s, setup_s=r.setup_s, exec_s=r.exec_s, cores=r.cores)
        if isinstance(r.result, SandboxResult) and r.result.info.get("woken"):
            out.woken, out.dropped = True, dict(r.result.info.get("dropped") or {})
        unseen = False
        if self.journal is not None:
            unseen = self.journal.finish(r.id, r.outcome.value, out.model_dump_json())
        self.metrics.count(service, r.outcome.value, r.act_s)
        self._acts.setdefault(job, deque(maxlen=100_000)).append(r.act_s)
        counts = self._outcomes.setdefault(job, {})
        counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        return out, unseen

    def status(self, id: str) -> v1.ActionResult:
        if CALLER_JOB.get() is not None and not visible(self._job_of(id) or ""):
            raise NotFound(f"no action {id!r}")
        if id in self._inflight:
            wait = self.runtime.why_waiting(id)
            if wait is not None:
                return v1.ActionResult(id=id, state="queued", message=f"waiting for {wait}")
            return v1.ActionResult(id=id, state="running")
        entry = self.journal.get(id) if self.journal else None
        if entry is None:
            raise NotFound(f"no action {id!r}")
        if entry.state != "done":
            return v1.ActionResult(id=id, state="queued")
        return v1.ActionResult.model_validate(entry.response)

    async def cancel(self, id: str) -> v1.ActionResult:
        if CALLER_JOB.get() is not None:
            self.status(id)  # another job's action: NotFound, before anything is cancelled
        if not self.runtime.cancel(id) and id not in self._inflight:
            self.status(id)  # raises NotFound for unknown ids
        task = self._inflight.get(id)
        if task is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(task), 0.5)
            except asyncio.TimeoutError:
                return self.status(id)  # running: it ends on its own (timeouts bound it)
        return self.status(id)

    # -- sessions --------------------------------------------------------------------------------
    async def open_session(self, req: v1.SessionRequest) -> v1.SessionInfo:
        job = job_for(req.job, UNNAMED_JOB)
        sid = req.trajectory or f"s-{uuid.uuid4().hex}"
        if sid in self.sessions and not visible(self.sessions[sid].job):
            # another job's session: never joined, and nothing said of it
            raise Conflict(f"trajectory: {sid!r} is in use: choose another (or send none: the server makes one)")
        if sid not in self.sessions and req.restore is not None:
            await self._restore(sid, job, req)
        elif sid not in self.sessions:
            try:
                session = await self.tg.session(job=job, trajectory=sid, image=req.image)
            except ImageError as e:
                raise BadRequest(str(e)) from None
            except NoRoom as e:
                self.metrics.refused.labels(e.limit).inc()
                raise
            await self._opened(sid, session, req.image)
        s = self.sessions[sid]
        return v1.SessionInfo(session_id=sid, job=s.job, image=s.image)

    def session_state(self, sid: str) -> v1.SessionState:
        s = self.session(sid)
        return v1.SessionState(session_id=sid, job=s.job, image=s.image,
                               state=self.runtime.session_state(sid) or "new")

    @property
    def snapshots(self) -> Snapshots:
        """The snapshot store, made on first use: without a journal (tests, the embedded server) a
        temporary directory removed when the service stops."""
        if self._snapshots is None:
            d = self._snapshot_dir
            if d is None:
                d = tempfile.mkdtemp(prefix="tangram-snapshots-")
                self.on_stop.append(lambda: shutil.rmtree(d, ignore_errors=True))
            self._snapshots = Snapshots(d)
        return self._snapshots

    async def _restore(self, sid: str, job: str, req: v1.SessionRequest) -> None:
        """Open session ``sid`` of ``job`` from snapshot ``req.restore`` (an action on the new
        session); another job's snapshot is a 404, as an unknown one."""
        if req.image is not None:
            raise BadRequest("image: a restored session's image is its snapshot's; give restore or image")
        path = self._snapshot(req.restore, "restore")
        self.admit()
        try:
            await self.restore_session(sid, job, path)
        except ImageError as e:
            raise BadRequest(f"restore: {e}") from None
        except SessionError as e:
            raise Unavailable(f"restore: {e.result.outcome.value}: {e.result.message}") from None

    async def restore_session(self, sid: str, job: str, path: str) -> Session:
        """Open session ``sid`` of ``job`` from the snapshot file at ``path`` (an action on the new
        session), journaled as any open session, so that a restart knows it. ``NoRoom`` (503) at
        once rather than a restore that waits for memory; the restore's own failures
        (``ImageError``, ``SessionError``) are raised as they are, for the caller to put in its terms."""
        self.runtime.admit_session()
        session = await self.tg.restore(path, job=job, trajectory=sid)
        await self._opened(sid, session, session.image)
        return session

    async def _opened(self, sid: str, session: Session, image: str | None) -> None:
        """A new open session: served, counted, and in the journal on disk before it is answered."""
        self.sessions[sid] = session
        self.metrics.sessions.set(len(self.sessions))
        if self.journal is not None:
            self.journal.session_open(sid, session.job, image)
            await self._durable()

    async def snapshot(self, sid: str) -> v1.SnapshotInfo:
        """Snapshot session ``sid``'s files into the server's snapshot directory (an action on the
        session, ordered with its steps); 422 saying why a session cannot be, 503 if we failed."""
        s = self.session(sid)
        self.admit()
        id, path = self.snapshots.new()
        try:
            await s.snapshot(path)
        except SessionError as e:
            self.snapshots.discard(id)
            if e.result.outcome is Outcome.REJECTED:
                raise BadRequest(e.result.message) from None
            raise Unavailable(f"snapshot: {e.result.outcome.value}: {e.result.message}") from None
        except BaseException:
            self.snapshots.discard(id)
            raise
        return v1.SnapshotInfo(**self.snapshots.record(id, session_id=sid, job=s.job, image=s.image))

    def _snapshot(self, id: str, field: str = "snapshot") -> str:
        """The path of snapshot ``id`` if the caller may see it; else ``NotFound`` naming it."""
        try:
            path = self.snapshots.path(id, field)
            if not visible(self.snapshots.info(id).get("job") or UNNAMED_JOB):
                raise UnknownSnapshot(f"{field}: no snapshot {id!r}")
        except UnknownSnapshot as e:
            raise NotFound(str(e)) from None
        return path

    def list_snapshots(self) -> list[v1.SnapshotInfo]:
        return [v1.SnapshotInfo.model_validate(i) for i in self.snapshots.list()
                if visible(i.get("job") or UNNAMED_JOB)]

    def delete_snapshot(self, id: str) -> None:
        self._snapshot(id)
        self.snapshots.delete(id)

    def images(self) -> list[v1.ImageInfo]:
        """The images of the store sessions and one-shots may name (none without sandboxes)."""
        sb = self.runtime.sandbox_manager()
        if sb is None:
            return []
        return [v1.ImageInfo(name=i.name, id=i.id, size_bytes=i.size_bytes, created=i.created, layers=len(i.layers))
                for i in sb.images.list()]

    async def fork(self, sid: str, req: v1.ForkRequest) -> v1.ForkResult:
        s = self.session(sid)
        self.admit()
        try:
            children = await s.fork(req.n)
        except SessionError as e:
            return v1.ForkResult(outcome=e.result.outcome.value, message=e.result.message)
        for c in children:
            self.sessions[c.id] = c
            if self.journal is not None:
                self.journal.session_open(c.id, c.job, c.image)
        self.metrics.sessions.set(len(self.sessions))
        return v1.ForkResult(outcome="ok", session_ids=[c.id for c in children], fork_s=s.last_fork.get("fork_s"),
                             message="files are shared copy-on-write; the shell and python interpreter of the "
                                     "source and the children restart on their next step")

    async def prewarm(self, req: v1.PrewarmRequest) -> v1.PrewarmResult:
        """``req.n`` sandboxes of ``req.image``; on Ray on each of ``req.nodes`` nodes (default one)."""
        try:
            p = await self.tg.prewarm(req.image, req.n, req.nodes)
        except ImageError as e:  # a registry that does not answer is ours to say, not the request's
            raise (Unavailable if e.infra else BadRequest)(str(e)) from None
        except ValueError as e:  # more nodes than there are
            raise BadRequest(str(e)) from None
        return v1.PrewarmResult(image=p.image, requested=p.requested, ready=p.ready, idle_total=p.idle_total,
                                cap=p.cap, message=p.message)

    def session(self, sid: str) -> Session:
        """Open session ``sid`` if the request may see it; else ``NotFound`` (saying why it ended,
        to a caller who sees every job)."""
        s = self.sessions.get(sid)
        if s is not None and not visible(s.job):
            raise NotFound(f"no session {sid!r}")
        if s is None:
            why = self.runtime.ended.get(sid) if CALLER_JOB.get() is None else None
            raise NotFound(why or f"no session {sid!r}")
        return s

    def _session_ended(self, sid: str, reason: str) -> None:
        """The runtime ended a session (expiry, its node died): it is gone for HTTP callers too."""
        if self.sessions.pop(sid, None) is not None:
            self.metrics.sessions.set(len(self.sessions))
            if self.journal is not None:
                self.journal.session_closed(sid)

    def _session_rested(self, sid: str, path: str | None) -> None:
        """A session went to rest (its state at ``path``) or woke: the journal knows, for a restart."""
        if self.journal is not None and sid in self.sessions:
            self.journal.session_rested(sid, path)

    async def exec(self, sid: str, req: v1.ExecRequest) -> v1.ActionResult:
        s = self.session(sid)
        if (req.command is None) == (req.python is None):
            raise BadRequest("command/python: give exactly one")
        self._check_cpus("cpus", req.cpus)
        async with self.step(s.job, req.model_dump_json(), "exec") as step:
            r = await s.exec(req.command, python=req.python, stdin=req.stdin.encode() if req.stdin else None,
                             timeout_s=req.timeout_s, cpus=req.cpus, parallel_fraction=req.hints.parallel_fraction,
                             hint_s=req.hints.work_s, operation=req.hints.operation, id=step.id,
                             remaining_turns=req.hints.remaining_turns)
            return step.record(r)

    def step(self, job: str, request: dict | str, label: str, *, id: str | None = None, kind: str = "exec",
             rejects: Callable[[BaseException], bool] = callers_error) -> Step:
        """A journaled step of one of ``job``'s sessions, the native API's and every dialect's:
        ``Overloaded`` when the queue is full, else accepted into the journal now under ``id``
        (default: a new one) with ``request`` (what the journal keeps of it) and counted under
        ``label`` once it ends. Not re-run after a restart (a session's state is not). Use::

            async with service.step(s.job, request, "exec") as step:
                r = await s.exec(..., id=step.id)
                out = step.record(r)

        ``rejects``: whether an exception that stops the step is the caller's fault (``rejected``;
        anything else is ``infra_error``). See ``Step``."""
        self.admit()
        id = id or new_id("x")
        if self.journal is not None:
            self.journal.accept(id, job, kind, request, False)
        return Step(id, job, label, self._record, self._finish_unrunnable, self._durable, rejects)

    async def put_files(self, sid: str, req: v1.PutFiles) -> v1.ActionResult:
        s = self.session(sid)
        r = await s.files(Files(put=decode_files("files", req.files)))
        return self._record(r, s.job, "files")

    async def fs(self, sid: str, req: v1.FsRequest) -> v1.FsResult:
        """``Session.fs``: the caller's failures as 404 (not found), 409 (exists), 403 (denied) or
        422 (anything else about the path), ours as 503."""
        s = self.session(sid)
        r = await s.fs(FsCall(req.call, req.path, destination=req.destination, depth=req.depth,
                              data=_b64decode("data", req.data), max_bytes=req.max_bytes))
        if r.outcome is Outcome.FAILED and "error" in r.result.info:
            why, code = r.message or r.result.message, r.result.info["error"]
            raise {"not_found": NotFound, "exists": Conflict, "denied": Forbidden}.get(code, BadRequest)(why)
        if r.outcome is not Outcome.OK:
            raise Unavailable(f"{req.call}: {r.outcome.value}: {r.message or r.result.message}")
        info = r.result.info
        if req.call == "read":
            return v1.FsResult(data=base64.b64encode(r.result.files[req.path]).decode(), cut=bool(info.get("cut")))
        return v1.FsResult(entry=info.get("entry"), entries=info.get("entries"))

    async def get_files(self, sid: str, paths: list[str]) -> v1.GotFiles:
        s = self.session(sid)
        for p in paths:
            if (problem := path_problem(p)) is not None:
                raise BadRequest(f"path: {problem}")
        r = await s.files(Files(get=paths))
        return v1.GotFiles(files={k: base64.b64encode(v).decode() for k, v in r.result.files.items()},
                           missing=r.result.missing)

    async def close_session(self, sid: str) -> None:
        s = self.session(sid)
        await s.close()  # the runtime tells _session_ended, which forgets it here

    # -- models ----------------------------------------------------------------------------------
    async def model_call(self, name: str, op: str, req: v1.ModelRequest) -> v1.ModelResult:
        models = self.runtime.models
        if models is None or name not in models.services:  # configured: a call says why it cannot run yet
            raise NotFound(f"no model service {name!r}")
        # bad input is the caller's to fix: a 422 naming the problem (an id outside the vocabulary,
        # an empty or too long sequence), before anything is queued or batched with others' calls
        problem = models.validate(name, op, req.tokens, 1 if op == "score" else 2)
        if problem is not None and problem.split(":", 1)[0] in ("tokens", "op"):
            raise BadRequest(problem)
        job = job_for(req.job, UNNAMED_JOB)
        self.admit()
        call = self.tg.score if op == "score" else self.tg.logprobs
        r = await call(name, req.tokens, job=job, hint_s=req.hint_s)
        self.metrics.actions.labels(f"model:{name}", r.outcome.value).inc()
        if r.outcome is not Outcome.REJECTED:
            self.metrics.act.labels(f"model:{name}").observe(r.act_s)
        return v1.ModelResult(outcome=r.outcome.value, message=r.message, value=r.result, act_s=r.act_s)

    # -- stats -----------------------------------------------------------------------------------
    def job_stats(self, job: str) -> v1.JobStats:
        acts = sorted(self._acts.get(job, ()))
        if (not acts and job not in self._outcomes) or not visible(job):
            raise NotFound(f"no actions seen for job {job!r}")

        def pct(q: float) -> float | None:
            return acts[min(len(acts) - 1, int(q / 100 * len(acts)))] if acts else None

        return v1.JobStats(job=job, actions=len(acts), outcomes=self._outcomes.get(job, {}),
                           avg_act_s=sum(acts) / len(acts) if acts else None, p50_act_s=pct(50), p99_act_s=pct(99))

    def all_jobs(self) -> list[v1.JobStats]:
        return [self.job_stats(job) for job in sorted(set(self._acts) | set(self._outcomes)) if visible(job)]

    def cluster(self) -> v1.ClusterInfo:
        return v1.ClusterInfo(backend=self.runtime.backend, nodes=[v1.ClusterNode(**n) for n in self.runtime.nodes()],
                              **(self.runtime.move_stats() or {}))

    def drain_node(self, node_id: str) -> v1.ClusterNode:
        """``POST /v1/cluster/nodes/{id}/drain``: the node takes no new work now; its sessions
        move to other nodes between two of their steps; its state says ``drained`` once it holds
        nothing. Not for one job's API key: it moves every job's sessions."""
        if CALLER_JOB.get() is not None:
            raise Forbidden("node: draining a node moves every job's sessions; use the server's token")
        try:
            return v1.ClusterNode(**self.runtime.drain_node(node_id))
        except KeyError as e:
            raise NotFound(e.args[0]) from None
        except ValueError as e:
            raise BadRequest(str(e)) from None

    async def health(self, details: bool = True) -> dict:
        """``GET /healthz``: liveness plus the figures a person checks first; without ``details``
        (a caller who may not see them) liveness alone, asking no sandbox worker anything."""
        if not details:
            return {"status": "ok", "version": __version__}
        snap = self.runtime.snapshot()
        return {"status": "ok", "version": __version__, "queued": snap.queued, "running": snap.running,
                "cores": snap.cores, "sessions": len(self.sessions), "isolation": snap.isolation,
                "one_shot_cpus": self.runtime.one_shot_cpus(),
                "recovered": self.recovered, "sessions_placed": snap.sessions,
                "session_mem_used_mb": round(snap.session_mem_used_gb * 1024, 1),
                "session_mem_reserved_mb": round(snap.session_mem_reserved_gb * 1024, 1),
                "memory_mb": round(snap.memory_gb * 1024), "head_waited_s": round(snap.head_waited_s, 3),
                "head_waits_for": snap.head_waits_for, "fronts": self.fronts, "sandbox_workers": self._workers(),
                "rest": self.runtime.rest_stats(), "recovered_sessions": self.recovered_sessions,
                "followed": self.runtime.engine.handed_over, "core_waits": await self.runtime.core_waits(),
                "one_shot_sandboxes": await self.runtime.one_shot_sandboxes()}

    def _workers(self) -> dict | None:
        """Sandbox worker processes up / started (None: one-shots run in this process)."""
        workers = self.runtime.sandbox_workers()
        return None if workers is None else {"up": workers[0], "total": workers[1]}

    def metrics_text(self) -> str:
        """``GET /metrics``: the Prometheus exposition of this process's registry."""
        self.refresh_gauges()
        return generate_latest(self.metrics.registry).decode()

    def refresh_gauges(self) -> None:
        snap = self.runtime.snapshot()
        self.metrics.queue.set(snap.queued)
        self.metrics.running.set(snap.running)
        self.metrics.cores_held.set(snap.cores_held)
        self.metrics.sessions_placed.set(snap.sessions)
        self.metrics.session_mem_used.set(snap.session_mem_used_gb * (1 << 30))
        self.metrics.session_mem_reserved.set(snap.session_mem_reserved_gb * (1 << 30))
        self.metrics.memory.set(snap.memory_gb * (1 << 30))
        self.metrics.head_wait.set(snap.head_waited_s)
        rest = self.runtime.rest_stats()
        if rest is not None:
            m = self.metrics
            m.sessions_awake.set(rest["awake"])
            m.sessions_at_rest.set(rest["at_rest"])
            m.rest_bytes.set(rest["rest_bytes"])
            m.rest_limit.set(rest["rest_disk_mb"] << 20)
            m.rests.set(rest["rests"])
            m.wakes.set(rest["wakes"])
            m.rest_failures.set(rest["rest_failures"])
        moved = self.runtime.move_stats()
        if moved is not None:
            self.metrics.moves.set(moved["moves"])
            if moved["move_p50_s"] is not None:
                self.metrics.move_p50.set(moved["move_p50_s"])
