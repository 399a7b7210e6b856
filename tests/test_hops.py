"""``tools/hops.py``, the c=1 ``/run_code`` traced hop by hop: every hop it wraps is still reached
(it wraps private functions of the server, the runtime and the sandbox manager, which may move)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "hops.py"


@pytest.mark.slow
def test_every_hop_of_a_run_code_is_stamped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, str(TOOL), "--requests", "20", "--port", str(port)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["requests"] == 20
    order = ["client", "http_in", "sf_in", "svc_in", "submit", "mgr_run", "sb_req", "sb_ans", "mgr_done", "report",
             "finished", "svc_out", "resp_start", "client_end"]
    assert set(out["hops_ms"]) == {f"{a}->{b}" for a, b in zip(order, order[1:])}
