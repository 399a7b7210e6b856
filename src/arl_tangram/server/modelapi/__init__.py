"""Model services in the protocols RL frameworks already call: SGLang's ``/generate``
(``sglang.py``), OpenAI's completions, chat and models for the official SDK (``openai.py``),
vLLM's ``/classify`` and ``/pooling`` and SGLang's ``/v1/embeddings`` (``pooling.py``), and the
reward batch shapes of OpenRLHF and slime at configured paths (``rewards.py``), with API quotas
(``quotas.py``). Each configured Hugging Face service answers the routes of its kind: a causal LM
(``task = "logprobs"``) generates, a score model (``task = "score"``) classifies.

The routes translate bodies into ``Generate`` / ``Classify`` requests (wherever HTTP is served,
fronts included); ``engine.py`` runs them in the engine process as the model services' batched
calls. ``dialect(config)`` builds the dialect over a configuration (quotas, reward routes);
``DIALECT`` is the one without (docs/model-protocols.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

from fastapi import Request

from ..dialect import Dialect
from . import openai, pooling, rewards, sglang
from .common import ApiError, error_body
from .config import ModelApiConfig, Quota, RewardRoute
from .engine import Calls
from .table import Table

#: the paths the protocols' routes take (their errors, routing's included, are in their shape)
PREFIXES = ("/generate", "/classify", "/pooling", "/models/", "/v1/completions", "/v1/chat/completions",
            "/v1/embeddings")


class Reach(NamedTuple):
    """The engine process's calls the routes make (in process, or across the front link)."""

    models: Callable[..., Any]
    generate: Callable[..., Any]
    classify: Callable[..., Any]
    stream_open: Callable[..., Any]
    stream_read: Callable[..., Any]


def routes(router: Any, calls: Any, guarded: Sequence[Any], config: ModelApiConfig | None = None) -> None:
    """Every protocol's routes over ``calls``; the reward routes ``config`` names. They stand
    first in ``router``'s table as one entry matched by path (``table.py``)."""
    reach = Reach(lambda *a: calls.modelapi_models(*a), lambda *a: calls.modelapi_generate(*a),  # looked up
                  lambda *a: calls.modelapi_classify(*a),  # when called, as every dialect's routes do
                  lambda *a: calls.modelapi_stream_open(*a), lambda *a: calls.modelapi_stream_read(*a))
    table = Table()
    sglang.routes(table, reach, guarded)
    openai.routes(table, reach, guarded)
    pooling.routes(table, reach, guarded)
    for r in (config.reward_routes if config is not None else ()):
        rewards.add(table, reach, guarded, r)
    router.routes.insert(0, table)


def dialect(config: ModelApiConfig | None = None) -> Dialect:
    """The model protocols' dialect over ``config`` (its quotas and reward routes)."""
    calls = Calls(config or ModelApiConfig())
    reward_paths = frozenset(r.path for r in config.reward_routes) if config is not None else frozenset()

    def claims(request: Request) -> bool:
        p = request.url.path
        return (p.startswith(PREFIXES) or p == "/v1/models" or p in reward_paths
                or (p.startswith("/v1/models/") and request.method == "GET"))

    return Dialect("modelapi", {"modelapi_models": calls.models, "modelapi_generate": calls.generate,
                                "modelapi_classify": calls.classify, "modelapi_stream_open": calls.stream_open,
                                "modelapi_stream_read": calls.stream_read},
                   routes if config is None else functools.partial(routes, config=config),
                   claims=claims, error=lambda status, message: error_body("openai", status, message),
                   relayed=(ApiError,), configure=lambda raw: dialect(ModelApiConfig.model_validate(raw)))


DIALECT = dialect()

__all__ = ["DIALECT", "ApiError", "ModelApiConfig", "Quota", "RewardRoute", "dialect"]
