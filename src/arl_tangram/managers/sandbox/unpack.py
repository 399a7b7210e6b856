"""A layer tar's checks and its unpacking into overlayfs' on-disk format, for the image store.

``Checker`` judges a layer's members in order, and the first bad one fails it with a message
naming it: paths that escape the root (``../``, absolute names), links pointing out of the image,
hard links to files the layer does not contain, device nodes and FIFOs, unknown whiteout kinds,
more file bytes than a limit. ``Unpacker`` writes the members into a fresh directory as overlayfs
reads them: a whiteout (``.wh.NAME``) becomes a 0/0 character device, an opaque directory
(``.wh..wh..opq``) gets ``trusted.overlay.opaque=y``. ``check_and_unpack`` does both in one pass
(a member's checks depend only on the members before it); ``unpack_child`` is the same in a
pull's child process (``registry/unpackproc``). ``ImageError`` lives here because these checks
raise it; ``images`` (the store) names it for everyone else.

Unpacking never follows a link on the host: a member under a symlink of its own layer is refused,
files are created with ``O_NOFOLLOW | O_EXCL`` in a fresh directory, and ownership, modes
(set after the contents, so read-only directories can be filled) and mtimes are applied to the
entry itself. Alternative dropped: ``tarfile``'s ``data`` filter — it refuses absolute symlinks
(normal in a root filesystem: ``/etc/alternatives``) and knows nothing of whiteouts.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .layertar import BadLayer, Inflated, TarStream

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class ImageError(ValueError):
    """An import or lookup that cannot be done; the message names the archive member or field.
    ``infra``: the failure is ours or a registry's, not the request's (a registry that does not
    answer): an action it ends is ``infra_error``, not ``rejected``."""

    infra = False


def normalise(name: str, where: str) -> str:
    """A member's path relative to the image root, or an error if it leaves it."""
    if name.startswith("/"):
        raise ImageError(f"{where}: member {name!r} has an absolute path")
    plain = name[2:] if name.startswith("./") else name  # (mmdebstrap's members all start so)
    if "//" not in plain and "./" not in plain and not plain.endswith((".", "/")) and plain:
        return plain  # the usual member: nothing to take out, and no "." or ".." in it
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{where}: member {name!r} escapes the root (..)")
    return "/".join(parts)


def _escapes(link_dir: str, target: str) -> bool:
    """Whether a symlink in ``link_dir`` to ``target`` resolves outside the image root (absolute
    targets are read inside the sandbox's root, so they stay in)."""
    if target.startswith("/"):
        return False
    depth = 0
    for part in (link_dir.split("/") if link_dir else []) + target.split("/"):
        if part in ("", "."):
            continue
        depth += -1 if part == ".." else 1
        if depth < 0:
            return True
    return False


@dataclass
class LayerPlan:
    """What validation learnt about one layer (its id and where to read it from)."""

    where: str
    digest: str
    open: object  # () -> IO[bytes] of the (possibly compressed) layer
    size: int = 0


class Checker:
    """Validates the members of one layer, in order; the first bad one raises ``ImageError``.
    ``max_bytes`` bounds the layer's file bytes (a small compressed layer may expand to any size)."""

    def __init__(self, where: str, max_bytes: int | None = None) -> None:
        self.where = where
        self.files: set[str] = set()
        self.links: set[str] = set()
        self.parents: set[str] = set()  # the directories of ``files``
        self.size = 0
        self.max_bytes = max_bytes

    def _under_link(self, path: str, name: str, what: str = "member") -> None:
        links = self.links
        if not links:
            return
        cut = path.rfind("/")
        while cut > 0:
            if path[:cut] in links:
                raise ImageError(f"{self.where}: {what} {name!r} lies under the symlink {path[:cut]!r}")
            cut = path.rfind("/", 0, cut)

    def check(self, m: tarfile.TarInfo, name: str | None = None) -> str:
        """Judge member ``m`` (named ``name`` in its layer, if not its own name); its path,
        relative to the root ("" for the root itself)."""
        where, name = self.where, m.name if name is None else name
        path = normalise(name, where)
        if not path:
            return path
        parent, _, base = path.rpartition("/")
        self._under_link(path, name)
        if base.startswith(WHITEOUT):
            if base != OPAQUE and (base.startswith(WHITEOUT + WHITEOUT) or base == WHITEOUT):
                raise ImageError(f"{where}: member {name!r} is an unknown whiteout kind")
            return path
        if m.ischr() or m.isblk():
            raise ImageError(f"{where}: member {name!r} is a device node")
        if m.isfifo():
            raise ImageError(f"{where}: member {name!r} is a FIFO")
        if m.issym():
            if _escapes(parent, m.linkname):
                raise ImageError(f"{where}: symlink {name!r} -> {m.linkname!r} points out of the image")
            self.links.add(path)
        elif m.islnk():
            target = normalise(m.linkname, where)
            if target not in self.files:
                raise ImageError(f"{where}: hard link {name!r} -> {m.linkname!r} names no earlier file of its layer")
            # the link is made by path: a directory of the target's path replaced by a symlink
            # since would send it out of the layer
            self._under_link(target, m.linkname, "hard link target")
        elif m.isreg():
            self.size += m.size
            if self.max_bytes is not None and self.size > self.max_bytes:
                raise ImageError(f"{where}: its files hold more than {self.max_bytes} bytes (the limit)")
        elif not m.isdir():
            raise ImageError(f"{where}: member {name!r} has an unsupported type {m.type!r}")
        if not m.isdir() and path in self.parents:  # a directory replaced: no hard link may name its files
            prefix = path + "/"
            self.files = {f for f in self.files if not f.startswith(prefix)}
            self.parents = {p for p in self.parents if not p.startswith(prefix)}
            self.parents.discard(path)
        if not m.issym():
            self.links.discard(path)
        if m.isreg() or m.islnk():
            self.files.add(path)
            while parent and parent not in self.parents:
                self.parents.add(parent)
                parent = posixpath.dirname(parent)
        else:
            self.files.discard(path)
        return path


def _members(stream: IO[bytes], where: str, each) -> tuple[str, int]:
    """Read a whole (possibly compressed) layer tar, calling ``each(tar, member)`` for each
    member; (sha256 of the uncompressed tar, its length). Decoding errors are ``ImageError``s
    naming the layer; ``each``'s own errors pass as they are."""
    inflated = Inflated(stream.read)
    try:
        tar = TarStream(inflated)
        for m in tar:
            each(tar, m)
        for _ in inflated:  # the tar's trailing padding is part of its identity
            pass
    except BadLayer as e:
        raise ImageError(f"{where}: {e}") from None
    except (tarfile.TarError, EOFError) as e:  # reading the layer out of an archive
        raise ImageError(f"{where}: not a readable tar (truncated or corrupt: {e})") from None
    finally:
        inflated.close()
    if inflated.count % 512:
        raise ImageError(f"{where}: not a readable tar (truncated or corrupt: it ends inside a block)")
    return inflated.digest(), inflated.count


def check_layer(stream: IO[bytes], where: str) -> tuple[str, int]:
    """Read a whole layer tar; raise ``ImageError`` on the first bad member. Returns
    (sha256 of the uncompressed tar, total file bytes)."""
    checker = Checker(where)
    digest, _ = _members(stream, where, lambda tar, m: checker.check(m))
    return digest, checker.size


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class Unpacker:
    """Writes validated members into the fresh directory ``dest`` in overlayfs' format.

    ``dest`` starts empty, so a path this unpacker has not made does not exist: a member there is
    created with no look first, and a file gets its ownership, mode and mtime through its open
    descriptor (the layer's files are the bulk of a pull's system calls). A path made before (a
    later member replacing an earlier one) is looked at and removed first."""

    def __init__(self, dest: Path | str, where: str) -> None:
        self.dest, self.where = str(dest), where
        self.dirs: list[tuple[str, tarfile.TarInfo]] = []
        self.made: set[str] = set()  # the paths this unpacker created (with their parent directories)
        self.owner = (os.geteuid(), os.getegid())
        self.umask = _umask()

    def _parent(self, parent: str) -> None:
        if parent == self.dest or parent in self.made:
            return
        os.makedirs(parent, exist_ok=True)
        while parent != self.dest and parent not in self.made:
            self.made.add(parent)
            parent = os.path.dirname(parent)

    def add(self, tar: "tarfile.TarFile | TarStream", m: tarfile.TarInfo, name: str | None = None,
            path: str | None = None) -> None:
        """Write member ``m`` of ``tar`` (named ``name`` in its layer, if not its own name;
        ``path``: that name as ``Checker.check`` normalised it, if it did)."""
        rel = path if path is not None else normalise(m.name if name is None else name, self.where)
        if not rel:
            return
        full = self.dest + "/" + rel  # ``rel`` is normalised: no empty, "." or ".." parts
        parent, _, base = full.rpartition("/")
        self._parent(parent)
        if base == OPAQUE:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            return
        if base.startswith(WHITEOUT):
            target = os.path.join(parent, base[len(WHITEOUT):])
            if target in self.made:
                self._forget(target)
                _remove(target)
            os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            self.made.add(target)
            return
        again = full in self.made
        self.made.add(full)
        if m.isdir():
            if not again:
                os.mkdir(full, 0o700)
            else:
                if os.path.lexists(full) and not _is_real_dir(full):  # a symlink to a directory is replaced too
                    _remove(full)
                os.makedirs(full, exist_ok=True)
            self.dirs.append((full, m))
            return
        if again:
            self._forget(full)
            _remove(full)
        if m.issym():
            os.symlink(m.linkname, full)
        elif m.islnk():
            os.link(os.path.join(self.dest, normalise(m.linkname, self.where)), full, follow_symlinks=False)
            return  # shares the target's inode, ownership and mode
        else:
            self._file(tar, m, full)
            return
        _attrs(full, m, self.owner)

    def _file(self, tar: "tarfile.TarFile | TarStream", m: tarfile.TarInfo, full: str) -> None:
        mode = m.mode & 0o7777
        # created with its mode where the umask keeps it (setuid and setgid bits are set after the owner)
        plain = not mode & 0o7000 and not mode & self.umask
        if isinstance(tar, TarStream):  # the data as slices of the stream's chunks
            pieces = tar.data()
        else:
            src = tar.extractfile(m)
            pieces = iter(lambda: src.read(1 << 20), b"")
        _write_file(full, pieces, mode, plain, m.uid, m.gid, m.mtime, self.owner)

    def _forget(self, full: str) -> None:
        """A directory about to be replaced: its modes are not applied at the end (a symlink may
        stand on its path by then, and chmod follows one)."""
        if self.dirs and _is_real_dir(full):
            prefix = full + "/"
            self.dirs = [(d, m) for d, m in self.dirs if d != full and not d.startswith(prefix)]

    def finish(self) -> None:
        for full, m in reversed(self.dirs):  # deepest first: a read-only directory is filled before it closes
            if _is_real_dir(full):  # not one a later member replaced (chmod would follow a symlink there)
                _attrs(full, m, self.owner)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_file(full: str, pieces, mode: int, plain: bool, uid: int, gid: int, mtime: float,
                owner: tuple[int, int]) -> None:
    """Create the file ``full`` (it does not exist) with the data ``pieces``, then its owner,
    mode (unless ``plain``: created with it) and mtime, all through its descriptor."""
    fd = os.open(full, _CREATE, mode if plain else 0o600)
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view):]
        if (uid, gid) != owner:
            os.fchown(fd, uid, gid)
            plain = False  # a new owner clears setuid/setgid bits: the mode is written after it
        if not plain:
            os.fchmod(fd, mode)
        os.utime(fd, (mtime, mtime))
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it for every thread)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o777  # unknown: every mode is written explicitly


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def check_and_unpack(stream: IO[bytes], dest: Path, where: str, max_bytes: int | None) -> tuple[str, int]:
    """Check each member, then write it into the fresh directory ``dest``, in one pass (a
    member's checks depend only on the members before it). Returns (sha256 of the uncompressed
    tar, file bytes); the caller discards ``dest`` if this raises."""
    checker = Checker(where, max_bytes)
    unpacker = Unpacker(dest, where)
    digest, _ = _members(stream, where, lambda tar, m: unpacker.add(tar, m, path=checker.check(m)))
    unpacker.finish()
    return digest, checker.size


def unpack_child() -> None:
    """A pull's unpacking process (``registry/unpackproc``): the layer's bytes on stdin, checked
    and unpacked into ``argv[1]`` (a hidden directory the parent made and places; at most
    ``argv[3]`` file bytes); one JSON line on stdout: the digest and file bytes, or the error
    naming the layer (``argv[2]``), with ``infra`` where it is ours (the disk), not the layer's."""
    import sys

    class Stdin:
        def read(self, n: int = -1) -> bytes:
            return os.read(0, n if n > 0 else 1 << 20)

    dest, where, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        digest, size = check_and_unpack(Stdin(), Path(dest), where, None if max_bytes < 0 else max_bytes)
        answer: dict = {"digest": digest, "size": size}
    except ImageError as e:  # the layer's
        answer = {"error": str(e), "infra": e.infra}
    except OSError as e:  # the disk's (full, read-only), not the layer's
        answer = {"error": f"{where}: cannot unpack: {e}", "infra": True}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def remove_dead_temps(directory: Path, prefix: str) -> int:
    """Delete ``directory/<prefix><pid>-*`` left by processes that are gone (a pull or import
    killed part way); returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove(os.path.join(directory, name))
            removed += 1
    return removed


UNPACKING = ".unpack-"  # + pid + "-": a layer being unpacked, renamed into place once whole


def unpack_checked(stream: IO[bytes], dest: Path, where: str) -> None:
    """Unpack a validated layer into the fresh directory ``dest``."""
    unpacker = Unpacker(dest, where)
    _members(stream, where, unpacker.add)
    unpacker.finish()


def syncfs(path: Path | str) -> None:
    """Write the dirty data of ``path``'s file system to its disk (``syncfs``: that file system
    alone, where ``os.sync`` flushes them all; one call instead of an fsync per file and
    directory of a layer)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc_syncfs is None or _libc_syncfs(fd) != 0:
            os.sync()  # no syncfs here, or it failed: every file system, as a last resort
    finally:
        os.close(fd)


def _load_syncfs():
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_libc_syncfs = _load_syncfs()


def _attrs(full: str, m: tarfile.TarInfo, owner: tuple[int, int] | None = None) -> None:
    """Owner (unless it is ``owner``, the one it was made with), mode and mtime of an entry."""
    if (m.uid, m.gid) != owner:
        os.lchown(full, m.uid, m.gid)
    if not m.issym():
        os.chmod(full, m.mode & 0o7777)
    os.utime(full, (m.mtime, m.mtime), follow_symlinks=False)
