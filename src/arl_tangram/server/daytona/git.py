"""The toolbox's ``/git`` calls: git run in the sandbox, as a command of its session, and a
remote's transfers carried out by the server.

Sandboxes have no network here, so a repository on a git server is fetched by the server itself
(``git clone --bare`` on the host, in a temporary directory of its own) and handed to the sandbox
as a bundle, which the sandbox's git clones or fetches from; a push goes the other way: the
sandbox's git bundles the branch, the server pushes it. The server reaches only the URL a
``clone`` named (http, https or git; its credentials kept here, never in the sandbox): a remote
the sandbox's code set is never fetched by the server. A repository cloned from a path in the
sandbox, and its pulls and pushes, are the sandbox's git alone.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import tempfile
import urllib.parse
import uuid
from typing import Any

from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.spec import FsCall
from ..service import Service
from .errors import DaytonaApiError, daemon
from .files import read, write
from .process import Using, abs_path, ran, step
from .sandboxes import Box

#: schemes the server fetches and pushes for a sandbox (ssh needs keys the server does not hold)
NETWORK = ("http", "https", "git")
#: the longest one transfer or one git command runs
GIT_TIMEOUT_S = 300.0
#: git's own messages, as the daemon's error codes
ERRORS = (("not a git repository", 404, "GIT_REPO_NOT_FOUND"),
          ("cannot change to", 404, "GIT_REPO_NOT_FOUND"),
          ("Authentication failed", 401, "GIT_AUTH_FAILED"),
          ("could not read Username", 401, "GIT_AUTH_FAILED"),
          ("already exists", 409, "GIT_BRANCH_EXISTS"),
          ("did not match any", 404, "GIT_BRANCH_NOT_FOUND"),
          ("invalid reference", 404, "GIT_BRANCH_NOT_FOUND"),
          ("not something we can merge", 404, "GIT_BRANCH_NOT_FOUND"),
          ("Remote branch", 404, "GIT_BRANCH_NOT_FOUND"),
          ("would be overwritten", 409, "GIT_DIRTY_WORKTREE"),
          ("CONFLICT", 409, "GIT_MERGE_CONFLICT"),
          ("[rejected]", 409, "GIT_PUSH_REJECTED"),
          ("[remote rejected]", 422, "GIT_REMOTE_REJECTED"),
          ("does not appear to be a git repository", 404, "GIT_REPO_NOT_FOUND"),
          ("not found", 404, "GIT_REPO_NOT_FOUND"),
          ("Could not resolve host", 502, "GIT_TRANSPORT_FAILED"),
          ("unable to access", 502, "GIT_TRANSPORT_FAILED"),
          ("unable to connect", 502, "GIT_TRANSPORT_FAILED"),
          ("Connection refused", 502, "GIT_TRANSPORT_FAILED"))
#: porcelain v2's status letters as Daytona's ``Status``
STATUS = {".": "Unmodified", "M": "Modified", "T": "Modified", "A": "Added", "D": "Deleted", "R": "Renamed",
          "C": "Copied", "U": "Updated but unmerged", "?": "Untracked"}


def _error(text: str, default: int = 400, secret: str | None = None) -> DaytonaApiError:
    text = text.strip() or "git failed"
    if secret:  # as given, and as it is written in a URL
        text = text.replace(secret, "***").replace(urllib.parse.quote(secret, safe=""), "***")
    for needle, status, code in ERRORS:
        if needle in text:
            return daemon(status, text[-2000:], code)
    return daemon(default, text[-2000:])


async def _git(service: Service, box: Box, s: Any, script: str, op: str) -> str:
    """``script`` (git commands) in the sandbox: its stdout, or its failure as the daemon's
    error."""
    r = await step(service, box, s, f"( export GIT_TERMINAL_PROMPT=0 && {script} )", GIT_TIMEOUT_S, f"git {op}")
    code, out, err = ran(r, box.id)
    if code != 0:
        raise _error(err or out)
    return out


def _remote(url: Any, username: Any, password: Any) -> tuple[str, str | None]:
    """(the URL the server reaches, credentials in it; the URL the sandbox's repository shows)
    for a network remote, or (url, None) for a path in the sandbox."""
    if not isinstance(url, str) or not url or url.startswith("-") or "\0" in url:
        raise daemon(400, "url: a repository URL or a path in the sandbox is expected")
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or url.startswith("file:") or (len(parts.scheme) == 1 and url[1:2] == ":"):
        return url, None
    if parts.scheme not in NETWORK:
        raise daemon(400, f"url: {parts.scheme}:// is not one this server fetches (http, https, git, or a path in "
                          "the sandbox)")
    host = parts.netloc.rsplit("@", 1)[-1]
    shown = urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    if username or password:
        if not all(isinstance(x, (str, type(None))) for x in (username, password)):
            raise daemon(400, "username, password: strings are expected")
        auth = urllib.parse.quote(username or "git", safe="") + (":" + urllib.parse.quote(password, safe="")
                                                                  if password else "")
        return urllib.parse.urlunsplit((parts.scheme, f"{auth}@{host}", parts.path, parts.query, parts.fragment)), shown
    return url, shown


def _host_env(home: str, network: bool) -> dict[str, str]:
    """The host git's environment: none of the server's own (its secrets stay), no prompts, no
    system or user configuration; a command that reaches a remote may use only the network
    protocols (never a path of the host), one that reads a bundle only files."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_ALLOW_PROTOCOL": ":".join(NETWORK) if network else "file"}


async def _host(args: list[str], tmp: str, secret: str | None, insecure: bool = False,
                network: bool = True) -> str:
    """``git args`` on the host (in a thread: a git transfer is seconds of waiting, not the event
    loop's); its failure as the daemon's error, the credentials masked."""
    argv = ["git", "-c", "transfer.fsckObjects=true"] + (["-c", "http.sslVerify=false"] if insecure else []) + args
    try:
        p = await asyncio.to_thread(subprocess.run, argv, cwd=tmp, env=_host_env(tmp, network), capture_output=True,
                                    timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise daemon(502, f"git {args[0]}: no answer from the remote within {GIT_TIMEOUT_S:.0f} s",
                     "GIT_TRANSPORT_FAILED") from None
    except FileNotFoundError:
        raise daemon(503, "git is not installed on the server") from None
    if p.returncode != 0:
        raise _error(p.stderr.decode(errors="replace"), 502, secret)
    return p.stdout.decode(errors="replace")


async def _fetched(remote: dict, branch: str | None = None) -> bytes:
    """The remote's repository, fetched on the host, as a bundle of all its branches."""
    tmp = tempfile.mkdtemp(prefix="tangram-git-")
    try:
        args = ["clone", "--bare", "--quiet"] + (["--branch", branch] if branch else []) + ["--", remote["fetch"],
                                                                                              "repo.git"]
        await _host(args, tmp, remote.get("password"), remote.get("insecure", False))
        await _host(["-C", "repo.git", "bundle", "create", "--quiet", "../all.bundle", "--all"], tmp, None,
                    network=False)
        with open(os.path.join(tmp, "all.bundle"), "rb") as fh:
            return fh.read()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _push(remote: dict, bundle: bytes, branch: str) -> None:
    tmp = tempfile.mkdtemp(prefix="tangram-git-")
    try:
        with open(os.path.join(tmp, "b.bundle"), "wb") as fh:
            fh.write(bundle)
        await _host(["init", "--bare", "--quiet", "repo.git"], tmp, None, network=False)
        ref = f"refs/heads/{branch}"
        await _host(["-C", "repo.git", "fetch", "--quiet", "../b.bundle", f"{ref}:{ref}"], tmp, None, network=False)
        await _host(["-C", "repo.git", "push", "--quiet", "--", remote["fetch"], f"{ref}:{ref}"], tmp,
                    remote.get("password"), remote.get("insecure", False))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _branch(value: Any, name: str = "branch") -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value.startswith("-") or any(c in value for c in " \t\n~^:?*[\\\0"):
        raise daemon(400, f"{name}: a branch name is expected, got {value!r}")
    return value


def _status(out: str) -> dict:
    """``git status --porcelain=v2 --branch -z`` as Daytona's ``GitStatus``."""
    head, upstream, ahead, behind, files = "", None, 0, 0, []
    items = out.split("\0")
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if item.startswith("# branch.head "):
            head = item[14:]
        elif item.startswith("# branch.upstream "):
            upstream = item[18:]
        elif item.startswith("# branch.ab "):
            a, b = item[12:].split()
            ahead, behind = int(a), -int(b)
        elif item[:2] in ("1 ", "2 ", "u "):
            fields = item.split(" ", {"1": 8, "2": 9, "u": 10}[item[0]])
            xy = fields[1]
            if item[0] == "2":
                i += 1  # its original path
            files.append({"name": fields[-1], "staging": STATUS.get(xy[0], "Modified"),
                          "worktree": STATUS.get(xy[1], "Modified"), "extra": ""})
        elif item.startswith("? "):
            files.append({"name": item[2:], "staging": "Untracked", "worktree": "Untracked", "extra": ""})
    detached = head == "(detached)"
    return {"currentBranch": "" if detached else head, "fileStatus": files, "ahead": ahead, "behind": behind,
            "branchPublished": upstream is not None, "upstream": upstream or "", "detached": detached}


def _q(x: str) -> str:
    return shlex.quote(x)


async def daytona_git(service: Service, sid: str, op: str, args: dict) -> Any:
    """One git call: ``clone``, ``status``, ``add``, ``commit``, ``branches``, ``checkout``,
    ``create_branch``, ``delete_branch``, ``init``, ``pull``, ``push``."""
    async with Using(service, sid) as (box, s):
        path = abs_path(args.get("path") or HOME_ALIAS)
        p = _q(path)
        if op == "clone":
            return await _clone(service, box, s, path, args)
        if op == "status":
            return _status(await _git(service, box, s, f"git -C {p} status --porcelain=v2 --branch -z", op))
        if op == "add":
            files = args.get("files") or []
            if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
                raise daemon(400, "files: a list of paths is expected (. for all)")
            await _git(service, box, s, f"git -C {p} add -- {' '.join(_q(f) for f in files)}", op)
            return None
        if op == "commit":
            message, author, email = args.get("message"), args.get("author"), args.get("email")
            if not all(isinstance(x, str) and x for x in (message, author, email)):
                raise daemon(400, "message, author, email: strings are expected")
            out = await _git(service, box, s, f"git -C {p} -c user.name={_q(author)} -c user.email={_q(email)} commit "
                                              f"--quiet {'--allow-empty ' if args.get('allow_empty') else ''}"
                                              f"-m {_q(message)} && git -C {p} rev-parse HEAD", op)
            return {"hash": out.strip().splitlines()[-1]}
        if op == "branches":
            out = await _git(service, box, s, f"git -C {p} branch --show-current && git -C {p} for-each-ref "
                                              "--format='%(refname:short)' refs/heads", op)
            lines = out.splitlines()
            return {"current": lines[0] if lines else "", "branches": lines[1:]}
        if op in ("checkout", "create_branch", "delete_branch"):
            name = _branch(args.get("branch") if op == "checkout" else args.get("name"), "name")
            if name is None:
                raise daemon(400, "a branch name is expected")
            verb = {"checkout": "checkout --quiet", "create_branch": "checkout --quiet -b",
                    "delete_branch": "branch -D"}[op]
            await _git(service, box, s, f"git -C {p} {verb} {_q(name)}", op)
            return None
        if op == "init":
            initial = _branch(args.get("initial_branch"))
            await _git(service, box, s, f"git init --quiet {'--bare ' if args.get('bare') else ''}"
                                        f"{'-b ' + _q(initial) + ' ' if initial else ''}-- {p}", op)
            return None
        if op in ("pull", "push"):
            return await _sync(service, box, s, path, op, args)
    raise daemon(400, f"git: no operation {op!r}")


def _bundle_name() -> tuple[str, str]:
    name = f".tangram-git-{uuid.uuid4().hex}.bundle"
    return name, f"{HOME_ALIAS}/{name}"


async def _clone(service: Service, box: Box, s: Any, path: str, args: dict) -> None:
    fetch, shown = _remote(args.get("url"), args.get("username"), args.get("password"))
    branch = _branch(args.get("branch"))
    commit = args.get("commit_id")
    if commit is not None and (not isinstance(commit, str) or not commit.isalnum()):
        raise daemon(400, "commit_id: a commit's hash is expected")
    then = f" && git -C {_q(path)} checkout --quiet {_q(commit)}" if commit else ""
    b = f"--branch {_q(branch)} " if branch else ""
    if shown is None:  # a path in the sandbox: its own git
        src = fetch if "://" in fetch else abs_path(fetch, "url")
        depth = args.get("depth")
        d = ""
        if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0:
            d, src = f"--depth {depth} ", src if "://" in src else "file://" + src  # (a plain path ignores --depth)
        await _git(service, box, s, f"git clone --quiet {b}{d}-- {_q(src)} {_q(path)}{then}", "clone")
        return
    remote = {"fetch": fetch, "url": shown,
              "password": args.get("password") or urllib.parse.unquote(urllib.parse.urlsplit(fetch).password or "")
              or None,
              "insecure": bool(args.get("insecure_skip_tls"))}
    bundle = await _fetched(remote, branch)
    name, full = _bundle_name()
    await write(s, box, [(full, bundle)])
    await _git(service, box, s, f"git clone --quiet {b}-- {_q(full)} {_q(path)} && git -C {_q(path)} remote set-url "
                                f"origin {_q(shown)}{then}; rc=$?; rm -f {_q(full)}; exit $rc", "clone")
    box.remotes[path] = {"origin": remote}


async def _sync(service: Service, box: Box, s: Any, path: str, op: str, args: dict) -> None:
    """``pull`` and ``push``: through the server for a remote a clone named, else the
    sandbox's git."""
    name = args.get("remote") or "origin"
    branch = _branch(args.get("branch"))
    p = _q(path)
    current = f"$(git -C {p} branch --show-current)"
    br = _q(branch) if branch else current
    remote = box.remotes.get(path, {}).get(name)
    if remote is not None and (args.get("username") or args.get("password")):
        fetch, _ = _remote(remote["url"], args.get("username"), args.get("password"))
        remote = {**remote, "fetch": fetch, "password": args.get("password") or remote.get("password")}
    if remote is None:  # a remote of the sandbox's own (a path): its git alone
        if op == "pull":
            await _git(service, box, s, f"git -C {p} pull --quiet --no-rebase --no-edit {_q(name)} "
                                        f"{br if branch else ''}", op)
        else:
            up = "--set-upstream " if args.get("set_upstream") else ""
            await _git(service, box, s, f"git -C {p} push --quiet {up}{_q(name)} {br}", op)
        return
    bundle_name, full = _bundle_name()
    ident = (f"-c user.name=\"$(git -C {p} config user.name || echo {_q('user')})\" "
             f"-c user.email=\"$(git -C {p} config user.email || echo user@localhost)\"")
    if op == "pull":
        await write(s, box, [(full, await _fetched(remote))])
        await _git(service, box, s, f"git -C {p} fetch --quiet {_q(full)} '+refs/heads/*:refs/remotes/{name}/*' && "
                                    f"git -C {p} {ident} merge --quiet --no-edit {_q(name)}/{br}; rc=$?; "
                                    f"rm -f {_q(full)}; exit $rc", op)
        return
    out = await _git(service, box, s, f"b={br} && git -C {p} bundle create --quiet {_q(full)} \"refs/heads/$b\" && "
                                      f"echo \"$b\" && git -C {p} rev-parse \"refs/heads/$b\"", op)
    pushed, sha = out.split()[-2:]
    try:
        got = await read(s, box, [full])
    finally:
        await s.fs(FsCall("remove", full))
    data = got.get(full)
    if not isinstance(data, bytes):
        raise data if isinstance(data, DaytonaApiError) else daemon(500, "push: the bundle could not be read")
    await _push(remote, data, pushed)
    up = f" && git -C {p} branch --quiet --set-upstream-to={_q(name)}/{_q(pushed)} {_q(pushed)}" \
        if args.get("set_upstream") else ""
    await _git(service, box, s, f"git -C {p} update-ref refs/remotes/{_q(name)}/{_q(pushed)} {_q(sha)}{up}", op)


CALLS = {"daytona_git": daytona_git}
