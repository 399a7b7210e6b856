"""The agent compiled for an image's own interpreter, so that its sandboxes start it compiled.

An image sandbox runs the agent with the image's python (its packages are the user's). The
host's compiled copy of the agent (``isolation.compile_runner``) is for the host's interpreter;
where the image's is another version, every sandbox of the image would compile the agent's
modules at its start: tens of milliseconds of a cold start. So the agent is compiled once per
image, by the image's own interpreter, in a sandbox of the image (no capabilities, an
unprivileged uid, a fresh root, the agent's sources read-only, only the output directory
writable), and kept in the store (``agents/<image id>-<sources>/``): the sandboxes of that image,
and of no other, bind it over the agent's ``__pycache__`` read-only.

Compiled by the image's code, the files are as trustworthy as the image, which already chooses
the interpreter they run in; what comes out is kept only where it is a ``.pyc`` named after one
of the agent's modules, owned by root and read-only from then on.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .images import remove_dead_temps
from .isolation import INSIDE, compile_runner

AGENTS = "agents"
TEMP = ".compile-"  # + pid + "-": a compilation under way


@lru_cache(maxsize=1)
def sources_key() -> str:
    """What identifies the agent's sources: their names, sizes and modification times."""
    h = hashlib.sha256()
    for p in sorted(INSIDE.glob("*.py")):
        st = p.stat()
        h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def cache_dir(store_root: Path, image_id: str) -> Path:
    return store_root / AGENTS / f"{image_id[:32]}-{sources_key()}"


def ready(store_root: Path, image_id: str) -> str | None:
    """The compiled agent for ``image_id`` if it is in the store."""
    d = cache_dir(store_root, image_id)
    return str(d) if d.is_dir() else None


def compile_for(store_root: Path, image_id: str, sandbox: Callable[[str], list[str]]) -> str | None:
    """Compile the agent for ``image_id``: ``sandbox(out)`` is the argv prefix that runs a command
    in a fresh sandbox of the image with the host directory ``out`` bound writable at its own
    path and the agent's sources read-only at theirs, ending with the image's interpreter and
    its arguments. The directory made, or None when the image's interpreter could not."""
    agents = store_root / AGENTS
    agents.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(agents, TEMP)
    tmp = agents / f"{TEMP}{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir(mode=0o755)  # ours: the sandbox's user is this process's user in its user namespace
    try:
        argv = sandbox(str(tmp))
        if not compile_runner(argv[0], tuple(argv[1:]), str(tmp)):
            return None
        modules = {p.stem for p in INSIDE.glob("*.py")}
        for entry in os.scandir(tmp):
            st = entry.stat(follow_symlinks=False)
            module, _, rest = entry.name.partition(".")
            if not stat.S_ISREG(st.st_mode) or module not in modules or not rest.endswith(".pyc") \
                    or rest.count(".") != 1:
                _remove(entry.path)
                continue
            os.chmod(entry.path, 0o644)  # a regular file (checked above): no link to follow
        final = cache_dir(store_root, image_id)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # another process compiled it first: the same files
        return str(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune(store_root: Path, image_ids: set[str]) -> int:
    """Remove the compiled agents of images the store no longer has, and of older sources."""
    agents = store_root / AGENTS
    removed = remove_dead_temps(agents, TEMP)
    keep = {f"{i[:32]}-{sources_key()}" for i in image_ids}
    for entry in (os.scandir(agents) if agents.is_dir() else ()):
        if not entry.name.startswith(".") and entry.name not in keep:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)
