"""Images named by a registry reference, pulled on first use; the image store's disk budget.

A name is looked up in the store as it is first (an imported image keeps working by its name),
then as the reference it parses as (``python:3.12`` is stored as
``docker.io/library/python:3.12``). Only a name that is neither is pulled, and an action that
names it waits for the pull as part of its run: its ACT includes it, and ``pulling`` says how
far it is (``/v1/actions/{id}``: "pulling IMAGE: N of M MB"). Every action waiting for one image
shares one pull (and ``registry.pulling`` shares each layer between images). A failed pull ends
the action with the error, which names the reference: ``rejected`` for the request's (an
unknown image, refused credentials, a bad layer), ``infra_error`` for a registry that does not
answer (``ImageError.infra``).

``image_max_gb`` bounds the store: after a pull, the least recently used images that no
sandbox uses are removed until it fits (``ImageStore.victims``). Never while a pull of this
manager is under way, and a pull waits for an eviction to end (it may find a layer cached that
the eviction takes); never an image an action resolved within ``RECENT_S`` (it is about to mount
it: a mounted one is kept anyway); an action asking for an image being removed waits for the
removal, then pulls it again.

On a cluster every node pulls for itself, and its agent tells the head what its store holds
(``present``: the names of the images here and of those being pulled) and which of its actions
wait for a pull (``waits``), so that the head places a new session where its image is and shows
the waiting reason as one machine does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from .host import SandboxHost
from .images import ImageError
from .registry.pulling import PullEvent, pull, store_name
from .registry.reference import BadReference, Reference, parse

log = logging.getLogger(__name__)

#: an image resolved this recently is not evicted: its action is about to mount it
RECENT_S = 60.0
#: the store's record of an image's last use is written at most this often per image
TOUCH_S = 30.0
MB = 1 << 20


def stored_names(name: str) -> list[str]:
    """The names the store may hold image ``name`` by, in the order they are looked up: the name
    as it is (an imported image keeps working by its name), then the reference it parses as."""
    names = [name]
    try:
        full = store_name(parse(name))
    except BadReference:
        return names
    if full != name:
        names.append(full)
    return names


def as_reference(name: str, where: str = "in the store") -> Reference:
    """``name`` as a registry reference; ``ImageError`` naming it (and saying that no image of
    that name is ``where``) if it is not one."""
    try:
        return parse(name)
    except BadReference as e:
        raise ImageError(f"image: no image named {name!r} {where}, and it is not a registry reference "
                         f"({str(e).removeprefix(f'image reference {name!r}: ')})") from None


class _Progress:
    """One pull's bytes: its layers' declared total and how much of each is in."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.layers: dict[int, int] = {}

    def event(self, e: PullEvent) -> None:
        if e.index < 0:
            self.total = e.size
        else:
            self.layers[e.index] = e.size if e.state in ("cached", "unpacking", "done") else e.done

    def text(self, name: str) -> str:
        if self.total is None:
            return f"pulling {name}: reading its manifest"
        return f"pulling {name}: {sum(self.layers.values()) / MB:.1f} of {self.total / MB:.1f} MB"


class Pulls:
    """The sandbox manager's part that turns a requested image name into a stored image."""

    def __init__(self, host: SandboxHost) -> None:
        self.host = host
        self.names: dict[str, str] = {}  # a name as asked -> the store's name for it (found there)
        self.resolved: dict[str, float] = {}  # the store's name -> when an action last resolved it
        self.touched: dict[str, float] = {}  # the store's name -> when its last use was written
        self.waiting: dict[str, tuple[str, str]] = {}  # action id -> (name as asked, the store's name)
        self.flights: dict[str, asyncio.Task] = {}  # the store's name -> its pull
        self.progress: dict[str, _Progress] = {}
        self.evicting: asyncio.Task | None = None
        self.doomed: set[str] = set()  # images being removed now
        self.counts = {"pulls": 0, "pull_failures": 0, "bytes_pulled": 0, "pull_seconds": 0.0, "cache_hits": 0,
                       "evicted": 0}
        self.disk_bytes: int | None = None
        self.changes = 0  # pulls landed and images removed here: ``present`` reads the store again
        self._present: tuple[object, frozenset[str]] = (None, frozenset())

    # -- names -----------------------------------------------------------------------------------
    def local(self, name: str) -> str | None:
        """The store's name for ``name`` if the image is here; None if it is not (no network)."""
        stored = self.names.get(name)
        if stored is not None and stored not in self.doomed:
            return stored
        store = self.host.images
        for candidate in stored_names(name):
            if candidate in self.doomed:
                continue
            try:
                store.get(candidate)
            except ImageError:
                continue
            self.names[name] = candidate
            return candidate
        return None

    def check(self, name: str) -> None:
        """``ImageError`` unless ``name`` is an image here or a reference it could be pulled by
        (a session naming it opens at once; its first step pulls it)."""
        if self.local(name) is None:
            self.reference(name)

    def reference(self, name: str) -> Reference:
        return as_reference(name)

    # -- pulls -----------------------------------------------------------------------------------
    async def ready(self, name: str, action_id: str | None = None) -> str:
        """The store's name for image ``name``, pulled first if it is not here (the caller's
        action waits: ``pulling(action_id)`` says how far it is)."""
        while self.evicting is not None and (name in self.doomed or self.names.get(name) in self.doomed):
            await asyncio.shield(self.evicting)
        stored = self.local(name)
        if stored is not None:
            self.counts["cache_hits"] += 1
            self._used(stored)
            return stored
        ref = self.reference(name)
        full = store_name(ref)
        while self.evicting is not None:  # a layer this pull finds cached could be going
            await asyncio.shield(self.evicting)
        if action_id is not None:
            self.waiting[action_id] = (name, full)
        try:
            await asyncio.shield(self._flight(ref, full))
        except ImageError as e:  # the same kind (``infra`` kept), saying what was looked for first
            raise type(e)(f"image: no image named {name!r} in the store, and pulling it failed: {e}") from None
        finally:
            if action_id is not None:
                self.waiting.pop(action_id, None)
        self.names[name] = full
        self._used(full)
        return full

    def prefetch(self, name: str) -> None:
        """Start pulling ``name`` now if it is a reference not here (a session naming it was
        opened: its first step then waits for less); a failure is logged, and met again by that
        step, which says it."""
        if self.host.closing or self.local(name) is not None:
            return
        try:
            ref = parse(name)
        except BadReference:
            return
        if self.evicting is None:  # else its step pulls it, once the eviction is over
            self._flight(ref, store_name(ref))

    def pulling(self, action_id: str) -> str | None:
        """"pulling IMAGE: N of M MB" while action ``action_id`` waits for its image's pull."""
        w = self.waiting.get(action_id)
        if w is None:
            return None
        prog = self.progress.get(w[1])
        return prog.text(w[0]) if prog is not None else f"pulling {w[0]}"

    def waits(self) -> dict[str, str]:
        """Every action waiting for a pull here, with its ``pulling`` text (a node's news to its head)."""
        return {aid: text for aid in list(self.waiting) if (text := self.pulling(aid)) is not None}

    async def present(self) -> tuple[object, frozenset[str]]:
        """``(mark, names)``: the store's names of the images here and of those being pulled (a
        session placed here now joins the pull under way), what a node reports for placement.
        ``mark`` changes whenever the names may have, so a caller that saw it asks for nothing
        more; the store's images are listed again only then (the modification time of its
        directory of images, which an import by another process changes too, and this manager's
        own pulls and removals)."""
        listing = self.host.images.root / "images"  # the store's named images, one file each
        try:
            mtime = listing.stat().st_mtime_ns
        except OSError:
            mtime = 0
        mark = (mtime, self.changes, tuple(sorted(self.flights)))
        seen, names = self._present
        if mark != seen:
            stored = await asyncio.to_thread(_names, self.host.images)
            names = frozenset(stored) | frozenset(self.flights)
            self._present = (mark, names)
        return mark, names

    def _flight(self, ref: Reference, full: str) -> asyncio.Task:
        task = self.flights.get(full)
        if task is None:
            task = self.flights[full] = asyncio.get_running_loop().create_task(self._pull(ref, full))
            task.add_done_callback(lambda t, full=full: self._landed(full, t))
        return task

    async def _pull(self, ref: Reference, full: str) -> None:
        prog = self.progress[full] = _Progress()
        t0 = time.monotonic()
        try:
            await pull(ref, self.host.images, self.host.config.registries, prog.event, fetched=self._fetched)
        except BaseException:
            self.counts["pull_failures"] += 1
            raise
        else:
            self.counts["pulls"] += 1
        finally:
            self.counts["pull_seconds"] += time.monotonic() - t0
            self.progress.pop(full, None)

    def _fetched(self, n: int) -> None:
        self.counts["bytes_pulled"] += n

    def _landed(self, full: str, task: asyncio.Task) -> None:
        self.flights.pop(full, None)
        self.changes += 1
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:
            log.info("pull of %s failed: %s", full, e)
            return
        self.resolved[full] = time.monotonic()  # just pulled: kept until its first action mounted it
        if not self.flights and not self.host.closing:
            self._fit_later()

    def _used(self, stored: str) -> None:
        now = time.monotonic()
        self.resolved[stored] = now
        if now - self.touched.get(stored, 0.0) >= TOUCH_S:
            self.touched[stored] = now
            self.host.images.touch(stored)

    # -- the disk budget -------------------------------------------------------------------------
    def _fit_later(self) -> None:
        if self.evicting is None:
            self.evicting = asyncio.get_running_loop().create_task(self.fit())
            self.evicting.add_done_callback(self._fitted)

    def _fitted(self, task: asyncio.Task) -> None:
        self.evicting = None
        if not task.cancelled() and task.exception() is not None:
            log.error("the image store's disk budget could not be applied: %s", task.exception())

    async def fit(self) -> list[str]:
        """Apply ``image_max_gb`` (above); the images removed."""
        store, limit = self.host.images, self.host.config.image_max_gb
        if limit is None:
            self.disk_bytes = await asyncio.to_thread(store.disk_bytes)
            return []
        now = time.monotonic()
        keep = {n for n, t in self.resolved.items() if now - t < RECENT_S} | set(self.flights)
        if self.host.config.image is not None:
            keep.add(self.host.config.image)
        victims = await asyncio.to_thread(store.victims, int(limit * (1 << 30)), keep)
        victims = [v for v in victims if v not in self.flights and now - self.resolved.get(v, -RECENT_S) >= RECENT_S]
        self.doomed = set(victims)
        for name in [n for n, s in self.names.items() if s in self.doomed]:
            del self.names[name]
        for v in victims:
            self.resolved.pop(v, None)
            self.touched.pop(v, None)
            if self.host.imageboxes is not None:
                self.host.imageboxes.forget(v)
        try:
            removed = await asyncio.to_thread(_remove_each, store, victims)
        finally:
            self.doomed = set()
        self.counts["evicted"] += len(removed)
        self.changes += 1
        if removed:
            log.info("image store over images.max_gb (%g GB): removed %s", limit, ", ".join(removed))
        self.disk_bytes = await asyncio.to_thread(store.disk_bytes)
        return removed

    # -- what the server shows -------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts since start (``/metrics``): pulls and failures, bytes downloaded, seconds spent
        pulling, actions whose image was here already, images evicted; the store's disk use and
        bound; pulls under way."""
        limit = self.host.config.image_max_gb
        return {**self.counts, "disk_bytes": self.disk_bytes,
                "disk_limit_bytes": int(limit * (1 << 30)) if limit is not None else None,
                "pulling": len(self.flights)}

    async def start(self) -> None:
        self.disk_bytes = await asyncio.to_thread(self.host.images.disk_bytes)

    async def close(self) -> None:
        tasks = [t for t in (*self.flights.values(), self.evicting) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _names(store) -> list[str]:
    """The names of the images in ``store`` that are whole (one damaged is left out, not the list)."""
    try:
        return [i.name for i in store.list()]
    except (ImageError, OSError, ValueError):  # one image damaged or removed while listed: each alone
        pass
    names = []
    for path in sorted((store.root / "images").glob("*.json")):
        try:
            name = json.loads(path.read_text())["name"]
            store.get(name)
        except (ImageError, OSError, ValueError, KeyError, TypeError):
            continue
        names.append(name)
    return names


def _remove_each(store, names: list[str]) -> list[str]:
    removed = []
    for name in names:
        try:
            store.remove(name)
        except ImageError:
            continue  # mounted since, or gone
        removed.append(name)
    return removed
