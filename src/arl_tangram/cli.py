"""``tangram``: the command line.

``tangram simulate`` compares scheduling policies on a simulated cluster; ``tangram bench`` prints
measured figures as JSON. Bad input exits with code 2 and one line naming the problem.
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .core.cluster import Cluster, scale_cluster, uniform_cluster
from .waits import DEFAULT_MAX_QUEUE_S

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="ARL-Tangram: action-level resource management for agentic RL.")
bench_app = typer.Typer(no_args_is_help=True, help="Measured figures, printed as JSON.")
app.add_typer(bench_app, name="bench")
image_app = typer.Typer(no_args_is_help=True, help="Container images for sandboxes: pull, import, list, remove.")
app.add_typer(image_app, name="image")

console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)


class WorkloadName(str, Enum):
    code_agent = "code_agent"
    mopd = "mopd"
    search = "search"
    rlvr = "rlvr"
    mixed = "mixed"


class PolicyName(str, Enum):
    tangram = "tangram"
    trajectory_static = "trajectory-static"
    task_isolated = "task-isolated"
    fifo = "fifo"
    all = "all"


def fail(message: str) -> typer.Exit:
    """Print ``message`` as it is (escaped: Rich markup ate ``[models]`` of an install hint) and
    exit 2."""
    console.print(f"[red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(2)


def _cluster(base: Cluster, cpus, cpu_nodes, gpus, gpus_per_node) -> Cluster:
    if cpus is None and cpu_nodes is None and gpus is None and gpus_per_node is None:
        return base
    c_cpus = cpus if cpus is not None else base.total_cores
    c_nodes = cpu_nodes if cpu_nodes is not None else (max(1, c_cpus // 64) if cpus is not None
                                                        else max(1, len(base.cpu_nodes)))
    c_gpus = gpus if gpus is not None else base.total_gpus
    per = gpus_per_node if gpus_per_node is not None else (base.gpu_nodes[0].gpus if base.gpu_nodes else 8)
    if c_cpus and c_nodes > c_cpus:
        raise fail(f"--cpu-nodes: {c_nodes} nodes cannot share {c_cpus} cores")
    return uniform_cluster(cpus=c_cpus, cpu_nodes=c_nodes, gpus=c_gpus, gpus_per_node=per,
                           quotas=base.quotas, models=base.models)


@app.command()
def simulate(
    workload: Optional[WorkloadName] = typer.Option(None, help="Built-in workload.", show_default="code_agent"),
    trace: Optional[Path] = typer.Option(None, help="Replay a JSONL trace instead of a built-in workload."),
    policy: PolicyName = typer.Option(PolicyName.all, help="Policy to run, or all of them side by side."),
    cpus: Optional[int] = typer.Option(None, min=0, help="CPU cores in the pool.", show_default="per workload"),
    cpu_nodes: Optional[int] = typer.Option(None, min=1, help="CPU nodes the cores are spread over."),
    gpus: Optional[int] = typer.Option(None, min=0, help="GPUs in the pool.", show_default="per workload"),
    gpus_per_node: Optional[int] = typer.Option(None, min=1, help="GPUs per node (one NVLink island each)."),
    scale: float = typer.Option(1.0, help="Multiply every pool by this (the paper compares 1x and 0.5x)."),
    steps: Optional[int] = typer.Option(None, min=1, help="RL steps per job.", show_default="2"),
    trajectories: Optional[int] = typer.Option(None, min=1, help="Trajectories per step.", show_default="per workload"),
    seed: int = typer.Option(0, help="Seed of the workload generator and the simulation."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write ACT CDFs and utilisation (PNG) here."),
    min_resources: bool = typer.Option(False, "--min-resources",
                                       help="Find each policy's smallest pool matching trajectory-static's "
                                            "step time at scale 1."),
    export_trace: Optional[Path] = typer.Option(None, help="Also write the workload as a JSONL trace here."),
    max_queue_s: float = typer.Option(DEFAULT_MAX_QUEUE_S, help="An action not started this many (simulated) "
                                                               "seconds after submission ends rejected."),
    client_remaining: bool = typer.Option(True, " /--no-client-remaining",
                                          help="Simulated clients do not send their remaining turns (the policy "
                                               "learns what it can per job)."),
) -> None:
    """Compare scheduling policies on a simulated cluster (the real engine on a virtual clock)."""
    from .sim.compare import BASELINES, comparison, run_policy
    from .sim.trace import TraceError, dump_trace, load_trace
    from .sim.workloads import generate
    from .report import plot, print_summary, results_table

    if workload is not None and trace is not None:
        raise fail("--workload and --trace: give one or the other")
    if scale <= 0 or scale != scale:
        raise fail(f"--scale: must be > 0, got {scale}")
    if not max_queue_s > 0:
        raise fail(f"--max-queue-s: must be > 0, got {max_queue_s}")
    t0 = time.perf_counter()
    if trace is not None:
        if steps is not None or trajectories is not None:
            raise fail("--steps/--trajectories: a trace fixes its own steps and trajectories")
        try:
            wl = load_trace(trace)
        except TraceError as e:
            raise fail(f"trace {e}")
    else:
        name = (workload or WorkloadName.code_agent).value
        wl = generate(name, seed=seed, steps=steps, trajectories=trajectories)
    if export_trace is not None:
        n = dump_trace(wl, export_trace)
        console.print(f"wrote {n:,} actions to {export_trace}")
    base = _cluster(wl.default_cluster, cpus, cpu_nodes, gpus, gpus_per_node)
    cluster = scale_cluster(base, scale)
    needs = _missing_pools(wl, cluster)
    if needs:
        raise fail(needs)
    policies = ["tangram", *BASELINES] if policy is PolicyName.all else [policy.value]
    desc = cluster.describe()
    pools = [f"{desc['cpus']:,} cores on {desc['cpu_nodes']} nodes" if desc["cpus"] else "",
             f"{desc['gpus']} GPUs on {desc['gpu_nodes']} nodes" if desc["gpus"] else "",
             ", ".join(f"API {n} ({q['rate_per_s']:g}/s, {q['concurrency']} in flight)"
                       for n, q in desc["quotas"].items())]
    console.print(f"[bold]{wl.name}[/]: {wl.num_actions:,} actions, {len(wl.jobs)} job(s); "
                  f"{'; '.join(p for p in pools if p)} (scale {scale:g})")
    runs = []
    with _progress() as progress:
        for p in policies:
            task = progress.add_task(p, total=wl.num_actions)
            runs.append(run_policy(wl, cluster, p, seed,
                                   progress=lambda n, task=task: progress.update(task, completed=n),
                                   max_queue_s=max_queue_s, client_remaining=client_remaining))
            progress.update(task, completed=wl.num_actions)
    rows = [r.summary for r in runs]
    cmp = comparison(rows)
    sim_wall = time.perf_counter() - t0
    out.print(results_table(f"{wl.name} — {len(policies)} policies, scale {scale:g}, seed {seed}", rows, cmp))
    print_summary(out, rows, cmp)
    console.print(f"simulated in {sim_wall:.1f} s wall time")
    report = {"workload": wl.name, "cluster": desc, "scale": scale, "seed": seed, "num_actions": wl.num_actions,
              "client_remaining": client_remaining, "wall_s": sim_wall, "results": rows, "comparison": cmp}
    if min_resources:
        report["min_resources"] = _min_resources(wl, base, policies, seed, client_remaining)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_out}")
    if plot_out is not None:
        plot([r.result for r in runs], plot_out, f"{wl.name} (scale {scale:g})")
        console.print(f"wrote {plot_out}")


def _missing_pools(wl, cluster: Cluster) -> str | None:
    services = {a.service for j in wl.jobs for s in j.steps for t in s for a in t.actions}
    if any(s == "sandbox" for s in services) and not cluster.total_cores:
        return "--cpus: this workload runs sandbox actions but the cluster has no CPU cores"
    if any(s.startswith("model:") for s in services) and not cluster.total_gpus:
        return "--gpus: this workload runs model actions but the cluster has no GPUs"
    return None


def _min_resources(wl, base: Cluster, policies: list[str], seed: int, client_remaining: bool = True) -> dict:
    from .sim.compare import min_scale, run_policy

    ref = run_policy(wl, base, "trajectory-static", seed, client_remaining=client_remaining).summary
    target = ref.get("avg_step_s")
    result = {"reference": "trajectory-static", "reference_step_s": target, "policies": {}}
    if target is None:
        result["error"] = f"trajectory-static is infeasible at scale 1: {ref.get('infeasible')}"
        return result
    with _progress() as progress:
        task = progress.add_task("min-resources", total=None)
        for p in policies:
            progress.update(task, description=f"min-resources: {p}")
            s = min_scale(wl, base, p, target, seed=seed, client_remaining=client_remaining,
                          on_try=lambda pol, sc, st: progress.update(task, description=f"{pol} @ {sc:.3f}"))
            result["policies"][p] = {"min_scale": s, "resource_savings": None if s is None else round(1 - s, 4)}
    from rich.table import Table

    table = Table(title=f"Smallest pool matching trajectory-static's step time at scale 1 ({target:.1f} s)",
                  title_justify="left", header_style="bold")
    table.add_column("policy")
    table.add_column("min scale", justify="right")
    table.add_column("resource savings", justify="right")
    for p, v in result["policies"].items():
        table.add_row(p, "-" if v["min_scale"] is None else f"{v['min_scale']:.3f}",
                      "-" if v["resource_savings"] is None else f"{v['resource_savings']:.1%}")
    out.print(table)
    return result


def _progress() -> Progress:
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise fail(f"--{name}: expected comma-separated numbers, got {text!r}")
    if not vals or any(not v > 0 for v in vals):
        raise fail(f"--{name}: expected numbers > 0, got {text!r}")
    return vals


@app.command()
def evaluate(
    out_dir: Path = typer.Option(Path("tangram-report"), "--out", help="Directory for report.md/.html, PNGs, JSON."),
    quick: bool = typer.Option(False, "--quick", help="Small workloads, 2 scales, 2 seeds: a smoke run for CI."),
    workloads: Optional[str] = typer.Option(None, help="Comma-separated built-in workloads.", show_default="all"),
    trace: Optional[list[Path]] = typer.Option(None, help="Also evaluate a JSONL trace (repeatable)."),
    scales: Optional[str] = typer.Option(None, help="Comma-separated pool scales.", show_default="0.125,0.25,0.5,1,2"),
    seeds: Optional[int] = typer.Option(None, min=1, help="Seeds 0..N-1 per point.", show_default="3"),
    workers: Optional[int] = typer.Option(None, min=1, help="Worker processes.", show_default="min(2, cores)"),
    min_resources: bool = typer.Option(True, " /--no-min-resources",
                                       help="Skip the smallest-pool searches (resources at equal step time)."),
    client_remaining: bool = typer.Option(True, " /--no-client-remaining",
                                          help="Simulated clients do not send their remaining turns (the policy "
                                               "learns them per job)."),
) -> None:
    """Every workload x pool scale x seed x policy, in parallel; writes a report directory."""
    from dataclasses import replace

    from .report import write_evaluation_report
    from .sim.evaluate import QUICK, Plan, default_workers, evaluate as run_evaluation
    from .sim.trace import TraceError, load_trace
    from .sim.workloads import WORKLOADS

    plan = QUICK if quick else Plan()
    changes: dict = {"min_resources": min_resources, "client_remaining": client_remaining}
    names = list(plan.workloads)
    if workloads is not None:
        names = [w.strip() for w in workloads.split(",") if w.strip()]
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown or not names:
            raise fail(f"--workloads: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(WORKLOADS)})")
    for t in trace or ():
        try:
            load_trace(t)
        except TraceError as e:
            raise fail(f"--trace {e}")
        names.append(str(t.resolve()))
    changes["workloads"] = tuple(names)
    if scales is not None:
        changes["scales"] = _floats(scales, "scales")
    if seeds is not None:
        changes["seeds"] = tuple(range(seeds))
    plan = replace(plan, **changes)
    n_workers = workers or default_workers()
    cells = len(plan.workloads) * len(plan.scales) * len(plan.seeds) * len(plan.policies)
    console.print(f"[bold]evaluate[/]: {len(plan.workloads)} workloads x {len(plan.scales)} scales x "
                  f"{len(plan.seeds)} seeds x {len(plan.policies)} policies = {cells} simulations"
                  f"{' + min-resource searches' if plan.min_resources else ''} on {n_workers} processes")
    with _progress() as progress:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total)
            progress.update(tasks[phase], completed=done)

        ev = run_evaluation(plan, n_workers, progress=update)
    data = ev.to_json()
    paths = write_evaluation_report(data, out_dir)
    h = data["headline"]
    from .report import headline_rows
    from rich.table import Table

    table = Table(title=f"Headline ({ev.wall_s:.0f} s on {n_workers} processes)", title_justify="left",
                  header_style="bold")
    for col in ("figure", "paper", "this sweep", "where"):
        table.add_column(col)
    for row in headline_rows(h):
        table.add_row(*row[:4])
    out.print(table)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    if ev.errors:
        for e in ev.errors:
            console.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(1)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (a token is required off loopback)."),
    port: int = typer.Option(8080, min=1, max=65535, help="Port to listen on."),
    config: Optional[Path] = typer.Option(None, help="A TOML or JSON file with a ServeConfig."),
    token: Optional[str] = typer.Option(None, envvar="TANGRAM_TOKEN", help="Bearer token clients must send."),
    journal: Optional[Path] = typer.Option(None, help="SQLite journal of accepted actions.",
                                           show_default="from config, else ~/.local/state/arl-tangram/journal.sqlite3"),
    record: Optional[Path] = typer.Option(None, help="Write every finished action to this JSONL trace (replay it "
                                                     "with tangram simulate --trace)."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS",
                                      help="Schedule the sandboxes of every node of this Ray cluster (auto or "
                                           "HOST:PORT) instead of this machine's."),
    fronts: Optional[int] = typer.Option(None, min=0, max=64,
                                         help="HTTP front processes beside the engine process (0: one process).",
                                         show_default="from config, else 0 on 2 cores or fewer, one per 4 cores up to 8"),
    sandbox_workers: Optional[int] = typer.Option(None, "--sandbox-workers", min=0, max=64,
                                                  help="Processes that carry out one-shot runs beside the "
                                                       "engine process.",
                                                      show_default="from config, else as --fronts"),
) -> None:
    """Serve the SandboxFusion-compatible and native APIs over this machine or a Ray cluster."""
    import ipaddress
    import logging

    import uvicorn

    from .server.app import KEEP_ALIVE_S
    from .server.config import ConfigError, ServeConfig, build, build_service, load
    from .runtime.host import helper_processes
    from .server.fronts import listen
    from .server.fronts import serve as serve_with_fronts

    try:
        cfg = load(config) if config is not None else ServeConfig()
    except ConfigError as e:
        raise fail(str(e))
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not token and not cfg.api_keys:
        raise fail(f"--token: serving on {host} (not loopback) requires a bearer token (or api_keys in --config)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sandbox_workers is not None:
        cfg = cfg.model_copy(update={"sandbox_workers": sandbox_workers})
    n = fronts if fronts is not None else cfg.fronts
    if n is None:
        n = helper_processes(len(os.sched_getaffinity(0)))
    if n == 0:
        try:
            app = build(cfg, token=token, journal=journal, ray=ray, record=record)
        except Exception as e:  # isolation unavailable, unwritable journal: say it, exit 2
            raise fail(str(e))
        console.print(f"ARL-Tangram serving on http://{host}:{port} (docs at /docs, SandboxFusion at /run_code)")
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(cfg.drain_s) + 5,
                    timeout_keep_alive=KEEP_ALIVE_S)
        return
    try:
        sock = listen(host, port)
    except OSError as e:
        raise fail(f"--port: cannot listen on {host}:{port}: {e.strerror}")
    try:
        service = build_service(cfg, journal=journal, ray=ray, record=record)
    except Exception as e:
        raise fail(str(e))
    console.print(f"ARL-Tangram serving on http://{host}:{port} with {n} HTTP front processes (docs at /docs, "
                  "SandboxFusion at /run_code)")
    serve_with_fronts(service, sock, n, token, int(cfg.max_body_mb * (1 << 20)), cfg.drain_s, cfg.keys(),
                      settings=cfg.dialect_settings())


@app.command()
def top(
    url: str = typer.Option("http://127.0.0.1:8080", help="The server to watch."),
    interval: float = typer.Option(1.0, min=0.1, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    token: Optional[str] = typer.Option(None, envvar="TANGRAM_TOKEN",
                                        help="Bearer token of the server (a job's API key: that job only)."),
) -> None:
    """A live view of a running server: queue, ACT percentiles per job, its nodes."""
    import httpx

    from .client import TangramError
    from .top import run

    try:
        run(url, interval, once, token)
    except httpx.TransportError as e:
        raise fail(f"--url: cannot reach {url} ({e})")
    except TangramError as e:
        raise fail(f"--url: {url} answered {e}")
    except KeyboardInterrupt:
        pass


@bench_app.command("scheduler")
def bench_scheduler(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    nodes: int = typer.Option(1000, min=1, help="CPU nodes in the pool (64 cores each)."),
    seconds: float = typer.Option(2.0, min=0.01, help="Measuring time per run."),
    repeats: int = typer.Option(3, min=1, help="Runs per queue depth; the rates are their median."),
) -> None:
    """Policy + engine decisions per second at queue depths 1,000 / 10,000 / 100,000."""
    from .bench.scheduler import run

    _print_json(run(nodes=nodes, seconds=seconds, log=lambda m: console.print(m), repeats=repeats), json_out)


@bench_app.command("sandbox")
def bench_sandbox(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    samples: int = typer.Option(30, min=3, help="Actions per latency figure."),
) -> None:
    """Sandbox latencies (cold, warm, session exec) and throughput on this machine, then the
    environment figures of `tangram bench envs` (under "environments")."""
    from .bench.envs import run as run_envs
    from .bench.sandbox import run

    result = run(samples, log=lambda m: console.print(m))
    result["environments"] = run_envs(max(3, samples // 3), log=lambda m: console.print(m))
    _print_json(result, json_out)


@bench_app.command("sandbox-cpu")
def bench_sandbox_cpu(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    cases: str = typer.Option("python,bash", help="Comma-separated: python, bash."),
    requests: int = typer.Option(1000, min=10, help="Trivial one-shots measured per case."),
    concurrency: int = typer.Option(8, min=1, help="One-shots in flight."),
    warmup: int = typer.Option(200, min=0, help="One-shots run first, not measured."),
) -> None:
    """Where a trivial one-shot's sandbox CPU goes, by process (the sandbox's cgroup, bwrap,
    runner, zygote, children), through the real manager, as ms per one-shot."""
    from .bench.sandbox_cpu import run

    chosen = tuple(c for c in cases.split(",") if c)
    bad = [c for c in chosen if c not in ("python", "bash")]
    if bad or not chosen:
        raise typer.BadParameter(f"unknown case(s) {', '.join(bad) or '(none)'}: choose python, bash", param_hint="--cases")
    _print_json(run(chosen, requests, concurrency, warmup, log=lambda m: console.print(m)), json_out)


@bench_app.command("zygote")
def bench_zygote(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    runs: int = typer.Option(300, min=10, help="One-shots per measurement."),
    rounds: int = typer.Option(3, min=1, help="Alternating measurements of each mode."),
    gap_ms: float = typer.Option(2.0, "--gap-ms", min=0.0, help="Idle time after each run (the sandbox in its pool)."),
    code: str = typer.Option("print(1)", help="The one-shot's program (e.g. 'raise ValueError(1)': a failing one)."),
) -> None:
    """A python one-shot's child alone (the sandbox runner's zygote, outside a sandbox): forked on
    demand vs forked ahead, run latency, CPU and page faults, as ratios."""
    from .bench.zygote import run

    _print_json(run(runs, rounds, gap_ms / 1000, log=lambda m: console.print(m), code=code), json_out)


@bench_app.command("spawn")
def bench_spawn(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    ballast_mb: int = typer.Option(100, "--ballast-mb", min=0, help="Memory the starting process holds beside its "
                                   "own (a server's heap)."),
    starts: int = typer.Option(20, min=3, help="Sandboxes started per measurement."),
    rounds: int = typer.Option(3, min=1, help="Alternating measurements of each way."),
) -> None:
    """A sandbox's start from a large server process: the loop's fork (uvloop's subprocess) against
    vfork (how sandboxes start now): the starter's CPU and page faults, time to ready, loop stalls."""
    from .bench.spawn import run

    _print_json(run(ballast_mb, starts, rounds, log=lambda m: console.print(m)), json_out)


@bench_app.command("envs")
def bench_envs(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    samples: int = typer.Option(10, min=3, help="Samples per latency figure."),
    workspace_mb: int = typer.Option(200, min=1, help="Workspace size written before the fork."),
    children: int = typer.Option(8, min=1, max=256, help="Children per fork."),
) -> None:
    """Image session start, fork(N) of a large workspace, snapshot/restore, persistent-shell steps."""
    from .bench.envs import run

    _print_json(run(samples, workspace_mb, children, log=lambda m: console.print(m)), json_out)


@bench_app.command("e2e")
def bench_e2e(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    trajectories: int = typer.Option(6, min=1, help="Concurrent agent trajectories."),
    turns: int = typer.Option(8, min=1, help="Actions per trajectory."),
    seed: int = typer.Option(0, help="Seed of the workload."),
) -> None:
    """A miniature code-agent run on this machine's cores, Tangram vs trajectory-static."""
    from .bench.e2e import run

    _print_json(run(trajectories, turns, seed, log=lambda m: console.print(m)), json_out)


@bench_app.command("agentic")
def bench_agentic(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    device: str = typer.Option("cpu", help="cuda or cpu: where the teacher and reward models run."),
    groups: Optional[int] = typer.Option(None, min=1, help="GRPO groups (default: 2 x cores / k)."),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="Trajectories per group (default: 2 on cpu, 4 on cuda)."),
    turns: Optional[int] = typer.Option(None, min=1, help="Turns per trajectory, give or take one."),
    seed: int = typer.Option(0, help="Seed of the workload."),
    cores: Optional[int] = typer.Option(None, min=1, help="Sandbox cores (default: this process's CPUs)."),
    search_runs: int = typer.Option(3, "--search-runs", min=0, help="Real runs of the equal-step search at most."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="A directory for results.json, report.md/.html, "
                                                               "plots and the traces."),
) -> None:
    """A real GRPO-style step (sandboxes, teacher and reward models, a judge API) under Tangram and
    trajectory-static on the same cores and device, with the simulator's replay of its trace."""
    if device not in ("cpu", "cuda"):
        raise fail(f"--device: expected cpu or cuda, got {device!r}")
    from .bench.agentic import run

    try:
        result = run(device, groups, k, turns, seed, cores, search_runs, out_dir, log=lambda m: console.print(m))
    except ValueError as e:
        raise fail(str(e))
    _print_json(result, json_out)


def _check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda"):
        raise fail(f"--device: expected auto, cpu or cuda, got {device!r}")


def _sections(given: str | None, known: Sequence[str]) -> tuple[str, ...]:
    """``--sections``: the parts named (default: all), each one a bench knows."""
    picked = tuple(x for x in (given or ",".join(known)).split(",") if x)
    unknown = sorted(set(picked) - set(known))
    if unknown:
        raise fail(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return picked


@bench_app.command("models")
def bench_models(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    device: str = typer.Option("auto", help="cuda, cpu, or auto."),
    requests: Optional[int] = typer.Option(None, min=12, help="Requests in the MOPD-style run."),
    sections: Optional[str] = typer.Option(None, help="Comma-separated parts (default all): h2d, throughput, hf, "
                                                      "mopd, dedicated, ttfs, multigpu."),
    shares: Optional[str] = typer.Option(None, help="Shared MOPD runs: compute shares, e.g. 1,0.0833."),
    dedicated_gpus: int = typer.Option(1, "--dedicated-gpus", min=1, help="Dedicated replays at once, one per GPU."),
) -> None:
    """Host-to-device bandwidth, batched vs unbatched scoring, HF services, 12 services sharing vs dedicated."""
    _check_device(device)
    from .bench.models import SECTIONS, run

    picked = _sections(sections, SECTIONS)
    _print_json(run(device, log=lambda m: console.print(m), requests=requests, sections=picked,
                    shares=shares.split(",") if shares else None, dedicated_gpus=dedicated_gpus), json_out)


@bench_app.command("modelapi")
def bench_modelapi(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    device: str = typer.Option("auto", help="cuda, cpu, or auto."),
    sections: Optional[str] = typer.Option(None, help="Comma-separated parts (default all): overhead, decode."),
    requests: int = typer.Option(300, min=10, help="Overhead: requests per route."),
    shape: Optional[str] = typer.Option(None, help="Decode: tiny, qwen2.5-0.5b or qwen2.5-1.5b, random weights "
                                                   "(default: qwen2.5-0.5b on CUDA, tiny on CPU)."),
    batches: str = typer.Option("1,32", help="Decode: comma-separated batch sizes."),
    new_tokens: int = typer.Option(128, "--new-tokens", min=1, help="Decode: tokens each row generates."),
    prompt_len: int = typer.Option(32, "--prompt-len", min=1, help="Decode: prompt tokens per row."),
    runs: int = typer.Option(3, min=1, help="Decode: timed runs of each way, alternating (medians)."),
    dtype: Optional[str] = typer.Option(None, help="Decode: float32, bfloat16 or float16 (default: bfloat16 on "
                                                   "CUDA, float32 on CPU)."),
    bandwidth_gbps: Optional[float] = typer.Option(None, "--bandwidth-gbps", min=0.001, help="Decode: the "
                                                   "device's memory bandwidth for the bound (default: a copy's)."),
) -> None:
    """The model protocols' added ms per request over the native API, and decode tokens/s vs transformers."""
    _check_device(device)
    from .bench.modelapi import SECTIONS, SHAPES, run

    picked = _sections(sections, SECTIONS)
    if shape is not None and shape not in SHAPES:
        raise fail(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise fail(f"--dtype: float32, bfloat16 or float16, got {dtype!r}")
    try:
        sizes = tuple(int(b) for b in batches.split(",") if b)
    except ValueError:
        raise fail(f"--batches: comma-separated integers, got {batches!r}") from None
    _print_json(run(device, picked, requests, shape, sizes, new_tokens, prompt_len, runs, dtype, bandwidth_gbps,
                    log=lambda m: console.print(m)), json_out)


@bench_app.command("server")
def bench_server(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    levels: Optional[str] = typer.Option(None, help="Comma-separated concurrencies (default 1,8,32,1000; "
                                                    "with --against 1,8)."),
    against: Optional[str] = typer.Option(None, "--against", help="Base URL of another SandboxFusion-compatible "
                                                                  "server: the same cases run against it in "
                                                                  "the same run and both are printed."),
    cases: Optional[str] = typer.Option(None, help="Comma-separated cases: python, bash, cpu_200ms (default "
                                                  "python; with --against all three)."),
    cpu_jobs: int = typer.Option(32, "--cpu-jobs", min=1, help="Concurrent 200 ms CPU jobs in cpu_200ms."),
    server_cpus: Optional[str] = typer.Option(None, "--server-cpus", help="Pin tangram's server to these CPUs "
                                                                          "(taskset list, e.g. 0-1)."),
    client_procs: int = typer.Option(1, "--client-procs", min=1, help="Load-generator processes (one Python "
                                                                      "client tops out near 800 req/s)."),
    variant: Optional[list[str]] = typer.Option(None, "--variant", help="NAME=CPUS:FRONTS[:WORKERS[:CORES]][@SRC], "
                                                "repeatable: several tangram servers measured in turn in one run "
                                                "(e.g. --variant two=0-1: --variant all=:), the first being the "
                                                "reference; CORES: the cores it schedules (its config's cores, may "
                                                "exceed its CPUs: over=0-15:::32); an empty "
                                                "part is the server's default; @SRC runs another checkout's code "
                                                "(its src directory, run as the bench runs: with ARL_TANGRAM_PURE=1 both "
                                                "sides' sources, e.g. --variant main=::@../main/src --variant this=::; "
                                                "without it, each side's compiled hot path where built in place)."),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Repeat the whole plan, the servers alternating (in the "
                               "reverse order every other round): each figure is then the round of median "
                               "throughput, every round listed beside it."),
    requests: Optional[int] = typer.Option(None, min=1, help="Requests per case and level (default: 5 per "
                                           "concurrent client, at least 40)."),
    client: Optional[str] = typer.Option(None, help="Load generator: aiohttp (default where installed: ~0.1 ms "
                                         "of CPU a request) or httpx (~1.6 ms)."),
    cpu: bool = typer.Option(False, "--cpu", help="Also give each tangram result its CPU per request by part: "
                             "engine process, HTTP fronts, sandbox workers, sandboxes (ms)."),
    ceiling: float = typer.Option(0.0, "--ceiling", min=0.0, help="Seconds: after each round, measure each "
                                  "pinned variant's CPUs bare for that long a loop (a fork, a bash spawned, "
                                  "pure computation, one worker a CPU), and give each ratio as a share of the "
                                  "host's own (host_ceiling)."),
    floor: float = typer.Option(0.0, "--floor", min=0.0, help="Seconds: after each round, time each "
                                "server's CPUs for that long a loop, one iteration at a time: a bash spawned, a "
                                "python child forked (each reaped), 20,000 additions; and give each python or "
                                "bash c=1 p50 beside its case's bare one (host_floor; needs 1 in --levels)."),
) -> None:
    """/run_code latency and throughput over loopback HTTP, beside the same actions in-process or
    beside another SandboxFusion-compatible server (--against)."""
    from .bench.server import CLIENTS, parse_variant, run

    if client is not None and client not in CLIENTS:
        raise fail(f"--client: expected one of {', '.join(CLIENTS)}, got {client!r}")
    try:
        variants = [parse_variant(v) for v in variant or ()]
    except ValueError as e:
        raise fail(f"--variant: {e}")

    if ceiling and (len(variants) < 2 or any(not v[1] for v in variants)):
        raise fail("--ceiling: give two or more --variant, each with its CPUs (e.g. all=0-15: two=0-1:)")
    try:
        parsed = tuple(int(x) for x in (levels or ("1,8" if against else "1,8,32,1000")).split(","))
    except ValueError:
        raise fail(f"--levels: expected comma-separated integers, got {levels!r}")
    chosen = tuple((cases or ("python,bash,cpu_200ms" if against else "python")).split(","))
    unknown = set(chosen) - {"python", "bash", "cpu_200ms"}
    if unknown:
        raise fail(f"--cases: unknown {', '.join(sorted(unknown))} (known: python, bash, cpu_200ms)")
    if against is not None and not against.startswith(("http://", "https://")):
        raise fail(f"--against: expected an http(s) URL, got {against!r}")
    _print_json(run(parsed, log=lambda m: console.print(m), against=against, cases=chosen, cpu_jobs=cpu_jobs,
                    server_cpus=server_cpus, client_procs=client_procs, variants=variants or None, requests=requests,
                    client=client, cpu=cpu, rounds=rounds, ceiling=ceiling, floor=floor),
                json_out)


@bench_app.command("cluster")
def bench_cluster(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    nodes: str = typer.Option("1,2,3", help="Comma-separated node counts of the loopback Ray clusters "
                              "(empty: no scaling or chaos run)."),
    cores: int = typer.Option(1, min=1, help="CPUs each node gives the cluster."),
    actions: int = typer.Option(150, min=1, help="One-shots per scaling run."),
    work_ms: float = typer.Option(0.0, min=0, help="CPU time each one-shot burns (0: a trivial program)."),
    chaos: int = typer.Option(300, min=0, help="One-shots of the chaos run (a node removed mid-run); 0 skips it."),
    gpu_nodes: int = typer.Option(0, min=0, help="Nodes of one GPU each for the model chaos run (a node's agent "
                                  "killed with teacher calls in flight; with CUDA node i gets GPU i); 0 skips it."),
    model_calls: int = typer.Option(400, min=3, help="Teacher calls of the model chaos run."),
    model_device: str = typer.Option("auto", help="cuda, cpu (CPU devices stand in for GPUs) or auto."),
    drain_sessions: int = typer.Option(50, min=0, help="Sessions on the node drained by the drain run (their "
                                       "moves to a node that joined); 0 skips it."),
    restart_sessions: int = typer.Option(20, min=0, help="Sessions held by `tangram serve --ray` when it is "
                                         "killed with -9 and started again (the restart run); 0 skips it."),
    per_core: int = typer.Option(4, "--per-core", min=1, help="Requests in flight per node core (scaling, hops, "
                                 "local, sessions' revisits)."),
    hops: int = typer.Option(1000, min=0, help="One-shots of each node count's hop-by-hop probe under load (a head "
                             "in the bench's process); 0 skips it."),
    hops_alone: int = typer.Option(100, "--hops-alone", min=1, help="One-shots of the probe one at a time."),
    profiled: int = typer.Option(500, "--profiled", min=0, help="One-shots of the probe under load with the head's "
                                 "main thread profiled (its CPU by owner: engine, runtime, Ray, asyncio); 0 skips it."),
    local: bool = typer.Option(True, "--local/--no-local", help="The same load on `tangram serve` without Ray "
                               "pinned to the largest cluster's sandbox cores."),
    sessions: int = typer.Option(0, "--sessions", min=0, help="Sessions opened over the largest cluster, each "
                                 "revisited under load and a sample alone (revisit p50/p99); 0 skips it."),
    session_sample: int = typer.Option(100, "--session-sample", min=0, help="Sessions revisited one at a time."),
) -> None:
    """The Ray backend: scaling over nodes, a node killed mid-run, the engine's cost at 64 nodes,
    a node of --drain-sessions sessions drained, the head killed with -9 holding --restart-sessions
    sessions and started again, and (--gpu-nodes) model services with a GPU node's agent killed
    mid-run."""
    from .bench.cluster import run  # first: it keeps the loopback clusters' addresses on 127.0.0.1

    try:
        parsed = tuple(int(x) for x in nodes.split(",")) if nodes.strip() else ()
    except ValueError:
        raise fail(f"--nodes: expected comma-separated integers, got {nodes!r}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise fail("bench cluster needs Ray: pip install 'arl-tangram[ray]'")
    if model_device not in ("auto", "cuda", "cpu"):
        raise fail(f"--model-device: expected auto, cuda or cpu, got {model_device!r}")
    _print_json(run(parsed, cores, actions, work_ms, chaos_actions=chaos, log=lambda m: console.print(m),
                    gpu_nodes=gpu_nodes, model_calls=model_calls, model_device=model_device,
                    drain_sessions=drain_sessions, restart_sessions=restart_sessions, per_core=per_core, hops=hops,
                    hops_alone=hops_alone, compare_local=local, sessions=sessions, session_sample=session_sample,
                    profiled=profiled),
                json_out)


@bench_app.command("sessions")
def bench_sessions(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    sessions: int = typer.Option(1000, "--sessions", "--n", min=1, help="Sessions to open and keep."),
    concurrency: int = typer.Option(16, min=1, help="Concurrent clients when opening and revisiting."),
    over: int = typer.Option(150, min=1, help="Session attempts against a 1 GB server, past its capacity."),
    max_awake: int = typer.Option(256, "--max-awake", min=0, help="The server's sandbox.max_awake_sessions (256: "
                                  "~3.4 GB of awake sessions, bounded on a shared host; the default is 640)."),
    rest_after: float = typer.Option(30.0, "--rest-after", min=0, help="The server's sandbox.rest_after_s."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Another checkout's src directory: the same "
                                            "run against a server from it first, then this/baseline ratios."),
) -> None:
    """Session density over HTTP: open N sessions with a small state, revisit each (one at a time,
    then concurrently), idle memory per session, and refusals past capacity."""
    from .bench.sessions import run

    if baseline is not None and not (baseline / "arl_tangram" / "__init__.py").is_file():
        raise fail(f"--baseline: {baseline} is not a src directory holding arl_tangram")
    _print_json(run(sessions, concurrency, over, log=lambda m: console.print(m), max_awake=max_awake,
                    rest_after_s=rest_after, baseline=str(baseline.resolve()) if baseline else None), json_out)


@bench_app.command("e2b")
def bench_e2b(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    samples: int = typer.Option(30, min=1, help="Calls per latency figure."),
    open_n: int = typer.Option(200, "--open", min=1, help="Sandboxes to open at once, each with a small state."),
    open_concurrency: int = typer.Option(50, "--open-concurrency", min=1,
                                         help="Of those, how many are being created at a time."),
) -> None:
    """E2B's own SDK against a local server: create + first command, commands.run("true"), 1 MB
    write + read, run_code (p50/p90), and N sandboxes open at once."""
    from .bench.e2b import run

    try:
        _print_json(run(samples, open_n, log=lambda m: console.print(m), open_concurrency=open_concurrency),
                    json_out)
    except RuntimeError as e:
        raise fail(str(e))


@bench_app.command("images")
def bench_images(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    tasks: int = typer.Option(100, min=1, help="Task images over the one base (each one project as one layer)."),
    concurrent: int = typer.Option(64, min=1, help="Sessions opened at once over --images images not on the node."),
    images: int = typer.Option(16, min=1, help="Images those sessions name."),
    samples: int = typer.Option(20, min=3, help="Sessions per first-session latency figure."),
    runs: int = typer.Option(3, min=1, help="Pulls (and skopeo copies) of the base for the throughput figure."),
    base: str = typer.Option("debian", help="debian (Debian's packages by mmdebstrap, cached), host-python (the "
                                            "host's python3 and pytest, copied) or the path of a root filesystem "
                                            "tar (.tar, .tar.gz, .tar.xz, .tar.zst: debian's, carried)."),
    cache: Optional[Path] = typer.Option(None, help="Where the base root and its compressed layer are kept.",
                                         show_default="$XDG_CACHE_HOME/arl-tangram/bench-images"),
    sections: Optional[str] = typer.Option(None, help="Comma-separated parts (default all): throughput, tasks, "
                                                      "first_session, concurrent, bad_input."),
) -> None:
    """Task images from a registry on loopback: pull throughput vs skopeo copy, N task images over
    one base (bytes fetched, disk used), first session from a pulled image, concurrent sessions
    over images not on the node, and bad inputs through a server. Needs root, bubblewrap,
    docker-registry and skopeo (and mmdebstrap for the Debian base)."""
    from .bench.images import SECTIONS, run

    picked = _sections(sections, SECTIONS)
    try:
        _print_json(run(tasks, concurrent, images, samples, runs, base, cache, log=lambda m: console.print(m),
                        sections=picked), json_out)
    except RuntimeError as e:
        raise fail(str(e))


@bench_app.command("daytona")
def bench_daytona(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the JSON here."),
    samples: int = typer.Option(30, min=1, help="Calls per latency figure."),
    open_n: int = typer.Option(200, "--open", min=1, help="Sandboxes to open at once, each with a small state."),
    open_concurrency: int = typer.Option(50, "--open-concurrency", min=1,
                                         help="Of those, how many are being created at a time."),
) -> None:
    """Daytona's own SDK against a local server: create + first exec, exec("true"), code_run, a
    session command, 1 MB upload + download, list_files (p50/p90), and N sandboxes open at once."""
    from .bench.daytona import run

    try:
        _print_json(run(samples, open_n, log=lambda m: console.print(m), open_concurrency=open_concurrency),
                    json_out)
    except RuntimeError as e:
        raise fail(str(e))


_STORE_HELP = "Image cache directory."
_STORE_DEFAULT = "$TANGRAM_IMAGE_STORE, else ~/.local/share/arl-tangram/images"


@image_app.command("import")
def image_import(
    path: Path = typer.Argument(..., help="A `docker save` or OCI archive, or a root filesystem directory."),
    name: str = typer.Option(..., "--name", help="Name to give the image (sessions ask for it by this name)."),
    store: Optional[Path] = typer.Option(None, help=_STORE_HELP, show_default=_STORE_DEFAULT),
) -> None:
    """Import an image: every layer is checked, then unpacked once into the layer cache."""
    from .managers.sandbox.images import ImageError, ImageStore

    t = time.perf_counter()
    try:
        img = ImageStore(store).import_path(path, name)
    except ImageError as e:
        raise fail(str(e))
    except PermissionError as e:
        raise fail(f"--store: {e} (unpacking whiteouts needs root)")
    out.print_json(json.dumps({"name": img.name, "id": img.id, "layers": list(img.layers),
                               "size_bytes": img.size_bytes, "import_s": round(time.perf_counter() - t, 3)}))


@image_app.command("pull")
def image_pull(
    ref: str = typer.Argument(..., help="A registry reference: python:3.12 (Docker Hub), ghcr.io/org/repo:tag, "
                              "host:port/name@sha256:..."),
    config: Optional[Path] = typer.Option(None, "--config", help="A server config (TOML or JSON) whose "
                                          "[[registries]] tables say how to reach registries (mirrors, insecure "
                                          "hosts, credentials)."),
    store: Optional[Path] = typer.Option(None, help=_STORE_HELP, show_default=_STORE_DEFAULT),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Pull an image from a registry into the store: layers already there are not fetched, every
    blob is checked against its digest and every layer as `import` checks it. Sessions then ask
    for it by its full reference (printed as "name")."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from .managers.sandbox.images import ImageError, ImageStore
    from .managers.sandbox.registry import pull_sync

    registries = _images_config(config).sandbox.registries
    fetched: dict[int, int] = {}
    states: dict[int, str] = {}
    bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=console, disable=quiet, transient=False)
    tasks: dict[int, object] = {}

    def on_event(e) -> None:
        if e.index < 0:
            return
        states[e.index] = e.state
        if e.state == "downloading":
            fetched[e.index] = e.done
        if e.index not in tasks:
            tasks[e.index] = bars.add_task("", total=e.size or None)
        done = e.size if e.state in ("cached", "unpacking", "done") else e.done
        bars.update(tasks[e.index], completed=done, description=f"{e.digest[7:19]} {e.state:<11}")

    t = time.perf_counter()
    try:
        with bars:
            img = pull_sync(ref, ImageStore(store), registries, on_event)
    except ImageError as e:
        raise fail(str(e))
    except PermissionError as e:
        raise fail(f"--store: {e} (unpacking whiteouts needs root)")
    out.print_json(json.dumps({"name": img.name, "id": img.id, "digest": img.digest, "layers": list(img.layers),
                               "size_bytes": img.size_bytes, "fetched_bytes": sum(fetched.values()),
                               "cached_layers": sum(1 for s in states.values() if s == "cached"),
                               "pull_s": round(time.perf_counter() - t, 3)}))


@image_app.command("prune")
def image_prune(
    config: Optional[Path] = typer.Option(None, "--config", help="A server config (TOML or JSON): its "
                                          "images.max_gb is the budget applied."),
    max_gb: Optional[float] = typer.Option(None, "--max-gb", min=0, help="Remove the least recently used images "
                                           "no sandbox uses until the store's layers fit in this many GB "
                                           "(default: the config's images.max_gb; none: no image is removed)."),
    grace_s: float = typer.Option(600.0, "--grace-s", min=0, help="Leave layers no image names and downloaded "
                                  "blobs younger than this (a pull under way may be about to use them)."),
    store: Optional[Path] = typer.Option(None, help=_STORE_HELP, show_default=_STORE_DEFAULT),
) -> None:
    """Apply the disk budget, and clear what killed pulls and imports left: partial blobs and
    hidden directories of processes that are gone, layers no image uses, downloaded blobs and
    lock files nobody holds. Prints what was removed and the disk the images use now."""
    from .managers.sandbox.images import ImageError, ImageStore
    from .managers.sandbox.registry import prune

    if max_gb is None and config is not None:
        max_gb = _images_config(config).images.max_gb
    try:
        got = prune(ImageStore(store), int(max_gb * (1 << 30)) if max_gb is not None else None, grace_s)
    except ImageError as e:
        raise fail(str(e))
    out.print_json(json.dumps(got))


def _images_config(config: Optional[Path]):
    """The server config at ``config`` (its [[registries]] and [images]), or the defaults."""
    from .server.config import ConfigError, ServeConfig, load

    try:
        return load(config) if config is not None else ServeConfig()
    except ConfigError as e:
        raise fail(str(e))


@image_app.command("ls")
def image_ls(store: Optional[Path] = typer.Option(None, help=_STORE_HELP, show_default=_STORE_DEFAULT)) -> None:
    """List the images: each one's size (its layers' file bytes) and how much of it is shared with
    other images (layers of the same digest, on disk once)."""
    from .managers.sandbox.images import ImageError, ImageStore

    try:
        usage = ImageStore(store).usage()
    except ImageError as e:
        raise fail(str(e))
    out.print_json(json.dumps([{"name": u["name"], "id": u["id"][:12], "layers": u["layers"],
                                "size_bytes": u["size_bytes"], "shared_bytes": u["shared_bytes"],
                                "source": u["source"]} for u in usage]))


@image_app.command("rm")
def image_rm(name: str = typer.Argument(..., help="The image to remove."),
             store: Optional[Path] = typer.Option(None, help=_STORE_HELP, show_default=_STORE_DEFAULT)) -> None:
    """Remove an image and the layers no other image uses (do it while no server uses the image)."""
    from .managers.sandbox.images import ImageError, ImageStore

    try:
        gone = ImageStore(store).remove(name)
    except ImageError as e:
        raise fail(str(e))
    out.print_json(json.dumps({"removed": name, "layers_deleted": len(gone)}))


def _print_json(result: dict, json_out: Optional[Path]) -> None:
    text = json.dumps(result, indent=2)
    out.print_json(text)
    if json_out is not None:
        json_out.write_text(text)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
