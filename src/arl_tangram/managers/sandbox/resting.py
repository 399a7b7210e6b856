"""When sessions rest and wake (``rest.py`` says how: the blob store, pack and load).

A session idle for ``rest_after_s``, or the least recently used when more than
``max_awake_sessions`` are awake, is put to rest: its state packed into a blob on disk, its
sandbox reset for another session (``sessionpool.py``) or, for an image session, its processes
ended and its root kept. Its next step wakes it in a sandbox from the sessions' pool. The LRU one
goes to rest as a wake or an open *starts*, so that its pack overlaps the wake rather than the
step's answer. ``Resting`` also closes sessions idle past ``session_idle_expiry_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Awaitable, Callable

from .host import SandboxHost
from .images import ImageError
from .isolation import Isolation
from .rest import Rested, RestFailed, RestStore, load, pack
from .sandbox import Sandbox, SandboxDied
from .sessionpool import SessionPool
from .sessions import SessionBook

log = logging.getLogger(__name__)

#: sessions put to rest at once: a rest is mostly waiting (the runner packing, the disk, the
#: sandbox's death), and a pass that keeps up with new sessions must overlap a few
REST_PARALLEL = 4
#: a rested session's blob up to this size is read by the event loop itself when it wakes
#: (a page-cache read of a few KB: tens of microseconds), larger ones in a thread
INLINE_READ = 256 << 10
#: modules never imported ahead in a fresh sandbox (``SandboxHost.warm_modules``): importing runs a
#: module's code in a sandbox another session will get, so standard-library ones only, and none
#: with side effects
NEVER_WARM = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser", "pydoc",
                        "ensurepip", "venv", "__main__", "builtins", "sys"})


class Resting:
    """Puts idle sessions to rest and wakes them; ``expire(trajectory)`` ends one idle too long."""

    def __init__(self, host: SandboxHost, book: SessionBook, spares: SessionPool,
                 expire: Callable[[str], None]) -> None:
        self.host = host
        self.book = book
        self.spares = spares
        self.expire = expire
        self.store: RestStore | None = None
        self.on_rest: Callable[[str, str | None], None] | None = None  # (session, blob path; None: woken)
        self.rest_recorded: Callable[[], Awaitable[None]] | None = None  # returns once on_rest's news is durable
        self.counts = {"rests": 0, "wakes": 0, "rest_failures": 0, "wake_failures": 0}
        self.close_after_rest: set[str] = set()
        self.unrestable: dict[str, float] = {}  # failed to rest when last used at this time: not retried
        self.not_whole: dict[str, dict[str, str]] = {}  # a whole rest refused: what it could not carry
        self._rester: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None

    def open_store(self) -> None:
        self.store = RestStore(self.host.config.rest_dir)

    def start(self) -> None:
        """Start closing sessions idle past ``session_idle_expiry_s`` (and resting those due)."""
        self._reaper = asyncio.get_running_loop().create_task(self._expire_sessions())

    def loops(self) -> list[asyncio.Task]:
        """Its tasks that run until shutdown (cancelled then)."""
        return [t for t in (self._reaper, self._rester) if t is not None]

    def shut_down(self) -> None:
        """Let go of the rested sessions' roots and the store (the blobs stay in a configured
        ``rest_dir``: the server's journal knows them)."""
        for rested in self.book.rested.values():
            if rested.rootfs is not None:
                rested.rootfs.release()
        self.book.rested.clear()
        if self.store is not None:
            self.store.close()

    async def _expire_sessions(self) -> None:
        c = self.host.config
        book = self.book
        while not self.host.closing:
            await asyncio.sleep(min(1.0, c.session_idle_expiry_s / 4, (c.rest_after_s or 4.0) / 4))
            now = time.monotonic()
            self.want()
            for traj, last in list(book.last_used.items()):
                if now - last > c.session_idle_expiry_s and traj not in book.using and book.exists(traj):
                    log.info("session %s idle for %.0fs: closing it", traj, now - last)
                    self.expire(traj)

    def forget(self, rested: Rested) -> None:
        """A rested session is closed: its blob goes (and its root, for an image session)."""
        if self.store is not None:
            self.store.forget(rested)
        if rested.rootfs is not None and self.host.imageboxes is not None:
            self.host.imageboxes.drop(rested.rootfs)

    def closed(self, trajectory: str) -> None:
        """A session is closed: its blob goes; one being put to rest now loses it once it is written."""
        self.unrestable.pop(trajectory, None)
        if trajectory in self.book.moving:
            self.close_after_rest.add(trajectory)
        rested = self.book.rested.pop(trajectory, None)
        if rested is not None:
            self.forget(rested)

    def want(self) -> None:
        """Start a pass putting sessions to rest, unless one is running (it loops while there is work)."""
        if self.host.closing or self.store is None:
            return
        if self._rester is None or self._rester.done():
            self._rester = asyncio.get_running_loop().create_task(self._rest_pass())

    def due(self) -> list[str]:
        """Idle sessions due for rest, least recently used first: those idle ``rest_after_s``,
        and as many as are awake past ``max_awake_sessions``."""
        c = self.host.config
        book = self.book
        now = time.monotonic()
        idle = []
        for t in book.awake:  # the awake ones, not the (many more) at rest
            last = book.last_used.get(t, 0.0)
            if t not in book.using and t not in book.moving and self.unrestable.get(t) != last:
                idle.append((last, t))
        idle.sort()
        # sessions a step is making awake (waking, or opening) count as awake already
        coming = sum(1 for t in book.using if t not in book.awake)
        over = len(book.awake) + coming - c.max_awake_sessions
        return [t for i, (last, t) in enumerate(idle) if i < over or (c.rest_after_s and now - last >= c.rest_after_s)]

    async def _rest_pass(self) -> None:
        while not self.host.closing:
            picks = self.due()[:REST_PARALLEL]
            if not picks:
                return
            await asyncio.gather(*(self.rest(t) for t in picks))

    async def rest(self, trajectory: str, whole: bool = False) -> bool:
        """Put an idle session to rest now (True), or say it cannot be (False: busy, gone, or its
        state could not be packed; it then stays awake, untouched). ``whole``: only if nothing is
        dropped (a move for balance: a session is never made to lose a value so that another node
        runs it); else it stays awake and ``not_whole[trajectory]`` says what it could not carry."""
        host, book = self.host, self.book
        sb = book.awake.get(trajectory)
        if sb is None or sb.dead or trajectory in book.using or trajectory in book.moving or self.store is None:
            return False
        done = asyncio.get_running_loop().create_future()
        book.moving[trajectory] = done
        last = book.last_used.get(trajectory, 0.0)
        try:
            sb.thaw()
            # an image session's root stays mounted (its files are the image's and its own, on disk);
            # a default session's layered workspace goes into the blob like a tmpfs one: a rested
            # session then holds no mount (thousands of them would slow every sandbox's start) and
            # wakes after a restart too
            keep_root = sb.rootfs is not None and not sb.rootfs.workspace_only
            roots = ["/tmp"] if keep_root else (["workspace"] if host.mode is Isolation.NONE
                                                else ["workspace", "/tmp"])
            try:
                blob, dropped, modules = await pack(sb, roots)
                path = await asyncio.to_thread(self.store.write, trajectory, blob)
            except (RestFailed, OSError) as e:
                log.warning("session %s cannot be put to rest: %s", trajectory, e)
                self.counts["rest_failures"] += 1
                self.unrestable[trajectory] = last
                if trajectory in self.close_after_rest:  # closed meanwhile: its sandbox is ours to let go
                    self.spares.release(sb)
                elif not sb.dead:
                    sb.freeze()
                return False
            if whole and dropped:
                log.info("session %s stays awake: its state cannot be carried whole (%s)", trajectory,
                         ", ".join(dropped))
                self.not_whole[trajectory] = dropped
                self.store.forget(Rested(path, len(blob)))
                if trajectory in self.close_after_rest:
                    self.spares.release(sb)
                elif not sb.dead:
                    sb.freeze()
                return False
            rested = Rested(path, len(blob), dropped, sb.rootfs.image.name if keep_root else None)
            stdlib = getattr(sys, "stdlib_module_names", frozenset())
            host.module_uses.update(m for m in modules if isinstance(m, str) and m.split(".")[0] in stdlib
                                    and m.split(".")[0] not in NEVER_WARM)
            book.awake.pop(trajectory, None)
            recorded = trajectory not in self.close_after_rest
            if recorded:
                # recorded (the journal committed) before the processes end: a crash between the two
                # then leaves a session that wakes from its blob, never one marked awake whose
                # processes are gone
                book.rested[trajectory] = rested
                self.counts["rests"] += 1
                if self.on_rest is not None:
                    self.on_rest(trajectory, path)
                if self.rest_recorded is not None:
                    try:
                        await self.rest_recorded()
                    except Exception as e:  # the journal failed: the server reports that itself
                        log.warning("session %s: its rest could not be recorded: %s", trajectory, e)
            if keep_root:  # its files are on disk already: keep the root, end the processes
                rested.rootfs = await host.imageboxes.stop_processes(sb)
            else:  # reset for another session (recycle.py), or killed
                self.spares.release(sb)
            if trajectory in self.close_after_rest:
                if recorded:  # closed while it was recorded: close_session forgot it, but not a root kept since
                    book.rested.pop(trajectory, None)
                    if rested.rootfs is not None:
                        host.imageboxes.drop(rested.rootfs)
                else:
                    self.forget(rested)
                return False
            return True
        except SandboxDied as e:  # it died packing: its state is gone, as with any dead sandbox
            log.warning("session %s died while being put to rest: %s", trajectory, e)
            self.counts["rest_failures"] += 1
            book.awake.pop(trajectory, None)
            host.kill_later(sb)
            return False
        finally:
            self.close_after_rest.discard(trajectory)
            del book.moving[trajectory]
            done.set_result(None)

    async def wake(self, trajectory: str, rested: Rested, image: str | None, cores: tuple[int, ...],
                   then: Callable[[Sandbox], dict | None] | None = None) -> tuple[Sandbox, dict[str, str], dict | None]:
        """A sandbox with the rested session's state loaded; on failure the session stays at rest
        (nothing is lost: a later step tries again) and ``SandboxDied`` says why. It is pinned to
        the step's ``cores`` before the load runs anything in it (the session's shell replayed, its
        namespace unpickled: the user's code). ``then(sb)``: the step's cell request, if it can
        ride on the wake's last request (``rest.load``; its answer is the third value), the
        sandbox then limited for it first."""
        host = self.host
        sb = None
        try:
            # a small blob (most are a few KB) is read here: a hop to a thread costs more, and
            # waits behind whatever else holds the default executor's few threads
            blob = (self.store.read(rested.path) if rested.size <= INLINE_READ
                    else await asyncio.to_thread(self.store.read, rested.path))
            if rested.rootfs is not None:
                sb = await host.imageboxes.spawn(rested.rootfs.image.name, rootfs=rested.rootfs)
            else:
                sb = await self.spares.take(image)
            sb.set_cpus(cores)
            cell = then(sb) if then is not None else None
            dropped, answer = await load(sb, blob, cell)
        except (OSError, SandboxDied, ImageError) as e:
            self.counts["wake_failures"] += 1
            if sb is not None:
                if rested.rootfs is not None:
                    await host.imageboxes.stop_processes(sb)
                else:
                    await sb.kill()
            self.book.rested[trajectory] = rested
            raise SandboxDied(f"the session could not be woken from rest ({e}); it is still at rest") from None
        self.store.forget(rested)
        self.counts["wakes"] += 1
        if self.on_rest is not None:
            self.on_rest(trajectory, None)
        return sb, dropped, answer

    def stats(self) -> dict:
        """What ``/healthz``, ``/metrics`` and ``tangram top`` show of rest (counts since start)."""
        c, book, rec = self.host.config, self.book, self.host.recycler
        return {"awake": len(book.awake), "at_rest": len(book.rested), "resting_now": len(book.moving),
                "rest_bytes": self.store.used if self.store is not None else 0, "rest_disk_mb": c.rest_disk_mb,
                "max_awake_sessions": c.max_awake_sessions, "rest_after_s": c.rest_after_s, **self.counts,
                # session sandboxes reset for another session once theirs left, and those killed instead
                "sandboxes_reused": rec.sessions_recycled,
                "sandboxes_not_reused": sum(rec.sessions_discarded.values()),
                "session_pool": len(self.spares.idle)}

    def prune(self) -> int:
        """Remove the blobs in a configured ``rest_dir`` that no session at rest here owns (a
        server killed between writing a blob and journaling it leaves one); returns how many."""
        if self.store is None or self.store.owned:
            return 0
        keep = {os.path.basename(r.path) for r in self.book.rested.values()}
        gone = 0
        for name in os.listdir(self.store.dir):
            if (name.endswith(".rest") or name.endswith(".rest.tmp")) and name not in keep:
                try:
                    os.unlink(os.path.join(self.store.dir, name))
                    gone += 1
                except FileNotFoundError:
                    pass
        return gone

    async def arrive(self, trajectory: str, blob: bytes, dropped: dict[str, str]) -> None:
        """A session moved here from another node as its rest blob (``pack`` there): at rest here,
        its next step wakes it as any rested session wakes, its Python state and files intact."""
        if self.store is None:
            raise RuntimeError("sessions cannot be put to rest here (no store)")
        if self.book.exists(trajectory) or trajectory in self.book.moving:
            raise RuntimeError(f"session {trajectory!r} already exists here")
        path = await asyncio.to_thread(self.store.write, trajectory, blob)
        self.book.rested[trajectory] = Rested(path, len(blob), dict(dropped))
        self.book.last_used[trajectory] = time.monotonic()

    def adopt(self, trajectory: str, path: str, image: str | None = None) -> None:
        """A session put to rest by an earlier server (its blob at ``path``): it wakes on its next
        step. Raises ``FileNotFoundError`` when the blob is gone, ``ImageError`` for an image
        session (its root was the old server's mount)."""
        if image is not None:
            raise ImageError("image sessions at rest cannot be woken after a restart (their root was mounted by "
                             "the server that stopped)")
        size = os.stat(path).st_size
        self.book.rested[trajectory] = Rested(path, size)
        if self.store is not None:
            self.store.used += size
        self.book.last_used[trajectory] = time.monotonic()
