"""An HTTP front process: the FastAPI app over ``RemoteService``, the engine process's calls
(``server/calls.py``) seen across the front link (``link.py``).

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

import functools
import json
import logging
import os
import signal
import socket
from typing import Any

from typing import Sequence

from ..link import Caller
from .calls import DIALECTS, SCOPED, calls_of, with_dialects
from .dialect import Dialect
from .service import CALLER_JOB

log = logging.getLogger(__name__)

ENV = "TANGRAM_FRONT"  # JSON: fd, link, max_body_bytes, drain_s, index, dialects (modules beside DIALECTS)


class RemoteService:
    """The engine process's calls (``server/calls.py``: those of ``dialects``), each one call
    across the link: the same names the routes see in process."""

    def __init__(self, link: str, dialects: Sequence[Dialect] = DIALECTS) -> None:
        self.link = link
        self._caller = Caller(on_lost=_stop_front, peer="the engine process")
        for name in calls_of(dialects):  # ``request`` queues the frame now and returns the answer's future
            setattr(self, name, functools.partial(self._request, name))

    def _request(self, name: str, *args: Any):
        """One call; a request with a job's API key carries the job across (``Local.scoped``)."""
        job = CALLER_JOB.get()
        if job is None:
            return self._caller.request(name, *args)
        return self._caller.request(SCOPED, job, name, *args)

    async def start(self) -> None:
        await self._caller.connect(self.link)

    async def stop(self) -> None:
        self._caller.close()


def _stop_front() -> None:
    """The link to the engine process dropped: stop (gracefully) instead of answering 503 for
    ever; a live engine process starts another front, a dead one takes us with it anyway."""
    log.error("front: the link to the engine process dropped; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    import uvicorn

    from ..runtime.host import die_with_parent
    from .app import KEEP_ALIVE_S, create_app

    die_with_parent("front")
    spec: dict[str, Any] = json.loads(os.environ.pop(ENV))
    token = os.environ.pop("TANGRAM_TOKEN", None) or None
    keys = json.loads(os.environ.pop("TANGRAM_KEYS", None) or "{}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s front{spec['index']} %(name)s: "
                                                    "%(message)s")
    sock = socket.socket(fileno=spec["fd"])
    dialects = with_dialects(spec.get("dialects", ()), spec.get("settings"))
    app = create_app(RemoteService(spec["link"], dialects), token=token, max_body_bytes=spec["max_body_bytes"],
                     keys=keys, dialects=dialects)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=int(spec["drain_s"]) + 5,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
