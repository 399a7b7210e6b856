"""Sandboxes whose root is an image: spawning them, prewarmed pools per image, and cleanup.

Same isolation as the host-directories sandbox (bubblewrap: every namespace, no capabilities,
an unprivileged uid, cgroup limits, a private size-limited /tmp), but the root is the image's
overlay (``rootfs.RootFs``) bound in writable: the writes land in the sandbox's own tmpfs layer,
limited to ``workspace_mb``, and never reach the image or another sandbox.

Prewarmed sandboxes wait per image; the total of idle sandboxes (the default warm pool included)
never exceeds ``max_idle_sandboxes``: a prewarm asking for more gets what fits and says so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

from . import agentpyc
from .cgroups import CgroupRoot
from .images import Image, ImageError, ImageStore
from .isolation import BOOT, HOME_ALIAS, INSIDE, PYCACHE, Isolation, Layout, command
from .rootfs import (HOST_IMAGE, Interpreter, Layer, RootFs, choose_interpreter, ensure_base, overlay_supported,
                     umount)
from .sandbox import Limits, Sandbox, SandboxDied

log = logging.getLogger(__name__)
_IDS = itertools.count()


def bwrap_argv(layout: Layout, root: str, interp: Interpreter, pycache: str | None = None) -> list[str]:
    """The sandbox on the mounted ``root``; ``pycache``: the agent compiled by the image's own
    interpreter (``agentpyc``), bound over the package's ``__pycache__`` and started by import;
    without it the agent starts as a script (the image's python is not the one the host's
    compiled copy is for)."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(layout.uid), "--gid", str(layout.uid), "--hostname", "sandbox", "--bind", root, "/"]
    for src, dst in interp.host_binds:
        argv += ["--ro-bind", src, dst]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(layout.tmp_bytes), "--tmpfs", "/tmp",
             "--ro-bind", str(INSIDE), "/run/tangram/inside"]
    if pycache is not None:
        argv += ["--ro-bind", pycache, "/run/tangram/inside/__pycache__"]
    argv += ["--chdir", "/workspace", "--clearenv",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
             "--setenv", "LANG", "C.UTF-8"]
    tail = ["-c", BOOT] if pycache is not None else ["/run/tangram/inside/__main__.py"]
    return argv + _home_alias(root) + [*interp.argv, *tail, "--reap"]


def compile_argv(layout: Layout, root: str, interp: Interpreter, out: str, memory_bytes: int) -> list[str]:
    """A sandbox on the fresh ``root`` that compiles the agent (``agentpyc``): the agent's sources
    read-only and ``out`` writable, each at its host path; its address space capped."""
    kb = (memory_bytes + (256 << 20)) >> 10
    return ["/bin/sh", "-c", f'ulimit -v {kb}; exec "$@"', "sh",
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(layout.uid), "--gid", str(layout.uid), "--bind", root, "/", "--proc", "/proc",
            "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", str(INSIDE), str(INSIDE), "--bind", out, out,
            "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", *interp.argv]


def _home_alias(root: str) -> list[str]:
    """``HOME_ALIAS`` names the workspace in image sandboxes too: a link where the image has
    nothing there, the workspace mounted over the image's own directory where it has one
    (anything else there, or a linked parent, is left as the image has it)."""
    parent = os.path.join(root, os.path.dirname(HOME_ALIAS).lstrip("/"))
    path = os.path.join(root, HOME_ALIAS.lstrip("/"))
    if os.path.islink(parent):
        return []
    if not os.path.lexists(path):
        return ["--symlink", "/workspace", HOME_ALIAS]
    if os.path.isdir(path) and not os.path.islink(path):
        return ["--bind", os.path.join(root, "workspace"), HOME_ALIAS]
    return []


def remove_stale_roots() -> int:
    """Unmount and delete the roots left by processes that died without cleaning up (their run
    directories carry their pid); returns how many mounts were removed."""
    base = tempfile.gettempdir()
    stale: list[str] = []
    try:
        with open("/proc/self/mountinfo") as fh:
            points = [line.split()[4] for line in fh]
    except OSError:
        return 0
    dirs = set()
    for point in points:
        rel = os.path.relpath(point, base)
        head = rel.split("/", 1)[0]
        if head.startswith("tangram-roots-") and not rel.startswith(".."):
            pid = head.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                stale.append(point)
                dirs.add(os.path.join(base, head))
    for point in sorted(stale, key=len, reverse=True):  # overlays before the tmpfs under them
        try:
            umount(point)
        except OSError as e:
            log.warning("cannot unmount a stale sandbox root %s: %s", point, e)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    if stale:
        log.info("removed %d mounts left by sandboxes of dead processes", len(stale))
    return len(stale)


@dataclass
class Prewarmed:
    image: str
    requested: int
    ready: int
    idle_total: int
    cap: int
    message: str = ""


class ImageSandboxes:
    """Spawns image sandboxes for one manager and keeps its per-image idle pools."""

    def __init__(self, store: ImageStore, layout: Layout, limits: Limits, cgroups: CgroupRoot | None,
                 host_python: str, python_args: tuple[str, ...], max_idle: int) -> None:
        self.store = store
        self.layout = layout
        self.limits = limits
        self.cgroups = cgroups
        self.host_python = host_python
        self.python_args = python_args
        self.max_idle = max_idle
        self.run_dir: str | None = None
        self.pools: dict[str, list[Sandbox]] = {}
        self._interp: dict[str, Interpreter] = {}
        self._images: dict[str, Image] = {}
        self._base: str | None = None
        self._empty: str | None = None
        self._setup_lock = threading.Lock()
        self.live: set[RootFs] = set()
        #: image id -> the agent compiled by its interpreter (None: being compiled, or it could not be)
        self._agents: dict[str, str | None] = {}

    def image(self, name: str) -> Image:
        """The image ``name`` (cached: images are immutable once imported)."""
        if name == HOST_IMAGE.name:
            return HOST_IMAGE
        img = self._images.get(name)
        if img is None:
            img = self._images[name] = self.store.get(name)
        return img

    def forget(self, name: str) -> None:
        """``name`` is being removed from the store (the disk budget): looked up afresh next time."""
        self._images.pop(name, None)

    def _setup(self) -> None:
        """Once, from whichever thread mounts the first root. Locked, and ``run_dir`` is set last:
        two first spawns at once (the sessions' warm pool starts two) once let one thread see
        ``run_dir`` set but the base layers not yet, mount a root on ``None`` and leak its tmpfs."""
        with self._setup_lock:
            if self.run_dir is not None:
                return
            why = overlay_supported()
            if why is not None:
                raise ImageError(f"image: {why}")
            remove_stale_roots()
            run_dir = tempfile.mkdtemp(prefix=f"tangram-roots-{os.getpid()}-")
            self._base = ensure_base(self.store)
            self._empty = os.path.join(run_dir, "empty")  # the host image's only lower layer
            os.mkdir(self._empty)
            self.run_dir = run_dir

    def scratch_dir(self, name: str) -> str:
        """A new directory ``name`` beside the mounted roots (a restore unpacks there)."""
        self._setup()
        path = os.path.join(self.run_dir, name)
        os.makedirs(path)
        return path

    async def stop_processes(self, sb: Sandbox) -> RootFs:
        """Kill ``sb``'s processes but keep its root mounted, no longer one of the live roots:
        the caller owns it now (a fork stacks new roots on it)."""
        rootfs = sb.rootfs
        sb.on_kill = None
        await sb.kill()
        self.live.discard(rootfs)
        return rootfs

    def new_root(self, image: Image, session_layers: list[Layer] = ()) -> RootFs:
        """Mount a fresh root of ``image`` (on ``session_layers``, top first)."""
        self._setup()
        d = os.path.join(self.run_dir, f"r{next(_IDS)}")
        os.mkdir(d)
        host = image.name == HOST_IMAGE.name
        rootfs = RootFs(d, image, [str(p) for p in reversed(image.layer_dirs(self.store))],
                        self._empty if host else self._base, list(session_layers),
                        self.layout.workspace_bytes).mount()
        self.live.add(rootfs)
        return rootfs

    def interpreter(self, image: Image, root: str) -> Interpreter:
        it = self._interp.get(image.id)
        if it is None:
            it = self._interp[image.id] = choose_interpreter(root, self.host_python, self.python_args)
        return it

    def agent_pycache(self, image: Image, interp: Interpreter) -> str | None:
        """The agent compiled by ``image``'s own interpreter, if it is in the store; the first
        ask starts its compilation in the background (the sandboxes started meanwhile start the
        agent as a script). None for an image run by the host's interpreter: the host's
        compiled copy, or none, is the one it uses."""
        if interp.host_binds or not PYCACHE.is_dir():  # the host's python; or no mount point for one
            return None
        known = self._agents.get(image.id)
        if known is not None:
            return known
        found = agentpyc.ready(self.store.root, image.id)  # (compiled meanwhile, by us or another process)
        if found is None and image.id not in self._agents:
            threading.Thread(target=self._compile_agent, args=(image, interp), name="tangram-agentpyc",
                             daemon=True).start()
        self._agents[image.id] = found
        return found

    def _compile_agent(self, image: Image, interp: Interpreter) -> None:
        try:
            rootfs = self.new_root(image)
        except OSError as e:
            log.warning("cannot mount a root of image %s to compile the agent for it: %s", image.name, e)
            return
        try:
            made = agentpyc.compile_for(self.store.root, image.id, lambda out: compile_argv(
                self.layout, rootfs.root, interp, out, self.limits.memory_bytes or (1 << 30)))
        except OSError as e:
            log.warning("cannot compile the agent for image %s: %s", image.name, e)
            made = None
        finally:
            self.drop(rootfs)
        if made is not None:
            self._agents[image.id] = made

    async def spawn(self, image_name: str, session_layers: list[Layer] = (), rootfs: RootFs | None = None) -> Sandbox:
        """A running sandbox on a new root of ``image_name`` (or on ``rootfs``, already mounted)."""
        if rootfs is None:
            image = self.image(image_name)
            try:
                rootfs = await asyncio.to_thread(self.new_root, image, list(session_layers))
            except OSError as e:
                raise SandboxDied(f"cannot mount the root of image {image_name!r}: {e}") from None
        if rootfs.workspace_only:  # a default session: the default sandbox with this workspace
            argv = command(Isolation.BWRAP, self.layout, layered=rootfs.root)
        else:
            interp = self.interpreter(rootfs.image, rootfs.root)
            argv = bwrap_argv(self.layout, rootfs.root, interp, self.agent_pycache(rootfs.image, interp))
        sid = f"sbi-{next(_IDS)}-{os.urandom(3).hex()}"
        try:
            sb = await Sandbox.spawn(sid, argv, self.cgroups, self.limits)
        except BaseException:
            self.drop(rootfs)
            raise
        sb.rootfs = rootfs
        sb.image = None if rootfs.workspace_only else rootfs.image.name
        sb.on_kill = lambda: self.drop(rootfs)
        return sb

    def drop(self, rootfs: RootFs | None) -> None:
        if rootfs is not None:
            self.live.discard(rootfs)
            rootfs.release()

    def idle(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def take(self, image_name: str) -> Sandbox | None:
        pool = self.pools.get(image_name)
        while pool:
            sb = pool.pop()
            if not sb.dead and sb.proc.returncode is None:
                return sb
        return None

    async def prewarm(self, image_name: str, n: int, other_idle: int) -> Prewarmed:
        """Start up to ``n`` more idle sandboxes of ``image_name`` within the idle cap."""
        self.image(image_name)  # unknown image: ImageError now, not n failures later
        room = max(0, self.max_idle - other_idle - self.idle())
        want = min(n, room)
        made = await asyncio.gather(*(self.spawn(image_name) for _ in range(want)), return_exceptions=True)
        ok = [sb for sb in made if isinstance(sb, Sandbox)]
        errors = [e for e in made if isinstance(e, BaseException)]
        self.pools.setdefault(image_name, []).extend(ok)
        notes = []
        if want < n:
            notes.append(f"capped: {n - want} not started (max_idle_sandboxes {self.max_idle})")
        if errors:
            notes.append(f"{len(errors)} failed to start: {errors[0]}")
        return Prewarmed(image_name, n, len(ok), self.idle() + other_idle, self.max_idle, "; ".join(notes))

    async def shut_down(self) -> None:
        doomed = [sb for pool in self.pools.values() for sb in pool]
        self.pools.clear()
        await asyncio.gather(*(sb.kill() for sb in doomed), return_exceptions=True)
        for rootfs in list(self.live):
            self.drop(rootfs)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
