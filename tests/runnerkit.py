"""Scripts run against the sandbox's ``runner.py`` in a child process of their own: importing the
runner takes over its process's stdin and stdout (never pytest's). A script gets the runner's
directory as ``sys.argv[1]`` and prints one JSON object, on the runner's protocol descriptor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_with_runner(tmp_path: Path, source: str, timeout: float = 60) -> Any:
    """What ``source`` printed, parsed; the test fails with its stderr if it did not exit 0."""
    from arl_tangram.managers.sandbox.isolation import RUNNER

    script = tmp_path / "probe.py"
    script.write_text(source)
    p = subprocess.run([sys.executable, "-I", str(script), str(Path(RUNNER).parent)], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
