"""Which trajectories decide when their step ends, and how much priority that is worth.

A synchronous RL step ends when its last trajectory ends, so every second the longest trajectories
wait is a second of step time, while the others have slack. ``CriticalPath.on_submit`` returns, per
submitted action, seconds of priority (taken off its SRPT key) from two signals:

* *projected last* (the boost): each trajectory gets a projected finish ``now + predicted work +
  remaining turns x seconds per turn``; an action whose trajectory lies within ``window`` (a
  fraction of the step's remaining horizon) of its step's latest projected finish gets
  ``boost_s``. Remaining turns are the client's ``Action.remaining_turns``. Without them, only a
  sandbox action (CPU pool) is projected, from the expected residual ``E[L - k - 1 | L > k]``
  learned per job from the lengths (in turns) of the trajectories that ended. Seconds per turn are
  learned per job: the decayed mean interval between a trajectory's consecutive submissions.
* *waiting credit*: an action on a quota pool (``api:*``) that carries no remaining turns gets
  ``wait_credit`` x its trajectory's mean queue wait per finished action so far. On a quota pool
  every call costs about the same, so SRPT's gain there is small and its price is that some
  trajectories wait much more than others; the step waits for the unluckiest long one. The credit
  hands waiting back to the trajectories that took more than their share, turn by turn.
* *slack order* (``slack_aging``): an action on a quota pool whose client sends its remaining
  turns and whose trajectory is not projected last gets ``-min(predicted x remaining turns,
  aging x slack)`` — it goes behind by the rest of its trajectory's calls (SRPT over
  trajectories), but never by more than its slack (``latest - finish``) converted to key seconds
  (a newer call passes an older one for their key difference / aging seconds), so the delay
  cannot make it the step's last.

Why (issue 13). Figures: Tangram's step time over the best baseline's of the same seed, worst of
seeds 0-4 / mean, at pool scales 1 / 0.5 / 0.25 (``tangram evaluate --scales 1,0.5,0.25 --seeds 5
--no-min-resources [--no-client-remaining]``, ``vs_best_baseline`` in results.json):

* Clients without counts, before: search 0.939/0.968, 0.920/0.980, 0.966/0.986; mopd 0.997/1.002,
  0.969/0.989, 0.892/0.952. After: search 0.953/0.993, 0.936/0.991, 0.991/0.998; mopd
  0.996/1.001, 0.985/1.006, 0.993/1.018; against each baseline's own mean Tangram is now ahead on
  every workload and scale (search vs fifo 1.006 / 1.007 / 1.002). Search's ACT against the best
  baseline 1.049 / 0.985 / 0.986 -> 1.046 / 1.065 / 1.138.
* With counts: mopd at 0.25x 0.931/0.991 -> 0.997/1.048; search's worst seed 1.043 / 1.064 /
  1.046 -> 1.043 / 1.064 / 1.069.
* The *straggler* boost (once 80% of a step's trajectories had ended, the rest were boosted) was
  dropped: fixed at submission, it only let the stragglers' new actions overtake older queued ones
  of the same step (LIFO among them) and pulled model loads forward on GPU pools. It is what cost
  mopd at 0.25x above; no workload lost step time without it. It did buy mopd some ACT: 1.054 ->
  1.020 of the best baseline's at 0.25x with counts.
* The learned projection is kept for sandbox actions only: on mopd (GPU) it boosted LIFO-like
  among trajectories with equal turn counts (equal residuals, so the latest submission projects
  latest) and cost 0.985 -> 0.969 at 0.5x (for +2% ACT at 1x); on search it gained nothing; on
  code_agent it gains ~1% of step time at 0.5x and 0.25x.
* The waiting credit on search without counts, 20 seeds, step time over fifo's mean / worst seed:
  before 0.992/0.959, 0.992/0.971, 1.002/0.971 with +7.5 / 3.4 / 1.2% ACT over fifo (SRPT alone:
  0.991/0.945, 0.997/0.962, 0.996/0.974); with the credit 1.002/0.976, 1.003/0.980, 1.001/0.993
  with +7.9 / 11.4 / 14.5% ACT. Weight 0.5 gave the same step time for +7.5 / 6.6 / 5.9% ACT;
  weight 2 more ACT (+25% at 0.25x) for 0.993 of fifo's step time on the mean. Not applied when
  the client sends counts: it then fights the boost (search 0.5x worst seed 1.064 -> 0.970). On
  GPU pools it reorders across models and pays loads (mopd 0.25x worst seed 0.993 -> 0.874).

Why the slack order (issue 23): on search at 0.125x / 0.25x / 0.5x Tangram's average ACT was
0.938 / 0.956 / 0.981 of trajectory-static's on the worst seed (``tangram evaluate``, clients send
counts), even fifo's was lower. A quota's throughput is fixed and the system is closed (a
trajectory waits for its call, thinks, calls again), so the mean ACT is set by how many
trajectories are still calling (Little: R = N / X - Z); the baseline's random backoff lets some run
ahead and finish, while aging and the boost keep all abreast, the largest population to the end.
Finishing the trajectories with the fewest calls left first shrinks it; the slack bound keeps the
step. Worst seed, 0.125x ... 2x: ACT 0.938 / 0.956 / 0.981 / 1.041 / 1.001 -> 1.282 / 1.349 /
1.253 / 1.156 / 1.000 (1.0004), step 1.039 / 1.075 / 1.064 / 1.043 / 1.000 -> 1.015 / 1.056 / 1.134
/ 1.087 / 1.000; mixed ACT 1.171 -> 1.265 (0.25x), step unchanged or better. Measured and
dropped: the rest of the trajectory unbounded (ACT 1.26-1.54 but step 0.946), bounded by the
slack / (remaining turns + 1) (ACT 0.925 at 0.5x), on CPU and GPU pools too (code_agent at 0.125x
ACT 1.015 -> 0.899, mopd at 0.25x 1.024 -> 0.991: action sizes vary 100x there, per-action SRPT
already has that gain and the trajectory term fights it). Without counts nothing changes.

mopd's last seed behind fifo without counts (seed 4 at 0.5x, 0.985) was not a critical-path
matter: model calls now age faster (``action_level.Options.gpu_aging_per_s``, figures there).
Signals for the GPU round measured first and dropped (mopd, no counts, step time over the best
baseline's at 1x / 0.5x / 0.25x): the waiting credit, ordering only within a model's queue
(models by their head's key without it): seeds 0-4 worst 0.919 / 0.800 / 0.846 — it favours the
trajectories that have run turns over first turns, whose remaining gaps then start late; the
expected remaining turns x seconds per turn taken off the key (x0.1; least attained,
continuous): 20 seeds mean 1.002 / 1.008 / 1.023 but seed 4 at 0.5x 0.977, x0.3 and x1 worse,
within a model's queue only worse (worst 0.960 at 0.5x); holding the block the best blocked
wide call waits for (EASY backfilling: frontier-235b at 0.25x had calls queued but none running
235 of 440 s, small models backfilled its island; others ran there only if predicted to end
before it drained): held GPUs idled, 20 seeds 0.5x / 0.25x mean 0.981 / 0.825, ACT 0.81 / 0.32.

What remains: without counts, search's step time is up to 6.4% behind trajectory-static on single
seeds (seed 1 at 1x and 0.5x). That baseline's calls hit the API's limiter directly and back off
at random: a random service order whose step
time spreads about +-10% around fifo's; even exact submission order (fifo) is >1% behind it on 7
of 20 seeds at 1x (worst 0.89). Search trajectory lengths are independent of everything a
scheduler sees (after ~7 turns their hazard is flat, ~0.2 a turn), so no order that uses only what
was observed finds the long ones; the client's counts do. Seed 1, mean step at 1x / 0.5x: Tangram
227.5 / 315.1 s, fifo 227.0 / 314.4, trajectory-static 216.9 / 294.9 (fifo 0.955 / 0.938 of it).
At 1x both steps end with a 30-turn trajectory (the generator's cap) that waited 29.7 + 27.5 s
under Tangram, 22.9 + 33.3 under fifo, 14.7 + 21.2 under the baseline's backoff, all in the
step's first 80 s (its first 10 turns, the start-of-step burst), before its length shows. Tangram's
part of it is one browse call (2.9 s predicted, no credit yet) passed by ~600 newer 0.9 s search
calls carrying ~1.7 s of credit: 29 s on that call (the window's mean wait was 4.6 s). Bounding
such pass-overs by aging quota calls at 0.3 / 0.6 per s: seed 1 0.962 / 0.960 at 1x, 0.936 /
0.936 at 0.5x, 20 seeds' mean unchanged (0.984 at 1x) for ACT 1.05 -> 1.01 / 0.99 of the best
baseline's; a credit only for waiting above the step's mean: 0.964 / 0.927.

Measured and dropped as well: ordering every action by remaining trajectory time
(``key -= w * remaining``) gives up SRPT's ACT; with no counts on search (20 seeds, vs fifo):
least-attained service (fewest turns first, 5 s a turn) = fifo's step time and ACT; submission
order within the job = fifo exactly (ACT -7% against SRPT at 1x); stronger aging (1/s) 0.999 /
1.000 of fifo, +1.3% ACT; aging 0.3/s with the credit 0.988 worst, +3.7% ACT; a credit for the
mean interval per turn (gaps included) instead of the queue wait: +13% ACT but 0.909 of fifo on
one seed at 1x; (seeds 0-4, vs the best baseline) most-turns-first 0.966 / 0.969 / 0.991 on the
mean; random order, for scale, 0.86-0.95 on the worst seed. On mopd without counts, boosting the
trajectories with the most expected turns left (least attained, by class): 20 seeds 1.003 /
1.007 / 1.019 of fifo on the mean (vs 1.001 / 1.003 / 1.017) but 0.958 on the worst seed at 0.25x
(vs 0.965), and a scan of the step's runs per submit. A client count blurred by a lognormal factor
(sigma 0.5) fell to 0.93x (measured before this change): the boost is only as good as the
client's plan.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..core.action import CPU, GPU, Action, Finished

StepKey = tuple[str, "int | None"]


@dataclass(slots=True)
class _Step:
    seen: int = 0
    ended: int = 0
    projected: int = 0  # trajectories with a projected finish
    heap: list = field(default_factory=list)  # (-finish, seq, trajectory, version); stale ones dropped lazily


@dataclass(slots=True)
class _Run:
    key: StepKey
    step: _Step
    turns: int = 0
    last_submit: float = 0.0
    finish: float = 0.0
    version: int = 0
    projected: bool = False
    waited_s: float = 0.0  # queue time of its finished actions
    finished: int = 0


class CriticalPath:
    __slots__ = ("window", "use_projection", "boost_s", "wait_credit", "decay", "slack_aging", "_runs", "_steps",
                 "_cycle", "_lengths", "_residual", "_seq")

    def __init__(self, window: float = 0.05, use_projection: bool = True, boost_s: float = 30.0,
                 wait_credit: float = 1.0, decay: float = 0.02, slack_aging: float = 0.0) -> None:
        self.window = window
        self.use_projection = use_projection
        self.boost_s = boost_s
        self.wait_credit = wait_credit
        self.decay = decay
        self.slack_aging = slack_aging  # a quota pool's aging (key seconds per second); 0: no slack order
        self._runs: dict[str, _Run] = {}
        self._steps: dict[StepKey, _Step] = {}
        self._cycle: dict[str, float] = {}  # job -> seconds per turn
        self._lengths: dict[str, dict[int, int]] = {}  # job -> {turns: trajectories that ended after them}
        self._residual: dict[str, dict[int, float]] = {}  # job -> {turns done: expected turns left}
        self._seq = itertools.count()

    def on_submit(self, a: Action, now: float, predicted_s: float) -> float:
        """Record ``a``'s turn; the seconds of priority it gets (0.0: none)."""
        traj = a.trajectory
        if traj is None:
            return 0.0
        run = self._runs.get(traj)
        job = a.job
        if run is None:
            key = (job, a.step)
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = _Step()
            step.seen += 1
            run = self._runs[traj] = _Run(key, step)
        else:
            step = run.step
            if run.turns:
                interval = now - run.last_submit
                cycle = self._cycle.get(job)
                self._cycle[job] = interval if cycle is None else cycle + self.decay * (interval - cycle)
        k = run.turns
        run.turns = k + 1
        run.last_submit = now
        remaining: float | None = a.remaining_turns
        if remaining is None:
            pool = a.pool
            if pool == CPU:
                if not self.use_projection or job not in self._lengths:
                    return 0.0
                remaining = self._learned(job, k)  # a trajectory of the job has ended
                if remaining is None:
                    return 0.0
            elif pool == GPU:
                return 0.0
            else:  # a quota pool: the waiting credit
                return self.wait_credit * run.waited_s / run.finished if run.finished else 0.0
        elif not self.use_projection:
            return 0.0
        cycle = self._cycle.get(job)
        if cycle is None:
            return 0.0
        run.finish = now + predicted_s + remaining * cycle
        run.version += 1
        if not run.projected:
            run.projected = True
            step.projected += 1
        heapq.heappush(step.heap, (-run.finish, next(self._seq), traj, run.version))
        if step.projected < 2:  # the first projection of a step has nothing to be compared with
            return 0.0
        latest = self._latest(step.heap)
        if run.finish >= latest - self.window * max(0.0, latest - now):
            return self.boost_s
        if self.slack_aging and a.remaining_turns is not None and a.pool != CPU and a.pool != GPU:
            # the rest of the trajectory's calls, as far back as its slack allows (module docstring)
            return -min(predicted_s * a.remaining_turns, self.slack_aging * (latest - run.finish))
        return 0.0

    def on_finish(self, f: Finished) -> None:
        """Count the queue time of a trajectory's finished call on a quota pool (the waiting
        credit's only input)."""
        a = f.action
        pool = a.pool
        if pool == CPU or pool == GPU or f.started_at is None or a.trajectory is None:
            return
        run = self._runs.get(a.trajectory)
        if run is not None:
            run.waited_s += f.started_at - f.submitted_at
            run.finished += 1

    def on_end(self, trajectory: str) -> None:
        run = self._runs.pop(trajectory, None)
        if run is None:
            return
        job = run.key[0]
        lengths = self._lengths.get(job)
        if lengths is None:
            lengths = self._lengths[job] = {}
        lengths[run.turns] = lengths.get(run.turns, 0) + 1
        self._residual.pop(job, None)
        step = run.step
        step.ended += 1
        if run.projected:
            step.projected -= 1
        if step.ended == step.seen and self._steps.get(run.key) is step:  # the step is over
            del self._steps[run.key]

    def slack(self, trajectory: str | None) -> float | None:
        """Seconds ``trajectory`` may be delayed before it is projected to end its step (its
        latest projected finish minus its own); None until it has a projection."""
        run = self._runs.get(trajectory) if trajectory is not None else None
        if run is None or not run.projected:
            return None
        return max(0.0, self._latest(run.step.heap) - run.finish)

    def _latest(self, heap: list) -> float:
        runs = self._runs
        while heap:
            _, _, traj, version = heap[0]
            run = runs.get(traj)
            if run is not None and run.version == version:
                return -heap[0][0]
            heapq.heappop(heap)
        return float("-inf")

    def _learned(self, job: str, k: int) -> float | None:
        """Expected turns left after this one, given ``k`` turns before it, from the trajectories
        of ``job`` that ended (None until one has)."""
        lengths = self._lengths.get(job)
        if not lengths:
            return None
        cache = self._residual.get(job)
        if cache is None:
            cache = self._residual[job] = {}
        value = cache.get(k)
        if value is None:
            longer = [(n, c) for n, c in lengths.items() if n > k]
            total = sum(c for _, c in longer)
            value = cache[k] = sum((n - k - 1) * c for n, c in longer) / total if total else 0.0
        return value
