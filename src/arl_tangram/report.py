"""What people read: comparison tables (rich) and plots (matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .core.action import CPU, GPU, Outcome


def cell_text(v, fmt: str = "{:.3f}") -> str:
    """A figure as a table cell: ``-`` for none or NaN."""
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
        util = f"{cell_text(r.get('cpu_utilization'), '{:.0%}')}/{cell_text(r.get('gpu_utilization'), '{:.0%}')}"
        cpu = "-" if not r.get("cpu_core_seconds_held") else \
            f"{_hours(r['cpu_core_seconds_held'])}/{_hours(r['cpu_core_seconds_busy'])}"
        gpu = "-" if not r.get("gpu_seconds_held") else \
            f"{_hours(r['gpu_seconds_held'])}/{_hours(r['gpu_seconds_busy'])}"
        table.add_row(r["policy"], f"{r['num_actions']:,}", cell_text(r["avg_act_s"]), cell_text(r["p50_act_s"]),
                      cell_text(r["p99_act_s"], "{:.2f}"), cell_text(r["avg_step_s"], "{:.1f}"), cpu, gpu, util, vs)
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


# -- the evaluation report (``tangram evaluate``) ---------------------------------------------------
# A report is built once as a list of blocks (heading, paragraph, table, image) and rendered to both
# Markdown and HTML, so the two can never disagree.

COLORS = {"tangram": "#d62728", "trajectory-static": "#1f77b4", "task-isolated": "#2ca02c", "fifo": "#9467bd"}


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _spread(st: dict | None, fmt: str = "{:.2f}", unit: str = "") -> str:
    """``mean [min..max]`` over seeds."""
    if not st:
        return "-"
    if st["n"] == 1:
        return f"{fmt.format(st['mean'])}{unit}"
    return f"{fmt.format(st['mean'])}{unit} [{fmt.format(st['min'])}..{fmt.format(st['max'])}]"


def headline_rows(h: dict) -> list[list[str]]:
    """The headline table: the paper's figure, ours, where it was reached and how it was computed."""

    def where(p: dict | None, against: str = "") -> str:
        if not p:
            return "-"
        return f"{p['workload']} at {p['scale']:g}x pool{against}"

    rows = []
    a, s, r = h.get("act_vs_trajectory_static"), h.get("step_vs_trajectory_static"), h.get("resource_savings")
    paper = h["paper"]
    rows.append(["average ACT, up to", f"{paper['act_speedup']:.1f}x",
                 _spread(a and {"mean": a["value"], "min": a["min"], "max": a["max"], "n": a["seeds"]}, "{:.2f}", "x"),
                 where(a, " vs trajectory-static"),
                 "trajectory-static's average ACT / Tangram's, per seed, mean over seeds; the largest over "
                 "workloads x scales"])
    rows.append(["RL step time, up to", f"{paper['step_speedup']:.1f}x",
                 _spread(s and {"mean": s["value"], "min": s["min"], "max": s["max"], "n": s["seeds"]}, "{:.2f}", "x"),
                 where(s, " vs trajectory-static"),
                 "trajectory-static's average step time / Tangram's, per seed, mean over seeds; the largest "
                 "over workloads x scales"])
    rows.append(["external resources saved, up to", _pct(paper["resource_savings"]),
                 "-" if not r else f"{r['value']:.1%} [{r['min']:.1%}..{r['max']:.1%}]",
                 "-" if not r else f"{r['workload']} (Tangram {r['min_scale']:.3f}x vs trajectory-static "
                                   f"{r['baseline_min_scale']:.3f}x of the pool)",
                 "1 - Tangram's smallest pool / trajectory-static's smallest pool, each the smallest scale "
                 "(bisection over 0.05..2x) whose average step time is within trajectory-static's at 1x; per "
                 "seed, mean over seeds; the largest over workloads"])
    for key, label, what in (("act_vs_best_baseline", "average ACT vs the best baseline, up to", "ACT"),
                             ("step_vs_best_baseline", "RL step time vs the best baseline, up to", "step time")):
        p = h.get(key)
        if p:
            rows.append([label, "-", f"{p['value']:.2f}x [{p['min']:.2f}..{p['max']:.2f}]", where(p),
                         f"the smallest {what} of the three baselines at the same point and seed / Tangram's, "
                         "mean over seeds; the largest over workloads x scales"])
            w = p["worst_seed"]
            rows.append([f"{label.split(',')[0]}, worst seed", "-", f"{w['value']:.3f}x",
                         f"{w['workload']} at {w['scale']:g}x pool",
                         f"as above but the smallest single-seed value (below 1x: a baseline beat Tangram there); "
                         f"the worst mean over seeds is {p['worst_mean']:.3f}x"])
    return rows


def evaluation_blocks(data: dict, images: dict[str, str]) -> list[tuple]:
    """The report as blocks: ("h", level, text) | ("p", text) | ("table", headers, rows) | ("img", path, alt)."""
    plan = data["plan"]
    b: list[tuple] = [("h", 1, "ARL-Tangram evaluation")]
    b.append(("p", f"{len(plan['workloads'])} workloads ({', '.join(plan['workloads'])}) x pool scales "
                   f"{', '.join(f'{s:g}' for s in plan['scales'])} x seeds {', '.join(map(str, plan['seeds']))} x "
                   f"policies {', '.join(plan['policies'])}: {len(data['cells'])} simulations and "
                   f"{len(data['searches'])} min-resource searches in {data['wall_s']:.0f} s on {data['workers']} "
                   f"worker processes. Every figure below is computed from results.json, which holds each "
                   f"simulation's summary; the simulator runs the same engine and policy code as the real "
                   f"runtime on a virtual clock. Simulated clients "
                   + ("send each action's exact remaining turns in its trajectory (Action.remaining_turns), "
                      "which Tangram uses to find each step's critical path; the baselines ignore it."
                      if plan.get("client_remaining", True) else
                      "send no remaining turns: Tangram learns them per job from the trajectories that ended.")
                   + (" Queue time is unbounded (no action is rejected for waiting)." if plan.get("max_queue_s") is None
                      else f" Actions queued longer than {plan['max_queue_s']:g} s are rejected and leave the figures.")))
    if data.get("errors"):
        b.append(("p", "ERRORS (cells that raised; their figures are missing): " + "; ".join(data["errors"])))
    b.append(("h", 2, "Headline: the paper's figures beside this sweep"))
    b.append(("table", ["figure", "paper (arXiv 2603.13019)", "this sweep: mean [min..max over seeds]", "where",
                        "how it was computed"], headline_rows(data["headline"])))
    b.append(("p", "The paper's \"up to\" figures are the best points of its own sweep on its workloads and "
                   "cluster; ours are the best points of this sweep on the simulated workloads documented in "
                   "sim/workloads.py. Ratios above 1x mean Tangram is better by that factor."))
    b.append(("h", 2, "Per workload: mean and spread over seeds"))
    b.append(("p", "Each cell: mean over seeds [min..max]. ACT and step ratios are the baseline's value / "
                   "Tangram's on the same seed (above 1x: Tangram better), then averaged. Core-hours and "
                   "GPU-hours held count every unit allocated to an action or reserved (a static sandbox or "
                   "GPU partition is held while idle). 'infeasible' gives the reason a policy could not run."))
    by_w: dict[str, list[dict]] = {}
    for r in data["aggregate"]:
        by_w.setdefault(r["workload"], []).append(r)
    for w in plan["workloads"]:
        rows = []
        for r in sorted(by_w.get(w, []), key=lambda r: (r["scale"], plan["policies"].index(r["policy"]))):
            if r["avg_act_s"] is None:
                rows.append([f"{r['scale']:g}", r["policy"], "infeasible: " + "; ".join(r["infeasible"])[:120],
                             "", "", "", "", "", ""])
                continue
            held = r.get("cpu_core_seconds_held")
            gheld = r.get("gpu_seconds_held")
            rows.append([f"{r['scale']:g}", r["policy"], _spread(r["avg_act_s"], "{:.3f}"),
                         _spread(r["p99_act_s"], "{:.1f}"), _spread(r["avg_step_s"], "{:.1f}"),
                         "1.00x" if r["policy"] == "tangram" else _spread(r["act_ratio"], "{:.2f}", "x"),
                         "1.00x" if r["policy"] == "tangram" else _spread(r["step_ratio"], "{:.3f}", "x"),
                         "-" if not held or not held["mean"] else f"{held['mean'] / 3600:,.1f}",
                         "-" if not gheld or not gheld["mean"] else f"{gheld['mean'] / 3600:,.1f}"])
        b.append(("h", 3, w))
        b.append(("table", ["scale", "policy", "avg ACT s", "p99 ACT s", "avg step s", "ACT ratio", "step ratio",
                            "CPU core-h held", "GPU-h held"], rows))
    mr = data.get("min_resources") or {}
    if mr:
        b.append(("h", 2, "Resources at equal step time"))
        b.append(("p", "The smallest pool scale (every CPU, GPU and quota pool multiplied by it; bisection over "
                       f"0.05..2x, {plan['search_iterations']} halvings after bracketing) at which each policy's "
                       "average step time is within trajectory-static's at scale 1 on the same seed. "
                       "'saved vs 1x' = 1 - scale; 'saved vs trajectory-static' = 1 - scale / trajectory-static's "
                       "own smallest scale (the baseline may also need less than 1x where the step time hardly "
                       "depends on the pool). '-' where no scale up to 2x matched."))
        rows = []
        for w, per in mr.items():
            for p in plan["policies"]:
                v = per.get(p)
                if v is None:
                    continue
                rel = v.get("vs_trajectory_static")
                rows.append([w, p, _spread(v["target_step_s"], "{:.1f}"), _spread(v["min_scale"], "{:.3f}"),
                             "-" if not v["savings"] else
                             f"{v['savings']['mean']:.1%} [{v['savings']['min']:.1%}..{v['savings']['max']:.1%}]",
                             "-" if not rel else f"{rel['mean']:.1%} [{rel['min']:.1%}..{rel['max']:.1%}]",
                             f"{v['matched']}/{v['seeds']}"])
        b.append(("table", ["workload", "policy", "target step s", "min scale", "saved vs 1x",
                            "saved vs trajectory-static", "seeds matched"], rows))
    b.append(("h", 2, "Plots"))
    for key, alt in (("act_vs_scale", "average ACT vs pool scale per workload (mean over seeds, bars: min..max)"),
                     ("step_vs_scale", "average RL step time vs pool scale per workload (mean over seeds, "
                                       "bars: min..max)"),
                     ("held_vs_step", "resources held vs step time: each point is one pool scale (mean over "
                                      "seeds); lower-left is better"),
                     ("act_cdf", "ACT CDFs at scale 1, first seed (101 quantiles per policy)")):
        if key in images:
            b.append(("p", alt))
            b.append(("img", images[key], alt))
    return b


def render_markdown(blocks: list[tuple]) -> str:
    out: list[str] = []
    for blk in blocks:
        if blk[0] == "h":
            out.append(f"{'#' * blk[1]} {blk[2]}\n")
        elif blk[0] == "p":
            out.append(blk[1] + "\n")
        elif blk[0] == "table":
            headers, rows = blk[1], blk[2]
            out.append("| " + " | ".join(headers) + " |")
            out.append("|" + "|".join("---" for _ in headers) + "|")
            for r in rows:
                out.append("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
            out.append("")
        elif blk[0] == "img":
            out.append(f"![{blk[2]}]({blk[1]})\n")
    return "\n".join(out)


def render_html(blocks: list[tuple], title: str = "ARL-Tangram evaluation") -> str:
    from html import escape

    body: list[str] = []
    for blk in blocks:
        if blk[0] == "h":
            body.append(f"<h{blk[1]}>{escape(blk[2])}</h{blk[1]}>")
        elif blk[0] == "p":
            body.append(f"<p>{escape(blk[1])}</p>")
        elif blk[0] == "table":
            head = "".join(f"<th>{escape(h)}</th>" for h in blk[1])
            rows = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in r) + "</tr>" for r in blk[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif blk[0] == "img":
            body.append(f'<img src="{escape(blk[1])}" alt="{escape(blk[2])}">')
    style = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;"
             "padding:3px 8px;text-align:right}td:nth-child(-n+2),th{text-align:left}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def evaluation_plots(data: dict, out_dir: Path) -> dict[str, str]:
    """The report's PNGs; returns {name: file name relative to ``out_dir``}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plan = data["plan"]
    workloads = plan["workloads"]
    agg = data["aggregate"]
    images: dict[str, str] = {}

    def grid(n: int):
        cols = min(3, n)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax in flat[n:]:
            ax.axis("off")
        return fig, flat

    def save(fig, axes, name: str) -> None:
        """Legend, layout, ``name``.png into ``out_dir``, and its place in the report."""
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        images[name] = f"{name}.png"

    for metric, name, label in (("avg_act_s", "act_vs_scale", "average ACT (s)"),
                                ("avg_step_s", "step_vs_scale", "average step time (s)")):
        fig, axes = grid(len(workloads))
        for ax, w in zip(axes, workloads):
            for p in plan["policies"]:
                pts = sorted((r["scale"], r[metric]) for r in agg
                             if r["workload"] == w and r["policy"] == p and r[metric])
                if not pts:
                    continue
                xs = [s for s, _ in pts]
                ys = [st["mean"] for _, st in pts]
                err = [[st["mean"] - st["min"] for _, st in pts], [st["max"] - st["mean"] for _, st in pts]]
                ax.errorbar(xs, ys, yerr=err, label=p, color=COLORS.get(p), marker="o", ms=3, capsize=2)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            if metric == "avg_act_s":  # ACT spans orders of magnitude over scales; step times do not
                ax.set_yscale("log")
                ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title(w)
            ax.set_xlabel("pool scale")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        save(fig, axes, name)

    panels = []
    for w in workloads:
        for kind, key, unit in (("CPU", "cpu_core_seconds_held", "core-h"), ("GPU", "gpu_seconds_held", "GPU-h")):
            if any(r["workload"] == w and r.get(key) and r[key]["mean"] for r in agg):
                panels.append((w, kind, key, unit))
    if panels:
        fig, axes = grid(len(panels))
        for ax, (w, kind, key, unit) in zip(axes, panels):
            for p in plan["policies"]:
                pts = sorted((r["avg_step_s"]["mean"], r[key]["mean"] / 3600, r["scale"]) for r in agg
                             if r["workload"] == w and r["policy"] == p and r.get(key) and r["avg_step_s"])
                if not pts:
                    continue
                ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", ms=3, label=p,
                        color=COLORS.get(p))
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{w}: {kind} held vs step time")
            ax.set_xlabel("average step time (s)")
            ax.set_ylabel(f"{kind} {unit} held")
            ax.grid(alpha=0.3)
        save(fig, axes, "held_vs_step")

    seed = plan["seeds"][0]
    scale = 1.0 if 1.0 in plan["scales"] else plan["scales"][-1]
    fig, axes = grid(len(workloads))
    for ax, w in zip(axes, workloads):
        for c in data["cells"]:
            if c["workload"] == w and c["seed"] == seed and c["scale"] == scale and c["act_quantiles"]:
                qs = c["act_quantiles"]
                ax.plot([max(q, 1e-3) for q in qs], [i / (len(qs) - 1) for i in range(len(qs))],
                        label=c["policy"], color=COLORS.get(c["policy"]))
        ax.set_xscale("log")
        ax.set_title(f"{w} (scale {scale:g}, seed {seed})")
        ax.set_xlabel("action completion time (s)")
        ax.set_ylabel("fraction of actions")
        ax.grid(alpha=0.3)
    save(fig, axes, "act_cdf")
    return images


def write_evaluation_report(data: dict, out_dir: str | Path) -> list[Path]:
    """results.json, report.md, report.html and the PNGs into ``out_dir``; returns the paths."""
    import json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    images = evaluation_plots(data, out_dir)
    blocks = evaluation_blocks(data, images)
    (out_dir / "report.md").write_text(render_markdown(blocks))
    (out_dir / "report.html").write_text(render_html(blocks))
    return [out_dir / n for n in ("results.json", "report.md", "report.html", *images.values())]
