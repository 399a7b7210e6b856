"""One pydantic config tree for ``tangram serve`` (TOML or JSON file); every field documented."""

from __future__ import annotations

import json
import os
import tomllib
from typing import Literal
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..managers.models.spec import HF_TASKS, hf_dir_problem
from ..managers.sandbox.registry.config import RegistriesConfig, RegistryHost
from ..managers.sandbox.spec import SandboxConfig
from ..policy import MOVE_S, POLICIES
from ..waits import DEFAULT_MAX_QUEUE_S
from .modelapi.config import ModelApiConfig


class ConfigError(ValueError):
    pass


class ModelService(BaseModel):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    loader: str | None = Field(None, pattern=r"^[A-Za-z0-9_.]+:[A-Za-z0-9_]+$", description="module:function "
                               "returning (torch module, {op: fn}), for custom code (or give hf)")
    hf: str | None = Field(None, min_length=1, description="a local Hugging Face model directory (config.json "
                           "and *.safetensors; nothing is downloaded)")
    task: Literal["logprobs", "score"] | None = Field(None, description="with hf: logprobs (a causal LM) or score "
                                                      "(a sequence-classification head at the last token)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="with hf: cast the "
                                                                   "floating-point weights (default: as stored)")
    kwargs: dict = Field(default_factory=dict)
    gpus: int = Field(1, ge=1)
    memory_gb: float | None = Field(None, gt=0)
    max_batch: int = Field(16, ge=1)
    max_wait_ms: float = Field(5.0, ge=0)
    compute_share: float = Field(1.0, gt=0, le=1, description="fraction of each GPU's compute one batch gets; "
                                 "batches of services whose shares add up to <= 1 run on a GPU at once")
    idle_s: float | None = Field(None, ge=0, description="a copy unused this long releases its GPU memory "
                                 "(scale to zero); default: kept while it fits")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelService":
        if (self.loader is None) == (self.hf is None):
            raise ValueError(f"model {self.name!r}: give exactly one of loader and hf")
        if self.hf is not None:
            if self.task is None:
                raise ValueError(f"task: model {self.name!r} from hf needs task ({' or '.join(HF_TASKS)})")
            problem = hf_dir_problem(self.hf)
            if problem is not None:
                raise ValueError(problem)
        elif self.task is not None or self.dtype is not None:
            raise ValueError(f"model {self.name!r}: task and dtype go with hf (a loader returns its own ops)")
        return self


class ApiKey(BaseModel):
    """An API key that acts as one job (README, "API keys and jobs")."""

    key: str = Field(..., min_length=16, max_length=512, pattern=r"^[!-~]+$",
                     description="the secret clients send (Authorization: Bearer, or E2B_API_KEY); 16 or more "
                                 "printable characters")
    job: str = Field(..., min_length=1, max_length=200, description="the job whose sessions, sandboxes and "
                     "actions the key sees and submits under (its fair share)")


class ImagesConfig(BaseModel):
    """The image store (``[images]``); where images come from is ``[[registries]]``."""

    model_config = ConfigDict(extra="forbid")

    max_gb: float | None = Field(None, gt=0, description="disk the image store may use: past it, after a pull, "
                                 "the least recently used images no sandbox uses are removed (default: no bound; "
                                 "`tangram image prune` applies it by hand)")
    docker_config: str | None = Field(None, description="Docker's config.json to take registry credentials from "
                                      "(default: $DOCKER_CONFIG/config.json, else ~/.docker/config.json)")
    durable: bool = Field(True, description="a machine that crashes never uses a layer whose files were lost: an "
                          "imported layer is synced (syncfs) before it becomes visible, a pulled one behind its pull "
                          "(a marker on disk until then; one from an earlier boot has its layer removed at start); "
                          "false skips it (for a store that is a throwaway cache)")


class ServeConfig(BaseModel):
    policy: str = Field("tangram", description=f"scheduling policy ({', '.join(POLICIES)})")
    cores: int | None = Field(None, ge=1, description="cores to schedule (default: this process's CPUs)")
    journal: str | None = Field(None, description="SQLite journal path (default ~/.local/state/arl-tangram/...)")
    record: str | None = Field(None, description="write every finished action to this JSONL trace (replay it "
                                                 "under every policy with tangram simulate --trace)")
    max_queue: int = Field(10_000, ge=1, description="waiting actions before new ones get HTTP 429")
    max_queue_s: float = Field(DEFAULT_MAX_QUEUE_S, gt=0, description="an action not started this many seconds "
                                                                     "after submission ends rejected, saying what it "
                                                                     "waited for")
    memory_gb: float | None = Field(None, gt=0, description="memory sessions may reserve (default: this machine's)")
    max_body_mb: float = Field(32, gt=0, description="largest request body accepted (HTTP 413 above)")
    sandbox_workers: int | None = Field(None, ge=0, le=64, description="processes that carry out one-shot runs "
                                        "beside the engine process (0: none; default: 0 on 2 cores or fewer, else "
                                        "one per 4 cores, at most 8)")
    fronts: int | None = Field(None, ge=0, le=64, description="HTTP front processes beside the engine process "
                               "(0: HTTP in the engine process; default: 0 on 2 cores or fewer, else one per 4 "
                               "cores, at most 8)")
    drain_s: float = Field(10.0, ge=0, description="on shutdown, how long running actions may finish")
    api_keys: list[ApiKey] = Field(default_factory=list, description="API keys, each acting as one job: a "
                                   "request with one sees only that job's sessions, sandboxes and actions, and "
                                   "submits under it; with any configured, every request needs a key (or --token)")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    registries: list[RegistryHost] = Field(default_factory=list, description="[[registries]] tables: how to reach "
                                           "the registries images are pulled from by reference (mirrors, plain "
                                           "HTTP for hosts named insecure, credentials)")
    model_api: ModelApiConfig = Field(default_factory=ModelApiConfig, description="[model_api]: the model "
                                      "protocols' quotas and reward routes (docs/model-protocols.md)")
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    models: list[ModelService] = Field(default_factory=list, description="model services to serve on the GPUs "
                                                                          "(or CPU devices without CUDA)")
    gpus: int | None = Field(None, ge=1, description="GPUs to schedule (default: all visible; CPU devices: 1); "
                             "with --ray, per GPU node (default: the node's Ray GPU resource)")
    gpu_memory_gb: float | None = Field(None, gt=0, description="memory per GPU (default: the device's)")
    gpu_island_size: int | None = Field(None, ge=1, description="GPUs per NVLink island (default: discovered "
                                        "from NVML or nvidia-smi)")
    move_s: float = Field(MOVE_S, ge=0, description="with --ray, what the policy expects moving a session to "
                          "another node to cost, in seconds (default: what `tangram bench cluster` measured): a "
                          "step whose node is full waits for it when that is predicted quicker than a move; "
                          "where the last 16 moves cost more (p50, the carry and the session's wake on its new node), "
                          "that is the price instead")
    ray_resource: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$", description="with --ray, "
                                     "serve only the Ray nodes that have this custom resource (`ray start "
                                     "--resources '{\"NAME\": 1}'`): several heads share one Ray cluster, each with "
                                     "its own nodes, journal and jobs (docs/scale.md)")
    lease_s: float = Field(60.0, gt=0, description="with --ray, how long the nodes' agents keep their sessions "
                           "once the head stops renewing their lease: a head restarted within it re-attaches them; "
                           "after it they close everything and exit")

    @field_validator("api_keys")
    @classmethod
    def _distinct_keys(cls, v: list[ApiKey]) -> list[ApiKey]:
        if len({k.key for k in v}) != len(v):
            raise ValueError("the same key is given twice")
        return v

    def keys(self) -> dict[str, str]:
        """API key -> its job."""
        return {k.key: k.job for k in self.api_keys}

    def dialect_settings(self) -> dict[str, dict]:
        """The dialects' own tables, by dialect name, as plain data (``calls.with_dialects``); a
        dialect left at its defaults is not named."""
        return {"modelapi": self.model_api.model_dump()} if self.model_api != ModelApiConfig() else {}

    @field_validator("registries")
    @classmethod
    def _one_table_a_host(cls, v: list[RegistryHost]) -> list[RegistryHost]:
        hosts = [r.host for r in v]
        for h in hosts:
            if hosts.count(h) > 1:
                raise ValueError(f"host {h!r} has two tables")
        return v

    @model_validator(mode="after")
    def _images_to_sandboxes(self) -> "ServeConfig":
        """The sandboxes pull and bound the store: they carry these (to workers and nodes too)."""
        update: dict = {}
        if self.registries or self.images.docker_config is not None:
            update["registries"] = RegistriesConfig(registries=self.registries,
                                                    docker_config=self.images.docker_config)
        if self.images.max_gb is not None:
            update["image_max_gb"] = self.images.max_gb
        if not self.images.durable:
            update["image_durable"] = False
        if update:
            self.sandbox = self.sandbox.model_copy(update=update)
        return self

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r} (known: {', '.join(POLICIES)})")
        return v


def load(path: Path) -> ServeConfig:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--config: {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}") \
            from None
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"--config: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def default_journal() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "arl-tangram" / "journal.sqlite3"


def build(cfg: ServeConfig, token: str | None = None, journal: Path | None = None, sandboxes=True,
          ray: str | None = None, record: Path | None = None):
    """The ASGI app of ``tangram serve`` in one process (``build_service``'s service behind it)."""
    from .app import create_app
    from .calls import with_dialects

    return create_app(build_service(cfg, journal, sandboxes, ray, record), token=token,
                      max_body_bytes=int(cfg.max_body_mb * (1 << 20)), keys=cfg.keys(),
                      dialects=with_dialects(settings=cfg.dialect_settings()))


def build_service(cfg: ServeConfig, journal: Path | None = None, sandboxes=True, ray: str | None = None,
                  record: Path | None = None):
    """The service of ``tangram serve``: over this machine, or over the Ray cluster at ``ray``
    (``auto`` or ``HOST:PORT``); ``sandboxes`` may name another sandbox manager factory (tests
    serve over an in-process double this way)."""
    from ..runtime import LocalRuntime
    from .journal import Journal
    from .service import Service

    path = Path(journal or cfg.journal or default_journal())
    path.parent.mkdir(parents=True, exist_ok=True)
    models = None
    if cfg.models:
        from ..managers.models.spec import ModelServiceConfig
        models = [ModelServiceConfig(**m.model_dump()) for m in cfg.models]
    if ray is not None:
        from ..runtime.ray_runtime import RayRuntime
        from .journal import journal_owner
        # the head loads no weights (it needs no torch); each GPU node's agent does. On Ray, gpus / gpu_memory_gb / gpu_island_size apply to every GPU node
        runtime = RayRuntime(ray, cfg.policy, cfg.sandbox, max_queue_s=cfg.max_queue_s, models=models,
                             gpus_per_node=cfg.gpus, gpu_memory_gb=cfg.gpu_memory_gb,
                             gpu_island_size=cfg.gpu_island_size, move_s=cfg.move_s,
                             lease_s=cfg.lease_s, owner=f"tangram serve {journal_owner(str(path))}",
                             resource=cfg.ray_resource)
    else:
        workers = cfg.sandbox_workers
        if workers is None:
            from ..runtime.host import helper_processes
            workers = helper_processes(len(cfg.sandbox.cpus or os.sched_getaffinity(0)))
        sandbox = cfg.sandbox
        if sandbox.rest_dir is None:  # beside the journal: a restart finds the sessions it left at rest
            sandbox = sandbox.model_copy(update={"rest_dir": str(path) + ".rest"})
        runtime = LocalRuntime(cfg.policy, sandbox, cfg.cores, cfg.memory_gb, models=models, gpus=cfg.gpus,
                               gpu_memory_gb=cfg.gpu_memory_gb, gpu_island_size=cfg.gpu_island_size,
                               sandboxes=sandboxes, max_queue_s=cfg.max_queue_s, workers=workers)
    if record is not None or cfg.record is not None:
        runtime.record(record or cfg.record)
    return Service(runtime, Journal(str(path)), cfg.max_queue, cfg.drain_s, snapshot_dir=cfg.sandbox.snapshot_dir)
