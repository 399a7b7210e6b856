"""Action-level scheduling on shared pools: the Tangram policy and its ``fifo`` ablation.

Tangram (docs/design.md, "Scheduling direction") in one round, per pool:
1. *Priority*: each waiting action has a static key ``predicted work + expected setup +
   aging * submitted_at - critical boost``. Linear aging is order-preserving over time, so one
   heap per job serves SRPT-with-aging exactly, without re-keying as time passes. Model calls age
   at 0.6/s, sandbox and API calls at 0.1/s (``Options.gpu_aging_per_s`` says why).
2. *Admission at minimum demand first*: pop by key (across jobs, the best key of a job below its
   weighted fair share wins) and start each action at its minimum; skip up to ``lookahead`` that
   do not fit (backfilling) instead of blocking the pool behind them.
3. *Elasticity*: only when nothing of this pool is left waiting (but sessions that chose to wait
   for their own full node: ``_schedule_cpu``), spare units (minus a reserve for arrivals, since
   spare capacity may not last) go to the actions started in this round by largest marginal time
   reduction per unit on their concave speed-up curves (water-filling).
4. *Placement*: sessions stick to the node that holds their state (migrating, at a restore cost,
   only when that node is full, another node has cores free that no step living there waits for,
   and the wait for the home is predicted to be longer than the move costs: ``_cpu_node``,
   ``_home_wait``; never a session the runtime pinned home); a one-shot or a new session naming an
   image goes to a node holding it where one has room (``CpuPool.image_holders``); a model runs on an idle resident instance, else on an idle
   buddy-aligned block inside one island chosen by load time plus a cost-aware eviction price, or
   it waits for a busy resident instance when that is predicted to be quicker than a load.
5. *Quotas*: API calls start only while the token bucket and concurrency allow.

``fifo`` uses the same mechanisms with first-come-first-served keys, no elasticity, no migration,
no fair share, and LRU eviction without residency-aware waiting: one shared pool, nothing clever.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Final, Iterator

from ..core.action import CPU, GPU, Action, Finished, by_fields
from ..core.cluster import DEFAULT_H2D_GBPS
from ..core.pools import CpuPool, Instance
from .base import Decision, EngineView, Evict, Follow, Grow, Prefetch, Shrink, Start, Wait, pool_wait
from .critical import CriticalPath
from .predictor import DurationPredictor
from .queues import JobQueues


@dataclass(frozen=True, slots=True)
class Options:
    ordering: str = "srpt"  # "srpt" (with aging) or "fifo"
    elastic: bool = True
    migrate: bool = True
    #: a session moves off its full node only when the predicted wait for it is longer than a move
    #: costs (``_home_wait``): a move to save less than it costs delays the step it was meant to
    #: hurry. On Ray a move also starts the session's processes afresh (its Python state), which the
    #: simulator does not charge. False: move whenever the home is full.
    price_moves: bool = True
    #: a session moves off its full home only to a node with cores free beyond what the steps
    #: living there wait for (``_idle_node``): a node that is merely less busy has a queue of its
    #: own, and a move that takes its free core makes that queue wait while the moved step pays the
    #: move, so moves between busy nodes only trade one wait for another plus the move (on Ray
    #: ~0.3 s each, ``MOVE_S``). False: any node with room, as long as the price holds.
    idle_moves: bool = True
    fair_share: bool = True
    residency_aware: bool = True  # cost-aware eviction + wait for a busy resident instance
    prefetch: bool = True  # load registered models onto idle GPUs before they are asked for
    aging_per_s: float = 0.1
    #: Model calls age faster. A call is passed by a newer one for (its key - theirs) / aging
    #: seconds: at 0.1/s a 235B teacher's call (8 GPUs, seconds of work, a load) waits a minute
    #: behind 1-GPU calls, its trajectories end the step, and when its backlog finally wins it takes
    #: whole islands from the popular models. 0.6/s keeps mopd's every seed within 1% of the best
    #: baseline's step time; pools without GPUs are not affected.
    gpu_aging_per_s: float = 0.6
    critical_boost_s: float = 30.0  # 0: no priority from critical.py at all
    critical_path: bool = True  # boost trajectories projected to finish their step last (critical.py)
    critical_window: float = 0.05
    projected_boost_s: float = 30.0
    elastic_reserve_fraction: float = 0.05
    elastic_quiet_s: float = 10.0
    min_gain_fraction: float = 0.01
    min_gain_s: float = 0.05
    lookahead: int = 16
    reuse_horizon_s: float = 30.0
    job_weights: dict[str, float] = field(default_factory=dict)
    #: price each GPU start's setup when it is dispatched (``_schedule_gpu`` says why)
    dispatch_setup: bool = True
    #: on quota pools, order the trajectories that are not critical by the rest of their calls,
    #: within their slack (``critical.py`` says why)
    slack_order: bool = True
    #: take cores back from grown actions when a queue forms (``_take_back``; needs a CPU manager
    #: that can, ``EngineView.cpu_resizes``)
    shrink: bool = True
    #: queue a one-shot behind a running one when no core is free (``Follow``; needs a CPU manager
    #: that chains, ``EngineView.followable``), when the one it follows is predicted to take no
    #: longer than this (seconds; 0: never). Bound to one core, a follower waits out the rest of
    #: its predecessor's run even if another core frees first, so only short runs are followed.
    follow_max_s: float = 0.1

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


CPU_NEW: Final = "cpu:new"  # the queue of sandbox actions that need a new session

TANGRAM = Options()
FIFO = Options(ordering="fifo", elastic=False, migrate=False, fair_share=False, residency_aware=False, prefetch=False,
               critical_boost_s=0.0, critical_path=False, dispatch_setup=False,
               slack_order=False, shrink=False)


class ActionLevelPolicy:
    """Shared pools, one action at a time; see the module docstring."""

    def __init__(self, name: str = "tangram", options: Options = TANGRAM,
                 predictor: DurationPredictor | None = None) -> None:
        self.name = name
        self.opt = options
        self.predictor = predictor or DurationPredictor()
        self.view: EngineView  # set by ``bind``, before any other call
        self._cpus: CpuPool  # ``view.cpu``, typed: compiled, read without a lookup by name (3 an action)
        self.queues: dict[str, JobQueues] = {}  # per pool; per model service for GPUs
        self.gpu_queues: dict[str, JobQueues] = {}
        # Per-action bookkeeping is kept only where it is read, not as a dict insert and pop per
        # action on dicts of every action in flight (74,000 in ``bench scheduler``):
        self._new_session: set[str] = set()  # ids waiting in ``CPU_NEW`` (cancel must find their queue)
        self.predicted: dict[str, float] = {}  # elastic and GPU actions (``_gain``, ``_resident_wait``)
        self._grown: dict[str, int] = {}  # running actions given cores above their minimum -> how many
        self.job_units: dict[str, dict[str, int]] = {}
        self.critical = CriticalPath(options.critical_window, options.critical_path, options.projected_boost_s,
                                     slack_aging=options.aging_per_s if options.slack_order else 0.0)
        self._model_rate: dict[str, tuple[float, float]] = {}
        self._cpu_queued_at = -math.inf
        # a full home node -> (until when it holds, its running actions' predicted ends: (at, cores))
        self._home_ends: dict[int, tuple[float, list[tuple[float, int]]]] = {}
        # a full home -> the steps that chose to wait for it this round, in order: (cores, predicted
        # seconds each), what a later step waits behind
        self._claimed: dict[int, list[tuple[int, float]]] = {}
        self._home_waits = 0  # steps that chose to wait for their full home this round (``_schedule_cpu``)
        # Steps of homed sessions waiting, per node: what a move there would jump (``_idle_node``).
        # Counted per action against the home it had when queued, so a home that changes while
        # it waits (a drain's move) never leaves a count behind; only where moves cost something
        # (``bind``): with free moves (``bench scheduler``) any node with room will do, and the
        # count, kept for every step, measured 0.84-0.91x of its decisions per CPU second.
        self._count_homes = False
        self._queued_on: dict[str, int] = {}  # waiting step -> its home when it was queued
        self._home_queue: list[int] = []  # per node: cores its sessions' waiting steps need
        self._cpu_only = False  # the cluster has CPU nodes only (set by ``bind``)
        # the fair-share test the queues call, bound once (not a new bound method every round)
        self._fair: Callable[[str], bool] | None = self._favoured if options.fair_share else None

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self, view: EngineView, now: float) -> Iterator[Decision]:
        self.view = view
        self._cpus = view.cpu
        # no quotas, models or GPUs: actions of other pools are rejected by the engine, so the CPU
        # round is the whole round (and ``schedule`` skips the dispatch below)
        self._cpu_only = not view.quotas and not view.cluster.models and not view.gpu.capacity
        opt = self.opt
        self._count_homes = opt.migrate and opt.idle_moves and view.costs.session_restore_s > 0
        return iter(())

    def on_cluster_change(self, now: float) -> Iterator[Decision]:
        """Nodes or model services joined or left (``Engine.add_gpu_node`` and its kin): every
        round reads the pools afresh, only the CPU-only shortcut is decided once."""
        view = self.view
        self._cpu_only = not view.quotas and not view.cluster.models and not view.gpu.capacity
        return iter(())

    def on_submit(self, action: Action, now: float) -> None:
        pred = self.predictor.predict(action)
        pool = action.pool
        if pool == CPU:
            traj = action.trajectory
            lo, hi = action.demand.ranges[CPU]
            qkey = CPU
            if traj is not None:
                home = self._cpus.homes.get(traj)
                if home is None:
                    qkey = CPU_NEW
                    self._new_session.add(action.id)
                elif self._count_homes:
                    self._queued_on[action.id] = home
                    counts = self._home_queue
                    if home >= len(counts):
                        counts.extend([0] * (home + 1 - len(counts)))
                    counts[home] += lo
            if hi > lo:
                self.predicted[action.id] = pred
        else:
            qkey = action.service if pool == GPU else pool
            if pool == GPU:
                self.predicted[action.id] = pred
        q = self.queues.get(qkey)
        if q is None:
            q = self.queues[qkey] = JobQueues()
            if pool == GPU:
                self.gpu_queues[action.model or ""] = q
        opt = self.opt
        if opt.ordering == "fifo":
            key = action.submitted_at
        else:
            if pool == GPU:
                key = pred + opt.gpu_aging_per_s * action.submitted_at + self._setup_estimate(action)
            else:
                key = pred + opt.aging_per_s * action.submitted_at
            if opt.critical_boost_s:
                key -= self.critical.on_submit(action, now, pred)  # seconds of priority (critical.py)
        if pool == GPU:
            self._note_model_request(action.model or "", now)
        q.push(action, key)

    def on_cancel(self, action: Action) -> None:
        q = self.queues.get(self._queue_of(action))
        if q is not None:
            q.cancel(action)
        self._new_session.discard(action.id)
        self.predicted.pop(action.id, None)
        if self._queued_on:
            self._unqueue(action.id, action.demand.ranges[CPU][0] if action.pool == CPU else 0)

    def _unqueue(self, action_id: str, lo: int) -> None:
        """A step counted in ``_home_queue`` (``lo`` cores) left the queue (started or cancelled)."""
        node = self._queued_on.pop(action_id, -1)
        if node >= 0:
            self._home_queue[node] -= lo

    def on_finish(self, finished: Finished) -> None:
        a = finished.action
        if self.predicted:
            self.predicted.pop(a.id, None)
        if self._new_session:
            self._new_session.discard(a.id)
        if self._grown:
            self._grown.pop(a.id, None)
        if finished.started_at is not None:
            self.job_units[a.job][a.pool] -= finished.units  # charged when it started
        self.predictor.observe(finished)
        self.critical.on_finish(finished)

    def on_trajectory_end(self, job: str, step: int | None, trajectory: str) -> None:
        self.critical.on_end(trajectory)

    def next_wakeup(self, now: float) -> float | None:
        view = self.view
        wake = self._next_idle_expiry()
        for pool, q in self.queues.items():
            if q.size and pool in view.quotas:
                qp = view.quotas[pool]
                if qp.in_use < qp.quota.concurrency:
                    t = qp.next_token_at(now)
                    wake = t if wake is None else min(wake, t)
        return wake

    def _queue_of(self, a: Action) -> str:
        """The queue ``a`` waits in (``on_submit`` chose it)."""
        if a.pool == GPU:
            return a.service
        return CPU_NEW if a.id in self._new_session else a.pool

    def why_waiting(self, action: Action, now: float) -> Wait:
        """Its own reasons first: a copy of the model loading or busy (the policy waits for it
        rather than load another), its job above its fair share while another job waits here;
        then what the pools lack."""
        view = self.view
        model = action.model
        if action.pool == GPU and model is not None:
            for load in view.loading.values():
                if load.model == model:
                    return Wait("model-loading", f"a copy of model {model!r} loading onto GPU(s) {list(load.block)}")
            copies = view.gpu.instances.get(model, [])
            if copies and all(i.busy is not None for i in copies):
                return Wait("model-busy", f"a copy of model {model!r} to finish its batch (all {len(copies)} "
                                          "busy)")
        if self._fair is not None and not self._favoured(action.job):
            q = self.queues.get(self._queue_of(action))
            ahead = sorted(j for j, h in q.heaps.items() if h and j != action.job) if q is not None else []
            if ahead:
                return Wait("fair-share", f"fair share: job {action.job!r} holds more than its weighted share; "
                                          f"job {ahead[0]!r} goes first")
        return pool_wait(view, action, now)

    # -- the round -------------------------------------------------------------------------------
    def schedule(self, now: float) -> Iterator[Decision]:
        """API quotas, then CPUs, then GPUs (or prefetching onto idle GPUs). The pools' rounds are
        chained, not nested in one generator: every decision passes through one Python frame
        fewer, which is measurable at one round per event."""
        if self._cpu_only:
            return self._schedule_cpu(now)
        rounds: list[Iterator[Decision]] = []
        cpu_waiting = gpu_waiting = False
        for pool, q in self.queues.items():
            if not q.size:
                continue
            if pool == CPU or pool == CPU_NEW:
                cpu_waiting = True
            elif pool in self.view.quotas:
                rounds.append(self._schedule_api(q, pool, now))
            else:
                gpu_waiting = True
        if cpu_waiting:
            rounds.append(self._schedule_cpu(now))
        if self.view.cluster.models:
            rounds.append(self._scale_to_zero(now))
        if gpu_waiting:
            rounds.append(self._schedule_gpu(now))
        elif self.opt.prefetch and self.view.gpu.capacity:
            rounds.append(self._prefetch(now))
        if len(rounds) == 1:
            return rounds[0]
        return itertools.chain.from_iterable(rounds)

    def _schedule_cpu(self, now: float) -> Iterator[Decision]:
        """Two queues merged by key: actions of sessions that already live on a node, and actions
        that need a new session (and so memory somewhere). Each skips at most ``lookahead`` entries
        that do not fit, separately, so sessions waiting for memory can never starve the sessions
        whose progress would free it. (This is the scheduler's hot path: one round per event, so
        it allocates nothing until something is skipped or started.)

        Steps left waiting because they chose to wait for their own full node (``_cpu_node``: the
        wait is predicted shorter than a move) do not make the pool busy for elasticity: only
        their home can serve them, and nothing grows there (``_water_fill``); counted as a queue
        they would stop all growth for ``elastic_quiet_s`` after each. The take-back below still
        counts them: taking no cores back for them costs code_agent ACT and step time at 0.25x."""
        pool = self._cpus
        homed, new = self.queues.get(CPU), self.queues.get(CPU_NEW)
        queues = []
        if homed is not None and homed.size:
            queues.append(homed)
        if new is not None and new.size:
            queues.append(new)
        admitted: list[tuple[Action, int, int]] = []  # the elastic ones (to grow if nothing waits)
        skipped: dict[int, list] | None = None
        if self._claimed:
            self._claimed.clear()
        self._home_waits = 0
        fair = self._fair
        if self._grown and self.opt.shrink:
            waiting = sum(q.size for q in queues)
            if waiting > pool.total_free:
                yield from self._take_back(waiting - pool.total_free)
        while queues and pool.total_free:
            q = queues[0] if len(queues) == 1 else min(queues, key=JobQueues.peek_key)
            entry = q.pop(fair)
            if entry is None:
                queues.remove(q)
                continue
            a = entry[2]
            lo, hi = a.demand.ranges[CPU]
            node = self._cpu_node(a, lo, now)
            if node is None:
                if skipped is None:
                    skipped = {}
                mine = skipped.setdefault(id(q), [])
                mine.append(entry)
                if len(mine) >= self.opt.lookahead or not q.size:
                    queues.remove(q)
                continue
            self._charge(a.job, CPU, lo)
            if self._queued_on:
                self._unqueue(a.id, lo)
            yield Start(a, node, lo)
            if hi > lo:  # only elastic actions can be grown below
                admitted.append((a, node, lo))
            if not q.size:
                queues.remove(q)
        if skipped:
            for sq in (homed, new):
                if sq is not None and id(sq) in skipped:
                    sq.push_back(skipped[id(sq)])
        queued = (homed.size if homed is not None else 0) + (new.size if new is not None else 0)
        if queued and homed is not None and homed.size and self.view.followable and self.opt.follow_max_s:
            yield from self._follow(homed, now)
        if queued > self._home_waits:  # steps that chose to wait for their home are no queue: below
            self._cpu_queued_at = now
        elif self.opt.elastic and admitted and now - self._cpu_queued_at >= self.opt.elastic_quiet_s:
            yield from self._water_fill(admitted, now)

    def _follow(self, q: JobQueues, now: float) -> Iterator[Decision]:
        """No core free and one-shots waiting: queue them behind running ones (``Follow``), so
        a core's next run starts the moment its last one ends, with no round trip through the
        engine between. The head of the queue goes behind the oldest run of its size
        that is predicted short and has not yet run longer than that (``follow_max_s``: a
        follower waits out the rest of its run, so a straggler is not followed), looking at the
        first ``lookahead`` runs only; one naming an image some node holds follows only a run on
        such a node (``_cpu_node``). Stops at the first entry that may not follow (a session's
        step, an elastic action, none of its size to follow), which keeps the queue's order."""
        ends = self.view.followable
        fair = self._fair
        limit = self.opt.follow_max_s
        predict = self.predictor.predict
        scan = self.opt.lookahead
        while ends and q.size:
            entry = q.pop(fair)
            if entry is None:
                return
            a = entry[2]
            lo, hi = a.demand.ranges[CPU]
            after = None
            if a.trajectory is None and lo == hi:
                holders = self._cpus.image_holders(a) if self._cpus.image_nodes else None
                for aid, prev in itertools.islice(ends.items(), scan):
                    if (len(prev.allocation.units) == lo and now - prev.started_at <= limit
                            and predict(prev.action) <= limit
                            and (holders is None or prev.allocation.node in holders)):
                        after = aid
                        break
            if after is None:
                q.push_back([entry])
                return
            self._charge(a.job, CPU, lo)
            yield Follow(a, after)

    def _cpu_node(self, a: Action, lo: int, now: float) -> int | None:
        """The node ``a`` starts on now, or None. A session's step runs on its home node; off a
        full home it moves only to a node where it jumps no queue (``_idle_node``) and only when the
        wait for its home is longer than the move costs (``_home_wait``); a pinned session
        (``CpuPool.pin``) waits for its home. A draining home takes nothing again: its sessions
        move to any node with room, whatever the wait. A one-shot or a new session goes to the
        node with the most free cores, of those holding its image where one has room."""
        pool = self._cpus
        traj = a.trajectory
        if traj is None:
            if pool.image_nodes:
                holders = pool.image_holders(a)
                if holders:
                    node = pool.best_holder(lo, holders)
                    if node is not None:
                        return node
            return pool.best_node(lo)
        home = pool.homes.get(traj)
        if home is not None:
            if len(pool.free_cores[home]) >= lo:  # ``nfree``, read once per round
                return home
            if not self.opt.migrate:
                return None
            costs = self.view.costs
            move_s = costs.session_restore_s
            if pool.alive[home] and move_s > 0:  # a move for balance, priced
                if traj in pool.pinned:
                    self._wait_home(home, a, lo)
                    return None
                away = self._idle_node(lo, costs.session_mem_gb) if self.opt.idle_moves \
                    else pool.best_node(lo, costs.session_mem_gb)
                if away is None:
                    return None
                if self.opt.price_moves and self._home_wait(home, lo, now) <= move_s:
                    self._wait_home(home, a, lo)
                    return None
                return away
            if pool.alive[home] and traj in pool.pinned:
                self._wait_home(home, a, lo)
                return None
            return pool.best_node(lo, costs.session_mem_gb)
        mem = self.view.costs.session_mem_gb
        if pool.image_nodes:
            holders = pool.image_holders(a)
            if holders:
                node = pool.best_holder(lo, holders, mem)
                if node is not None:
                    return node
        return pool.best_node(lo, mem)

    def _wait_home(self, home: int, a: Action, lo: int) -> None:
        """A step waits for its full home by choice: the next step there waits behind it, for as
        long as this one is predicted to run (``_claimed``), and it is no queue for elasticity
        (``_schedule_cpu``)."""
        self._claimed.setdefault(home, []).append((lo, self.predictor.predict(a) * a.speed_factor(lo)))
        self._home_waits += 1

    def _idle_node(self, lo: int, mem_gb: float) -> int | None:
        """The node with the most free cores that has ``lo`` of them (and ``mem_gb`` memory to
        spare) beyond what the waiting steps of the sessions living there need, and beyond the
        steps that chose to wait for it this round (``_claimed``); None when every node with room
        has such a queue. Nodes are read by free cores, most first, as ``CpuPool.best_node`` does:
        when every node is busy none has cores free and this reads nothing."""
        pool = self._cpus
        first = pool.best_node(lo, mem_gb)
        if first is None:
            return None
        queued = self._home_queue
        claimed = self._claimed
        waiting = len(queued)
        if (first >= waiting or not queued[first]) and (not claimed or first not in claimed):
            return first
        buckets = pool.buckets
        free_mem = pool.free_mem
        for k in range(min(pool.top, len(buckets) - 1), lo - 1, -1):
            for node in buckets[k]:
                ahead = (queued[node] if node < waiting else 0)
                if claimed and node in claimed:
                    ahead += sum(n for n, _ in claimed[node])
                if k - ahead >= lo and (mem_gb <= 0 or free_mem[node] >= mem_gb):
                    return node
        return None

    def _home_wait(self, home: int, lo: int, now: float) -> float:
        """How long until ``lo`` cores are free on the full node ``home``, as predicted: its running
        actions' predicted ends, earliest first, until enough cores come back. A session moves only
        when this is longer than a move costs (``Costs.session_restore_s``), as the simulator
        charges it: a move to save less than it costs delays the step it was meant to hurry (a
        real move on Ray costs ~0.3 s, ``MOVE_S``, while steps of a few ms free the home node
        sooner). An action already past its prediction is expected to run as long again as it has
        (its duration is plainly not the usual one), rather than to end at once, which would pin
        its node's sessions behind a straggler. Steps that chose to wait for the node earlier in
        the round (``_claimed``) are served first, in turn, each on the first cores free and
        for its predicted time: a later one waits behind them (else every step homed on a busy
        node would expect the same first free core; and where it expected only the cores the
        running actions free, the second step waiting for a one-core node found none and moved,
        a move of ~25 ms, and a wake on the new node, to save a wait of one ~5 ms step). The ends are read
        from every running action, so only when another node has room, and kept until the earliest
        of them passes, not per node and round (thousands of running actions read for each of up
        to ``lookahead`` skipped steps, at one round per event). Free moves (``session_restore_s``
        0) skip it."""
        cached = self._home_ends.get(home)
        if cached is None or now >= cached[0]:
            ends: list[tuple[float, int]] = []
            for r in self.view.running.values():
                alloc = r.allocation
                if alloc.node != home or alloc.pool != CPU:
                    continue
                act = r.action
                n = len(alloc.units)
                elapsed = now - r.started_at
                expected = self.predictor.predict(act) * act.speed_factor(n)
                ends.append((r.started_at + expected if expected > elapsed else now + elapsed, n))
            ends.sort()
            cached = (ends[0][0] if ends else now, ends)
            self._home_ends[home] = cached
        cores = [now] * len(self._cpus.free_cores[home])  # when each core of the node is next free, as predicted
        for at, n in cached[1]:
            cores.extend([at] * n)
        heapq.heapify(cores)
        for n, work_s in self._claimed.get(home, ()):
            if len(cores) < n:
                return math.inf
            start = max(heapq.heappop(cores) for _ in range(n))
            for _ in range(n):
                heapq.heappush(cores, start + work_s)
        if len(cores) < lo:
            return math.inf
        return max(heapq.heappop(cores) for _ in range(lo)) - now

    def _gain(self, a: Action, units: int) -> float:
        w = self.predicted.get(a.id, 0.0)
        gain = w * (a.speed_factor(units) - a.speed_factor(units + 1))
        return gain if gain >= max(self.opt.min_gain_s, self.opt.min_gain_fraction * w) else 0.0

    def _water_fill(self, admitted: list[tuple[Action, int, int]], now: float) -> Iterator[Decision]:
        """Spare cores to the actions just admitted, largest marginal gain first. Spare capacity
        may not last, so a reserve stays free and nothing grows unless the pool has had no queue
        for ``elastic_quiet_s`` (the caller checks): growing into a burst delays the burst more
        than it speeds up the grown action (measured on rlvr at 0.5x and 0.25x).

        A step's onset looks quiet (the previous step's tail was), so the first actions of its
        burst are grown just before it queues; the cores are taken back when the queue forms
        (``_take_back``, a ``Shrink`` the engine applies). Reserving for the expected arrivals or
        staying quiet after each new session or step does not catch the onset and costs growth
        elsewhere. ``elastic_quiet_s`` is 10 s: shorter windows cost rlvr and code_agent more ACT
        than they give mixed.

        Nothing grows on a node that a step of this round chose to wait for (``_claimed``: the
        wait for its cores is shorter than a move): the cores free there are the ones it waits
        for. (The built-in workloads' CPU actions all need one core at minimum, so a home too
        full for one has no core free and the sweep is identical with or without this; it
        matters for steps whose minimum is more.)"""
        pool = self._cpus
        heap = []
        claimed = self._claimed  # a home that steps chose to wait for keeps its free cores for them
        for a, node, lo in admitted:
            if a.demand.ranges[CPU][1] > lo and node not in claimed:
                gain = self._gain(a, lo)
                if gain > 0:
                    heap.append((-gain, a.id, a, node, lo))
        if not heap:
            return
        budget = pool.total_free - int(self.opt.elastic_reserve_fraction * pool.capacity)
        if budget <= 0:
            return
        heapq.heapify(heap)
        extra: dict[str, int] = {}
        node_free: dict[int, int] = {}
        while heap and budget > 0:
            _, aid, a, node, k = heapq.heappop(heap)
            free = node_free.get(node)
            if free is None:
                free = pool.nfree(node)
            if free <= 0:
                continue
            node_free[node] = free - 1
            budget -= 1
            extra[aid] = extra.get(aid, 0) + 1
            k += 1
            if k < a.demand.ranges[CPU][1]:
                gain = self._gain(a, k)
                if gain > 0:
                    heapq.heappush(heap, (-gain, aid, a, node, k))
        grown = self._grown if self.opt.shrink and self.view.cpu_resizes else None
        for aid, n in extra.items():
            self._charge(self.view.running[aid].action.job, CPU, n)
            if grown is not None:
                grown[aid] = n
            yield Grow(aid, n)

    def _take_back(self, need: int) -> Iterator[Decision]:
        """A queue formed while actions hold cores a ``Grow`` gave them: take back up to ``need``
        of those cores, every extra core of the most recently grown first (they have the most of
        their run left at the grown speed; ``_water_fill`` says why). A core
        serves a queued action at full speed and the last cores of a grown one at a fraction of
        it (Amdahl), so with a queue they go back whole."""
        running = self.view.running
        for aid in reversed(list(self._grown)):
            if need <= 0:
                break
            run = running.get(aid)
            if run is None:
                del self._grown[aid]
                continue
            node = run.allocation.node
            if node is None or not self._cpus.alive[node]:
                continue  # a draining node's cores go to no one: the run keeps them
            n = self._grown.pop(aid)
            self._charge(run.action.job, CPU, -n)
            need -= n
            yield Shrink(aid, n)

    def _schedule_gpu(self, now: float) -> Iterator[Decision]:
        """Models in order of their best waiting action; a model whose head cannot be placed is
        blocked for this round only, so one big instance waiting for an island never holds up the
        small models behind it (per-model queues instead of one head-of-line).

        *Setup priced at dispatch.* A head whose start needs a load (its model is not resident on
        the block) or evicts idle copies is re-keyed once, to its key plus those seconds (its load
        plus the expected reloads, ``_setup_cost``), and yields when another model's head now keys
        lower. Exchange argument: with A needing setup L and B resident, A-then-B costs
        ``L + p_A`` more completion time than B-then-A costs ``p_B``, so SRPT, whose key is
        predicted work plus expected setup, must see the setup known *now*, not the guess made at
        submission. When GPUs are plenty both start in the same round anyway; when they are
        scarce this is what stops the churn of evicting a copy that its own queue needs next.
        A call yields for up to its price / aging seconds while resident models' calls keep
        coming, so with the client's counts the price is bounded like the quota pools' slack order
        (``critical.py``): at most ``gpu_aging x slack`` key seconds, none for a trajectory with
        no projection yet (the job's first turns) or on the critical path; without counts nothing
        says which trajectory may wait and it applies in full.
        Why: with more weights than GPU memory (mopd at 0.125x: 1,047 GB in 640 GB on one island)
        an unpriced dispatch evicts copies whose own model has calls waiting, and loads take up to a
        fifth of GPU time. Resident copies strictly first starves the big models; pricing only
        some setups (cold models, starts that evict, the load amortised over a queue) prices
        too little."""
        pool = self.view.gpu
        priced = self.opt.dispatch_setup
        order = [(q.peek_key(), model, False) for model, q in self.gpu_queues.items() if q.size]
        heapq.heapify(order)
        while order and pool.spare_gpus:
            key, model, costed = heapq.heappop(order)
            q = self.gpu_queues[model]
            entry = q.pop(self._favoured if self.opt.fair_share and len(q.heaps) > 1 else None)
            if entry is None:
                continue
            a = entry[2]
            start = self._gpu_start(a, now, q.size)
            if type(start) is not Start:
                q.push_back([entry])
                if start is not None:  # waits for a busy copy, while another one loads
                    yield start
                continue
            if priced and not costed and order:
                setup = self._setup_cost(start, now)
                if a.remaining_turns is not None and self.opt.critical_path:
                    slack = self.critical.slack(a.trajectory)  # no deferral past it (docstring)
                    setup = 0.0 if slack is None else min(setup, self.opt.gpu_aging_per_s * slack)
                if setup > 0.0 and key + setup > order[0][0]:
                    q.push_back([entry])  # re-keyed once: the next head may start without a load
                    heapq.heappush(order, (key + setup, model, True))
                    continue
            self._charge(a.job, GPU, len(start.block))
            yield start
            if q.size:
                heapq.heappush(order, (q.peek_key(), model, False))

    def _setup_cost(self, start: Start, now: float) -> float:
        """Seconds of setup ``start`` adds to the GPUs: its own load unless its model is resident
        on the block, plus the expected reloads of the copies it evicts (``_keep_value``)."""
        pool = self.view.gpu
        a = start.action
        cost = 0.0
        if pool.instance_on(a.model or "", start.block) is None:
            cost = pool.load_s(start.block, self._per_gpu_gb(a))
        for inst in start.evict:
            cost += self._keep_value(inst, now)
        return cost

    def _gpu_start(self, a: Action, now: float, queued: int) -> Start | Prefetch | None:
        """Where to run ``a`` now; or None when no idle block can take it. When waiting for a
        busy resident copy is predicted to be quicker than loading another, ``a`` waits — but if
        an idle block has room without evicting anything, a new copy is loaded there anyway
        (a ``Prefetch``): the model's demand has outgrown its copies, and idle GPUs cost nothing
        more (elastic instances: scale out on contention, scale in by eviction under pressure)."""
        pool = self.view.gpu
        model = a.model or ""
        g = a.demand.ranges[GPU][0]
        per_gpu = self._per_gpu_gb(a)
        spec = self.view.cluster.model(model)
        share = spec.compute_share if spec is not None else 1.0
        inst = pool.idle_instance(model, share=share)
        if inst is not None and len(inst.gpus) == g:
            return Start(a, block=inst.gpus)
        best = None
        for block in pool.blocks(g):
            if not pool.fits(block, share):
                continue
            mine = pool.instance_on(model, block)
            if mine is not None and mine.busy is not None:
                continue  # a copy runs one batch at a time; its next batch waits for it
            load = pool.load_s(block, per_gpu) if mine is None else 0.0
            plan = self._evictions(block, per_gpu, now)
            if plan is None:
                continue
            evicted, evict_cost = plan
            # best fit among islands keeps whole islands free for big instances
            island_free = sum(1 for x in pool.islands[pool.gpus[block[0]].island] if not pool.gpus[x].occupants)
            cost = (load + evict_cost, island_free)
            if best is None or cost < best[0]:
                best = (cost, block, evicted)
        if best is None:
            return None
        if self.opt.residency_aware:
            wait = self._resident_wait(model, now, queued)
            if wait is not None and wait < best[0][0]:
                loading = self.view.loading
                if best[2] or any(i.busy in loading for i in pool.instances.get(model, ())):
                    return None
                return Prefetch(model, best[1]) if self.opt.prefetch and self.view.cluster.model(model) else None
        return Start(a, block=best[1], evict=tuple(best[2]))

    def _prefetch(self, now: float) -> Iterator[Decision]:
        """With no model action waiting, give every registered model that has no GPU copy one, on
        idle GPUs and in free memory only (never evicting), most requested first. Weights wait in
        host RAM anyway and idle GPUs cost nothing more, while a cold request would pay the load
        in its ACT. One copy only: extra copies of busy models would occupy GPUs with loads just
        when bursts arrive."""
        pool = self.view.gpu
        if not pool.spare_gpus:
            return
        for m in sorted(self.view.cluster.models, key=lambda m: -self._rate(m.name, now)):
            if any(not i.reserved_by for i in pool.instances.get(m.name, ())):
                continue
            if m.idle_s is not None and not now - self._model_rate.get(m.name, (0.0, -math.inf))[1] < m.idle_s:
                continue  # scaled to zero: only a request brings it back
            fits = [b for b in pool.blocks(m.gpus)
                    if pool.fits(b, m.compute_share) and all(pool.free_gb(g) >= m.per_gpu_gb() for g in b)]
            if fits:  # the fullest memory that still fits keeps room for bigger models elsewhere
                yield Prefetch(m.name, min(fits, key=lambda b: sum(pool.free_gb(g) for g in b)))
                if not pool.spare_gpus:
                    return

    def _scale_to_zero(self, now: float) -> Iterator[Decision]:
        """Copies of models with an ``idle_s`` that ran nothing for that long give their GPU
        memory back; the weights stay in host RAM for the next request."""
        pool = self.view.gpu
        for m in self.view.cluster.models:
            if m.idle_s is None:
                continue
            for inst in list(pool.instances.get(m.name, ())):
                if inst.busy is None and not inst.reserved_by and now - inst.last_used >= m.idle_s:
                    yield Evict(m.name, inst.gpus)

    def _next_idle_expiry(self) -> float | None:
        pool = self.view.gpu
        wake = None
        for m in self.view.cluster.models:
            if m.idle_s is None:
                continue
            for inst in pool.instances.get(m.name, ()):
                if inst.busy is None and not inst.reserved_by:
                    t = inst.last_used + m.idle_s
                    wake = t if wake is None else min(wake, t)
        return wake

    def _resident_wait(self, model: str, now: float, queued: int) -> float | None:
        """Predicted wait for a busy resident instance of ``model`` to have served this action and
        the ``queued`` ones behind it, shared over the instances; None when none is resident."""
        insts = [i for i in self.view.gpu.instances.get(model, ()) if i.busy is not None and not i.reserved_by]
        if not insts:
            return None
        running = self.view.running
        soonest = math.inf
        per_action = 0.0
        for inst in insts:
            busy = inst.busy
            if busy is None:  # not among ``insts``; says so to the type checker
                continue
            r = running.get(busy)
            if r is None:
                continue
            pred = self.predicted.get(busy, 0.0)
            soonest = min(soonest, max(0.0, r.started_at + pred - now))
            per_action = max(per_action, pred)
        if soonest == math.inf:
            return None
        return soonest + queued * per_action / len(insts)

    def _evictions(self, block: tuple[int, ...], per_gpu: float, now: float) -> tuple[list[Instance], float] | None:
        pool = self.view.gpu
        chosen: list[Instance] = []
        freed: dict[int, float] = {}
        for g in block:
            need = per_gpu - pool.free_gb(g) - freed.get(g, 0.0)
            if need <= 1e-9:
                continue
            candidates = [i for i in pool.gpus[g].instances if i.busy is None and not i.reserved_by and i not in chosen]
            candidates.sort(key=(lambda i: self._keep_value(i, now)) if self.opt.residency_aware
                            else (lambda i: i.last_used))
            for inst in candidates:
                if need <= 1e-9:
                    break
                chosen.append(inst)
                for x in inst.gpus:
                    freed[x] = freed.get(x, 0.0) + inst.per_gpu_gb
                need -= inst.per_gpu_gb
            if need > 1e-9:
                return None
        cost = sum(self._keep_value(i, now) for i in chosen) if self.opt.residency_aware else 0.0
        return chosen, cost

    def _keep_value(self, inst: Instance, now: float) -> float:
        """Expected reload seconds an eviction costs: reload time weighted by the chance the model
        is asked for again within the reuse horizon (from its recent request rate)."""
        rate = self._rate(inst.model, now)
        p_reuse = 1.0 - math.exp(-rate * self.opt.reuse_horizon_s)
        return self.view.gpu.load_s(inst.gpus, inst.per_gpu_gb) * p_reuse

    def _schedule_api(self, q: JobQueues, pool: str, now: float) -> Iterator[Decision]:
        qp = self.view.quotas[pool]
        fav = self._favoured if self.opt.fair_share and len(q.heaps) > 1 else None
        while q.size and qp.available(now):
            entry = q.pop(fav)
            if entry is None:
                break
            self._charge(entry[2].job, pool, 1)
            yield Start(entry[2])

    # -- estimates and bookkeeping ---------------------------------------------------------------
    def _per_gpu_gb(self, a: Action) -> float:
        return self.view.cluster.per_gpu_gb(a.model or "", a.weights_gb, a.demand.min(GPU))

    def _setup_estimate(self, a: Action) -> float:
        if a.pool == GPU and not self.view.gpu.instances.get(a.model or ""):
            return self._per_gpu_gb(a) / max(self.view.gpu.h2d_gbps, default=DEFAULT_H2D_GBPS)
        return 0.0

    def _note_model_request(self, model: str, now: float, tau: float = 60.0) -> None:
        rate, t = self._model_rate.get(model, (0.0, now))
        self._model_rate[model] = (rate * math.exp(-(now - t) / tau) + 1.0 / tau, now)

    def _rate(self, model: str, now: float, tau: float = 60.0) -> float:
        rate, t = self._model_rate.get(model, (0.0, now))
        return rate * math.exp(-(now - t) / tau)

    def _charge(self, job: str, pool: str, units: int) -> None:
        usage = self.job_units.get(job)
        if usage is None:
            usage = self.job_units[job] = {pool: units}
        else:
            usage[pool] = usage.get(pool, 0) + units

    def _favoured(self, job: str) -> bool:
        """Below its weighted fair share (DRF: the dominant share over all pools counts)."""
        view = self.view
        weights = self.opt.job_weights
        active = {j for j, units in self.job_units.items() if any(units.values())}
        for q in self.queues.values():
            active.update(j for j, h in q.heaps.items() if h)
        total_w = sum(weights.get(j, 1.0) for j in active) or 1.0
        entitled = weights.get(job, 1.0) / total_w
        dominant = 0.0
        for pool, units in self.job_units.get(job, {}).items():
            if pool == CPU:
                cap = view.cpu.capacity
            elif pool == GPU:
                cap = view.gpu.capacity
            else:
                qp = view.quotas.get(pool)
                cap = qp.quota.concurrency if qp else 0
            if cap:
                dominant = max(dominant, units / cap)
        return dominant < entitled


def tangram_policy(**overrides) -> ActionLevelPolicy:
    return ActionLevelPolicy("tangram", replace(TANGRAM, **overrides))


def fifo_policy() -> ActionLevelPolicy:
    return ActionLevelPolicy("fifo", FIFO)
