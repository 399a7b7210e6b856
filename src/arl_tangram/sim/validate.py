"""The simulator validated against reality: replay a recorded run and compare its ACTs.

``replay_error`` loads a trace written by ``TraceRecorder`` (which holds each action's measured
``act_s``), replays it on the same cluster with the same costs and policy, and reports the
simulated ACTs beside the measured ones, action by action. The difference is the simulator's
error on that run: what it does not model (engine and event-loop latency, process start-up
variance, the machine's other load) plus the costs model's distance from the real sandboxes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.cluster import Cluster
from ..policy import Costs, make_policy
from .metrics import percentile
from .simulator import Simulator
from .trace import load_trace


def replay_error(trace: str | Path, cluster: Cluster, *, policy: str = "tangram", costs: Costs | None = None,
                 seed: int = 0) -> dict:
    """Measured vs simulated ACT of every recorded action (matched by job/step/trajectory/seq)."""
    measured: dict[str, float] = {}
    with open(trace, encoding="utf-8") as fh:
        for raw in fh:
            if raw.strip():
                x = json.loads(raw)
                if x.get("act_s") is not None:
                    measured[f"{x.get('job', 'default')}/{x['step']}/{x['trajectory']}#{x['seq']}"] = x["act_s"]
    wl = load_trace(trace)
    result = Simulator(wl, cluster, make_policy(policy), seed=seed, costs=costs or Costs()).run()
    simulated = {f.action.id: f.act_s for f in result.finished}
    pairs = [(measured[k], simulated[k]) for k in measured if k in simulated]
    if not pairs:
        raise ValueError(f"{trace}: no recorded action has a measured act_s to compare")
    m = sorted(p[0] for p in pairs)
    s = sorted(p[1] for p in pairs)
    avg_m, avg_s = sum(m) / len(m), sum(s) / len(s)
    abs_err = sorted(abs(b - a) for a, b in pairs)
    return {"actions": len(pairs), "policy": policy,
            "measured_avg_act_s": avg_m, "simulated_avg_act_s": avg_s,
            "avg_act_error": avg_s / avg_m - 1 if avg_m else None,
            "measured_p50_act_s": percentile(m, 50), "simulated_p50_act_s": percentile(s, 50),
            "median_abs_error_s": percentile(abs_err, 50), "p90_abs_error_s": percentile(abs_err, 90)}
