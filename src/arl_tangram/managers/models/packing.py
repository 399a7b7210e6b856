"""A model's weights packed for loading: each GPU's part of a copy contiguous in one host buffer.

A copy placed on k GPUs takes its tensors in k parts (``placement``). At registration every
tensor gets a slot in one page-locked host buffer, laid out part by part (in the module's own
order inside a part, which is layer order), so that a load is **one** host-to-device copy per GPU
(``cudaMemcpyAsync`` of the whole part into one device allocation, on that GPU's load stream, all
GPUs at once) and the copy's parameters and buffers are views into that device allocation.

Why: a load issued one copy per tensor (hundreds for a 7B model) pays a launch per tensor, and
the second GPU's link idles while the first GPU's copies are queued, so two GPUs load barely
faster than one, while raw copies reach twice the bandwidth to two GPUs at once (one issuing
thread per GPU does no better: docs/models.md). With one copy per GPU, issue time is a few
microseconds and each link runs one long transfer.

Host memory stays one copy of the weights: a Hugging Face checkpoint is read straight into its
slots (``hf.load(layout_for=...)``), and a loader's module tensors are moved into the buffer one
at a time (each freed as it is moved: at most one tensor beyond the one copy).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from .placement import place

#: a tensor's byte offset inside its part: CUDA allocations are 256-byte aligned, and a view keeps
#: the alignment vectorised kernels expect for any dtype
ALIGN = 256


@dataclass(frozen=True)
class Slot:
    part: int  # which GPU of the block (index of its stage)
    offset: int  # bytes from the start of its part
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where every tensor of a model lies in its packed host buffer, for copies on ``k`` GPUs."""

    k: int
    slots: dict[str, Slot]
    parts: tuple[tuple[int, int], ...]  # per GPU of the block: [start, end) bytes in the host buffer

    @property
    def total(self) -> int:
        return self.parts[-1][1] if self.parts else 0

    def at(self, name: str) -> int:
        """Absolute byte offset of ``name`` in the host buffer."""
        s = self.slots[name]
        return self.parts[s.part][0] + s.offset


def host_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised host buffer of ``nbytes`` (uint8) for packed weights, page-locked later in
    place (torch's own memory copies as fast as memory advised to use transparent huge pages, or
    ``cudaHostAlloc``'s)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def stage_of(module: nn.Module, k: int) -> dict[str, int]:
    """Which GPU of a block of ``k`` each parameter and buffer name of ``module`` goes to (a
    placement of a copy of ``module`` on meta devices; ``module`` itself is not hooked)."""
    probe = copy.deepcopy(module)
    where = place(probe, [torch.device("meta", i) for i in range(k)])
    return {n: d.index or 0 for n, d in where.items()}


def layout(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], stages: dict[str, int], k: int) -> Layout:
    """Slots for ``tensors`` (name, dtype, shape; in the module's order) split into ``k`` parts by
    ``stages`` (a name not in it goes to the first part)."""
    items = [(n, dt, tuple(sh)) for n, dt, sh in tensors]
    by_part: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[] for _ in range(k)]
    for n, dt, sh in items:
        by_part[min(k - 1, stages.get(n, 0))].append((n, dt, sh))
    slots: dict[str, Slot] = {}
    parts, start = [], 0
    for i, part in enumerate(by_part):
        off = 0
        for n, dt, sh in part:
            nbytes = dt.itemsize * _numel(sh)
            slots[n] = Slot(i, off, nbytes, dt, sh)
            off += _round(nbytes)
        parts.append((start, start + off))
        start += off
    return Layout(k, slots, tuple(parts))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def view(buffer: torch.Tensor, offset: int, slot: Slot) -> torch.Tensor:
    """The tensor of ``slot`` inside the uint8 ``buffer`` at byte ``offset``."""
    return buffer[offset:offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def pack(state: dict[str, torch.Tensor], lay: Layout, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Put every tensor of ``state`` into its slot of ``buffer`` (allocated here when None) and
    replace it in ``state`` by the view of its slot, one at a time: a tensor already lying in its
    slot (read there by ``hf.load``) is not copied, and each moved tensor is let go as soon as it
    is moved (host memory peaks at the buffer plus the largest tensor still held elsewhere)."""
    if buffer is None:
        buffer = host_buffer(lay.total)
    for name in list(state):
        slot = lay.slots[name]
        dst = view(buffer, lay.at(name), slot)
        src = state[name]
        if slot.nbytes and src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
        state[name] = dst
        del src
    return buffer


def device_part(lay: Layout, i: int, device: torch.device) -> torch.Tensor:
    """An empty allocation for part ``i`` on ``device`` (the GPU of the block that part goes to)."""
    start, end = lay.parts[i]
    return torch.empty(end - start, dtype=torch.uint8, device=device)


def views(parts: list[torch.Tensor], lay: Layout, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Every tensor of ``names`` as a view of its part's device allocation."""
    out = {}
    for n in names:
        s = lay.slots[n]
        out[n] = view(parts[s.part], s.offset, s)
    return out
