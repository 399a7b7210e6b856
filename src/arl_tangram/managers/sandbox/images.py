"""Container images for sandboxes: import once, unpack each layer once, share it everywhere.

``ImageStore.import_path`` takes a ``docker save`` archive (classic or the OCI-flavoured one
Docker 25+ writes), an OCI image-layout archive, or a root filesystem directory. Every layer is
checked completely *before* anything is written to the cache, and a bad member fails the import
with a message naming it: paths that escape the root (``../``, absolute names), links pointing out
of the image, hard links to files the layer does not contain, device nodes and FIFOs, truncated
or unknown formats. Then each layer is unpacked into ``layers/<sha256 of its tar>/`` (content
addressed: two images sharing a base share its directories) in overlayfs' own on-disk format:
a whiteout (``.wh.NAME``) becomes a 0/0 character device, an opaque directory (``.wh..wh..opq``)
gets ``trusted.overlay.opaque=y``. So a sandbox mounts the layers as overlay lower directories
as they are — nothing is flattened or copied per sandbox. The checks and the unpacking are
``unpack.py``'s; this module is the store around them.

Layer tars may be plain, gzip- or zstd-compressed (sniffed from their first bytes). Images pulled
from a registry (``registry/``) go through the same checks: ``ImageStore.unpack_layer`` checks
and unpacks a layer in one pass into a hidden directory that is renamed into place only once the
whole layer passed, and ``ImageStore.record`` names an image only once all its layers are in.
A store is ``durable`` by default: a layer is never trusted after a crash of the machine unless its
files reached the disk. An import runs one ``syncfs`` of the store's file system before each
rename; a pull (``unpack_layer``) renames first and syncs behind it, off the pull's path: it writes
``unsynced/<digest>`` (this boot's id, fsynced) before the rename, and a thread of the
store's (``_Syncer``) runs ``syncfs`` and removes the marker. A marker found at start
(``check_unsynced``) from another boot means the machine went down before that sync: its layer is
removed (a pull fetches it again); one from this boot (a killed process) is synced then. An fsync
per file would cost a disk flush each.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from ...core.names import IMAGE_NAME_RE
from .unpack import (UNPACKING, ImageError, LayerPlan, check_and_unpack, check_layer, normalise,
                     remove_dead_temps, syncfs, unpack_checked)

NAME_RE = IMAGE_NAME_RE  # core.names: checked where names enter too
UNSYNCED = "unsynced"  # the store's directory of markers: a pulled layer visible before its files were synced

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Image:
    """An imported image: its layers (bottom first, as directories of the cache) and the parts of
    its config a sandbox uses."""

    name: str
    id: str
    layers: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    source: str = ""
    created: float = 0.0
    size_bytes: int = 0
    #: each layer's file bytes, as ``layers`` (empty in records written before it was kept)
    layer_sizes: tuple[int, ...] = ()
    #: the manifest digest the image was pulled by ("" for an imported one)
    digest: str = ""

    def layer_dirs(self, store: "ImageStore") -> list[Path]:
        return [store.layer_dir(d) for d in self.layers]


def default_store() -> Path:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return Path(os.environ.get("TANGRAM_IMAGE_STORE") or base / "arl-tangram" / "images")


def _tar_directory(root: Path, out: IO[bytes]) -> None:
    """A root filesystem directory as a deterministic tar (sorted, hard links detected)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                arc = os.path.relpath(full, root)
                info = tar.gettarinfo(full, arc)
                if info.isreg():
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)


class ImageStore:
    """The content-addressed cache of layers and the named images made of them."""

    def __init__(self, root: Path | str | None = None, durable: bool = True, sync_behind: bool = True) -> None:
        self.root = Path(root) if root is not None else default_store()
        #: after a crash of the machine a layer is whole or absent, never used with files the
        #: kernel had not written yet: an import's ``syncfs`` before its rename, a pull's behind it
        #: (its marker until then: the module's docstring)
        self.durable = durable
        #: a pulled layer's sync behind its rename (``_place``); False: before it, as an import's
        self.sync_behind = sync_behind

    def layer_dir(self, digest: str) -> Path:
        return self.root / "layers" / digest

    def _image_file(self, name: str) -> Path:
        return self.root / "images" / (name.replace("/", "%2F") + ".json")

    # -- queries ---------------------------------------------------------------------------------
    def get(self, name: str) -> Image:
        """The image ``name``; ``ImageError`` naming it if it was never imported."""
        if not NAME_RE.match(name):
            raise ImageError(f"image: {name!r} is not a valid image name (letters, digits, ._:@/-)")
        try:
            data = json.loads(self._image_file(name).read_text())
        except FileNotFoundError:
            raise ImageError(f"image: no image named {name!r} (pull it with `tangram image pull` or import "
                             "it with `tangram image import`)") from None
        data["layers"] = tuple(data["layers"])
        data["layer_sizes"] = tuple(data.get("layer_sizes") or ())
        img = Image(**data)
        missing = [d for d in img.layers if not self.layer_dir(d).is_dir()]
        if missing:
            raise ImageError(f"image: {name!r} is damaged: layer {missing[0][:12]} is missing from the cache")
        return img

    def list(self) -> list[Image]:
        d = self.root / "images"
        if not d.is_dir():
            return []
        return sorted((self.get(json.loads(p.read_text())["name"]) for p in d.glob("*.json")), key=lambda i: i.name)

    def remove(self, name: str) -> list[str]:
        """Forget ``name`` and delete the layers no other image uses; returns the deleted layers.
        Refused while a sandbox's root is made of it (another image's root that shares some of
        its layers keeps those, and does not hold it)."""
        img = self.get(name)
        stacks = self._mounted_stacks()
        busy = stacks.count(tuple(img.layers))
        if busy:
            raise ImageError(f"image: {name!r} is in use by {busy} running sandbox mount(s); stop the server using "
                             "it first")
        self._image_file(name).unlink()
        used = {d for other in self.list() for d in other.layers} | {d for st in stacks for d in st}
        gone = [d for d in img.layers if d not in used]
        for d in gone:
            # renamed hidden first: a layer is there whole or not at all, for a pull that looks
            # (and one whose removal is killed part way is cleaned up as an unpacking is)
            hidden = self.root / "layers" / f"{UNPACKING}{os.getpid()}-rm-{os.urandom(4).hex()}"
            try:
                os.rename(self.layer_dir(d), hidden)
            except FileNotFoundError:
                continue
            shutil.rmtree(hidden, ignore_errors=True)
        return gone

    # -- import ----------------------------------------------------------------------------------
    def import_path(self, path: Path | str, name: str) -> Image:
        """Import a docker-save / OCI archive or a root filesystem directory as ``name``."""
        if not NAME_RE.match(name):
            raise ImageError(f"--name: {name!r} is not a valid image name (letters, digits, ._:@/-)")
        path = Path(path)
        if path.is_dir():
            return self._import_dir(path, name)
        if not path.is_file():
            raise ImageError(f"PATH: {path} does not exist")
        try:
            outer = tarfile.open(path, "r:*")
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ImageError(f"PATH: {path} is not an image archive (not a tar: {e})") from None
        with outer:
            try:
                names = {posixpath.normpath(m.name).lstrip("/"): m for m in outer.getmembers()}
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ImageError(f"PATH: {path} is truncated or corrupt ({e})") from None
            layer_names, config = self._manifest(outer, names, path)
            plans = []
            for i, lname in enumerate(layer_names):
                where = f"layer {i} ({lname})"
                member = _archive_member(names, lname)
                if member is None or not member.isreg():
                    raise ImageError(f"{where}: listed in the manifest but missing from the archive")
                opener = (lambda m=member: outer.extractfile(m))
                digest, size = check_layer(opener(), where)
                plans.append(LayerPlan(where, digest, opener, size))
            return self._commit(name, plans, config, str(path))

    def _manifest(self, outer: tarfile.TarFile, names: dict, path: Path) -> tuple[list[str], dict]:
        def read_json(name: str, what: str):
            m = names.get(name)
            if m is None:
                return None
            try:
                return json.load(outer.extractfile(m))
            except (json.JSONDecodeError, UnicodeDecodeError, tarfile.TarError, OSError) as e:
                raise ImageError(f"{what}: not valid JSON ({e})") from None

        manifest = read_json("manifest.json", "manifest.json")
        if manifest is not None:  # docker save (classic and OCI-flavoured)
            if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict) \
                    or not isinstance(manifest[0].get("Layers"), list):
                raise ImageError("manifest.json: expected a list of images with Layers")
            if len(manifest) > 1:
                raise ImageError(f"manifest.json: the archive holds {len(manifest)} images; save one at a time")
            cfg = read_json(str(manifest[0].get("Config", "")).lstrip("./"), "image config") or {}
            return [str(x) for x in manifest[0]["Layers"]], cfg
        index = read_json("index.json", "index.json")
        if index is not None:  # OCI image layout
            try:
                desc = index["manifests"][0]
                m = read_json(_blob(desc["digest"]), "OCI manifest")
                if m is not None and "manifests" in m:  # an index of platforms: take the first
                    m = read_json(_blob(m["manifests"][0]["digest"]), "OCI manifest")
                if m is None:
                    raise ImageError("index.json: its manifest blob is missing from the archive")
                cfg = read_json(_blob(m["config"]["digest"]), "image config") or {}
                return [_blob(layer["digest"]) for layer in m["layers"]], cfg
            except (KeyError, IndexError, TypeError) as e:
                raise ImageError(f"index.json: not an OCI image index ({type(e).__name__}: {e})") from None
        raise ImageError(f"PATH: {path} is neither a docker-save nor an OCI archive (no manifest.json or index.json)")

    def _import_dir(self, root: Path, name: str) -> Image:
        spool = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        try:
            _tar_directory(root, spool)
        except OSError as e:
            raise ImageError(f"PATH: cannot read {root}: {e}") from None
        spool.seek(0)
        digest, size = check_layer(spool, f"directory {root}")

        def opener():
            spool.seek(0)
            return spool

        with spool:
            return self._commit(name, [LayerPlan(f"directory {root}", digest, opener, size)], {}, str(root))

    def _commit(self, name: str, plans: list[LayerPlan], config: dict, source: str) -> Image:
        """Unpack the layers not cached yet (each into a temporary directory, renamed into place
        whole) and record the image."""
        for plan in plans:
            if self.has_layer(plan.digest):
                continue
            tmp = self._unpack_dir()
            try:
                unpack_checked(plan.open(), tmp, plan.where)
                self._place(tmp, plan.digest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return self.record(name, [p.digest for p in plans], [p.size for p in plans], config, source)

    # -- the pieces a pull uses --------------------------------------------------------------------
    def has_layer(self, digest: str) -> bool:
        return self.layer_dir(digest).is_dir()

    def _unpack_dir(self) -> Path:
        (self.root / "layers").mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{UNPACKING}{os.getpid()}-", dir=self.root / "layers"))

    def _place(self, tmp: Path, digest: str, behind: bool = False) -> None:
        """Rename the unpacked ``tmp`` into place as layer ``digest`` (whole, or not at all);
        ``durable``: its files on the disk first, or (``behind``, a pull's) synced right after by
        the store's thread, its marker on the disk before the rename (the module's docstring)."""
        os.chmod(tmp, 0o755)
        marker = None
        if self.durable:
            boot = boot_id() if behind and self.sync_behind else ""
            if boot:
                marker = self.root / UNSYNCED / digest
                if not marker.parent.is_dir():  # its entry on the disk too, or a crash could lose the marker
                    marker.parent.mkdir(exist_ok=True)
                    _fsync_dir(self.root)
                _write_synced(marker, boot)
            else:
                syncfs(tmp)
        final = self.layer_dir(digest)
        try:
            os.rename(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                if marker is not None:
                    marker.unlink(missing_ok=True)
                raise
            # a concurrent import or pull got there first: the same content (its marker, if any,
            # is its syncer's; ours goes with the sync asked below)
        if marker is not None:
            _syncer(self.root).ask(marker)

    def check_unsynced(self) -> int:
        """At a server's start, before any sandbox uses a layer: a pulled layer whose sync marker
        says another boot is removed (the machine went down before its files were surely on the
        disk; the next use pulls it again); one of this boot's (a killed process) is synced behind.
        Returns how many layers were removed."""
        markers = self.root / UNSYNCED
        try:
            names = os.listdir(markers)
        except FileNotFoundError:
            return 0
        boot, syncer, removed = boot_id(), _syncer(self.root), 0
        for digest in names:
            marker = markers / digest
            if not re.fullmatch(r"[0-9a-f]{64}", digest) or syncer.holds(marker):
                continue
            try:
                said = marker.read_text().strip()
            except OSError:
                continue
            if boot and said == boot:
                syncer.ask(marker)
                continue
            log.warning("image store %s: layer %s was pulled before the machine went down and never synced to "
                        "disk: removed (the next use of its images pulls it again)", self.root, digest[:12])
            shutil.rmtree(self.layer_dir(digest), ignore_errors=True)
            marker.unlink(missing_ok=True)
            removed += 1
        return removed

    def synced(self, timeout: float | None = None) -> bool:
        """Wait until every pulled layer of this process is synced to disk; False at ``timeout``."""
        return _syncer(self.root).idle(timeout)

    def unpack_layer(self, stream: IO[bytes], where: str, expect: str | None = None,
                     max_bytes: int | None = None, unpack=None) -> tuple[str, int]:
        """Check and unpack one (possibly compressed) layer tar into the cache in one pass; it
        becomes visible only once whole and checked. ``expect``: the sha256 its uncompressed tar
        must have (an image config's diff_id, without ``sha256:``). Returns (that digest, its file
        bytes). ``unpack``: what checks and unpacks it into the hidden directory, with
        ``unpack.check_and_unpack``'s arguments and answer (a pull's child process); that
        function if None. Blocking I/O: call it in a thread."""
        tmp = self._unpack_dir()
        try:
            digest, size = (unpack or check_and_unpack)(stream, tmp, where, max_bytes)
            if expect is not None and digest != expect:
                raise ImageError(f"{where}: its content is sha256:{digest}, not the layer sha256:{expect} the "
                                 "image's config names")
            self._place(tmp, digest, behind=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return digest, size

    def record(self, name: str, layers: list[str], sizes: list[int], config: dict, source: str,
               digest: str = "") -> Image:
        """Name an image made of ``layers`` (all in the cache already): written whole, at once,
        so an image is listed and used only once every layer is in."""
        if not NAME_RE.match(name):
            raise ImageError(f"image: {name!r} is not a valid image name (letters, digits, ._:@/-; 128 at most)")
        missing = [d for d in layers if not self.has_layer(d)]
        if missing:
            raise ImageError(f"image: {name!r}: layer {missing[0][:12]} is not in the cache")
        cfg = config.get("config") or config.get("Config") or {}
        env = {}
        for item in cfg.get("Env") or []:
            k, _, v = str(item).partition("=")
            env[k] = v
        img = Image(name=name, id=hashlib.sha256("\n".join(layers).encode()).hexdigest(), layers=tuple(layers),
                    env=env, workdir=str(cfg.get("WorkingDir") or ""), source=source, created=time.time(),
                    size_bytes=sum(sizes), layer_sizes=tuple(sizes), digest=digest)
        (self.root / "images").mkdir(parents=True, exist_ok=True)
        final = self._image_file(name)
        tmp_json = final.with_name(f".{os.getpid()}-{os.urandom(4).hex()}.tmp")  # not *.json: never listed
        try:
            tmp_json.write_text(json.dumps(asdict(img)))
            os.replace(tmp_json, final)
        except BaseException:
            tmp_json.unlink(missing_ok=True)
            raise
        return img

    def clean_stale(self) -> int:
        """Remove what imports and pulls killed part way left (never visible, only disk)."""
        return remove_dead_temps(self.root / "layers", UNPACKING)

    def layer_bytes(self, digest: str) -> int:
        """The file bytes of a cached layer, counted on disk."""
        return _tree_bytes(self.layer_dir(digest))

    def known_layer_sizes(self) -> dict[str, int]:
        """Layer -> its file bytes, as the image records say (images that cannot be read skipped)."""
        out: dict[str, int] = {}
        d = self.root / "images"
        for p in (d.glob("*.json") if d.is_dir() else ()):
            try:
                data = json.loads(p.read_text())
                out.update(zip(data["layers"], data.get("layer_sizes") or ()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    # -- use and the disk budget ------------------------------------------------------------------
    def touch(self, name: str) -> None:
        """Mark ``name`` used now: the disk budget evicts the least recently used images first
        (an image's record's mtime is its last use; ``record`` sets it too)."""
        try:
            os.utime(self._image_file(name))
        except OSError:
            pass  # removed meanwhile: nothing to mark

    def last_used(self) -> dict[str, float]:
        """Image name -> when it was last used (or recorded)."""
        d = self.root / "images"
        out: dict[str, float] = {}
        for p in (d.glob("*.json") if d.is_dir() else ()):
            try:
                out[json.loads(p.read_text())["name"]] = p.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def disk_bytes(self) -> int:
        """The file bytes of the layers the images use, each layer counted once."""
        used = {d for img in self._records() for d in img.get("layers", ())}
        sizes = self.known_layer_sizes()
        return sum(sizes[d] if d in sizes else self.layer_bytes(d) for d in used if self.has_layer(d))

    def _records(self) -> list[dict]:
        d = self.root / "images"
        out = []
        for p in (d.glob("*.json") if d.is_dir() else ()):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _mounted_stacks(self) -> list[tuple[str, ...]]:
        """The images' layers (bottom first) of each overlay root mounted on this host from this
        store: what a mount lists below the store's base directory (``rootfs.RootFs``: the
        session's layers, the base, then the image's, top first)."""
        layers = f"{self.root / 'layers'}/"
        out = []
        for line in _mount_text().splitlines():
            if " - overlay " not in line:
                continue
            lowers: list[str] = []
            for opt in line.rsplit(" ", 1)[-1].split(","):
                key, _, value = opt.partition("=")
                if key == "lowerdir":
                    lowers += value.split(":")
                elif key == "lowerdir+":
                    lowers.append(value)
            mine = [p[len(layers):] for p in lowers if p.startswith(layers)]
            if mine:
                out.append(tuple(reversed(mine)))
        return out

    def victims(self, max_bytes: int, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """The least recently used images to remove so that the layers the others use fit in
        ``max_bytes``: never one in ``keep`` nor one a mounted root uses (a sandbox of it is
        running, prewarmed or at rest); a layer counts until no image left uses it. Fewer than
        needed when the rest are in use. Reads only."""
        records = {r["name"]: r for r in self._records() if isinstance(r.get("name"), str)}
        sizes = self.known_layer_sizes()
        stacks = self._mounted_stacks()
        users: dict[str, int] = {}
        for layers in [r.get("layers", ()) for r in records.values()] + stacks:  # a mounted layer stays
            for d in set(layers):
                users[d] = users.get(d, 0) + 1
        size = {d: sizes[d] if d in sizes else self.layer_bytes(d) for d in users if self.has_layer(d)}
        total = sum(size.values())
        out: list[str] = []
        if total <= max_bytes:
            return out
        for name, _ in sorted(self.last_used().items(), key=lambda kv: kv[1]):
            r = records.get(name)
            if r is None or name in keep or tuple(r.get("layers", ())) in stacks:
                continue
            out.append(name)
            for d in set(r.get("layers", ())):
                users[d] -= 1
                if users[d] == 0:
                    total -= size.get(d, 0)
            if total <= max_bytes:
                break
        return out

    def evict(self, max_bytes: int, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Remove ``victims(max_bytes, keep)`` (each with the layers no other image uses);
        returns those removed (one mounted meanwhile stays)."""
        removed = []
        for name in self.victims(max_bytes, keep):
            try:
                self.remove(name)
            except ImageError:
                continue
            removed.append(name)
        return removed

    def prune(self, max_bytes: int | None = None, grace_s: float = 600.0) -> dict:
        """The store's part of ``tangram image prune`` (``registry.pulling.prune`` adds the blobs):
        the budget applied (``max_bytes``), and what killed imports and pulls left removed:
        hidden directories of processes that are gone, layers no image uses (unused for
        ``grace_s``: a pull under way in another process may be about to name them)."""
        evicted = self.evict(max_bytes) if max_bytes is not None else []
        hidden = self.clean_stale()
        used = {d for img in self._records() for d in img.get("layers", ())}
        mounts = _mount_text()
        orphans = 0
        now = time.time()
        layers = self.root / "layers"
        for entry in (os.scandir(layers) if layers.is_dir() else ()):
            if entry.name.startswith(".") or entry.name in used or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.path in mounts or now - entry.stat(follow_symlinks=False).st_ctime < grace_s:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            orphans += 1
        return {"evicted": evicted, "hidden_removed": hidden, "unused_layers_removed": orphans}

    def usage(self) -> list[dict]:
        """Each image's size and how much of it it shares with other images (layers of the
        same digest, on disk once)."""
        images = self.list()
        users: dict[str, int] = {}
        for img in images:
            for d in set(img.layers):
                users[d] = users.get(d, 0) + 1
        sizes: dict[str, int] = {}
        for img in images:
            if len(img.layer_sizes) == len(img.layers):
                sizes.update(zip(img.layers, img.layer_sizes))
        out = []
        for img in images:
            per = {d: sizes[d] if d in sizes else sizes.setdefault(d, self.layer_bytes(d))
                   for d in img.layers}
            out.append({"name": img.name, "id": img.id, "layers": len(img.layers), "size_bytes": sum(per.values()),
                        "shared_bytes": sum(n for d, n in per.items() if users[d] > 1),
                        "source": img.source, "digest": img.digest})
        return out


def boot_id() -> str:
    """This boot's id (the kernel's, new at each boot); "" where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _write_synced(path: Path, text: str) -> None:
    """``text`` in the new file ``path``, the file and its directory's entry on the disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Syncer:
    """A store's thread that syncs its pulled layers to disk behind the pulls: one ``syncfs`` for
    every layer asked before it starts, then their markers removed. A failed sync leaves its markers
    (the next start after a crash removes those layers) and is logged."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cond = threading.Condition()
        self.asked: list[Path] = []
        self.syncing: list[Path] = []
        self.thread: threading.Thread | None = None

    def ask(self, marker: Path) -> None:
        with self.cond:
            self.asked.append(marker)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="tangram-image-sync", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def holds(self, marker: Path) -> bool:
        with self.cond:
            return marker in self.asked or marker in self.syncing

    def idle(self, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.asked and not self.syncing, timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.asked)
                self.syncing, self.asked = self.asked, []
            try:
                syncfs(self.root)
            except FileNotFoundError:  # the store was removed (a bench's, a test's): nothing to keep
                pass
            except OSError as e:
                log.error("image store %s: syncing %d pulled layer(s) to disk failed (%s): a crash of the machine "
                          "now would cost their pulls again", self.root, len(self.syncing), e)
            else:
                for marker in self.syncing:
                    marker.unlink(missing_ok=True)
            with self.cond:
                self.syncing = []
                self.cond.notify_all()


_syncers: dict[Path, _Syncer] = {}
_syncers_lock = threading.Lock()


def _syncer(root: Path) -> _Syncer:
    with _syncers_lock:
        key = root.resolve()
        if key not in _syncers:
            _syncers[key] = _Syncer(key)
        return _syncers[key]


def _tree_bytes(root: Path) -> int:
    """The file bytes under ``root`` (a layer recorded before per-layer sizes were kept)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _archive_member(names: dict[str, tarfile.TarInfo], name: str) -> tarfile.TarInfo | None:
    """A member of the outer archive by name, following symlinks inside it (``docker save``
    writes a layer shared by two images once and links the second to it)."""
    path = normalise(name, "manifest.json")
    for _ in range(8):
        m = names.get(path)
        if m is None or not m.issym():
            return m
        path = normalise(posixpath.normpath(posixpath.join(posixpath.dirname(path), m.linkname)), "manifest.json")
    return None


def _mount_text() -> str:
    """This mount namespace's mount table (overlay options name their layers)."""
    try:
        with open("/proc/self/mountinfo") as fh:
            return fh.read()
    except OSError:
        return ""


def _blob(digest: str) -> str:
    algo, _, hexd = str(digest).partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise ImageError(f"OCI descriptor: unsupported digest {digest!r}")
    return f"blobs/sha256/{hexd}"


def resolve_in(root: str, path: str, hops: int = 40) -> str | None:
    """``path`` inside the tree ``root`` with symlinks followed *inside* it (absolute targets
    are relative to ``root``); the host path, or None if it does not exist."""
    parts = [p for p in path.split("/") if p]
    cur = root
    while parts:
        part = parts.pop(0)
        if part == "..":
            cur = cur if cur == root else os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(nxt)
            parts = [p for p in target.split("/") if p] + parts
            if target.startswith("/"):
                cur = root
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return None  # an overlay whiteout
        cur = nxt
    return cur
