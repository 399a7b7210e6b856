"""The engine: queue and pool state, a policy's decisions applied through managers.

It is pure and synchronous: no asyncio, no wall clock, no I/O. Time comes from a ``Clock``;
managers are told to start actions and report completions back by calling ``complete``. The
simulator and the real runtimes drive this same code, which is what keeps the simulator honest.

Contract: every accepted action ends in exactly one terminal ``Finished`` record, delivered to the
listeners; a second completion of the same action is refused (``KeyError``), never double counted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Protocol

from .core.action import CPU, GPU, Action, Allocation, Finished, InvalidAction, Outcome
from .core.clock import Clock
from .core.cluster import Cluster
from .core.pools import CapacityError, CpuPool, GpuPool, QuotaPool
from .policy.base import Costs, Grow, Policy, Prefetch, Profile, Release, Reservation, Reserve, Running, Start


class Manager(Protocol):
    """Carries decisions out (a sandbox, a model server, an API client, or their simulations)."""

    def start(self, action: Action, allocation: Allocation) -> None:
        """Begin running; report back later through ``Engine.complete``. Must not call back into
        the engine before returning."""
        ...

    def close_session(self, trajectory: str) -> None: ...

    def prefetch(self, key: str, model: str, gpus: tuple[int, ...], per_gpu_gb: float) -> None:
        """(GPU managers) copy ``model``'s weights onto ``gpus``; report ``Engine.loaded(key)``."""
        ...


class Usage:
    """Integrals of units held over time (held = allocated to an action or reserved)."""

    __slots__ = ("t", "cpu_held", "gpu_held", "cpu_running", "gpu_running", "cpu_held_s", "gpu_held_s", "series",
                 "sample_every_s", "_next_sample")

    def __init__(self, sample_every_s: float = 1.0) -> None:
        self.t = 0.0
        self.cpu_held = self.gpu_held = self.cpu_running = self.gpu_running = 0
        self.cpu_held_s = self.gpu_held_s = 0.0
        self.series: deque[tuple[float, int, int, int, int]] = deque(maxlen=1_000_000)  # bounded for servers
        self.sample_every_s = sample_every_s
        self._next_sample = 0.0

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.cpu_held_s += self.cpu_held * dt
            self.gpu_held_s += self.gpu_held * dt
            self.t = now
        if now >= self._next_sample:
            self.series.append((now, self.cpu_held, self.cpu_running, self.gpu_held, self.gpu_running))
            self._next_sample = now + self.sample_every_s


class Engine:
    """Owns the queue and pool state; asks the policy; applies decisions; takes completions back."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        managers: Mapping[str, Manager],
        clock: Clock,
        *,
        costs: Costs | None = None,
        profile: Profile | None = None,
        sample_every_s: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.managers = managers
        self.clock = clock
        self.costs = costs or Costs()
        self.profile = profile or Profile()
        self.cpu = CpuPool(cluster.cpu_nodes)
        self.gpu = GpuPool(cluster.gpu_nodes)
        self.quotas: dict[str, QuotaPool] = {f"api:{q.name}": QuotaPool(q) for q in cluster.quotas}
        self.pending: dict[str, Action] = {}
        self.running: dict[str, Running] = {}
        self.reservations: dict[str, Reservation] = {}
        self.usage = Usage(sample_every_s)
        self.listeners: list[Callable[[Finished], None]] = []
        self.loading: dict[str, tuple] = {}  # prefetch key -> (instance, gpus)
        now = clock.now()
        for q in self.quotas.values():
            q.t_last = now
        self.usage.t = now
        self._apply_all(policy.bind(self, now), now)

    # -- inputs ----------------------------------------------------------------------------------
    def submit(self, action: Action) -> Finished | None:
        """Accept ``action`` (None) or reject it at once with a message naming the field."""
        now = self.clock.now()
        action.submitted_at = now
        if action.id in self.pending or action.id in self.running:
            raise InvalidAction("id", f"action {action.id!r} is already in flight")
        problem = self._validate(action)
        if problem is not None:
            return self._finish_unstarted(action, Outcome.REJECTED, problem, now, register=False)
        self.pending[action.id] = action
        self.policy.on_submit(action, now)
        return None

    def cancel(self, action_id: str) -> Finished | None:
        """Cancel a waiting action; a running one is the manager's to stop (returns None)."""
        action = self.pending.pop(action_id, None)
        if action is None:
            return None
        self.policy.on_cancel(action)
        return self._finish_unstarted(action, Outcome.CANCELLED, "cancelled while queued", self.clock.now())

    def complete(self, action_id: str, outcome: Outcome, *, setup_s: float = 0.0, exec_s: float = 0.0,
                 message: str = "") -> Finished:
        """A manager reports that a started action ended."""
        run = self.running.pop(action_id)
        now = self.clock.now()
        self.usage.advance(now)
        alloc = run.allocation
        a = run.action
        units = alloc.count
        if alloc.pool == CPU:
            res = self.reservations.get(alloc.reservation) if alloc.reservation else None
            if res is not None:
                res.free.extend(alloc.units)
            else:
                self.cpu.give(alloc.node, alloc.units)
                self.usage.cpu_held -= units
            self.usage.cpu_running -= units
        elif alloc.pool == GPU:
            self.gpu.release(alloc.units)
            if run.instance is not None:
                run.instance.busy = None
                run.instance.last_used = now
            if not alloc.reservation:
                self.usage.gpu_held -= units
            self.usage.gpu_running -= units
        else:
            if not alloc.unmanaged:
                self.quotas[alloc.pool].give()
        finished = Finished(a, outcome, a.submitted_at, run.started_at, now, setup_s, exec_s,
                            units if alloc.pool in (CPU, GPU) else 1, message)
        self.policy.on_finish(finished)
        for listener in self.listeners:
            listener(finished)
        return finished

    def loaded(self, key: str) -> None:
        """A GPU manager finished a prefetch: the instance is resident and idle."""
        inst, block = self.loading.pop(key)
        now = self.clock.now()
        self.usage.advance(now)
        self.gpu.release(block)
        inst.busy = None
        inst.last_used = now
        self.usage.gpu_held -= len(block)
        self.usage.gpu_running -= len(block)

    def end_trajectory(self, trajectory: str, job: str = "default", step: int | None = None) -> None:
        """The trajectory will send no more actions: its session's state can go."""
        self.cpu.detach(trajectory)
        for manager in {id(m): m for m in self.managers.values()}.values():
            manager.close_session(trajectory)
        self.policy.on_trajectory_end(job, step, trajectory)

    def schedule(self) -> int:
        """One scheduling round; returns how many actions were started."""
        now = self.clock.now()
        return self._apply_all(self.policy.schedule(now), now)

    def next_wakeup(self) -> float | None:
        return self.policy.next_wakeup(self.clock.now())

    # -- applying decisions ----------------------------------------------------------------------
    def _apply_all(self, decisions: Iterable, now: float) -> int:
        self.usage.advance(now)
        started: list[Running] = []
        prefetches: list[tuple] = []
        for d in decisions:
            if type(d) is Start:
                started.append(self._start(d, now))
            elif type(d) is Prefetch:
                prefetches.append(self._prefetch(d))
            elif type(d) is Grow:
                self._grow(d)
            elif type(d) is Reserve:
                self._reserve(d, now)
            elif type(d) is Release:
                self._release(d)
            else:
                raise TypeError(f"unknown decision {d!r}")
        for run in started:
            manager = self.managers.get(run.allocation.pool if run.allocation.pool in (CPU, GPU) else "api")
            if manager is None:
                raise RuntimeError(f"no manager for pool {run.allocation.pool}")
            manager.start(run.action, run.allocation)
        for p in prefetches:
            self.managers[GPU].prefetch(*p)
        return len(started)

    def _prefetch(self, d: Prefetch) -> tuple:
        spec = self.cluster.model(d.model)
        if spec is None or spec.gpus != len(d.block):
            raise CapacityError(f"cannot prefetch {d.model!r} onto {d.block}")
        if not self.gpu.idle(d.block):
            raise CapacityError(f"GPUs {d.block} are not idle")
        key = f"prefetch:{d.model}@{','.join(map(str, d.block))}"
        inst = self.gpu.add_instance(d.model, d.block, spec.per_gpu_gb())
        self.gpu.occupy(d.block, key)
        inst.busy = key
        self.loading[key] = (inst, d.block)
        self.usage.gpu_held += len(d.block)
        self.usage.gpu_running += len(d.block)
        return key, d.model, d.block, spec.per_gpu_gb()

    def _start(self, d: Start, now: float) -> Running:
        a = d.action
        if self.pending.pop(a.id, None) is None:
            raise CapacityError(f"policy started {a.id!r}, which is not waiting")
        pool = a.pool
        instance = None
        if pool == CPU:
            if d.reservation:
                res = self.reservations[d.reservation]
                if d.count > len(res.free):
                    raise CapacityError(f"reservation {res.key} has {len(res.free)} free cores, {d.count} asked")
                units = tuple(res.free[len(res.free) - d.count:])
                del res.free[len(res.free) - d.count:]
                node = res.node
            else:
                node = d.node
                units = self.cpu.take(node, d.count)
                self.usage.cpu_held += d.count
            self.usage.cpu_running += d.count
            setup = ""
            if a.trajectory is not None:
                home = self.cpu.homes.get(a.trajectory)
                if home is None:
                    setup = "create"
                    self.cpu.attach(a.trajectory, node, self.costs.session_mem_gb)
                elif home != node:
                    setup = "restore"
                    self.cpu.attach(a.trajectory, node, self.costs.session_mem_gb)
                else:
                    setup = "" if d.reservation else "thaw"
            alloc = Allocation(CPU, node, units, setup, reservation=d.reservation)
        elif pool == GPU:
            block = d.block
            for inst in d.evict:
                self.gpu.evict(inst)
            model = a.model or ""
            instance = self.gpu.instance_on(model, block)
            setup = ""
            if instance is None:
                spec = self.cluster.model(model)
                per_gpu = spec.per_gpu_gb() if spec else a.weights_gb / len(block)
                instance = self.gpu.add_instance(model, block, per_gpu)
                setup = "load"
            self.gpu.occupy(block, a.id)
            instance.busy = a.id
            instance.uses += 1
            node = self.gpu.gpus[block[0]].node
            if not d.reservation:
                self.usage.gpu_held += len(block)
            self.usage.gpu_running += len(block)
            alloc = Allocation(GPU, node, block, setup, tuple((i.model, i.gpus) for i in d.evict), d.reservation)
        else:
            if d.unmanaged:
                alloc = Allocation(pool, unmanaged=True)
            else:
                self.quotas[pool].take(now)
                alloc = Allocation(pool)
        run = Running(a, alloc, now, instance)
        self.running[a.id] = run
        return run

    def _grow(self, d: Grow) -> None:
        run = self.running[d.action_id]
        alloc = run.allocation
        if alloc.pool != CPU:
            raise CapacityError(f"only CPU actions grow, {d.action_id} is on {alloc.pool}")
        extra = self.cpu.take(alloc.node, d.count)
        self.usage.cpu_held += d.count
        self.usage.cpu_running += d.count
        run.allocation = replace(alloc, units=alloc.units + extra)

    def _reserve(self, d: Reserve, now: float) -> None:
        if d.key in self.reservations:
            raise CapacityError(f"reservation {d.key} exists")
        if d.pool == CPU:
            units = self.cpu.take(d.node, d.count)
            self.usage.cpu_held += d.count
            self.reservations[d.key] = Reservation(d.key, CPU, d.node, units, list(units), now)
        elif d.pool == GPU:
            if not self.gpu.idle(d.block):
                raise CapacityError(f"GPUs {d.block} are not free to reserve")
            for g in d.block:
                self.gpu.gpus[g].reserved_by = d.key
            if d.model:
                spec = self.cluster.model(d.model)
                if spec is None:
                    raise CapacityError(f"cannot preload unknown model {d.model!r}")
                self.gpu.add_instance(d.model, d.block, spec.per_gpu_gb(), owner=d.key)
            self.usage.gpu_held += len(d.block)
            node = self.gpu.gpus[d.block[0]].node
            self.reservations[d.key] = Reservation(d.key, GPU, node, d.block, list(d.block), now)
        else:
            raise CapacityError(f"cannot reserve pool {d.pool}")

    def _release(self, d: Release) -> None:
        res = self.reservations.pop(d.key)
        if len(res.free) != len(res.units):
            raise CapacityError(f"reservation {d.key} released while in use")
        if res.pool == CPU:
            self.cpu.give(res.node, res.units)
            self.usage.cpu_held -= len(res.units)
        else:
            for inst in [i for g in res.units for i in self.gpu.gpus[g].instances if i.reserved_by == d.key]:
                if inst in self.gpu.instances.get(inst.model, ()):
                    inst.reserved_by = ""
            for g in res.units:
                self.gpu.gpus[g].reserved_by = ""
            self.usage.gpu_held -= len(res.units)

    # -- helpers ---------------------------------------------------------------------------------
    def _validate(self, a: Action) -> str | None:
        if a.pool == CPU:
            lo = a.demand.ranges[CPU][0]
            if not self.cpu.capacity:
                return "service: this cluster has no CPU nodes for sandbox actions"
            if lo > self.cpu.max_cores:
                return f"demand.cpu: minimum {lo} exceeds the largest node ({self.cpu.max_cores} cores)"
        elif a.pool == GPU:
            g = a.demand.ranges[GPU][0]
            if not self.gpu.capacity:
                return "service: this cluster has no GPUs for model actions"
            if a.demand.ranges[GPU][1] != g:
                return "demand.gpu: a model instance has a fixed size (min must equal max)"
            if g > self.gpu.max_island:
                return f"demand.gpu: {g} GPUs exceed the largest island ({self.gpu.max_island})"
            spec = self.cluster.model(a.model or "")
            if spec is not None and spec.gpus != g:
                return f"demand.gpu: model {spec.name!r} runs on {spec.gpus} GPUs per instance, not {g}"
            per_gpu = spec.per_gpu_gb() if spec else a.weights_gb / g
            if spec is None and a.weights_gb <= 0:
                return f"service: unknown model {a.model!r} (register it or give weights_gb)"
            if per_gpu > min(x.memory_gb for x in self.gpu.gpus):
                return f"weights_gb: {per_gpu:.1f} GB per GPU exceeds GPU memory"
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
