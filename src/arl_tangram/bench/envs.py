"""Environment figures on this machine, through the real local runtime (printed as JSON).

* session start from an image: a new session's first step (``true``), cold (the overlay root is
  mounted and the sandbox started on demand) and prewarmed (``Tangram.prewarm`` first); the
  host-directories sandbox's cold start beside it
* fork(8) of a session with a 200 MB workspace: the fork action's ACT, and inside it the pause
  (stopping the source's processes) and the copy-on-write part (freezing the writable layer,
  mounting nine new roots); what the children's writable layers hold right after (should be ~0);
  a child's first step (its sandbox starts then)
* snapshot of that session to a file and restore into a new session (restore + first step)
* the same fork(8) of a *default* session (no image: its workspace is layered over the host's
  directories, ``rootfs.HOST_IMAGE``), and what that layering costs: the spawn of a layered default
  sandbox (what a new default session takes) beside a plain one (what one-shots keep), interleaved
* over HTTP (a ``tangram serve`` subprocess, the sync client): a default session's fork(8),
  snapshot (``POST /v1/sessions/{id}/snapshot``) and restore (``POST /v1/sessions {"restore"}``) plus
  the restored session's first step, p50 of ``samples``
* persistent-shell step p50 (host sandbox and image), beside a python-cell step

The image is built here from host executables (dash and a few coreutils) into a temporary store,
so nothing is downloaded and the user's store is untouched. Needs root (overlay mounts).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..managers.sandbox.images import ImageStore
from ..managers.sandbox.spec import SandboxConfig
from ..runtime import Tangram

TOOLS = ("/usr/bin/dash", "/usr/bin/true", "/usr/bin/cat", "/usr/bin/ls")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, round(q / 100 * len(values)) - 1))], 2)


def build_image(store: ImageStore, name: str = "bench") -> None:
    """A root filesystem of dash and a few tools with their libraries, imported as ``name``."""
    root = Path(tempfile.mkdtemp(prefix="tangram-bench-rootfs-"))
    try:
        for d in ("usr/bin", "usr/lib", "usr/lib64", "etc", "workspace"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            os.symlink(target, root / link)
        for exe in TOOLS:
            if not os.path.exists(exe):
                continue
            shutil.copy2(os.path.realpath(exe), root / "usr/bin" / os.path.basename(exe))
            out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
            for word in out.split():
                if word.startswith("/") and os.path.exists(word):
                    dest = root / ("usr" + word if not word.startswith("/usr/") else word[1:]).lstrip("/")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(os.path.realpath(word), dest)
        os.symlink("dash", root / "usr/bin/sh")
        (root / "etc/motd").write_text("bench image\n")
        store.import_path(root, name)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _upper_bytes(tg: Tangram, trajectories: list[str]) -> int:
    """Bytes held by the writable layers of these sessions' roots (tmpfs usage)."""
    mgr = tg.runtime.sandboxes
    total = 0
    for t in trajectories:
        root = mgr.pending_roots.get(t)
        if root is None and t in mgr.sessions and mgr.sessions[t].rootfs is not None:
            root = mgr.sessions[t].rootfs
        if root is not None:
            st = os.statvfs(root.rw)
            total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


async def _measure(samples: int, workspace_mb: int, children: int, log: Callable[[str], None], store: ImageStore
                   ) -> dict:
    result: dict = {"workspace_mb": workspace_mb, "children": children}
    cfg = SandboxConfig(image_store=str(store.root), warm_pool=0, warm_sessions=0, workspace_mb=max(256, workspace_mb * 2),
                        memory_mb=max(512, workspace_mb * 3), max_idle_sandboxes=samples + 8)
    async with Tangram.local(sandbox=cfg) as tg:
        await (await tg.session(image="bench")).exec("true")  # first use: base layer, interpreter choice
        cold, host = [], []  # image and host-directories sandboxes, interleaved (the machine is shared)
        for _ in range(samples):
            for image, into in (("bench", cold), (None, host)):
                t = time.perf_counter()
                s = await tg.session(image=image)
                r = await s.exec("true")
                into.append((time.perf_counter() - t) * 1000)
                assert r.ok, r.message
                await s.close()
        result["image_session_start_cold_p50_ms"] = _pct(cold, 50)
        result["host_session_start_cold_p50_ms"] = _pct(host, 50)
        log(f"image session start (cold) p50 {result['image_session_start_cold_p50_ms']} ms; host sandbox "
            f"{result['host_session_start_cold_p50_ms']} ms")
        await tg.prewarm("bench", samples)
        warm = []
        for _ in range(samples):
            t = time.perf_counter()
            s = await tg.session(image="bench")
            r = await s.exec("true")
            warm.append((time.perf_counter() - t) * 1000)
            assert r.ok, r.message
            await s.close()
        result["image_session_start_prewarmed_p50_ms"] = _pct(warm, 50)
        log(f"image session start (prewarmed) p50 {result['image_session_start_prewarmed_p50_ms']} ms")

        steps: dict[str, list[float]] = {"shell_host": [], "shell_image": [], "python_cell": []}
        host, img = await tg.session(), await tg.session(image="bench")
        await host.exec("cd /tmp")
        await img.exec("cd /tmp")
        for _ in range(samples * 3):
            for key, sess, kw in (("shell_host", host, {"command": "echo $PWD"}),
                                  ("shell_image", img, {"command": "echo $PWD"}),
                                  ("python_cell", host, {"python": "x = 1"})):
                t = time.perf_counter()
                r = await sess.exec(**kw)
                steps[key].append((time.perf_counter() - t) * 1000)
                assert r.ok, r.message
        await host.close()
        await img.close()
        for key, vals in steps.items():
            result[f"{key}_step_p50_ms"] = _pct(vals, 50)
        log(f"shell step p50: host {result['shell_host_step_p50_ms']} ms, image {result['shell_image_step_p50_ms']} "
            f"ms; python cell {result['python_cell_step_p50_ms']} ms")

        mgr = tg.runtime.sandboxes
        if mgr.layered:
            spawns: dict[str, list[float]] = {"plain": [], "layered": []}
            for _ in range(samples * 2):
                for key, spawn in (("plain", mgr.pool.spawn), ("layered", mgr.spares.spawn)):
                    t = time.perf_counter()
                    sb = await spawn()
                    spawns[key].append((time.perf_counter() - t) * 1000)
                    await sb.kill()
            result["spawn_plain_p50_ms"] = _pct(spawns["plain"], 50)
            result["spawn_layered_p50_ms"] = _pct(spawns["layered"], 50)
            result["spawn_layered_over_plain"] = round(result["spawn_layered_p50_ms"] / result["spawn_plain_p50_ms"], 3)
            log(f"default sandbox spawn p50: plain {result['spawn_plain_p50_ms']} ms (one-shots), layered "
                f"{result['spawn_layered_p50_ms']} ms (sessions): x{result['spawn_layered_over_plain']}")
        for image, prefix in (("bench", ""), (None, "default_")):
            if image is None and not mgr.layered:
                break
            await _forks(tg, image, prefix, workspace_mb, children, result, log)
    return result


async def _forks(tg: Tangram, image: str | None, prefix: str, workspace_mb: int, children: int, result: dict,
                 log: Callable[[str], None]) -> None:
    forks, firsts = [], []
    snap_dir = tempfile.mkdtemp(prefix="tangram-bench-snap-")
    try:
        for rep in range(3):
            s = await tg.session(image=image)
            code = (f"import os\nos.makedirs('/workspace/data', exist_ok=True)\nblock = os.urandom(1 << 20)\n"
                    f"for i in range({workspace_mb}):\n"
                    f"    open(f'/workspace/data/f{{i % 50}}-{{i}}', 'wb').write(block)")
            r = await s.exec(python=code, timeout_s=120)
            assert r.ok, r.stderr or r.message
            t = time.perf_counter()
            kids = await s.fork(children)
            act = (time.perf_counter() - t) * 1000
            info = s.last_fork
            forks.append({"act_ms": round(act, 2), "pause_ms": round(info["pause_s"] * 1000, 2),
                          "cow_ms": round(info["cow_s"] * 1000, 2), "fork_ms": round(info["fork_s"] * 1000, 2)})
            if rep == 0:
                result[prefix + "children_upper_bytes_after_fork"] = _upper_bytes(tg, [k.id for k in kids])
                for k in kids:
                    t = time.perf_counter()
                    r = await k.exec("true")
                    firsts.append((time.perf_counter() - t) * 1000)
                    assert r.ok, r.message
                t = time.perf_counter()
                path = await kids[0].snapshot(os.path.join(snap_dir, "s.tar"))
                result[prefix + "snapshot_s"] = round(time.perf_counter() - t, 3)
                result[prefix + "snapshot_bytes"] = os.path.getsize(path)
                t = time.perf_counter()
                restored = await tg.restore(path)
                result[prefix + "restore_s"] = round(time.perf_counter() - t, 3)
                t = time.perf_counter()
                r = await restored.exec("true")
                result[prefix + "restored_first_step_ms"] = round((time.perf_counter() - t) * 1000, 2)
                assert r.ok, r.message
                await restored.close()
            for k in (s, *kids):
                await k.close()
    finally:
        shutil.rmtree(snap_dir, ignore_errors=True)
    result[prefix + "fork"] = forks
    result[prefix + "fork_act_p50_ms"] = _pct([f["act_ms"] for f in forks], 50)
    result[prefix + "fork_cow_p50_ms"] = _pct([f["cow_ms"] for f in forks], 50)
    result[prefix + "fork_child_first_step_p50_ms"] = _pct(firsts, 50)
    log(f"{prefix or 'image '}fork({children}) of {workspace_mb} MB: ACT p50 {result[prefix + 'fork_act_p50_ms']} ms "
        f"(copy-on-write part {result[prefix + 'fork_cow_p50_ms']} ms); child's first step p50 "
        f"{result[prefix + 'fork_child_first_step_p50_ms']} ms")
    log(f"snapshot {result[prefix + 'snapshot_s']} s ({result[prefix + 'snapshot_bytes'] >> 20} MB), restore {result[prefix + 'restore_s']} s")


def _over_http(samples: int, workspace_mb: int, children: int, tmp: str, log: Callable[[str], None]) -> dict:
    from ..client import TangramClient
    from .sessions import _Server

    server = _Server(tmp, {"sandbox": {"workspace_mb": max(256, workspace_mb * 2),
                                       "memory_mb": max(512, workspace_mb * 3)}})
    forks, snaps, restores = [], [], []
    try:
        with TangramClient(server.url) as c:
            for _ in range(samples):
                s = c.session()
                r = s.exec(python=f"import os\nblock = os.urandom(1 << 20)\nfor i in range({workspace_mb}):\n"
                                  f"    open(f'f{{i}}', 'wb').write(block)", timeout_s=120)
                assert r.outcome == "ok", r.message
                t = time.perf_counter()
                kids = s.fork(children)
                forks.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                snap = s.snapshot()
                snaps.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                back = c.restore(snap.snapshot)
                r = back.exec("ls | wc -l")
                restores.append((time.perf_counter() - t) * 1000)
                assert r.outcome == "ok" and r.run.stdout.strip() == str(workspace_mb), r
                for x in (s, *kids, back):
                    x.close()
                c.delete_snapshot(snap.snapshot)
    finally:
        server.stop()
    out = {"fork_p50_ms": _pct(forks, 50), "snapshot_p50_ms": _pct(snaps, 50),
           "restore_and_first_step_p50_ms": _pct(restores, 50), "workspace_mb": workspace_mb, "children": children}
    log(f"over HTTP, a default session of {workspace_mb} MB: fork({children}) p50 {out['fork_p50_ms']} ms, snapshot "
        f"{out['snapshot_p50_ms']} ms, restore + first step {out['restore_and_first_step_p50_ms']} ms")
    return out


def run(samples: int = 10, workspace_mb: int = 200, children: int = 8,
        log: Callable[[str], None] = lambda m: None) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "image sandboxes need root (overlay mounts)"}
    tmp = Path(tempfile.mkdtemp(prefix="tangram-bench-store-"))
    try:
        store = ImageStore(tmp / "store")
        t = time.perf_counter()
        build_image(store)
        import_s = time.perf_counter() - t
        result = asyncio.run(_measure(samples, workspace_mb, children, log, store))
        result["image_build_and_import_s"] = round(import_s, 3)
        result["http"] = _over_http(samples, workspace_mb, children, str(tmp), log)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
