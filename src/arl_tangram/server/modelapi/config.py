"""What the model protocols take from configuration: API quotas and the reward models' batch
routes. Nothing here is needed for a model service to be reached (every configured service
answers the routes of its kind without it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: routes a reward route's path may not take (the model protocols' own and the native API's)
RESERVED = ("/generate", "/classify", "/pooling", "/v1/", "/models/", "/healthz", "/metrics", "/run_code",
            "/sandboxes", "/v2/", "/templates", "/docs", "/openapi.json")


class Quota(BaseModel):
    """A limit on the model protocols' requests: at most ``requests_per_minute`` requests and
    ``tokens_per_minute`` tokens (prompt and generated) in any 60 s, per API key (by the job the
    key acts as; a request without a key counts as job ``default``) and per model. ``job`` and
    ``model``: which ones it applies to, ``*`` for each one (each counted on its own)."""

    model_config = ConfigDict(extra="forbid")

    job: str = Field("*", min_length=1, description="an API key's job, or * for each job")
    model: str = Field("*", min_length=1, description="a model service's name, or * for each model")
    requests_per_minute: int | None = Field(None, ge=1, description="requests in any 60 s (None: no limit)")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt and generated tokens in any 60 s "
                                          "(None: no limit); counted once a request is answered")


class RewardRoute(BaseModel):
    """A reward model's batch route in a framework's own shape: OpenRLHF's ``--remote_rm_url``
    (``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``) or slime's
    remote reward model (``{"prompt", "response", "label"}`` -> the reward)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., pattern=r"^/[A-Za-z0-9._~/-]*$", description="the route, e.g. /reward")
    model: str = Field(..., min_length=1, description="the score model service that scores the texts")
    shape: Literal["openrlhf", "slime"]

    @field_validator("path")
    @classmethod
    def _free(cls, v: str) -> str:
        if v == "/" or any(v == r.rstrip("/") or v.startswith(r if r.endswith("/") else r + "/") or v == r
                           for r in RESERVED):
            raise ValueError(f"path {v!r} is taken by another route")
        return v


class ModelApiConfig(BaseModel):
    """The model protocols' settings (``tangram serve``'s ``[model_api]``)."""

    model_config = ConfigDict(extra="forbid")

    quotas: list[Quota] = Field(default_factory=list)
    reward_routes: list[RewardRoute] = Field(default_factory=list)

    @field_validator("reward_routes")
    @classmethod
    def _distinct(cls, v: list[RewardRoute]) -> list[RewardRoute]:
        if len({r.path for r in v}) != len(v):
            raise ValueError("two reward routes share a path")
        return v
