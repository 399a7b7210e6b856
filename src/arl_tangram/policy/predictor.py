"""Online duration prediction per (job, service, operation), with client hints as priors.

Observed execution times are normalised to the action's minimum demand (dividing out the speed-up
it got), so an elastic test run that ran on 8 cores teaches the predictor what it costs on 1.
Recent history weighs more (exponential decay) because workloads drift within an RL run.
"""

from __future__ import annotations

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
        self._stats: dict[tuple[str, str, str], list[float]] = {}

    def predict(self, action: Action) -> float:
        stats = self._stats
        coarse = stats.get((action.job, action.service, ""))
        if action.hint_s is not None:
            prior, w0 = action.hint_s, self.hint_weight
        elif coarse is not None:
            prior, w0 = coarse[0] / coarse[1], 0.5
        else:
            prior, w0 = self.default_s, 0.5
        if action.operation:
            seen = stats.get((action.job, action.service, action.operation))
        else:
            seen = coarse if action.hint_s is not None else None
        if seen is None:
            return prior
        return (w0 * prior + seen[0]) / (w0 + seen[1])

    def observe(self, finished: Finished) -> None:
        if finished.outcome not in (Outcome.OK, Outcome.FAILED) or finished.exec_s <= 0:
            return
        a = finished.action
        at_min = finished.exec_s / a.speed_factor(finished.units)
        keys = [(a.job, a.service, "")]
        if a.operation:
            keys.append((a.job, a.service, a.operation))
        d = self.decay
        for key in keys:
            s = self._stats.get(key)
            if s is None:
                self._stats[key] = [at_min, 1.0]
            else:
                s[0] = s[0] * d + at_min
                s[1] = s[1] * d + 1.0
