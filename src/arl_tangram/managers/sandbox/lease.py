"""The lease on a core: one-shots queued behind a running one on the same cores.

The engine may start a one-shot ``after`` another on its cores (``SandboxManager.start``): the
follower takes and prepares its sandbox at once, and its request is written the moment the run
before it answers (``sandbox.Turn``), or once that run ends without an answer. ``Lease`` keeps each
core's queue of runs whose sandbox has not answered yet.
"""

from __future__ import annotations

from typing import Callable

from .sandbox import Turn


class Unanswered:
    """An action started here whose sandbox has not answered yet, in its core's queue: the turn
    it waits for (None: none, it ran at once) and the action it waits for, and its follower."""

    __slots__ = ("turn", "before", "next", "done")

    def __init__(self) -> None:
        self.done = False  # its sandbox answered, or it ended (``Lease.over``)
        self.turn: Turn | None = None
        self.before: Unanswered | None = None
        self.next: Unanswered | None = None


class Lease:
    """The runs whose sandbox has not answered yet, each with the one queued behind it.
    ``changed()`` is called when a follower leaves (the pool's refill counts the sandboxes
    followers hold)."""

    def __init__(self, changed: Callable[[], None] = lambda: None) -> None:
        self.unanswered: dict[str, Unanswered] = {}
        self.followers = 0  # followers whose turn has not come: each holds a sandbox, soon reset
        self._changed = changed

    def join(self, action_id: str, after: str | None) -> Unanswered:
        """``action_id`` starts, behind ``after`` if that one has not answered yet. A second
        follower of one action would share its cores: refused (``RuntimeError``)."""
        mine = Unanswered()
        before = self.unanswered.get(after) if after is not None else None
        if before is not None:
            if before.next is not None:
                raise RuntimeError(f"{after} already has a follower here")
            mine.turn, mine.before, before.next = Turn(), before, mine
            self.followers += 1
        self.unanswered[action_id] = mine
        return mine

    def over(self, action_id: str, mine: Unanswered) -> None:
        """``action_id``'s sandbox answered, or it ended: its follower's turn. One that ended
        before its own turn came never ran: it leaves its place in the queue to what followed it,
        which waits for what it waited for (else it would share that run's cores)."""
        if mine.done:
            return  # told already
        mine.done = True
        if self.unanswered.get(action_id) is mine:  # else a run of the same id since is another's
            del self.unanswered[action_id]
        self._changed()  # a follower fewer, so the refill looks again
        if mine.turn is not None and not mine.turn.opened:
            self.followers -= 1
            before, after = mine.before, mine.next
            assert before is not None
            before.next = after
            if after is not None:
                after.before = before
        elif mine.next is not None:
            self.followers -= 1
            mine.next.before = None
            mine.next.turn.open()

    def cancel(self, action_id: str) -> None:
        """``action_id`` is cancelled: if it still waits for its turn, its place goes now (the
        engine may queue another there at once)."""
        mine = self.unanswered.get(action_id)
        if mine is not None and mine.turn is not None and not mine.turn.opened:
            self.over(action_id, mine)
