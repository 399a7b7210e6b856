"""Fork, snapshot and restore of sessions: copy-on-write through overlay layers.

An image session's whole root is layered; a default session's workspace is (``rootfs.HOST_IMAGE``:
the rest of its tree is the host's read-only directories, as for a one-shot), so both go through
the same operations here.

The manager owns the sessions and carries these out (``execution.Execution.fork``, ``restore``);
this module holds the operations on roots and files they are made of.

**Fork** (an action on the source session, so it is ordered with the session's other actions):
the source's processes are stopped (it is paused only for this instant), its writable tmpfs is
remounted read-only and becomes one more shared lower layer, and the parent and each child get a
fresh empty writable layer on top of it. Nothing is copied: a child's disk and memory grow only
with what it writes, and no child ever sees another's writes (or the parent's later ones).

What carries over: every file of the session (the image's, and everything written since).
What does not: processes. The persistent Python interpreter and the persistent shell of the
parent *and* the children start afresh on their next step (their memory is re-created, not
forked: forking a live interpreter across mount namespaces would need CRIU-like machinery; an
interpreter starts in tens of milliseconds, and RL rollouts re-run their setup as files anyway).
Children's sandboxes start lazily, on their first action: fork itself is only mounts.

**Snapshot** writes the session's own layers (not the image's: the snapshot names the image by
id) as one tar: ``tangram-snapshot.json`` and ``layers/<i>/...`` bottom first, whiteouts and
opaque directories in the OCI ``.wh.`` form. **Restore** validates the whole file like an image
import (escapes, devices, links pointing out) before unpacking anything, then stacks the layers
on the image for a new session. The image must be in the restoring node's store under the same id.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import stat
import tarfile
import time

from .imagebox import ImageSandboxes
from .images import ImageError
from .rootfs import Layer, RootFs
from .spec import SandboxResult
from .unpack import Checker, Unpacker

FORMAT = "tangram-snapshot/1"
META = "tangram-snapshot.json"


def not_layered(what: str, why: str) -> SandboxResult:
    return SandboxResult(message=f"{what}: the session has no copy-on-write layer ({why})")


def stack(boxes: ImageSandboxes, src: RootFs, copies: int) -> list[RootFs]:
    """Fork's copy-on-write step (blocking: call it in a thread): freeze ``src``'s writable layer
    into a shared read-only one and mount ``copies`` fresh roots on it. ``src`` is released."""
    layer = src.freeze().acquire()  # held while the new roots are stacked on it
    roots: list[RootFs] = []
    try:
        for _ in range(copies):
            roots.append(boxes.new_root(src.image, [layer, *src.session_layers]))
    except BaseException:
        for r in roots:
            boxes.drop(r)
        raise
    finally:
        src.release()
        layer.release()
    return roots


async def snapshot(rootfs: RootFs, path: str) -> SandboxResult:
    """Write the session's layers to ``path`` (``write_snapshot``, in a thread)."""
    t = time.perf_counter()
    size = await asyncio.to_thread(write_snapshot, rootfs, path)
    return SandboxResult(info={"path": path, "bytes": size, "snapshot_s": time.perf_counter() - t})


def _layer_members(top: str, prefix: str):
    """(TarInfo, fileobj-path) for the layer directory ``top``, overlay whiteouts and opaque
    directories turned into their ``.wh.`` entries."""
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, top)
        if rel_dir != "." and _opaque(dirpath):
            info = tarfile.TarInfo(f"{prefix}/{rel_dir}/.wh..wh..opq")
            yield info, None
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            arc = f"{prefix}/{os.path.normpath(os.path.join(rel_dir, name))}"
            st = os.lstat(full)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                yield tarfile.TarInfo(f"{os.path.dirname(arc)}/.wh.{name}"), None
                continue
            yield arc, full


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def write_snapshot(rootfs: RootFs, path: str) -> int:
    """The session's layers (bottom first) into the tar ``path``; returns its size."""
    layers = [*reversed(rootfs.lowers_top_first()), rootfs.upper]
    tmp = f"{path}.partial"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        meta = json.dumps({"format": FORMAT, "image": rootfs.image.name, "image_id": rootfs.image.id,
                           "layers": len(layers)}).encode()
        info = tarfile.TarInfo(META)
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        for i, top in enumerate(layers):
            for item, full in _layer_members(top, f"layers/{i}"):
                if isinstance(item, tarfile.TarInfo):
                    tar.addfile(item)
                    continue
                info = tar.gettarinfo(full, item)
                if info is None:
                    continue  # sockets: not part of a filesystem's state
                if info.isreg():
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
    os.replace(tmp, path)
    return os.path.getsize(path)


def read_snapshot(path: str, dest_dir: str) -> tuple[dict, list[str]]:
    """Validate the whole snapshot, then unpack its layers under ``dest_dir``; returns the
    metadata and the layer directories, top first."""
    where = f"snapshot {path}"
    try:
        tar = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as e:
        raise ImageError(f"{where}: not a snapshot file ({e})") from None
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, OSError) as e:
            raise ImageError(f"{where}: truncated or corrupt ({e})") from None
        if not members or members[0].name != META:
            raise ImageError(f"{where}: not a snapshot file (no {META} first)")
        meta = json.load(tar.extractfile(members[0]))
        if meta.get("format") != FORMAT:
            raise ImageError(f"{where}: unsupported format {meta.get('format')!r}")
        count = int(meta.get("layers", 0))
        checkers = [Checker(f"{where} layer {i}") for i in range(count)]
        plan = []
        for m in members[1:]:
            head, _, rest = m.name.partition("/")
            idx, _, rel = rest.partition("/")
            if head != "layers" or not idx.isdigit() or int(idx) >= count:
                raise ImageError(f"{where}: unexpected member {m.name!r}")
            if m.islnk():
                lhead, _, lrest = m.linkname.partition("/")
                lidx, _, lrel = lrest.partition("/")
                if lhead != "layers" or lidx != idx:
                    raise ImageError(f"{where}: hard link {m.name!r} -> {m.linkname!r} leaves its layer")
                m.linkname = lrel
            checkers[int(idx)].check(m, rel)
            plan.append((int(idx), m, rel))
        dirs = [os.path.join(dest_dir, str(i)) for i in range(count)]
        for d in dirs:
            os.makedirs(d)
        unpackers = [Unpacker(d, f"{where} layer {i}") for i, d in enumerate(dirs)]
        for idx, m, rel in plan:
            unpackers[idx].add(tar, m, rel)
        for u in unpackers:
            u.finish()
    return meta, list(reversed(dirs))


def restore(boxes: ImageSandboxes, trajectory: str, path: str) -> RootFs:
    """Mount a new root for session ``trajectory`` from the snapshot ``path`` (blocking I/O:
    call it in a thread). Its processes start on the session's first action."""
    dest = boxes.scratch_dir(f"restore-{trajectory}-{os.urandom(3).hex()}")
    try:
        with tarfile.open(path, "r:") as tar:
            first = tar.next()
            meta = json.load(tar.extractfile(first)) if first is not None and first.name == META else {}
        image = boxes.image(str(meta.get("image", "")))
        if image.id != meta.get("image_id"):
            raise ImageError(f"snapshot {path}: made from image {meta.get('image')!r} with id "
                             f"{str(meta.get('image_id'))[:12]}, but this store's image of that name has id "
                             f"{image.id[:12]}")
        _, dirs = read_snapshot(path, dest)
    except (ImageError, tarfile.TarError, OSError, ValueError) as e:
        shutil.rmtree(dest, ignore_errors=True)
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"snapshot {path}: cannot read it ({e})") from None
    layers = [Layer(d, remove=d) for d in dirs]
    for layer in layers:
        layer.acquire()
    try:
        return boxes.new_root(image, layers)
    finally:
        for layer in layers:
            layer.release()
        if not any(layer.refs for layer in layers):
            shutil.rmtree(dest, ignore_errors=True)
