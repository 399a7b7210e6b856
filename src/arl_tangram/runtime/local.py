"""The embedded local runtime: the engine and a policy on an asyncio loop, real sandboxes.

The same engine and policy as the simulator, but time is the monotonic clock and the pools are
this machine (``LocalHost.detect``). Usage, through the API in ``runtime.api``::

    async with Tangram.local() as tg:
        r = await tg.run("print('hi')")                 # one-shot, any registered language
        s = await tg.session()                          # a trajectory's stateful sandbox
        await s.exec(python="x = 41")
        r = await s.exec(python="print(x + 1)")
        await s.put({"data.txt": b"..."}); files = await s.get(["data.txt"])
        await s.close()
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..core.cluster import ApiQuota
from ..core.seam import Manager, Pool, Sink
from ..managers.quota import ApiManager, Handler
from ..managers.sandbox.corewaits import summary
from ..managers.sandbox.manager import SandboxManager
from ..managers.sandbox.spec import SandboxConfig
from ..policy import Costs, Policy, Profile, Wait
from ..waits import DEFAULT_MAX_QUEUE_S
from .base import NoRoom, Runtime
from .host import LocalHost, mem_available_mb
from .workers import SandboxWorkers

log = logging.getLogger(__name__)

#: builds the sandbox manager from the runtime's sink and its session-expiry callback; the
#: default is ``SandboxManager``; tests pass an in-process double here
SandboxFactory = Callable[[Sink, Callable[[str], None]], Manager]


class LocalRuntime(Runtime):
    """This machine's cores (real sandboxes), GPUs (model services) and API quotas."""

    def __init__(self, policy: str | Policy = "tangram", sandbox: SandboxConfig | None = None,
                 cores: int | None = None, memory_gb: float | None = None, profile: Profile | None = None, *,
                 sandboxes: bool | SandboxFactory = True, models: list | None = None, gpus: int | None = None,
                 gpu_memory_gb: float | None = None, model_device: str = "auto",
                 apis: dict[str, tuple[ApiQuota, Handler]] | None = None, gpu_island_size: int | None = None,
                 max_queue_s: float | None = DEFAULT_MAX_QUEUE_S, workers: int = 0) -> None:
        """``models``: ``ModelServiceConfig``s served on this machine's GPUs (discovered with their
        NVLink islands; ``gpus``, ``gpu_memory_gb``, ``gpu_island_size`` override) or, without CUDA,
        on ``gpus`` CPU "devices" of ``gpu_memory_gb`` each; ``apis``: name -> (quota, async handler);
        ``sandboxes``: False for none, or a factory of another sandbox manager (a test double);
        ``memory_gb``: the memory sessions may reserve (default: this machine's); ``max_queue_s``: an
        action not started this long after submission ends ``rejected``; ``workers``: processes that
        carry out one-shots beside this one (``runtime/workers.py``; 0: all in this process)."""
        super().__init__()
        sink = self.report
        managers: dict[Pool, Manager] = {}
        self.sandboxes: Any = None
        if sandboxes:
            config = sandbox or SandboxConfig()
            expire = self._expire
            self._expiry_s = config.session_idle_expiry_s
            if callable(sandboxes):
                self.sandboxes = sandboxes(sink, expire)
            else:
                self.sandboxes = SandboxManager(config, sink, expire)
                if workers:
                    self.sandboxes = SandboxWorkers(self.sandboxes, workers, sink, cores)
            managers[Pool.CPU] = self.sandboxes
        self.models = None
        model_specs: tuple = ()
        if models:
            from ..managers.models.spec import require_torch
            require_torch()
            from ..managers.models.manager import ModelManager
            self.models = ModelManager(models, sink, model_device)
            model_specs = tuple(self.models.load_all())
            managers[Pool.GPU] = self.models
        self.apis = None
        quotas: tuple[ApiQuota, ...] = ()
        if apis:
            self.apis = ApiManager({name: handler for name, (_, handler) in apis.items()}, sink)
            quotas = tuple(ApiQuota(name, q.rate_per_s, q.concurrency, q.burst) for name, (q, _) in apis.items())
            managers[Pool.API] = self.apis
        real = self.sandbox_manager()
        if real is not None and cores is None:
            cores = len(real.host_cpus)
        host = LocalHost.detect(sandboxes=self.sandboxes is not None, cores=cores, memory=memory_gb,
                                models=self.models is not None, cuda=bool(self.models and self.models.cuda),
                                gpus=gpus, gpu_memory_gb=gpu_memory_gb, gpu_island_size=gpu_island_size)
        mem_gb = self.sandboxes.config.memory_mb / 1024 if self.sandboxes is not None else 1.0
        headroom_gb = self.sandboxes.config.session_headroom_mb / 1024 if self.sandboxes is not None else 0.0
        self._build(host.cluster(quotas, model_specs), policy, managers, Costs.local(mem_gb), profile,
                    max_queue_s=max_queue_s, session_headroom_gb=headroom_gb)
        if real is not None:
            real.on_rest = self.session_rested
            real.rest_recorded = self.rest_recorded

    def _expire(self, trajectory: str) -> None:
        self.end_session(trajectory, f"session {trajectory} expired: unused for more than {self._expiry_s:g} s "
                                     "(SandboxConfig.session_idle_expiry_s); its state is gone")

    def admit_session(self) -> None:
        """The engine's accounting, then the ground truth: this host's available memory."""
        super().admit_session()
        real = self.sandbox_manager()
        if real is not None and real.store is not None and real.store.used >= real.config.rest_disk_mb << 20:
            raise NoRoom("rest disk", f"no room for a new session: sessions at rest use {real.store.used >> 20} MB "
                                      f"of disk, at sandbox.rest_disk_mb ({real.config.rest_disk_mb} MB); close "
                                      "sessions or retry later")
        floor = self.sandboxes.config.min_free_memory_mb if self.sandboxes is not None else 0
        avail = mem_available_mb()
        if floor and avail is not None and avail < floor:
            raise NoRoom("host memory", f"no room for a new session: this host has {avail:.0f} MB of memory "
                                        f"available, below sandbox.min_free_memory_mb ({floor} MB)")

    def sandbox_manager(self) -> SandboxManager | None:
        s = self.sandboxes
        if isinstance(s, SandboxWorkers):
            return s.local
        return s if isinstance(s, SandboxManager) else None

    def sandbox_config(self) -> SandboxConfig | None:
        return self.sandboxes.config if self.sandboxes is not None else None

    def session_usage(self, trajectory: str) -> tuple[int, float] | None:
        real = self.sandbox_manager()
        sb = real.sessions.get(trajectory) if real is not None else None
        if sb is None or sb.group is None:
            return None
        try:
            return sb.group.memory_bytes(), sb.group.cpu_seconds()
        except (OSError, ValueError):  # the group went with its sandbox meanwhile
            return None

    def interrupt_step(self, trajectory: str) -> bool:
        real = self.sandbox_manager()
        sb = real.sessions.get(trajectory) if real is not None else None
        if sb is None:
            return False
        sb.interrupt_step()
        return True

    def session_state(self, trajectory: str) -> str | None:
        real = self.sandbox_manager()
        return real.session_state(trajectory) if real is not None else None

    async def warm_up(self, timeout_s: float) -> bool:
        real = self.sandbox_manager()
        return await real.sessions_warm(timeout_s) if real is not None and real.mode is not None else True

    def rest_stats(self) -> dict | None:
        real = self.sandbox_manager()
        return real.rest_stats() if real is not None and real.store is not None else None

    def image_stats(self) -> dict | None:
        real = self.sandbox_manager()
        return real.image_stats() if real is not None else None

    def why_waiting(self, action_id: str) -> Wait | None:
        """The policy's reason while the action is queued; once started, while it waits for its
        image's pull, "pulling IMAGE: N of M MB" (reason ``image-pull``)."""
        wait = super().why_waiting(action_id)
        real = self.sandbox_manager()
        if wait is None and real is not None:
            pulling = real.pulling(action_id)
            if pulling is not None:
                return Wait("image-pull", pulling)
        return wait

    def adopt_rested(self, trajectory: str, path: str, image: str | None) -> None:
        real = self.sandbox_manager()
        if real is None:
            raise LookupError("no sandbox manager in this process to wake it")
        real.adopt_rested(trajectory, path, image)

    def prune_rested(self) -> int:
        real = self.sandbox_manager()
        return real.prune_rested() if real is not None else 0

    def sandbox_workers(self) -> tuple[int, int] | None:
        s = self.sandboxes
        if not isinstance(s, SandboxWorkers):
            return None
        return sum(1 for w in s.workers if w.up), len(s.workers)

    async def core_waits(self) -> dict | None:
        s = self.sandboxes
        if isinstance(s, SandboxWorkers):
            return summary(*await s.core_waits())
        return summary(*s.core_waits.state()) if isinstance(s, SandboxManager) else None

    async def one_shot_sandboxes(self) -> dict[str, int] | None:
        s = self.sandboxes
        if isinstance(s, SandboxWorkers):
            return await s.one_shot_sandboxes()
        return s.one_shot_sandboxes() if isinstance(s, SandboxManager) else None

    def isolation(self) -> str | None:
        real = self.sandbox_manager()
        return real.mode.value if real is not None and real.mode is not None else None

    def cgroups(self) -> str | None:
        real = self.sandbox_manager()
        if real is None or real.root is None:  # a CgroupRoot, where there is one
            return None
        return "v2" if real.root.v2 else "v1"

    def one_shot_cpus(self) -> str | None:
        real = self.sandbox_manager()
        if real is None or real.mode is None:  # not started up
            return None
        return "shared" if real.shares_cpus else "pinned"
