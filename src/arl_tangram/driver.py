"""Decide, then schedule the next wake-up: the loop the simulator and every runtime share.

After anything changes (an action submitted, a manager's report, a timer), the owner of the event
loop calls ``tick``: one scheduling round, then, if the policy wants to be asked again at a later
time even when nothing happens (a quota's next token), the wake-up is armed through the ``arm``
callback the owner gave (a virtual-time event in the simulator, ``loop.call_later`` in a runtime).
A wake-up later than one already armed is not armed again: the earlier one will re-ask.

It is pure like the engine: no clock of its own, no asyncio. (The first release had this logic
twice, in the simulator's event loop and in the local runtime, with slightly different rules.)
"""

from __future__ import annotations

from typing import Callable

from .core.pools import EPS
from .engine import Engine


class Driver:
    """Runs scheduling rounds of ``engine`` and keeps one wake-up armed."""

    __slots__ = ("engine", "arm", "armed_at")

    def __init__(self, engine: Engine, arm: Callable[[float], None]) -> None:
        self.engine = engine
        self.arm = arm
        self.armed_at: float | None = None

    def tick(self) -> int:
        """One round; returns how many actions it started."""
        engine = self.engine
        started = engine.schedule()
        now = engine.clock.now()
        # On a real clock time moves during the round: a queue deadline that fell due meanwhile
        # would be neither expired nor armed (it is not in the future), and would wait for an
        # unrelated event (found by ``tangram bench sessions``). Each extra round expires it.
        while (deadline := engine.next_deadline()) is not None and deadline <= now + EPS:
            started += engine.schedule()
            now = engine.clock.now()
        wake = engine.next_wakeup()
        if wake is not None and wake > now + EPS and (self.armed_at is None or self.armed_at <= now
                                                      or wake < self.armed_at):
            self.armed_at = wake
            self.arm(wake)
        return started
