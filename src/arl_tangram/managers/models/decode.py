"""Generation for a causal LM service, and text inputs for a score model: the ops ``generate`` and
``classify`` (requests and answers: ``generation.py``).

``generate`` runs one batch of requests to one model as one decode loop with a KV cache: a prefill
of every prompt at once, then one forward a step for the rows still generating, each row leaving
the batch (its cache rows dropped) as soon as it stops: at an EOS id (the model directory's
``generation_config.json``, else its config), at a stop id or string, at ``max_new_tokens`` or at
the model's context. The batch is one action of the engine, so it runs under the model services'
GPU sharing, residency and scale to zero as every other batch does.

Prompts are right-padded as the native ops pad them, and decoding appends after the longest: a
row's new token sits at its own position (``position_ids``) and the padding between its prompt and
its first new token stays masked out. A prompt's log-probabilities are read from the prefill's
logits exactly as the native ``logprobs`` op computes them (float32 log-softmax of the same
forward), so both answer the same numbers for the same tokens.

A request with an ``on_token`` (the model protocols' streamed request) is handed each of its
tokens as it is chosen, in the loop's thread, with the text it adds once settled (``_emit``).

Tokenizer and chat template come from the model directory, applied as transformers applies them
(``apply_chat_template`` renders the text, which is then tokenized without special tokens). A
request whose input is bad once seen here (a templated prompt past the context, text for a model
without a tokenizer) gets its own error; the rest of the batch runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import hf
from .generation import FINISH_LENGTH, FINISH_STOP, Classified, Classify, Generate, Generated, Sampling

log = logging.getLogger(__name__)

#: the ops each task of a Hugging Face service gets beside its own (``hf.load``'s)
TASK_OPS = {"logprobs": ("generate",), "score": ("classify",)}
#: ops whose batches a copy's warm-up runs but does not judge graphs by: ``generate``'s decode
#: steps run eagerly, and ``classify`` replays the ``score`` op's graphs, which that op's own
#: warm-up judges (judging them again could drop graphs that pay for the other op)
EAGER_OPS = frozenset(("generate", "classify"))


class InputError(ValueError):
    """The request's input cannot run on this model (the message names the field)."""


class Codec:
    """The model directory's tokenizer (transformers' ``AutoTokenizer``, nothing downloaded), or
    none: then only token ids are taken."""

    def __init__(self, path: str | None, name: str) -> None:
        self.name = name
        self.tokenizer = None
        self._pieces: dict[int, str] = {}  # token id -> its own text (``pieces``)
        try:
            from transformers import AutoTokenizer

            if path is not None and any(os.path.exists(os.path.join(path, f)) for f in
                   ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
                self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # a directory without a usable tokenizer still serves token ids
            log.warning("model %s: no tokenizer from %s (%s: %s); it takes token ids only", name, path,
                        type(e).__name__, e)

    def _need(self, field_: str):
        if self.tokenizer is None:
            raise InputError(f"{field_}: model {self.name!r} has no tokenizer in its directory; send token ids")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True, field_: str = "text") -> list[int]:
        """``text``'s ids as the tokenizer makes them; a fast tokenizer's own (Rust) encoder is
        called directly: the same ids (its post-processor adds the special tokens) for a tenth
        of the wrapper's time."""
        if not isinstance(text, str):
            raise InputError(f"{field_}: must be a string")
        tok = self._need(field_)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render(self, messages: list[dict], add_generation_prompt: bool, continue_final: bool = False,
               kwargs: dict | None = None) -> str:
        """The chat template's text for ``messages`` (the directory's template, as transformers
        renders it)."""
        tok = self._need("messages")
        if getattr(tok, "chat_template", None) is None:
            raise InputError(f"messages: model {self.name!r} has no chat template in its directory; send a prompt")
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final, **(kwargs or {}))
        except Exception as e:  # the template refused the conversation (its raise_exception, a missing key)
            raise InputError(f"messages: the chat template refused them: {e}") from None

    def chat(self, messages: list[dict], add_generation_prompt: bool, continue_final: bool = False,
             kwargs: dict | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt, continue_final, kwargs), False, "messages")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text (as the OpenAI API's ``tokens`` and top log-probabilities show
        it). A token's text never changes, so each is decoded once (one call into the tokenizer
        for the ones not seen yet) and kept: at most the vocabulary's size, and a prompt's
        tokens are mostly ones seen before (decoding 32 of them took more than the rest of an
        OpenAI request's own work)."""
        known = self._pieces
        new = sorted(t for t in ids if t not in known)
        if new:
            if self.tokenizer is None:
                texts = [f"token_id:{t}" for t in new]
            else:
                backend = getattr(self.tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own (Rust)
                texts = (backend.decode_batch([[t] for t in new], skip_special_tokens=False) if backend is not None
                         else self.tokenizer.batch_decode([[t] for t in new], skip_special_tokens=False))
            known.update(zip(new, texts))
        return {t: known[t] for t in ids}


def eos_ids(path: str, module: nn.Module, codec: Codec) -> frozenset[int]:
    """The ids generation stops at: the directory's ``generation_config.json`` (what
    transformers' ``generate`` stops at), else the model config's, else the tokenizer's."""
    ids: Any = None
    try:
        with open(os.path.join(path, "generation_config.json")) as fh:
            ids = json.load(fh).get("eos_token_id")
    except (OSError, ValueError):
        pass
    if ids is None:
        ids = getattr(module.config, "eos_token_id", None)
    if ids is None and codec.tokenizer is not None:
        ids = codec.tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset(ids if isinstance(ids, (list, tuple)) else [ids])


def ops_for(path: str, task: str, name: str, module: nn.Module) -> dict[str, Callable]:
    """The ops ``task``'s service gets from this module, bound to the directory's tokenizer."""
    codec = Codec(path, name)
    if task == "logprobs":
        eos = eos_ids(path, module, codec)

        def generate_op(model: nn.Module, batch: list) -> list[Generated]:
            return generate(model, codec, eos, batch)

        return {"generate": generate_op}
    if task == "score":
        labels = _labels(module)

        def classify_op(model: nn.Module, batch: list) -> list[Classified]:
            return classify(model, codec, labels, batch)

        return {"classify": classify_op}
    return {}


def _labels(module: nn.Module) -> list[str]:
    id2label = getattr(module.config, "id2label", None) or {}
    n = getattr(module.config, "num_labels", len(id2label)) or len(id2label)
    return [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n)]


def _limits(model: nn.Module) -> tuple[int, int | None]:
    vocab = model.get_input_embeddings().num_embeddings
    pos = getattr(model.config, "max_position_embeddings", None)
    return vocab, int(pos) if pos else None


def _check_ids(ids: Any, vocab: int, field_: str = "input_ids") -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):
        raise InputError(f"{field_}: must be a flat list of integer token ids")
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        raise InputError(f"{field_}: id {bad[0]} out of range [0, {vocab}) of the model's vocabulary")
    return list(ids)


def _prompt(codec: Codec, req: Generate, vocab: int) -> list[int]:
    given = [x is not None for x in (req.ids, req.text, req.messages)]
    if sum(given) != 1:
        raise InputError("prompt: give exactly one of token ids, text and messages")
    if req.ids is not None:
        ids = _check_ids(req.ids, vocab)
    elif req.text is not None:
        ids = codec.encode(req.text, req.add_special_tokens)
    else:
        ids = codec.chat(req.messages or [], req.add_generation_prompt and not req.continue_final_message,
                         req.continue_final_message, req.template_kwargs)
    if not ids:
        raise InputError("prompt: empty (no tokens)")
    return ids


# -- generate ----------------------------------------------------------------------------------------

@dataclass
class _Row:
    """One request's state in the loop."""

    index: int
    req: Generate
    prompt: list[int]
    budget: int  # tokens it may still generate
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str = FINISH_LENGTH
    matched: int | str | None = None
    done: bool = False
    generator: torch.Generator | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # a streamed request's (``_emit``): its sink, the window of tokens its settled text is decoded
    # in (from ``seen`` to ``read``), that text, and how much of it was handed on
    on_token: Callable[..., None] | None = None
    seen: int = 0
    read: int = 0
    said: str = ""
    sent: int = 0

    @property
    def s(self) -> Sampling:
        return self.req.sampling

    @property
    def greedy(self) -> bool:
        return self.s.temperature <= 0 or self.s.top_k == 1


def _as_request(item: Any) -> Generate:
    """A bare token list (the model manager's warm-up) is a prompt to extend by one token."""
    if isinstance(item, Generate):
        return item
    return Generate(ids=list(item), sampling=Sampling(max_new_tokens=1, temperature=0.0))


@torch.inference_mode()
def generate(model: nn.Module, codec: Codec, eos: frozenset[int], batch: list) -> list[Generated]:
    """Carry out a batch of ``Generate`` requests on ``model`` (one decode loop for all)."""
    vocab, max_pos = _limits(model)
    answers: list[Generated | None] = [None] * len(batch)
    rows: list[_Row] = []
    for i, item in enumerate(batch):
        req = _as_request(item)
        try:
            prompt = _prompt(codec, req, vocab)
            want = req.sampling.max_new_tokens
            if want is not None and want < 0:
                raise InputError(f"max_new_tokens: must be at least 0, got {want}")
            room = max_pos - len(prompt) if max_pos is not None else None
            if room is not None and room < 0 or (room is not None and want is not None and want > room):
                raise InputError(f"prompt: {len(prompt)} tokens{f' + {want} to generate' if want else ''} "
                                 f"exceed model {codec.name!r}'s context of {max_pos} tokens")
            if want is None and room is None:
                raise InputError("max_new_tokens: this model's context is unknown; give max_new_tokens")
            if req.prompt_logprobs_from is not None and not 0 <= req.prompt_logprobs_from:
                raise InputError("logprob_start_len: must be at least 0")
        except InputError as e:
            answers[i] = Generated(error=str(e))
            continue
        budget = want if want is not None else room
        assert budget is not None
        rows.append(_Row(i, req, prompt, budget, on_token=getattr(req, "on_token", None)))
    if rows:
        _decode(model, rows, eos, codec)
    for r in rows:
        answers[r.index] = _answer(r, codec)
    return answers  # type: ignore[return-value]


def _decode(model: nn.Module, rows: list[_Row], eos: frozenset[int], codec: Codec) -> None:
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    for r in rows:
        if r.s.seed is not None and not r.greedy:
            r.generator = torch.Generator(device=device)
            r.generator.manual_seed(int(r.s.seed) & 0xFFFF_FFFF_FFFF_FFFF)
    want_prompt = [r for r in rows if r.req.prompt_logprobs_from is not None]
    going = [r for r in rows if r.budget > 0]
    if not want_prompt and not going:
        return
    n, length = len(rows), max(len(r.prompt) for r in rows)
    ids = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
        mask[i, :len(r.prompt)] = 1
    positions = torch.arange(length).expand(n, length)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    cache = DynamicCache(config=model.config) if going else None
    keep: Any = 0  # every position's logits: prompt log-probabilities read them all
    last = [len(r.prompt) - 1 for r in rows]
    if not want_prompt:  # only each row's last position: (rows, distinct last positions, vocab)
        cols = sorted(set(last))
        keep = torch.tensor(cols, device=device)
        last = [cols.index(p) for p in last]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=cache is not None, logits_to_keep=keep).logits
    for i, r in enumerate(rows):
        if r.req.prompt_logprobs_from is not None:
            _prompt_logprobs(r, logits[i], ids[i])
    if not going:
        return
    step = logits[[rows.index(r) for r in going], [last[rows.index(r)] for r in going]]
    del logits
    at = [rows.index(r) for r in going]
    if cache is not None and len(at) < n:
        sel = torch.tensor(at, device=device)
        cache.batch_select_indices(sel)
        mask = mask[sel]
    pos = torch.tensor([len(r.prompt) for r in going], device=device)
    while True:
        tokens, chosen = _choose(step, going)
        left = []
        for r, t in zip(going, tokens):
            _extend(r, t, eos, codec)
            if r.on_token is not None:
                _emit(r, codec)
            if not r.done:
                left.append(r)
        if not left:
            return
        if len(left) < len(going):
            sel = torch.tensor([i for i, r in enumerate(going) if not r.done], device=device)
            cache.batch_select_indices(sel)  # type: ignore[union-attr]
            mask, pos, chosen = mask[sel], pos[sel], chosen[sel.to(chosen.device)]
        going = left
        mask = torch.cat([mask, torch.ones((len(going), 1), dtype=mask.dtype, device=device)], dim=1)
        step = model(input_ids=chosen.to(device)[:, None], attention_mask=mask, position_ids=pos[:, None],
                     past_key_values=cache, use_cache=True).logits[:, -1]
        pos = pos + 1


def _log_softmax(logits: torch.Tensor, r: _Row) -> torch.Tensor:
    """Float32 log-probabilities of a row's logits: the model's own, or of the distribution its
    temperature samples from (``scaled_logprobs``)."""
    x = logits.float()
    if r.req.scaled_logprobs and r.s.temperature > 0 and r.s.temperature != 1.0:
        x = x / r.s.temperature
    return x.log_softmax(-1)


def _prompt_logprobs(r: _Row, logits: torch.Tensor, ids: torch.Tensor) -> None:
    """Log p(t_p | t_<p) for the prompt's positions from ``prompt_logprobs_from`` on (None at 0),
    and their top alternatives; the native ``logprobs`` op's computation."""
    n, start = len(r.prompt), r.req.prompt_logprobs_from or 0
    values: list[float | None] = [None] if start == 0 else []
    tops: list[list[tuple[int, float]] | None] = [None] if start == 0 else []
    ranks: list[int | None] = [None] if start == 0 else []
    first = max(start, 1)
    if first < n:
        lp = _log_softmax(logits[first - 1:n - 1], r)
        target = ids[first:n].to(lp.device)
        chosen = lp.gather(-1, target[:, None])
        values += chosen[:, 0].tolist()
        if r.req.top_logprobs > 0:
            v, i = lp.topk(min(r.req.top_logprobs, lp.shape[-1]), dim=-1)
            tops += [list(zip(a, b)) for a, b in zip(i.tolist(), v.tolist())]
            ranks += ((lp > chosen).sum(-1) + 1).tolist()
    r.prompt_logprobs = values[:max(0, n - start)]
    if r.req.top_logprobs > 0:
        r.prompt_top, r.prompt_ranks = tops[:max(0, n - start)], ranks[:max(0, n - start)]


def _choose(logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], torch.Tensor]:
    """The next token of each row (greedy, or drawn at its temperature from its top-k and top-p),
    on the host and on the device (the next step's input, never copied back), and each row's
    log-probability of it where asked."""
    chosen = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        x = logits[sampled].float()
        temps = torch.tensor([rows[i].s.temperature for i in sampled], device=x.device)
        x = x / temps[:, None]
        ks = [rows[i].s.top_k for i in sampled]
        ps = [rows[i].s.top_p for i in sampled]
        if any(k > 0 for k in ks) or any(p < 1.0 for p in ps):
            x = _filter(x, ks, ps)
        probs = x.softmax(-1)
        free = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        if free:
            chosen[[sampled[j] for j in free]] = torch.multinomial(probs[free], 1)[:, 0]
        for j, i in enumerate(sampled):
            g = rows[i].generator
            if g is not None:  # its own draws: the same whatever the batch around it
                chosen[i] = torch.multinomial(probs[j], 1, generator=g)[0]
    tokens = chosen.tolist()
    asked = [i for i, r in enumerate(rows) if r.req.output_logprobs or r.req.top_logprobs]
    if asked:  # one log-softmax and one copy to the host for every row that asked
        x = logits[asked].float()
        scale = [rows[i].s.temperature if rows[i].req.scaled_logprobs and rows[i].s.temperature > 0 else 1.0
                 for i in asked]
        if any(t != 1.0 for t in scale):
            x = x / torch.tensor(scale, device=x.device)[:, None]
        lp = x.log_softmax(-1)
        picked = lp.gather(-1, chosen[asked][:, None].to(lp.device))[:, 0].tolist()
        k = max(rows[i].req.top_logprobs for i in asked)
        tops = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None
        ids, values = (tops.indices.tolist(), tops.values.tolist()) if tops is not None else ([], [])
        for j, i in enumerate(asked):
            r = rows[i]
            if r.req.output_logprobs:
                r.logprobs.append(picked[j])
            if r.req.top_logprobs:
                n = r.req.top_logprobs
                r.tops.append(list(zip(ids[j][:n], values[j][:n])))
    return tokens, chosen


def _filter(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Logits outside each row's top ``k`` (0: all) and top-``p`` nucleus set to -inf; the most
    likely token always stays."""
    vocab = x.shape[-1]
    sorted_, order = x.sort(-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.tensor([k if k > 0 else vocab for k in ks], device=x.device)[:, None]
    drop = rank >= k
    p = torch.tensor(ps, device=x.device, dtype=x.dtype)[:, None]
    probs = sorted_.softmax(-1)
    drop |= (probs.cumsum(-1) - probs) >= p
    drop[:, 0] = False
    sorted_ = sorted_.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_)


def _extend(r: _Row, token: int, eos: frozenset[int], codec: Codec) -> None:
    """Append ``token`` to row ``r`` and see whether it stops there."""
    r.out.append(token)
    r.budget -= 1
    s = r.s
    if (token in eos and not s.ignore_eos) or token in s.stop_token_ids:
        r.done, r.finish, r.matched = True, FINISH_STOP, token
        return
    if s.stop:
        # a stop string that ends in this token lies within its last tokens (each a character or more)
        window = max(len(x) for x in s.stop) + 2
        tail = codec.decode(r.out[-window:], s.skip_special_tokens)
        hit = next((x for x in s.stop if x and x in tail), None)
        if hit is not None:
            r.done, r.finish, r.matched = True, FINISH_STOP, hit
            return
    if r.budget <= 0:
        r.done, r.finish = True, FINISH_LENGTH


def _emit(r: _Row, codec: Codec) -> None:
    """Hand a streamed row's new token on, with the text it adds once that text is settled: the
    tokens are decoded in a window that starts one settled step back (a word's leading space
    comes out as in the whole text), a character still split over tokens waits for its last
    byte, and the last characters a stop string could begin with wait until it cannot. The
    last token's text, and what was held back, the answer's text carries (cut before the stop
    string it ended on)."""
    token, s = r.out[-1], r.s
    text = ""
    if not r.done:  # the last token's text (cut where a stop string begins) is the answer's to give
        before = codec.decode(r.out[r.seen:r.read], s.skip_special_tokens)
        now = codec.decode(r.out[r.seen:], s.skip_special_tokens)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            r.said += now[len(before):]
            r.seen, r.read = r.read, len(r.out)
        hold = max(len(x) for x in s.stop) - 1 if s.stop else 0
        upto = max(r.sent, len(r.said) - hold)
        text, r.sent = r.said[r.sent:upto], upto
    logprob = r.logprobs[-1] if r.req.output_logprobs else None
    top = r.tops[-1] if r.req.top_logprobs else None
    pieces = codec.pieces({token, *(t for t, _ in top or ())}) if r.req.pieces else None
    assert r.on_token is not None
    r.on_token(token, text, logprob, top, pieces)


def _answer(r: _Row, codec: Codec) -> Generated:
    s = r.s
    text = codec.decode(r.out, s.skip_special_tokens)
    if isinstance(r.matched, str):
        cut = min((text.find(x) for x in s.stop if x and x in text), default=-1)
        if cut >= 0:
            text = text[:cut]
    elif r.finish == FINISH_STOP and not s.skip_special_tokens and r.out:
        # a stop token ends the answer but is not part of its text (SGLang's and vLLM's way)
        text = codec.decode(r.out[:-1], False)
    g = Generated(prompt_ids=r.prompt, output_ids=r.out, text=text, finish=r.finish, matched=r.matched,
                  prompt_logprobs=r.prompt_logprobs, prompt_top=r.prompt_top, prompt_ranks=r.prompt_ranks,
                  output_logprobs=r.logprobs if r.req.output_logprobs else None,
                  output_top=r.tops if r.req.top_logprobs else None)
    if r.req.pieces:
        seen = set(r.prompt) | set(r.out)
        for tops in (r.prompt_top or []) + (r.tops or []):
            seen.update(t for t, _ in tops or ())
        g.pieces = codec.pieces(seen)
        g.prompt_text = codec.decode(r.prompt, False)
    return g


# -- classify ----------------------------------------------------------------------------------------

@torch.inference_mode()
def classify(model: nn.Module, codec: Codec, labels: list[str], batch: list) -> list[Classified]:
    """A batch of ``Classify`` inputs through the score model (``hf.score``: the head at each
    input's last token); a bad input answers its own error."""
    vocab, max_pos = _limits(model)
    answers: list[Classified | None] = [None] * len(batch)
    seqs, where = [], []
    for i, item in enumerate(batch):
        req = item if isinstance(item, Classify) else Classify(ids=list(item))
        try:
            given = [x is not None for x in (req.ids, req.text, req.messages)]
            if sum(given) != 1:
                raise InputError("input: give exactly one of token ids, text and messages")
            if req.ids is not None:
                ids = _check_ids(req.ids, vocab, "input")
            elif req.text is not None:
                ids = codec.encode(req.text, req.add_special_tokens, "input")
            else:
                ids = codec.chat(req.messages or [], False)
            if not ids:
                raise InputError("input: empty (no tokens)")
            if max_pos is not None and len(ids) > max_pos:
                raise InputError(f"input: {len(ids)} tokens exceed model {codec.name!r}'s context of {max_pos} "
                                 "tokens")
        except InputError as e:
            answers[i] = Classified(error=str(e))
            continue
        seqs.append(ids)
        where.append(i)
    if seqs:
        for i, ids, value in zip(where, seqs, hf.score(model, seqs)):
            answers[i] = Classified(values=[value] if isinstance(value, float) else list(value), tokens=len(ids),
                                    labels=labels)
    return answers  # type: ignore[return-value]
