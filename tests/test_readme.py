"""Every Python snippet in the README runs as written (issue 20: one lacked an import and used
undefined names, another printed ``Outcome.OK`` where the docs say ``ok``).

Each ```python block is run on its own, in a fresh interpreter, exactly as it stands in the
README. What a snippet assumes from the text before it is made here, as a user would make it: the
``py312`` image of the environments section is imported with ``tangram image import`` (from an
archive built by ``imagekit``: a shell and coreutils, not Docker's python image, which would need
a download)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from imagekit import docker_archive, host_tools

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _run(code: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _snippet(*words: str) -> str:
    found = [s for s in SNIPPETS if all(w in s for w in words)]
    assert len(found) == 1, f"expected one README snippet with {words}, found {len(found)}"
    return found[0]


def test_every_snippet_is_covered_here():
    """A new snippet gets a test below (each one names what it shows)."""
    covered = [_snippet("Tangram.local() as tg", "tg.run("), _snippet("models=teachers"), _snippet("py312")]
    assert len(SNIPPETS) == len(covered), "a README python snippet has no test in tests/test_readme.py"


@needs_bwrap
def test_the_embedded_api_snippet(tmp_path):
    p = _run(_snippet("Tangram.local() as tg", "tg.run("), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()  # the outcome as the docs spell it, the reversed input, its ACT
    assert lines[0] == "ok olleh" and lines[1].strip().startswith("ACT") and lines[2] == "42", p.stdout


@needs_bwrap
def test_the_model_services_snippet(tmp_path):
    pytest.importorskip("torch")
    p = _run(_snippet("models=teachers"), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    words = p.stdout.split()
    assert words[:3] == ["ok", "3", "ok"] and "a hit for primes" in p.stdout, p.stdout


@needs_bwrap
@pytest.mark.slow
def test_the_environments_snippet(tmp_path):
    tools = [shutil.which(t) for t in ("bash", "mkdir", "cat", "echo")]
    archive = docker_archive(tmp_path / "py.tar", [host_tools(*tools) + [("symlink", "usr/bin/sh", "bash")]])
    env = {"TANGRAM_IMAGE_STORE": str(tmp_path / "store")}
    imported = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "image", "import", str(archive), "--name",
                               "py312"], capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert imported.returncode == 0, imported.stderr
    p = _run(_snippet("py312"), tmp_path, env)
    assert p.returncode == 0, p.stderr[-3000:]
    # a child starts a fresh shell in the workspace (no cd, no export: MODE is empty) with the
    # parent's files; the restored session has them too
    assert [line for line in p.stdout.splitlines() if line] == ["/workspace", "x = 1", "x = 1"], p.stdout
