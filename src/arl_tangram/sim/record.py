"""Record a run's finished actions in the public trace format, so it can be replayed under every
policy (``tangram simulate --trace``, ``tangram evaluate --trace``).

A ``TraceRecorder`` is an engine listener: ``engine.listeners.append(recorder)``; the simulator,
the local runtime and the server all deliver every terminal ``Finished`` record to their engine's
listeners, so the same recorder works on each. Each line holds what the replay needs (job, step,
trajectory, seq, service, gap, work at the minimum demand, demand and hints) and what the run
measured (``outcome``, ``act_s``, ``setup_s``), which the replay ignores and a validation compares
against.

The replay model (sim/workload.py) starts a step's trajectories together and submits each action
``gap_s`` after the previous one of its trajectory finished, so:

* ``gap_s`` of a trajectory's first action is its submission time minus the step's start, the
  earliest submission of that (job, step); of a later action, its submission minus the previous
  action's finish. Lines are therefore written per (job, step) once its start is known: when the
  job's next step begins, or at ``close()``.
* ``work_s`` is the measured execution time divided by the speed-up of the units it ran on
  (``Action.speed_factor``), i.e. the work at the minimum demand, as the trace format defines it.
* An action without a trajectory (a one-shot ``/run_code``) is a trajectory of one action, so the
  replay keeps its arrival time. Actions that never started (rejected, cancelled) are not written:
  they carry no work; the next action's gap is still measured from their end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..core.action import API_PREFIX, Finished
from ..core.cluster import ApiQuota, ModelSpec


@dataclass(slots=True)
class _Pending:
    submitted_at: float
    first: bool
    line: dict


@dataclass(slots=True)
class _Step:
    start: float
    lines: list[_Pending] = field(default_factory=list)


class TraceRecorder:
    """Writes every started action that finishes to ``path`` (JSONL); call ``close()`` at the end.
    ``models``: the cluster's model services, whose weights a model call that does not carry its
    own (a batch the runtime formed from several callers) is written with, since a trace line of a
    model service needs them to load."""

    def __init__(self, path: str | Path | IO[str], quotas: tuple[ApiQuota, ...] = (),
                 models: tuple[ModelSpec, ...] = ()) -> None:
        self._fh = open(path, "w", encoding="utf-8") if isinstance(path, (str, Path)) else path
        self._owns = isinstance(path, (str, Path))
        self._quotas = {q.name: q for q in quotas}
        self._weights = {m.name: m.weights_gb for m in models}
        self._quota_written: set[str] = set()
        self._steps: dict[tuple[str, int], _Step] = {}
        self._latest_step: dict[str, int] = {}
        self._trajectories: dict[str, list] = {}  # trajectory -> [next seq, previous finish]
        self.written = 0
        self.skipped = 0

    def __call__(self, f: Finished) -> None:
        a = f.action
        step = a.step if a.step is not None else 0
        latest = self._latest_step.get(a.job)
        if latest is None or step > latest:
            self._latest_step[a.job] = step
            for key in [k for k in self._steps if k[0] == a.job and k[1] < step]:
                self._flush(key)
        traj = a.trajectory if a.trajectory is not None else a.id
        state = self._trajectories.get(traj)
        first = state is None
        if first:
            state = self._trajectories[traj] = [0, 0.0]
        prev_finish = state[1]
        state[1] = f.finished_at
        if a.trajectory is None:
            del self._trajectories[traj]
        if f.started_at is None:
            self.skipped += 1
            return
        seq = state[0]
        state[0] = seq + 1
        line: dict = {"job": a.job, "step": step, "trajectory": traj, "seq": seq, "service": a.service,
                      "gap_s": 0.0 if first else round(max(0.0, f.submitted_at - prev_finish), 6),
                      "work_s": round(f.exec_s / a.speed_factor(f.units) if f.units > 1 else f.exec_s, 6)}
        if a.pool in ("cpu", "gpu"):
            line["demand"] = {k: list(v) for k, v in a.demand.ranges.items()}
        if a.parallel_fraction:
            line["parallel_fraction"] = a.parallel_fraction
        weights = a.weights_gb or self._weights.get(a.model or "", 0.0)
        if weights:
            line["weights_gb"] = weights
        for name in ("operation", "hint_s", "timeout_s"):
            value = getattr(a, name)
            if value:
                line[name] = value
        if a.service.startswith(API_PREFIX):
            api = a.service[len(API_PREFIX):]
            q = self._quotas.get(api)
            if q is not None and api not in self._quota_written:
                line["quota"] = {"rate_per_s": q.rate_per_s, "concurrency": q.concurrency, "burst": q.burst}
                self._quota_written.add(api)
        line["outcome"] = f.outcome.value
        line["act_s"] = round(f.act_s, 6)
        line["setup_s"] = round(f.setup_s, 6)
        buf = self._steps.get((a.job, step))
        if buf is None:
            buf = self._steps[(a.job, step)] = _Step(f.submitted_at)
        buf.start = min(buf.start, f.submitted_at)
        buf.lines.append(_Pending(f.submitted_at, first, line))

    def _flush(self, key: tuple[str, int]) -> None:
        buf = self._steps.pop(key)
        for p in sorted(buf.lines, key=lambda p: p.submitted_at):
            if p.first:
                p.line["gap_s"] = round(p.submitted_at - buf.start, 6)
            self._fh.write(json.dumps(p.line, separators=(",", ":")) + "\n")
            self.written += 1
        self._fh.flush()

    def close(self) -> None:
        """Write every step still buffered and close the file (when the recorder opened it)."""
        for key in sorted(self._steps):
            self._flush(key)
        if self._owns:
            self._fh.close()
        else:
            self._fh.flush()
