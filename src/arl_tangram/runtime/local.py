"""The embedded local runtime: the engine and a policy on an asyncio loop, real sandboxes.

The same engine and policy as the simulator, but time is the monotonic clock and the CPU pool is
this machine (or the CPUs configured). Usage::

    async with Tangram.local() as tg:
        r = await tg.run("print('hi')")                 # one-shot, any registered language
        s = await tg.session()                          # a trajectory's stateful sandbox
        await s.exec(python="x = 41")
        r = await s.exec(python="print(x + 1)")
        await s.put({"data.txt": b"..."}); files = await s.get(["data.txt"])
        await s.close()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..core.action import Action, Demand, Finished, Outcome
from ..core.cluster import ApiQuota, Cluster, CpuNode, GpuNode
from ..engine import Engine
from ..managers.quota import ApiManager
from ..managers.sandbox.images import ImageError
from ..managers.sandbox.manager import Exec, Files, RunCode, SandboxConfig, SandboxManager, SandboxResult
from ..policy import Costs, Policy, Profile, make_policy

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


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 8.0


class LocalRuntime:
    """Owns the engine, the sandbox manager and the futures of submitted actions."""

    def __init__(self, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
                 cores: int | None = None, memory_gb: float | None = None, profile: Profile | None = None, *,
                 sandboxes: bool = True, models: list | None = None, gpus: int | None = None,
                 gpu_memory_gb: float | None = None, model_device: str = "auto",
                 apis: dict[str, tuple[ApiQuota, Any]] | None = None) -> None:
        """``models``: ``ModelServiceConfig``s served on this machine's GPUs (or, without CUDA, on
        ``gpus`` CPU "devices" of ``gpu_memory_gb`` each); ``apis``: name -> (quota, async handler)."""
        managers: dict = {}
        cpu_nodes: tuple = ()
        self.sandboxes = SandboxManager(sandbox) if sandboxes else None
        if self.sandboxes is not None:
            n = cores or len(self.sandboxes.host_cpus)
            cpu_nodes = (CpuNode("local", n, memory_gb or _memory_gb()),)
            self.sandboxes.on_done = self._done
            self.sandboxes.on_expire = self.end_session
            managers["cpu"] = self.sandboxes
        gpu_nodes: tuple = ()
        model_specs: tuple = ()
        self.models = None
        self.fronts: dict[tuple[str, str], "_ModelFront"] = {}
        if models:
            from ..managers.models.manager import ModelManager
            self.models = ModelManager(models, model_device)
            model_specs = tuple(self.models.load_all())
            if self.models.cuda:
                import torch
                count = gpus or torch.cuda.device_count()
                mem = gpu_memory_gb or torch.cuda.get_device_properties(0).total_memory / 1e9 * 0.9
            else:
                count, mem = gpus or 1, gpu_memory_gb or 16.0
            gpu_nodes = (GpuNode("local-gpu", count, mem, count, 25.0),)
            self.models.on_done = self._done
            managers["gpu"] = self.models
        quotas: tuple = ()
        self.apis = None
        if apis:
            self.apis = ApiManager({name: handler for name, (_, handler) in apis.items()})
            self.apis.on_done = self._done
            quotas = tuple(q if q.name == name else ApiQuota(name, q.rate_per_s, q.concurrency, q.burst)
                           for name, (q, _) in apis.items())
            managers["api"] = self.apis
        self.cluster = Cluster(cpu_nodes, gpu_nodes, quotas, model_specs)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        mem_gb = self.sandboxes.config.memory_mb / 1024 if self.sandboxes else 1.0
        costs = Costs(session_create_s=0.01, session_thaw_s=0.001, session_restore_s=0.01, session_mem_gb=mem_gb)
        self.engine = Engine(self.cluster, self.policy, managers, MonotonicClock(), costs=costs, profile=profile)
        if self.models is not None:
            self.models.on_loaded = self._loaded
        self.engine.listeners.append(self._finished)
        self._futures: dict[str, asyncio.Future] = {}
        self._results: dict[str, Any] = {}
        self._wake: asyncio.TimerHandle | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> "LocalRuntime":
        if self.sandboxes is not None:
            await self.sandboxes.start_up()
        self._schedule()  # lets the policy prefetch models onto idle GPUs
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for aid in list(self.engine.pending):
            self.engine.cancel(aid)
        for manager in (self.sandboxes, self.models, self.apis):
            if manager is not None:
                await manager.shut_down()
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()

    # -- submitting ------------------------------------------------------------------------------
    async def submit(self, action: Action) -> ActionResult:
        """Schedule ``action`` and wait for its one terminal outcome."""
        fut = asyncio.get_running_loop().create_future()
        self._futures[action.id] = fut
        self.engine.submit(action)  # a rejection resolves the future through the listener
        self._schedule()
        return await fut

    def _done(self, action_id: str, outcome: Outcome, setup_s: float, exec_s: float, message: str,
              result: Any) -> None:
        self._results[action_id] = result
        self.engine.complete(action_id, outcome, setup_s=setup_s, exec_s=exec_s, message=message)
        self._schedule()

    def _finished(self, f: Finished) -> None:
        fut = self._futures.pop(f.action.id, None)
        result = self._results.pop(f.action.id, None)
        if result is None and f.action.pool == "cpu":
            result = SandboxResult(message=f.message)
        if fut is not None and not fut.done():
            fut.set_result(ActionResult(f.action.id, f.outcome, result, f.act_s, f.queue_s, f.setup_s, f.exec_s,
                                        f.units, f.message))

    def _schedule(self) -> None:
        self.engine.schedule()
        wake = self.engine.next_wakeup()
        if wake is not None:
            loop = asyncio.get_running_loop()
            if self._wake is not None:
                self._wake.cancel()
            self._wake = loop.call_later(max(0.0, wake - time.monotonic()), self._schedule)

    def _loaded(self, key: str) -> None:
        self.engine.loaded(key)
        self._schedule()

    def end_session(self, trajectory: str) -> None:
        self.engine.end_trajectory(trajectory)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"


class _ModelFront:
    """Dynamic batching for one (service, operation): requests arriving within ``max_wait_ms`` (up
    to ``max_batch``) become one action, so the GPU sees batches while callers see single calls.
    While as many batches are in flight as the pool could run copies of the model, new requests
    keep accumulating instead of queueing as small batches: under load, batches grow."""

    def __init__(self, runtime: LocalRuntime, model: str, op: str, max_batch: int, max_wait_ms: float,
                 gpus: int) -> None:
        self.runtime, self.model, self.op = runtime, model, op
        self.max_batch, self.max_wait_s, self.gpus = max_batch, max_wait_ms / 1000, gpus
        self.items: list = []
        self.futures: list[asyncio.Future] = []
        self.meta: list[tuple[str, float | None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.in_flight = 0
        self.max_in_flight = max(1, runtime.cluster.total_gpus // gpus)

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
        from ..managers.models.manager import ModelCall
        action = Action(self.runtime.new_id("m"), f"model:{self.model}", Demand({"gpu": (self.gpus, self.gpus)}),
                        job=meta[0][0], operation=self.op, hint_s=meta[0][1], payload=ModelCall(self.op, items))
        task = asyncio.get_running_loop().create_task(self.runtime.submit(action))

        def deliver(t: asyncio.Task) -> None:
            self.in_flight -= 1
            if self.items:
                self._flush()
            r: ActionResult = t.result()
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

    def __init__(self, runtime: LocalRuntime, trajectory: str, job: str, image: str | None = None) -> None:
        self.runtime = runtime
        self.id = trajectory
        self.job = job
        self.image = image
        self.closed = False
        self.last_fork: dict = {}

    async def fork(self, n: int, *, id: str | None = None) -> list["Session"]:
        """``n`` new sessions whose files start as a copy-on-write copy of this one's (an image
        session only). Files carry over; processes (the python interpreter, the shell) of this
        session and the children start afresh on their next step."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
            raise ValueError("n: must be an integer from 1 to 256")
        from ..managers.sandbox.envops import Fork
        children = tuple(self.runtime.new_id("s") for _ in range(n))
        action = Action(id or self.runtime.new_id("k"), "sandbox", job=self.job, trajectory=self.id,
                        operation="fork", hint_s=0.02, payload=Fork(self.id, children))
        r = await self.runtime.submit(action)
        if r.outcome is not Outcome.OK:
            raise SessionError(r)
        self.last_fork = r.result.info  # timings: pause_s (source stopped), cow_s (layers mounted), fork_s
        return [Session(self.runtime, c, self.job, self.image) for c in children]

    async def snapshot(self, path: str | os.PathLike | None = None) -> str:
        """Write this session's filesystem state to ``path`` (default: a new file in the
        temporary directory); ``Tangram.restore(path)`` opens a new session from it."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        from ..managers.sandbox.envops import Snapshot
        if path is None:
            import tempfile
            fd, path = tempfile.mkstemp(suffix=".tangram-snapshot.tar")
            os.close(fd)
        action = Action(self.runtime.new_id("p"), "sandbox", job=self.job, trajectory=self.id, operation="snapshot",
                        hint_s=0.5, timeout_s=600, payload=Snapshot(self.id, os.fspath(path)))
        r = await self.runtime.submit(action)
        if r.outcome is not Outcome.OK:
            raise SessionError(r)
        return os.fspath(path)

    async def exec(self, command: str | None = None, *, python: str | None = None, stdin: bytes | None = None,
                   timeout_s: float = 10.0, cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0,
                   hint_s: float | None = None, operation: str = "", memory_mb: int | None = None,
                   id: str | None = None) -> ActionResult:
        """Run a shell ``command`` in the workspace, or a ``python`` cell in the session's
        interpreter (its variables carry over from call to call)."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        if (command is None) == (python is None):
            raise ValueError("exec: give exactly one of command or python")
        rng = (cpus, cpus) if isinstance(cpus, int) else cpus
        payload = Exec(command=command, python=python, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                       image=self.image)
        action = Action(id or self.runtime.new_id("x"), "sandbox", Demand({"cpu": rng}), job=self.job,
                        trajectory=self.id,
                        operation=operation or ("python" if python is not None else command.split()[0]
                                                if command.split() else "shell"),
                        hint_s=hint_s, parallel_fraction=parallel_fraction, timeout_s=timeout_s + 30,
                        payload=payload)
        return await self.runtime.submit(action)

    async def put(self, files: dict[str, bytes], id: str | None = None) -> ActionResult:
        return await self.files(Files(put=files), id)

    async def get(self, paths: list[str]) -> dict[str, bytes]:
        r = await self.files(Files(get=paths))
        return r.result.files

    async def files(self, files: Files, id: str | None = None) -> ActionResult:
        """Put and/or get workspace files as one action (``result.files``, ``result.missing``)."""
        if self.closed:
            raise RuntimeError(f"session {self.id} is closed")
        if files.image is None:
            files.image = self.image
        action = Action(id or self.runtime.new_id("f"), "sandbox", job=self.job, trajectory=self.id,
                        operation="files", hint_s=0.005, payload=files)
        return await self.runtime.submit(action)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.runtime.end_session(self.id)


class Tangram:
    """The embedded API: ``async with Tangram.local() as tg: ...``."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime

    @classmethod
    def local(cls, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
              cores: int | None = None, profile: Profile | None = None, **kwargs) -> "Tangram":
        """``kwargs``: ``sandboxes=False``, ``models=[ModelServiceConfig...]``, ``gpus``,
        ``gpu_memory_gb``, ``apis={name: (ApiQuota, async handler)}`` (see ``LocalRuntime``)."""
        return cls(LocalRuntime(policy, sandbox, cores, profile=profile, **kwargs))

    async def __aenter__(self) -> "Tangram":
        await self.runtime.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runtime.close()

    async def run(self, code: str, language: str = "python", *, stdin: bytes | str | None = None,
                  files: dict[str, bytes] | None = None, fetch_files: list[str] | None = None,
                  timeout_s: float = 10.0, compile_timeout_s: float = 10.0, memory_mb: int | None = None,
                  cpus: int | tuple[int, int] = 1, parallel_fraction: float = 0.0, job: str = "default",
                  hint_s: float | None = None, id: str | None = None, operation: str = "",
                  image: str | None = None) -> ActionResult:
        """Run a one-shot program in a fresh sandbox (of ``image``, if given)."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        rng = (cpus, cpus) if isinstance(cpus, int) else cpus
        payload = RunCode(code, language, stdin, dict(files or {}), list(fetch_files or []), compile_timeout_s,
                          timeout_s, memory_mb, image)
        action = Action(id or self.runtime.new_id("r"), "sandbox", Demand({"cpu": rng}), job=job,
                        operation=operation or language,
                        hint_s=hint_s, parallel_fraction=parallel_fraction,
                        timeout_s=timeout_s + compile_timeout_s + 30, payload=payload)
        return await self.runtime.submit(action)

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
        problem = None
        mm = rt.models
        if mm is None or (model not in mm.loaded and model not in mm.failed):
            problem = f"service: unknown model {model!r}"
        elif model in mm.failed:
            problem = f"service: model {model!r} failed to load ({mm.failed[model]})"
        elif op not in mm.loaded[model].ops:
            problem = f"op: model {model!r} has no {op!r} (it has {', '.join(mm.loaded[model].ops)})"
        elif not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
            problem = "tokens: must be a flat list of integer token ids"
        elif len(tokens) < min_len:
            problem = f"tokens: {op} needs at least {min_len} token(s)"
        else:
            vocab = mm.loaded[model].vocab
            bad = [t for t in tokens if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                problem = f"tokens: id {bad[0]} out of range [0, {vocab})"
        if problem is not None:
            return ActionResult(rt.new_id("m"), Outcome.REJECTED, None, 0.0, 0.0, 0.0, 0.0, 0, problem)
        front = rt.fronts.get((model, op))
        if front is None:
            spec = mm.services[model]
            front = rt.fronts[(model, op)] = _ModelFront(rt, model, op, spec.max_batch, spec.max_wait_ms, spec.gpus)
        return await front.call(list(tokens), job, hint_s)

    async def call_api(self, name: str, payload: Any = None, *, job: str = "default", timeout_s: float = 60.0,
                       operation: str = "", hint_s: float | None = None) -> ActionResult:
        """Call an external API through its quota (waits in the queue rather than over-calling)."""
        action = Action(self.runtime.new_id("q"), f"api:{name}", job=job, operation=operation, hint_s=hint_s,
                        timeout_s=timeout_s, payload=payload)
        return await self.runtime.submit(action)

    async def session(self, job: str = "default", trajectory: str | None = None, image: str | None = None) -> Session:
        """A new session (its sandbox starts with its first action). An unknown ``image`` raises
        ``ImageError`` here, not at the first step."""
        if image is not None:
            self._check_image(image)
        return Session(self.runtime, trajectory or self.runtime.new_id("s"), job, image)

    def _check_image(self, image: str) -> None:
        sb = self.runtime.sandboxes
        if sb is None:
            raise ImageError("image: this runtime has no sandboxes")
        sb.imageboxes.image(image) if sb.imageboxes is not None else sb.images.get(image)

    async def restore(self, path: str | os.PathLike, job: str = "default", trajectory: str | None = None) -> Session:
        """A new session whose files are those of a snapshot (``Session.snapshot``). The
        snapshot's image must be in this runtime's image store under the same id."""
        sb = self.runtime.sandboxes
        if sb is None:
            raise ImageError("restore: this runtime has no sandboxes")
        traj = trajectory or self.runtime.new_id("s")
        await sb.restore(traj, os.fspath(path))
        root = sb.pending_roots[traj]
        return Session(self.runtime, traj, job, root.image.name)

    async def prewarm(self, image: str, n: int):
        """Start ``n`` sandboxes of ``image`` now, so that sessions and one-shots of it skip
        setup, within the idle cap ``max_idle_sandboxes`` (see the result's ``ready``)."""
        if self.runtime.sandboxes is None:
            raise ImageError("prewarm: this runtime has no sandboxes")
        return await self.runtime.sandboxes.prewarm(image, n)
