"""Sessions at rest (issue #25): an idle session's python state and files go to disk, its
processes end, and its next step wakes it with the state exactly as it was, or says what it lost."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import pytest

from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox.spec import Files, SandboxConfig
from arl_tangram.runtime import NoRoom, Tangram
from arl_tangram.runtime.local import LocalRuntime
from arl_tangram.server.service import Service

from runnerkit import PRELUDE, run_with_runner
from servers import Server, alive

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

STATE = '''
import json, collections
from os import path as ospath
n = 42
big = 2 ** 100
s = "héllo\\n"
xs = list(range(1000))
d = {"a": [1, 2, {"b": (3, 4)}], 5: None}
alias = xs
def f(x, k=3, *, m=1): return x * k * m + n
def outer():
    hits = []
    def inner(v):
        hits.append(v)
        return len(hits)
    return inner
counter_fn = outer()
counter_fn("first")
lam = lambda y: y + n
class Point:
    __slots__ = ("x", "y")
    def __init__(self, x, y): self.x, self.y = x, y
    def norm(self): return self.x ** 2 + self.y ** 2
class Sub(Point):
    tag = "sub"
    def norm(self): return super().norm() + 1
class Plain:
    def __init__(self): self.items = {"k": [1]}
p = Sub(3, 4)
plain = Plain()
c = collections.Counter("aab")
import os
os.chdir("/workspace/sub") if os.path.isdir("/workspace/sub") else None
os.environ["MY_VAR"] = "kept"
'''

CHECK = '''
import os
assert n == 42 and big == 2 ** 100 and s == "héllo\\n"
assert xs == list(range(1000)) and alias is xs
assert d == {"a": [1, 2, {"b": (3, 4)}], 5: None}
assert f(2) == 48 and f(2, k=1, m=2) == 46 and f.__defaults__ == (3,) and f.__kwdefaults__ == {"m": 1}
hits = counter_fn.__closure__[0].cell_contents
assert hits[0] == "first" and counter_fn("again") == len(hits)  # the closure's list, still shared
assert lam(1) == 43
assert p.norm() == 26 and isinstance(p, Point) and type(p) is Sub and Sub.tag == "sub"
assert plain.items == {"k": [1]} and type(plain) is Plain
assert c["a"] == 2 and json.dumps([1]) == "[1]" and ospath.join("a", "b") == "a/b"
assert os.getcwd() == "/workspace/sub" and os.environ["MY_VAR"] == "kept"
print(open("/workspace/sub/data.txt").read(), open("/tmp/scratch").read(), os.readlink("/workspace/link"))
'''


def _config(**kw) -> SandboxConfig:
    return SandboxConfig(warm_pool=2, **{"rest_after_s": 0, **kw})


async def _rest(tg: Tangram, trajectory: str) -> None:
    manager = tg.runtime.sandbox_manager()
    assert await manager.rest(trajectory)
    assert manager.session_state(trajectory) == "at_rest"


def test_a_woken_session_has_every_kind_of_value_exactly_as_it_left_them():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            s = await tg.session(trajectory="kinds")
            r = await s.exec("mkdir -p sub && printf hello > sub/data.txt && printf tmp > /tmp/scratch && "
                             "ln -s sub/data.txt link")
            assert r.outcome is Outcome.OK, r.message
            r = await s.exec(python=STATE)
            assert r.outcome is Outcome.OK, r.stderr
            await _rest(tg, "kinds")
            assert tg.runtime.engine.cpu.session_mem["kinds"] == 0.0  # at rest: no memory reserved
            r = await s.exec(python=CHECK)
            assert r.outcome is Outcome.OK, r.stderr
            assert r.stdout.split() == ["hello", "tmp", "sub/data.txt"]
            assert r.result.info["woken"] is True and r.result.info["dropped"] == {}
            # and again: a second rest carries what the woken interpreter holds
            await _rest(tg, "kinds")
            r = await s.exec(python=CHECK)
            assert r.outcome is Outcome.OK, r.stderr
    asyncio.run(main())


def test_a_woken_session_s_shell_has_its_directory_variables_functions_aliases_and_options():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            s = await tg.session(trajectory="shell")
            r = await s.exec("mkdir -p a/b && cd a/b && export FOO='x y'\nBAR=$'multi\\nline'\narr=(1 2 3)\n"
                             "declare -A m=([k]=v)\ngreet() { echo \"hi $1\"; }\nalias ll='ls -l'\n"
                             "set -o pipefail\nshopt -s extglob")
            assert r.outcome is Outcome.OK, r.stderr
            await _rest(tg, "shell")
            r = await s.exec('pwd; echo "$FOO|$BAR|${arr[2]}|${m[k]}"; greet you; alias ll; set -o | grep pipefail; '
                             'shopt extglob; env | grep ^FOO=')
            assert r.outcome is Outcome.OK, r.stderr
            assert r.stdout.split("\n")[:5] == ["/workspace/a/b", "x y|multi", "line|3|v", "hi you", "alias ll='ls -l'"]
            assert r.stdout.split()[-5:] == ["on", "extglob", "on", "FOO=x", "y"]
            assert r.result.info["woken"] and r.result.info["dropped"] == {}
    asyncio.run(main())


def test_a_step_after_a_wake_names_the_globals_that_could_not_be_carried():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            s = await tg.session(trajectory="lossy")
            r = await s.exec(python="import threading\nkept = [1, 2]\nfh = open('/workspace/f', 'w')\n"
                                    "gen = (i for i in range(3))\nlock = threading.Lock()")
            assert r.outcome is Outcome.OK, r.stderr
            await _rest(tg, "lossy")
            r = await s.exec(python="print(kept, [n for n in ('fh', 'gen', 'lock') if n in globals()])")
            assert r.outcome is Outcome.OK, r.stderr
            assert r.stdout.strip() == "[1, 2] []"
            assert set(r.result.info["dropped"]) == {"fh", "gen", "lock"}
            assert "cannot pickle" in r.result.info["dropped"]["gen"]
            assert "woken from rest without: " in r.message and "gen (" in r.message
            r = await s.exec(python="print(kept)")  # once said, not said again
            assert r.message == "" and "woken" not in r.result.info
    asyncio.run(main())


def test_least_recently_used_sessions_go_to_rest_past_max_awake_and_idle_ones_after_rest_after_s():
    async def main():
        async with Tangram.local(sandbox=_config(max_awake_sessions=2)) as tg:
            manager = tg.runtime.sandbox_manager()
            sessions = []
            for i in range(4):
                s = await tg.session(trajectory=f"lru{i}")
                r = await s.exec(python=f"v = {i}")
                assert r.outcome is Outcome.OK
                sessions.append(s)
            for _ in range(100):
                if len(manager.rested) == 2 and not manager.book.moving:
                    break
                await asyncio.sleep(0.05)
            assert sorted(manager.rested) == ["lru0", "lru1"]  # the least recently used
            assert sorted(manager.sessions) == ["lru2", "lru3"]
            for i, s in enumerate(sessions):
                r = await s.exec(python="print(v)")
                assert r.stdout.strip() == str(i)
            assert manager.rest_stats()["wakes"] >= 2
        async with Tangram.local(sandbox=_config(rest_after_s=0.3)) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="idle")
            await s.exec(python="v = 7")
            for _ in range(100):
                if manager.session_state("idle") == "at_rest":
                    break
                await asyncio.sleep(0.05)
            assert manager.session_state("idle") == "at_rest"
            assert (await s.exec(python="print(v)")).stdout.strip() == "7"
    asyncio.run(main())


def test_a_step_sent_while_its_session_is_put_to_rest_waits_then_wakes_it():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="race")
            await s.exec(python="v = 'x' * 1000")
            resting = asyncio.ensure_future(manager.rest("race"))
            await asyncio.sleep(0)  # the rest has begun
            assert manager.session_state("race") == "resting"
            r = await s.exec(python="print(len(v))")
            assert await resting is True
            assert r.outcome is Outcome.OK and r.stdout.strip() == "1000" and r.result.info["woken"]
    asyncio.run(main())


def test_a_file_written_while_its_session_is_put_to_rest_is_there_after_the_wake():
    """Review M6: ``Session.files`` while the session was being put to rest wrote into the sandbox
    from the engine process after the pack had taken its files: acknowledged, then lost with the
    reset. It now goes the action's way, which waits for the rest and wakes the session."""
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="late")
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            write = manager.store.write
            manager.store.write = lambda *a: (time.sleep(0.3), write(*a))[1]  # a slow disk: the window
            resting = asyncio.ensure_future(manager.rest("late"))
            await asyncio.sleep(0.15)  # packed; the blob is being written
            assert manager.session_state("late") == "resting"
            r = await s.files(Files(put={"late.txt": b"acknowledged"}))
            assert r.outcome is Outcome.OK
            await resting
            r = await s.exec(python="print(open('/workspace/late.txt').read())")
            assert r.outcome is Outcome.OK and r.stdout == "acknowledged\n", (r.outcome, r.stderr)
    asyncio.run(main())


def test_a_rest_is_recorded_durably_while_the_session_s_processes_still_live():
    """A crash between recording a rest and ending the processes must leave a session that wakes
    from its blob: so the record (the server's journal commit: ``rest_barriers``) comes first."""
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="order")
            await s.exec(python="v = 7")
            pid = manager.sessions["order"].proc.pid
            seen = []

            async def barrier() -> None:
                await asyncio.sleep(0.05)  # a slow commit: the processes must wait for it
                seen.append((manager.session_state("order"), manager.rested["order"].path,
                             os.path.exists(f"/proc/{pid}") and alive(pid)))

            tg.runtime.rest_barriers.append(barrier)
            assert await manager.rest("order")
            assert seen and seen[0][0] == "resting" and os.path.exists(seen[0][1]) and seen[0][2] is True
            r = await s.exec(python="print(v)")
            assert r.outcome is Outcome.OK and r.stdout.strip() == "7" and r.result.info["woken"]
    asyncio.run(main())


def test_a_session_closed_while_its_rest_is_recorded_leaves_no_blob_and_no_process():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="gone")
            await s.exec(python="v = 1")
            sb = manager.sessions["gone"]
            closing = asyncio.get_running_loop().create_future()

            async def barrier() -> None:
                closing.set_result(manager.rested["gone"].path)
                await asyncio.sleep(0.05)

            tg.runtime.rest_barriers.append(barrier)
            resting = asyncio.ensure_future(manager.rest("gone"))
            path = await closing
            await s.close()
            assert await resting is False
            await asyncio.sleep(0.2)
            assert manager.session_state("gone") is None and manager.store.used == 0
            assert not os.path.exists(path)
            # its processes are gone: the sandbox was reset for another session (or killed)
            assert sb.dead or (sb in manager.spares.idle and manager.recycler.sessions_recycled == 1)
    asyncio.run(main())


SLOW_PACK = """
class Slow:
    def __reduce__(self):
        import time; time.sleep(0.5)
        return (int, (1,))
s = Slow()
"""


def test_a_session_closed_while_it_is_packed_releases_its_sandbox_once():
    """Review H1: ``close_session`` during a rest's pack released the sandbox, and the rest
    released it again: reset twice, put in the sessions' pool twice, two later sessions shared
    it (one read the other's globals). Now only the rest releases it, once."""
    async def main():
        async with Tangram.local(sandbox=SandboxConfig(warm_pool=0, warm_sessions=2, rest_after_s=0, recycle_pool_max=4)) as tg:
            manager = tg.runtime.sandbox_manager()
            a = await tg.session(trajectory="A")
            assert (await a.exec(python=SLOW_PACK)).outcome is Outcome.OK
            sb = manager.sessions["A"]
            resting = asyncio.ensure_future(manager.rest("A"))
            await asyncio.sleep(0.15)  # packing (Slow's pickling takes 0.5 s)
            assert manager.session_state("A") == "resting"
            manager.close_session("A")
            assert await resting is False
            for _ in range(200):
                if not manager.spares.returning and not manager.book.moving:
                    break
                await asyncio.sleep(0.025)
            assert sum(x is sb for x in manager.spares.idle) <= 1
            assert manager.session_state("A") is None and manager.store.used == 0
            c, d = await tg.session(trajectory="C"), await tg.session(trajectory="D")
            assert (await c.exec(python="secret = 'C-only'")).outcome is Outcome.OK
            assert (await d.exec(python="y = 1")).outcome is Outcome.OK
            assert manager.sessions["C"] is not manager.sessions["D"]
            r = await d.exec(python="print(globals().get('secret'))")
            assert r.outcome is Outcome.OK and r.stdout == "None\n"
    asyncio.run(main())


def test_closing_a_rested_session_removes_its_state_from_disk():
    async def main():
        async with Tangram.local(sandbox=_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="bye")
            await s.exec(python="v = 1")
            await _rest(tg, "bye")
            path = manager.rested["bye"].path
            assert manager.store.used > 0
            await s.close()
            await asyncio.sleep(0)
            assert "bye" not in manager.rested and manager.store.used == 0
            assert not os.path.exists(path)
    asyncio.run(main())


def test_a_new_session_is_refused_naming_the_limit_once_rested_sessions_fill_rest_disk_mb():
    async def main():
        async with Tangram.local(sandbox=_config(rest_disk_mb=1)) as tg:
            s = await tg.session(trajectory="fat")
            r = await s.exec(python="blob = bytes(range(256)) * 8192")  # 2 MB
            assert r.outcome is Outcome.OK
            await _rest(tg, "fat")
            with pytest.raises(NoRoom) as e:
                await tg.session(trajectory="next")
            assert e.value.limit == "rest disk" and "sandbox.rest_disk_mb (1 MB)" in str(e.value)
            assert len((await s.exec(python="print(len(blob))")).stdout.strip()) > 0  # it still wakes
            await tg.session(trajectory="next")  # woken: its blob is gone, room again
    asyncio.run(main())


@pytest.mark.slow
def test_a_server_killed_with_sessions_at_rest_wakes_them_after_restart(tmp_path):
    """kill -9 with one session at rest and one awake: after the restart the rested one answers
    with its state, the awake one is gone saying why, and both are visible over HTTP."""
    cfg = {"sandbox": {"rest_after_s": 0, "max_awake_sessions": 1, "warm_pool": 2}}
    s = Server(tmp_path, cfg)
    try:
        sids = []
        for i in range(2):
            sid = httpx.post(f"{s.url}/v1/sessions", json={"job": "j"}).json()["session_id"]
            assert httpx.get(f"{s.url}/v1/sessions/{sid}").json()["state"] == "new"
            r = httpx.post(f"{s.url}/v1/sessions/{sid}/exec", timeout=60,
                           json={"python": f"import math\nxs = list(range(1000))\nv = {i}\ndef f(): "
                                           "return math.sqrt(xs[16]) + v"}).json()
            assert r["outcome"] == "ok"
            sids.append(sid)
        for _ in range(100):
            if httpx.get(f"{s.url}/v1/sessions/{sids[0]}").json()["state"] == "at_rest":
                break
        assert httpx.get(f"{s.url}/v1/sessions/{sids[0]}").json()["state"] == "at_rest"
        assert httpx.get(f"{s.url}/v1/sessions/{sids[1]}").json()["state"] == "awake"
        health = httpx.get(f"{s.url}/healthz").json()
        assert health["rest"]["at_rest"] == 1 and health["rest"]["awake"] == 1 and health["rest"]["rest_bytes"] > 0
        metrics = httpx.get(f"{s.url}/metrics").text
        assert "tangram_sessions_at_rest 1.0" in metrics and "tangram_rest_disk_limit_bytes" in metrics
    finally:
        s.stop(signal.SIGKILL)
    orphan = os.path.join(s.journal + ".rest", "0" * 40 + ".rest")  # written, never journaled
    with open(orphan, "wb") as fh:
        fh.write(b"x")
    s = Server(tmp_path, cfg, journal=s.journal)
    try:
        assert httpx.get(f"{s.url}/healthz").json()["recovered_sessions"] == {"at_rest": 1, "reattached": 0, "lost": 1}
        assert not os.path.exists(orphan)
        assert httpx.get(f"{s.url}/v1/sessions/{sids[0]}").json()["state"] == "at_rest"
        r = httpx.post(f"{s.url}/v1/sessions/{sids[0]}/exec", json={"python": "print(f(), len(xs))"},
                       timeout=60).json()
        assert r["outcome"] == "ok" and r["run"]["stdout"] == "4.0 1000\n" and r["woken"] and r["dropped"] == {}
        gone = httpx.get(f"{s.url}/v1/sessions/{sids[1]}")
        assert gone.status_code == 404 and "awake (not at rest) when the server stopped" in gone.json()["message"]
    finally:
        s.stop()


def test_top_shows_awake_and_rested_sessions_and_the_disk_they_use():
    from rich.console import Console

    from arl_tangram.top import render
    health = {"version": "x", "isolation": "bwrap", "queued": 0, "running": 0, "cores": 2, "sessions": 3,
              "session_mem_used_mb": 10.0, "session_mem_reserved_mb": 18.0, "memory_mb": 1024, "sessions_placed": 3,
              "rest": {"awake": 1, "at_rest": 2, "resting_now": 0, "rest_bytes": 3 << 20, "rest_disk_mb": 100,
                       "max_awake_sessions": 256, "rest_after_s": 30.0, "rests": 5, "wakes": 3, "rest_failures": 0,
                       "wake_failures": 0}}
    console = Console(record=True, width=200)
    console.print(render("http://x", health, []))
    text = console.export_text()
    assert "sessions awake 1 (at most 256 idle), at rest 2 using 3.0 of 100 MB of disk; 5 rests, 3 wakes" in text


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="image sandboxes mount overlays: root only")
def test_an_image_session_rests_with_its_root_mounted_and_wakes_with_its_files_and_globals(tmp_path):
    from imagekit import docker_archive, python_layer

    from arl_tangram.managers.sandbox.images import ImageStore
    store = ImageStore(tmp_path / "store")
    store.import_path(docker_archive(tmp_path / "py.tar", [python_layer()]), "py")

    async def main():
        cfg = SandboxConfig(warm_pool=0, rest_after_s=0, image_store=str(store.root))
        async with Tangram.local(sandbox=cfg) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(image="py")
            r = await s.exec(python="import json\nxs = list(range(1000))\n"
                                    "open('/workspace/w', 'w').write('disk')\nopen('/tmp/t', 'w').write('tmpfs')")
            assert r.outcome is Outcome.OK, r.stderr
            await _rest(tg, s.id)
            assert manager.rested[s.id].rootfs is not None  # the workspace stayed where it was
            r = await s.exec(python="print(json.dumps(xs[-1]), open('/workspace/w').read(), open('/tmp/t').read())")
            assert r.outcome is Outcome.OK, r.stderr
            assert r.stdout.split() == ["999", "disk", "tmpfs"] and r.result.info["woken"]
            await s.close()
    asyncio.run(main())


def test_a_server_answers_once_the_sessions_warm_sandboxes_are_ready():
    """Right after a server starts, a new session (or a wake) finds a warm layered sandbox: the
    sessions' pool was full before it answered (its first steps paid a layered start before)."""
    async def main():
        runtime = LocalRuntime(sandbox=SandboxConfig(warm_pool=1, warm_sessions=3))
        service = Service(runtime)
        await service.start()
        try:
            return len(runtime.sandbox_manager().spares.idle)
        finally:
            await service.stop()
    assert asyncio.run(main()) == 3


# -- a session's sandbox is reused once its session has left (put to rest, or closed) ---------------

INSPECT = r'''
import json, os, resource, signal, sys
def files(root):
    out = []
    for d, dirs, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in dirs + names]
    return sorted(out)
procs = []
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
        with open(f"/proc/{p}/cmdline", "rb") as fh:
            procs.append(fh.read().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1])
print(json.dumps({
    "files": {r: files(r) for r in ("/workspace", "/tmp", "/dev/shm")},
    "procs": sorted(procs),
    "env": dict(os.environ), "cwd": os.getcwd(), "umask": os.umask(0o022),
    "signals": {s.name: getattr(signal.getsignal(s), "__qualname__", str(signal.getsignal(s)))
                for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "limits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
    "planted": "planted_mod" in sys.modules, "dumps": json.dumps([1]),
    "globals": sorted(k for k in globals() if not k.startswith("__")),
    "ipc": [open(f"/proc/sysvipc/{k}").read().count("\n") for k in ("shm", "msg", "sem")],
    "keys": "leaked-key" in open("/proc/keys").read() if os.path.exists("/proc/keys") else None,
}, sort_keys=True))
'''

ATTACK = r'''
import json, os, resource, signal, subprocess, sys, types, threading, time
for d in ("/workspace", "/tmp", "/dev/shm"):
    open(f"{d}/left-{os.getpid()}", "w").write("secret")
    os.makedirs(f"{d}/deep/er", exist_ok=True)
    os.chmod(f"{d}/deep", 0)
os.environ["LEAK"] = "1"
os.chdir("/tmp")
os.umask(0o077)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, lambda *a: None)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.modules["planted_mod"] = types.ModuleType("planted_mod")
json.dumps = lambda *a, **k: "patched"
subprocess.Popen(["sleep", "1000"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
import ctypes, platform
if platform.machine() == "x86_64":  # add_key(2) into the user keyring, which outlives processes
    ctypes.CDLL(None).syscall(248, b"user", b"leaked-key", b"secret", 6, -4)
secret = "the earlier session's"
'''


def _recycling_config(**kw) -> SandboxConfig:
    return _config(warm_sessions=1, **kw)


async def _recycled(manager, before: int) -> None:
    for _ in range(200):
        if manager.recycler.sessions_recycled > before and not manager.book.moving:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"no session sandbox was recycled: {manager.recycler.stats()}")


async def _reused(manager, trajectory: str, leave):
    """``trajectory``'s sandbox once ``leave()`` (a rest, a close) had it reset and back in the
    sessions' pool, made the one the next session takes."""
    sb = manager.sessions[trajectory]
    before = manager.recycler.sessions_recycled
    left = leave()
    if asyncio.iscoroutine(left):
        await left
    await _recycled(manager, before)
    _take_recycled(manager, sb)
    return sb


def _take_recycled(manager, sb) -> None:
    """Make ``sb`` (back in the sessions' pool) the one the next session takes."""
    pool = manager.spares.idle
    assert sb in pool, "the rested session's sandbox is not in the sessions' pool"
    pool.remove(sb)
    pool.append(sb)


PROCS = r"""
import os
names = []
for p in os.listdir("/proc"):
    if p.isdigit():
        with open(f"/proc/{p}/cmdline", "rb") as fh:
            names.append(fh.read().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1])
print(" ".join(sorted(names)))
"""


def test_a_recycled_sandbox_has_its_shell_started_ahead_as_a_fresh_one_and_clean():
    """A session's first command in a sandbox reset after another session finds its shell
    started, as in a fresh sandbox of the pool (starting it is most of a first command), and
    nothing of the shell before it."""
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            fresh = await tg.session(trajectory="fresh")
            want = (await fresh.exec(python=PROCS)).stdout.split()
            assert "bash" in want, want  # the pool's fresh sandboxes have it (warm_shell)

            a = await tg.session(trajectory="a")
            assert (await a.exec("cd /tmp; export SHELL_LEAK=1; leak() { :; }")).ok
            sb = await _reused(manager, "a", lambda: _rest(tg, "a"))

            b = await tg.session(trajectory="b")
            got = (await b.exec(python=PROCS)).stdout.split()
            assert manager.sessions["b"] is sb  # the same sandbox, reused
            assert got == want
            r = await b.exec("echo ${SHELL_LEAK:-unset} $(pwd) $(type -t leak || echo none)")
            assert r.stdout.split() == ["unset", "/workspace", "none"], r.stdout + r.stderr
            assert "new shell" not in (r.message or "")

    asyncio.run(main())


def test_a_session_in_a_recycled_sandbox_sees_nothing_of_the_session_before_it():
    async def main():  # no shell started ahead: a recycled sandbox starts its shell on first use
        async with Tangram.local(sandbox=_recycling_config(warm_shell=False)) as tg:
            manager = tg.runtime.sandbox_manager()
            fresh = await tg.session(trajectory="fresh")
            r = await fresh.exec(python=INSPECT)
            assert r.outcome is Outcome.OK, r.stderr
            want = __import__("json").loads(r.stdout)

            a = await tg.session(trajectory="a")
            r = await a.exec("ipcmk -M 4096 >/dev/null; ipcmk -Q >/dev/null; cd /tmp; export SHELL_LEAK=1; "
                             "(sleep 1000 &) ; true")
            assert r.outcome is Outcome.OK, r.stderr
            r = await a.exec(python=ATTACK)
            assert r.outcome is Outcome.OK, r.stderr
            sb = await _reused(manager, "a", lambda: _rest(tg, "a"))

            b = await tg.session(trajectory="b")
            r = await b.exec(python=INSPECT)
            assert r.outcome is Outcome.OK, r.stderr
            assert manager.sessions["b"] is sb  # the same sandbox, reused
            got = __import__("json").loads(r.stdout)
            assert got == want
            r = await b.exec("echo ${SHELL_LEAK:-unset} $(pwd)")
            assert r.stdout.split() == ["unset", "/workspace"]

            # and the earlier session wakes elsewhere with everything it had (a module comes back by
            # name, freshly imported: what the session patched in it is not carried, rest.py says so)
            r = await a.exec(python="print(secret, os.getcwd(), os.environ['LEAK'], json.dumps([1]), "
                                    "sorted(os.listdir('/workspace')) != [])")
            assert r.outcome is Outcome.OK, r.stderr
            assert r.stdout.split() == ["the", "earlier", "session's", "/tmp", "1", "[1]", "True"]
    asyncio.run(main())


def test_a_closed_session_s_sandbox_is_reused_and_a_forked_one_is_not():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            a = await tg.session(trajectory="closed")
            assert (await a.exec(python="x = 1\nopen('/workspace/f', 'w').write('a')")).outcome is Outcome.OK
            sb = await _reused(manager, "closed", lambda: a.close())
            b = await tg.session(trajectory="after")
            r = await b.exec(python="print('x' in globals(), os.listdir('/workspace')) if 'os' in globals() else "
                                    "print('x' in globals(), __import__('os').listdir('/workspace'))")
            assert r.outcome is Outcome.OK, r.stderr
            assert manager.sessions["after"] is sb and r.stdout.strip() == "False []"

            src = await tg.session(trajectory="src")
            assert (await src.exec(python="y = 2")).outcome is Outcome.OK
            await src.fork(1)
            assert (await src.exec(python="z = 3")).outcome is Outcome.OK
            forked = manager.sessions["src"]
            assert forked.rootfs.session_layers  # its workspace is stacked on the fork's layer
            assert await manager.recycler.session_verdict(forked) == "not recyclable"
    asyncio.run(main())


def test_a_cell_that_ends_its_interpreter_is_reported_and_so_is_the_next_step_and_a_rest():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="dies")
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            sb = manager.sessions["dies"]
            r = await s.exec(python="import os; os._exit(3)")
            assert "the session's python interpreter exited with code 3: its variables are gone" in r.message
            assert manager.sessions["dies"] is sb and not sb.dead  # the sandbox lives on
            r = await s.exec(python="print('x' in globals())")
            assert r.outcome is Outcome.OK and r.stdout.strip() == "False"
            assert "a new python interpreter: the session's earlier one exited with code 3" in r.message
            r = await s.exec(python="print('x' in globals())")  # said once
            assert r.message == ""

            # it dies again, then is put to rest before any other step: the wake says so
            assert (await s.exec(python="y = 2")).outcome is Outcome.OK
            r = await s.exec(python="import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
            assert "killed by signal 9" in r.message
            await _rest(tg, "dies")
            r = await s.exec(python="print('y' in globals())")
            assert r.outcome is Outcome.OK and r.stdout.strip() == "False"
            assert "(namespace)" in r.result.info["dropped"]
            assert "killed by signal 9 before its rest" in r.message
    asyncio.run(main())


def test_a_cell_that_kills_its_sandbox_s_zygote_fails_and_the_session_starts_anew():
    """Review M5: a cell killing its interpreter's parent (the sandbox's zygote) left every later
    python step of the session failing as infra_error, and the sandbox was never replaced. The
    step that finds no interpreter can start is now the user's failure, the sandbox is replaced,
    and the next step runs in a new one, saying the session restarted."""
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="z")
            got = [await s.exec(python=code) for code in
                   ("import os; os.kill(os.getppid(), 9)", "import os; os._exit(3)", "print(1)")]
            sb = manager.sessions["z"]
            r = await s.exec(python="print(2)")
            assert all(g.outcome is not Outcome.INFRA_ERROR for g in got), [(g.outcome, g.message) for g in got]
            assert got[2].outcome is Outcome.FAILED and "zygote" in got[2].message
            assert sb.dead and manager.sessions["z"] is not sb
            assert r.outcome is Outcome.OK and r.stdout == "2\n" and "session restarted" in r.message
    asyncio.run(main())


def test_a_cell_that_ignores_its_timeout_is_ended_without_losing_the_sandbox():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="stubborn")
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            sb = manager.sessions["stubborn"]
            r = await s.exec(python="import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass",
                             timeout_s=0.5)
            assert r.outcome is Outcome.TIMEOUT, r.message
            assert "did not stop at its cell's timeout" in r.message
            r = await s.exec(python="print('x' in globals())")
            assert r.outcome is Outcome.OK and r.stdout.strip() == "False"
            assert "its variables are gone" in r.message and manager.sessions["stubborn"] is sb
            r = await s.exec(python="import time\ntime.sleep(5)", timeout_s=0.3)  # an ordinary timeout keeps state
            assert r.outcome is Outcome.TIMEOUT
            assert (await s.exec(python="print(time.time() > 0)")).stdout.strip() == "True"
    asyncio.run(main())


def test_every_kind_of_value_survives_rest_and_wake_through_recycled_sandboxes():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="kinds2")
            r = await s.exec("mkdir -p sub && printf hello > sub/data.txt && printf tmp > /tmp/scratch && "
                             "ln -s sub/data.txt link")
            assert r.outcome is Outcome.OK, r.message
            assert (await s.exec(python=STATE)).outcome is Outcome.OK
            for _ in range(3):  # each wake in a recycled sandbox (another session's, then its own)
                before = manager.recycler.sessions_recycled
                await _rest(tg, "kinds2")
                await _recycled(manager, before)
                other = await tg.session()
                assert (await other.exec(python="noise = list(range(10))")).outcome is Outcome.OK
                r = await s.exec(python=CHECK)
                assert r.outcome is Outcome.OK, r.stderr
                assert r.stdout.split() == ["hello", "tmp", "sub/data.txt"]
                assert r.result.info["dropped"] == {}
            assert manager.recycler.sessions_recycled >= 3
    asyncio.run(main())


def test_a_python_one_shot_in_a_session_s_sandbox_runs_and_the_sandbox_is_then_never_reused():
    from arl_tangram.core import Action, Allocation
    from arl_tangram.managers.sandbox.spec import Exec, RunCode
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=1))
        await agent.start()
        try:
            cores = Allocation("cpu", 0, (0,))
            c = await agent.run(Action("c1", "sandbox", trajectory="t", payload=Exec(python="x = 41")), cores)
            assert c.outcome is Outcome.OK, c.message
            c = await agent.run(Action("r", "sandbox", trajectory="t", payload=RunCode("print(6 * 7)")), cores)
            assert c.outcome is Outcome.OK and c.result.run.stdout == "42\n", c.message
            c = await agent.run(Action("c2", "sandbox", trajectory="t", payload=Exec(python="print(x + 1)")), cores)
            assert c.outcome is Outcome.OK and c.result.run.stdout == "42\n", c.message  # its state untouched
            manager = agent.manager
            sb = manager.sessions["t"]
            manager.close_session("t")
            for _ in range(200):
                if sb.dead:
                    break
                await asyncio.sleep(0.025)
            assert sb.dead and sb not in manager.spares.idle
            assert any("forked from the runner" in why for why in manager.recycler.sessions_discarded)
        finally:
            await agent.shut_down()
    asyncio.run(main())


# counts a needle in every writable mapping of the one-shot's process, and a control needle never
# used anywhere: the scan's own objects (the needles, the copies) count the same for both
SCAN_MEMORY = r"""
import ctypes
def needle(s):
    return bytes(reversed(s.encode()))
found = {"secret": needle("gnoleb 1937_A_TERCESPOT"), "control": needle("gnoleb 0000_Z_TERCESPOT")}
hits = dict.fromkeys(found, 0)
for line in open("/proc/self/maps").read().splitlines():
    parts = line.split()
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    if not parts[1].startswith("rw") or (len(parts) > 5 and parts[5].startswith("[v")):
        continue
    try:
        data = ctypes.string_at(lo, hi - lo)
    except Exception:
        continue
    for k, m in found.items():
        hits[k] += data.count(m)
print(hits["secret"], hits["control"])
"""


def test_a_python_one_shot_in_a_recycled_session_sandbox_reads_nothing_of_earlier_sessions():
    """Review H3: a python one-shot sent to a session's sandbox whose interpreter holds the zygote
    ran in a fork of the runner, whose heap still held earlier sessions' cells and answers: it
    found session A's secret in session B's sandbox. It now runs in a new interpreter (exec)."""
    from arl_tangram.core import Action, Allocation
    from arl_tangram.managers.sandbox.spec import Exec, RunCode
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=1, rest_after_s=0))
        await agent.start()
        try:
            cores = Allocation("cpu", 0, (0,))
            manager = agent.manager
            c = await agent.run(Action("a1", "sandbox", trajectory="A", payload=Exec(
                python="password = 'TOPSECRET_A_7391 belongs to job A'\nprint(password)")), cores)
            assert c.outcome is Outcome.OK, c.message
            sb = await _reused(manager, "A", lambda: manager.close_session("A"))
            c = await agent.run(Action("b1", "sandbox", trajectory="B", payload=Exec(python="y = 1")), cores)
            assert c.outcome is Outcome.OK and manager.sessions["B"] is sb, c.message
            c = await agent.run(Action("b2", "sandbox", trajectory="B", payload=RunCode(SCAN_MEMORY)), cores)
            assert c.outcome is Outcome.OK, (c.message, c.result.run.stderr)
            secret, control = map(int, c.result.run.stdout.split())
            assert secret == control, (secret, control)
            c = await agent.run(Action("b3", "sandbox", trajectory="B", payload=RunCode(
                "import sys\nprint(sys.argv, __name__)\nraise ValueError('mine')")), cores)
            assert c.outcome is Outcome.FAILED and c.result.run.stdout == "['main.py'] __main__\n"
            assert 'File "main.py", line 3' in c.result.run.stderr and "<string>" not in c.result.run.stderr
            c = await agent.run(Action("b4", "sandbox", trajectory="B", payload=Exec(python="print(y)")), cores)
            assert c.outcome is Outcome.OK and c.result.run.stdout == "1\n"  # the session's state untouched
        finally:
            await agent.shut_down()
    asyncio.run(main())


def test_a_session_sandbox_whose_first_action_was_a_python_one_shot_is_recycled():
    """Review L1: the runner's last op ("python") outlived the session, so the reset after it left
    preforked the next session's interpreter and then asked the zygote, which waits on that
    interpreter, for a one-shot child forked ahead: no answer in 2 s, the sandbox discarded."""
    from arl_tangram.core import Action, Allocation
    from arl_tangram.managers.sandbox.spec import RunCode
    from arl_tangram.runtime.agent import NodeAgent

    async def main():
        agent = NodeAgent("n1", 1, SandboxConfig(warm_pool=0, warm_sessions=1))
        await agent.start()
        try:
            manager = agent.manager
            c = await agent.run(Action("r", "sandbox", trajectory="t", payload=RunCode("print(1)")),
                                Allocation("cpu", 0, (0,)))
            assert c.outcome is Outcome.OK, c.message
            before = manager.recycler.sessions_recycled
            manager.close_session("t")
            for _ in range(200):
                if manager.recycler.sessions_recycled > before or manager.recycler.sessions_discarded:
                    break
                await asyncio.sleep(0.025)
            assert manager.recycler.sessions_recycled == before + 1, manager.recycler.stats()
        finally:
            await agent.shut_down()
    asyncio.run(main())


def test_the_step_that_wakes_a_session_runs_in_the_wake_and_is_reported_as_any_step():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            s = await tg.session(trajectory="rides")
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            await _rest(tg, "rides")
            r = await s.exec(python="print(x)\nx")  # the output and the displayed value, as any step
            assert r.outcome is Outcome.OK and r.stdout == "1\n" and r.result.info["woken"] is True
            assert r.result.run.display == [{"text/plain": "1"}]
            await _rest(tg, "rides")
            r = await s.exec(python="import time\ntime.sleep(5)", timeout_s=0.3)
            assert r.outcome is Outcome.TIMEOUT and r.result.info["woken"] is True
            assert (await s.exec(python="print(x)")).stdout == "1\n"  # a cell's own timeout keeps the state
            await _rest(tg, "rides")  # the cell rides on the load (inside.pickling.load_here): its own timeout still holds
            r = await s.exec(python="import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass",
                             timeout_s=0.5)
            assert r.outcome is Outcome.TIMEOUT and r.result.info["woken"] is True, r.message
            assert "did not stop at its cell's timeout" in r.message and r.result.run.timed_out
            r = await s.exec(python="print('x' in globals())")
            assert r.stdout.strip() == "False" and "its variables are gone" in r.message
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            await _rest(tg, "rides")
            r = await s.exec(python="raise ValueError('boom')")
            assert r.outcome is Outcome.FAILED and "ValueError: boom" in r.stderr
            await _rest(tg, "rides")
            r = await s.exec(python="b = bytearray(600 << 20)\nb[::4096] = b'x' * len(b[::4096])", memory_mb=128)
            assert r.outcome is Outcome.OOM, (r.outcome, r.message)
    asyncio.run(main())


def test_a_blob_rested_before_sessions_had_their_own_interpreter_still_wakes(tmp_path):
    import marshal
    import pickle

    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            blob = marshal.dumps({"ns": pickle.dumps({"a": [1, 2], "b": "x"}, 4),
                                  "files": {"workspace": [("f.txt", "f", 0o644, 0.0, b"kept")], "/tmp": []},
                                  "cwd": "/workspace", "environ": {"PATH": "/usr/bin:/bin", "OLD": "1"},
                                  "path": ["/usr/lib/python3"], "dropped": {}, "shell": None}, 4)
            path = tmp_path / "old.rest"
            path.write_bytes(blob)
            manager.adopt_rested("old", str(path))
            s = await tg.session(trajectory="old")
            r = await s.exec(python="import os\nprint(a, b, os.environ.get('OLD'), open('f.txt').read())")
            assert r.outcome is Outcome.OK, (r.message, r.stderr)
            assert r.stdout == "[1, 2] x 1 kept\n" and r.result.info["woken"] is True
    asyncio.run(main())


def test_a_cell_that_closes_its_interpreter_s_channel_ends_that_interpreter_not_the_sandbox():
    async def main():
        async with Tangram.local(sandbox=_recycling_config()) as tg:
            manager = tg.runtime.sandbox_manager()
            s = await tg.session(trajectory="closes")
            assert (await s.exec(python="x = 1")).outcome is Outcome.OK
            sb = manager.sessions["closes"]
            r = await s.exec(python="import os, time\nfor fd in range(3, 64):\n    try: os.close(fd)\n    except OSError: pass\n"
                                    "time.sleep(30)", timeout_s=60)  # it lives on without its channel
            assert "closed its channel to the runner" in r.message, r.message
            r = await s.exec(python="import os\nfor fd in range(3, 64):\n    try: os.close(fd)\n    except OSError: pass")
            assert "exited with code 0" in r.message, r.message  # its answer could not go: it ended
            r = await s.exec(python="print('x' in globals())")
            assert r.outcome is Outcome.OK and r.stdout == "False\n" and manager.sessions["closes"] is sb
            before = manager.recycler.sessions_recycled
            await s.close()
            await _recycled(manager, before)  # its zygote still answers: the sandbox is reused
    asyncio.run(main())


def test_a_wake_past_max_awake_puts_the_least_recently_used_to_rest_while_its_step_runs():
    """The least recently used goes to rest as the step that wakes another session starts, not
    once that step is over (its pack and reset then no longer compete with the step's answer)."""
    async def main():
        async with Tangram.local(sandbox=_recycling_config(max_awake_sessions=1, rest_after_s=600)) as tg:
            manager = tg.runtime.sandbox_manager()
            a = await tg.session(trajectory="a")
            assert (await a.exec(python="x = 'a'")).outcome is Outcome.OK
            b = await tg.session(trajectory="b")
            assert (await b.exec(python="x = 'b'")).outcome is Outcome.OK
            for _ in range(500):  # a, the least recently used, goes to rest
                if manager.session_state("a") == "at_rest" and manager.session_state("b") == "awake":
                    break
                await asyncio.sleep(0.01)
            assert manager.session_state("a") == "at_rest"
            step = asyncio.create_task(a.exec(python="import time\ntime.sleep(2)\nprint(x)"))
            for _ in range(150):
                if manager.session_state("b") == "at_rest":
                    break
                await asyncio.sleep(0.01)
            assert manager.session_state("b") == "at_rest" and not step.done()  # while a's step still runs
            r = await step
            assert r.outcome is Outcome.OK and r.stdout == "a\n" and r.result.info["woken"] is True
            r = await b.exec(python="print(x)")
            assert r.outcome is Outcome.OK and r.stdout == "b\n" and r.result.info["woken"] is True
    asyncio.run(main())


# The runner packs and unpacks a session's files itself (PID 1 of the sandbox): never through a
# link the sandbox's code put in the way, whatever the blob says (an audit found a tree swapped
# while it was packed made the wake write a file through a link into /proc/1/fd/4, the answer
# channel). Run apart: booting the agent takes over the process's stdin and stdout.
PACKING = PRELUDE + r'''
import tempfile
from inside import rest
outside = tempfile.mkdtemp()
src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
os.symlink("/proc/self/maps", os.path.join(src, "maps"))
os.symlink(outside, os.path.join(src, "away"))
os.mkfifo(os.path.join(src, "fifo"))
deep = src
for _ in range(rest.PACK_DEPTH + 5):
    deep = os.path.join(deep, "d")
os.makedirs(deep)
entries, skipped = rest._pack(src)
kinds = {rel: (kind, data) for rel, kind, mode, mtime, data in entries}
# a blob as a swapped tree packed it: "a" a link out, then a file under "a"; and "pre", a link the
# fresh sandbox already has, with a file packed under it
os.symlink(outside, os.path.join(dst, "pre"))
blob = [("a", "l", 0o777, 0.0, outside.encode()), ("a/4", "f", 0o644, 0.0, b"forged"),
        ("pre/5", "f", 0o644, 0.0, b"forged"), ("ok", "d", 0o755, 0.0, b""), ("ok/f", "f", 0o600, 7.0, b"fine")]
dropped = rest._unpack(dst, blob)
print(json.dumps({
    "maps": [kinds["maps"][0], kinds["maps"][1].decode()], "away": kinds["away"][0], "fifo": skipped.get("fifo"),
    "deep": [k for k in skipped if k.endswith("/")],
    "outside": sorted(os.listdir(outside)), "dropped": sorted(dropped),
    "a": os.readlink(os.path.join(dst, "a")), "ok": open(os.path.join(dst, "ok", "f")).read(),
    "mtime": os.stat(os.path.join(dst, "ok", "f")).st_mtime, "outside_path": outside}), file=out)
'''


def test_packing_and_unpacking_never_follow_a_link(tmp_path):
    out = run_with_runner(tmp_path, PACKING, timeout=120)
    assert out["maps"] == ["l", "/proc/self/maps"] and out["away"] == "l"  # links packed as links, never read
    assert "not a regular file" in out["fifo"]
    assert len(out["deep"]) == 1 and out["deep"][0].count("d/") == 257  # walked 256 deep, the next named
    assert out["outside"] == []  # nothing written through a link
    assert out["dropped"] == ["a/4", "pre/5"] and out["a"] == out["outside_path"]
    assert out["ok"] == "fine" and out["mtime"] == 7.0
