"""How long a core sat between one one-shot's answer and the next one's request on it: what the
lease (``lease.py``) is for, measured where it happens. Each ``SandboxManager`` keeps one (in the engine
process and in each sandbox worker); ``/healthz`` shows them merged (``core_waits``), and ``bench
server`` the part of each level. Under load it is the hand-over between two runs; on an idle server
it is idleness, seconds long.

Kept as counts in buckets a quarter of an octave wide (a quantile read off them is within 19% of
the true one): one ``log2`` per one-shot, no list that grows with the runs. The mean is of the
waits under ~1 s (``IDLE_BUCKET``): longer ones are a core with nothing to do (a bench's pause
between levels, say), counted apart as ``idle_n``, and would swamp it."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

PER_OCTAVE = 4
BUCKETS = 24 * PER_OCTAVE + 2  # 1 µs to ~16 s; the last counts everything longer
IDLE_BUCKET = 20 * PER_OCTAVE + 1  # waits in this bucket (over 2^20 µs, ~1.05 s) and above: idleness


def bucket_of(seconds: float) -> int:
    """The bucket of a wait: 0 below 1 µs, then ``1 + floor(4 log2(µs))``, capped."""
    us = seconds * 1e6
    if us < 1.0:
        return 0
    return min(1 + int(math.log2(us) * PER_OCTAVE), BUCKETS - 1)


def upper_ms(k: int) -> float:
    """The upper edge of bucket ``k``, in ms."""
    return 2.0 ** (k / PER_OCTAVE) / 1000.0


class CoreWaits:
    """Per core, the last one-shot's answer; the waits before the next ones, counted."""

    __slots__ = ("counts", "total_s", "_last")

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.total_s = 0.0
        self._last: dict[int, float] = {}

    def ran(self, cores: Iterable[int], written: float, answered: float) -> None:
        """A one-shot on ``cores`` had its first request written at ``written`` and its answer read
        at ``answered`` (``time.monotonic``): a wait counted for each core. A request written before
        the last answer on a core (runs that overlapped: a core taken back, a run grown onto it)
        counts none there."""
        last = self._last
        for core in cores:
            prev = last.get(core)
            last[core] = answered
            if prev is not None and written >= prev:
                wait = written - prev
                k = bucket_of(wait)
                self.counts[k] += 1
                if k < IDLE_BUCKET:
                    self.total_s += wait

    def ended(self, cores: Iterable[int], at: float) -> None:
        """A one-shot on ``cores`` ended at ``at`` with no answer (killed, cancelled): the next
        wait there counts from then, not from the run before it."""
        for core in cores:
            self._last[core] = at

    def state(self) -> tuple[list[int], float]:
        """What crosses to the engine process from a worker: the counts and their sum."""
        return list(self.counts), self.total_s


def merge(states: Iterable[tuple[Sequence[int], float]]) -> tuple[list[int], float]:
    counts, total = [0] * BUCKETS, 0.0
    for c, t in states:
        for k, v in enumerate(c):
            counts[k] += v
        total += t
    return counts, total


def summary(counts: Sequence[int], total_s: float) -> dict:
    """``n``, ``mean_ms``, ``p50_ms``/``p90_ms``/``p99_ms`` (a bucket's upper edge) and the nonzero
    ``buckets`` (upper edge in ms -> count: two readings subtract bucket by bucket)."""
    n = sum(counts)
    busy = sum(counts[:IDLE_BUCKET])
    out: dict = {"n": n, "idle_n": n - busy, "mean_ms": round(total_s / busy * 1000, 3) if busy else None}
    for q in (50, 90, 99):
        out[f"p{q}_ms"] = None
        if n:
            need, seen = q / 100 * n, 0
            for k, v in enumerate(counts):
                seen += v
                if seen >= need:
                    out[f"p{q}_ms"] = round(upper_ms(k), 3)
                    break
    out["buckets"] = {f"{upper_ms(k):.4g}": v for k, v in enumerate(counts) if v}
    return out


def between(before: dict | None, after: dict | None) -> dict | None:
    """The summary of the waits counted between two ``summary`` readings (of one server)."""
    if not after or "buckets" not in after:
        return None
    old = (before or {}).get("buckets", {})
    edges = {f"{upper_ms(k):.4g}": k for k in range(BUCKETS)}
    counts = [0] * BUCKETS
    for edge, v in after["buckets"].items():  # a worker restarted (or late to answer) between: never below 0
        counts[edges[edge]] = max(0, v - old.get(edge, 0))

    def total(reading: dict) -> float:
        return (reading.get("mean_ms") or 0) * (reading.get("n", 0) - reading.get("idle_n", 0)) / 1000

    out = summary(counts, max(total(after) - total(before or {}), 0.0))
    del out["buckets"]
    return out
