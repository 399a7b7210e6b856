"""``tangram bench agentic``: the workload, the judge API's quota, the replay figures and the report
(fast), and the whole CPU run end to end (slow: about two minutes on 2 cores). Figures are not
asserted: they are measurements."""

import asyncio
import inspect
import json
import math
import shutil
import subprocess
import sys
import time

import pytest

from arl_tangram.bench import agentic_workload as W
from arl_tangram.bench.agentic_judge import BACKOFF_BASE_S, BACKOFF_CAP_S, REJECT_S, JudgeApi, JudgeCall, JudgeClient
from arl_tangram.bench.agentic_report import FIGURES, errors, flat, quantiles, write_report
from arl_tangram.core.action import Action, Demand, Finished, Outcome
from arl_tangram.core.cluster import ApiQuota, uniform_cluster
from arl_tangram.sim import replay as R
from arl_tangram.policy import Costs
from arl_tangram.sim.managers import SimApiManager


def tangram(*args):
    return subprocess.run([sys.executable, "-m", "arl_tangram.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_plan_is_one_seeded_grpo_step_of_sequential_actions():
    a = W.plan(2, 3, 7, W.CPU, 4, 0.05)
    assert a == W.plan(2, 3, 7, W.CPU, 4, 0.05) and a != W.plan(2, 3, 8, W.CPU, 4, 0.05)
    assert [t.id for t in a] == ["g0k0", "g0k1", "g0k2", "g1k0", "g1k1", "g1k2"]
    names = {t.name for t in W.CPU.teachers}
    for t in a:
        kinds = [s.kind for s in t.steps]
        assert kinds[-2:] == ["reward", "judge"]  # the trajectory's score, then the judge
        assert kinds[0] in ("shell", "edit") and t.steps[0].wait_s > 0  # each turn begins with a generation
        turns = kinds.count("teacher")
        assert W.CPU.turns - 1 <= turns <= W.CPU.turns + 1
        assert all(s.wait_s == 0 for s in t.steps if s.kind not in ("shell", "edit"))
        for s in t.steps:
            if s.kind == "test":
                assert s.cores == (1, 4) and 0 < s.parallel_fraction < 1
            if s.kind in ("teacher", "reward"):
                assert s.tokens and max(s.tokens) < W.CPU.vocab
            if s.kind == "teacher":
                assert s.model in names
    assert len({s.model for t in a for s in t.steps if s.kind == "teacher"}) > 1  # several teachers
    d = W.describe(a)
    assert d["trajectories"] == 6 and d["actions"] == sum(len(t.steps) for t in a) and d["by_kind"]["judge"] == 6


def test_plan_refuses_what_it_cannot_plan_naming_the_field():
    for kwargs, field in (({"groups": 0}, "groups"), ({"max_cores": 0}, "max_cores"), ({"unit_s": 0.0}, "unit_s")):
        args = {"groups": 1, "k": 1, "seed": 0, "sizes": W.CPU, "max_cores": 1, "unit_s": 0.1, **kwargs}
        with pytest.raises(ValueError, match=field):
            W.plan(**args)


def test_a_test_run_does_its_units_on_the_cpus_it_has():
    cmd, pf = W.test_command(4, 0.25)
    assert pf == pytest.approx(0.75)
    for cpus in ({0}, None):
        pre = (lambda: __import__("os").sched_setaffinity(0, cpus)) if cpus else None
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, preexec_fn=pre)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == ["passed", "4"]


def test_calibration_prints_one_units_seconds():
    p = subprocess.run([shutil.which("python3") or sys.executable, "-c", W.CALIBRATE], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and 0 < float(p.stdout) < 10


def test_the_judge_client_backs_off_as_the_simulated_client_does():
    params = inspect.signature(SimApiManager.__init__).parameters
    assert (REJECT_S, BACKOFF_BASE_S, BACKOFF_CAP_S) == (params["reject_s"].default, params["backoff_base_s"].default,
                                                         params["backoff_cap_s"].default)


def test_the_judge_answers_429_over_its_quota_and_the_client_retries_until_admitted():
    async def main():
        api = JudgeApi(ApiQuota("judge", rate_per_s=20.0, concurrency=1))
        client = JudgeClient(api, seed=1)
        t = time.monotonic()
        results = await asyncio.gather(*(client(JudgeCall(0.05)) for _ in range(3)))
        return api, results, time.monotonic() - t

    api, results, took = asyncio.run(main())
    assert results == [1.0, 1.0, 1.0] and api.calls == 3
    assert api.rejections >= 2  # one slot: the other two were turned away at least once each
    assert took >= 0.15  # one at a time


def _finished(aid, pool, act, units=1, outcome=Outcome.OK):
    service = {"cpu": "sandbox", "gpu": "model:m"}.get(pool, pool)
    demand = Demand({"cpu": (1, 1)}) if pool == "cpu" else Demand({"gpu": (1, 1)}) if pool == "gpu" else None
    a = Action(aid, service, demand, weights_gb=1.0 if pool == "gpu" else 0.0)
    return Finished(a, outcome, 0.0, 0.0, act, 0.0, act, units, "")


def test_act_figures_split_by_resource_kind_and_leave_rejected_actions_out():
    fs = [_finished("a", "cpu", 1.0), _finished("b", "cpu", 3.0), _finished("c", "gpu", 0.5),
          _finished("d", "api:judge", 2.0), _finished("e", "cpu", 100.0, outcome=Outcome.REJECTED)]
    f = R.act_figures(fs)
    assert f["n"] == 4 and f["avg_act_s"] == pytest.approx(6.5 / 4) and f["p99_act_s"] == 3.0
    assert f["by_kind"]["cpu"] == {"n": 2, "avg_act_s": 2.0, "p50_act_s": 1.0, "p99_act_s": 3.0}
    assert f["by_kind"]["api"]["n"] == 1 and f["by_kind"]["gpu"]["avg_act_s"] == 0.5
    assert R.act_figures([])["avg_act_s"] is None


def _trace(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_shift_first_gaps_moves_only_each_trajectorys_first_action(tmp_path):
    src = _trace(tmp_path / "t.jsonl", [
        {"step": 0, "trajectory": "a", "seq": 0, "service": "sandbox", "gap_s": 0.0, "work_s": 1.0},
        {"step": 0, "trajectory": "a", "seq": 1, "service": "sandbox", "gap_s": 0.5, "work_s": 1.0},
        {"step": 0, "trajectory": "b", "seq": 0, "service": "sandbox", "gap_s": 0.2, "work_s": 1.0}])
    assert R.shift_first_gaps(src, tmp_path / "s.jsonl", 1.5, work={("a", 1): 0.25}) == 3
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [x["gap_s"] for x in lines] == [1.5, 0.5, 1.7]
    assert [x["work_s"] for x in lines] == [1.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="offset_s"):
        R.shift_first_gaps(src, tmp_path / "x.jsonl", -1.0)


def test_with_cores_cuts_cpu_nodes_from_the_last_and_keeps_the_rest():
    c = uniform_cluster(cpus=16, cpu_nodes=2, gpus=1, gpus_per_node=1)
    assert R.with_cores(c, 12).total_cores == 12 and len(R.with_cores(c, 12).cpu_nodes) == 2
    assert R.with_cores(c, 5).total_cores == 5 and len(R.with_cores(c, 5).cpu_nodes) == 1
    assert R.with_cores(c, 5).gpu_nodes == c.gpu_nodes
    with pytest.raises(ValueError, match="cores"):
        R.with_cores(c, 0)


def test_a_replay_gives_each_policy_the_figures_a_real_run_reports(tmp_path):
    """Two trajectories of a sandbox step and a teacher call on 2 cores: Tangram's replay ends
    when the longer one does; trajectory-static holds a core per trajectory while it lives. The
    teacher's 25 GB take a second to load at 25 GB/s, which a run that loaded it first never pays."""
    lines = []
    for t, work in (("a", 2.0), ("b", 1.0)):
        lines += [{"step": 0, "trajectory": t, "seq": 0, "service": "sandbox", "gap_s": 1.0, "work_s": work},
                  {"step": 0, "trajectory": t, "seq": 1, "service": "model:m", "gap_s": 0.0, "work_s": 0.1,
                   "weights_gb": 25.0}]
    lines.append({"step": 0, "trajectory": "c", "seq": 0, "service": "model:m", "gap_s": 0.0, "work_s": 0.1,
                  "weights_gb": 25.0})
    trace = _trace(tmp_path / "t.jsonl", lines)
    wl_models = R.load_trace(trace).models
    one = uniform_cluster(cpus=2, gpus=1, gpus_per_node=1, models=wl_models)
    local = Costs.local(0.5)  # this machine's sandboxes: a session costs well under a millisecond
    t = R.replay(trace, one, "tangram", costs=local)
    assert R.step_s(t) == pytest.approx(3.1, abs=0.01)  # the model copy is resident: no load charged
    f = R.act_figures(t.finished)
    assert f["by_kind"]["gpu"]["avg_act_s"] == pytest.approx(0.1) and f["by_kind"]["gpu"]["n"] == 3
    assert f["by_kind"]["cpu"]["avg_act_s"] == pytest.approx(1.5, abs=0.01)
    s = R.replay(trace, one, "trajectory-static", costs=local)
    assert R.step_s(s) == pytest.approx(3.1, abs=0.01)
    assert s.cpu_held_s > t.cpu_held_s  # a sandbox held from the first action to the last
    loaded = R.replay(trace, one, "tangram", costs=local, resident=False)
    assert R.act_figures(loaded.finished)["by_kind"]["gpu"]["p99_act_s"] >= 1.0  # a load charged at the first call


def test_flat_figures_and_their_errors_compare_key_by_key():
    m = {"n": 3, "avg_act_s": 1.0, "p99_act_s": 2.0, "step_s": 10.0, "core_s": 20.0, "gpu_s": 0.0,
         "by_kind": {"cpu": {"avg_act_s": 1.5, "p99_act_s": 2.0}}}
    s = {**m, "avg_act_s": 1.1, "step_s": 9.0, "by_kind": {"cpu": {"avg_act_s": 1.5, "p99_act_s": 3.0}}}
    fm, fs = flat(m), flat(s)
    assert set(FIGURES) <= set(fm) and fm["gpu_avg_act_s"] is None and fm["actions"] == 3
    e = errors(fm, fs)
    assert e["avg_act_s"] == pytest.approx(0.1) and e["step_s"] == pytest.approx(-0.1)
    assert e["cpu_p99_act_s"] == pytest.approx(0.5) and e["gpu_s"] is None and e["api_avg_act_s"] is None
    q = quantiles([3.0, 1.0, 2.0])
    assert len(q) == 101 and q[0] == 1.0 and q[-1] == 3.0 and q[50] == 2.0 and quantiles([]) == []


def _report() -> dict:
    side = {f: 1.0 for f in FIGURES}
    pol = {"measured": side, "simulated": {**side, "step_s": 1.1}, "error": errors(side, {**side, "step_s": 1.1}),
           "error_own": errors(side, side),
           "act_quantiles": {"measured": [0.1, 1.0], "simulated": [0.1, 1.2]}}
    return {"plan": {"groups": 1, "k": 2, "actions": 10, "by_kind": {"shell": 4}, "seed": 0, "teachers": ["t"],
                     "reward_model": "r", "judge": {"rate_per_s": 1.0, "concurrency": 1}},
            "host": {"sandbox_cores": 2}, "device": "cpu", "wall_s": 1.0, "baseline": "trajectory-static",
            "frameworks": {"trajectory-static": "a sandbox per trajectory"},
            "policies": {"tangram": pol, "trajectory-static": pol},
            "comparison": {"measured": {"act_ratio": 1.0}, "simulated": {"act_ratio": 1.0}},
            "equal_step": {"how": "bisection", "target_step_s": 1.0, "baseline_cores": 2, "measured": None,
                           "tries": [{"cores": 2, "step_s": 1.0, "simulated_step_s": 1.1, "core_s": 2.0, "gpu_s": 0.1,
                                      "avg_act_s": 0.5}],
                           "simulated": {"min_cores": 2, "cores_saved": 0.0}},
            "targets": {"given_for": "x", "targets": {"step_ratio": 1.3}, "step_ratio": 1.0,
                        "met": {"step_ratio": False}}}


def test_the_report_files_are_written_with_their_plots(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(_report(), tmp_path)
    assert {p.name for p in paths} >= {"results.json", "report.md", "report.html", "figures.png", "act_cdf.png",
                                       "equal_step.png"}
    md = (tmp_path / "report.md").read_text()
    assert "| step_s | 1.000 | 1.100 | +10.0% | +0.0% |" in md and "![" in md
    assert json.loads((tmp_path / "results.json").read_text())["policies"]["tangram"]["error"]["step_s"] == \
        pytest.approx(0.1)


def test_the_cli_refuses_an_unknown_device_naming_the_option():
    p = tangram("bench", "agentic", "--device", "tpu")
    assert p.returncode == 2 and "--device" in p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bench_agentic_on_cpu_measures_both_policies_and_replays_the_trace(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "a.json"
    p = tangram("bench", "agentic", "--device", "cpu", "--json", str(out), "--out", str(tmp_path / "report"))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["policies"]) == {"tangram", "trajectory-static"}
    n = r["plan"]["actions"]
    for name, x in r["policies"].items():
        for side in ("measured", "simulated"):
            assert x[side]["actions"] == n, (name, side)  # every planned action ran to ok, in both
            for f in ("avg_act_s", "p99_act_s", "step_s", "core_s", "gpu_s", "cpu_avg_act_s", "gpu_avg_act_s",
                      "api_avg_act_s"):
                assert x[side][f] is not None and x[side][f] > 0 and math.isfinite(x[side][f]), (name, side, f)
        for key in ("error", "error_own"):
            assert all(x[key][f] is not None for f in ("avg_act_s", "step_s", "core_s", "gpu_s")), (name, key)
        assert x["details"]["model_loads_in_step"] == 0  # every copy was resident before the step
    assert r["policies"]["tangram"]["details"]["judge_rejections"] == 0  # the engine keeps to the quota
    # the static device is cut in one slice per model, each held the whole step
    st = r["policies"]["trajectory-static"]["measured"]
    assert st["gpu_s"] == pytest.approx(st["step_s"], rel=0.05)
    eq = r["equal_step"]
    assert eq["tries"][0]["cores"] == r["host"]["sandbox_cores"] and eq["simulated"]["min_cores"] >= 1
    assert set(r["comparison"]["measured"]) >= {"act_ratio", "step_ratio", "core_s_saved", "gpu_s_saved"}
    assert (tmp_path / "report" / "report.md").exists() and (tmp_path / "report" / "traces" / "tangram.jsonl").exists()
