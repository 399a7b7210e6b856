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

from arl_tangram.core import Action, Demand, Outcome
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
