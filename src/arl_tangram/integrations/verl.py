"""verl integration: a sandbox tool for verl's agent loop and a code-reward function.

``TangramSandboxTool`` follows verl's ``BaseTool`` interface (``create`` / ``execute`` /
``calc_reward`` / ``release``; it subclasses verl's class when verl is installed). A trajectory's
tool instance is a Tangram session: files and interpreter state carry over between turns, and
cores are held only while a call runs. Config snippet for verl's tool config YAML::

    tools:
      - class_name: arl_tangram.integrations.verl.TangramSandboxTool
        config: {tangram_url: "http://127.0.0.1:8080", job: "my-rl-job", timeout_s: 30, mode: python}
        tool_schema:
          type: function
          function:
            name: code_interpreter
            description: Run python code in a persistent sandbox and see its output.
            parameters: {type: object, properties: {code: {type: string}}, required: [code]}

``compute_score`` is a drop-in ``custom_reward_function`` (``reward_model.custom_reward_function.path``
pointing at this module, ``name: compute_score``): it runs the solution's code against the test
cases in ``ground_truth`` and returns the fraction that pass. An infrastructure failure raises
``InfraError`` after the client's retries instead of returning 0: a broken sandbox is not a wrong
answer.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

from ..client import AsyncTangramClient, TangramClient

try:  # pragma: no cover - depends on verl being installed
    from verl.tools.base_tool import BaseTool as _Base
except ImportError:  # verl is heavy (torch, ray); its documented interface is all we need
    class _Base:  # type: ignore[no-redef]
        def __init__(self, config: dict, tool_schema: Any) -> None:
            self.config = config
            self.tool_schema = tool_schema
            function = getattr(tool_schema, "function", None) or (tool_schema or {}).get("function", {})
            self.name = getattr(function, "name", None) or function.get("name", "tangram_sandbox")


class InfraError(RuntimeError):
    """The sandbox service failed (not the code): retry later, never score it."""


class TangramSandboxTool(_Base):
    def __init__(self, config: dict, tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self.url = config.get("tangram_url", os.environ.get("TANGRAM_URL", "http://127.0.0.1:8080"))
        self.job = config.get("job", "verl")
        self.timeout_s = float(config.get("timeout_s", 30))
        self.mode = config.get("mode", "python")  # python: a persistent interpreter; bash: shell commands
        self.max_chars = int(config.get("max_observation_chars", 8000))
        self.client = AsyncTangramClient(self.url, token=config.get("token") or os.environ.get("TANGRAM_TOKEN"))
        self._sessions: dict[str, str] = {}

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        instance_id = instance_id or f"verl-{uuid.uuid4().hex}"
        info = await self.client._call("POST", "/v1/sessions", json={"job": self.job, "trajectory": _safe(instance_id)})
        self._sessions[instance_id] = info["session_id"]
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        sid = self._sessions.get(instance_id)
        if sid is None:
            await self.create(instance_id)
            sid = self._sessions[instance_id]
        code = parameters.get("code", "")
        body = {"timeout_s": self.timeout_s, ("python" if self.mode == "python" else "command"): code}
        r = await self.client._call("POST", f"/v1/sessions/{sid}/exec", json=body)
        outcome = r["outcome"]
        run = r.get("run") or {}
        if outcome == "infra_error":
            text = "The code could not be run (sandbox infrastructure error). Try again."
        else:
            text = (run.get("stdout", "") + run.get("stderr", ""))[: self.max_chars]
            if outcome == "timeout":
                text += f"\n[timed out after {self.timeout_s:g}s]"
            elif outcome == "oom":
                text += "\n[killed: out of memory]"
        return text, 0.0, {"outcome": outcome, "act_s": r.get("act_s"), "cores": r.get("cores")}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        sid = self._sessions.pop(instance_id, None)
        if sid is not None:
            await self.client._call("DELETE", f"/v1/sessions/{sid}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._:@-]", "-", name)[:200]


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(solution: str) -> str:
    """The last fenced python block of a model's answer (or the whole answer)."""
    blocks = _FENCE.findall(solution)
    return blocks[-1] if blocks else solution


def compute_score(data_source: str, solution_str: str, ground_truth: str | dict, extra_info: dict | None = None,
                  url: str | None = None, timeout_s: float = 10.0) -> float:
    """Fraction of ``ground_truth``'s test cases (``{"inputs": [...], "outputs": [...]}``, as
    JSON or a dict) whose stdout matches (trailing whitespace aside), running the solution
    through Tangram, all cases at once."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    inputs, outputs = list(tests.get("inputs", [])), list(tests.get("outputs", []))
    if not inputs or len(inputs) != len(outputs):
        raise ValueError("ground_truth: needs equally many inputs and outputs")
    code = extract_code(solution_str)
    batch = f"rw-{uuid.uuid4().hex}"
    with TangramClient(url or os.environ.get("TANGRAM_URL", "http://127.0.0.1:8080"),
                       token=os.environ.get("TANGRAM_TOKEN")) as client:
        results = {r.id.split("~")[0]: r for r in client.run_batch(
            [{"code": code, "stdin": i, "timeout_s": timeout_s, "job": "verl-reward", "id": f"{batch}-{k}"}
             for k, i in enumerate(inputs)], concurrency=8)}
    passed = 0
    for k, expected in enumerate(outputs):
        r = results[f"{batch}-{k}"]
        if r.outcome == "infra_error":
            raise InfraError(f"sandbox infrastructure failure while scoring: {r.message}")
        if r.outcome == "ok" and r.run is not None and r.run.stdout.rstrip() == str(expected).rstrip():
            passed += 1
    return passed / len(outputs)
