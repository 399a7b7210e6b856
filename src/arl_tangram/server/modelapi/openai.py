"""OpenAI's API for the official ``openai`` SDK unchanged (``base_url`` = the server + ``/v1``, or
``/models/NAME/v1`` for one model): ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions``, with vLLM's extensions RL frameworks send (``prompt_logprobs``, ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``chat_template_kwargs``,
``return_token_ids``).

Log-probabilities are the model's own (vLLM's default), whatever the temperature; a prompt's
(``echo`` with ``max_tokens`` 0, or ``prompt_logprobs``) are the native ``logprobs`` op's numbers.
``stream`` answers server-sent events in OpenAI's chunk shapes, a chunk per token as the decode
loop makes it (``openai_stream.py``; a completion that echoes its prompt or asks for the prompt's
log-probabilities streams each choice whole once it ran). Errors are OpenAI's ``{"error":
{"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...managers.models.generation import Generate, Generated, Sampling
from ..dialect import answer
from . import openai_stream as stream
from .common import ApiError, bad, body_of, json_response, lp, new_id, now, route
from .openai_stream import DONE, chat_entry, finish, open_stream, sse, stop_reason, text_of, usage

PROTOCOL = "openai"
OWNER = "arl-tangram"


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=1000)
    return_token_ids: bool = False


class CompletionBody(_Common):
    prompt: Any = None  # checked by ``prompts_of`` (a union here costs more than the rest of the body)
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=1000)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatBody(_Common):
    messages: Any
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=1000)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


def _unsupported(body: _Common) -> None:
    """What we do not do, refused rather than ignored (a caller would get other answers than asked)."""
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_p", 0.0),
                          ("repetition_penalty", 1.0)):
        v = getattr(body, name)
        if v is not None and v != neutral:
            raise bad(f"{name}: not supported here (only {neutral})", name)
    if body.logit_bias:
        raise bad("logit_bias: not supported here", "logit_bias")
    if body.top_k is not None and body.top_k < 1 and body.top_k not in (-1, 0):
        raise bad("top_k: -1 (all) or at least 1", "top_k")


def _sampling(body: _Common, max_tokens: int | None) -> Sampling:
    if max_tokens is not None and max_tokens < 0:
        raise bad(f"max_tokens: must be at least 0, got {max_tokens}", "max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return Sampling(max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0), seed=body.seed,
                    stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                    skip_special_tokens=body.skip_special_tokens)


def _samples(base: Generate, n: int) -> list[Generate]:
    """``n`` samples of one prompt; with a seed, the k-th draws from seed + k."""
    out = [base]
    for k in range(1, n):
        s = base.sampling
        seed = s.seed + k if s.seed is not None else None
        out.append(Generate(**{**base.__dict__, "sampling": Sampling(**{**s.__dict__, "seed": seed})}))
    return out


def prompts_of(prompt: Any, field: str = "prompt") -> list[dict]:
    """A prompt (or an input) as OpenAI's API takes it: text, a list of texts, token ids or a list
    of token-id lists; one ``{"text"}`` or ``{"ids"}`` each."""
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise bad(f"{field}: a string, a list of strings, a list of token ids or a list of such lists", field)
    if all(isinstance(p, str) for p in prompt):
        return [{"text": p} for p in prompt]
    if all(type(p) is int for p in prompt):
        return [{"ids": prompt}]
    if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
        return [{"ids": p} for p in prompt]
    raise bad(f"{field}: a string, a list of strings, a list of token ids or a list of such lists", field)


def messages_of(messages: Any) -> list[dict]:
    """A message list as chat templates take it: each a dict with a string role and string content
    (a list of text parts is joined), anything else a 400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"messages[{i}]: an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content: a string or a list of text parts", "messages")
        out.append({**m, "content": content})
    return out


def _prompt_logprobs(g: Generated) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position, None at 0, else {id: {logprob, rank,
    decoded_token}} of the prompt's token and its likeliest alternatives."""
    if g.prompt_logprobs is None:
        return None
    out: list = []
    for p, value in enumerate(g.prompt_logprobs):
        if value is None:
            out.append(None)
            continue
        t = g.prompt_ids[p]
        entry = {str(t): {"logprob": lp(value), "rank": (g.prompt_ranks or [None] * (p + 1))[p],
                          "decoded_token": g.pieces.get(t)}}
        for rank, (alt, v) in enumerate((g.prompt_top or [None] * (p + 1))[p] or (), 1):
            entry.setdefault(str(alt), {"logprob": lp(v), "rank": rank, "decoded_token": g.pieces.get(alt)})
        out.append(entry)
    return out


def _completion_logprobs(g: Generated, echo: bool, k: int) -> dict:
    """The legacy completions' ``logprobs``: tokens, their log-probabilities, the top ``k`` (and
    the token itself) at each, and each token's offset in the text."""
    pieces = g.pieces
    ids = (g.prompt_ids + g.output_ids) if echo else g.output_ids
    values = (list(g.prompt_logprobs or [None] * len(g.prompt_ids)) if echo else []) + list(g.output_logprobs or [])
    tops = (((g.prompt_top or [None] * len(g.prompt_ids)) if echo else [])
            + list(g.output_top or [None] * len(g.output_ids)))
    tokens = [pieces.get(t, "") for t in ids]
    top: list = []
    offsets: list[int] = []
    at = 0
    for s, v, row in zip(tokens, values, tops):
        offsets.append(at)
        at += len(s)
        if v is None:
            top.append(None)
            continue
        d = {pieces.get(a, ""): lp(x) for a, x in row[:k]} if row else {}
        d.setdefault(s, lp(v))
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [lp(v) for v in values], "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(g: Generated) -> dict:
    tops = g.output_top or [[]] * len(g.output_ids)
    return {"content": [chat_entry(t, v, row, g.pieces)
                        for t, v, row in zip(g.output_ids, g.output_logprobs or [], tops)]}


def _include_usage(body: _Common) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


async def _sse(chunks: list[dict]):
    for c in chunks:
        yield sse(c)
    yield DONE


def routes(router: Any, calls: Any, guarded: Any) -> None:
    async def models(request: Request) -> Response:
        only = request.path_params.get("model")
        got = await answer(calls.models())
        data = [{"id": m["id"], "object": "model", "created": 0, "owned_by": OWNER, "root": m["root"], "parent": None}
                for m in got if only is None or m["id"] == only]
        if only is not None and not data:
            raise ApiError(404, f"The model `{only}` does not exist", param="model")
        return json_response({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        got = await answer(calls.models())
        for m in got:
            if m["id"] == name and request.path_params.get("model") in (None, name):
                return json_response({"id": m["id"], "object": "model", "created": 0, "owned_by": OWNER,
                                      "root": m["root"], "parent": None})
        raise ApiError(404, f"The model `{name}` does not exist", param="model")

    async def completions(request: Request) -> Response:
        body: CompletionBody = await body_of(request, CompletionBody)
        _unsupported(body)
        if body.suffix:
            raise bad("suffix: not supported here", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad("best_of: only equal to n", "best_of")
        s = _sampling(body, body.max_tokens)
        want_prompt = body.echo and body.logprobs is not None or body.prompt_logprobs is not None
        k = max(body.logprobs or 0, body.prompt_logprobs or 0)
        items: list[Generate] = []
        for p in prompts_of(body.prompt):
            base = Generate(**p, add_special_tokens=body.add_special_tokens, sampling=s,
                            prompt_logprobs_from=0 if want_prompt else None,
                            output_logprobs=body.logprobs is not None, top_logprobs=k, pieces=True)
            items += _samples(base, body.n)
        name = request.path_params.get("model") or body.model
        if body.stream and not body.echo and body.prompt_logprobs is None:  # a chunk per token as it is made
            sid, resolved, first = await open_stream(calls, PROTOCOL, name, items)
            head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                    "model": body.model or resolved}
            return StreamingResponse(stream.completion(calls, sid, first, head, body.n, body.logprobs,
                                                       body.include_stop_str_in_output, _include_usage(body)),
                                     media_type="text/event-stream")
        resolved, got = await answer(calls.generate(PROTOCOL, name, items))
        shown = body.model or resolved
        choices = []
        for i, g in enumerate(got):
            text = text_of(g, body.include_stop_str_in_output)
            if body.echo:
                text = (g.prompt_text or "") + text
            c: dict = {"index": i, "text": text, "finish_reason": finish(g), "stop_reason": stop_reason(g),
                       "logprobs": _completion_logprobs(g, body.echo, body.logprobs or 0)
                       if body.logprobs is not None else None}
            if body.prompt_logprobs is not None:
                c["prompt_logprobs"] = _prompt_logprobs(g)
            if body.return_token_ids:
                c["prompt_token_ids"], c["token_ids"] = g.prompt_ids, g.output_ids
            choices.append(c)
        use = usage(got, body.n)
        cid, created = new_id("cmpl"), now()
        if body.stream:  # with the prompt echoed or its log-probabilities: each choice whole, once it ran
            chunks = [{"id": cid, "object": "text_completion", "created": created, "model": shown, "choices": [c]}
                      for c in choices]
            if _include_usage(body):
                chunks.append({"id": cid, "object": "text_completion", "created": created, "model": shown,
                               "choices": [], "usage": use})
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        return json_response({"id": cid, "object": "text_completion", "created": created, "model": shown,
                              "choices": choices, "usage": use, "system_fingerprint": None})

    async def chat(request: Request) -> Response:
        body: ChatBody = await body_of(request, ChatBody)
        _unsupported(body)
        if body.tools or body.functions:
            raise bad("tools: tool calls are not supported here", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise bad("response_format: only text", "response_format")
        if body.continue_final_message and body.add_generation_prompt:
            body.add_generation_prompt = False
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        s = _sampling(body, limit)
        k = body.top_logprobs or 0
        if k and not body.logprobs:
            raise bad("top_logprobs: needs logprobs: true", "top_logprobs")
        base = Generate(messages=messages_of(body.messages), add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message,
                        template_kwargs=dict(body.chat_template_kwargs or {}), sampling=s,
                        prompt_logprobs_from=0 if body.prompt_logprobs is not None else None,
                        output_logprobs=body.logprobs, top_logprobs=max(k, body.prompt_logprobs or 0),
                        pieces=body.logprobs or body.prompt_logprobs is not None)
        name = request.path_params.get("model") or body.model
        items = _samples(base, body.n)
        if body.stream:  # a chunk per token as it is made
            sid, resolved, first = await open_stream(calls, PROTOCOL, name, items)
            head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(),
                    "model": body.model or resolved}
            return StreamingResponse(stream.chat(calls, sid, first, head, body.n, body.logprobs,
                                                 body.include_stop_str_in_output, _include_usage(body)),
                                     media_type="text/event-stream")
        resolved, got = await answer(calls.generate(PROTOCOL, name, items))
        choices = []
        for i, g in enumerate(got):
            c: dict = {"index": i, "message": {"role": "assistant",
                                               "content": text_of(g, body.include_stop_str_in_output)},
                       "logprobs": _chat_logprobs(g) if body.logprobs else None, "finish_reason": finish(g),
                       "stop_reason": stop_reason(g)}
            if body.return_token_ids:
                c["token_ids"] = g.output_ids
            choices.append(c)
        out: dict = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                     "model": body.model or resolved, "choices": choices, "usage": usage(got, body.n),
                     "system_fingerprint": None}
        if body.prompt_logprobs is not None:
            out["prompt_logprobs"] = _prompt_logprobs(got[0])
        if body.return_token_ids:
            out["prompt_token_ids"] = got[0].prompt_ids
        return json_response(out)

    for base in ("/v1", "/models/{model}/v1"):
        route(router, f"{base}/models", ["GET"], PROTOCOL, guarded, models)
        route(router, base + "/models/{name:path}", ["GET"], PROTOCOL, guarded, model)
        route(router, f"{base}/completions", ["POST"], PROTOCOL, guarded, completions)
        route(router, f"{base}/chat/completions", ["POST"], PROTOCOL, guarded, chat)
