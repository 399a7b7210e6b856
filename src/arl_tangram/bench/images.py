"""``tangram bench images``: task images from a registry, the issue's targets side by side (JSON).

Everything runs on this machine: Debian's distribution registry on loopback, images pushed with
``skopeo`` (``bench/taskimages.py``), a base root (Debian's packages by ``mmdebstrap``, cached;
``--base host-python`` copies the host's python3 and pytest instead; ``--base PATH`` takes a root
filesystem tar, plain or gzip-, xz- or zstd-compressed: a machine with no network or no
``mmdebstrap`` runs the Debian base from a copy of ``debian_root``'s tar) and ``tasks`` task images
over it, each adding one small Python project with its own tests as one layer. ``sections``
picks the parts to run.

* ``throughput``: one pull of the base image into an empty store (its blob's digest checked,
  its layer checked and unpacked, its ``syncfs`` behind it: the store's default; ``sync_behind_s``
  is how long after the pull that sync ended, ``pull_sync_first_s`` the pull with the sync before
  the layer appears, as imports are)
  against ``skopeo copy`` of the same image to a directory (the wire and the disk, nothing
  unpacked), ``runs`` of each alternating, medians; ``pull_throughput_vs_skopeo_copy`` at the
  top of the JSON is that ratio (``pull_unpacks_in``: where that pull unpacked the layer).
  Beside them the same pull without the ``syncfs``, and, also without it, the layer unpacked in
  a child process as the default pull does and in a thread of the pulling process (as small
  layers are; in alternating order); ``reader_phases``: the same blob from memory, the inflate
  alone, with the diff_id hash, with the tar parsed and checked, and the whole unpacking in a
  child process into tmpfs and onto the disk, wall and CPU seconds; then
  ``tar -xzf`` of the same blob (this disk's own speed at creating the layer's files), our
  client's download of the blob alone (digest checked, nothing kept), the pull into a tmpfs
  store (the disk left out), and what creating one empty file costs on this disk; the CPU
  seconds of the pull (all its threads) and of ``skopeo``. Target: 0.8x.
  Nothing made by a run is deleted before the last run: ext4 without a journal scans past
  every inode deleted in the last 30 seconds for each file it creates, so a run right after a
  deletion of ten thousand files pays for it.
* ``tasks``: the ``tasks`` images pulled into one store: layer bytes fetched and the disk the
  store's layers use, each against the base plus the task layers (target: within 5%), and how
  often the base's blob was fetched (target: once).
* ``first_session``: a session from a pulled task image and its first step, p50 over ``samples``
  (target 50 ms), and from a prewarmed one (target 15 ms).
* ``concurrent``: ``concurrent`` sessions over ``images`` task images none of which is on the
  node, opened and stepped at once (each its image's first use among them): how many times each
  blob was fetched (target: once), every step's outcome, the wall time.
* ``bad_input``: through a ``tangram serve`` subprocess, each bad input's HTTP status and answer:
  an unknown image, a registry that is down, a blob whose digest does not match, a layer with a
  path out of the root, one with a device node, a manifest of 5,000 layers, one declaring a
  petabyte, a name that is no reference; then that none of them is listed and no 5xx came but
  for the registry that is down (target: a 4xx or a clear error naming the reference).

Needs root (overlay mounts, whiteouts), bubblewrap, docker-registry and skopeo.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..managers.sandbox import layertar
from ..managers.sandbox.images import ImageStore
from ..managers.sandbox.registry import PullLimits, RegistriesConfig, pull
from ..managers.sandbox.spec import SandboxConfig
from ..runtime import Tangram
from . import taskimages
from .taskimages import (BadRegistry, Layout, Registry, compress, debian_root, host_python_root, project, push,
                         root_layer, skopeo, tar_dir, task_layer)

BASES = ("debian", "host-python")
SECTIONS = ("throughput", "tasks", "first_session", "concurrent", "bad_input")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, round(q / 100 * len(values)) - 1))], 2)


def _cache_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "arl-tangram" / "bench-images"


def _base(kind: str, cache: Path, log: Callable[[str], None]) -> tuple[bytes, tuple[bytes, str], str]:
    """The base layer's tar, its gzip blob (cached beside it: compressing it is the slow part) and
    what it is."""
    if kind not in BASES:
        path = Path(kind)
        tar = root_layer(path)
        what = f"the root filesystem tar {path.name}"
    elif kind == "debian":
        t = time.monotonic()
        tar_path = debian_root(cache)
        log(f"base: Debian root {tar_path} ({time.monotonic() - t:.0f} s)")
        tar = root_layer(tar_path)
        what = f"Debian {tar_path.name} (minbase + {', '.join(taskimages.DEBIAN_PACKAGES)})"
    else:
        tar = tar_dir(host_python_root(cache / f"host-python-{sys.version_info.major}.{sys.version_info.minor}"))
        what = "the host's python3 and pytest"
    key = hashlib.sha256(tar).hexdigest()
    packed = cache / f"base-{key[:16]}.tar.gz"
    if not packed.is_file():
        gz = shutil.which("pigz") or shutil.which("gzip")
        t = time.monotonic()
        if gz:
            data = subprocess.run([gz, "-6", "-n", "-c"], input=tar, capture_output=True, check=True).stdout
        else:
            data = compress(tar, "gzip")[0]
        packed.write_bytes(data)
        log(f"base: compressed {len(tar) >> 20} MB to {len(data) >> 20} MB ({time.monotonic() - t:.0f} s, cached)")
    return tar, (packed.read_bytes(), "application/vnd.oci.image.layer.v1.tar+gzip"), what


def run(tasks: int = 100, concurrent: int = 64, images: int = 16, samples: int = 20, runs: int = 3,
        base: str = "debian", cache: Path | None = None, log: Callable[[str], None] = print,
        sections: tuple[str, ...] = SECTIONS) -> dict:
    if os.geteuid() != 0:
        raise RuntimeError("needs root (overlay mounts and whiteouts)")
    if taskimages.MISSING:
        raise RuntimeError(f"needs {' and '.join(taskimages.MISSING)} (apt-get install -y docker-registry skopeo)")
    if base not in BASES and not Path(base).is_file():
        raise RuntimeError(f"--base: {' or '.join(BASES)} or a root filesystem tar, got {base!r}")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise RuntimeError(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    cache = _cache_dir(cache)
    cache.mkdir(parents=True, exist_ok=True)
    base_tar, base_blob, what = _base(base, cache, log)
    work = Path(tempfile.mkdtemp(prefix="tangram-bench-images-"))
    out: dict = {"base": what, "tasks": tasks, "cpus": os.cpu_count(), "inflate": layertar.INFLATE}
    # the task images: as many as the sections that run name
    wanted = max([tasks] * ("tasks" in sections) + [images] * ("concurrent" in sections)
                 + [2] * ("first_session" in sections) + [0])
    try:
        with Registry(work / "registry", access_log=True) as reg:
            layout = Layout(work / "layout")
            layout.tag("base", layout.image_of([base_tar], packed={0: base_blob}))
            push(layout, "base", f"{reg.host}/swe/base:v1")
            t = time.monotonic()
            task_tars = {}
            for n in range(wanted):
                task_tars[n] = task_layer(project(n))
                layout.tag(f"task{n}", layout.image_of([base_tar, task_tars[n]], packed={0: base_blob}))
                push(layout, f"task{n}", f"{reg.host}/swe/task{n}:v1")
            log(f"pushed the base and {wanted} task images with skopeo ({time.monotonic() - t:.0f} s)")
            regs = RegistriesConfig.from_toml({"registries": [{"host": reg.host, "insecure": True}]})
            if "throughput" in sections:
                out["throughput"] = _throughput(reg, regs, base_tar, base_blob[0], runs, work, log)
                # the target's figure, named plainly: skopeo copy's time over the pull's (a durable store)
                out["pull_throughput_vs_skopeo_copy"] = out["throughput"]["ratio_vs_skopeo"]
            if "tasks" in sections:
                out["tasks_over_one_base"] = _tasks(reg, regs, tasks, base_tar, base_blob[0], task_tars, work, log)
            if "first_session" in sections:
                out["first_session"] = _first_session(reg, regs, samples, work, log)
            if "concurrent" in sections:
                out["concurrent"] = _concurrent(reg, regs, concurrent, images, work, log)
            if "bad_input" in sections:
                out["bad_input"] = _bad_input(reg, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _throughput(reg: Registry, regs: RegistriesConfig, tar: bytes, blob: bytes, runs: int, work: Path,
                log: Callable[[str], None]) -> dict:
    ref = f"{reg.host}/swe/base:v1"
    blob_path = work / "base.tar.gz"
    blob_path.write_bytes(blob)
    files = _members(tar)
    create_us = _create_cost(work / "create-cost")
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    took: dict[str, list[float]] = {k: [] for k in ("skopeo", "pull", "pull_nosync", "tar", "download", "pull_tmpfs",
                                                     "skopeo_cpu", "pull_cpu", "sync_behind", "pull_sync_first")}
    # where the layer is unpacked, each without syncfs: in a child process as the default pull
    # does, in a thread of the pulling process (as small layers are)
    variants = [("pull_child", PullLimits(process_unpack_cpus=1)),
                ("pull_thread", PullLimits(process_unpack_bytes=1 << 62))]
    took.update({k: [] for k, _ in variants})
    for i in range(runs):
        t, c = time.perf_counter(), _cpu(resource.RUSAGE_CHILDREN)
        skopeo("copy", "-q", "--src-tls-verify=false", f"docker://{ref}", f"dir:{work / f'skopeo-{i}'}")
        took["skopeo"].append(time.perf_counter() - t)
        took["skopeo_cpu"].append(_cpu(resource.RUSAGE_CHILDREN) - c)
        def durable() -> None:
            store = ImageStore(work / f"tp-store-{i}")  # its syncfs behind the pull
            t, c = time.perf_counter(), _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
            asyncio.run(pull(ref, store, regs))
            took["pull"].append(time.perf_counter() - t)
            # its unpacking process's CPU too (a layer this large is unpacked in a child)
            took["pull_cpu"].append(_cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - c)
            t = time.perf_counter()
            store.synced()
            took["sync_behind"].append(time.perf_counter() - t)

        def sync_first() -> None:
            t = time.perf_counter()
            asyncio.run(pull(ref, ImageStore(work / f"tp-first-{i}", sync_behind=False), regs))
            took["pull_sync_first"].append(time.perf_counter() - t)
        for one in ((durable, sync_first) if i % 2 == 0 else (sync_first, durable)):  # neither always first
            one()
        t = time.perf_counter()
        asyncio.run(pull(ref, ImageStore(work / f"tp-nosync-{i}", durable=False), regs))
        took["pull_nosync"].append(time.perf_counter() - t)
        for key, limits in (variants if i % 2 == 0 else variants[::-1]):  # none always first
            t = time.perf_counter()
            asyncio.run(pull(ref, ImageStore(work / f"tp-{key}-{i}", durable=False), regs, limits=limits))
            took[key].append(time.perf_counter() - t)
        d = work / f"tar-{i}"
        d.mkdir()
        t = time.perf_counter()
        subprocess.run(["tar", "-xzf", str(blob_path), "-C", str(d)], check=False, capture_output=True)
        took["tar"].append(time.perf_counter() - t)
        took["download"].append(asyncio.run(_download_only(ref, regs)))
        if shm is not None:
            mem = ImageStore(Path(tempfile.mkdtemp(prefix="tangram-bench-pull-", dir=shm)))
            try:
                t = time.perf_counter()
                asyncio.run(pull(ref, mem, regs))
                took["pull_tmpfs"].append(time.perf_counter() - t)
                mem.synced()
            finally:
                shutil.rmtree(mem.root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in took.items() if v}
    mb = len(blob) / (1 << 20)
    result = {"blob_mb": round(mb, 1), "tar_mb": round(len(tar) / (1 << 20), 1), "files": files["files"],
              "members": files["members"], "pull_s": round(med["pull"], 3), "skopeo_copy_s": round(med["skopeo"], 3),
              "pull_unpacks_in": "a child process" if PullLimits().unpacks_in_child(len(blob)) else "a thread",
              "pull_without_syncfs_s": round(med["pull_nosync"], 3),
              "syncfs_cost_s": round(med["pull"] - med["pull_nosync"], 3),
              "sync_behind_s": round(med["sync_behind"], 3),
              "pull_sync_first_s": round(med["pull_sync_first"], 3),
              "sync_behind_speedup": round(med["pull_sync_first"] / med["pull"], 2),
              # these without syncfs
              "pull_unpacking_in_a_child_s": round(med["pull_child"], 3),
              "pull_unpacking_in_a_thread_s": round(med["pull_thread"], 3),
              "child_over_thread_speedup": round(med["pull_thread"] / med["pull_child"], 2),
              "reader_phases": _phases(blob, runs, work, shm),
              "tar_xzf_s": round(med["tar"], 3), "download_only_s": round(med["download"], 3),
              "pull_tmpfs_s": round(med["pull_tmpfs"], 3) if "pull_tmpfs" in med else None,
              "create_us_per_file": create_us, "pull_mb_per_s": round(mb / med["pull"], 1),
              "pull_cpu_s": round(med["pull_cpu"], 3), "skopeo_cpu_s": round(med["skopeo_cpu"], 3),
              "ratio_vs_skopeo": round(med["skopeo"] / med["pull"], 2),
              "ratio_vs_skopeo_without_syncfs": round(med["skopeo"] / med["pull_nosync"], 2),
              "ratio_vs_skopeo_plus_tar": round((med["skopeo"] + med["tar"]) / med["pull"], 2),
              "ratio_tmpfs_vs_skopeo": round(med["skopeo"] / med["pull_tmpfs"], 2) if "pull_tmpfs" in med else None,
              "target_ratio": 0.8, "runs": runs, "all_s": {k: [round(x, 3) for x in v] for k, v in took.items()}}
    log(f"throughput: pull {result['pull_s']} s, its sync behind it {result['sync_behind_s']} s "
        f"(syncing first: {result['pull_sync_first_s']} s; {result['pull_without_syncfs_s']} s without a sync, "
        f"{result['pull_tmpfs_s']} s into tmpfs), skopeo copy "
        f"{result['skopeo_copy_s']} s, tar -xzf {result['tar_xzf_s']} s, download alone {result['download_only_s']} s, "
        f"{create_us} us to create a file: {result['ratio_vs_skopeo']}x skopeo")
    return result


def _phases(blob: bytes, runs: int, work: Path, shm: Path | None) -> dict:
    """Where the unpacking's time goes, on the same blob from memory (no network), each ``runs``
    times, medians of wall and CPU seconds: the inflate alone (this thread), the inflate with the
    diff_id sha256 (``Inflated``: each in a thread), those with the tar parsed and every member
    checked (no writes; again with a 0.5 ms switch interval: whether the inflate and hash threads
    wait for the parsing thread's interpreter lock), and the whole unpacking in a child process
    as a pull runs it (``unpack_in_child``; the child's CPU too) into tmpfs and onto this disk."""
    import io

    from ..managers.sandbox import unpack as unpack_mod
    from ..managers.sandbox.registry.unpackproc import unpack_in_child

    took: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], object]) -> None:
        t, c = time.perf_counter(), _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
        fn()
        took.setdefault(f"{key}_s", []).append(time.perf_counter() - t)
        took.setdefault(f"{key}_cpu_s", []).append(_cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - c)

    def inflate() -> None:
        for _ in layertar.inflate(io.BytesIO(blob).read):
            pass

    def inflate_hash() -> None:
        inflated = layertar.Inflated(io.BytesIO(blob).read)
        for _ in inflated:
            pass
        inflated.digest()

    def checked_switching() -> None:  # the inflate and hash threads get the lock back within 0.5 ms
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        try:
            unpack_mod.check_layer(io.BytesIO(blob), "bench")
        finally:
            sys.setswitchinterval(old)

    places = [("disk", work)] + ([("tmpfs", shm)] if shm is not None else [])
    for i in range(runs):
        timed("inflate", inflate)
        timed("inflate_and_hash", inflate_hash)
        timed("inflate_hash_parse_and_check", lambda: unpack_mod.check_layer(io.BytesIO(blob), "bench"))
        timed("inflate_hash_parse_and_check_switch_0_5ms", checked_switching)
        for where, root in (places if i % 2 == 0 else places[::-1]):
            d = Path(tempfile.mkdtemp(prefix="tangram-bench-phase-", dir=root))
            try:
                timed(f"unpack_{where}", lambda: unpack_in_child(io.BytesIO(blob), d, "bench", None))
            finally:
                if where == "tmpfs":  # (the disk's are kept to the end: see the module's docstring)
                    shutil.rmtree(d, ignore_errors=True)
    return {k: round(statistics.median(v), 3) for k, v in took.items()}


def _cpu(who: int) -> float:
    """User and system seconds of this process (all its threads) or of its waited-for children."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _members(tar: bytes) -> dict:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        members = t.getmembers()
    return {"members": len(members), "files": sum(1 for m in members if m.isreg())}


def _create_cost(d: Path, n: int = 2000) -> float:
    """Microseconds to create one empty file on this disk (in fresh directories, as an unpacking
    does), the median of ten batches."""
    d.mkdir()
    per = []
    for b in range(10):
        sub = d / str(b)
        sub.mkdir()
        t = time.perf_counter()
        for i in range(n // 10):
            os.close(os.open(sub / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        per.append((time.perf_counter() - t) / (n // 10) * 1e6)
    return round(statistics.median(per), 1)


async def _download_only(ref: str, regs: RegistriesConfig) -> float:
    """Our client's download of the image's layer blobs, each checked against its digest, nothing kept."""
    from ..managers.sandbox.registry import parse
    from ..managers.sandbox.registry.client import RegistryClient

    r = parse(ref)
    async with RegistryClient(regs) as client:
        t = time.perf_counter()
        manifest = await client.resolve(r)
        for desc in manifest.layers:
            await client.fetch_blob(r, desc, None)
        return time.perf_counter() - t


async def _pull_all(refs: list[str], store: ImageStore, regs: RegistriesConfig, at_once: int) -> None:
    gate = asyncio.Semaphore(at_once)

    async def one(ref: str) -> None:
        async with gate:
            await pull(ref, store, regs)

    await asyncio.gather(*(one(r) for r in refs))


def _tasks(reg: Registry, regs: RegistriesConfig, tasks: int, base_tar: bytes, base_blob: bytes,
           task_tars: dict[int, bytes], work: Path, log: Callable[[str], None]) -> dict:
    store = ImageStore(work / "tasks-store")
    before = reg.blob_gets()
    t = time.perf_counter()
    asyncio.run(_pull_all([f"{reg.host}/swe/task{n}:v1" for n in range(tasks)], store, regs, 8))
    took = time.perf_counter() - t
    gets = {p: v[len(before.get(p, [])):] for p, v in reg.blob_gets().items()}
    base_digest = "sha256:" + hashlib.sha256(base_blob).hexdigest()
    task_blobs = [compress(task_tars[n], "gzip")[0] for n in range(tasks)]
    layer_digests = {base_digest} | {"sha256:" + hashlib.sha256(b).hexdigest() for b in task_blobs}
    fetched = sum(sum(v) for p, v in gets.items() if p.rsplit("/", 1)[1] in layer_digests)
    expected_fetch = len(base_blob) + sum(len(b) for b in task_blobs)
    disk = store.disk_bytes()
    expected_disk = _file_bytes(base_tar) + sum(_file_bytes(task_tars[n]) for n in range(tasks))
    result = {"images": tasks, "pull_s": round(took, 2), "layer_bytes_fetched": fetched,
              "base_plus_task_layer_bytes": expected_fetch, "fetched_ratio": round(fetched / expected_fetch, 4),
              "disk_bytes": disk, "base_plus_task_file_bytes": expected_disk,
              "disk_ratio": round(disk / expected_disk, 4),
              "base_fetched": sum(len(v) for p, v in gets.items() if p.endswith(base_digest)),
              "target": "ratios within 1 +- 0.05; the base fetched once"}
    log(f"{tasks} task images: fetched {result['fetched_ratio']}x base + task layers, disk {result['disk_ratio']}x, "
        f"base fetched {result['base_fetched']}x ({took:.1f} s)")
    return result


def _file_bytes(tar: bytes) -> int:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return sum(m.size for m in t if m.isreg())


def _config(work: Path, regs: RegistriesConfig, name: str, **kw) -> SandboxConfig:
    return SandboxConfig(warm_pool=0, warm_sessions=0, image_store=str(work / name), registries=regs,
                         memory_mb=1024, **kw)


def _first_session(reg: Registry, regs: RegistriesConfig, samples: int, work: Path,
                   log: Callable[[str], None]) -> dict:
    refs = [f"{reg.host}/swe/task{n}:v1" for n in range(2)]

    async def main() -> dict:
        cfg = _config(work, regs, "session-store", max_idle_sandboxes=samples + 8)
        async with Tangram.local(sandbox=cfg) as tg:
            for ref in refs:
                await tg.pull(ref)
                await (await tg.session(image=ref)).exec("true")  # first use: base directory, interpreter
            cold = []
            for i in range(samples):
                t = time.perf_counter()
                s = await tg.session(image=refs[i % 2])
                r = await s.exec("true")
                cold.append((time.perf_counter() - t) * 1000)
                if not r.ok:
                    raise RuntimeError(f"a session's first step failed: {r.message}")
                await s.close()
            await tg.prewarm(refs[0], samples)
            warm = []
            for _ in range(samples):
                t = time.perf_counter()
                s = await tg.session(image=refs[0])
                r = await s.exec("true")
                warm.append((time.perf_counter() - t) * 1000)
                await s.close()
            return {"cold_p50_ms": _pct(cold, 50), "prewarmed_p50_ms": _pct(warm, 50), "samples": samples,
                    "target_ms": {"cold": 50, "prewarmed": 15}}

    result = asyncio.run(main())
    log(f"first session from a pulled image: p50 {result['cold_p50_ms']} ms, prewarmed {result['prewarmed_p50_ms']} ms")
    return result


def _concurrent(reg: Registry, regs: RegistriesConfig, n: int, images: int, work: Path,
                log: Callable[[str], None]) -> dict:
    refs = [f"{reg.host}/swe/task{k}:v1" for k in range(images)]

    async def main() -> tuple[list, float, dict]:
        cfg = _config(work, regs, "concurrent-store", max_idle_sandboxes=8)
        async with Tangram.local(sandbox=cfg) as tg:
            before = reg.blob_gets()
            t = time.perf_counter()

            async def one(i: int):
                s = await tg.session(image=refs[i % images])
                r = await s.exec("cat /repo/README.md")
                await s.close()
                return r

            results = await asyncio.gather(*(one(i) for i in range(n)))
            took = time.perf_counter() - t
            gets = {p: len(v) - len(before.get(p, [])) for p, v in reg.blob_gets().items()}
            return results, took, {p: c for p, c in gets.items() if c}, tg.runtime.image_stats()

    results, took, gets, stats = asyncio.run(main())
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
    result = {"sessions": n, "images": images, "wall_s": round(took, 2), "outcomes": outcomes,
              "blobs_fetched": len(gets), "most_fetches_of_one_blob": max(gets.values(), default=0),
              "pulls": stats["pulls"], "target": "every blob fetched once"}
    log(f"{n} sessions over {images} images: {outcomes}, {len(gets)} blobs, each fetched at most "
        f"{result['most_fetches_of_one_blob']}x ({took:.1f} s)")
    return result


def _bad_input(reg: Registry, work: Path, log: Callable[[str], None]) -> dict:
    import httpx

    from .server import free_port, wait_up

    bad = BadRegistry()
    dead = f"127.0.0.1:{free_port()}"
    port = free_port()
    config = {"registries": [{"host": h, "insecure": True} for h in (reg.host, bad.host, dead)],
              "sandbox": {"image_store": str(work / "bad-store"), "warm_pool": 0, "warm_sessions": 0}}
    (work / "bad.json").write_text(json.dumps(config))
    logf = open(work / "bad-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(port), "--config",
                             str(work / "bad.json"), "--journal", str(work / "bad-journal.sqlite3"), "--fronts", "0",
                             "--sandbox-workers", "0"], stdout=logf, stderr=subprocess.STDOUT)
    cases = {"unknown image": f"{reg.host}/swe/nothing:v1", "registry down": f"{dead}/swe/base:v1",
             "digest mismatch": f"{bad.host}/bad/mismatch:v1", "path out of the root": f"{bad.host}/bad/escape:v1",
             "device node": f"{bad.host}/bad/device:v1", "5,000 layers": f"{bad.host}/bad/many:v1",
             "a petabyte declared": f"{bad.host}/bad/huge:v1"}
    out: dict = {}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, timeout_s=60, proc=proc, log=str(work / "bad-server.log"))
        with httpx.Client(base_url=url, timeout=120) as c:
            for what, ref in cases.items():
                r = c.post("/v1/actions", json={"action": {"code": "print(1)", "image": ref}})
                body = r.json()
                out[what] = {"status": r.status_code, "outcome": body.get("outcome"),
                             "message": (body.get("message") or "")[:300], "names_the_reference": ref in
                             (body.get("message") or "")}
            r = c.post("/v1/sessions", json={"image": "Not_A_Reference"})
            out["no reference"] = {"status": r.status_code, "message": r.json().get("message", "")[:300]}
            listed = [i["name"] for i in c.get("/v1/images").json()]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        bad.close()
    store = ImageStore(work / "bad-store")
    hidden = [p.name for p in (store.root / "layers").iterdir() if p.name.startswith(".")] \
        if (store.root / "layers").is_dir() else []
    out["summary"] = {"listed": listed, "hidden_left": hidden,
                      "server_errors": [w for w, v in out.items() if v["status"] >= 500],
                      "all_named": all(v.get("names_the_reference", True) for v in out.values()),
                      "target": "each a 4xx or a clear error naming the reference; nothing listed or left"}
    log("bad input: " + ", ".join(f"{w}: {v.get('outcome') or v['status']}" for w, v in out.items() if w != "summary"))
    return out
