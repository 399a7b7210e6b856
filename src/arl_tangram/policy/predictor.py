"""Online duration prediction per (job, service, operation), with client hints as priors.

Observed execution times are normalised to the action's minimum demand (dividing out the speed-up
it got), so an elastic test run that ran on 8 cores teaches the predictor what it costs on 1.
Recent history weighs more (exponential decay) because workloads drift within an RL run.
"""

from __future__ import annotations

from typing import Final

from ..core.action import Action, Finished, Outcome


class DurationPredictor:
    """Predicts work seconds at minimum demand.

    Estimate = (prior_weight * prior + sum of decayed observations) / (prior_weight + decayed count).
    The prior is the client's hint when given, else what this (job, service) has shown, else
    ``default_s``. Falls back gracefully from the finest key to the coarsest.
    """

    def __init__(self, default_s: float = 1.0, decay: float = 0.995, hint_weight: float = 2.0) -> None:
        self.default_s = default_s
        self.decay = decay
        self.hint_weight = hint_weight
        # job -> service -> _Service; nested rather than keyed by (job, service, operation) tuples,
        # which cost a tuple per lookup on the scheduler's hot path (two per submit, two per finish)
        self._jobs: dict[str, dict[str, _Service]] = {}

    def predict(self, action: Action) -> float:
        svc = self._jobs.get(action.job, _NONE).get(action.service)
        coarse = svc.coarse if svc is not None else None
        if action.hint_s is not None:
            prior, w0 = action.hint_s, self.hint_weight
        elif coarse is not None:
            prior, w0 = coarse.total / coarse.weight, 0.5
        else:
            prior, w0 = self.default_s, 0.5
        if action.operation:
            seen = svc.ops.get(action.operation) if svc is not None else None
        else:
            seen = coarse if action.hint_s is not None else None
        if seen is None:
            return prior
        return (w0 * prior + seen.total) / (w0 + seen.weight)

    def observe(self, finished: Finished) -> None:
        if finished.outcome not in _LEARN or finished.exec_s <= 0:
            return
        a = finished.action
        at_min = finished.exec_s / a.speed_factor(finished.units) if finished.units > 1 else finished.exec_s
        services = self._jobs.get(a.job)
        if services is None:
            services = self._jobs[a.job] = {}
        svc = services.get(a.service)
        if svc is None:
            svc = services[a.service] = _Service()
        d = self.decay
        c = svc.coarse
        if c is None:
            svc.coarse = _Decayed(at_min)
        else:
            c.add(at_min, d)
        if a.operation:
            f = svc.ops.get(a.operation)
            if f is None:
                svc.ops[a.operation] = _Decayed(at_min)
            else:
                f.add(at_min, d)


class _Decayed:
    """A decayed sum of seconds and its decayed count. (Was a two-item list: compiled, the floats
    of a class are unboxed and a list's are not.)"""

    __slots__ = ("total", "weight")

    def __init__(self, first: float) -> None:
        self.total = first
        self.weight = 1.0

    def add(self, seconds: float, decay: float) -> None:
        self.total = self.total * decay + seconds
        self.weight = self.weight * decay + 1.0


class _Service:
    """Decayed seconds for one (job, service), overall and per operation."""

    __slots__ = ("coarse", "ops")

    def __init__(self) -> None:
        self.coarse: _Decayed | None = None
        self.ops: dict[str, _Decayed] = {}


_NONE: Final[dict[str, _Service]] = {}
_LEARN: Final = (Outcome.OK, Outcome.FAILED)
