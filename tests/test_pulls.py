"""Images named by a registry reference, pulled on first use as part of the action, through the
real local runtime and a real registry on loopback (tests/registrykit.py): one pull shared by
every action waiting for an image, the waiting reason, failures as ``rejected`` or
``infra_error`` naming the reference, ``/metrics``, the disk budget and ``tangram image prune``,
the server config, and a real task end to end (a session from a task's image, a patch, the
project's tests). Without docker-registry and skopeo the registry tests skip naming them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from imagekit import layer_tar, python_layer
from registrykit import MISSING, Layout, Proxy, Registry, Rule, free_port, push

from arl_tangram.bench.taskimages import host_python_root, project, run_task_command, tar_dir, task_layer
from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox import pulls as pulls_module
from arl_tangram.managers.sandbox.images import ImageError, ImageStore
from arl_tangram.managers.sandbox.registry import RegistriesConfig
from arl_tangram.managers.sandbox.spec import SandboxConfig
from arl_tangram.runtime import Tangram
from arl_tangram.server.config import ConfigError, ServeConfig, load

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="overlay roots and whiteouts need root")
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)} (apt-get install -y "
                                 "docker-registry skopeo)")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


# -- the config (no registry) ----------------------------------------------------------------------

def test_the_server_config_takes_registries_and_an_image_budget_naming_bad_fields(tmp_path):
    cfg = ServeConfig.model_validate({"registries": [{"host": "127.0.0.1:5000", "insecure": True},
                                                     {"host": "docker.io", "mirrors": ["127.0.0.1:5000"]}],
                                      "images": {"max_gb": 2.5, "docker_config": "/nonexistent/config.json"},
                                      "sandbox": {"warm_pool": 1}})
    # the sandboxes carry them (to sandbox workers and nodes' agents too)
    assert cfg.sandbox.registries.host("127.0.0.1:5000").insecure and cfg.sandbox.image_max_gb == 2.5
    assert cfg.sandbox.registries.host("docker.io").mirrors == ["127.0.0.1:5000"] and cfg.sandbox.warm_pool == 1
    assert str(cfg.sandbox.registries.docker_config) == "/nonexistent/config.json"
    assert ServeConfig().sandbox.registries.registries == [] and ServeConfig().sandbox.image_max_gb is None
    # layers are on disk before they are visible unless the config says the store is a throwaway cache
    from arl_tangram.managers.sandbox.host import SandboxHost
    assert ServeConfig().sandbox.image_durable
    fast = ServeConfig.model_validate({"images": {"durable": False}, "sandbox": {"image_store": str(tmp_path)}})
    assert not fast.sandbox.image_durable and not SandboxHost(fast.sandbox).images.durable
    bad = {'[[registries]]\nhost = "a b"\n': "registries.0.host",
           '[[registries]]\nhost = "x.io"\n[[registries]]\nhost = "x.io"\n': "registries: .*two tables",
           '[[registries]]\nhost = "x.io"\nusername = "u"\n': "registries.0: .*username and password",
           '[[registries]]\nhost = "x.io"\nmirrors = ["http://m.io"]\n': "registries.0.mirrors: .*insecure",
           '[images]\nmax_gb = 0\n': "images.max_gb", '[images]\ndurable = "maybe"\n': "images.durable", '[images]\ncolour = 1\n': "images.colour"}
    for text, where in bad.items():
        path = tmp_path / "c.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"--config: {where}"):
            load(path)


def test_a_name_neither_imported_nor_a_reference_is_refused_at_once(tmp_path):
    async def main():
        cfg = SandboxConfig(warm_pool=0, warm_sessions=0, image_store=str(tmp_path / "store"))
        async with Tangram.local(sandbox=cfg) as tg:
            with pytest.raises(ImageError, match=r"no image named 'Not_A_Ref' in the store, and it is not a "
                                                 r"registry reference"):
                await tg.session(image="Not_A_Ref")
            r = await tg.run("print(1)", image="Not_A_Ref")
            assert r.outcome is Outcome.REJECTED and "not a registry reference" in r.message

    asyncio.run(main())


def test_a_node_tells_the_images_it_holds_listed_again_only_when_they_changed(tmp_path, monkeypatch):
    """What a node's agent tells its head for placement (``Pulls.present``): the store's names and
    those being pulled, under a mark that stays while nothing changed (nothing is read again)."""
    from types import SimpleNamespace

    store = ImageStore(tmp_path / "store")
    pulls = pulls_module.Pulls(SimpleNamespace(images=store))
    lists = []
    real = pulls_module._names
    monkeypatch.setattr(pulls_module, "_names", lambda s: lists.append(1) or real(s))

    def root(n: int) -> Path:
        d = tmp_path / f"root{n}"
        (d / "etc").mkdir(parents=True)
        (d / "etc" / "hello").write_text(str(n))
        return d

    async def main():
        seen = [await pulls.present()]
        store.import_path(root(0), "myimage")
        seen.append(await pulls.present())
        seen.append(await pulls.present())  # nothing changed: the same mark, no listing
        pulls.flights["docker.io/library/python:3.12"] = asyncio.get_running_loop().create_future()
        seen.append(await pulls.present())  # a pull under way counts: a session placed there joins it
        del pulls.flights["docker.io/library/python:3.12"]
        time.sleep(0.01)
        store.import_path(root(1), "127.0.0.1:5000/py/task0:v1")  # by another process: the directory changed
        seen.append(await pulls.present())
        return seen

    seen = asyncio.run(main())
    assert [sorted(names) for _, names in seen] == [
        [], ["myimage"], ["myimage"], ["docker.io/library/python:3.12", "myimage"],
        ["127.0.0.1:5000/py/task0:v1", "myimage"]]
    assert seen[1][0] == seen[2][0] and len({m for m, _ in seen}) == 4 and len(lists) == 4
    assert pulls_module.stored_names("python:3.12") == ["python:3.12", "docker.io/library/python:3.12"]
    assert pulls_module.stored_names("Not_A_Ref") == ["Not_A_Ref"]


# -- against a registry -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """A registry with py/base (the host's python, a few MB), py/task0..3 (the base and one task
    project each) and py/bad (a layer escaping the root)."""
    if MISSING:
        pytest.skip(f"needs {' and '.join(MISSING)} (apt-get install -y docker-registry skopeo)")
    d = tmp_path_factory.mktemp("pulls-origin")
    reg = Registry(d / "registry")
    lay = Layout(d / "layout")
    base = layer_tar(python_layer())
    lay.tag("base", lay.image_of([base]))
    for n in range(4):
        lay.tag(f"task{n}", lay.image_of([base, task_layer(project(n))]))
    lay.tag("bad", lay.image_of([base, layer_tar([("file", "../evil", "x")])]))
    for tag in ("base", "task0", "task1", "task2", "task3", "bad"):
        push(lay, tag, f"{reg.host}/py/{tag}:v1")
    yield reg
    reg.close()


@pytest.fixture
def proxy(origin):
    p = Proxy(origin.host)
    yield p
    p.close()


def _sandboxes(tmp_path, host: str, **kw) -> SandboxConfig:
    regs = RegistriesConfig.from_toml({"registries": [{"host": host, "insecure": True}]})
    return SandboxConfig(warm_pool=0, warm_sessions=0, image_store=str(tmp_path / "store"), registries=regs, **kw)


def _blobs(proxy: Proxy) -> dict[str, int]:
    return {p: n for p, n in proxy.hits.items() if "/blobs/" in p}


@root_only
@needs_tools
@needs_bwrap
def test_sessions_and_one_shots_naming_a_reference_share_one_pull_within_their_action(tmp_path, proxy):
    proxy.rules.append(Rule("/blobs/", ("delay", 0.3), 1000))  # so that the actions overlap their pulls
    t0, t1 = f"{proxy.host}/py/task0:v1", f"{proxy.host}/py/task1:v1"

    async def main():
        async with Tangram.local(sandbox=_sandboxes(tmp_path, proxy.host)) as tg:
            sessions = [await tg.session(image=img) for img in (t0, t0, t1, t1)]
            steps = [s.exec(python="import os; print(open('/repo/README.md').read()); print(*sorted(os.listdir('/repo')))")
                     for s in sessions]
            shots = [tg.run("print(open('/repo/pyproject.toml').read().split()[3])", image=img) for img in (t0, t1)]
            results = await asyncio.gather(*steps, *shots)
            stats = tg.runtime.image_stats()
            again = await tg.run("print('again')", image=t0)  # on the node now: no request at all
            hits = sum(proxy.hits.values())
            return results, stats, again, hits, tg.runtime.image_stats()

    results, stats, again, hits, after = asyncio.run(main())
    steps, shots = results[:4], results[4:]
    assert all(r.outcome is Outcome.OK for r in results), [(r.outcome, r.message) for r in results]
    assert [r.stdout.splitlines()[0] for r in steps] == ["# shapes0", "# shapes0", "# shapes1", "# shapes1"]
    assert "shapes0" in steps[1].stdout.split() and "shapes1" in steps[3].stdout.split()
    assert [r.stdout.strip() for r in shots] == ['"shapes0"', '"shapes1"']
    # one pull per image: every blob fetched once (two configs, the shared base, two task layers)
    assert set(_blobs(proxy).values()) == {1} and len(_blobs(proxy)) == 5, _blobs(proxy)
    assert stats["pulls"] == 2 and stats["pull_failures"] == 0 and stats["bytes_pulled"] > 0
    assert stats["pull_seconds"] > 0 and stats["disk_bytes"] > 0
    # the pull is part of the action: its setup time includes it
    assert max(r.setup_s for r in results) >= 0.3
    assert again.outcome is Outcome.OK and after["cache_hits"] > stats["cache_hits"]
    assert sum(proxy.hits.values()) == hits


@root_only
@needs_tools
@needs_bwrap
def test_an_action_waiting_for_its_pull_says_pulling_n_of_m_mb(tmp_path, proxy):
    from arl_tangram.core.action import Action
    from arl_tangram.managers.sandbox.spec import RunCode

    proxy.rules.append(Rule("/blobs/", ("delay", 1.0), 1000))
    ref = f"{proxy.host}/py/task2:v1"

    async def main():
        async with Tangram.local(sandbox=_sandboxes(tmp_path, proxy.host)) as tg:
            rt = tg.runtime
            action = Action("pull-1", "sandbox", payload=RunCode("print('ran')", image=ref), hint_s=0.1,
                            timeout_s=60)
            fut = asyncio.ensure_future(rt.submit(action))
            seen = []
            while not fut.done():
                w = rt.why_waiting("pull-1")
                if w is not None and w.reason == "image-pull":
                    seen.append(w.detail)
                await asyncio.sleep(0.05)
            return await fut, seen

    r, seen = asyncio.run(main())
    assert r.outcome is Outcome.OK and r.result.run.stdout == "ran\n"
    assert seen and all(d.startswith(f"pulling {proxy.host}/py/task2:v1") for d in seen), seen
    sized = [d for d in seen if re.search(r": \d+\.\d of \d+\.\d MB$", d)]
    assert sized, seen
    total = float(sized[-1].split(" of ")[1].split()[0])
    assert total > 0 and all(float(d.split(": ")[1].split()[0]) <= total for d in sized)


@root_only
@needs_tools
@needs_bwrap
def test_a_failed_pull_ends_the_action_naming_the_reference_rejected_or_infra_error(tmp_path, proxy):
    dead = f"127.0.0.1:{free_port()}"

    async def main():
        cfg = _sandboxes(tmp_path, proxy.host)
        cfg.registries = RegistriesConfig.from_toml({"registries": [{"host": proxy.host, "insecure": True},
                                                                    {"host": dead, "insecure": True}]})
        async with Tangram.local(sandbox=cfg) as tg:
            unknown = await tg.run("print(1)", image=f"{proxy.host}/py/nothing:v1")
            bad = await tg.run("print(1)", image=f"{proxy.host}/py/bad:v1")
            s = await tg.session(image=f"{proxy.host}/py/task0:nope")  # a reference: opened; its step pulls
            step = await s.exec("true")
            down = await tg.run("print(1)", image=f"{dead}/py/base:v1")
            proxy.rules.append(Rule("/blobs/", ("corrupt",), 1000))
            corrupt = await tg.run("print(1)", image=f"{proxy.host}/py/task3:v1")
            return unknown, bad, step, down, corrupt, tg.runtime.image_stats()

    unknown, bad, step, down, corrupt, stats = asyncio.run(main())
    assert unknown.outcome is Outcome.REJECTED and f"{proxy.host}/py/nothing:v1: not found" in unknown.message
    assert bad.outcome is Outcome.REJECTED and "py/bad:v1: layer 1" in bad.message and "escapes the root" in bad.message
    assert step.outcome is Outcome.REJECTED and "py/task0:nope: not found" in step.message
    assert down.outcome is Outcome.INFRA_ERROR and f"{dead}/py/base:v1: cannot reach {dead}" in down.message
    assert corrupt.outcome is Outcome.REJECTED and "does not match its digest" in corrupt.message
    assert stats["pull_failures"] >= 5 and stats["pulls"] == 0  # (the session's pull may have started twice)
    store = ImageStore(tmp_path / "store")
    assert store.list() == []  # nothing half-visible
    assert not [p for p in (tmp_path / "store" / "layers").iterdir() if p.name.startswith(".")]


@root_only
@needs_tools
@needs_bwrap
def test_the_disk_budget_evicts_the_least_recently_used_images_no_sandbox_uses(tmp_path, proxy, monkeypatch):
    refs = [f"{proxy.host}/py/task{n}:v1" for n in range(3)]

    async def main():
        async with Tangram.local(sandbox=_sandboxes(tmp_path, proxy.host, image_max_gb=1e-9)) as tg:
            pulls = tg.runtime.sandbox_manager().pulls
            s = await tg.session(image=refs[0])
            assert (await s.exec("true")).outcome is Outcome.OK  # awake: its root stays mounted
            for ref in refs[1:]:
                assert (await tg.run("print(1)", image=ref)).outcome is Outcome.OK
            boxes = tg.runtime.sandbox_manager().imageboxes
            for _ in range(200):  # the one-shots' sandboxes are killed after their report
                if pulls.evicting is None and len(boxes.live) <= 1:
                    break
                await asyncio.sleep(0.05)
            kept = sorted(i.name for i in ImageStore(tmp_path / "store").list())
            monkeypatch.setattr(pulls_module, "RECENT_S", 0.0)  # as if their last use were long ago
            removed = await pulls.fit()
            left = [i.name for i in ImageStore(tmp_path / "store").list()]
            before = proxy.blob_gets()
            r = await tg.run("print('back')", image=refs[1])  # pulled again on its next use
            again = proxy.blob_gets() - before
            return kept, removed, left, r, again, tg.runtime.image_stats()

    kept, removed, left, r, again, stats = asyncio.run(main())
    assert kept == sorted(refs)  # recently resolved: not evicted under the actions that named them
    assert removed == refs[1:] and left == [refs[0]]  # least recently used first; never the mounted one
    assert r.outcome is Outcome.OK and again == 2  # its config and its own layer: the base stayed
    assert stats["evicted"] == 2 and stats["disk_limit_bytes"] == 1


@root_only
@needs_tools
def test_prune_applies_the_budget_and_clears_what_killed_pulls_left(tmp_path, proxy):
    store = tmp_path / "store"
    config = tmp_path / "c.toml"
    config.write_text(f'[[registries]]\nhost = "{proxy.host}"\ninsecure = true\n')
    cli = [sys.executable, "-m", "arl_tangram.cli", "image"]
    for n in range(3):
        out = subprocess.run([*cli, "pull", f"{proxy.host}/py/task{n}:v1", "--config", str(config), "--store",
                              str(store), "--quiet"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        time.sleep(0.05)  # distinct last-use times
    dead = 2 ** 22 + 7  # no such pid
    (store / "blobs" / f".part-{dead}-abcd").write_bytes(b"half a blob")
    old = store / "blobs" / "sha256" / ("0" * 64)
    old.parent.mkdir(exist_ok=True)  # where older versions kept downloaded blobs
    old.write_bytes(b"a blob nobody unpacked")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (store / "blobs" / "locks" / ("1" * 64)).write_bytes(b"")
    (store / "layers" / f".unpack-{dead}-x").mkdir()
    listed = json.loads(subprocess.run([*cli, "ls", "--store", str(store)], capture_output=True, text=True).stdout)
    sizes = {u["name"]: u for u in listed}
    out = subprocess.run([*cli, "prune", "--store", str(store), "--max-gb", str(1e-9)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["evicted"] == [f"{proxy.host}/py/task{n}:v1" for n in range(3)]
    assert got["partial_blobs_removed"] == 1 and got["blobs_removed"] == 1 and got["hidden_removed"] == 1
    assert got["locks_removed"] >= 1 and got["disk_bytes"] == 0
    assert not list((store / "images").glob("*.json")) and not [p for p in (store / "layers").iterdir()
                                                                if p.name != "base-v1"]
    assert all(u["size_bytes"] > u["shared_bytes"] > 0 for u in sizes.values())


@pytest.mark.slow
@root_only
@needs_tools
@needs_bwrap
def test_a_real_task_end_to_end_a_session_from_its_image_a_patch_and_its_tests(tmp_path_factory, tmp_path):
    """The base: the host's python3 with pytest (tests/ use it for speed; `tangram bench images`
    uses a Debian root made from Debian's packages); three task images over it."""
    d = tmp_path_factory.mktemp("tasks")
    root = host_python_root(d / "root")
    lay = Layout(d / "layout", level=1)
    base = tar_dir(root)
    tasks = [project(n) for n in range(3)]
    with Registry(d / "registry") as reg:
        for t in tasks:
            lay.tag(f"task{t.n}", lay.image_of([base, task_layer(t)], env=["PATH=/usr/bin:/bin"]))
            push(lay, f"task{t.n}", f"{reg.host}/swe/task{t.n}:v1")
        proxy = Proxy(reg.host)
        try:
            async def main():
                async with Tangram.local(sandbox=_sandboxes(tmp_path, proxy.host, memory_mb=1024)) as tg:
                    async def one(t):
                        s = await tg.session(image=f"{proxy.host}/swe/task{t.n}:v1")
                        before = await s.exec("cd /repo && python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -n 1",
                                              timeout_s=120)
                        await s.put({"fix.patch": t.patch.encode()})
                        after = await s.exec(run_task_command(), timeout_s=120)
                        await s.close()
                        return before, after

                    return await asyncio.gather(*(one(t) for t in tasks))

            results = asyncio.run(main())
            blobs = _blobs(proxy)
        finally:
            proxy.close()
    for t, (before, after) in zip(tasks, results):
        assert before.outcome is Outcome.OK and after.outcome is Outcome.OK, (before.result.run, after.result.run)
        assert before.stdout.strip().startswith(f"{t.failing} failed, {t.tests - t.failing} passed"), before.stdout
        assert after.stdout.strip().startswith(f"{t.tests} passed"), after.stdout
    assert set(blobs.values()) == {1} and len(blobs) == 1 + 2 * len(tasks)  # the base once


@root_only
@needs_tools
@needs_bwrap
def test_over_http_the_client_names_references_and_metrics_count_the_pulls(tmp_path, proxy):
    from arl_tangram.client import TangramClient
    from servers import Server

    config = {"registries": [{"host": proxy.host, "insecure": True}], "images": {"max_gb": 10},
              "sandbox": {"image_store": str(tmp_path / "store"), "warm_pool": 0, "warm_sessions": 0}}
    server = Server(tmp_path, config=config)
    t0, t1 = f"{proxy.host}/py/task0:v1", f"{proxy.host}/py/task1:v1"
    try:
        with TangramClient(server.url) as c:
            s = c.session(image=t0)
            r = s.exec(python="print(open('/repo/README.md').read().split()[1])")
            assert (r.outcome, r.run.stdout) == ("ok", "shapes0\n"), r.message
            proxy.rules.append(Rule("/blobs/", ("delay", 1.0), 1000))
            sub = c.submit("print('one-shot')", image=t1)
            waits = []
            while True:
                got = c.get(sub.id)
                if got.state == "done":
                    break
                waits.append(got.message)
                time.sleep(0.05)
            assert got.outcome == "ok" and got.run.stdout == "one-shot\n", got.message
            assert any(m.startswith(f"waiting for pulling {t1}: ") and m.endswith(" MB") for m in waits), waits
            proxy.rules.clear()
            warm = c.prewarm(t0, 1)
            assert warm.ready == 1 and warm.image == t0
            assert {t0, t1} <= {i.name for i in c.images()}
            metrics = httpx_get(f"{server.url}/metrics")
            s.close()
    finally:
        server.stop()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("tangram_image_")}
    assert values["tangram_image_pulls_total"] == 2 and values["tangram_image_pull_failures_total"] == 0
    assert values["tangram_image_pulled_bytes_total"] > 0 and values["tangram_image_pull_seconds_total"] >= 1.0
    assert values["tangram_image_cache_hits_total"] >= 1 and values["tangram_image_disk_bytes"] > 0
    assert values["tangram_image_disk_limit_bytes"] == 10 * (1 << 30)


def httpx_get(url: str) -> str:
    import httpx

    r = httpx.get(url, timeout=30)
    r.raise_for_status()
    return r.text
