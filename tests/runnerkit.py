"""Scripts run against the sandbox's agent (the ``inside`` package) in a child process of their
own: starting its state (``inside.boot``) takes over the process's stdin and stdout (never
pytest's). A script gets the package's parent directory as ``sys.argv[1]`` and prints one JSON
object, on the agent's protocol descriptor; ``PRELUDE`` starts one so (``st``: the state, ``out``:
a text stream on that descriptor)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PRELUDE = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["runner"]
import inside as _inside
st = _inside.boot()  # its fds 0 and 1 now go to /dev/null: answer on the protocol's copy
out = os.fdopen(st.proto_out, "w")
'''


def run_with_runner(tmp_path: Path, source: str, timeout: float = 60) -> Any:
    """What ``source`` printed, parsed; the test fails with its stderr if it did not exit 0."""
    from arl_tangram.managers.sandbox.isolation import INSIDE

    script = tmp_path / "probe.py"
    script.write_text(source)
    p = subprocess.run([sys.executable, "-I", str(script), str(INSIDE.parent)], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
