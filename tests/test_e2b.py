"""The E2B dialect, driven by E2B's own SDKs (``e2b``, ``e2b-code-interpreter``, as pinned in the
test extra) against a live ``tangram serve`` with real sandboxes. The SDKs are configured the way
a user would: only ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")
ci = pytest.importorskip("e2b_code_interpreter")

from e2b import AsyncSandbox, CommandExitException, Sandbox  # noqa: E402
from e2b.exceptions import (AuthenticationException, FileNotFoundException, NotFoundException,  # noqa: E402
                            SandboxNotRunningException)

from servers import Server  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

#: set in the server's environment: no sandbox may see it
SERVER_SECRET = "tangram-e2b-test-secret-4d1f"


def _point_sdk_at(url: str, key: str = "e2b_0123456789abcdef") -> dict:
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
    return saved


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    os.environ["TANGRAM_E2B_TEST_SECRET"] = SERVER_SECRET
    try:
        srv = Server(tmp_path_factory.mktemp("e2b"), config={"sandbox": {"warm_pool": 2}})
    finally:
        os.environ.pop("TANGRAM_E2B_TEST_SECRET", None)
    saved = _point_sdk_at(srv.url)
    yield srv
    _restore(saved)
    srv.stop()


# -- the control plane and the MVP calls, sync ----------------------------------------------------

def test_sync_sandbox_commands_files_and_lifecycle(server):
    sb = Sandbox.create(metadata={"job": "e2b-test", "purpose": "sync"}, envs={"FOO": "bar baz"}, timeout=120)
    try:
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id and info.metadata == {"job": "e2b-test", "purpose": "sync"}
        assert info.state.value == "running"
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121

        r = sb.commands.run('echo "out $FOO"; echo err >&2; pwd; echo $HOME')
        assert (r.exit_code, r.stderr) == (0, "err\n")
        assert r.stdout == "out bar baz\n/home/user\n/home/user\n"
        assert sb.commands.run("echo $FOO", envs={"FOO": "mine"}).stdout == "mine\n"  # the command's own wins
        assert sb.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sb.commands.run("whoami || id -u", user="root").exit_code == 0
        with pytest.raises(CommandExitException) as e:
            sb.commands.run("echo partial; exit 3")
        assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
        seen = []
        assert sb.commands.run("echo a; echo b >&2", on_stdout=seen.append, on_stderr=seen.append).exit_code == 0
        assert seen == ["a\n", "b\n"]
        sb.files.write("/home/user/kept.txt", "kept")
        with pytest.raises(e2b.TimeoutException):
            sb.commands.run("sleep 5", timeout=1)
        assert sb.commands.run("echo next; cat kept.txt").stdout == "next\nkept"  # the sandbox goes on, whole
        with pytest.raises(e2b.SandboxException) as e:
            sb.commands.run("true", envs={"BAD NAME": "x"})
        assert "process.envs" in str(e.value)

        # files: under the home directory and elsewhere, read back by commands and by the SDK
        info = sb.files.write("/home/user/a.txt", "hello")
        assert (info.name, info.path) == ("a.txt", "/home/user/a.txt")
        sb.files.write("rel/b.bin", b"\x00\xffbin")  # relative: under the home directory
        sb.files.write("/tmp/c.txt", "tmp file")
        assert sb.commands.run("cat a.txt rel/b.bin /tmp/c.txt | wc -c").stdout.strip() == "18"
        assert sb.files.read("/home/user/a.txt") == "hello"
        assert sb.files.read("/home/user/rel/b.bin", format="bytes") == bytearray(b"\x00\xffbin")
        assert sb.files.read("/tmp/c.txt") == "tmp file"
        assert sb.files.exists("/home/user/a.txt") and not sb.files.exists("/home/user/none")
        assert sb.files.make_dir("/home/user/d/e") is True and sb.files.make_dir("/home/user/d/e") is False
        names = sorted(e.path for e in sb.files.list("/home/user", depth=2))
        assert names == ["/home/user/a.txt", "/home/user/d", "/home/user/d/e", "/home/user/kept.txt",
                         "/home/user/rel", "/home/user/rel/b.bin"]
        got = sb.files.get_info("/home/user/a.txt")
        assert (got.type.value, got.size, got.name) == ("file", 5, "a.txt")
        assert sb.files.get_info("/home/user/d").type.value == "dir"
        moved = sb.files.rename("/home/user/a.txt", "/home/user/d/a2.txt")
        assert moved.path == "/home/user/d/a2.txt" and sb.files.read("d/a2.txt") == "hello"
        sb.files.remove("/home/user/d")
        assert not sb.files.exists("/home/user/d/a2.txt")
        with pytest.raises(FileNotFoundException):
            sb.files.read("/home/user/none")
        with pytest.raises(NotFoundException):
            sb.files.remove("/home/user/none")
        w = sb.files.write_files([{"path": "/home/user/m1", "data": "1"}, {"path": "/tmp/m2", "data": "2"}])
        assert [x.path for x in w] == ["/home/user/m1", "/tmp/m2"]
        assert sb.commands.run("cat /home/user/m1 /tmp/m2").stdout == "12"

        listed = [s.sandbox_id for s in Sandbox.list(query=e2b.SandboxQuery(metadata={"purpose": "sync"}))
                  .next_items()]
        assert listed == [sb.sandbox_id]
        before = sb.get_info().end_at
        sb.set_timeout(600)
        assert (sb.get_info().end_at - before).total_seconds() > 400
        assert sb.is_running()
    finally:
        sb.kill()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(SandboxNotRunningException):  # as E2B's proxy answers for a sandbox that is gone
        sb.commands.run("true")
    assert not sb.is_running()
    assert Sandbox.kill(sb.sandbox_id) is False


def test_sync_code_interpreter(server):
    sb = ci.Sandbox.create(envs={"FOO": "sandbox"})
    try:
        # the sandbox's variables, and a run's own for that run only
        assert sb.run_code("import os; os.environ['FOO'], os.environ['HOME']").text == "('sandbox', '/home/user')"
        assert sb.run_code("os.environ['FOO'], os.environ['X']", envs={"FOO": "run", "X": "1"}).text == "('run', '1')"
        assert sb.run_code("os.environ['FOO'], os.environ.get('X')").text == "('sandbox', None)"
        ex = sb.run_code("x = 6 * 7\nprint('side')\nx")
        assert ex.text == "42" and ex.logs.stdout == ["side\n"] and ex.error is None
        assert ex.results[0].is_main_result
        assert sb.run_code("x + 1").text == "43"  # the interpreter's state carries over
        ex = sb.run_code("import sys; print('e', file=sys.stderr); 1/0")
        assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
        assert "ZeroDivisionError" in ex.error.traceback and ex.logs.stderr == ["e\n"]
        # the interpreter and commands share the files
        sb.run_code("open('/home/user/from_py.txt', 'w').write('py')")
        assert sb.files.read("/home/user/from_py.txt") == "py"
        assert sb.commands.run("cat from_py.txt").stdout == "py"
        ctx = sb.create_code_context()
        assert ctx.id in [c.id for c in sb.list_code_contexts()] and ctx.cwd == "/home/user"
        assert sb.run_code("x", context=ctx).text == "42"  # contexts share the interpreter (README)
        sb.remove_code_context(ctx)
        assert sb.list_code_contexts() == []
        with pytest.raises(e2b.SandboxException) as e:  # the interpreter SDK maps every 4xx but 404 to this
            sb.run_code("1", language="r")
        assert "language" in str(e.value)
    finally:
        sb.kill()


def test_a_contexts_cells_run_in_its_cwd_and_cells_are_journaled(server):
    """From an audit: a context's ``cwd`` was ignored, and cells (unlike commands) were never
    journaled as accepted, so one in flight at a crash left no record."""
    sb = ci.Sandbox.create()
    try:
        sb.commands.run("mkdir -p /tmp/work && echo there > /tmp/work/f.txt")
        home = sb.run_code("import os; os.getcwd()").text
        ctx = sb.create_code_context(cwd="/tmp/work")
        assert ctx.cwd == "/tmp/work"
        assert sb.run_code("os.getcwd(), open('f.txt').read()", context=ctx).text == "('/tmp/work', 'there\\n')"
        assert sb.run_code("os.chdir('/tmp'); os.getcwd()", context=ctx).text == "'/tmp'"
        assert sb.run_code("os.getcwd()", context=ctx).text == "'/tmp'"  # its own move holds
        assert sb.run_code("os.getcwd()").text == home  # the default context: back home
        assert sb.run_code("os.getcwd()", context=ctx).text == "'/tmp/work'"  # its cwd again after another's
        bad = sb.create_code_context(cwd="/nowhere")
        with pytest.raises(e2b.SandboxException) as e:
            sb.run_code("1", context=bad)
        assert "cwd" in str(e.value)
        marker = "journaled_cell_7d1"
        assert sb.run_code(f"{marker} = 6 * 7\n{marker}").text == "42"
        with sqlite3.connect(server.journal) as db:
            rows = db.execute("SELECT kind, state, outcome FROM actions WHERE request LIKE ?",
                              (f"%{marker}%",)).fetchall()
        assert rows == [("exec", "done", "ok")]
    finally:
        sb.kill()



def test_a_file_too_large_for_one_read_says_so_not_disk_full(server):
    from e2b.exceptions import NotEnoughSpaceException

    sb = Sandbox.create()
    try:
        sb.commands.run("head -c 17000000 /dev/zero > /home/user/big && cp /home/user/big /tmp/big")
        for path in ("/home/user/big", "/tmp/big"):
            with pytest.raises(e2b.SandboxException) as e:
                sb.files.read(path, format="bytes")
            assert not isinstance(e.value, NotEnoughSpaceException) and "16 MB or larger" in str(e.value), e.value
        assert sb.commands.run("wc -c < /tmp/big").stdout.strip() == "17000000"  # the sandbox goes on
    finally:
        sb.kill()


def test_a_cells_output_cut_at_the_cap_says_so(server):
    sb = ci.Sandbox.create()
    try:
        ex = sb.run_code("print('x' * (3 << 20))\n'done'")
        assert ex.text == "'done'" and ex.error is None
        assert sum(len(s) for s in ex.logs.stdout) <= (1 << 20) + 1
        assert "the rest was dropped" in ex.logs.stderr[-1]
        assert sb.run_code("print('small')").logs.stderr == []
    finally:
        sb.kill()

# -- async: background commands, connect, stdin, signals, the code interpreter --------------------

def test_async_background_connect_stdin_and_kill(server):
    async def main():
        sb = await AsyncSandbox.create(metadata={"trajectory": "traj-async-1"})
        assert sb.sandbox_id == "traj-async-1"
        try:
            h = await sb.commands.run("sleep 0.5; echo bg done", background=True, timeout=0)
            listed = await sb.commands.list()
            assert [p.pid for p in listed] == [h.pid] and listed[0].args[-1] == "sleep 0.5; echo bg done"
            again = await sb.commands.connect(h.pid)
            r = await h.wait()
            assert r.stdout == "bg done\n" and r.exit_code == 0
            assert (await again.wait()).stdout == "bg done\n"
            assert await sb.commands.list() == []

            p = await sb.commands.run("cat; echo end", stdin=True, background=True)
            await sb.commands.send_stdin(p.pid, "piped\n")
            await sb.commands.close_stdin(p.pid)
            assert (await p.wait()).stdout == "piped\nend\n"

            await sb.files.write("/home/user/kept.txt", "kept")
            slow = await sb.commands.run("sleep 30; echo not-reached", background=True)
            await asyncio.sleep(0.5)
            assert await sb.commands.kill(slow.pid) is True
            with pytest.raises(CommandExitException) as e:
                await slow.wait()
            assert e.value.exit_code == -1 and "not-reached" not in e.value.stdout
            # the kill ended that command only: the sandbox, its files and its shell live on
            assert (await sb.commands.run("echo after; cat kept.txt")).stdout == "after\nkept"

            await sb.files.write("/home/user/x.py", "print(6*7)")
            assert (await sb.commands.run("python3 x.py")).stdout == "42\n"
            assert await sb.files.read("/home/user/x.py") == "print(6*7)"
        finally:
            await sb.kill()
        with pytest.raises(SandboxNotRunningException):
            await sb.files.read("/home/user/x.py")

        c = await ci.AsyncSandbox.create()
        try:
            assert (await c.run_code("sum(range(10))")).text == "45"
        finally:
            await c.kill()

    asyncio.run(main())


def test_a_command_reads_its_stdin_as_it_is_sent(server):
    """``stdin=True``: the command runs while its stdin is open and reads each piece as it is sent
    (an answer comes back before the next line is sent: interactive programs work), ``close_stdin``
    is its end of file, and input after its end is refused naming the process."""
    async def main():
        sb = await AsyncSandbox.create()
        try:
            seen: list[str] = []
            p = await sb.commands.run('while read -r line; do echo "got $line"; done; echo eof', stdin=True,
                                      background=True, on_stdout=seen.append, timeout=60)

            async def heard(text: str) -> None:
                for _ in range(400):
                    if text in "".join(seen):
                        return
                    await asyncio.sleep(0.025)
                raise AssertionError(f"{text!r} never came: {seen}")

            await sb.commands.send_stdin(p.pid, "one\n")
            await heard("got one\n")
            await sb.commands.send_stdin(p.pid, "two ")  # a line in two pieces
            await asyncio.sleep(0.1)
            assert "got two" not in "".join(seen)
            await sb.commands.send_stdin(p.pid, "halves\n")
            await heard("got two halves\n")
            big = "x" * 300_000  # more than a pipe holds: written as the command reads it
            await sb.commands.send_stdin(p.pid, big + "\n")
            await sb.commands.close_stdin(p.pid)
            r = await p.wait()
            assert r.stdout == f"got one\ngot two halves\ngot {big}\neof\n" and r.exit_code == 0
            with pytest.raises(NotFoundException) as e:  # as envd: an ended process is not found
                await sb.commands.send_stdin(p.pid, "late\n")
            assert f"pid {p.pid}" in str(e.value)

            # an interpreter driven line by line, its answers read between the lines
            seen.clear()
            py = await sb.commands.run("python3 -u -c 'import sys\nfor l in sys.stdin: print(int(l) * 2)'",
                                       stdin=True, background=True, on_stdout=seen.append, timeout=60)
            for i in (3, 21):
                await sb.commands.send_stdin(py.pid, f"{i}\n")
                await heard(f"{2 * i}\n")
            await sb.commands.close_stdin(py.pid)
            assert (await py.wait()).stdout == "6\n42\n"
            # the session's shell lives on, and the next command's stdin is its own (empty)
            assert (await sb.commands.run("cat; echo after")).stdout == "after\n"
        finally:
            await sb.kill()

    asyncio.run(main())


def test_a_gzip_upload_is_held_to_the_body_limit_once_inflated(server):
    """From an audit: ``files.write(..., gzip=True)`` of 150 MB of zeros passed the 32 MB body
    limit compressed, took the server's memory to 1 GB and lost the sandbox (``infra_error``).
    Inflated past the limit it is refused (413) and the sandbox lives on; below it, it lands."""
    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/small", b"ab" * (1 << 20), gzip=True)
        assert sb.files.read("/home/user/small", format="bytes") == b"ab" * (1 << 20)
        with pytest.raises(Exception) as e:
            sb.files.write("/home/user/big", b"\0" * (40 << 20), gzip=True)
        assert "body limit" in str(e.value), e.value
        assert sb.commands.run("echo alive").stdout == "alive\n"  # the sandbox was not lost
        assert not sb.files.exists("/home/user/big")
    finally:
        sb.kill()


def test_a_command_said_killed_at_its_timeout_never_runs_after(server):
    """From an audit: a command queued behind a background one (a sandbox runs one thing at a
    time) got "ran past its timeout and was killed" at its deadline, then ran once the other
    ended (its side effect landed, and it was journaled ``ok``). Killed at the deadline now."""
    from e2b.exceptions import TimeoutException

    sb = Sandbox.create()
    try:
        h = sb.commands.run("sleep 3", background=True)
        with pytest.raises(TimeoutException):
            sb.commands.run("echo late > /home/user/late", timeout=1)
        h.wait()
        time.sleep(0.5)  # (it would have run right after the sleep)
        assert not sb.files.exists("/home/user/late")
        assert sb.commands.run("echo next").stdout == "next\n"  # the sandbox goes on
    finally:
        sb.kill()


def test_a_cell_that_ends_its_interpreter_says_so_and_the_next_keeps_the_sandboxs_envs(server):
    """From an audit: ``os._exit(1)`` in a cell answered no error, and every later cell ran
    without the sandbox's ``envs`` (the new interpreter never got them); ``sys.exit(3)`` too was
    no error, where a notebook reports ``SystemExit``."""
    sb = ci.Sandbox.create(envs={"FOO": "bar"})
    try:
        assert sb.run_code("import os; os.environ.get('FOO')").text == "'bar'"
        died = sb.run_code("import os; os._exit(1)")
        assert died.error is not None and died.error.name == "InterpreterExited", died.error
        assert "variables are gone" in died.error.value
        assert sb.run_code("import os; os.environ.get('FOO'), os.environ['HOME']").text == "('bar', '/home/user')"
        ended = sb.run_code("import sys; sys.exit(3)")
        assert ended.error is not None and (ended.error.name, ended.error.value) == ("SystemExit", "3"), ended.error
        assert sb.run_code("1 + 1").error is None
    finally:
        sb.kill()


def test_pausing_with_a_command_running_is_an_error_not_already_paused(server):
    """409 is what the SDK reads as "paused already" (``pause()`` returned False and the sandbox
    went on running); a sandbox busy with a command is refused with an error that says so."""
    sb = Sandbox.create()
    try:
        h = sb.commands.run("sleep 30", background=True)
        with pytest.raises(Exception) as e:
            sb.pause()
        assert "cannot be paused" in str(e.value), e.value
        assert Sandbox.get_info(sb.sandbox_id).state.value == "running"
        h.kill()
        with pytest.raises(CommandExitException):
            h.wait()  # (its end, before the pause)
        sb.pause()
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
    finally:
        sb.kill()


def test_links_are_listed_as_links_a_dangling_one_too(server):
    """From an audit: a dangling link was missing from ``files.list`` (its type unknown to the SDK,
    which drops such entries) and ``get_info`` gave no type."""
    from e2b import FileType

    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/a.txt", "a")
        sb.commands.run("ln -s /home/user/a.txt /home/user/good && ln -s /nowhere /home/user/dangling")
        entries = {e.name: e for e in sb.files.list("/home/user")}
        assert entries["a.txt"].type == FileType.FILE
        for name, target in (("good", "/home/user/a.txt"), ("dangling", "/nowhere")):
            assert entries[name].type == FileType.SYMLINK and entries[name].symlink_target == target, entries[name]
        assert sb.files.get_info("/home/user/dangling").type == FileType.SYMLINK
    finally:
        sb.kill()


def test_pause_keeps_files_and_connect_resumes(server):
    sb = Sandbox.create(timeout=60)
    try:
        sb.files.write("/home/user/keep.txt", "kept")
        sb.pause()
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        with pytest.raises(SandboxNotRunningException):
            sb.commands.run("true")
        back = Sandbox.connect(sb.sandbox_id)
        assert back.get_info().state.value == "running"
        assert back.commands.run("cat keep.txt").stdout == "kept"
    finally:
        sb.kill()


# -- streaming output -----------------------------------------------------------------------------

def test_on_stdout_gets_output_while_the_command_runs(server):
    """The first line reaches ``on_stdout`` while the command still runs: the callback itself asks
    the server which processes run (a second connection) and finds this one."""
    sb = Sandbox.create()
    try:
        seen: list[tuple[str, list[str]]] = []

        def on_stdout(line: str) -> None:
            running = [p.args[-1] for p in sb.commands.list()]
            seen.append((line, running))

        cmd = "echo first; sleep 1; echo second"
        r = sb.commands.run(cmd, on_stdout=on_stdout)
        assert r.stdout == "first\nsecond\n"
        assert [line for line, _ in seen] == ["first\n", "second\n"]
        assert cmd in seen[0][1]  # the command was still running when its first line came
        assert sb.commands.list() == []
    finally:
        sb.kill()


def test_run_code_streams_its_output_while_the_cell_runs(server):
    """The first print reaches ``on_stdout`` while the cell still runs: the callback asks the
    server how many actions run (the cell's is one); none does once it has ended."""
    def running() -> int:
        return httpx.get(f"{server.url}/healthz").json()["running"]

    sb = ci.Sandbox.create()
    try:
        seen = []
        ex = sb.run_code("import time\nprint('first', flush=True)\ntime.sleep(1)\nprint('second')\n6 * 7",
                         on_stdout=lambda m: seen.append((m.line, running())))
        assert ex.text == "42" and ex.logs.stdout == ["first\n", "second\n"]
        assert seen[0] == ("first\n", 1) and [line for line, _ in seen] == ["first\n", "second\n"]
        assert running() == 0
        # an error after some output: still the cell's error, with what it printed before
        ex = sb.run_code("print('before')\nraise ValueError('late')")
        assert ex.logs.stdout == ["before\n"] and ex.error.name == "ValueError"
        assert sb.run_code("x = ").error.name == "SyntaxError"
        assert sb.run_code("print('no newline', end='')").logs.stdout == ["no newline"]
    finally:
        sb.kill()


def test_a_background_command_streams_and_connect_sees_the_rest(server):
    async def main():
        sb = await AsyncSandbox.create()
        try:
            first = asyncio.Event()
            lines: list[str] = []

            def got(line: str) -> None:
                lines.append(line)
                first.set()

            h = await sb.commands.run("echo started; sleep 60; echo not-reached", background=True, timeout=0,
                                      on_stdout=got)
            await asyncio.wait_for(first.wait(), 30)  # the 60 s sleep has not ended: it streamed
            assert lines == ["started\n"] and [p.pid for p in await sb.commands.list()] == [h.pid]
            again = await sb.commands.connect(h.pid)  # a re-attached stream: the output so far, then the rest
            assert await sb.commands.kill(h.pid) is True
            with pytest.raises(CommandExitException) as e:
                await again.wait()
            assert e.value.stdout == "started\n"
            with pytest.raises(CommandExitException):
                await h.wait()
            assert lines == ["started\n"]

            # a stream that floods: what reaches the callback is capped as the result is
            total = 0

            def count(chunk: str) -> None:
                nonlocal total
                total += len(chunk)

            r = await sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' a; echo done >&2", on_stdout=count)
            assert total == len(r.stdout) == 1 << 20 and r.stderr == "done\n"
            assert "cap" in (r.error or "")
        finally:
            await sb.kill()

    asyncio.run(main())


# -- errors ---------------------------------------------------------------------------------------

def test_errors_in_e2b_shape(server):
    with pytest.raises(NotFoundException):
        Sandbox.connect("no-such-sandbox")
    with pytest.raises(e2b.SandboxException) as e:  # the SDK's exception for a 400
        Sandbox.create(timeout=-5)
    assert "timeout" in str(e.value)
    with pytest.raises(Exception) as e:
        Sandbox.create(template="no-such-template")
    assert "templateID" in str(e.value)
    # raw: every answer is JSON {"code": int, "message"}, routing errors included
    r = httpx.get(f"{server.url}/sandboxes/nope", headers={"X-API-Key": "k"})
    assert r.status_code == 404 and set(r.json()) == {"code", "message"} and r.json()["code"] == 404
    r = httpx.get(f"{server.url}/no/such/route", headers={"E2b-Sandbox-Id": "x", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 404 and r.json()["code"] == 404
    r = httpx.post(f"{server.url}/v2/sandboxes", content=b"{not json", headers={"X-API-Key": "k"})
    assert r.status_code == 400 and r.json()["message"].startswith("body:")
    r = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": "base", "metadata": {"job": 3}})
    assert r.status_code == 400 and r.json()["message"].startswith("metadata:")

    sb = Sandbox.create()
    try:
        # envd calls need the sandbox's own access token
        forged = Sandbox(sandbox_id=sb.sandbox_id, sandbox_domain=None, envd_version=sb._envd_version,
                         envd_access_token="forged", connection_config=e2b.ConnectionConfig(
                             extra_sandbox_headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": "forged"}))
        with pytest.raises(AuthenticationException):
            forged.commands.run("true")
        with pytest.raises(Exception):
            forged.files.read("/home/user/x")
        # a Connect error for a bad RPC body, naming the field
        r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json={"path": 7},
                       headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token})
        assert r.status_code == 400 and r.json() == {"code": "invalid_argument", "message": "path: a path is expected"}
    finally:
        sb.kill()


def test_api_key_is_the_servers_token(tmp_path):
    srv = Server(tmp_path, token="sekrit-token")
    saved = _point_sdk_at(srv.url, "wrong")
    try:
        with pytest.raises(AuthenticationException):
            Sandbox.create()
        sb = Sandbox.create(api_key="sekrit-token")
        assert sb.commands.run("echo ok").stdout == "ok\n"
        sb.kill()
    finally:
        _restore(saved)
        srv.stop()


KEY_A, KEY_B = "e2b_" + "a" * 40, "e2b_" + "b" * 40


def _keyed_server(tmp_path, args: tuple[str, ...] = ()) -> Server:
    return Server(tmp_path, config={"api_keys": [{"key": KEY_A, "job": "job-a"}, {"key": KEY_B, "job": "job-b"}]},
                  token="admin-token-0123456789", args=args)


def _check_keys_scope_jobs(srv: Server) -> None:
    """Two jobs' keys, each through E2B's SDK and the native client: each sees only its own
    sandboxes, sessions and actions (another's id is a 404, as if it did not exist), and what it
    runs is that job's."""
    from arl_tangram.client import TangramClient
    from arl_tangram.client.base import TangramError

    saved = _point_sdk_at(srv.url, KEY_A)
    a = b = None
    try:
        with pytest.raises(AuthenticationException):
            Sandbox.create(api_key="e2b_" + "c" * 40)  # unknown key: E2B's 401
        a = Sandbox.create(metadata={"who": "a"})
        b = Sandbox.create(api_key=KEY_B, metadata={"who": "b"})
        assert a.commands.run("echo a").stdout == "a\n"
        assert [s.sandbox_id for s in Sandbox.list().next_items()] == [a.sandbox_id]
        assert [s.sandbox_id for s in Sandbox.list(api_key=KEY_B).next_items()] == [b.sandbox_id]
        with pytest.raises(NotFoundException):
            Sandbox.get_info(b.sandbox_id)  # with A's key: B's sandbox does not exist
        with pytest.raises(NotFoundException):
            Sandbox.kill(b.sandbox_id) or (_ for _ in ()).throw(NotFoundException("kill answered False"))
        assert b.commands.run("echo still b").stdout == "still b\n"  # untouched
        with pytest.raises(e2b.SandboxException) as e:  # a body naming another job than the key's
            Sandbox.create(metadata={"job": "job-b"})
        assert "metadata.job" in str(e.value) and "job-a" in str(e.value)

        native_a = TangramClient(srv.url, token=KEY_A)
        native_b = TangramClient(srv.url, token=KEY_B)
        with pytest.raises(TangramError) as e:  # B's sandbox is B's session: A cannot join it
            native_a.session(trajectory=b.sandbox_id)
        # 409, saying nothing of whose it is (the same answer as for any id in use)
        assert e.value.status == 409 and "trajectory" in str(e.value) and "job-b" not in str(e.value)
        r = httpx.post(f"{srv.url}/v1/sessions/{b.sandbox_id}/exec", json={"command": "true"},
                       headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 404 and "no session" in r.json()["message"]
        done = native_b.run_code("print(1)", id="act-of-b")
        assert done.outcome == "ok"
        r = httpx.get(f"{srv.url}/v1/actions/act-of-b", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 404
        assert native_b.get("act-of-b").outcome == "ok"
        r = httpx.post(f"{srv.url}/v1/actions", json={"id": "act-of-b", "action": {"code": "print(3)"}},
                       headers={"Authorization": f"Bearer {KEY_A}"})  # reusing B's id tells nothing of it
        assert r.status_code == 409 and "in use" in r.json()["message"] and "job-b" not in r.text
        # the server-wide views are the token's: a key sees its own job only (/v1/jobs)
        for path in ("/metrics", "/v1/cluster"):
            r = httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 403 and "token" in r.json()["message"]
            r = httpx.get(f"{srv.url}{path}", headers={"Authorization": "Bearer admin-token-0123456789"})
            assert r.status_code == 200
        for headers in ({"Authorization": f"Bearer {KEY_A}"}, {}):
            assert set(httpx.get(f"{srv.url}/healthz", headers=headers).json()) == {"status", "version"}
        full = httpx.get(f"{srv.url}/healthz", headers={"Authorization": "Bearer admin-token-0123456789"}).json()
        assert "running" in full and "sessions" in full
        from arl_tangram import top
        health, jobs, cluster = top.snapshot(native_a)  # `tangram top` with a key: its job, no nodes
        assert cluster is None and {j.job for j in jobs} == {"job-a"} and "queued" not in health
        top.render(srv.url, health, jobs, cluster)
        s = native_a.session()
        assert s.job == "job-a" and s.exec("echo $HOME").outcome == "ok"
        assert {j.job for j in native_a.jobs()} == {"job-a"}  # its actions carry its job, and only those show
        assert {j.job for j in native_b.jobs()} == {"job-b"}
        assert native_b.stats("job-b").outcomes.get("ok", 0) >= 2  # B's sandbox commands and its run_code
        r = httpx.get(f"{srv.url}/v1/jobs/job-b/stats", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 404
        r = httpx.post(f"{srv.url}/v1/actions", json={"job": "job-b", "action": {"code": "print(1)"}},
                       headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 403 and "job" in r.json()["message"]
        r = httpx.post(f"{srv.url}/run_code", json={"code": "print(2)", "language": "python"},
                       headers={"Authorization": f"Bearer {KEY_B}"})
        assert r.json()["status"] == "Success"
        assert native_b.stats("job-b").actions >= 3  # SandboxFusion's run is B's too
        for path in ("/run_code", "/v1/jobs"):  # an unknown key: 401 in each dialect's shape
            r = httpx.request("POST" if path == "/run_code" else "GET", f"{srv.url}{path}",
                              json={"code": "1"}, headers={"Authorization": "Bearer nope-nope-nope-nope"})
            assert r.status_code == 401 and "message" in r.json() and "code" not in r.json()
        r = httpx.get(f"{srv.url}/v2/sandboxes", headers={"X-API-Key": "nope"})
        assert r.status_code == 401 and r.json()["code"] == 401
        admin = httpx.get(f"{srv.url}/v1/jobs", headers={"Authorization": "Bearer admin-token-0123456789"})
        assert {"job-a", "job-b"} <= {j["job"] for j in admin.json()}  # the token sees every job
        s.close()
        native_a.close()
        native_b.close()
    finally:
        for box, key in ((a, KEY_A), (b, KEY_B)):
            if box is not None:
                Sandbox.kill(box.sandbox_id, api_key=key)
        _restore(saved)


def test_api_keys_tie_requests_to_jobs(tmp_path):
    srv = _keyed_server(tmp_path)
    try:
        _check_keys_scope_jobs(srv)
    finally:
        srv.stop()


@pytest.mark.slow
def test_api_keys_through_http_fronts(tmp_path):
    srv = _keyed_server(tmp_path, ("--fronts", "2"))
    try:
        _check_keys_scope_jobs(srv)
    finally:
        srv.stop()


# -- containment: model-written code run as E2B commands ------------------------------------------

def test_containment_as_e2b_commands(server, tmp_path):
    marker = tmp_path / "host-secret.txt"
    marker.write_text("host secret")
    a, b = Sandbox.create(), Sandbox.create()
    try:
        a.files.write("/home/user/mine.txt", "only a's")
        a.commands.run("echo a-tmp > /tmp/a-tmp.txt")
        r = b.commands.run(f"cat {marker}; ls /home/user /tmp; cat /proc/1/environ | tr '\\0' '\\n'; env")
        out = r.stdout + r.stderr
        assert "host secret" not in out and "mine.txt" not in out and "a-tmp" not in out
        assert SERVER_SECRET not in out and "E2B_API_KEY" not in out
        net = b.commands.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 3)\" "
                             "&& echo CONNECTED || echo blocked")
        assert net.stdout.strip() == "blocked"
        assert b.commands.run("touch /usr/x 2>&1 || echo ro").stdout.strip().endswith("ro")
    finally:
        a.kill()
        b.kill()


def test_files_never_follow_a_symlink_the_sandbox_planted_to_the_host(server, tmp_path):
    """Workspace files are read and written from the server process (``hostfiles``): links that
    sandbox code plants, to a host file or a host directory, must never be followed there."""
    host_dir = tmp_path / "host-only"
    host_dir.mkdir()
    secret = host_dir / "secret.txt"
    secret.write_text("host secret")
    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/plain.txt", "plain")  # the fast path, first: the sandbox is started
        assert sb.files.read("/home/user/plain.txt") == "plain"
        sb.commands.run(f"ln -s {secret} /home/user/leak; ln -s {host_dir} /home/user/dir; "
                        f"mkdir -p /home/user/a; ln -s {host_dir} /home/user/a/b; mkfifo /home/user/fifo")
        for path in ("/home/user/leak", "/home/user/dir/secret.txt", "/home/user/a/b/secret.txt"):
            try:
                got = sb.files.read(path)
            except FileNotFoundException:
                got = None
            assert got != "host secret", path
        for path in ("/home/user/leak", "/home/user/dir/new.txt", "/home/user/a/b/new.txt"):
            try:
                sb.files.write(path, "overwritten")
            except e2b.SandboxException:
                pass  # refused inside the sandbox: fine
        assert secret.read_text() == "host secret" and sorted(p.name for p in host_dir.iterdir()) == ["secret.txt"]
        with pytest.raises(e2b.SandboxException):  # a FIFO is neither read nor hung on
            sb.files.read("/home/user/fifo", request_timeout=5)
        assert sb.commands.run("cat plain.txt").stdout == "plain"
        sb.files.write("/home/user/plain.txt", "again")  # owned as the sandbox's user: it may change it
        assert sb.commands.run("echo more >> plain.txt && cat plain.txt && rm plain.txt").stdout == "againmore\n"
    finally:
        sb.kill()


def test_filesystem_calls_are_not_answered_by_the_sandboxs_own_code(server):
    """From an audit: the filesystem calls ran in the session's own interpreter (and reads and
    writes outside the home directory in its own shell), so the sandbox's code could answer them:
    a grader checking ``files.exists`` or reading a result file through the SDK read a forgery."""
    sb = ci.Sandbox.create()
    try:
        sb.files.write("/tmp/result.txt", "real")
        sb.files.write("/home/user/there.txt", "here")
        # the interpreter's os and json, and the shell's base64, cat and mkdir, replaced
        ex = sb.run_code("import os, json\nos.lstat = os.stat = lambda *a, **k: 1/0\n"
                         "json.dumps = lambda *a, **k: '{\"entries\": []}'\n"
                         "os.path.isdir = os.path.lexists = os.path.exists = lambda p: False\n'patched'")
        assert ex.error is None and ex.text == "'patched'"
        r = sb.commands.run("base64() { echo Zm9yZ2Vk; }; cat() { : ; }; mkdir() { : ; }; export -f base64 cat mkdir; "
                            "echo ok")
        assert r.stdout == "ok\n"
        assert sb.files.read("/tmp/result.txt") == "real"
        assert sb.files.exists("/home/user/there.txt") and not sb.files.exists("/home/user/nowhere")
        assert "there.txt" in [e.name for e in sb.files.list("/home/user")]
        assert sb.files.get_info("/home/user/there.txt").size == 4
        sb.files.write("/tmp/out/new.txt", "written")  # a directory made, the file written
        assert sb.files.read("/tmp/out/new.txt") == "written"
        sb.files.make_dir("/tmp/d/e")
        assert sb.files.rename("/tmp/d", "/tmp/moved").path == "/tmp/moved"
        assert [e.name for e in sb.files.list("/tmp/moved")] == ["e"]
        sb.files.remove("/tmp/moved")
        assert not sb.files.exists("/tmp/moved")
        assert sb.run_code("import os; os.lstat is os.stat").text == "True"  # the session's own state: its own
    finally:
        sb.kill()


def test_links_to_the_agents_own_files_are_never_followed(server):
    """Found by a probe: the sandbox's agent followed a link the sandbox planted with its own
    rights, so a link to ``/proc/1/fd/N`` (the agent's descriptors, the answer channel to the
    server among them), written through, put the caller's bytes on that channel, and one to
    ``/proc/1/maps`` read the agent's memory map back."""
    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/plain.txt", "plain")
        sb.commands.run("for n in 0 1 2 3 4 5 6 7 8 9 10 11; do ln -s /proc/1/fd/$n /home/user/fd$n; "
                        "ln -s /proc/1/fd/$n /tmp/fd$n; done; ln -s /proc/1/maps /home/user/maps; "
                        "ln -s /proc/1/environ /tmp/environ")
        forged = '{"exit_code": 0, "stdout": "Zm9yZ2Vk"}\n'
        for n in range(12):
            for path in (f"/home/user/fd{n}", f"/tmp/fd{n}"):
                with pytest.raises(e2b.SandboxException):
                    sb.files.write(path, forged)
                with pytest.raises(e2b.SandboxException):
                    sb.files.read(path, request_timeout=10)
        for path in ("/home/user/maps", "/tmp/environ"):
            with pytest.raises(e2b.SandboxException) as e:
                sb.files.read(path)
            assert "not a plain file" in str(e.value)
        r = sb.commands.run("echo mine; cat plain.txt")  # every answer still its own request's
        assert (r.stdout, r.exit_code) == ("mine\nplain", 0)
        assert sb.files.read("/home/user/plain.txt") == "plain"
    finally:
        sb.kill()


# -- many at once ---------------------------------------------------------------------------------

async def _many(n: int) -> list[float]:
    async def one(i: int) -> float:
        t = time.perf_counter()
        sb = await AsyncSandbox.create(metadata={"i": str(i)})
        r = await sb.commands.run(f"echo {i}")
        assert r.stdout == f"{i}\n"
        await sb.files.write("/home/user/i", str(i))
        assert await sb.files.read("/home/user/i") == str(i)
        await sb.kill()
        return time.perf_counter() - t

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_concurrent_sandboxes_from_asyncio(server):
    took = asyncio.run(_many(20))
    assert len(took) == 20
    assert Sandbox.list(query=e2b.SandboxQuery(metadata={"i": "3"})).next_items() == []


@pytest.mark.slow
def test_a_hundred_concurrent_sandboxes(server):
    assert len(asyncio.run(_many(100))) == 100


@pytest.mark.slow
def test_through_http_fronts(tmp_path):
    srv = Server(tmp_path, args=("--fronts", "2"))
    saved = _point_sdk_at(srv.url)
    try:
        sb = ci.Sandbox.create()
        assert sb.commands.run("echo via fronts").stdout == "via fronts\n"
        sb.files.write("/home/user/f", "F")
        assert sb.files.read("/home/user/f") == "F"
        h = sb.commands.run("sleep 0.2; echo bg", background=True)
        assert h.wait().stdout == "bg\n"
        seen = []  # streamed through the front's link: the first line while the command runs
        r = sb.commands.run("echo one; sleep 0.5; echo two", on_stdout=lambda line: seen.append(
            (line, [p.pid for p in sb.commands.list()])))
        assert r.stdout == "one\ntwo\n" and seen[0][0] == "one\n" and seen[0][1]
        assert sb.run_code("2 + 2").text == "4"
        sb.kill()
        with pytest.raises(SandboxNotRunningException):
            sb.commands.run("true")
    finally:
        _restore(saved)
        srv.stop()


def test_list_pages(server):
    made = [Sandbox.create(metadata={"page": "yes"}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=e2b.SandboxQuery(metadata={"page": "yes"}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
        r = httpx.get(f"{server.url}/v2/sandboxes", params={"limit": "0"})
        assert r.status_code == 400 and "limit" in json.loads(r.text)["message"]
    finally:
        for s in made:
            s.kill()


# -- templates that are imported images: /home/user, files, fork ---------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="image sandboxes mount overlays: root only")
def test_image_template_files_fork_and_metrics(tmp_path):
    from arl_tangram.managers.sandbox.images import ImageStore

    from imagekit import docker_archive, host_tools

    tools = [shutil.which(t) for t in ("bash", "cat", "mkdir", "ls", "base64", "dirname", "env", "sleep")]
    store = ImageStore(tmp_path / "store")
    layer = host_tools(*tools) + [("symlink", "usr/bin/sh", "bash"), ("file", "etc/motd", "from the image\n"),
                                  ("dir", "home/user", 0o755), ("file", "home/user/hidden", "shadowed\n")]
    store.import_path(docker_archive(tmp_path / "img.tar", [layer]), "tiny-e2b")
    srv = Server(tmp_path, config={"sandbox": {"image_store": str(store.root), "warm_pool": 0}})
    saved = _point_sdk_at(srv.url)
    try:
        sb = Sandbox.create(template="tiny-e2b", metadata={"job": "img"})
        assert sb.get_info().template_id == "tiny-e2b"
        # the image's /home/user is the workspace here too (mounted over the image's own)
        assert sb.commands.run("pwd; cat /etc/motd; ls /home/user").stdout == "/home/user\nfrom the image\n"
        sb.files.write("/home/user/state.txt", "s1")
        sb.files.write("/tmp/t.txt", "tmp")
        assert sb.commands.run("cat state.txt /tmp/t.txt").stdout == "s1tmp"
        assert sb.files.read("/tmp/t.txt") == "tmp"
        assert [e.name for e in sb.files.list("/home/user")] == ["state.txt"]
        assert sb.files.get_info("/etc/motd").size == len("from the image\n")
        forks = sb.fork(count=2, timeout=60)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks)
        for i, f in enumerate(forks):
            assert f.get_info().metadata == {"job": "img"}
            assert f.commands.run("cat state.txt").stdout == "s1"
            f.files.write("/home/user/state.txt", f"child {i}")
        assert sb.files.read("/home/user/state.txt") == "s1"  # copy-on-write: the source is untouched
        assert [f.files.read("state.txt") for f in forks] == ["child 0", "child 1"]
        snap = sb.create_snapshot(name="tiny-e2b-snap")
        from_snap = Sandbox.create(template="tiny-e2b-snap", timeout=60)
        assert from_snap.commands.run("cat state.txt; cat /etc/motd").stdout == "s1from the image\n"
        with sqlite3.connect(srv.journal) as db:  # an open session the journal knows, as a created one
            assert db.execute("SELECT state FROM sessions WHERE id=?", (from_snap.sandbox_id,)).fetchall() == [("awake",)]
        from_snap.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        m = sb.get_metrics()
        assert len(m) == 1 and m[0].mem_used > 0 and m[0].mem_total >= m[0].mem_used
        for f in forks:
            f.kill()
        sb.kill()
        plain = Sandbox.create()  # the default sandbox forks too: its workspace is layered copy-on-write
        plain.files.write("/home/user/p.txt", "plain")
        [child] = plain.fork()
        child.files.write("/home/user/p.txt", "child")
        assert (plain.files.read("p.txt"), child.files.read("p.txt")) == ("plain", "child")
        child.kill()
        plain.kill()
    finally:
        _restore(saved)
        srv.stop()


def test_the_e2b_timeout_outlives_the_servers_idle_expiry(tmp_path):
    """A sandbox idle past ``session_idle_expiry_s`` stays while its E2B timeout runs (E2B's
    timeout is its owner's word), and goes at the end of it."""
    srv = Server(tmp_path, config={"sandbox": {"session_idle_expiry_s": 1.5, "warm_pool": 1}})
    saved = _point_sdk_at(srv.url)
    try:
        # times are taken from each call's return, so a slow start on a loaded host moves the
        # checks with it instead of eating their margins (keep's 9 s against a check at ~4 s)
        keep = Sandbox.create(timeout=9)
        born = time.monotonic()
        keep.files.write("/home/user/k", "kept")
        short = Sandbox.create(timeout=2)
        short.files.write("/home/user/k", "short")
        short_written = time.monotonic()
        time.sleep(max(0.0, short_written + 3.5 - time.monotonic()))  # idle 3.5 s > 1.5 s
        assert time.monotonic() < born + 7, "the host is too slow for this test's margins"
        assert keep.files.read("/home/user/k") == "kept"  # idle past the expiry: still there
        with pytest.raises(NotFoundException):
            short.get_info()  # its E2B timeout ended
        time.sleep(max(0.0, born + 9 + 1.5 - time.monotonic()))
        with pytest.raises(NotFoundException):
            keep.get_info()
    finally:
        _restore(saved)
        srv.stop()


def test_concurrent_calls_on_one_sandbox(server):
    """Calls on one sandbox at once (a background command, writes, reads, a cell) each get their
    own answer: the sandbox runs them one after another."""
    async def main():
        sb = await ci.AsyncSandbox.create()
        try:
            bg = await sb.commands.run("sleep 0.3; echo bg", background=True)
            writes = [sb.files.write(f"/home/user/c{i}", str(i)) for i in range(5)]
            runs = [sb.commands.run(f"echo {i}") for i in range(5)]
            cells = [sb.run_code(f"{i} * 2") for i in range(3)]
            done = await asyncio.gather(*writes, *runs, *cells)
            assert [r.stdout for r in done[5:10]] == [f"{i}\n" for i in range(5)]
            assert [e.text for e in done[10:]] == ["0", "2", "4"]
            assert (await bg.wait()).stdout == "bg\n"
            reads = await asyncio.gather(*(sb.files.read(f"/home/user/c{i}") for i in range(5)))
            assert reads == [str(i) for i in range(5)]
            # a command killed while it waits for the sandbox never runs
            slow = await sb.commands.run("sleep 1", background=True)
            queued = await sb.commands.run("echo ran > /home/user/ran", background=True)
            assert await sb.commands.kill(queued.pid) is True
            await slow.wait()
            assert not await sb.files.exists("/home/user/ran")
            # a command still waiting for its stdin hears that the sandbox is gone when it is killed
            waiting = await sb.commands.run("cat", stdin=True, background=True)
        finally:
            await sb.kill()
        with pytest.raises(SandboxNotRunningException):
            await waiting.wait()

    asyncio.run(main())


@pytest.mark.slow
def test_bench_e2b_prints_its_figures():
    from arl_tangram.bench.e2b import run

    out = run(2, 3, open_concurrency=2)
    opened = out["open_at_once"]
    assert (opened["open"], opened["listed"], opened["errors"], opened["again_errors"]) == (3, 3, [], 0)
    assert opened["held_while_open"]["sessions"] == 3
    assert all(out[k]["n"] == 2 for k in ("create_and_first_command", "commands_run_true", "write_and_read_1mb",
                                          "files_list", "files_exists", "read_outside_home",
                                          "stdin_turn", "run_code"))
    assert out["stream_first_line"]["n"] == out["stream_whole_command"]["n"] == 1  # (streaming: its own tests)


def test_a_character_cut_between_streamed_batches_survives_a_quiet_poll():
    """run_code's NDJSON stream: a quiet poll sends the partial line held so far, but a UTF-8
    character cut between two batches must wait for its other bytes (flushing the decoder there
    turned one "é" into two U+FFFD)."""
    from arl_tangram.server.e2b.routes import _cell_lines

    batches = iter([(b"", b"", False), (b"\xa9 ok\n", b"", True)])  # quiet, then the rest
    result = {"stdout": "caf\u00e9 ok\n", "stderr": "", "results": [], "error": None, "execution_count": 1}

    async def collect():
        gen = _cell_lines((b"caf\xc3", b""), None, lambda sent, wait: next(batches), lambda: result)
        return [json.loads(line) async for line in gen]

    lines = asyncio.run(collect())
    text = "".join(x["text"] for x in lines if x["type"] == "stdout")
    assert text == "caf\u00e9 ok\n" and "\ufffd" not in text, lines
    assert lines[-1] == {"type": "number_of_executions", "execution_count": 1}
