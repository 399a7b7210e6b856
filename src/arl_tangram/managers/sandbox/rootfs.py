"""A sandbox's root filesystem from an image: read-only layers under a private writable layer.

Mounted on the host side, in a private run directory, and bound into bubblewrap as ``/``
(Debian's bubblewrap 0.8 has no ``--overlay``): a size-limited tmpfs holds the writable layer
(``upper``) and overlayfs' work directory; the lower directories are, top first, the session's
frozen layers (made by forks and restores), a small base layer with the mount points the sandbox
needs, and the image's layers from the cache. Mounting from the host keeps every layer reachable
for fork and snapshot; mounting inside a mount namespace would hide them.

Mounts are made with ``mount(2)`` through ctypes: the ``mount`` program costs a fork and an exec
(about 2 ms each), which would dominate a fork into eight children.

A ``Layer`` is reference counted: a frozen session layer (its tmpfs remounted read-only) lives
until the last root filesystem stacked on it is released. Image layers belong to the cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import stat
import struct
import threading
from dataclasses import dataclass, field

from .images import Image, ImageStore, resolve_in

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

#: the built-in image of default sessions: what a default sandbox sees today (the host's system
#: directories, bound read-only by bubblewrap as for one-shots) with only the workspace layered: a
#: ``RootFs`` of it is an overlay of an empty directory under the session's tmpfs, bound as
#: ``/workspace``, so a default session forks, snapshots and restores as an image session does.
#: Its name is not a valid image name (``core.names``), so no imported image can take it.
HOST_IMAGE = Image(name="@host", id="host-workspace/1", layers=())

BASE_DIRS = ("proc", "dev", "tmp", "sys", "workspace", "run/tangram/host")
BASE_FILES = ("run/tangram/runner.py", "run/tangram/shell.py")
HOST_ROOT = "/run/tangram/host"


class MountError(OSError):
    pass


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data is not None else None) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"mount {fstype or ''} on {target}: {os.strerror(err)}")


def umount(target: str) -> None:
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not mounted; ENOENT: gone
            raise MountError(err, f"umount {target}: {os.strerror(err)}")


# the new mount API, for overlays whose options do not fit in one page (many layers, long paths)
_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_MOVE_MOUNT = 430, 431, 432, 429
FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 1, 6
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
MOVE_MOUNT_F_EMPTY_PATH = 0x4
OPTIONS_MAX = 4000  # mount(2) takes one page of options


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{what}: {os.strerror(err)}")
    return ret


def mount_overlay(target: str, lowers: list[str], upper: str, work: str, force_api: bool = False) -> None:
    """An overlay of ``lowers`` (top first) under ``upper`` at ``target``, nosuid and nodev.
    mount(2) when the options fit in a page; else the new mount API, one ``lowerdir+`` per layer
    (Linux 6.8+), so an image's layer count and a fork chain's depth are bounded only by
    overlayfs' own limit (500 lower layers)."""
    data = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    if len(data) < OPTIONS_MAX and not force_api:
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, data)
        return
    syscall = _libc.syscall
    fd = _check(syscall(_SYS_FSOPEN, b"overlay", 0), "fsopen overlay")
    try:
        for layer in lowers:
            if ":" in layer or "," in layer:
                raise MountError(22, f"layer path {layer!r} has ':' or ','")
            _check(syscall(_SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, b"lowerdir+", layer.encode(), 0),
                   f"overlay lowerdir+ {layer} (needs Linux 6.8+ for {len(lowers)} layers)")
        _check(syscall(_SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, b"upperdir", upper.encode(), 0), "overlay upperdir")
        _check(syscall(_SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, b"workdir", work.encode(), 0), "overlay workdir")
        _check(syscall(_SYS_FSCONFIG, fd, FSCONFIG_CMD_CREATE, None, None, 0), "overlay create")
        mfd = _check(syscall(_SYS_FSMOUNT, fd, 0, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV), "fsmount overlay")
        try:
            _check(syscall(_SYS_MOVE_MOUNT, mfd, b"", -100, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
                   f"move_mount to {target}")
        finally:
            os.close(mfd)
    finally:
        os.close(fd)


def overlay_supported() -> str | None:
    """None if this process can mount overlays, else why not."""
    if os.geteuid() != 0:
        return "images need root (overlay and tmpfs mounts are made on the host)"
    try:
        with open("/proc/filesystems") as fh:
            if "overlay" not in fh.read():
                return "the kernel has no overlay filesystem"
    except OSError:
        pass
    return None


@dataclass
class Layer:
    """A read-only lower directory; when the last reference goes, ``mountpoint`` (a read-only
    tmpfs) is unmounted and its directory removed, or ``remove`` (an unpacked snapshot) deleted."""

    path: str
    mountpoint: str | None = None
    remove: str | None = None
    refs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def acquire(self) -> "Layer":
        with self._lock:
            self.refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last and self.mountpoint is not None:
            umount(self.mountpoint)
            shutil.rmtree(os.path.dirname(self.mountpoint), ignore_errors=True)
        elif last and self.remove is not None:
            shutil.rmtree(self.remove, ignore_errors=True)


def ensure_base(store: ImageStore) -> str:
    """The base layer: empty mount points for /proc, /dev, /tmp, the workspace and the runner."""
    base = store.root / "base-v1"
    if not base.is_dir():
        tmp = store.root / f".base-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for d in BASE_DIRS:
            (tmp / d).mkdir(parents=True, exist_ok=True)
        os.chmod(tmp / "tmp", 0o1777)
        for f in BASE_FILES:
            (tmp / f).touch()
        try:
            os.rename(tmp, base)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(base)


class RootFs:
    """One sandbox's root: ``lowers`` (top first) under a private tmpfs upper, merged at ``root``."""

    def __init__(self, run_dir: str, image: Image, image_dirs: list[str], base: str, session_layers: list[Layer],
                 size_bytes: int) -> None:
        self.dir = run_dir
        self.image = image
        self.image_dirs = image_dirs  # top first, like every overlay lowerdir list
        self.base = base
        self.session_layers = [layer.acquire() for layer in session_layers]
        self.size_bytes = size_bytes
        self.rw = os.path.join(run_dir, "rw")
        self.root = os.path.join(run_dir, "root")
        self.upper = os.path.join(self.rw, "upper")
        self.mounted = False
        self.released = False

    def mount(self) -> "RootFs":
        os.makedirs(self.rw, exist_ok=True)
        os.makedirs(self.root, exist_ok=True)
        try:
            mount("tmpfs", self.rw, "tmpfs", MS_NOSUID | MS_NODEV, f"size={self.size_bytes},mode=0755")
            # the host image's overlay is the workspace itself: as writable for the sandbox's user
            # as the plain sandbox's workspace tmpfs (mode 0777)
            os.mkdir(self.upper, 0o755)
            if self.workspace_only:
                os.chmod(self.upper, 0o777)
            os.mkdir(os.path.join(self.rw, "work"), 0o700)
            mount_overlay(self.root, [layer.path for layer in self.session_layers] + [self.base] + self.image_dirs,
                          self.upper, os.path.join(self.rw, "work"))
        except BaseException:  # anything: a tmpfs mounted here must not outlive this object
            self.release()
            raise
        self.mounted = True
        return self

    @property
    def workspace_only(self) -> bool:
        """This root is a default session's layered workspace (``HOST_IMAGE``), not a whole root."""
        return self.image.name == HOST_IMAGE.name

    def freeze(self) -> Layer:
        """Turn the writable layer into a read-only shared layer (for a fork; this root's
        processes must be dead). The caller stacks new roots on ``[layer] + session_layers``,
        then calls ``release`` (which then keeps the tmpfs: the layer owns it)."""
        umount(self.root)
        mount("none", self.rw, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        layer = Layer(self.upper, self.rw)
        self.rw = ""
        return layer

    def release(self) -> None:
        """Unmount and delete this root and drop its references to shared layers; idempotent."""
        if self.released:
            return
        self.released = True
        umount(self.root)
        if self.rw:
            umount(self.rw)
        for layer in self.session_layers:
            layer.release()
        if self.rw:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            try:
                os.rmdir(self.root)
            except OSError:
                pass

    def lowers_top_first(self) -> list[str]:
        return [layer.path for layer in self.session_layers]


def elf_interpreter(path: str) -> str | None:
    """The dynamic loader an ELF executable names (PT_INTERP), or None for a static one."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            for i in range(phnum):
                fh.seek(phoff + i * phentsize)
                p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", fh.read(40))
                if p_type == 3:
                    fh.seek(p_offset)
                    return fh.read(p_filesz).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


@dataclass(frozen=True)
class Interpreter:
    """How the runner starts inside an image: the image's own python3, or the host's bound in
    read-only under /run/tangram/host and started through the host's loader (so the image's C
    library, or its lack of one, does not matter)."""

    argv: tuple[str, ...]
    host_binds: tuple[tuple[str, str], ...] = ()


def choose_interpreter(root: str, host_python: str, args: tuple[str, ...]) -> Interpreter:
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"):
        found = resolve_in(root, candidate)
        if found is not None and os.access(found, os.X_OK) and stat.S_ISREG(os.stat(found).st_mode):
            return Interpreter((candidate, *args))
    exe = os.path.realpath(host_python)
    loader = elf_interpreter(exe)
    binds = [("/usr", HOST_ROOT + "/usr")]
    for top in ("/lib", "/lib64"):
        if os.path.isdir(top) and not os.path.islink(top):
            binds.append((top, HOST_ROOT + top))

    def inside(p: str) -> str:
        real = os.path.realpath(p)
        for src, dst in binds:
            if real == src or real.startswith(src + "/"):
                return dst + real[len(src):]
        raise RuntimeError(f"interpreter: {p} is outside the host directories bound into images")

    argv = [inside(exe), *args]
    if loader is not None:
        libdirs = sorted({os.path.dirname(os.path.realpath(loader)), os.path.dirname(exe).replace("/bin", "/lib")})
        libpath = ":".join(inside(d) for d in libdirs if os.path.isdir(d))
        argv = [inside(loader), "--library-path", libpath, *argv]
    return Interpreter(tuple(argv), tuple(binds))
