"""The model manager: carries out the engine's GPU decisions with real torch models.

Each service's weights are loaded once into host RAM (page-locked in place when CUDA is present):
from a loader's module, or from a Hugging Face directory (``hf``). The engine decides where copies
live, which to evict and how much of a GPU's compute each batch gets; this manager makes it so:

* a load copies the host tensors onto the copy's GPUs (a skeleton on the meta device takes them
  with ``assign``, so no second host copy is made; every parameter and buffer, persistent or not).
  A copy placed on k GPUs has its layers split over them (``placement``) and each GPU's part
  crosses that GPU's own host link, all k at once, while the module is built around them;
* a new copy is warmed before it takes a call, and captures CUDA graphs where they pay
  (``_warm``, ``graphs``);
* a batch runs on a stream taken from its GPU's pool (``devices``), so batches of services that
  share a GPU (their compute shares add up to at most 1) overlap on it instead of queueing behind
  one another; the thread that runs a batch waits on that stream only, never on the whole device;
* an eviction drops the device copy; its memory goes back to the driver once no load has run for
  a while (``HAND_BACK``), so a load right after an eviction reuses the evicted copy's blocks.

A loader or a batch that fails (an exception, a GPU out of memory) fails that service's actions
with a message and leaves the others serving; a Hugging Face directory that cannot be read stops
the start (``ModelDirError``). With no CUDA the same code runs on CPU "devices" whose memory is
only the engine's model. docs/models.md has the measurements behind these choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...core.action import Action, Allocation, Outcome
from ...core.cluster import ModelSpec
from ...core.records import Load
from ...core.seam import Completion, Loaded, Sink
from ..tasks import TaskSet
from .devices import Device, batch_on
from . import decode, packing
from .graphs import GRAPH_JUDGE, MIN_GAIN, Graphs
from .packing import Layout
from .placement import place
from .spec import ModelCall, ModelCard, ModelDirError, ModelServiceConfig, call_problem

log = logging.getLogger(__name__)


@dataclass
class HostModel:
    """A service's weights in host memory and the skeleton its device copies are made from.

    ``host_state`` holds every parameter (once, under its first name: tied weights share one
    tensor) and every buffer, persistent or not: a non-persistent buffer (a Llama's rotary
    ``inv_freq``) is in no ``state_dict``, and left on the meta skeleton it fails the first call
    with "Cannot copy out of meta tensor". ``aliases`` maps each further name of a tied parameter
    to its first; ``persistent`` names what ``load_state_dict`` takes (the rest is assigned)."""

    spec: ModelServiceConfig
    ops: dict[str, Callable]
    host_state: dict[str, torch.Tensor]
    skeleton: torch.nn.Module
    weights_gb: float
    vocab: int | None
    max_len: int | None = None  # the model's positions (longer sequences are refused)
    aliases: dict[str, str] = field(default_factory=dict)
    persistent: frozenset[str] = frozenset()
    pinned: list[int] = field(default_factory=list)  # host pointers registered with CUDA
    layout: Layout | None = None  # where each tensor lies in ``packed`` (``packing``)
    packed: torch.Tensor | None = None  # the one host buffer every tensor of ``host_state`` is a view of


def _load(spec: ModelServiceConfig, pin: bool) -> HostModel:
    """Weights into host memory once, packed for a copy on ``spec.gpus`` GPUs (``packing``: each
    GPU's part contiguous, so a load is one copy per GPU), page-locked in place with CUDA; the
    module onto meta."""
    max_len = None
    lay: Layout | None = None
    if spec.hf is not None:
        from . import hf

        def layout_for(module: torch.nn.Module, sizes: dict[str, tuple[torch.dtype, tuple]]) -> Layout:
            nonlocal lay
            lay = _layout(module, spec.gpus, sizes)
            return lay

        got = hf.load(spec.hf, spec.task or "", spec.dtype, layout_for=layout_for)
        module, ops, vocab, max_len = got.module, got.ops, got.vocab, got.max_positions
        ops = {**ops, **decode.ops_for(spec.hf, spec.task or "", spec.name, module)}  # generate / classify
        tensors, buffer = got.tensors, got.storage
    else:
        mod_name, _, fn_name = (spec.loader or "").partition(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        module, ops = fn(**spec.kwargs)
        emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else getattr(module, "embed", None)
        vocab = getattr(emb, "num_embeddings", None)
        tensors, buffer = {}, None
    module.eval().requires_grad_(False)  # served, never trained: no autograd on any copy
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[n] = first[id(p)]
            continue
        first[id(p)] = n
        state[n] = tensors[n] if n in tensors else p.detach().contiguous()
    for n, b in module.named_buffers(remove_duplicate=False):
        state[n] = tensors[n] if n in tensors else b.detach().contiguous()
    del tensors
    persistent = frozenset(module.state_dict().keys())
    skeleton = module.to("meta")  # the module lets go of its tensors; ``state`` keeps them
    if lay is None:  # from the meta skeleton: placing a copy of the real module would copy its weights
        lay = _layout(skeleton, spec.gpus, {})
    buffer = packing.pack(state, lay, buffer)  # each tensor into its slot, the original let go
    pinned = [p for p in [_pin_in_place(buffer.untyped_storage())] if p] if pin else []
    weights = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    return HostModel(spec, ops, state, skeleton, weights, vocab, max_len, aliases, persistent,
                     pinned, lay, buffer)


def _layout(module: torch.nn.Module, k: int, sizes: dict[str, tuple[torch.dtype, tuple]]) -> Layout:
    """The packed layout of ``module``'s parameters (under their first name) and buffers for a
    copy on ``k`` GPUs; ``sizes`` overrides a tensor's dtype and shape (a checkpoint's, as read)."""
    seen: set[int] = set()
    tensors = []
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            tensors.append((n, *sizes.get(n, (p.dtype, tuple(p.shape)))))
    for n, b in module.named_buffers(remove_duplicate=False):
        tensors.append((n, *sizes.get(n, (b.dtype, tuple(b.shape)))))
    return packing.layout(tensors, packing.stage_of(module, k) if k > 1 else {}, k)


def _pin_in_place(storage: torch.UntypedStorage) -> int:
    """Page-lock host memory where it lies (cudaHostRegister): no copy, and none of the caching
    allocator's power-of-two rounding, which nearly doubled host RAM for a dozen models."""
    ptr, n = storage.data_ptr(), storage.nbytes()
    if n == 0:
        return 0
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, n, 0))
    return ptr


def _unpin(ptrs: list[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)


#: activations and workspace a copy needs beyond its weights, when a service does not say
ACTIVATION_OVERHEAD = 0.2

#: batches whose timings ``ModelManager.batch_log`` keeps (for benchmarks: where a slow batch waited)
BATCH_LOG = 20000

#: the longest sequences a new copy is warmed with (``ModelManager._warm``)
WARM_LEN = 512


def logits_gb(ld: "HostModel") -> float:
    """GPU memory a Hugging Face teacher's logits take beyond ``ACTIVATION_OVERHEAD``, which a
    big vocabulary outgrows: a full batch of ``WARM_LEN`` tokens a row in the weights' dtype, and
    one row in float32 twice (the log-softmax). A Qwen2.5-0.5B teacher (1 GB of weights, 151,936
    ids) at 16 rows: 2.8 GB. Other services: 0 (their activations are in the 20%)."""
    if ld.spec.hf is None or ld.spec.task != "logprobs" or not ld.vocab:
        return 0.0
    n = min(ld.max_len or WARM_LEN, WARM_LEN)
    item = next((v.element_size() for v in ld.host_state.values() if v.is_floating_point()), 2)
    return (ld.spec.max_batch * n * ld.vocab * item + 2 * n * ld.vocab * 4) / 1e9


def _assign(module: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Put ``t`` in place of the parameter or buffer ``name`` (what ``load_state_dict`` does not
    reach: non-persistent buffers)."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path)
    if isinstance(getattr(owner, leaf, None), torch.nn.Parameter):
        setattr(owner, leaf, torch.nn.Parameter(t, requires_grad=False))
    else:  # a buffer (``Module.__setattr__`` keeps it one, persistent or not)
        setattr(owner, leaf, t)


@dataclass
class DeviceCopy:
    """A model's weights on a block of devices."""

    module: torch.nn.Module
    devices: list[torch.device]
    gpus: list[Device]  # the GPUs' shared streams and gates (empty on CPU devices)
    bytes: int = 0
    hops: dict = field(default_factory=dict)  # a split copy's tensors moved between GPUs, per batch (placement)


#: the interpreter's thread switch interval while GPU services run. Batches run in worker threads;
#: at Python's default 5 ms, the event loop thread that starts the next batch and answers callers
#: waits for the GIL behind them, and under bursts those waits compound into ~1 s stalls (a p99 ACT
#: ~20x that at 0.2 ms with 12 services sharing one GPU: ``bench models --shares 1,1@0.2``).
GPU_SWITCH_INTERVAL_S = 0.0002

#: when an evicted copy's device memory goes back to the driver (``ModelManager.hand_back``):
#: "deferred": once no load has started or run for ``HAND_BACK_AFTER_S`` (a load that follows
#: the eviction sooner, as the engine's evict-then-prefetch does, gets the evicted copy's cached
#: blocks); "lazy": in a thread right after the eviction; "kept": never by an eviction (the caching
#: allocator hands cached blocks back itself when an allocation would otherwise fail).
#: Why not "lazy": a copy into device memory the driver handed out right after other memory went
#: back to it runs ~20% slower while the driver is still busy with the freed memory (``bench models
#: --sections h2d``, ``after_free``), and waiting for no load to be copying before handing back does
#: not help (the driver's work goes on after ``cudaFree`` returns). A caveat of
#: keeping blocks: a smaller part carved from a larger evicted block leaves the rest of that block
#: cached for loads only (batches allocate on other streams) until the part is evicted; the
#: caching allocator's own retry on a failed allocation frees only whole unused blocks. And a
#: graph capture through ``torch.cuda.graph`` empties every GPU's cache itself, kept blocks too: a
#: single-GPU copy's warm-up in between hands the evicted blocks back (``graphs.EMPTY_CACHE_ON_CAPTURE``).
HAND_BACK = "deferred"
#: the stream whose cache a packed load's per-GPU parts are allocated from: "default" (the
#: loading thread's current stream) or "load" (the GPU's load stream, which nothing but loads
#: allocates on). "load" does not spare the second GPU's part its fresh allocation (its cache is
#: empty: ``graphs``' ``EMPTY_CACHE_ON_CAPTURE`` says why) and loads a little slower: "default" it is
ALLOC_ON = "default"
ALLOC_WAYS = ("default", "load")
HAND_BACK_WAYS = ("deferred", "lazy", "kept")
HAND_BACK_AFTER_S = 2.0


class ModelManager:
    """Implements the engine's ``ModelHost`` protocol for ``Pool.GPU``; reports to ``sink``.
    ``load_all`` puts the services into host RAM before the engine exists, so that the cluster it
    is built on knows their sizes."""

    def __init__(self, services: list[ModelServiceConfig], sink: Sink, device: str = "auto",
                 graphs: bool = True) -> None:
        self.cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        self.services = {s.name: s for s in services}
        self.loaded: dict[str, HostModel] = {}
        self.failed: dict[str, str] = {}
        self.instances: dict[tuple[str, tuple[int, ...]], DeviceCopy] = {}
        self.tasks = TaskSet(sink, "models")
        self._load_streams: dict[int, Any] = {}
        self._plans: dict[tuple[str, int], dict[str, int]] = {}
        self._gpus: dict[int, Device] = {}  # per GPU: the streams and gate its copies share (``devices``)
        self._lock = threading.Lock()  # the copies dict and counters are written from loader threads
        self._memory = threading.Lock()  # device allocation vs handing memory back (empty_cache)
        self.loads = 0
        self.load_seconds = 0.0
        self.load_log: list[dict] = []  # per load: model, gpus, bytes, seconds (for benchmarks)
        self.batch_log: list[dict] = []  # per batch: submitted, thread started, gate passed, done, returned
        self._switch_interval = sys.getswitchinterval()
        if self.cuda:  # process-wide, restored at shut_down; see GPU_SWITCH_INTERVAL_S
            sys.setswitchinterval(GPU_SWITCH_INTERVAL_S)
        self.evictions = 0
        self.graphs = graphs  # CUDA graphs for single-GPU copies where they pay (``graphs``)
        self.graph_judge = GRAPH_JUDGE  # which batches the warm-up times to decide that (``graphs.GRAPH_JUDGE``)
        self._alloc_s: dict[int, float] = {}  # per loading thread: its last packed load's device allocation
        self._fresh: dict[int, int] = {}  # per loading thread: new device segments (cudaMalloc) of that allocation
        self.pack = True  # load a packed copy with one copy per GPU (``packing``); off: tensor by tensor
        self.alloc_first = False  # a packed load allocates every GPU's part before the first copy (the way before)
        self.alloc_on = ALLOC_ON  # which stream's cache a packed load's parts come from (``ALLOC_ON``)
        self.trace_cache = False  # benchmarks: the load log says what each GPU's cache held before each part
        self._cache_before: dict[int, list] = {}
        self._fresh_per_gpu: dict[int, list[int]] = {}
        self.hand_back = HAND_BACK  # when an evicted copy's device memory goes back to the driver
        self.hand_back_after_s = HAND_BACK_AFTER_S
        self.hand_back_log: list[tuple[float, float]] = []  # (start, end) of each hand-back, perf_counter
        self._loads_begun = 0  # loads started so far (a deferred hand-back waits for a quiet spell)
        self._loading = 0  # loads in progress
        self._hand_back_waiting = False  # a deferred hand-back is armed

    def load_all(self) -> list[ModelSpec]:
        """Load every service into host RAM; a loader that raises marks only its service failed, a
        Hugging Face directory that cannot be read raises ``ModelDirError`` (naming the path)."""
        specs = []
        for name, spec in self.services.items():
            try:
                self.loaded[name] = ld = _load(spec, self.cuda)
            except ModelDirError:  # a configuration naming a model that is not there: nothing starts
                for ld in self.loaded.values():
                    _unpin(ld.pinned)
                self.loaded.clear()
                raise
            except Exception as e:  # the user's loader: any failure is contained to its service
                self.failed[name] = f"{type(e).__name__}: {e}"
                log.error("model service %s failed to load: %s", name, self.failed[name])
                continue
            per_instance = spec.memory_gb or ld.weights_gb * (1 + ACTIVATION_OVERHEAD) + logits_gb(ld)
            specs.append(ModelSpec(name, per_instance, spec.gpus, spec.compute_share, spec.idle_s))
        return specs

    def validate(self, model: str, op: str, tokens: Any, min_len: int) -> str | None:
        """Why a request to ``model``'s ``op`` with ``tokens`` cannot run (a message naming the
        field), or None. The one place model requests are checked, for every entry point: the
        same rules (``spec.call_problem``) a head without GPUs applies to its nodes' cards."""
        ld = self.loaded.get(model)
        cards = {model: ModelCard(model, tuple(ld.ops), ld.vocab, ld.max_len)} if ld is not None else {}
        return call_problem(cards, self.failed, model, op, tokens, min_len)

    def cards(self) -> dict[str, ModelCard]:
        """The loaded services as plain data (what another process checks requests against)."""
        return {name: ModelCard(name, tuple(ld.ops), ld.vocab, ld.max_len)
                for name, ld in self.loaded.items()}

    def device(self, gpu: int) -> torch.device:
        return torch.device(f"cuda:{gpu % torch.cuda.device_count()}") if self.cuda else torch.device("cpu")

    def _gpu(self, dev: torch.device) -> Device:
        with self._lock:
            gpu = self._gpus.get(dev.index or 0)
            if gpu is None:
                gpu = self._gpus[dev.index or 0] = Device(dev)
        return gpu

    def _load_stream(self, dev: torch.device):
        with self._lock:
            stream = self._load_streams.get(dev.index)
            if stream is None:
                stream = self._load_streams[dev.index] = torch.cuda.Stream(dev)
        return stream

    def _instance(self, name: str, block: tuple[int, ...]) -> DeviceCopy:
        """The copy of ``name`` on ``block``, loaded (and warmed, see ``_warm``) now if it is not
        resident: in a worker thread, so the copies cross the host links while the event loop goes
        on, and before the copy takes a call."""
        inst = self.instances.get((name, block))
        if inst is not None:
            return inst
        with self._lock:
            self._loads_begun += 1
            self._loading += 1
        try:
            return self._load_copy(name, block)
        finally:
            with self._lock:
                self._loading -= 1

    def _load_copy(self, name: str, block: tuple[int, ...]) -> DeviceCopy:
        ld = self.loaded[name]
        t = time.perf_counter()
        devices = [self.device(g) for g in block]
        # the copies start first and cross the host links while this thread builds the module
        # around them: the skeleton's copy, the placement's hooks, the assignment (a fixed cost
        # that does not shrink with more GPUs, so hidden it lets k links load k times as fast)
        lay = ld.layout
        where = {k: devices[i] for k, i in self._plan(name, len(devices)).items()}
        packed = self.pack and lay is not None and ld.packed is not None and lay.k == len(devices)
        copy_times: list = []
        if packed:
            state, nbytes, pending, copy_times = self._copy_packed(ld, lay, devices)
        else:  # tensor by tensor (``pack`` off: the comparison ``bench models --sections multigpu`` makes)
            state, nbytes, pending = self._copy_to_gpus(dict(ld.host_state), where, devices[0], wait=False)
        extra = {alias: ld.host_state[first] for alias, first in ld.aliases.items()
                 if where.get(alias, devices[0]) != where.get(first, devices[0])}
        if extra:  # a tied weight used on another GPU of the split: its own copy there
            got, n, more = self._copy_to_gpus(extra, {a: where[a] for a in extra}, devices[0], wait=False)
            state.update(got)
            nbytes += n
            pending += [st for st in more if st not in pending]
        t_prepare = time.perf_counter()
        module = copy.deepcopy(ld.skeleton)
        hops: dict = {}
        place(module, devices, hops)
        for alias, first in ld.aliases.items():
            state.setdefault(alias, state[first])
        module.load_state_dict({k: state[k] for k in ld.persistent}, assign=True)
        for k in state.keys() - ld.persistent:
            _assign(module, k, state[k])
        t_copy = time.perf_counter()
        for st in pending:
            st.synchronize()
        copy_s = [round(a.elapsed_time(b) / 1e3, 5) for a, b in copy_times]
        gpus = [self._gpu(d) for d in dict.fromkeys(devices)] if self.cuda else []
        if self.cuda and len(gpus) == 1 and self.graphs:
            module.tangram_graphs = Graphs(gpus[0])  # kept by ``_warm`` only where they pay
        inst = DeviceCopy(module, devices, gpus, nbytes, hops)
        t_assign = time.perf_counter()
        warm = self._warm(ld, inst) if self.cuda else {"warm_s": 0.0}
        seconds = time.perf_counter() - t
        with self._lock:
            self.load_seconds += seconds
            self.loads += 1
            self.load_log.append({"model": name, "gpus": list(block), "bytes": nbytes, "seconds": seconds,
                                  "issue_s": t_prepare - t, "build_s": t_copy - t_prepare,
                                  "wait_s": t_assign - t_copy, "copy_s": copy_s, "packed": packed,
                                  "alloc_s": self._alloc_s.pop(threading.get_ident(), None),
                                  "new_segments": self._fresh.pop(threading.get_ident(), None),
                                  "new_segments_per_gpu": self._fresh_per_gpu.pop(threading.get_ident(), None),
                                  "cache_before": self._cache_before.pop(threading.get_ident(), None),
                                  "alloc_on": self.alloc_on,
                                  "since_hand_back_s": t - self.hand_back_log[-1][1] if self.hand_back_log else None,
                                  "hand_back": self.hand_back,
                                  **warm})
            self.instances[(name, block)] = inst
        return inst

    def _warm(self, ld: HostModel, inst: DeviceCopy) -> dict:
        """Run every op of a new copy on a few batches before it takes calls, so that no caller
        pays the first-use costs: loading kernels (CUDA loads modules lazily), cuBLAS workspaces for
        the copy's stream, the caching allocator's pool for that stream (blocks are per stream),
        and capturing CUDA graphs (unwarmed, the first run of a many-service workload pays them
        all, several times the ACT of a warm one). Shapes: a full batch of long sequences eagerly (the pool's largest blocks), a
        single short one (the small kernels cuBLAS picks for few rows), then every graph bucket
        of ``WARM_LEN`` tokens, timed eager and graphed (every bucket, or one row: ``graph_judge``):
        graphs that do not pay are dropped (``graphs``). An op that fails here is logged, not
        fatal: a custom op may not take token lists."""
        t = time.perf_counter()
        n = min(ld.max_len or WARM_LEN, WARM_LEN)
        vocab = max(2, ld.vocab or 2)
        g: Graphs | None = getattr(inst.module, "tangram_graphs", None)
        out: dict = {}

        def batch(rows: int, length: int) -> list[list[int]]:
            return [[(7 * i + j) % vocab for j in range(max(2, length))] for i in range(rows)]

        def timed(op: Callable, b: list) -> float:
            t0 = time.perf_counter()
            _run_op(op, inst, b, capture=False)  # the buckets' captures are this thread's, below
            return time.perf_counter() - t0

        for op_name, op in ld.ops.items():
            try:
                if g is not None:
                    g.enabled = False
                for rows, length in ((ld.spec.max_batch, n), (1, min(n, 16)), (1, n)):
                    _run_op(op, inst, batch(rows, length))
                if g is None or op_name in decode.EAGER_OPS:  # graphs are judged by the ops they serve
                    continue
                g.enabled = True
                sizes, rows = [], 1
                while g.bucket(rows, n, ld.max_len) is not None and rows <= ld.spec.max_batch:
                    sizes.append(rows)
                    rows *= 2
                judged = sizes if self.graph_judge == "buckets" else sizes[:1]
                eager: dict[int, float] = {}
                for rows in sizes:  # eagerly, leaving each bucket's inputs for its capture
                    _run_op(op, inst, batch(rows, n), capture=False)
                    if rows in judged:
                        g.enabled = False
                        eager[rows] = min(timed(op, batch(rows, n)) for _ in range(3 if rows == 1 else 1))
                        g.enabled = True
                with inst.gpus[0].gate.exclusive():
                    g.capture_wanted()
                graphed = {r: min(timed(op, batch(r, n)) for _ in range(3 if r == 1 else 1)) if g.enabled
                           else float("inf") for r in eager}
                out[op_name] = {**{"eager_%dx%d_ms" % (r, n): round(t * 1e3, 3) for r, t in eager.items()},
                                **{"graph_%dx%d_ms" % (r, n): round(t * 1e3, 3) for r, t in graphed.items()}}
                if sum(eager.values()) < sum(graphed.values()) * MIN_GAIN:
                    g.drop()
            except Exception as e:
                log.warning("warming %s's %s failed (its first calls pay the warm-up): %s: %s",
                            ld.spec.name, op_name, type(e).__name__, e)
        if g is not None:
            g.enabled = bool(g.graphs)
            out["graphs"] = len(g.graphs)
        inst.hops.clear()
        out["warm_s"] = time.perf_counter() - t
        return out

    def _plan(self, name: str, k: int) -> dict[str, int]:
        """Which GPU of a block of ``k`` each tensor of ``name`` goes to (by index in the block),
        from a placement of the skeleton made once per service and block size."""
        key = (name, k)
        plan = self._plans.get(key)
        if plan is None:
            probe = copy.deepcopy(self.loaded[name].skeleton)
            where = place(probe, [torch.device("meta", i) for i in range(k)])
            plan = self._plans[key] = {n: d.index or 0 for n, d in where.items()}
        return plan

    def _copy_packed(self, ld: HostModel, lay: Layout, devices: list[torch.device]):
        """The packed host buffer onto the block: one allocation and one asynchronous copy per GPU
        (each on that GPU's load stream, all issued before any is waited for), the tensors views of
        the allocations. Returns the views, the bytes, the streams to wait for and, on CUDA, a
        (start, end) event pair per copy (the time each GPU's copy engine spent, for the load log).

        Each GPU's copy is issued as soon as its part is allocated (``alloc_first`` off), so the
        next GPU's allocation (a fresh 7 GB ``cudaMalloc`` is ~13 ms) overlaps the copies already
        running instead of coming before any of them."""
        assert ld.packed is not None
        fresh, alloc_s = 0, 0.0
        parts: list[torch.Tensor] = []
        pending, events = [], []

        per_gpu: list[int] = []

        def allocate(i: int) -> torch.Tensor:
            nonlocal fresh, alloc_s
            t0 = time.perf_counter()
            with self._memory:
                if self.cuda and self.trace_cache:
                    self._cache_before.setdefault(threading.get_ident(), []).append(_cache_of(devices[i]))
                before = _segments([devices[i]]) if self.cuda else 0
                on = torch.cuda.stream(self._load_stream(devices[i])) if self.cuda and self.alloc_on == "load" \
                    else contextlib.nullcontext()
                with on:
                    part = packing.device_part(lay, i, devices[i])
                got = (_segments([devices[i]]) - before) if self.cuda else 0
                fresh += got
                per_gpu.append(got)
            alloc_s += time.perf_counter() - t0
            return part

        if self.alloc_first:
            parts = [allocate(i) for i in range(len(lay.parts))]
        for i, (start, end) in enumerate(lay.parts):
            part = parts[i] if self.alloc_first else allocate(i)
            if not self.alloc_first:
                parts.append(part)
            if not self.cuda:
                part.copy_(ld.packed[start:end])
                continue
            stream = self._load_stream(part.device)
            with torch.cuda.stream(stream):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                part.copy_(ld.packed[start:end], non_blocking=True)
                b.record(stream)
            events.append((a, b))
            if stream not in pending:
                pending.append(stream)
        self._fresh[threading.get_ident()] = fresh
        self._fresh_per_gpu[threading.get_ident()] = per_gpu
        self._alloc_s[threading.get_ident()] = alloc_s
        state = packing.views(parts, lay, ld.host_state)
        return state, lay.total, pending, events

    def _copy_to_gpus(self, host: dict[str, torch.Tensor], where: dict, first: torch.device, wait: bool = True):
        """Host tensors onto their GPUs, every GPU's link busy at once: one allocation per GPU
        (a cudaMalloc per tensor keeps the first GPU's copies enqueueing while the second's link
        idles),
        then asynchronous copies into views of it, interleaved over the GPUs, on each GPU's load
        stream; the thread waits for those streams only."""
        align = 256
        layout: dict[torch.device, int] = {}
        offsets: dict[str, int] = {}
        for k, v in host.items():
            dev = where.get(k, first)
            off = layout.get(dev, 0)
            offsets[k] = off
            layout[dev] = off + (v.numel() * v.element_size() + align - 1) // align * align
        with self._memory:
            buffers = {dev: torch.empty(size, dtype=torch.uint8, device=dev) for dev, size in layout.items()}
        streams = {dev: self._load_stream(dev) for dev in buffers} if self.cuda else {}
        per_dev: dict[torch.device, list[str]] = {dev: [] for dev in buffers}
        for k in host:
            per_dev[where.get(k, first)].append(k)
        state, nbytes = {}, 0
        queues = list(per_dev.values())
        for i in range(max(map(len, queues), default=0)):  # round-robin: no link waits for another's turn
            for keys in queues:
                if i >= len(keys):
                    continue
                k = keys[i]
                v, dev = host[k], where.get(k, first)
                n = v.numel() * v.element_size()
                dst = buffers[dev][offsets[k]:offsets[k] + n].view(v.dtype).view(v.shape)
                with torch.cuda.stream(streams[dev]) if streams else contextlib.nullcontext():
                    dst.copy_(v, non_blocking=True)
                state[k] = dst
                nbytes += n
        if not wait:
            return state, nbytes, list(streams.values())
        for st in streams.values():
            st.synchronize()
        return state, nbytes

    def _evict(self, evict: tuple) -> None:
        for name, gpus in evict:
            self.instances.pop((name, tuple(gpus)), None)

    # -- the ModelHost protocol -------------------------------------------------------------------
    def start(self, action: Action, allocation: Allocation) -> None:
        self.tasks.run(action, lambda: self._run(action, allocation))

    def cancel(self, action_id: str) -> None:
        self.tasks.cancel(action_id)

    def prefetch(self, load: Load) -> None:
        async def copy() -> None:
            try:
                await asyncio.to_thread(self._instance, load.model, load.block)
            except Exception as e:  # the copy is made again when a request needs it, which reports
                log.error("prefetching %s onto GPUs %s failed: %s: %s", load.model, load.block, type(e).__name__, e)

        self.tasks.spawn(copy(), lambda: Loaded(load.key))

    def evict(self, model: str, gpus: tuple[int, ...]) -> None:
        """Scale to zero: drop the copy; its memory goes back to the driver as ``hand_back`` says
        (``empty_cache`` waits for the device, so it runs in a thread, off the event loop, and
        not while a load allocates)."""
        inst = self.instances.pop((model, tuple(gpus)), None)
        if inst is None:
            return
        self.evictions += 1
        g = getattr(inst.module, "tangram_graphs", None)
        dropping = None
        if g is not None and not g.drop_now():  # its graphs' pool back to the cache now; ``wanted``
            # holds closures over the module. A capture running: ``drop`` waits for it, in a thread
            dropping = g.drop
        del inst, g
        if self.hand_back == "lazy":  # after the drop: the graphs' pool must be in the cache first
            def hand_back(drop=dropping) -> None:
                if drop is not None:
                    drop()
                self._empty_cache()

            self.tasks.spawn(asyncio.to_thread(hand_back))
        elif dropping is not None:
            self.tasks.spawn(asyncio.to_thread(dropping))
        elif self.hand_back == "deferred" and not self._hand_back_waiting:
            self._hand_back_waiting = True
            self.tasks.spawn(self._hand_back_when_quiet())

    async def _hand_back_when_quiet(self) -> None:
        """Hand the cached memory back once ``hand_back_after_s`` went by with no load begun or
        running (a load in that time took the evicted copies' blocks: wait again)."""
        try:
            while True:
                begun = self._loads_begun
                await asyncio.sleep(self.hand_back_after_s)
                if self._loads_begun == begun and not self._loading:
                    break
            await asyncio.to_thread(self._empty_cache)
        finally:
            self._hand_back_waiting = False

    def _empty_cache(self) -> None:
        """Give the cached device memory back to the driver (``empty_cache`` waits for the device:
        in a thread, and not while a load allocates). On CPU devices only the log is written."""
        with self._memory:
            t = time.perf_counter()
            if self.cuda:
                torch.cuda.empty_cache()
            self.hand_back_log.append((t, time.perf_counter()))

    def close_session(self, trajectory: str) -> None:
        pass

    async def _run(self, action: Action, allocation: Allocation) -> Completion:
        name = action.model or ""
        call: ModelCall = action.payload
        t0 = time.perf_counter()
        result, message, outcome, setup_s = None, "", Outcome.OK, 0.0
        phase = "loading its weights onto GPUs " + ",".join(map(str, allocation.units))
        try:
            self._evict(allocation.evict)
            inst = self.instances.get((name, tuple(allocation.units)))  # resident: no thread hop
            if inst is None:
                inst = await asyncio.to_thread(self._instance, name, allocation.units)
            setup_s = time.perf_counter() - t0
            phase = f"running a batch of {len(call.batch)} ({call.op})"
            op = self.loaded[name].ops[call.op]
            timing = {"model": name, "rows": len(call.batch), "submitted": time.perf_counter()}
            result = await asyncio.to_thread(_run_op, op, inst, call.batch, True, timing)
            timing["returned"] = time.perf_counter()
            if len(self.batch_log) < BATCH_LOG:
                self.batch_log.append(timing)
        except torch.OutOfMemoryError as e:
            outcome, message = Outcome.OOM, f"model service {name}: GPU out of memory {phase}: {e}"
        except Exception as e:  # a fault of the model code or the device: ours, not the caller's input
            log.exception("model call %s on %s failed", action.id, name)
            outcome, message = Outcome.INFRA_ERROR, f"model service {name} failed {phase}: {type(e).__name__}: {e}"
        exec_s = time.perf_counter() - t0 - setup_s
        return Completion(action.id, outcome, setup_s, exec_s, message, result)

    async def start_up(self) -> None:
        pass  # the weights were read into host memory at construction (load_all: the cluster needs their sizes)

    async def shut_down(self) -> None:
        await self.tasks.close()
        self.instances.clear()
        if self.cuda:  # a deferred hand-back still waiting was cancelled with the tasks
            self._empty_cache()
        sys.setswitchinterval(self._switch_interval)
        for ld in self.loaded.values():
            _unpin(ld.pinned)  # before the host tensors are freed
            ld.pinned = []
        # let go of every host tensor now, whoever still holds this manager: a benchmark that runs
        # one runtime after another would otherwise run out of host memory
        self.loaded.clear()
        self._load_streams.clear()


def _cache_of(device: torch.device, least: int = 1 << 28) -> list[dict]:
    """The caching allocator's segments of at least ``least`` bytes on ``device`` (size, bytes
    allocated in it, the stream whose pool it belongs to): what a load could have reused."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == device.index and seg.get("total_size", 0) >= least:
            out.append({"gb": round(seg["total_size"] / 1e9, 3), "allocated_gb": round(seg.get("allocated_size", 0) / 1e9, 3),
                        "stream": seg.get("stream"), "blocks": [(round(b["size"] / 1e9, 3), b["state"][0])
                                                               for b in seg.get("blocks", [])][:6]})
    return out


def _segments(devices: list[torch.device]) -> int:
    """Device memory segments the caching allocator got from the driver so far (cudaMalloc calls)
    on ``devices``: a load that adds none reused blocks cached from an evicted copy."""
    return sum(torch.cuda.memory_stats(d).get("segment.all.allocated", 0) for d in dict.fromkeys(devices))


def _run_op(op: Callable, inst: DeviceCopy, batch: list, capture: bool = True, timing: dict | None = None):
    """Run one batch on a stream of each of the copy's GPUs (``devices.batch_on``). Graphs its
    batches asked for are captured afterwards, in a thread of their own holding the GPU alone:
    the caller does not wait for them."""
    timing = {} if timing is None else timing
    timing["thread"] = time.perf_counter()
    try:
        if not inst.gpus:
            return op(inst.module, batch)
        with batch_on(inst.gpus):
            timing["gate"] = time.perf_counter()
            return op(inst.module, batch)
    finally:
        timing["done"] = time.perf_counter()
        inst.hops.clear()
        g = getattr(inst.module, "tangram_graphs", None)
        if capture and g is not None and g.wanted and not g.capturing:
            g.capturing = True
            threading.Thread(target=_capture, args=(g, inst.gpus[0]), daemon=True,
                             name="tangram-graph-capture").start()


def _capture(g: Graphs, gpu: Device) -> None:
    try:
        with gpu.gate.exclusive():
            g.capture_wanted()
    except Exception:  # never a caller's failure: the batches of this shape stay eager
        log.exception("capturing CUDA graphs failed")
    finally:
        g.capturing = False
