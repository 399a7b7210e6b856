"""The embedded Python API: ``Tangram``, its ``Session``s, and dynamic batching of model calls.

It works over any ``Runtime`` (``Tangram.local()`` builds the one for this machine); each call
becomes one action that the runtime's engine schedules.
"""

from __future__ import annotations

import asyncio
import time
import os
from typing import Any, Callable

from ..core.action import Action, Demand, Outcome, seconds
from ..managers.models.spec import ModelCall
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.livestdin import LiveStdin
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spec import Exec, Files, Fork, FsCall, Restore, RunCode, SandboxConfig, Snapshot
from ..policy import Policy, Profile
from .base import ActionResult, Runtime
from .local import LocalRuntime

#: seconds the engine lets a sandbox action run past the program's own limits (compile + run)
#: before it counts as lost: the sandbox's own kill (``SandboxConfig.grace_s``) comes first
ACTION_TIMEOUT_SLACK_S = 30.0


class _ModelFront:
    """Dynamic batching for one (service, operation): requests arriving within ``max_wait_ms`` (up
    to ``max_batch``) become one action, so the GPU sees batches while callers see single calls.
    While as many batches are in flight as the pool could run copies of the model, new requests
    keep accumulating instead of queueing as small batches: under load, batches grow."""

    def __init__(self, runtime: Runtime, model: str, op: str, max_batch: int, max_wait_ms: float,
                 gpus: int) -> None:
        self.runtime, self.model, self.op = runtime, model, op
        self.max_batch, self.max_wait_s, self.gpus = max_batch, max_wait_ms / 1000, gpus
        self.items: list = []
        self.futures: list[asyncio.Future] = []
        self.meta: list[tuple[str, float | None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    @property
    def max_in_flight(self) -> int:
        """As many batches as the pool could run copies of the model now (on Ray, GPU nodes join
        and leave while it runs)."""
        return max(1, self.runtime.engine.gpu.capacity // self.gpus)

    def call(self, item: list[int], job: str, hint_s: float | None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.items.append(item)
        self.futures.append(fut)
        self.meta.append((job, hint_s))
        if len(self.items) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush)
        return fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.items or (self.in_flight >= self.max_in_flight and len(self.items) < self.max_batch):
            return  # a batch completing flushes what has gathered meanwhile
        items, futures, meta = self.items[:self.max_batch], self.futures[:self.max_batch], self.meta[:self.max_batch]
        del self.items[:self.max_batch], self.futures[:self.max_batch], self.meta[:self.max_batch]
        self.in_flight += 1
        action = Action(self.runtime.new_id("m"), f"model:{self.model}", Demand({"gpu": (self.gpus, self.gpus)}),
                        job=meta[0][0], operation=self.op, hint_s=meta[0][1], payload=ModelCall(self.op, items))
        task = asyncio.get_running_loop().create_task(self.runtime.submit(action))
        self.tasks.add(task)

        def deliver(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            self.in_flight -= 1
            if self.items:
                self._flush()
            if t.cancelled() or t.exception() is not None:
                # the batch never ended in an outcome (the runtime closed, or a bug): every caller
                # still gets one, an infrastructure error, instead of waiting forever
                why = "cancelled" if t.cancelled() else f"{type(t.exception()).__name__}: {t.exception()}"
                r = ActionResult(action.id, Outcome.INFRA_ERROR, None, 0.0, 0.0, 0.0, 0.0, 0,
                                 f"model batch did not run to an outcome ({why})")
            else:
                r = t.result()
            for i, fut in enumerate(futures):
                if not fut.done():
                    value = r.result[i] if r.outcome is Outcome.OK else None
                    fut.set_result(ActionResult(r.id, r.outcome, value, r.act_s, r.queue_s, r.setup_s, r.exec_s,
                                                r.cores, r.message))

        task.add_done_callback(deliver)


class SessionError(RuntimeError):
    """A fork or snapshot that did not succeed; ``result`` is its action's terminal outcome."""

    def __init__(self, result: ActionResult) -> None:
        super().__init__(f"{result.outcome.value}: {result.message}")
        self.result = result


class Session:
    """A trajectory's stateful sandbox; each call is one action (cores only while it runs).
    ``image``: the image its root comes from (default: the configured one, else the host's
    system directories). Shell commands run in one persistent shell; python in one interpreter."""

    def __init__(self, runtime: Runtime, trajectory: str, job: str, image: str | None = None) -> None:
        self.runtime = runtime
        self.id = trajectory
        self.job = job
        self.image = image
        self.last_fork: dict = {}
        # A session's steps run one at a time, in the order they came: two started at once would
        # share one sandbox, and the first one's end would freeze the sandbox's cgroup under the
        # second until its timeout. A step that arrives while another runs waits here (FIFO).
        self._steps = asyncio.Lock()

    async def _step(self, action: Action) -> ActionResult:
        async with self._steps:
            return await self.runtime.submit(action)

    def _check(self) -> None:
        """Raise ``SessionGone`` (with the reason: closed, expired, lost with its node)."""
        self.runtime.check_session(self.id)

    async def fork(self, n: int, *, id: str | None = None) -> list["Session"]:
        """``n`` new sessions whose files start as a copy-on-write copy of this one's (an image
        session only). Files carry over; processes (the python interpreter, the shell) of this
        session and the children start afresh on their next step."""
        self._check()
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
            raise ValueError("n: must be an integer from 1 to 256")
        children = tuple(self.runtime.new_id("s") for _ in range(n))
        action = Action(id or self.runtime.new_id("k"), "sandbox", job=self.job, trajectory=self.id,
                        operation="fork", hint_s=0.02, payload=Fork(self.id, children))
        r = await self._step(action)
        if r.outcome is not Outcome.OK:
            raise SessionError(r)
        self.last_fork = r.result.info  # timings: pause_s (source stopped), cow_s (layers mounted), fork_s
        return [Session(self.runtime, c, self.job, self.image) for c in children]

    async def snapshot(self, path: str | os.PathLike | None = None) -> str:
        """Write this session's filesystem state to ``path`` (default: a new file in the
        temporary directory); ``Tangram.restore(path)`` opens a new session from it."""
        self._check()
        if path is None:
            import tempfile
            fd, path = tempfile.mkstemp(suffix=".tangram-snapshot.tar")
            os.close(fd)
        action = Action(self.runtime.new_id("p"), "sandbox", job=self.job, trajectory=self.id, operation="snapshot",
                        hint_s=0.5, timeout_s=600, payload=Snapshot(self.id, os.fspath(path)))
        r = await self._step(action)
        if r.outcome is not Outcome.OK:
            raise SessionError(r)
        return os.fspath(path)

    async def exec(self, command: str | None = None, *, python: str | None = None, stdin: bytes | None = None,
                   timeout_s: float = 10.0, cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0,
                   hint_s: float | None = None, operation: str = "", memory_mb: int | None = None,
                   id: str | None = None, jupyter: bool = False, remaining_turns: int | None = None,
                   on_output: Callable[[str, bytes], None] | None = None,
                   live_stdin: LiveStdin | None = None) -> ActionResult:
        """Run a shell ``command`` in the workspace, or a ``python`` cell in the session's
        interpreter (its variables carry over from call to call; ``jupyter``: an exception's
        traceback goes only into the cell's error record, as in a notebook). ``remaining_turns``:
        how many more actions the trajectory will send (the scheduler favours the step's last
        finishers). ``on_output(stream, data)``: the step's output as it comes
        (``SandboxManager.listen``: capped as the result's; called on the runtime's event loop, so
        it must return at once);
        where sessions run in another process (Ray's nodes) it is not called and the output
        comes in the result only. ``live_stdin``: a shell command's stdin fed while it runs
        (``LiveStdin.send``, ``close``: ``managers/sandbox/livestdin.py``), after ``stdin`` if
        both are given; only where sessions run in this process (``live_stdin_here``), else a
        ``ValueError``."""
        self._check()
        if (command is None) == (python is None):
            raise ValueError("exec: give exactly one of command or python")
        if live_stdin is not None and (python is not None or not self.live_stdin_here):
            raise ValueError("exec: live_stdin is for a shell command of a session that runs in this process"
                             if python is None else "exec: live_stdin is for a shell command, not a python cell")
        rng = (cpus, cpus) if isinstance(cpus, int) else cpus
        payload = Exec(command=command, python=python, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                       image=self.image, jupyter=jupyter)
        action = Action(id or self.runtime.new_id("x"), "sandbox", Demand({"cpu": rng}), job=self.job,
                        trajectory=self.id,
                        operation=operation or ("python" if python is not None else command.split()[0]
                                                if command.split() else "shell"),
                        hint_s=hint_s, parallel_fraction=parallel_fraction,
                        timeout_s=timeout_s + ACTION_TIMEOUT_SLACK_S, payload=payload,
                        remaining_turns=remaining_turns)
        manager = self.runtime.sandbox_manager() if on_output is not None or live_stdin is not None else None
        if manager is None:
            return await self._step(action)
        stops = []
        if on_output is not None:
            stops.append(manager.listen(action.id, on_output))
        if live_stdin is not None:
            stops.append(manager.feed(action.id, live_stdin))
        try:
            return await self._step(action)
        finally:
            for stop in stops:
                stop()
            if live_stdin is not None:  # (also when the step never ran: later input is refused, not kept)
                live_stdin.end()

    @property
    def live_stdin_here(self) -> bool:
        """Whether ``exec`` can take a ``live_stdin``: this session's steps run in this process."""
        return self.runtime.sandbox_manager() is not None

    async def put(self, files: dict[str, bytes], id: str | None = None) -> ActionResult:
        return await self.files(Files(put=files), id)

    async def get(self, paths: list[str]) -> dict[str, bytes]:
        r = await self.files(Files(get=paths))
        return r.result.files

    async def files(self, files: Files, id: str | None = None) -> ActionResult:
        """Put and/or get workspace files as one action (``result.files``, ``result.missing``)."""
        self._check()
        if files.image is None:
            files.image = self.image
        manager = self.runtime.sandbox_manager()
        if manager is not None and (files.put or files.get):
            # straight to the workspace from this process, between steps (no core, no runner round
            # trip: ``managers/sandbox/hostfiles.py`` says why and how it stays safe)
            async with self._steps:
                t = time.monotonic()
                done = manager.host_files(self.id, files)
                if done is not None:
                    took = time.monotonic() - t
                    return ActionResult(id or self.runtime.new_id("f"), done[0], done[1], took, 0.0, 0.0, took, 0,
                                        done[1].message)
        action = Action(id or self.runtime.new_id("f"), "sandbox", job=self.job, trajectory=self.id,
                        operation="files", hint_s=0.005, payload=files)
        return await self._step(action)

    async def fs(self, call: FsCall, id: str | None = None) -> ActionResult:
        """One filesystem call anywhere in the session's sandbox (``FsCall``: stat, list, mkdir,
        remove, move, read, write), carried out by the sandbox's agent, never by code of the
        session's that its user could have replaced."""
        self._check()
        if call.image is None:
            call.image = self.image
        action = Action(id or self.runtime.new_id("f"), "sandbox", job=self.job, trajectory=self.id,
                        operation="fs", hint_s=0.005, payload=call)
        return await self._step(action)

    @property
    def closed(self) -> bool:
        return self.id in self.runtime.ended

    async def close(self) -> None:
        self.runtime.end_session(self.id, f"session {self.id} was closed by its owner")


def one_shot(id: str, code: str, language: str = "python", *, stdin: bytes | str | None = None,
             files: dict[str, bytes] | None = None, fetch_files: list[str] | None = None, timeout_s: float = 10.0,
             compile_timeout_s: float = 10.0, memory_mb: int | None = None, cpus: int | tuple[int, int] = 1,
             parallel_fraction: float = 0.0, job: str = "default", hint_s: float | None = None,
             operation: str = "", image: str | None = None, memory_as_rlimit: bool = False,
             remaining_turns: int | None = None) -> Action:
    """The action of a one-shot program (``Tangram.run``'s arguments): plain data, so that a
    server's HTTP front builds it and the engine process only schedules it."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    rng = (cpus, cpus) if isinstance(cpus, int) else cpus
    payload = RunCode(code, language, stdin, dict(files or {}), list(fetch_files or []), compile_timeout_s,
                      timeout_s, memory_mb, image, memory_as_rlimit)
    return Action(id, "sandbox", Demand({"cpu": rng}), job=job, operation=operation or language, hint_s=hint_s,
                  parallel_fraction=parallel_fraction,
                  timeout_s=timeout_s + compile_timeout_s + ACTION_TIMEOUT_SLACK_S, payload=payload,
                  remaining_turns=remaining_turns)


class Tangram:
    """The embedded API: ``async with Tangram.local() as tg: ...``."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.fronts: dict[tuple[str, str], _ModelFront] = {}

    @classmethod
    def local(cls, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
              cores: int | None = None, profile: Profile | None = None, record: str | None = None,
              **kwargs) -> "Tangram":
        """``record``: write every finished action to this JSONL trace (replay it with ``tangram
        simulate --trace``); ``kwargs``: ``sandboxes=False``, ``models=[ModelServiceConfig...]``,
        ``gpus``, ``gpu_memory_gb``, ``apis={name: (ApiQuota, async handler)}``, ``workers=N`` (sandbox
        worker processes for one-shots; see ``LocalRuntime``)."""
        runtime = LocalRuntime(policy, sandbox, cores, profile=profile, **kwargs)
        if record is not None:
            runtime.record(record)
        return cls(runtime)

    @classmethod
    def ray(cls, address: str = "auto", policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
            profile: Profile | None = None, *, models: list | None = None, **kwargs) -> "Tangram":
        """Every node of the Ray cluster at ``address`` (``auto`` or ``HOST:PORT``): one engine
        here, a node agent with its own sandboxes on each node and, with ``models``
        (``ModelServiceConfig``s), the GPUs of each GPU node (see ``RayRuntime``; ``kwargs``:
        ``gpus_per_node``, ``gpu_memory_gb``, ``gpu_island_size``, ``model_device``, ``max_queue_s``)."""
        from .ray_runtime import RayRuntime
        return cls(RayRuntime(address, policy, sandbox, profile, models=models, **kwargs))

    async def __aenter__(self) -> "Tangram":
        await self.runtime.start()
        self.runtime.prune_live()  # no journal here: what an earlier head left running is nobody's
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runtime.close()

    async def run(self, code: str, language: str = "python", *, stdin: bytes | str | None = None,
                  files: dict[str, bytes] | None = None, fetch_files: list[str] | None = None,
                  timeout_s: float = 10.0, compile_timeout_s: float = 10.0, memory_mb: int | None = None,
                  cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0, job: str = "default",
                  hint_s: float | None = None, id: str | None = None, operation: str = "",
                  image: str | None = None, memory_as_rlimit: bool = False,
                  remaining_turns: int | None = None) -> ActionResult:
        """Run a one-shot program in a fresh or verified-pristine recycled sandbox (of ``image``, if
        given); ``memory_as_rlimit`` also caps its address space (SandboxFusion's MemoryError)."""
        return await self.runtime.submit(one_shot(
            id or self.runtime.new_id("r"), code, language, stdin=stdin, files=files, fetch_files=fetch_files,
            timeout_s=timeout_s, compile_timeout_s=compile_timeout_s, memory_mb=memory_mb, cpus=cpus,
            parallel_fraction=parallel_fraction, job=job, hint_s=hint_s, operation=operation, image=image,
            memory_as_rlimit=memory_as_rlimit, remaining_turns=remaining_turns))

    async def score(self, model: str, tokens: list[int], *, job: str = "default",
                    hint_s: float | None = None) -> ActionResult:
        """A reward model's scalar for one token sequence (batched with concurrent calls)."""
        return await self._model_call(model, "score", tokens, job, hint_s, min_len=1)

    async def logprobs(self, model: str, tokens: list[int], *, job: str = "default",
                       hint_s: float | None = None) -> ActionResult:
        """A teacher's log-probability of each token given the ones before it."""
        return await self._model_call(model, "logprobs", tokens, job, hint_s, min_len=2)

    async def _model_call(self, model: str, op: str, tokens, job: str, hint_s, min_len: int) -> ActionResult:
        rt = self.runtime
        mm = rt.models
        problem = f"service: unknown model {model!r}" if mm is None else mm.validate(model, op, tokens, min_len)
        if problem is not None:
            return ActionResult.rejected(rt.new_id("m"), problem)
        front = self.fronts.get((model, op))
        if front is None:
            spec = mm.services[model]
            front = self.fronts[(model, op)] = _ModelFront(rt, model, op, spec.max_batch, spec.max_wait_ms, spec.gpus)
        # checked now: the batch's action is built later, in a timer callback
        return await front.call(list(tokens), job, seconds("hint_s", hint_s))

    async def call_model(self, model: str, op: str, item: Any, *, job: str = "default",
                         hint_s: float | None = None) -> ActionResult:
        """One request to any op of a model service, with the item that op takes per request
        (``generate``'s ``Generate``, ``classify``'s ``Classify``: ``managers/models/generation.py``),
        batched with concurrent calls to the same op as ``score`` and ``logprobs`` are. The caller
        checks the item (``runtime.models.validate`` for token ids); an unknown model is rejected."""
        rt = self.runtime
        mm = rt.models
        if mm is None or model not in mm.services:
            return ActionResult.rejected(rt.new_id("m"), f"service: unknown model {model!r}")
        front = self.fronts.get((model, op))
        if front is None:
            spec = mm.services[model]
            front = self.fronts[(model, op)] = _ModelFront(rt, model, op, spec.max_batch, spec.max_wait_ms, spec.gpus)
        return await front.call(item, job, seconds("hint_s", hint_s))

    async def call_api(self, name: str, payload: Any = None, *, job: str = "default", timeout_s: float = 60.0,
                       operation: str = "", hint_s: float | None = None) -> ActionResult:
        """Call an external API through its quota (waits in the queue rather than over-calling)."""
        action = Action(self.runtime.new_id("q"), f"api:{name}", job=job, operation=operation,
                        hint_s=hint_s, timeout_s=timeout_s, payload=payload)
        return await self.runtime.submit(action)

    async def session(self, job: str = "default", trajectory: str | None = None, image: str | None = None) -> Session:
        """A new session (its sandbox starts with its first action). An ``image`` neither in the
        store nor a registry reference raises ``ImageError`` here, not at the first step; one
        named by a reference not here starts to be pulled, and the first step waits for the
        pull (a failed pull ends that step, saying why); ``NoRoom`` when memory has run out. On
        Ray the node the session lands on pulls it, one that holds it preferred."""
        if image is not None:
            self._check_image(image)
        self.runtime.admit_session()  # NoRoom rather than a first step that waits for memory
        if trajectory is not None:
            self.runtime.ended.pop(trajectory, None)  # a trajectory that ended may start over
        return Session(self.runtime, trajectory or self.runtime.new_id("s"), job, image)

    def _sandboxes(self, what: str) -> SandboxManager:
        sb = self.runtime.sandbox_manager()
        if sb is None:
            raise ImageError(f"{what}: this runtime has no image-capable sandboxes")
        return sb

    def _check_image(self, image: str) -> None:
        """An image here, or a registry reference (its pull starts now; the first step waits for it)."""
        self.runtime.check_image(image)

    async def restore(self, path: str | os.PathLike, job: str = "default", trajectory: str | None = None) -> Session:
        """A new session whose files are those of a snapshot (``Session.snapshot``), made by an
        action on it, as a fork is. The snapshot's image must be in this runtime's image store
        under the same id; ``ImageError`` says why a snapshot cannot be restored."""
        self._sandboxes("restore")
        traj = trajectory or self.runtime.new_id("s")
        action = Action(self.runtime.new_id("o"), "sandbox", job=job, trajectory=traj, operation="restore",
                        hint_s=0.5, timeout_s=600, payload=Restore(os.fspath(path)))
        r = await self.runtime.submit(action)
        if r.outcome is Outcome.REJECTED:
            raise ImageError(r.message)
        if r.outcome is not Outcome.OK:
            raise SessionError(r)
        return Session(self.runtime, traj, job, r.result.info["image"])

    async def pull(self, image: str) -> str:
        """Have ``image`` in this runtime's store now (pulled if it is a registry reference not
        here; ``ImageError`` naming it if it cannot be, its ``infra`` set where the registry did
        not answer); returns the store's name for it. On Ray: on one node (one that holds it,
        else the emptiest), which sessions naming it then prefer."""
        return await self.runtime.pull_image(image)

    async def prewarm(self, image: str, n: int, nodes: int | None = None):
        """Start ``n`` sandboxes of ``image`` now (pulled first if it is a reference not here),
        so that sessions and one-shots of it skip setup, within the idle cap
        ``max_idle_sandboxes`` (see the result's ``ready``). ``nodes``: on Ray, pull it and start
        ``n`` sandboxes on each of that many nodes (default one; those holding it first), which
        sessions naming it then prefer; one machine is one node (more: ``ValueError``)."""
        return await self.runtime.prewarm(image, n, nodes)
