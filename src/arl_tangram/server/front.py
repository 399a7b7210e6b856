"""An HTTP front process: the FastAPI app over ``RemoteService``, the engine process's ``Service``
seen across the front link (``link.py``).

``tangram serve --fronts N`` starts N of these beside the engine process. Each accepts on the
listening socket the engine process bound (inherited as a file descriptor, so the kernel hands
each new connection to whichever front is free), parses HTTP, checks the token and the body size,
validates bodies into the API's models, and serialises answers — the per-request work that does
not need the engine. The engine process keeps every decision and all state: the engine and
policy, the journal, sessions, sandboxes, metrics. So any front answers any request, and a front
that dies loses only the connections it held.

A front dies with the engine process (``PR_SET_PDEATHSIG``): a killed server leaves no front
holding the port.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from typing import Any

from ..api import sandboxfusion as sf
from ..api import v1
from ..link import Caller

log = logging.getLogger(__name__)

ENV = "TANGRAM_FRONT"  # JSON: fd, link, max_body_bytes, drain_s, index


class RemoteService:
    """The ``Service`` methods the routes call, each one call across the link."""

    def __init__(self, link: str) -> None:
        self.link = link
        self._caller = Caller(on_lost=_stop_front, peer="the engine process")
        self.call = self._caller.call

    async def start(self) -> None:
        await self._caller.connect(self.link)

    async def stop(self) -> None:
        self._caller.close()

    async def sf_run_code(self, req: sf.RunCodeRequest) -> sf.RunCodeResponse:
        return await self.call("sf_run_code", req)

    async def sf_run_jupyter(self, req: sf.RunJupyterRequest) -> sf.RunJupyterResponse:
        return await self.call("sf_run_jupyter", req)

    async def submit(self, req: v1.ActionRequest) -> v1.ActionResult:
        return await self.call("submit", req)

    async def status(self, id: str) -> v1.ActionResult:
        return await self.call("status", id)

    async def cancel(self, id: str) -> v1.ActionResult:
        return await self.call("cancel", id)

    async def open_session(self, req: v1.SessionRequest) -> v1.SessionInfo:
        return await self.call("open_session", req)

    async def exec(self, sid: str, req: v1.ExecRequest) -> v1.ActionResult:
        return await self.call("exec", sid, req)

    async def put_files(self, sid: str, req: v1.PutFiles) -> v1.ActionResult:
        return await self.call("put_files", sid, req)

    async def get_files(self, sid: str, paths: list[str]) -> v1.GotFiles:
        return await self.call("get_files", sid, paths)

    async def fork(self, sid: str, req: v1.ForkRequest) -> v1.ForkResult:
        return await self.call("fork", sid, req)

    async def prewarm(self, req: v1.PrewarmRequest) -> v1.PrewarmResult:
        return await self.call("prewarm", req)

    async def close_session(self, sid: str) -> None:
        return await self.call("close_session", sid)

    async def model_call(self, name: str, op: str, req: v1.ModelRequest) -> v1.ModelResult:
        return await self.call("model_call", name, op, req)

    async def all_jobs(self) -> list[v1.JobStats]:
        return await self.call("all_jobs")

    async def job_stats(self, job: str) -> v1.JobStats:
        return await self.call("job_stats", job)

    async def cluster(self) -> v1.ClusterInfo:
        return await self.call("cluster")

    async def health(self) -> dict:
        return await self.call("health")

    async def metrics_text(self) -> str:
        return await self.call("metrics_text")


def _stop_front() -> None:
    """The link to the engine process dropped: stop (gracefully) instead of answering 503 for
    ever; a live engine process starts another front, a dead one takes us with it anyway."""
    log.error("front: the link to the engine process dropped; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    import uvicorn

    from ..runtime.host import die_with_parent
    from .app import create_app

    die_with_parent("front")
    spec: dict[str, Any] = json.loads(os.environ.pop(ENV))
    token = os.environ.pop("TANGRAM_TOKEN", None) or None
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s front{spec['index']} %(name)s: "
                                                    "%(message)s")
    sock = socket.socket(fileno=spec["fd"])
    app = create_app(RemoteService(spec["link"]), token=token, max_body_bytes=spec["max_body_bytes"])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=int(spec["drain_s"]) + 5))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
