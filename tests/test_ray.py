"""The Ray backend on a real multi-node Ray cluster on loopback (``ray.cluster_utils.Cluster``):
one engine in this process, a node agent with real sandboxes on each node."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every Ray address on 127.0.0.1
ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

from arl_tangram.core import Outcome  # noqa: E402
from arl_tangram.managers.sandbox.manager import SandboxConfig  # noqa: E402
from arl_tangram.runtime import SessionGone, Tangram  # noqa: E402

from raycluster import loopback_cluster  # noqa: E402
from servers import Server, alive, free_port  # noqa: E402
from shrink_probe import WATCH_CORES, needs_a_core_to_take_back  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.skipif(shutil.which("bwrap") is None,
                                                   reason="bubblewrap is not installed")]


@pytest.fixture
def cluster():
    with loopback_cluster({"num_cpus": 1}, {"num_cpus": 1}) as (c, nodes):
        yield c, nodes


def _node_of(tg, trajectory):
    return tg.runtime.sandboxes.homes[trajectory]


def test_work_spreads_over_nodes_and_a_dead_node_loses_no_action(cluster):
    c, nodes = cluster
    finished: Counter = Counter()

    async def main():
        async with Tangram.ray(c.address, sandbox=SandboxConfig(warm_pool=1)) as tg:
            rt = tg.runtime
            rt.engine.listeners.append(lambda f: finished.update([f.action.id]))
            assert rt.engine.cpu.capacity == 2 and len(rt.nodes()) == 2
            # one-shots and sessions spread over both nodes
            seen: set[str] = set()

            async def watch():
                while True:
                    seen.update(n["name"] for n in rt.nodes() if n["running"])
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            rs = await asyncio.gather(*(tg.run(f"import time; time.sleep(0.3); print({i})") for i in range(6)))
            watcher.cancel()
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(6)] and len(seen) == 2
            s = await tg.session()
            await s.exec(python="x = 41")
            assert (await s.exec(python="print(x + 1)")).stdout == "42\n"
            home = _node_of(tg, s.id)

            # a node dies with one-shots running and a session step in flight
            longs = [asyncio.ensure_future(tg.run("import time; time.sleep(1.5); print('done')", id=f"long-{i}"))
                     for i in range(4)]
            step = asyncio.ensure_future(s.exec("sleep 30"))
            await asyncio.sleep(0.8)
            victim = next(n for n in nodes if n.node_id == home.ray_id)
            c.remove_node(victim)
            step_r = await asyncio.wait_for(step, 60)
            capacity_after = rt.engine.cpu.capacity
            long_rs = await asyncio.wait_for(asyncio.gather(*longs), 120)
            with pytest.raises(SessionGone) as gone:
                await s.exec("ls")

            # a node that joins gets work
            c.add_node(num_cpus=1)
            for _ in range(200):
                if rt.engine.cpu.capacity == 2:
                    break
                await asyncio.sleep(0.1)
            joined = rt.engine.cpu.capacity
            before = {n["name"] for n in rt.nodes() if n["state"] == "alive"}
            seen.clear()
            watcher = asyncio.ensure_future(watch())
            more = await asyncio.gather(*(tg.run("import time; time.sleep(0.3)") for _ in range(6)))
            watcher.cancel()
            return step_r, capacity_after, long_rs, gone.value.reason, joined, before, seen, more, rt.nodes()

    step_r, capacity_after, long_rs, gone, joined, alive, seen, more, table = asyncio.run(asyncio.wait_for(main(), 300))
    assert step_r.outcome is Outcome.INFRA_ERROR and "lost with its node" in step_r.message
    assert "lost with its node" in gone
    assert capacity_after == 1, "the dead node's capacity left the engine at once"
    assert [(r.outcome, r.stdout) for r in long_rs] == [(Outcome.OK, "done\n")] * 4  # re-run elsewhere
    ids = [f"long-{i}" for i in range(4)]
    # every accepted action ended, and at most one re-run each (2 records: the lost run and the re-run)
    assert all(1 <= finished[i] <= 2 for i in ids)
    assert joined == 2 and alive == seen and all(r.ok for r in more)
    assert [n["state"] for n in table].count("dead") == 1


def test_serve_with_ray_restart_recovers_and_leaks_no_sandbox(cluster, tmp_path):
    c, _ = cluster
    journal = tmp_path / "journal.sqlite3"

    def serve() -> Server:  # agents outlive a head for their lease: 3 s here (test_reattach.py: a head back in time)
        return Server(tmp_path, journal=journal, config={"lease_s": 3}, args=("--ray", c.address),
                      start_timeout_s=60)

    head = serve()
    url = head.url
    cluster_info = httpx.get(f"{url}/v1/cluster").json()
    assert cluster_info["backend"] == "ray" and [n["cores"] for n in cluster_info["nodes"]] == [1, 1]
    assert all(n["sandboxes"] and n["isolation"] == "bwrap" for n in cluster_info["nodes"])
    ids = [f"crash-{i}" for i in range(6)]
    for i in ids:
        r = httpx.post(f"{url}/v1/actions", json={"id": i, "wait": False, "action": {
            "code": "import time; time.sleep(1); print('ok')"}}, timeout=30)
        assert r.status_code in (200, 202)
    deadline = time.monotonic() + 30  # a loaded host may take longer than any fixed sleep to start them
    while True:
        agents = httpx.get(f"{url}/v1/cluster").json()["nodes"]
        sandboxes = _sandbox_processes()
        if sum(len(n["running"]) for n in agents) >= 1 and sandboxes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(len(n["running"]) for n in agents) >= 1
    assert sandboxes, "the agents should be running sandboxes now"
    head.stop(signal.SIGKILL)
    deadline = time.time() + 60
    while time.time() < deadline and any(alive(p) for p in sandboxes):
        time.sleep(0.5)
    assert not [p for p in sandboxes if alive(p)], "sandboxes of the dead head outlived their agents' lease"
    head2 = serve()
    url2 = head2.url
    try:
        final = {}
        deadline = time.time() + 120
        while len(final) < len(ids) and time.time() < deadline:
            for i in ids:
                if i not in final:
                    r = httpx.get(f"{url2}/v1/actions/{i}").json()
                    if r["state"] == "done":
                        final[i] = r
            time.sleep(0.3)
        assert {i: r["outcome"] for i, r in final.items()} == {i: "ok" for i in ids}
    finally:
        head2.stop()


def test_an_unreachable_ray_address_is_one_clear_line():
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(port), "--ray",
                        f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "ray start --head" in " ".join(p.stderr.split())


def _sandbox_processes() -> list[int]:
    """Every process below a node agent's worker (its sandboxes: bwrap and what runs inside)."""
    children: dict[int, list[int]] = {}
    cmd: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    cmd[int(name)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [p for p, c in cmd.items() if c.startswith("ray::NodeAgent")]
    while todo:
        for ch in children.get(todo.pop(), ()):
            out.append(ch)
            todo.append(ch)
    return out


@needs_a_core_to_take_back
def test_a_run_on_a_node_is_shrunk_by_its_agent():
    """``Shrink`` on Ray: the head's engine takes a core back and the node's agent shrinks the
    run's sandbox (or pins it to one core when it starts, if the call beat the start: "1 1").
    Pinned one-shots, so that the program sees its cores shrink."""
    from arl_tangram.core import Allocation
    code = WATCH_CORES
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()

    async def main():
        async with Tangram.ray(c.address, sandbox=SandboxConfig(warm_pool=1, one_shots_share_cpus=False)) as tg:
            rt = tg.runtime
            assert rt.engine.cpu_resizes
            run = asyncio.ensure_future(tg.run(code, cpus=2, id="grown", timeout_s=30))
            for _ in range(600):
                if any("grown" in n.running for n in rt.nodes_by_id.values()):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # started in its sandbox
            node = rt.engine.running["grown"].allocation.node
            rt.sandboxes.resize("grown", Allocation("cpu", node, (0,)))
            return await asyncio.wait_for(run, 60)

    try:
        r = asyncio.run(asyncio.wait_for(main(), 180))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    assert r.outcome is Outcome.OK and r.stdout in ("2 1\n", "1 1\n"), (r.stdout, r.stderr)


def test_a_session_put_to_rest_on_its_node_drops_the_head_s_memory_reservation(cluster):
    """The node's manager rests an idle session (its processes end): the head hears of it at its
    next poll and reserves nothing for it; its next step wakes it there, state intact."""
    c, _ = cluster

    async def main():
        async with Tangram.ray(c.address, sandbox=SandboxConfig(warm_pool=1, rest_after_s=0.5)) as tg:
            rt = tg.runtime
            s = await tg.session()
            r = await s.exec(python="xs = list(range(1000))")
            assert r.outcome is Outcome.OK, r.message
            reserved = rt.engine.cpu.session_mem[s.id]
            for _ in range(300):
                if rt.engine.cpu.session_mem[s.id] == 0.0:
                    break
                await asyncio.sleep(0.1)
            rested = rt.engine.cpu.session_mem[s.id]
            woken = await s.exec(python="print(len(xs))")
            return reserved, rested, woken, rt.engine.cpu.session_mem[s.id]

    reserved, rested, woken, after = asyncio.run(asyncio.wait_for(main(), 180))
    assert reserved > 0 and rested == 0.0
    assert woken.outcome is Outcome.OK and woken.stdout == "1000\n" and woken.result.info.get("woken")
    assert after > 0  # awake again: its measured memory is reserved again


def test_two_heads_share_one_ray_cluster_each_serving_only_its_own_nodes():
    """Several heads on one Ray cluster (``ray_resource``): each serves only the nodes with its
    custom resource, starts agents there alone, and runs its actions and sessions on them."""
    with loopback_cluster({"num_cpus": 1, "resources": {"head_a": 1}},
                          {"num_cpus": 1, "resources": {"head_b": 1}}) as (c, nodes):
        ids = {"head_a": nodes[0].node_id, "head_b": nodes[1].node_id}

        async def main():
            config = SandboxConfig(warm_pool=0, warm_sessions=0)
            async with Tangram.ray(c.address, sandbox=config, resource="head_a", owner="head A") as a:
                async with Tangram.ray(c.address, sandbox=config, resource="head_b", owner="head B") as b:
                    seen = {name: [n["id"] for n in tg.runtime.nodes()] for name, tg in (("head_a", a), ("head_b", b))}
                    ra, rb = await asyncio.gather(a.run("print('a')"), b.run("print('b')"))
                    s = await b.session()
                    await s.exec(python="x = 2")
                    step = await s.exec(python="print(x * 21)")
                    home = b.runtime.sandboxes.homes[s.id].ray_id
                    capacity = (a.runtime.engine.cpu.capacity, b.runtime.engine.cpu.capacity)
            return seen, ra, rb, step, home, capacity

        seen, ra, rb, step, home, capacity = asyncio.run(main())
    assert seen == {"head_a": [ids["head_a"]], "head_b": [ids["head_b"]]} and capacity == (1, 1)
    assert ra.stdout == "a\n" and rb.stdout == "b\n" and step.stdout == "42\n" and home == ids["head_b"]
