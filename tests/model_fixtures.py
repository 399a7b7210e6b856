"""Model loaders for tests: behaviour a real service can show (slowness, failures), built from the
tiny random-weight transformer."""

from __future__ import annotations

import time

from arl_tangram.managers.models import tiny


def slow_reward_model(delay_s: float = 1.0):
    """The tiny reward model whose ``score`` takes ``delay_s`` per batch."""
    module, ops = tiny.reward_model()
    score = ops["score"]

    def slow_score(m, batch):
        time.sleep(delay_s)
        return score(m, batch)

    return module, {"score": slow_score}


# -- Hugging Face model directories with random weights, built from configs (nothing downloaded)
def save_hf(path, arch: str, *, vocab: int = 96, layers: int = 2, positions: int = 64, tied: bool = False,
            seed: int = 0, labels: int = 1) -> str:
    """A tiny ``arch`` model (``llama``, ``qwen2``: causal LMs; ``qwen2-rm``: a Qwen2
    sequence-classification reward model with ``labels`` outputs) saved with ``save_pretrained`` to
    ``path``, as a user's downloaded model would lie there; returns the path."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2ForSequenceClassification)

    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                 tie_word_embeddings=tied)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif arch == "qwen2-rm":
        model = Qwen2ForSequenceClassification(Qwen2Config(**shape, num_labels=labels, pad_token_id=0))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random, but not the init's near-zeros: answers that differ per token
        for p in model.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    model.save_pretrained(str(path))
    return str(path)


def hf_reference(path: str, task: str, seq: list[int]):
    """transformers' own float32 answer for one unpadded sequence: the log-probabilities of tokens
    1..n-1 (``logprobs``) or the classification head's output (``score``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "logprobs" else AutoModelForSequenceClassification
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits.float()
    if task == "score":
        row = logits[0].tolist()
        return row[0] if len(row) == 1 else row
    lp = logits[0].log_softmax(-1)
    return [lp[i - 1, seq[i]].item() for i in range(1, len(seq))]


def llama_loader(path: str):
    """A custom loader (not ``hf``) that returns a transformers Llama loaded the usual way."""
    from transformers import AutoModelForCausalLM

    from arl_tangram.managers.models import hf

    return AutoModelForCausalLM.from_pretrained(path).eval(), {"logprobs": hf.logprobs}
