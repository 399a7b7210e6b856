"""The engine's written contract, checked at the manager seam (the Recorder double of conftest)."""

from __future__ import annotations

import pytest

from arl_tangram.core import Action, ApiQuota, Demand, Outcome, uniform_cluster
from arl_tangram.core.cluster import Cluster
from arl_tangram.core.pools import CapacityError, QuotaPool
from arl_tangram.core.seam import Completion, Loaded
from arl_tangram.policy import Start, fifo_policy, tangram_policy


def test_a_second_completion_of_one_action_is_refused(harness):
    h = harness(uniform_cluster(cpus=2), fifo_policy())
    h.submit("a", cpu=1)
    h.schedule()
    first = h.complete("a")
    assert first.outcome is Outcome.OK and len(h.finished) == 1
    with pytest.raises(KeyError):
        h.complete("a", outcome=Outcome.FAILED)
    assert len(h.finished) == 1 and h.engine.cpu.total_free == 2


def test_reports_are_one_typed_record_each(harness):
    h = harness(uniform_cluster(cpus=1), fifo_policy())
    h.submit("a", cpu=1)
    h.schedule()
    f = h.engine.report(Completion("a", Outcome.FAILED, setup_s=0.5, exec_s=2.0, message="exit 1"))
    assert (f.outcome, f.setup_s, f.exec_s, f.message, f.units) == (Outcome.FAILED, 0.5, 2.0, "exit 1", 1)
    with pytest.raises(TypeError):
        h.engine.report("a")


def test_units_go_back_through_the_ledger_and_the_meter_follows(harness):
    h = harness(uniform_cluster(cpus=4), fifo_policy())
    h.submit("a", cpu=2)
    h.submit("b", cpu=1)
    h.schedule()
    meter = h.engine.cpu.meter
    assert (meter.held, meter.running, h.engine.cpu.total_free) == (3, 3, 1)
    held = meter.held
    h.advance(2.0)
    h.complete("a")
    h.complete("b")
    assert (meter.held, meter.running, h.engine.cpu.total_free) == (0, 0, 4)
    h.engine.usage.advance(h.clock.now())
    assert h.engine.usage.cpu_held_s == pytest.approx(held * 2.0)


def test_a_prefetch_is_reported_as_loaded_and_its_gpus_come_back(harness):
    from arl_tangram.core.cluster import ModelSpec
    cluster = uniform_cluster(gpus=2, gpus_per_node=2, models=(ModelSpec("m", 10.0, 1),))
    h = harness(cluster, tangram_policy())
    h.schedule()
    assert h.rec.loading, "an idle GPU should get a copy of the registered model"
    assert h.engine.gpu.meter.running == len(h.rec.loading)
    for key in list(h.rec.loading):
        h.engine.report(Loaded(key))
    h.rec.loading.clear()
    assert h.engine.gpu.meter.running == 0 and not h.engine.loading
    assert all(i.busy is None for insts in h.engine.gpu.instances.values() for i in insts)


def test_cancelling_a_running_action_asks_its_manager(harness):
    h = harness(uniform_cluster(cpus=1), fifo_policy())
    h.submit("a", cpu=1)
    h.schedule()
    assert h.engine.cancel("a") is None and h.rec.cancelled == ["a"]
    f = h.engine.report(Completion("a", Outcome.CANCELLED, message="cancelled while running"))
    assert f.outcome is Outcome.CANCELLED and h.engine.cpu.total_free == 1


def test_a_policy_that_oversubscribes_gets_capacity_error(harness):
    class Greedy:
        name = "greedy"

        def bind(self, view, now):
            self.view = view
            return ()

        def on_submit(self, action, now):
            self.waiting = action

        def schedule(self, now):
            yield Start(self.waiting, node=0, count=5)

        def next_wakeup(self, now):
            return None

    h = harness(uniform_cluster(cpus=4), Greedy())
    h.submit("a", cpu=(1, 8))
    with pytest.raises(CapacityError):
        h.schedule()
    assert h.engine.cpu.total_free == 4 and h.engine.cpu.meter.held == 0


def test_reading_a_quota_does_not_change_it():
    q = QuotaPool(ApiQuota("search", rate_per_s=2.0, concurrency=1, burst=1.0))
    q.admit(0.0)
    before = (q.tokens, q.t_last, q.in_use)
    for t in (0.1, 0.2, 0.6, 5.0):
        q.available(t)
        q.next_token_at(t)
    assert (q.tokens, q.t_last, q.in_use) == before
    assert q.next_token_at(0.25) == pytest.approx(0.5)
    q.release()
    assert q.available(0.5) and not q.available(0.4)
    with pytest.raises(CapacityError):
        q.release()


def test_a_gpu_cluster_needs_a_model_host():
    from arl_tangram.core.clock import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine

    class CpuOnly:
        def start(self, action, allocation): ...
        def cancel(self, action_id): ...
        def close_session(self, trajectory): ...

    with pytest.raises(TypeError, match="ModelHost"):
        Engine(uniform_cluster(gpus=1), fifo_policy(), {Pool.GPU: CpuOnly()}, ManualClock())
    Engine(Cluster(), fifo_policy(), {}, ManualClock())  # nothing to host: fine


def test_a_node_that_leaves_takes_its_capacity_and_sessions_with_it(harness):
    from arl_tangram.core.cluster import CpuNode

    h = harness(uniform_cluster(cpus=4, cpu_nodes=2), fifo_policy())
    h.submit("s1-a", cpu=1, trajectory="s1")
    h.schedule()
    home = h.allocation("s1-a").node
    h.complete("s1-a")
    for i in range(4):
        h.submit(f"x{i}", cpu=1)
    h.schedule()
    h.submit("s1-b", cpu=1, trajectory="s1")  # queued: the pool is full
    assert h.schedule() == {}
    lost = h.engine.remove_cpu_node(home, "session s1 was lost with its node")
    assert lost == ["s1"]
    assert [(f.action.id, f.outcome, f.message) for f in h.finished[-1:]] == [
        ("s1-b", Outcome.INFRA_ERROR, "session s1 was lost with its node")]
    assert (h.engine.cpu.capacity, h.engine.cpu.max_cores) == (2, 2)
    on_dead = [i for i in h.engine.running if h.allocation(i).node == home]
    assert len(on_dead) == 2
    for i in on_dead:  # their manager reports them; the cores do not come back
        h.complete(i, outcome=Outcome.INFRA_ERROR)
    assert h.engine.cpu.total_free == 0 and h.engine.cpu.meter.held == 2
    new = h.engine.add_cpu_node(CpuNode("n-new", 3, 12.0))
    assert new == 2 and (h.engine.cpu.capacity, h.engine.cpu.max_cores) == (5, 3)
    h.submit("y", cpu=3)
    assert h.schedule()["y"].node == new


def test_a_draining_node_takes_no_new_work_and_its_sessions_move_off_it(harness):
    h = harness(uniform_cluster(cpus=6, cpu_nodes=3), fifo_policy())  # 2 cores a node
    for s in ("s1", "s2"):
        h.submit(f"{s}-a", cpu=1, trajectory=s)
    h.schedule()
    homes = {s: h.allocation(f"{s}-a").node for s in ("s1", "s2")}
    node = homes["s1"]
    h.complete("s1-a")  # s1 idle; s2's step may still run there (the same node or not)
    held = h.engine.drain_cpu_node(node)
    assert "s1" in held and set(held) == {s for s, n in homes.items() if n == node}
    assert h.engine.cpu.nfree(node) == 0 and h.engine.cpu.capacity == 4  # out of placement at once
    for i in range(3):
        h.submit(f"x{i}", cpu=1)
    assert node not in {a.node for a in h.schedule().values()}  # no one-shot lands there
    target = h.engine.move_session("s1")
    assert target is not None and target != node and h.engine.cpu.homes["s1"] == target
    assert h.engine.move_session("s1") == target  # moved already: it stays
    assert h.engine.move_session("nobody") is None
    h.submit("s1-b", cpu=1, trajectory="s1")  # its next step goes to its new home
    for i in range(3):
        h.complete(f"x{i}")
    assert h.schedule()["s1-b"].node == target
    if "s2" in held:  # still running there: its cores do not come back to the pool
        h.complete("s2-a")
        assert h.engine.cpu.nfree(node) == 0
    assert h.engine.remove_cpu_node(node, "gone") == [s for s in held if s != "s1"]


def _grown(harness, **engine_kwargs):
    """One elastic action grown onto a quiet 4-core node (it holds all 4 cores), and its harness."""
    h = harness(uniform_cluster(cpus=4), tangram_policy(), **engine_kwargs)
    h.submit("big", cpu=(1, 4), hint_s=20.0, parallel_fraction=0.9)
    assert len(h.schedule()["big"].units) == 4, "a quiet pool grows an elastic action"
    return h


def test_a_queue_takes_cores_back_from_a_grown_action(harness):
    h = _grown(harness)
    before = h.allocation("big").units
    h.submit("b", cpu=1)
    h.submit("c", cpu=1)
    started = h.schedule()
    # the grown action keeps its first core and gives the rest back, in the same round that
    # starts the queue on them; the manager is told before the starts are handed over
    assert h.allocation("big").units == before[:1]
    assert h.rec.resized == [("big", before[:1])]
    assert h.rec.log[-3:] == [("resize", "big"), ("start", "b"), ("start", "c")]
    assert set(started) == {"b", "c"}
    assert set(started["b"].units + started["c"].units) <= set(before[1:])
    cpu = h.engine.cpu
    assert (cpu.total_free, cpu.meter.held, cpu.meter.running) == (1, 3, 3)
    f = h.complete("big")
    assert f.units == 1 and cpu.total_free == 2
    assert h.engine.policy.job_units["default"]["cpu"] == 2  # b and c: the shrink was uncharged


def test_a_shrink_the_manager_cannot_apply_is_refused(harness):
    class NoResize:
        def start(self, action, allocation): ...
        def cancel(self, action_id): ...
        def close_session(self, trajectory): ...

    from arl_tangram.core.clock import ManualClock
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine
    from arl_tangram.policy import Shrink

    engine = Engine(uniform_cluster(cpus=4), tangram_policy(), {Pool.CPU: NoResize()}, ManualClock())
    assert not engine.cpu_resizes
    with pytest.raises(CapacityError, match="cannot take cores back"):
        engine._apply_all([Shrink("x", 1)], 0.0)
    # nor does the policy ask: its grown action keeps its cores when a queue forms
    engine.submit(Action("big", "sandbox", Demand({"cpu": (1, 4)}), hint_s=20.0, parallel_fraction=0.9))
    engine.schedule()
    assert len(engine.running["big"].allocation.units) == 4
    engine.submit(Action("b", "sandbox", Demand({"cpu": (1, 1)})))
    engine.schedule()
    assert "b" in engine.pending and len(engine.running["big"].allocation.units) == 4


def test_a_shrink_keeps_the_minimum_and_the_ledger(harness):
    from arl_tangram.policy import Shrink

    h = _grown(harness)
    before = h.allocation("big").units
    for bad, why in ((Shrink("big", 4), "at least 1 must stay"), (Shrink("big", 0), "at least"),
                     (Shrink("nobody", 1), "not running")):
        with pytest.raises(CapacityError, match=why):
            h.engine._apply_all([bad], h.clock.now())
        assert h.allocation("big").units == before and h.engine.cpu.total_free == 0
    h.engine._apply_all([Shrink("big", 2)], h.clock.now())
    assert h.allocation("big").units == before[:2] and h.engine.cpu.total_free == 2
    assert h.rec.resized == [("big", before[:2])]


def test_a_grown_action_on_a_draining_node_keeps_its_cores(harness):
    """Cores released on a draining node go to no one, so taking them back would only slow the run."""
    h = harness(uniform_cluster(cpus=8, cpu_nodes=2), tangram_policy())
    h.submit("big", cpu=(1, 4), hint_s=20.0, parallel_fraction=0.9)
    alloc = h.schedule()["big"]
    assert len(alloc.units) == 4
    h.engine.drain_cpu_node(alloc.node)
    for i in range(5):
        h.submit(f"q{i}", cpu=1)
    assert len(h.schedule()) == 4  # the other node's cores; one waits
    assert h.rec.resized == [] and len(h.allocation("big").units) == 4


# -- Follow: a one-shot queued behind a running one (issue 26's lease) ----------------------------

def _chained(harness, take: bool = True, cpus: int = 2, **options):
    from arl_tangram.core.seam import Pool
    from conftest import Chaining

    h = harness(uniform_cluster(cpus=cpus), tangram_policy(**options))
    chains = Chaining(h.rec, take)
    h.engine = type(h.engine)(h.engine.cluster, h.engine.policy.__class__(h.engine.policy.name, h.engine.policy.opt),
                              {Pool.CPU: chains}, h.clock)
    h.engine.listeners.append(h.finished.append)
    h.complete_short = lambda id: h.complete(id, exec_s=0.003)  # as the one-shots' hints say
    return h, chains


def _one_shots(h, *ids: str) -> None:
    for i in ids:
        h.submit(i, cpu=1, hint_s=0.003)


def test_a_one_shot_follows_the_oldest_run_when_no_core_is_free_and_takes_its_cores(harness):
    h, chains = _chained(harness)
    _one_shots(h, "a", "b")
    first = h.schedule()
    h.advance(0.001)
    _one_shots(h, "c", "d", "e")
    assert h.schedule() == {}
    # c behind a (the oldest start), d behind b; e waits: one follower per run
    assert chains.followed == [("c", first["a"].units, "a"), ("d", first["b"].units, "b")]
    assert list(h.engine.pending) == ["e"]
    assert h.engine.following == {"c": "a", "d": "b"} and not h.engine.followable
    cpu = h.engine.cpu
    assert cpu.total_free == 0 and cpu.meter.held == 2
    f = h.complete_short("a")
    assert f.action.id == "a" and f.outcome == Outcome.OK
    # a's core went to c unreleased, and nothing was started by the engine: the manager did
    assert cpu.total_free == 0 and h.allocation("c").units == first["a"].units
    assert h.engine.running["c"].started_at == h.clock.now()
    assert len(h.rec.started) == 2
    # e now follows c (the oldest start); every one ends, and the cores come back
    assert h.schedule() == {}
    assert chains.followed[-1] == ("e", first["a"].units, "c")
    for i in ("b", "c", "d", "e"):
        h.complete(i)
    assert cpu.total_free == 2 and cpu.meter.held == 0 and not h.engine.running
    assert not (h.engine.followers or h.engine.following or h.engine.followable)
    assert h.engine.policy.job_units["default"]["cpu"] == 0
    assert sorted(f.action.id for f in h.finished) == ["a", "b", "c", "d", "e"]


def test_a_follower_the_manager_did_not_take_is_started_by_the_engine_when_its_run_ends(harness):
    h, chains = _chained(harness, take=False, cpus=1)
    _one_shots(h, "a")
    h.schedule()
    _one_shots(h, "b")
    h.schedule()
    assert chains.followed == [("b", (0,), "a")] and [a.id for a, _ in h.rec.started] == ["a"]
    h.complete_short("a")
    assert [a.id for a, _ in h.rec.started] == ["a", "b"] and h.allocation("b").units == (0,)


def test_a_follower_cancelled_or_lost_before_its_turn_ends_once_and_leaves_the_cores_to_its_run(harness):
    h, chains = _chained(harness, cpus=1)
    _one_shots(h, "a")
    h.schedule()
    _one_shots(h, "b")
    h.schedule()
    assert h.engine.cancel("b") is None  # the manager took it: it may be starting, and reports
    assert h.rec.cancelled == ["b"]
    f = h.engine.complete(Completion("b", Outcome.CANCELLED, message="cancelled while running"))
    assert (f.action.id, f.outcome) == ("b", Outcome.CANCELLED)
    assert h.engine.cpu.total_free == 0 and "a" in h.engine.followable  # a holds its core, and may be followed again
    with pytest.raises(KeyError):
        h.complete("b")  # once
    h.complete_short("a")
    assert h.engine.cpu.total_free == 1 and h.engine.policy.job_units["default"]["cpu"] == 0
    # not taken by the manager: the engine ends it itself, and the run keeps its core
    h2, _ = _chained(harness, take=False, cpus=1)
    _one_shots(h2, "a")
    h2.schedule()
    _one_shots(h2, "b")
    h2.schedule()
    f = h2.engine.cancel("b")
    assert f is not None and (f.outcome, f.message) == (Outcome.CANCELLED, "cancelled while queued")
    assert h2.rec.cancelled == []
    h2.complete_short("a")
    assert h2.engine.cpu.total_free == 1 and [a.id for a, _ in h2.rec.started] == ["a"]


def test_only_fixed_one_shots_follow_and_only_runs_predicted_short(harness):
    h, chains = _chained(harness, cpus=1)
    _one_shots(h, "a")
    h.schedule()
    h.submit("long", cpu=1, hint_s=5.0)
    h.submit("b", cpu=1, hint_s=0.003)
    h.schedule()
    assert chains.followed == [("b", (0,), "a")]  # srpt: b first, and only one behind a
    h.complete_short("a")
    h.schedule()
    assert chains.followed[-1] == ("long", (0,), "b")  # b is short: what follows it may be long
    h.complete_short("b")
    _one_shots(h, "c")
    h.schedule()
    assert chains.followed[-1][0] == "long" and list(h.engine.pending) == ["c"], \
        "nothing follows a run predicted longer than follow_max_s"
    # a session's step, an elastic action: neither follows, and what queues behind them waits too
    h2, chains2 = _chained(harness, cpus=1)
    _one_shots(h2, "a")
    h2.schedule()
    h2.submit("step", cpu=1, hint_s=0.001, trajectory="t")
    h2.submit("elastic", cpu=(1, 2), hint_s=0.001)
    _one_shots(h2, "b")
    h2.schedule()
    assert chains2.followed == [] and set(h2.engine.pending) == {"step", "elastic", "b"}
    # a run predicted short that has run longer than follow_max_s already (a straggler): passed
    # over for a younger one, and not followed at all when it is the only one
    h4, chains4 = _chained(harness, cpus=2)
    _one_shots(h4, "old")
    h4.schedule()
    h4.advance(0.5)
    _one_shots(h4, "young", "b", "c")
    h4.schedule()
    assert chains4.followed == [("b", h4.allocation("young").units, "young")] and list(h4.engine.pending) == ["c"]
    h3, chains3 = _chained(harness, cpus=2, follow_max_s=0.0)
    _one_shots(h3, "a", "b", "c")
    h3.schedule()
    assert chains3.followed == [] and list(h3.engine.pending) == ["c"]


def test_a_one_shot_naming_a_held_image_follows_only_a_run_on_a_node_holding_it(harness):
    """Two nodes of one core, both running a short one-shot; node 1 holds image ``img``. A one-shot
    naming it follows the run on node 1 although the run on node 0 is older; one naming an image
    held nowhere follows the oldest run, as any one-shot."""
    from arl_tangram.core.seam import Pool
    from arl_tangram.managers.sandbox.spec import RunCode
    from conftest import Chaining

    h = harness(uniform_cluster(cpus=2, cpu_nodes=2), tangram_policy())
    chains = Chaining(h.rec)
    h.engine = type(h.engine)(h.engine.cluster, h.engine.policy.__class__(h.engine.policy.name, h.engine.policy.opt),
                              {Pool.CPU: chains}, h.clock)
    h.engine.cpu.hold_images(1, ["img"])
    h.submit("old", cpu=1, hint_s=0.003)
    assert h.schedule()["old"].node == 0  # the image one-shots below are not placed by it
    h.advance(0.001)
    h.submit("young", cpu=1, hint_s=0.003)
    assert h.schedule()["young"].node == 1
    h.submit("i", cpu=1, hint_s=0.003, payload=RunCode(code="print(1)", image="img"))
    h.submit("x", cpu=1, hint_s=0.003, payload=RunCode(code="print(1)", image="elsewhere"))
    assert h.schedule() == {}
    assert [(f[0], f[2]) for f in chains.followed] == [("i", "young"), ("x", "old")]


def test_an_engine_without_a_chaining_manager_refuses_follow(harness):
    from arl_tangram.policy import Follow

    h = harness(uniform_cluster(cpus=1), tangram_policy())
    h.submit("a", cpu=1, hint_s=0.003)
    h.schedule()
    b = h.submit("b", cpu=1, hint_s=0.003)
    assert h.schedule() == {} and not h.engine.followable
    with pytest.raises(CapacityError, match="cannot start an action as another ends"):
        h.engine._apply_all([Follow(b, "a")], 0.0)
