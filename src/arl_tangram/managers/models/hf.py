"""Model services from a local Hugging Face directory (``config.json`` + ``*.safetensors``).

What the model manager needs from a checkpoint is a module skeleton (no weights in it), the
weights in host memory, and the ops. This module builds them so that every weight is in host
memory once:

* the skeleton comes from transformers' Auto class for the task (``from_config``), built with its
  *parameters* on the meta device (no memory, no random init) and its *buffers* real: buffers that
  are not in the checkpoint (a Llama's rotary ``inv_freq``, non-persistent) are computed by the
  modules' constructors, and the manager carries every parameter and buffer to the GPU;
* the weights are read straight from the safetensors files (their format: an 8-byte header length,
  a JSON header of dtype, shape and byte range, then the bytes) into one host buffer, cast to the
  service's ``dtype`` tensor by tensor as they are read. ``from_pretrained`` would build the
  model's own tensors first: a second host copy of every weight beside the one we page-lock, and
  it may reach for the network. The one buffer is page-locked with one ``cudaHostRegister``.

The ops run the model's own ``forward`` (so an architecture's own details — logit soft-capping,
scaled embeddings — stay in), right-padded with an attention mask: padding and batching change
no answer (tests compare with transformers' own float32 computation, one sequence at a time).
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import graphs, packing
from .spec import ModelDirError, hf_dir_problem

#: safetensors dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

#: alignment of each tensor in the host buffer (any dtype's, and a 64-byte line)
_ALIGN = 64


@dataclass
class HfModel:
    """A checkpoint made ready for the model manager."""

    module: nn.Module  # parameters on meta, buffers real (on the CPU)
    tensors: dict[str, torch.Tensor]  # parameter (and persistent buffer) name -> view of ``storage``
    storage: torch.Tensor | None  # the one host buffer every checkpoint tensor lies in (uint8)
    ops: dict[str, Callable]
    vocab: int
    max_positions: int | None


@dataclass(frozen=True)
class _Entry:
    file: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _index(path: str) -> dict[str, _Entry]:
    """Every tensor of every ``*.safetensors`` file under ``path``, by its checkpoint key."""
    out: dict[str, _Entry] = {}
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= 100 * (1 << 20):
                    raise ValueError(f"header length {n}")
                header = json.loads(fh.read(n))
            size = os.path.getsize(file)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(f"tensor {key}: dtype {meta['dtype']} is not supported")
                if not 0 <= begin <= end <= size - 8 - n:
                    raise ValueError(f"tensor {key}: bytes {begin}..{end} lie outside the file")
                out[key] = _Entry(file, key, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + begin, end - begin)
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"not a safetensors file ({e})"
            raise ModelDirError(f"hf: cannot read {file}: {why}") from None
    return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real. Patches
    ``nn.Module.register_parameter`` for the duration (process-wide: models are built before the
    service starts, in one thread): a parameter is created (``torch.empty``, pages never touched)
    and moved to meta at once, before its module initialises it."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _skeleton(path: str, task: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers says what is wrong with the config; we add where
        raise ModelDirError(f"hf: {path}/config.json: {type(e).__name__}: {e}") from None
    auto = AutoModelForCausalLM if task == "logprobs" else AutoModelForSequenceClassification
    try:
        with _parameters_on_meta():
            module = auto.from_config(config, dtype=dtype)
    except ValueError as e:  # an architecture with no model for this task
        raise ModelDirError(f"hf: {path}: no {task} model for this config ({e})") from None
    return module.eval()


def _find(name: str, aliases: list[str], index: dict[str, _Entry], prefix: str) -> _Entry | None:
    """The checkpoint entry of a parameter known by ``aliases`` (tied weights have several names);
    also under the base model's prefix added or taken off (a checkpoint saved from the bare model,
    or a task model loaded from another task's checkpoint)."""
    for n in aliases:
        for key in (n, f"{prefix}.{n}", n.removeprefix(f"{prefix}.")):
            if key in index:
                return index[key]
    return None


def _read(entries: dict[str, _Entry], cast: dict[str, torch.dtype],
          place: Callable[[dict[str, tuple[torch.dtype, tuple[int, ...]]]], tuple[dict[str, int], int]] | None = None,
          ) -> tuple[torch.Tensor | None, dict]:
    """Read ``entries`` into one host buffer, every file in a thread of its own (reads from the
    page cache run at memory speed; several files go in parallel). ``place`` says where each
    tensor lies in the buffer and how big the buffer is (the model manager's packed layout, which
    may hold more than the checkpoint: buffers its constructor made); by default in order."""
    shapes = {name: (cast[name], e.shape) for name, e in entries.items()}
    if place is not None:
        offsets, total = place(shapes)
    else:
        offsets, total = {}, 0
        for name, e in entries.items():
            offsets[name] = total
            n = e.nbytes // max(1, e.dtype.itemsize) * cast[name].itemsize
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    storage = packing.host_buffer(total) if total else None
    tensors: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        n = e.nbytes // max(1, e.dtype.itemsize) * cast[name].itemsize
        tensors[name] = storage[offsets[name]:offsets[name] + n].view(cast[name]).view(e.shape)  # type: ignore

    def read_file(file: str) -> None:
        with open(file, "rb", buffering=0) as fh:
            for name, e in sorted(((k, v) for k, v in entries.items() if v.file == file), key=lambda kv: kv[1].start):
                dst = tensors[name]
                if e.dtype == dst.dtype:
                    view = memoryview(storage[offsets[name]:offsets[name] + e.nbytes].numpy())  # type: ignore
                else:  # cast as read: one tensor's bytes at a time beside the buffer, never a model's
                    view = memoryview(bytearray(e.nbytes))
                got = 0
                while got < e.nbytes:
                    k = os.preadv(fh.fileno(), [view[got:]], e.start + got)
                    if k <= 0:
                        raise ModelDirError(f"hf: cannot read {file}: it ends inside tensor {e.key}")
                    got += k
                if e.dtype != dst.dtype and e.nbytes:
                    dst.copy_(torch.frombuffer(view, dtype=e.dtype).view(e.shape))

    files = sorted({e.file for e in entries.values()})
    with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
        for f in pool.map(read_file, files):
            pass
    return storage, tensors


def load(path: str, task: str, dtype: str | None = None,
         layout_for: Callable[[nn.Module, dict[str, tuple[torch.dtype, tuple[int, ...]]]], Any] | None = None,
         ) -> HfModel:
    """Read the model at ``path`` for ``task`` (``logprobs`` or ``score``), floating-point weights
    cast to ``dtype`` (default: as stored). ``layout_for(skeleton, {name: (dtype, shape)})``, if
    given, returns a ``packing.Layout`` the weights are read into (so they are packed for loading
    with no second host copy). Raises ``ModelDirError`` naming the path."""
    problem = hf_dir_problem(path)
    if problem is not None:
        raise ModelDirError(problem)
    index = _index(path)
    floats = [e.dtype for e in index.values() if e.dtype.is_floating_point]
    target = getattr(torch, dtype) if dtype else (max(set(floats), key=floats.count) if floats else torch.float32)
    module = _skeleton(path, task, target)
    prefix = getattr(module, "base_model_prefix", "") or "model"
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    entries: dict[str, _Entry] = {}
    missing = []
    for aliases in names.values():
        e = _find(aliases[0], aliases, index, prefix)
        if e is None:
            missing.append(aliases[0])
        else:
            entries[aliases[0]] = e
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelDirError(f"hf: {path} has no weights for {', '.join(missing[:3])}{more} "
                            f"(is it a {'causal LM' if task == 'logprobs' else 'sequence-classification'} model?)")
    for n, _ in module.named_buffers():  # persistent buffers saved in the checkpoint win over the constructor's
        e = _find(n, [n], index, prefix)
        if e is not None:
            entries[n] = e
    cast = {n: target if e.dtype.is_floating_point and n in {a[0] for a in names.values()} else e.dtype
            for n, e in entries.items()}
    for n, e in entries.items():
        p = module.get_parameter(n) if n in {a[0] for a in names.values()} else None
        if p is not None and tuple(p.shape) != e.shape:
            raise ModelDirError(f"hf: {path}: {e.key} has shape {list(e.shape)}, the config makes "
                                f"{n} {list(p.shape)}")
    def place(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, int], int]:
        assert layout_for is not None
        lay = layout_for(module, shapes)
        return {n: lay.at(n) for n in shapes}, lay.total

    storage, tensors = _read(entries, cast, place if layout_for is not None else None)
    emb = module.get_input_embeddings()
    config = module.config
    max_pos = getattr(config, "max_position_embeddings", None)
    ops = {"logprobs": logprobs} if task == "logprobs" else {"score": score}
    return HfModel(module, tensors, storage, ops, emb.num_embeddings, int(max_pos) if max_pos else None)


def _batch(model: nn.Module, seqs: list[list[int]], max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask on the model's first device, of the batch's shape (its
    graph bucket where the copy has graphs: rows past the batch attend to one token). The pad id
    is never attended to: any id does."""
    device = model.get_input_embeddings().weight.device
    rows, n = graphs.shape_of(model, seqs, max_len)
    ids = torch.zeros((rows, n), dtype=torch.long)
    mask = torch.zeros((rows, n), dtype=torch.long)
    mask[len(seqs):, 0] = 1
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    if device.type == "cuda":
        ids, mask = ids.pin_memory().to(device, non_blocking=True), mask.pin_memory().to(device, non_blocking=True)
    else:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask


def _max_len(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p(t_i | t_<i) at every position of every row, float32, (rows, length - 1). The
    log-softmax runs one row at a time: a batch's float32 logits at once would be rows x length x
    vocab x 4 bytes (5 GB for 16 x 512 tokens of a 150k vocabulary)."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    targets = ids[:, 1:].to(logits.device)
    return torch.stack([logits[i, :-1].float().log_softmax(-1).gather(-1, targets[i, :, None])[:, 0]
                        for i in range(ids.shape[0])])


def _scores(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = (mask.sum(1) - 1).to(hidden.device)  # right padding: the last real token
    pooled = hidden[torch.arange(ids.shape[0], device=hidden.device), last]
    head = getattr(model, "score", None) or getattr(model, "classifier")
    return head(pooled.to(head.weight.device)).float()


@torch.inference_mode()
def logprobs(model: nn.Module, seqs: list[list[int]]) -> list[list[float]]:
    """log p(t_i | t_<i) for i = 1..n-1 of each sequence, in float32 (one copy to the host)."""
    ids, mask = _batch(model, seqs, _max_len(model))
    host = graphs.forward(model, "logprobs", lambda i, m: _logprobs(model, i, m), ids, mask).cpu()
    return [host[i, :len(s) - 1].tolist() for i, s in enumerate(seqs)]


@torch.inference_mode()
def score(model: nn.Module, seqs: list[list[int]]) -> list:
    """The classification head at each sequence's last token (a float for one label, else a list).
    The model's base runs with the attention mask and the head is applied at the last real token
    here: transformers' own pooling looks for the last token that is not the pad id, which a
    sequence may legitimately contain, and needs a pad id in the config to batch at all."""
    ids, mask = _batch(model, seqs, _max_len(model))
    out = graphs.forward(model, "score", lambda i, m: _scores(model, i, m), ids, mask).cpu()
    return [row[0] if len(row) == 1 else row for row in out[:len(seqs)].tolist()]
