"""One scheduling round per loop pass for the reports it brings (``Runtime.tick_soon``, issue 26):
k completions read in one pass free their cores at once and start the queued actions in one
``schedule()``; every action still ends exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from arl_tangram.core.action import Action, Demand, Outcome
from arl_tangram.core.seam import Completion
from arl_tangram.driver import Driver
from arl_tangram.managers.sandbox.spec import SandboxConfig, SandboxResult
from arl_tangram.runtime.local import LocalRuntime


class HeldRuns:
    """A CPU manager double that holds what it starts until the test answers them together,
    as one read of a worker's link hands the engine process several answers."""

    def __init__(self, sink, expire=None) -> None:
        self.sink = sink
        self.config = SandboxConfig()
        self.held: list[str] = []

    async def start_up(self) -> None:
        pass

    async def shut_down(self) -> None:
        pass

    def start(self, action, allocation) -> None:
        self.held.append(action.id)

    def answer_all(self) -> list[str]:
        done, self.held = self.held, []
        for aid in done:
            self.sink(Completion(aid, Outcome.OK, 0.0, 0.0, "", SandboxResult()))
        return done

    def cancel(self, action_id: str) -> None:
        if action_id in self.held:
            self.held.remove(action_id)
            self.sink(Completion(action_id, Outcome.CANCELLED, message="cancelled while running"))

    def close_session(self, trajectory: str) -> None:
        pass


def _runtime(cores: int) -> tuple[LocalRuntime, list[int]]:
    rt = LocalRuntime(sandboxes=HeldRuns, cores=cores, memory_gb=16)
    rounds = [0]

    class Counting(Driver):
        __slots__ = ()

        def tick(self) -> int:
            rounds[0] += 1
            return super().tick()

    rt.driver = Counting(rt.engine, rt._arm)
    return rt, rounds


def test_the_completions_of_one_pass_start_the_queue_in_one_round():
    async def main():
        rt, rounds = _runtime(cores=4)
        await rt.start()
        m: HeldRuns = rt.sandboxes
        waits = [asyncio.ensure_future(rt.submit(Action(f"a{i}", "sandbox", Demand({"cpu": (1, 1)}))))
                 for i in range(12)]
        await asyncio.sleep(0)  # the submissions run: 4 start, 8 queue
        assert len(m.held) == 4 and len(rt.engine.pending) == 8
        before = rounds[0]
        first = m.answer_all()  # four answers in one callback of the loop
        assert rt.engine.cpu.meter.held == 0  # their cores are back at once ...
        assert rounds[0] == before and not m.held  # ... and handed on by one round, after the pass
        await asyncio.sleep(0)
        assert rounds[0] == before + 1 and len(m.held) == 4 and len(rt.engine.pending) == 4
        second = m.answer_all()
        await asyncio.sleep(0)
        third = m.answer_all()
        results = await asyncio.gather(*waits)
        assert sorted(first + second + third) == sorted(f"a{i}" for i in range(12))
        assert [r.outcome for r in results] == [Outcome.OK] * 12  # each ended once, as itself
        await rt.close()

    asyncio.run(main())


def test_a_report_outside_a_running_loop_is_scheduled_at_once():
    rt, rounds = _runtime(cores=1)
    before = rounds[0]
    rt.tick_soon()
    assert rounds[0] == before + 1 and not rt._round_due


def test_the_rounds_script_measures_the_code_it_is_pointed_at():
    """``tools/rounds.py`` runs as a file against a checkout's ``src`` (its A/B use)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root / "src"), ARL_TANGRAM_PURE="1")
    done = subprocess.run([sys.executable, str(root / "tools" / "rounds.py"), "--k", "4", "--actions", "400",
                           "--cores", "4"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["k"] == 4 and out["actions"] == 400 and out["cores"] == 4
    assert out["rounds_per_action"] > 0 and out["cpu_us_per_action"] > 0 and out["actions_per_s"] > 0
