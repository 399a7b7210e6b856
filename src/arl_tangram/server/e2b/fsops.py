"""envd's filesystem answers, shaped from the sandbox agent's (``inside.fsops.op_fs``).

Every filesystem call of the E2B API (Stat, ListDir, MakeDir, Remove, Move, and ``/files`` reads
and writes outside the home directory) is one ``FsCall`` of the sandbox's session, carried out by
the runner, the sandbox's trusted agent: it sees exactly what the sandbox's own commands see,
whatever the path, and nothing else. Never a step in the session's interpreter or shell, where
the user's code runs too: a cell that patched ``os.lstat`` or a shell function named ``base64``
would answer every later call (``tests/test_e2b.py`` tries both). This module only turns the
runner's neutral entries (``path, mode, size, mtime, link``) and failure codes into envd's JSON
and Connect codes.
"""

from __future__ import annotations

import datetime
import posixpath
import stat

KINDS = {stat.S_IFREG: "FILE_TYPE_FILE", stat.S_IFDIR: "FILE_TYPE_DIRECTORY", stat.S_IFLNK: "FILE_TYPE_SYMLINK"}

#: the runner's failure codes (``FsCall``) as the HTTP status and Connect code envd answers with
STATUS = {"not_found": (404, "not_found"), "exists": (409, "already_exists"), "denied": (403, "permission_denied"),
          "invalid": (400, "invalid_argument"), "too_many": (400, "resource_exhausted")}


def entry(e: dict) -> dict:
    """envd's ``EntryInfo`` of one runner entry. A link keeps the kind of what it points to, as
    envd 0.6 shows it, and is marked as a link (the SDK then types it SYMLINK, a dangling one too:
    without the mark, its unknown type dropped it from a list)."""
    mode, path = int(e["mode"]), str(e["path"])
    when = datetime.datetime.fromtimestamp(float(e["mtime"]), datetime.timezone.utc)
    out = {"name": posixpath.basename(path.rstrip("/")) or "/", "type": KINDS.get(stat.S_IFMT(mode),
           "FILE_TYPE_UNSPECIFIED"), "path": path, "size": str(int(e["size"])), "mode": stat.S_IMODE(mode),
           "permissions": stat.filemode(mode), "owner": "user", "group": "user",
           "modifiedTime": when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    if e.get("link") is not None:
        out["symlinkTarget"] = str(e["link"])
        out["isSymlink"] = True
    return out


def answer(info: dict) -> dict:
    """envd's answer to a call whose runner answer is ``info``."""
    if "entries" in info:
        return {"entries": [entry(e) for e in info["entries"]]}
    if "entry" in info:
        return {"entry": entry(info["entry"])}
    return {}
