"""The model protocols' calls in the engine process: which service a request names, its quota,
and its requests run as the model services' batched calls (``Tangram.call_model``).

The routes (``sglang.py``, ``openai.py``, ``pooling.py``, ``rewards.py``) translate a body into
``Generate`` or ``Classify`` requests and the answers back; what needs the engine process's state
is here: the model services (``service.runtime.models``), the quotas, and the counters on the
service's ``/metrics`` registry (``service.metrics.registry``). A model is named by its service
name or by its model directory (verl sends the path it loaded the model from), or left out when
one service of the kind is served.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from prometheus_client import Counter

from ...core.action import Outcome
from ...managers.models.generation import Classified, Classify, Generate, Generated
from ..service import UNNAMED_JOB, Overloaded, Service, job_for
from .common import ApiError, new_id
from .config import ModelApiConfig
from .quotas import Quotas
from .streams import UNREAD_S, Stream, Streamed, Waker

#: a causal LM (``task = "logprobs"``) generates; a score model (``task = "score"``) classifies
OPS = {"logprobs": "generate", "score": "classify"}
STATE = "modelapi"


class State:
    """The protocols' state on one service: its quotas and counters."""

    def __init__(self, service: Service, config: ModelApiConfig) -> None:
        self.service = service
        self.quotas = Quotas(config.quotas)
        self.streams: dict[str, Stream] = {}  # streamed requests by id (``streams.py``)
        self.waker: Waker | None = None
        self._children: dict[tuple, Any] = {}
        reg = service.metrics.registry
        self.requests = Counter("tangram_model_api_requests_total", "Requests of the model protocols, by protocol, "
                                "model, job and HTTP status", ["protocol", "model", "job", "status"], registry=reg)
        self.tokens = Counter("tangram_model_api_tokens_total", "Tokens of the model protocols' answered requests, "
                              "by model, job and kind (prompt, completion)", ["model", "job", "kind"], registry=reg)
        self.throttled = Counter("tangram_model_api_throttled_total", "Requests answered 429 by an API quota, by "
                                 "model, job and the limit reached (requests, tokens)", ["model", "job", "limit"],
                                 registry=reg)

    def services(self) -> dict[str, Any]:
        models = self.service.runtime.models
        return dict(models.services) if models is not None else {}

    def resolve(self, model: str | None, task: str) -> str:
        """The service a request names (by name or model directory; none: the one of its kind)."""
        services = self.services()
        of_task = [n for n, s in services.items() if s.hf is not None and s.task == task]
        what = "causal LM" if task == "logprobs" else "score model"
        if not model:
            if len(of_task) == 1:
                return of_task[0]
            raise ApiError(400 if of_task else 404, f"model: required (served {what}s: {', '.join(of_task)})"
                           if of_task else f"model: no {what} is served here", param="model")
        name = model if model in services else None
        if name is None:
            want = os.path.normpath(model)
            by_dir = [n for n in of_task if os.path.normpath(services[n].hf) == want]
            name = by_dir[0] if len(by_dir) == 1 else None
        if name is None:
            raise ApiError(404, f"The model `{model}` does not exist (served {what}s: {', '.join(of_task) or 'none'})",
                           param="model")
        if name not in of_task:
            other = services[name].task if services[name].hf is not None else "custom"
            raise ApiError(400, f"model: {name!r} is a {other} service, not a {what}: "
                           + ("it answers /classify, /pooling and /v1/embeddings" if other == "score" else
                              "it answers /generate, /v1/completions and /v1/chat/completions" if other == "logprobs"
                              else "it answers the native API only"), param="model")
        problem = self.service.runtime.models.validate(name, OPS[task], [0], 1)  # type: ignore[union-attr]
        if problem is not None:  # a service that failed to load: ours
            raise ApiError(503, problem, retry_after_s=5)
        return name

    def count(self, counter: Counter, *labels: str) -> Any:
        """A counter's labelled child, kept: ``labels()`` locks and validates on every call."""
        key = (id(counter), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(*labels)
        return child

    def enter(self, protocol: str, model: str, job: str) -> None:
        throttled = self.quotas.enter(job, model)
        if throttled is not None:
            self.count(self.throttled, model, job, throttled.limit).inc()
            self.count(self.requests, protocol, model, job, "429").inc()
            q = throttled.quota
            per = q.requests_per_minute if throttled.limit == "requests" else q.tokens_per_minute
            raise ApiError(429, f"rate limit reached for {model} (job {job}): {per} {throttled.limit} per minute; "
                           f"retry in {throttled.retry_after_s}s", kind=throttled.limit,
                           code="rate_limit_exceeded", retry_after_s=throttled.retry_after_s)


def state(service: Service, config: ModelApiConfig) -> State:
    return service.dialect_state(STATE, lambda s: State(s, config))


class Calls:
    """The engine-side calls (``fn(service, *args)``), over one configuration."""

    def __init__(self, config: ModelApiConfig) -> None:
        self.config = config

    def models(self, service: Service) -> list[dict]:
        """The services the protocols serve: name, task, model directory."""
        st = state(service, self.config)
        return [{"id": n, "task": s.task, "root": s.hf} for n, s in st.services().items()
                if s.hf is not None and s.task in OPS]

    async def generate(self, service: Service, protocol: str, model: str | None,
                       items: list[Generate]) -> tuple[str, list[Generated]]:
        """Run ``items`` (one HTTP request's prompts) on the causal LM ``model`` names."""
        st = state(service, self.config)
        name = st.resolve(model, "logprobs")
        return name, await self._run(st, service, protocol, name, "generate", items)

    async def classify(self, service: Service, protocol: str, model: str | None,
                       items: list[Classify]) -> tuple[str, list[Classified]]:
        """Run ``items`` (one HTTP request's inputs) on the score model ``model`` names."""
        st = state(service, self.config)
        name = st.resolve(model, "score")
        return name, await self._run(st, service, protocol, name, "classify", items)

    async def stream_open(self, service: Service, protocol: str, model: str | None,
                          items: list[Generate]) -> tuple[str, str]:
        """Start ``items`` on the causal LM ``model`` names as ``generate`` does (the same checks,
        quota and admission, each a 4xx or 429 here), their tokens streamed: the stream's id and
        the model's name (``streams.py``)."""
        st = state(service, self.config)
        name = st.resolve(model, "logprobs")
        job = self._admit(st, service, protocol, name, "generate", items)
        now = time.monotonic()
        for sid in [k for k, v in st.streams.items() if now - v.read_at > UNREAD_S]:
            st.streams.pop(sid)  # its client went away: its run ends on its own
        if st.waker is None or st.waker.loop is not asyncio.get_running_loop():
            st.waker = Waker(asyncio.get_running_loop())
        stream = Stream(st.waker, name)
        streamed = [Streamed(it, stream.sink(i)) for i, it in enumerate(items)]

        async def run() -> None:
            try:
                answers = await self._call(st, service, protocol, name, "generate", streamed, job)
            except asyncio.CancelledError:  # the server stops: a waiting read ends with a 503 to retry
                stream.finish(error=ApiError(503, "the server is stopping", retry_after_s=1))
                raise
            except Exception as e:  # the read raises it: an ApiError as the protocol's error
                stream.finish(error=e)
            else:
                stream.finish(answers)

        sid = new_id("stream")
        st.streams[sid] = stream
        stream.task = asyncio.get_running_loop().create_task(run())
        return sid, name

    async def stream_read(self, service: Service, sid: str, sent: int, wait_s: float) -> dict:
        """The events of stream ``sid`` past the first ``sent`` (waiting up to ``wait_s`` for one),
        and its answers once it ran; a stream read to its end is dropped."""
        st = state(service, self.config)
        stream = st.streams.get(sid)
        if stream is None:
            raise ApiError(404, f"stream {sid}: unknown or already read to its end")
        try:
            got = await stream.read(sent, min(max(wait_s, 0.0), 60.0))
        except BaseException:
            st.streams.pop(sid, None)
            raise
        if got["done"]:
            st.streams.pop(sid, None)
        return got

    async def _run(self, st: State, service: Service, protocol: str, name: str, op: str, items: list) -> list:
        job = self._admit(st, service, protocol, name, op, items)
        return await self._call(st, service, protocol, name, op, items, job)

    def _admit(self, st: State, service: Service, protocol: str, name: str, op: str, items: list) -> str:
        """The request's job once its token ids are checked, its quota let it in and the queue has
        room."""
        job = job_for(None, UNNAMED_JOB)
        if not items:
            raise ApiError(400, "prompt: empty batch", param="prompt")
        models = service.runtime.models
        for it in items:  # token ids are checked before anything queues; text is checked where it is tokenized
            if it.ids is not None:
                problem = models.validate(name, op, it.ids, 1)  # type: ignore[union-attr]
                if problem is not None:
                    raise ApiError(400, problem.replace("tokens:", "prompt:", 1), param="prompt")
        st.enter(protocol, name, job)
        try:
            service.admit()
        except Overloaded:  # the server's queue is full: a 429 too
            st.count(st.requests, protocol, name, job, "429").inc()
            raise
        return job

    async def _call(self, st: State, service: Service, protocol: str, name: str, op: str, items: list,
                    job: str) -> list:
        try:
            if len(items) == 1:  # no task for the common case
                done = [await service.tg.call_model(name, op, items[0], job=job)]
            else:
                done = await asyncio.gather(*(service.tg.call_model(name, op, it, job=job) for it in items))
            out = []
            for r in done:
                if r.outcome is not Outcome.OK:  # the input was checked: a queue past max_queue_s, the GPU, ours
                    raise ApiError(503, f"{r.outcome.value}: {r.message}", retry_after_s=1)
                out.append(r.result)
            bad = next((x for x in out if x.error), None)
            if bad is not None:
                raise ApiError(400, bad.error, param=bad.error.split(":", 1)[0] if ":" in bad.error else None)
        except ApiError as e:
            st.count(st.requests, protocol, name, job, str(e.status)).inc()
            raise
        except BaseException:
            st.count(st.requests, protocol, name, job, "5xx").inc()
            raise
        st.count(st.requests, protocol, name, job, "200").inc()
        if op == "generate":
            prompt = sum(len(x.prompt_ids) for x in out)
            completion = sum(len(x.output_ids) for x in out)
        else:
            prompt, completion = sum(x.tokens for x in out), 0
        st.count(st.tokens, name, job, "prompt").inc(prompt)
        if completion:
            st.count(st.tokens, name, job, "completion").inc(completion)
        st.quotas.charge(job, name, prompt + completion)
        return out
