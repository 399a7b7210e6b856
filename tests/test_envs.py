"""Environments for real: sandboxes from images (read-only layers, a private writable layer),
persistent shells, fork, snapshot/restore, prewarm; and the security probes of test_sandbox.py
run again inside an image. Images are built by the tests from host executables (tests/imagekit.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import test_sandbox as host_probes
from imagekit import docker_archive, host_tools, python_layer

from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox.images import ImageError, ImageStore
from arl_tangram.managers.sandbox.manager import SandboxConfig
from arl_tangram.runtime import Tangram
from arl_tangram.runtime.api import SessionError

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.skipif(os.geteuid() != 0, reason="image sandboxes mount overlays: root only")]

TOOLS = ["/usr/bin/dash", "/usr/bin/ls", "/usr/bin/cat", "/usr/bin/sleep", "/usr/bin/nproc", "/usr/bin/wc",
         "/usr/bin/find", "/usr/bin/head", "/usr/bin/tr", "/usr/bin/sort", "/usr/bin/rm", "/usr/bin/mkdir"]
FILES = [("file", "etc/motd", "from the image\n"), ("file", "etc/gone", "deleted by the top layer\n"),
         ("dir", "usr/local/lib", 0o755)]
TOP = [("whiteout", "etc/gone"), ("file", "repo/app.py", "VERSION = 1\n"), ("symlink", "repo/motd", "/etc/motd")]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ImageStore:
    d = tmp_path_factory.mktemp("images")
    s = ImageStore(d / "store")
    sh = [("symlink", "usr/bin/sh", "dash")]
    s.import_path(docker_archive(d / "sh.tar", [host_tools(*TOOLS) + sh + FILES, TOP]), "tiny-sh")
    s.import_path(docker_archive(d / "bash.tar", [host_tools(*TOOLS, "/usr/bin/bash") + sh + FILES, TOP]),
                  "tiny-bash")
    return s


def run(store: ImageStore, coro_fn, **config):
    cfg = SandboxConfig(**{"warm_pool": 0, "image_store": str(store.root), **config})

    async def main():
        async with Tangram.local(sandbox=cfg) as tg:
            return await coro_fn(tg)

    return asyncio.run(main())


def _mount_points(pid: int) -> set[str]:
    tag = f"tangram-roots-{pid}-"
    with open("/proc/self/mountinfo") as fh:
        return {line.split()[4] for line in fh if tag in line}


_before: set[str] = set()


@pytest.fixture(autouse=True)
def _mount_baseline():
    """Mounts of a dead process whose pid this one reuses (pids wrap at 32,768 here) are not this
    test's leaks: each test counts only what appeared while it ran."""
    global _before
    _before = _mount_points(os.getpid())
    yield


def _mounts(pid: int | None = None) -> int:
    """Image roots mounted by process ``pid`` (default: this one, since this test began); other
    processes' roots (another test run on the same machine) are not ours to count."""
    if pid is None:
        return len(_mount_points(os.getpid()) - _before)
    return len(_mount_points(pid))


# -- images --------------------------------------------------------------------------------------

def test_sessions_see_the_image_and_write_only_to_their_own_layer(store):
    image_files = {p: p.read_bytes() for d in store.get("tiny-sh").layer_dirs(store) for p in d.rglob("*")
                   if p.is_file() and not p.is_symlink()}

    async def body(tg):
        one = await tg.run("import os\nprint(sorted(os.listdir('/etc')), open('/repo/motd').read().strip())",
                           image="tiny-sh")
        a, b = await tg.session(image="tiny-sh"), await tg.session(image="tiny-sh")
        wa = await a.exec("echo 'VERSION = 2' > /repo/app.py; echo pkg > /usr/local/lib/pkg.py; rm /etc/motd; "
                          "cat /repo/app.py; ls /etc")
        rb = await b.exec("cat /repo/app.py; ls /usr/local/lib; cat /etc/motd")
        await a.close()
        await b.close()
        return one, wa, rb

    one, wa, rb = run(store, body)
    assert one.outcome is Outcome.OK and one.stdout == "['motd'] from the image\n", one.stderr
    assert wa.outcome is Outcome.OK and wa.stdout == "VERSION = 2\n", wa.stderr
    assert rb.outcome is Outcome.OK and rb.stdout == "VERSION = 1\nfrom the image\n", rb.stderr
    after = {p: p.read_bytes() for d in store.get("tiny-sh").layer_dirs(store) for p in d.rglob("*")
             if p.is_file() and not p.is_symlink()}
    assert after == image_files, "a session's writes reached the image's layers"
    assert _mounts() == 0, "overlay or tmpfs mounts left behind"


def test_an_image_without_bash_gets_its_sh_and_toolchains_are_looked_up_in_the_image(store):
    async def body(tg):
        s = await tg.session(image="tiny-sh")
        shell = await s.exec("echo $0; x=1; f() { echo f$1; }")
        again = await s.exec("echo $x; f 2")
        bash = await tg.run("echo hi", "bash", image="tiny-sh")
        bash_ok = await tg.run("echo hi $BASH_VERSION | cut -c1-3", "bash", image="tiny-bash")
        unknown = await tg.run("print(1)", image="No_Such_Image")
        await s.close()
        return shell, again, bash, bash_ok, unknown

    shell, again, bash, bash_ok, unknown = run(store, body)
    assert shell.outcome is Outcome.OK and shell.stdout == "/bin/sh\n", shell.stderr
    assert again.stdout == "1\nf2\n"
    assert bash.outcome is Outcome.REJECTED and "needs bash" in bash.message
    assert bash_ok.outcome in (Outcome.OK, Outcome.FAILED) and bash_ok.result.run is not None
    assert unknown.outcome is Outcome.REJECTED and "no image named 'No_Such_Image'" in unknown.message
    with pytest.raises(ImageError, match="no image named"):
        run(store, lambda tg: tg.session(image="No_Such_Image"))


def test_the_default_image_comes_from_the_config_and_fills_the_warm_pool(store):
    async def body(tg):
        pool = tg.runtime.sandboxes.pool.idle
        for _ in range(500):
            if len(pool) >= 1:
                break
            await asyncio.sleep(0.01)
        pooled = [sb.image for sb in list(pool)]
        return pooled, await tg.run("import os\nprint(os.path.exists('/repo/app.py'))")

    pooled, r = run(store, body, image="tiny-sh", warm_pool=1)
    assert pooled == ["tiny-sh"]
    assert r.outcome is Outcome.OK and r.stdout == "True\n"
    with pytest.raises(ImageError, match="sandbox.image|no image named"):
        run(store, lambda tg: tg.run("pass"), image="No_Such_Image")


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="builds its image from the host's python3.11")
def test_an_image_with_python_runs_the_runner_and_cells_on_it_and_pip_installs_are_importable(tmp_path):
    store = ImageStore(tmp_path / "store")
    store.import_path(docker_archive(tmp_path / "py.tar", [python_layer()]), "py")

    async def body(tg):
        s = await tg.session(image="py")
        where = await s.exec(python="import sys, os\nprint(sys.executable, os.listdir('/run/tangram/host'))")
        pip = await s.exec("echo 'X = 5' > /usr/local/lib/python3.11/dist-packages/mypkg.py && "
                           "python3 -c 'import mypkg; print(mypkg.X)'")
        cell = await s.exec(python="import mypkg\nprint(mypkg.X)")
        other = await tg.run("import mypkg", image="py")
        await s.close()
        return where, pip, cell, other

    where, pip, cell, other = run(store, body)
    assert where.stdout == "/usr/bin/python3 []\n", where.stderr  # the image's python; no host /usr bound
    assert pip.stdout == "5\n" and cell.stdout == "5\n"
    assert other.outcome is Outcome.FAILED and "No module named 'mypkg'" in other.stderr


# -- persistent shells ---------------------------------------------------------------------------

@pytest.mark.parametrize("image", [None, "tiny-sh"])
def test_shell_state_persists_and_streams_stay_apart(store, image):
    async def body(tg):
        s = await tg.session(image=image)
        steps = ["mkdir -p d && cd d && export GREETING=hi && greet() { echo \"$GREETING $1\"; }",
                 "pwd; greet there; echo oops >&2; false",
                 "read line; echo got $line",
                 "sleep 30",
                 "echo still $GREETING; pwd",
                 "exit 3",
                 "echo fresh ${GREETING:-unset}; pwd"]
        out = []
        for cmd in steps:
            out.append(await s.exec(cmd, stdin=b"typed\n" if cmd.startswith("read") else None,
                                    timeout_s=1 if cmd.startswith("sleep") else 10))
        await s.close()
        return out

    setup, used, read, slept, kept, exited, fresh = run(store, body)
    assert setup.outcome is Outcome.OK
    assert used.outcome is Outcome.FAILED and used.result.run.exit_code == 1
    assert used.stdout == "/workspace/d\nhi there\n" and used.stderr == "oops\n"
    assert read.stdout == "got typed\n"
    assert slept.outcome is Outcome.TIMEOUT and slept.act_s < 4
    assert kept.outcome is Outcome.OK and kept.stdout == "still hi\n/workspace/d\n", "the timeout lost the shell"
    assert exited.result.run.exit_code == 3 and "the shell exited" in exited.message
    assert fresh.stdout == "fresh unset\n/workspace\n"


def test_a_step_busy_inside_the_shell_restarts_it_and_says_so(store):
    async def body(tg):
        s = await tg.session()
        await s.exec("export KEEP=1")
        busy = await s.exec("while :; do :; done", timeout_s=1)
        after = await s.exec("echo ${KEEP:-gone}")
        await s.close()
        return busy, after

    busy, after = run(store, body)
    assert busy.outcome is Outcome.TIMEOUT and "shell was killed" in busy.message
    assert after.outcome is Outcome.OK and after.stdout == "gone\n"


def test_a_step_that_replaces_the_shell_ends_and_the_next_step_gets_a_new_one(store):
    async def body(tg):
        s = await tg.session()
        replaced = await s.exec("echo before; exec sleep 30", timeout_s=5)
        after = await s.exec("echo after")
        await s.close()
        return replaced, after

    replaced, after = run(store, body)
    assert replaced.stdout == "before\n" and "the shell exited" in replaced.message and replaced.act_s < 2
    assert after.outcome is Outcome.OK and after.stdout == "after\n"


# -- fork, snapshot, restore, prewarm ------------------------------------------------------------

def test_fork_gives_each_child_a_private_copy_on_write_filesystem(store):
    async def body(tg):
        s = await tg.session(image="tiny-sh")
        await s.exec("echo base > /workspace/f; echo 'VERSION = 9' > /repo/app.py; rm /etc/motd")
        kids = await s.fork(3)
        writes = [await k.exec(f"cat /workspace/f /repo/app.py; ls /etc; echo child{i} > /workspace/f")
                  for i, k in enumerate(kids)]
        await s.exec("echo parent > /workspace/f")
        reads = [await k.exec("cat /workspace/f") for k in (s, *kids)]
        grandkids = await kids[0].fork(1)
        gk = await grandkids[0].exec("cat /workspace/f")
        await s.close()  # children keep the layers they stand on
        late = await kids[2].exec("cat /workspace/f /repo/app.py")
        for k in (*kids, *grandkids):
            await k.close()
        return writes, reads, gk, late

    writes, reads, gk, late = run(store, body)
    for w in writes:
        assert w.outcome is Outcome.OK and w.stdout == "base\nVERSION = 9\n", w.stdout + w.stderr
    assert [r.stdout for r in reads] == ["parent\n", "child0\n", "child1\n", "child2\n"]
    assert gk.stdout == "child0\n"
    assert late.stdout == "child2\nVERSION = 9\n"
    assert _mounts() == 0


def test_a_default_session_forks_and_snapshots_as_an_image_session_does(store, tmp_path):
    """No image: the host directories as a one-shot sees them, the workspace layered copy-on-write."""
    snap = tmp_path / "d.tar"

    async def body(tg):
        s = await tg.session()
        first = await s.exec("echo base > f; mkdir sub; echo deep > sub/g; touch /usr/x 2>&1; ls /home/user")
        kids = await s.fork(3)
        upper = [tg.runtime.sandboxes.pending_roots[k.id].upper for k in kids]
        untouched = [os.listdir(u) for u in upper]  # nothing copied at fork
        writes = [await k.exec(f"cat f sub/g; echo child{i} > f; rm sub/g") for i, k in enumerate(kids)]
        await s.exec("echo parent > f")
        reads = [(await k.exec("cat f; ls sub")).stdout for k in (s, *kids)]
        await kids[1].snapshot(snap)
        for k in (s, *kids):
            await k.close()
        restored = await tg.restore(snap)
        again = await restored.exec("cat f; ls sub; echo more > h")
        await restored.close()
        return first, untouched, writes, reads, again, restored.image

    first, untouched, writes, reads, again, image = run(store, body)
    assert first.outcome is Outcome.OK and "Read-only file system" in first.stdout and "f\nsub\n" in first.stdout
    assert untouched == [[], [], []]
    for w in writes:
        assert w.outcome is Outcome.OK and w.stdout == "base\ndeep\n", w.stdout + w.stderr
    assert reads == ["parent\ng\n", "child0\n", "child1\n", "child2\n"]
    assert again.outcome is Outcome.OK and again.stdout == "child1\n" and image is None
    assert _mounts() == 0


def test_snapshot_restores_in_another_runtime_and_bad_snapshots_are_refused(store, tmp_path):
    snap = tmp_path / "s.tar"

    async def make(tg):
        s = await tg.session(image="tiny-sh")
        await s.exec("mkdir -p /workspace/sub && echo kept > /workspace/sub/f; rm /etc/motd; "
                     "echo 'VERSION = 3' > /repo/app.py")
        kids = await s.fork(1)  # the snapshot must carry the forked layer and the child's own
        await kids[0].exec("echo child > /workspace/g")
        return await kids[0].snapshot(snap)

    assert run(store, make) == str(snap)

    async def use(tg):
        ended = []
        tg.runtime.engine.listeners.append(ended.append)
        s = await tg.restore(snap)
        restored = [(f.action.operation, f.action.trajectory, f.outcome) for f in ended]
        r = await s.exec("cat /workspace/sub/f /workspace/g /repo/app.py; ls /etc")
        await s.close()
        return r, restored, s.id

    r, restored, sid = run(store, use)
    assert restored == [("restore", sid, Outcome.OK)]  # an action on the new session, scheduled as any other
    assert r.outcome is Outcome.OK and r.stdout == "kept\nchild\nVERSION = 3\n", r.stdout + r.stderr
    bad = tmp_path / "bad.tar"
    with tarfile.open(snap) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m) if m.isreg() else None
            if m.name.endswith("sub/f"):
                m.name = "layers/0/../../escape"
            dst.addfile(m, data)
    with pytest.raises(ImageError, match="escapes the root"):
        run(store, lambda tg: tg.restore(bad))
    assert _mounts() == 0


def test_prewarm_fills_up_to_the_idle_cap_and_sessions_use_it(store):
    async def body(tg):
        first = await tg.prewarm("tiny-sh", 5)
        boxes = tg.runtime.sandboxes.imageboxes
        ready = boxes.idle()
        s = await tg.session(image="tiny-sh")
        r = await s.exec("echo ok")
        used = boxes.idle()
        await s.close()
        with pytest.raises(ImageError):
            await tg.prewarm("No_Such_Image", 1)
        return first, ready, used, r

    first, ready, used, r = run(store, body, max_idle_sandboxes=3)
    assert first.ready == 3 and "capped" in first.message and ready == 3
    assert r.outcome is Outcome.OK and used == 2


# -- the security probes of test_sandbox.py, inside an image ---------------------------------------

PROBES = ["test_no_network_not_even_a_loopback_port_on_the_host", "test_cannot_signal_a_process_outside_the_sandbox",
          "test_fork_bomb_is_contained", "test_memory_bomb_ends_as_oom", "test_cpu_hog_gets_only_its_cores",
          "test_sleeping_past_the_timeout_is_killed_in_time", "test_flooding_stdout_is_capped_and_flagged",
          "test_filling_the_disk_stops_at_the_workspace_size", "test_sessions_cannot_see_each_other",
          "test_session_state_persists_across_execs", "test_the_allocation_is_what_the_code_sees",
          "test_a_frozen_session_uses_no_cpu", "test_a_sandbox_that_dies_is_an_infra_error_not_a_user_failure"]


@pytest.mark.parametrize("probe", PROBES)
def test_security_probe_holds_inside_an_image(store, monkeypatch, probe):
    original = host_probes.run
    monkeypatch.setattr(host_probes, "run",
                        lambda fn, **cfg: original(fn, **{"image": "tiny-bash", "image_store": str(store.root),
                                                          **cfg}))
    getattr(host_probes, probe)()
    assert _mounts() == 0


def test_host_files_stay_invisible_and_image_writes_stay_private(store):
    project = Path(__file__).resolve()
    code = f"""
import os
for p in [{str(project)!r}, '/root', {str(project.parents[1])!r}]:
    print(p, os.path.exists(p))
print('home:', os.listdir('/home'), os.path.realpath('/home/user'))  # only the workspace's second name
open('/etc/evil', 'w').write('x')
print(sorted(os.listdir('/run/tangram')))
"""
    r = run(store, lambda tg: tg.run(code, image="tiny-sh"))
    assert r.outcome is Outcome.OK, r.stderr
    assert "True" not in r.stdout and "home: ['user'] /workspace" in r.stdout
    assert not os.path.exists("/etc/evil")
    assert not any((d / "etc/evil").exists() for d in store.get("tiny-sh").layer_dirs(store))
    # no python3 in the image: the host's /usr is bound read-only for the agent (as in every sandbox);
    # its package is bound at /run/tangram/inside (the base layer still holds the mount points of the
    # two files it used to be)
    assert "['host', 'inside', 'runner.py', 'shell.py']" in r.stdout


# -- the native API ----------------------------------------------------------------------------------

def test_server_sessions_in_images_fork_and_prewarm(store, tmp_path):
    import httpx
    from servers import Server

    server = Server(tmp_path, config={"sandbox": {"image_store": str(store.root), "image": "tiny-sh", "warm_pool": 0,
                                                  "max_idle_sandboxes": 2}})
    try:
        c = httpx.Client(base_url=server.url, timeout=30)
        one = c.post("/v1/actions", json={"action": {"code": "print(open('/repo/app.py').read())"}}).json()
        assert one["outcome"] == "ok" and one["run"]["stdout"] == "VERSION = 1\n\n"
        bad = c.post("/v1/sessions", json={"image": "No_Such_Image"})
        assert bad.status_code == 422 and "no image named" in bad.json()["message"]
        sid = c.post("/v1/sessions", json={"image": "tiny-bash"}).json()["session_id"]
        assert c.post(f"/v1/sessions/{sid}/exec", json={"command": "cd /repo; echo v5 > app.py"}).json()["outcome"] == "ok"
        fork = c.post(f"/v1/sessions/{sid}/fork", json={"n": 2}).json()
        assert fork["outcome"] == "ok" and len(fork["session_ids"]) == 2 and fork["fork_s"] is not None
        outs = [c.post(f"/v1/sessions/{k}/exec", json={"command": f"cat /repo/app.py; echo {k} > /repo/app.py"}).json()
                for k in fork["session_ids"]]
        assert [o["run"]["stdout"] for o in outs] == ["v5\n", "v5\n"]
        assert c.post(f"/v1/sessions/{sid}/fork", json={"n": 0}).status_code == 422
        warm = c.post("/v1/pools/prewarm", json={"image": "tiny-sh", "n": 5}).json()
        assert warm["ready"] == 2 and warm["cap"] == 2 and "capped" in warm["message"]
        assert c.post("/v1/pools/prewarm", json={"image": "No_Such_Image", "n": 1}).status_code == 422
        for k in (sid, *fork["session_ids"]):
            assert c.delete(f"/v1/sessions/{k}").status_code == 204
    finally:
        server.stop()
    assert _mounts(server.proc.pid) == 0


def test_roots_left_by_a_dead_process_are_removed(tmp_path):
    import subprocess
    import tempfile

    from arl_tangram.managers.sandbox.imagebox import remove_stale_roots
    from arl_tangram.managers.sandbox.rootfs import mount

    dead = subprocess.Popen(["true"])
    dead.wait()
    d = Path(tempfile.mkdtemp(prefix=f"tangram-roots-{dead.pid}-"))
    (d / "r0/rw").mkdir(parents=True)
    mount("tmpfs", str(d / "r0/rw"), "tmpfs", 0, "size=1m")
    assert remove_stale_roots() >= 1
    assert not d.exists()


def test_the_shell_survives_a_timeout_without_a_pid_namespace_too(store):
    async def body(tg):
        s = await tg.session()
        await s.exec("cd /tmp && X=3")
        slow = await s.exec("sleep 30", timeout_s=1)
        kept = await s.exec("echo $X $PWD")
        await s.close()
        return slow, kept

    slow, kept = run(store, body, isolation="none")
    assert slow.outcome is Outcome.TIMEOUT and "shell" not in slow.message
    assert kept.stdout == "3 /tmp\n"


def test_the_warm_pool_cannot_exceed_the_idle_cap():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="warm_pool"):
        SandboxConfig(warm_pool=10, max_idle_sandboxes=4)


def test_an_image_with_more_layers_than_one_mount_option_page_holds(tmp_path):
    store = ImageStore(tmp_path / ("store-with-a-long-path-" + "x" * 60))
    layers = [host_tools("/usr/bin/dash", "/usr/bin/cat") + [("symlink", "usr/bin/sh", "dash")]]
    layers += [[("file", f"layers/{i}", f"{i}\n"), ("whiteout", f"layers/{i - 1}")] for i in range(1, 60)]
    img = store.import_path(docker_archive(tmp_path / "many.tar", layers), "many")
    assert sum(len(str(p)) + 1 for p in img.layer_dirs(store)) > 4096

    async def body(tg):
        s = await tg.session(image="many")
        r = await s.exec("cat /layers/*")
        kids = await s.fork(1)
        k = await kids[0].exec("cat /layers/59")
        for x in (s, *kids):
            await x.close()
        return r, k

    r, k = run(store, body)
    assert r.outcome is Outcome.OK and r.stdout == "59\n", r.stderr + r.message
    assert k.stdout == "59\n"


def test_an_image_in_use_cannot_be_removed(tmp_path):
    store = ImageStore(tmp_path / "store")
    store.import_path(docker_archive(tmp_path / "a.tar", [host_tools("/usr/bin/dash") + [("file", "x", "1")]]), "busy")

    async def body(tg):
        await tg.prewarm("busy", 1)
        with pytest.raises(ImageError, match="in use"):
            store.remove("busy")

    run(store, body)
    assert store.remove("busy")  # free again once the runtime has shut down
