"""The real policies' decisions on small hand-built pools."""

import pytest

from arl_tangram.core import ApiQuota, ModelSpec, Outcome, uniform_cluster
from arl_tangram.core.cluster import Cluster, CpuNode, GpuNode
from arl_tangram.policy import Costs, TaskIsolatedPolicy, TrajectoryStaticPolicy, fifo_policy, tangram_policy


def cpu_cluster(cores=4, nodes=1):
    return uniform_cluster(cpus=cores * nodes, cpu_nodes=nodes)


# -- priority -----------------------------------------------------------------------------------

def test_srpt_runs_the_shorter_predicted_action_first(harness):
    h = harness(cpu_cluster(1), tangram_policy())
    h.submit("blocker", hint_s=1)
    h.schedule()
    h.submit("long", hint_s=60)
    h.submit("short", hint_s=0.5)
    assert h.schedule() == {}
    h.complete("blocker")
    assert list(h.schedule()) == ["short"]


def test_fifo_runs_in_arrival_order(harness):
    h = harness(cpu_cluster(1), fifo_policy())
    h.submit("blocker")
    h.schedule()
    h.submit("long", hint_s=60)
    h.submit("short", hint_s=0.5)
    h.complete("blocker")
    assert list(h.schedule()) == ["long"]


def test_aging_lets_a_long_action_overtake_newcomers(harness):
    h = harness(cpu_cluster(1), tangram_policy(aging_per_s=0.1))
    h.submit("blocker", hint_s=1)
    h.schedule()
    h.submit("long", hint_s=10)
    h.advance(200)  # waited long enough: 10 - 0.1*0 < 0.5 + 0.1*200
    h.submit("short", hint_s=0.5)
    h.complete("blocker")
    assert list(h.schedule()) == ["long"]



@pytest.mark.parametrize("gpu_aging, first", [(0.6, "long"), (0.1, "short")])
def test_a_model_call_ages_at_the_gpu_rate(harness, gpu_aging, first):
    """A queued 8 s teacher call and a 0.5 s one submitted 20 s later: at the GPU rate (0.6/s,
    the default) the old call has waited long enough (8 + 0 < 0.5 + 0.6*20); at the sandbox rate
    (0.1/s) the newcomer would still pass it (8 > 0.5 + 0.1*20)."""
    h = harness(gpu_cluster(1, island=1, models=[ModelSpec("m", 10, 1)]), tangram_policy(gpu_aging_per_s=gpu_aging))
    h.submit("blocker", "model:m", gpu=1, hint_s=1)
    h.schedule()
    h.submit("long", "model:m", gpu=1, hint_s=8)
    h.advance(20)
    h.submit("short", "model:m", gpu=1, hint_s=0.5)
    assert h.schedule() == {}
    h.complete("blocker")
    assert list(h.schedule()) == [first]

def test_predictor_learns_from_history_per_operation(harness):
    h = harness(cpu_cluster(1), tangram_policy())
    for i in range(5):  # "test" runs take 30 s, "ls" 0.1 s
        h.submit(f"t{i}", operation="test")
        h.schedule()
        h.complete(f"t{i}", exec_s=30)
        h.submit(f"l{i}", operation="ls")
        h.schedule()
        h.complete(f"l{i}", exec_s=0.1)
    h.submit("blocker", operation="ls")
    h.schedule()
    h.submit("test-next", operation="test")
    h.submit("ls-next", operation="ls")
    h.complete("blocker", exec_s=0.1)
    assert list(h.schedule()) == ["ls-next"]


# -- elasticity -----------------------------------------------------------------------------------

def test_elastic_action_gets_spare_cores_only_when_nothing_waits(harness):
    h = harness(cpu_cluster(16), tangram_policy(elastic_reserve_fraction=0.0))
    h.submit("e", cpu=(1, 8), parallel_fraction=0.9, hint_s=60)
    started = h.schedule()
    assert started["e"].count == 8
    h2 = harness(cpu_cluster(4), tangram_policy(elastic_reserve_fraction=0.0))
    for i in range(5):
        h2.submit(f"a{i}", cpu=(1, 8), parallel_fraction=0.9, hint_s=60)
    started = h2.schedule()
    assert len(started) == 4 and all(a.count == 1 for a in started.values())


def test_serial_actions_are_not_grown(harness):
    h = harness(cpu_cluster(16), tangram_policy(elastic_reserve_fraction=0.0))
    h.submit("serial", cpu=(1, 8), parallel_fraction=0.0, hint_s=60)
    assert h.schedule()["serial"].count == 1


def test_water_filling_favours_the_larger_marginal_gain(harness):
    h = harness(cpu_cluster(8), tangram_policy(elastic_reserve_fraction=0.0))
    h.submit("par", cpu=(1, 8), parallel_fraction=0.95, hint_s=100)
    h.submit("weak", cpu=(1, 8), parallel_fraction=0.3, hint_s=100)
    got = h.schedule()
    assert got["par"].count + got["weak"].count <= 8
    assert got["par"].count > got["weak"].count >= 1


def test_fifo_never_grows(harness):
    h = harness(cpu_cluster(16), fifo_policy())
    h.submit("e", cpu=(1, 8), parallel_fraction=0.9, hint_s=60)
    assert h.schedule()["e"].count == 1


# -- placement: sessions --------------------------------------------------------------------------

def test_session_sticks_to_its_node_and_thaws(harness):
    h = harness(cpu_cluster(4, nodes=4), tangram_policy())
    h.submit("s1", trajectory="t")
    first = h.schedule()["s1"]
    assert first.setup == "create"
    h.complete("s1")
    for i in range(3):  # other sessions land elsewhere
        h.submit(f"o{i}", trajectory=f"other{i}")
    h.schedule()
    h.submit("s2", trajectory="t")
    second = h.schedule()["s2"]
    assert second.node == first.node and second.setup == "thaw"


def _home_full_other_free(h):
    """Session t lives on one node, that node is busy and the other node has a free core."""
    h.submit("s1", trajectory="t")
    home = h.schedule()["s1"].node
    h.complete("s1")
    h.submit("hog1", hint_s=100)
    h.submit("hog2", hint_s=100)
    got = h.schedule()
    away = next(i for i, a in got.items() if a.node != home)
    h.complete(away)
    h.submit("s2", trajectory="t")
    return home


def test_fifo_waits_for_the_home_node_instead_of_migrating(harness):
    h = harness(cpu_cluster(1, nodes=2), fifo_policy())
    _home_full_other_free(h)
    assert h.schedule() == {}


def test_tangram_migrates_instead_of_waiting(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy())
    home = _home_full_other_free(h)
    got = h.schedule()["s2"]
    assert got.node != home and got.setup == "restore"
    assert h.engine.cpu.homes["t"] == got.node


def _home_busy_for(h, busy_s):
    """Session t's node runs one action predicted to end in ``busy_s`` (its own job: no
    observation of ``sandbox`` steps mixes into the prediction); the other node has a free core."""
    h.submit("s1", trajectory="t")
    home = h.schedule()["s1"].node
    h.complete("s1")
    h.submit("hog1", job="hogs", hint_s=busy_s)
    h.submit("hog2", job="hogs", hint_s=busy_s)
    got = h.schedule()
    h.complete(next(i for i, a in got.items() if a.node != home), exec_s=busy_s)
    h.submit("s2", trajectory="t")
    return home, next(i for i, a in got.items() if a.node == home)


@pytest.mark.parametrize("busy_s, moves", [(0.1, False), (0.3, False), (0.4, True), (5.0, True)])
def test_a_session_moves_only_when_the_wait_it_saves_is_more_than_the_move_costs(harness, busy_s, moves):
    """Issue 24: the policy prices a move as the simulator charges it (``Costs.session_restore_s``,
    here what a real move measured on Ray: 0.32 s)."""
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.32))
    home, hog = _home_busy_for(h, busy_s)
    got = h.schedule()
    if moves:
        assert got["s2"].node != home and got["s2"].setup == "restore"
    else:
        assert got == {}  # it waits for its home node
        h.complete(hog)
        again = h.schedule()["s2"]
        assert again.node == home and again.setup == "thaw"


def test_unpriced_moves_go_whenever_the_home_is_full(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(price_moves=False), costs=Costs(session_restore_s=0.32))
    home, _ = _home_busy_for(h, 0.1)
    got = h.schedule()["s2"]
    assert got.node != home and got.setup == "restore"


def _home_full_for(h, busy_s):
    """Session t's home node (4 cores) runs a 4-core action predicted to end in ``busy_s`` (its
    own job, as ``_home_busy_for``); the other node is idle."""
    h.submit("s1", trajectory="t")
    home = h.schedule()["s1"].node
    h.complete("s1")
    h.submit("hog1", job="hogs", cpu=4, hint_s=busy_s)
    h.submit("hog2", job="hogs", cpu=4, hint_s=busy_s)
    got = h.schedule()
    h.complete(next(i for i, a in got.items() if a.node != home), exec_s=busy_s)
    return home


@pytest.mark.parametrize("another_waits", [False, True])
def test_a_step_waiting_for_its_home_by_choice_is_no_queue_for_elasticity(harness, another_waits):
    """Issue 24's move pricing: a step that chose to wait for its full home node (the wait is
    shorter than a move) does not stop an elastic action on the other node from growing (counted
    as a queue, it stopped all growth: ``Options.price_moves``); an action that waits because
    nothing fits it still does."""
    h = harness(cpu_cluster(4, nodes=2), tangram_policy(elastic_reserve_fraction=0.0),
                costs=Costs(session_restore_s=0.32))
    home = _home_full_for(h, 0.1)
    h.submit("s2", trajectory="t", hint_s=0.5)
    h.submit("e", job="other", cpu=(1, 4), parallel_fraction=0.9, hint_s=60)
    if another_waits:
        h.submit("big", job="other", cpu=4, hint_s=100)
    got = h.schedule()
    assert "s2" not in got and "big" not in got  # s2 waits for its home; nothing fits big
    assert got["e"].node != home
    assert got["e"].count == (1 if another_waits else 4)


def test_nothing_grows_into_the_home_a_step_chose_to_wait_for(harness):
    """Sessions t and u live on one node, which has 2 free cores; t's step needs 3 and chose to
    wait for them (the hog there ends before a move would). u's elastic step starts there at its
    minimum and does not grow into the core t's step waits for; an action on the other node does."""
    h = harness(cpu_cluster(4, nodes=2), tangram_policy(elastic_reserve_fraction=0.0),
                costs=Costs(session_restore_s=0.32))
    h.submit("s1", trajectory="t")
    home = h.schedule()["s1"].node
    h.submit("blocker", job="b", cpu=4)  # fills the other node, so u's session lands beside t's
    h.submit("u1", trajectory="u")
    got = h.schedule()
    assert got["u1"].node == home and got["blocker"].node != home
    h.complete("s1")
    h.complete("u1")
    h.submit("hog", job="hogs", cpu=2, hint_s=0.1)
    assert h.schedule()["hog"].node == home
    h.complete("blocker")
    h.submit("s2", trajectory="t", cpu=3, hint_s=0.5)
    h.submit("u2", trajectory="u", cpu=(1, 4), parallel_fraction=0.9, hint_s=60)
    h.submit("e", job="other", cpu=(1, 4), parallel_fraction=0.9, hint_s=60)
    got = h.schedule()
    assert "s2" not in got  # it waits for its home
    assert got["u2"].node == home and got["u2"].count == 1
    assert got["e"].node != home and got["e"].count == 4


def test_the_wait_counts_down_as_the_home_node_runs(harness):
    """A 2 s action on the home node, 1.8 s in: 0.2 s are left, less than the move, so the step
    waits; past its prediction it is expected to run as long again, and the step moves."""
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.5))
    home, _ = _home_busy_for(h, 2.0)
    h.advance(1.8)
    assert h.schedule() == {}
    h.advance(0.5)  # now past its prediction (2.3 s of 2 s): expected to run as long again
    got = h.schedule()
    assert got["s2"].node != home and got["s2"].setup == "restore"


def test_a_session_on_a_draining_node_moves_however_short_the_wait(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=10.0))
    home, _ = _home_busy_for(h, 0.01)
    h.engine.drain_cpu_node(home)
    got = h.schedule()
    assert got["s2"].node != home and got["s2"].setup == "restore"


def _two_sessions_one_home_busy(h, busy_s=5.0):
    """Sessions t and u live on nodes of their own (1 core each); t's node runs a hog predicted to
    take ``busy_s``, u's node has its core free. Returns (t's home, u's home)."""
    h.submit("t1", trajectory="t")
    h.submit("u1", trajectory="u")
    got = h.schedule()
    t_home, u_home = got["t1"].node, got["u1"].node
    assert t_home != u_home
    h.complete("t1")
    h.complete("u1")
    h.submit("hog1", job="hogs", hint_s=busy_s)
    h.submit("hog2", job="hogs", hint_s=busy_s)
    got = h.schedule()
    h.complete(next(i for i, a in got.items() if a.node == u_home), exec_s=busy_s)
    return t_home, u_home


@pytest.mark.parametrize("idle_moves", [True, False])
def test_no_move_to_a_node_whose_own_sessions_wait_for_it(harness, idle_moves):
    """t's home is busy for 5 s (far longer than a move) and u's node has a core free, but u's own
    step waits for it: moving t there would make u's step wait behind t's move. t's step (the
    shorter, so considered first) waits for its home and u's step runs at home; without
    ``idle_moves`` (any node with room) t takes u's core and u waits."""
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(idle_moves=idle_moves), costs=Costs(session_restore_s=0.32))
    t_home, u_home = _two_sessions_one_home_busy(h)
    h.submit("t2", trajectory="t", hint_s=0.1)
    h.submit("u2", trajectory="u", hint_s=1.0)
    got = h.schedule()
    if idle_moves:
        assert set(got) == {"u2"} and got["u2"].node == u_home and got["u2"].setup == "thaw"
        assert h.engine.cpu.homes["t"] == t_home
    else:
        assert set(got) == {"t2"} and got["t2"].node == u_home and got["t2"].setup == "restore"


def test_a_move_goes_to_the_idle_node_not_the_one_with_a_queue(harness):
    """Three nodes of one core: t's home (node 0) is busy for 5 s; node 1 (u's home) and node 2
    are free, but u's step waits for node 1. t moves (the wait is longer than the move) to the
    idle node 2, and u's step runs at home."""
    h = harness(cpu_cluster(1, nodes=3), tangram_policy(), costs=Costs(session_restore_s=0.32))
    h.engine.adopt_session("t", 0)
    h.engine.adopt_session("u", 1)
    for i in range(3):
        h.submit(f"hog{i}", job="hogs", hint_s=5.0)
    got = h.schedule()
    for hog, alloc in got.items():
        if alloc.node != 0:
            h.complete(hog, exec_s=5.0)
    h.submit("t2", trajectory="t", hint_s=0.1)
    h.submit("u2", trajectory="u", hint_s=1.0)
    got = h.schedule()
    assert got["t2"].node == 2 and got["t2"].setup == "restore"
    assert got["u2"].node == 1 and got["u2"].setup == "thaw"


def test_steps_waiting_for_one_home_wait_in_turn_and_only_the_one_past_the_price_moves(harness):
    """Five sessions live on node 0 (one core), busy for 0.1 s more; node 1 is idle. Each of their
    steps (0.1 s each, predicted) waits behind the ones before it: 0.1, 0.2, 0.3 s are less than
    the move (0.32 s), so those three wait; the fourth would wait 0.4 s and moves to node 1; the
    fifth finds no idle node left and waits. (Where a later step counted only the cores that the
    running actions free, the second found none on a one-core node and moved at once.)"""
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.32))
    for i in range(5):
        h.engine.adopt_session(f"t{i}", 0)
    h.submit("hog0", job="hogs", hint_s=0.1)
    h.submit("hog1", job="hogs", hint_s=0.1)
    got = h.schedule()
    h.complete(next(i for i, a in got.items() if a.node == 1), exec_s=0.1)
    for i in range(5):
        h.submit(f"step{i}", trajectory=f"t{i}", hint_s=0.1)
    got = h.schedule()
    assert set(got) == {"step3"} and got["step3"].node == 1 and got["step3"].setup == "restore", got


def test_a_pinned_session_is_never_moved_for_balance(harness):
    """A session the runtime pinned home (its state cannot be carried) waits for its busy home
    however long the wait and however idle the other node, and runs there when a core frees."""
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.32))
    home, hog = _home_busy_for(h, 100.0)
    h.engine.cpu.pin("t")
    assert h.schedule() == {}
    h.advance(50)
    assert h.schedule() == {}
    h.complete(hog)
    got = h.schedule()["s2"]
    assert got.node == home and got.setup == "thaw"
    assert "t" in h.engine.cpu.pinned  # until the session ends
    h.complete("s2")
    h.engine.end_trajectory("t")
    assert "t" not in h.engine.cpu.pinned


def test_unpinned_the_session_moves_again(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.32))
    home, _ = _home_busy_for(h, 100.0)
    h.engine.cpu.pin("t")
    assert h.schedule() == {}
    h.engine.cpu.unpin("t")
    got = h.schedule()["s2"]
    assert got.node != home and got.setup == "restore"


def test_a_pinned_session_on_a_draining_node_still_moves(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy(), costs=Costs(session_restore_s=0.32))
    home, _ = _home_busy_for(h, 100.0)
    h.engine.cpu.pin("t")
    h.engine.drain_cpu_node(home)
    got = h.schedule()["s2"]
    assert got.node != home and got.setup == "restore"
    assert "t" in h.engine.cpu.pinned  # it stays home on its new node


def test_a_pin_outlives_a_rehoming_and_goes_with_a_lost_node(harness):
    h = harness(cpu_cluster(1, nodes=2), tangram_policy())
    h.submit("s1", trajectory="t")
    home = h.schedule()["s1"].node
    cpu = h.engine.cpu
    cpu.pin("t")
    cpu.attach("t", 1 - home, 0.5)  # the runtime homes it again (a step that stayed)
    assert "t" in cpu.pinned
    h.complete("s1")
    assert h.engine.remove_cpu_node(1 - home, "lost") == ["t"]
    assert "t" not in cpu.pinned
    with pytest.raises(ValueError, match="session"):
        cpu.pin("")


def test_ending_a_trajectory_frees_its_session_memory(harness):
    c = Cluster(cpu_nodes=(CpuNode("n", 8, memory_gb=4),))
    h = harness(c, tangram_policy(), costs=Costs(session_mem_gb=2))
    h.submit("a", trajectory="t1")
    h.submit("b", trajectory="t2")
    h.submit("c", trajectory="t3")
    assert set(h.schedule()) == {"a", "b"}  # memory for two sessions only
    h.complete("a")
    h.engine.end_trajectory("t1")
    assert set(h.schedule()) == {"c"}
    assert h.rec.closed == ["t1"]


# -- placement: images ----------------------------------------------------------------------------

def _imaged(h, id, image, trajectory=None):
    from arl_tangram.managers.sandbox.spec import Exec, RunCode

    payload = Exec(command="true", image=image) if trajectory else RunCode(code="print(1)", image=image)
    return h.submit(id, cpu=1, trajectory=trajectory, payload=payload)


def _three_nodes(h_factory):
    """Nodes a (4 cores), b (2) and c (4); b holds image ``img``."""
    c = Cluster(cpu_nodes=(CpuNode("a", 4, memory_gb=8), CpuNode("b", 2, memory_gb=8), CpuNode("c", 4, memory_gb=8)))
    h = h_factory(c, tangram_policy(), costs=Costs(session_mem_gb=1))
    h.engine.cpu.hold_images(1, ["img"])
    return h


def test_a_one_shot_naming_an_image_goes_to_a_node_holding_it_while_it_has_room(harness):
    """b holds the image: one-shots naming it go there although a and c have more cores free,
    until b is full; then where any one-shot goes (and that node pulls). One naming another image
    or none goes to the node with the most free cores."""
    h = _three_nodes(harness)
    _imaged(h, "i1", "img")
    _imaged(h, "x", "other")
    h.submit("plain", cpu=1)
    got = h.schedule()
    assert got["i1"].node == 1
    assert got["x"].node != 1 and got["plain"].node != 1
    _imaged(h, "i2", "img")
    assert h.schedule()["i2"].node == 1
    _imaged(h, "i3", "img")  # b is full now
    assert h.schedule()["i3"].node in (0, 2)


def test_a_new_session_naming_an_image_starts_on_a_node_holding_it(harness):
    h = _three_nodes(harness)
    _imaged(h, "s1", "img", trajectory="t")
    got = h.schedule()["s1"]
    assert got.node == 1 and got.setup == "create"
    assert h.engine.cpu.homes["t"] == 1


def test_an_image_held_by_another_name_is_found_through_image_names(harness):
    """The runtime's stores know an image by its full reference too: ``image_names`` says which
    names an action's image may be held by."""
    from arl_tangram.core.pools import named_image

    h = _three_nodes(harness)
    cpu = h.engine.cpu
    cpu.hold_images(1, ["docker.io/library/python:3.12"])
    short = _imaged(h, "short", "python:3.12")
    assert cpu.image_holders(short) is None  # by its name alone: held nowhere
    assert h.schedule()["short"].node != 1
    cpu.image_names = lambda a: [n for i in named_image(a) for n in (i, "docker.io/library/" + i)]
    assert cpu.image_holders(short) == {1}
    _imaged(h, "i", "python:3.12")
    assert h.schedule()["i"].node == 1


def test_image_holdings_follow_the_reports_and_the_nodes(harness):
    h = _three_nodes(harness)
    cpu = h.engine.cpu
    cpu.hold_images(0, ["img", "base"])
    assert cpu.image_nodes == {"img": {0, 1}, "base": {0}}
    cpu.hold_images(0, ["base"])  # a report replaces what the node held
    assert cpu.image_nodes == {"img": {1}, "base": {0}}
    h.engine.drain_cpu_node(1)
    assert cpu.image_nodes == {"base": {0}} and cpu.images[1] == frozenset()
    cpu.hold_images(1, ["img"])  # a drained node takes no work: it holds nothing for placement
    assert "img" not in cpu.image_nodes
    new = h.engine.add_cpu_node(CpuNode("d", 2, memory_gb=8))
    cpu.hold_images(new, ["img"])
    _imaged(h, "i", "img")
    assert h.schedule()["i"].node == new
    with pytest.raises(ValueError, match="node 9"):
        cpu.hold_images(9, ["img"])
    with pytest.raises(ValueError, match="string"):
        cpu.hold_images(0, "img")
    with pytest.raises(ValueError, match="non-empty strings"):
        cpu.hold_images(0, ["img", 3])
    assert cpu.images[0] == frozenset({"base"})  # a bad report changes nothing


# -- placement: GPUs ------------------------------------------------------------------------------

def gpu_cluster(gpus=8, island=4, mem=80, models=()):
    return Cluster(gpu_nodes=(GpuNode("g", gpus, mem, island, 25.0),), models=tuple(models))


def test_multi_gpu_instance_stays_inside_one_island(harness):
    h = harness(gpu_cluster(8, island=4, models=[ModelSpec("big", 100, 4)]), tangram_policy())
    h.submit("x", "model:big", gpu=4)
    block = h.schedule()["x"].units
    islands = {h.engine.gpu.gpus[g].island for g in block}
    assert len(islands) == 1 and len(block) == 4


def test_big_instance_waits_for_a_whole_island(harness):
    h = harness(gpu_cluster(8, island=4, models=[ModelSpec("small", 10, 1), ModelSpec("big", 100, 4)]),
                tangram_policy())
    h.submit("s1", "model:small", gpu=1)
    h.submit("s2", "model:small", gpu=1)
    h.schedule()
    a1, a2 = h.allocation("s1").units, h.allocation("s2").units
    islands = {h.engine.gpu.gpus[g].island for g in a1 + a2}
    h.submit("b", "model:big", gpu=4)
    got = h.schedule()
    if len(islands) == 2:  # both islands dirty: the big one must wait
        assert got == {}
    else:
        assert set(got["b"].units).isdisjoint(a1 + a2)


def test_resident_model_is_reused_without_a_load(harness):
    h = harness(gpu_cluster(2, island=2, models=[ModelSpec("rm", 14, 1)]), tangram_policy())
    h.submit("r1", "model:rm")
    first = h.schedule()["r1"]
    assert first.setup == "load"
    h.complete("r1")
    h.submit("r2", "model:rm")
    second = h.schedule()["r2"]
    assert second.setup == "" and second.units == first.units


def test_cost_aware_eviction_keeps_the_popular_model(harness):
    models = [ModelSpec("hot", 60, 1), ModelSpec("cold", 60, 1), ModelSpec("new", 60, 1)]
    h = harness(gpu_cluster(2, island=2, mem=80, models=models), tangram_policy())
    h.submit("c0", "model:cold")
    h.submit("h0", "model:hot")
    h.schedule()
    h.complete("c0")
    h.complete("h0")
    for i in range(1, 6):  # hot is asked for again and again
        h.advance(1)
        h.submit(f"h{i}", "model:hot")
        h.schedule()
        h.complete(f"h{i}")
    h.advance(1)
    h.submit("n", "model:new")
    got = h.schedule()["n"]
    assert [m for m, _ in got.evict] == ["cold"]
    assert h.engine.gpu.instances["hot"]


def test_waits_for_a_busy_resident_instance_when_loading_is_slower(harness):
    h = harness(gpu_cluster(2, island=2, models=[ModelSpec("m", 70, 1)]), tangram_policy())
    h.submit("m1", "model:m", hint_s=0.2)
    h.schedule()
    h.submit("m2", "model:m", hint_s=0.2)
    assert h.schedule() == {}  # 70 GB at 25 GB/s = 2.8 s load > 0.2 s wait
    h.complete("m1", exec_s=0.2)
    assert h.schedule()["m2"].setup == ""


def test_loads_another_instance_when_the_backlog_is_long(harness):
    h = harness(gpu_cluster(2, island=2, models=[ModelSpec("m", 10, 1)]), tangram_policy())
    for i in range(10):
        h.submit(f"m{i}", "model:m", hint_s=2.0)
    got = h.schedule()
    assert len(got) == 2 and {a.units for a in got.values()} == {(0,), (1,)}


@pytest.mark.parametrize("priced, first", [(True, "b1"), (False, "a1")])
def test_a_start_that_would_evict_a_copy_its_own_queue_needs_yields_to_that_queue(harness, priced, first):
    """Two GPUs, one 60 GB model each. A's copy is busy for a long time, B's is idle; a1 (A) is
    older than b1 (B). Loading A over B's copy (2.4 s, plus B's expected reload) is slower than
    waiting a turn, so with the setup priced at dispatch b1 runs on its resident copy and a1 waits
    for a GPU; unpriced, a1 evicts the copy b1 needs next (the churn of mopd at 0.125x)."""
    models = [ModelSpec("A", 60, 1), ModelSpec("B", 60, 1)]
    h = harness(gpu_cluster(2, island=2, mem=80, models=models), tangram_policy(prefetch=False, dispatch_setup=priced))
    h.submit("a0", "model:A", gpu=1, hint_s=100)
    h.submit("b0", "model:B", gpu=1, hint_s=0.1)
    assert set(h.schedule()) == {"a0", "b0"}
    h.complete("b0", exec_s=0.1)
    h.advance(1)
    h.submit("a1", "model:A", gpu=1, hint_s=1)
    h.advance(1)
    h.submit("b1", "model:B", gpu=1, hint_s=1)
    got = h.schedule()
    assert list(got) == [first]
    assert [m for m, _ in got[first].evict] == ([] if priced else ["B"])


@pytest.mark.parametrize("counts, first", [(True, "ta#1"), (False, "tb#0")])
def test_the_setup_price_never_defers_a_call_past_its_trajectorys_slack(harness, counts, first):
    """As above, but the older call's trajectory 'ta' has 30 turns left and is projected to end
    the step (no slack): with the client's counts it is not deferred and evicts B's copy; without
    them nothing says it is critical and it yields to tb#0 on the resident copy."""
    models = [ModelSpec("A", 60, 1), ModelSpec("B", 60, 1)]
    h = harness(gpu_cluster(2, island=2, mem=80, models=models), tangram_policy(prefetch=False))

    def left(n):
        return {"remaining_turns": n} if counts else {}

    h.submit("a0", "model:A", gpu=1, hint_s=100)
    h.submit("ta#0", "model:B", gpu=1, hint_s=0.1, trajectory="ta", step=0, **left(5))
    assert set(h.schedule()) == {"a0", "ta#0"}
    h.complete("ta#0", exec_s=0.1)
    h.advance(1)
    h.submit("ta#1", "model:A", gpu=1, hint_s=1, trajectory="ta", step=0, **left(30))
    h.advance(1)
    h.submit("tb#0", "model:B", gpu=1, hint_s=1, trajectory="tb", step=0, **left(0))
    assert list(h.schedule()) == [first]


# -- quotas ---------------------------------------------------------------------------------------

def test_quota_concurrency_and_rate_are_respected(harness):
    q = ApiQuota("search", rate_per_s=2, concurrency=3, burst=2)
    h = harness(Cluster(quotas=(q,)), tangram_policy())
    for i in range(6):
        h.submit(f"q{i}", "api:search")
    assert len(h.schedule()) == 2  # the bucket holds two tokens
    wake = h.engine.next_wakeup()
    assert wake is not None and abs(wake - 0.5) < 1e-9
    h.advance(0.5)
    assert len(h.schedule()) == 1  # one token refilled; 3 in flight = concurrency
    h.advance(5)
    assert h.schedule() == {}  # tokens but no free slot
    h.complete("q0")
    assert len(h.schedule()) == 1


# -- fairness and critical path ---------------------------------------------------------------------

def test_job_below_its_fair_share_goes_first(harness):
    h = harness(cpu_cluster(4), tangram_policy())
    for i in range(4):
        h.submit(f"a{i}", job="A", hint_s=1)
    h.schedule()
    for i in range(4, 8):
        h.submit(f"a{i}", job="A", hint_s=1)
    h.submit("b0", job="B", hint_s=50)  # longer, yet B holds nothing
    h.complete("a0")
    assert list(h.schedule()) == ["b0"]


def test_without_fair_share_srpt_would_pick_the_other_job(harness):
    h = harness(cpu_cluster(4), tangram_policy(fair_share=False))
    for i in range(4):
        h.submit(f"a{i}", job="A", hint_s=1)
    h.schedule()
    h.submit("a4", job="A", hint_s=1)
    h.submit("b0", job="B", hint_s=50)
    h.complete("a0")
    assert list(h.schedule()) == ["a4"]


def test_a_steps_last_trajectories_do_not_overtake_each_others_queued_actions(harness):
    """The straggler boost is gone (critical.py says why): once most of a step's trajectories have
    ended, a straggler's new action keeps its SRPT place behind the shorter one another straggler
    queued before the threshold (the boost, fixed at submission, put the newer one first)."""
    h = harness(_api_cluster(), tangram_policy(fair_share=False))
    for i in range(10):  # job S, step 0: ten trajectories, one call each so far
        h.submit(f"s{i}", "api:web", job="S", step=0, trajectory=f"t{i}", hint_s=0.1)
    for i in range(10):
        h.complete(next(iter(h.schedule())))
    for i in range(7):
        h.engine.end_trajectory(f"t{i}", "S", 0)
    h.submit("blocker", "api:web", job="S", hint_s=1)
    h.schedule()
    h.submit("older", "api:web", job="S", step=0, trajectory="t8", hint_s=5)  # 7 of 10 ended
    h.engine.end_trajectory("t7", "S", 0)
    h.submit("newer", "api:web", job="S", step=0, trajectory="t9", hint_s=20)  # 8 of 10 ended
    h.complete("blocker")
    assert list(h.schedule()) == ["older"]


# -- outcomes ---------------------------------------------------------------------------------------

def test_impossible_demand_is_rejected_with_the_field_named(harness):
    h = harness(cpu_cluster(4), tangram_policy())
    h.submit("huge", cpu=16)
    assert len(h.finished) == 1
    f = h.finished[0]
    assert f.outcome is Outcome.REJECTED and f.message.startswith("demand.cpu")
    h.submit("gpu", "model:x", weights_gb=1)
    assert h.finished[-1].outcome is Outcome.REJECTED and "GPU" in h.finished[-1].message


def test_cancel_of_a_queued_action_ends_it_once(harness):
    h = harness(cpu_cluster(1), tangram_policy())
    h.submit("run")
    h.schedule()
    h.submit("wait")
    assert h.engine.cancel("wait").outcome is Outcome.CANCELLED
    assert h.engine.cancel("wait") is None
    h.complete("run")
    assert h.schedule() == {}
    assert [f.outcome for f in h.finished] == [Outcome.CANCELLED, Outcome.OK]


# -- static baselines -----------------------------------------------------------------------------

def test_trajectory_static_holds_a_sandbox_for_the_whole_trajectory(harness):
    from arl_tangram.policy import Profile
    h = harness(cpu_cluster(4), TrajectoryStaticPolicy(), profile=Profile(trajectories=2))
    h.submit("t1a", trajectory="t1", cpu=(1, 8), parallel_fraction=0.9)
    got = h.schedule()["t1a"]
    assert got.count == 2 and got.reservation  # k = 4 cores / 2 trajectories
    h.complete("t1a")
    assert h.engine.cpu.total_free == 2  # still held between actions
    h.submit("t2a", trajectory="t2")
    h.submit("t3a", trajectory="t3")
    assert set(h.schedule()) == {"t2a"}  # t3 waits for a sandbox
    h.engine.end_trajectory("t1")
    assert set(h.schedule()) == {"t3a"}


def test_task_isolated_partitions_per_job(harness):
    from arl_tangram.policy import Profile
    prof = Profile(unit_seconds={("A", "cpu"): 3.0, ("B", "cpu"): 1.0})
    h = harness(cpu_cluster(4), TaskIsolatedPolicy(), profile=prof)
    for i in range(4):
        h.submit(f"b{i}", job="B")
    assert len(h.schedule()) == 1  # B owns one core of four, even with A idle


def test_static_gpu_partitions_preload_and_refuse_to_overflow(harness):
    from arl_tangram.policy import InfeasiblePolicy, Profile
    import pytest
    models = [ModelSpec("a", 10, 1), ModelSpec("b", 10, 1)]
    h = harness(gpu_cluster(4, island=4, models=models), TaskIsolatedPolicy(),
                profile=Profile(model_seconds={"a": 3, "b": 1}))
    a_instances = [i for i in h.engine.gpu.instances["a"]]
    assert len(a_instances) == 3 and len(h.engine.gpu.instances["b"]) == 1
    h.submit("x", "model:a")
    assert h.schedule()["x"].setup == ""  # preloaded
    with pytest.raises(InfeasiblePolicy):
        harness(gpu_cluster(1, island=1, models=models), TaskIsolatedPolicy())


def test_an_id_in_flight_cannot_be_submitted_twice(harness):
    import pytest
    from arl_tangram.core import InvalidAction
    h = harness(cpu_cluster(1), tangram_policy())
    h.submit("same")
    with pytest.raises(InvalidAction) as e:
        h.submit("same")
    assert e.value.field == "id"
    h.schedule()
    h.complete("same")
    h.submit("same")  # finished ids are the journal's business, not the engine's memory
    assert "same" in h.engine.pending


# -- static baselines with fewer sandboxes than trajectories (issue 13) ---------------------------

def _two_slot_cluster():
    """One node whose memory holds two sessions (2 GB each): two sandbox slots, many trajectories."""
    return Cluster((CpuNode("n0", 8, memory_gb=4.0),))


def test_task_isolated_trajectories_wait_for_a_sandbox_slot_instead_of_deadlocking(harness):
    h = harness(_two_slot_cluster(), TaskIsolatedPolicy())
    for t in range(20):  # more new trajectories queued than the policy's lookahead
        h.submit(f"t{t}#0", trajectory=f"t{t}")
    assert set(h.schedule()) == {"t0#0", "t1#0"}  # two slots
    h.complete("t0#0")
    h.submit("t0#1", trajectory="t0")  # a trajectory that holds a slot goes on
    assert set(h.schedule()) == {"t0#1"}
    h.complete("t0#1")
    h.complete("t1#0")
    h.engine.end_trajectory("t0")
    h.engine.end_trajectory("t1")
    assert set(h.schedule()) == {"t2#0", "t3#0"}  # slots are handed on first come, first served


def test_every_static_baseline_finishes_code_agent_at_an_eighth_of_the_pool():
    """The issue's reproduction: ``tangram simulate --workload code_agent --scale 0.125`` aborted
    because task-isolated deadlocked; at this scale the memory of 64 cores holds 128 of the 256
    trajectories' sessions at once."""
    from arl_tangram.core import scale_cluster
    from arl_tangram.sim.compare import run_policy
    from arl_tangram.sim.workloads import generate

    wl = generate("code_agent", seed=0, trajectories=160, steps=1)
    cluster = scale_cluster(wl.default_cluster, 0.125)
    for policy in ("task-isolated", "trajectory-static", "fifo", "tangram"):
        run = run_policy(wl, cluster, policy, max_queue_s=None)  # waits, however long, instead of rejections
        assert run.summary.get("infeasible") is None, run.summary.get("infeasible")
        assert run.summary["num_actions"] == wl.num_actions


# -- the step's critical path (issue 13) ------------------------------------------------------------

def _api_cluster(concurrency=1):
    return Cluster(quotas=(ApiQuota("web", 1000.0, concurrency),))


def test_the_trajectory_projected_to_finish_last_goes_first(harness):
    """One quota slot; trajectory 'long' has 20 turns left, 'short' none. Once the job's seconds per
    turn are known, 'long' is on the step's critical path and overtakes the shorter action."""
    h = harness(_api_cluster(), tangram_policy())
    for traj in ("long", "short"):
        h.submit(f"{traj}#0", "api:web", trajectory=traj, step=0, hint_s=1.0, remaining_turns=5)
    h.schedule()
    started = next(iter(h.engine.running))
    h.advance(1.0)
    h.complete(started)
    h.schedule()
    h.advance(1.0)
    h.complete(next(iter(h.engine.running)))
    h.advance(4.0)  # both trajectories come back: seconds per turn are now observed
    h.submit("short#1", "api:web", trajectory="short", step=0, hint_s=0.5, remaining_turns=0)
    h.submit("long#1", "api:web", trajectory="long", step=0, hint_s=2.0, remaining_turns=20)
    assert list(h.schedule()) == ["long#1"]


def test_without_the_signal_shortest_predicted_goes_first(harness):
    h = harness(_api_cluster(), tangram_policy(critical_path=False))
    h.submit("blocker", "api:web", hint_s=1.0)
    h.schedule()
    h.submit("long#1", "api:web", trajectory="long", step=0, hint_s=2.0, remaining_turns=20)
    h.submit("short#1", "api:web", trajectory="short", step=0, hint_s=0.5, remaining_turns=0)
    h.complete("blocker")
    assert list(h.schedule()) == ["short#1"]


def test_remaining_turns_are_learned_from_ended_trajectories_of_the_job():
    from arl_tangram.core import Action
    from arl_tangram.policy.critical import CriticalPath

    cp = CriticalPath()
    for t, turns in (("a", 2), ("b", 4), ("c", 6)):
        for k in range(turns):
            cp.on_submit(Action(f"{t}{k}", "sandbox", job="j", trajectory=t, step=0), float(k), 0.1)
        cp.on_end(t)
    assert cp._learned("j", 0) == pytest.approx((1 + 3 + 5) / 3)
    assert cp._learned("j", 3) == pytest.approx((0 + 2) / 2)  # b (4 turns) and c (6) are longer than 3
    assert cp._learned("j", 6) == 0.0
    assert cp._learned("other", 0) is None  # nothing ended in that job: no guess


def test_remaining_turns_must_be_a_count():
    from arl_tangram.core import Action, InvalidAction

    with pytest.raises(InvalidAction) as e:
        Action("x", "sandbox", remaining_turns=-1)
    assert e.value.field == "remaining_turns"


# -- the waiting credit on quota pools (issue 13, clients that send no remaining turns) -------------

def _one_turn_each(h, trajs, wait_s):
    """Each of ``trajs`` runs one call; the one named first waits ``wait_s`` for the slot."""
    for t in trajs:
        h.submit(f"{t}#0", "api:web", trajectory=t, step=0, hint_s=1.0)
    for t in trajs:
        started = list(h.schedule())
        h.advance(wait_s if t == trajs[0] else 0.0)
        h.complete(started[0])


def test_on_a_quota_pool_the_trajectory_that_waited_more_goes_first(harness):
    """One slot, no remaining turns sent. 'patient' waited 20 s behind 'lucky' for its first call,
    so its next call overtakes lucky's although lucky's is predicted shorter (SRPT alone would pick
    lucky's, as the next test shows): waiting is handed back to whoever took more than its share."""
    h = harness(_api_cluster(), tangram_policy())
    _one_turn_each(h, ["lucky", "patient"], 20.0)
    h.submit("blocker", "api:web", hint_s=1.0)
    h.schedule()
    h.submit("lucky#1", "api:web", trajectory="lucky", step=0, hint_s=0.5)
    h.submit("patient#1", "api:web", trajectory="patient", step=0, hint_s=2.0)
    h.complete("blocker")
    assert list(h.schedule()) == ["patient#1"]


@pytest.mark.parametrize("remaining", [True, False])
def test_no_waiting_credit_with_the_clients_counts_or_without_critical_path(harness, remaining):
    """With the client's remaining turns the projection decides (the credit would fight it); with
    ``critical_boost_s=0`` nothing of critical.py applies: SRPT picks the shorter call."""
    policy = tangram_policy(critical_path=False) if remaining else tangram_policy(critical_boost_s=0.0)
    h = harness(_api_cluster(), policy)
    extra = {"remaining_turns": 1} if remaining else {}
    for t in ("lucky", "patient"):
        h.submit(f"{t}#0", "api:web", trajectory=t, step=0, hint_s=1.0, **extra)
    for t in ("lucky", "patient"):
        started = list(h.schedule())
        h.advance(20.0 if t == "lucky" else 0.0)
        h.complete(started[0])
    h.submit("blocker", "api:web", hint_s=1.0)
    h.schedule()
    h.submit("lucky#1", "api:web", trajectory="lucky", step=0, hint_s=0.5, **extra)
    h.submit("patient#1", "api:web", trajectory="patient", step=0, hint_s=2.0, **extra)
    h.complete("blocker")
    assert list(h.schedule()) == ["lucky#1"]


def test_the_waiting_credit_is_the_mean_queue_time_per_finished_action():
    from arl_tangram.core import Action, Finished, Outcome
    from arl_tangram.policy.critical import CriticalPath

    cp = CriticalPath(wait_credit=0.5)
    first = Action("t#0", "api:web", trajectory="t", step=0)
    assert cp.on_submit(first, 0.0, 1.0) == 0.0  # nothing finished yet
    cp.on_finish(Finished(first, Outcome.OK, 0.0, 6.0, 7.0))
    second = Action("t#1", "api:web", trajectory="t", step=0)
    assert cp.on_submit(second, 9.0, 1.0) == pytest.approx(0.5 * 6.0)
    cp.on_finish(Finished(second, Outcome.OK, 9.0, 11.0, 12.0))
    third = Action("t#2", "api:web", trajectory="t", step=0)
    assert cp.on_submit(third, 13.0, 1.0) == pytest.approx(0.5 * 4.0)
    cp.on_finish(Finished(third, Outcome.REJECTED, 13.0, None, 14.0))  # never started: no wait to count
    assert cp.on_submit(Action("t#3", "api:web", trajectory="t", step=0), 15.0, 1.0) == pytest.approx(0.5 * 4.0)
    # only quota pools get the credit
    assert cp.on_submit(Action("t#4", "sandbox", trajectory="t", step=0), 16.0, 1.0) == 0.0


@pytest.mark.parametrize("slack_order, order", [(True, ["crit#1", "few#1", "many#1"]),
                                                (False, ["crit#1", "many#1", "few#1"])])
def test_on_a_quota_pool_trajectories_with_slack_go_by_the_calls_they_have_left(harness, slack_order, order):
    """One quota slot; three trajectories come back for their second call at once (equal
    predictions). 'crit' has 40 turns left and ends the step; of the other two, the one with 1 turn
    left goes before the one with 5: finishing it shrinks the population that keeps calling."""
    h = harness(_api_cluster(), tangram_policy(slack_order=slack_order))
    for traj in ("crit", "many", "few"):
        h.submit(f"{traj}#0", "api:web", trajectory=traj, step=0, hint_s=1.0, remaining_turns=5)
    for _ in range(3):
        h.schedule()
        h.advance(1.0)
        h.complete(next(iter(h.engine.running)))
    h.advance(3.0)
    h.submit("blocker", "api:web", hint_s=1.0)
    h.schedule()
    for traj, left in (("crit", 40), ("many", 5), ("few", 1)):
        h.submit(f"{traj}#1", "api:web", trajectory=traj, step=0, hint_s=1.0, remaining_turns=left)
    started = []
    h.complete("blocker")
    for _ in range(3):
        started += list(h.schedule())
        h.advance(1.0)
        h.complete(started[-1])
    assert started == order


def test_the_slack_order_never_sends_a_call_back_further_than_its_slack():
    from arl_tangram.core import Action
    from arl_tangram.policy.critical import CriticalPath

    cp = CriticalPath(slack_aging=0.1)
    for traj in ("last", "near", "far"):
        cp.on_submit(Action(f"{traj}#0", "api:web", trajectory=traj, step=0, remaining_turns=9), 0.0, 1.0)
    # seconds per turn become 10; 'last' projects 10 + 1 + 30 x 10 = 311
    assert cp.on_submit(Action("last#1", "api:web", trajectory="last", step=0, remaining_turns=30), 10.0, 1.0) == 0.0
    # 'far' projects 10 + 1 + 2 x 10 = 31: slack 280 s -> up to 28 key seconds; the rest of it is 2 x 1 s
    assert cp.on_submit(Action("far#1", "api:web", trajectory="far", step=0, remaining_turns=2), 10.0, 1.0) == \
        pytest.approx(-2.0)
    # 'near' projects 10 + 1 + 27 x 10 = 281: slack 30 s -> 3 key seconds, less than its 27 x 1 s left
    assert cp.on_submit(Action("near#1", "api:web", trajectory="near", step=0, remaining_turns=27), 10.0, 1.0) == \
        pytest.approx(-3.0)
    # sandbox and model calls keep their per-action order
    assert cp.on_submit(Action("far#2", "sandbox", trajectory="far", step=0, remaining_turns=1), 11.0, 1.0) == 0.0
