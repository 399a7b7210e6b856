"""Draining a Ray node: its sessions move to other nodes between two of their steps, files and
all, on a real 3-node Ray cluster on loopback (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import Counter

import httpx
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every Ray address on 127.0.0.1
ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")


from arl_tangram.core import Outcome  # noqa: E402
from arl_tangram.managers.sandbox.manager import SandboxConfig  # noqa: E402
from arl_tangram.runtime import Tangram  # noqa: E402
from arl_tangram.server.service import NotFound, Service  # noqa: E402

from raycluster import loopback_cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.skipif(os.geteuid() != 0, reason="moving a session snapshots its layered workspace: root")]


@pytest.fixture
def cluster():
    with loopback_cluster(*[{"num_cpus": 2}] * 3) as (c, _):
        yield c


def test_draining_the_busiest_node_moves_every_session_and_loses_no_one_shot(cluster):
    async def main():
        # a move priced below what a carry takes here: the moves of the drain reprice it
        async with Tangram.ray(cluster.address, sandbox=SandboxConfig(warm_pool=1, warm_sessions=1),
                               move_s=0.001) as tg:
            rt = tg.runtime
            service = Service(rt)
            assert rt.engine.costs.session_restore_s == 0.001
            sessions = [await tg.session() for _ in range(6)]
            first = await asyncio.gather(*(s.exec(f"echo file{i} > f; mkdir -p d; echo deep{i} > d/g")
                                           for i, s in enumerate(sessions)))
            assert all(r.ok for r in first), [r.message for r in first]
            homes = Counter(rt.sandboxes.homes[s.id].ray_id for s in sessions)
            busiest = homes.most_common(1)[0][0]
            on_it = [i for i, s in enumerate(sessions) if rt.sandboxes.homes[s.id].ray_id == busiest]
            shots = [asyncio.ensure_future(tg.run(f"import time; time.sleep(1); print({i})")) for i in range(6)]
            running = asyncio.ensure_future(sessions[on_it[0]].exec("sleep 1; cat f"))
            await asyncio.sleep(0.5)
            with pytest.raises(NotFound, match="no-such-node"):
                service.drain_node("no-such-node")
            t0 = time.monotonic()
            at_once = service.drain_node(busiest)
            # a step that arrives meanwhile waits for its session's move; it is not refused
            waiting = [asyncio.ensure_future(sessions[i].exec("cat d/g")) for i in on_it[1:]]
            fresh = await tg.session()
            fresh_r = await fresh.exec("echo fresh > f")
            fresh_home = rt.sandboxes.homes[fresh.id].ray_id
            drained_after = None
            while time.monotonic() - t0 < 60:
                node = next(n for n in rt.nodes() if n["id"] == busiest)
                if node["state"] == "drained":
                    drained_after = time.monotonic() - t0
                    break
                await asyncio.sleep(0.2)
            reads = [await s.exec("cat f d/g") for s in sessions]
            homes_after = {rt.sandboxes.homes[s.id].ray_id for s in sessions}
            return (at_once, on_it, await running, await asyncio.gather(*waiting), fresh_r, fresh_home, busiest,
                    drained_after, node, reads, homes_after, await asyncio.gather(*shots), rt.sandboxes.moves,
                    sorted(rt.sandboxes.move_s), sorted(rt.sandboxes.move_cost_s), service.cluster())

    (at_once, on_it, running, waiting, fresh_r, fresh_home, busiest, drained_after, node, reads, homes_after, shots,
     moves, took, cost, info) = asyncio.run(asyncio.wait_for(main(), 240))
    assert at_once.state == "draining" and at_once.cores_free == 0  # no new work, at once
    assert running.outcome is Outcome.OK and running.stdout == f"file{on_it[0]}\n"  # its running step finished
    assert [(r.outcome, r.stdout) for r in waiting] == [(Outcome.OK, f"deep{i}\n") for i in on_it[1:]]
    assert fresh_r.ok and fresh_home != busiest  # no new session lands on the draining node
    assert drained_after is not None and node["sessions"] == 0 and not node["running"], node
    assert [(r.outcome, r.stdout) for r in reads] == [(Outcome.OK, f"file{i}\ndeep{i}\n") for i in range(6)]
    assert busiest not in homes_after and moves >= len(on_it)
    assert [(r.outcome, r.stdout) for r in shots] == [(Outcome.OK, f"{i}\n") for i in range(6)]  # 0 lost
    # each moved session's next step told what its moves cost whole (the carries, then its wake
    # there), and the policy now prices a move at that (far above 1 ms), and says so
    assert info.moves == moves and info.move_max_s == round(took[-1], 4), info
    assert 1 <= len(cost) <= moves and sum(cost) >= sum(took), (cost, took)
    assert info.move_price_s == round(cost[len(cost) // 2], 4) > 0.001, (info, cost)


def test_a_node_is_drained_over_http_and_its_session_keeps_its_files(cluster, tmp_path):
    from servers import Server

    server = Server(tmp_path, args=("--ray", cluster.address), start_timeout_s=90)
    try:
        url = server.url
        sid = httpx.post(f"{url}/v1/sessions", json={"job": "j"}).json()["session_id"]
        r = httpx.post(f"{url}/v1/sessions/{sid}/exec", json={"command": "echo kept > f"}, timeout=60).json()
        assert r["outcome"] == "ok", r
        [home] = [n for n in httpx.get(f"{url}/v1/cluster").json()["nodes"] if n["sessions"]]
        bad = httpx.post(f"{url}/v1/cluster/nodes/no-such-node/drain")
        assert bad.status_code == 404 and "no-such-node" in bad.json()["message"]
        d = httpx.post(f"{url}/v1/cluster/nodes/{home['name']}/drain")
        assert d.status_code == 200 and d.json()["state"] in ("draining", "drained"), d.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = next(n for n in httpx.get(f"{url}/v1/cluster").json()["nodes"] if n["id"] == home["id"])
            if now["state"] == "drained":
                break
            time.sleep(0.2)
        assert now["state"] == "drained" and now["sessions"] == 0, now
        r = httpx.post(f"{url}/v1/sessions/{sid}/exec", json={"command": "cat f"}, timeout=60).json()
        assert r["outcome"] == "ok" and r["run"]["stdout"] == "kept\n", r
        info = httpx.get(f"{url}/v1/cluster").json()
        assert [n["id"] for n in info["nodes"] if n["sessions"]] != [home["id"]]
        # the head counts the move and times it (/v1/cluster and /metrics)
        assert info["moves"] >= 1 and 0 < info["move_p50_s"] <= info["move_max_s"], info
        assert "tangram_session_moves " in httpx.get(f"{url}/metrics").text
    finally:
        server.stop()


def test_fork_children_on_other_nodes_get_their_files_carried(cluster):
    """A fork's children are made beside their source; a child's step the engine places on another
    node (it has no home yet: the most free cores win) brings its files along."""
    async def main():
        async with Tangram.ray(cluster.address, sandbox=SandboxConfig(warm_pool=1, warm_sessions=1)) as tg:
            s = await tg.session()
            assert (await s.exec("echo parent > f")).ok
            kids = await s.fork(4)
            reads = await asyncio.gather(*(k.exec("cat f; sleep 0.5") for k in kids))
            homes = {tg.runtime.sandboxes.homes[k.id].ray_id for k in kids}
            return reads, homes, tg.runtime.sandboxes.moves

    reads, homes, moves = asyncio.run(asyncio.wait_for(main(), 180))
    assert [(r.outcome, r.stdout) for r in reads] == [(Outcome.OK, "parent\n")] * 4, [r.message for r in reads]
    assert len(homes) > 1 and moves >= 1  # they spread over the nodes, files and all
