"""What a run's fresh process costs the kernel, against restoring its pages in place:
``python -m arl_tangram.bench.forkcost``.

A python one-shot runs in a child the sandbox's zygote forked; the child writes ~300 of the
zygote's pages (copy-on-write) and is killed after its answer. At 16 CPUs that costs more kernel
time per run than at 2, and the idle CPUs aside, that is most of what 16 cores lose to 2. The
alternative is research: one process that runs a run and then puts back the pages it wrote. It
would still copy each page once, but make no process, copy no page table, and unmap nothing.
Which part is the larger one decides whether the alternative can pay. This measures both
without a sandbox.

N workers (one per CPU of the set, each allowed the whole set, as one-shots are) each hold a
``--heap-mb`` private buffer, every page resident, and loop for ``--seconds``:

- ``fork``: fork a child that writes one byte to each of ``--pages`` pages spread over the buffer,
  then exits; reap it.
- ``in_place``: write the same pages, then copy each back from a pristine copy (4 KB each): the
  floor, the pages written known for free.
- ``tracked``: write them, ask the kernel which pages were written, copy those back, and protect
  them again: userfaultfd's asynchronous write-protection (a write to a protected page is let
  through in the kernel and marks it written) read by ``PAGEMAP_SCAN`` (Linux 6.7+): the way on
  kernels without soft-dirty bits (``CONFIG_MEM_SOFT_DIRTY`` unset, as Firecracker's: ``clear_refs``
  4 marks nothing). Each iteration checks nothing was
  missed: ``restored_exactly`` says the buffer equals its pristine copy at the end.

Two more modes give the host's own ceiling for a run's process, nothing of ours in it
(``bench server --ceiling`` measures them beside its servers, round by round):

- ``spawn``: start ``bash -c 'echo 1'`` (``posix_spawn``, vfork and exec, as the runner starts a
  program), output to ``/dev/null``, and reap it: a bash one-shot's process, bare.
- ``compute``: a fixed pure-Python loop (20,000 additions): what the CPUs give work that makes no
  process, the frequency and caches of the set at full load.

With ``--timed``, one worker allowed the whole set runs the loop one iteration at a time and
says each iteration's wall time (p50, p99): the host's own floor at one request at a time for a
sandbox that makes a process a run (``bench server --floor`` measures it beside its c=1 figures).

Printed as JSON, per CPU set and mode: CPU ms an iteration (user, system, both: the workers'
own and their reaped children's) and iterations a second over all workers; with ``--timed``,
the iterations, their wall time's p50 and p99 and the CPU ms an iteration. The bookkeeping is
Python's (a C version would cost less); a process's other state (threads, mappings, descriptors)
is not in it.
"""

from __future__ import annotations

import argparse
import json
import math
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


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


UFFDIO_API = _iowr(0xAA, 0x3F, 24)  # struct uffdio_api: api, features, ioctls
UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)  # struct uffdio_register: start, len, mode, ioctls
UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, 24)  # struct uffdio_writeprotect: start, len, mode
UFFD_FEATURE_WP_UNPOPULATED, UFFD_FEATURE_WP_ASYNC = 1 << 13, 1 << 15
PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)  # struct pm_scan_arg: twelve u64 (Linux 6.7+)
PAGE_IS_WRITTEN, PM_SCAN_WP_MATCHING, PM_SCAN_CHECK_WPASYNC = 1 << 1, 1 << 0, 1 << 1
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}


class WriteWatch:
    """The pages of ``mm`` written since the last ``rearm``: userfaultfd's asynchronous
    write-protection (a write to a protected page is let through by the kernel, which marks it
    written: no fault reaches user space) read by ``PAGEMAP_SCAN``. Raises OSError where the
    kernel has neither."""

    def __init__(self, mm) -> None:
        import ctypes
        import errno
        import platform

        self._ct = ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        self._ioctl = libc.ioctl
        self._ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.size = len(mm)
        number = SYS_USERFAULTFD.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, f"userfaultfd's number on {platform.machine()}")
        self.uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK)
        if self.uffd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self.pagemap = -1
        try:
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            api = (ctypes.c_uint64 * 3)(0xAA, UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, 0)
            self._call(self.uffd, UFFDIO_API, api, "UFFDIO_API (asynchronous write-protection)")
            self._call(self.uffd, UFFDIO_REGISTER, (ctypes.c_uint64 * 4)(self.base, self.size, 1 << 1, 0),
                       "UFFDIO_REGISTER")
            self._call(self.uffd, UFFDIO_WRITEPROTECT, (ctypes.c_uint64 * 3)(self.base, self.size, 1),
                       "UFFDIO_WRITEPROTECT")
        except OSError:
            self.close()
            raise
        self._vec = (ctypes.c_uint64 * (3 * 1024))()  # up to 1,024 runs a scan; more take more scans

    def close(self) -> None:
        for fd in (self.uffd, self.pagemap):
            if fd >= 0:
                os.close(fd)
        self.uffd = self.pagemap = -1

    def _call(self, fd: int, request: int, arg, what: str) -> int:
        r = self._ioctl(fd, request, self._ct.byref(arg))
        if r < 0:
            raise OSError(self._ct.get_errno(), what)
        return r

    def written(self, rearm: bool = False) -> list[tuple[int, int]]:
        """(offset, length) of each run of written pages; ``rearm``: protect them again too."""
        flags = PM_SCAN_CHECK_WPASYNC | (PM_SCAN_WP_MATCHING if rearm else 0)
        end, at, runs, v = self.base + self.size, self.base, [], self._vec
        while at < end:  # a scan stops where its vector fills: ``walk_end`` says where
            arg = (self._ct.c_uint64 * 12)(96, flags, at, end, 0, self._ct.addressof(v), len(v) // 3, 0, 0,
                                           PAGE_IS_WRITTEN, 0, PAGE_IS_WRITTEN)
            n = self._call(self.pagemap, PAGEMAP_SCAN, arg, "PAGEMAP_SCAN")
            runs.extend((v[3 * i] - self.base, v[3 * i + 1] - v[3 * i]) for i in range(n))
            # (a full vector's walk may stop before the end of the last run it reported: seen here
            # as 512 runs reported twice in 2,048, without the max)
            at = max(arg[4], v[3 * n - 2] if n else 0)
        return runs


#: modes without a heap (``pages`` means nothing to them)
BARE = ("spawn", "compute")
SPAWNED = ("bash", "-c", "echo 1")


def _usage() -> tuple:
    """This process's and its reaped children's CPU so far (``_spent`` takes the difference)."""
    return resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)


def _spent(before: tuple) -> dict:
    """User and system seconds since ``before`` (``_usage``), this process's and its children's."""
    after = _usage()
    return {"user_s": sum(a.ru_utime - b.ru_utime for a, b in zip(after, before)),
            "system_s": sum(a.ru_stime - b.ru_stime for a, b in zip(after, before))}


def _walls(walls: list[float] | None) -> dict:
    """p50 and p99 of the iterations' wall times (``--timed``), in ms: nearest rank, as
    ``sim.metrics.percentile`` gives the servers' (not imported: a worker imports the stdlib only)."""
    if not walls:
        return {}
    walls.sort()
    rank = {q: max(0, min(len(walls) - 1, math.ceil(q / 100 * len(walls)) - 1)) for q in (50, 99)}
    return {"p50_ms": round(walls[rank[50]] * 1e3, 4), "p99_ms": round(walls[rank[99]] * 1e3, 4)}


def _bare(mode: str, seconds: float, walls: list[float] | None = None) -> dict:
    """``spawn`` or ``compute``'s loop (see the module's docstring); each iteration's wall time
    appended to ``walls`` if given."""
    import shutil

    if mode == "spawn":
        path = shutil.which(SPAWNED[0])
        if path is None:
            raise OSError(2, "no bash on PATH", SPAWNED[0])
        null = os.open(os.devnull, os.O_WRONLY)
        actions = [(os.POSIX_SPAWN_DUP2, null, 1)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    n = 0
    before = _usage()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        if mode == "spawn":
            os.waitpid(os.posix_spawn(path, list(SPAWNED), env, file_actions=actions), 0)
        else:
            x = 0
            for i in range(20_000):
                x += i
        if walls is not None:
            walls.append(time.perf_counter() - t)
        n += 1
    return {"iterations": n, **_spent(before), **_walls(walls)}


def worker(mode: str, heap_mb: int, pages: int, seconds: float, timed: bool = False) -> dict:
    """One worker's loop; returns its iterations and CPU (its own and its reaped children's), and
    with ``timed`` the p50 and p99 of its iterations' wall times."""
    import mmap

    walls: list[float] | None = [] if timed else None
    if mode in BARE:
        return _bare(mode, seconds, walls)
    # private (copy-on-write in a fork, as a heap is; ``mmap``'s default is shared) and page-aligned,
    # as write-protection wants
    buf = mmap.mmap(-1, heap_mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf[:] = os.urandom(1 << 20) * heap_mb  # every page resident (and not one shared zero page)
    stride = max(1, len(buf) // PAGE // max(pages, 1)) * PAGE
    offsets = [i * stride for i in range(pages) if i * stride < len(buf)]
    pristine = bytes(buf) if mode != "fork" else b""
    watch = WriteWatch(buf) if mode == "tracked" else None
    n = 0
    before = _usage()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        if mode == "fork":
            pid = os.fork()
            if pid == 0:
                for off in offsets:
                    buf[off] = (buf[off] + 1) & 0xFF
                os._exit(0)
            os.waitpid(pid, 0)
        elif mode == "in_place":  # the pages known: the floor
            for off in offsets:
                buf[off] = (buf[off] + 1) & 0xFF
            for off in offsets:
                buf[off:off + PAGE] = pristine[off:off + PAGE]
        else:  # tracked: the pages written found by the kernel, put back, protected again
            for off in offsets:
                buf[off] = (buf[off] + 1) & 0xFF
            for off, length in watch.written():
                buf[off:off + length] = pristine[off:off + length]
            watch.written(rearm=True)
        if walls is not None:
            walls.append(time.perf_counter() - t)
        n += 1
    if watch is not None:
        watch.close()
    out = {"iterations": n, **_spent(before), **_walls(walls)}
    if mode != "fork":
        out["restored_exactly"] = buf[:] == pristine
    return out


def _workers(cpus: list[int], count: int, mode: str, heap_mb: int, pages: int, seconds: float,
             timed: bool = False) -> list[dict]:
    """``count`` worker processes at once, each allowed every CPU of ``cpus``: their rows."""
    cmd = [sys.executable, "-m", "arl_tangram.bench.forkcost", "--worker", mode, "--heap-mb", str(heap_mb),
           "--pages", str(pages), "--seconds", str(seconds), *(["--timed"] if timed else [])]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus)) for _ in range(count)]
    return [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in procs]


def latency(cpus: list[int], mode: str, heap_mb: int, pages: int, seconds: float) -> dict:
    """One worker allowed every CPU of ``cpus``, one iteration at a time: the p50 and p99 of an
    iteration's wall time (a bare process made and reaped, for ``spawn`` and ``fork``)."""
    row = _workers(cpus, 1, mode, heap_mb, pages, seconds, timed=True)[0]
    if "error" in row:
        return row
    if not row["iterations"]:
        return {"error": f"no iteration in {seconds} s"}
    return {"iterations": row["iterations"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
            "cpu_ms": round((row["user_s"] + row["system_s"]) * 1e3 / row["iterations"], 4)}


def measure(cpus: list[int], mode: str, heap_mb: int, pages: int, seconds: float) -> dict:
    """``len(cpus)`` workers at once, each allowed every CPU of ``cpus``."""
    rows = _workers(cpus, len(cpus), mode, heap_mb, pages, seconds)
    if any("error" in r for r in rows):
        return {"workers": len(cpus), "error": next(r["error"] for r in rows if "error" in r)}
    n = sum(r["iterations"] for r in rows)
    user = sum(r["user_s"] for r in rows)
    system = sum(r["system_s"] for r in rows)
    return {"workers": len(cpus), "iterations": n, "per_s": round(n / seconds, 1),
            "cpu_ms": round((user + system) * 1e3 / max(n, 1), 4),
            "user_ms": round(user * 1e3 / max(n, 1), 4), "system_ms": round(system * 1e3 / max(n, 1), 4),
            **({"restored_exactly": all(r["restored_exactly"] for r in rows)} if mode in ("in_place", "tracked")
               else {})}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default="0-1", help="CPU sets, ';'-separated (default 0-1), e.g. '0-1;0-15'")
    ap.add_argument("--modes", default="fork,in_place,tracked", help="of fork, in_place, tracked, spawn, compute")
    ap.add_argument("--pages", default="0,300", help="pages written an iteration, comma-separated")
    ap.add_argument("--heap-mb", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--timed", action="store_true", help="one worker a set, one iteration at a time: "
                    "each iteration's wall time (p50, p99) besides the CPU")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        try:
            print(json.dumps(worker(a.worker, a.heap_mb, int(a.pages), a.seconds, a.timed)))
        except OSError as e:  # no userfaultfd, or no asynchronous write-protection, here
            print(json.dumps({"error": f"{e.strerror or e} ({e.filename or a.worker})"}))
        return
    out: dict = {"heap_mb": a.heap_mb, "seconds": a.seconds, "sets": {}}
    for text in a.cpus.split(";"):
        cpus = _cpu_set(text)
        rows = out["sets"][text] = {}
        for mode in a.modes.split(","):
            for pages in (None,) if mode in BARE else (int(p) for p in a.pages.split(",")):
                if mode != "fork" and pages == 0:
                    continue  # nothing to do
                key, what = (mode, "") if pages is None else (f"{mode}@{pages}", f" {pages:>4} pages")
                rows[key] = r = (latency if a.timed else measure)(cpus, mode, a.heap_mb, pages or 0, a.seconds)
                if "error" in r:
                    print(f"cpus {text:>6} {mode:>8}{what}: not here: {r['error']}", file=sys.stderr)
                    continue
                if a.timed:
                    print(f"cpus {text:>6} {mode:>8}{what}: p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms "
                          f"an iteration, one at a time ({r['cpu_ms']:.3f} ms CPU)", file=sys.stderr)
                    continue
                print(f"cpus {text:>6} {mode:>8}{what}: {r['cpu_ms']:.3f} ms CPU an iteration "
                      f"({r['system_ms']:.3f} system), {r['per_s']:,.0f}/s"
                      + ("" if r.get("restored_exactly", True) else "; NOT restored exactly"), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
