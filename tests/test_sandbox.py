"""Real sandboxes, real processes: functionality, lifecycle, and attempts to break out.

Every probe targets only this test's own processes and loopback. Needs bubblewrap (`.ci/run`
installs it) and writable cgroups for the resource tests; skips with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl_tangram.core import Outcome
from arl_tangram.managers.sandbox.cgroups import open_root
from arl_tangram.managers.sandbox.languages import LANGUAGES, Language
from arl_tangram.managers.sandbox.livestdin import UNSENT_MAX, LiveStdin, StdinClosed, StdinFull
from arl_tangram.managers.sandbox.manager import SandboxConfig
from arl_tangram.runtime import Tangram

from runnerkit import PRELUDE, run_with_runner

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
_root = open_root(tag=f"tangram-probe-{os.getpid()}")
HAS_CGROUPS = _root is not None
BOUNDS_CPU_TIME = _root is not None and _root.bounds_cpu_time
if _root is not None:
    _root.cleanup()
needs_cgroups = pytest.mark.skipif(not HAS_CGROUPS, reason="no writable cgroups on this host")


def run(coro_fn, **config):
    """Run ``coro_fn(tg)`` against a fresh local runtime and tear everything down."""
    cfg = SandboxConfig(**{"warm_pool": 2, **config})

    async def main():
        async with Tangram.local(sandbox=cfg) as tg:
            return await coro_fn(tg)

    return asyncio.run(main())


# -- functionality -------------------------------------------------------------------------------

def test_python_bash_and_cpp_one_shots():
    async def body(tg):
        py = await tg.run("import sys\nprint(sys.stdin.read().upper())", stdin="hello")
        sh = await tg.run("echo from-bash; exit 3", "bash")
        cpp = await tg.run('#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}',
                           "cpp", stdin="40 2")
        bad = await tg.run("int main( {", "cpp")
        crash = await tg.run("raise ValueError('boom')")
        return py, sh, cpp, bad, crash

    py, sh, cpp, bad, crash = run(body)
    assert py.outcome is Outcome.OK and py.stdout == "HELLO\n"
    assert sh.outcome is Outcome.FAILED and sh.result.run.exit_code == 3 and sh.stdout == "from-bash\n"
    assert cpp.outcome is Outcome.OK and cpp.stdout == "42\n" and cpp.result.compile.exit_code == 0
    assert bad.outcome is Outcome.FAILED and bad.result.compile.exit_code != 0 and bad.result.run is None
    assert "compile error" in bad.message
    assert crash.outcome is Outcome.FAILED and "ValueError: boom" in crash.stderr


def test_programs_start_with_default_signals_and_stdin_and_as_the_language_says():
    """Programs are spawned without a fork of the runner where they can be (posix_spawn): what
    they see must not change — SIGPIPE and SIGINT at their defaults (``yes | head`` ends
    quietly, as in a terminal and under SandboxFusion), stdin fed, their own process group (not
    their own session: inside/procs.py, "A run's process group"), and a program that does not exist fails
    as before."""
    async def body(tg):
        pipe = await tg.run("yes | head -2; echo rc=${PIPESTATUS[0]}", "bash")
        sigs = await tg.run("grep -E '^Sig(Ign|Blk):' /proc/self/status; ps -o pgid=,sid= -p $$; echo $$", "bash")
        stdin = await tg.run("read a b; echo $((a * b))", "bash", stdin="6 7")
        missing = await tg.run("exec no-such-program-here", "bash")
        return pipe, sigs, stdin, missing

    pipe, sigs, stdin, missing = run(body)
    assert (pipe.outcome, pipe.stdout, pipe.stderr) == (Outcome.OK, "y\ny\nrc=141\n", "")  # 128 + SIGPIPE
    lines = sigs.stdout.split()
    ignored = int(lines[1], 16)
    assert ignored & (1 << (13 - 1)) == 0 and ignored & (1 << (2 - 1)) == 0, sigs.stdout  # SIGPIPE, SIGINT
    if len(lines) >= 7 and lines[4].isdigit():
        assert lines[4] == lines[6] != lines[5], "the program leads a process group of its own, in the runner's session"
    assert stdin.stdout == "42\n"
    assert missing.outcome is Outcome.FAILED and missing.result.run.exit_code == 127 and "no-such-program" in missing.stderr


def test_files_in_and_out_of_a_one_shot():
    async def body(tg):
        return await tg.run("open('out.txt','w').write(open('in.txt').read()[::-1])", files={"in.txt": b"abc"},
                            fetch_files=["out.txt", "missing.txt"])

    r = run(body)
    assert r.outcome is Outcome.OK
    assert r.result.files == {"out.txt": b"cba"} and r.result.missing == ["missing.txt"]


def test_unknown_language_and_missing_toolchain_are_rejected_clearly():
    LANGUAGES["cobol-test"] = Language("cobol-test", "main.cob", ("cobc-run",), requires=("cobc-not-installed",))
    try:
        async def body(tg):
            return await tg.run("x", "klingon"), await tg.run("x", "cobol-test")

        unknown, missing = run(body)
    finally:
        del LANGUAGES["cobol-test"]
    assert unknown.outcome is Outcome.REJECTED and "unknown 'klingon'" in unknown.message
    assert missing.outcome is Outcome.REJECTED and "cobc-not-installed" in missing.message


@needs_cgroups
def test_the_allocation_is_what_the_code_sees():
    async def body(tg):
        return await tg.run("echo $TANGRAM_NUM_CPUS $OMP_NUM_THREADS $(nproc)", "bash", cpus=(2, 2))

    r = run(body)
    assert r.outcome is Outcome.OK and r.stdout.split() == ["2", "2", "2"] and r.cores == 2


# -- security ------------------------------------------------------------------------------------

def test_host_files_are_invisible_and_the_root_is_read_only():
    project = Path(__file__).resolve()
    code = f"""
import os
for p in [{str(project)!r}, '/root', {str(project.parents[1])!r}]:
    print(p, os.path.exists(p))
print('home:', os.listdir('/home'), os.path.realpath('/home/user'))  # only the workspace's second name
for p in ['/etc/evil', '/usr/evil', '/evil', '/proc/evil', '/home/evil']:
    try:
        open(p, 'w').write('x'); print('WROTE', p)
    except OSError as e:
        print('denied', p)
open('/workspace/ok.txt', 'w').write('fine'); print('workspace ok')
"""

    r = run(lambda tg: tg.run(code))
    assert r.outcome is Outcome.OK, r.stderr
    assert "True" not in r.stdout and "WROTE" not in r.stdout and "home: ['user'] /workspace" in r.stdout
    assert r.stdout.count("denied") == 5 and "workspace ok" in r.stdout
    assert not os.path.exists("/evil") and not os.path.exists("/etc/evil")


def test_no_network_not_even_a_loopback_port_on_the_host():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = f"""
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect(('127.0.0.1', {port})); print('CONNECTED')
except OSError as e:
    print('refused', e)
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2); print('CONNECTED-OUT')
except OSError as e:
    print('unreachable', e)
"""
    try:
        r = run(lambda tg: tg.run(code))
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert r.outcome is Outcome.OK and "CONNECTED" not in r.stdout
    assert "refused" in r.stdout and "unreachable" in r.stdout


def test_cannot_signal_a_process_outside_the_sandbox():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = f"import os\ntry:\n    os.kill({victim.pid}, 9); print('KILLED')\nexcept OSError as e:\n    print('no', e)"
        r = run(lambda tg: tg.run(code))
        time.sleep(0.1)
        assert victim.poll() is None, "the host process was killed from inside the sandbox"
        assert "KILLED" not in r.stdout and "no" in r.stdout
    finally:
        victim.kill()
        victim.wait()


KEYRINGS = r'''
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
c = ctypes.c_long
add, request, ctl = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[platform.machine()]
def said(name, ret):
    print(name, ret, ctypes.get_errno())
said("add_key", libc.syscall(c(add), b"user", b"tangram-probe", b"secret", c(6), c(-4)))
said("request_key", libc.syscall(c(request), b"user", b"tangram-probe", None, c(0)))
said("keyctl", libc.syscall(c(ctl), c(0), c(-4), c(0)))
print("listed", "tangram-probe" in open("/proc/keys").read())
'''


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="no keyring syscall numbers here")
def test_the_keyrings_are_closed_to_sandboxed_code():
    """The kernel's keyrings are not namespaced and every sandbox runs as the same host user: a key
    one sandbox added was listed in /proc/keys of every sandbox running beside it. The keyring calls
    are refused (EPERM) to one-shots, their children, and session cells alike."""
    async def body(tg):
        one = await tg.run(KEYRINGS)
        child = await tg.run(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {KEYRINGS!r}])")
        s = await tg.session()
        cell = await s.exec(python=KEYRINGS)
        await s.close()
        return one, child, cell

    for r in run(body):
        assert r.outcome is Outcome.OK, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:3] == ["add_key -1 1", "request_key -1 1", "keyctl -1 1"], r.stdout
        assert lines[3] == "listed False"


@needs_cgroups
def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"

    async def body(tg):
        bomb = await tg.run(code, timeout_s=2)
        after = await tg.run("print('alive')")
        return bomb, after

    bomb, after = run(body, pids_max=32)
    assert bomb.outcome is Outcome.TIMEOUT
    assert after.outcome is Outcome.OK and after.stdout == "alive\n"
    probe = subprocess.run(["true"])
    assert probe.returncode == 0


@needs_cgroups
def test_memory_bomb_ends_as_oom():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    r = run(lambda tg: tg.run(code, memory_mb=96, timeout_s=20))
    assert r.outcome is Outcome.OOM, (r.outcome, r.message, r.stderr[-300:])
    assert "out of memory" in r.message


@needs_cgroups
def test_cpu_hog_gets_only_its_cores():
    code = """
import os, time, resource
t = time.time()
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        end = time.time() + 1.0
        while time.time() < end:
            pass
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
wall = time.time() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(round((ru.ru_utime + ru.ru_stime) / wall, 2))
"""
    r = run(lambda tg: tg.run(code, cpus=1, timeout_s=30))
    assert r.outcome is Outcome.OK, r.stderr
    assert float(r.stdout) <= 1.15, f"4 busy processes on 1 core used {r.stdout.strip()} cores"


def test_sleeping_past_the_timeout_is_killed_in_time():
    r = run(lambda tg: tg.run("import time\ntime.sleep(60)", timeout_s=1))
    assert r.outcome is Outcome.TIMEOUT and r.act_s < 4


def test_flooding_stdout_is_capped_and_flagged():
    async def body(tg):
        finite = await tg.run("import sys\nsys.stdout.write('x' * (50 << 20))")
        # 3 s, not 1: on a loaded 2-core machine the interpreter's start alone can take a second, and the
        # cap must be reached before the timeout for the assertion to say anything
        endless = await tg.run("while True:\n    print('y' * 1000)", timeout_s=3)
        return finite, endless

    finite, endless = run(body, max_output_bytes=1 << 16)
    assert finite.outcome is Outcome.OK and len(finite.stdout) == 1 << 16 and finite.result.run.truncated
    assert "output truncated" in finite.message
    assert endless.outcome is Outcome.TIMEOUT and len(endless.stdout) == 1 << 16


def test_filling_the_disk_stops_at_the_workspace_size():
    code = """
try:
    with open('big', 'wb') as f:
        while True:
            f.write(b'0' * (1 << 20))
except OSError as e:
    print('stopped', e.errno)
"""
    r = run(lambda tg: tg.run(code, timeout_s=20), workspace_mb=16, memory_mb=256)
    assert r.outcome is Outcome.OK and "stopped 28" in r.stdout  # ENOSPC


def test_daemonised_children_do_not_outlive_the_action():
    async def body(tg):
        s = await tg.session()
        await s.exec("(while true; do echo beat >> /workspace/beat; sleep 0.02; done) & disown; "
                     "python3 -c 'import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(600)' &",
                     timeout_s=5)
        # (shell steps return when the command does: the loop may not have written yet)
        first = await s.exec("cat beat 2>/dev/null | wc -l; ps -e -o comm= | sort | tr '\\n' ' '")
        await asyncio.sleep(0.3)
        second = await s.exec("cat beat 2>/dev/null | wc -l")
        await s.close()
        return first, second

    first, second = run(body)
    count1, procs = first.stdout.split("\n", 1)
    assert count1.strip() == second.stdout.strip(), "a background loop kept running after its action"
    assert "sleep" not in procs and procs.count("python3") <= 3  # the runner, its zygote, the session's interpreter


def test_sessions_cannot_see_each_other():
    async def body(tg):
        a, b = await tg.session(), await tg.session()
        await a.put({"secret.txt": b"a's secret"})
        found = await b.exec("ls -a /workspace; find / -name secret.txt 2>/dev/null | head", timeout_s=120)
        assert found.outcome is Outcome.OK, found  # the search must have finished to prove anything
        mine = await a.exec("cat secret.txt")
        await a.close()
        await b.close()
        return found, mine

    found, mine = run(body)
    assert "secret" not in found.stdout
    assert mine.stdout == "a's secret"


# -- lifecycle -------------------------------------------------------------------------------------

def test_session_state_persists_across_execs():
    async def body(tg):
        s = await tg.session()
        r1 = await s.exec(python="import math\nx = 41")
        r2 = await s.exec(python="x += 1\nprint(x, math.pi > 3)")
        r3 = await s.exec("echo data > f.txt")
        r4 = await s.exec(python="print(open('f.txt').read().strip())")
        await s.close()
        return r1, r2, r3, r4

    r1, r2, r3, r4 = run(body)
    assert [r.outcome for r in (r1, r2, r3, r4)] == [Outcome.OK] * 4
    assert r2.stdout == "42 True\n" and r4.stdout == "data\n"


def test_a_session_step_streams_its_output_while_it_runs_capped_as_its_result():
    async def body(tg):
        s = await tg.session()
        chunks: list[tuple[str, bytes, str | None]] = []
        r = await s.exec("echo one; sleep 1; echo two >&2; echo three", id="x-streamed",
                         on_output=lambda k, d: chunks.append((k, d, tg.runtime.state_of("x-streamed"))))
        total = {"stdout": 0, "stderr": 0}

        def count(k: str, d: bytes) -> None:
            total[k] += len(d)

        flood = await s.exec("head -c 3000000 /dev/zero; echo e >&2", on_output=count)
        endless = await s.exec("yes", timeout_s=2, on_output=count)
        quiet = await s.exec("echo nobody listens")
        broken = await s.exec("echo a; echo b", on_output=lambda k, d: 1 / 0)  # the listener's bug, not the step's
        after = await s.exec("echo $((6 * 7))")
        await s.close()
        return chunks, r, total, flood, endless, quiet, broken, after

    chunks, r, total, flood, endless, quiet, broken, after = run(body, max_output_bytes=1 << 16)
    assert (broken.outcome, broken.stdout, after.stdout) == (Outcome.OK, "a\nb\n", "42\n")
    assert chunks[0] == ("stdout", b"one\n", "running")  # the step had not ended when its first line came
    assert b"".join(d for k, d, _ in chunks if k == "stdout") == b"one\nthree\n" == r.stdout.encode()
    assert [d for k, d, _ in chunks if k == "stderr"] == [b"two\n"] and r.result.run.stderr == "two\n"
    assert flood.result.run.truncated and len(flood.stdout) == 1 << 16 and endless.outcome is Outcome.TIMEOUT
    # the cap holds for what is streamed too; and what is streamed is what the results say
    assert total == {"stdout": 2 << 16, "stderr": len(flood.result.run.stderr) + len(endless.result.run.stderr)}
    assert quiet.stdout == "nobody listens\n"


def test_a_session_step_reads_a_live_stdin_as_it_is_fed():
    """``live_stdin``: a shell step reads what is sent while it runs (after ``stdin``, and after
    what was sent before it started), ``close`` is its end of file, later input is refused; input
    the step does not read is bounded (``StdinFull`` past ``UNSENT_MAX``, taking none of that
    piece) and none of what was taken is lost."""
    async def heard(got: list[bytes], text: bytes) -> None:
        for _ in range(400):
            if text in b"".join(got):
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"{text!r} never came: {got}")

    async def body(tg):
        s = await tg.session()
        feed = LiveStdin()
        feed.send(b"early\n")  # kept until the step holds the sandbox
        got: list[bytes] = []
        step = asyncio.ensure_future(s.exec('while read -r l; do echo "[$l]"; done; echo end', stdin=b"given\n",
                                            live_stdin=feed, timeout_s=30, on_output=lambda k, d: got.append(d)))
        await heard(got, b"[early]\n")
        feed.send(b"late\n")
        await heard(got, b"[late]\n")
        feed.close()
        fed = await step
        with pytest.raises(StdinClosed):
            feed.send(b"after its end\n")
        # a step that reads nothing for a while: its input waits, bounded, and none of it is lost
        # (nor held by the runner, PID 1, past its own bound: its peak memory stays put)
        peak = (await s.exec("grep VmHWM /proc/1/status")).stdout
        hog, started = LiveStdin(), []
        reader = asyncio.ensure_future(s.exec("echo started; sleep 2; wc -c", live_stdin=hog, timeout_s=30,
                                              on_output=lambda k, d: started.append(d)))
        await heard(started, b"started")
        sent, refused, piece = 0, None, b"y" * (1 << 20)
        for _ in range(64):
            try:
                hog.send(piece)
            except StdinFull as e:
                refused = str(e)
                break
            sent += len(piece)
        hog.close()
        counted = await reader
        peak_after = (await s.exec("grep VmHWM /proc/1/status")).stdout
        # input kept up to the cap before a large command: all of it reaches the step (an audit:
        # the cap was checked again as the step started, counting the request, and lost the session)
        kept = LiveStdin()
        kept.send(b"k" * (UNSENT_MAX - 10))
        kept.close()
        large = await s.exec(f": {'c' * 200_000}; echo $X; wc -c", live_stdin=kept, timeout_s=30)
        with pytest.raises(ValueError):
            await s.exec(python="print(1)", live_stdin=LiveStdin())
        after = await s.exec("echo ok")
        await s.close()
        return fed, sent, refused, counted, after, peak, peak_after, large

    fed, sent, refused, counted, after, peak, peak_after, large = run(body)
    kb = [int(x.split()[1]) for x in (peak, peak_after)]
    assert kb[1] - kb[0] < 8 << 10, (peak, peak_after)  # (one 16 MiB piece took it up 30 MB)
    assert (large.outcome, large.stdout.split()[-1]) == (Outcome.OK, str(UNSENT_MAX - 10)), large.message
    assert (fed.outcome, fed.stdout) == (Outcome.OK, "[given]\n[early]\n[late]\nend\n")
    assert refused is not None and str(UNSENT_MAX) in refused and UNSENT_MAX <= sent < 2 * UNSENT_MAX, (sent, refused)
    assert counted.outcome is Outcome.OK and counted.stdout.split()[-1] == str(sent), counted.stdout
    assert after.stdout == "ok\n"


def test_a_live_stdin_keeps_what_comes_before_its_step_and_refuses_what_comes_after():
    """``LiveStdin`` at its seam: kept before the step is bound (bounded), passed on while bound,
    end of file once, nothing after the step's end."""
    written: list[tuple[bytes, bool, bool]] = []

    def sink(data: bytes, eof: bool, checked: bool = True) -> None:
        written.append((data, eof, checked))

    feed = LiveStdin()
    feed.send(b"a")
    feed.send(b"")
    with pytest.raises(StdinFull):
        feed.send(b"z" * UNSENT_MAX)
    feed.send(b"b")  # the refused piece took nothing: what comes next is still in order
    feed.bind(sink)
    feed.send(b"c")
    feed.close()
    feed.close()
    # what was kept goes unchecked (it was taken under the cap already), the rest checked
    assert written == [(b"ab", False, False), (b"c", False, True), (b"", True, True)] and feed.closed
    with pytest.raises(StdinClosed):
        feed.send(b"d")
    ended = LiveStdin()
    ended.send(b"never bound")
    ended.end()
    ended.bind(sink)
    assert len(written) == 3  # a step that never ran takes nothing
    with pytest.raises(StdinClosed):
        ended.send(b"x")


FORGE_ANSWER = """import os, stat, fcntl
hit = []
for fd in range(3, 64):  # the runner's answer channel is a pipe the cell's process holds
    try:
        st = os.fstat(fd)
    except OSError:
        continue
    if stat.S_ISFIFO(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
        os.write(fd, b'{"id": %s, "stdout": ""}\\n')
        hit.append(fd)
print('real', hit)"""


@pytest.mark.parametrize("forged_id", ["wrong", "next"])
def test_a_cell_that_forges_answers_never_shifts_its_sessions_answers(forged_id):
    """A session's cell could write lines of its own on the answer channel (it ran in the runner);
    one taken as an answer used to shift every later answer by one step. Cells now run in the
    session's own interpreter, whose only channel is a pipe to the runner: the runner checks each
    answer and sends it on with the request's id, so a malformed or out-of-turn one ends that
    interpreter (the step fails saying its variables are gone) and the host never sees it (a
    well-formed one: the next test); the host's own check (an
    answer out of turn breaks the sandbox) stays as a second line. No later step gets another
    step's answer."""
    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 41")
        sb = tg.runtime.sandboxes.sessions[s.id]
        fid = str(sb._seq + 1) if forged_id == "next" else "123456789"
        forged = await s.exec(python=FORGE_ANSWER % fid)
        later = [await s.exec(python="print('second')"), await s.exec(python="print('third')")]
        await s.close()
        return forged, later

    forged, later = run(body)
    assert forged.outcome is not Outcome.OK
    assert all("real" not in r.stdout for r in later), [r.stdout for r in later]
    assert later[-1].outcome is Outcome.OK and later[-1].stdout == "third\n"
    assert forged.outcome is Outcome.FAILED and "its variables are gone" in forged.message
    assert later[0].outcome is Outcome.OK and later[0].stdout == "second\n"


# a cell writing a well-formed answer of its own on its interpreter's pipe to the runner, with the
# request's nonce if it carries one (the cell can read its own request: it runs in that process)
FORGE_WELL_FORMED = """import os, sys
f = sys._getframe()
while "st" not in f.f_locals:
    f = f.f_back
fd, req, g = f.f_locals["st"].out, None, sys._getframe()
while g is not None:
    if isinstance(g.f_locals.get("req"), dict) and g.f_locals["req"].get("op") == "cell":
        req = g.f_locals["req"]
    g = g.f_back
nonce = ',"nonce":' + repr(req["nonce"]).replace("'", '"') if "nonce" in req else ""
os.write(fd, ('{"stdout":"Zm9yZ2Vk","stderr":"","truncated":false,"timed_out":false,"exit_code":0,'
              '"duration_s":DURATION,"display":DISPLAY,"raised":RAISED' + nonce + '}\\n').encode())
print("real answer of the forging step")"""


def _forged(display="[]", raised="[]", duration="0.1") -> str:
    return FORGE_WELL_FORMED.replace("DISPLAY", display).replace("RAISED", raised).replace("DURATION", duration)


def test_a_forged_answer_of_a_shape_no_cell_makes_is_the_user_s_failure_never_the_runner_s_end():
    """Review H2: a forged answer whose ``display`` was nested 600 deep passed the runner's
    checks and overflowed its recursive ``to_json`` outside any ``try``: the runner (PID 1) died,
    the step was infra_error and the session lost. Display and raised items are now checked
    element by element: any other shape ends the interpreter (the user's failure), the sandbox
    lives on and the session's next step runs."""
    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 1")
        sb = tg.runtime.sandboxes.sessions[s.id]
        got = []
        for code in (_forged(display="[" * 600 + "]" * 600), _forged(display="[1]"),
                     _forged(display='[{"text/plain": 1}]'),
                     _forged(raised='[{"ename": "E"}]'), _forged(raised="[[]]"), _forged(duration="1e400")):
            forged = await s.exec(python=code)
            after = await s.exec(python="print('after')")
            got.append((forged, after))
        alive = tg.runtime.sandboxes.sessions.get(s.id) is sb and not sb.dead
        await s.close()
        return got, alive

    got, alive = run(body)
    assert alive
    for forged, after in got:
        assert forged.outcome is not Outcome.INFRA_ERROR, forged.message
        assert after.outcome is Outcome.OK and after.stdout == "after\n", (after.outcome, after.message)


def test_a_cell_raising_a_lone_surrogate_keeps_its_interpreter():
    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 41")
        r = await s.exec(python="raise ValueError('bad \\ud800')")
        after = await s.exec(python="print(x + 1)")
        await s.close()
        return r, after

    r, after = run(body)
    assert r.outcome is Outcome.FAILED and r.result.run.error[0]["evalue"] == "bad ?", (r.message, r.result.run.error)
    assert after.outcome is Outcome.OK and after.stdout == "42\n" and after.message == ""


def test_a_well_formed_forged_answer_answers_only_its_own_step():
    """Review M4: a forged answer of the right shape (and, now, the request's nonce, which the cell
    can read) was accepted, and the forging step's real answer then answered the next step, and so
    on. Now the forged line answers the forging step only (as if it had printed it); its real
    answer ends that interpreter: left on the pipe, before the next cell, which runs in a new one
    and says so; read after the next request, as that request's (out of turn), failing that step.
    Also: a display with a lone surrogate is passed on, made encodable."""
    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 1")
        forged = await s.exec(python=_forged())
        later = [await s.exec(python="print('second')"), await s.exec(python="print('third')")]
        lone = await s.exec(python=_forged(display='[{"text/plain": "\\\\ud800"}]'))
        settle = await s.exec(python="print('settle')")  # takes the lone forgery's real answer, as second did
        after = await s.exec(python="print('after')")
        await s.close()
        return forged, later, lone, settle, after

    forged, later, lone, settle, after = run(body)
    assert forged.outcome is not Outcome.INFRA_ERROR
    # the forging step's real answer was on the pipe before the next request (a new interpreter runs
    # it), or came after it (out of turn: that step fails, its interpreter ended); never its answer
    second, third = later
    assert "real" not in second.stdout + third.stdout and "its variables are gone" in second.message
    assert (second.outcome, second.stdout) == (Outcome.OK, "second\n") or \
        (second.outcome is Outcome.FAILED and "answered out of turn" in second.message), second
    assert (third.outcome, third.stdout) == (Outcome.OK, "third\n")
    assert lone.outcome is Outcome.OK and lone.result.run.display == [{"text/plain": "?"}]
    assert "real" not in settle.stdout + after.stdout
    assert (settle.outcome, settle.stdout) == (Outcome.OK, "settle\n") or \
        (settle.outcome is Outcome.FAILED and "answered out of turn" in settle.message), settle
    assert after.outcome is Outcome.OK and after.stdout == "after\n"


BAD_CHUNK = """import os, sys
f = sys._getframe()
while "st" not in f.f_locals:
    f = f.f_back
os.write(f.f_locals["st"].out, b'{"stream":"stdout","data":"A"}\\n')"""


def test_a_streamed_cell_s_malformed_output_chunk_ends_its_interpreter_not_the_step_as_infra():
    """Review M2: a chunk line whose data is not base64 raised out of the runner's relay: the
    user's step was infra_error and its interpreter lived on, its real answer then answering the
    next step. Now it ends that interpreter (the user's failure) and the next step runs."""
    async def body(tg):
        s = await tg.session()
        got: list = []
        bad = await s.exec(python=BAD_CHUNK, on_output=lambda name, data: got.append((name, data)))
        after = await s.exec(python="print('next')")
        await s.close()
        return bad, after

    bad, after = run(body)
    assert bad.outcome is Outcome.FAILED and "malformed output chunk" in bad.message, (bad.outcome, bad.message)
    assert after.outcome is Outcome.OK and after.stdout == "next\n"


@needs_cgroups
def test_a_cell_flooding_its_answer_pipe_without_a_newline_is_its_own_failure():
    """Review M1: the runner buffered a session interpreter's answer up to 1 GiB: a cell writing
    hundreds of MB without a newline on its answer pipe grew the runner (PID 1, in the sandbox's
    memory limit) until it was OOM-killed, an infra_error. The runner now stops at 60 MB (the host
    reads no longer line) and ends the interpreter: the user's failure; the sandbox lives on."""
    cell = """import os, sys
f = sys._getframe()
while "st" not in f.f_locals:
    f = f.f_back
chunk = b"x" * (1 << 20)
for i in range(320):
    os.write(f.f_locals["st"].out, chunk)"""

    async def body(tg):
        s = await tg.session()
        await s.exec(python="x = 1")
        flood = await s.exec(python=cell, timeout_s=60)
        after = await s.exec(python="print('after')")
        await s.close()
        return flood, after

    flood, after = run(body, memory_mb=256)
    assert flood.outcome is Outcome.FAILED and "answered more than the runner takes" in flood.message, \
        (flood.outcome, flood.message)
    assert after.outcome is Outcome.OK and after.stdout == "after\n"


def _streamed_cell(cell: str, **config) -> tuple:
    """``cell`` run streamed in a session (after a first step): its result, the chunks its listener
    got, and how long it took."""
    async def body(tg):
        s = await tg.session()
        await s.exec(python="1")
        chunks: list[tuple[str, bytes]] = []
        t = time.monotonic()
        r = await s.exec(python=cell, timeout_s=60, on_output=lambda k, d: chunks.append((k, d)))
        took = time.monotonic() - t
        await s.close()
        return r, chunks, took

    return run(body, **config)


def test_a_streamed_cell_writing_a_byte_at_a_time_is_coalesced():
    """Each read of a cell's pipe used to be its own chunk line: hostile output written a byte at a
    time cost the engine process a line, a decode and a call per byte. Chunks now leave at most
    every CELL_COALESCE_S (the bound below counts the cell's whole duration), all bytes in order."""
    from arl_tangram.managers.sandbox.inside import COALESCE_S as CELL_COALESCE_S
    cell = "import os\nfor i in range(20000):\n    os.write(1, b'x')\nos.write(2, b'end')"

    r, chunks, took = _streamed_cell(cell)
    assert r.outcome is Outcome.OK and r.stdout == "x" * 20000
    assert b"".join(d for k, d in chunks if k == "stdout") == b"x" * 20000
    assert b"".join(d for k, d in chunks if k == "stderr") == b"end"
    assert len(chunks) <= 2 * (took / CELL_COALESCE_S + 2), (len(chunks), took)


def test_a_streamed_cell_writing_chunk_lines_itself_is_capped_and_coalesced():
    """Review M3: a streamed cell could write chunk lines straight on its answer pipe, past its
    Capture's cap and coalescing: the runner relayed each line and the engine process parsed and
    decoded every one (200k lines: 1.69 s of its CPU). The runner now relays at most
    ``max_output_bytes`` a stream, in chunks at most every CELL_COALESCE_S."""
    from arl_tangram.managers.sandbox.inside import COALESCE_S as CELL_COALESCE_S
    cell = """import os, sys
f = sys._getframe()
while "st" not in f.f_locals:
    f = f.f_back
line = b'{"stream":"stdout","data":"eA=="}\\n' * 1000
for i in range(100):
    os.write(f.f_locals["st"].out, line)
print('own')"""

    r, chunks, took = _streamed_cell(cell, max_output_bytes=4096)
    got = b"".join(d for k, d in chunks if k == "stdout")
    assert len(got) <= 4096 and got.startswith(b"x" * 100), len(got)
    assert len(chunks) <= 2 * (took / CELL_COALESCE_S + 2), (len(chunks), took)


@needs_cgroups
def test_a_frozen_session_uses_no_cpu():
    async def body(tg):
        s = await tg.session()
        spin = "import threading\ndef spin():\n    while True:\n        pass\nthreading.Thread(target=spin, daemon=True).start()"
        await s.exec(python=spin)
        sb = tg.runtime.sandboxes.sessions[s.id]
        assert sb.frozen
        c0 = sb.cpu_seconds()
        await asyncio.sleep(0.5)
        frozen_use = sb.cpu_seconds() - c0
        c1 = sb.cpu_seconds()
        # thawed, the thread spins again: wait until it has used CPU (bounded), rather than a fixed 0.5 s
        # that a machine at load 5 may not give it
        await s.exec(python="import time\nt = time.process_time()\nend = time.monotonic() + 20\n"
                            "while time.process_time() - t < 0.3 and time.monotonic() < end:\n    time.sleep(0.05)",
                     timeout_s=30)
        running_use = sb.cpu_seconds() - c1
        await s.close()
        return frozen_use, running_use

    frozen_use, running_use = run(body)
    assert frozen_use < 0.02, f"frozen session burnt {frozen_use:.3f}s of CPU in 0.5s"
    assert running_use > 0.2  # the same thread spins again once thawed: the measurement works


@needs_cgroups
def test_expiry_and_close_leave_nothing_behind():
    async def body(tg):
        mgr = tg.runtime.sandboxes
        s = await tg.session()
        await s.exec(python="x = 1")
        sb = mgr.sessions[s.id]
        dirs = list(sb.group.dirs.values())
        await asyncio.sleep(1.5)  # idle expiry is 0.5 s
        # a session's sandbox, once its session is gone, is killed with its cgroup or reset for
        # another session (rest.py: back in the sessions' pool, its session's processes ended)
        gone = s.id not in mgr.sessions and ((sb.dead and not any(d.exists() for d in dirs))
                                             or sb in mgr.spares.idle)
        t = await tg.session()
        await t.exec("true")
        sb2 = mgr.sessions[t.id]
        await t.close()
        await asyncio.sleep(0.2)
        closed = (sb2.dead and not any(d.exists() for d in sb2.group.dirs.values())) or sb2 in mgr.spares.idle
        return gone, closed, list(mgr.root.dirs.values())

    gone, closed, roots = run(body, session_idle_expiry_s=0.5)
    assert gone and closed
    assert not any(d.exists() for d in roots), "shutdown left cgroups behind"
    # this checkout's sandboxes only (their bwrap names our agent's path): other checkouts may be testing too
    from arl_tangram.managers.sandbox.isolation import INSIDE
    ours = subprocess.run(["pgrep", "-f", str(INSIDE)], capture_output=True, text=True).stdout.split()
    assert not ours, f"sandbox processes left running: {ours}"


def test_a_sandbox_that_dies_is_an_infra_error_not_a_user_failure():
    async def body(tg):
        task = asyncio.create_task(tg.run("import time\ntime.sleep(30)", timeout_s=60))
        for _ in range(600):  # until it runs (a fixed 0.5 s was too short at load 8: its setup took 0.56 s)
            if tg.runtime.sandboxes.busy:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        for sb in list(tg.runtime.sandboxes.busy):
            sb.proc.kill()
        return await task

    r = run(body)
    assert r.outcome is Outcome.INFRA_ERROR and "sandbox" in r.message


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed")
def test_unshare_fallback_still_isolates():
    code = f"import os, socket\nprint(os.path.exists({str(Path(__file__).resolve())!r}), os.getcwd())\ntry:\n" \
           "    socket.create_connection(('127.0.0.1', 22), timeout=1); print('NET')\nexcept OSError:\n    print('no net')"
    r = run(lambda tg: tg.run(code), isolation="unshare")
    assert r.outcome is Outcome.OK, r.message + r.stderr
    assert r.stdout.split() == ["False", "/workspace", "no", "net"]


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_the_same_program_sees_the_same_paths_in_every_isolating_mode(isolation):
    code = ("import os\nopen('f', 'w').write('x')\nopen('/tmp/t', 'w').write('x')\nopen('/dev/shm/s', 'w').write('x')\n"
            "print(os.getcwd(), os.environ['HOME'], sorted(os.listdir('/workspace')), os.path.exists('/root'),"
            " os.path.exists('/run/tangram/inside/__main__.py'))")
    r = run(lambda tg: tg.run(code), isolation=isolation)
    assert r.outcome is Outcome.OK, r.message + r.stderr
    assert r.stdout == "/workspace /workspace ['f'] False True\n"


def test_isolation_none_runs_only_when_asked_for():
    r = run(lambda tg: tg.run("print('trusted')"), isolation="none")
    assert r.outcome is Outcome.OK and r.stdout == "trusted\n"


@needs_cgroups
def test_groups_left_by_a_killed_process_are_removed_at_start():
    dead = subprocess.Popen(["true"])
    dead.wait()
    root = open_root(tag=f"tangram-{dead.pid}")  # as if that process had died mid-run
    stale = list(root.dirs.values())
    for d in stale:
        (d / "sb-old").mkdir()
    fresh = open_root(tag=f"tangram-test-{os.getpid()}")
    try:
        assert not any(d.exists() for d in stale)
    finally:
        fresh.cleanup()


def _busy(n: int, seconds: float) -> str:
    """Python that runs ``n`` busy processes for ``seconds`` and prints the CPUs' worth they used."""
    return f"""
import os, resource, time
t = time.time()
pids = []
for _ in range({n}):
    pid = os.fork()
    if pid == 0:
        stop = time.time() + {seconds}
        while time.time() < stop:
            pass
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(round((ru.ru_utime + ru.ru_stime) / (time.time() - t), 2))
"""


def _manager_run(code: str, units: tuple[int, ...], shrink_to: tuple[int, ...] | None = None, **config):
    """One one-shot through a real ``SandboxManager`` on ``units``; ``shrink_to``: the engine
    takes cores back (``resize``) 0.3 s after it is placed. Returns (completions, pins left)."""
    from arl_tangram.core import Action, Allocation, Demand
    from arl_tangram.managers.sandbox.manager import RunCode, SandboxManager

    async def main():
        done: list = []
        m = SandboxManager(SandboxConfig(**{"warm_pool": 1, **config}), done.append)
        await m.start_up()
        try:
            a = Action("grown", "sandbox", Demand({"cpu": (1, len(units))}), payload=RunCode(code, run_timeout_s=30))
            m.start(a, Allocation("cpu", 0, units))
            if shrink_to is not None:
                for _ in range(2000):  # until it is placed and running
                    if m.runs.pins.get("grown", [None])[0] is not None:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                m.resize("grown", Allocation("cpu", 0, shrink_to))
            for _ in range(6000):
                if done:
                    break
                await asyncio.sleep(0.01)
            if shrink_to is not None:
                m.resize("grown", Allocation("cpu", 0, shrink_to))  # ended: ignored
            return done, m.runs.pins
        finally:
            await m.shut_down()

    return asyncio.run(main())


@needs_cgroups
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to take one back")
def test_a_shrunk_pinned_sandbox_really_has_fewer_cores():
    """``Shrink`` at the manager: the engine takes a core back from a running one-shot pinned to
    its cores; from then on its processes see and use one core, while it runs (its cgroup's
    cpuset shrank)."""
    code = """
import os, time
first = len(os.sched_getaffinity(0))
end = time.time() + 20
while len(os.sched_getaffinity(0)) == first and time.time() < end:
    time.sleep(0.01)
print(first, len(os.sched_getaffinity(0)))
""" + _busy(2, 1.0)
    done, pins = _manager_run(code, (0, 1), shrink_to=(0,), one_shots_share_cpus=False)
    assert len(done) == 1 and done[0].outcome is Outcome.OK, done
    first, after, used = done[0].result.run.stdout.split()
    assert (first, after) == ("2", "1")
    assert float(used) <= 1.15, f"2 busy processes on the 1 core left used {used} cores"
    assert not pins, "a finished run's pin is forgotten"


@pytest.mark.skipif(not BOUNDS_CPU_TIME or len(os.sched_getaffinity(0)) < 2,
                    reason="needs cgroups with the cpu controller and 2 cores")
def test_a_one_shot_sharing_the_cpus_is_bounded_to_its_cores_time():
    """A one-shot runs on any of the host's CPUs (``one_shots_share_cpus``) but is bounded to its
    cores' worth of CPU time: hostile code that forks busy processes on a 1-core allocation gets
    one CPU's worth, not the host's; its thread counts still say one core."""
    code = "import os\nprint(len(os.sched_getaffinity(0)), os.environ['TANGRAM_NUM_CPUS'])\n" + _busy(3, 1.0)
    done, _ = _manager_run(code, (0,))
    assert len(done) == 1 and done[0].outcome is Outcome.OK, done
    cpus, threads, used = done[0].result.run.stdout.split()
    assert (int(cpus), threads) == (len(os.sched_getaffinity(0)), "1")
    assert float(used) <= 1.15, f"3 busy processes on a 1-core one-shot used {used} CPUs' worth"


@pytest.mark.skipif(not BOUNDS_CPU_TIME or len(os.sched_getaffinity(0)) < 2,
                    reason="needs cgroups with the cpu controller and 2 cores")
def test_a_shrunk_one_shot_sharing_the_cpus_gets_less_time():
    """``Shrink`` of a one-shot that shares the CPUs lowers its quota: it still sees every CPU,
    and from then on uses one CPU's worth."""
    code = "import os, time\ntime.sleep(1.5)\nprint(len(os.sched_getaffinity(0)))\n" + _busy(2, 1.0)
    done, pins = _manager_run(code, (0, 1), shrink_to=(0,))
    assert len(done) == 1 and done[0].outcome is Outcome.OK, done
    cpus, used = done[0].result.run.stdout.split()
    assert int(cpus) == len(os.sched_getaffinity(0))
    assert float(used) <= 1.15, f"2 busy processes after the shrink to 1 core used {used} CPUs' worth"
    assert not pins


@pytest.mark.skipif(not BOUNDS_CPU_TIME or len(os.sched_getaffinity(0)) < 2,
                    reason="needs cgroups with the cpu controller and 2 cores")
def test_a_shrink_the_group_refuses_ends_the_run_as_an_infrastructure_failure(monkeypatch):
    """A run must not keep cores the engine took back: where its group will not take the smaller
    quota, the sandbox is killed and the run reports ``infra_error``, never ``ok`` on 2 cores."""
    import errno

    from arl_tangram.managers.sandbox.cgroups import Group

    real = Group.set_cpu_quota

    def refusing(self, cpus):
        if cpus == 1:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(self, cpus)

    monkeypatch.setattr(Group, "set_cpu_quota", refusing)
    done, pins = _manager_run("import time\ntime.sleep(3)\nprint('done')", (0, 1), shrink_to=(0,))
    assert len(done) == 1 and done[0].outcome is Outcome.INFRA_ERROR, done
    assert not pins


@needs_cgroups
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_one_shots_pinned_when_sharing_is_off():
    code = "import os\nprint(len(os.sched_getaffinity(0)))\n" + _busy(2, 0.5)
    done, _ = _manager_run(code, (1,), one_shots_share_cpus=False)
    assert len(done) == 1 and done[0].outcome is Outcome.OK, done
    cpus, used = done[0].result.run.stdout.split()
    assert cpus == "1" and float(used) <= 1.15



def test_a_sessions_shell_files_never_lead_the_runner_to_its_own_channel():
    """From an audit: the runner wrote a step's command and stdin to files in the sandbox's own
    /tmp by path, following what the sandbox's code had put there: a link to /proc/1/fd/4 (its
    answer channel) made the command text the host's answer (``exit 1`` came back ok, with the
    forged stdout). The shell's files removed or replaced: a new shell, said so."""
    def forged(i: int) -> str:
        return json.dumps({"id": i, "stdout": base64.b64encode(b"all tests passed\n").decode(), "stderr": "",
                           "truncated": False, "timed_out": False, "exit_code": 0, "duration_s": 0.01})

    async def body(tg):
        s = await tg.session()
        assert (await s.exec("echo first")).result.run.stdout == "first\n"
        seen = []
        for target in ("/proc/1/fd/4", "/proc/1/fd/3"):
            for name in ("step", "in"):
                await s.exec(f"rm -f /tmp/.tangram-shell/{name} && ln -s {target} /tmp/.tangram-shell/{name}")
                for i in range(1, 7):  # the answer's id a forgery must guess (5 for a fresh session)
                    r = await s.exec(forged(i) + "\nexit 1", stdin=b"x" if name == "in" else None)
                    seen.append((r.outcome, r.result.run.stdout if r.result.run else None))
                    if name == "in":  # a live stdin's FIFO is made afresh too, never written through the link
                        await s.exec(f"rm -f /tmp/.tangram-shell/in && ln -s {target} /tmp/.tangram-shell/in")
                        feed = LiveStdin()
                        feed.send(forged(i).encode() + b"\n")
                        feed.close()
                        r = await s.exec("cat >/dev/null; exit 1", live_stdin=feed)
                        seen.append((r.outcome, r.result.run.stdout if r.result.run else None))
        # /tmp full: the step fails saying so, the shell and its state live on
        await s.exec("KEEP=yes; mkdir -p /workspace/d && cd /workspace/d")
        await s.exec("head -c 100M /dev/zero > /tmp/fill 2>/dev/null; true")
        full = await s.exec("echo " + "x" * 9000)
        await s.exec(python="import os; os.remove('/tmp/fill')")
        after_full = await s.exec("echo $KEEP $(pwd)")
        replaced = []
        for cmd in ("rm -rf /tmp/.tangram-shell", "rm /tmp/.tangram-shell/out",
                    "mv /tmp/.tangram-shell /tmp/moved && ln -s /proc/1/fd /tmp/.tangram-shell"):
            await s.exec("X=kept")
            await s.exec(cmd)
            r = await s.exec("echo ok $X; echo err >&2")
            replaced.append((r.outcome, r.result.run.stdout, r.result.run.stderr, r.message))
        return seen, replaced, full, after_full

    seen, replaced, full, after_full = run(body)
    assert full.outcome is Outcome.FAILED and full.result.run.exit_code == 126, (full.message, full.stderr)
    assert "No space left" in full.stderr
    assert after_full.stdout == "yes /workspace/d\n" and after_full.message == "", after_full.message
    assert all(o is Outcome.FAILED and "all tests passed" not in (out or "") for o, out in seen), seen
    for outcome, out, err, message in replaced:
        assert (outcome, out, err) == (Outcome.OK, "ok\n", "err\n") and "a new shell was started" in message

# The runner opens files the host names (``op_write``, ``op_read``, ``op_fs``) through whatever
# links the sandbox planted, with its own rights: ``open_plain`` must refuse its own descriptors
# (reached through /proc/<pid>/fd), /proc and /sys files, and anything not a regular file, with
# openat2 and without it (an older kernel: the descriptors this process holds are compared).
OPEN_PLAIN = PRELUDE + r'''
import tempfile
from inside import files, fsops, to_json
d = tempfile.mkdtemp()
held = open(os.path.join(d, "held.txt"), "w")  # a file this process holds open
plain = os.path.join(d, "plain.txt")
open(plain, "w").write("plain")
os.mkfifo(os.path.join(d, "fifo"))
links = {"answers": f"/proc/self/fd/{st.proto_out}", "requests": f"/proc/self/fd/{st.proto_in}",
         "held": f"/proc/self/fd/{held.fileno()}", "maps": "/proc/self/maps", "fifo": os.path.join(d, "fifo"),
         "plain": plain}
for name, target in links.items():
    os.symlink(target, os.path.join(d, "to-" + name))
got = {}
for openat2 in (True, False):
    st.openat2 = openat2 and st.libc is not None
    for name in links:
        for flags in (os.O_RDONLY, os.O_WRONLY | os.O_CREAT):
            try:
                os.close(files.open_plain(st, os.path.join(d, "to-" + name), flags))
                got[f"{openat2} {name} {flags}"] = "opened"
            except files.NotPlain:
                got[f"{openat2} {name} {flags}"] = "refused"
            except OSError as e:
                got[f"{openat2} {name} {flags}"] = f"error {e.errno}"
st.openat2 = st.libc is not None
fsops.LIST_MAX = 3
for i in range(4):
    open(os.path.join(d, f"f{i}"), "w").write("x" * i)
fs = {"big": fsops.op_fs(st, {"call": "list", "path": d}),
      "read": fsops.op_fs(st, {"call": "read", "path": os.path.join(d, "f3"), "max_bytes": 2}),
      "relative": fsops.op_fs(st, {"call": "stat", "path": "plain.txt"}),
      "missing": fsops.op_fs(st, {"call": "remove", "path": os.path.join(d, "nowhere")}),
      "made": fsops.op_fs(st, {"call": "mkdir", "path": os.path.join(d, "a", "b")})["fs"]["entry"]["mode"] & 0o170000}
# a terminal opened for the host never becomes PID 1's controlling terminal (O_NOCTTY)
import pty
master, slave = pty.openpty()
os.setsid()  # a session leader with no terminal: the case where an open without O_NOCTTY takes one
os.symlink(os.ttyname(slave), os.path.join(d, "tty"))
os.close(slave)
tty = fsops.op_fs(st, {"call": "read", "path": os.path.join(d, "tty")})
tty_nr = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4])
# a tree 1,500 deep: listed and removed without recursion; names that are not UTF-8; /proc/self
deep = os.path.join(d, "deep")
os.mkdir(deep)
fd = os.open(deep, os.O_RDONLY)
for _ in range(1500):
    os.mkdir("d", dir_fd=fd)
    nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nfd
os.close(fd)
fsops.LIST_MAX = 10000
listed = fsops.op_fs(st, {"call": "list", "path": deep, "depth": 2000})
assert "fs" in listed, listed
removed = fsops.op_fs(st, {"call": "remove", "path": deep})
odd = os.path.join(d, "odd")
os.mkdir(odd)
open(os.path.join(os.fsencode(odd), b"bad\xffname"), "w").close()
os.symlink(b"/tmp/\xfe", os.path.join(os.fsencode(odd), b"oddlink"))
odd_list = fsops.op_fs(st, {"call": "list", "path": odd})
line = to_json(odd_list).encode()  # what the agent sends: never "answer not encodable"
fsops.LIST_BYTES = 2000  # names past the byte budget: too_many, never an answer past the channel's line
many = os.path.join(d, "many")
os.mkdir(many)
for i in range(40):
    os.symlink("/" + "t" * 200, os.path.join(many, f"l{i}"))
budget = fsops.op_fs(st, {"call": "list", "path": many})
nul = fsops.op_fs(st, {"call": "write", "path": os.path.join(d, "b\0zzz"), "data": "eA=="})
try:
    files.open_plain(st, os.path.join(d, "plain.txt\0/etc"), os.O_RDONLY)
    nul_open = "opened"
except ValueError:
    nul_open = "refused"
proc = {p: fsops.op_fs(st, {"call": c, "path": p}) for c, p in (("list", "/proc/self/map_files"), ("stat", "/proc/self/fd/0"),
                                                              ("list", "/proc/self/fd"))}
print(json.dumps({"got": got, "fs": fs, "tty": tty, "tty_nr": tty_nr, "listed": len(listed["fs"]["entries"]),
                  "removed": removed, "gone": not os.path.exists(deep), "odd": json.loads(line),
                  "proc": proc, "budget": budget, "nul": [nul, nul_open, os.path.exists(os.path.join(d, "b"))]}),
      file=out)
'''


def test_the_runner_opens_only_plain_files_for_the_host(tmp_path):
    out = run_with_runner(tmp_path, OPEN_PLAIN)
    for key, what in out["got"].items():
        openat2, name, flags = key.split()
        if name == "plain":
            assert what == "opened", key
        elif name == "fifo" and int(flags) & os.O_WRONLY:
            assert what in ("refused", "error 6"), key  # ENXIO: no reader, never blocked on
        else:
            assert what == "refused", key
    fs = out["fs"]
    assert fs["big"]["fs_error"][0] == "too_many"
    assert fs["read"] == {"fs": {"data": "eHg=", "cut": True}}  # b"xx"
    assert fs["relative"]["fs_error"][0] == "invalid" and fs["missing"]["fs_error"][0] == "not_found"
    assert fs["made"] == 0o040000
    assert out["tty"]["fs_error"][0] == "invalid" and out["tty_nr"] == 0
    assert out["listed"] == 1500 and out["removed"] == {"fs": {}} and out["gone"]
    names = sorted(e["path"].rsplit("/", 1)[1] for e in out["odd"]["fs"]["entries"])
    assert names == ["bad\ufffdname", "oddlink"]
    assert [e["link"] for e in out["odd"]["fs"]["entries"] if e["link"]] == ["/tmp/\ufffd"]
    assert out["budget"]["fs_error"][0] == "too_many"
    assert out["nul"][0]["fs_error"][0] == "invalid" and out["nul"][1:] == ["refused", False]  # never cut at the NUL
    for path, answer in out["proc"].items():  # nothing of /proc shown through the agent's own rights
        assert answer.get("fs_error", [""])[0] == "invalid" and "/proc" in answer["fs_error"][1], (path, answer)
