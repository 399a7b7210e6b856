"""Which build of the scheduler's hot path this process runs, and the switch to the other one.

``setup.py`` compiles the modules of ``HOT_PATH`` with mypyc where it can. Their sources stay the
one truth and run as they are wherever the compiled modules are absent, or when
``ARL_TANGRAM_PURE=1`` is set before ``arl_tangram`` is first imported: then ``use_sources``
(called by the package's ``__init__``) makes Python import this package's ``.py`` files even where
a compiled module sits beside them. The package does the same, with a warning, in a checkout whose
compiled modules are older than their sources (``stale``), so an edit or a pull is never shadowed
by an older build. ``tangram bench scheduler`` measures both builds in one run
that way, and a test checks that they decide the same.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

PACKAGE = __name__.rpartition(".")[0]
ROOT = Path(__file__).resolve().parent

#: the modules one action passes through from submit to finish, compiled by ``setup.py``
HOT_PATH = ("core/action", "core/clock", "core/cluster", "core/pools", "core/records", "policy/base",
            "policy/queues", "policy/predictor", "policy/critical", "policy/action_level", "waits", "engine")


#: the plain modules that compiled ones import: compiled against them, so an edit to one makes the
#: build stale too (mypyc checks the types it was told at the boundary; ``tests/test_layers.py``
#: keeps this list equal to what ``HOT_PATH`` imports)
HOT_PATH_IMPORTS = ("core/errors", "core/seam")


def pure_requested() -> bool:
    return os.environ.get("ARL_TANGRAM_PURE", "") not in ("", "0")


class _Sources(importlib.abc.MetaPathFinder):
    """Finds this package's modules as ``.py`` files (the default finder prefers an extension
    module of the same name)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + ".") or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, leaf + ".py")
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def use_sources() -> None:
    """Import this package's modules from their sources from now on (before any is imported)."""
    if not any(isinstance(f, _Sources) for f in sys.meta_path):
        sys.meta_path.insert(0, _Sources())


def compiled() -> bool:
    """True when the engine (and the rest of ``HOT_PATH``) was imported as a compiled module."""
    from . import engine

    return any(str(engine.__file__).endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)


def stale() -> list[str]:
    """Sources that the compiled modules do not match: one whose compiled module Python would
    import instead of it, wrongly (edited after it was built: an editable install not rebuilt
    since; or no longer in ``HOT_PATH``: a module left over from an older build), and a plain
    module of ``HOT_PATH_IMPORTS`` edited after a compiled module was built against it. Only a
    source checkout (``setup.py`` two folders up) can be stale: an installed wheel's files all
    come from one build, whatever their times."""
    if not (ROOT.parent.parent / "setup.py").exists():
        return []
    out = []
    oldest: float | None = None
    for built in sorted(ROOT.rglob("*")):
        if built.suffix not in (".so", ".pyd"):
            continue
        name = built.relative_to(ROOT).parent.joinpath(built.name.split(".", 1)[0]).as_posix()
        source = ROOT / f"{name}.py"
        if not source.exists():
            continue
        at = _built_at(built)
        oldest = at if oldest is None else min(oldest, at)
        if name not in HOT_PATH or source.stat().st_mtime > at:
            out.append(f"{name}.py")
    if oldest is not None:
        for name in HOT_PATH_IMPORTS:
            source = ROOT / f"{name}.py"
            if source.exists() and source.stat().st_mtime > oldest:
                out.append(f"{name}.py")
    return sorted(set(out))


def _built_at(shim: Path) -> float:
    """When a compiled module was last built. Its code is in its group's shared library
    (``<hash>__mypyc.*`` beside the package, named inside the module); the module itself is a shim
    that imports it, whose C never changes, and ``setup.py build_ext --inplace`` leaves it as it
    was, old mtime and all, while the library is rebuilt: the newer of the two counts."""
    t = shim.stat().st_mtime
    found = re.search(rb"([0-9a-f]{20})__mypyc", shim.read_bytes())
    if found is not None:
        for lib in ROOT.parent.glob(found.group(1).decode() + "__mypyc.*"):
            t = max(t, lib.stat().st_mtime)
    return t
