"""The sessions' pool: layered default sandboxes ready for new sessions, and those sessions left.

A new default session (or a wake) takes a sandbox whose workspace is copy-on-write layered
(``rootfs.HOST_IMAGE``: it can fork and snapshot), its interpreter forked from the zygote ahead and
its shell started. Once a session leaves its sandbox (put to rest, or closed) the sandbox is reset
as a one-shot's is (``Recycler.session_verdict``) and comes back here, so an open or a wake costs a
fork of the sandbox's zygote, not a new sandbox.
"""

from __future__ import annotations

import asyncio
import logging

from .host import SandboxHost
from .pool import RETURN_WAIT_S, OneShots
from .rootfs import HOST_IMAGE
from .sandbox import Sandbox, SandboxDied
from .sessions import SessionBook

log = logging.getLogger(__name__)


class SessionPool:
    """Layered sandboxes for new default sessions (empty where sessions are not layered)."""

    def __init__(self, host: SandboxHost, oneshots: OneShots, book: SessionBook) -> None:
        self.host = host
        self.oneshots = oneshots
        self.book = book
        self.idle: list[Sandbox] = []
        self.returning = 0  # sandboxes being reset for this pool (``release``)
        self.releasing: set[Sandbox] = set()  # those sandboxes: a second release of one is refused

    async def spawn(self) -> Sandbox:
        """A default sandbox whose workspace is copy-on-write layered (``HOST_IMAGE``), for a new
        session: it can fork and snapshot. One-shots keep the plain tmpfs workspace."""
        host = self.host
        sb = await host.imageboxes.spawn(HOST_IMAGE.name)
        try:  # as a plain one: what a wake and a first cell need, imported now (and the session's
            # interpreter forked from the zygote after them, ahead of the session: ``prefork``)
            modules = host.warm_modules()
            await sb.request({"op": "warm", "modules": modules, "prefork": True}, 20.0)
            sb.warmed = frozenset(modules)
            await self._warm_shell(sb)
        except SandboxDied:
            await sb.kill()
            raise
        return sb

    async def _warm_shell(self, sb: Sandbox) -> None:
        """The next session's shell, started before a session takes the sandbox (a fresh one, or
        one reset after its session left, whose shell went with it): starting it is most of a
        session's first command (~20 ms under load, 4-6x a later step)."""
        if self.host.config.warm_shell:
            await sb.request({"op": "shell", "command": ":", "timeout_s": 10.0, "prestart": True}, 20.0)

    def wanted(self) -> int:
        """Layered sandboxes kept ready for new default sessions (within the idle cap)."""
        c = self.host.config
        return min(c.warm_sessions, max(0, c.max_idle_sandboxes - c.warm_pool)) if self.host.layered else 0

    def cap(self) -> int:
        """How many idle session sandboxes the pool keeps at most."""
        c = self.host.config
        return min(max(c.warm_sessions, c.recycle_pool_max), c.max_idle_sandboxes) if self.host.layered else 0

    def coming_back(self) -> int:
        """Session sandboxes on their way to the pool: being reset, or their session being put to
        rest (most come back; an image session's does not, nor an unclean one)."""
        return self.returning + len(self.book.moving)

    async def ready(self, timeout_s: float) -> bool:
        """Wait until the pool is full (False: not within ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.idle) < self.wanted():
            if loop.time() >= deadline or self.host.closing:
                return False
            await asyncio.sleep(0.01)
        return True

    async def take(self, image: str | None = None) -> Sandbox:
        """A sandbox for a new (or waking) session: a layered one from this pool, one coming back
        (``RETURN_WAIT_S``), or a fresh one; where sessions are not layered, or ``image`` is not
        the default, what a one-shot of it would take."""
        host = self.host
        if not host.layered or (image is not None and image != host.config.image):
            return await self.oneshots.take(image)
        host.want_spares()
        deadline = asyncio.get_running_loop().time() + RETURN_WAIT_S
        while True:
            while self.idle:
                sb = self.idle.pop()
                if not sb.dead and sb.proc.returncode is None:
                    return sb
            if not self.coming_back() or not await host.returned_by(deadline):
                break
        return await host.made_for_action(self.spawn())

    def release(self, sb: Sandbox) -> None:
        """A session has left ``sb`` (its state packed, or the session closed): reset it for the
        next session and put it in the pool (``Recycler.session_verdict``: the same wipe and
        checks as a one-shot's), or kill it when that cannot be verified or the pool is full.

        Once per sandbox: one already being reset or back in the pool is refused (logged), so one
        sandbox never ends up in the pool twice, for two sessions."""
        if sb in self.releasing or sb in self.idle:
            log.warning("session sandbox %s released twice: the second release is ignored", sb.id)
            return
        self.releasing.add(sb)
        self.returning += 1
        self.host.tasks.spawn(self._recycle(sb))

    async def _recycle(self, sb: Sandbox) -> None:
        """Reset ``sb``; then, if sessions have come to use modules its zygote has not imported
        (``warm_modules``), import them there; and fork the next session's interpreter ahead
        (``prefork``), off the next open's or wake's latency path."""
        try:
            await self._reuse(sb)
        finally:
            self.releasing.discard(sb)
            self.returning -= 1
            self.host.sandbox_returned()

    async def _reuse(self, sb: Sandbox) -> None:
        host = self.host
        if not sb.dead and sb.frozen:
            sb.thaw()
        if host.closing or len(self.idle) >= self.cap():
            await sb.kill()
            return
        modules = host.warm_modules()
        missing = [m for m in modules if m not in sb.warmed]
        if await host.recycler.session_verdict(sb, prefork=not missing) is None:
            try:
                if missing:
                    await sb.request({"op": "warm", "modules": missing, "prefork": True}, 20.0)
                    sb.warmed = sb.warmed | frozenset(missing)
                await self._warm_shell(sb)
                if self.put_back(sb):
                    return
            except SandboxDied as e:
                log.warning("session sandbox %s not recycled: warming it failed: %s", sb.id, e)
        await sb.kill()

    def put_back(self, sb: Sandbox) -> bool:
        if sb in self.idle:  # (``release`` refuses a second release: never twice here)
            return True
        if self.host.closing or len(self.idle) >= self.cap():
            return False
        self.idle.append(sb)
        return True
