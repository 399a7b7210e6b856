"""Each core's wait between two one-shots (``managers/sandbox/corewaits.py``): counted per core,
never across runs that overlapped, read off coarse buckets within a fifth, and subtracted between
two readings (``bench server``'s per-level figure)."""

from __future__ import annotations

import pytest

from arl_tangram.managers.sandbox.corewaits import CoreWaits, between, bucket_of, merge, summary, upper_ms


@pytest.mark.parametrize("seconds", [2e-6, 1e-4, 7.5e-4, 1e-3, 0.0123, 1.7])
def test_a_wait_falls_in_a_bucket_whose_upper_edge_is_within_a_fifth_above_it(seconds):
    edge = upper_ms(bucket_of(seconds)) / 1000
    assert seconds <= edge <= seconds * 1.2


def test_waits_are_per_core_from_the_last_answer_and_overlapping_runs_count_none():
    w = CoreWaits()
    w.ran((0,), 10.000, 10.002)  # the first run on a core: nothing before it
    w.ran((1,), 10.000, 10.003)
    w.ran((0,), 10.0025, 10.005)  # 0.5 ms after core 0's last answer
    w.ran((1,), 10.0030, 10.006)  # at once
    w.ran((0,), 10.0045, 10.007)  # written before core 0's last answer: overlapped, no wait
    s = summary(*w.state())
    assert s["n"] == 2 and s["mean_ms"] == pytest.approx(0.25, abs=1e-3)
    assert s["p50_ms"] <= 0.001 and 0.5 <= s["p90_ms"] <= 0.6
    assert sum(s["buckets"].values()) == 2
    w.ran((0, 1), 10.008, 10.010)  # a run on both: a wait on each (1 and 2 ms)
    w.ended((0,), 10.020)  # killed with no answer: the next wait on core 0 counts from its end
    w.ran((0,), 10.021, 10.022)
    w.ran((1,), 13.0, 13.001)  # a core with nothing to do for ~3 s: idleness, not in the mean
    s = summary(*w.state())
    assert (s["n"], s["idle_n"]) == (6, 1) and s["mean_ms"] == pytest.approx((0.5 + 0 + 1 + 2 + 1) / 5, abs=1e-3)


def test_two_readings_subtract_and_workers_merge():
    a, b = CoreWaits(), CoreWaits()
    for i in range(10):
        a.ran((0,), i * 1.0, i * 1.0 + 0.5)  # a 0.5 s wait before each but the first
    early = summary(*merge([a.state(), b.state()]))
    for i in range(5):
        b.ran((3,), i * 0.01, i * 0.01 + 0.008)  # 2 ms waits, on a worker
    late = summary(*merge([a.state(), b.state()]))
    assert (early["n"], late["n"]) == (9, 13)
    part = between(early, late)
    assert part["n"] == 4 and 2.0 <= part["p50_ms"] <= 2.4 and part["mean_ms"] == pytest.approx(2.0, rel=0.01)
    assert between(None, None) is None and between(None, late)["n"] == 13
    assert between(late, early)["n"] == 0, "a worker restarted between two readings: no count below 0"
