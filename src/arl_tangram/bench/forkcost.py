"""What a run's fresh process costs the kernel, against restoring its pages in place (issue 26):
``python -m arl_tangram.bench.forkcost``.

A python one-shot runs in a child the sandbox's zygote forked; the child writes ~300 of the
zygote's pages (copy-on-write) and is killed after its answer. At 16 CPUs that costs more kernel
time per run than at 2, and the idle CPUs aside, that is most of what 16 cores lose to 2. The
alternative is research: one process that runs a run and then puts back the pages it wrote. It
would still copy each page once, but make no process, copy no page table, and unmap nothing.
Which part is the larger one decides whether the alternative can pay. This measures both
without a sandbox.

N workers (one per CPU of the set, each allowed the whole set, as one-shots are) each hold a
``--heap-mb`` buffer, every page resident, and loop for ``--seconds``:

- ``fork``: fork a child that writes one byte to each of ``--pages`` pages spread over the buffer,
  then exits; reap it.
- ``in_place``: write the same pages, then copy each back from a pristine copy (4 KB each).

Printed as JSON, per CPU set and mode: CPU ms an iteration (user, system, both: the workers'
own and their reaped children's) and iterations a second over all workers. ``in_place`` is a
floor: the real thing must also learn which pages were written, a write-protect fault a page
and a scan of the page tables. The lent hosts' kernels (Firecracker 6.18) are built without
soft-dirty bits (``CONFIG_MEM_SOFT_DIRTY`` unset: ``clear_refs`` 4 marks nothing), so it would be
userfaultfd's asynchronous write-protection read by ``PAGEMAP_SCAN`` (Linux 6.7+), not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PAGE = 4096


def _cpu_set(text: str) -> list[int]:
    """``0-1`` or ``0-15`` or ``0,2,4``."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def worker(mode: str, heap_mb: int, pages: int, seconds: float) -> dict:
    """One worker's loop; returns its iterations and CPU (its own and its reaped children's)."""
    buf = bytearray(os.urandom(1 << 20) * heap_mb)  # every page resident (and not one shared zero page)
    stride = max(1, len(buf) // PAGE // max(pages, 1)) * PAGE
    offsets = [PAGE + i * stride for i in range(pages) if PAGE + i * stride < len(buf)]
    pristine = bytes(buf) if mode == "in_place" else b""
    n = 0
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mode == "fork":
            pid = os.fork()
            if pid == 0:
                for off in offsets:
                    buf[off] = (buf[off] + 1) & 0xFF
                os._exit(0)
            os.waitpid(pid, 0)
        else:
            for off in offsets:
                buf[off] = (buf[off] + 1) & 0xFF
            for off in offsets:
                buf[off:off + PAGE] = pristine[off:off + PAGE]
        n += 1
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    user = sum(a.ru_utime - b.ru_utime for a, b in zip(after, before))
    system = sum(a.ru_stime - b.ru_stime for a, b in zip(after, before))
    return {"iterations": n, "user_s": user, "system_s": system}


def measure(cpus: list[int], mode: str, heap_mb: int, pages: int, seconds: float) -> dict:
    """``len(cpus)`` workers at once, each allowed every CPU of ``cpus``."""
    cmd = [sys.executable, "-m", "arl_tangram.bench.forkcost", "--worker", mode, "--heap-mb", str(heap_mb),
           "--pages", str(pages), "--seconds", str(seconds)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus)) for _ in cpus]
    rows = [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in procs]
    n = sum(r["iterations"] for r in rows)
    user = sum(r["user_s"] for r in rows)
    system = sum(r["system_s"] for r in rows)
    return {"workers": len(cpus), "iterations": n, "per_s": round(n / seconds, 1),
            "cpu_ms": round((user + system) * 1e3 / max(n, 1), 4),
            "user_ms": round(user * 1e3 / max(n, 1), 4), "system_ms": round(system * 1e3 / max(n, 1), 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default="0-1", help="CPU sets, ';'-separated (default 0-1), e.g. '0-1;0-15'")
    ap.add_argument("--modes", default="fork,in_place")
    ap.add_argument("--pages", default="0,300", help="pages written an iteration, comma-separated")
    ap.add_argument("--heap-mb", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.heap_mb, int(a.pages), a.seconds)))
        return
    out: dict = {"heap_mb": a.heap_mb, "seconds": a.seconds, "sets": {}}
    for text in a.cpus.split(";"):
        cpus = _cpu_set(text)
        rows = out["sets"][text] = {}
        for mode in a.modes.split(","):
            for pages in (int(p) for p in a.pages.split(",")):
                if mode != "fork" and pages == 0:
                    continue  # nothing to do
                rows[f"{mode}@{pages}"] = r = measure(cpus, mode, a.heap_mb, pages, a.seconds)
                print(f"cpus {text:>6} {mode:>8} {pages:>4} pages: {r['cpu_ms']:.3f} ms CPU an iteration "
                      f"({r['system_ms']:.3f} system), {r['per_s']:,.0f}/s", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
