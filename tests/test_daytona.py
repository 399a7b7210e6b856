"""The Daytona dialect, driven by Daytona's own SDK (``daytona``, as pinned in the test extra), sync
and async, against a live ``tangram serve`` with real sandboxes. The SDK is configured the way a
user would: only ``DAYTONA_API_URL`` (the server's URL followed by ``/api``) and
``DAYTONA_API_KEY``."""

from __future__ import annotations

import asyncio
import inspect
import io
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid

import httpx
import pytest

daytona = pytest.importorskip("daytona")

from daytona import (AsyncDaytona, CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams,  # noqa: E402
                     CreateSnapshotParams, Daytona, DaytonaConfig, FileDownloadRequest, FileUpload,
                     ListSandboxesQuery, Resources, SessionExecuteRequest)
from daytona.common.errors import (DaytonaAuthenticationError, DaytonaBadRequestError,  # noqa: E402
                                   DaytonaConflictError, DaytonaError, DaytonaFileNotFoundError,
                                   DaytonaForbiddenError, DaytonaNotFoundError,
                                   DaytonaProcessExecutionTimeoutError)

from servers import Server  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

#: set in the server's environment: no sandbox may see it
SERVER_SECRET = "tangram-daytona-test-secret-7c2e"
VARS = ("DAYTONA_API_URL", "DAYTONA_API_KEY")


def _point_sdk_at(url: str, key: str = "dtn_local") -> dict:
    saved = {k: os.environ.get(k) for k in VARS}
    os.environ.update(DAYTONA_API_URL=f"{url}/api", DAYTONA_API_KEY=key)
    return saved


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    os.environ["TANGRAM_DAYTONA_TEST_SECRET"] = SERVER_SECRET
    try:
        srv = Server(tmp_path_factory.mktemp("daytona"), config={"sandbox": {"warm_pool": 2}})
    finally:
        os.environ.pop("TANGRAM_DAYTONA_TEST_SECRET", None)
    saved = _point_sdk_at(srv.url)
    yield srv
    _restore(saved)
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """One sync client for the module (each holds an event connection)."""
    return Daytona()


class Synced:
    """An object of the async SDK driven from a test written for the sync one: each coroutine it
    returns runs on ``loop`` (a thread's) and is waited for, an async iterator is read whole, and
    what comes back is wrapped the same way. So one test walks both SDKs, call by call."""

    def __init__(self, obj, loop) -> None:
        self._obj, self._loop = obj, loop

    def __getattr__(self, name: str):
        value = getattr(self._obj, name)
        if callable(value) and not isinstance(value, type) and inspect.ismethod(value):
            return lambda *a, **k: self._settle(value(*a, **k))
        return self._wrap(value)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    def _settle(self, value):
        if inspect.isawaitable(value):
            async def wait():
                return await value
            value = self._run(wait())
        if inspect.isasyncgen(value) or hasattr(value, "__anext__"):
            async def read():
                return [x async for x in value]
            value = self._run(read())
        return self._wrap(value)

    def _wrap(self, value):
        if isinstance(value, list):
            return [self._wrap(v) for v in value]
        if type(value).__module__.startswith("daytona._async"):
            return Synced(value, self._loop)
        return value


@pytest.fixture(scope="module", params=["sync", "async"])
def sdk(request, server, client):
    """The sync client, or the async one behind ``Synced``: the walks below run with both."""
    if request.param == "sync":
        yield client
        return
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def make():
        return AsyncDaytona()

    d = asyncio.run_coroutine_threadsafe(make(), loop).result(30)
    yield Synced(d, loop)
    asyncio.run_coroutine_threadsafe(d.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _follow(process, session: str, command: str, out: list, err: list | None = None) -> None:
    """A command's streamed logs to its end (the sync SDK's method is a coroutine; through
    ``Synced`` the async SDK's has run already)."""
    done = process.get_session_command_logs_async(session, command, out.append,
                                                  (err if err is not None else out).append)
    if inspect.isawaitable(done):
        asyncio.run(done)


def _labels(**kw: str) -> CreateSandboxFromSnapshotParams:
    return CreateSandboxFromSnapshotParams(labels=kw)


# -- sandboxes: create, get, list, states, intervals, exec, code_run -------------------------------

def test_sandboxes_exec_code_run_and_states(server, sdk):
    client = sdk
    name = f"one-{uuid.uuid4().hex[:8]}"
    sb = client.create(CreateSandboxFromSnapshotParams(name=name, labels={"purpose": name},
                                                       env_vars={"FOO": "bar baz"}, auto_stop_interval=0))
    try:
        assert sb.state.value == "started" and sb.name == name and sb.labels["purpose"] == name
        assert sb.labels["code-toolbox-language"] == "python" and sb.env == {"FOO": "bar baz"}
        assert (sb.cpu, sb.gpu) == (1, 0) and sb.memory >= 1 and sb.disk >= 1 and sb.auto_stop_interval == 0
        assert client.get(name).id == sb.id and client.get(sb.id).name == name
        with pytest.raises(DaytonaConflictError):
            client.create(CreateSandboxFromSnapshotParams(name=name))

        r = sb.process.exec('echo "out $FOO"; echo err >&2; pwd; echo $HOME')
        assert (r.exit_code, r.result) == (0, "out bar baz\nerr\n/home/user\n/home/user\n")
        assert r.artifacts.stdout == r.result
        assert sb.process.exec("echo $FOO", env={"FOO": "mine"}).result == "mine\n"  # the command's own wins
        assert sb.process.exec("pwd", cwd="/tmp").result == "/tmp\n"
        sb.process.exec("mkdir -p work/sub")
        assert sb.process.exec("pwd", cwd="work/sub").result == "/home/user/work/sub\n"  # under the home directory
        assert sb.process.exec("echo partial; exit 3").exit_code == 3
        assert sb.process.exec("cd /tmp; export GONE=1").exit_code == 0
        assert sb.process.exec("pwd; echo ${GONE:-unset}").result == "/home/user\nunset\n"  # exec keeps nothing
        # parsed as one unit, its stdin empty, its own here-document and a last external command
        r = sb.process.exec("cat; cat <<'EOF'\nin doc\nEOF\nls -d /tmp")
        assert (r.exit_code, r.result) == (0, "in doc\n/tmp\n")
        r = sb.process.exec("echo 'unterminated")
        assert r.exit_code == 2 and "unexpected EOF" in r.result
        with pytest.raises(DaytonaProcessExecutionTimeoutError):
            sb.process.exec("sleep 5", timeout=1)
        assert sb.process.exec("echo next").result == "next\n"  # the sandbox goes on, whole
        with pytest.raises(DaytonaBadRequestError):
            sb.process.exec("true", env={"BAD NAME": "x"})

        r = sb.process.code_run("import os, sys\nprint(sys.argv[1:], os.environ['FOO'], os.environ['X'])",
                                daytona.CodeRunParams(argv=["a", "b"], env={"X": "1"}))
        assert (r.exit_code, r.result) == (0, "['a', 'b'] bar baz 1\n")
        r = sb.process.code_run("import sys\nprint('before')\nsys.exit(4)")
        assert (r.exit_code, r.result) == (4, "before\n")
        r = sb.process.code_run("x = 1\n1 / 0")
        assert r.exit_code == 1 and r.result.startswith("Traceback") and "ZeroDivisionError" in r.result
        assert "tangram" not in r.result
        assert sb.process.code_run("print(x)").exit_code == 1  # each run is a new process: no x
        # killed by a signal: no exit code of its own (the shell's 128 + signal), its output kept
        r = sb.process.code_run("import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
        assert (r.exit_code, r.result) == (137, "x\n")
        # what it leaves running ends with it, and the answer does not wait for it
        t = time.monotonic()
        r = sb.process.code_run("import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('left')")
        assert (r.exit_code, r.result) == (0, "left\n") and time.monotonic() - t < 10
        assert sb.process.exec("ps -eo comm | grep -c '^sleep$'").result.strip() == "0"
        for i in range(5):  # one after another: each child reaped, its exit code its own
            assert sb.process.code_run(f"import sys; print({i}); sys.exit({i})").exit_code == i
        # the exit code is the child's own: not that of a fork the code let run on, nor upset by
        # the code closing every descriptor it did not open and opening files of its own
        r = sb.process.code_run("import os, sys\nif os.fork() == 0:\n    sys.exit(3)\nos.wait()\nprint('parent')")
        assert (r.exit_code, r.result) == (0, "parent\n")
        r = sb.process.code_run("import os\nos.closerange(3, 1 << 16)\nfs = [open(f'fd{i}', 'w') for i in range(64)]\n"
                                "print('closed')\nraise SystemExit(5)")
        assert (r.exit_code, r.result) == (5, "closed\n")
        assert sb.process.exec("cat fd* | wc -c; rm fd*").result == "0\n"
        for _ in range(3):  # each child reaped before the answer: no zombie of the interpreter's
            assert sb.process.code_run("pass").exit_code == 0
        assert sb.process.exec("ps -eo stat= | grep -c '^Z'").result == "0\n"
        assert sb.process.code_run("import time; time.sleep(0.1); print('ok')").result == "ok\n"
        with pytest.raises(Exception) as e:  # (the SDK's code_run raises its API client's error as it is)
            sb.process.code_run("import time; time.sleep(5)", timeout=1)
        assert e.value.status == 408 and "PROCESS_EXECUTION_TIMEOUT" in e.value.body
        assert sb.process.code_run("print(2 + 2)").result == "4\n"

        listed = [s.id for s in client.list(ListSandboxesQuery(labels={"purpose": name}))]
        assert listed == [sb.id]
        assert [s.id for s in client.list(ListSandboxesQuery(name=name[:6]))] == [sb.id]

        sb.set_labels({"purpose": name, "extra": "yes"})
        sb.set_autostop_interval(30)
        sb.set_auto_delete_interval(60)
        sb.refresh_data()
        assert sb.labels["extra"] == "yes" and (sb.auto_stop_interval, sb.auto_delete_interval) == (30, 60)

        sb.process.exec("echo kept > kept.txt")
        sb.stop()
        assert sb.state.value == "stopped"
        assert client.get(sb.id).state.value == "stopped"
        with pytest.raises(DaytonaError):  # a stopped sandbox's toolbox answers nothing
            sb.process.exec("true")
        sb.start()
        assert sb.state.value == "started"
        assert sb.process.exec("cat kept.txt").result == "kept\n"  # its files were kept
        assert sb.get_user_home_dir() == "/home/user" and sb.get_work_dir() == "/home/user"
    finally:
        sb.delete()
    with pytest.raises(DaytonaNotFoundError):
        client.get(sb.id)
    assert [s.id for s in client.list(ListSandboxesQuery(labels={"purpose": name}))] == []


def test_list_pages_and_an_ephemeral_sandbox(server, client):
    made = [client.create(_labels(page="yes")) for _ in range(3)]
    try:
        r = httpx.get(f"{server.url}/api/sandbox", params={"labels": '{"page": "yes"}', "limit": "2"},
                      headers={"Authorization": "Bearer x"}).json()
        assert len(r["items"]) == 2 and r["nextCursor"]
        assert all(i["toolboxProxyUrl"] == f"{server.url}/api/toolbox" for i in r["items"])
        # the SDK follows the cursor: every one, a page of 2 at a time
        assert {s.id for s in client.list(ListSandboxesQuery(labels={"page": "yes"}, limit=2))} == \
            {s.id for s in made}
        eph = client.create(CreateSandboxFromSnapshotParams(labels={"page": "eph"}, auto_delete_interval=0))
        eph.stop()  # an auto-delete interval of 0: deleted at its stop
        with pytest.raises(DaytonaNotFoundError):
            client.get(eph.id)
    finally:
        for s in made:
            s.delete()


# -- process sessions ------------------------------------------------------------------------------

def test_process_sessions(server, sdk):
    client = sdk
    sb = client.create(_labels(purpose="sessions"))
    p = sb.process
    try:
        p.create_session("s1")
        with pytest.raises(DaytonaConflictError):
            p.create_session("s1")
        r = p.execute_session_command("s1", SessionExecuteRequest(
            command="cd /tmp && export X=42 && y=7 && f() { echo fn$1; }"))
        assert r.exit_code == 0
        r = p.execute_session_command("s1", SessionExecuteRequest(command="pwd; echo $X $y; f 1; echo e >&2"))
        assert (r.exit_code, r.stdout, r.stderr) == (0, "/tmp\n42 7\nfn1\n", "e\n")
        assert r.output == "/tmp\n42 7\nfn1\ne\n"
        assert p.execute_session_command("s1", SessionExecuteRequest(command="exit 5")).exit_code == 5
        assert p.execute_session_command("s1", SessionExecuteRequest(command="echo $X")).stdout == "42\n"
        p.execute_session_command("s1", SessionExecuteRequest(command="a=(1 '2 3'); nl=$'x\\ny'; __own=1"))
        r = p.execute_session_command("s1", SessionExecuteRequest(command='echo "${a[1]}|$nl|${__own:-not kept}"'))
        assert r.stdout == "2 3|x\ny|not kept\n"
        p.create_session("s2")  # another session: its own directory and variables
        assert p.execute_session_command("s2", SessionExecuteRequest(command="pwd; echo ${X:-none}")).stdout == \
            "/home/user\nnone\n"

        r = p.execute_session_command("s1", SessionExecuteRequest(
            command="for i in 1 2 3; do echo line $i; sleep 0.2; done; echo bad >&2; exit 2", run_async=True))
        assert r.exit_code is None and p.get_session_command("s1", r.cmd_id).exit_code is None
        out: list[str] = []
        err: list[str] = []
        _follow(p, "s1", r.cmd_id, out, err)
        assert ("".join(out), "".join(err)) == ("line 1\nline 2\nline 3\n", "bad\n")
        assert p.get_session_command("s1", r.cmd_id).exit_code == 2
        logs = p.get_session_command_logs("s1", r.cmd_id)
        assert (logs.stdout, logs.stderr) == ("line 1\nline 2\nline 3\n", "bad\n")

        r = p.execute_session_command("s1", SessionExecuteRequest(command="read a; echo got $a", run_async=True))
        p.send_session_command_input("s1", r.cmd_id, "hello\n")
        for _ in range(100):
            if p.get_session_command("s1", r.cmd_id).exit_code is not None:
                break
            time.sleep(0.05)
        assert p.get_session_command("s1", r.cmd_id).exit_code == 0
        assert p.get_session_command_logs("s1", r.cmd_id).stdout == "hello\ngot hello\n"  # the input echoed
        with pytest.raises(DaytonaError) as e:
            p.send_session_command_input("s1", r.cmd_id, "late\n")
        assert e.value.status_code == 410
        r = p.execute_session_command("s1", SessionExecuteRequest(command="read a; echo $a", run_async=True,
                                                                  suppress_input_echo=True))
        p.send_session_command_input("s1", r.cmd_id, "quiet\n")
        while p.get_session_command("s1", r.cmd_id).exit_code is None:
            time.sleep(0.05)
        assert p.get_session_command_logs("s1", r.cmd_id).stdout == "quiet\n"

        assert sorted(s.session_id for s in p.list_sessions()) == ["s1", "s2"]
        assert [c.command for c in p.get_session("s1").commands][:2] == [
            "cd /tmp && export X=42 && y=7 && f() { echo fn$1; }", "pwd; echo $X $y; f 1; echo e >&2"]
        p.delete_session("s2")
        with pytest.raises(DaytonaNotFoundError):
            p.get_session("s2")
        assert p.get_entrypoint_session().commands == []
    finally:
        sb.delete()


# -- the file system -------------------------------------------------------------------------------

def test_file_system(server, sdk, tmp_path):
    client = sdk
    sb = client.create(_labels(purpose="files"))
    fs = sb.fs
    try:
        fs.upload_file(b"hello", "a.txt")
        local = tmp_path / "local.bin"
        local.write_bytes(b"\x00\xffbin")
        fs.upload_files([FileUpload(b"one", "/home/user/d/1.txt"), FileUpload(b"two", "/tmp/2.txt"),
                         FileUpload(str(local), "d/local.bin")])
        fs.upload_file_stream(io.BytesIO(b"streamed" * 1000), "/tmp/streamed.txt")
        assert fs.download_file("a.txt") == b"hello" and fs.download_file("/tmp/2.txt") == b"two"
        assert fs.download_file("/home/user/d/local.bin") == b"\x00\xffbin"
        assert b"".join(fs.download_file_stream("/tmp/streamed.txt")) == b"streamed" * 1000
        fs.download_file("d/1.txt", str(tmp_path / "got.txt"))
        assert (tmp_path / "got.txt").read_bytes() == b"one"
        got = fs.download_files([FileDownloadRequest(source="d/1.txt"), FileDownloadRequest(source="/nope")])
        assert (got[0].result, got[0].error) == (b"one", None) and got[1].result is None and "/nope" in got[1].error
        with pytest.raises(DaytonaFileNotFoundError):
            fs.download_file("/home/user/none")
        assert sb.process.exec("cat a.txt d/1.txt /tmp/2.txt").result == "helloonetwo"

        listed = {f.name: f for f in fs.list_files("/home/user")}
        assert set(listed) == {"a.txt", "d"} and listed["d"].is_dir and listed["a.txt"].size == 5
        assert sorted(f.path for f in fs.list_files("/home/user", depth=2)) == [
            "/home/user/a.txt", "/home/user/d", "/home/user/d/1.txt", "/home/user/d/local.bin"]
        info = fs.get_file_info("a.txt")
        assert (info.name, info.is_dir, info.size, info.permissions, info.mode) == ("a.txt", False, 5, "0644",
                                                                                     "-rw-r--r--")
        with pytest.raises(DaytonaFileNotFoundError):
            fs.get_file_info("/home/user/none")

        fs.create_folder("newdir/sub", "755")
        fs.create_folder("newdir/sub", "755")  # there already: fine
        fs.create_folder("private", "700")
        assert fs.get_file_info("private").permissions == "0700"
        fs.move_files("a.txt", "newdir/a.txt")
        assert fs.download_file("newdir/a.txt") == b"hello"
        matches = fs.find_files("/home/user", "hel+o")
        assert [(m.file, m.line, m.content) for m in matches] == [("/home/user/newdir/a.txt", 1, "hello")]
        assert fs.find_files("/home/user/d", "[") == []  # not a regular expression: the text itself
        assert sorted(fs.search_files("/home/user", "*.txt").files) == ["/home/user/d/1.txt",
                                                                        "/home/user/newdir/a.txt"]
        results = fs.replace_in_files(["newdir/a.txt", "/tmp/2.txt", "missing.txt"], "l", "L")
        assert [(r.file, r.success) for r in results] == [("newdir/a.txt", True), ("/tmp/2.txt", True),
                                                          ("missing.txt", False)]
        assert fs.download_file("newdir/a.txt") == b"heLLo" and fs.download_file("/tmp/2.txt") == b"two"
        fs.set_file_permissions("newdir/a.txt", mode="600")
        assert fs.get_file_info("newdir/a.txt").permissions == "0600"
        with pytest.raises(DaytonaBadRequestError):
            fs.set_file_permissions("newdir/a.txt", mode="rwx")
        with pytest.raises(DaytonaError):
            fs.delete_file("newdir")  # a directory: recursive only
        fs.delete_file("newdir", recursive=True)
        fs.delete_file("/tmp/2.txt")
        with pytest.raises(DaytonaFileNotFoundError):
            fs.get_file_info("newdir")
        with pytest.raises(DaytonaFileNotFoundError):
            fs.delete_file("/tmp/2.txt")
    finally:
        sb.delete()


def test_file_calls_are_not_answered_by_the_sandboxs_own_code(server, client):
    """A grader's ``find_files`` or ``download_file`` reads what the sandbox's agent reads, never
    what a program the sandbox's code planted (a ``grep`` earlier on the PATH, a shell function)
    answers."""
    sb = client.create(_labels(purpose="trust"))
    try:
        sb.fs.upload_file(b"the real answer\n", "/tmp/result.txt")
        sb.process.create_session("s")
        sb.process.execute_session_command("s", SessionExecuteRequest(
            command="mkdir -p /tmp/bin && printf '#!/bin/sh\\necho forged\\n' > /tmp/bin/grep && chmod +x "
                    "/tmp/bin/grep && cp /tmp/bin/grep /tmp/bin/cat && export PATH=/tmp/bin:$PATH && "
                    "grep() { echo forged; }; cat() { echo forged; }"))
        assert sb.process.execute_session_command("s", SessionExecuteRequest(command="grep x y")).stdout == "forged\n"
        assert sb.fs.download_file("/tmp/result.txt") == b"the real answer\n"
        assert [m.content for m in sb.fs.find_files("/tmp", "real")] == ["the real answer"]
    finally:
        sb.delete()


# -- the async SDK ---------------------------------------------------------------------------------

def test_async_sdk(server):
    async def main():
        async with AsyncDaytona() as d:
            sb = await d.create(CreateSandboxFromSnapshotParams(labels={"purpose": "async"}, env_vars={"A": "1"}))
            try:
                assert (await sb.process.exec("echo $A")).result == "1\n"
                assert (await sb.process.code_run("print(6 * 7)")).result == "42\n"
                await sb.fs.upload_file(b"async", "f.txt")
                assert await sb.fs.download_file("f.txt") == b"async"
                assert [f.name for f in await sb.fs.list_files("/home/user")] == ["f.txt"]
                assert (await sb.fs.get_file_info("f.txt")).size == 5
                await sb.process.create_session("a")
                r = await sb.process.execute_session_command("a", SessionExecuteRequest(
                    command="echo one; sleep 0.3; echo two", run_async=True))
                seen: list[str] = []
                await sb.process.get_session_command_logs_async("a", r.cmd_id, seen.append, seen.append)
                assert "".join(seen) == "one\ntwo\n"
                assert (await sb.process.get_session_command("a", r.cmd_id)).exit_code == 0
                await sb.git.init("repo")
                assert (await sb.git.status("repo")).file_status == []
                assert [s.id async for s in d.list(ListSandboxesQuery(labels={"purpose": "async"}))] == [sb.id]
                await sb.stop()
                assert sb.state.value == "stopped"
                await sb.start()
                assert (await sb.fs.download_file("f.txt")) == b"async"
                with pytest.raises(DaytonaFileNotFoundError):
                    await sb.fs.download_file("none.txt")
            finally:
                await sb.delete()
            with pytest.raises(DaytonaNotFoundError):
                await d.get(sb.id)

    asyncio.run(main())


async def _many(n: int) -> list[float]:
    async with AsyncDaytona() as d:
        async def one(i: int) -> float:
            t = time.perf_counter()
            sb = await d.create(_labels(many=str(i)))
            assert (await sb.process.exec(f"echo {i}")).result == f"{i}\n"
            await sb.fs.upload_file(str(i).encode(), "i")
            assert await sb.fs.download_file("i") == str(i).encode()
            await sb.delete()
            return time.perf_counter() - t

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_concurrent_sandboxes_from_asyncio(server, client):
    assert len(asyncio.run(_many(20))) == 20
    assert list(client.list(ListSandboxesQuery(labels={"many": "3"}))) == []


@pytest.mark.slow
def test_a_hundred_concurrent_sandboxes(server):
    assert len(asyncio.run(_many(100))) == 100


# -- git -------------------------------------------------------------------------------------------

def _host_git(*args: str, cwd=None) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd or "/tmp"), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "host", "GIT_AUTHOR_EMAIL": "host@x", "GIT_COMMITTER_NAME": "host",
           "GIT_COMMITTER_EMAIL": "host@x"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def git_server(tmp_path):
    """A bare repository with two commits on ``main``, served by ``git daemon`` on 127.0.0.1 (push
    enabled)."""
    base = tmp_path / "git"
    work = tmp_path / "work"
    base.mkdir()
    _host_git("init", "-q", "-b", "main", str(work))
    (work / "README.md").write_text("first\n")
    _host_git("add", ".", cwd=work)
    _host_git("commit", "-qm", "first", cwd=work)
    (work / "two.txt").write_text("two\n")
    _host_git("add", ".", cwd=work)
    _host_git("commit", "-qm", "second", cwd=work)
    _host_git("clone", "-q", "--bare", str(work), str(base / "repo.git"))
    from arl_tangram.bench.server import free_port

    port = free_port()
    daemon = subprocess.Popen(["git", "daemon", "--reuseaddr", "--listen=127.0.0.1", f"--port={port}",
                               f"--base-path={base}", "--export-all", "--enable=receive-pack", str(base)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"git://127.0.0.1:{port}/repo.git", base / "repo.git", work
    daemon.terminate()
    daemon.wait(10)


def test_git_against_a_loopback_git_server(server, sdk, git_server):
    client = sdk
    url, bare, work = git_server
    sb = client.create(_labels(purpose="git"))
    g = sb.git
    try:
        g.clone(url, "repo")
        assert sb.process.exec("cat repo/README.md repo/two.txt").result == "first\ntwo\n"
        assert sb.process.exec("git -C repo remote get-url origin").result == url + "\n"
        st = g.status("repo")
        assert (st.current_branch, st.file_status, st.branch_published) == ("main", [], True)
        branches = g.branches("repo")
        assert (branches.branches, branches.current) == (["main"], "main")

        sb.fs.upload_file(b"new\n", "repo/new.txt")
        sb.fs.upload_file(b"changed\n", "repo/README.md")
        st = g.status("repo")
        assert {(f.name, f.staging.value, f.worktree.value) for f in st.file_status} == {
            ("new.txt", "Untracked", "Untracked"), ("README.md", "Unmodified", "Modified")}
        g.add("repo", ["."])
        assert {(f.name, f.staging.value) for f in g.status("repo").file_status} == {("new.txt", "Added"),
                                                                                      ("README.md", "Modified")}
        sha = g.commit("repo", "from the sandbox", "Agent", "agent@example.com").sha
        assert len(sha) == 40 and g.status("repo").ahead == 1
        assert sb.process.exec("git -C repo log -1 --format='%an <%ae> %s'").result == \
            "Agent <agent@example.com> from the sandbox\n"
        with pytest.raises(DaytonaError):
            g.commit("repo", "nothing to commit", "Agent", "agent@example.com")
        g.commit("repo", "empty", "Agent", "agent@example.com", allow_empty=True)

        g.push("repo")  # through the server: the sandbox has no network
        assert _host_git("--git-dir", str(bare), "log", "-1", "--format=%s", "main") == "empty\n"
        assert g.status("repo").ahead == 0

        _host_git("pull", "-q", str(bare), "main", cwd=work)  # the host's clone moves on: the sandbox pulls
        (work / "host.txt").write_text("from the host\n")
        _host_git("add", ".", cwd=work)
        _host_git("commit", "-qm", "host", cwd=work)
        _host_git("push", "-q", str(bare), "main", cwd=work)
        g.pull("repo")
        assert sb.fs.download_file("repo/host.txt") == b"from the host\n"

        g.create_branch("repo", "feature")
        assert g.branches("repo").current == "feature"
        with pytest.raises(DaytonaConflictError):
            g.create_branch("repo", "feature")
        g.checkout_branch("repo", "main")
        assert g.status("repo").current_branch == "main"
        with pytest.raises(DaytonaNotFoundError):
            g.checkout_branch("repo", "no-such-branch")
        g.delete_branch("repo", "feature")
        assert g.branches("repo").branches == ["main"]
        with pytest.raises(DaytonaNotFoundError):
            g.status("not-a-repo")

        # a path in the sandbox: its own git, no server in between
        g.clone("/home/user/repo", "copy", branch="main")
        assert sb.fs.download_file("copy/host.txt") == b"from the host\n"
        sb.fs.upload_file(b"local\n", "copy/local.txt")
        g.add("copy", ["local.txt"])
        g.commit("copy", "local", "Agent", "agent@example.com")
        sb.process.exec("git -C repo checkout -q -b side")  # (a non-bare remote takes no push to its checkout)
        g.push("copy")
        assert sb.process.exec("git -C repo log -1 --format=%s main").result == "local\n"
        with pytest.raises(DaytonaError):
            g.clone("ssh://git@127.0.0.1/x.git", "nope")
    finally:
        sb.delete()


# -- snapshots, fork -------------------------------------------------------------------------------

def test_snapshots_and_fork(server, sdk):
    client = sdk
    sb = client.create(_labels(purpose="snap", job="snapjob"))
    made = []
    try:
        sb.fs.upload_file(b"state one", "state.txt")
        snap_name = f"snap-{uuid.uuid4().hex[:8]}"
        sb.create_snapshot(snap_name)
        assert sb.state.value == "started"
        snap = client.snapshot.get(snap_name)
        assert (snap.name, snap.state.value, snap.source_sandbox_id) == (snap_name, "active", sb.id)
        assert snap_name in [s.name for s in client.snapshot.list().items]
        with pytest.raises(DaytonaConflictError):
            sb.create_snapshot(snap_name)
        sb.fs.upload_file(b"state two", "state.txt")
        from_snap = client.create(CreateSandboxFromSnapshotParams(snapshot=snap_name, labels={"job": "snapjob"}))
        made.append(from_snap)
        assert from_snap.snapshot == snap_name
        assert from_snap.fs.download_file("state.txt") == b"state one"
        with pytest.raises(DaytonaNotFoundError):
            client.create(CreateSandboxFromSnapshotParams(snapshot="no-such-snapshot"))

        child = sb.fork(name="the-child")
        made.append(child)
        assert child.name == "the-child" and child.labels["purpose"] == "snap" and child.state.value == "started"
        assert child.fs.download_file("state.txt") == b"state two"
        child.fs.upload_file(b"child's", "state.txt")
        assert sb.fs.download_file("state.txt") == b"state two"  # copy-on-write: the source is untouched

        client.snapshot.delete(snap_name)
        with pytest.raises(DaytonaNotFoundError):
            client.snapshot.get(snap_name)
    finally:
        for s in made:
            s.delete()
        sb.delete()


@pytest.mark.skipif(os.geteuid() != 0, reason="image sandboxes mount overlays: root only")
def test_an_imported_image_resources_and_a_snapshot_of_it(tmp_path):
    from arl_tangram.managers.sandbox.images import ImageStore

    from imagekit import docker_archive, host_tools

    tools = [shutil.which(t) for t in ("bash", "cat", "mkdir", "ls", "env", "sleep")]
    store = ImageStore(tmp_path / "store")
    layer = host_tools(*tools) + [("symlink", "usr/bin/sh", "bash"), ("file", "etc/motd", "from the image\n"),
                                  ("dir", "home/user", 0o755)]
    store.import_path(docker_archive(tmp_path / "img.tar", [layer]), "tiny-daytona")
    srv = Server(tmp_path, config={"sandbox": {"image_store": str(store.root), "warm_pool": 0}})
    saved = _point_sdk_at(srv.url)
    try:
        d = Daytona()
        sb = d.create(CreateSandboxFromImageParams(image="tiny-daytona", resources=Resources(cpu=1, memory=1)))
        assert (sb.cpu, sb.memory) == (1, 1)
        assert sb.process.exec("cat /etc/motd; pwd").result == "from the image\n/home/user\n"
        # the memory asked for is each command's bound: 1 GiB holds 300 MB, 400 MB is over 0.5 GiB
        r = sb.process.code_run("b = bytearray(300 << 20); print(len(b) >> 20)")
        assert (r.exit_code, r.result) == (0, "300\n")
        with pytest.raises(DaytonaBadRequestError):
            d.create(CreateSandboxFromImageParams(image="tiny-daytona", resources=Resources(memory=100_000)))
        with pytest.raises(DaytonaBadRequestError):
            d.create(CreateSandboxFromImageParams(image="../not-an-image-name"))
        with pytest.raises(DaytonaBadRequestError):  # anything to build: refused, saying why
            d.create(CreateSandboxFromImageParams(image=daytona.Image.base("tiny-daytona").pip_install("numpy")))
        d.snapshot.create(CreateSnapshotParams(name="tiny-snap", image="tiny-daytona"))
        other = d.create(CreateSandboxFromSnapshotParams(snapshot="tiny-snap"))
        assert other.process.exec("cat /etc/motd").result == "from the image\n"
        sb.fs.upload_file(b"s1", "state.txt")
        sb.create_snapshot("tiny-state")
        restored = d.create(CreateSandboxFromSnapshotParams(snapshot="tiny-state"))
        assert restored.process.exec("cat state.txt /etc/motd").result == "s1from the image\n"
        [child] = [sb.fork()]
        assert child.process.exec("cat state.txt").result == "s1"
        for s in (sb, other, restored, child):
            s.delete()
    finally:
        _restore(saved)
        srv.stop()


# -- keys and tenancy, errors ----------------------------------------------------------------------

KEY_A, KEY_B = "dtn_" + "a" * 40, "dtn_" + "b" * 40


def _keyed_server(tmp_path, args: tuple[str, ...] = ()) -> Server:
    return Server(tmp_path, config={"api_keys": [{"key": KEY_A, "job": "job-a"}, {"key": KEY_B, "job": "job-b"}]},
                  token="admin-token-0123456789", args=args)


def _check_keys_scope_jobs(srv: Server) -> None:
    url = f"{srv.url}/api"
    a = Daytona(DaytonaConfig(api_key=KEY_A, api_url=url))
    b = Daytona(DaytonaConfig(api_key=KEY_B, api_url=url))
    with pytest.raises(DaytonaAuthenticationError):
        Daytona(DaytonaConfig(api_key="dtn_" + "c" * 40, api_url=url)).create()
    sa = a.create(_labels(who="a"))
    sb = b.create(_labels(who="b"))
    try:
        assert sa.labels.get("job") is None and sa.organization_id == "job-a"
        assert [s.id for s in a.list()] == [sa.id] and [s.id for s in b.list()] == [sb.id]
        with pytest.raises(DaytonaNotFoundError):
            a.get(sb.id)  # with A's key: B's sandbox does not exist
        r = httpx.post(f"{url}/toolbox/{sb.id}/process/execute", json={"command": "echo hi"},
                       headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 404 and r.json()["statusCode"] == 404
        r = httpx.post(f"{url}/toolbox/{sb.id}/process/execute", json={"command": "echo hi"})  # no key at all
        assert r.status_code == 401 and r.json()["statusCode"] == 401
        r = httpx.delete(f"{url}/sandbox/{sb.id}", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 404
        assert sb.process.exec("echo still b").result == "still b\n"  # untouched
        with pytest.raises(DaytonaForbiddenError):  # labels naming another job than the key's
            a.create(_labels(job="job-b"))
        admin = httpx.get(f"{url}/sandbox", headers={"Authorization": "Bearer admin-token-0123456789"}).json()
        assert {sa.id, sb.id} <= {i["id"] for i in admin["items"]}  # the token sees every job
        jobs = httpx.get(f"{srv.url}/v1/jobs", headers={"Authorization": f"Bearer {KEY_B}"}).json()
        assert {j["job"] for j in jobs} == {"job-b"}  # B's command was B's job
    finally:
        sa.delete()
        sb.delete()


def test_api_keys_tie_sandboxes_to_jobs(tmp_path):
    srv = _keyed_server(tmp_path)
    try:
        _check_keys_scope_jobs(srv)
    finally:
        srv.stop()


@pytest.mark.slow
def test_through_http_fronts(tmp_path):
    srv = _keyed_server(tmp_path, ("--fronts", "2"))
    try:
        _check_keys_scope_jobs(srv)
        d = Daytona(DaytonaConfig(api_key=KEY_A, api_url=f"{srv.url}/api"))
        sb = d.create()
        sb.process.create_session("s")
        r = sb.process.execute_session_command("s", SessionExecuteRequest(command="echo a; sleep 0.3; echo b",
                                                                          run_async=True))
        seen: list[str] = []
        asyncio.run(sb.process.get_session_command_logs_async("s", r.cmd_id, seen.append, seen.append))
        assert "".join(seen) == "a\nb\n"
        assert sb.process.code_run("print(1)").result == "1\n"
        sb.fs.upload_file(b"via fronts", "f")
        assert sb.fs.download_file("f") == b"via fronts"
        for _ in range(100):  # the event connection through a front's link too
            if d._event_dispatcher.is_connected:
                break
            time.sleep(0.05)
        assert d._event_dispatcher.is_connected
        sb.delete()
    finally:
        srv.stop()


def test_errors_in_daytona_shape(server, client):
    h = {"Authorization": "Bearer x"}
    r = httpx.get(f"{server.url}/api/sandbox/no-such-sandbox", headers=h)
    assert r.status_code == 404 and r.json()["statusCode"] == 404 and r.json()["source"] == "DAYTONA_API"
    r = httpx.get(f"{server.url}/api/no-such-route", headers=h)  # a routing 404, in Daytona's shape
    assert r.status_code == 404 and r.json()["statusCode"] == 404 and "message" in r.json()
    r = httpx.put(f"{server.url}/api/sandbox", headers=h)  # a known path, another method: 405, its shape too
    assert r.status_code == 405 and r.json()["statusCode"] == 405 and "POST" in r.headers["allow"]
    r = httpx.get(f"{server.url}/api", headers=h)  # not under /api/: not the dialect's
    assert r.status_code == 404 and "statusCode" not in r.json()
    r = httpx.post(f"{server.url}/api/sandbox", content=b"[1]", headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["message"]
    r = httpx.post(f"{server.url}/api/sandbox", json={"cpu": "many"}, headers=h)
    assert r.status_code == 400 and r.json()["message"].startswith("cpu")
    r = httpx.post(f"{server.url}/api/sandbox", json={"volumes": [{"volumeId": "v", "mountPath": "/v"}]}, headers=h)
    assert r.status_code == 400 and "volumes" in r.json()["message"]
    sb = client.create(_labels(purpose="errors"))
    try:
        r = httpx.get(f"{server.url}/api/toolbox/{sb.id}/files/info", params={"path": "/nope"}, headers=h)
        assert r.status_code == 404 and (r.json()["code"], r.json()["source"]) == ("FILE_NOT_FOUND", "DAYTONA_DAEMON")
        with pytest.raises(DaytonaError) as e:  # no PTY here: said so, in the SDK's terms
            sb.process.create_pty_session("pty", on_data=lambda b: None)
        assert "WebSocket" in str(e.value) or "PTY" in str(e.value)
        r = httpx.post(f"{server.url}/api/toolbox/{sb.id}/process/pty", json={"id": "x"}, headers=h)
        assert r.status_code == 501 and "PTY" in r.json()["message"]
        with pytest.raises(DaytonaNotFoundError):
            sb.process.get_session_command("nope", "nope")
    finally:
        sb.delete()


def test_past_capacity_a_clear_refusal(tmp_path):
    """A sandbox the server has no room for is refused at once (503, saying which limit), never
    left to hang."""
    srv = Server(tmp_path, config={"sandbox": {"min_free_memory_mb": 10 ** 8, "warm_pool": 0}})
    try:
        d = Daytona(DaytonaConfig(api_key="x", api_url=f"{srv.url}/api"))
        t = time.monotonic()
        with pytest.raises(daytona.DaytonaError) as e:
            d.create()
        assert e.value.status_code == 503 and "memory" in str(e.value) and time.monotonic() - t < 10
    finally:
        srv.stop()


# -- the event connection --------------------------------------------------------------------------

def test_the_event_connection_and_the_sdk_without_it(server):
    async def main():
        async with AsyncDaytona() as d:
            watched = await d.create(_labels(purpose="events"))
            for _ in range(100):
                if d._event_dispatcher.is_connected:
                    break
                await asyncio.sleep(0.05)
            assert d._event_dispatcher.is_connected  # served: Socket.IO over a WebSocket at /api/socket.io/
            async with AsyncDaytona() as other:
                await (await other.get(watched.id)).stop()  # another client stops it
            for _ in range(100):  # the watching object hears it without asking
                if watched.state.value == "stopped":
                    break
                await asyncio.sleep(0.05)
            assert watched.state.value == "stopped"
            await watched.delete()
        async with AsyncDaytona() as d:  # refused (a path no server answers): the SDK polls, and works
            d._event_dispatcher._api_url = f"{server.url}/no-events/api"
            sb = await d.create(_labels(purpose="no-events"))
            await asyncio.sleep(0.5)
            assert not d._event_dispatcher.is_connected and d._event_dispatcher.is_failed
            assert (await sb.process.exec("echo fine")).result == "fine\n"
            await sb.stop()
            await sb.start()
            assert sb.state.value == "started"
            await sb.delete()
        r = httpx.get(f"{server.url}/api/socket.io/", params={"EIO": "4", "transport": "polling"},
                      headers={"Authorization": "Bearer x"})
        assert r.status_code in (400, 404)

    asyncio.run(main())


# -- containment: model-written code run as Daytona commands ---------------------------------------

def test_containment_as_daytona_commands(server, client, tmp_path):
    marker = tmp_path / "host-secret.txt"
    marker.write_text("host secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    a, b = client.create(_labels(purpose="contain")), client.create(_labels(purpose="contain"))
    try:
        a.fs.upload_file(b"only a's", "mine.txt")
        a.process.exec("echo a-tmp > /tmp/a-tmp.txt")
        r = b.process.exec(f"cat {marker}; ls /home/user /tmp; cat /proc/1/environ | tr '\\0' '\\n'; env")
        assert "host secret" not in r.result and "mine.txt" not in r.result and "a-tmp" not in r.result
        assert SERVER_SECRET not in r.result and "DAYTONA_API_KEY" not in r.result
        net = b.process.code_run(f"import socket\nfor addr in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
                                 "    try:\n        socket.create_connection(addr, 2); print('CONNECTED')\n"
                                 "    except OSError:\n        print('blocked')")
        assert net.result == "blocked\nblocked\n"
        assert b.process.exec("touch /usr/x 2>&1 || echo ro").result.strip().endswith("ro")
        # memory: the server's bound on each command (512 MB by default) ends a hog, the sandbox lives on
        r = b.process.code_run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", timeout=30)
        assert r.exit_code != 0
        try:
            bomb = b.process.exec("f() { f | f & }; f; sleep 1; echo survived", timeout=5)
            assert "survived" in bomb.result or bomb.exit_code != 0
        except DaytonaProcessExecutionTimeoutError:
            pass  # on a loaded host the bomb can hold the sandbox's core past 5 s: killed, as any timeout
        assert b.process.exec("echo alive").result == "alive\n"
        assert subprocess.run(["true"]).returncode == 0
    finally:
        listener.close()
        a.delete()
        b.delete()


@pytest.mark.slow
def test_auto_stop_after_its_interval(server, client):
    sb = client.create(CreateSandboxFromSnapshotParams(labels={"purpose": "autostop"}, auto_stop_interval=1))
    try:
        sb.fs.upload_file(b"kept", "k")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and client.get(sb.id).state.value != "stopped":
            time.sleep(1)
        assert client.get(sb.id).state.value == "stopped"
        sb.start()
        assert sb.fs.download_file("k") == b"kept"
    finally:
        sb.delete()


@pytest.mark.slow
def test_bench_daytona_prints_its_figures():
    from arl_tangram.bench.daytona import run

    out = run(3, 4, open_concurrency=2)
    assert (out["open_at_once"]["open"], out["open_at_once"]["errors"]) == (4, [])
    figures = out["side_by_side"]
    assert set(figures) == {"create_and_first_exec", "exec_true", "code_run", "exec_bin_true", "session_command"}
    for k, sides in figures.items():  # each beside the SDK's floor and the native API, as ratios
        assert all(sides[s]["n"] == 3 and sides[s]["p50_ms"] > 0 for s in ("daytona", "floor", "native")), k
        assert sides["vs_floor"] > 0 and sides["vs_native"] > 0
        row = out["summary"][k]  # the same p50s, beside the target where there is one
        assert all(row[s] == sides[s]["p50_ms"] for s in ("daytona", "floor", "native")), k
        assert ("met" in row) == (sides.get("target_ms") is not None), k
        if "met" in row:
            assert row["met"] == (row["daytona"] <= row["target_ms"]), k
