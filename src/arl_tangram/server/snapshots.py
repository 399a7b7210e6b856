"""The server's snapshots: files in one directory, named by the ids the HTTP API hands out.

``POST /v1/sessions/{id}/snapshot`` writes ``<dir>/<id>.tar`` (the sandbox manager's snapshot
format, ``managers/sandbox/envops.py``) and ``<dir>/<id>.json`` (what it was taken from); ``POST
/v1/sessions`` with ``restore`` opens a session from one; ``GET /v1/snapshots`` and ``DELETE
/v1/snapshots/{id}`` list and remove them. The directory is the server's state directory (beside
its journal, so snapshots survive a restart of the server: the listing is the directory's), or
``sandbox.snapshot_dir`` (on Ray, a path every node can read), or, for a service built without a
journal (tests, the embedded server), a temporary directory removed when it stops.

An id is checked against its own pattern before it becomes a path, so a client's id can name
nothing but a snapshot of this directory: anything else is a 404 naming it.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

ID_RE = re.compile(r"^snap-[0-9a-f]{32}$")


class UnknownSnapshot(LookupError):
    """No snapshot of that id here (the service answers 404 naming it)."""


class Snapshots:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def new(self) -> tuple[str, str]:
        """A fresh id and the path its tar is to be written at."""
        id = f"snap-{uuid.uuid4().hex}"
        return id, str(self.dir / f"{id}.tar")

    def record(self, id: str, **meta: object) -> dict:
        """After the tar is written: its metadata (with ``bytes`` and ``created``) beside it."""
        info = {"snapshot": id, "bytes": os.path.getsize(self.dir / f"{id}.tar"), "created": time.time(), **meta}
        tmp = self.dir / f".{id}.json"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.dir / f"{id}.json")
        return info

    def path(self, id: str, field: str = "snapshot") -> str:
        """The tar of snapshot ``id``; ``UnknownSnapshot`` naming it if there is none."""
        p = self.dir / f"{id}.tar"
        if not isinstance(id, str) or not ID_RE.match(id) or not p.is_file():
            raise UnknownSnapshot(f"{field}: no snapshot {id!r}")
        return str(p)

    def info(self, id: str) -> dict:
        self.path(id)
        try:
            return json.loads((self.dir / f"{id}.json").read_text())
        except (OSError, ValueError):  # written by a server that died between the two files
            st = os.stat(self.dir / f"{id}.tar")
            return {"snapshot": id, "bytes": st.st_size, "created": st.st_mtime}

    def list(self) -> list[dict]:
        ids = sorted(p.stem for p in self.dir.glob("snap-*.tar") if ID_RE.match(p.stem))
        return sorted((self.info(i) for i in ids), key=lambda d: d.get("created", 0.0))

    def delete(self, id: str) -> None:
        os.unlink(self.path(id))
        try:
            os.unlink(self.dir / f"{id}.json")
        except FileNotFoundError:
            pass

    def discard(self, id: str) -> None:
        """Remove what a failed snapshot left (its ``.partial`` or tar), if anything."""
        for name in (f"{id}.tar", f"{id}.tar.partial", f"{id}.json"):
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass
