"""Splitting a model's layers over the GPUs of a multi-GPU instance (pipeline placement).

An instance placed on k GPUs of one island keeps its stack of layers (the module's largest
``nn.ModuleList``) in k contiguous stages of about equal bytes; what comes before the stack (an
embedding) sits on the first GPU, what comes after it (a final norm, an output head) on the last.
Each unit's inputs are moved to its GPU before it runs, so the model's own ``forward`` runs
unchanged and an operation only has to expect its output on the last GPU.

Why layers split rather than tensor parallel through ``torch.distributed``: a split runs any
``nn.Module`` (no per-architecture sharding rules, no process group per instance), gives
bit-identical results to one GPU (the same kernels on the same shapes), and its point here is the
memory of a model too big for one GPU and loading its weights over k host links at once; a batch
crosses each stage boundary once over NVLink. Tensor parallel would also cut a batch's latency up to
k times; it is the next step when one model's latency, not capacity, is the bottleneck.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch import nn


def _stack_path(module: nn.Module) -> str | None:
    """The dotted path of the ``nn.ModuleList`` holding the most parameters, or None."""
    best, best_n = None, 0
    for path, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 1:
            n = sum(p.numel() for p in sub.parameters())
            if n > best_n:
                best, best_n = path, n
    return best


def _units(module: nn.Module, prefix: str, stack: str) -> Iterator[tuple[str, nn.Module, bool]]:
    """Leaves of the split in forward order: ``(path, module, in_stack)``."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path == stack:
            for i, layer in enumerate(child):
                yield f"{path}.{i}", layer, True
        elif stack.startswith(path + "."):
            yield from _units(child, path + ".", stack)
        else:
            yield path, child, False


def stages(module: nn.Module, k: int) -> list[tuple[str, nn.Module, int]]:
    """``(path, submodule, stage)`` for every unit of ``module`` split over ``k`` stages."""
    stack = _stack_path(module) if k > 1 else None
    if stack is None:
        return [("", module, 0)]
    units = list(_units(module, "", stack))
    layers = [u for u in units if u[2]]
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for _, m, _ in layers]
    total, acc, out, seen_stack = sum(sizes) or 1, 0, [], False
    bounds: dict[str, int] = {}
    for (path, _, _), size in zip(layers, sizes):
        # the layer's midpoint decides its stage: stages get about total/k bytes each
        bounds[path] = min(k - 1, int((acc + size / 2) * k / total))
        acc += size
    for path, sub, in_stack in units:
        if in_stack:
            seen_stack = True
            out.append((path, sub, bounds[path]))
        else:
            out.append((path, sub, k - 1 if seen_stack else 0))
    return out


def _move(x: Any, device: torch.device, hops: dict) -> Any:
    """``x`` with its tensors on ``device``. A tensor crosses to a GPU once per batch: ``hops``
    (cleared after each batch) keeps what was moved, since the same mask and position embeddings
    are handed to every layer (a Llama's 4-D attention mask: batch x length^2 elements, once per
    layer of the second stage without this). Assumes, as the models do, that a tensor handed to
    several stages is not changed in place between them."""
    if isinstance(x, torch.Tensor):
        if x.device == device:
            return x
        key = (id(x), device)
        got = hops.get(key)
        if got is None or got[0] is not x:
            got = hops[key] = (x, x.to(device, non_blocking=True))
        return got[1]
    if isinstance(x, (list, tuple)):
        return type(x)(_move(v, device, hops) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device, hops) for k, v in x.items()}
    return x


def _follow(sub: nn.Module, dev: torch.device, hops: dict) -> None:
    """Move ``sub``'s tensor inputs onto ``dev`` before its own ``forward`` runs. An instance
    attribute, not a forward pre-hook: a hook turns off ``TransformerEncoderLayer``'s fused fast
    path (other kernels: scores no longer bit-identical to one GPU's). The attribute reaches
    ``sub`` through a weak reference: holding its bound ``forward`` would make a cycle
    (sub -> forward -> sub) that keeps an evicted copy's weights on its GPUs until the garbage
    collector's next full pass, long enough for the next loads to run out of memory."""
    if "forward" in sub.__dict__:  # already an instance attribute: wrap it as it is
        inner = sub.forward

        def forward(*args, **kwargs):
            return inner(*_move(args, dev, hops), **_move(kwargs, dev, hops))
    else:
        own, ref = type(sub).forward, weakref.ref(sub)

        def forward(*args, **kwargs):
            return own(ref(), *_move(args, dev, hops), **_move(kwargs, dev, hops))

    sub.forward = forward


def place(module: nn.Module, devices: list[torch.device], hops: dict | None = None) -> dict[str, torch.device]:
    """Hook ``module``'s stages so their inputs follow them onto ``devices`` (moved tensors kept
    in ``hops`` until the caller clears it); returns the device of every parameter and buffer name,
    tied and shared ones under each of their names (for loading its weights there)."""
    hops = {} if hops is None else hops
    where: dict[str, torch.device] = {}
    plan = stages(module, len(devices))
    for path, sub, stage in plan:
        dev = devices[stage]
        prefix = f"{path}." if path else ""
        for name, _ in list(sub.named_parameters(remove_duplicate=False)) + list(sub.named_buffers(remove_duplicate=False)):
            where.setdefault(prefix + name, dev)
        if len(devices) > 1:
            _follow(sub, dev, hops)
    for name, _ in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        where.setdefault(name, devices[0])  # the root's own tensors, if any
    return where
