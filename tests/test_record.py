"""Recorded traces: a run's finished actions written in the public trace format and replayed."""

import json

import pytest

from arl_tangram.core import scale_cluster
from arl_tangram.policy import make_policy
from arl_tangram.sim.record import TraceRecorder
from arl_tangram.sim.simulator import Simulator, simulate
from arl_tangram.sim.trace import load_trace
from arl_tangram.sim.workloads import generate


def record(wl, cluster, path, policy="tangram"):
    sim = Simulator(wl, cluster, make_policy(policy))
    rec = TraceRecorder(path, wl.quotas)
    sim.engine.listeners.append(rec)
    result = sim.run()
    rec.close()
    return result, rec


def test_a_recorded_simulation_replays_to_the_same_actions_and_acts(tmp_path):
    """Record every action of a run (three resource kinds, two steps), replay the file under the same
    policy and pool: the same actions, and ACTs within 2% (the replay's step starts at the earliest
    recorded submission, which shifts each step's first gaps a little)."""
    wl = generate("mixed", seed=2, trajectories=8, steps=2)
    cluster = wl.default_cluster
    path = tmp_path / "run.jsonl"
    result, rec = record(wl, cluster, path)
    assert rec.written == wl.num_actions and rec.skipped == 0
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert {x["outcome"] for x in lines} == {"ok"}
    assert sum(x["act_s"] for x in lines) == pytest.approx(sum(f.act_s for f in result.finished), rel=1e-6)
    back = load_trace(path)
    assert back.num_actions == wl.num_actions
    replay = simulate(back, cluster, make_policy("tangram"))
    recorded = sum(f.act_s for f in result.finished) / len(result.finished)
    replayed = sum(f.act_s for f in replay.finished) / len(replay.finished)
    assert replayed == pytest.approx(recorded, rel=0.02)
    assert sum(a.work_s for j in back.jobs for s in j.steps for t in s for a in t.actions) == pytest.approx(
        sum(a.work_s for j in wl.jobs for s in j.steps for t in s for a in t.actions), rel=1e-6)


def test_elastic_work_is_recorded_at_the_minimum_demand(tmp_path):
    """A test run that got 8 cores ran faster than its work at 1 core; the trace holds the latter."""
    wl = generate("code_agent", seed=0, trajectories=4, steps=1)
    path = tmp_path / "code.jsonl"
    result, _ = record(wl, scale_cluster(wl.default_cluster, 2.0), path)
    grown = [f for f in result.finished if f.units > f.action.demand.min("cpu")]
    assert grown, "expected some elastic action to get spare cores"
    by_key = {(x["trajectory"], x["seq"]): x for x in map(json.loads, path.read_text().splitlines())}
    f = grown[0]
    seq = [g.action.id for g in result.finished if g.action.trajectory == f.action.trajectory].index(f.action.id)
    assert by_key[(f.action.trajectory, seq)]["work_s"] == pytest.approx(f.action.payload.work_s, rel=1e-5)


def test_one_shot_actions_keep_their_arrival_times(tmp_path, harness):
    from arl_tangram.core import uniform_cluster
    from arl_tangram.policy import tangram_policy

    h = harness(uniform_cluster(cpus=2), tangram_policy())
    path = tmp_path / "oneshots.jsonl"
    rec = TraceRecorder(path)
    h.engine.listeners.append(rec)
    h.advance(5.0)
    h.submit("x")
    h.schedule()
    h.advance(2.0)
    h.complete("x", exec_s=2.0)
    h.advance(1.0)
    h.submit("y")
    h.schedule()
    h.advance(0.5)
    h.complete("y", exec_s=0.5)
    rec.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["trajectory"], x["gap_s"], x["work_s"]) for x in lines] == [("x", 0.0, 2.0), ("y", 3.0, 0.5)]
    assert load_trace(path).num_actions == 2


def test_replay_error_of_a_recorded_simulation_is_small(tmp_path):
    from arl_tangram.sim.validate import replay_error

    wl = generate("search", seed=1, trajectories=16, steps=1)
    path = tmp_path / "search.jsonl"
    record(wl, wl.default_cluster, path)
    err = replay_error(path, wl.default_cluster)
    assert err["actions"] == wl.num_actions
    assert abs(err["avg_act_error"]) < 0.02


@pytest.mark.slow
def test_a_real_run_recorded_and_replayed_matches_the_measured_acts(tmp_path):
    """The issue's validation, on this machine: sessions in real sandboxes (bubblewrap or the
    unshare fallback) run short commands between LLM-like gaps; the run is recorded, replayed in the
    simulator on the same cores with the runtime's own costs, and the simulated mean ACT must be
    within 50% of the measured one (the error is printed; sandbox start-up varies with the load
    of a shared machine, which the simulator does not model)."""
    import asyncio
    import shutil

    from arl_tangram.runtime import Tangram
    from arl_tangram.sim.validate import replay_error

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    path = tmp_path / "real.jsonl"

    async def run():
        async with Tangram.local("tangram") as tg:
            # the simulator models a runtime whose warm pools are full; the first half second after a
            # start, while both pools (one-shots', sessions' layered sandboxes) fill at once, a
            # session's first step can pay a sandbox's start (50-140 ms measured) that it does not model
            sm = tg.runtime.sandbox_manager()
            for _ in range(200):
                if len(sm.pool.idle) >= sm.config.warm_pool and len(sm.spares.idle) >= sm.spares.wanted():
                    break
                await asyncio.sleep(0.05)
            rec = TraceRecorder(path)
            tg.runtime.engine.listeners.append(rec)

            async def trajectory(i):
                s = await tg.session(job="rec", trajectory=f"t{i}")
                for k in range(4):
                    await asyncio.sleep(0.1 + 0.05 * ((i + k) % 3))
                    r = await s.exec(f"sleep 0.05 && echo {i}-{k} && ls / > /dev/null", operation="shell")
                    assert r.outcome.value == "ok", r.message
                await s.close()

            await asyncio.gather(*(trajectory(i) for i in range(3)))
            rec.close()
            return tg.runtime.cluster, tg.runtime.engine.costs

    cluster, costs = asyncio.run(run())
    err = replay_error(path, cluster, costs=costs)
    print(json.dumps(err))
    assert err["actions"] == 12
    assert abs(err["avg_act_error"]) < 0.5


def test_a_model_call_without_its_own_weights_is_recorded_with_the_services_and_loads(tmp_path, harness):
    """A batch the runtime forms from several callers carries no ``weights_gb``: the recorder
    writes the registered service's, which a model line needs to load."""
    from arl_tangram.core import ModelSpec, uniform_cluster
    from arl_tangram.policy import tangram_policy

    cluster = uniform_cluster(cpus=1, gpus=1, models=(ModelSpec("teacher", 2.0),))
    h = harness(cluster, tangram_policy())
    path = tmp_path / "models.jsonl"
    rec = TraceRecorder(path, models=cluster.models)
    h.engine.listeners.append(rec)
    h.submit("m", service="model:teacher", gpu=1)
    started = h.schedule()
    h.finish_loads()
    started.update(h.schedule())
    assert "m" in started
    h.advance(0.2)
    h.complete("m", exec_s=0.2)
    rec.close()
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["service"] == "model:teacher" and line["weights_gb"] == 2.0
    assert load_trace(path).num_actions == 1
