"""CUDA graphs of a copy's batches, one per bucket shape, where they pay.

Measured on an H100 (``bench/models.py``'s tiny teacher, bf16, one batch of 512 tokens per row,
forward only): a 0.5B model's eager forward takes 7.9 ms for one row, its CUDA graph 1.9 ms; four
rows 12.1 vs 5.3 ms; sixteen rows 20.6 vs 20.2 ms. A 2B model: 7.1 vs 5.9 ms (one row); a 7B
model 14.4 vs 13.6 ms (one row) and the same at 4 and 16 rows. Eager batches of small models are
bound by the interpreter launching kernels, one after another; big batches and big models by
the GPU. In the MOPD-style run (12 teachers, 0.5B-7B, mostly batches of 1-3 rows) most GPU time
went to small models' launch-bound batches: 7.7 GPU-seconds held for 600 requests.

So a copy replays a graph for batches of at most ``MAX_TOKENS`` padded tokens (each copy's graphs
hold a memory pool of their largest batch's activations: 12 copies at 4096 tokens held 5.2 GB) — rows padded up
to a power of two, lengths up to a power of two from 64 — and runs bigger batches eagerly. Whether
graphs pay is measured per copy when it is warmed (``ModelManager._warm``): a copy whose graph is
slower than its eager batch (``MIN_GAIN``) drops its graphs and their memory. Graphs pay beyond
what the warm-up measures alone: an eager batch is bound by its thread's kernel launches, which
slow down when other threads want the interpreter. One H100, 12 teachers sharing it (share 1): a
3B teacher's one-row eager batch took 36-40 ms in a burst of arrivals with its GPU busy 7.9 ms of
it (530 kernels; torch.profiler, ``bench models --profile``), against 9 ms eager / 8 ms graphed
when warmed alone. Graphs of one copy share one memory pool and replay under one lock (a graph's
static output is read before the next replay).

Dropped: ``torch.compile`` (measured: 27 s to compile the 0.5B model for one shape, 16.6 ms vs
20.6 ms eager at 16 x 512 afterwards): a copy loads in well under a second and may be evicted
and reloaded many times, so a compile per load and shape costs more than it saves.
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
#: a copy keeps its graphs only if a graph runs at least this many times faster than eager. Was
#: 1.15 (the 3B and 7B teachers then ran eagerly): one H100, 12 teachers sharing it at share 1, the
#: same machine one run each (``bench models --sections mopd --shares 1 --min-gain``): average ACT
#: 6.77 ms at 1.15 vs 6.28 ms at 1.0 (0.93x), p99 28.7 vs 22.3 ms (0.78x)
MIN_GAIN = 1.0
#: which batches a copy's warm-up times, eager and graphed, to decide whether its graphs pay:
#: "one_row", one row of 512 tokens; "buckets", one batch of every bucket it captured (1, 2, 4 rows),
#: summed. Why "buckets" was tried: a 7B teacher is compute-bound, and on one H100 its one-row graph
#: (15.95 ms) vs eager (15.52) dropped its graphs, while its two-row batches, the slowest of that
#: run, took 28.6 ms eager against 25.3 ms of GPU time graphed. Measured (2x H200, GPU 0, 12
#: teachers at share 1, alternating one_row, buckets, one_row, buckets in one run): the 7B's graphs
#: paid at every bucket there (eager/graphed 15.1/13.9-14.1, 28.3-29.7/26.2-26.4, 53.1-55.3/50.2-50.9
#: ms), so both ways kept every copy's graphs; average ACT 5.88, 6.31, 6.41, 6.31 ms, p99 19.7, 21.1,
#: 22.2, 21.6 ms (the same settings differ by 9% between runs); the 7B's warm-up took 0.73-0.75 s
#: against 0.58-0.59 s, all twelve 3.9-4.1 s against 3.2-3.3 s. Not the default: no gain measured,
#: a slower load; an H100 run where the two ways decide differently is still to be made
GRAPH_JUDGE = "one_row"
GRAPH_JUDGES = ("buckets", "one_row")
#: capture through ``torch.cuda.graph``, whose entry synchronises the device and hands every GPU's
#: cached memory back to the driver (``empty_cache``) before each capture (read in torch's source).
#: Off: ``capture_begin`` / ``capture_end`` on the side stream, the same capture without those.
#: Why off is wanted: a copy's warm-up captures its buckets, so every load of a single-GPU copy
#: empties the caches of all GPUs, the blocks that evictions keep for the next load
#: (``manager.HAND_BACK``) too. 2x H200 (NV18), 7B, a 2-GPU copy loaded after a 1-GPU copy's load and
#: eviction, 8 loads: the second GPU's cache held no segment before any of them (the load log's
#: ``cache_before``), its part a fresh 7 GB ``cudaMalloc`` each time, while the first GPU's 13.15 GB
#: block (in use by the 1-GPU copy during its warm-up) stayed cached and was reused. Off measured
#: (``bench models --sections multigpu --multigpu-modes packed_capture_empties,packed_capture_keeps
#: --multigpu-rounds 4 --no-multigpu-raw``, 2x H200 NV18, alternating): the second GPU's part reused
#: the evicted block (no new segment in any warm round), every copy kept its 3 graphs, 2-GPU load
#: 0.126 s vs 0.135 s median, **1.90x** the 1-GPU load (best 1.94x) against 1.79x (best 1.80x);
#: resident 1.10x, identical scores. So off by default. With it off, a capture that needs memory
#: while the GPU's free memory sits in the caches runs out of memory (no hand-back may run inside a
#: capture): it is captured again the way before, which hands the caches back first (seen on one
#: H100 with 12 teachers: a capture failed with 41 GiB cached and unused, and that copy ran eager)
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

    @torch.inference_mode()  # as the ops run: their inputs are inference tensors (measured: else autograd refuses)
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
                # more the way that empties them first (a full H100 of 12 teachers: a 7B's capture
                # ran out of memory with 41 GiB cached and unused, and that copy ran eager)
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
        ``drop`` must follow (in a thread). Review L3: an eviction that always dropped in a thread
        kept the evicted weights and graph pool alive until the thread got the lock, memory the
        engine's ledger already counted free, and a lazy hand-back could run before the drop."""
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
