"""envd's filesystem calls (Stat, ListDir, MakeDir, Remove, Move), carried out inside the sandbox.

Each is one shell step of the sandbox's session that runs ``HELPER`` (standard library only)
under the sandbox's python: it sees exactly what the sandbox's own commands see, whatever the
path (the workspace, ``/tmp``), and nothing else. It prints one JSON object: the answer, or
``{"error": [connect code, message]}``.
"""

from __future__ import annotations

import json
import shlex

HELPER = r'''
import json, os, stat, sys, shutil, datetime
op, args = sys.argv[1], json.loads(sys.argv[2])
KINDS = {stat.S_IFREG: "FILE_TYPE_FILE", stat.S_IFDIR: "FILE_TYPE_DIRECTORY"}
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
    if link:
        out["symlinkTarget"] = target
    return out
def fail(code, message):
    print(json.dumps({"error": [code, message]}))
    sys.exit(0)
try:
    p = args.get("path")
    if op == "stat":
        print(json.dumps({"entry": entry(p)}))
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
        print(json.dumps({"entries": found}))
    elif op == "mkdir":
        if os.path.lexists(p):
            fail("already_exists", f"path {p} already exists")
        os.makedirs(p)
        print(json.dumps({"entry": entry(p)}))
    elif op == "remove":
        if not os.path.lexists(p):
            fail("not_found", f"path {p} does not exist")
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        print("{}")
    elif op == "move":
        src, dst = args["source"], args["destination"]
        if not os.path.lexists(src):
            fail("not_found", f"path {src} does not exist")
        parent = os.path.dirname(dst)
        if parent:
            os.makedirs(parent, exist_ok=True)
        os.rename(src, dst)
        print(json.dumps({"entry": entry(dst)}))
    else:
        fail("unimplemented", f"no filesystem operation {op}")
except FileNotFoundError as e:
    fail("not_found", f"path {e.filename or p} does not exist")
except PermissionError as e:
    fail("permission_denied", f"{e.strerror}: {e.filename}")
except OSError as e:
    fail("invalid_argument", f"{e.strerror}: {e.filename}")
'''


def command(op: str, args: dict) -> str:
    """The shell step that runs ``op`` with ``args`` in the sandbox."""
    return f"python3 -I -S -c {shlex.quote(HELPER)} {op} {shlex.quote(json.dumps(args))}"


def answer(stdout: str) -> dict:
    """The helper's answer; ``ValueError`` when it printed none (it did not run)."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value
