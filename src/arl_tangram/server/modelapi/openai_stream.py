"""OpenAI's ``stream: true``: server-sent events as the decode loop makes the tokens, in the chunk
shapes of ``/v1/chat/completions`` and ``/v1/completions``; and the pieces of an answer both the
streamed and the whole one are built from.

A streamed request runs as a stream in the engine process (``streams.py``): the route opens it
and reads it until the first token has come (or the answer: an input the model refuses is then
the protocol's 4xx, as without ``stream``), then answers 200 and sends a chunk for every token
(its text where settled, and its log-probabilities where asked), then what is left of each
choice's text with its finish reason, the usage where ``stream_options.include_usage`` asks for
it, and ``[DONE]``. An error after the first token comes as one ``{"error": {...}}`` event in
OpenAI's shape before ``[DONE]``.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ...managers.models.generation import FINISH_STOP, Generated
from ..dialect import answer
from .common import as_api_error, dumps, error_body, lp

log = logging.getLogger(__name__)

#: how long one read of a stream waits for a token before the route reads again
WAIT_S = 10.0
DONE = b"data: [DONE]\n\n"


def usage(got: list[Generated], n: int) -> dict:
    prompt = sum(len(g.prompt_ids) for g in got[::n])
    completion = sum(len(g.output_ids) for g in got)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish(g: Generated) -> str:
    return "stop" if g.finish == FINISH_STOP else "length"


def stop_reason(g: Generated) -> int | str | None:
    return g.matched if g.finish == FINISH_STOP else None


def text_of(g: Generated, with_stop: bool) -> str:
    """A choice's text; with the stop string it ended on where asked (vLLM's
    ``include_stop_str_in_output``)."""
    if with_stop and isinstance(g.matched, str):
        return g.text + g.matched
    return g.text


def chat_entry(token: int, value: float, top: Any, pieces: dict[int, str]) -> dict:
    """One token of chat's ``logprobs.content``: its text, log-probability, bytes and top
    alternatives."""
    s = pieces.get(token, "")
    return {"token": s, "logprob": lp(value), "bytes": list(s.encode()),
            "top_logprobs": [{"token": (a := pieces.get(t, "")), "logprob": lp(x), "bytes": list(a.encode())}
                             for t, x in top or ()]}


def sse(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


async def open_stream(calls: Any, protocol: str, model: str | None, items: list) -> tuple[str, str, dict]:
    """Start ``items`` as a stream and read it up to its first token (or its answer, or its
    error: raised here, before any byte is sent): the stream's id, the model's name, that read."""
    sid, name = await answer(calls.stream_open(protocol, model, items))
    got = await answer(calls.stream_read(sid, 0, WAIT_S))
    while not got["events"] and not got["done"]:
        got = await answer(calls.stream_read(sid, 0, WAIT_S))
    return sid, name, got


async def _reads(calls: Any, sid: str, got: dict) -> AsyncIterator[dict]:
    """Every read of the stream from ``got`` on, the last one ``done``."""
    sent = 0
    while True:
        yield got
        if got["done"]:
            return
        sent += len(got["events"])
        got = await answer(calls.stream_read(sid, sent, WAIT_S))


def _rest(final: str, said: str) -> str:
    """What of a choice's text the stream has not sent."""
    if final.startswith(said):
        return final[len(said):]
    log.warning("a streamed text parted from its answer's (%r, then %r): the rest is not sent", said, final)
    return ""


def _error(e: Exception) -> bytes:
    """An error after the first token: an event in OpenAI's shape."""
    err = as_api_error(e, "stream")
    return sse(error_body("openai", err.status, err.message, err.param, err.code, err.kind))


async def chat(calls: Any, sid: str, got: dict, head: dict, n: int, logprobs: bool, with_stop: bool,
               include_usage: bool) -> AsyncIterator[bytes]:
    """``/v1/chat/completions``' chunks: the role, a chunk per token, the rest, the finish; the
    chunks of one read sent together."""
    said = [""] * n
    out = [sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}) for i in range(n)]
    try:
        async for read in _reads(calls, sid, got):
            for i, token, text, value, top, pieces in read["events"]:
                content = {"content": [chat_entry(token, value, top, pieces or {})]} if logprobs else None
                if text or content is not None:
                    said[i] += text
                    out.append(sse({**head, "choices": [{"index": i, "delta": {"content": text}, "logprobs": content,
                                                         "finish_reason": None}]}))
            if read["done"]:
                answers = read["answers"]
                for i, g in enumerate(answers):
                    rest = _rest(text_of(g, with_stop), said[i])
                    if rest:
                        out.append(sse({**head, "choices": [{"index": i, "delta": {"content": rest},
                                                             "logprobs": None, "finish_reason": None}]}))
                    out.append(sse({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                         "finish_reason": finish(g), "stop_reason": stop_reason(g)}]}))
                if include_usage:
                    out.append(sse({**head, "choices": [], "usage": usage(answers, n)}))
                out.append(DONE)
            yield b"".join(out)
            out.clear()
    except Exception as e:
        yield b"".join(out) + _error(e) + DONE


async def completion(calls: Any, sid: str, got: dict, head: dict, samples: int, k: int | None, with_stop: bool,
                     include_usage: bool) -> AsyncIterator[bytes]:
    """``/v1/completions``' chunks: one per token (with its ``logprobs`` where ``k`` is given),
    then the rest of each choice with its finish; the chunks of one read sent together."""
    said: dict[int, str] = {}
    at: dict[int, int] = {}  # each choice's text offset of its next token (as the whole answer counts it)
    out: list[bytes] = []
    try:
        async for read in _reads(calls, sid, got):
            for i, token, text, value, top, pieces in read["events"]:
                logprobs = None
                if k is not None:
                    pieces = pieces or {}
                    s = pieces.get(token, "")
                    alts = {pieces.get(t, ""): lp(x) for t, x in (top or ())[:k]}
                    alts.setdefault(s, lp(value))
                    logprobs = {"tokens": [s], "token_logprobs": [lp(value)], "top_logprobs": [alts],
                                "text_offset": [at.get(i, 0)]}
                    at[i] = at.get(i, 0) + len(s)
                if text or logprobs is not None:
                    said[i] = said.get(i, "") + text
                    out.append(sse({**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                                         "finish_reason": None}]}))
            if read["done"]:
                answers = read["answers"]
                for i, g in enumerate(answers):
                    rest = _rest(text_of(g, with_stop), said.get(i, ""))
                    out.append(sse({**head, "choices": [{"index": i, "text": rest, "logprobs": None,
                                                         "finish_reason": finish(g), "stop_reason": stop_reason(g)}]}))
                if include_usage:
                    out.append(sse({**head, "choices": [], "usage": usage(answers, samples)}))
                out.append(DONE)
            yield b"".join(out)
            out.clear()
    except Exception as e:
        yield b"".join(out) + _error(e) + DONE
