"""Model loaders for tests: behaviour a real service can show (slowness, failures), built from the
tiny random-weight transformer."""

from __future__ import annotations

import time

from arl_tangram.managers.models import tiny


def slow_reward_model(delay_s: float = 1.0):
    """The tiny reward model whose ``score`` takes ``delay_s`` per batch."""
    module, ops = tiny.reward_model()
    score = ops["score"]

    def slow_score(m, batch):
        time.sleep(delay_s)
        return score(m, batch)

    return module, {"score": slow_score}
