"""The scheduler's fast paths (issue 13: ``tangram bench scheduler``) decide and check exactly what
the general paths do: validation, cancel from either CPU queue, one job's queue, the usage meter."""

import pytest

from arl_tangram.bench.scheduler import breakdown, floor, measure
from arl_tangram.core import Action, Demand, InvalidAction, Outcome, uniform_cluster
from arl_tangram.core.pools import Meter
from arl_tangram.engine import Usage
from arl_tangram.policy import tangram_policy
from arl_tangram.policy.action_level import CPU_NEW
from arl_tangram.policy.queues import JobQueues


@pytest.mark.parametrize("ranges", [{"cpu": (1, 1)}, {"cpu": [2, 4]}, {"cpu": (1.0, 2.0)}, {"gpu": (True, 1)},
                                    {"cpu": (1, 2), "gpu": (1, 1)}])
def test_valid_ranges_pass_by_the_fast_path_or_the_full_check(ranges):
    got = Demand(ranges).ranges
    assert got == {k: (int(lo), int(hi)) for k, (lo, hi) in ranges.items()}
    assert all(type(r) is tuple and all(type(n) is int for n in r) for r in got.values())


@pytest.mark.parametrize("ranges, words", [({"cpu": (0, 1)}, "1 <= min <= max"), ({"cpu": (3, 2)}, "1 <= min"),
                                           ({"cpu": (1, 2.5)}, "integers"), ({"cpu": (1,)}, "pair"),
                                           ({"tpu": (1, 1)}, "unknown resource kind")])
def test_invalid_ranges_name_the_field(ranges, words):
    with pytest.raises(InvalidAction) as e:
        Demand(ranges)
    assert e.value.field == f"demand.{next(iter(ranges))}" and words in str(e.value)


def test_an_action_of_a_pool_always_has_a_range_of_its_unit():
    assert Action("a", "sandbox").demand.ranges == {"cpu": (1, 1)}
    assert Action("m", "model:x", Demand({"cpu": (2, 2)})).demand.ranges == {"cpu": (2, 2), "gpu": (1, 1)}
    assert Action("q", "api:search").demand.ranges == {}
    with pytest.raises(InvalidAction) as e:
        Action("b", "bogus")
    assert e.value.field == "service"


def test_usage_samples_when_built_and_a_repeat_of_the_same_time_changes_nothing():
    cpu, gpu = Meter(), Meter()
    u = Usage(cpu, gpu, 0.0, sample_every_s=1.0)
    assert list(u.series) == [(0.0, 0, 0, 0, 0)]
    cpu.change(3, 3)
    u.advance(0.0)
    assert u.cpu_held_s == 0.0 and len(u.series) == 1
    u.advance(2.0)
    assert u.cpu_held_s == 6.0 and u.series[-1] == (2.0, 3, 3, 0, 0)
    with pytest.raises(ValueError, match="sample_every_s"):
        Usage(cpu, gpu, 0.0, sample_every_s=0.0)


def test_fair_share_is_weighed_once_a_second_job_queues():
    q = JobQueues()
    q.push(Action("a1", "sandbox", job="a"), 1.0)
    q.push(Action("a2", "sandbox", job="a"), 2.0)
    asked = []
    assert q.pop(lambda job: asked.append(job) or True)[2].id == "a1"
    assert asked == []  # one job: nothing to weigh
    q.push(Action("b1", "sandbox", job="b"), 5.0)
    assert q.pop(lambda job: asked.append(job) or job == "b")[2].id == "b1"
    assert sorted(asked) == ["a", "b"] and q.size == 1


def test_cancel_finds_the_queue_of_a_new_session_and_of_a_homed_one(harness):
    h = harness(uniform_cluster(cpus=1, cpu_nodes=1), tangram_policy())
    h.submit("run", trajectory="t1")
    h.schedule()
    h.submit("new", trajectory="t2")  # no session yet: waits in the new-session queue
    h.submit("homed", trajectory="t1")
    queues = h.engine.policy.queues
    assert queues[CPU_NEW].size == 1 and queues["cpu"].size == 1
    assert h.engine.cancel("new").outcome is Outcome.CANCELLED
    assert h.engine.cancel("homed").outcome is Outcome.CANCELLED
    assert queues[CPU_NEW].size == 0 and queues["cpu"].size == 0
    h.complete("run")
    assert h.schedule() == {}


def test_elastic_actions_keep_their_prediction_only_while_in_flight(harness):
    h = harness(uniform_cluster(cpus=4, cpu_nodes=1), tangram_policy(elastic_quiet_s=0.0))
    h.submit("one", cpu=(1, 1))
    h.submit("grows", cpu=(1, 4), parallel_fraction=0.9, hint_s=100.0)
    policy = h.engine.policy
    assert set(policy.predicted) == {"grows"}
    started = h.schedule()
    assert started["grows"].count > 1  # water-filled: ``_gain`` read its prediction
    h.complete("grows")
    h.complete("one")
    assert policy.predicted == {}


def test_the_bench_keeps_the_queue_at_depth_and_breaks_an_action_down():
    rate = measure(100, nodes=2, seconds=0.05)
    assert rate.queued == 100 and rate.cpu_per_s > 0
    parts = breakdown(100, nodes=2, iterations=200)
    assert set(parts) == {"report", "complete", "build", "submit", "schedule", "total"}
    assert parts["total"] >= parts["schedule"] > 0
    assert floor(100, nodes=2, iterations=200) > 0
