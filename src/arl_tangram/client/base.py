"""The part of the clients that does no I/O, written once for the sync and the async client.

Every call is a *plan*: a generator that yields what it needs done — send a ``Request``, or
``Sleep`` before the next attempt — and gets back the ``httpx.Response`` (or has the transport
error thrown into it). It reads the response into a typed result or a ``TangramError`` and, on
a failed attempt, asks ``RetryPolicy.verdict`` whether to try again. The clients in ``sync`` and
``aio`` only carry plans out (``Client.send``/``time.sleep`` or their awaitable twins): the retry
rules, the infra_error re-run of one-shot programs and every request body live here alone.

Why plans: httpx's own layout (a shared base plus a thin wrapper per method in each client)
writes every public method twice, and a sync client that runs the async one on a private event
loop breaks callers that already run a loop (verl's agent loop does).
"""

from __future__ import annotations

import base64
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Generator, Literal, TypedDict, TypeVar

import httpx
from pydantic import BaseModel
from typing_extensions import Unpack

from ..api import v1

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Request:
    """What to send. ``idempotent``: sending it twice does what sending it once does, so a send
    whose fate is unknown (the connection broke after the request left, a 5xx) may be repeated."""

    method: Literal["GET", "POST", "PUT", "DELETE"]
    path: str
    json: Any = None
    params: tuple[tuple[str, str], ...] = ()
    idempotent: bool = True

    def args(self) -> dict[str, Any]:
        """Keyword arguments of ``httpx.Client.request`` / ``httpx.AsyncClient.request``."""
        return {"method": self.method, "url": self.path, "json": self.json, "params": list(self.params) or None}


@dataclass(frozen=True)
class Sleep:
    """Wait this long before the next attempt."""

    seconds: float


Plan = Generator["Request | Sleep", "httpx.Response | None", T]


class TangramError(RuntimeError):
    """The server answered with an error it means (4xx other than 429, or a 5xx after the retries):
    ``status`` is the HTTP status, ``message`` the server's explanation (it names the field)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


RETRY_STATUS = frozenset({500, 502, 503, 504})
# Errors raised before a request can have reached the server: retrying them is always safe.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, ``Retry-After`` honoured. 429 is always retried (the server
    refuses before admitting anything); transport errors and 5xx only when the request is
    idempotent or provably never sent."""

    retries: int = 4
    backoff_s: float = 0.25

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after is not None and retry_after.isdigit():
            return float(retry_after)
        return self.backoff_s * 2 ** attempt * random.uniform(0.5, 1.5)

    def verdict(self, request: Request, attempt: int, response: httpx.Response | None,
                error: Exception | None) -> float | None:
        """The one retry verdict: seconds to wait before sending ``request`` again, or ``None``
        when attempt number ``attempt`` (from 0) is final."""
        if attempt >= self.retries:
            return None
        if error is not None:
            return self.delay(attempt) if request.idempotent or isinstance(error, NOT_SENT) else None
        assert response is not None
        if response.status_code == 429:
            return self.delay(attempt, response.headers.get("retry-after"))
        if response.status_code in RETRY_STATUS and request.idempotent:
            return self.delay(attempt)
        return None


def read(response: httpx.Response) -> Any:
    """A response's JSON body, ``None`` for 204, or ``TangramError`` for any error status."""
    if response.status_code == 204:
        return None
    try:
        body = response.json()
    except ValueError:  # a proxy's HTML page, a truncated body
        raise TangramError(response.status_code, f"not JSON: {response.text[:200]!r}") from None
    if response.status_code >= 400:
        message = body.get("message") if isinstance(body, dict) else None
        raise TangramError(response.status_code, message or response.text[:500])
    return body


def exchange(request: Request, policy: RetryPolicy) -> Plan[Any]:
    """Send ``request`` until the policy's verdict says stop; the body read from the last answer."""
    attempt = 0
    while True:
        response, error = None, None
        try:
            response = yield request
        except httpx.TransportError as e:
            error = e
        wait = policy.verdict(request, attempt, response, error)
        if wait is None:
            if error is not None:
                raise error
            return read(response)
        yield Sleep(wait)
        attempt += 1


def typed(model: type[M], request: Request, policy: RetryPolicy) -> Plan[M]:
    return model.model_validate((yield from exchange(request, policy)))


class RunOptions(TypedDict, total=False):
    """Keyword options of ``run_code``/``submit`` (and the dicts given to ``run_batch``)."""

    stdin: str | None
    files: dict[str, bytes]
    fetch_files: list[str]
    timeout_s: float
    compile_timeout_s: float
    memory_mb: int | None
    cpus: tuple[int, int]
    hint_s: float | None
    parallel_fraction: float
    operation: str
    remaining_turns: int
    #: the image to run in: one in the server's store, or a registry reference it pulls on first use
    image: str | None


def b64(files: dict[str, bytes] | None) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in (files or {}).items()}


def action_body(code: str, language: str, id: str | None, job: str, wait: bool, options: RunOptions) -> dict:
    """The body of ``POST /v1/actions``; an unknown option is a ``TypeError`` naming it."""
    unknown = set(options) - set(RunOptions.__annotations__)
    if unknown:
        raise TypeError(f"run_code: unknown option(s) {sorted(unknown)} (known: {sorted(RunOptions.__annotations__)})")
    o: dict[str, Any] = dict(options)
    action = {"kind": "run_code", "code": code, "language": language, "stdin": o.get("stdin"),
              "files": b64(o.get("files")), "fetch_files": list(o.get("fetch_files") or []),
              "timeout_s": o.get("timeout_s", 10.0), "compile_timeout_s": o.get("compile_timeout_s", 10.0),
              "memory_mb": o.get("memory_mb")}
    if o.get("image") is not None:
        action["image"] = o["image"]
    return {"id": id or f"c-{uuid.uuid4().hex}", "job": job, "wait": wait, "cpus": list(o.get("cpus", (1, 1))),
            "hints": {"work_s": o.get("hint_s"), "parallel_fraction": o.get("parallel_fraction", 0.0),
                      "operation": o.get("operation", ""), "remaining_turns": o.get("remaining_turns")},
            "action": action}


RETRY_MARK = ":retry-"  # within the ids the server accepts (letters, digits and ._:@-)


def first_id(id: str) -> str:
    """The id a re-run's id was derived from."""
    return id.rsplit(RETRY_MARK, 1)[0]


def attempt_id(id: str, attempt: int) -> str:
    """The id of re-run number ``attempt`` of a one-shot program: derived, so that it really runs
    again (the first id's infra_error result is final for that id), yet traceable to the first."""
    return f"{first_id(id)}{RETRY_MARK}{attempt}"


class Methods:
    """The complete method set, written once. Each method builds a plan and hands it to
    ``self._carry_out``: the sync client returns its result, the async client an awaitable of it
    (annotations name the result). Subclasses set ``policy``; sessions share their client's."""

    policy: RetryPolicy

    def _carry_out(self, plan: Plan[Any]) -> Any:  # pragma: no cover - each client defines it
        raise NotImplementedError

    # -- one-shot programs -----------------------------------------------------------------------
    def run_code(self, code: str, language: str = "python", *, id: str | None = None, job: str = "default",
                 **options: Unpack[RunOptions]) -> v1.ActionResult:
        """Run a program and wait for its outcome. An ``infra_error`` (ours, not the code's) is
        re-run under a derived id, up to the policy's retries; the last outcome is returned."""
        return self._carry_out(self._run_code(action_body(code, language, id, job, True, options)))

    def _run_code(self, body: dict) -> Plan[v1.ActionResult]:
        for attempt in range(self.policy.retries + 1):
            this = {**body, "id": attempt_id(body["id"], attempt)} if attempt else body
            result = yield from typed(v1.ActionResult, Request("POST", "/v1/actions", this), self.policy)
            if result.outcome != "infra_error" or attempt == self.policy.retries:
                return result
            yield Sleep(self.policy.delay(attempt))
        raise AssertionError("unreachable")

    def submit(self, code: str, language: str = "python", *, id: str | None = None, job: str = "default",
               **options: Unpack[RunOptions]) -> v1.ActionResult:
        """Queue a program and answer at once (``state`` queued/running); poll ``get`` with its id.
        The id is the idempotency key: submitting it again never runs the program twice."""
        return self._carry_out(typed(v1.ActionResult, Request(
            "POST", "/v1/actions", action_body(code, language, id, job, False, options)), self.policy))

    def get(self, id: str) -> v1.ActionResult:
        """An action's state, and its result once done (404: unknown id); while one waits, its
        ``message`` says for what (a queue's reason, or "pulling IMAGE: N of M MB")."""
        return self._carry_out(typed(v1.ActionResult, Request("GET", f"/v1/actions/{id}"), self.policy))

    def cancel(self, id: str) -> v1.ActionResult:
        """Cancel a queued action (a running one ends on its own time limit)."""
        return self._carry_out(typed(v1.ActionResult, Request("POST", f"/v1/actions/{id}/cancel"), self.policy))

    # -- sessions --------------------------------------------------------------------------------
    def session(self, job: str = "default", trajectory: str | None = None, image: str | None = None) -> Any:
        """Open (or, for a known ``trajectory``, reopen) a stateful session (of ``image``: default the
        server's; an image of its store, or a registry reference it pulls, the first step waiting
        for the pull). The client names a new session itself so that a retried open cannot leave
        an orphan behind."""
        body = {"job": job, "trajectory": trajectory or f"s-{uuid.uuid4().hex}"}
        if image is not None:
            body["image"] = image
        return self._carry_out(self._open(Request("POST", "/v1/sessions", body)))

    def restore(self, snapshot: str, job: str = "default", trajectory: str | None = None) -> Any:
        """A new session whose files are those of ``snapshot`` (``Session.snapshot``); its
        processes start afresh. 404 naming an unknown snapshot."""
        body = {"job": job, "trajectory": trajectory or f"s-{uuid.uuid4().hex}", "restore": snapshot}
        return self._carry_out(self._open(Request("POST", "/v1/sessions", body)))

    def snapshots(self) -> list[v1.SnapshotInfo]:
        """The snapshots the server keeps, oldest first."""
        return self._carry_out(self._list(v1.SnapshotInfo, "/v1/snapshots"))

    def delete_snapshot(self, snapshot: str) -> None:
        """Remove a snapshot (404 naming an unknown one)."""
        return self._carry_out(exchange(Request("DELETE", f"/v1/snapshots/{snapshot}"), self.policy))

    def images(self) -> list[v1.ImageInfo]:
        """The images in the server's store (``tangram image import`` or ``pull`` there, or pulled on
        first use); sessions and one-shots may also name any registry reference."""
        return self._carry_out(self._list(v1.ImageInfo, "/v1/images"))

    def prewarm(self, image: str, n: int, nodes: int | None = None) -> v1.PrewarmResult:
        """Have ``n`` more sandboxes of ``image`` ready (a registry reference not on the server is
        pulled first), within the server's idle cap (``ready`` says how many were started); on a
        Ray cluster on each of ``nodes`` nodes."""
        body: dict = {"image": image, "n": n}
        if nodes is not None:
            body["nodes"] = nodes
        request = Request("POST", "/v1/pools/prewarm", body, idempotent=False)
        return self._carry_out(typed(v1.PrewarmResult, request, self.policy))

    def _list(self, model: type[M], path: str) -> Plan[list[M]]:
        return [model.model_validate(x) for x in (yield from exchange(Request("GET", path), self.policy))]

    def _open(self, request: Request) -> Plan[Any]:
        info = yield from typed(v1.SessionInfo, request, self.policy)
        return self._session(info)

    def _session(self, info: v1.SessionInfo) -> Any:  # pragma: no cover - each client defines it
        raise NotImplementedError

    # -- model services --------------------------------------------------------------------------
    def score(self, model: str, tokens: list[int], job: str = "default", hint_s: float | None = None) -> v1.ModelResult:
        """A reward model's scalar for one sequence (the server batches concurrent calls)."""
        return self._model(model, "score", tokens, job, hint_s)

    def logprobs(self, model: str, tokens: list[int], job: str = "default",
                 hint_s: float | None = None) -> v1.ModelResult:
        """A teacher's per-token log-probabilities of one sequence."""
        return self._model(model, "logprobs", tokens, job, hint_s)

    def _model(self, model: str, op: str, tokens: list[int], job: str, hint_s: float | None) -> Any:
        body = {"tokens": tokens, "job": job, "hint_s": hint_s}
        return self._carry_out(typed(v1.ModelResult, Request("POST", f"/v1/models/{model}/{op}", body), self.policy))

    # -- observing the server --------------------------------------------------------------------
    def stats(self, job: str) -> v1.JobStats:
        """Outcome counts and ACT percentiles of one job (404: no action seen for it)."""
        return self._carry_out(typed(v1.JobStats, Request("GET", f"/v1/jobs/{job}/stats"), self.policy))

    def jobs(self) -> list[v1.JobStats]:
        """``stats`` of every job the server has seen."""
        return self._carry_out(self._jobs())

    def _jobs(self) -> Plan[list[v1.JobStats]]:
        return [v1.JobStats.model_validate(j) for j in (yield from exchange(Request("GET", "/v1/jobs"), self.policy))]

    def health(self) -> dict:
        """``/healthz``: queue length, running actions, cores, sessions, isolation mode, version."""
        return self._carry_out(exchange(Request("GET", "/healthz"), self.policy))

    def cluster(self) -> dict:
        """``GET /v1/cluster``: the pools the server schedules (a server without it answers 404)."""
        return self._carry_out(exchange(Request("GET", "/v1/cluster"), self.policy))


@dataclass
class SessionMethods:
    """A session's calls, written once; ``client`` carries the plans out."""

    client: Methods
    id: str
    job: str = "default"
    policy: RetryPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = self.client.policy

    def exec(self, command: str | None = None, *, python: str | None = None, stdin: str | None = None,
             timeout_s: float = 10.0, cpus: tuple[int, int] = (1, 1), hint_s: float | None = None,
             parallel_fraction: float = 0.0, operation: str = "", remaining_turns: int | None = None
             ) -> v1.ActionResult:
        """Run a shell ``command`` or ``python`` in the session's persistent interpreter (exactly
        one). Not idempotent, so never re-sent once it may have reached the server; an
        ``infra_error`` is returned, not retried: the session's state may be gone."""
        body = {"command": command, "python": python, "stdin": stdin, "timeout_s": timeout_s, "cpus": list(cpus),
                "hints": {"work_s": hint_s, "parallel_fraction": parallel_fraction, "operation": operation,
                          "remaining_turns": remaining_turns}}
        request = Request("POST", f"/v1/sessions/{self.id}/exec", body, idempotent=False)
        return self.client._carry_out(typed(v1.ActionResult, request, self.policy))

    def put_files(self, files: dict[str, bytes]) -> v1.ActionResult:
        """Write files into the session's workspace."""
        request = Request("PUT", f"/v1/sessions/{self.id}/files", {"files": b64(files)})
        return self.client._carry_out(typed(v1.ActionResult, request, self.policy))

    def get_files(self, paths: list[str]) -> dict[str, bytes]:
        """Read files from the workspace; paths that do not exist are absent from the result."""
        return self.client._carry_out(self._get_files(paths))

    def _get_files(self, paths: list[str]) -> Plan[dict[str, bytes]]:
        request = Request("GET", f"/v1/sessions/{self.id}/files", params=tuple(("path", p) for p in paths))
        got = v1.GotFiles.model_validate((yield from exchange(request, self.policy)))
        return {k: base64.b64decode(v) for k, v in got.files.items()}

    def fs(self, call: str, path: str, *, destination: str | None = None, depth: int = 1, data: bytes = b"",
           max_bytes: int = 1 << 24) -> v1.FsResult:
        """One filesystem call anywhere in the session's sandbox (``stat``, ``list``, ``mkdir``,
        ``remove``, ``move``, ``read``, ``write``; absolute paths), carried out by the sandbox's
        agent: nothing the session's own code did can answer it. A failure raises ``TangramError``
        (404 not found, 409 exists, 403 denied, 422 otherwise). Calls that change the files are not
        retried once sent."""
        body = {"call": call, "path": path, "destination": destination, "depth": depth,
                "data": base64.b64encode(data).decode(), "max_bytes": max_bytes}
        request = Request("POST", f"/v1/sessions/{self.id}/fs", body, idempotent=call in ("stat", "list", "read"))
        return self.client._carry_out(typed(v1.FsResult, request, self.policy))

    def fork(self, n: int) -> list[Any]:
        """``n`` new sessions whose files start as this one's, copy-on-write (nothing is copied;
        none sees another's writes). The shell and python interpreter of this session and the
        children start afresh on their next step. Not retried once sent; a fork the server could
        not make raises ``TangramError`` (422: refused, naming why; 503: our failure)."""
        return self.client._carry_out(self._fork(n))

    def _fork(self, n: int) -> Plan[list[Any]]:
        request = Request("POST", f"/v1/sessions/{self.id}/fork", {"n": n}, idempotent=False)
        r = yield from typed(v1.ForkResult, request, self.policy)
        if r.outcome != "ok":
            raise TangramError(422 if r.outcome == "rejected" else 503, f"fork {r.outcome}: {r.message}")
        return [self.client._session(v1.SessionInfo(session_id=c, job=self.job)) for c in r.session_ids]

    def snapshot(self) -> v1.SnapshotInfo:
        """Snapshot the session's files on the server (``snapshot`` is the id ``restore`` takes)."""
        request = Request("POST", f"/v1/sessions/{self.id}/snapshot", idempotent=False)
        return self.client._carry_out(typed(v1.SnapshotInfo, request, self.policy))

    def close(self) -> None:
        """Close the session: its sandbox, files and processes go."""
        return self.client._carry_out(exchange(Request("DELETE", f"/v1/sessions/{self.id}"), self.policy))


class Walk:
    """Steps through a plan for a client: ``next()`` is the next step, ``None`` once the plan has
    finished (its result in ``value``); set ``reply`` or ``error`` before the next ``next()``."""

    def __init__(self, plan: Plan[Any]) -> None:
        self.plan = plan
        self.reply: httpx.Response | None = None
        self.error: httpx.TransportError | None = None
        self.value: Any = None

    def next(self) -> Request | Sleep | None:
        try:
            step = self.plan.send(self.reply) if self.error is None else self.plan.throw(self.error)
        except StopIteration as done:
            self.value = done.value
            return None
        self.reply, self.error = None, None
        return step


def headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
