"""How a sandbox is walled off: the command line that starts its agent (the ``inside`` package).

``bwrap`` (bubblewrap) is the default: new user, pid, net, ipc, uts, cgroup and mount namespaces;
system directories read-only; a size-limited private tmpfs for the workspace and another for /tmp;
the root and /dev remounted read-only (/dev/shm is a private tmpfs); no capabilities; a clean
environment; an unprivileged uid; the agent is the PID namespace's init (``--as-pid-1``), so
nothing inside can signal it. The only writable places are ``WRITABLE`` (what a recycled sandbox
wipes). Without bwrap, ``unshare`` gives the same namespaces and builds the same tree (the same
paths: the workspace is ``/workspace`` in every isolating mode) on a tmpfs it pivots into, but the
code runs as root of its user namespace. ``none`` runs the agent directly:
only for trusted code, and only when configured explicitly.
"""

from __future__ import annotations

import enum
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: the agent's package, bound read-only at ``/run/tangram/inside`` in every sandbox (its directory
#: name is the name it is imported by there); started by ``ENTRY`` as a script, or by ``BOOT``
INSIDE = Path(__file__).with_name("inside")
ENTRY = INSIDE / "__main__.py"
#: the package's ``__pycache__``: where the copy compiled for the sandboxes' interpreter is bound
#: (``compile_runner``), over whatever the host's own imports left there
PYCACHE = INSIDE / "__pycache__"
SYSTEM_LINKS = ("bin", "lib", "lib64", "sbin")
ETC_FILES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl", "java-17-openjdk",
             "gcc", "bash.bashrc")


# the writable places inside a bwrap sandbox and their modes (a recycled sandbox is wiped back to this)
#: the workspace's second name: E2B's clients (server/e2b) expect their files and cwd under it
HOME_ALIAS = "/home/user"
WRITABLE = {"/workspace": 0o777, "/tmp": 0o1777, "/dev/shm": 0o1777}


class Isolation(str, enum.Enum):
    AUTO = "auto"
    BWRAP = "bwrap"
    UNSHARE = "unshare"
    NONE = "none"


class IsolationUnavailable(RuntimeError):
    """Neither bubblewrap nor unshare works here and ``none`` was not configured."""


@dataclass(frozen=True)
class Layout:
    """What the sandbox sees. ``interpreter`` runs the agent and one-shot python; ``ro_binds``
    are host paths made visible read-only (a venv with the tasks' packages, say)."""

    interpreter: str = "/usr/bin/python3"
    interpreter_args: tuple[str, ...] = ("-I",)
    ro_binds: tuple[str, ...] = ()
    workspace_bytes: int = 256 << 20
    tmp_bytes: int = 64 << 20
    uid: int = 1000
    pycache: str | None = None  # a host directory holding the agent compiled by ``interpreter`` (``compile_runner``)


#: how the agent starts when its compiled form is there: imported (a script's modules would be
#: compiled at every start, a large part of a sandbox's start-up), then its directory leaves
#: ``sys.path`` again (the user's code must not import it by accident)
BOOT = "import sys; sys.path.insert(0, '/run/tangram'); from inside import loop; del sys.path[0]; loop.main()"


def compile_runner(interpreter: str, args: tuple[str, ...], into: str) -> bool:
    """Compile the agent's modules with the sandboxes' own interpreter (its magic number, its
    cache tag) into ``into``, as the ``__pycache__`` the sandbox will look in (``PYCACHE``, made
    here if the host never imported the package: it is the mount point); False when it cannot
    (the sandboxes then start it as a script)."""
    script = ("import importlib.util, os, py_compile, sys\n"
              "for src in sys.argv[2:]:\n"
              "    name = os.path.basename(src)\n"
              "    cfile = os.path.join(sys.argv[1], os.path.basename(importlib.util.cache_from_source(src)))\n"
              "    py_compile.compile(src, cfile=cfile, dfile='/run/tangram/inside/' + name, doraise=True)")
    sources = sorted(str(p) for p in INSIDE.glob("*.py") if p.name != "__main__.py")
    try:
        PYCACHE.mkdir(exist_ok=True)
        return subprocess.run([interpreter, *args, "-c", script, into, *sources], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _works(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def detect(preferred: Isolation, layout: Layout) -> Isolation:
    """The isolation to use; raises ``IsolationUnavailable`` rather than silently running hostile
    code unconfined."""
    if preferred is Isolation.NONE:
        return Isolation.NONE
    tried = []
    for mode in ((Isolation.BWRAP, Isolation.UNSHARE) if preferred is Isolation.AUTO else (preferred,)):
        exe = shutil.which(mode.value)
        if exe and _works(command(mode, layout, probe=True)):
            return mode
        tried.append(f"{mode.value}: {'not installed' if not exe else 'cannot create namespaces here'}")
    raise IsolationUnavailable(
        "no sandbox isolation works on this host (" + "; ".join(tried) + "). Install bubblewrap "
        "(apt-get install -y bubblewrap), or set isolation: none to run trusted code unconfined.")


def command(mode: Isolation, layout: Layout, probe: bool = False, workspace: str | None = None,
            layered: str | None = None) -> list[str]:
    """The argv that starts the agent (or, with ``probe``, just checks the isolation works).
    ``workspace`` is the host directory used as workspace when there is no isolation; ``layered``
    (bwrap only) a mounted copy-on-write workspace (``rootfs.RootFs`` of ``HOST_IMAGE``: a session's,
    so that it can fork and snapshot) bound in place of the private workspace tmpfs."""
    compiled = mode is Isolation.BWRAP and _compiled(layout)
    tail = [layout.interpreter, *layout.interpreter_args, "/run/tangram/inside/__main__.py", "--reap"]
    if compiled:
        tail = [layout.interpreter, *layout.interpreter_args, "-c", BOOT, "--reap"]
    if layered:  # a session's sandbox: its zygote forks session interpreters, not one-shots (``State.session``)
        tail.append("--session")
    if probe:
        tail = [layout.interpreter, "-I", "-S", "-c", "pass"]
    if mode is Isolation.BWRAP:
        return _bwrap(layout, layered, compiled) + tail
    if mode is Isolation.UNSHARE:
        return _unshare(layout, tail)
    return [layout.interpreter, *layout.interpreter_args, str(ENTRY), "--workspace", workspace or "/tmp"]


def _compiled(layout: Layout) -> bool:
    """The compiled copy is there and so is its mount point (a host's cleaning may remove an
    empty ``__pycache__`` while the server runs: then the agent starts as a script)."""
    return layout.pycache is not None and PYCACHE.is_dir()


def _bwrap(layout: Layout, layered: str | None = None, compiled: bool = False) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(layout.uid), "--gid", str(layout.uid), "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{name}"]
    for name in ETC_FILES:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for path in layout.ro_binds:
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(layout.tmp_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--perms", "1777", "--size", str(layout.tmp_bytes), "--tmpfs", "/tmp",
             *(["--bind", layered, "/workspace"] if layered else
               ["--perms", "0777", "--size", str(layout.workspace_bytes), "--tmpfs", "/workspace"]),
             "--symlink", "/workspace", HOME_ALIAS,
             "--ro-bind", str(INSIDE), "/run/tangram/inside",
             *(("--ro-bind", layout.pycache, "/run/tangram/inside/__pycache__") if compiled else ()),
             "--remount-ro", "/", "--chdir", "/workspace", "--clearenv",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
             "--setenv", "LANG", "C.UTF-8"]
    return argv


def _unshare(layout: Layout, tail: list[str]) -> list[str]:
    """Namespaces by unshare(1): the mount setup runs as root of the new user namespace and builds
    the same tree as bubblewrap's (read-only system directories, the chosen /etc files, private
    /tmp, /dev/shm and /workspace tmpfs, the agent at /run/tangram/inside) on a tmpfs, then pivots into
    it, so a program sees the same paths in both modes and nothing of the host beyond them."""
    size_tmp, size_ws = layout.tmp_bytes, layout.workspace_bytes
    steps = ["set -e", "mount -t tmpfs -o size=8m,mode=755 none /mnt", "cd /mnt",
             f"mkdir -p usr etc proc dev/shm tmp workspace run/tangram/inside .old {os.path.dirname(HOME_ALIAS)[1:]}",
             f"ln -s /workspace {HOME_ALIAS[1:]}",
             "mount --rbind /usr usr", "mount -o remount,bind,ro usr"]
    for name in SYSTEM_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            steps.append(f"ln -s {os.readlink(host)} {name}")
        elif host.is_dir():
            steps += [f"mkdir {name}", f"mount --rbind /{name} {name}", f"mount -o remount,bind,ro {name}"]
    for name in ETC_FILES:
        host = Path("/etc") / name
        if host.exists():
            steps += [f"mkdir -p etc/{name}" if host.is_dir() else f"touch etc/{name}",
                      f"mount --rbind /etc/{name} etc/{name}", f"mount -o remount,bind,ro etc/{name}"]
    for path in layout.ro_binds:
        steps += [f"mkdir -p .{path}", f"mount --rbind {path} .{path}", f"mount -o remount,bind,ro .{path}"]
    for dev in ("null", "zero", "full", "random", "urandom", "tty"):
        steps += [f"touch dev/{dev}", f"mount --bind /dev/{dev} dev/{dev}"]
    steps += ["ln -s /proc/self/fd dev/fd", "ln -s /proc/self/fd/0 dev/stdin", "ln -s /proc/self/fd/1 dev/stdout",
              "ln -s /proc/self/fd/2 dev/stderr",
              f"mount -t tmpfs -o size={size_tmp},mode=1777 none dev/shm",
              f"mount -t tmpfs -o size={size_tmp},mode=1777 none tmp",
              f"mount -t tmpfs -o size={size_ws},mode=0777 none workspace",
              "mount -t proc proc proc",
              f"cp {shlex.quote(str(INSIDE))}/*.py run/tangram/inside/",
              "pivot_root . .old", "umount -l /.old", "rmdir /.old", "mount -o remount,ro,bind /",
              "cd /workspace",
              'exec /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/workspace LANG=C.UTF-8 "$@"']
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts",
            "--mount", "--", "sh", "-c", "\n".join(steps), "sh", *tail]
