"""Python clients for ``tangram serve`` (sync and async, on httpx).

Every submission carries an id (generated when not given), so a retried request can never run an
action twice. Transport errors, HTTP 5xx and 429 (honouring Retry-After) are retried with
exponential backoff; so is an ``infra_error`` outcome of a one-shot run (under a derived id, as a
new attempt), because it is ours and not the code's. A session step that ends in ``infra_error``
is returned, not retried: its state may be gone and only the caller knows what to redo.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import AsyncIterator, Iterable, Iterator

import httpx

from ..api import v1

RETRY_STATUS = {429, 500, 502, 503, 504}


class TangramError(RuntimeError):
    """The server refused a request (4xx other than 429): the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _b64(files: dict[str, bytes] | None) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in (files or {}).items()}


def _request(code: str, language: str, id: str | None, job: str, wait: bool, **kw) -> dict:
    action = {"kind": "run_code", "code": code, "language": language, "stdin": kw.get("stdin"),
              "files": _b64(kw.get("files")), "fetch_files": list(kw.get("fetch_files") or []),
              "timeout_s": kw.get("timeout_s", 10.0), "compile_timeout_s": kw.get("compile_timeout_s", 10.0),
              "memory_mb": kw.get("memory_mb")}
    return {"id": id or f"c-{uuid.uuid4().hex}", "job": job, "wait": wait, "cpus": list(kw.get("cpus", (1, 1))),
            "hints": {"work_s": kw.get("hint_s"), "parallel_fraction": kw.get("parallel_fraction", 0.0),
                      "operation": kw.get("operation", "")}, "action": action}


def _delay(attempt: int, response: httpx.Response | None, base: float) -> float:
    if response is not None and response.headers.get("retry-after", "").isdigit():
        return float(response.headers["retry-after"])
    return base * 2 ** attempt * random.uniform(0.5, 1.5)


def _decide(attempt: int, retries: int, response: httpx.Response | None, error: Exception | None,
            backoff_s: float) -> tuple[bool, float, dict | None]:
    """One attempt's verdict, shared by both clients: (done, delay before the next try, body).
    Raises the transport error or ``TangramError`` when there is nothing left to try."""
    retryable = error is not None or response.status_code in RETRY_STATUS
    if not retryable:
        return True, 0.0, _check(response)
    if attempt == retries:
        if error is not None:
            raise error
        return True, 0.0, _check(response)
    return False, _delay(attempt, response, backoff_s), None


def _retry_id(req: dict, attempt: int) -> dict:
    """A new attempt of a one-shot run after an infra_error: a derived id, so it really runs."""
    return {**req, "id": f"{req['id'].split('~')[0]}~{attempt + 1}"}


def _check(r: httpx.Response) -> dict | None:
    if r.status_code == 204:
        return None
    body = r.json()
    if r.status_code >= 400:
        raise TangramError(r.status_code, body.get("message", r.text) if isinstance(body, dict) else r.text)
    return body


class TangramClient:
    """Synchronous client. ``with TangramClient("http://127.0.0.1:8080") as c: c.run_code(...)``."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", token: str | None = None, timeout_s: float = 600,
                 retries: int = 4, backoff_s: float = 0.25) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s

    def __enter__(self) -> "TangramClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, url: str, **kw) -> dict | None:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = self.http.request(method, url, **kw)
            except httpx.TransportError as e:
                error = e
            done, delay, body = _decide(attempt, self.retries, response, error, self.backoff_s)
            if done:
                return body
            time.sleep(delay)
        raise AssertionError("unreachable")

    def run_code(self, code: str, language: str = "python", *, id: str | None = None, job: str = "default",
                 **kw) -> v1.ActionResult:
        """Run a one-shot program and wait for its outcome."""
        req = _request(code, language, id, job, True, **kw)
        for attempt in range(self.retries + 1):
            result = v1.ActionResult.model_validate(self._call("POST", "/v1/actions", json=req))
            if result.outcome != "infra_error" or attempt == self.retries:
                return result
            req = _retry_id(req, attempt)
            time.sleep(_delay(attempt, None, self.backoff_s))
        return result

    def submit(self, code: str, language: str = "python", *, id: str | None = None, job: str = "default",
               **kw) -> v1.ActionResult:
        """Queue a one-shot program; poll ``get`` with the returned id."""
        return v1.ActionResult.model_validate(self._call("POST", "/v1/actions",
                                                         json=_request(code, language, id, job, False, **kw)))

    def get(self, id: str) -> v1.ActionResult:
        return v1.ActionResult.model_validate(self._call("GET", f"/v1/actions/{id}"))

    def cancel(self, id: str) -> v1.ActionResult:
        return v1.ActionResult.model_validate(self._call("POST", f"/v1/actions/{id}/cancel"))

    def run_batch(self, programs: Iterable[dict], concurrency: int = 32) -> Iterator[v1.ActionResult]:
        """Run many ``run_code`` keyword sets; yields results as they finish."""
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(lambda p=p: self.run_code(**p)) for p in programs]
            for f in as_completed(futures):
                yield f.result()

    def score(self, model: str, tokens: list[int], job: str = "default") -> v1.ModelResult:
        """A reward model's scalar for one sequence (the server batches concurrent calls)."""
        return v1.ModelResult.model_validate(self._call("POST", f"/v1/models/{model}/score",
                                                        json={"tokens": tokens, "job": job}))

    def logprobs(self, model: str, tokens: list[int], job: str = "default") -> v1.ModelResult:
        return v1.ModelResult.model_validate(self._call("POST", f"/v1/models/{model}/logprobs",
                                                        json={"tokens": tokens, "job": job}))

    def session(self, job: str = "default", trajectory: str | None = None) -> "ClientSession":
        info = self._call("POST", "/v1/sessions", json={"job": job, "trajectory": trajectory})
        return ClientSession(self, info["session_id"])

    def stats(self, job: str) -> v1.JobStats:
        return v1.JobStats.model_validate(self._call("GET", f"/v1/jobs/{job}/stats"))

    def health(self) -> dict:
        return self._call("GET", "/healthz")


class ClientSession:
    def __init__(self, client: TangramClient, session_id: str) -> None:
        self.client = client
        self.id = session_id

    def __enter__(self) -> "ClientSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exec(self, command: str | None = None, *, python: str | None = None, stdin: str | None = None,
             timeout_s: float = 10.0, cpus: tuple[int, int] = (1, 1), hint_s: float | None = None,
             parallel_fraction: float = 0.0, operation: str = "") -> v1.ActionResult:
        body = {"command": command, "python": python, "stdin": stdin, "timeout_s": timeout_s, "cpus": list(cpus),
                "hints": {"work_s": hint_s, "parallel_fraction": parallel_fraction, "operation": operation}}
        return v1.ActionResult.model_validate(self.client._call("POST", f"/v1/sessions/{self.id}/exec", json=body))

    def put(self, files: dict[str, bytes]) -> v1.ActionResult:
        return v1.ActionResult.model_validate(self.client._call("PUT", f"/v1/sessions/{self.id}/files",
                                                                json={"files": _b64(files)}))

    def get(self, paths: list[str]) -> dict[str, bytes]:
        body = self.client._call("GET", f"/v1/sessions/{self.id}/files", params=[("path", p) for p in paths])
        return {k: base64.b64decode(v) for k, v in body["files"].items()}

    def close(self) -> None:
        self.client._call("DELETE", f"/v1/sessions/{self.id}")


class AsyncTangramClient:
    """Asynchronous client with the same calls (``await c.run_code(...)``, ``async for r in
    c.run_batch(...)``)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", token: str | None = None, timeout_s: float = 600,
                 retries: int = 4, backoff_s: float = 0.25, max_connections: int = 256) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s,
                                      limits=httpx.Limits(max_connections=max_connections))
        self.retries = retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> "AsyncTangramClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def _call(self, method: str, url: str, **kw) -> dict | None:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = await self.http.request(method, url, **kw)
            except httpx.TransportError as e:
                error = e
            done, delay, body = _decide(attempt, self.retries, response, error, self.backoff_s)
            if done:
                return body
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def run_code(self, code: str, language: str = "python", *, id: str | None = None, job: str = "default",
                       **kw) -> v1.ActionResult:
        req = _request(code, language, id, job, True, **kw)
        for attempt in range(self.retries + 1):
            result = v1.ActionResult.model_validate(await self._call("POST", "/v1/actions", json=req))
            if result.outcome != "infra_error" or attempt == self.retries:
                return result
            req = _retry_id(req, attempt)
            await asyncio.sleep(_delay(attempt, None, self.backoff_s))
        return result

    async def get(self, id: str) -> v1.ActionResult:
        return v1.ActionResult.model_validate(await self._call("GET", f"/v1/actions/{id}"))

    async def run_batch(self, programs: Iterable[dict], concurrency: int = 64) -> AsyncIterator[v1.ActionResult]:
        sem = asyncio.Semaphore(concurrency)

        async def one(p: dict) -> v1.ActionResult:
            async with sem:
                return await self.run_code(**p)

        for fut in asyncio.as_completed([one(p) for p in programs]):
            yield await fut


__all__ = ["AsyncTangramClient", "ClientSession", "TangramClient", "TangramError"]
