"""``tangram top``: a live terminal view of a running server (queue, utilisation, ACT per job)."""

from __future__ import annotations

import time

import httpx
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table


def snapshot(url: str, token: str | None = None) -> tuple[dict, list[dict]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    health = httpx.get(f"{url}/healthz", timeout=5).json()
    jobs = httpx.get(f"{url}/v1/jobs", headers=headers, timeout=5).json()
    return health, jobs


def render(url: str, health: dict, jobs: list[dict]) -> Group:
    cores = health.get("cores") or 1
    head = (f"[bold]{url}[/]  v{health.get('version')}  isolation {health.get('isolation')}   "
            f"queued [bold]{health['queued']}[/]  running [bold]{health['running']}[/] on {cores} cores   "
            f"sessions {health['sessions']}")
    table = Table(header_style="bold", expand=True)
    for col, just in [("job", "left"), ("actions", "right"), ("ok", "right"), ("failed", "right"),
                      ("timeout", "right"), ("oom", "right"), ("infra_error", "right"), ("avg ACT", "right"),
                      ("p50", "right"), ("p99", "right")]:
        table.add_column(col, justify=just)
    for j in jobs:
        o = j["outcomes"]

        def ms(v):
            return "-" if v is None else f"{v * 1000:,.1f} ms"

        table.add_row(j["job"], f"{j['actions']:,}", *(str(o.get(k, 0)) for k in
                                                       ("ok", "failed", "timeout", "oom", "infra_error")),
                      ms(j["avg_act_s"]), ms(j["p50_act_s"]), ms(j["p99_act_s"]))
    return Group(Panel(head, title="ARL-Tangram"), table)


def run(url: str, interval_s: float = 1.0, once: bool = False, token: str | None = None) -> None:
    from rich.console import Console

    console = Console()
    if once:
        console.print(render(url, *snapshot(url, token)))
        return
    with Live(render(url, *snapshot(url, token)), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval_s)
            try:
                live.update(render(url, *snapshot(url, token)))
            except httpx.TransportError as e:
                live.update(Panel(f"[red]cannot reach {url}: {e}[/]"))
