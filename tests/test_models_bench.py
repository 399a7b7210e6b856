"""The models bench's own bookkeeping: variants of a shared run, where the average ACT goes."""

import pytest

torch = pytest.importorskip("torch")

from arl_tangram.bench import models as bench  # noqa: E402


def test_a_shared_variant_names_share_switch_interval_and_graph_judge():
    assert bench._variant("0.25") == (0.25, None, None)
    assert bench._variant("1@5") == (1.0, 5.0, None)
    assert bench._variant("1+one_row") == (1.0, None, "one_row")
    assert bench._variant("0.0833@0.2+buckets") == (0.0833, 0.2, "buckets")
    with pytest.raises(ValueError, match="shares: unknown graph judge 'fast'"):
        bench._variant("1+fast")


def test_breakdown_averages_each_phase_per_service_in_ms():
    reqs = [{"model": "teacher-10", "act_s": 0.010, "queue_s": 0.002, "setup_s": 0.0, "exec_s": 0.008},
            {"model": "teacher-2", "act_s": 0.004, "queue_s": 0.0, "setup_s": 0.001, "exec_s": 0.003},
            {"model": "teacher-2", "act_s": 0.006, "queue_s": 0.002, "setup_s": 0.0, "exec_s": 0.004}]
    b = bench._breakdown(reqs)
    assert b["all"] == {"n": 3, "act_ms": pytest.approx(6.667, abs=1e-3), "queue_ms": pytest.approx(1.333, abs=1e-3),
                        "setup_ms": pytest.approx(0.333, abs=1e-3), "exec_ms": pytest.approx(5.0)}
    assert list(b["by_model"]) == ["teacher-2", "teacher-10"]  # in the services' order, not the strings'
    assert b["by_model"]["teacher-2"]["act_ms"] == pytest.approx(5.0)
    assert b["by_model"]["teacher-2"]["queue_ms"] == pytest.approx(1.0)


def test_compare_gives_each_services_gap_to_dedicated():
    one = {"n": 1, "act_ms": 7.0, "queue_ms": 2.0, "setup_ms": 0.0, "exec_ms": 5.0}
    ded = {"n": 1, "act_ms": 5.5, "queue_ms": 0.1, "setup_ms": 0.0, "exec_ms": 5.4}
    m = {"by_compute_share": {"1": {"avg_act_s": 0.007, "p99_act_s": 0.02,
                                    "breakdown": {"all": one, "by_model": {"t": one}}}},
         "task_isolated_dedicated": {"avg_act_s": 0.0055, "p99_act_s": 0.01,
                                     "breakdown": {"all": ded, "by_model": {"t": ded}}}}
    bench._compare(m)
    assert m["by_model_shared_minus_dedicated_ms"]["1"]["t"] == {"act_ms": 1.5, "queue_ms": 1.9, "exec_ms": -0.4}
    assert m["ratios_by_compute_share"]["1"]["p99"] == pytest.approx(2.0)


def test_unknown_multigpu_modes_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="multigpu_modes: unknown bogus .*packed_capture_keeps"):
        bench.run("cpu", sections=("multigpu",), multigpu_modes=("bogus",))
