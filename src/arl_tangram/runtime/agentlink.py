"""The link between a Ray head and a node's agent: every action's call and answer, one frame each.

Ray places the agents (an actor pinned to each node), tells the head of joins and deaths, and
carries what is large or rare (a start, a take-over, a session's move through the object store,
pulls, prewarms). What every action does, its start and its answer, crosses a ``link.py``
connection instead, one per node, opened when the node joins: the agent listens on its node's
address (the one Ray knows it by), the head connects with a token it handed the agent over Ray
(``NodeAgent.open_link``). A Ray actor call costs the head ~3 ms of CPU on the 2-core VM (its
Python side, its C++ threads, a task and four loop passes around it) where a frame costs a pickle
and a write, and the frames of one loop pass leave in one write (``docs/scale.md``).

The agent's end (``Served``) answers a run from its sandbox manager's report itself (no task, no
future, unless the run must first wait for a run an earlier head left: ``NodeAgent.run_linked``).
A one-shot queued behind another on its node's cores is sent ahead (``follow``: the lease, as with
sandbox workers on one machine), and the agent starts it the moment the first one's sandbox
answers, before the head has heard of that end: a core idles for no round trip to the head.
Its lease is renewed by the same connection's looks (``look``). The link is its head's alone: a
head that takes the agent over (``attach``) gets a new one and the old one is closed, so a head
that was replaced hears it as its link closing, which it treats as the node lost, as it does an
agent that died.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Callable

from ..core.action import Action, Allocation
from ..link import Caller, Hub

log = logging.getLogger(__name__)

#: what the head calls over the link; everything else goes through Ray
CALLS = frozenset({"run", "follow", "cancel", "resize", "close_session", "look"})


def new_token() -> bytes:
    """A link's token: what the connecting end sends before anything is read from it."""
    return secrets.token_bytes(32)


class Served:
    """The agent's calls, as the link serves them (``link.Hub``); ``agent`` is a ``NodeAgent``
    (not imported: the agent imports this module)."""

    REPLIES = frozenset({"run", "follow"})  # answered through the hub's reply callback: no task per run

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def run(self, action: Action, allocation: Allocation, reply: Callable[[bool, Any], None]) -> None:
        self.agent.run_linked(action, allocation, reply)

    def follow(self, action: Action, allocation: Allocation, after: str, reply: Callable[[bool, Any], None]) -> None:
        """Start ``action`` on the cores of ``after`` the moment ``after``'s sandbox answers (the
        lease, as a sandbox worker's: ``SandboxManager.start``); at once if it has. A second
        follower of one run is the head's bug: refused."""
        try:
            self.agent.follow_linked(action, allocation, after, reply)
        except RuntimeError as e:
            reply(False, e)

    def cancel(self, action_id: str) -> None:
        self.agent.cancel(action_id)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        self.agent.resize(action_id, allocation)

    def close_session(self, trajectory: str) -> None:
        self.agent.close_session(trajectory)

    async def look(self, lease_s: float, images_seen: object = None) -> tuple[list[str], dict]:
        return await self.agent.look(lease_s, images_seen)


async def serve(agent: Any, host: str, token: bytes) -> tuple[Hub, int]:
    """The agent's end, listening on ``host`` (any free port): the hub and its port."""
    hub = Hub(Served(agent), CALLS)
    port = await hub.listen_tcp(host, token)
    return hub, port


async def connect(host: str, port: int, token: bytes, on_lost: Callable[[], None], peer: str) -> Caller:
    """The head's end, connected; ``on_lost`` is called once if the agent's end closes."""
    caller = Caller(on_lost=on_lost, peer=peer)
    await caller.connect_tcp(host, port, token)
    return caller


def ignore(ok: bool, value: Any) -> None:
    """The answer of a call made for its effect (cancel, resize, close): a failure is logged."""
    if not ok and not isinstance(value, ConnectionError):
        log.warning("a call to a node's agent failed: %s: %s", type(value).__name__, value)
