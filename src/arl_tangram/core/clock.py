"""Time as a dependency: the engine and policy never read the wall clock themselves."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """Anything that tells the current time in seconds (monotonic, arbitrary origin)."""

    def now(self) -> float: ...


class ManualClock:
    """A clock that moves only when told to; the simulator's virtual time and tests use it."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance_to(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"time cannot go backwards: {t} < {self._t}")
        self._t = t
