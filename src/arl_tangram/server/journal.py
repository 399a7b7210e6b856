"""A durable journal of accepted actions (SQLite in WAL mode).

An action is written before it is acknowledged, and its result when it ends, so that after a crash
every accepted action is accounted for: finished once, re-run where that is safe (a stateless
one-shot), or finished as ``infra_error`` (a session step whose sandbox died with the server). The
action id is the idempotency key: a resubmission finds the row instead of making a second one.
``synchronous=NORMAL`` survives a killed process (the WAL is in the OS's hands), not a power cut.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    id: str
    job: str
    kind: str
    request: dict
    state: str  # accepted | done
    outcome: str | None
    response: dict | None
    safe_to_rerun: bool
    accepted_at: float


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("""CREATE TABLE IF NOT EXISTS actions (
            id TEXT PRIMARY KEY, job TEXT NOT NULL, kind TEXT NOT NULL, request TEXT NOT NULL,
            state TEXT NOT NULL, outcome TEXT, response TEXT, safe INTEGER NOT NULL,
            accepted_at REAL NOT NULL, finished_at REAL)""")

    def accept(self, id: str, job: str, kind: str, request: dict, safe_to_rerun: bool) -> Entry | None:
        """Record a new action; returns the existing entry instead when ``id`` is known."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO actions (id, job, kind, request, state, safe, accepted_at) "
                "VALUES (?, ?, ?, ?, 'accepted', ?, ?)", (id, job, kind, json.dumps(request), int(safe_to_rerun),
                                                          time.time()))
            if cur.rowcount == 1:
                return None
        return self.get(id)

    def finish(self, id: str, outcome: str, response: dict) -> None:
        with self._lock:
            self._db.execute("UPDATE actions SET state='done', outcome=?, response=?, finished_at=? "
                             "WHERE id=? AND state!='done'", (outcome, json.dumps(response), time.time(), id))

    def get(self, id: str) -> Entry | None:
        with self._lock:
            row = self._db.execute("SELECT id, job, kind, request, state, outcome, response, safe, accepted_at "
                                   "FROM actions WHERE id=?", (id,)).fetchone()
        return _entry(row) if row else None

    def unfinished(self) -> list[Entry]:
        with self._lock:
            rows = self._db.execute("SELECT id, job, kind, request, state, outcome, response, safe, accepted_at "
                                    "FROM actions WHERE state!='done' ORDER BY accepted_at").fetchall()
        return [_entry(r) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _entry(row) -> Entry:
    return Entry(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5],
                 json.loads(row[6]) if row[6] else None, bool(row[7]), row[8])
