"""verl integration (verl 0.9.x): a sandbox tool for ``ToolAgentLoop`` and a code reward.

``TangramSandboxTool`` is a verl ``BaseTool`` (config and tool schema: ``examples/verl/``).
verl's ``ToolAgentLoop`` creates an instance, executes **one** call and releases it for every
tool call, so an instance is not a trajectory. The trajectory is the ``agent_data`` verl passes to
``execute``: its Tangram session is keyed on that object (its ``request_id`` names the session),
opened at the trajectory's first call and kept across its turns, so files and interpreter state
carry over; cores are held only while a call runs. verl sends no end-of-trajectory signal per
call, so a session is closed when (1) verl drops the trajectory's ``agent_data`` (a weak-reference
finaliser), (2) it has been idle for ``session_idle_s`` (checked at every call), or, as the last
resort when the trainer dies, (3) the server's ``sandbox.session_idle_expiry_s`` — keep that
above the longest generation gap between two turns. Called without ``agent_data`` (a loop that
keeps one instance per trajectory), the instance is the trajectory and ``release`` closes it.

Failures: the code's own failures, timeouts and OOMs are observations for the model. A failure of
ours (``infra_error``, a lost session, an unreachable or overloaded server) raises ``InfraError``:
verl's loop logs "Error executing tool" instead of handing the model a fake observation. After a
lost session the trajectory keeps failing instead of silently getting an empty sandbox.

``compute_score`` is a ``reward.custom_reward_function`` (path ``pkg://arl_tangram.integrations.verl``,
name ``compute_score``, ``reward_kwargs: {url: ...}``). It runs the solution against the test cases
in ``ground_truth`` and returns the fraction that pass; an infrastructure failure raises
``InfraError`` (after the client's retries) instead of scoring 0. verl's built-in
``reward.sandbox_fusion.url`` path also works against ``tangram serve`` (its ``/run_code``), but
verl itself counts a sandbox error as a failed test case there.

Sessions are not keyed on ``request_id`` strings (with ``full_determinism`` verl reuses
``det-<priority>`` ids across steps, so two trajectories would share a sandbox), nor stored in
``agent_data.extra_fields`` (verl stops merging the engine's extra fields into a non-empty dict
and ships every key to the trainer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..client import AsyncSession, AsyncTangramClient, TangramClient, TangramError
from ..client.base import first_id

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on verl being installed
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
    from verl.utils.rollout_trace import rollout_trace_op
except ImportError:  # compute_score needs no verl; the tool is only usable by verl anyway
    class BaseTool:  # type: ignore[no-redef]
        def __init__(self, config: dict, tool_schema: Any) -> None:
            raise ImportError("TangramSandboxTool needs verl: pip install 'arl-tangram[verl]'")

    class ToolResponse(BaseModel):  # type: ignore[no-redef]
        text: str | None = None

    def rollout_trace_op(fn):  # type: ignore[no-redef]
        return fn


class InfraError(RuntimeError):
    """The sandbox service failed (not the code): retry later, never score it."""


def _env_url() -> str:
    return os.environ.get("TANGRAM_URL", "http://127.0.0.1:8080")


class ToolSettings(BaseModel):
    """The tool's ``config`` block in verl's tool config YAML."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["native"] = Field("native", description="verl's tool type (required by verl's loader)")
    tangram_url: str = Field(default_factory=_env_url, description="the server (default: $TANGRAM_URL)")
    token: str | None = Field(default_factory=lambda: os.environ.get("TANGRAM_TOKEN"), description="bearer token")
    job: str = Field("verl", min_length=1, max_length=100, description="the job (tenant) name sessions run under")
    mode: Literal["python", "bash"] = Field("python", description="python: a persistent interpreter; bash: commands")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="time limit of one call")
    cpus: tuple[int, int] = Field((1, 1), description="cores of one call (min, max)")
    max_observation_chars: int = Field(8000, ge=1, description="output handed to the model, at most")
    session_idle_s: float = Field(600.0, gt=0, description="close a trajectory's session unused for this long")
    retries: int = Field(4, ge=0, description="client retries of a request that may be repeated")
    backoff_s: float = Field(0.25, ge=0, description="first retry delay (doubles each retry)")


@dataclass
class _Trajectory:
    name: str
    session: AsyncSession | None = None
    last_used: float = field(default_factory=time.monotonic)
    lost: str | None = None  # why the session is gone, once it is


class TangramSandboxTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Any) -> None:
        try:
            self.settings = ToolSettings.model_validate(config or {})
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"TangramSandboxTool config: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        super().__init__(config, tool_schema)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncTangramClient] = \
            weakref.WeakKeyDictionary()
        self._by_data: weakref.WeakKeyDictionary[Any, _Trajectory] = weakref.WeakKeyDictionary()
        self._by_instance: dict[str, _Trajectory] = {}
        self._closing: set[asyncio.Task] = set()

    # -- verl's BaseTool contract ----------------------------------------------------------------
    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """No session yet: verl creates an instance per call; ``execute`` finds the trajectory's."""
        return instance_id or f"tangram-{uuid.uuid4().hex}", ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) \
            -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="error: the parameter 'code' (a string) is required"), 0.0, \
                {"outcome": "rejected"}
        self._expire_idle()
        traj = self._trajectory(instance_id, kwargs.get("agent_data"))
        if traj.lost is not None:
            raise InfraError(traj.lost)
        try:
            session = traj.session or await self._open(traj)
            field_ = "python" if self.settings.mode == "python" else "command"
            r = await session.exec(**{field_: code}, timeout_s=self.settings.timeout_s, cpus=self.settings.cpus,
                                   operation="verl-tool")
        except TangramError as e:
            if e.status == 404:
                traj.lost = f"the sandbox session {traj.name} was lost (server restart or idle expiry): {e.message}"
                raise InfraError(traj.lost) from e
            if e.status == 429 or e.status >= 500:
                raise InfraError(f"sandbox service unavailable: {e}") from e
            raise
        except httpx.TransportError as e:
            raise InfraError(f"cannot reach the sandbox service at {self.settings.tangram_url}: {e!r}") from e
        finally:
            traj.last_used = time.monotonic()
        if r.outcome in ("infra_error", "cancelled"):
            raise InfraError(f"sandbox infrastructure failure ({r.outcome}): {r.message}")
        return ToolResponse(text=self._observation(r)), 0.0, {"outcome": r.outcome, "act_s": r.act_s,
                                                              "cores": r.cores}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Closes the session only of an instance that was its own trajectory (no ``agent_data``)."""
        traj = self._by_instance.pop(instance_id, None)
        if traj is not None:
            await self._close(traj)

    # -- trajectories and their sessions ---------------------------------------------------------
    def _trajectory(self, instance_id: str, agent_data: Any) -> _Trajectory:
        if agent_data is None:
            return self._by_instance.setdefault(instance_id, _Trajectory(_name(self.settings.job, instance_id)))
        traj = self._by_data.get(agent_data)
        if traj is None:
            traj = _Trajectory(_name(self.settings.job, str(getattr(agent_data, "request_id", "")) or instance_id))
            self._by_data[agent_data] = traj
            weakref.finalize(agent_data, self._close_soon, asyncio.get_running_loop(), traj)
        return traj

    async def _open(self, traj: _Trajectory) -> AsyncSession:
        # the server reopens a known name, so concurrent first calls of one trajectory share one session
        traj.session = await self._client().session(job=self.settings.job, trajectory=traj.name)
        return traj.session

    def _client(self) -> AsyncTangramClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            s = self.settings
            # the answer comes after queueing plus the run: the client's default wait plus the time limit
            client = self._clients[loop] = AsyncTangramClient(s.tangram_url, token=s.token, retries=s.retries,
                                                              backoff_s=s.backoff_s, timeout_s=600 + s.timeout_s)
        return client

    def _expire_idle(self) -> None:
        """Close sessions idle too long. The record stays (until its ``agent_data`` or instance
        goes): a trajectory that comes back gets ``InfraError``, not a silently empty sandbox."""
        now = time.monotonic()
        for traj in [*self._by_data.values(), *self._by_instance.values()]:
            if traj.session is not None and now - traj.last_used > self.settings.session_idle_s:
                traj.lost = f"the sandbox session {traj.name} was closed after {now - traj.last_used:.0f}s idle " \
                            f"(session_idle_s={self.settings.session_idle_s:g})"
                self._spawn_close(traj)

    def _close_soon(self, loop: asyncio.AbstractEventLoop, traj: _Trajectory) -> None:
        """The trajectory's ``agent_data`` was dropped (may run in any thread, at garbage collection)."""
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._spawn_close, traj)

    def _spawn_close(self, traj: _Trajectory) -> None:
        session, traj.session = traj.session, None
        if session is not None:
            task = asyncio.get_running_loop().create_task(self._close_session(traj.name, session))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, traj: _Trajectory) -> None:
        session, traj.session = traj.session, None
        if session is not None:
            await self._close_session(traj.name, session)

    @staticmethod
    async def _close_session(name: str, session: AsyncSession) -> None:
        try:
            await session.close()
        except TangramError as e:  # 404: the server expired it already
            if e.status != 404:
                log.warning("closing session %s: %s (the server's idle expiry will)", name, e)
        except httpx.TransportError as e:
            log.warning("closing session %s: %r (the server's idle expiry will)", name, e)

    async def aclose(self) -> None:
        """Close every open session and the clients (verl never calls it; for scripts and tests)."""
        for traj in [*self._by_data.values(), *self._by_instance.values()]:
            await self._close(traj)
        self._by_data.clear()
        self._by_instance.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    def _observation(self, r: Any) -> str:
        run = r.run
        text = ((run.stdout + run.stderr) if run else r.message)[: self.settings.max_observation_chars]
        if r.outcome == "timeout":
            text += f"\n[timed out after {self.settings.timeout_s:g}s]"
        elif r.outcome == "oom":
            text += "\n[killed: out of memory]"
        elif r.outcome == "rejected":
            text = f"[rejected: {r.message}]"
        return text


def _name(job: str, trajectory: str) -> str:
    """A session name: the trajectory's id for tracing, a random part so that it is never reused."""
    return f"{re.sub(r'[^A-Za-z0-9._:@-]', '-', f'{job}.{trajectory}')[:160]}.{uuid.uuid4().hex[:12]}"


# -- the code reward ------------------------------------------------------------------------------
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(solution: str) -> str:
    """The last fenced python block of a model's answer (or the whole answer)."""
    blocks = _FENCE.findall(solution)
    return blocks[-1] if blocks else solution


def compute_score(data_source: str, solution_str: str, ground_truth: str | dict, extra_info: dict | None = None,
                  url: str | None = None, timeout_s: float = 10.0, job: str = "verl-reward", concurrency: int = 8,
                  retries: int = 4, **verl_kwargs: Any) -> float:
    """Fraction of ``ground_truth``'s test cases (``{"inputs": [...], "outputs": [...]}``, as
    JSON or a dict) whose stdout matches (trailing whitespace aside), running the solution through
    Tangram, all cases at once. ``verl_kwargs``: what verl's reward managers may add (a reward
    router's address), unused. Raises ``InfraError`` when the service, not the code, failed."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    inputs, outputs = list(tests.get("inputs", [])), list(tests.get("outputs", []))
    if not inputs or len(inputs) != len(outputs):
        raise ValueError("ground_truth: needs equally many inputs and outputs")
    code = extract_code(solution_str)
    batch = f"rw-{uuid.uuid4().hex}"
    programs = [{"code": code, "stdin": str(i), "timeout_s": timeout_s, "job": job, "id": f"{batch}-{k}"}
                for k, i in enumerate(inputs)]
    try:
        with TangramClient(url or _env_url(), token=os.environ.get("TANGRAM_TOKEN"), retries=retries) as client:
            results = {first_id(r.id): r for r in client.run_batch(programs, concurrency=concurrency)}
    except httpx.TransportError as e:
        raise InfraError(f"cannot reach the sandbox service while scoring: {e!r}") from e
    except TangramError as e:
        if e.status == 429 or e.status >= 500:
            raise InfraError(f"sandbox service unavailable while scoring: {e}") from e
        raise
    passed = 0
    for k, expected in enumerate(outputs):
        r = results[f"{batch}-{k}"]
        if r.outcome in ("infra_error", "cancelled"):
            raise InfraError(f"sandbox infrastructure failure while scoring ({r.outcome}): {r.message}")
        if r.outcome == "ok" and r.run is not None and r.run.stdout.rstrip() == str(expected).rstrip():
            passed += 1
    return passed / len(outputs)
