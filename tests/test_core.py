import pytest

from arl_tangram.core import Action, ApiQuota, Demand, InvalidAction, scale_cluster, uniform_cluster
from arl_tangram.core.pools import CapacityError, CpuPool, GpuPool
from arl_tangram.core.cluster import GpuNode


def test_demand_validation_names_the_field():
    with pytest.raises(InvalidAction) as e:
        Demand({"cpu": (4, 2)})
    assert e.value.field == "demand.cpu"
    with pytest.raises(InvalidAction) as e:
        Demand({"tpu": (1, 1)})
    assert e.value.field == "demand.tpu"


def test_action_validation_names_the_field():
    with pytest.raises(InvalidAction) as e:
        Action("a", "teleport")
    assert e.value.field == "service"
    with pytest.raises(InvalidAction) as e:
        Action("a", "sandbox", parallel_fraction=1.5)
    assert e.value.field == "parallel_fraction"
    with pytest.raises(InvalidAction) as e:
        Action("a", "sandbox", Demand.of(cpu=(1, 3)), speedup=(1.0, 1.5))
    assert e.value.field == "speedup"
    with pytest.raises(InvalidAction) as e:
        Action("", "sandbox")
    assert e.value.field == "id"
    for bad in (2.5, -1):
        with pytest.raises(InvalidAction) as e:
            Action("a", "sandbox", remaining_turns=bad)
        assert e.value.field == "remaining_turns"


def test_an_integral_count_of_turns_is_stored_as_an_int():
    # a float from JSON (2.0) is the int it equals, compiled or not (the compiled field is an int)
    a = Action("a", "sandbox", remaining_turns=2.0)
    assert a.remaining_turns == 2 and type(a.remaining_turns) is int


def test_pools_and_default_demands():
    assert Action("a", "sandbox").pool == "cpu" and Action("a", "sandbox").demand.min("cpu") == 1
    m = Action("m", "model:rm-7b", Demand.of(gpu=2))
    assert m.pool == "gpu" and m.model == "rm-7b"
    assert Action("q", "api:search").pool == "api:search"


def test_speed_factor_amdahl_and_table():
    a = Action("a", "sandbox", Demand.of(cpu=(1, 8)), parallel_fraction=0.8)
    assert a.speed_factor(1) == 1.0
    assert a.speed_factor(4) == pytest.approx(0.2 + 0.8 / 4)
    assert a.speed_factor(100) == a.speed_factor(8)  # capped at max
    t = Action("t", "sandbox", Demand.of(cpu=(2, 4)), speedup=(1.0, 1.4, 1.7))
    assert t.speed_factor(3) == pytest.approx(1 / 1.4)
    assert t.speed_factor(4) == pytest.approx(1 / 1.7)


def test_cpu_pool_best_node_and_capacity_checks():
    pool = CpuPool(uniform_cluster(cpus=12, cpu_nodes=3).cpu_nodes)
    assert pool.capacity == 12
    a = pool.take(0, 3)
    assert len(a) == 3 and pool.nfree(0) == 1
    assert pool.best_node(2) in (1, 2)
    assert pool.best_node(5) is None
    with pytest.raises(CapacityError):
        pool.take(0, 2)
    pool.give(0, a)
    assert pool.nfree(0) == 4 and pool.total_free == 12
    with pytest.raises(CapacityError):
        pool.give(0, (99,))


def test_gpu_blocks_stay_inside_islands():
    pool = GpuPool((GpuNode("g", 8, island_size=4),))
    blocks = list(pool.blocks(2))
    assert blocks == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert list(pool.blocks(4)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert list(pool.blocks(8)) == []  # no island of 8


def test_gpu_memory_is_never_oversubscribed():
    pool = GpuPool((GpuNode("g", 2, gpu_memory_gb=80, island_size=2),))
    pool.add_instance("a", (0,), 50)
    with pytest.raises(CapacityError):
        pool.add_instance("b", (0, 1), 40)
    inst = pool.add_instance("b", (1,), 40)
    pool.evict(inst)
    assert pool.free_gb(1) == 80


def test_scale_cluster_halves_every_pool():
    c = uniform_cluster(cpus=512, cpu_nodes=8, gpus=64, gpus_per_node=8,
                        quotas=(ApiQuota("search", 40, 32),))
    h = scale_cluster(c, 0.5)
    assert h.total_cores == 256 and len(h.cpu_nodes) == 4
    assert h.total_gpus == 32 and all(n.gpus == 8 for n in h.gpu_nodes)
    assert h.quotas[0].concurrency == 16 and h.quotas[0].rate_per_s == 20
    small = scale_cluster(uniform_cluster(gpus=8), 0.25)
    assert small.total_gpus == 2 and small.gpu_nodes[0].island_size == 2
    with pytest.raises(ValueError):
        scale_cluster(c, 0)


def test_best_node_is_the_node_with_most_free_cores_through_any_take_and_give():
    """best_node keeps a lazily lowered pointer to the fullest bucket (the scheduler's hot path);
    it must agree with a scan of every node after any sequence of takes and gives."""
    import random

    from arl_tangram.core.pools import CpuPool

    from arl_tangram.core.cluster import CpuNode

    rng = random.Random(3)
    pool = CpuPool(uniform_cluster(cpus=40, cpu_nodes=5).cpu_nodes)
    held: list[tuple[int, tuple[int, ...]]] = []
    for step in range(2000):
        if step == 1000:  # a bigger node joins while the pool is in use
            pool.add_node(CpuNode("big", 16, 64.0))
        nodes = len(pool.nodes)
        if held and rng.random() < 0.5:
            pool.give(*held.pop(rng.randrange(len(held))))
        else:
            node = rng.randrange(nodes)
            n = rng.randint(0, pool.nfree(node))
            held.append((node, pool.take(node, n)))
        need = rng.randint(1, 16)
        best = pool.best_node(need)
        most = max(pool.nfree(i) for i in range(nodes))
        if most < need:
            assert best is None
        else:
            assert pool.nfree(best) == most
