"""``tangram evaluate``: the sweep's arithmetic on hand-made cells, and the command end to end."""

import json
import re
import subprocess
import sys

import pytest

from arl_tangram.sim.evaluate import Plan, aggregate, headline, summarize_searches, vs_best_baseline


def cell(workload, scale, seed, policy, act, step, held=100.0):
    return {"workload": workload, "scale": scale, "seed": seed, "policy": policy, "act_quantiles": [],
            "summary": {"avg_act_s": act, "p50_act_s": act, "p99_act_s": act, "avg_step_s": step,
                        "cpu_core_seconds_held": held, "gpu_seconds_held": 0.0, "cpu_utilization": 0.5,
                        "gpu_utilization": None}}


def test_ratios_are_taken_per_seed_then_averaged():
    cells = [cell("w", 1.0, 0, "tangram", 1.0, 10.0), cell("w", 1.0, 0, "trajectory-static", 4.0, 20.0),
             cell("w", 1.0, 1, "tangram", 10.0, 100.0), cell("w", 1.0, 1, "trajectory-static", 20.0, 100.0)]
    rows = {r["policy"]: r for r in aggregate(cells)}
    static = rows["trajectory-static"]
    assert static["act_ratio"]["mean"] == pytest.approx((4.0 + 2.0) / 2)  # not 24/11
    assert static["act_ratio"]["min"] == 2.0 and static["act_ratio"]["max"] == 4.0
    assert static["step_ratio"]["mean"] == pytest.approx(1.5)
    assert rows["tangram"]["avg_act_s"]["mean"] == 5.5


def test_headline_is_the_best_point_and_names_the_worst_seed():
    cells = []
    for seed, (t_step, f_step) in enumerate([(10.0, 9.0), (10.0, 12.0)]):
        cells += [cell("a", 1.0, seed, "tangram", 1.0, t_step), cell("a", 1.0, seed, "fifo", 2.0, f_step),
                  cell("a", 0.5, seed, "tangram", 1.0, 10.0), cell("a", 0.5, seed, "fifo", 3.0, 10.0),
                  cell("a", 0.5, seed, "trajectory-static", 5.0, 15.0)]
    h = headline(cells, [])
    assert h["act_vs_trajectory_static"]["value"] == pytest.approx(5.0)
    assert h["act_vs_best_baseline"]["value"] == pytest.approx(3.0)
    assert h["step_vs_best_baseline"]["worst_seed"] == {"value": pytest.approx(0.9), "workload": "a", "scale": 1.0}
    assert h["paper"] == {"act_speedup": 4.3, "step_speedup": 1.5, "resource_savings": 0.712}


def test_vs_best_baseline_takes_the_best_baseline_of_each_seed():
    cells = []
    for seed, (t_step, f_step, s_step) in enumerate([(10.0, 9.0, 12.0), (10.0, 12.0, 11.0)]):
        cells += [cell("a", 1.0, seed, "tangram", 1.0, t_step), cell("a", 1.0, seed, "fifo", 2.0, f_step),
                  cell("a", 1.0, seed, "trajectory-static", 4.0, s_step)]
    step = vs_best_baseline(cells)["step"]
    assert len(step) == 1 and step[0]["workload"] == "a" and step[0]["scale"] == 1.0
    assert step[0]["min"] == pytest.approx(0.9) and step[0]["mean"] == pytest.approx((0.9 + 1.1) / 2)
    assert vs_best_baseline(cells)["act"][0]["mean"] == pytest.approx(2.0)


def test_resource_savings_average_only_the_seeds_that_matched_and_compare_with_the_baselines_own_minimum():
    searches = [{"workload": "w", "seed": 0, "policy": "tangram", "target_step_s": 10.0, "min_scale": 0.25},
                {"workload": "w", "seed": 1, "policy": "tangram", "target_step_s": 12.0, "min_scale": 0.35},
                {"workload": "w", "seed": 0, "policy": "trajectory-static", "target_step_s": 10.0, "min_scale": 1.0},
                {"workload": "w", "seed": 1, "policy": "trajectory-static", "target_step_s": 12.0, "min_scale": 0.5},
                {"workload": "w", "seed": 0, "policy": "fifo", "target_step_s": 10.0, "min_scale": None}]
    s = summarize_searches(searches)
    assert s["w"]["tangram"]["savings"]["mean"] == pytest.approx(0.7)
    assert s["w"]["tangram"]["vs_trajectory_static"]["mean"] == pytest.approx((0.75 + 0.3) / 2)
    assert s["w"]["tangram"]["matched"] == 2 and s["w"]["fifo"]["matched"] == 0
    assert s["w"]["fifo"]["savings"] is None
    h = headline([], searches)["resource_savings"]
    assert h["value"] == pytest.approx(0.525) and h["baseline_min_scale"] == pytest.approx(0.75)


def test_a_plan_rejects_bad_input_naming_the_field():
    with pytest.raises(ValueError, match="scales"):
        Plan(scales=(0.0,))
    with pytest.raises(ValueError, match="policies"):
        Plan(policies=("fifo",))


def test_evaluate_rejects_an_unknown_workload():
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "evaluate", "--workloads", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--workloads" in p.stderr


@pytest.mark.slow
def test_evaluate_quick_writes_a_report_consistent_with_its_json(tmp_path):
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "evaluate", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    data = json.loads((out / "results.json").read_text())
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    for png in ("act_vs_scale", "step_vs_scale", "held_vs_step", "act_cdf"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png}.png)" in md and f'src="{png}.png"' in html
    plan = data["plan"]
    assert len(data["cells"]) == len(plan["workloads"]) * len(plan["scales"]) * len(plan["seeds"]) * 4
    assert not data["errors"]
    # the headline in the report is the one in the JSON, beside the paper's figures
    h = data["headline"]
    row = next(line for line in md.splitlines() if line.startswith("| average ACT, up to"))
    assert "| 4.3x |" in row and f"{h['act_vs_trajectory_static']['value']:.2f}x" in row
    row = next(line for line in md.splitlines() if line.startswith("| RL step time, up to"))
    assert "| 1.5x |" in row and f"{h['step_vs_trajectory_static']['value']:.2f}x" in row
    row = next(line for line in md.splitlines() if line.startswith("| external resources saved, up to"))
    assert "| 71.2% |" in row and f"{h['resource_savings']['value']:.1%}" in row
    # every per-workload row is the aggregate of its seeds' summaries in the JSON
    for agg in data["aggregate"]:
        seeds = [c["summary"]["avg_step_s"] for c in data["cells"] if c["workload"] == agg["workload"]
                 and c["scale"] == agg["scale"] and c["policy"] == agg["policy"]]
        if agg["avg_step_s"] is None:
            continue
        assert agg["avg_step_s"]["mean"] == pytest.approx(sum(seeds) / len(seeds))
        pattern = rf"\| {agg['scale']:g} \| {re.escape(agg['policy'])} \| [^|]+ \| [^|]+ \| {agg['avg_step_s']['mean']:.1f}"
        assert re.search(pattern, md), pattern
    assert h["act_vs_trajectory_static"]["workload"] in plan["workloads"]
