"""The engine's records of what holds units right now: running actions, static reservations and
model copies being loaded. The engine writes them; policies read them through ``EngineView``."""

from __future__ import annotations

from dataclasses import dataclass

from .action import Action, Allocation
from .pools import CapacityError, Instance


@dataclass(slots=True, eq=False)
class Running:
    """A started action: where it runs and, on GPUs, the model copy it uses."""

    action: Action
    allocation: Allocation
    started_at: float
    instance: Instance | None = None


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
