"""Pull an image from a registry into the ``ImageStore``: layers shared by digest, each fetched once.

``pull(ref, store, registries, progress=...)`` returns the stored ``Image``, named by the full
reference (``python:3.12`` is stored as ``docker.io/library/python:3.12``).

- A layer is known by its config's ``diff_id`` (the sha256 of its uncompressed tar), which is
  also how ``tangram image import`` names it: one already in the store is not fetched, whichever
  image brought it (an image whose base is on the node fetches only its own layers). A fetched
  layer must hash to its diff_id, so a config cannot plant a layer under another's name.
- Concurrent pulls of one image share one pull, and concurrent pulls of one layer (by two
  images) share one download and unpack: a flight per key in this process, a file lock per
  layer between processes. A flight nobody waits for any more is cancelled.
- A layer is unpacked while it downloads, and never written whole anywhere: its bytes go
  straight from the connection to a thread that decompresses and hashes them, and from there
  to one that checks and unpacks them into a hidden directory as they arrive (unpack.py's
  checks: paths escaping the root, device nodes...; ``layertar``), so a pull takes about as
  long as the slowest of the three, not their sum. A large layer's decompression, checks and
  unpacking run in a child process (``unpackproc``), fed through a pipe: the receiving and the
  unpacking then do not wait for each other's turn at one interpreter lock.
- Nothing unverified is visible or used: the unpacking sees the end of the stream only once
  the download has checked the blob's size and sha256, and the hidden directory is renamed
  into place only after that and once the uncompressed tar hashed to its diff_id (and, in a
  durable store, once its files reached the disk: ``ImageStore.durable``); a failed check
  removes it. A download that starts over from its first byte (another mirror, a
  registry without ranges) starts the unpacking over too, in a fresh hidden directory. The
  image is recorded last. A pull killed part way leaves only hidden directories, removed by
  the next pull once their process is gone. Layers that passed stay cached even if a later
  layer of the same image is bad (they are content-addressed; ``tangram image prune`` removes
  those no image uses).
- Bounds: at most ``max_layers`` layers and ``max_declared_bytes`` of declared blob sizes per
  image; a layer's files at most ``max_layer_files_bytes`` once uncompressed.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from .. import agentpyc
from ..images import Image, ImageError, ImageStore, NAME_RE, remove_dead_temps
from .client import Descriptor, RegistryClient, json_document
from .config import RegistriesConfig
from .errors import NoPlatform, RegistryError, TooLarge
from .reference import Reference, parse
from .unpackproc import unpack_in_child

log = logging.getLogger(__name__)
PART = ".part-"  # + pid + "-": a blob being downloaded (by versions that kept one; removed by a pull)


@dataclass(frozen=True)
class PullLimits:
    max_layers: int = 128
    max_declared_bytes: int = 64 << 30
    max_layer_files_bytes: int = 256 << 30
    max_config_bytes: int = 8 << 20
    #: layers of one image fetched at once (Docker's max-concurrent-downloads default)
    concurrent_layers: int = 3
    #: a layer blob of at least this many bytes is checked and unpacked in a child process
    #: (``unpackproc``: an interpreter lock of its own, beside the one receiving the blob);
    #: smaller ones in a thread, where the child's start would cost more than it saves
    process_unpack_bytes: int = 8 << 20
    #: ... on a machine with at least this many CPUs for this process (on one, the second
    #: interpreter has nothing to run on; on 2 quiet cores it measured 1.2x a thread's ext4 pull)
    process_unpack_cpus: int = 2

    def unpacks_in_child(self, blob_bytes: int) -> bool:
        """Whether a layer blob of ``blob_bytes`` is checked and unpacked in a child process here."""
        return blob_bytes >= self.process_unpack_bytes and _cpus() >= self.process_unpack_cpus


@dataclass(frozen=True)
class PullEvent:
    """Progress of one layer of one pull. ``state``: ``cached`` (on the node already),
    ``waiting`` (another process is fetching it), ``downloading`` (``done`` of ``size`` bytes),
    ``unpacking``, ``done``. ``index`` -1 with state ``resolved`` announces the image (``size``:
    its layers' declared bytes, ``done``: how many layers)."""

    ref: str
    index: int
    digest: str
    size: int
    done: int
    state: str


Progress = Callable[[PullEvent], None]


class _Flight:
    """One piece of work that several callers wait for; progress goes to all of them."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.listeners: list[Callable] = []
        self.waiters = 0
        self.last: tuple | None = None

    def emit(self, *event) -> None:
        self.last = event
        for listener in list(self.listeners):
            try:
                listener(*event)
            except Exception:  # a caller's progress display must not fail a pull others share
                log.exception("a pull's progress listener failed")


_FLIGHTS: dict[tuple, _Flight] = {}


async def _join(key: tuple, start: Callable[[Callable], Awaitable], listener: Callable | None = None):
    """Wait for the flight ``key``, starting it with ``start(emit)`` if none is under way."""
    loop = asyncio.get_running_loop()
    k = (loop, *key)
    fl = _FLIGHTS.get(k)
    if fl is None:
        fl = _FLIGHTS[k] = _Flight()
        fl.task = loop.create_task(start(fl.emit))

        def done(_t, k=k, fl=fl) -> None:
            if _FLIGHTS.get(k) is fl:
                del _FLIGHTS[k]

        fl.task.add_done_callback(done)
    elif listener is not None and fl.last is not None:
        listener(*fl.last)
    if listener is not None:
        fl.listeners.append(listener)
    fl.waiters += 1
    try:
        return await asyncio.shield(fl.task)
    finally:
        fl.waiters -= 1
        if listener is not None:
            fl.listeners.remove(listener)
        if fl.waiters == 0 and not fl.task.done():
            fl.task.cancel()  # everyone who wanted it left (cancelled)
            await asyncio.wait([fl.task])  # and it has ended (its threads too) before we go on


def store_name(ref: Reference) -> str:
    """The name a pulled image has in the store: its full reference."""
    return str(ref)


async def pull(ref: str | Reference, store: ImageStore, registries: RegistriesConfig | None = None,
               progress: Progress | None = None, *, client: RegistryClient | None = None,
               limits: PullLimits | None = None, fetched: Callable[[int], None] | None = None) -> Image:
    """Pull ``ref`` into ``store`` (unless it is there: a tag is looked up again, a digest is
    not) and return the stored image. Errors are ``ImageError``s naming the reference. A
    ``client`` given stays open (the caller closes it); otherwise the pull makes its own.
    ``fetched(n)``: told the bytes of each layer this pull downloaded (not those another pull
    of this process downloaded for it, nor cached ones)."""
    ref = parse(ref) if isinstance(ref, str) else ref
    name = store_name(ref)
    if not NAME_RE.match(name):
        raise ImageError(f"{ref}: longer than the 128 characters an image name may have in the store")
    limits = limits or PullLimits()
    if ref.digest and not ref.tag:
        try:
            return store.get(name)  # a digest names fixed content: nothing to ask the registry
        except ImageError:
            pass

    async def start(emit: Callable) -> Image:
        owned = _Owned(RegistryClient(registries)) if client is None else None
        try:
            return await _pull(ref, name, store, client or owned.client, limits, emit, owned, fetched)
        finally:
            if owned is not None:
                await owned.release()

    return await _join(("image", str(store.root), name), start, progress)


def pull_sync(ref: str | Reference, store: ImageStore, registries: RegistriesConfig | None = None,
              progress: Progress | None = None, **kwargs) -> Image:
    """``pull`` from code without an event loop (the command line)."""
    return asyncio.run(pull(ref, store, registries, progress, **kwargs))


class _Owned:
    """A client the pull made: closed by its last user (a layer's flight may outlive the pull
    that started it, when another pull waits for that layer too)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client, self.users = client, 1

    def hold(self) -> None:
        self.users += 1

    async def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            await self.client.aclose()


async def _pull(ref: Reference, name: str, store: ImageStore, client: RegistryClient, limits: PullLimits,
                emit: Progress, owned: _Owned | None, fetched: Callable[[int], None] | None) -> Image:
    blobs = store.root / "blobs"
    await asyncio.to_thread(_clean, store, blobs)
    manifest = await client.resolve(ref)
    if len(manifest.layers) > limits.max_layers:
        raise TooLarge(f"{ref}: the manifest lists {len(manifest.layers)} layers (at most {limits.max_layers})")
    declared = sum(d.size for d in manifest.layers)
    if declared > limits.max_declared_bytes:
        raise TooLarge(f"{ref}: the manifest declares {declared} bytes of layers (at most "
                       f"{limits.max_declared_bytes})")
    if not manifest.layers:
        raise RegistryError(f"{ref}: the image has no layers")
    config = _config(ref, await client.fetch_small(ref, manifest.config, limits.max_config_bytes),
                     len(manifest.layers))
    diff_ids = [d.removeprefix("sha256:") for d in config["rootfs"]["diff_ids"]]
    try:  # the same content under the same name: nothing to do
        have = store.get(name)
        if have.digest == manifest.digest and list(have.layers) == diff_ids:
            return have
    except ImageError:
        pass
    emit(PullEvent(str(ref), -1, manifest.digest, declared, len(manifest.layers), "resolved"))
    sizes = store.known_layer_sizes()
    gate = asyncio.Semaphore(limits.concurrent_layers)

    async def layer(i: int, desc: Descriptor, diff: str) -> int:
        def listen(state: str, done: int) -> None:
            emit(PullEvent(str(ref), i, desc.digest, desc.size, done, state))

        if store.has_layer(diff):
            listen("cached", desc.size)
            return sizes[diff] if diff in sizes else await asyncio.to_thread(store.layer_bytes, diff)
        async def fetch(e: Callable) -> int:
            if owned is not None:
                owned.hold()
            try:
                return await _fetch_layer(ref, store, client, desc, diff, i, limits, e, fetched)
            finally:
                if owned is not None:
                    await owned.release()

        async with gate:
            return await _join(("layer", str(store.root), diff), fetch, listen)

    tasks = [asyncio.ensure_future(layer(i, d, diff)) for i, (d, diff) in enumerate(zip(manifest.layers, diff_ids))]
    try:
        got = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return await asyncio.to_thread(store.record, name, diff_ids, list(got), config, str(ref), manifest.digest)


def _config(ref: Reference, body: bytes, layers: int) -> dict:
    config = json_document(ref, body, "image config")
    os_, arch = config.get("os"), config.get("architecture")
    if os_ and arch and (os_, arch) != ("linux", "amd64"):
        raise NoPlatform(f"{ref}: the image is for {os_}/{arch}, not linux/amd64")
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != layers:
        raise RegistryError(f"{ref}: the image config names {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
                            f"layer digests (diff_ids) for {layers} layers")
    for d in diff_ids:
        if not (isinstance(d, str) and d.startswith("sha256:") and len(d) == 71
                and all(c in "0123456789abcdef" for c in d[7:])):
            raise RegistryError(f"{ref}: the image config names a layer {d!r} that is not a sha256 digest")
    return config


def _clean(store: ImageStore, blobs: Path) -> None:
    store.clean_stale()
    remove_dead_temps(blobs, PART)


async def _fetch_layer(ref: Reference, store: ImageStore, client: RegistryClient, desc: Descriptor, diff: str,
                       index: int, limits: PullLimits, emit: Callable,
                       fetched: Callable[[int], None] | None = None) -> int:
    """Download, check and unpack one layer (unpacked as it arrives); its file bytes."""
    locks = store.root / "blobs" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    where = f"{ref}: layer {index} ({desc.digest[:19]})"
    async with _FileLock(locks / diff, lambda: emit("waiting", 0)):
        if store.has_layer(diff):  # another process unpacked it while we waited
            emit("done", desc.size)
            return await asyncio.to_thread(store.layer_bytes, diff)
        _, size = await _download(ref, store, client, desc, diff, where, limits, emit)
        if fetched is not None:
            fetched(desc.size)
        emit("done", desc.size)
        return size


async def _download(ref: Reference, store: ImageStore, client: RegistryClient, desc: Descriptor, diff: str,
                    where: str, limits: PullLimits, emit: Callable) -> tuple[str, int]:
    """Download blob ``desc`` while threads check and unpack it; (diff_id, file bytes) of the
    layer now in place."""
    child = unpack_in_child if limits.unpacks_in_child(desc.size) else None
    feed = _Feed(32 << 20 if child else 16 << 20)  # (a child's start: tens of ms of the blob held here)
    unpacking = _in_thread(_unpack_feed, store, feed, where, diff, limits.max_layer_files_bytes, child)
    try:
        emit("downloading", 0)
        await client.fetch_blob(ref, desc, None, lambda n: emit("downloading", n), tee=feed)
    except BaseException:
        feed.fail()
        await asyncio.gather(unpacking, return_exceptions=True)  # its hidden directory removed
        raise
    feed.end()  # verified: the unpacking may see the stream's end, and place the layer
    emit("unpacking", desc.size)
    return await _finish(unpacking)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


async def _finish(unpacking: asyncio.Future):
    """Await an unpacking thread; cancelled, wait for it to end first (a thread cannot be
    stopped: the layer ends unpacked, and cached, or discarded before this returns, so a
    cancelled pull leaves nothing of it running)."""
    try:
        return await asyncio.shield(unpacking)
    except asyncio.CancelledError:
        await asyncio.gather(unpacking, return_exceptions=True)
        raise


def _unpack_feed(store: ImageStore, feed: "_Feed", where: str, diff: str, max_bytes: int,
                 unpack: Callable | None = None) -> tuple[str, int]:
    try:
        while True:
            try:
                return store.unpack_layer(feed, where, expect=diff, max_bytes=max_bytes, unpack=unpack)
            except _Spoiled:  # the download started over: so does the unpacking, from its first byte
                feed.resume()
    finally:
        feed.gone()


class _Spoiled(Exception):
    """The download started over: what the unpacking read is not the blob's beginning."""


class _Failed(Exception):
    """The download failed: the unpacking stops, its directory removed."""


class _Feed:
    """A layer's bytes from its download to the thread unpacking it, in order, at most ``limit``
    bytes ahead of it (the download's writes wait). ``read`` hands over the chunks as they came
    (no copy). The end of the stream comes only with ``end``, once the blob's digest matched;
    ``fail`` makes the reader raise instead, and so does ``restart`` (the download starting over
    after bytes came: the reader raises ``_Spoiled`` until it ``resume``s, then reads the new
    stream). The writes come from worker threads, the reads from the unpacking's threads."""

    def __init__(self, limit: int = 16 << 20) -> None:
        self.limit = limit
        self.cv = threading.Condition()
        self.chunks: deque[bytes] = deque()
        self.held = 0
        self.fed = False
        self.ended = False
        self.error: Exception | None = None
        self.reader_gone = False
        self.stream = 0  # how many times the download started over
        self.reading = 0  # the stream the reader reads

    def write(self, data: bytes) -> int:
        with self.cv:
            while self.held >= self.limit and not (self.reader_gone or self.error):
                self.cv.wait()
            if self.reader_gone or self.error:
                return len(data)  # nobody reads on: the download goes on for its digest's verdict
            self.chunks.append(data)
            self.held += len(data)
            self.fed = True
            self.cv.notify_all()
        return len(data)

    def restart(self) -> None:
        with self.cv:
            if self.fed and self.error is None:
                self.stream += 1
                self.chunks.clear()
                self.held = 0
                self.fed = False
                self.cv.notify_all()

    def resume(self) -> None:
        with self.cv:
            self.reading = self.stream

    def end(self) -> None:
        with self.cv:
            self.ended = True
            self.cv.notify_all()

    def fail(self) -> None:
        with self.cv:
            if self.error is None:
                self.error = _Failed()
            self.cv.notify_all()

    def gone(self) -> None:
        with self.cv:
            self.reader_gone = True
            self.chunks.clear()
            self.cv.notify_all()

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (the next chunk, or its first ``n``); b"" at the verified end."""
        with self.cv:
            while not self.chunks and not self.ended and self.error is None and self.reading == self.stream \
                    and not self.reader_gone:
                self.cv.wait()
            if self.error is not None:
                raise self.error
            if self.reading != self.stream:
                raise _Spoiled()
            if self.reader_gone:
                raise _Failed()
            if not self.chunks:
                return b""
            head = self.chunks[0]
            if 0 <= n < len(head):
                self.chunks[0] = head[n:]
                head = head[:n]
            else:
                self.chunks.popleft()
            self.held -= len(head)
            self.cv.notify_all()
            return head


def _in_thread(fn: Callable, *args) -> asyncio.Future:
    """``fn(*args)`` in a thread of its own (not the loop's executor: an unpacking reads from
    writes that run there, and must never wait behind them); a future of its result."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting side
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="tangram-unpack", daemon=True).start()
    return fut


def prune(store: ImageStore, max_bytes: int | None = None, grace_s: float = 600.0) -> dict:
    """``tangram image prune``: the store's part (``ImageStore.prune``: the budget, hidden
    directories, unused layers), then the blobs': partial blobs of processes that are gone,
    downloaded blobs older than ``grace_s`` (left by versions that kept them) and lock files
    nobody holds; and the agents compiled for images no longer in the store (``agentpyc``). What
    was removed, and the disk the images use now."""
    out = store.prune(max_bytes, grace_s)
    out.update(_prune_blobs(store.root / "blobs", grace_s))
    out["agents_removed"] = agentpyc.prune(store.root, {img.id for img in store.list()})
    out["disk_bytes"] = store.disk_bytes()
    return out


def _prune_blobs(blobs: Path, grace_s: float) -> dict:
    parts = remove_dead_temps(blobs, PART)
    old = 0
    now = time.time()
    for p in ((blobs / "sha256").iterdir() if (blobs / "sha256").is_dir() else ()):
        try:
            if now - p.stat().st_mtime >= grace_s:
                p.unlink()
                old += 1
        except OSError:
            continue
    locks = 0
    for p in ((blobs / "locks").iterdir() if (blobs / "locks").is_dir() else ()):
        try:
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a pull holds it
        try:  # one that opens it now locks a file no longer named: at worst a layer fetched twice
            p.unlink()
            locks += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return {"partial_blobs_removed": parts, "blobs_removed": old, "locks_removed": locks}


class _FileLock:
    """An exclusive ``flock`` on ``path``, waited for without blocking the loop; ``on_wait`` is
    called once if another process holds it."""

    def __init__(self, path: Path, on_wait: Callable[[], None]) -> None:
        self.path, self.on_wait, self.fd = path, on_wait, -1

    async def __aenter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        told = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
            except BaseException:
                os.close(self.fd)
                raise
            if not told:
                told = True
                self.on_wait()
            try:
                await asyncio.sleep(0.05)
            except BaseException:
                os.close(self.fd)
                raise

    async def __aexit__(self, *exc) -> None:
        os.close(self.fd)  # closing the descriptor releases the lock
