"""The figures of ``tangram bench agentic`` side by side, and its report files.

A run's figures (``sim.replay.act_figures`` plus step and held resource-seconds) are flattened
into one level (``cpu_avg_act_s`` for the sandbox actions' average ACT, ...) so that a measured
and a simulated column compare key by key; ``errors`` is (simulated - measured) / measured per
figure. ``write_report`` writes results.json, report.md, report.html and the plots, built as
``tangram evaluate``'s are (``report.render_markdown``/``render_html`` from one list of blocks,
its colours per policy).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..report import cell_text
from ..sim.replay import KINDS

#: the figures a run reports, overall then per resource kind (where the step had such actions)
FIGURES = ("avg_act_s", "p99_act_s", "step_s", "core_s", "gpu_s",
           *(f"{k}_{f}" for k in KINDS for f in ("avg_act_s", "p99_act_s")))
CDF_POINTS = 101


def flat(figures: dict) -> dict:
    """``FIGURES`` of one run (measured or simulated), ``None`` for a kind it had no action of."""
    out = {f: figures.get(f) for f in ("avg_act_s", "p99_act_s", "step_s", "core_s", "gpu_s")}
    by = figures.get("by_kind", {})
    for k in KINDS:
        for f in ("avg_act_s", "p99_act_s"):
            out[f"{k}_{f}"] = by.get(k, {}).get(f)
    out["actions"] = figures.get("n")
    return out


def errors(measured: dict, simulated: dict) -> dict:
    """(simulated - measured) / measured for each figure both have (measured above zero)."""
    out = {}
    for f in FIGURES:
        m, s = measured.get(f), simulated.get(f)
        out[f] = (s - m) / m if m and s is not None else None
    return out


def quantiles(acts: list[float]) -> list[float]:
    """``CDF_POINTS`` quantiles of the ACTs, for a CDF plot."""
    xs = sorted(acts)
    if not xs:
        return []
    return [xs[min(len(xs) - 1, round(i * (len(xs) - 1) / (CDF_POINTS - 1)))] for i in range(CDF_POINTS)]


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def blocks(data: dict, images: dict[str, str]) -> list[tuple]:
    p = data["plan"]
    b: list[tuple] = [("h", 1, "ARL-Tangram: a real agentic-RL step against static provisioning")]
    b.append(("p", f"{p['groups']} groups x {p['k']} trajectories ({p['actions']} actions: "
                   f"{', '.join(f'{n} {k}' for k, n in p['by_kind'].items())}), seed {p['seed']}, on "
                   f"{data['host']['sandbox_cores']} sandbox cores and {data['device']} for the models "
                   f"({', '.join(p['teachers'])}; {p['reward_model']}); judge API at {p['judge']['rate_per_s']:g}/s, "
                   f"{p['judge']['concurrency']} in flight. Measured: each policy's real run. Simulated: the Tangram "
                   f"run's recorded trace replayed under that policy on the cluster its real run had. Error: "
                   f"simulated / measured - 1; own trace's error: the same for the policy's own run's trace "
                   f"replayed under it. {data['wall_s']:.0f} s in all."))
    b.append(("p", f"Baseline ({data['baseline']}): {data['frameworks'][data['baseline']]}."))
    rows = []
    for f in FIGURES:
        row = [f]
        for name in data["policies"]:
            x = data["policies"][name]
            row += [cell_text(x["measured"].get(f)), cell_text(x["simulated"].get(f)), _pct(x["error"].get(f)),
                    _pct(x.get("error_own", {}).get(f))]
        rows.append(row)
    heads = ["figure"] + [f"{n} {c}" for n in data["policies"]
                          for c in ("measured", "simulated", "error", "own trace's error")]
    b.append(("h", 2, "Measured and simulated, per policy"))
    b.append(("table", heads, rows))
    c = data["comparison"]
    b.append(("h", 2, f"{data['baseline']} / tangram"))
    b.append(("table", ["figure", "measured", "simulated"],
              [[k, cell_text(c["measured"].get(k), "{:.2f}"), cell_text(c["simulated"].get(k), "{:.2f}")] for k in c["measured"]]))
    eq = data["equal_step"]
    b.append(("h", 2, "Resources at equal step time"))
    b.append(("p", eq["how"] + f"; target {eq['target_step_s']:.2f} s on {eq['baseline_cores']} cores."))
    b.append(("table", ["cores", "step s measured", "step s simulated", "core-s held", "GPU-s held", "avg ACT s"],
              [[t["cores"], cell_text(t["step_s"], "{:.2f}"), cell_text(t["simulated_step_s"], "{:.2f}"), cell_text(t["core_s"], "{:.1f}"),
                cell_text(t["gpu_s"], "{:.2f}"), cell_text(t["avg_act_s"])] for t in eq["tries"]]))
    m, s = eq.get("measured") or {}, eq["simulated"]
    b.append(("p", f"Fewest cores within the target: measured {m.get('min_cores', '-')} "
                   f"(cores saved {cell_text(m.get('cores_saved'), '{:.0%}')}, GPU-seconds saved "
                   f"{cell_text(m.get('gpu_s_saved'), '{:.0%}')}), simulated {s['min_cores']} "
                   f"(cores saved {s['cores_saved']:.0%})."))
    t = data["targets"]
    b.append(("h", 2, f"Targets (for {t['given_for']})"))
    b.append(("table", ["figure", "target", "this run", "met"],
              [[k, f"{v:g}", cell_text(t.get("worst_simulator_error" if k == "simulator_error" else k), "{:.3f}"),
                "yes" if t["met"][k] else "no"] for k, v in t["targets"].items()]))
    b.append(("h", 2, "Plots"))
    for key, alt in (("figures", "measured (solid) and simulated (hatched) figures per policy"),
                     ("act_cdf", "ACT CDF per policy: measured (solid), simulated (dashed)"),
                     ("equal_step", "Tangram's step time against its sandbox cores, measured and simulated, "
                                    "and the baseline's on all cores")):
        if key in images:
            b.append(("p", alt))
            b.append(("img", images[key], alt))
    return b


def plots(data: dict, out_dir: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..report import COLORS

    images: dict[str, str] = {}
    names = list(data["policies"])

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        images[name] = f"{name}.png"

    groups = [("average ACT (s)", [f for f in FIGURES if f.endswith("avg_act_s")]),
              ("p99 ACT (s)", [f for f in FIGURES if f.endswith("p99_act_s")]),
              ("step (s)", ["step_s"]), ("held (resource-s)", ["core_s", "gpu_s"])]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
    for ax, (label, figs) in zip(axes[0], groups):
        width = 0.8 / (2 * len(names))
        for i, name in enumerate(names):
            x = data["policies"][name]
            for j, side in enumerate(("measured", "simulated")):
                ys = [x[side].get(f) or 0.0 for f in figs]
                ax.bar([k + (2 * i + j - len(names) + 0.5) * width for k in range(len(figs))], ys, width,
                       color=COLORS.get(name), hatch="//" if side == "simulated" else None,
                       alpha=0.6 if side == "simulated" else 1.0, label=f"{name} {side}")
        ax.set_xticks(range(len(figs)), [f.replace("_act_s", "").replace("_s", "") for f in figs], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    save(fig, "figures")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        for side, style in (("measured", "-"), ("simulated", "--")):
            qs = data["policies"][name]["act_quantiles"][side]
            if qs:
                ax.plot([max(q, 1e-3) for q in qs], [i / (len(qs) - 1) for i in range(len(qs))], style,
                        color=COLORS.get(name), label=f"{name} {side}")
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "act_cdf")

    eq = data["equal_step"]
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted((t["cores"], t["step_s"], t["simulated_step_s"]) for t in eq["tries"])
    ax.plot([c for c, _, _ in pts], [s for _, s, _ in pts], "o-", color=COLORS["tangram"], label="tangram measured")
    sim = [(c, s) for c, _, s in pts if s is not None]
    if sim:
        ax.plot([c for c, _ in sim], [s for _, s in sim], "o--", color=COLORS["tangram"], alpha=0.6,
                label="tangram simulated")
    ax.axhline(eq["target_step_s"], color=COLORS.get(data["baseline"]), label=f"{data['baseline']}, all cores")
    ax.set_xlabel("Tangram's sandbox cores")
    ax.set_ylabel("step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "equal_step")
    return images


def write_report(data: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md, report.html and the PNGs into ``out_dir``; returns the paths.
    Without matplotlib the report has no plots and says so."""
    from ..report import render_html, render_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    try:
        images = plots(data, out_dir)
    except ModuleNotFoundError as e:
        images = {}
        data["plots"] = f"none: needs {e.name}"
    bl = blocks(data, images)
    (out_dir / "report.md").write_text(render_markdown(bl))
    (out_dir / "report.html").write_text(render_html(bl, "ARL-Tangram: agentic step, measured and simulated"))
    return [out_dir / n for n in ("results.json", "report.md", "report.html", *images.values())]
