"""The model manager: carries out the engine's GPU decisions with real torch models.

Each service's weights are loaded once into host RAM (pinned when CUDA is present). The engine
decides where copies live and which to evict (it models every GPU's memory); this manager makes it
so: a load copies the host tensors onto the device (a skeleton on the meta device takes them with
``assign``, so no second host copy is made), an eviction drops the device copy, and a call runs the
service's operation on one batch. Multi-GPU instances are given the first GPU of their block as the
device (the tiny models here fit one; a loader for a sharded model may use the whole block).
With no CUDA the same code runs on CPU "devices" whose memory is only the engine's model.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...core.action import Action, Allocation, Outcome
from ...core.cluster import ModelSpec
from ...core.records import Load
from ...core.seam import Completion, Loaded, Sink
from ..tasks import TaskSet

log = logging.getLogger(__name__)


@dataclass
class ModelServiceConfig:
    """A model service: ``loader`` is ``module:function`` returning ``(torch module, {op: fn})``
    where ``fn(module, batch) -> list`` (``score``: sequences -> scalars; ``logprobs``: sequences ->
    per-token log-probabilities)."""

    name: str
    loader: str
    kwargs: dict = field(default_factory=dict)
    gpus: int = 1
    memory_gb: float | None = None  # per instance; default: the weights plus 20% for activations
    max_batch: int = 16
    max_wait_ms: float = 5.0


@dataclass
class ModelCall:
    """One batch of requests to one operation of a service."""

    op: str
    batch: list


@dataclass
class HostModel:
    spec: ModelServiceConfig
    ops: dict[str, Callable]
    host_state: dict[str, torch.Tensor]
    skeleton: torch.nn.Module
    weights_gb: float
    vocab: int | None
    pinned: list[int] = field(default_factory=list)  # host pointers registered with CUDA


def _load(spec: ModelServiceConfig, pin: bool) -> HostModel:
    mod_name, _, fn_name = spec.loader.partition(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    module, ops = fn(**spec.kwargs)
    module.eval()
    vocab = getattr(getattr(module, "embed", None), "num_embeddings", None)
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    pinned = [_pin_in_place(v) for v in state.values()] if pin else []
    skeleton = module.to("meta")  # the module lets go of its tensors; ``state`` keeps them
    weights = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    return HostModel(spec, ops, state, skeleton, weights, vocab, [p for p in pinned if p])


def _pin_in_place(t: torch.Tensor) -> int:
    """Page-lock a host tensor where it lies (cudaHostRegister): no copy, and none of the caching
    allocator's power-of-two rounding, which nearly doubled host RAM for a dozen models."""
    if t.numel() == 0:
        return 0
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    return t.data_ptr()


def _unpin(ptrs: list[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)


#: activations and workspace a copy needs beyond its weights, when a service does not say
ACTIVATION_OVERHEAD = 0.2


class ModelManager:
    """Implements the engine's ``ModelHost`` protocol for ``Pool.GPU``; reports to ``sink``.
    ``load_all`` puts the services into host RAM before the engine exists, so that the cluster it
    is built on knows their sizes."""

    def __init__(self, services: list[ModelServiceConfig], sink: Sink, device: str = "auto") -> None:
        self.cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        self.services = {s.name: s for s in services}
        self.loaded: dict[str, HostModel] = {}
        self.failed: dict[str, str] = {}
        self.instances: dict[tuple[str, tuple[int, ...]], torch.nn.Module] = {}
        self.tasks = TaskSet(sink, "models")
        self.loads = 0
        self.load_seconds = 0.0

    def load_all(self) -> list[ModelSpec]:
        """Load every service into host RAM; a loader that raises marks only its service failed."""
        specs = []
        for name, spec in self.services.items():
            try:
                self.loaded[name] = ld = _load(spec, self.cuda)
            except Exception as e:  # the user's loader: any failure is contained to its service
                self.failed[name] = f"{type(e).__name__}: {e}"
                log.error("model service %s failed to load: %s", name, self.failed[name])
                continue
            per_instance = spec.memory_gb or ld.weights_gb * (1 + ACTIVATION_OVERHEAD)
            specs.append(ModelSpec(name, per_instance, spec.gpus))
        return specs

    def validate(self, model: str, op: str, tokens: Any, min_len: int) -> str | None:
        """Why a request to ``model``'s ``op`` with ``tokens`` cannot run (a message naming the
        field), or None. The one place model requests are checked, for every entry point."""
        if model not in self.loaded and model not in self.failed:
            return f"service: unknown model {model!r}"
        if model in self.failed:
            return f"service: model {model!r} failed to load ({self.failed[model]})"
        ops = self.loaded[model].ops
        if op not in ops:
            return f"op: model {model!r} has no {op!r} (it has {', '.join(ops)})"
        if not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
            return "tokens: must be a flat list of integer token ids"
        if len(tokens) < min_len:
            return f"tokens: {op} needs at least {min_len} token(s)"
        vocab = self.loaded[model].vocab
        bad = [t for t in tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            return f"tokens: id {bad[0]} out of range [0, {vocab})"
        return None

    def device(self, gpu: int) -> torch.device:
        return torch.device(f"cuda:{gpu % torch.cuda.device_count()}") if self.cuda else torch.device("cpu")

    def _instance(self, name: str, block: tuple[int, ...]) -> torch.nn.Module:
        inst = self.instances.get((name, block))
        if inst is None:
            ld = self.loaded[name]
            t = time.perf_counter()
            dev = self.device(block[0])
            state = {k: v.to(dev, non_blocking=True) for k, v in ld.host_state.items()}
            inst = copy.deepcopy(ld.skeleton)
            inst.load_state_dict(state, assign=True)
            if self.cuda:
                torch.cuda.synchronize(dev)
            self.load_seconds += time.perf_counter() - t
            self.loads += 1
            self.instances[(name, block)] = inst
        return inst

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
            except Exception:  # the copy is made again when a request needs it
                log.exception("prefetching %s failed", load.model)

        self.tasks.spawn(copy(), lambda: Loaded(load.key))

    def close_session(self, trajectory: str) -> None:
        pass

    async def _run(self, action: Action, allocation: Allocation) -> Completion:
        name = action.model or ""
        call: ModelCall = action.payload
        t0 = time.perf_counter()
        result, message, outcome, setup_s = None, "", Outcome.OK, 0.0
        try:
            self._evict(allocation.evict)
            inst = await asyncio.to_thread(self._instance, name, allocation.units)
            setup_s = time.perf_counter() - t0
            op = self.loaded[name].ops[call.op]
            result = await asyncio.to_thread(_run_op, op, inst, call.batch, self.cuda)
        except torch.cuda.OutOfMemoryError as e:
            outcome, message = Outcome.OOM, f"GPU out of memory: {e}"
        except Exception as e:  # a fault of the model code or the device: ours, not the caller's input
            log.exception("model call %s on %s failed", action.id, name)
            outcome, message = Outcome.INFRA_ERROR, f"model service {name} failed: {type(e).__name__}: {e}"
        exec_s = time.perf_counter() - t0 - setup_s
        return Completion(action.id, outcome, setup_s, exec_s, message, result)

    async def shut_down(self) -> None:
        await self.tasks.close()
        self.instances.clear()
        for ld in self.loaded.values():
            _unpin(ld.pinned)  # before the host tensors are freed
            ld.pinned = []


def _run_op(op: Callable, inst: torch.nn.Module, batch: list, cuda: bool):
    out = op(inst, batch)
    if cuda:
        torch.cuda.synchronize()
    return out
