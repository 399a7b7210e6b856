"""Score models in the protocols reward clients call: vLLM's ``POST /classify`` and ``POST
/pooling``, and SGLang's ``POST /v1/embeddings`` as verl reads it (each also under
``/models/NAME/...``).

verl's discriminative reward models send ``{"model": <the model's path>, "input": <text>,
"use_activation": false}`` (older verl: ``"activation"``) to ``/classify`` and read
``data[-1].probs[-1]``, or ``{"model", "input"}`` to ``/v1/embeddings`` and read
``data[-1].embedding[-1]``. The values are the classification head's outputs at the input's last
token (the native ``score`` op's numbers); ``/classify`` applies vLLM's activation unless told
not to (a sigmoid for one label, else a softmax), ``/pooling`` and ``/v1/embeddings`` give them
raw. Text is tokenized with the model's tokenizer, special tokens added unless
``add_special_tokens`` is false.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from ...managers.models.generation import Classified, Classify
from ..dialect import answer
from .common import bad, body_of, json_response, new_id, now, route
from .openai import messages_of, prompts_of

PROTOCOL = "vllm"


class ScoreBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Any = None  # checked by ``inputs``
    messages: Any = None
    use_activation: bool | None = None
    activation: bool | None = None
    add_special_tokens: bool = True
    encoding_format: str | None = None
    truncate_prompt_tokens: int | None = None


def inputs(body: ScoreBody) -> list[Classify]:
    if body.truncate_prompt_tokens is not None:
        raise bad("truncate_prompt_tokens: not supported here", "truncate_prompt_tokens")
    if body.encoding_format not in (None, "float"):
        raise bad("encoding_format: only float", "encoding_format")
    if (body.input is None) == (body.messages is None):
        raise bad("input/messages: give exactly one", "input")
    if body.messages is not None:
        return [Classify(messages=messages_of(body.messages))]
    return [Classify(**p, add_special_tokens=body.add_special_tokens) if "text" in p else Classify(**p)
            for p in prompts_of(body.input, "input")]


def activated(values: list[float]) -> list[float]:
    """vLLM's classification activation: a sigmoid for one label, a softmax for more."""
    if len(values) == 1:
        v = values[0]
        return [1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))]
    top = max(values)
    e = [math.exp(v - top) for v in values]
    s = sum(e)
    return [v / s for v in e]


def _usage(got: list[Classified]) -> dict:
    n = sum(c.tokens for c in got)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def routes(router: Any, calls: Any, guarded: Any) -> None:
    async def run(request: Request) -> tuple[ScoreBody, str, list[Classified]]:
        body = await body_of(request, ScoreBody)
        name = request.path_params.get("model") or body.model
        resolved, got = await answer(calls.classify(PROTOCOL, name, inputs(body)))
        return body, body.model or resolved, got

    async def classify(request: Request) -> Response:
        body, shown, got = await run(request)
        use = body.use_activation if body.use_activation is not None else (
            body.activation if body.activation is not None else True)
        data = []
        for i, c in enumerate(got):
            probs = activated(c.values) if use else c.values
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": c.labels[best] if best < len(c.labels) else str(best),
                         "probs": probs, "num_classes": len(probs)})
        return json_response({"id": new_id("classify"), "object": "list", "created": now(), "model": shown,
                              "data": data, "usage": _usage(got)})

    async def pooling(request: Request) -> Response:
        body, shown, got = await run(request)
        use = bool(body.use_activation)
        data = [{"index": i, "object": "pooling", "data": activated(c.values) if use else c.values}
                for i, c in enumerate(got)]
        return json_response({"id": new_id("pool"), "object": "list", "created": now(), "model": shown,
                              "data": data, "usage": _usage(got)})

    async def embeddings(request: Request) -> Response:
        body, shown, got = await run(request)
        data = [{"object": "embedding", "embedding": c.values, "index": i} for i, c in enumerate(got)]
        n = sum(c.tokens for c in got)
        return json_response({"object": "list", "data": data, "model": shown,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    for base in ("", "/models/{model}"):
        route(router, f"{base}/classify", ["POST"], PROTOCOL, guarded, classify)
        route(router, f"{base}/pooling", ["POST"], PROTOCOL, guarded, pooling)
        route(router, f"{base}/v1/embeddings", ["POST"], PROTOCOL, guarded, embeddings)
