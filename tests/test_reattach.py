"""Issue 24: the head restarts, sessions stay. A node agent outlives its head (a lease the head
renews); a restarted head takes it over and re-attaches the journal's sessions it holds. The
agent's side in process; the whole of it on a loopback Ray cluster with `tangram serve --ray`
killed with -9 and started again."""

from __future__ import annotations

import asyncio
import shutil
import signal
import threading
import time

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
            step = asyncio.ensure_future(_step(agent, "slow", "kept", "import time; time.sleep(2); x = 41"))
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
    assert waited >= 0.5 and not old_answered


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


# -- the whole of it: `tangram serve --ray` killed with -9 and started again ----------------------

@pytest.fixture
def cluster():
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    with loopback_cluster({"num_cpus": 2}, {"num_cpus": 2}) as (c, _):
        yield c


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
    time.sleep(1.0)
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
    time.sleep(5)  # rested on its node after 0.5 s idle; the head hears of it at its next poll
    head.stop(signal.SIGKILL)
    head2 = serve()
    try:
        health = httpx.get(f"{head2.url}/healthz").json()
        assert health["recovered_sessions"] == {"at_rest": 1, "reattached": 0, "lost": 0}, health
        got = _exec(head2.url, sid, python="print(len(xs), open('f').read().strip())")
        assert got["outcome"] == "ok" and got["run"]["stdout"] == "1000 rested\n", got
    finally:
        head2.stop()
