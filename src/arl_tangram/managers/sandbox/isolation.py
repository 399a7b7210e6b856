"""How a sandbox is walled off: the command line that starts its runner.

``bwrap`` (bubblewrap) is the default: new user, pid, net, ipc, uts, cgroup and mount namespaces;
system directories read-only; a size-limited private tmpfs for the workspace and another for /tmp;
the root and /dev remounted read-only (/dev/shm is a private tmpfs); no capabilities; a clean
environment; an unprivileged uid; the runner is the PID namespace's init (``--as-pid-1``), so
nothing inside can signal it. The only writable places are ``WRITABLE`` (what a recycled sandbox
wipes). Without bwrap, ``unshare`` gives the same namespaces and builds the same tree (the same
paths: the workspace is ``/workspace`` in every isolating mode) on a tmpfs it pivots into, but the
code runs as root of its user namespace. ``none`` runs the runner directly:
only for trusted code, and only when configured explicitly.
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("runner.py")
SHELL = Path(__file__).with_name("shell.py")  # loaded by the runner for persistent shell steps
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
    """What the sandbox sees. ``interpreter`` runs the runner and one-shot python; ``ro_binds``
    are host paths made visible read-only (a venv with the tasks' packages, say)."""

    interpreter: str = "/usr/bin/python3"
    interpreter_args: tuple[str, ...] = ("-I",)
    ro_binds: tuple[str, ...] = ()
    workspace_bytes: int = 256 << 20
    tmp_bytes: int = 64 << 20
    uid: int = 1000
    pycache: str | None = None  # a host directory holding the runner compiled by ``interpreter`` (``compile_runner``)


#: how the runner starts when its compiled form is there: imported (a script is compiled at every
#: start, ~9 ms of CPU of the ~28 ms a sandbox's start costs, measured on the 2-core VM), then its
#: directory leaves ``sys.path`` again (the user's code must not import it by accident)
BOOT = "import sys; sys.path.insert(0, '/run/tangram'); import runner; del sys.path[0]; runner.main()"


def compile_runner(interpreter: str, args: tuple[str, ...], into: str) -> bool:
    """Compile the runner with the sandboxes' own interpreter (its magic number, its cache tag)
    into ``into``, as the ``__pycache__`` the sandbox will look in; False when it cannot (the
    sandboxes then run it as a script, as before)."""
    script = ("import importlib.util, os, py_compile, sys; src = '/run/tangram/runner.py'; "
              "name = os.path.basename(importlib.util.cache_from_source(src)); "
              "py_compile.compile(sys.argv[1], cfile=os.path.join(sys.argv[2], name), dfile=src, doraise=True)")
    try:
        return subprocess.run([interpreter, *args, "-c", script, str(RUNNER), into], capture_output=True,
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
    """The argv that starts the runner (or, with ``probe``, just checks the isolation works).
    ``workspace`` is the host directory used as workspace when there is no isolation; ``layered``
    (bwrap only) a mounted copy-on-write workspace (``rootfs.RootFs`` of ``HOST_IMAGE``: a session's,
    so that it can fork and snapshot) bound in place of the private workspace tmpfs."""
    tail = [layout.interpreter, *layout.interpreter_args, "/run/tangram/runner.py", "--reap"]
    if mode is Isolation.BWRAP and layout.pycache is not None:
        tail = [layout.interpreter, *layout.interpreter_args, "-c", BOOT, "--reap"]
    if layered:  # a session's sandbox: its runner makes no zygote for one-shots (runner.SESSION)
        tail.append("--session")
    if probe:
        tail = [layout.interpreter, "-I", "-S", "-c", "pass"]
    if mode is Isolation.BWRAP:
        return _bwrap(layout, layered) + tail
    if mode is Isolation.UNSHARE:
        return _unshare(layout, tail)
    return [layout.interpreter, *layout.interpreter_args, str(RUNNER), "--workspace", workspace or "/tmp"]


def _bwrap(layout: Layout, layered: str | None = None) -> list[str]:
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
             "--ro-bind", str(RUNNER), "/run/tangram/runner.py", "--ro-bind", str(SHELL), "/run/tangram/shell.py",
             *(("--ro-bind", layout.pycache, "/run/tangram/__pycache__") if layout.pycache else ()),
             "--remount-ro", "/", "--chdir", "/workspace", "--clearenv",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
             "--setenv", "LANG", "C.UTF-8"]
    return argv


def _unshare(layout: Layout, tail: list[str]) -> list[str]:
    """Namespaces by unshare(1): the mount setup runs as root of the new user namespace and builds
    the same tree as bubblewrap's (read-only system directories, the chosen /etc files, private
    /tmp, /dev/shm and /workspace tmpfs, the runner at /run/tangram) on a tmpfs, then pivots into
    it, so a program sees the same paths in both modes and nothing of the host beyond them."""
    size_tmp, size_ws = layout.tmp_bytes, layout.workspace_bytes
    steps = ["set -e", "mount -t tmpfs -o size=8m,mode=755 none /mnt", "cd /mnt",
             f"mkdir -p usr etc proc dev/shm tmp workspace run/tangram .old {os.path.dirname(HOME_ALIAS)[1:]}",
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
              f"cp {RUNNER} {SHELL} run/tangram/",
              "pivot_root . .old", "umount -l /.old", "rmdir /.old", "mount -o remount,ro,bind /",
              "cd /workspace",
              'exec /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/workspace LANG=C.UTF-8 "$@"']
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts",
            "--mount", "--", "sh", "-c", "\n".join(steps), "sh", *tail]
