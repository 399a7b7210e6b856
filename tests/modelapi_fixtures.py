"""Model directories for the model-protocol tests: tiny Llama, Qwen2 and a Qwen2 reward model
with random weights, each with a byte-level BPE tokenizer built with ``tokenizers`` (trained here
on a few sentences) and a ChatML chat template in its tokenizer config, saved with
``save_pretrained`` as a downloaded model lies on disk. Nothing is downloaded."""

from __future__ import annotations

import os

#: the specials, first: ids 0, 1, 2 (the config's bos and eos name them)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, IM_START, EOS = 0, 1, 2
VOCAB = 320

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from verifiable rewards trains a policy on its own samples.",
    "def add(a, b):\n    return a + b\n",
    "What is the capital of France? Paris is the capital of France.",
    "system user assistant: hello, how are you today? I am fine, thank you.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > ! ? , . ; :",
]


def tokenizer(path: str):
    """A byte-level BPE tokenizer of ``VOCAB`` ids with ChatML's specials, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def save_model(path, arch: str, *, seed: int = 0, positions: int = 128, layers: int = 2, labels: int = 1,
               tokenizer_too: bool = True) -> str:
    """A tiny ``arch`` (``llama``, ``qwen2``: causal LMs; ``qwen2-rm``: a reward model with
    ``labels`` outputs) with random weights, its EOS the tokenizer's ``<|im_end|>``."""
    import torch
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2ForSequenceClassification)

    path = str(path)
    os.makedirs(path, exist_ok=True)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                 bos_token_id=BOS, eos_token_id=EOS, pad_token_id=BOS)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif arch == "qwen2-rm":
        model = Qwen2ForSequenceClassification(Qwen2Config(**shape, num_labels=labels))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random, but answers that differ per token
        for p in model.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    if arch != "qwen2-rm":
        model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=BOS)
    model.save_pretrained(path)
    if tokenizer_too:
        tokenizer(path)
    return path
