"""What the copies on one GPU share: a pool of compute streams and a gate for graph captures.

Streams: a batch takes a stream of its GPU for its duration and gives it back, instead of each
copy owning one. PyTorch's caching allocator keeps freed blocks per stream, so with a stream per
copy every service's largest batch stays cached apart from every other's (12 services on one
H100, warmed with full batches, would end with ~29 GB reserved but unallocated, out of memory).
A pool grows to the most batches that ran on the GPU at once (1 at compute share 1), and services
reuse each other's blocks. Batches of services that share a GPU still overlap, each on a stream.

Gate: a CUDA graph capture must not run beside other work on its GPU (captures beside other
services' batches fail with cuBLAS execution errors and invalidated captures, and take the
batches down with them). Batches hold the gate shared; a capture holds it alone, waiting for
the running batches to end and holding back new ones (a waiting capture goes first).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch


class Gate:
    """A readers-writer lock that prefers the writer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class Device:
    """One GPU's shared stream pool, gate and capture stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gate = Gate()
        self._free: list = []
        self._lock = threading.Lock()
        self.streams_made = 0
        self._capture_stream = None

    def take(self):
        with self._lock:
            if self._free:
                return self._free.pop()
            self.streams_made += 1
        return torch.cuda.Stream(self.device)

    def give(self, stream) -> None:
        with self._lock:
            self._free.append(stream)

    def capture_stream(self):
        """The one side stream captures run on (cuBLAS keeps a workspace per stream)."""
        with self._lock:
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            return self._capture_stream


@contextlib.contextmanager
def batch_on(devices: list[Device]) -> Iterator[list]:
    """Hold each device's gate shared and one stream of each, current, for one batch; wait on
    those streams only (other services' batches on the same GPUs keep running)."""
    devices = sorted(devices, key=lambda d: d.device.index or 0)  # one order: no two batches wait on each other
    with contextlib.ExitStack() as stack:
        for d in devices:
            stack.enter_context(d.gate.shared())
        streams = [d.take() for d in devices]
        try:
            for s in streams:
                stack.enter_context(torch.cuda.stream(s))
            yield streams
            for s in streams:
                s.synchronize()
        finally:
            stack.close()
            for d, s in zip(devices, streams):
                d.give(s)
