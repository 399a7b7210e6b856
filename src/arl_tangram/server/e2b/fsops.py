"""envd's filesystem calls (Stat, ListDir, MakeDir, Remove, Move), carried out inside the sandbox.

Each is one python step of the sandbox's session that runs ``HELPER`` (standard library only)
in a namespace of its own, inside the sandbox: it sees exactly what the sandbox's own commands
see, whatever the path (the workspace, ``/tmp``), and nothing else, and needs no python in the
image (the step runs in the sandbox's agent) and no process start. The session's own python
variables are untouched. It prints one JSON object: the answer, or ``{"error": [connect code,
message]}``; only that line is read, as data.
"""

from __future__ import annotations

import json

HELPER = r'''
import json, os, stat, sys, shutil, datetime
op, args = OP, json.loads(ARGS)
class Done(Exception):
    pass
def say(value):
    sys.stdout.write("\n" + json.dumps(value) + "\n")
    sys.stdout.flush()
KINDS = {stat.S_IFREG: "FILE_TYPE_FILE", stat.S_IFDIR: "FILE_TYPE_DIRECTORY", stat.S_IFLNK: "FILE_TYPE_SYMLINK"}
def entry(path):
    st = os.lstat(path)
    link = stat.S_ISLNK(st.st_mode)
    target = None
    if link:
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError:
            pass
    when = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
    out = {"name": os.path.basename(path.rstrip("/")) or "/", "type": KINDS.get(stat.S_IFMT(st.st_mode),
           "FILE_TYPE_UNSPECIFIED"), "path": path, "size": str(st.st_size), "mode": stat.S_IMODE(st.st_mode),
           "permissions": stat.filemode(st.st_mode), "owner": "user", "group": "user",
           "modifiedTime": when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    if link:  # as envd 0.6 marks a link (the SDK then types it SYMLINK, a dangling one included:
        out["symlinkTarget"] = target  # without the mark, its unknown type dropped it from a list)
        out["isSymlink"] = True
    return out
def fail(code, message):
    say({"error": [code, message]})
    raise Done()
try:
    p = args.get("path")
    if op == "stat":
        say({"entry": entry(p)})
    elif op == "list":
        if not os.path.isdir(p):
            fail("invalid_argument" if os.path.exists(p) else "not_found",
                 f"path {p} is not a directory" if os.path.exists(p) else f"path {p} does not exist")
        depth, found = max(1, int(args.get("depth") or 1)), []
        def walk(d, level):
            for name in sorted(os.listdir(d)):
                full = os.path.join(d, name)
                try:
                    e = entry(full)
                except OSError:
                    continue
                found.append(e)
                if level < depth and e["type"] == "FILE_TYPE_DIRECTORY" and not os.path.islink(full):
                    walk(full, level + 1)
        walk(p, 1)
        say({"entries": found})
    elif op == "mkdir":
        if os.path.lexists(p):
            fail("already_exists", f"path {p} already exists")
        os.makedirs(p)
        say({"entry": entry(p)})
    elif op == "remove":
        if not os.path.lexists(p):
            fail("not_found", f"path {p} does not exist")
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        say({})
    elif op == "move":
        src, dst = args["source"], args["destination"]
        if not os.path.lexists(src):
            fail("not_found", f"path {src} does not exist")
        parent = os.path.dirname(dst)
        if parent:
            os.makedirs(parent, exist_ok=True)
        os.rename(src, dst)
        say({"entry": entry(dst)})
    else:
        fail("unimplemented", f"no filesystem operation {op}")
except Done:
    pass
except FileNotFoundError as e:
    say({"error": ["not_found", f"path {e.filename or p} does not exist"]})
except PermissionError as e:
    say({"error": ["permission_denied", f"{e.strerror}: {e.filename}"]})
except OSError as e:
    say({"error": ["invalid_argument", f"{e.strerror}: {e.filename}"]})
'''


def cell(op: str, args: dict) -> str:
    """The python step that runs ``op`` with ``args`` in the sandbox, in a namespace of its own."""
    return (f"__import__('builtins').exec({HELPER!r}, {{'__name__': 'e2b_fs', 'OP': {op!r}, "
            f"'ARGS': {json.dumps(args)!r}}})")


def answer(stdout: str) -> dict:
    """The helper's answer; ``ValueError`` when it printed none (it did not run)."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value
