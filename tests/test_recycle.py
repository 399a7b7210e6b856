"""Recycled one-shot sandboxes: every attack a one-shot can make on a later one, then a check
that the next run sees exactly what a run in a fresh sandbox sees.

Model-written code is hostile: an RL policy that can leave something for the next episode's
reward check will learn to. Each test runs an attack, waits for the recycler's verdict, and
takes an inventory of everything a program can observe (files and extended attributes in every
writable place, processes, System V IPC, keyrings, where ``json`` imports from, rlimits,
priority, affinity) in the next one-shot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox.isolation import Isolation
from arl_tangram.managers.sandbox.manager import SandboxConfig
from arl_tangram.runtime import Tangram

from runnerkit import PRELUDE, run_with_runner

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

INVENTORY = r'''
import ctypes, json as j, os, resource
def walk(root):
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.join(d, x) for x in dirs + files]
    return sorted(out)
libc = ctypes.CDLL(None, use_errno=True)
keys = libc.syscall(ctypes.c_long(250), ctypes.c_long(11), ctypes.c_long(-4), None, ctypes.c_long(0))
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
inv = {"files": {r: walk(r) for r in ("/workspace", "/tmp", "/dev/shm")},
       "modes": {r: oct(os.stat(r).st_mode) for r in ("/workspace", "/tmp", "/dev/shm")},
       "xattrs": {r: os.listxattr(r) for r in ("/workspace", "/tmp", "/dev/shm")},
       "others": [p for p in pids if p not in (1, 2, os.getpid())],
       "ipc": {k: open(f"/proc/sysvipc/{k}").read().splitlines()[1:] for k in ("shm", "msg", "sem")},
       "keys": keys, "listed_keys": sorted(row.split()[8] for row in open("/proc/keys") if row.split()[7] != "keyring"),
       "json": j.__file__, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
       "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
       "policy": [os.sched_getscheduler(p) for p in (1, 2, 0)],
       "free_tmp": os.statvfs("/tmp").f_bavail > 1000}
print(j.dumps(inv))
'''


async def _settle(tg, before: int) -> dict:
    """Wait for the recycler's verdict on the last one-shot's sandbox."""
    rec = tg.runtime.sandboxes.recycler
    deadline = time.monotonic() + 10
    while rec.recycled + sum(rec.discarded.values()) == before and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return rec.stats()


async def _inventory(tg) -> tuple[dict, int]:
    r = await tg.run(INVENTORY)
    assert r.outcome is Outcome.OK, r.stderr
    inv = json.loads(r.stdout)
    return inv, r


def attack_then_inspect(attack: str, language: str = "python", timeout_s: float = 5.0) -> dict:
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            assert tg.runtime.sandboxes.mode is Isolation.BWRAP
            rec = tg.runtime.sandboxes.recycler
            fresh, _ = await _inventory(tg)  # a fresh sandbox, which is then recycled
            await _settle(tg, 0)
            assert rec.recycled == 1, rec.stats()
            a = await tg.run(attack, language, timeout_s=timeout_s)
            stats = await _settle(tg, 1)
            after, _ = await _inventory(tg)
            return {"fresh": fresh, "after": after, "attack": a, "stats": stats}

    return asyncio.run(main())


def assert_pristine(out: dict, reused: bool) -> None:
    assert out["after"] == out["fresh"]
    if reused:
        assert out["stats"]["recycled"] == 2 and not out["stats"]["discarded"], out["stats"]
    else:
        assert out["stats"]["recycled"] == 1 and out["stats"]["discarded"], out["stats"]


def test_sandboxes_run_as_sched_batch_and_a_reset_keeps_them_so():
    """The runner, the zygote and a one-shot all run ``SCHED_BATCH`` (``inside.loop.batch``: their
    wake-ups never preempt the host's process that woke them), before and after a reuse."""
    out = attack_then_inspect("print('harmless')")
    assert out["fresh"]["policy"] == [os.SCHED_BATCH] * 3, out["fresh"]["policy"]
    assert_pristine(out, reused=True)


def test_files_left_in_every_writable_place_are_gone():
    attack = r'''
import os
open(os.path.join(os.environ["HOME"], ".bashrc"), "w").write("echo planted\n")
for root in ("/workspace", "/tmp", "/dev/shm"):
    os.makedirs(f"{root}/.hidden/deeper", exist_ok=True)
    open(f"{root}/.hidden/deeper/note", "w").write("left for the next run")
    os.symlink("/etc/passwd", f"{root}/link")
    os.chmod(f"{root}/.hidden/deeper", 0)
    os.chmod(f"{root}/.hidden", 0)
    os.setxattr(root, "user.left", b"1")
    os.chmod(root, 0o700)
print("planted")
'''
    out = attack_then_inspect(attack)
    assert out["attack"].stdout == "planted\n", out["attack"].stderr
    assert_pristine(out, reused=True)


def test_planted_modules_are_not_imported_later():
    attack = r'''
for name in ("json.py", "sitecustomize.py", "usercustomize.py", "x.pth"):
    for root in ("/workspace", "/tmp", "/dev/shm"):
        open(f"{root}/{name}", "w").write("import os; os._exit(3)\n")
import os
os.makedirs("/workspace/json", exist_ok=True)
open("/workspace/json/__init__.py", "w").write("raise SystemExit(3)\n")
print("planted")
'''
    out = attack_then_inspect(attack)
    assert out["after"]["json"].startswith("/usr/"), out["after"]["json"]
    assert_pristine(out, reused=True)


def test_a_detached_background_process_does_not_survive():
    attack = r'''
import os, subprocess, time
subprocess.Popen(["sleep", "600"], start_new_session=True)
subprocess.Popen(["bash", "-c", "while true; do date >> /tmp/beat; sleep 0.01; done"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
print("detached")
'''
    out = attack_then_inspect(attack)
    assert out["after"]["others"] == [] and out["after"]["files"]["/tmp"] == []
    assert_pristine(out, reused=True)


PTRACE = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
results = {}
for pid in (1, 2):
    results[f"attach {pid}"] = libc.ptrace(16, pid, None, None) == 0
    try:
        with open(f"/proc/{pid}/mem", "r+b") as fh:
            results[f"mem {pid}"] = True
    except OSError:
        results[f"mem {pid}"] = False
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):  # the numbers may show; the descriptors must not open
            os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK))
            results[f"fds {pid}"] = True
    except OSError:
        pass
    buf = ctypes.create_string_buffer(8)
    class Iov(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    local, remote = Iov(ctypes.addressof(buf), 8), Iov(0x400000, 8)
    results[f"vm_write {pid}"] = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) > 0
print(sorted(k for k, v in results.items() if v))
'''


def test_the_runner_and_zygote_cannot_be_ptraced_or_written():
    out = attack_then_inspect(PTRACE)
    assert out["attack"].stdout == "[]\n", out["attack"].stdout + out["attack"].stderr
    assert_pristine(out, reused=True)


def test_signals_to_the_runner_are_ignored():
    attack = "import os\nfor sig in (2, 15, 19, 10, 9):\n    os.kill(1, sig)\nprint('still here')"
    out = attack_then_inspect(attack)
    assert out["attack"].outcome is Outcome.OK and out["attack"].stdout == "still here\n"
    assert_pristine(out, reused=True)


@pytest.mark.parametrize("attack", [
    "import os\nos.kill(2, 9)",                                             # kill the zygote
    "import os\nos.kill(2, 19)",                                            # stop it
    "import resource\nresource.prlimit(1, resource.RLIMIT_NOFILE, (64, 64))",   # shrink the runner's limits
    "import resource\nresource.prlimit(2, resource.RLIMIT_NOFILE, (64, 64))",   # ... or the zygote's
    "import os\nos.setpriority(os.PRIO_PROCESS, 2, 19)",                    # deprioritise the zygote
    "import os\nos.sched_setscheduler(1, os.SCHED_OTHER, os.sched_param(0))",  # the runner's policy back
], ids=["kill-zygote", "stop-zygote", "prlimit-runner", "prlimit-zygote", "nice-zygote", "policy-runner"])
def test_tampering_with_the_runner_or_zygote_discards_the_sandbox(attack):
    out = attack_then_inspect(attack)
    assert_pristine(out, reused=False)
    # the program's own doing is its outcome: a run that kills its zygote must not become an
    # infra_error (never scored, retried by SandboxFusion clients); it was, through a TypeError
    assert out["attack"].outcome in (Outcome.OK, Outcome.FAILED), (out["attack"].outcome, out["attack"].message)


def test_a_bash_one_shot_killing_everything_it_can_discards_the_sandbox_before_the_next_run():
    """``kill -9 -1`` kills the zygote; the reset right after the answer found it still in /proc
    (dying), kept the sandbox, and the next python one-shot there failed ``infra_error`` (an audit
    saw 2 of 8 such pairs over HTTP). The inventory after it runs in another sandbox."""
    out = attack_then_inspect("kill -9 -1; echo after", language="bash")
    assert out["attack"].outcome is Outcome.OK and out["attack"].stdout == "after\n", out["attack"]
    assert_pristine(out, reused=False)


ON_ITS_WAY_OUT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
sys.argv = ["runner"]
import inside
from inside import procs
st = inside.boot()  # (takes over this process's stdin and stdout: run apart, never in pytest's)
pid = os.fork()
if pid == 0:
    os._exit(0)
for _ in range(200):  # until it is a zombie
    if procs.read_proc(st, f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[0] == b"Z":
        break
    time.sleep(0.01)
out = [procs.process_state(st, pid)["ending"], procs.process_state(st, os.getpid())["ending"],
       procs.sigkill_pending(st, os.getpid())]
os.waitpid(pid, 0)
os.write(st.proto_out, json.dumps(out).encode())
"""


HELD_PROC = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["runner"]
import inside
from inside import procs
st = inside.boot()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(r, 1)
    os._exit(0)
path = f"/proc/{pid}/limits"
first = procs.read_proc(st, path, hold=True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft - 7, hard))  # changed between two reads
again = procs.read_proc(st, path, hold=True)  # the same descriptor, read afresh
fresh = first != again and again == procs.read_proc(st, path) and b" %d " % (soft - 7) in again
os.write(w, b"x")
os.waitpid(pid, 0)
try:
    procs.read_proc(st, path, hold=True)
    after = "read"
except OSError as e:
    after = e.errno
print(json.dumps({"fresh": fresh, "held": path in st.proc_held,
                  "after": after, "esrch": __import__("errno").ESRCH}), file=os.fdopen(st.proto_out, "w"))
"""


def test_a_held_proc_file_reads_afresh_and_fails_once_its_process_is_gone(tmp_path):
    """``inside.procs.read_proc(hold=True)``: the reset's reads of the runner's and the zygote's state
    come from descriptors kept open; each read is the file as it is now, and once the process has
    ended (and been reaped) a read fails rather than reaching whatever process takes its number."""
    out = run_with_runner(tmp_path, HELD_PROC)
    assert out["fresh"] and out["held"], out
    assert out["after"] == out["esrch"], out


def test_a_process_on_its_way_out_is_not_taken_for_the_one_snapshotted():
    """``inside.procs.process_state``: a zombie (as a killed zygote is until reaped) reads ``ending``."""
    import subprocess
    import sys

    from importlib.util import find_spec

    where = os.path.dirname(os.path.dirname(find_spec("arl_tangram.managers.sandbox.inside").origin))  # (not imported)
    p = subprocess.run([sys.executable, "-c", ON_ITS_WAY_OUT, where],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [True, False, False]


REAP_THE_DYING = r"""
import ctypes, json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
sys.argv = ["runner", "--reap"]  # (the PID namespace's init, as the agent is in a sandbox)
import inside
from inside import procs
st = inside.boot()
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()


def state(pid):
    try:
        return procs.read_proc(st, f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"


def until(pid, want):
    for _ in range(500):
        if state(pid) == want:
            return
        time.sleep(0.01)
    raise SystemExit(f"{pid} never reached {want}: {state(pid)}")


r, w = os.pipe()
interpreter = os.fork()  # the session's interpreter: its child exits and it never waits for it
if interpreter == 0:
    os.close(r)
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.write(w, b"%d" % child)
    time.sleep(60)
    os._exit(0)
os.close(w)
zombie = int(os.read(r, 16))
until(zombie, "Z")
stray = os.fork()  # what a step left running
if stray == 0:
    time.sleep(60)
    os._exit(0)
leader = os.fork()  # its main thread gone, another one running: reads as a zombie, is not one
if leader == 0:
    libc.prctl(15, b"a) Z 1 (x", 0, 0, 0)  # PR_SET_NAME: a name to trip a parse that splits from the left
    threading.Thread(target=time.sleep, args=(60,)).start()
    libc.syscall(60, 0)  # exit(2) of the main thread alone
until(leader, "Z")
named = os.fork()
if named == 0:
    libc.prctl(15, b"b) Z 1 (x", 0, 0, 0)
    time.sleep(60)
    os._exit(0)
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
killed = os.fork()  # killed on this CPU while this process holds it: a SIGKILL pending, not yet acted on
if killed == 0:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass
time.sleep(0.05)
os.kill(killed, 9)
out = {"killed": procs.dying(killed, {me})}
os.waitpid(killed, 0)
out["dying"] = [procs.dying(zombie, {interpreter}), procs.dying(zombie, {me}), procs.dying(leader, {me}),
                procs.dying(named, {me}), procs.dying(stray, {me}), procs.dying(999999, set())]


class Interpreter:
    pid = interpreter


st.child = Interpreter()
t = time.monotonic()
out["reaped"] = procs.reap_strays(st)
out["took_s"] = time.monotonic() - t
out["zombie"] = state(zombie)  # (only its parent can reap it)
out["others"] = [state(p) for p in (stray, leader, named)]  # the agent's own: reaped before it answers
st.child = None  # no session's interpreter: everything gone before it says so, the zombie's parent too
out["reset"] = procs.reap_strays(st)
out["after"] = [state(p) for p in (interpreter, zombie)]
json.dump(out, os.fdopen(st.proto_out, "w"))
"""


def test_a_sessions_step_does_not_wait_on_its_interpreters_dying_children_but_kills_the_living():
    """``inside.procs.reap_strays`` with a session's interpreter alive: a zombie only the
    interpreter can reap (a ``Popen`` never waited for) does not hold the step's answer; a live stray, a process whose main thread has
    exited while another thread runs (it reads as a zombie) and one whose name holds ``) Z (``
    are killed, and reaped before it answers (the agent's own children: none is left for the next
    step to see). ``procs.dying``: a process killed and not yet run since is dying. Without the
    interpreter (a reset) nothing is spared. (Run in a PID namespace of its own: every process it
    finds there is killed.)"""
    from arl_tangram.managers.sandbox.isolation import INSIDE

    p = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--unshare-pid", "--as-pid-1", "--proc", "/proc",
                        "--die-with-parent", sys.executable, "-I", "-c", REAP_THE_DYING, str(INSIDE.parent)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["killed"] is True, out
    assert out["dying"] == [True, False, False, False, False, True], out
    assert out["reaped"] is True and out["took_s"] < 0.2, out  # (it spun ~0.42 s and said False)
    assert out["zombie"] == "Z" and out["others"] == ["gone"] * 3, out
    assert out["reset"] is True and out["after"] == ["gone", "gone"], out


def test_a_cells_child_left_unwaited_does_not_hold_up_the_sessions_steps():
    """A cell's ``subprocess.Popen`` never waited for leaves a zombie of the session's interpreter,
    which only the interpreter can reap: each later step's reaping waited on it ~0.42 s and gave
    up. The zombie stays the cell's (its exit status is the program's to read)."""
    async def main():
        async with Tangram.local(sandbox=SandboxConfig(warm_pool=0), cores=2) as tg:
            s = await tg.session()
            first = await s.exec(python="import subprocess, time\np = subprocess.Popen(['true'])\ntime.sleep(0.2)")
            steps, took = [], []
            for _ in range(3):
                t = time.monotonic()
                steps.append(await s.exec(python="print(open(f'/proc/{p.pid}/stat').read().rsplit(')', 1)[1][1])"))
                took.append(time.monotonic() - t)
            last = await s.exec(python="print(p.wait())")
            await s.close()
            return first, steps, took, last

    first, steps, took, last = asyncio.run(main())
    assert first.outcome is Outcome.OK, first
    assert [(r.outcome, r.stdout) for r in steps] == [(Outcome.OK, "Z\n")] * 3, steps
    assert min(took) < 0.3, took  # (each step waited ~0.43 s)
    assert (last.outcome, last.stdout) == (Outcome.OK, "0\n"), last


def test_a_changed_affinity_is_put_back():
    out = attack_then_inspect("import os\nos.sched_setaffinity(1, {0})\nos.sched_setaffinity(2, {0})")
    assert_pristine(out, reused=True)


def test_filling_tmp_and_shm_leaves_the_next_run_room():
    attack = r'''
for root in ("/tmp", "/dev/shm", "/workspace"):
    try:
        with open(f"{root}/fill", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
    except OSError as e:
        print(root, e.errno)
'''
    out = attack_then_inspect(attack, timeout_s=20)
    assert "/tmp 28" in out["attack"].stdout, out["attack"].stdout + out["attack"].stderr
    assert_pristine(out, reused=True)


def test_ipc_objects_and_keys_do_not_carry_over():
    attack = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("shm", libc.shmget(0x1234, 4096, 0o1600) >= 0)
print("msg", libc.msgget(0x1235, 0o1600) >= 0)
print("sem", libc.semget(0x1236, 1, 0o1600) >= 0)
c = ctypes.c_long
print("key", libc.syscall(c(248), b"user", b"leak", b"secret", c(6), c(-4)) > 0)
print("mq", libc.mq_open(b"/leak", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)
'''
    out = attack_then_inspect(attack)
    # the keyrings are closed to sandboxed code (inside.reset.deny_keyrings): the add is refused outright
    assert "shm True" in out["attack"].stdout and "key False" in out["attack"].stdout, out["attack"].stdout
    assert "mq False" in out["attack"].stdout  # POSIX queues cannot be created at all (RLIMIT_MSGQUEUE 0)
    assert_pristine(out, reused=True)


def test_a_bash_one_shot_is_recycled_too():
    out = attack_then_inspect("mkdir -p /tmp/a && echo hi > /tmp/a/b && (sleep 600 &) && echo ok", language="bash")
    assert out["attack"].stdout == "ok\n"
    assert_pristine(out, reused=True)


def test_later_runs_cannot_read_earlier_requests_from_memory():
    """A one-shot's code and stdin never enter the memory a later one-shot is forked from."""
    secret = "expected-answer-7f3a9c"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    probe = f"""
import hashlib
prefix, found = b"expected-answer-", False  # the whole secret never appears in this program
with open("/proc/self/maps") as fh:
    maps = fh.read().splitlines()
with open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        addr, perms = line.split()[:2]
        if "r" not in perms:
            continue
        lo, hi = (int(x, 16) for x in addr.split("-"))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except OSError:
            continue
        at = data.find(prefix)
        while at >= 0:
            found |= hashlib.sha256(data[at:at + {len(secret)}]).hexdigest() == {digest!r}
            at = data.find(prefix, at + 1)
print(found)
"""
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            rec = tg.runtime.sandboxes.recycler
            # a reward check whose code, stdin and output all hold the expected answer
            await tg.run(f"got = input()\nprint('expected', {secret!r}, 'got', got)", stdin=secret + "\n")
            stats = await _settle(tg, 0)  # (read before the probe: its own reset may be counted at once)
            return await tg.run(probe), stats

    r, stats = asyncio.run(main())
    assert stats["recycled"] == 1 and r.outcome is Outcome.OK
    assert r.stdout == "False\n", r.stderr


def test_a_child_forked_ahead_is_seen_by_no_other_kind_of_run():
    """After a python run, the reset forks the next python child ahead; a bash run that comes
    instead sees only the runner and the zygote (the child is killed first), and a python run
    after it is forked as usual."""
    listing = "for p in /proc/[0-9]*; do p=${p#/proc/}; [ $p != $$ ] && [ $p != $BASHPID ] && echo $p; done; true"
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            rec = tg.runtime.sandboxes.recycler
            await tg.run("print(1)")
            await _settle(tg, 0)
            seen = await tg.run(listing, "bash")
            stats = await _settle(tg, 1)  # (before the last run: its own reset may be counted at once)
            again = await tg.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()"
                                 " and int(p) != os.getpid()))")
            return seen, again, stats

    seen, again, stats = asyncio.run(main())
    assert seen.outcome is Outcome.OK and again.outcome is Outcome.OK, (seen, again)
    others = sorted(int(p) for p in seen.stdout.split() if int(p) not in (1, 2))
    assert len(others) <= 1, seen.stdout  # at most the `[` or subshell bash forked to run the test itself
    assert again.stdout == "[1, 2]\n", again.stdout
    assert stats["recycled"] == 2 and not stats["discarded"], stats


#: a script's start that drives the agent's ``Zygote`` itself (``z``), answering on ``out``
WITH_ZYGOTE = PRELUDE + r'''
import signal, tempfile, time
from inside import unb64, zygote
z = zygote.Zygote(st)
'''

ZYGOTE_PROTOCOL = WITH_ZYGOTE + r'''
req = {"cwd": tempfile.gettempdir(), "code": "import os\nprint(os.getpid())", "timeout_s": 10}
seen = []
def run():
    r = z.run(req)
    seen.append((r["exit_code"], unb64(r["stdout"]).decode().strip()))
run()
z.fork_ahead()
ahead = z.ahead
run()                                  # the child forked ahead runs it
z.fork_ahead()
os.kill(z.ahead, signal.SIGKILL)       # it dies idle: the next run forks one, in step with the zygote
run()
run()
z.fork_ahead()
z.drop_ahead()
run()
late = []                              # runs past their deadline: killed with their group, whoever took them
slow = dict(req, code="import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(30)", timeout_s=0.5)
for how in ("ahead", "died idle", "on demand"):
    if how != "on demand":
        z.fork_ahead()
    if how == "died idle":
        os.kill(z.ahead, signal.SIGKILL)
    r = z.run(slow)
    late.append((r["timed_out"], r.get("signal"), unb64(r["stdout"]).decode().strip()))
run()
print(json.dumps({"ahead": ahead, "seen": seen, "late": late, "broken": z.broken}), file=out, flush=True)
'''


def test_the_zygote_protocol_survives_a_child_forked_ahead_dying_idle(tmp_path):
    out = run_with_runner(tmp_path, ZYGOTE_PROTOCOL)  # (booting the agent would take over our fds)
    assert out["broken"] == ""
    assert [code for code, _ in out["seen"]] == [0] * 6, out
    assert out["seen"][1][1] == str(out["ahead"])  # the second run was the child forked ahead
    assert len({pid for _, pid in out["seen"]}) == 6, out  # a fresh process every run
    # a run past its deadline is killed (SIGKILL, its group) whether the child forked ahead took it,
    # or, that one having died idle, the one the zygote forked for it, or one forked on demand; the
    # zygote stays in step
    assert [(t, sig) for t, sig, _ in out["late"]] == [(True, 9)] * 3, out


ZYGOTE_OUT_OF_STEP = WITH_ZYGOTE + r'''
req = {"cwd": tempfile.gettempdir(), "code": "print(1)", "timeout_s": 10}
z.run(req)
z.fork_ahead()
seen = {}
try:
    z.run(dict(req, stdin="a"))        # not base64: refused before anything is sent to the zygote
except Exception as e:
    seen["bad_stdin"] = type(e).__name__
seen["after_bad_stdin"] = (unb64(z.run(req)["stdout"]).decode(), z.broken)
z.fork_ahead()
collect = zygote.collect
def failing(*a, **k):
    raise OSError("collecting failed")
zygote.collect = failing                # a failure after the send: the zygote's replies go unread
try:
    z.run(req)
except OSError:
    pass
zygote.collect = collect
seen["after_failure"] = z.broken
y = zygote.Zygote(st)                   # a zygote that never says who took the run (stopped)
y.run(req)
os.kill(y.pid, signal.SIGSTOP)
t = time.monotonic()
try:
    y.run(dict(req, timeout_s=0.5))
    seen["silent"] = "answered"
except RuntimeError as e:
    seen["silent"] = str(e)
seen["silent_s"] = time.monotonic() - t
os.kill(y.pid, signal.SIGKILL)
print(json.dumps(seen), file=out, flush=True)
'''


def test_a_run_that_fails_after_its_request_went_to_the_zygote_breaks_it(tmp_path):
    """``Zygote.run`` reads who took its request only once the output has ended: a failure in
    between would leave the zygote's replies unread, and the next call would read them out of step
    (a review found a reset then coming back clean). Such a failure now breaks the zygote (the reset
    discards the sandbox); a request's own bad value fails before anything is sent; a zygote that
    never says who took the run is the runner's error by the run's deadline plus ``TAKEN_LATE_S``."""
    out = run_with_runner(tmp_path, ZYGOTE_OUT_OF_STEP)
    assert out["bad_stdin"] == "Error", out
    assert out["after_bad_stdin"] == ["1\n", ""], out
    assert out["after_failure"], out
    # a zygote silent at the run's deadline is the runner's error (infra_error), said well before the
    # host's own grace past the deadline (5 s) would kill the sandbox and call it the run's timeout
    assert out["silent"].startswith("zygote:") and out["silent_s"] < 0.5 + 4.0, out


USER_PROCESS = ("import ctypes, os, signal\n"
                "print(os.getpgid(0) == os.getpid(), os.getsid(0) != os.getpid(),"
                " signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
                " ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")  # PR_GET_DUMPABLE
#: bash: its process group and session from /proc (pgrp and session are the 5th and 6th fields)
BASH_GROUP = 'read -r -a f < /proc/$$/stat; [ "${f[4]}" = $$ ]; g=$?; [ "${f[5]}" != $$ ]; echo $g $?'


def test_a_one_shot_leads_a_process_group_of_its_own_but_no_session_with_pythons_sigint_and_dumpable():
    """``Zygote.child``: the first run's child is forked for it, the later ones ahead (the reset
    after a python run); each leads a process group of its own (what a timeout kills), but no
    session of its own (a session costs the kernel an autogroup: inside/procs.py, "A run's process
    group"), has Python's SIGINT handler (a KeyboardInterrupt), and is an ordinary (dumpable)
    process again, unlike the zygote. A bash one-shot (started by posix_spawn, then ahead) too."""
    runs, stats = _bash_runs([(USER_PROCESS, {"language": "python"}) for _ in range(3)]
                             + [(BASH_GROUP, {}) for _ in range(3)])
    assert [(r.outcome, r.stdout) for r in runs] == ([(Outcome.OK, "True True True 1\n")] * 3
                                                     + [(Outcome.OK, "0 0\n")] * 3), runs
    assert stats["recycled"] == 6 and not stats["discarded"], stats


PYTHON_STATE = ("import ctypes, os, signal, sys\n"
                "print(sorted(os.environ.items()), os.getcwd(), os.getpgid(0) == os.getpid(),"
                " signal.getsignal(signal.SIGINT) is signal.default_int_handler, ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),"
                " sys.stdin.read(), sys.stdout.seekable(), sorted(os.listdir('/proc/self/fd')))")


def test_a_python_run_in_a_child_forked_ahead_starts_as_one_forked_for_it(tmp_path):
    """The child forked ahead rehearses a run's steps before it waits (``inside.zygote.warm``: a request
    read from its own pipe, the environment's names, dumpability, the workspace): a run it takes
    sees what a child forked for the run sees, with another environment too (its variables, none
    of the rehearsal's), and the names the rehearsal sets are those the host gives every run."""
    from arl_tangram.managers.sandbox.execution import request_env

    runs, stats = _bash_runs([(PYTHON_STATE, {"language": "python", "stdin": "in"}) for _ in range(3)])
    first, ahead, again = runs
    assert all(r.outcome is Outcome.OK for r in runs), runs
    assert ahead.stdout == first.stdout == again.stdout, (first.stdout, ahead.stdout)
    assert "'MKL_NUM_THREADS', '1'" in first.stdout and " True True 1 in False " in first.stdout, first.stdout
    assert stats["recycled"] == 3 and not stats["discarded"], stats
    two = [(PYTHON_STATE, {"language": "python", "cpus": 2}) for _ in range(2)]  # values not the rehearsal's
    other, stats = _bash_runs(two, cores=2)
    assert other[0].stdout == other[1].stdout and "'MKL_NUM_THREADS', '2'" in other[1].stdout, other
    names = run_with_runner(tmp_path, PRELUDE + "from inside.zygote import RUN_ENV\n"
                            "print(json.dumps(sorted(RUN_ENV)), file=out)")
    assert names == sorted(request_env((0,))), names


def test_fork_ahead_is_the_configs_to_choose():
    """With ``fork_ahead`` a recycled sandbox waits in the pool with one process more (the next
    run's child) than without; either way the runs are recycled and correct."""
    async def main(ahead: bool):
        cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1, fork_ahead=ahead)
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            mgr = tg.runtime.sandboxes
            r = await tg.run("print(1)")
            await _settle(tg, 0)
            pooled = list(mgr.pool.idle)
            if len(pooled) != 1 or pooled[0].group is None:
                pytest.skip("no cgroups here: the sandbox's processes cannot be counted from the host")
            procs = pooled[0].group.pids()
            again = await tg.run("print(2)")
            return r, procs, again, await _settle(tg, 1)

    runs = {ahead: asyncio.run(main(ahead)) for ahead in (True, False)}
    for r, _, again, stats in runs.values():
        assert r.stdout == "1\n" and again.stdout == "2\n"
        assert stats["recycled"] == 2 and not stats["discarded"], stats
    assert len(runs[True][1]) == len(runs[False][1]) + 1, (runs[True][1], runs[False][1])



def test_a_one_shots_reset_rides_on_its_run_unless_its_memory_limit_is_its_own(monkeypatch):
    """A one-shot's reset is sent with its run (``Recycler.riding``): one write to the sandbox per
    one-shot, recycled as before, the next run correct in it. A run under a memory limit of its
    own below the default gets its reset asked afterwards (its OOM count is read first)."""
    import marshal

    from arl_tangram.managers.sandbox.sandbox import Sandbox

    writes: list[tuple[str, str | None]] = []
    send = Sandbox._send

    def counted(self, data: bytes, riding: int = 0) -> None:
        req = marshal.loads(data[4:])
        if req["op"] in ("python", "run", "reset"):  # (the sessions' warm pool writes its own)
            writes.append((req["op"], (req.get("then") or {}).get("op")))
        send(self, data, riding)

    monkeypatch.setattr(Sandbox, "_send", counted)

    async def main():
        cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            seen = []
            for i, (code, kw) in enumerate([("print(1)", {}), ("print(2)", {"memory_mb": 256}),
                                            ("print(3)", {}), ("echo 4", {"language": "bash"})]):
                writes.clear()
                r = await tg.run(code, **kw)
                stats = await _settle(tg, i)
                seen.append((r.stdout, list(writes), stats["recycled"]))
            return seen

    seen = asyncio.run(main())
    assert seen[0] == ("1\n", [("python", "reset")], 1), seen
    assert seen[1] == ("2\n", [("python", None), ("reset", None)], 2), seen
    assert seen[2] == ("3\n", [("python", "reset")], 3), seen
    assert seen[3] == ("4\n", [("run", "reset")], 4), seen




def test_a_request_after_an_unread_riding_reset_reads_it_first_and_drops_an_unclean_sandbox():
    """A request sent while a riding reset's answer is unread reads that answer first, so the
    channel stays in step; a reset that did not find the sandbox clean kills it, as an
    infrastructure failure (never a timeout of the request that came next)."""
    from arl_tangram.managers.sandbox.sandbox import SandboxDied

    async def main():
        cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)
        async with Tangram.local(sandbox=cfg, cores=1) as tg:
            mgr = tg.runtime.sandboxes
            out = {}
            for name, code in (("clean", "print(1)"),
                               ("unclean", "import os\nos.setpriority(os.PRIO_PROCESS, 2, 19)")):
                sb = await mgr.pool.take()
                run = {**mgr.execution.base((0,), sb), "op": "python", "code": code, "stdin": None, "timeout_s": 5,
                       "files": {}, "fetch": []}
                await sb.request(run, 10, then=mgr.recycler.riding(sb))
                pending = sb.then_pending
                try:
                    await sb.request({"op": "ping"}, 10)
                    out[name] = (pending, "answered", sb.dead, sb.then_pending)
                except SandboxDied as e:
                    out[name] = (pending, "died", e.deadline, sb.dead)
                await sb.kill()
            return out

    out = asyncio.run(main())
    assert out["clean"] == (True, "answered", False, False), out
    assert out["unclean"] == (True, "died", False, True), out


def test_a_clean_sandbox_past_the_idle_cap_is_killed_and_counted():
    """Three one-shots at once with room for one idle sandbox: one is recycled, the other two
    reset clean but are killed at the cap, counted apart (``over_cap``) from the unclean ones."""
    async def main():
        cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1, max_idle_sandboxes=1)
        async with Tangram.local(sandbox=cfg, cores=3) as tg:
            rs = await asyncio.gather(*(tg.run(f"print({i})") for i in range(3)))
            counts = tg.runtime.sandboxes.one_shot_sandboxes()
            for _ in range(200):
                counts = tg.runtime.sandboxes.one_shot_sandboxes()
                if counts["recycled"] + counts["discarded"] + counts["over_cap"] >= 3:
                    break
                await asyncio.sleep(0.02)
            return [r.stdout for r in rs], counts

    outs, counts = asyncio.run(main())
    assert outs == ["0\n", "1\n", "2\n"]
    assert (counts["recycled"], counts["over_cap"], counts["discarded"]) == (1, 2, 0), counts


NO_TRACEBACK = r"""
import builtins, json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
sys.argv = ["runner"]
real = builtins.__import__
def without_traceback(name, *args, **kwargs):
    if name == "traceback":
        raise ImportError("an image's minimal python")
    return real(name, *args, **kwargs)
builtins.__import__ = without_traceback
import inside
from inside import zygote
st = inside.boot()
out = os.fdopen(st.proto_out, "w")
z = zygote.Zygote(st)
r = z.run({"cwd": tempfile.gettempdir(), "code": "print(5)", "timeout_s": 10})
print(json.dumps({"exit": r["exit_code"], "stdout": inside.unb64(r["stdout"]).decode(), "broken": z.broken}), file=out)
"""


def test_a_python_without_a_module_the_rehearsal_uses_still_runs_one_shots(tmp_path):
    assert run_with_runner(tmp_path, NO_TRACEBACK) == {"exit": 0, "stdout": "5\n", "broken": ""}


# A python one-shot's child says how it ended on a pipe of its own and closes its streams before
# its exit (the address space's teardown then comes after the answer). A child can forge that
# report: it may claim any exit code (as os._exit could) but must not outlive its run.
FORGED_END = r'''
import os, time
for fd in map(int, os.listdir("/proc/self/fd")):
    if fd > 2:
        try:
            os.write(fd, (0).to_bytes(4, "little"))
        except OSError:
            pass
os.close(1)
os.close(2)
time.sleep(0.3)
open("/tmp/late", "w").write("outlived its run")
time.sleep(600)
'''


def test_a_child_that_reports_its_end_and_lingers_is_killed():
    t = time.monotonic()
    out = attack_then_inspect(FORGED_END, timeout_s=20)
    assert out["attack"].outcome is Outcome.OK, out["attack"]  # the code it chose to report
    assert time.monotonic() - t < 15  # never waited for to its timeout
    assert_pristine(out, reused=True)  # no /tmp/late, no process left


def _three_runs_in_one_sandbox(code: str) -> tuple[list, dict]:
    """``code`` run three times in one recycled sandbox (its child forked on demand, then ahead),
    each run's sandbox settled before the next: the runs and the recycler's figures."""
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            runs = []
            for i in range(3):
                runs.append(await tg.run(code, timeout_s=10))
                await _settle(tg, i)
            return runs, tg.runtime.sandboxes.recycler.stats()

    return asyncio.run(main())


THREAD_LEFT = r"""
import os, threading, time
out = os.dup(1)
def tick():
    for _ in range(300):
        os.write(out, b"tick\n")
        time.sleep(0.01)
threading.Thread(target=tick).start()
time.sleep(0.05)
print("main done", flush=True)
"""


def test_a_python_child_with_a_thread_left_ends_with_it():
    """A child that reported its end waits for the runner's kill (issue 26), but not one whose
    program left a thread running: that thread ends with the program, as under ``os._exit``,
    and writes nothing more (waiting, it would tick on into the output for LINGER_S)."""
    runs, stats = _three_runs_in_one_sandbox(THREAD_LEFT)
    for r in runs:
        assert r.outcome is Outcome.OK and "main done\n" in r.stdout, (r.outcome, r.stderr)
        assert r.stdout.count("tick") <= 15, r.stdout.count("tick")
    assert stats["recycled"] == 3 and not stats["discarded"], stats


FORKED_COPY = "import os\npid = os.fork()\nprint('parent' if pid else 'child', flush=True)\n"


@pytest.mark.parametrize("wait", [False, True], ids=["parent-ends-first", "parent-waits-for-it"])
def test_a_program_whose_forked_copy_returns_is_answered_at_its_end(wait):
    """A copy of the program made by ``os.fork`` returns through the child's end too (writing a
    status of its own): it never waits for the runner, which would then wait (for LINGER_S,
    1 s) on a parent that waits for it. A hang check, not a timing: a second is the bug."""
    code = FORKED_COPY + ("if pid:\n    os.waitpid(pid, 0)\n" if wait else "")
    runs, _ = _three_runs_in_one_sandbox(code)
    for r in runs:
        assert r.outcome is Outcome.OK and sorted(r.stdout.split()) == ["child", "parent"], (r.outcome, r.stdout)
        assert r.result.run.duration_s < 0.9, r.result.run.duration_s


@pytest.mark.parametrize("code, exit_code", [
    ("import sys\nsys.exit(3)", 3),
    ("import sys\nsys.exit(256 + 4)", 4),              # as the kernel keeps it: the low byte
    ("import sys\nsys.exit('bye')", 1),
    ("raise ValueError('no')", 1),
    ("import os\nos._exit(5)", 5),                      # no report: the zygote's wait status
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", -11),
    ("print('ok')", 0),
], ids=["exit-3", "exit-260", "exit-text", "raise", "os-exit", "signal", "ok"])
def test_a_python_child_ends_with_the_status_a_fresh_process_would(code, exit_code):
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=2) as tg:
            await tg.run("print(0)")
            await _settle(tg, 0)  # the next run is the child forked ahead in a recycled sandbox
            r = await tg.run(code)
            stats = await _settle(tg, 1)
            return r, await tg.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()"
                                   " and int(p) != os.getpid()))"), stats

    r, after, stats = asyncio.run(main())
    assert r.result.run.exit_code == exit_code, (r.result.run, r.stderr)
    assert (r.outcome is Outcome.OK) == (exit_code == 0)
    if code.startswith("raise"):
        assert "ValueError: no" in r.stderr
    assert after.stdout == "[1, 2]\n" and stats["recycled"] == 2 and not stats["discarded"], (after, stats)


OUT_OF_PROTOCOL = PRELUDE + r'''
import tempfile
from inside import zygote
z = zygote.Zygote(st)
req = {"cwd": tempfile.gettempdir(), "code": "print(1)", "timeout_s": 10}
first = z.run(req)["exit_code"]
z.settle()
z.sock.sendall(b"g" + (5).to_bytes(4, "little") + b"stale")  # a run's bytes without its descriptors
z.fork_ahead()
try:
    z.run(req)
    ran = True
except RuntimeError:
    ran = False
print(json.dumps({"first": first, "broken": z.broken, "ran": ran}), file=out, flush=True)
'''


def test_the_zygote_ends_on_a_message_out_of_protocol(tmp_path):
    """A request's bytes that reach the zygote itself (a run's child died before reading them)
    are never taken for a run: the zygote ends, and the runner finds it broken (its sandbox is
    then discarded, not recycled)."""
    out = run_with_runner(tmp_path, OUT_OF_PROTOCOL)
    assert out["first"] == 0 and out["broken"] and not out["ran"], out


# -- a bash started ahead (issue 26) -----------------------------------------------------------------
# After a bash one-shot the reset starts the next one's bash ahead, held before its script
# (inside/procs.py, "A bash started ahead"). These run the same probe in a fresh bash and in one started
# ahead and compare everything a script can see, then attack and inspect as above.

#: whether this bash was started ahead (its initial environment holds the BASH_ENV it waited on)
AHEAD_MARK = 'grep -c "^BASH_ENV=" <(tr "\\0" "\\n" < /proc/$$/environ) || true'

# (the shell's descriptors are listed into a file: listed into a pipeline, the shell itself may
# still hold one of the pipeline's pipes while ls reads them, on a loaded machine)
BASH_PROBE = r'''echo "_=$_"
echo "0=$0 #=$# seconds=$SECONDS pwd=$(pwd) BASH_ENV=${BASH_ENV-unset}"
read -r line; echo "stdin=$line"; rest=$(cat); echo "rest=$rest"
env | grep -v '^_=' | sort
ls /proc/$$/fd > /tmp/fds; sort -n /tmp/fds | tr '\n' ' '; echo
trap -p; set -o | grep -c on; shopt | grep -c on; echo "opts=$-"
ulimit -a | md5sum; echo "nice=$(nice)"
echo "to stderr" >&2
exit 3
'''


def _bash_runs(scripts: list[tuple[str, dict]], cores: int = 2) -> tuple[list, dict]:
    """Run ``scripts`` (code, run() keyword arguments) one after another in one recycled sandbox."""
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=cores) as tg:
            assert tg.runtime.sandboxes.mode is Isolation.BWRAP
            out = []
            for i, (code, kw) in enumerate(scripts):
                out.append(await tg.run(code, kw.pop("language", "bash"), **kw))
                await _settle(tg, i)
            return out, tg.runtime.sandboxes.recycler.stats()

    return asyncio.run(main())


def _ahead(r) -> str:
    return r.stdout.rsplit("\n", 2)[-2]


def test_a_bash_started_ahead_runs_a_script_as_a_fresh_bash_does():
    code = BASH_PROBE.replace("exit 3", AHEAD_MARK + "\nexit 3")
    runs, stats = _bash_runs([(code, {"stdin": "first line\nmore\n"})] * 3)
    fresh, ahead, again = runs
    assert [_ahead(r) for r in runs] == ["0", "1", "1"], [r.stdout for r in runs]  # (fails with no bash ahead)
    for r in runs:
        assert r.outcome is Outcome.FAILED and r.result.run.exit_code == 3, (r.outcome, r.stderr)
        assert r.stderr == "to stderr\n", r.stderr
        assert r.stdout.rsplit("\n", 2)[0] == fresh.stdout.rsplit("\n", 2)[0], (fresh.stdout, r.stdout)
    lines = fresh.stdout.splitlines()
    assert lines[0] == "_=bash" and lines[1] == "0=main.sh #=0 seconds=0 pwd=/workspace BASH_ENV=unset", lines
    assert "stdin=first line" in lines and "rest=more" in lines, lines
    assert stats["recycled"] == 3 and not stats["discarded"], stats


def test_a_bash_started_ahead_times_out_and_is_killed_with_its_group():
    runs, stats = _bash_runs([("echo 1", {}),
                              ("(sleep 30; echo late) & sleep 30", {"timeout_s": 0.5}),
                              ("echo $0; " + AHEAD_MARK, {})])
    first, slow, after = runs
    assert slow.outcome is Outcome.TIMEOUT and slow.result.run.timed_out, slow
    assert slow.result.run.duration_s < 5, slow.result.run.duration_s
    assert "late" not in slow.stdout
    assert after.outcome is Outcome.OK and after.stdout == "main.sh\n1\n", after.stdout
    assert stats["recycled"] == 3 and not stats["discarded"], stats


def test_a_bash_started_ahead_is_used_only_by_the_run_it_was_started_for():
    """After a bash run: a python run sees no bash waiting (it was killed first); a bash run under
    another environment (here: more cores, so another TANGRAM_NUM_CPUS) starts its own."""
    listing = ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()))")
    runs, stats = _bash_runs([("echo 1", {}), (listing, {"language": "python"}), ("echo 2", {}),
                              ("echo $TANGRAM_NUM_CPUS; " + AHEAD_MARK, {"cpus": 2}),
                              ("echo $TANGRAM_NUM_CPUS; " + AHEAD_MARK, {"cpus": 2})], cores=2)
    assert runs[1].stdout == "[1, 2]\n", runs[1].stdout  # the runner and the zygote only
    assert runs[3].stdout == "2\n0\n" and runs[4].stdout == "2\n1\n", (runs[3].stdout, runs[4].stdout)
    assert stats["recycled"] == 5 and not stats["discarded"], stats


def test_a_bash_started_ahead_takes_the_runs_memory_cap():
    """SandboxFusion's ``memory_limit_MB`` (an address space cap): a bash started ahead for a
    capped run has that cap, as a fresh one does; a run under another cap starts its own."""
    probe = "ulimit -v; ulimit -d; " + AHEAD_MARK
    capped = {"memory_mb": 300, "memory_as_rlimit": True}
    runs, stats = _bash_runs([(probe, dict(capped)), (probe, dict(capped)), (probe, dict(capped)),
                              (probe, {"memory_mb": 200, "memory_as_rlimit": True}), (probe, {})])
    assert [r.stdout for r in runs] == ["307200\n307200\n0\n", "307200\n307200\n1\n", "307200\n307200\n1\n",
                                        "204800\n204800\n0\n", "unlimited\nunlimited\n0\n"], [r.stdout for r in runs]
    mapping = "python3 -c 'import mmap; mmap.mmap(-1, 400 << 20); print(\"mapped\")'; " + AHEAD_MARK
    too_big = _bash_runs([(mapping, dict(capped))] * 2)[0]  # untouched: only the address space cap stops it
    assert [r.stdout for r in too_big] == ["0\n", "1\n"], [(r.stdout, r.stderr) for r in too_big]
    assert all("Cannot allocate memory" in r.stderr for r in too_big), [r.stderr for r in too_big]
    assert stats["recycled"] == 5 and not stats["discarded"], stats


BASH_INVENTORY = r'''for r in /workspace /tmp /dev/shm; do echo "$r: $(stat -c %a $r) $(find $r -mindepth 1 | sort | tr '\n' ' ')"; done
for p in /proc/[0-9]*; do p=${p#/proc/}; [ $p != 1 ] && [ $p != 2 ] && [ $p != $$ ] && [ $p != $BASHPID ] && echo "proc $p $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null)"; done
cat /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem | grep -vc key
env | sort | md5sum
'''


def test_what_a_bash_run_leaves_is_not_seen_by_the_bash_started_ahead_for_the_next():
    attack = r'''for r in /workspace /tmp /dev/shm; do mkdir -p $r/.hidden; echo left > $r/.hidden/note; chmod 0 $r/.hidden; done
(setsid sleep 600 &) ; (while true; do date >> /tmp/beat; sleep 0.01; done &)
export LEFT=1; echo 'echo planted' > ~/.bashrc; echo 'echo planted' > /workspace/main.sh.next
python3 -c "import ctypes; l = ctypes.CDLL(None); print('shm', l.shmget(0x99, 4096, 0o1600) >= 0)"
echo attacked'''
    runs, stats = _bash_runs([(BASH_INVENTORY, {}), (attack, {}), (BASH_INVENTORY + AHEAD_MARK, {})])
    fresh, attacked, after = runs
    assert attacked.stdout == "shm True\nattacked\n", (attacked.stdout, attacked.stderr)
    assert after.stdout == fresh.stdout + "1\n", (fresh.stdout, after.stdout)
    assert "planted" not in after.stdout and after.stderr == "", after.stderr
    assert stats["recycled"] == 3 and not stats["discarded"], stats


def test_a_run_that_finds_the_pool_empty_waits_for_the_sandbox_being_reset():
    """The only sandbox is being reset when the next one-shot starts: that run waits the reset
    out (about a millisecond) and takes it, rather than starting a sandbox of its own (10-50 ms
    of CPU; at 16 cores such starts had python one-shots cost 3.9 ms of sandbox CPU instead of
    3.0, docs/performance.md)."""
    cfg = SandboxConfig(warm_pool=0, recycle_pool_max=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=1) as tg:
            mgr = tg.runtime.sandboxes
            assert mgr.mode is Isolation.BWRAP
            outs, resetting = [], []
            for i in range(5):  # each next run starts as the last one's answer is read: its reset is under way
                r = await tg.run(f"print({i})")
                resetting.append(mgr.recycler.resetting)
                outs.append(r.stdout)
            await _settle(tg, mgr.recycler.recycled)
            return outs, resetting, dict(mgr.fresh), mgr.recycler.stats()

    outs, resetting, fresh, stats = asyncio.run(main())
    assert outs == [f"{i}\n" for i in range(5)]
    # else the test proves nothing (a reset riding on its run may be over already when the next comes)
    assert 1 in resetting, resetting
    assert fresh == {"run": 1}, (fresh, stats)  # the first run's sandbox, and no other
    assert stats["recycled"] == 5, stats


def test_sandboxes_wear_out_each_at_its_own_count():
    """``recycle_max_uses`` bounds every sandbox, but each draws its own count, so sandboxes made
    and used together are not all replaced at once (issue 26: on 12 and 14 cores they wore out in
    bunches and runs found the pool empty): over the upper half until the first wears out (the
    first generation, used at one pace), from the last tenth after (replacements, already spread)."""
    from types import SimpleNamespace

    from arl_tangram.managers.sandbox.recycle import Recycler

    def sandbox():
        return SimpleNamespace(uses=0, max_uses=None, recyclable=True, dead=False,
                               proc=SimpleNamespace(returncode=None))

    rec = Recycler(True, put=lambda sb: True, spawn=lambda coro: None, max_uses=100)
    first = [rec.limit(sandbox()) for _ in range(2000)]
    assert min(first) == 50 and max(first) == 100 and len(set(first)) == 51, sorted(set(first))
    sb = sandbox()
    sb.uses = rec.limit(sb) - 2  # its last run but one: reset for another
    assert rec._not_reset(sb) is None
    assert min(rec.limit(sandbox()) for _ in range(100)) < 90  # (none has worn out yet)
    sb.uses += 1  # its last: replaced, and its count stays its own
    assert rec._not_reset(sb) == "worn out" and rec.limit(sb) == sb.uses + 1
    limits = [rec.limit(sandbox()) for _ in range(300)]  # its replacement, and every one after
    assert min(limits) == 90 and max(limits) == 100 and len(set(limits)) == 11, sorted(set(limits))
    assert {Recycler(True, lambda sb: True, lambda c: None, max_uses=1).limit(sandbox()) for _ in range(5)} == {1}


def test_a_sandbox_lost_from_circulation_is_replaced_within_the_idle_cap():
    """A recycled one-shot sandbox discarded after its run (worn out, unclean, dead) is replaced
    in the background at once: under load the warm pool's own rule counts the sandboxes that
    followers hold and never refills, so the circulation (three a busy core) dwindled until runs
    found the pool empty and started their own (issue 26: 2-14 a level on 12 cores). Never past
    the idle cap: with every sandbox discarded after its run, the pool would otherwise grow by
    one a run."""
    from types import SimpleNamespace

    from arl_tangram.managers.sandbox.recycle import Recycler

    async def recycler_side():
        lost = []
        tasks = []
        rec = Recycler(True, put=lambda sb: True, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
                       max_uses=1, lost=lambda: lost.append(1))

        async def kill():
            pass

        rec.release(SimpleNamespace(id="sb", uses=0, max_uses=None, recyclable=True, dead=False, kill=kill,
                                    proc=SimpleNamespace(returncode=None)))
        off = Recycler(False, put=lambda sb: True, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
                       lost=lambda: lost.append(2))
        off.release(SimpleNamespace(id="sb2", uses=0, max_uses=None, recyclable=True, dead=False, kill=kill,
                                    proc=SimpleNamespace(returncode=None)))
        await asyncio.gather(*tasks)
        return lost, dict(rec.discarded), dict(off.discarded)

    lost, worn, off = asyncio.run(recycler_side())
    assert worn == {"worn out": 1} and off == {"recycling off": 1}
    assert lost == [1]  # a sandbox never in circulation (recycling off: each run a fresh one) is not owed

    cfg = SandboxConfig(warm_pool=1, recycle_pool_max=3)

    async def manager_side():
        async with Tangram.local(sandbox=cfg, cores=1) as tg:
            mgr = tg.runtime.sandboxes

            async def pool_reaches(n):
                for _ in range(300):
                    if len(mgr.pool.idle) >= n:
                        return
                    await asyncio.sleep(0.02)

            await pool_reaches(1)  # the warm pool, full: its own rule starts nothing more
            started = mgr.fresh["pool"]
            mgr.lease.followers = 3  # as under load: every core's follower holds a sandbox (the rule's blind spot)
            try:
                mgr.recycler.lost()
                mgr.recycler.lost()
                await pool_reaches(3)
                sizes = [len(mgr.pool.idle)]
                mgr.recycler.lost()  # at the idle cap: nothing more
                await asyncio.sleep(0.5)
                sizes.append(len(mgr.pool.idle))
            finally:
                mgr.lease.followers = 0
            return mgr.fresh["pool"] - started, sizes

    started, sizes = asyncio.run(manager_side())
    assert started == 2 and sizes == [3, 3], (started, sizes)


def test_at_a_light_load_each_discard_is_replaced_once():
    """Runs one after another, each sandbox worn out after one (``recycle_max_uses=1``): the warm
    pool's own rule replaces each run's sandbox as it is taken, so the discard owes nothing more
    (the pool stays at its warm size, one start a run); a session's sandbox owes nothing either."""
    cfg = SandboxConfig(warm_pool=1, recycle_pool_max=2, recycle_max_uses=1)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=1) as tg:
            mgr = tg.runtime.sandboxes
            async def pooled():
                for _ in range(300):
                    if mgr.pool.idle:
                        return
                    await asyncio.sleep(0.02)

            await pooled()
            before = mgr.fresh["pool"]
            for i in range(4):
                r = await tg.run(f"print({i})")
                assert r.stdout == f"{i}\n", r
                await _settle(tg, mgr.recycler.recycled + sum(mgr.recycler.discarded.values()) - 1)
                await pooled()  # (a run sooner than a start finds the pool empty whatever the rule)
            await asyncio.sleep(0.5)  # any replacement started by then is in the pool
            one_shots = (mgr.fresh["pool"] - before, len(mgr.pool.idle), mgr.recycler.discarded["worn out"])
            s = await tg.session()
            assert (await s.exec("echo hi")).stdout.strip() == "hi"
            await s.close()
            await asyncio.sleep(0.3)
            return one_shots, mgr.pool.owed, mgr.fresh["pool"] - before

    (started, pooled, worn), owed, started_after = asyncio.run(main())
    assert worn == 4 and started == 4 and pooled == 1, (started, pooled, worn)  # not 8 and 2
    assert owed == 0 and started_after == started, (owed, started_after)


def test_a_one_shot_sandbox_killed_by_its_runs_cancel_is_replaced_under_load():
    """A cancelled run's sandbox is killed outside the recycler's verdict (it may hold the user's
    processes): under load (followers holding sandboxes, the refill's rule blind) it is owed a
    replacement as a discarded one is."""
    cfg = SandboxConfig(warm_pool=1, recycle_pool_max=3)

    async def main():
        async with Tangram.local(sandbox=cfg, cores=1) as tg:
            mgr, rt = tg.runtime.sandboxes, tg.runtime
            for _ in range(300):
                if mgr.pool.idle:
                    break
                await asyncio.sleep(0.02)
            task = asyncio.ensure_future(tg.run("import time; time.sleep(30)", id="long", timeout_s=60))
            for _ in range(300):
                if rt.state_of("long") == "running":
                    break
                await asyncio.sleep(0.02)
            for _ in range(300):  # the refill has replaced the sandbox the run took (its own rule)
                if mgr.pool.idle:
                    break
                await asyncio.sleep(0.02)
            started = mgr.fresh["pool"]
            mgr.lease.followers = 3  # as under load: the followers' sandboxes hide the pool's shortfall
            try:
                assert rt.cancel("long") is True
                r = await asyncio.wait_for(task, 20)
                for _ in range(300):
                    if mgr.fresh["pool"] > started:
                        break
                    await asyncio.sleep(0.02)
            finally:
                mgr.lease.followers = 0
            return r.outcome, mgr.fresh["pool"] - started

    outcome, replaced = asyncio.run(main())
    assert outcome is Outcome.CANCELLED and replaced == 1, (outcome, replaced)
