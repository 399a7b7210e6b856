"""The seam between the engine and the managers that carry its decisions out.

Shaped like vLLM v1's split of scheduler and executor: the engine decides and hands each started
action to the manager of its pool; a manager runs it (a sandbox, a model copy on a GPU, an API
call, or a simulation of one) and reports back one typed record to a sink it was given when it was
built. Nothing here knows about asyncio, processes or sockets.

The sink is given at construction, so the order of wiring does not matter and the record's shape
is a type; managers are keyed by ``Pool``, so the engine has no special case for API quotas.
"""

from __future__ import annotations

import enum
from typing import Callable, Protocol, runtime_checkable

from .action import API_PREFIX, CPU, GPU, Action, Allocation
from .records import Completion, Load, Loaded

__all__ = ["Chainer", "Completion", "Loaded", "Load", "Manager", "ModelHost", "Pool", "Report", "Resizer", "Sink"]


class Pool(str, enum.Enum):
    """Which manager carries an action out: sandboxes (cores), model services (GPUs) or APIs."""

    CPU = CPU
    GPU = GPU
    API = "api"

    @classmethod
    def of(cls, pool: str) -> "Pool":
        """The manager pool of an action's ``pool`` (``cpu``, ``gpu`` or ``api:<name>``)."""
        found = _POOL_OF.get(pool)
        if found is not None:
            return found
        if pool.startswith(API_PREFIX):
            _POOL_OF[pool] = cls.API  # on the engine's hot path: remembered
            return cls.API
        raise ValueError(f"no manager pool for {pool!r}")


_POOL_OF: dict[str, Pool] = {CPU: Pool.CPU, GPU: Pool.GPU}


# The two reports are defined with the engine's other records (``core.records``, compiled with
# it: ``setup.py``; this module's runtime-checkable protocols cannot be) and are part of this seam.
Report = Completion | Loaded
Sink = Callable[[Report], None]


@runtime_checkable
class Manager(Protocol):
    """What every manager does. Built with a ``Sink``; reports each started action's end there
    exactly once, never from inside ``start`` (the engine is mid-round then)."""

    def start(self, action: Action, allocation: Allocation) -> None:
        """Begin running ``action`` on ``allocation``."""
        ...

    def cancel(self, action_id: str) -> None:
        """Stop a running action; it still reports a ``Completion`` (``cancelled``) to the sink.
        Unknown or finished ids are ignored."""
        ...

    def close_session(self, trajectory: str) -> None:
        """The trajectory will send no more actions: drop its state."""
        ...

    async def start_up(self) -> None:
        """Get ready before the first action (sandboxes, pools, connections): a runtime awaits it
        for each of its managers when it starts. The engine never calls it (nor the simulator,
        whose managers have nothing to start)."""
        ...

    async def shut_down(self) -> None:
        """Stop everything this manager started: a runtime awaits it for each manager when it
        closes, after cancelling what was queued. Nothing is reported after it returns."""
        ...


@runtime_checkable
class ModelHost(Manager, Protocol):
    """What only GPU managers do: copy weights onto GPUs before anyone asks, and drop a copy that
    has been idle too long (evictions that make room travel in ``Allocation.evict`` of the action
    that needs it)."""

    def prefetch(self, load: Load) -> None:
        """Copy ``load.model`` onto ``load.block``; report ``Loaded(load.key)`` when resident."""
        ...

    def evict(self, model: str, gpus: tuple[int, ...]) -> None:
        """Drop the idle copy of ``model`` on ``gpus`` (scale to zero; no report follows)."""
        ...


@runtime_checkable
class Resizer(Protocol):
    """What a CPU manager does when it can take cores back from a running action (a sandbox's
    cgroup cpuset shrinks while its processes run; a simulated run slows down). The engine sends
    ``Shrink`` decisions only to such a manager; with any other, grown actions keep their cores
    until they end."""

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """From now on the running ``action_id`` has only ``allocation.units`` (a subset of the
        units it had): stop using the others before returning, since the engine hands them to
        the next starts right after. Unknown or finished ids are ignored."""
        ...


@runtime_checkable
class Chainer(Protocol):
    """What a CPU manager does when it can start an action the moment another one ends, without
    waiting to hear from the engine (the lease: between two one-shots on a core, the round trip to
    the engine and back leaves the core idle, a fifth of 16 cores' time). The engine sends ``Follow``
    decisions only to such a manager; the cores stay the running action's in the engine's ledger
    until its ``Completion`` arrives, and pass to the follower then, unreleased."""

    def chains(self, action: Action) -> bool:
        """Whether a run of ``action``, started now, could take a follower (the engine lists only
        those as followable): a question about where it would run, answered without effects."""
        ...

    def follow(self, action: Action, allocation: Allocation, after: str) -> bool:
        """Start ``action`` on ``allocation`` (the cores of the running ``after``) as soon as
        ``after`` ends, or at once if it has ended already. False: not taken (``after`` does not
        run here, say); the engine then starts it itself when ``after``'s report arrives. Either
        way ``action`` ends in exactly one ``Completion``, which may come before ``after``'s when
        it is cancelled or its runner is lost."""
        ...
