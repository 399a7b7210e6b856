"""A session's step on the Ray head (``RemoteSandboxes``): a step at home goes as a one-shot does (no
task, no lock), and a move or a step that must carry the session waits for that step's answer. At the
seam: the link (``send_run``) and the carry replaced by test doubles that record what happens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from arl_tangram.core import Action, Allocation, Outcome
from arl_tangram.core.seam import Completion
from arl_tangram.managers.sandbox.spec import RunCode
from arl_tangram.runtime import ray_runtime


def _setup(monkeypatch):
    events: list[str] = []
    answers: dict[str, object] = {}

    def send_run(runtime, node, action, allocation, done, after=None):
        events.append(f"sent {action.id} to {node.name}")
        answers[action.id] = done

    async def run_on_node(runtime, node, action, allocation):
        answer = asyncio.get_running_loop().create_future()
        send_run(runtime, node, action, allocation, answer.set_result)
        return await answer

    monkeypatch.setattr(ray_runtime, "send_run", send_run)
    monkeypatch.setattr(ray_runtime, "run_on_node", run_on_node)
    nodes = [SimpleNamespace(name=f"n{i}", index=i, state="alive") for i in range(2)]
    runtime = SimpleNamespace(by_index=dict(enumerate(nodes)),
                              images=SimpleNamespace(first_step=lambda node, action, allocation: allocation,
                                                     forget=lambda traj: None))
    runtime.engine = SimpleNamespace(
        cpu=SimpleNamespace(session_mem={}, attach=lambda traj, node, gb: events.append(f"homed {traj} on n{node}")),
        costs=SimpleNamespace(session_mem_gb=1.0))
    sunk: list[Completion] = []
    remote = ray_runtime.RemoteSandboxes(runtime, sunk.append)

    async def carry(traj, old, new, balance=False):
        events.append(f"carried {traj} from {old.name} to {new.name}")
        remote.homes[traj] = new

    monkeypatch.setattr(remote, "carry", carry)
    return remote, nodes, events, answers, sunk


async def _turns(n: int) -> None:
    """Let the loop run ``n`` passes: what waits on a lock or an answer moves on."""
    for _ in range(n):
        await asyncio.sleep(0)


def _step(i: int, node: int) -> tuple[Action, Allocation]:
    return Action(f"s{i}", "sandbox", trajectory="t", payload=RunCode("print(1)")), Allocation("cpu", node, (0,))


def test_a_step_at_home_is_sent_without_a_task_and_a_move_waits_for_its_answer(monkeypatch):
    remote, nodes, events, answers, sunk = _setup(monkeypatch)

    async def main():
        remote.start(*_step(1, 0))  # the first step: its home is where it lands
        remote.start(*_step(2, 0))  # answered not yet: this one takes the lock and waits
        tasks_after_start = dict(remote.tasks.actions)
        move = asyncio.ensure_future(remote.move("t", nodes[1]))
        await _turns(5)
        before_answer = list(events)
        answers["s1"](Completion("s1", Outcome.OK))
        await _turns(20)
        answers["s2"](Completion("s2", Outcome.OK))
        await asyncio.wait_for(move, 5)
        await remote.shut_down()
        return tasks_after_start, before_answer

    tasks_after_start, before_answer = asyncio.run(main())
    assert list(tasks_after_start) == ["s2"]  # s1 took no task
    assert before_answer == ["sent s1 to n0"]  # neither s2 nor the move went while s1 ran
    assert events == ["sent s1 to n0", "sent s2 to n0", "carried t from n0 to n1", "homed t on n1"], events
    assert [c.action_id for c in sunk] == ["s1", "s2"]
    assert remote.homes["t"] is nodes[1] and remote._stepping == {}


def test_a_step_placed_away_from_home_carries_the_session_after_the_step_in_flight(monkeypatch):
    remote, nodes, events, answers, sunk = _setup(monkeypatch)

    async def main():
        remote.start(*_step(1, 0))
        remote.start(*_step(2, 1))  # placed on the other node: a move first, after s1's answer
        await _turns(5)
        before_answer = list(events)
        answers["s1"](Completion("s1", Outcome.OK))
        await _turns(20)
        answers["s2"](Completion("s2", Outcome.OK))
        await _turns(5)
        remote.start(*_step(3, 1))  # at its new home: sent without a task again
        fast = "s3" not in remote.tasks.actions
        answers["s3"](Completion("s3", Outcome.OK))
        await remote.shut_down()
        return before_answer, fast

    before_answer, fast = asyncio.run(main())
    assert before_answer == ["sent s1 to n0"]
    assert events == ["sent s1 to n0", "carried t from n0 to n1", "sent s2 to n1", "sent s3 to n1"], events
    assert fast and [c.action_id for c in sunk] == ["s1", "s2", "s3"]
