"""What people read: comparison tables (rich) and plots (matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .core.action import CPU, GPU, Outcome


def _f(v, fmt: str = "{:.3f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _hours(v) -> str:
    return "-" if v is None else f"{v / 3600:,.1f}"


def results_table(title: str, rows: list[dict], comparison: dict) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col, justify in [("policy", "left"), ("actions", "right"), ("avg ACT s", "right"), ("p50", "right"),
                         ("p99", "right"), ("avg step s", "right"), ("CPU core-h held/busy", "right"),
                         ("GPU-h held/busy", "right"), ("util CPU/GPU", "right"), ("vs tangram ACT/step", "right")]:
        table.add_column(col, justify=justify)
    for r in rows:
        if r.get("avg_act_s") is None:
            table.add_row(r["policy"], "-", "[yellow]infeasible[/]", "", "", "", "", "", "",
                          r.get("infeasible", "")[:60])
            continue
        cmp = comparison.get(r["policy"], {})
        if r["policy"] == "tangram":
            vs = "[bold]1.00x / 1.00x[/]"
        elif cmp.get("act_ratio"):
            a, s = cmp["act_ratio"], cmp["step_ratio"]
            vs = f"[{'green' if a >= 1 else 'red'}]{a:.2f}x[/] / [{'green' if s >= 1 else 'red'}]{s:.2f}x[/]"
        else:
            vs = "-"
        util = f"{_f(r.get('cpu_utilization'), '{:.0%}')}/{_f(r.get('gpu_utilization'), '{:.0%}')}"
        cpu = "-" if not r.get("cpu_core_seconds_held") else \
            f"{_hours(r['cpu_core_seconds_held'])}/{_hours(r['cpu_core_seconds_busy'])}"
        gpu = "-" if not r.get("gpu_seconds_held") else \
            f"{_hours(r['gpu_seconds_held'])}/{_hours(r['gpu_seconds_busy'])}"
        table.add_row(r["policy"], f"{r['num_actions']:,}", _f(r["avg_act_s"]), _f(r["p50_act_s"]),
                      _f(r["p99_act_s"], "{:.2f}"), _f(r["avg_step_s"], "{:.1f}"), cpu, gpu, util, vs)
    table.caption = ("vs tangram: the baseline's value divided by Tangram's (above 1x: Tangram is better by "
                     "that factor)")
    return table


def print_summary(console: Console, rows: list[dict], comparison: dict) -> None:
    if not comparison:
        return
    worse = [f"{name} ({'ACT' if not c['tangram_act_no_worse'] else ''}"
             f"{' and ' if not c['tangram_act_no_worse'] and not c['tangram_step_no_worse'] else ''}"
             f"{'step' if not c['tangram_step_no_worse'] else ''})"
             for name, c in comparison.items() if "act_ratio" in c
             and not (c["tangram_act_no_worse"] and c["tangram_step_no_worse"])]
    ran = {n: c for n, c in comparison.items() if "act_ratio" in c}
    if ran:
        best_act = min(ran.values(), key=lambda c: c["act_ratio"])
        best_step = min(ran.values(), key=lambda c: c["step_ratio"])
        console.print(f"Tangram vs the best baseline: average ACT [bold]{best_act['act_ratio']:.2f}x[/], "
                      f"average step time [bold]{best_step['step_ratio']:.2f}x[/] (above 1x: Tangram better).")
    if worse:
        console.print(f"[red]Tangram is worse than: {', '.join(worse)}[/]")


def plot(results: list, path: str | Path, title: str) -> None:
    """ACT CDF per policy, then pool utilisation over time (held solid, running dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r is not None]
    has_cpu = any(r.cluster.total_cores for r in results)
    has_gpu = any(r.cluster.total_gpus for r in results)
    panels = 1 + int(has_cpu) + int(has_gpu)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = axes[0]
    colors = {"tangram": "#d62728", "trajectory-static": "#1f77b4", "task-isolated": "#2ca02c", "fifo": "#9467bd"}
    ax = axes[0]
    for r in results:
        acts = sorted(f.act_s for f in r.finished if f.outcome is not Outcome.REJECTED)
        if not acts:
            continue
        ys = [(i + 1) / len(acts) for i in range(len(acts))]
        ax.plot([max(a, 1e-3) for a in acts], ys, label=r.policy, color=colors.get(r.policy))
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title("ACT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    i = 1
    for kind, cap_attr, held_i, run_i in ((CPU, "total_cores", 1, 2), (GPU, "total_gpus", 3, 4)):
        if (kind == CPU and not has_cpu) or (kind == GPU and not has_gpu):
            continue
        ax = axes[i]
        i += 1
        for r in results:
            cap = getattr(r.cluster, cap_attr) or 1
            ts = [p[0] for p in r.series]
            ax.plot(ts, [p[held_i] / cap for p in r.series], color=colors.get(r.policy), label=f"{r.policy} held")
            ax.plot(ts, [p[run_i] / cap for p in r.series], color=colors.get(r.policy), linestyle="--", alpha=0.7)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"fraction of {kind.upper()} pool")
        ax.set_title(f"{kind.upper()} held (solid) and running actions (dashed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
