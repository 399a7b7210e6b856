"""Issue 24: the head restarts, sessions stay. A node agent outlives its head (a lease the head
renews); a restarted head takes it over and re-attaches the journal's sessions it holds. The
agent's side in process; the whole of it on a loopback Ray cluster with `tangram serve --ray`
killed with -9 and started again."""

from __future__ import annotations

import asyncio
import inspect
import shutil
import signal
import threading
import time
import types

import httpx
import pytest

from arl_tangram.core import Action, Allocation, Outcome
from arl_tangram.managers.sandbox.spec import Exec, RunCode, SandboxConfig

from raycluster import loopback_cluster

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _step(agent, aid, traj, cell):
    """A python cell in the session's interpreter (its variables live on between steps)."""
    return agent.run(Action(aid, "sandbox", trajectory=traj, payload=Exec(python=cell, timeout_s=60)),
                     Allocation("cpu", 0, (0,)))


@needs_bwrap
def test_an_agent_taken_over_keeps_its_sessions_and_cancels_the_dead_heads_runs():
    from arl_tangram.runtime.agent import HeldElsewhere, NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=0))
        await agent.start(30.0)  # the first head's lease
        try:
            for t in ("kept", "orphan"):
                assert (await _step(agent, f"{t}-1", t, "x = 41")).outcome is Outcome.OK
            shot = asyncio.ensure_future(agent.run(Action("shot", "sandbox", payload=RunCode(
                "import time; time.sleep(30)")), Allocation("cpu", 0, (0,))))
            step = asyncio.ensure_future(_step(agent, "slow", "kept", "import time; time.sleep(5); x = 41"))
            await asyncio.sleep(0.5)
            with pytest.raises(HeldElsewhere, match="another head"):  # a second head on the cluster
                await agent.attach(30.0, "another head")
            info = await agent.attach(30.0)  # the head restarted: the old one awaits these no more
            cut = await asyncio.wait_for(shot, 20)
            closed = agent.keep(["kept"])
            t0 = time.monotonic()
            after = await _step(agent, "kept-2", "kept", "print(x + 1)")  # waits for "slow" to end
            waited = time.monotonic() - t0
            return info, cut, closed, after, waited, agent.sessions(), step.done()
        finally:
            await agent.shut_down()

    info, cut, closed, after, waited, held, old_answered = asyncio.run(main())
    assert info["sandboxes"] and sorted(info["sessions"]) == ["kept", "orphan"] and info["cancelled"] == ["shot"]
    assert cut.outcome is Outcome.CANCELLED  # a one-shot: the new head's journal re-runs it
    assert closed == ["orphan"] and held == ["kept"]
    # the step in flight ran to its end (its answer went nowhere) and the next one waited for it
    assert after.outcome is Outcome.OK and after.result.run.stdout == "42\n", after
    assert waited >= 0.5 and not old_answered  # (the slow step's 5 s leave ~4 after the attaches, on a loaded host)


@needs_bwrap
def test_an_agent_whose_lease_runs_out_closes_everything_and_cannot_be_taken_over():
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=0))
        await agent.start(60.0)
        try:
            assert (await _step(agent, "a", "t", "print(1)")).outcome is Outcome.OK
            running = asyncio.ensure_future(_step(agent, "b", "t2", "import time; time.sleep(30)"))
            await agent.take_expired(0.5)  # the head's last renewal (short: a step under load outlived 0.5 s)
            deadline = time.monotonic() + 20
            while not agent.orphaned and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            ended = await asyncio.wait_for(running, 20)
            return agent.orphaned, agent.sessions(), ended, await agent.attach(30.0)
        finally:
            await agent.shut_down()

    orphaned, held, ended, taken = asyncio.run(main())
    assert orphaned and held == [] and taken is None
    assert ended.outcome is Outcome.CANCELLED


class InProcess:
    """A test double of a Ray actor handle at the head's seam: ``handle.method.remote(*args)``
    calls the agent itself, in this event loop (what Ray does across processes)."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def __getattr__(self, name):
        method = getattr(self.agent, name)

        async def call(*args):
            out = method(*args)
            return await out if inspect.isawaitable(out) else out

        return types.SimpleNamespace(remote=lambda *args: call(*args))


class Hung:
    """An agent Ray still lists alive whose event loop hangs: no call of it ever answers."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name):
        def remote(*args):
            self.calls += 1
            return asyncio.get_running_loop().create_future()  # never resolved

        return types.SimpleNamespace(remote=remote)


def test_an_agent_s_lease_runs_from_the_end_of_its_start():
    """H3: a start longer than the lease (a GPU agent loading weights) does not orphan the agent
    in its own start, the head renewing it meanwhile or not; once started, the lease runs."""
    from arl_tangram.runtime.agent import NodeAgent

    class SlowStart(NodeAgent):
        async def _start_sandboxes(self):  # stands for ModelManager.load_all of big weights
            await asyncio.sleep(1.0)
            return {"name": self.name, "sandboxes": False, "problem": "no cores for sandboxes"}

    async def main():
        agent = SlowStart("n0", 1, sandboxes=False)
        start = asyncio.ensure_future(agent.start(0.3, "head"))
        await asyncio.sleep(0.1)
        await agent.take_expired(0.3, "head")  # the head renews a starting agent
        info = await start
        orphaned_in_start = agent.orphaned
        taken = await agent.attach(0.3, "head")  # the head restarted: it takes its agent over
        deadline = time.monotonic() + 20  # no renewal any more: the lease runs out
        while not agent.orphaned and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await agent.shut_down()
        return info, orphaned_in_start, taken, agent.orphaned

    info, orphaned_in_start, taken, orphaned_later = asyncio.run(main())
    assert info["name"] == "n0" and not orphaned_in_start
    assert taken is not None and taken["sessions"] == []
    assert orphaned_later


@needs_bwrap
def test_a_re_run_of_a_one_shot_attach_cancelled_gets_its_own_result():
    """M1: the new head's journal re-runs a one-shot ``attach`` cancelled, with the same id, at
    once: after ``attach`` returned, or while it still runs. Each re-run gets its own result; the
    dead head's call got ``cancelled``; nothing is left tracked."""
    from arl_tangram.runtime.agent import NodeAgent

    def shot(aid, code):
        return Action(aid, "sandbox", payload=RunCode(code))

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=0))
        await agent.start(30.0, "head")
        try:
            firsts = [asyncio.ensure_future(agent.run(shot(a, "import time; time.sleep(30)"), Allocation("cpu", 0, (0,))))
                      for a in ("after", "during")]
            await asyncio.sleep(1.0)
            attach = asyncio.ensure_future(agent.attach(30.0, "head"))
            await asyncio.sleep(0)  # attach cancelled both and waits for them to end
            during = await agent.run(shot("during", "print('during')"), Allocation("cpu", 0, (0,)), "head")
            info = await attach
            after = await agent.run(shot("after", "print('after')"), Allocation("cpu", 0, (0,)), "head")
            olds = [await asyncio.wait_for(f, 20) for f in firsts]
            return info, during, after, olds, dict(agent.manager.tasks.actions), dict(agent._waiting)
        finally:
            await agent.shut_down()

    info, during, after, olds, tracked, waiting = asyncio.run(main())
    assert info["cancelled"] == ["after", "during"]
    assert during.outcome is Outcome.OK and during.result.run.stdout == "during\n", during
    assert after.outcome is Outcome.OK and after.result.run.stdout == "after\n", after
    assert [o.outcome for o in olds] == [Outcome.CANCELLED, Outcome.CANCELLED]
    assert tracked == {} and waiting == {}


@needs_bwrap
def test_a_second_attach_leaves_no_step_waiting_forever():
    """L3: a head takes the agent over while a dead head's step runs; that head's next step waits
    for it; then another head takes over. The waiting step never runs (its head is gone), and ends;
    the newest head's step runs after the first one ended, state intact."""
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=0))
        await agent.start(30.0, "head")
        try:
            assert (await _step(agent, "s0", "t", "x = 1")).outcome is Outcome.OK
            asyncio.ensure_future(_step(agent, "s1", "t", "import time; time.sleep(2); x = 2"))
            await asyncio.sleep(0.5)
            await agent.attach(30.0, "head")  # the head restarted
            waiting = asyncio.ensure_future(_step(agent, "s2", "t", "x = 3"))  # waits for s1
            await asyncio.sleep(0.2)
            await agent.attach(30.0, "head")  # ... and restarted again
            last = await asyncio.wait_for(_step(agent, "s3", "t", "print(x)"), 30)
            stuck = await asyncio.wait_for(waiting, 30)
            return stuck, last, dict(agent._leftover)
        finally:
            await agent.shut_down()

    stuck, last, leftover = asyncio.run(main())
    assert stuck.outcome is Outcome.CANCELLED and "taken over" in stuck.message, stuck
    assert last.outcome is Outcome.OK and last.result.run.stdout == "2\n", last
    assert leftover == {}


def test_a_head_is_an_id_kept_in_its_journal(tmp_path, monkeypatch):
    """M2: the owner a head tells its agents is a UUID stored in its journal file: the same file
    names the same head across restarts; another file (another host's default path) another head.
    A journal written before the id existed keeps its rows and gets one."""
    import sqlite3

    from arl_tangram.runtime import ray_runtime
    from arl_tangram.server.config import ServeConfig, build_service
    from arl_tangram.server.journal import Journal, journal_owner

    a, b, old = (str(tmp_path / f"{n}.sqlite3") for n in ("a", "b", "old"))
    first = journal_owner(a)
    j = Journal(a)
    assert j.owner == first
    j.close()
    assert journal_owner(a) == first and journal_owner(b) != first
    db = sqlite3.connect(old)  # the tables of a journal before the id
    db.execute("""CREATE TABLE actions (id TEXT PRIMARY KEY, job TEXT NOT NULL, kind TEXT NOT NULL,
        request TEXT NOT NULL, state TEXT NOT NULL, outcome TEXT, response TEXT, safe INTEGER NOT NULL,
        accepted_at REAL NOT NULL, finished_at REAL)""")
    db.execute("INSERT INTO actions VALUES ('x', 'j', 'run_code', '{}', 'accepted', NULL, NULL, 1, 1.0, NULL)")
    db.commit()
    db.close()
    j = Journal(old)
    try:
        assert [e.id for e in j.unfinished()] == ["x"] and len(j.owner) == 32 and journal_owner(old) == j.owner
    finally:
        j.close()

    told = {}

    class Stop(Exception):
        pass

    def runtime(*args, **kwargs):  # the RayRuntime build_service makes, stopped once told its owner
        told.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray_runtime, "RayRuntime", runtime)
    with pytest.raises(Stop):
        build_service(ServeConfig(), tmp_path / "a.sqlite3", ray="auto")
    assert told["owner"] == f"tangram serve {first}"


def test_a_head_whose_agent_another_took_over_is_told_and_counts_the_node_lost():
    """M2: an agent whose loop hung past its lease is taken over by another head; the calls of the
    head it had answer ``Replaced`` (every call that acts for a head: review L2, only renewal, run and
    keep checked), and that head's look says the node is lost; the new head's same calls pass."""
    from arl_tangram.runtime.agent import NodeAgent, Replaced
    from arl_tangram.runtime.ray_nodes import Node, look_at_agents

    async def main():
        agent = NodeAgent("n0", 1, sandboxes=False)
        await agent.start(0.3, "head A")
        time.sleep(0.5)  # the agent's event loop hangs past A's lease; head B attaches first
        taken = await agent.attach(60.0, "head B")
        calls = {
            "take_expired": lambda h: agent.take_expired(60.0, h), "keep": lambda h: agent.keep([], h),
            "run": lambda h: agent.run(Action("a", "sandbox", payload=RunCode("1")), Allocation("cpu", 0, (0,)), h),
            "cancel": lambda h: agent.cancel("a", h), "resize": lambda h: agent.resize("a", Allocation("cpu", 0, (0,)), h),
            "close_session": lambda h: agent.close_session("t", h), "evict": lambda h: agent.evict("m", (0,), h),
            "prefetch": lambda h: agent.prefetch("k", "m", (0,), 1.0, h),
            "export_session": lambda h: agent.export_session("t", h),
            "import_session": lambda h: agent.import_session("t", None, h)}
        refused = []
        for name, call in calls.items():
            with pytest.raises(Replaced, match="taken over by another head"):
                out = call("head A")
                if inspect.isawaitable(out):
                    await out
            refused.append(name)
        for name in ("cancel", "resize", "close_session", "evict", "export_session", "import_session"):
            out = calls[name]("head B")  # the new head's own: nothing here to act on, and no refusal
            if inspect.isawaitable(out):
                await out
        node = Node("n0" * 8, "127.0.0.1", 1, 0, handle=InProcess(agent), state="alive")
        (look,) = await look_at_agents([node], 60.0, "head A", 5.0)
        (mine,) = await look_at_agents([node], 60.0, "head B", 5.0)
        await agent.shut_down()
        return taken, refused, look, mine

    taken, refused, look, mine = asyncio.run(main())
    assert taken is not None and refused == ["take_expired", "keep", "run", "cancel", "resize", "close_session",
                                             "evict", "prefetch", "export_session", "import_session"]
    assert look.lost is not None and "taken over by another head (head B)" in look.lost
    assert mine.lost is None


def test_one_hung_agent_holds_up_no_other_s_renewal():
    """M3: the head renews every agent at once, each under a timeout: an agent whose loop hangs
    stalls no other's lease; it gets one call, not one per look, and once it has not answered for a
    lease it is lost."""
    from arl_tangram.runtime.agent import NodeAgent
    from arl_tangram.runtime.ray_nodes import Node, look_at_agents

    async def main():
        agent = NodeAgent("n0", 1, sandboxes=False)
        await agent.start(1.0, "head")
        hung = Hung()
        live = Node("a" * 24, "127.0.0.1", 1, 0, handle=InProcess(agent), state="alive", renewed_at=time.monotonic())
        stuck = Node("b" * 24, "127.0.0.1", 1, 0, handle=hung, state="alive", renewed_at=time.monotonic())
        lost = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:  # three leases
            looks = await asyncio.wait_for(look_at_agents([stuck, live], 1.0, "head", 0.1), 10)
            assert looks[1].lost is None
            lost = lost or looks[0].lost
            await asyncio.sleep(0.1)
        await agent.shut_down()
        return agent.orphaned, hung.calls, lost

    orphaned, calls, lost = asyncio.run(main())
    assert not orphaned
    assert calls == 1
    assert lost is not None and "has not answered" in lost


# -- the whole of it: `tangram serve --ray` killed with -9 and started again ----------------------

@pytest.fixture
def cluster():
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    with loopback_cluster({"num_cpus": 2}, {"num_cpus": 2}) as (c, _):
        yield c


def _until(what, timeout_s: float = 30.0) -> None:
    """Polls ``what()`` until it holds: a loaded host may take longer than any fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"{what.__doc__ or what} did not happen in {timeout_s} s"
        time.sleep(0.1)


def _session_state(journal, sid) -> str | None:
    """A session's state as the journal has it committed (None before its row)."""
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        row = db.execute("SELECT state FROM sessions WHERE id=?", (sid,)).fetchone()
        return row[0] if row else None
    except sqlite3.Error:
        return None
    finally:
        db.close()


def _exec(url, sid, **body):
    r = httpx.post(f"{url}/v1/sessions/{sid}/exec", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.ray
@pytest.mark.slow
@needs_bwrap
def test_serve_with_ray_killed_and_restarted_keeps_every_session(cluster, tmp_path):
    """Sessions with files and Python state, the head killed with -9 and started again on the same
    journal and cluster: every session's next step sees its files and its variables; the one
    whose step was in flight keeps them too (that step ran to its end; its answer was lost)."""
    from servers import Server

    journal = tmp_path / "journal.sqlite3"

    def serve() -> Server:
        return Server(tmp_path, journal=journal, config={"lease_s": 60}, args=("--ray", cluster.address),
                      start_timeout_s=90)

    head = serve()
    url = head.url
    sids = [httpx.post(f"{url}/v1/sessions", json={"job": "j"}).json()["session_id"] for _ in range(4)]
    for i, sid in enumerate(sids):
        assert _exec(url, sid, command=f"echo file{i} > f")["outcome"] == "ok"
        assert _exec(url, sid, python=f"x = {i}")["outcome"] == "ok"
    nodes = httpx.get(f"{url}/v1/cluster").json()["nodes"]
    assert sum(n["sessions"] for n in nodes) == 4
    def in_flight():
        try:
            httpx.post(f"{url}/v1/sessions/{sids[0]}/exec", json={"python": "import time; time.sleep(3); y = 7",
                                                                  "timeout_s": 30}, timeout=30)
        except httpx.HTTPError:
            pass  # the head dies under it

    step = threading.Thread(target=in_flight)
    step.start()

    def running() -> bool:
        """the step running on a node"""
        return any(n["running"] for n in httpx.get(f"{url}/v1/cluster", timeout=10).json()["nodes"])

    _until(running)
    time.sleep(0.3)  # the head's call on its way to the node's agent; well inside the step's 3 s
    head.stop(signal.SIGKILL)
    step.join()
    t0 = time.monotonic()
    head2 = serve()
    try:
        url2 = head2.url
        started_s = time.monotonic() - t0
        health = httpx.get(f"{url2}/healthz").json()
        assert health["recovered_sessions"] == {"at_rest": 0, "reattached": 4, "lost": 0}, health
        for i, sid in enumerate(sids):
            got = _exec(url2, sid, command="cat f")
            assert got["outcome"] == "ok" and got["run"]["stdout"] == f"file{i}\n", got
            got = _exec(url2, sid, python="print(x)")
            assert got["outcome"] == "ok" and got["run"]["stdout"] == f"{i}\n", got
        got = _exec(url2, sids[0], python="print(y)")  # the step in flight at the kill ran to its end
        assert got["outcome"] == "ok" and got["run"]["stdout"] == "7\n", got
        nodes = httpx.get(f"{url2}/v1/cluster").json()["nodes"]
        assert sum(n["sessions"] for n in nodes) == 4 and all(n["state"] == "alive" for n in nodes)
        fresh = httpx.post(f"{url2}/v1/sessions", json={"job": "j"}).json()["session_id"]
        assert _exec(url2, fresh, command="ls f")["outcome"] == "failed"  # a new session sees nothing of them
    finally:
        head2.stop()
    assert started_s < 90


@pytest.mark.ray
@pytest.mark.slow
@needs_bwrap
def test_agents_whose_head_does_not_come_back_close_everything_and_exit(cluster, tmp_path):
    """The lease runs out with no head: the agents close their sessions and exit (their names
    free), and a later head on the cluster starts new agents and lists the old sessions as lost."""
    import ray

    from arl_tangram.runtime.ray_runtime import agent_name
    from servers import Server

    journal = tmp_path / "journal.sqlite3"
    head = Server(tmp_path, journal=journal, config={"lease_s": 3}, args=("--ray", cluster.address),
                  start_timeout_s=90)
    url = head.url
    sid = httpx.post(f"{url}/v1/sessions", json={"job": "j"}).json()["session_id"]
    assert _exec(url, sid, command="echo gone > f")["outcome"] == "ok"
    ids = [n["id"] for n in httpx.get(f"{url}/v1/cluster").json()["nodes"]]
    head.stop(signal.SIGKILL)
    ray.init(address=cluster.address, namespace="tangram", log_to_driver=False)
    try:
        present = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            present = []
            for i in ids:
                try:
                    ray.get_actor(agent_name(i))
                    present.append(i)
                except ValueError:
                    pass
            if not present:
                break
            time.sleep(0.5)
        assert present == [], "agents outlived their lease"
    finally:
        ray.shutdown()
    head2 = Server(tmp_path, journal=journal, config={"lease_s": 3}, args=("--ray", cluster.address),
                   start_timeout_s=90)
    try:
        health = httpx.get(f"{head2.url}/healthz").json()
        assert health["recovered_sessions"]["lost"] == 1, health
        r = httpx.post(f"{head2.url}/v1/sessions/{sid}/exec", json={"command": "cat f"}, timeout=60)
        assert r.status_code == 404 and "awake" in r.text, r.text
    finally:
        head2.stop()


@pytest.mark.ray
@pytest.mark.slow
@needs_bwrap
def test_a_session_at_rest_on_its_node_is_re_attached_after_a_head_restart(cluster, tmp_path):
    """A session the node's manager put to rest (the journal says so, naming the node): the head
    killed with -9 and started again re-attaches it, and its next step wakes it, state intact."""
    from servers import Server

    journal = tmp_path / "journal.sqlite3"
    config = {"lease_s": 60, "sandbox": {"rest_after_s": 0.5}}

    def serve() -> Server:
        return Server(tmp_path, journal=journal, config=config, args=("--ray", cluster.address), start_timeout_s=90)

    head = serve()
    sid = httpx.post(f"{head.url}/v1/sessions", json={"job": "j"}).json()["session_id"]
    assert _exec(head.url, sid, python="xs = list(range(1000))")["outcome"] == "ok"
    assert _exec(head.url, sid, command="echo rested > f")["outcome"] == "ok"
    # rested on its node after 0.5 s idle; the head hears of it at its next poll and journals it
    _until(lambda: _session_state(journal, sid) == "at_rest")
    head.stop(signal.SIGKILL)
    head2 = serve()
    try:
        health = httpx.get(f"{head2.url}/healthz").json()
        assert health["recovered_sessions"] == {"at_rest": 1, "reattached": 0, "lost": 0}, health
        got = _exec(head2.url, sid, python="print(len(xs), open('f').read().strip())")
        assert got["outcome"] == "ok" and got["run"]["stdout"] == "1000 rested\n", got
    finally:
        head2.stop()


@pytest.mark.ray
@pytest.mark.slow
@needs_bwrap
def test_a_restarted_head_renews_the_agents_it_took_over_while_another_node_still_joins(cluster):
    """H3, the head's side: a restarted head whose other node takes longer than the lease to join
    (a GPU node loading weights) renews the agent it took over meanwhile: that agent keeps its
    session. And M2 over Ray: a call naming another head is answered ``Replaced``."""
    import ray

    from arl_tangram.runtime import Tangram
    from arl_tangram.runtime.agent import Replaced
    from arl_tangram.runtime.ray_runtime import RayRuntime, agent_name

    lease_s = 3.0
    config = SandboxConfig(warm_pool=0, warm_sessions=0)

    async def main():
        first = Tangram.ray(cluster.address, sandbox=config, lease_s=lease_s, owner="head")
        await first.__aenter__()
        s = await first.session()
        assert (await s.exec(python="x = 5")).outcome is Outcome.OK
        home = first.runtime.sandboxes.homes[s.id].ray_id
        first.runtime._monitor.cancel()  # the head dies (its agents live on: never closed)
        second = RayRuntime(cluster.address, sandbox=config, lease_s=lease_s, owner="head")
        join = second._join

        async def slow_join(node):  # the other node joins after three leases
            if node.ray_id != home:
                await asyncio.sleep(3 * lease_s)
            await join(node)

        second._join = slow_join
        await second.start()
        try:
            agent = ray.get_actor(agent_name(home))
            held = await agent.sessions.remote()
            kept = second.adopt_live(s.id, None)
            states = sorted(n["state"] for n in second.nodes())
            try:
                await agent.take_expired.remote(lease_s, "another head")
                refused = None
            except Exception as e:
                refused = e
            return s.id, held, kept, states, refused
        finally:
            await second.close()

    sid, held, kept, states, refused = asyncio.run(main())
    assert held == [sid] and kept and states == ["alive", "alive"]
    assert isinstance(refused, Replaced) and "taken over by another head (head)" in str(refused)


@pytest.mark.ray
@pytest.mark.slow
@needs_bwrap
def test_a_node_lost_while_its_agent_lived_is_taken_back_without_the_sessions_it_lost(cluster):
    """A node the head counted lost while its agent lived on (silent past its lease, say) is found
    again and taken over; the sessions the head ended with it are closed on the agent, not kept."""
    import ray

    from arl_tangram.runtime import Tangram
    from arl_tangram.runtime.ray_runtime import agent_name

    async def main():
        async with Tangram.ray(cluster.address, sandbox=SandboxConfig(warm_pool=0, warm_sessions=0),
                               rejoin_after_s=1.0) as tg:
            rt = tg.runtime
            s = await tg.session()
            assert (await s.exec(python="x = 5")).outcome is Outcome.OK
            node = rt.sandboxes.homes[s.id]
            agent = ray.get_actor(agent_name(node.ray_id))
            rt.node_lost(node, "its agent has not answered for 61 s: its lease ran out")
            lost = next(n for n in rt.nodes() if n["id"] == node.ray_id)
            deadline = time.monotonic() + 60
            while rt.nodes_by_id[node.ray_id] is node and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            again = rt.nodes_by_id[node.ray_id]
            while again.state == "starting" and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the keep the take-over sent
            return lost, again.state, again.adopted, await agent.sessions.remote()

    lost, state, adopted, held = asyncio.run(main())
    assert lost["state"] == "dead" and lost["problem"] == "lost: its agent has not answered for 61 s: its lease ran out"
    assert state == "alive" and adopted and held == []
