"""Task images on a Ray cluster: every node pulls for itself, a new session goes to a node that
holds its image, prewarm takes an image and a node count.

The placement's preference is tested fast, with doubles at the head's seam (the real engine and
policy, nodes that only say which images they hold); the rest on a real loopback Ray cluster of
two nodes, each with its own image store, and a real registry on loopback (tests/registrykit.py)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from types import SimpleNamespace

import pytest

from arl_tangram.core import Action, Allocation, Demand, Outcome
from arl_tangram.core.action import Setup
from arl_tangram.core.cluster import Cluster, CpuNode
from arl_tangram.managers.sandbox.images import ImageError
from arl_tangram.managers.sandbox.spec import Exec, RunCode
from arl_tangram.policy import make_policy
from arl_tangram.runtime.imageplace import NodeRoom, prewarm_nodes, session_node
from arl_tangram.runtime.ray_images import SENT_S, ClusterImages
from arl_tangram.runtime.ray_nodes import Node

T0 = "127.0.0.1:5000/py/task0:v1"


# -- the decision, pure ------------------------------------------------------------------------------

def test_a_new_session_goes_to_a_node_holding_its_image_when_it_has_room():
    rooms = [NodeRoom(0, 8, 30.0, False), NodeRoom(1, 2, 4.0, True), NodeRoom(2, 3, 1.0, True)]
    assert session_node(rooms, 1, 2.0) == 1  # not the emptiest node: the one holding the image
    assert session_node(rooms, 1, 0.5) == 2  # both hold it and have room: the one with more free cores
    assert session_node(rooms, 4, 2.0) is None  # no holder has the cores: placed as any new session
    assert session_node(rooms, 1, 8.0) is None  # nor the memory
    assert session_node([NodeRoom(0, 8, 30.0, False)], 1, 1.0) is None
    # a prewarm over n nodes: the holders first (nothing to fetch there), then the emptiest
    assert prewarm_nodes(rooms, 1) == [2] and prewarm_nodes(rooms, 3) == [2, 1, 0]
    assert prewarm_nodes([NodeRoom(3, 1, 1.0, False), NodeRoom(4, 5, 1.0, False)], 1) == [4]
    assert prewarm_nodes(rooms, 5) == [2, 1, 0] and prewarm_nodes(rooms, 0) == []


# -- the head's side with doubles: the real engine and policy, nodes that only tell their images ----

def _head(cores=(4, 4)):
    from arl_tangram.core import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine
    from conftest import Recorder

    rec = Recorder()
    engine = Engine(Cluster(cpu_nodes=tuple(CpuNode(f"n{i}", c, 16.0) for i, c in enumerate(cores))),
                    make_policy("tangram"), {p: rec for p in Pool}, ManualClock())
    nodes = {i: Node(f"{i:02d}" * 12, "127.0.0.1", c, 0, index=i, state="alive") for i, c in enumerate(cores)}
    head = SimpleNamespace(owner="head", engine=engine, by_index=nodes,
                           nodes_by_id={n.ray_id: n for n in nodes.values()})
    return head, ClusterImages(head), rec


def _step(aid, traj, image, cpus=1):
    return Action(aid, "sandbox", Demand({"cpu": (cpus, cpus)}), trajectory=traj, payload=Exec(command="true", image=image))


def _news(names, mark=1):
    return {"rested": [], "images": (mark, list(names)), "pulling": {}, "image_stats": None}


def test_the_head_places_a_session_where_its_image_is_and_sends_its_first_step_as_a_new_session():
    head, images, rec = _head()
    engine = head.engine
    busy = Action("busy", "sandbox", Demand({"cpu": (2, 2)}), payload=RunCode("1"))
    engine.submit(busy)
    engine.schedule()
    holder = rec.started[-1][1].node  # two of its four cores taken: the other node is the emptier
    other = 1 - holder
    images.learn(head.by_index[holder], _news([T0, "docker.io/library/python:3.12"]))

    assert images.place(_step("a1", "s1", T0)) == holder
    engine.submit(_step("a1", "s1", T0))
    engine.schedule()
    action, alloc = rec.started[-1]
    assert action.id == "a1" and alloc.node == holder  # the engine would have chosen ``other``
    sent = images.first_step(head.by_index[holder], action, alloc)
    assert alloc.setup is Setup.THAW and sent.setup is Setup.CREATE and sent.units == alloc.units
    assert images.first_step(head.by_index[holder], action, alloc) is alloc  # only its first step

    # a Docker Hub short name matches the full reference the node's store names it by
    assert images.place(_step("a2", "s2", "python:3.12")) == holder
    # an image no node holds: placed as any new session (the emptiest node), which then pulls it
    assert images.place(_step("a3", "s3", "127.0.0.1:5000/py/task1:v1")) is None
    engine.submit(_step("a3", "s3", "127.0.0.1:5000/py/task1:v1"))
    engine.schedule()
    action, alloc = rec.started[-1]
    assert action.id == "a3" and alloc.node == other
    # work just sent there counts as held there (its pull starts) until the node's news says more
    images.first_step(head.by_index[other], action, alloc)
    assert images.place(_step("a4", "s4", "127.0.0.1:5000/py/task1:v1")) == other
    node = head.by_index[other]
    node.sent = {k: v - SENT_S for k, v in node.sent.items()}
    images.learn(node, {"rested": [], "images": None, "pulling": {}, "image_stats": None})
    assert node.sent == {} and images.place(_step("a5", "s5", "127.0.0.1:5000/py/task1:v1")) is None
    # one-shots, sessions with a home and steps without an image are the engine's alone
    assert images.place(Action("o", "sandbox", payload=RunCode("1", image=T0))) is None
    assert images.place(_step("a6", "s1", T0)) is None and images.place(_step("a7", "s7", None)) is None
    # a node lost before the first step of a session homed there by its image was sent: that
    # session loses nothing with it (placed again), the one that ran there keeps its home (lost)
    assert images.place(_step("a8", "s8", T0)) == holder and "s8" in images.fresh
    images.node_lost(holder)
    assert "s8" not in engine.cpu.homes and "s8" not in images.fresh and engine.cpu.homes["s1"] == holder


def test_one_shots_naming_an_image_go_to_a_node_holding_it_by_any_of_its_names():
    """The head tells the engine what each node holds (``CpuPool.hold_images``) and the names an
    action's image may be held under: a one-shot naming ``python:3.12`` runs on the node whose
    store says ``docker.io/library/python:3.12``, though the other node is emptier."""
    head, images, rec = _head()
    engine = head.engine
    engine.cpu.image_names = images.names_of
    engine.submit(Action("busy", "sandbox", Demand({"cpu": (2, 2)}), payload=RunCode("1")))
    engine.schedule()
    holder = rec.started[-1][1].node
    assert engine.cpu.images[holder] == frozenset()
    images.learn(head.by_index[holder], _news(["docker.io/library/python:3.12"]))
    assert engine.cpu.images[holder] == {"docker.io/library/python:3.12"}
    engine.submit(Action("o", "sandbox", payload=RunCode("1", image="python:3.12")))
    engine.schedule()
    assert rec.started[-1][0].id == "o" and rec.started[-1][1].node == holder
    # one just sent to the other node counts as held there until its news says more
    first = images.first_step(head.by_index[1 - holder], Action("p", "sandbox", payload=RunCode("1", image=T0)),
                              Allocation("cpu", 1 - holder, (0,)))
    assert first.node == 1 - holder and T0 in engine.cpu.images[1 - holder]


def test_a_holder_without_room_does_not_take_the_session_and_a_refused_step_leaves_no_home():
    head, images, rec = _head(cores=(2, 2))
    engine = head.engine
    images.learn(head.by_index[0], _news([T0]))
    assert images.place(_step("a1", "s1", T0, cpus=3)) is None  # no node has three cores
    engine.submit(Action("busy", "sandbox", Demand({"cpu": (2, 2)}), payload=RunCode("1")))
    engine.schedule()
    full = rec.started[-1][1].node
    images.learn(head.by_index[full], _news([T0], mark=2))
    images.learn(head.by_index[1 - full], _news([], mark=2))
    assert images.place(_step("a2", "s2", T0)) is None  # the holder is full: any node, which pulls
    # a step homed by its image and then refused at once leaves no home behind
    bad = _step("a3", "s3", T0)
    images.learn(head.by_index[1 - full], _news([T0], mark=3))
    assert images.place(bad) == 1 - full and "s3" in engine.cpu.homes
    images.unplace(bad)
    assert "s3" not in engine.cpu.homes and "s3" not in images.fresh


def test_the_head_checks_names_against_its_nodes_and_sums_their_pull_counts():
    head, images, _ = _head()
    images.learn(head.by_index[1], {**_news(["myimage"]), "image_stats": {"pulls": 2, "disk_bytes": 10,
                                                                          "disk_limit_bytes": None}})
    images.learn(head.by_index[0], {**_news([]), "image_stats": {"pulls": 1, "disk_bytes": 5,
                                                                 "disk_limit_bytes": None},
                                    "pulling": {"x-1": "pulling a: 1.0 of 2.0 MB"}})
    images.check("myimage")  # imported on a node under that name: not a reference, and fine
    images.check(T0)  # a reference: each node its sessions land on pulls it
    with pytest.raises(ImageError, match=r"no image named 'Not_A_Ref' on any node, and it is not a registry "
                                         r"reference"):
        images.check("Not_A_Ref")
    assert images.stats() == {"pulls": 3, "disk_bytes": 15, "disk_limit_bytes": None}
    head.by_index[0].running.add("x-1")
    assert images.pulling("x-1") == "pulling a: 1.0 of 2.0 MB" and images.pulling("x-2") is None
    with pytest.raises(ValueError, match=r"nodes: 3 asked, and the cluster has 2 node"):
        images._chosen(T0, 3)
    with pytest.raises(ValueError, match=r"nodes: 0 is not a positive"):
        images._chosen(T0, 0)
    assert [n.index for n in images._chosen("myimage", 1)] == [1]  # its holder first


# -- on a real loopback Ray cluster, with a real registry ---------------------------------------------

ray_and_registry = [pytest.mark.ray, pytest.mark.slow,
                    pytest.mark.skipif(os.geteuid() != 0, reason="overlay roots and whiteouts need root"),
                    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A registry with py/task0..3 (one base of the host's python, one task project each) behind a
    counting proxy, and a Ray cluster of two nodes of two cores, each with its own image store."""
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    from imagekit import layer_tar, python_layer
    from raycluster import loopback_cluster
    from registrykit import MISSING, Layout, Proxy, Registry, push

    from arl_tangram.bench.taskimages import project, task_layer

    if MISSING:
        pytest.skip(f"needs {' and '.join(MISSING)} (apt-get install -y docker-registry skopeo)")
    d = tmp_path_factory.mktemp("ray-images")
    reg = Registry(d / "registry")
    lay = Layout(d / "layout")
    base = layer_tar(python_layer())
    for n in range(4):
        lay.tag(f"task{n}", lay.image_of([base, task_layer(project(n))]))
        push(lay, f"task{n}", f"{reg.host}/py/task{n}:v1")
    proxy = Proxy(reg.host)
    stores = [d / "store-a", d / "store-b"]
    try:
        with loopback_cluster(*({"num_cpus": 2, "env_vars": {"TANGRAM_IMAGE_STORE": str(s)}} for s in stores)) as (
                c, nodes):
            yield SimpleNamespace(cluster=c, stores={n.node_id: s for n, s in zip(nodes, stores)}, proxy=proxy,
                                  registry=reg, refs=[f"{proxy.host}/py/task{n}:v1" for n in range(4)])
    finally:
        proxy.close()
        reg.close()


def _task_layer_gets(world, n: int) -> int:
    """How many times task ``n``'s own layer (the last of its image) was fetched through the proxy."""
    import httpx

    r = httpx.get(f"http://{world.registry.host}/v2/py/task{n}/manifests/v1", timeout=30,
                  headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    digest = r.json()["layers"][-1]["digest"]
    return sum(k for path, k in world.proxy.hits.items() if path.endswith(f"/blobs/{digest}"))


def _has(store, image: str) -> bool:
    from arl_tangram.managers.sandbox.images import ImageStore

    try:
        ImageStore(store).get(image)
    except ImageError:
        return False
    return True


def _sandboxes(world, *hosts: str):
    from arl_tangram.managers.sandbox.registry import RegistriesConfig
    from arl_tangram.managers.sandbox.spec import SandboxConfig

    regs = RegistriesConfig.from_toml({"registries": [{"host": h, "insecure": True} for h in hosts]})
    return SandboxConfig(warm_pool=0, warm_sessions=0, registries=regs)  # each node's own store (the fixture)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="overlay roots and whiteouts need root")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_on_ray_each_node_pulls_for_itself_and_sessions_go_where_their_image_is(world, tmp_path):
    from imagekit import docker_archive, python_layer
    from registrykit import Rule, free_port

    from arl_tangram.managers.sandbox.images import ImageStore
    from arl_tangram.runtime import Tangram

    t0, t1, t2 = world.refs[:3]
    dead = f"127.0.0.1:{free_port()}"
    proxy = world.proxy

    rt = None

    async def until(what, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, (
                f"timed out; running {[(r.action.id, r.action.trajectory, r.allocation.node) for r in rt.engine.running.values()]}, "
                f"queued {[(a, str(rt.why_waiting(a))) for a in rt.engine.pending]}, homes {rt.engine.cpu.homes}, "
                f"nodes {[(n['name'], n['cores_free'], n['running']) for n in rt.nodes()]}")
            await asyncio.sleep(0.05)

    async def main():
        out = {}
        nonlocal rt
        async with Tangram.ray(world.cluster.address, sandbox=_sandboxes(world, proxy.host, dead)) as tg:
            rt = tg.runtime
            assert len(rt.by_index) == 2

            def home(s):
                return rt.sandboxes.homes[s.id]

            # two sessions of one image at once: one node, one pull (its blobs fetched once), and
            # the steps wait for it saying so
            proxy.rules.append(Rule("/blobs/", ("delay", 1.0), 1000))
            s1, s2 = await tg.session(image=t0), await tg.session(image=t0)
            first = [asyncio.ensure_future(s.exec(python="print(open('/repo/README.md').read().split()[1])",
                                                  id=f"first-{i}", timeout_s=60)) for i, s in enumerate((s1, s2))]
            waits = []
            while not all(f.done() for f in first):
                w = rt.why_waiting("first-0")
                if w is not None and w.reason == "image-pull":
                    waits.append(w.detail)
                await asyncio.sleep(0.05)
            out["first"] = [f.result() for f in first]
            out["waits"] = waits
            proxy.rules.clear()
            a = home(s1)
            out["same_node"] = home(s2) is a
            out["t0_gets_after_one_node"] = _task_layer_gets(world, 0)

            # that node full: a third session of the image goes to the other node, which pulls it itself
            busy = [asyncio.ensure_future(s.exec(python="import time; time.sleep(4)", timeout_s=30)) for s in (s1, s2)]
            await until(lambda: sum(1 for r in rt.engine.running.values() if r.action.trajectory in (s1.id, s2.id)) == 2)
            s3 = await tg.session(image=t0)
            out["third"] = await s3.exec(python="print(open('/repo/README.md').read().split()[1])", timeout_s=60)
            b = home(s3)
            out["third_elsewhere"] = b is not a
            out["t0_gets_after_two_nodes"] = _task_layer_gets(world, 0)
            out["stores_t0"] = [_has(world.stores[n.ray_id], t0) for n in (a, b)]
            await asyncio.gather(*busy)

            # a session of another image: once a node holds it, the next one goes there even though
            # the other node has more free cores (it would be the engine's choice)
            s4 = await tg.session(image=t1)
            out["s4"] = await s4.exec(python="print(open('/repo/README.md').read().split()[1])", timeout_s=60)
            x = home(s4)
            hold = asyncio.ensure_future(s4.exec(python="import time; time.sleep(4)", timeout_s=30))
            await until(lambda: any(r.action.trajectory == s4.id for r in rt.engine.running.values()))
            s5 = await tg.session(image=t1)
            out["s5"] = await s5.exec(python="print(open('/repo/README.md').read().split()[1])", timeout_s=60)
            out["s5_with_s4"] = home(s5) is x
            out["t1_gets"] = _task_layer_gets(world, 1)
            await hold

            # an image imported on one node only, by its own name: sessions naming it go there
            other = b if x is a else a
            archive = docker_archive(tmp_path / "local.tar", [python_layer() + [("file", "etc/which", b"imported\n")]])
            ImageStore(world.stores[other.ray_id]).import_path(archive, "localonly")
            await until(lambda: "localonly" in other.images)
            s6 = await tg.session(image="localonly")
            out["s6"] = await s6.exec(python="print(open('/etc/which').read(), end='')")
            out["s6_there"] = home(s6) is other

            # bad names: a clear error at once, or the step's (rejected: the request's; infra_error:
            # a registry that does not answer), each naming the reference
            with pytest.raises(ImageError, match=r"no image named 'Not_A_Ref' on any node, and it is not a "
                                                 r"registry reference"):
                await tg.session(image="Not_A_Ref")
            missing = await tg.session(image=f"{proxy.host}/py/nothing:v1")
            out["missing"] = await missing.exec("true")
            down = await tg.session(image=f"{dead}/py/task0:v1")
            out["down"] = await down.exec("true")
            out["one_shot"] = await tg.run("print(open('/repo/README.md').read().split()[1])", image=t1)

            # prewarm: the image pulled and its sandboxes started on two nodes
            out["prewarm"] = await tg.prewarm(t2, 1, nodes=2)
            out["t2_gets"] = _task_layer_gets(world, 2)
            out["stores_t2"] = [_has(s, t2) for s in world.stores.values()]
            with pytest.raises(ValueError, match=r"nodes: 3 asked, and the cluster has 2 node"):
                await tg.prewarm(t2, 1, nodes=3)
            # t0 and t2 on both nodes, t1 on one at least: the nodes' counts as their next looks tell
            await until(lambda: (rt.image_stats() or {}).get("pulls", 0) >= 5)
            out["stats"] = rt.image_stats()
        return out

    out = asyncio.run(asyncio.wait_for(main(), 600))
    assert [(r.outcome, r.stdout) for r in out["first"]] == [(Outcome.OK, "shapes0\n")] * 2, out["first"]
    assert out["same_node"] and out["t0_gets_after_one_node"] == 1
    assert out["waits"] and all(w.startswith(f"pulling {t0}") for w in out["waits"]), out["waits"]
    assert any(re.search(r": \d+\.\d of \d+\.\d MB$", w) for w in out["waits"]), out["waits"]
    assert (out["third"].outcome, out["third"].stdout) == (Outcome.OK, "shapes0\n"), out["third"]
    assert out["third_elsewhere"] and out["t0_gets_after_two_nodes"] == 2 and out["stores_t0"] == [True, True]
    assert (out["s4"].outcome, out["s5"].outcome) == (Outcome.OK, Outcome.OK) and out["s5"].stdout == "shapes1\n"
    assert out["s5_with_s4"] and out["t1_gets"] == 1
    assert (out["s6"].outcome, out["s6"].stdout, out["s6_there"]) == (Outcome.OK, "imported\n", True)
    assert out["missing"].outcome is Outcome.REJECTED and "py/nothing:v1" in out["missing"].message
    assert out["down"].outcome is Outcome.INFRA_ERROR and dead in out["down"].message
    assert out["one_shot"].outcome is Outcome.OK and out["one_shot"].stdout == "shapes1\n"
    p = out["prewarm"]
    assert p.image == t2 and p.requested == 2 and p.ready == 2 and "on each of 2 node(s)" in p.message
    assert out["t2_gets"] == 2 and out["stores_t2"] == [True, True]
    assert out["stats"]["pulls"] >= 5 and out["stats"]["pull_failures"] >= 2 and out["stats"]["bytes_pulled"] > 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="overlay roots and whiteouts need root")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_tangram_serve_with_ray_takes_task_images_and_prewarms_on_n_nodes(world, tmp_path):
    import httpx
    from servers import Server

    from arl_tangram.client import TangramClient

    t3 = world.refs[3]
    config = {"registries": [{"host": world.proxy.host, "insecure": True}], "lease_s": 10,
              "sandbox": {"warm_pool": 0, "warm_sessions": 0}}
    server = Server(tmp_path, config=config, args=("--ray", world.cluster.address), start_timeout_s=120)
    try:
        with TangramClient(server.url) as c:
            s = c.session(image=t3)
            r = s.exec(python="print(open('/repo/README.md').read().split()[1])")
            warm = c.prewarm(t3, 1, nodes=2)
            too_many = httpx.post(f"{server.url}/v1/pools/prewarm", json={"image": t3, "n": 1, "nodes": 3},
                                  timeout=60)
            bad = httpx.post(f"{server.url}/v1/sessions", json={"image": "Not_A_Ref"}, timeout=60)
            deadline = time.monotonic() + 30
            while True:  # the nodes' pull counts reach the head with their agents' next looks
                metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
                pulls = [float(line.split()[1]) for line in metrics.splitlines()
                         if line.startswith("tangram_image_pulls_total")]
                if (pulls and pulls[0] >= 2) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            s.close()
    finally:
        server.stop()
    assert (r.outcome, r.run.stdout) == ("ok", "shapes3\n"), r.message
    assert warm.ready == 2 and warm.image == t3 and _task_layer_gets(world, 3) == 2
    assert too_many.status_code == 422 and "nodes: 3 asked" in too_many.text
    assert bad.status_code in (400, 422) and "Not_A_Ref" in bad.text
    assert pulls and pulls[0] >= 2  # t3 on each node, each its own pull
