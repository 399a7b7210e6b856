"""The policy says why an action waits: a short reason a program can count and the same in words
with the figures of the moment, read for the head of the queue, for ``GET /v1/actions/{id}`` and
for an action rejected after ``max_queue_s``."""

from __future__ import annotations

import pytest

from arl_tangram.core import ApiQuota, Outcome, uniform_cluster
from arl_tangram.core.cluster import ModelSpec
from arl_tangram.policy import TrajectoryStaticPolicy, Wait, fifo_policy, tangram_policy


def test_a_job_above_its_share_waits_behind_the_other_job(harness):
    h = harness(uniform_cluster(cpus=2), tangram_policy())
    h.submit("a1", cpu=1, job="big")
    h.submit("a2", cpu=1, job="big")
    assert set(h.schedule()) == {"a1", "a2"}  # alone, it may take every core
    h.submit("a3", cpu=1, job="big")
    h.submit("b1", cpu=1, job="small")
    h.schedule()
    wait = h.engine.why_waiting(h.engine.pending["a3"])
    assert wait.reason == "fair-share" and "'small' goes first" in wait.detail, wait
    assert h.engine.why_waiting(h.engine.pending["b1"]).reason == "cores"  # below its share: cores are what it lacks


def test_fifo_has_no_fair_share_to_give_as_a_reason(harness):
    h = harness(uniform_cluster(cpus=1), fifo_policy())
    h.submit("a1", cpu=1, job="big")
    h.schedule()
    h.submit("a2", cpu=1, job="big")
    h.submit("b1", cpu=1, job="small")
    h.schedule()
    assert {h.engine.why_waiting(h.engine.pending[i]).reason for i in ("a2", "b1")} == {"cores"}


def test_a_quota_says_when_its_next_token_comes(harness):
    h = harness(uniform_cluster(quotas=(ApiQuota("search", rate_per_s=2.0, concurrency=4, burst=1.0),)),
                tangram_policy())
    h.submit("q1", service="api:search")
    h.submit("q2", service="api:search")
    assert set(h.schedule()) == {"q1"}
    wait = h.engine.why_waiting(h.engine.pending["q2"])
    assert wait.reason == "quota" and wait.until == pytest.approx(h.clock.now() + 0.5), wait


def test_a_model_call_waits_for_a_busy_copy(harness):
    h = harness(uniform_cluster(gpus=1, models=(ModelSpec("teacher", weights_gb=40.0, gpus=1),)), tangram_policy())
    h.submit("m1", service="model:teacher", gpu=1)
    assert set(h.schedule()) == {"m1"}  # loads a copy and runs on it
    h.submit("m2", service="model:teacher", gpu=1)
    assert h.schedule() == {}
    wait = h.engine.why_waiting(h.engine.pending["m2"])
    assert wait.reason == "model-busy" and wait.detail == "a copy of model 'teacher' to finish its batch (all 1 busy)"


def test_the_static_baseline_names_what_the_pools_lack(harness):
    h = harness(uniform_cluster(cpus=1), TrajectoryStaticPolicy())
    h.submit("a", cpu=1, trajectory="t1")
    h.schedule()
    h.submit("b", cpu=1, trajectory="t2")
    h.schedule()
    assert isinstance(h.engine.why_waiting(h.engine.pending["b"]), Wait)


def test_a_rejection_after_max_queue_s_carries_the_policys_reason(harness):
    h = harness(uniform_cluster(cpus=2), tangram_policy(), max_queue_s=10.0)
    for i in range(3):
        h.submit(f"a{i}", cpu=1, job="big")
    h.schedule()
    h.submit("b", cpu=1, job="small")
    h.schedule()
    h.advance(11)
    h.schedule()
    rejected = {f.action.id: f.message for f in h.finished if f.outcome is Outcome.REJECTED}
    assert "fair share: job 'big'" in rejected["a2"] and "'small' goes first" in rejected["a2"], rejected
