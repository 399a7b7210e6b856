"""API quotas of the model protocols: requests and tokens per minute, per API key's job and per
model, in a sliding window of 60 s (the paper's third resource, counted rather than placed).

A request is counted when it is let in; its tokens (prompt and generated) once it is answered, as
the model's tokenizer counted them: a request is let in while the window's tokens are under the
limit, so one request may take the window past it, and the next waits until enough of the window's
tokens have aged out. ``Retry-After`` says when that is."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .config import Quota

WINDOW_S = 60.0


@dataclass
class _Window:
    requests: deque = field(default_factory=deque)  # when each request was let in
    tokens: deque = field(default_factory=deque)  # (when, tokens) of each answered request
    token_total: int = 0

    def prune(self, now: float) -> None:
        edge = now - WINDOW_S
        while self.requests and self.requests[0] <= edge:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= edge:
            self.token_total -= self.tokens.popleft()[1]


@dataclass(frozen=True)
class Throttled:
    """Why a request waits: the limit it reached (``requests`` or ``tokens``), the quota, and in
    how many whole seconds it would be let in."""

    limit: str
    quota: Quota
    retry_after_s: int


class Quotas:
    def __init__(self, quotas: list[Quota], clock: Callable[[], float] = time.monotonic) -> None:
        self.quotas = list(quotas)
        self.clock = clock
        self.windows: dict[tuple[int, str, str], _Window] = {}

    def _matching(self, job: str, model: str) -> list[tuple[Quota, _Window]]:
        out = []
        for i, q in enumerate(self.quotas):
            if q.job in ("*", job) and q.model in ("*", model):
                w = self.windows.get((i, job, model))
                if w is None:
                    w = self.windows[(i, job, model)] = _Window()
                out.append((q, w))
        return out

    def enter(self, job: str, model: str) -> Throttled | None:
        """Let a request of ``job`` to ``model`` in (counted), or say why not (nothing counted)."""
        if not self.quotas:
            return None
        now = self.clock()
        matching = self._matching(job, model)
        for q, w in matching:
            w.prune(now)
            if q.requests_per_minute is not None and len(w.requests) >= q.requests_per_minute:
                wait = w.requests[len(w.requests) - q.requests_per_minute] + WINDOW_S - now
                return Throttled("requests", q, max(1, math.ceil(wait)))
            if q.tokens_per_minute is not None and w.token_total >= q.tokens_per_minute:
                over, wait = w.token_total - q.tokens_per_minute, 0.0
                for t, n in w.tokens:  # the oldest age out first: until the window is under the limit
                    over -= n
                    wait = t + WINDOW_S - now
                    if over < 0:
                        break
                return Throttled("tokens", q, max(1, math.ceil(wait)))
        for _, w in matching:
            w.requests.append(now)
        return None

    def charge(self, job: str, model: str, tokens: int) -> None:
        """The tokens of an answered request of ``job`` to ``model``."""
        if not self.quotas or tokens <= 0:
            return
        now = self.clock()
        for q, w in self._matching(job, model):
            if q.tokens_per_minute is not None:
                w.tokens.append((now, tokens))
                w.token_total += tokens
