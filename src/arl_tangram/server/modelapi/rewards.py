"""Reward models' batch routes in the shapes RL frameworks post, at the paths the configuration
names (``ModelApiConfig.reward_routes``):

* OpenRLHF's ``--remote_rm_url``: ``{"query": [text, ...], "prompts": [...], "labels": [...]}``
  (each query the prompt and the response, one text) -> ``{"rewards": [...], "scores": [...],
  "extra_logs": {...}}``;
* slime's remote reward model: ``{"prompt", "response", "label"}`` -> the reward, a JSON number
  (a prompt given as chat messages gets the response as the assistant's message, templated).

A reward is the score model's head at the text's last token (its last output where it has more
than one, as verl reads ``probs[-1]``): the native ``score`` op's number, raw.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from ...managers.models.generation import Classify
from ..dialect import answer
from .common import bad, body_of, json_response, route
from .config import RewardRoute

PROTOCOL = "rewards"


class OpenRlhfBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class SlimeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str | list[dict]
    response: str
    label: Any = None


def add(router: Any, calls: Any, guarded: Any, r: RewardRoute) -> None:
    """The route ``r`` names."""
    if r.shape == "openrlhf":
        async def openrlhf(request: Request) -> Response:
            body = await body_of(request, OpenRlhfBody)
            if not body.query:
                raise bad("query: empty", "query")
            _, got = await answer(calls.classify(PROTOCOL, r.model, [Classify(text=q) for q in body.query]))
            rewards = [c.values[-1] for c in got]
            return json_response({"rewards": rewards, "scores": rewards,
                                  "extra_logs": {"tokens": [c.tokens for c in got]}})

        route(router, r.path, ["POST"], PROTOCOL, guarded, openrlhf)
    else:
        async def slime(request: Request) -> Response:
            body = await body_of(request, SlimeBody)
            if isinstance(body.prompt, list):
                item = Classify(messages=[*body.prompt, {"role": "assistant", "content": body.response}])
            else:
                item = Classify(text=body.prompt + body.response)
            _, got = await answer(calls.classify(PROTOCOL, r.model, [item]))
            return json_response(got[0].values[-1])

        route(router, r.path, ["POST"], PROTOCOL, guarded, slime)
