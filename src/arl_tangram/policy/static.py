"""Today's practice, as real policies: static partitions held whether used or not.

* ``task-isolated``: action-level inside each service, but every pool is split up front — CPU
  cores per job, API concurrency per job, and each model service owns a fixed GPU partition
  with its weights preloaded. Partitions are sized from the expected load (``Profile``), which is
  the best a static plan can do.
* ``trajectory-static``: each trajectory holds a dedicated sandbox of k cores from its first action
  to its last (k = cores / concurrent trajectories, 1..8); trajectories without a free sandbox
  wait first come, first served. Model services own GPU partitions as in task-isolated. API calls
  are made directly by each trajectory with no central quota: the external API's limiter answers
  over-limit calls and clients back off and retry.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from ..core.action import CPU, GPU, Action, Finished
from .base import Decision, EngineView, Release, Reserve, Start, Wait, pool_wait


class InfeasiblePolicy(RuntimeError):
    """A static plan that cannot be laid out on this cluster (fewer GPUs than one instance of
    every service needs, say): reported as such, never silently degraded."""


class StaticPartitions:
    """What both static baselines share: per-service GPU partitions, FIFO inside each."""

    name = "static"

    def __init__(self) -> None:
        self.view: EngineView  # set by ``bind``, before any other call
        self.gpu_waiting: dict[str, deque[Action]] = {}
        self.api_waiting: dict[str, deque[Action]] = {}

    def why_waiting(self, action: Action, now: float) -> Wait:
        """What the pools (or this action's partition of them) lack: no reasons of its own."""
        return pool_wait(self.view, action, now)

    def _bind_gpu(self) -> Iterator[Decision]:
        view = self.view
        pool = view.gpu
        models = list(view.cluster.models)
        if not models or not pool.capacity:
            return
        need = sum(m.gpus for m in models)
        if need > pool.capacity:
            raise InfeasiblePolicy(
                f"{self.name}: one instance of each of {len(models)} model services needs {need} GPUs, "
                f"the cluster has {pool.capacity}")
        count = {m.name: 0 for m in models}
        load = {m.name: view.profile.model_seconds.get(m.name, 1.0) * m.gpus for m in models}

        def place(m) -> tuple[int, ...] | None:
            for block in pool.blocks(m.gpus):
                if pool.idle(block) and all(pool.free_gb(g) >= m.per_gpu_gb() for g in block):
                    count[m.name] += 1
                    return block
            return None

        for m in sorted(models, key=lambda m: -m.gpus):
            block = place(m)
            if block is None:
                raise InfeasiblePolicy(f"{self.name}: no island has {m.gpus} free GPUs for model {m.name!r}")
            yield Reserve(f"gpu:{m.name}:0", GPU, block=block, model=m.name)
        candidates = list(models)
        while candidates:
            m = max(candidates, key=lambda m: (load[m.name] / (count[m.name] + 1), m.name))
            n = count[m.name]
            block = place(m)
            if block is None:
                candidates.remove(m)
                continue
            yield Reserve(f"gpu:{m.name}:{n}", GPU, block=block, model=m.name)

    def _schedule_gpu(self) -> Iterator[Decision]:
        pool = self.view.gpu
        for model, waiting in self.gpu_waiting.items():
            if not waiting:
                continue
            for inst in pool.instances.get(model, ()):
                if not waiting:
                    break
                if inst.busy is None and inst.reserved_by:
                    yield Start(waiting.popleft(), block=inst.gpus, reservation=inst.reserved_by)

    def on_cancel(self, action: Action) -> None:
        for waiting in (self.gpu_waiting.get(action.model or ""), self.api_waiting.get(action.pool)):
            if waiting is not None and action in waiting:
                waiting.remove(action)

    def next_wakeup(self, now: float) -> float | None:
        wake = None
        for pool, waiting in self.api_waiting.items():
            qp = self.view.quotas.get(pool)
            if waiting and qp is not None and qp.in_use < qp.quota.concurrency:
                t = qp.next_token_at(now)
                wake = t if wake is None else min(wake, t)
        return wake


def _shares(view: EngineView, pool: str) -> dict[str, float]:
    """Each job's fraction of the expected load on ``pool`` (from the profile)."""
    loads = {job: s for (job, p), s in view.profile.unit_seconds.items() if p == pool and s > 0}
    total = sum(loads.values())
    return {job: s / total for job, s in loads.items()} if total else {}


class TaskIsolatedPolicy(StaticPartitions):
    """Per-job CPU partitions; inside one, actions of trajectories whose sandbox already lives on
    a node (``cpu_waiting``) go before trajectories that still need a sandbox (``cpu_new``). The
    latter wait first come, first served for a slot — memory for their session — like the
    semaphore a framework puts in front of a fixed sandbox fleet. (One queue with a bounded
    lookahead deadlocks when more trajectories than slots are queued ahead of the ones holding
    the slots.)"""

    name = "task-isolated"

    def __init__(self) -> None:
        super().__init__()
        self.cpu_parts: dict[str, list[str]] = {}
        self.cpu_waiting: dict[str, deque[Action]] = {}
        self.cpu_new: dict[str, deque[Action]] = {}
        self.api_caps: dict[tuple[str, str], int] = {}
        self.api_in_use: dict[tuple[str, str], int] = {}

    def bind(self, view: EngineView, now: float) -> Iterator[Decision]:
        self.view = view
        yield from self._bind_gpu()
        yield from self._bind_cpu()
        for pool in view.quotas:
            for job, share in _shares(view, pool).items():
                self.api_caps[(pool, job)] = max(1, int(view.quotas[pool].quota.concurrency * share))

    def _bind_cpu(self) -> Iterator[Decision]:
        pool = self.view.cpu
        if not pool.capacity:
            return
        shares = _shares(self.view, CPU)
        if len(shares) <= 1:
            shares = {"*": 1.0}
        jobs = sorted(shares)
        if len(jobs) > pool.capacity:
            raise InfeasiblePolicy(f"{self.name}: {len(jobs)} jobs cannot split {pool.capacity} cores")
        targets = {j: max(1, round(pool.capacity * shares[j])) for j in jobs}
        while sum(targets.values()) > pool.capacity:
            biggest = max(targets, key=targets.__getitem__)
            targets[biggest] -= 1
        node = 0
        for j in jobs:
            left = targets[j]
            self.cpu_parts[j] = []
            while left > 0 and node < len(pool.nodes):
                take = min(left, pool.nfree(node))
                if take:
                    key = f"cpu:{j}:{node}"
                    yield Reserve(key, CPU, node=node, count=take)
                    self.cpu_parts[j].append(key)
                    left -= take
                if pool.nfree(node) == 0:
                    node += 1

    def _part(self, job: str) -> str:
        return job if job in self.cpu_parts else "*" if "*" in self.cpu_parts else max(
            self.cpu_parts, key=lambda j: len(self.cpu_parts[j]))

    def on_submit(self, action: Action, now: float) -> None:
        if action.pool == CPU:
            # a trajectory's actions are sequential, so whether it has a sandbox cannot change while it waits
            new = action.trajectory is not None and action.trajectory not in self.view.cpu.homes
            (self.cpu_new if new else self.cpu_waiting).setdefault(self._part(action.job), deque()).append(action)
        elif action.pool == GPU:
            self.gpu_waiting.setdefault(action.model or "", deque()).append(action)
        else:
            self.api_waiting.setdefault(action.pool, deque()).append(action)

    def on_cancel(self, action: Action) -> None:
        super().on_cancel(action)
        if action.pool == CPU:
            for queues in (self.cpu_waiting, self.cpu_new):
                waiting = queues.get(self._part(action.job))
                if waiting is not None and action in waiting:
                    waiting.remove(action)

    def on_finish(self, finished: Finished) -> None:
        a = finished.action
        if a.pool not in (CPU, GPU) and finished.started_at is not None:
            key = (a.pool, a.job)
            self.api_in_use[key] = self.api_in_use.get(key, 0) - 1

    def on_trajectory_end(self, job: str, step: int | None, trajectory: str) -> None:
        pass

    def schedule(self, now: float) -> Iterator[Decision]:
        view = self.view
        for part, waiting in self.cpu_waiting.items():
            skipped = 0
            i = 0
            while i < len(waiting) and skipped < 16:
                a = waiting[i]
                res = self._cpu_reservation(part, a)
                if res is None:
                    skipped += 1
                    i += 1
                    continue
                del waiting[i]
                yield Start(a, node=res.node, count=a.demand.ranges[CPU][0], reservation=res.key)
        for part, new in self.cpu_new.items():
            while new:  # the semaphore: the longest-waiting trajectory takes the next free slot
                res = self._cpu_reservation(part, new[0])
                if res is None:
                    break
                a = new.popleft()
                yield Start(a, node=res.node, count=a.demand.ranges[CPU][0], reservation=res.key)
        yield from self._schedule_gpu()
        for pool, waiting in self.api_waiting.items():
            qp = view.quotas[pool]
            i = 0
            while i < len(waiting) and qp.available(now):
                a = waiting[i]
                key = (pool, a.job)
                cap = self.api_caps.get(key, qp.quota.concurrency)
                if self.api_in_use.get(key, 0) >= cap:
                    i += 1
                    continue
                del waiting[i]
                self.api_in_use[key] = self.api_in_use.get(key, 0) + 1
                yield Start(a)

    def _cpu_reservation(self, part: str, a: Action):
        view = self.view
        lo = a.demand.ranges[CPU][0]
        home = view.cpu.homes.get(a.trajectory) if a.trajectory else None
        best = None
        for key in self.cpu_parts[part]:
            res = view.reservations[key]
            if len(res.free) < lo:
                continue
            if home is not None:
                if res.node == home:
                    return res
                continue
            if a.trajectory and view.cpu.free_mem[res.node] < view.costs.session_mem_gb:
                continue
            if best is None or len(res.free) > len(best.free):
                best = res
        return best


class TrajectoryStaticPolicy(StaticPartitions):
    name = "trajectory-static"

    def __init__(self, max_sandbox_cores: int = 8) -> None:
        super().__init__()
        self.max_sandbox_cores = max_sandbox_cores
        self.k = 1
        self.ready: list[Action] = []
        self.waiting: deque[Action] = deque()
        self.to_release: list[str] = []
        self.unmanaged: list[Action] = []

    def bind(self, view: EngineView, now: float) -> Iterator[Decision]:
        self.view = view
        concurrent = max(1, view.profile.trajectories)
        self.k = max(1, min(self.max_sandbox_cores, view.cpu.capacity // concurrent)) if view.cpu.capacity else 1
        yield from self._bind_gpu()

    @staticmethod
    def _key(a: Action) -> str:
        return f"sandbox:{a.trajectory}" if a.trajectory else f"sandbox:action:{a.id}"

    def on_submit(self, action: Action, now: float) -> None:
        if action.pool == CPU:
            key = self._key(action)
            if key in self.to_release:  # the trajectory came back before its sandbox was released
                self.to_release.remove(key)
            (self.ready if key in self.view.reservations else self.waiting).append(action)
        elif action.pool == GPU:
            self.gpu_waiting.setdefault(action.model or "", deque()).append(action)
        else:
            self.unmanaged.append(action)

    def on_cancel(self, action: Action) -> None:
        super().on_cancel(action)
        for lst in (self.ready, self.waiting, self.unmanaged):
            if action in lst:
                lst.remove(action)

    def on_finish(self, finished: Finished) -> None:
        a = finished.action
        if a.pool == CPU and a.trajectory is None:
            self.to_release.append(self._key(a))

    def on_trajectory_end(self, job: str, step: int | None, trajectory: str) -> None:
        key = f"sandbox:{trajectory}"
        if key in self.view.reservations and key not in self.to_release:
            self.to_release.append(key)

    def schedule(self, now: float) -> Iterator[Decision]:
        view = self.view
        busy = []
        for key in self.to_release:
            res = view.reservations.get(key)
            if res is None:
                continue
            if len(res.free) < len(res.units):  # an action still runs: release once it is done
                busy.append(key)
            else:
                yield Release(key)
        self.to_release = busy
        ready, self.ready = self.ready, []
        for a in ready:  # a trajectory's actions share its sandbox: one waits while another runs
            res = view.reservations.get(self._key(a))
            if res is None:  # the trajectory ended with this action still queued
                self.waiting.append(a)
            elif res.free and not self._needs_memory(a, res.node):
                yield self._start(a)
            else:
                self.ready.append(a)
        while self.waiting:
            a = self.waiting[0]
            if self._key(a) in view.reservations:  # its sandbox was granted meanwhile
                self.waiting.popleft()
                self.ready.append(a)
                continue
            node = view.cpu.best_node(self.k, view.costs.session_mem_gb if a.trajectory else 0.0)
            if node is None:
                break
            self.waiting.popleft()
            yield Reserve(self._key(a), CPU, node=node, count=self.k)
            yield self._start(a)
        yield from self._schedule_gpu()
        for a in self.unmanaged:
            yield Start(a, unmanaged=True)
        self.unmanaged.clear()

    def _needs_memory(self, a: Action, node: int) -> bool:
        """A trajectory back after its end, its sandbox not released yet (an action of it still
        ran): its session's memory went back at the end and may be another's now, and the start
        takes it again (the engine attaches a session whose home is not the start's node): it
        waits until the node has it."""
        view = self.view
        return (a.trajectory is not None and view.cpu.homes.get(a.trajectory) != node
                and view.cpu.free_mem[node] < view.costs.session_mem_gb)

    def _start(self, a: Action) -> Start:
        res = self.view.reservations[self._key(a)]
        return Start(a, node=res.node, count=min(len(res.free), a.demand.ranges[CPU][1]), reservation=res.key)
