"""The seam between the engine and a scheduling policy.

A policy only decides. It reads the engine's state through ``EngineView`` and yields decisions as
data; the engine applies each one (so the next decision sees its effect) and hands started actions
to the managers once the round is over. Nothing here touches a clock, a thread or a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

from mypy_extensions import mypyc_attr

from ..core.action import Action, Finished, by_fields
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


Decision = Start | Grow | Prefetch | Evict | Reserve | Release


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
        step's work; charging it here as well made replays of real runs ~50% slow (was 10 ms
        create, 1 ms thaw)."""
        return cls(session_create_s=0.0005, session_thaw_s=0.0002, session_restore_s=0.01,
                   session_mem_gb=session_mem_gb)


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
