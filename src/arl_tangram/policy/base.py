"""The seam between the engine and a scheduling policy.

A policy only decides. It reads the engine's state through ``EngineView`` and yields decisions as
data; the engine applies each one (so the next decision sees its effect) and hands started actions
to the managers once the round is over. Nothing here touches a clock, a thread or a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Iterable, Mapping, Protocol

from mypy_extensions import mypyc_attr

from ..core.action import CPU, GPU, Action, Finished, by_fields
from ..core.cluster import Cluster
from ..core.pools import CpuPool, GpuPool, Instance, QuotaPool
from ..core.records import Load, Reservation, Running


@mypyc_attr(free_list_len=1)
@dataclass(init=False)  # one per action: ``__init__`` written out (``core.action.by_fields`` says why)
class Start:
    """Run ``action`` now: on CPU ``node`` with ``count`` cores, on GPU ``block`` (after evicting
    ``evict``), or on an API quota; ``reservation`` draws the units from a reserved partition;
    ``unmanaged`` API calls bypass our quota (the client-side practice the static baseline models)."""

    action: Action
    node: int | None
    count: int
    block: tuple[int, ...]
    evict: tuple[Instance, ...]
    reservation: str
    unmanaged: bool

    def __init__(self, action: Action, node: int | None = None, count: int = 1, block: tuple[int, ...] = (),
                 evict: tuple[Instance, ...] = (), reservation: str = "", unmanaged: bool = False) -> None:
        self.action = action
        self.node = node
        self.count = count
        self.block = block
        self.evict = evict
        self.reservation = reservation
        self.unmanaged = unmanaged

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)


@dataclass(frozen=True, slots=True)
class Grow:
    """Give an action started in this same round ``count`` more cores on its node (elasticity)."""

    action_id: str
    count: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Shrink:
    """Take ``count`` cores back from a running CPU action that a ``Grow`` gave more than its
    minimum: a queue formed, and a core serves a queued action better than the last cores of a
    grown one (speed-ups are concave). The engine returns the cores to the pool at once (the next
    decision of the round may start an action on them) and tells the pool's manager, which must
    take them from the running action before that action starts (``core.seam.Resizer``). Only
    engines whose CPU manager can do that accept it (``EngineView.cpu_resizes``)."""

    action_id: str
    count: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Follow:
    """Queue ``action`` behind the running ``after`` on its cores: the CPU manager starts it the
    moment ``after`` ends, and the engine hands it ``after``'s cores, unreleased, when that end is
    reported. Only for an action of ``EngineView.followable`` without a follower, and an action
    that asks for exactly its cores; only engines whose CPU manager can (``core.seam.Chainer``)
    list any. What it saves: the report's way to the engine and the start's way back, during
    which the core idles."""

    action: Action
    after: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Copy a registered model's weights onto the idle GPUs of ``block`` before anyone asks."""

    model: str
    block: tuple[int, ...]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Evict:
    """Drop the idle copy of ``model`` on ``block`` from GPU memory (scale to zero); its weights
    stay in host RAM and the next request loads it again."""

    model: str
    block: tuple[int, ...]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Reserve:
    """Set units aside for one owner (a trajectory's sandbox, a service's GPU partition): cores on
    ``node`` (``count``) or the GPUs of ``block``, preloaded with ``model`` when given."""

    key: str
    pool: str
    node: int | None = None
    count: int = 0
    block: tuple[int, ...] = ()
    model: str = ""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class Release:
    key: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


Decision = Start | Follow | Grow | Shrink | Prefetch | Evict | Reserve | Release


@dataclass(frozen=True, slots=True)
class Costs:
    """What state work costs: the policy expects it, the simulator's managers charge it (the real
    managers do the real thing). The defaults model container-style sandboxes at cluster scale:
    create ~1 s (workspace + namespaces from a warm pool), thaw ms (cgroup freezer), restore ~2 s
    (a few hundred MB of workspace moved to another node)."""

    session_create_s: float = 1.0
    session_thaw_s: float = 0.005
    session_restore_s: float = 2.0
    session_mem_gb: float = 2.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails

    @classmethod
    def local(cls, session_mem_gb: float) -> "Costs":
        """This machine's bubblewrap sandboxes: what an action's ``setup_s`` measures (2-core VM,
        20 sessions: taking a prepared sandbox 0.2 ms, thawing one 0.17 ms). A session's shell
        starts in its first step (~8 ms there), which is measured, recorded and replayed as that
        step's work; charging it here as well would count it twice in replays of real runs."""
        return cls(session_create_s=0.0005, session_thaw_s=0.0002, session_restore_s=0.01,
                   session_mem_gb=session_mem_gb)

    @classmethod
    def ray(cls, session_mem_gb: float, move_s: float | None = None) -> "Costs":
        """A Ray cluster of these sandboxes: as ``local``, but a session's restore elsewhere is a
        real move (snapshot on the old node's agent, the object store, restore on the new one),
        ``move_s`` seconds: what the policy weighs against the wait a move saves. Default
        ``MOVE_S``, measured by ``tangram bench cluster``."""
        local = cls.local(session_mem_gb)
        return cls(session_create_s=local.session_create_s, session_thaw_s=local.session_thaw_s,
                   session_restore_s=MOVE_S if move_s is None else move_s, session_mem_gb=session_mem_gb)


#: What a session's move between nodes of a Ray cluster costs, p50, as ``tangram bench cluster
#: --nodes 1 --drain-sessions 50`` measures it (0.32 s on a 2-core VM, loopback cluster): priced at
#: 0.01 s, sessions moved to save a few ms of waiting.
MOVE_S: Final = 0.32


@dataclass(slots=True)
class Profile:
    """Expected load, for static baselines that must size partitions up front: unit-seconds of
    work per (job, pool) and per model service, and the number of concurrent trajectories."""

    unit_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    model_seconds: dict[str, float] = field(default_factory=dict)
    trajectories: int = 0


class EngineView(Protocol):
    """What a policy may read of the engine (and must not write: the engine applies decisions)."""

    @property
    def cluster(self) -> Cluster: ...
    @property
    def cpu(self) -> CpuPool: ...
    @property
    def gpu(self) -> GpuPool: ...
    @property
    def quotas(self) -> Mapping[str, QuotaPool]: ...
    @property
    def running(self) -> Mapping[str, Running]: ...
    @property
    def reservations(self) -> Mapping[str, Reservation]: ...
    @property
    def loading(self) -> Mapping[str, Load]: ...
    @property
    def costs(self) -> Costs: ...
    @property
    def profile(self) -> Profile: ...
    @property
    def cpu_resizes(self) -> bool:
        """The CPU manager takes cores back from running actions (``Shrink`` is accepted)."""
        ...
    @property
    def followable(self) -> Mapping[str, Running]:
        """Running CPU actions another may ``Follow``: fixed-size, outside reservations and
        sessions, none behind them yet, oldest start first. Empty unless the CPU manager chains
        (``core.seam.Chainer``)."""
        ...


@dataclass(frozen=True, slots=True)
class Wait:
    """Why a policy has not started a queued action, in the manner of Ray autoscaler v2's reasons
    for a pending request: ``reason`` a short stable name a program can count (``cores``,
    ``session-memory``, ``gpus``, ``gpu-node``, ``model-loading``, ``model-busy``, ``quota``,
    ``fair-share``, ``turn``), ``detail`` the same in words with the figures of the moment, ``until`` when it
    changes by itself, where that is known (a quota's next token)."""

    reason: str
    detail: str
    until: float | None = None

    def __str__(self) -> str:
        return self.detail

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


def pool_wait(view: "EngineView", a: Action, now: float) -> Wait:
    """What the pools lack for ``a`` as they are now: the reason every policy can give; a policy
    says its own (a fair share, a copy it waits for) before this one."""
    if a.pool == CPU:
        cpu = view.cpu
        lo = a.demand.min(CPU)
        most_free = max((cpu.nfree(i) for i in range(len(cpu.nodes))), default=0)
        if a.trajectory is not None:
            home = cpu.homes.get(a.trajectory)
            if home is not None:
                return Wait("cores", f"{lo} free core(s) on its session's node {cpu.nodes[home].name} "
                                     f"({cpu.nfree(home)} free)")
            need = view.costs.session_mem_gb
            most_mem = max(cpu.free_mem, default=0.0)
            if most_mem < need:
                return Wait("session-memory",
                            f"memory for a new session: {need * 1024:.0f} MB needed, at most "
                            f"{max(0.0, most_mem) * 1024:.0f} MB free on a node ({len(cpu.homes)} sessions hold "
                            f"{cpu.session_reserved_gb() * 1024:.0f} MB)")
        if most_free < lo:
            return Wait("cores", f"{lo} free core(s) on one node (at most {most_free} free, {len(view.running)} "
                                 "actions running)")
        return Wait("turn", f"its turn: {lo} core(s) are free but actions ahead of it come first")
    if a.pool == GPU:
        g = a.demand.min(GPU)
        if g > view.gpu.max_island:
            return Wait("gpu-node", f"a GPU node to join with {g} GPU(s) in one island for model "
                                    f"{a.model or a.service!r} ({view.gpu.capacity} GPUs now, at most "
                                    f"{view.gpu.max_island} in an island)")
        return Wait("gpus", f"{g} GPU(s) for model {a.model or a.service!r} ({view.gpu.total_free} GPUs free)")
    quota = view.quotas.get(a.pool)
    if quota is not None:
        refill = quota.next_token_at(now)
        return Wait("quota", f"quota {a.pool}: {quota.in_use} of {quota.quota.concurrency} calls in flight, "
                             f"{quota.tokens_at(now):.1f} tokens", refill if refill > now else None)
    return Wait("capacity", f"capacity in pool {a.pool}")


class Policy(Protocol):
    """A scheduling policy; see ``TangramPolicy`` for the reference implementation.

    Optional: ``on_cluster_change(now) -> Iterable[Decision]``, called when nodes or model
    services join or leave while the engine runs (``Engine.add_gpu_node`` and its kin); a policy
    without it plans its partitions once, at ``bind``."""

    name: str

    def bind(self, view: EngineView, now: float) -> Iterable[Decision]:
        """Called once when the engine starts; may reserve partitions."""
        ...

    def on_submit(self, action: Action, now: float) -> None: ...

    def on_cancel(self, action: Action) -> None: ...

    def on_finish(self, finished: Finished) -> None: ...

    def on_trajectory_end(self, job: str, step: int | None, trajectory: str) -> None: ...

    def schedule(self, now: float) -> Iterable[Decision]: ...

    def next_wakeup(self, now: float) -> float | None:
        """When to call ``schedule`` again even if nothing happens (a quota refilling), or None."""
        ...

    def why_waiting(self, action: Action, now: float) -> Wait:
        """Why the queued ``action`` has not started (``pool_wait`` is what the pools lack; a
        policy's own reasons come first). Read for the head of the queue and for an action that
        waited past ``max_queue_s``, never in a round."""
        ...
