"""How to compile and run each language: a small registry that is easy to extend.

A language names its source file, an optional compile command, a run command and the executables
it needs. ``python`` runs inside the sandbox's warm interpreter (no interpreter start-up in ACT).
Toolchains are looked up on the paths the sandbox can see; a known language whose toolchain is
missing is an explicit error, never a crash.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Language:
    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    requires: tuple[str, ...] = ()
    in_interpreter: bool = False  # python: exec in the runner's pre-started interpreter


LANGUAGES: dict[str, Language] = {}


def register(lang: Language) -> Language:
    LANGUAGES[lang.name] = lang
    return lang


register(Language("python", "main.py", ("python3", "main.py"), in_interpreter=True))
register(Language("bash", "main.sh", ("bash", "main.sh"), requires=("bash",)))
register(Language("cpp", "main.cpp", ("./main",), ("g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"),
                  requires=("g++",)))
register(Language("c", "main.c", ("./main",), ("gcc", "-O2", "-o", "main", "main.c", "-lm"), requires=("gcc",)))
register(Language("nodejs", "main.js", ("node", "main.js"), requires=("node",)))
register(Language("java", "Main.java", ("java", "-Xshare:off", "Main"), ("javac", "Main.java"),
                  requires=("java", "javac")))
register(Language("perl", "main.pl", ("perl", "main.pl"), requires=("perl",)))


class UnknownLanguage(ValueError):
    pass


class MissingToolchain(RuntimeError):
    pass


def resolve(name: str, extra_path: str = "", which=None) -> Language:
    """The language ``name``, checked to be runnable in the sandbox (``which``: how to find an
    executable there, for a sandbox whose root is an image). Toolchains found on the host's paths
    are remembered: the lookup is a PATH scan per action otherwise."""
    key = (name, extra_path)
    if which is None and key in _RESOLVED:
        return _RESOLVED[key]
    lang = LANGUAGES.get(name)
    if lang is None:
        raise UnknownLanguage(f"language: unknown {name!r} (known: {', '.join(sorted(LANGUAGES))})")
    path = os.pathsep.join(p for p in (extra_path, SANDBOX_PATH) if p)
    find = which or (lambda exe: shutil.which(exe, path=path))
    missing = [exe for exe in lang.requires if find(exe) is None]
    if missing:
        raise MissingToolchain(f"language {name!r} needs {', '.join(missing)}, which the sandbox does not have")
    if which is None:
        _RESOLVED[key] = lang
    return lang


_RESOLVED: dict[tuple[str, str], Language] = {}
