"""The python one-shot's child, alone: the sandbox agent's ``Zygote`` (``inside/zygote.py``) outside
any sandbox, its child forked on demand against forked ahead (as the reset of a recycled sandbox
does), for ``tangram bench zygote``.

Each measurement is a fresh process that starts the sandbox agent's state (``inside.boot``: it
takes over its own descriptors 0 and 1, so it answers on the protocol's copy): ``runs`` trivial
one-shots, an idle ``gap_s`` after each (where the sandbox would wait in the pool), reporting a
run's p50 wall time (the latency path), the zygote's and its children's CPU and page faults per
run, and the agent's CPU per run. The two modes alternate ``rounds`` times and the medians are compared as
ratios (ahead / on demand), so slow drift of a shared machine hits both alike.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

PROBE = r'''
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
ahead, runs, gap = sys.argv[2] == "ahead", int(sys.argv[3]), float(sys.argv[4])
sys.argv = ["runner"]
import inside
from inside import zygote
st = inside.boot()
out = os.fdopen(st.proto_out, "w")
z = zygote.Zygote(st)
req = {"cwd": os.environ.get("TMPDIR", "/tmp"), "code": os.environ["PROBE_CODE"],
       "env": {"TANGRAM_NUM_CPUS": "1"}, "timeout_s": 10, "max_output": 1 << 20}
def one():
    t = time.perf_counter()
    r = z.run(req)
    took = time.perf_counter() - t
    if ahead:
        z.fork_ahead()
    time.sleep(gap)
    return r, took
for _ in range(20):
    r, _ = one()
    assert r["exit_code"] is not None and not r["timed_out"], r
s0 = resource.getrusage(resource.RUSAGE_SELF)
lat = [one()[1] for _ in range(runs)]
s1 = resource.getrusage(resource.RUSAGE_SELF)
if ahead:
    z.drop_ahead()
c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
z.sock.close()
os.waitpid(z.pid, 0)
c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
lat.sort()
k = runs + 20  # the zygote's children are counted once it is reaped: warm-up runs included
print(json.dumps({"run_p50_ms": lat[runs // 2] * 1e3,
                  "child_cpu_ms": (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / k * 1e3,
                  "child_faults": (c1.ru_minflt - c0.ru_minflt) / k,
                  "runner_cpu_ms": (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime) / runs * 1e3}),
      file=out, flush=True)
'''

MODES = ("on_demand", "ahead")


def _measure(mode: str, runs: int, gap_s: float, code: str) -> dict:
    from ..managers.sandbox.isolation import INSIDE  # (booting the agent here would take over our descriptors)

    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(PROBE)
        p = subprocess.run([sys.executable, "-I", str(probe), str(INSIDE.parent),
                            "ahead" if mode == "ahead" else "no", str(runs), str(gap_s)],
                           capture_output=True, text=True, timeout=120,
                           env={"TMPDIR": tmp, "PATH": "/usr/bin:/bin", "PROBE_CODE": code})
    if p.returncode != 0:
        raise RuntimeError(f"zygote probe ({mode}) failed: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def run(runs: int = 300, rounds: int = 3, gap_s: float = 0.002, log: Callable[[str], None] = lambda m: None,
        code: str = "print(1)") -> dict:
    """Medians over ``rounds`` alternating measurements of each mode, and ahead / on demand;
    ``code``: the one-shot (a failing one, ``raise ValueError(1)``, takes the traceback's way)."""
    seen: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(rounds):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            r = _measure(mode, runs, gap_s, code)
            seen[mode].append(r)
            log(f"{mode:>9}: run p50 {r['run_p50_ms']:.3f} ms, child CPU {r['child_cpu_ms']:.3f} ms, "
                f"{r['child_faults']:.0f} faults, runner CPU {r['runner_cpu_ms']:.3f} ms")
    med = {m: {k: round(statistics.median(r[k] for r in seen[m]), 3) for k in seen[m][0]} for m in MODES}
    return {"code": code, "runs": runs, "rounds": rounds, "gap_s": gap_s, **med,
            "ahead_vs_on_demand": {k: round(med["ahead"][k] / med["on_demand"][k], 3)
                                   for k in med["ahead"] if med["on_demand"][k]}}
