"""The head's link to a node's agent (runtime/agentlink.py, link.py over TCP): a token before
anything is read, runs answered over it, a take-over closing it, and a link lost under a run
ending that run as its node lost. The agent in process, the head's end at its seam (``send_run``
with a test double of the runtime)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import shutil
import socket
import struct

import pytest

from arl_tangram.core import Action, Allocation, Outcome
from arl_tangram.link import Caller, Hub
from arl_tangram.managers.sandbox.spec import RunCode, SandboxConfig

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

UNPICKLED: list[str] = []


def _mark(what: str) -> str:
    UNPICKLED.append(what)
    return what


class Hostile:
    """Unpickling this calls ``_mark``: a stand-in for code a pickle would run."""

    def __reduce__(self):
        return _mark, ("unpickled",)


class Echo:
    def echo(self, x):
        return x


def test_a_tcp_link_reads_nothing_from_a_peer_without_its_token():
    async def main():
        token = b"t" * 32
        hub = Hub(Echo(), {"echo"})
        port = await hub.listen_tcp("127.0.0.1", token)
        good = Caller(peer="echo")
        await good.connect_tcp("127.0.0.1", port, token)
        assert await good.call("echo", [1, "two"]) == [1, "two"]
        # a stranger: a wrong token of the right length, then a frame that would run code if read
        frame = pickle.dumps((0, "echo", (Hostile(),)))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * 32 + struct.pack(">I", len(frame)) + frame)
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5)  # EOF: the hub closed it
        # the right token but sent by a caller without one (its first frame is no token)
        bad = Caller(peer="echo")
        await bad.connect_tcp("127.0.0.1", port, b"")
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(bad.call("echo", Hostile()), 5)
        still = await good.call("echo", 3)  # the good caller is untouched by both
        good.close()
        await hub.close()
        return closed, still

    with pytest.raises(ValueError, match="token"):
        asyncio.run(Hub(Echo(), {"echo"}).listen_tcp("127.0.0.1", b"short"))
    closed, still = asyncio.run(main())
    assert closed == b"" and still == 3
    assert UNPICKLED == []


class FakeHead:
    """A test double of the runtime at ``ray_nodes``' seam (``Head``): who it is and which nodes
    it lost."""

    def __init__(self) -> None:
        self.owner = "head"
        self.nodes_by_id = {}
        self.closing = False
        self.lost: list[tuple[str, str]] = []

    def node_lost(self, node, why: str) -> None:
        self.lost.append((node.name, why))
        node.state = "dead"

    def lost_reason(self, session: str, node) -> str:
        return f"session {session} was lost with its node"


@contextlib.asynccontextmanager
async def linked(on_lost=lambda: None, warm_pool: int = 0):
    """A started agent of one core, its link open, and the head's side of it: ``(agent, head,
    node)``; the agent shut down after."""
    from arl_tangram.runtime import agentlink
    from arl_tangram.runtime.agent import NodeAgent
    from arl_tangram.runtime.ray_nodes import Node

    agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=warm_pool, warm_sessions=0))
    await agent.start(60.0, "head")
    try:
        token = agentlink.new_token()
        port = await agent.open_link("127.0.0.1", token, "head")
        node = Node("n1" * 12, "127.0.0.1", 1, 0, state="alive")
        node.link = await agentlink.connect("127.0.0.1", port, token, on_lost, "node n1's agent")
        head = FakeHead()
        head.nodes_by_id[node.ray_id] = node
        yield agent, head, node
    finally:
        await agent.shut_down()


@needs_bwrap
def test_runs_cross_the_link_and_a_link_lost_under_a_run_loses_the_node():
    from arl_tangram.runtime.ray_nodes import NodeLost, cancel_on_nodes, run_on_node, send_run

    async def main():
        closed = asyncio.Event()
        async with linked(closed.set) as (agent, head, node):
            cpu = Allocation("cpu", 0, (0,))
            ok = await run_on_node(head, node, Action("a", "sandbox", payload=RunCode("print(6 * 7)")), cpu)
            expired, news = await node.link.call("look", 60.0, None)  # the lease renewed over the link
            # a cancel over the link ends a run the agent holds
            got: list = []
            send_run(head, node, Action("c", "sandbox", payload=RunCode("import time; time.sleep(30)")), cpu,
                     got.append)
            await asyncio.sleep(0.5)
            cancel_on_nodes(head, "c")
            for _ in range(200):
                if got:
                    break
                await asyncio.sleep(0.05)
            cancelled = got[0]
            # a run in flight when the link closes (a take-over: the agent's end closes it)
            long = asyncio.ensure_future(run_on_node(
                head, node, Action("b", "sandbox", payload=RunCode("import time; time.sleep(30)")), cpu))
            await asyncio.sleep(0.5)
            taken = await agent.attach(60.0, "head")  # a restarted head takes the agent over
            lost = await asyncio.wait_for(long, 10)
            await asyncio.wait_for(closed.wait(), 5)
            after: list = []
            send_run(head, node, Action("d", "sandbox", payload=RunCode("print(1)")), cpu, after.append)
            return ok, expired, news, cancelled, taken, lost, after, node.running

    ok, expired, news, cancelled, taken, lost, after, running = asyncio.run(main())
    assert ok.outcome is Outcome.OK and ok.result.run.stdout == "42\n", ok
    assert expired == [] and "rested" in news
    assert cancelled.outcome is Outcome.CANCELLED, cancelled
    assert taken is not None and taken["cancelled"] == ["b"]
    assert lost.outcome is Outcome.INFRA_ERROR and isinstance(lost.result, NodeLost), lost
    assert after and after[0].outcome is Outcome.INFRA_ERROR and isinstance(after[0].result, NodeLost)
    assert running == set()


@needs_bwrap
def test_a_closing_head_reports_nothing_its_links_drop():
    """Shutting down, the head drops what its closing links end (the journal re-runs those): no
    node counted lost, no completion reported."""
    from arl_tangram.runtime.ray_nodes import send_run

    async def main():
        async with linked() as (agent, head, node):
            got: list = []
            send_run(head, node, Action("b", "sandbox", payload=RunCode("import time; time.sleep(30)")),
                     Allocation("cpu", 0, (0,)), got.append)
            await asyncio.sleep(0.3)
            head.closing = True
            node.link.close()
            await asyncio.sleep(0.3)
            return got, head.lost

    got, lost = asyncio.run(main())
    assert got == [] and lost == []


def test_an_agent_listens_only_where_it_is_told():
    """The agent's end binds the address it is given (its node's, as Ray knows it), not every
    interface."""
    from arl_tangram.runtime import agentlink
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n0", 1, sandboxes=False)
        await agent.start(60.0, "head")
        try:
            port = await agent.open_link("127.0.0.1", agentlink.new_token(), "head")
            bound = [s.getsockname() for s in agent._hub._server.sockets]
            return port, bound
        finally:
            await agent.shut_down()

    port, bound = asyncio.run(main())
    assert bound == [("127.0.0.1", port)]
    with socket.socket() as s:  # closed with the agent
        assert s.connect_ex(("127.0.0.1", port)) != 0


@needs_bwrap
def test_a_one_shot_sent_to_follow_another_starts_on_its_cores_as_that_one_answers():
    """The lease over the link: the follower is at the agent before its predecessor ends and
    starts there as it answers, without a round trip to the head; it reports after it."""
    from arl_tangram.runtime.ray_nodes import send_run

    async def main():
        async with linked(warm_pool=1) as (agent, head, node):
            cpu = Allocation("cpu", 0, (0,))
            ended: list = []
            send_run(head, node, Action("first", "sandbox", payload=RunCode("import time; time.sleep(1); print('a')")),
                     cpu, ended.append)
            send_run(head, node, Action("next", "sandbox", payload=RunCode("print('f')")), cpu, ended.append,
                     after="first")
            for _ in range(400):
                if len(ended) == 2:
                    break
                await asyncio.sleep(0.05)
            return ended

    ended = asyncio.run(main())
    assert [c.action_id for c in ended] == ["first", "next"], ended
    assert all(c.outcome is Outcome.OK for c in ended) and ended[1].result.run.stdout == "f\n"
