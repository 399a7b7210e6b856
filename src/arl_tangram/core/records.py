"""The engine's records of what holds units right now: running actions, static reservations and
model copies being loaded. The engine writes them; policies read them through ``EngineView``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mypy_extensions import mypyc_attr

from .action import Action, Allocation, Outcome, by_fields
from .pools import CapacityError, Instance


@mypyc_attr(free_list_len=1)
@dataclass(init=False, eq=False)  # ``__init__`` written out: ``action.by_fields``
class Running:
    """A started action: where it runs and, on GPUs, the model copy it uses."""

    action: Action
    allocation: Allocation
    started_at: float
    instance: Instance | None

    def __init__(self, action: Action, allocation: Allocation, started_at: float,
                 instance: Instance | None = None) -> None:
        self.action = action
        self.allocation = allocation
        self.started_at = started_at
        self.instance = instance

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)


@dataclass(slots=True, eq=False)
class Reservation:
    """Units set aside for one owner (a trajectory's sandbox, a service's GPU partition);
    ``free`` are those of ``units`` no action of the owner is using now."""

    key: str
    pool: str
    node: int
    units: tuple[int, ...]
    free: list[int]
    started_at: float

    def draw(self, count: int) -> tuple[int, ...]:
        if count > len(self.free):
            raise CapacityError(f"reservation {self.key} has {len(self.free)} free units, {count} asked")
        units = tuple(self.free[len(self.free) - count:])
        del self.free[len(self.free) - count:]
        return units

    def put_back(self, units: tuple[int, ...]) -> None:
        self.free.extend(units)

    @property
    def in_use(self) -> bool:
        return len(self.free) != len(self.units)


@dataclass(frozen=True, slots=True)
class Load:
    """A prefetch in flight: ``model``'s weights being copied onto the GPUs of ``block`` (``key``
    names it in the ``Loaded`` report that ends it)."""

    key: str
    model: str
    block: tuple[int, ...]
    per_gpu_gb: float
    instance: Instance

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@mypyc_attr(free_list_len=1)
@dataclass(init=False)  # one per action: ``__init__`` written out (``action.by_fields`` says why)
class Completion:
    """A manager's report that a started action ended (``core.seam``): its outcome, the seconds of
    state work (``setup_s``) and of execution, a message explaining anything unusual, and what it
    produced (``result``). ``session_mem_gb``: memory the action's session was measured to use
    once it went idle (GB; cgroup usage or RSS), None when not measured (one-shot actions,
    simulated managers); the engine reserves that plus headroom for the idle session instead of
    its estimate."""

    action_id: str
    outcome: Outcome
    setup_s: float
    exec_s: float
    message: str
    result: Any
    session_mem_gb: float | None

    def __init__(self, action_id: str, outcome: Outcome, setup_s: float = 0.0, exec_s: float = 0.0,
                 message: str = "", result: Any = None, session_mem_gb: float | None = None) -> None:
        self.action_id = action_id
        self.outcome = outcome
        self.setup_s = setup_s
        self.exec_s = exec_s
        self.message = message
        self.result = result
        self.session_mem_gb = session_mem_gb

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)


@dataclass(frozen=True, slots=True)
class Loaded:
    """A manager's report that a prefetch finished: the copy named ``key`` is resident and idle."""

    key: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails
