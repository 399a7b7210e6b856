"""Compiles the scheduler's hot path with mypyc (issue 13); everything else is in pyproject.toml.

The engine, the pool ledgers, the policy and the records they pass are ordinary typed Python,
compiled to C extension modules at install time: ``tangram bench scheduler`` measures 1.85x-1.88x
the decisions per CPU second of the same sources (it prints both; the README's Measured table). The
source stays the one truth: where no C compiler is found, or with ``ARL_TANGRAM_PURE=1``, the same
modules run as plain Python, and ``arl_tangram.build.compiled()`` says which one was imported.
The list of modules is ``arl_tangram.build.HOT_PATH``.

Editable installs put the compiled modules next to their sources, where Python would prefer them
even once a source is newer: such a checkout runs its sources, with a warning, until ``pip install
-e .`` builds again (``arl_tangram.build.stale``); ``tangram bench scheduler`` refuses to measure it.

Measured and dropped: Cython on the same unmodified modules (no types used: 1.0x).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext


def _hot_path() -> list[str]:
    """``arl_tangram.build.HOT_PATH``, read from its source (the package is not importable yet)."""
    import ast

    for node in ast.parse(open("src/arl_tangram/build.py").read()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "HOT_PATH":
            return [f"src/arl_tangram/{name}.py" for name in ast.literal_eval(node.value)]
    raise RuntimeError("HOT_PATH not found in src/arl_tangram/build.py")


def _ext_modules() -> list:
    if os.environ.get("ARL_TANGRAM_PURE", "") not in ("", "0"):
        return []
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")):
        print("arl-tangram: no C compiler found; the scheduler runs as plain Python", file=sys.stderr)
        return []
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        print("arl-tangram: no Python.h (python3-dev); the scheduler runs as plain Python", file=sys.stderr)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("arl-tangram: mypyc not importable; the scheduler runs as plain Python", file=sys.stderr)
        return []
    try:
        return mypycify(_hot_path(), opt_level="3", debug_level="0")
    except SystemExit as e:  # mypyc type-checks first and exits on an error (printed above)
        # e.g. a newer mypy in the isolated build environment than the one the sources were
        # checked with: the same hint as a failed compile, not a bare mypy error
        raise SystemExit(f"arl-tangram: mypyc rejected the scheduler's hot path (exit {e.code}; mypy's errors "
                         "are above); ARL_TANGRAM_PURE=1 installs it as plain Python") from None


class _BuildExt(build_ext):
    """Says how to install anyway when compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # the compiler's own output is above
            raise SystemExit(f"arl-tangram: compiling the scheduler's hot path failed ({e}); "
                             "ARL_TANGRAM_PURE=1 installs it as plain Python") from e


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": _BuildExt})
