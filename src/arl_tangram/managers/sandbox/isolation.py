"""How a sandbox is walled off: the command line that starts its runner.

``bwrap`` (bubblewrap) is the default: new user, pid, net, ipc, uts, cgroup and mount namespaces;
system directories read-only; a size-limited private tmpfs for the workspace and another for /tmp;
the root and /dev remounted read-only (/dev/shm is a private tmpfs); no capabilities; a clean
environment; an unprivileged uid; the runner is the PID namespace's init (``--as-pid-1``), so
nothing inside can signal it. The only writable places are ``WRITABLE`` (what a recycled sandbox
wipes). Without
bwrap, ``unshare`` gives the same namespaces with the host tree read-only and the sensitive parts
(/root, /home, the server's own tree) hidden under empty tmpfs. ``none`` runs the runner directly:
only for trusted code, and only when configured explicitly.
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

RUNNER = Path(__file__).with_name("runner.py")
SHELL = Path(__file__).with_name("shell.py")  # loaded by the runner for persistent shell steps
SYSTEM_LINKS = ("bin", "lib", "lib64", "sbin")
ETC_FILES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl", "java-17-openjdk",
             "gcc", "bash.bashrc")


# the writable places inside a bwrap sandbox and their modes (a recycled sandbox is wiped back to this)
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
    hide: tuple[str, ...] = field(default_factory=lambda: ("/root", "/home"))


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


def command(mode: Isolation, layout: Layout, probe: bool = False, workspace: str | None = None) -> list[str]:
    """The argv that starts the runner (or, with ``probe``, just checks the isolation works).
    ``workspace`` is the host directory used as workspace when there is no isolation."""
    tail = [layout.interpreter, *layout.interpreter_args, "/run/tangram/runner.py", "--reap"]
    if probe:
        tail = [layout.interpreter, "-I", "-S", "-c", "pass"]
    if mode is Isolation.BWRAP:
        return _bwrap(layout) + tail
    if mode is Isolation.UNSHARE:
        return _unshare(layout, tail)
    return [layout.interpreter, *layout.interpreter_args, str(RUNNER), "--workspace", workspace or "/tmp"]


def _bwrap(layout: Layout) -> list[str]:
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
             "--perms", "0777", "--size", str(layout.workspace_bytes), "--tmpfs", "/workspace",
             "--ro-bind", str(RUNNER), "/run/tangram/runner.py", "--ro-bind", str(SHELL), "/run/tangram/shell.py",
             "--remount-ro", "/", "--chdir", "/workspace", "--clearenv",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
             "--setenv", "LANG", "C.UTF-8"]
    return argv


def _unshare(layout: Layout, tail: list[str]) -> list[str]:
    """Namespaces by unshare(1); the mount setup runs as root of the new user namespace."""
    project = str(Path(__file__).resolve().parents[4])
    hide = " ".join(f"mount -t tmpfs -o size=4k,mode=000 none {p} 2>/dev/null;" for p in (*layout.hide, project)
                    if os.path.isdir(p))
    script = (
        f"mount -t tmpfs -o size=1m none /opt && cp {RUNNER} {SHELL} /opt/ && mount -o remount,ro /opt && "
        f"mkdir -p /tmp/.tangram-ws-$$ && mount -t tmpfs -o size={layout.workspace_bytes},mode=0777 none "
        f"/tmp/.tangram-ws-$$ && mount --bind /tmp/.tangram-ws-$$ /mnt && "
        f"mount -t tmpfs -o size={layout.tmp_bytes},mode=1777 none /tmp && {hide} "
        f"mount -o remount,bind,ro / 2>/dev/null; cd /mnt && "
        "exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/mnt LANG=C.UTF-8 \"$@\"")
    runner = [a.replace("/run/tangram/runner.py", "/opt/runner.py") for a in tail]
    if "--reap" in runner:
        runner += ["--workspace", "/mnt"]
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc", "--net",
            "--ipc", "--uts", "--mount", "--", "sh", "-c", script, "sh", *runner]
