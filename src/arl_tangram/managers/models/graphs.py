"""CUDA graphs of a copy's batches, one per bucket shape, where they pay.

Eager batches of small models are bound by the interpreter launching kernels, one after another
(on an H100, a 0.5B model's one-row forward: ~8 ms eager, ~2 ms replayed as a graph); big batches
and big models are bound by the GPU, where a graph gains little. A workload of many small teachers
spends most of its GPU time in such launch-bound batches of a few rows.

So a copy replays a graph for batches of at most ``MAX_TOKENS`` padded tokens (each copy's graphs
hold a memory pool of their largest batch's activations) — rows padded up to a power of two,
lengths up to a power of two from 64 — and runs bigger batches eagerly. Whether graphs pay is
measured per copy when it is warmed (``ModelManager._warm``): a copy whose graph is slower than its
eager batch (``MIN_GAIN``) drops its graphs and their memory. Graphs pay beyond what the warm-up
measures alone: an eager batch is bound by its thread's kernel launches, which slow down when other
threads want the interpreter. Graphs of one copy share one memory pool and replay under one lock
(a graph's static output is read before the next replay).

``torch.compile`` is not used: it takes tens of seconds per model and shape, and a copy loads in
well under a second and may be evicted and reloaded many times, so a compile per load and shape
costs more than it saves.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

import torch

log = logging.getLogger(__name__)

#: padded tokens (rows x length) up to which a batch replays a graph
MAX_TOKENS = 2048
#: graphs a copy keeps (least recently used go first)
MAX_GRAPHS = 16
#: a copy keeps its graphs only if a graph runs at least this many times faster than eager: a
#: higher bar sends the 3B and 7B teachers eager, and many teachers sharing a GPU then wait longer
MIN_GAIN = 1.0
#: which batches a copy's warm-up times, eager and graphed, to decide whether its graphs pay:
#: "one_row", one row of 512 tokens; "buckets", one batch of every bucket it captured (1, 2, 4 rows),
#: summed. "buckets" judges a compute-bound model by its larger batches too (where its graphs may pay
#: though its one-row graph does not); "one_row" is the default: the two have not decided
#: differently where measured, and "buckets" makes every load slower
GRAPH_JUDGE = "one_row"
GRAPH_JUDGES = ("buckets", "one_row")
#: capture through ``torch.cuda.graph``, whose entry synchronises the device and hands every GPU's
#: cached memory back to the driver (``empty_cache``) before each capture (read in torch's source).
#: Off: ``capture_begin`` / ``capture_end`` on the side stream, the same capture without those.
#: Off by default: a copy's warm-up captures its buckets, so with it on every load of a single-GPU
#: copy empties the caches of all GPUs, the blocks that evictions keep for the next load
#: (``manager.HAND_BACK``) too, and a multi-GPU copy loaded next allocates its parts afresh. With it
#: off, a capture that needs memory while the GPU's free memory sits in the caches runs out of
#: memory (no hand-back may run inside a capture): it is captured again the way before, which hands
#: the caches back first
EMPTY_CACHE_ON_CAPTURE = False
#: the shortest padded length
MIN_LEN = 64


def _out_of_memory(e: BaseException | None) -> bool:
    """Whether ``e`` is, or was raised while handling, a CUDA out-of-memory error (a capture's
    ``capture_end`` may raise its own error over the forward's)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
            return True
        e, seen = e.__context__, seen + 1
    return False


def _pow2(n: int, least: int = 1) -> int:
    p = least
    while p < n:
        p *= 2
    return p


class Graphs:
    """The graphs of one copy on one device. A batch whose bucket has no graph yet runs eagerly
    and leaves its inputs in ``wanted``; ``capture_wanted`` captures them while the caller holds
    the device alone (``devices.Gate``), off any caller's path. ``capture=False`` (CPU devices,
    tests) pads batches to the same buckets and runs them eagerly: what bucketing does to
    answers is tested on CPU."""

    def __init__(self, device=None, capture: bool = True, max_tokens: int = MAX_TOKENS) -> None:
        self.device = device  # a ``devices.Device``: its capture stream
        self.capture = capture
        self.max_tokens = max_tokens
        self.enabled = True
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.wanted: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.lock = threading.Lock()
        self.captures = 0
        self.capturing = False

    def bucket(self, rows: int, length: int, max_len: int | None = None) -> tuple[int, int] | None:
        """The padded shape a batch of ``rows`` sequences of at most ``length`` tokens runs as,
        or None to run it as it is (eagerly)."""
        if not self.enabled:
            return None
        r, n = _pow2(rows), _pow2(length, MIN_LEN)
        if max_len is not None:
            n = min(n, max(length, max_len))
        return (r, n) if r * n <= self.max_tokens else None

    def run(self, key: tuple, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(*inputs)`` (one tensor out), replayed from the graph for ``key`` if there is one;
        else eagerly, and the inputs are kept for a capture. The result is the caller's."""
        if not self.capture:
            return fn(*inputs)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is not None:
                self.graphs.move_to_end(key)
                graph, static_in, static_out = entry
                for s, x in zip(static_in, inputs):
                    s.copy_(x, non_blocking=True)
                graph.replay()
                return static_out.clone()
            if key not in self.wanted:
                self.wanted[key] = (fn, tuple(x.clone() for x in inputs))
        return fn(*inputs)

    def capture_wanted(self) -> int:
        """Capture every wanted graph; the caller holds the device alone. A forward that cannot be
        captured (one that waits for the host) turns graphs off for this copy: eager then."""
        with self.lock:
            wanted, self.wanted = self.wanted, {}
            if not self.enabled:
                return 0
            done = 0
            for key, (fn, inputs) in wanted.items():
                try:
                    self.graphs[key] = self._capture(fn, inputs)
                except Exception as e:
                    log.warning("no CUDA graph for this model (%s: %s); its batches run eagerly",
                                type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    self.enabled = False
                    self.graphs.clear()
                    return done
                done += 1
                while len(self.graphs) > MAX_GRAPHS:
                    self.graphs.popitem(last=False)
            return done

    @torch.inference_mode()  # as the ops run: their inputs are inference tensors (else autograd refuses)
    def _capture(self, fn: Callable[..., torch.Tensor], inputs: tuple) -> tuple:
        static_in = list(inputs)
        side = self.device.capture_stream() if self.device is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one run off the graph: lazy initialisations happen outside it
            fn(*static_in)
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: loads in other threads may allocate meanwhile (the gate keeps other batches off)
        static_out = None
        if not EMPTY_CACHE_ON_CAPTURE:
            try:
                with torch.cuda.stream(side):
                    graph.capture_begin(self.pool, capture_error_mode="thread_local")
                    try:
                        static_out = fn(*static_in)
                    finally:
                        graph.capture_end()
            except Exception as e:
                if not _out_of_memory(e):
                    raise
                # the GPU's free memory sits in the caches, which no capture may hand back: once
                # more the way that empties them first (else a full GPU's copy would run eager)
                log.info("a CUDA graph capture ran out of memory with the caches kept: captured again "
                         "after handing them back")
                graph = torch.cuda.CUDAGraph()
        if static_out is None:  # ``torch.cuda.graph``: sync, empty_cache (every GPU), capture
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                static_out = fn(*static_in)
        side.synchronize()
        self.captures += 1
        return graph, static_in, static_out

    def drop(self) -> None:
        """Stop using graphs and let go of them (their pool goes back to the allocator's cache);
        waits for a capture that is running (call it off the event loop, or ``drop_now`` first)."""
        self.enabled = False
        self.wanted = {}
        with self.lock:
            self.graphs.clear()
            self.wanted.clear()

    def drop_now(self) -> bool:
        """``drop`` without waiting: the inputs kept for captures (closures over the copy's module,
        so its weights) go at once, the graphs too unless a capture holds the lock; False then, and
        ``drop`` must follow (in a thread). Dropping in a thread every time would keep the evicted
        weights and graph pool alive until the thread got the lock, memory the engine's ledger
        already counts free, and a lazy hand-back could run before the drop."""
        self.enabled = False
        self.wanted = {}  # a running capture keeps its own reference to what it captures
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.graphs.clear()
            self.wanted.clear()
        finally:
            self.lock.release()
        return True


def shape_of(module: torch.nn.Module, seqs: list[list[int]], max_len: int | None = None) -> tuple[int, int]:
    """The (rows, length) a batch of ``seqs`` runs as: its bucket where the copy replays graphs,
    else as it is. Rows past ``len(seqs)`` are padding (one token each), their answers dropped."""
    rows, length = len(seqs), max(len(s) for s in seqs)
    g = getattr(module, "tangram_graphs", None)
    shape = g.bucket(rows, length, max_len) if isinstance(g, Graphs) else None
    return shape or (rows, length)


def forward(module: torch.nn.Module, key: str, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, replayed from the copy's graph for this shape where it has graphs."""
    g = getattr(module, "tangram_graphs", None)
    if isinstance(g, Graphs) and g.bucket(inputs[0].shape[0], inputs[0].shape[1]) == tuple(inputs[0].shape[:2]):
        return g.run((key, *(tuple(x.shape) for x in inputs)), fn, *inputs)
    return fn(*inputs)
