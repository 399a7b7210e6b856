"""Pool state: which units are free, which sessions live where, which models are GPU-resident.

The engine is the only writer, and only through each pool's ledger methods (``admit`` /
``release`` and their reservation twins), which check capacity and keep the pool's ``Meter`` (units
held and running, and the integral of units held over time) in step; policies only read. A policy
bug surfaces as ``CapacityError`` instead of an oversubscribed pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterable, Sequence

from .cluster import ApiQuota, CpuNode, GpuNode
from .errors import CapacityError

__all__ = ["EPS", "CapacityError", "CpuPool", "GpuPool", "Gpu", "Instance", "Meter", "QuotaPool", "Units"]


#: slack for float comparisons of memory and quota tokens (GB, tokens)
EPS: Final = 1e-9

#: units a meter counts: whole cores (int) or GPU compute shares (float)
Units = int | float


class Meter:
    """Units of one pool held (allocated to an action or reserved) and running, and the integral
    of held units over time (unit-seconds), advanced by the engine's clock. Cores count whole
    units (ints); GPUs count compute shares (floats): the type says both, so that a compiled
    build (``setup.py``) keeps an int an int."""

    __slots__ = ("held", "running", "held_s")

    def __init__(self) -> None:
        self.held: Units = 0
        self.running: Units = 0
        self.held_s = 0.0

    def change(self, held: Units, running: Units) -> None:
        self.held += held
        self.running += running


class CpuPool:
    """Cores and memory of CPU nodes, with an O(max cores) lookup of the emptiest node.

    ``homes`` maps a session (trajectory) to the node holding its sandbox state; the session's
    memory stays reserved there between actions while its cores go back to the pool. A session in
    ``pinned`` stays home: its state cannot be carried to another node (the runtime found so), so
    the policy never moves it for balance; a drain or a lost node still moves it.

    ``images`` is, per node, the names of the images it holds (``hold_images``: what the node
    reports of its image store and pulls); ``image_names`` reads the names an action's image may
    be held by, so that work naming an image can go to a node holding it (no pull there).
    """

    def __init__(self, nodes: tuple[CpuNode, ...]) -> None:
        self.nodes = nodes
        self.alive = [True] * len(nodes)
        self.capacity = sum(n.cores for n in nodes)
        self.max_cores = max((n.cores for n in nodes), default=0)
        self.free_cores: list[list[int]] = [list(range(n.cores - 1, -1, -1)) for n in nodes]
        self.free_mem: list[float] = [n.memory_gb for n in nodes]
        self.buckets: list[set[int]] = [set() for _ in range(self.max_cores + 1)]
        for i, n in enumerate(nodes):
            self.buckets[n.cores].add(i)
        self.total_free = self.capacity
        self.top = self.max_cores  # no node has more free cores than this (lowered lazily by best_node)
        self.homes: dict[str, int] = {}
        self.session_mem: dict[str, float] = {}
        self.session_used: dict[str, float] = {}  # measured when each session last went idle
        self.draining: set[int] = set()  # out of placement, its sessions still homed there until moved
        self.pinned: set[str] = set()  # sessions that stay home (``pin``)
        self.images: list[frozenset[str]] = [frozenset() for _ in nodes]
        self.image_nodes: dict[str, set[int]] = {}  # image name -> the nodes holding it (``hold_images``)
        self.image_names: Callable[[Any], Sequence[str]] = named_image
        self.meter = Meter()

    def nfree(self, node: int) -> int:
        return len(self.free_cores[node])

    def best_node(self, need: int, mem_gb: float = 0.0) -> int | None:
        """The node with the most free cores that has at least ``need`` of them and ``mem_gb``
        memory to spare (spreading leaves room for elastic growth), or None."""
        buckets = self.buckets
        while self.top > 0 and not buckets[self.top]:
            self.top -= 1
        for k in range(self.top, need - 1, -1):
            b = buckets[k]
            if b:
                if mem_gb <= 0:
                    return next(iter(b))
                for node in b:
                    if self.free_mem[node] >= mem_gb:
                        return node
        return None

    def best_holder(self, need: int, holders: Iterable[int], mem_gb: float = 0.0) -> int | None:
        """Of the nodes ``holders``, the one with the most free cores that has at least ``need``
        of them and ``mem_gb`` memory to spare (the lowest index on a tie), or None."""
        best = None
        most = need - 1
        for node in holders:
            n = len(self.free_cores[node])
            if (n > most or (n == most and best is not None and node < best)) and self.alive[node] \
                    and (mem_gb <= 0 or self.free_mem[node] >= mem_gb):
                best, most = node, n
        return best

    def take(self, node: int, n: int) -> tuple[int, ...]:
        free = self.free_cores[node]
        have = len(free)
        if n > have or n < 0:
            raise CapacityError(f"node {node} has {have} free cores, {n} asked")
        self.buckets[have].discard(node)
        self.buckets[have - n].add(node)
        self.total_free -= n
        taken = tuple(free[have - n:])
        del free[have - n:]
        return taken

    def give(self, node: int, cores: tuple[int, ...]) -> None:
        if not self.alive[node]:
            return  # the node has left: its cores left the pool with it
        free = self.free_cores[node]
        have = len(free)
        if have + len(cores) > self.nodes[node].cores:
            raise CapacityError(f"node {node} would have more free cores than it owns")
        self.buckets[have].discard(node)
        self.buckets[have + len(cores)].add(node)
        self.total_free += len(cores)
        free.extend(cores)
        if have + len(cores) > self.top:
            self.top = have + len(cores)

    # -- membership: nodes join and leave while the engine runs --------------------------------
    def add_node(self, node: CpuNode) -> int:
        """A node joins with all its cores free; returns its index (indices are never reused)."""
        i = len(self.nodes)
        self.nodes = (*self.nodes, node)
        self.alive.append(True)
        self.free_cores.append(list(range(node.cores - 1, -1, -1)))
        self.free_mem.append(node.memory_gb)
        self.images.append(frozenset())
        if node.cores > self.max_cores:
            self.buckets.extend(set() for _ in range(node.cores - self.max_cores))
            self.max_cores = node.cores
        self.buckets[node.cores].add(i)
        self.top = max(self.top, node.cores)
        self.capacity += node.cores
        self.total_free += node.cores
        return i

    def drain(self, node: int) -> None:
        """The node takes no new work: like ``remove_node``, its free cores and memory leave
        placement now and cores released there later are not handed out again, but its sessions
        keep their home until each is moved (``attach`` elsewhere) or the node leaves."""
        if not self.alive[node]:
            return
        self._leave(node)
        self.draining.add(node)

    def _leave(self, node: int) -> None:
        self.alive[node] = False
        free = self.free_cores[node]
        self.buckets[len(free)].discard(node)
        self.total_free -= len(free)
        self.capacity -= self.nodes[node].cores
        free.clear()
        self.free_mem[node] = 0.0
        self.max_cores = max((n.cores for n, up in zip(self.nodes, self.alive) if up), default=0)
        self.hold_images(node, ())

    def remove_node(self, node: int) -> list[str]:
        """A node leaves (drained or dead): its free cores leave the pool at once, cores still
        held there are dropped when released, and its sessions lose their home. Returns those
        sessions."""
        if node in self.draining:  # out of placement already; what it still homes is lost now
            self.draining.discard(node)
        elif not self.alive[node]:
            return []
        else:
            self._leave(node)
        lost = [s for s, home in self.homes.items() if home == node]
        for s in lost:
            del self.homes[s]
            self.session_mem.pop(s, None)
            self.session_used.pop(s, None)
            self.pinned.discard(s)
        return lost

    # -- what the runtime knows of sessions and nodes --------------------------------------------
    def pin(self, session: str) -> None:
        """``session`` stays on its home node from now on: its state cannot be carried to another
        (a move for balance would lose it), so no step of it is moved for balance; a drain or a
        lost node still moves it. Until the session ends (``detach``) or ``unpin``."""
        if not isinstance(session, str) or not session:
            raise ValueError(f"pin: session must be a non-empty string, got {session!r}")
        self.pinned.add(session)

    def unpin(self, session: str) -> None:
        """``session`` may be moved for balance again (its state can be carried now)."""
        self.pinned.discard(session)

    def hold_images(self, node: int, names: Iterable[str]) -> None:
        """Node ``node`` holds the images ``names`` now (its store's and those it is pulling; the
        whole set, replacing what it held before). A node out of placement (drained, gone) holds
        none."""
        if not 0 <= node < len(self.nodes):
            raise ValueError(f"hold_images: node {node} is not a node of this pool ({len(self.nodes)} nodes)")
        if isinstance(names, str):
            raise ValueError(f"hold_images: names must be a collection of image names, got the string {names!r}")
        given: list[Any] = list(names)  # untyped: compiled, a name of another type is checked here, not cast
        for name in given:
            if not isinstance(name, str) or not name:
                raise ValueError(f"hold_images: image names must be non-empty strings, got {name!r}")
        held: frozenset[str] = frozenset(given) if self.alive[node] else frozenset()
        old = self.images[node]
        if held == old:
            return
        index = self.image_nodes
        for name in old - held:
            on = index.get(name)
            if on is not None:
                on.discard(node)
                if not on:
                    del index[name]
        for name in held - old:
            index.setdefault(name, set()).add(node)
        self.images[node] = held

    def image_holders(self, action: Any) -> set[int] | None:
        """The nodes holding the image ``action`` names (by any of its names, ``image_names``);
        None when it names none or no node holds it."""
        index = self.image_nodes
        if not index:
            return None
        found: set[int] | None = None
        for name in self.image_names(action):
            on = index.get(name)
            if on:
                found = set(on) if found is None else found | on
        return found

    # -- the ledger: every change of what is held goes through these ----------------------------
    # ``admit`` and ``release`` are the engine's hot path (once per action each): they repeat the
    # bodies of ``take``/``give`` and ``Meter.change`` instead of calling them (two calls fewer an
    # action; within the noise alone), with the same checks. One core is popped, not sliced: with
    # the CPU round keeping only elastic admissions, 1.04x in ``bench scheduler``.

    def admit(self, node: int, count: int) -> tuple[int, ...]:
        """``count`` free cores of ``node`` for an action (or more cores for a running one)."""
        free = self.free_cores[node]
        have = len(free)
        if count > have or count < 0:
            raise CapacityError(f"node {node} has {have} free cores, {count} asked")
        buckets = self.buckets
        buckets[have].discard(node)
        buckets[have - count].add(node)
        self.total_free -= count
        cores: tuple[int, ...]
        if count == 1:  # most actions: a pop is cheaper than a slice copied and deleted
            cores = (free.pop(),)
        else:
            cores = tuple(free[have - count:])
            del free[have - count:]
        m = self.meter
        m.held += count
        m.running += count
        return cores

    def release(self, node: int, cores: tuple[int, ...]) -> None:
        n = len(cores)
        if self.alive[node]:  # else the node has left: its cores left the pool with it
            free = self.free_cores[node]
            have = len(free)
            if have + n > self.nodes[node].cores:
                raise CapacityError(f"node {node} would have more free cores than it owns")
            buckets = self.buckets
            buckets[have].discard(node)
            buckets[have + n].add(node)
            self.total_free += n
            free.extend(cores)
            if have + n > self.top:
                self.top = have + n
        m = self.meter
        m.held -= n
        m.running -= n

    def reserve(self, node: int, count: int) -> tuple[int, ...]:
        """Cores set aside for one owner: held, not running."""
        cores = self.take(node, count)
        self.meter.change(count, 0)
        return cores

    def unreserve(self, node: int, cores: tuple[int, ...]) -> None:
        self.give(node, cores)
        self.meter.change(-len(cores), 0)

    def admit_reserved(self, reservation, count: int) -> tuple[int, ...]:
        """``count`` cores of a reservation for one of its owner's actions (already held)."""
        cores = reservation.draw(count)
        self.meter.change(0, count)
        return cores

    def release_reserved(self, reservation, cores: tuple[int, ...]) -> None:
        reservation.put_back(cores)
        self.meter.change(0, -len(cores))

    def attach(self, session: str, node: int, mem_gb: float) -> None:
        """Make ``node`` the home of ``session`` (moving its reserved memory there; a pinned
        session stays pinned: it is re-homed, not ended)."""
        self._unhome(session)
        if self.free_mem[node] < mem_gb - EPS:
            raise CapacityError(f"node {node} has {self.free_mem[node]:.1f} GB free, session needs {mem_gb:.1f}")
        self.free_mem[node] -= mem_gb
        self.homes[session] = node
        self.session_mem[session] = mem_gb

    def detach(self, session: str) -> None:
        """``session`` ends (or is placed afresh): its home, memory and pin go."""
        self._unhome(session)
        self.pinned.discard(session)

    def _unhome(self, session: str) -> None:
        node = self.homes.pop(session, None)
        if node is not None:
            mem = self.session_mem.pop(session, 0.0)
            if self.alive[node]:
                self.free_mem[node] += mem
        self.session_used.pop(session, None)

    # -- session memory by use ------------------------------------------------------------------
    # A session's reservation is the running action's estimate while it runs and, once it goes
    # idle, what it was measured to use plus headroom (requests vs limits: the hard limit stays
    # its cgroup's). Reserving the whole limit for an idle session admits only ~47 sessions on 24 GB.

    def grow_session(self, session: str, mem_gb: float) -> None:
        """Raise ``session``'s reservation towards ``mem_gb`` (an action of it starts), as far as
        its node has memory free: never more than free, never raises (its cgroup limit is the
        hard bound; this keeps new sessions out of memory a running step may use)."""
        node = self.homes.get(session)
        if node is None:
            return
        have = self.session_mem.get(session, 0.0)
        extra = min(mem_gb - have, max(0.0, self.free_mem[node]))
        if extra > EPS:
            self.free_mem[node] -= extra
            self.session_mem[session] = have + extra

    def settle_session(self, session: str, used_gb: float, headroom_gb: float) -> None:
        """``session`` went idle using ``used_gb`` (measured): reserve that plus ``headroom_gb``.
        What is measured is in use whether or not it fits, so this never raises: a node's free
        memory may go negative, and then no new session is placed there."""
        node = self.homes.get(session)
        if node is None:
            return
        want = used_gb + headroom_gb
        self.free_mem[node] -= want - self.session_mem.get(session, 0.0)
        self.session_mem[session] = want
        self.session_used[session] = used_gb

    def session_reserved_gb(self) -> float:
        return sum(self.session_mem.values())

    def session_used_gb(self) -> float:
        """Memory idle sessions were measured to use (sessions never measured count 0)."""
        return sum(self.session_used.values())


def named_image(action: Any) -> Sequence[str]:
    """The image an action names, by the name it gives (a payload's ``image``: the sandbox specs
    that start one); none for any other. A runtime whose stores know an image by other names as
    well (a registry reference's full form) sets ``CpuPool.image_names`` to give them all."""
    image = getattr(action.payload, "image", None)
    return (image,) if isinstance(image, str) and image else ()


@dataclass(slots=True, eq=False)
class Instance:
    """A model's weights resident on a block of GPUs; ``busy`` names the action using it."""

    model: str
    gpus: tuple[int, ...]
    per_gpu_gb: float
    busy: str | None = None
    last_used: float = 0.0
    uses: int = 0
    reserved_by: str = ""


@dataclass(slots=True, eq=False)
class Gpu:
    """One GPU: memory is held per resident copy; compute is shared by the actions (and loads) in
    ``occupants`` (id -> compute share), whose shares sum to at most 1."""

    node: int
    island: int
    memory_gb: float
    used_gb: float = 0.0
    reserved_by: str = ""
    instances: list[Instance] = field(default_factory=list)
    occupants: dict[str, float] = field(default_factory=dict)
    share_used: float = 0.0
    alive: bool = True  # False once its node has left the pool (``GpuPool.remove_node``)

    @property
    def busy(self) -> str | None:
        """An action running here (the first of several sharing it), or None when idle."""
        return next(iter(self.occupants), None)

    @property
    def spare(self) -> float:
        return 1.0 - self.share_used


class GpuPool:
    """GPUs grouped into islands, their memory and the model instances resident on them."""

    def __init__(self, nodes: tuple[GpuNode, ...]) -> None:
        self.nodes: tuple[GpuNode, ...] = ()
        self.alive: list[bool] = []
        self.first_gpu: list[int] = []  # per node: its GPUs are first_gpu .. first_gpu + gpus - 1
        self.gpus: list[Gpu] = []
        self.islands: list[tuple[int, ...]] = []
        self.h2d_gbps: list[float] = []
        self.capacity = 0
        self.total_free = 0  # GPUs running nothing
        self.spare_gpus = 0  # GPUs with compute to spare (idle or partly shared)
        self.instances: dict[str, list[Instance]] = {}
        self.max_island = 0
        self.meter = Meter()
        for node in nodes:
            self.add_node(node)

    # -- membership: GPU nodes join and leave while the engine runs ------------------------------
    def add_node(self, node: GpuNode) -> int:
        """A node's GPUs join, idle and empty, with global ids after every GPU seen before (ids
        and island numbers are never reused); returns the node's index."""
        ni = len(self.nodes)
        base = len(self.gpus)
        mine: list[Gpu | None] = [None] * node.gpus
        islands: list[tuple[int, ...]] = []
        for local in node.islands():
            island = len(self.islands) + len(islands)
            islands.append(tuple(base + g for g in local))
            for g in local:  # islands need not be contiguous ranges (discovered NVLink domains)
                mine[g] = Gpu(ni, island, node.gpu_memory_gb)
        gpus: list[Gpu] = []
        for g, gpu in enumerate(mine):
            if gpu is None:
                raise ValueError(f"GPU node {node.name}: GPU {g} is in no island")
            gpus.append(gpu)
        self.nodes = (*self.nodes, node)
        self.alive.append(True)
        self.first_gpu.append(base)
        self.islands.extend(islands)
        self.gpus.extend(gpus)
        self.h2d_gbps.extend([node.h2d_gbps] * node.gpus)
        self.capacity += node.gpus
        self.total_free += node.gpus
        self.spare_gpus += node.gpus
        self.max_island = max([self.max_island, *(len(i) for i in islands)])
        return ni

    def remove_node(self, node: int) -> list[Instance]:
        """A node leaves (dead or drained): its GPUs leave the pool at once and are never chosen
        again (its islands become empty, so ``blocks`` skips them), and every copy resident there
        is forgotten. Copies still running an action stay with that action until the engine
        releases them; that release changes no free count (``vacate``). Returns the copies."""
        if not self.alive[node]:
            return []
        self.alive[node] = False
        first = self.first_gpu[node]
        ids = range(first, first + self.nodes[node].gpus)
        gone: list[Instance] = []
        for g in ids:
            gpu = self.gpus[g]
            gpu.alive = False
            if not gpu.occupants:
                self.total_free -= 1
            if gpu.share_used < 1.0 - EPS:
                self.spare_gpus -= 1
            for inst in gpu.instances:
                if inst not in gone:
                    gone.append(inst)
            gpu.instances = []
            gpu.used_gb = 0.0
            if self.islands[gpu.island]:
                self.islands[gpu.island] = ()
        for inst in gone:
            copies = self.instances.get(inst.model)
            if copies is not None and inst in copies:
                copies.remove(inst)
        self.capacity -= len(ids)
        self.max_island = max((len(i) for i in self.islands), default=0)
        return gone

    def blocks(self, size: int):
        """Buddy-aligned blocks of ``size`` GPUs inside one island (size need not be a power of
        two, blocks are aligned to multiples of it)."""
        for island in self.islands:
            for start in range(0, len(island) - size + 1, size):
                yield island[start:start + size]

    def idle(self, block: tuple[int, ...], owner: str = "") -> bool:
        gpus = self.gpus
        return all(not gpus[g].occupants and gpus[g].reserved_by == owner for g in block)

    def fits(self, block: tuple[int, ...], share: float, owner: str = "") -> bool:
        """Every GPU of ``block`` has ``share`` of its compute to spare (``share`` 1: idle)."""
        gpus = self.gpus
        return all(gpus[g].reserved_by == owner and gpus[g].share_used + share <= 1.0 + EPS for g in block)

    def idle_instance(self, model: str, owner: str = "", share: float = 1.0) -> Instance | None:
        """A resident instance of ``model`` running nothing whose GPUs have ``share`` of their
        compute to spare (other models resident there may be running), least recently used first."""
        best = None
        gpus = self.gpus
        for inst in self.instances.get(model, ()):
            if (inst.busy is None and inst.reserved_by == owner and (best is None or inst.last_used < best.last_used)
                    and all(gpus[g].share_used + share <= 1.0 + EPS for g in inst.gpus)):
                best = inst
        return best

    def instance_on(self, model: str, block: tuple[int, ...]) -> Instance | None:
        for inst in self.instances.get(model, ()):
            if inst.gpus == block:
                return inst
        return None

    def free_gb(self, g: int) -> float:
        gpu = self.gpus[g]
        return gpu.memory_gb - gpu.used_gb

    def add_instance(self, model: str, block: tuple[int, ...], per_gpu_gb: float, owner: str = "") -> Instance:
        for g in block:
            if self.free_gb(g) < per_gpu_gb - EPS:
                raise CapacityError(f"GPU {g} has {self.free_gb(g):.1f} GB free, {model} needs {per_gpu_gb:.1f}")
        inst = Instance(model, block, per_gpu_gb, reserved_by=owner)
        for g in block:
            gpu = self.gpus[g]
            gpu.used_gb += per_gpu_gb
            gpu.instances.append(inst)
        self.instances.setdefault(model, []).append(inst)
        return inst

    def evict(self, inst: Instance) -> None:
        if inst.busy is not None:
            raise CapacityError(f"cannot evict {inst.model} on {inst.gpus}: in use by {inst.busy}")
        for g in inst.gpus:
            gpu = self.gpus[g]
            gpu.used_gb -= inst.per_gpu_gb
            gpu.instances.remove(inst)
        self.instances[inst.model].remove(inst)

    def occupy(self, block: tuple[int, ...], owner: str, share: float = 1.0) -> None:
        """Run ``owner`` on ``block`` with ``share`` of each GPU's compute (0 < share <= 1)."""
        if not 0.0 < share <= 1.0:
            raise CapacityError(f"compute share {share} of {owner} is not in (0, 1]")
        for g in block:
            gpu = self.gpus[g]
            if gpu.share_used + share > 1.0 + EPS:
                raise CapacityError(f"GPU {g} is busy with {', '.join(gpu.occupants)}: "
                                    f"{gpu.spare:.2f} of its compute is spare, {owner} needs {share:.2f}")
            if owner in gpu.occupants:
                raise CapacityError(f"{owner} already runs on GPU {g}")
        for g in block:
            gpu = self.gpus[g]
            if not gpu.occupants:
                self.total_free -= 1
            gpu.occupants[owner] = share
            gpu.share_used += share
            if gpu.share_used >= 1.0 - EPS:
                self.spare_gpus -= 1

    def vacate(self, block: tuple[int, ...], owner: str) -> float:
        """``owner`` stops running on ``block``; returns the compute share it had."""
        share = 0.0
        for g in block:
            gpu = self.gpus[g]
            share = gpu.occupants.pop(owner)
            was_full = gpu.share_used >= 1.0 - EPS
            gpu.share_used = gpu.share_used - share if gpu.occupants else 0.0  # no float drift when idle
            if not gpu.alive:
                continue  # its node has left: the GPU left the free counts with it
            if not gpu.occupants:
                self.total_free += 1
            if was_full and gpu.share_used < 1.0 - EPS:
                self.spare_gpus += 1
        return share

    # -- the ledger ------------------------------------------------------------------------------
    def admit(self, inst: Instance, owner: str, *, reserved: bool = False, share: float = 1.0) -> None:
        """Run ``owner`` (an action, or a prefetch's key) on the copy ``inst`` with ``share`` of
        each of its GPUs' compute (a copy runs one batch at a time; other copies on the same GPUs
        may run beside it while the shares add up to at most 1). Held units count the share,
        unless a reservation holds the GPUs already."""
        if inst.busy is not None:
            raise CapacityError(f"the copy of {inst.model} on {inst.gpus} already runs {inst.busy}")
        self.occupy(inst.gpus, owner, share)
        inst.busy = owner
        n = len(inst.gpus) * share
        self.meter.change(0 if reserved else n, n)

    def release(self, inst: Instance, now: float, *, reserved: bool = False) -> None:
        """``inst``'s user is done: the copy stays resident, idle since ``now``."""
        if inst.busy is None:
            raise CapacityError(f"the copy of {inst.model} on {inst.gpus} runs nothing to release")
        share = self.vacate(inst.gpus, inst.busy)
        inst.busy = None
        inst.last_used = now
        n = len(inst.gpus) * share
        self.meter.change(0 if reserved else -n, -n)

    def reserve(self, block: tuple[int, ...], key: str) -> None:
        if not self.idle(block):
            raise CapacityError(f"GPUs {block} are not free to reserve")
        for g in block:
            self.gpus[g].reserved_by = key
        self.meter.change(len(block), 0)

    def unreserve(self, block: tuple[int, ...], key: str) -> None:
        for g in block:
            for inst in self.gpus[g].instances:
                if inst.reserved_by == key:
                    inst.reserved_by = ""
            self.gpus[g].reserved_by = ""
        self.meter.change(-len(block), 0)

    def load_s(self, block: tuple[int, ...], per_gpu_gb: float) -> float:
        """Copying weights host->GPU happens on every GPU of the block in parallel."""
        return max(per_gpu_gb / self.h2d_gbps[g] for g in block)


class QuotaPool:
    """An API's token bucket and concurrency slots.

    Reading (``available``, ``next_token_at``) never changes the bucket: the tokens at ``now`` are
    computed from the last change; only ``admit`` refills and spends. (The first release refilled
    on every read, so a policy's look changed the state it looked at.)
    """

    __slots__ = ("quota", "tokens", "t_last", "in_use")

    def __init__(self, quota: ApiQuota, now: float = 0.0) -> None:
        self.quota = quota
        self.tokens = quota.bucket
        self.t_last = now
        self.in_use = 0

    def tokens_at(self, now: float) -> float:
        if now <= self.t_last:
            return self.tokens
        return min(self.quota.bucket, self.tokens + (now - self.t_last) * self.quota.rate_per_s)

    def available(self, now: float) -> bool:
        return self.in_use < self.quota.concurrency and self.tokens_at(now) >= 1.0 - EPS

    def next_token_at(self, now: float) -> float:
        tokens = self.tokens_at(now)
        if tokens >= 1.0 - EPS:
            return now
        return now + (1.0 - tokens) / self.quota.rate_per_s

    def admit(self, now: float) -> None:
        """One call starts: a token spent, a concurrency slot taken."""
        if not self.available(now):
            raise CapacityError(f"quota {self.quota.name} exhausted")
        self.tokens = self.tokens_at(now) - 1.0
        self.t_last = max(self.t_last, now)
        self.in_use += 1

    def release(self) -> None:
        if self.in_use <= 0:
            raise CapacityError(f"quota {self.quota.name}: released more calls than were admitted")
        self.in_use -= 1
