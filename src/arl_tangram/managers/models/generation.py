"""What one request to a model's ``generate`` or ``classify`` operation carries, and what it
answers: plain data, no torch.

The HTTP dialects (``server/modelapi/``) build these from their bodies; the model manager's ops
(``decode.py``) carry them out where the weights and the tokenizer are, so that text, chat
messages and stop strings are handled beside the model (on a Ray cluster, on its GPU node). A
request whose input turns out to be bad there (a prompt past the context once templated, a
model without a tokenizer asked for text) gets its own ``error`` and the rest of its batch runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: how a ``Generated`` or ``Classified`` ended: the model stopped (EOS, a stop id or string), or
#: it reached ``max_new_tokens`` or the model's context
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Sampling:
    """How the next tokens are chosen and when generation stops. ``temperature`` 0 is greedy
    (argmax); ``top_k`` 0 and ``top_p`` 1 keep every token. ``seed``: the draws of this request
    come from its own generator, so the same request draws the same tokens whatever it is batched
    with. ``max_new_tokens`` None: up to the model's context."""

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass
class Generate:
    """One prompt: token ids, text (tokenized by the model's tokenizer), or chat ``messages``
    (the model's chat template, applied as transformers applies it). Which log-probabilities come
    back: ``prompt_logprobs_from`` (None: none; k: from prompt position k, SGLang's
    ``logprob_start_len``), ``output_logprobs``, ``top_logprobs`` alternatives per position, and
    whether they are of the temperature-scaled distribution (``scaled_logprobs``, SGLang's) or of
    the model's own (the OpenAI dialect's, and the native API's). ``pieces``: the text of every
    token in the answer (``Generated.pieces``)."""

    ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling: Sampling = field(default_factory=Sampling)
    prompt_logprobs_from: int | None = None
    output_logprobs: bool = False
    top_logprobs: int = 0
    scaled_logprobs: bool = False
    pieces: bool = False


@dataclass
class Generated:
    """One request's answer. ``error`` (the caller's input, a message naming the field) or the
    rest: the prompt's ids, the generated ids (a stop token included), their text (special tokens
    skipped as asked, cut before a stop string), how it finished and on what (``matched``: the
    stop id or string), and the log-probabilities asked for: ``prompt_logprobs`` from position
    ``prompt_logprobs_from`` (None for position 0, which nothing predicts), ``*_top``: per
    position, the ``top_logprobs`` most likely (id, log-probability), best first."""

    error: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = FINISH_LENGTH
    matched: int | str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1: the likeliest)
    output_logprobs: list[float] | None = None
    output_top: list[list[tuple[int, float]]] | None = None
    pieces: dict[int, str] = field(default_factory=dict)
    prompt_text: str | None = None  # the prompt's tokens decoded, special tokens kept (with ``pieces``)


@dataclass
class Classify:
    """One input to a score model: token ids, text or chat messages (templated without a
    generation prompt)."""

    ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True


@dataclass
class Classified:
    """The head's outputs at the input's last token (one per label), how many tokens it had, and
    the labels' names (the model config's ``id2label``); or the caller's ``error``."""

    error: str | None = None
    values: list[float] = field(default_factory=list)
    tokens: int = 0
    labels: list[str] = field(default_factory=list)
