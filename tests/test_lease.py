"""The lease at the sandbox manager (``SandboxManager.start``'s ``after``): a one-shot queued
behind another on its cores takes and prepares its sandbox at once, and its request reaches that
sandbox only once the run before it has answered (or ended without an answer), never sooner;
one cancelled before its turn leaves what follows it waiting for the run it waited for."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from arl_tangram.core import Action, Allocation, Demand, Outcome
from arl_tangram.managers.sandbox.manager import RunCode, SandboxConfig, SandboxManager

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

#: prints the time it started, then its end's after ``SLEEP`` (the sandboxes share the host's clock)
TIMED = "import time\nt = time.time()\ntime.sleep({sleep})\nprint(t, time.time())"
CORE = Allocation("cpu", 0, (0,))


def _one_shot(aid: str, sleep: float = 0.0) -> Action:
    return Action(aid, "sandbox", Demand({"cpu": (1, 1)}), payload=RunCode(TIMED.format(sleep=sleep),
                                                                          run_timeout_s=30))


def _times(c) -> tuple[float, float]:
    assert c.outcome is Outcome.OK, (c.outcome, c.message)
    start, end = c.result.run.stdout.split()
    return float(start), float(end)


async def _until(condition, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _run(body):
    async def main():
        done: dict = {}
        m = SandboxManager(SandboxConfig(warm_pool=3), lambda c: done.setdefault(c.action_id, c))
        await m.start_up()
        try:
            await _until(lambda: len(m.pool.idle) >= 3)
            return await body(m, done)
        finally:
            await m.shut_down()

    return asyncio.run(main())


def test_a_follower_is_prepared_at_once_and_runs_only_once_the_run_before_it_answered():
    async def body(m: SandboxManager, done: dict):
        m.start(_one_shot("a", 0.5), CORE)
        await _until(lambda: m.runs.pins.get("a", [None])[0] is not None)
        m.start(_one_shot("f"), CORE, after="a")
        with pytest.raises(RuntimeError, match="already has a follower"):
            m.start(_one_shot("g"), CORE, after="a")  # would share a's core with f
        await _until(lambda: m.runs.pins.get("f", [None])[0] is not None)  # its sandbox, taken ahead
        assert "a" not in done and "f" not in done and m.lease.followers == 1
        await _until(lambda: "f" in done)
        a_end, f_start = _times(done["a"])[1], _times(done["f"])[0]
        assert f_start >= a_end, f"the follower started {a_end - f_start:.3f}s before the run it follows ended"
        m.start(_one_shot("late"), CORE, after="a")  # a has answered: nothing to wait for
        m.start(_one_shot("stranger"), CORE, after="not-here")
        await _until(lambda: "late" in done and "stranger" in done)
        assert done["late"].outcome is Outcome.OK and done["stranger"].outcome is Outcome.OK
        assert m.lease.followers == 0 and not m.lease.unanswered

    _run(body)


def test_a_follower_cancelled_before_its_turn_gives_its_sandbox_back_and_its_own_follower_keeps_waiting():
    """The engine hands a follower its cores once its predecessor's end is reported, which a cancel
    reports before the kill lands, so a follower can be followed in turn; cancelling the middle one
    must not let the last start beside the run still on the core."""

    async def body(m: SandboxManager, done: dict):
        m.start(_one_shot("a", 0.6), CORE)
        await _until(lambda: m.runs.pins.get("a", [None])[0] is not None)
        m.start(_one_shot("f1"), CORE, after="a")
        m.start(_one_shot("f2"), CORE, after="f1")
        await _until(lambda: m.runs.pins.get("f1", [None])[0] is not None)
        held = m.runs.pins["f1"][0]
        m.cancel("f1")
        await _until(lambda: "f1" in done)
        assert done["f1"].outcome is Outcome.CANCELLED and "a" not in done
        assert held in m.pool.idle and not held.dead, "a sandbox nothing ran in was killed"
        await _until(lambda: "f2" in done)
        a_end, f2_start = _times(done["a"])[1], _times(done["f2"])[0]
        assert f2_start >= a_end, f"f2 started {a_end - f2_start:.3f}s before the run on its core ended"
        assert m.lease.followers == 0 and not m.lease.unanswered

    _run(body)


def test_a_follower_of_a_run_cancelled_or_failed_starts_once_that_run_is_over():
    async def body(m: SandboxManager, done: dict):
        m.start(_one_shot("a", 30), CORE)
        await _until(lambda: m.runs.pins.get("a", [None])[0] is not None)
        m.start(_one_shot("f"), CORE, after="a")
        await asyncio.sleep(0.3)
        assert "f" not in done
        m.cancel("a")
        await _until(lambda: "f" in done)
        assert done["a"].outcome is Outcome.CANCELLED and done["f"].outcome is Outcome.OK
        bad = Action("bad", "sandbox", Demand({"cpu": (1, 1)}), payload=RunCode("1", language="cobol-2090"))
        m.start(_one_shot("b", 0.4), CORE)
        await _until(lambda: m.runs.pins.get("b", [None])[0] is not None)
        m.start(bad, CORE, after="b")  # rejected without running: what follows it still waits for b
        m.start(_one_shot("c"), CORE, after="bad")
        await _until(lambda: "c" in done)
        assert done["bad"].outcome is Outcome.REJECTED
        assert _times(done["c"])[0] >= _times(done["b"])[1]

    _run(body)


def test_the_place_of_a_follower_cancelled_before_its_turn_is_free_at_once():
    """As the engine does: a queued one-shot is cancelled and another queued behind the same run
    in the next frame, before the cancelled one's task has even ended."""

    async def body(m: SandboxManager, done: dict):
        m.start(_one_shot("a", 0.5), CORE)
        await _until(lambda: m.runs.pins.get("a", [None])[0] is not None)
        m.start(_one_shot("q0"), CORE, after="a")
        m.cancel("q0")
        m.start(_one_shot("q1"), CORE, after="a")
        await _until(lambda: "q1" in done)
        assert done["q0"].outcome is Outcome.CANCELLED
        assert _times(done["q1"])[0] >= _times(done["a"])[1]
        assert m.lease.followers == 0 and not m.lease.unanswered

    _run(body)


def test_a_run_of_the_same_id_started_again_does_not_strand_the_follower_of_the_first():
    """The engine reports a cancel at once and may take the same id again while the first run is
    still being killed here: the first run's end must still open its follower's turn (review of
    2eb427e: it was looked up by id, found the second run's entry and did nothing)."""
    from arl_tangram.managers.sandbox.lease import Unanswered
    from arl_tangram.managers.sandbox.sandbox import Turn

    m = SandboxManager(SandboxConfig())
    first = m.lease.unanswered["x"] = Unanswered()
    b = m.lease.unanswered["b"] = Unanswered()
    b.turn, b.before, first.next = Turn(), first, b
    m.lease.followers = 1
    again = m.lease.unanswered["x"] = Unanswered()  # the same id, started again
    m.lease.over("x", first)
    assert b.turn.opened and m.lease.followers == 0 and m.lease.unanswered["x"] is again
    m.lease.over("x", first)  # told twice: nothing more
    assert m.lease.followers == 0 and m.lease.unanswered["x"] is again
