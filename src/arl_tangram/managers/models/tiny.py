"""Transformer models built from a config with random weights (nothing is downloaded): a reward
model (``score``: sequence -> scalar) and a teacher (``logprobs``: per-token log-probabilities).
Sizes from a few MB for tests to billions of parameters for GPU benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import graphs


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 512
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    seed: int = 0
    dtype: str = "float32"
    init_device: str = "cpu"  # where random weights are drawn (a GPU is much faster for billions)

    @classmethod
    def of_size(cls, billions: float, vocab: int = 32000, dtype: str = "bfloat16", seed: int = 0) -> "TinyConfig":
        """A config of about ``billions`` parameters (12 d^2 per layer, 32 layers or fewer), with
        heads of 128 and an even number of them: an odd count sends ``nn.MultiheadAttention`` down
        its slow path, whose input projection over a batch-first input of 2+ rows runs as 512
        products of 2 rows each, every one reading the whole weight (a 7B's 33 heads: 340 ms for a
        2 x 512 batch against ~25 ms)."""
        layers = 32 if billions >= 3 else 24 if billions >= 1 else 16
        d = int(((billions * 1e9 - 2 * vocab * 1024) / (12 * layers)) ** 0.5) // 256 * 256
        return cls(vocab=vocab, d_model=max(128, d), layers=layers, heads=max(2, d // 128), seed=seed, dtype=dtype)


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig, head: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, 4 * cfg.d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, 1 if head == "score" else cfg.vocab)
        self.head = head

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), 1)
        pad = torch.arange(n, device=ids.device)[None, :] >= lengths[:, None]
        h = self.blocks(self.embed(ids), mask=causal.to(self.embed.weight.dtype),
                        src_key_padding_mask=pad.to(self.embed.weight.dtype).masked_fill(pad, float("-inf")),
                        is_causal=False)
        return self.out(self.norm(h))


def _build(cfg: TinyConfig, head: str) -> TinyTransformer:
    dev = torch.device(cfg.init_device)
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    with torch.device("meta"):
        model = TinyTransformer(cfg, head)
    model = model.to_empty(device=dev).to(getattr(torch, cfg.dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32) * 0.02)
    return model.to("cpu").eval()


def _pad(seqs: list[list[int]], device, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and lengths of ``shape`` (rows, length); rows past the batch are one token long."""
    rows, n = shape
    ids = torch.zeros((rows, n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs] + [1] * (rows - len(seqs)))
    return ids.to(device, non_blocking=True), lengths.to(device, non_blocking=True)


def _scores(model: TinyTransformer, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    out = model(ids, lengths)[:, :, 0].float()
    last = (lengths - 1).to(out.device)
    return out[torch.arange(ids.shape[0], device=out.device), last]


def _logprobs(model: TinyTransformer, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    logits = model(ids, lengths).float().log_softmax(-1)
    return logits[:, :-1].gather(-1, ids[:, 1:, None].to(logits.device))[..., 0]


# The ops take the model's output where it comes out: on the last GPU of a multi-GPU copy. Their
# tensor work is one function of tensors, so a copy with CUDA graphs replays it (``graphs``).

@torch.inference_mode()
def score(model: TinyTransformer, seqs: list[list[int]]) -> list[float]:
    """Reward of each sequence: the head's value at its last token."""
    ids, lengths = _pad(seqs, model.embed.weight.device, graphs.shape_of(model, seqs))
    out = graphs.forward(model, "score", lambda i, n: _scores(model, i, n), ids, lengths)
    return out[:len(seqs)].tolist()


@torch.inference_mode()
def logprobs(model: TinyTransformer, seqs: list[list[int]]) -> list[list[float]]:
    """log p(token_t | tokens_<t) for t = 1..len-1 of each sequence."""
    ids, lengths = _pad(seqs, model.embed.weight.device, graphs.shape_of(model, seqs))
    picked = graphs.forward(model, "logprobs", lambda i, n: _logprobs(model, i, n), ids, lengths).cpu()
    return [picked[i, :len(s) - 1].tolist() for i, s in enumerate(seqs)]


def reward_model(**config) -> tuple[nn.Module, dict]:
    """Loader: ``arl_tangram.managers.models.tiny:reward_model``."""
    model = _build(TinyConfig(**config), "score")
    return model, {"score": score}


def teacher_model(**config) -> tuple[nn.Module, dict]:
    """Loader: ``arl_tangram.managers.models.tiny:teacher_model``."""
    model = _build(TinyConfig(**config), "logprobs")
    return model, {"logprobs": logprobs}
