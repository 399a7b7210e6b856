"""What a model service is and what one batch to it carries: plain data, no torch.

The embedded API, the server's config and the clients name model services through these records;
only ``manager`` (which serves them) imports torch, so everything else runs where torch is not
installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

#: what a user without torch is told when a model service is configured
INSTALL_HINT = "model services need torch: pip install 'arl-tangram[models]'"


def require_torch() -> None:
    """Raise ``ModuleNotFoundError`` with the install line when torch is missing (before any
    model service is built: one line, not a traceback from deep inside an import)."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(INSTALL_HINT, name="torch") from e


#: what a Hugging Face directory's model answers: ``logprobs`` (a causal LM: log p(t_i | t_<i) for
#: i = 1..n-1) or ``score`` (a sequence-classification head at the last token)
HF_TASKS = ("logprobs", "score")

#: the dtypes a service may name (``dtype``); floating-point weights are cast to it as they are read
DTYPES = ("float32", "bfloat16", "float16")


class ModelDirError(ValueError):
    """A Hugging Face model directory that cannot be served (missing, unreadable, incomplete); the
    message names the path. Raised when the service starts, not contained to the service: a
    configuration that names a model which is not there is a configuration error."""


def hf_dir_problem(path: str) -> str | None:
    """Why ``path`` is not a servable Hugging Face directory (``config.json`` and ``*.safetensors``
    files, all readable), or None. Cheap (headers are not read): the config check of ``tangram
    serve`` runs it before anything loads."""
    if not os.path.isdir(path):
        return f"hf: {path} is not a directory" if os.path.exists(path) else f"hf: {path} does not exist"
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as fh:
            json.load(fh)
    except OSError as e:
        return f"hf: cannot read {cfg}: {e.strerror}"
    except ValueError as e:
        return f"hf: {cfg} is not valid JSON: {e}"
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    except OSError as e:
        return f"hf: cannot list {path}: {e.strerror}"
    if not names:
        return f"hf: {path} holds no *.safetensors weights (other formats are not read)"
    for n in names:
        if not os.access(os.path.join(path, n), os.R_OK):
            return f"hf: cannot read {os.path.join(path, n)}"
    return None


@dataclass
class ModelServiceConfig:
    """A model service, from one of two sources:

    * ``hf``: a local Hugging Face directory (``config.json`` + safetensors; nothing is downloaded)
      and its ``task`` (``HF_TASKS``); ``dtype`` casts its floating-point weights (default: as
      stored);
    * ``loader``: ``module:function`` returning ``(torch module, {op: fn})`` where ``fn(module,
      batch) -> list`` (``score``: sequences -> scalars; ``logprobs``: sequences -> per-token
      log-probabilities), for custom code.
    """

    name: str
    loader: str | None = None
    kwargs: dict = field(default_factory=dict)
    gpus: int = 1
    memory_gb: float | None = None  # per instance; default: the weights plus 20% for activations
    max_batch: int = 16
    max_wait_ms: float = 5.0
    # compute_share, of each GPU per batch: < 1 lets other services' batches run beside it on their
    # own streams. 1 (one batch per GPU at a time, in the policy's SRPT order) is the default because
    # it does best on the MOPD-style bench (``bench models``; docs/models.md): these eager PyTorch
    # batches are bound by kernel launches, so overlapping them adds contention for the interpreter
    # and the SMs and turns SRPT order into processor sharing. Shares pay off where a
    # batch leaves most of its GPU idle for long (small batches of big kernels, CUDA graphs).
    compute_share: float = 1.0
    idle_s: float | None = None  # a copy unused this long releases its GPU memory (None: kept while it fits)
    hf: str | None = None  # a local Hugging Face model directory (instead of ``loader``)
    task: str | None = None  # with ``hf``: one of HF_TASKS
    dtype: str | None = None  # with ``hf``: one of DTYPES (default: the checkpoint's own)

    def __post_init__(self) -> None:
        if (self.loader is None) == (self.hf is None):
            raise ValueError(f"model {self.name!r}: give exactly one of loader (module:function) and hf (a directory)")
        if self.hf is not None and self.task not in HF_TASKS:
            raise ValueError(f"task: model {self.name!r} from hf needs task = one of {', '.join(HF_TASKS)}, "
                             f"got {self.task!r}")
        if self.hf is None and self.task is not None:
            raise ValueError(f"task: model {self.name!r}: task goes with hf (a loader returns its ops)")
        if self.hf is None and self.dtype is not None:
            raise ValueError(f"dtype: model {self.name!r}: dtype goes with hf (a loader's kwargs choose its own)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: model {self.name!r}: one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class ModelCall:
    """One batch of requests to one operation of a service."""

    op: str
    batch: list


@dataclass(frozen=True)
class ModelCard:
    """What a caller's request is checked against, as plain data: a loaded service's operations,
    vocabulary size and longest sequence (None: unknown). The model manager makes one per loaded
    service (``ModelManager.cards``); a head without GPUs (``RemoteModels``) checks requests
    against the cards its GPU nodes sent, before anything crosses to a node."""

    name: str
    ops: tuple[str, ...]
    vocab: int | None = None
    max_len: int | None = None


def call_problem(cards: dict[str, ModelCard], failed: dict[str, str], model: str, op: str, tokens,
                 min_len: int) -> str | None:
    """Why a request to ``model``'s ``op`` with ``tokens`` cannot run (a message naming the
    field), or None; the same checks as ``ModelManager.validate``."""
    if model in failed:
        return f"service: model {model!r} failed to load ({failed[model]})"
    card = cards.get(model)
    if card is None:
        return f"service: unknown model {model!r}"
    if op not in card.ops:
        return f"op: model {model!r} has no {op!r} (it has {', '.join(card.ops)})"
    if not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
        return "tokens: must be a flat list of integer token ids"
    if not tokens:
        return f"tokens: empty; {op} needs at least {min_len} token(s)"
    if len(tokens) < min_len:
        return f"tokens: {op} needs at least {min_len} token(s), got {len(tokens)}"
    if card.max_len is not None and len(tokens) > card.max_len:
        return f"tokens: {len(tokens)} tokens, longer than model {model!r}'s {card.max_len} positions"
    bad = [t for t in tokens if t < 0 or (card.vocab is not None and t >= card.vocab)]
    if bad:
        return f"tokens: id {bad[0]} out of range [0, {card.vocab}) of model {model!r}'s vocabulary"
    return None
