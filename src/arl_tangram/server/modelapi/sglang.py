"""SGLang's native ``POST /generate`` (and ``/models/NAME/generate``, a URL per model, so that each
teacher of an on-policy distillation run has its own).

What slime sends for a teacher's log-probabilities: ``{"input_ids": [...], "sampling_params":
{"temperature", "max_new_tokens": 0, "skip_special_tokens": false}, "return_logprob": true,
"logprob_start_len": 0}``, reading ``meta_info.input_token_logprobs[1:][i][0]``. As SGLang does,
the log-probabilities are of the temperature-scaled distribution (a temperature of 0 or 1: the
model's own), the first prompt position has none (``None``), and ``logprob_start_len`` -1 (the
default) returns the generated tokens' only.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...managers.models.generation import FINISH_STOP, Generate, Generated, Sampling
from ..dialect import answer
from .common import bad, body_of, dumps, json_response, lp, route

PROTOCOL = "sglang"
#: SGLang's default when ``max_new_tokens`` is not given
DEFAULT_MAX_NEW_TOKENS = 128

#: sampling parameters taken as they are; the rest of SGLang's are taken only at their neutral value
_TAKEN = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
          "skip_special_tokens", "n", "seed", "sampling_seed", "no_stop_trim", "spaces_between_special_tokens",
          "stream_interval"}
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
            "custom_params": None, "logit_bias": None}


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Any = None  # these two checked by ``requests`` (a union here costs more than the rest)
    input_ids: Any = None
    sampling_params: dict | list[dict] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    model: str | None = None


def _number(params: dict, key: str, default: float, lo: float, hi: float | None = None) -> float:
    v = params.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo or (hi is not None and v > hi):
        raise bad(f"sampling_params.{key}: must be a number in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}",
                  "sampling_params")
    return float(v)


def _integer(params: dict, key: str, default: int | None, lo: int) -> int | None:
    v = params.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(f"sampling_params.{key}: must be an integer of at least {lo}, got {v!r}", "sampling_params")
    return v


def sampling(params: dict | None) -> tuple[Sampling, int]:
    """SGLang's ``sampling_params`` as ``Sampling``, and ``n``."""
    params = dict(params or {})
    for key, neutral in _NEUTRAL.items():
        if key in params and params[key] != neutral and params[key] is not None:
            raise bad(f"sampling_params.{key}: not supported here (only {neutral!r})", "sampling_params")
    unknown = sorted(k for k in params if k not in _TAKEN and k not in _NEUTRAL)
    if unknown:
        raise bad(f"sampling_params: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
                  "sampling_params")
    stop = params.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise bad("sampling_params.stop: a string or a list of strings", "sampling_params")
    ids = params.get("stop_token_ids") or ()
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):
        raise bad("sampling_params.stop_token_ids: a list of token ids", "sampling_params")
    top_k = params.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k not in (-1, 0)):
        raise bad(f"sampling_params.top_k: -1 (all) or at least 1, got {top_k!r}", "sampling_params")
    seed = params.get("sampling_seed", params.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("sampling_params.seed: an integer", "sampling_params")
    s = Sampling(max_new_tokens=_integer(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0),
                 temperature=_number(params, "temperature", 1.0, 0.0), top_p=_number(params, "top_p", 1.0, 1e-9, 1.0),
                 top_k=max(0, top_k), seed=seed, stop=tuple(stop), stop_token_ids=tuple(ids),
                 ignore_eos=bool(params.get("ignore_eos", False)),
                 skip_special_tokens=bool(params.get("skip_special_tokens", True)))
    n = _integer(params, "n", 1, 1)
    assert n is not None
    return s, n


def _each(value: Any, i: int, count: int, field: str) -> Any:
    """A per-prompt field: one value for every prompt, or a list of one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad(f"{field}: {len(value)} values for {count} prompts", field)
        return value[i]
    return value


def requests(body: GenerateBody) -> tuple[list[Generate], list[tuple[int, int]], bool]:
    """The ``Generate`` requests of a body, (prompt, sample) of each, and whether it was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise bad("text/input_ids: give exactly one", "input_ids" if body.input_ids is not None else "text")
    if body.text is not None:
        batch = isinstance(body.text, list)
        if not isinstance(body.text, str) and not (batch and all(isinstance(t, str) for t in body.text)):
            raise bad("text: a string or a list of strings", "text")
        prompts: list[dict] = [{"text": t} for t in (body.text if batch else [body.text])]
    else:
        ids: Any = body.input_ids
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = [{"ids": x} for x in (ids if batch else [ids])]
        if not all(isinstance(x["ids"], list) and x["ids"] and all(type(t) is int for t in x["ids"]) for x in prompts):
            raise bad("input_ids: a non-empty list of token ids, or a list of such lists", "input_ids")
    if not prompts:
        raise bad("input_ids: empty batch", "input_ids")
    out, where = [], []
    for i, p in enumerate(prompts):
        s, n = sampling(_each(body.sampling_params, i, len(prompts), "sampling_params"))
        want = bool(_each(body.return_logprob, i, len(prompts), "return_logprob"))
        start = _each(body.logprob_start_len, i, len(prompts), "logprob_start_len")
        top = _each(body.top_logprobs_num, i, len(prompts), "top_logprobs_num")
        if not isinstance(top, int) or top < 0:
            raise bad("top_logprobs_num: at least 0", "top_logprobs_num")
        if not isinstance(start, int) or start < -1:
            raise bad("logprob_start_len: -1 (generated tokens only) or a prompt position", "logprob_start_len")
        for k in range(n):
            seed = s.seed + k if s.seed is not None and k else s.seed
            out.append(Generate(**p, sampling=Sampling(**{**s.__dict__, "seed": seed}),
                                prompt_logprobs_from=start if want and start >= 0 else None,
                                output_logprobs=want, top_logprobs=top if want else 0, scaled_logprobs=True,
                                pieces=want and body.return_text_in_logprobs))
            where.append((i, k))
    return out, where, batch or len(out) > 1


def _entries(values: list, ids: list[int], g: Generated, text: bool) -> list[list]:
    return [[lp(v), t, g.pieces.get(t) if text else None] for v, t in zip(values, ids)]


def _tops(tops: list | None, g: Generated, text: bool) -> list:
    return [None if row is None else [[lp(v), t, g.pieces.get(t) if text else None] for t, v in row]
            for row in (tops or [])]


def result(g: Generated, req: Generate, rid: str | None, took_s: float) -> dict:
    """One prompt's answer, as SGLang's ``/generate`` gives it."""
    finish: dict = ({"type": "stop", "matched": g.matched} if g.finish == FINISH_STOP
                    else {"type": "length", "length": len(g.output_ids)})
    meta: dict = {"id": rid, "finish_reason": finish, "prompt_tokens": len(g.prompt_ids),
                  "completion_tokens": len(g.output_ids), "cached_tokens": 0, "e2e_latency": took_s}
    if req.output_logprobs:
        text = req.pieces
        start = req.prompt_logprobs_from
        prompt = g.prompt_ids[start:] if start is not None else []
        meta["input_token_logprobs"] = _entries(g.prompt_logprobs or [], prompt, g, text)
        meta["output_token_logprobs"] = _entries(g.output_logprobs or [], g.output_ids, g, text)
        if req.top_logprobs:
            meta["input_top_logprobs"] = _tops(g.prompt_top, g, text)
            meta["output_top_logprobs"] = _tops(g.output_top, g, text)
    return {"text": g.text, "output_ids": g.output_ids, "meta_info": meta}


def routes(router: Any, calls: Any, guarded: Any) -> None:
    async def generate(request: Request) -> Response:
        body = await body_of(request, GenerateBody)
        model = request.path_params.get("model") or body.model
        items, where, batch = requests(body)
        t = time.perf_counter()
        _, got = await answer(calls.generate(PROTOCOL, model, items))
        took = time.perf_counter() - t
        rids = body.rid if isinstance(body.rid, list) else None
        out = [result(g, req, (rids[i] if rids and i < len(rids) else body.rid if isinstance(body.rid, str)
                               else None), took) for g, req, (i, _) in zip(got, items, where)]
        if body.stream:
            return StreamingResponse(_events(out), media_type="text/event-stream")
        return json_response(out if batch else out[0])

    route(router, "/generate", ["POST"], PROTOCOL, guarded, generate)
    route(router, "/models/{model}/generate", ["POST"], PROTOCOL, guarded, generate)


async def _events(out: list[dict]):
    """SGLang's stream: one event per answer (each whole: the batch ran before the answer), then
    ``[DONE]``."""
    for item in out:
        yield b"data: " + dumps(item) + b"\n\n"
    yield b"data: [DONE]\n\n"

