"""``tangram serve --fronts N``: the engine process with N HTTP front processes.

One Python process serving HTTP, driving the engine and managing every sandbox's pipes tops out
near one core whatever the machine has, as many requests a second on 16 cores as on 2. The
engine must stay the single decision maker, so the work that needs no shared state moves out:
HTTP parsing, auth, body limits, validation and serialisation run in the fronts
(``server/front.py``); this process keeps the ``Service`` and answers the fronts' calls
(a ``link.Hub``).

This process binds the listening socket (so a taken port fails here, at once, with the usual
message) and passes it to every front; the kernel wakes one front per new connection. Fronts that
exit are restarted (a front that keeps dying at start stops the server: something is wrong with
the install, not the load). On SIGTERM/SIGINT the fronts stop first, finishing the requests they
hold while this process still answers them, then the service drains as without fronts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

from .front import ENV
from ..link import Hub
from .calls import SCOPED, Local, calls_of, relayed, with_dialects
from .service import Service

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 10.0  # a front that dies this soon after its start counts as failing to start
MAX_QUICK_DEATHS = 3


def listen(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """The HTTP listening socket, inheritable by the fronts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class Fronts:
    """Starts, watches and stops the front processes."""

    def __init__(self, sock: socket.socket, link: str, n: int, token: str | None, max_body_bytes: int,
                 drain_s: float, keys: dict[str, str] | None = None, dialects: Sequence[str] = (),
                 settings: Mapping[str, Any] | None = None) -> None:
        self.sock, self.link, self.n = sock, link, n
        self.settings = dict(settings or {})  # the dialects' own tables (``calls.with_dialects``)
        self.keys = keys or {}
        self.dialects = list(dialects)  # modules of dialects beside the server's own, imported by each front
        self.token, self.max_body_bytes, self.drain_s = token, max_body_bytes, drain_s
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.started_at = [0.0] * n
        self.quick_deaths = 0

    def _spawn(self, i: int) -> None:
        env = dict(os.environ)
        env[ENV] = json.dumps({"fd": self.sock.fileno(), "link": self.link, "max_body_bytes": self.max_body_bytes,
                               "drain_s": self.drain_s, "index": i, "dialects": self.dialects,
                               "settings": self.settings})
        env.pop("TANGRAM_TOKEN", None)
        if self.token:
            env["TANGRAM_TOKEN"] = self.token  # the environment, not argv: argv is world-readable in ps
        env.pop("TANGRAM_KEYS", None)
        if self.keys:
            env["TANGRAM_KEYS"] = json.dumps(self.keys)
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "arl_tangram.server.front"], env=env,
                                         pass_fds=(self.sock.fileno(),))
        self.started_at[i] = time.monotonic()

    def start(self) -> None:
        for i in range(self.n):
            self._spawn(i)

    def check(self) -> None:
        """Restart fronts that exited; ``RuntimeError`` when they keep dying at start."""
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is None:
                continue
            quick = time.monotonic() - self.started_at[i] < RESTART_WINDOW_S
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            if self.quick_deaths >= MAX_QUICK_DEATHS:
                raise RuntimeError(f"HTTP front processes keep exiting at start (front {i}: exit code "
                                   f"{p.returncode}); see their log lines above")
            log.error("HTTP front %d (pid %d) exited with code %s: starting another", i, p.pid, p.returncode)
            self._spawn(i)

    async def stop(self) -> None:
        """SIGTERM: each front stops accepting and finishes its requests (while the link still
        answers them); SIGKILL for any still there after the drain time."""
        alive = [p for p in self.procs if p is not None and p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s + 10
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in alive:
            if p.poll() is None:
                log.error("HTTP front pid %d did not stop in time: killing it", p.pid)
                p.kill()
                p.wait()


async def _run(service: Service, sock: socket.socket, n: int, token: str | None, max_body_bytes: int,
               drain_s: float, keys: dict[str, str] | None = None, modules: Sequence[str] = (),
               settings: Mapping[str, Any] | None = None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tmp = tempfile.mkdtemp(prefix="tangram-link-")  # mode 0700: only this user reaches the link
    dialects = with_dialects(modules, settings)
    hub = Hub(Local(service, dialects), [*calls_of(dialects), SCOPED], relayed(dialects))
    fronts = Fronts(sock, os.path.join(tmp, "engine.sock"), n, token, max_body_bytes, drain_s, keys, modules,
                    settings)
    service.fronts = n
    await service.start()
    try:
        await hub.listen(fronts.link)
        fronts.start()
        log.info("serving with %d HTTP front processes (pids %s)", n, [p.pid for p in fronts.procs if p])
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                fronts.check()
    finally:
        await fronts.stop()
        await hub.close()
        await service.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def serve(service: Service, sock: socket.socket, n: int, token: str | None, max_body_bytes: int,
          drain_s: float, keys: dict[str, str] | None = None, dialects: Sequence[str] = (),
          settings: Mapping[str, Any] | None = None) -> None:
    """Run until SIGTERM/SIGINT (the CLI's entry for ``--fronts N`` with N >= 1). ``dialects``:
    modules of dialects served beside the server's own (each module's ``DIALECT``), imported here
    and in every front; ``settings``: the dialects' own tables (``calls.with_dialects``)."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(_run(service, sock, n, token, max_body_bytes, drain_s, keys, dialects, settings))
