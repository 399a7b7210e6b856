"""GPU nodes that join and leave a running engine (the Ray runtime's model services), and the node
agent's model host, without Ray: the pool's counts, the policy's choices, the engine's ledger."""

from __future__ import annotations

import asyncio

import pytest

from arl_tangram.core import Outcome
from arl_tangram.core.action import Action, Allocation, Demand
from arl_tangram.core.cluster import Cluster, GpuNode, ModelSpec
from arl_tangram.core.pools import GpuPool
from arl_tangram.core.seam import Completion
from arl_tangram.policy import tangram_policy


def _counts_hold(pool: GpuPool) -> None:
    """The pool's running counts agree with its GPUs, counting live ones only."""
    live = [g for g in pool.gpus if g.alive]
    assert pool.capacity == len(live)
    assert pool.total_free == sum(1 for g in live if not g.occupants)
    assert pool.spare_gpus == sum(1 for g in live if g.share_used < 1.0 - 1e-9)
    assert pool.max_island == max((len(i) for i in pool.islands), default=0)
    for insts in pool.instances.values():
        assert all(pool.gpus[g].alive for i in insts for g in i.gpus)


def test_gpu_nodes_join_with_new_ids_and_leave_without_a_trace_in_the_counts():
    pool = GpuPool((GpuNode("a", 2, 10.0, 2),))
    b = pool.add_node(GpuNode("b", 4, 20.0, groups=((0, 2), (1, 3))))  # discovered NVLink pairs
    assert b == 1 and pool.first_gpu == [0, 2] and pool.capacity == 6
    assert pool.islands == [(0, 1), (2, 4), (3, 5)] and [g.node for g in pool.gpus] == [0, 0, 1, 1, 1, 1]
    _counts_hold(pool)
    busy = pool.add_instance("m", (0,), 5.0)
    pool.admit(busy, "x", share=0.5)
    pool.add_instance("m", (1,), 5.0)  # idle
    half = pool.add_instance("m", (2,), 5.0)
    pool.admit(half, "y", share=1.0)
    _counts_hold(pool)

    gone = pool.remove_node(0)
    assert {i.gpus for i in gone} == {(0,), (1,)} and [i.gpus for i in pool.instances["m"]] == [(2,)]
    assert list(pool.blocks(1)) == [(2,), (4,), (3,), (5,)] and list(pool.blocks(2)) == [(2, 4), (3, 5)]
    _counts_hold(pool)
    pool.release(busy, 1.0)  # the action that ran there ends after its node left: counts unchanged
    _counts_hold(pool)
    assert pool.remove_node(0) == [] and pool.meter.running == 1.0  # y still runs on node b

    c = pool.add_node(GpuNode("c", 1, 10.0, 1))
    assert pool.first_gpu[c] == 6 and list(pool.blocks(1))[-1] == (6,)
    _counts_hold(pool)
    pool.remove_node(1)
    assert list(pool.blocks(1)) == [(6,)] and pool.max_island == 1
    _counts_hold(pool)


class _Host:
    """A ModelHost double: records what the engine asks."""

    def __init__(self) -> None:
        self.started: list[tuple[Action, Allocation]] = []
        self.prefetched: list = []

    def start(self, action, allocation):
        self.started.append((action, allocation))

    def cancel(self, action_id):
        pass

    def close_session(self, trajectory):
        pass

    def prefetch(self, load):
        self.prefetched.append(load)

    def evict(self, model, gpus):
        pass

    async def start_up(self):
        pass

    async def shut_down(self):
        pass


def _model_action(i: str) -> Action:
    return Action(i, "model:m", Demand({"gpu": (1, 1)}))


def test_the_engine_places_on_gpus_that_join_and_never_on_gpus_that_left():
    from arl_tangram.core import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine

    host = _Host()
    clock = ManualClock()
    engine = Engine(Cluster(), tangram_policy(), {Pool.GPU: host}, clock)
    finished = []
    engine.listeners.append(finished.append)
    # the head knows the services once the first GPU node has loaded them, then gets its GPUs
    engine.add_models([ModelSpec("m", 4.0, 1)])
    a = engine.add_gpu_node(GpuNode("a", 2, 10.0, 2))
    engine.schedule()
    assert len(host.prefetched) == 1 and host.prefetched[0].block in ((0,), (1,))
    first = host.prefetched[0]
    engine.loaded(first.key)
    for i in range(3):
        assert engine.submit(_model_action(f"r{i}")) is None
    engine.schedule()
    on_a = {act.id: alloc.units for act, alloc in host.started}
    assert set(on_a) == {"r0", "r1"} and {u for us in on_a.values() for u in us} == {0, 1}
    # a second node joins: the waiting call (or a copy for it) goes there
    b = engine.add_gpu_node(GpuNode("b", 2, 10.0, 2))
    assert engine.gpu.first_gpu[b] == 2
    engine.schedule()
    placed = {act.id: alloc.units for act, alloc in host.started} | {ld.key: ld.block for ld in host.prefetched[1:]}
    assert any(g in (2, 3) for us in placed.values() for g in us), placed
    # node a dies with r0 and r1 running on it: its capacity leaves now, their copies with it
    engine.remove_gpu_node(a)
    _counts_hold(engine.gpu)
    for rid in ("r0", "r1"):
        f = engine.report(Completion(rid, Outcome.INFRA_ERROR, message="node lost"))
        assert f.outcome is Outcome.INFRA_ERROR
    _counts_hold(engine.gpu)
    for key in list(engine.loading):
        engine.loaded(key)
    # the re-runs and everything after them run on node b only
    for i in range(6):
        engine.submit(_model_action(f"s{i}"))
    for _ in range(10):
        engine.schedule()
        for act, alloc in list(host.started):
            if act.id in engine.running:
                assert all(g in (2, 3) for g in alloc.units), (act.id, alloc.units)
                clock.advance_to(clock.now() + 0.1)
                engine.complete(Completion(act.id, Outcome.OK, exec_s=0.1))
        for key in list(engine.loading):
            engine.loaded(key)
        _counts_hold(engine.gpu)
    done = {f.action.id for f in finished if f.outcome is Outcome.OK}
    assert {f"s{i}" for i in range(6)} <= done


def test_a_prefetch_onto_a_node_that_leaves_is_dropped_by_the_engine():
    from arl_tangram.core import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine

    host = _Host()
    engine = Engine(Cluster(models=(ModelSpec("m", 4.0, 1),)), tangram_policy(), {Pool.GPU: host}, ManualClock())
    a = engine.add_gpu_node(GpuNode("a", 1, 10.0, 1))
    engine.schedule()
    assert engine.loading and engine.gpu.meter.running == 1.0
    assert engine.remove_gpu_node(a) == [host.prefetched[0].key]
    assert not engine.loading and engine.gpu.meter.running == 0 and engine.gpu.meter.held == 0
    assert engine.submit(_model_action("late")) is not None  # no GPUs left: rejected, saying so


def test_the_node_agent_hosts_model_services_on_its_own_devices():
    """The agent's model host on CPU devices, driven as the head drives it (its own GPU ids)."""
    pytest.importorskip("torch")
    from arl_tangram.core.action import GPU, Setup
    from arl_tangram.managers.models.spec import ModelCall, ModelServiceConfig
    from arl_tangram.runtime.agent import NodeAgent

    tiny = "arl_tangram.managers.models.tiny"

    async def main():
        agent = NodeAgent("n", 0, sandboxes=False, models=[ModelServiceConfig("t", f"{tiny}:teacher_model")],
                          gpus=2, gpu_memory_gb=4.0, model_device="cpu")
        info = await agent.start()
        assert info["sandboxes"] is False and info["gpu_node"].gpus == 2 and info["gpu_node"].gpu_memory_gb == 4.0
        assert [s.name for s in info["model_specs"]] == ["t"] and info["model_cards"]["t"].ops == ("logprobs",)
        await agent.prefetch("k", "t", (1,), 1.0)
        assert ("t", (1,)) in agent.models.instances
        action = Action("c", "model:t", Demand({"gpu": (1, 1)}), payload=ModelCall("logprobs", [[1, 2, 3]]))
        c = await agent.run(action, Allocation(GPU, 0, (1,), Setup.NONE))
        agent.evict("t", (1,))
        await agent.shut_down()
        return c

    c = asyncio.run(main())
    assert c.outcome is Outcome.OK and len(c.result) == 1 and len(c.result[0]) == 2


def test_with_gpus_that_may_join_a_model_action_waits_for_them_instead_of_being_refused():
    from arl_tangram.core import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine

    host = _Host()
    engine = Engine(Cluster(models=(ModelSpec("m", 4.0, 1), ModelSpec("big", 8.0, 2))), tangram_policy(),
                    {Pool.GPU: host}, ManualClock(), max_queue_s=60.0)
    assert engine.submit(_model_action("refused")) is not None  # a fixed cluster without GPUs refuses
    engine.gpus_may_join = True
    assert engine.submit(_model_action("waits")) is None
    assert engine.submit(Action("wide", "model:big", Demand({"gpu": (2, 2)}))) is None
    engine.schedule()
    assert not host.started and "a GPU node to join" in engine.why_waiting(engine.pending["waits"]).detail
    a = engine.add_gpu_node(GpuNode("a", 1, 10.0, 1))
    engine.schedule()
    assert [act.id for act, _ in host.started] == ["waits"]
    assert "2 GPU(s) in one island" in engine.why_waiting(engine.pending["wide"]).detail  # this node is too small
    engine.remove_gpu_node(a)
    engine.add_gpu_node(GpuNode("b", 2, 10.0, 2))
    engine.schedule()
    assert [act.id for act, _ in host.started] == ["waits", "wide"] and host.started[1][1].units == (1, 2)
