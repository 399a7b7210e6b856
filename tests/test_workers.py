"""Sandbox worker processes (``runtime/workers.py``): one-shots run in workers, sessions stay in
the engine process, a worker that dies ends its runs as infra_error and is replaced, and nothing
is left behind at shutdown."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest

from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox.manager import SandboxConfig
from arl_tangram.runtime import Tangram

from servers import children_of
from shrink_probe import WATCH_CORES, needs_a_core_to_take_back

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _runners_of(pid: int) -> int:
    """Processes under ``pid`` (its sandboxes' runners and their children)."""
    kids = children_of(pid)
    return len(kids) + sum(_runners_of(k) for k in kids)


async def _until(condition, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


def test_one_shots_run_in_workers_and_sessions_stay_here():
    async def main():
        async with Tangram.local(workers=2) as tg:
            sw = tg.runtime.sandboxes
            assert [w.up for w in sw.workers] == [True, True]
            rs = await asyncio.gather(*(tg.run(f"import os\nprint(os.getpid() > 0, {i})") for i in range(12)))
            assert [r.stdout for r in rs] == [f"True {i}\n" for i in range(12)]
            assert sum(_runners_of(w.proc.pid) for w in sw.workers) > 0  # the sandboxes are the workers'
            bash = await tg.run("echo out; echo err >&2; exit 3", "bash")
            assert (bash.outcome, bash.stdout, bash.stderr) == (Outcome.FAILED, "out\n", "err\n")
            s = await tg.session()
            await s.exec(python="x = 20")
            assert (await s.exec(python="print(x * 2)")).stdout == "40\n"
            assert s.id in sw.local.sessions  # the session's sandbox is the engine process's
            await s.close()
            workers = [w.proc for w in sw.workers]
        for p in workers:
            assert p.poll() is not None, "a worker outlived the runtime"

    asyncio.run(main())


def test_each_cores_wait_between_one_shots_is_counted_in_the_workers_and_merged():
    """``/healthz`` core_waits with workers: the workers count (the engine process ran none of the
    one-shots), and the engine process merges their counts; one at a time, every run but each
    core's first waited for the client's next request."""

    async def main():
        async with Tangram.local(workers=2) as tg:
            for _ in range(8):
                assert (await tg.run("print(1)")).stdout == "1\n"
            merged = await tg.runtime.core_waits()
            here = tg.runtime.sandboxes.local.core_waits.state()
            return merged, here, len(tg.runtime.sandboxes.local.host_cpus)

    merged, here, cores = asyncio.run(main())
    assert sum(here[0]) == 0, "the engine process ran no one-shot"
    assert 8 - cores <= merged["n"] <= 7 and merged["p50_ms"] > 0 and merged["mean_ms"] > 0



def test_what_became_of_one_shot_sandboxes_is_counted_in_the_workers_and_summed():
    """``/healthz`` one_shot_sandboxes with workers: the workers' recycled sandboxes reach the
    engine process's sum (it ran none of the one-shots itself), and their pools' starts too."""

    async def main():
        async with Tangram.local(workers=2) as tg:
            for _ in range(8):
                assert (await tg.run("print(1)")).stdout == "1\n"
            summed: dict = {}

            async def all_recycled() -> bool:
                summed.update(await tg.runtime.one_shot_sandboxes())
                return summed["recycled"] + summed["discarded"] >= 8

            for _ in range(100):
                if await all_recycled():
                    break
                await asyncio.sleep(0.05)
            return summed, tg.runtime.sandboxes.local.one_shot_sandboxes()

    summed, here = asyncio.run(main())
    assert here["recycled"] == 0, "the engine process ran no one-shot"
    assert summed["recycled"] == 8 and summed["discarded"] == 0, summed
    assert summed["started_for_pool"] > here["started_for_pool"], summed


def test_a_dead_worker_ends_its_runs_as_infra_error_and_is_replaced():
    async def main():
        async with Tangram.local(workers=1) as tg:
            w = tg.runtime.sandboxes.workers[0]
            first = w.proc.pid
            slow = asyncio.ensure_future(tg.run("import time\ntime.sleep(3)\nprint('late')"))
            await asyncio.sleep(0.8)
            os.kill(first, signal.SIGKILL)
            r = await slow
            assert r.outcome is Outcome.INFRA_ERROR and "worker" in r.message
            assert await _until(lambda: w.up and w.proc.pid != first), "the dead worker was not replaced"
            assert (await tg.run("print('again')")).stdout == "again\n"
            cancelled = asyncio.ensure_future(tg.run("import time\ntime.sleep(5)", id="to-cancel"))
            await asyncio.sleep(0.5)
            assert tg.runtime.cancel("to-cancel")
            assert (await cancelled).outcome is Outcome.CANCELLED

    asyncio.run(main())


def test_a_worker_that_dies_idle_costs_no_run_and_a_cancel_at_once_ends_the_action():
    async def main():
        async with Tangram.local(workers=1) as tg:
            w = tg.runtime.sandboxes.workers[0]
            first = w.proc.pid
            os.kill(first, signal.SIGKILL)  # nothing running: noticed from the link, not from a run
            assert await _until(lambda: not w.up or w.proc.pid != first), "the idle death went unnoticed"
            r = await tg.run("print('fine')")
            assert (r.outcome, r.stdout) == (Outcome.OK, "fine\n"), r.message
            for local in (False, True):  # cancelled in the very loop pass that started it
                if local:
                    w.up = False  # marked down: the run goes to the engine process's own manager
                task = asyncio.ensure_future(tg.run("import time\ntime.sleep(3)", id=f"early-{local}"))
                await asyncio.sleep(0)
                assert tg.runtime.cancel(f"early-{local}")
                assert (await asyncio.wait_for(task, 10)).outcome is Outcome.CANCELLED

    asyncio.run(main())


@needs_a_core_to_take_back
def test_a_run_on_a_worker_is_shrunk_there():
    """``Shrink`` of a one-shot that a worker runs: the frame reaches the worker's manager, whose
    sandbox's cgroup shrinks while the program runs (or, on a machine so loaded that the frame
    beats the sandbox's start, is pinned to the one core when it starts: "1 1"). Pinned one-shots,
    so that the program sees its cores shrink; one sharing the CPUs gets a smaller CPU-time quota
    instead (tests/test_sandbox.py)."""
    from arl_tangram.core import Allocation
    code = WATCH_CORES

    async def main():
        async with Tangram.local(workers=1, sandbox=SandboxConfig(one_shots_share_cpus=False)) as tg:
            sw = tg.runtime.sandboxes
            assert tg.runtime.engine.cpu_resizes
            run = asyncio.ensure_future(tg.run(code, cpus=2, id="grown", timeout_s=30))
            assert await _until(lambda: "grown" in sw.where)
            await asyncio.sleep(0.8)  # started in its sandbox
            sw.resize("grown", Allocation("cpu", 0, (0,)))
            return await run

    r = asyncio.run(main())
    assert r.outcome is Outcome.OK and r.stdout in ("2 1\n", "1 1\n"), (r.stdout, r.stderr)


def test_one_shots_queued_behind_a_run_start_in_its_worker_as_it_ends():
    """``Follow`` on real workers: with the one core busy, short one-shots queue behind the run
    (one at a time), start in the worker the moment it ends, and take its core; one cancelled
    while queued ends cancelled, and the next queues behind the run instead."""
    from arl_tangram.policy import tangram_policy

    async def main():
        # a run followed for up to 5 s of its own (the default, 0.1 s, would not follow a 1.5 s one)
        async with Tangram.local(tangram_policy(follow_max_s=5.0), cores=1, workers=1) as tg:
            e = tg.runtime.engine
            slow = asyncio.ensure_future(tg.run("import time\ntime.sleep(1.5)\nprint('slow')", hint_s=0.05,
                                                id="slow"))
            assert await _until(lambda: "slow" in e.running)
            quick = {i: asyncio.ensure_future(tg.run(f"print({i})", hint_s=0.01, id=f"q{i}")) for i in range(4)}
            assert await _until(lambda: e.following == {"q0": "slow"}), e.following
            assert e.running.keys() == {"slow"} and "q0" in tg.runtime.sandboxes.where
            assert tg.runtime.state_of("q0") == "running"
            assert tg.runtime.cancel("q0")
            assert (await quick.pop(0)).outcome is Outcome.CANCELLED
            assert await _until(lambda: e.following == {"q1": "slow"}), e.following
            r = await slow
            assert (r.outcome, r.stdout) == (Outcome.OK, "slow\n")
            for i, task in quick.items():
                r = await task
                assert (r.outcome, r.stdout) == (Outcome.OK, f"{i}\n"), r.message
            assert e.handed_over >= 1 and not e.following and e.cpu.total_free == 1

    asyncio.run(main())


class _Agent:
    """A worker's agent double: records what it is asked; runs end when the test says."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str | None]] = []
        self.done: dict[str, object] = {}
        self.cancelled: list[str] = []

    def run_cb(self, action, allocation, done, after=None) -> None:
        if after is not None and any(a == after for _, a in self.started):
            raise RuntimeError(f"{after} already has a follower here")  # as SandboxManager.start
        self.started.append((action.id, after))
        self.done[action.id] = done

    def cancel(self, action_id: str) -> None:
        self.cancelled.append(action_id)

    def end(self, action_id: str) -> None:
        from arl_tangram.core.seam import Completion
        self.done.pop(action_id)(Completion(action_id, Outcome.OK))


def test_a_worker_hands_each_follower_to_its_manager_at_once_with_the_run_it_follows():
    """The worker's side of the lease (``_Served``), at the link's seam: a follower goes to the
    manager when its frame comes, naming the run it waits for (the manager holds its request until
    that run answers: tests/test_lease.py); one the manager refuses is answered as refused, not
    lost; a cancel goes through; each run is answered once, when it ends."""
    from arl_tangram.core import Action, Allocation, Demand
    from arl_tangram.runtime.workers import _Served

    agent = _Agent()
    served = _Served(agent, asyncio.Event())
    answers: list[tuple[str, bool, object]] = []

    def act(i: str):
        return Action(i, "sandbox", Demand({"cpu": (1, 1)})), Allocation("cpu", 0, (0,))

    def reply_for(i: str):
        return lambda ok, value: answers.append((i, ok, getattr(value, "outcome", value)))

    served.run(*act("a"), reply=reply_for("a"))
    served.follow(*act("f1"), "a", reply=reply_for("f1"))
    served.follow(*act("f2"), "f1", reply=reply_for("f2"))
    assert agent.started == [("a", None), ("f1", "a"), ("f2", "f1")] and not answers
    served.follow(*act("x"), "a", reply=reply_for("x"))  # a second follower of a
    assert answers == [("x", False, answers[0][2])] and isinstance(answers[0][2], RuntimeError)
    assert "x" not in served.active
    served.cancel("f2")
    assert agent.cancelled == ["f2"]
    for aid in ("a", "f1", "f2"):
        agent.end(aid)
    assert [a[:2] for a in answers[1:]] == [("a", True), ("f1", True), ("f2", True)]
    assert not served.active


def test_each_worker_keeps_a_ready_sandbox_per_core_unless_the_config_sizes_the_pool():
    """The lease starts a follower while the sandbox before it is being reset: by default a
    worker's warm pool is at least its share of the cores; a ``warm_pool`` the config sets is
    split among the workers as it says (its memory is the user's choice), 0 stays 0."""
    import json
    from types import SimpleNamespace

    from arl_tangram.managers.sandbox.spec import SandboxConfig
    from arl_tangram.runtime.workers import SandboxWorkers

    def warm_of(config: SandboxConfig) -> int:
        local = SimpleNamespace(config=config, host_cpus=tuple(range(16)))
        return json.loads(json.dumps(SandboxWorkers(local, 4, lambda r: None)._config()))["warm_pool"]

    assert warm_of(SandboxConfig()) == 4  # 4 cores a worker (the default pool, 4, split: 1)
    assert warm_of(SandboxConfig(warm_pool=4)) == 1
    assert warm_of(SandboxConfig(warm_pool=32)) == 8
    assert warm_of(SandboxConfig(warm_pool=0)) == 0
    assert warm_of(SandboxConfig.model_validate({"warm_pool": 2})) == 1


def test_a_worker_process_runs_its_module_once():
    """``-m arl_tangram.runtime.workers`` ran workers.py again as ``__main__`` beside the copy the
    package had imported (runpy's RuntimeWarning at every start); the entry point is a module that
    nothing imports. Without its spec in the environment, the worker stops at reading it."""
    import subprocess
    import sys

    from arl_tangram.runtime.workers import ENV

    p = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "arl_tangram.runtime.worker_process"],
                       capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                        if k != ENV})
    assert p.returncode != 0 and "RuntimeWarning" not in p.stderr, p.stderr
    assert "KeyError" in p.stderr, p.stderr


def test_each_workers_pools_have_room_for_what_its_cores_circulate():
    """A worker's pools follow the cores the engine schedules (up to two a CPU), not the host's
    CPUs: a ready sandbox a core, idle room for three a core (a run's, its follower's and one being
    reset), the default idle cap growing to that room on a larger host; a size or cap the config
    sets itself is only split among the workers."""
    from types import SimpleNamespace

    from arl_tangram.managers.sandbox.spec import SandboxConfig
    from arl_tangram.runtime.workers import SandboxWorkers

    def config(cores, cpus=16, workers=4, **kw) -> dict:
        local = SimpleNamespace(config=SandboxConfig(**kw), host_cpus=tuple(range(cpus)))
        return SandboxWorkers(local, workers, lambda report: None, cores)._config()

    def sizes(c: dict) -> tuple[int, int, int]:
        return c["warm_pool"], c["recycle_pool_max"], c["max_idle_sandboxes"]

    assert sizes(config(None)) == (4, 12, 16)
    assert sizes(config(24)) == (6, 18, 18)
    assert sizes(config(1000)) == (8, 24, 24)  # sized for 32 cores: two a CPU
    assert sizes(config(None, cpus=64, workers=8)) == (8, 24, 24)  # the default cap, 64, was 8 a worker
    assert sizes(config(None, cpus=64, workers=8, max_idle_sandboxes=64)) == (8, 24, 8)  # the user's cap
    assert sizes(config(24, recycle_pool_max=8, max_idle_sandboxes=16)) == (6, 2, 6)
