"""The runtime at the manager seam: the same tests over the in-process double (any Linux host)
and over real sandboxes (where bubblewrap is installed)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from arl_tangram.core import Action, Demand, InvalidAction, Outcome
from arl_tangram.core.seam import Manager, ModelHost
from arl_tangram.managers.quota import ApiManager
from arl_tangram.managers.sandbox.manager import RunCode, SandboxConfig, SandboxManager
from arl_tangram.runtime import Tangram
from arl_tangram.sim.managers import SimApiManager, SimModelManager, SimSandboxManager
from arl_tangram.core.clock import ManualClock
from arl_tangram.core.cluster import uniform_cluster

from doubles import InProcessSandboxes

BACKENDS = ["double", pytest.param("real", marks=pytest.mark.skipif(shutil.which("bwrap") is None,
                                                                      reason="bubblewrap is not installed"))]


def local(backend: str, **kw) -> Tangram:
    if backend == "double":
        return Tangram.local(sandboxes=InProcessSandboxes.factory(), cores=2, **kw)
    return Tangram.local(sandbox=SandboxConfig(warm_pool=1), **kw)


def run(backend: str, body, **kw):
    async def main():
        async with local(backend, **kw) as tg:
            return await body(tg)
    return asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_shots_report_their_output_and_outcome(backend):
    async def body(tg):
        return await asyncio.gather(tg.run("print(input()[::-1])", stdin="olleh"), tg.run("exit 3", "bash"),
                                    tg.run("echo $((6*7))", "bash"))

    ok, failed, bash = run(backend, body)
    assert (ok.outcome, ok.stdout) == (Outcome.OK, "hello\n")
    assert failed.outcome is Outcome.FAILED and failed.result.run.exit_code == 3
    assert bash.stdout == "42\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_session_keeps_its_state_and_files(backend):
    async def body(tg):
        s = await tg.session(job="j")
        await s.exec(python="x = 41")
        await s.put({"data.txt": b"payload"})
        r = await s.exec(python="print(x + 1)")
        files = await s.get(["data.txt", "nope.txt"])
        shell = await s.exec("cat data.txt")
        await s.close()
        return r, files, shell

    r, files, shell = run(backend, body)
    assert r.stdout == "42\n"
    assert files == {"data.txt": b"payload"}
    assert shell.stdout == "payload"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_id_in_flight_is_refused_and_the_first_caller_keeps_its_result(backend):
    """Bug: the second submission replaced the first caller's future before the engine refused
    the duplicate, so the first caller never got its result."""
    async def body(tg):
        first = asyncio.ensure_future(tg.run("import time; time.sleep(0.3); print('first')", id="dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidAction) as e:
            await tg.run("print('second')", id="dup")
        assert e.value.field == "id"
        return await asyncio.wait_for(first, 20)

    r = run(backend, body)
    assert (r.outcome, r.stdout) == (Outcome.OK, "first\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_a_running_action_ends_it_once_as_cancelled(backend):
    async def body(tg):
        rt = tg.runtime
        task = asyncio.ensure_future(tg.run("import time; time.sleep(30)", id="long", timeout_s=60))
        for _ in range(200):
            if rt.state_of("long") == "running":
                break
            await asyncio.sleep(0.02)
        assert rt.state_of("long") == "running"
        assert rt.cancel("long") is True
        r = await asyncio.wait_for(task, 20)
        assert rt.cancel("long") is False and rt.state_of("long") is None
        return r

    r = run(backend, body)
    assert r.outcome is Outcome.CANCELLED and "cancelled" in r.message


def test_a_queued_action_that_is_cancelled_never_reaches_a_manager():
    async def body(tg):
        rt = tg.runtime
        blockers = [asyncio.ensure_future(tg.run("import time; time.sleep(0.5)")) for _ in range(2)]
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(tg.run("print(1)", id="queued"))
        await asyncio.sleep(0.05)
        assert rt.state_of("queued") == "queued"
        rt.cancel("queued")
        r = await waiting
        await asyncio.gather(*blockers)
        return r, [a.id for a, _ in rt.sandboxes.started]

    r, started = run("double", body)
    assert r.outcome is Outcome.CANCELLED and "queued" not in started


def test_snapshot_reports_queue_and_cores_without_reaching_into_the_engine():
    async def body(tg):
        rt = tg.runtime
        tasks = [asyncio.ensure_future(tg.run("import time; time.sleep(0.4)")) for _ in range(3)]
        await asyncio.sleep(0.15)
        snap = rt.snapshot()
        await asyncio.gather(*tasks)
        return snap, rt.snapshot()

    busy, idle = run("double", body)
    assert (busy.cores, busy.running, busy.queued, busy.cores_held) == (2, 2, 1, 2)
    assert (idle.running, idle.queued, idle.cores_held) == (0, 0, 0)


def test_every_manager_satisfies_the_seam():
    clock, sink = ManualClock(), (lambda r: None)
    at = lambda t, fn: None  # noqa: E731
    cluster = uniform_cluster(cpus=4, gpus=2)
    assert isinstance(SandboxManager(SandboxConfig(), sink), Manager)
    assert isinstance(ApiManager({}, sink), Manager)
    assert isinstance(InProcessSandboxes(sink), Manager)
    assert isinstance(SimSandboxManager(at, clock, sink), Manager)
    assert isinstance(SimApiManager(at, clock, sink, ()), Manager)
    assert isinstance(SimModelManager(at, clock, sink, cluster), ModelHost)
    assert not isinstance(SimSandboxManager(at, clock, sink), ModelHost)
    # what can take cores back from a running action (``Shrink``): the sandboxes, real and simulated
    from arl_tangram.core.seam import Resizer
    assert isinstance(SandboxManager(SandboxConfig(), sink), Resizer)
    assert isinstance(SimSandboxManager(at, clock, sink), Resizer)
    assert not isinstance(InProcessSandboxes(sink), Resizer)


def test_a_model_batch_that_never_ends_still_answers_every_caller():
    """Bug: when the batch's task was cancelled (as closing the runtime does) or raised, every
    caller in the batch waited forever."""
    pytest.importorskip("torch")
    from arl_tangram.managers.models.manager import ModelServiceConfig

    async def main():
        tg = Tangram.local(sandboxes=False, models=[ModelServiceConfig(
            "slow", "model_fixtures:slow_reward_model", {"delay_s": 2.0}, max_batch=4, max_wait_ms=5)])
        await tg.__aenter__()
        calls = [asyncio.ensure_future(tg.score("slow", [1, 2, 3])) for _ in range(3)]
        await asyncio.sleep(0.3)  # the batch is running on the "device"
        await tg.runtime.close()
        return await asyncio.wait_for(asyncio.gather(*calls), 10)

    results = asyncio.run(main())
    assert [r.outcome for r in results] == [Outcome.INFRA_ERROR] * 3
    assert all("did not run to an outcome" in r.message for r in results)


def test_the_sandbox_manager_refuses_to_report_without_a_sink():
    m = SandboxManager(SandboxConfig())
    with pytest.raises(RuntimeError, match="without a sink"):
        m.tasks.sink(object())


def test_bad_actions_are_rejected_with_the_field_named():
    async def body(tg):
        big = Action(tg.runtime.new_id("r"), "sandbox", Demand.of(cpu=(64, 64)), payload=RunCode("print(1)"))
        return await tg.runtime.submit(big)

    r = run("double", body)
    assert r.outcome is Outcome.REJECTED and r.message.startswith("demand.cpu:")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_memory_limit_above_the_default_is_honoured(backend):
    """Bug (cgroup v1): raising a sandbox's memory limit above its memory+swap limit failed, so
    every run asking for more than the default 512 MB (verl asks 1024) was an infra_error."""
    async def body(tg):
        return await tg.run("x = bytearray(700 << 20); print(len(x) >> 20)", memory_mb=1024)

    r = run(backend, body)
    assert (r.outcome, r.stdout) == (Outcome.OK, "700\n")


def test_calls_on_an_ended_session_say_why_it_ended():
    from arl_tangram.runtime import SessionGone

    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 1")
        await s.close()
        with pytest.raises(SessionGone) as closed:
            await s.exec(python="print(x)")
        t = await tg.session()
        await t.exec(python="y = 1")
        tg.runtime.sandboxes.expire(t.id)  # what the sandbox manager does past the idle expiry
        with pytest.raises(SessionGone) as expired:
            await t.exec(python="print(y)")
        return closed.value.reason, expired.value.reason, tg.runtime.sandboxes.closed

    closed, expired, closed_in_manager = run("double", body)
    assert "closed by its owner" in closed and "expired" in expired
    assert len(closed_in_manager) == 2


def test_a_node_agent_without_isolation_reports_why_and_takes_no_work(monkeypatch):
    from arl_tangram.managers.sandbox import manager as sandbox_manager
    from arl_tangram.runtime.agent import NodeAgent

    def no_isolation(*args, **kwargs):
        raise RuntimeError("no sandbox isolation available: install bubblewrap")

    monkeypatch.setattr(sandbox_manager, "detect", no_isolation)

    async def main():
        agent = NodeAgent("n1", 2)
        info = await agent.start()
        with pytest.raises(RuntimeError, match="runs no sandboxes"):
            await agent.run(Action("a", "sandbox", payload=RunCode("print(1)")), None)
        return info

    info = asyncio.run(main())
    assert info["sandboxes"] is False and info["cores"] == 2
    assert "install bubblewrap" in info["problem"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_node_agent_runs_what_the_engine_started_on_its_node():
    from arl_tangram.core import Allocation
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0))
        info = await agent.start()
        try:
            c = await agent.run(Action("a", "sandbox", trajectory="t", payload=RunCode("print(6 * 7)")),
                                Allocation("cpu", 0, (0,)))
            held = agent.sessions()
        finally:
            await agent.shut_down()
        return info, c, held

    info, c, held = asyncio.run(main())
    assert info["sandboxes"] and info["isolation"] == "bwrap"
    assert c.outcome is Outcome.OK and c.result.run.stdout == "42\n" and held == ["t"]


def test_remaining_turns_reach_the_engine():
    async def body(tg):
        await tg.run("print(1)", remaining_turns=4)
        s = await tg.session()
        await s.exec("true", remaining_turns=1)
        return [a.remaining_turns for a, _ in tg.runtime.sandboxes.started]

    assert run("double", body) == [4, 1]


def test_numpy_numbers_reach_the_compiled_action_and_bad_ones_name_their_field():
    """Compiled (``setup.py``), ``Action`` takes exactly the types it declares: a numpy int for
    ``hint_s`` or ``remaining_turns`` (an RL loop's counters) was a ``TypeError`` naming no field,
    and 3.0 turns, which the sources take, too. The embedded API converts; what is no number is
    ``InvalidAction`` naming the field."""
    np = pytest.importorskip("numpy")
    from arl_tangram.core.cluster import ApiQuota

    async def echo(payload):
        return payload

    async def body(tg):
        one_shot = await tg.run("print(1)", remaining_turns=np.int64(2), hint_s=np.int64(1))
        session = await tg.session()
        step = await session.exec(python="x = 1", remaining_turns=3.0, hint_s=np.float32(0.5))
        call = await tg.call_api("echo", 7, hint_s=np.int64(1), timeout_s=np.int64(5))
        fields = []
        for kw in ({"remaining_turns": 2.5}, {"remaining_turns": "2"}, {"hint_s": "fast"}):
            with pytest.raises(InvalidAction) as e:
                await tg.run("print(1)", **kw)
            fields.append(e.value.field)
        return one_shot, step, call, fields

    one_shot, step, call, fields = run("double", body, apis={"echo": (ApiQuota("echo", 100.0, 4), echo)})
    assert (one_shot.outcome, step.outcome, call.outcome, call.result) == (Outcome.OK, Outcome.OK, Outcome.OK, 7)
    assert fields == ["remaining_turns", "remaining_turns", "hint_s"]


def test_a_callback_submit_gets_the_one_outcome_and_none_when_the_runtime_closes_first():
    """``submit_cb`` (a one-shot in a server's engine process, no task per action): the callback
    gets the terminal outcome once; an id in flight is refused before anything is scheduled; and
    an action still running when the runtime closes gets None (no outcome: it stays unfinished)."""
    from arl_tangram.runtime.api import one_shot

    got: dict[str, list] = {"quick": [], "slow": []}

    async def main():
        tg = local("double")
        await tg.__aenter__()
        rt = tg.runtime
        rt.submit_cb(one_shot("quick", "print(7)"), got["quick"].append)
        with pytest.raises(InvalidAction, match="in flight"):
            rt.submit_cb(one_shot("quick", "print(8)"), got["quick"].append)
        rt.submit_cb(one_shot("slow", "import time; time.sleep(5)"), got["slow"].append)
        for _ in range(100):
            if got["quick"]:
                break
            await asyncio.sleep(0.02)
        await tg.__aexit__(None, None, None)

    asyncio.run(main())
    [r] = got["quick"]
    assert r.id == "quick" and r.outcome is Outcome.OK and r.stdout == "7\n"
    assert got["slow"] == [None]


def test_results_cross_a_link_field_by_field_and_come_back_equal():
    """What a server's links carry per one-shot (the run's payload, its result, the answer to a
    front) pickles as its fields in order (``core.action.by_fields``) and rebuilds equal."""
    import pickle

    from arl_tangram.managers.sandbox.spec import CommandResult, SandboxResult
    from arl_tangram.runtime import ActionResult
    from arl_tangram.runtime.api import one_shot

    run = CommandResult(0, "out\n", "err", 0.25, truncated=True, display=[{"text/plain": "1"}], note="n")
    res = SandboxResult(run=run, compile=CommandResult(None, "", "", 1.0, timed_out=True), files={"a": b"\0"},
                        missing=["b"], message="m", info={"k": [1]})
    ar = ActionResult("x", Outcome.TIMEOUT, res, 1.5, 0.1, 0.2, 1.2, 2, "late")
    action = one_shot("y", "print(1)", stdin="in", files={"f": b"1"}, fetch_files=["g"], memory_mb=64)
    for value in (run, res, ar, action.payload):
        assert type(value).__reduce__(value)[0] is type(value)  # by its fields, not pickle's default
        assert pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) == value
