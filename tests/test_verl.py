"""The verl integration against the real verl package (the `verl` extra) and a live `tangram serve`.

The tool is loaded by verl's own tool loader from examples/verl/tool_config.yaml and driven by
verl's own ``ToolAgentLoop._call_tool`` (create, execute with ``agent_data``, release for every
call); the rewards are loaded by verl's own custom-reward loader and scorer."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import socket
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]
pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")

from omegaconf import OmegaConf  # noqa: E402  (verl's dependencies, present once verl is)
from servers import Server  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop  # noqa: E402
from verl.experimental.agent_loop.tool_parser import FunctionCall  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import ToolResponse  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402
from verl.utils.reward_score import default_compute_score  # noqa: E402

from arl_tangram.client import AsyncSession, AsyncTangramClient, TangramError  # noqa: E402
from arl_tangram.integrations.verl import InfraError, TangramSandboxTool, compute_score  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "verl"
SOLUTION = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TRUTH = json.dumps({"inputs": ["1 2", "3 4", "5 5"], "outputs": ["3", "7", "11"]})  # the last one is wrong


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-verl"))
    yield s
    s.stop()


def load_tool(url: str, monkeypatch, tmp_path: Path, **overrides) -> TangramSandboxTool:
    """The example tool config, through verl's own loader, the server's address from $TANGRAM_URL."""
    monkeypatch.setenv("TANGRAM_URL", url)
    config = OmegaConf.load(EXAMPLES / "tool_config.yaml")
    config.tools[0].config.update(overrides)
    path = tmp_path / f"tools-{uuid.uuid4().hex}.yaml"
    path.write_text(OmegaConf.to_yaml(config))
    [tool] = initialize_tools_from_config(str(path))
    assert isinstance(tool, TangramSandboxTool) and isinstance(tool, BaseTool)
    return tool


def agent_loop(tool: TangramSandboxTool) -> ToolAgentLoop:
    """verl's own loop object, with only what its ``_call_tool`` reads (no model, no workers)."""
    loop = object.__new__(ToolAgentLoop)
    loop.tools = {tool.name: tool}
    loop.max_tool_response_length = 4096
    loop.tool_response_truncate_side = "middle"
    return loop


def trajectory(request_id: str | None = None) -> AgentData:
    return AgentData(messages=[], image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                     metrics={}, request_id=request_id or uuid.uuid4().hex, tools_kwargs={})


async def call(loop: ToolAgentLoop, data: AgentData, code: str) -> tuple[ToolResponse, float, dict]:
    """One tool call of one turn, exactly as verl's loop makes it."""
    tool_call = FunctionCall(name="code_interpreter", arguments=json.dumps({"code": code}), tool_call_id="c1")
    return await loop._call_tool(tool_call, data.tools_kwargs, data)


def test_the_tool_follows_verls_base_tool_contract(server, monkeypatch, tmp_path):
    tool = load_tool(server.url, monkeypatch, tmp_path)

    async def main():
        instance, created = await tool.create(create_kwargs={})
        assert isinstance(instance, str) and isinstance(created, ToolResponse)
        response, reward, metrics = await tool.execute(instance, {"code": "print(6 * 7)"}, agent_data=trajectory())
        await tool.release(instance)
        missing = await tool.execute(instance, {}, agent_data=trajectory())
        await tool.aclose()
        return response, reward, metrics, missing

    response, reward, metrics, missing = asyncio.run(main())
    assert isinstance(response, ToolResponse) and response.text == "42\n" and reward == 0.0
    assert metrics["outcome"] == "ok" and metrics["cores"] == 1
    assert missing[2]["outcome"] == "rejected" and "'code'" in missing[0].text
    with pytest.raises(ValueError, match="config: timeout_s"):
        TangramSandboxTool({"type": "native", "timeout_s": -1}, tool.tool_schema)
    with pytest.raises(ValueError, match="config: tangram_ur: Extra inputs"):
        TangramSandboxTool({"type": "native", "tangram_ur": "http://x"}, tool.tool_schema)


def test_bash_mode_and_the_example_server_config(server, monkeypatch, tmp_path):
    from arl_tangram.server.config import load

    assert load(EXAMPLES / "tangram.toml").sandbox.session_idle_expiry_s == 1800
    tool = load_tool(server.url, monkeypatch, tmp_path, mode="bash")
    loop = agent_loop(tool)

    async def main():
        data = trajectory()
        await call(loop, data, "echo kept > f.txt")
        r = await call(loop, data, "cat f.txt; exit 3")
        await tool.aclose()
        return r

    text, _, metrics = asyncio.run(main())
    assert text.text == "kept\n" and metrics["outcome"] == "failed"


def test_state_persists_across_the_turns_of_one_trajectory(server, monkeypatch, tmp_path):
    tool = load_tool(server.url, monkeypatch, tmp_path)
    loop = agent_loop(tool)

    async def main():
        data = trajectory()
        first = await call(loop, data, "open('notes.txt', 'w').write('from turn 1')\nx = 41")
        second = await call(loop, data, "x += 1")
        third = await call(loop, data, "print(open('notes.txt').read(), x)")
        slow = await call(loop, data, "import time\ntime.sleep(60)")
        await tool.aclose()
        return first, second, third, slow

    tool.settings.timeout_s = 1
    first, second, third, slow = asyncio.run(main())
    assert [first[2]["outcome"], second[2]["outcome"]] == ["ok", "ok"]
    assert third[0].text == "from turn 1 42\n"
    assert slow[2]["outcome"] == "timeout" and "timed out after 1s" in slow[0].text


def test_two_trajectories_never_share_a_session_even_with_one_request_id(server, monkeypatch, tmp_path):
    tool = load_tool(server.url, monkeypatch, tmp_path)
    loop = agent_loop(tool)

    async def one(data: AgentData, secret: str) -> list[str]:
        await call(loop, data, f"secret = {secret!r}\nopen('mine.txt', 'w').write({secret!r})")
        await asyncio.sleep(0)
        r = await call(loop, data, "import os\nprint(secret, sorted(os.listdir('.')), open('mine.txt').read())")
        return r[0].text

    async def main():
        a, b = trajectory("det-0"), trajectory("det-0")  # verl's ids under full_determinism repeat
        texts = await asyncio.gather(one(a, "alpha"), one(b, "beta"))
        names = {tool._by_data[a].name, tool._by_data[b].name}
        await tool.aclose()
        return texts, names

    (ta, tb), names = asyncio.run(main())
    assert ta == "alpha ['mine.txt'] alpha\n" and tb == "beta ['mine.txt'] beta\n"
    assert len(names) == 2 and all(".det-0." in n for n in names)


def test_a_dropped_trajectory_closes_its_session(server, monkeypatch, tmp_path):
    tool = load_tool(server.url, monkeypatch, tmp_path)
    loop = agent_loop(tool)

    async def main():
        data = trajectory()
        await call(loop, data, "x = 1")
        name = tool._by_data[data].name
        del data  # what verl does when the trajectory's run() returns
        gc.collect()
        for _ in range(100):  # the finaliser schedules the close on the loop
            await asyncio.sleep(0.02)
            if not tool._closing:
                break
        async with AsyncTangramClient(server.url) as c:
            with pytest.raises(TangramError) as e:
                await AsyncSession(c, name).exec(python="print(x)")
        return e.value.status

    assert asyncio.run(main()) == 404


def test_an_idle_trajectory_is_closed_and_then_fails_instead_of_starting_empty(server, monkeypatch, tmp_path):
    tool = load_tool(server.url, monkeypatch, tmp_path, session_idle_s=0.3)
    loop = agent_loop(tool)

    async def main():
        old, new = trajectory(), trajectory()
        await call(loop, old, "x = 1")
        await asyncio.sleep(0.5)
        await call(loop, new, "y = 2")  # any call sweeps idle sessions
        await asyncio.gather(*tool._closing)
        with pytest.raises(InfraError, match="idle"):
            await tool.execute("i", {"code": "print(x)"}, agent_data=old)
        via_verl = await call(loop, old, "print(x)")
        await tool.aclose()
        return via_verl

    text, reward, metrics = asyncio.run(main())
    assert text.text.startswith("Error executing tool 'code_interpreter'") and "idle" in text.text


def test_an_infrastructure_failure_reaches_verl_as_a_failure(tmp_path, monkeypatch):
    s = Server(tmp_path)
    tool = load_tool(s.url, monkeypatch, tmp_path, retries=1, backoff_s=0.05)
    loop = agent_loop(tool)

    async def main():
        data, other = trajectory(), trajectory()
        ok = await call(loop, data, "x = 1")
        await call(loop, other, "y = 1")
        async with AsyncTangramClient(s.url) as c:  # the server loses the session (as on a restart)
            await AsyncSession(c, tool._by_data[other].name).close()
        with pytest.raises(InfraError, match="lost"):
            await tool.execute("i", {"code": "print(y)"}, agent_data=other)
        s.stop()
        with pytest.raises(InfraError, match="cannot reach"):
            await tool.execute("i", {"code": "print(x)"}, agent_data=data)
        return ok, await call(loop, data, "print(x)")

    try:
        ok, failed = asyncio.run(main())
    finally:
        s.stop()
    assert ok[2]["outcome"] == "ok"
    assert failed[0].text.startswith("Error executing tool 'code_interpreter'") and "cannot reach" in failed[0].text
    assert failed[2] == {}  # no outcome of ours is reported for a failed call


def test_compute_score_through_verls_custom_reward_loader(server, monkeypatch):
    monkeypatch.setenv("TANGRAM_URL", server.url)
    config = OmegaConf.load(EXAMPLES / "reward.yaml")
    fn = get_custom_reward_fn(config)
    kwargs = {"data_source": "codecontests", "ground_truth": TRUTH, "extra_info": {"num_turns": 1}}
    assert fn(solution_str=SOLUTION, **kwargs) == pytest.approx(2 / 3)
    assert fn(solution_str="```python\nprint(input()\n```", **kwargs) == 0.0  # a syntax error is the code's
    # what NaiveRewardManager adds when a reward model router runs
    assert fn(solution_str=SOLUTION, reward_router_address="127.0.0.1:1", reward_model_tokenizer=None,
              **kwargs) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="ground_truth"):
        fn(solution_str=SOLUTION, **(kwargs | {"ground_truth": json.dumps({"inputs": ["1"]})}))


def test_verls_own_sandbox_fusion_scorer_runs_against_tangram(server):
    """``reward.sandbox_fusion.url`` (verl's built-in scorer) against our SandboxFusion endpoint."""
    from verl.utils.reward_score import sandbox_fusion

    url = f"{server.url}/run_code"
    assert default_compute_score("codecontests", SOLUTION, TRUTH, sandbox_fusion_url=url,
                                 memory_limit_mb=512) == pytest.approx(2 / 3)
    # verl's default memory_limit_mb (reward.sandbox_fusion.memory_limit_mb) is 1024
    score, cases = sandbox_fusion.compute_score(url, None, 1024, SOLUTION, TRUTH, continuous=True)
    errors = {c["api_response"]["message"] for c in cases if c["status"] == "sandbox_error"}
    assert score == pytest.approx(2 / 3) and not errors


def test_an_unreachable_service_raises_instead_of_scoring_zero():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(InfraError, match="cannot reach"):
        compute_score("codecontests", SOLUTION, TRUTH, url=dead, retries=1)
    # verl's built-in scorer, for contrast, scores the same outage 0 (its behaviour, not ours)
    assert default_compute_score("codecontests", SOLUTION, TRUTH, sandbox_fusion_url=f"{dead}/run_code") == 0.0
