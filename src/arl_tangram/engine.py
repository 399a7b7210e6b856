"""The engine: queue and pool state, a policy's decisions applied through managers.

It is pure and synchronous: no asyncio, no wall clock, no I/O. Time comes from a ``Clock``;
managers (``core.seam``) are told to start actions and report back through their sink, which ends
in ``Engine.report``. The simulator and the real runtimes drive this same code (``driver.Driver``
is the loop they share), which is what keeps the simulator honest.

Contract:

* every accepted action ends in exactly one terminal ``Finished`` record, delivered to the
  listeners; a second completion of the same action is refused (``KeyError``), never double counted;
* the engine changes pool state only through the pools' ledgers (``admit``/``release`` and their
  reservation twins), which check capacity and keep the usage integrals; a policy that asks for
  more than there is gets ``CapacityError`` (a bug), never an oversubscribed pool;
* decisions are applied one by one in the order the policy yields them (each sees the effect of
  the one before); started actions are handed to their managers only once the round is over.

Hot path: this module and the rest of ``build.HOT_PATH`` are compiled with mypyc at install
(``setup.py``), and the shape of the code below is what measured quickest on the sources: fast
paths where an action is checked, a pool's ledger without inner calls, one round per event. What
was measured, kept and dropped, with the figures, is in docs/performance.md (engine and policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable, Final, Iterable, Mapping

from .core.action import CPU, GPU, Action, Allocation, Finished, InvalidAction, Outcome, Setup
from .core.clock import Clock
from .core.cluster import Cluster, CpuNode, GpuNode, ModelSpec
from .core.pools import EPS, CapacityError, CpuPool, GpuPool, Meter, QuotaPool, Units
from .core.records import Load, Reservation, Running
from .core.seam import Chainer, Completion, Loaded, Manager, ModelHost, Pool, Report, Resizer
from .policy.base import (Costs, Decision, Evict, Follow, Grow, Policy, Prefetch, Profile, Release, Reserve, Shrink,
                          Start, Wait)
from .waits import DEFAULT_MAX_QUEUE_S, QueueDeadlines

# an enum member read costs ~0.1 µs on Python 3.11 (a descriptor call); the two the CPU start
# path reads for nearly every action are read once here
_NO_SETUP: Final = Setup.NONE
_THAW: Final = Setup.THAW


class Usage:
    """Integrals of units held over time (held = allocated to an action or reserved), read off
    the pools' meters, and a bounded series of samples for plots.

    The first sample is taken when it is built, so ``advance`` at the time of the last one is a
    no-op (the interval is positive): callers skip the call when ``now == usage.t`` (the engine's
    hot path: a completion and the round after it come at the same time; stubbing ``advance`` out
    altogether saved ~0.4 µs an action in ``tangram bench scheduler``)."""

    __slots__ = ("t", "cpu", "gpu", "series", "sample_every_s", "_next_sample")

    def __init__(self, cpu: Meter, gpu: Meter, now: float, sample_every_s: float = 1.0) -> None:
        if not sample_every_s > 0:
            raise ValueError(f"sample_every_s: must be positive, got {sample_every_s!r}")
        self.t = now
        self.cpu = cpu
        self.gpu = gpu
        self.series: deque[tuple[float, Units, Units, Units, Units]] = deque(maxlen=1_000_000)  # bounded for servers
        self.sample_every_s = sample_every_s
        self._next_sample = 0.0
        if now >= self._next_sample:
            self._sample(now)

    def _sample(self, now: float) -> None:
        self.series.append((now, self.cpu.held, self.cpu.running, self.gpu.held, self.gpu.running))
        self._next_sample = now + self.sample_every_s

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.cpu.held_s += self.cpu.held * dt
            self.gpu.held_s += self.gpu.held * dt
            self.t = now
        if now >= self._next_sample:
            self._sample(now)

    @property
    def cpu_held_s(self) -> float:
        return self.cpu.held_s

    @property
    def gpu_held_s(self) -> float:
        return self.gpu.held_s


class _Follower:
    """An action queued behind a running one (``Follow``): the cores it was given (its
    predecessor's) and whether the CPU manager took it (else the engine starts it itself when the
    predecessor's report arrives)."""

    __slots__ = ("action", "allocation", "taken")

    def __init__(self, action: Action, allocation: Allocation) -> None:
        self.action = action
        self.allocation = allocation
        self.taken = False


class Engine:
    """Owns the queue and pool state; asks the policy; applies decisions; takes reports back."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        managers: Mapping[Pool, Manager],
        clock: Clock,
        *,
        costs: Costs | None = None,
        profile: Profile | None = None,
        sample_every_s: float = 1.0,
        max_queue_s: float | None = DEFAULT_MAX_QUEUE_S,
        session_headroom_gb: float = 0.0,
    ) -> None:
        """``max_queue_s``: an action not started this long after it was submitted ends
        ``rejected`` (None: no bound); ``session_headroom_gb``: reserved for an idle session on top
        of the memory it was measured to use (``Completion.session_mem_gb``)."""
        self.cluster = cluster
        self.policy = policy
        self.managers = dict(managers)
        self.clock = clock
        self.costs = costs or Costs()
        self.profile = profile or Profile()
        now = clock.now()
        self.cpu = CpuPool(cluster.cpu_nodes)
        self.gpu = GpuPool(cluster.gpu_nodes)
        self.quotas: dict[str, QuotaPool] = {f"api:{q.name}": QuotaPool(q, now) for q in cluster.quotas}
        self.pending: dict[str, Action] = {}
        self.running: dict[str, Running] = {}
        self.reservations: dict[str, Reservation] = {}
        self.loading: dict[str, Load] = {}
        self.usage = Usage(self.cpu.meter, self.gpu.meter, now, sample_every_s)
        self.listeners: list[Callable[[Finished], None]] = []
        self.deadlines = QueueDeadlines(max_queue_s)
        self.session_headroom_gb = session_headroom_gb
        #: GPU nodes may join later (the Ray runtime with model services): a model action is not
        #: refused for want of GPUs or of a big enough island now; it waits (``max_queue_s``)
        self.gpus_may_join = False
        self._manager_of: dict[str, Manager] = {}
        host = self.managers.get(Pool.GPU)
        if self.gpu.capacity and not isinstance(host, ModelHost):
            raise TypeError("a cluster with GPUs needs a ModelHost manager for Pool.GPU")
        self._model_host: ModelHost | None = host if isinstance(host, ModelHost) else None
        # typed ``object``: narrowed from ``Manager``, the check made a type mypyc compiled as
        # None (the compiled engine refused every CPU manager with a TypeError)
        resizer: object = self.managers.get(Pool.CPU)
        #: the CPU manager can take cores back from a running action (``Shrink``; ``EngineView``)
        self._resizer: Resizer | None = resizer if isinstance(resizer, Resizer) else None
        #: the CPU manager starts an action the moment another ends (``Follow``; ``EngineView``)
        self._chainer: Chainer | None = resizer if isinstance(resizer, Chainer) else None
        #: running CPU actions that may take a follower (``EngineView.followable``; kept only
        #: with a chaining manager), oldest start first
        self.followable: dict[str, Running] = {}
        #: a running action's id -> its follower (the action, the allocation it was given: the
        #: predecessor's cores, and whether the manager took it); ``following``: the other way
        self.followers: dict[str, _Follower] = {}
        self.following: dict[str, str] = {}
        self.handed_over = 0  # followers their manager started as their run ended (for benches and tests)
        self._apply_all(policy.bind(self, now), now)

    # -- inputs ----------------------------------------------------------------------------------
    def submit(self, action: Action) -> Finished | None:
        """Accept ``action`` (None) or reject it at once with a message naming the field.

        An id already in flight raises ``InvalidAction`` (the caller's bug: ids are idempotency
        keys, and the first caller must keep its result)."""
        now = self.clock.now()
        aid = action.id
        if aid in self.pending or aid in self.running or aid in self.following:
            raise InvalidAction("id", f"action {aid!r} is already in flight")
        action.submitted_at = now
        problem = self._validate(action)
        if problem is not None:
            return self._finish_unstarted(action, Outcome.REJECTED, problem, now, register=False)
        self.pending[aid] = action
        self.deadlines.add(action)
        self.policy.on_submit(action, now)
        return None

    def cancel(self, action_id: str) -> Finished | None:
        """Cancel an action: a waiting one ends here (its ``Finished`` is returned); a running one
        is its manager's to stop, and ends when the manager reports (None is returned)."""
        action = self.pending.pop(action_id, None)
        if action is None:
            run = self.running.get(action_id)
            if run is not None:
                self.managers[Pool.of(run.allocation.pool)].cancel(action_id)
            elif action_id in self.following:
                after = self.following[action_id]
                if self.followers[after].taken:  # its manager may have started it: it reports
                    self.managers[Pool.CPU].cancel(action_id)
                else:
                    ended = Completion(action_id, Outcome.CANCELLED, message="cancelled while queued")
                    return self._end_follower(ended)
            return None
        self.policy.on_cancel(action)
        return self._finish_unstarted(action, Outcome.CANCELLED, "cancelled while queued", self.clock.now())

    def report(self, r: Report) -> Finished | None:
        """A manager's report: an action ended (its ``Finished``) or a prefetch is resident."""
        match r:
            case Completion():
                return self.complete(r)
            case Loaded(key=key):
                self.loaded(key)
                return None
            case _:
                raise TypeError(f"unknown report {r!r}")

    def complete(self, c: Completion) -> Finished:
        """A started action ended; its units go back to their pool (or reservation), or on to its
        follower (``Follow``)."""
        if self.following and c.action_id in self.following:
            return self._end_follower(c)  # cancelled or lost before its turn came
        run = self.running.pop(c.action_id)
        now = self.clock.now()
        if now != self.usage.t:
            self.usage.advance(now)
        alloc = run.allocation
        a = run.action
        pool = alloc.pool
        if pool == CPU:
            res = self.reservations.get(alloc.reservation) if alloc.reservation else None
            if res is not None:
                self.cpu.release_reserved(res, alloc.units)
            elif self.followers and c.action_id in self.followers:
                self._hand_over(c.action_id, now)  # its cores stay held: its follower has them now
            else:
                if self.followable:
                    self.followable.pop(c.action_id, None)
                node = alloc.node
                assert node is not None, "a CPU allocation names its node"
                self.cpu.release(node, alloc.units)
        elif pool == GPU:
            assert run.instance is not None, "a GPU action runs on a model copy"
            self.gpu.release(run.instance, now, reserved=bool(alloc.reservation))
        elif not alloc.unmanaged:
            self.quotas[pool].release()
        if c.session_mem_gb is not None and a.trajectory is not None:
            self.cpu.settle_session(a.trajectory, c.session_mem_gb, self.session_headroom_gb)
        units = len(alloc.units) or 1  # ``Allocation.count``; an API call counts one
        finished = Finished(a, c.outcome, a.submitted_at, run.started_at, now, c.setup_s, c.exec_s, units, c.message)
        self.policy.on_finish(finished)
        for listener in self.listeners:
            listener(finished)
        return finished

    def loaded(self, key: str) -> None:
        """A GPU manager finished a prefetch: the instance is resident and idle."""
        load = self.loading.pop(key)
        now = self.clock.now()
        self.usage.advance(now)
        self.gpu.release(load.instance, now)

    def end_trajectory(self, trajectory: str, job: str = "default", step: int | None = None) -> None:
        """The trajectory will send no more actions: its session's state can go."""
        self.cpu.detach(trajectory)
        for manager in {id(m): m for m in self.managers.values()}.values():
            manager.close_session(trajectory)
        self.policy.on_trajectory_end(job, step, trajectory)

    # -- membership --------------------------------------------------------------------------------
    def add_cpu_node(self, node: CpuNode) -> int:
        """A node joins while the engine runs; returns its index (what allocations name)."""
        i = self.cpu.add_node(node)
        self.cluster = replace(self.cluster, cpu_nodes=self.cpu.nodes)
        return i

    def remove_cpu_node(self, index: int, reason: str) -> list[str]:
        """A node leaves (dead or drained): its capacity leaves at once; the sessions it held are
        lost, and their queued steps end ``infra_error`` with ``reason``. Actions running there are
        their manager's to report. Returns the lost sessions."""
        lost = self.cpu.remove_node(index)
        self._unfollowable(index)
        gone = set(lost)
        now = self.clock.now()
        for action in [a for a in self.pending.values() if a.trajectory in gone]:
            del self.pending[action.id]
            self.policy.on_cancel(action)
            self._finish_unstarted(action, Outcome.INFRA_ERROR, reason, now)
        return lost

    def drain_cpu_node(self, index: int) -> list[str]:
        """A node is drained: it takes no new work from now on (its free cores and memory leave
        placement; what its running actions release is not handed out again), and the sessions it
        homes, returned, are to move (``move_session``) once their running steps end. A queued
        step of one of them is placed elsewhere as a move (``Setup.RESTORE``) or waits for it."""
        self.cpu.drain(index)
        self._unfollowable(index)
        return sorted(s for s, home in self.cpu.homes.items() if home == index)

    def _unfollowable(self, node: int) -> None:
        """A node drained or gone: nothing queues behind its runs any more (a follower already
        queued there is its manager's to start or report, as a run there is)."""
        if self.followable:
            for aid in [aid for aid, run in self.followable.items() if run.allocation.node == node]:
                del self.followable[aid]

    def adopt_session(self, session: str, node: int) -> None:
        """A session that lives on ``node`` already (a restarted head re-attaching its node's
        sessions) is homed there: its next step thaws it there. It reserves its estimate
        (``Costs.session_mem_gb``), or what the node has left when less: it exists whatever the
        ledger says, and its next step settles its measured use."""
        mem = min(self.costs.session_mem_gb, max(0.0, self.cpu.free_mem[node]))
        self.cpu.attach(session, node, mem)

    def move_session(self, session: str) -> int | None:
        """Where ``session`` goes off its draining home: the node with the most free cores that
        has room for its reserved memory; it is homed there now (its memory reserved there). None
        when no node has the room now (try again later) or the session has no home any more.
        A session already re-homed (a queued step of it was placed elsewhere) keeps that home."""
        cpu = self.cpu
        home = cpu.homes.get(session)
        if home is None:
            return None
        if home not in cpu.draining:
            return home
        mem = cpu.session_mem.get(session, self.costs.session_mem_gb)
        node = cpu.best_node(0, mem)
        if node is None:
            return None
        cpu.attach(session, node, mem)
        return node

    def add_gpu_node(self, node: GpuNode) -> int:
        """A GPU node joins while the engine runs (its GPUs idle and empty); returns its index.
        Its GPUs' global ids are ``gpu.first_gpu[index]`` onwards."""
        if self._model_host is None:
            raise TypeError("a cluster with GPUs needs a ModelHost manager for Pool.GPU")
        i = self.gpu.add_node(node)
        self.cluster = replace(self.cluster, gpu_nodes=self.gpu.nodes)
        self._cluster_changed()
        return i

    def remove_gpu_node(self, index: int) -> list[str]:
        """A GPU node leaves (dead or drained): its GPUs leave at once and its resident copies
        are forgotten; prefetches onto it end here (no ``Loaded`` is expected for them any more).
        Actions running there are their manager's to report (their copy is released then).
        Returns the keys of the prefetches dropped."""
        gone = self.gpu.remove_node(index)
        dropped: list[str] = []
        now = self.clock.now()
        if now != self.usage.t:
            self.usage.advance(now)
        for key, load in list(self.loading.items()):
            if load.instance in gone:
                del self.loading[key]
                self.gpu.release(load.instance, now)
                dropped.append(key)
        self._cluster_changed()
        return dropped

    def add_models(self, specs: Iterable[ModelSpec]) -> None:
        """Register model services while the engine runs (a runtime whose weights are loaded on
        the GPU nodes learns their sizes only once the first node has loaded them); a service
        already registered keeps its spec."""
        known = {m.name for m in self.cluster.models}
        new = tuple(m for m in specs if m.name not in known)
        if new:
            self.cluster = replace(self.cluster, models=(*self.cluster.models, *new))
            self._cluster_changed()

    @property
    def cpu_resizes(self) -> bool:
        return self._resizer is not None

    def _cluster_changed(self) -> None:
        """Tell the policy that pools or services changed, if it wants to know (an optional
        ``on_cluster_change(now)`` returning decisions; a policy that plans its partitions once,
        at ``bind``, keeps them)."""
        hook = getattr(self.policy, "on_cluster_change", None)
        if hook is not None:
            now = self.clock.now()
            self._apply_all(hook(now), now)

    def schedule(self) -> int:
        """One scheduling round; returns how many actions were started."""
        now = self.clock.now()
        deadline = self.deadlines.earliest(self.pending)  # drops the entries of started actions
        if deadline is not None and deadline <= now + EPS:  # not the common case, once per round
            self._expire_queued(now)
        return self._apply_all(self.policy.schedule(now), now)

    def next_wakeup(self) -> float | None:
        """When to run a round even if nothing happens: the policy's wish or the earliest queue
        deadline, whichever comes first."""
        wake = self.policy.next_wakeup(self.clock.now())
        deadline = self.deadlines.earliest(self.pending)
        if deadline is None:
            return wake
        return deadline if wake is None else min(wake, deadline)

    # -- bounded queue time ---------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The earliest time a queued action will be rejected for waiting too long, or None."""
        return self.deadlines.earliest(self.pending)

    def queue_head(self) -> Action | None:
        """The action waiting longest (``pending`` keeps submission order)."""
        return next(iter(self.pending.values()), None)

    def why_waiting(self, action: Action) -> Wait:
        """Why the queued ``action`` has not started: the policy says (``Policy.why_waiting``)."""
        return self.policy.why_waiting(action, self.clock.now())

    def session_room_gb(self) -> float:
        """The most memory a new session could find on one CPU node once the steps running now
        end: free memory plus what running steps hold above their session's idle reservation
        (their estimate goes back when they end). A session not measured yet (its first step
        runs) is expected to settle at the mean of those measured; with none measured, no credit.
        (No credit at all refused new sessions while a few first steps ran: on a 1 GB node, 16
        sessions of ~30 that fit.)"""
        cpu = self.cpu
        room = list(cpu.free_mem)
        used = cpu.session_used
        typical = cpu.session_used_gb() / len(used) if used else None
        for run in self.running.values():
            traj = run.action.trajectory
            if traj is None or run.allocation.pool != CPU:
                continue
            node = cpu.homes.get(traj)
            idle = used.get(traj, typical)
            if node is not None and idle is not None:
                room[node] += max(0.0, cpu.session_mem.get(traj, 0.0) - idle - self.session_headroom_gb)
        return max(room, default=0.0)

    def _expire_queued(self, now: float) -> None:
        for action in self.deadlines.due(self.pending, now, EPS):
            why = self.policy.why_waiting(action, now)  # before it leaves the queue
            del self.pending[action.id]
            self.policy.on_cancel(action)
            self._finish_unstarted(action, Outcome.REJECTED,
                                   f"capacity: not started within {self.deadlines.max_queue_s:g} s of queueing "
                                   f"(max_queue_s); it was waiting for {why}", now)

    # -- applying decisions ----------------------------------------------------------------------
    def _apply_all(self, decisions: Iterable[Decision], now: float) -> int:
        """The one apply path: every decision of every policy passes here, in order."""
        if now != self.usage.t:
            self.usage.advance(now)
        started: list[Running] = []
        loads: list[Load] = []
        shrunk: list[Running] | None = None
        followed: list[Follow] | None = None
        for d in decisions:
            if type(d) is Start:  # nearly every decision: one type test before the match below
                started.append(self._start(d, now))  # a direct call: compiled, a native one
                continue
            match d:
                case Start():
                    started.append(self._start(d, now))
                case Follow():
                    self._follow(d)
                    if followed is None:
                        followed = []
                    followed.append(d)
                case Prefetch():
                    loads.append(self._prefetch(d))
                case Grow():
                    self._grow(d)
                case Shrink():
                    if shrunk is None:
                        shrunk = []
                    shrunk.append(self._shrink(d))
                case Reserve():
                    self._reserve(d, now)
                case Release():
                    self._release(d)
                case Evict():
                    self._evict(d)
                case _:
                    raise TypeError(f"unknown decision {d!r}")
        if shrunk is not None:  # before the starts that may run on the cores taken back
            resizer = self._resizer
            assert resizer is not None, "_shrink checked"
            for run in shrunk:
                resizer.resize(run.action.id, run.allocation)
        manager_of = self._manager_of
        for run in started:
            alloc = run.allocation
            manager = manager_of.get(alloc.pool) or self._manager_for(alloc.pool)
            manager.start(run.action, alloc)
        if followed is not None:
            chainer = self._chainer
            assert chainer is not None, "_follow checked"
            for f in followed:
                fol = self.followers[f.after]
                fol.taken = chainer.follow(fol.action, fol.allocation, f.after)
        for load in loads:
            self._host().prefetch(load)
        return len(started)

    def _manager_for(self, pool: str) -> Manager:
        """The manager of an allocation's ``pool`` (``cpu``, ``gpu`` or ``api:<name>``),
        remembered in ``_manager_of`` (one dict lookup per start instead of ``Pool.of`` and a
        lookup by enum)."""
        manager = self.managers.get(Pool.of(pool))
        if manager is None:
            raise RuntimeError(f"no manager for pool {pool}")
        self._manager_of[pool] = manager
        return manager

    def _prefetch(self, d: Prefetch) -> Load:
        spec = self.cluster.model(d.model)
        if spec is None or spec.gpus != len(d.block):
            raise CapacityError(f"cannot prefetch {d.model!r} onto {d.block}")
        if not self.gpu.fits(d.block, spec.compute_share):
            raise CapacityError(f"GPUs {d.block} have less than {spec.compute_share:.2f} of their compute to spare")
        key = f"prefetch:{d.model}@{','.join(map(str, d.block))}"
        inst = self.gpu.add_instance(d.model, d.block, spec.per_gpu_gb())
        self.gpu.admit(inst, key, share=spec.compute_share)  # a load holds the share its first batch will use
        load = self.loading[key] = Load(key, d.model, d.block, spec.per_gpu_gb(), inst)
        return load

    def _evict(self, d: Evict) -> None:
        """Scale to zero: an idle copy leaves GPU memory; its weights stay in host RAM."""
        inst = self.gpu.instance_on(d.model, d.block)
        if inst is None or inst.busy is not None or inst.reserved_by:
            raise CapacityError(f"cannot evict {d.model!r} from {d.block}: not resident and idle")
        self.gpu.evict(inst)
        self._host().evict(d.model, d.block)

    def _host(self) -> ModelHost:
        if self._model_host is None:
            raise CapacityError("a GPU decision, and no ModelHost manages Pool.GPU")
        return self._model_host

    def _start(self, d: Start, now: float) -> Running:
        a = d.action
        aid = a.id
        if self.pending.pop(aid, None) is None:
            raise CapacityError(f"policy started {aid!r}, which is not waiting")
        pool = a.pool
        if pool == CPU:
            run = Running(a, self._start_cpu(d), now)
            chainer = self._chainer
            if chainer is not None and a.trajectory is None and not d.reservation:
                lo, hi = a.demand.ranges[CPU]
                if lo == hi and chainer.chains(a):
                    self.followable[aid] = run
        elif pool == GPU:
            alloc, instance = self._start_gpu(d)
            run = Running(a, alloc, now, instance)
        else:
            if not d.unmanaged:
                self.quotas[pool].admit(now)
            run = Running(a, Allocation(pool, unmanaged=d.unmanaged), now)
        self.running[aid] = run
        return run

    def _start_cpu(self, d: Start) -> Allocation:
        cpu = self.cpu
        reservation = d.reservation
        if reservation:
            res = self.reservations[reservation]
            node = res.node
            units = cpu.admit_reserved(res, d.count)
        else:
            if d.node is None:
                raise CapacityError(f"policy started {d.action.id!r} on the CPU pool without a node")
            node = d.node
            units = cpu.admit(node, d.count)
        setup = _NO_SETUP
        traj = d.action.trajectory
        if traj is not None:
            home = cpu.homes.get(traj)
            if home != node:
                setup = Setup.CREATE if home is None else Setup.RESTORE
                cpu.attach(traj, node, self.costs.session_mem_gb)
            else:
                if not reservation:
                    setup = _THAW
                if traj in cpu.session_used:  # only measured ones shrank
                    cpu.grow_session(traj, self.costs.session_mem_gb)
        return Allocation(CPU, node, units, setup, (), reservation)

    def _start_gpu(self, d: Start):
        a = d.action
        block = d.block
        for inst in d.evict:
            self.gpu.evict(inst)
        model = a.model or ""
        spec = self.cluster.model(model)
        share = spec.compute_share if spec is not None else 1.0
        instance = self.gpu.instance_on(model, block)
        setup = Setup.NONE
        if instance is None:
            per_gpu = self.cluster.per_gpu_gb(model, a.weights_gb, len(block))
            instance = self.gpu.add_instance(model, block, per_gpu)
            setup = Setup.LOAD
        self.gpu.admit(instance, a.id, reserved=bool(d.reservation), share=share)
        instance.uses += 1
        node = self.gpu.gpus[block[0]].node
        alloc = Allocation(GPU, node, block, setup, tuple((i.model, i.gpus) for i in d.evict), d.reservation,
                           share=share)
        return alloc, instance

    def _follow(self, d: Follow) -> None:
        """Queue a waiting action behind a running one, on its cores (handed over in
        ``_hand_over``); the manager is asked once the round's decisions are applied."""
        a = d.action
        aid = a.id
        if self._chainer is None:
            raise CapacityError(f"follow of {aid}: the CPU manager cannot start an action as another ends")
        run = self.followable.get(d.after)
        if run is None:
            raise CapacityError(f"policy queued {aid!r} behind {d.after!r}, which is not running or has a follower")
        alloc = run.allocation
        lo, hi = a.demand.ranges[CPU] if a.pool == CPU else (0, 0)
        if a.trajectory is not None or lo != hi or lo != len(alloc.units):
            raise CapacityError(f"policy queued {aid!r} behind {d.after!r}: only a one-shot asking for exactly its "
                                f"{len(alloc.units)} core(s) may follow")
        if self.pending.pop(aid, None) is None:
            raise CapacityError(f"policy queued {aid!r}, which is not waiting")
        del self.followable[d.after]
        self.followers[d.after] = _Follower(a, Allocation(CPU, alloc.node, alloc.units, _NO_SETUP))
        self.following[aid] = d.after

    def _hand_over(self, after: str, now: float) -> None:
        """``after`` ended: its follower runs on its cores from now (the manager started it
        already, or is told to now)."""
        fol = self.followers.pop(after)
        a = fol.action
        del self.following[a.id]
        run = self.running[a.id] = Running(a, fol.allocation, now)
        chainer = self._chainer
        if chainer is not None and chainer.chains(a):
            self.followable[a.id] = run
        if fol.taken:
            self.handed_over += 1
        else:
            manager = self._manager_of.get(CPU) or self._manager_for(CPU)
            manager.start(a, fol.allocation)

    def _end_follower(self, c: Completion) -> Finished:
        """A follower ended before its predecessor's report (cancelled; its runner lost): the
        predecessor keeps its cores, and releases them when it ends."""
        aid = c.action_id
        after = self.following.pop(aid)
        fol = self.followers.pop(after)
        self.followable[after] = self.running[after]  # another may follow it now
        now = self.clock.now()
        a = fol.action
        # charged by the policy when it followed: ``started_at`` set, as for any start
        finished = Finished(a, c.outcome, a.submitted_at, now, now, c.setup_s, c.exec_s, len(fol.allocation.units),
                            c.message)
        self.policy.on_finish(finished)
        for listener in self.listeners:
            listener(finished)
        return finished

    def _grow(self, d: Grow) -> None:
        run = self.running[d.action_id]
        alloc = run.allocation
        if alloc.pool != CPU:
            raise CapacityError(f"only CPU actions grow, {d.action_id} is on {alloc.pool}")
        assert alloc.node is not None, "a CPU allocation names its node"
        extra = self.cpu.admit(alloc.node, d.count)
        run.allocation = replace(alloc, units=alloc.units + extra)

    def _shrink(self, d: Shrink) -> Running:
        """Cores back from a running CPU action, down to no less than its minimum demand; the
        manager is told once the round's decisions are applied, before any start is handed over."""
        if self._resizer is None:
            raise CapacityError(f"shrink of {d.action_id}: the CPU manager cannot take cores back from a running action")
        run = self.running.get(d.action_id)
        if run is None:
            raise CapacityError(f"shrink of {d.action_id}, which is not running")
        alloc = run.allocation
        if alloc.pool != CPU or alloc.reservation:
            raise CapacityError(f"only CPU actions outside reservations shrink, {d.action_id} is on "
                                f"{alloc.reservation or alloc.pool}")
        assert alloc.node is not None, "a CPU allocation names its node"
        keep = len(alloc.units) - d.count
        if d.count <= 0 or keep < run.action.demand.ranges[CPU][0]:
            raise CapacityError(f"shrink of {d.action_id} by {d.count}: it holds {len(alloc.units)} cores, at least "
                                f"{run.action.demand.ranges[CPU][0]} must stay")
        self.cpu.release(alloc.node, alloc.units[keep:])
        run.allocation = replace(alloc, units=alloc.units[:keep])
        return run

    def _reserve(self, d: Reserve, now: float) -> None:
        if d.key in self.reservations:
            raise CapacityError(f"reservation {d.key} exists")
        if d.pool == CPU:
            if d.node is None:
                raise CapacityError(f"reservation {d.key} of the CPU pool names no node")
            units = self.cpu.reserve(d.node, d.count)
            self.reservations[d.key] = Reservation(d.key, CPU, d.node, units, list(units), now)
        elif d.pool == GPU:
            self.gpu.reserve(d.block, d.key)
            if d.model:
                spec = self.cluster.model(d.model)
                if spec is None:
                    raise CapacityError(f"cannot preload unknown model {d.model!r}")
                self.gpu.add_instance(d.model, d.block, spec.per_gpu_gb(), owner=d.key)
            node = self.gpu.gpus[d.block[0]].node
            self.reservations[d.key] = Reservation(d.key, GPU, node, d.block, list(d.block), now)
        else:
            raise CapacityError(f"cannot reserve pool {d.pool}")

    def _release(self, d: Release) -> None:
        res = self.reservations.pop(d.key)
        if res.in_use:
            raise CapacityError(f"reservation {d.key} released while in use")
        if res.pool == CPU:
            self.cpu.unreserve(res.node, res.units)
        else:
            self.gpu.unreserve(res.units, d.key)

    # -- helpers ---------------------------------------------------------------------------------
    def _validate(self, a: Action) -> str | None:
        if a.pool == CPU:
            lo = a.demand.ranges[CPU][0]  # an action of the CPU pool always has a CPU range
            if not self.cpu.capacity:
                return "service: this cluster has no CPU nodes for sandbox actions"
            if lo > self.cpu.max_cores:
                return f"demand.cpu: minimum {lo} exceeds the largest node ({self.cpu.max_cores} cores)"
        elif a.pool == GPU:
            g = a.demand.min(GPU)
            may_join = self.gpus_may_join
            if not self.gpu.capacity and not may_join:
                return "service: this cluster has no GPUs for model actions"
            if a.demand.max(GPU) != g:
                return "demand.gpu: a model instance has a fixed size (min must equal max)"
            if g > self.gpu.max_island and not may_join:
                return f"demand.gpu: {g} GPUs exceed the largest island ({self.gpu.max_island})"
            spec = self.cluster.model(a.model or "")
            if spec is not None and spec.gpus != g:
                return f"demand.gpu: model {spec.name!r} runs on {spec.gpus} GPUs per instance, not {g}"
            if spec is None and a.weights_gb <= 0:
                return f"service: unknown model {a.model!r} (register it or give weights_gb)"
            per_gpu = self.cluster.per_gpu_gb(a.model or "", a.weights_gb, g)
            largest = max((x.memory_gb for x in self.gpu.gpus if x.alive), default=0.0)
            if per_gpu > largest and (largest > 0 or not may_join):
                return (f"weights_gb: model {a.model!r} needs {per_gpu:.1f} GB per GPU, more than any GPU holds "
                        f"({largest:.1f} GB)")
        elif a.pool not in self.quotas:
            return f"service: no quota is configured for {a.pool!r}"
        return None

    def _finish_unstarted(self, action: Action, outcome: Outcome, message: str, now: float,
                          register: bool = True) -> Finished:
        finished = Finished(action, outcome, action.submitted_at, None, now, message=message)
        if register:
            self.policy.on_finish(finished)
        for listener in self.listeners:
            listener(finished)
        return finished
