"""``tangram top``: a live terminal view of a running server (queue, utilisation, ACT per job)."""

from __future__ import annotations

import time

import httpx
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from .api import v1
from .client import TangramClient, TangramError


def snapshot(client: TangramClient) -> tuple[dict, list[v1.JobStats], dict | None]:
    """What the server shows this client: with an API key, its job's stats only (the server's
    figures and nodes are the token's: 403, shown as such)."""
    health, jobs = client.health(), client.jobs()
    try:
        cluster = client.cluster()
    except TangramError as e:
        if e.status != 403:
            raise
        cluster = None
    return health, jobs, cluster


def nodes_table(cluster: dict) -> Table:
    """One row per node: state, cores free of total, GPUs, isolation, what runs there."""
    table = Table(header_style="bold", expand=True, title=f"{cluster.get('backend', 'local')} cluster")
    for col, just in [("node", "left"), ("address", "left"), ("state", "left"), ("cores free", "right"),
                      ("GPUs", "right"), ("isolation", "left"), ("running", "right"), ("sessions", "right"),
                      ("problem", "left")]:
        table.add_column(col, justify=just)
    style = {"alive": "green", "starting": "yellow", "draining": "yellow", "drained": "blue", "dead": "red"}
    for n in cluster.get("nodes", []):
        state = f"[{style.get(n['state'], 'white')}]{n['state']}[/]"
        table.add_row(n["name"], n["address"], state, f"{n['cores_free']}/{n['cores']}", str(n["gpus"]),
                      f"{n['isolation'] or '-'}{' + cgroups ' + n['cgroups'] if n.get('cgroups') else ''}",
                      str(len(n["running"])), str(n["sessions"]), n.get("problem") or "")
    return table


def render(url: str, health: dict, jobs: list[v1.JobStats], cluster: dict | None = None) -> Group:
    if "queued" not in health:  # an API key's view: its job only
        head = (f"[bold]{url}[/]  v{health.get('version')}  (an API key: this job's figures only; the "
                "server's need its token)")
        health = {}
    else:
        cores = health.get("cores") or 1
        head = (f"[bold]{url}[/]  v{health.get('version')}  isolation {health.get('isolation')}   "
                f"queued [bold]{health['queued']}[/]  running [bold]{health['running']}[/] on {cores} cores   "
                f"sessions {health['sessions']}")
    if "session_mem_reserved_mb" in health:  # older servers do not report session memory
        head += (f"\nsession memory: {health['session_mem_used_mb']:,.0f} MB in use, "
                 f"{health['session_mem_reserved_mb']:,.0f} MB reserved of {health['memory_mb']:,} MB "
                 f"({health['sessions_placed']} sessions placed)")
        rest = health.get("rest")
        if rest:  # nor sessions at rest
            head += (f"\nsessions awake {rest['awake']:,} (at most {rest['max_awake_sessions']:,} idle), at rest "
                     f"{rest['at_rest']:,} using {rest['rest_bytes'] / (1 << 20):,.1f} of {rest['rest_disk_mb']:,} MB "
                     f"of disk; {rest['rests']:,} rests, {rest['wakes']:,} wakes, {rest['rest_failures']} failed")
        workers = health.get("sandbox_workers")
        if health.get("fronts") or workers:  # servers with helper processes
            head += f"\nprocesses: {health.get('fronts', 0)} HTTP fronts"
            if workers:
                head += f", sandbox workers {workers['up']}/{workers['total']} up"
        if health.get("head_waits_for"):
            head += (f"\nhead of the queue: waiting {health['head_waited_s']:.1f} s for "
                     f"{health['head_waits_for']}")
    table = Table(header_style="bold", expand=True)
    for col, just in [("job", "left"), ("actions", "right"), ("ok", "right"), ("failed", "right"),
                      ("timeout", "right"), ("oom", "right"), ("infra_error", "right"), ("avg ACT", "right"),
                      ("p50", "right"), ("p99", "right")]:
        table.add_column(col, justify=just)
    for j in jobs:
        o = j.outcomes

        def ms(v):
            return "-" if v is None else f"{v * 1000:,.1f} ms"

        table.add_row(j.job, f"{j.actions:,}", *(str(o.get(k, 0)) for k in
                                                 ("ok", "failed", "timeout", "oom", "infra_error")),
                      ms(j.avg_act_s), ms(j.p50_act_s), ms(j.p99_act_s))
    parts = [Panel(head, title="ARL-Tangram"), table]
    if cluster:
        parts.append(nodes_table(cluster))
    return Group(*parts)


def run(url: str, interval_s: float = 1.0, once: bool = False, token: str | None = None) -> None:
    """Redraw in place on a terminal; elsewhere (a pipe, a log file, ``watch``-less ssh) print one
    plain, timestamped snapshot per interval: Rich's live display writes nothing until it stops
    when its output is not a terminal, so ``tangram top > top.log`` stayed empty."""
    from rich.console import Console

    console = Console()
    # one attempt per frame: the next frame is the retry
    with TangramClient(url, token=token, timeout_s=5, retries=0) as client:
        if once:
            console.print(render(url, *snapshot(client)))
            return
        if not console.is_terminal:
            _plain(console, client, url, interval_s)
            return
        with Live(render(url, *snapshot(client)), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval_s)
                try:
                    live.update(render(url, *snapshot(client)))
                except (httpx.TransportError, TangramError) as e:
                    live.update(Panel(f"[red]cannot read {url}: {e}[/]"))


def _plain(console, client: TangramClient, url: str, interval_s: float) -> None:
    frame = render(url, *snapshot(client))  # an unreachable server fails here, as on a terminal
    while True:
        console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {url}")
        console.print(frame)
        console.file.flush()
        time.sleep(interval_s)
        try:
            frame = render(url, *snapshot(client))
        except (httpx.TransportError, TangramError) as e:
            frame = f"cannot read {url}: {e}"
