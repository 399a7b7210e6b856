"""A durable journal of accepted actions (SQLite in WAL mode).

An action is written before it is acknowledged, and its result when it ends, so that after a crash
every accepted action is accounted for: finished once, re-run where that is safe (a stateless
one-shot), or finished as ``infra_error`` (a session step whose sandbox died with the server). The
action id is the idempotency key: a resubmission finds the row instead of making a second one. (An
action whose result is its only acknowledgement may reach disk only with that result:
``accept``'s ``with_result``; if none of it reached disk before its result, it is answered
before that commit, which cannot make it run twice: ``finish``.)
``synchronous=NORMAL`` survives a killed process (the WAL is in the OS's hands), not a power cut.

One journal, one server: a server holds an exclusive lock on ``<journal>.lock`` for its lifetime.
A second server on the same journal would "recover" the first one's running actions and run them
again, so it refuses to start (``JournalBusy``, naming the journal and the holder's pid). The lock
is ``flock``'s, which the kernel drops when its holder dies: a crashed server leaves no stale lock.

The journal also names its server (``journal_owner``: a UUID made once and kept in the file): a
head on Ray says it to its node agents, so that the same journal is the same head across restarts
(it takes its agents over at once) and another journal, on any host, another head: not the file's
path, which is the same default on every host. A journal without an id gets one when opened.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import random
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

log = logging.getLogger(__name__)

#: commits between two checkpoints of the WAL into the database file (``Checkpointer``)
CHECKPOINT_EVERY = 256
#: how long a commit nobody waits for (one-shots answered before theirs: ``finish`` True) may wait
#: for others to join it; a write that asks for one commits everything queued at once
COMMIT_LATER_S = 0.005
#: ... and how many statements it may hold before it commits anyway
COMMIT_LATER_MAX = 512
#: an action accepted ``with_result`` and finished before its acceptance was committed: one row,
#: written done (a row already there, which a server-made id never has, is finished as ``finish``
#: would have: never left accepted, so never re-run after its caller was answered)
_DONE_ROW = ("INSERT INTO actions (id, job, kind, request, state, outcome, response, safe, accepted_at, finished_at) "
             "VALUES (?, ?, ?, ?, 'done', ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET state='done', "
             "outcome=excluded.outcome, response=excluded.response, finished_at=excluded.finished_at "
             "WHERE actions.state!='done'")


def new_id(prefix: str) -> str:
    """An id for an action the server names itself: ``prefix-`` and 32 hex digits, the first 12
    the time in ms (as a UUIDv7's), the other 20 random (80 bits). Ids made later sort later, so
    their rows go at the end of the journal's id index instead of on a random page of it, which
    keeps commits cheap as the journal grows. The random part comes from a generator of its own,
    seeded from the OS (again in a forked child), not a system call per id; of its own, so that a
    ``random.seed()`` elsewhere in the process (a library seeding for reproducibility) cannot make
    ids repeat. An id names an action; it is no secret (what a request may see is checked by its
    job)."""
    return f"{prefix}-{time.time_ns() // 1_000_000:012x}{_IDS.getrandbits(80):020x}"


_IDS = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _IDS.seed(os.urandom(32)))


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
    """Group commit: the writes of one event-loop iteration are committed together, as one
    transaction, right after it (``loop.call_soon``); ``durable()`` waits for that commit. Reads
    see queued writes at once. Callers await ``durable()`` before they acknowledge: nothing is
    acknowledged before it is on disk (in the WAL), and a burst of N actions costs one commit, not
    N. (The one exception: a result whose action has nothing on disk yet, ``finish`` True; its
    answer acknowledges it, and its commit comes right after, behind that answer.) Outside a
    running loop (recovery at start, tools) every write commits at once (but for an ``accept``
    with ``with_result``, which waits for the next write's commit). The commits stay on the loop:
    a writer thread would make every answer wait for the GIL after each of its sqlite calls.

    The WAL is copied back into the database file by a thread of its own (``Checkpointer``), never
    inside a commit on the loop: SQLite's automatic checkpoint, with its two ``fsync``s, would
    land in whichever request's commit filled the WAL. The thread's connection checkpoints
    ``PASSIVE``ly: it never blocks the loop's commits, and the loop never waits for it; what is
    durable and when is unchanged (a commit is in the WAL before the answers that wait for it
    leave)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = _lock(path)
        try:
            self._db = _connect(path)
        except BaseException:
            os.close(self._lock)
            raise
        self._db.execute("""CREATE TABLE IF NOT EXISTS actions (
            id TEXT PRIMARY KEY, job TEXT NOT NULL, kind TEXT NOT NULL, request TEXT NOT NULL,
            state TEXT NOT NULL, outcome TEXT, response TEXT, safe INTEGER NOT NULL,
            accepted_at REAL NOT NULL, finished_at REAL)""")
        # open sessions: one at rest has its state in the file at ``path`` and can be
        # woken by the next server; one awake when the server died lost its state with it
        self._db.execute("""CREATE TABLE IF NOT EXISTS sessions (
            id TEXT PRIMARY KEY, job TEXT NOT NULL, image TEXT, state TEXT NOT NULL, path TEXT, at REAL NOT NULL)""")
        self.owner = _owner(self._db)
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer's, off the loop
        self._checkpointer: Checkpointer | None = None  # started at the first checkpoint due
        self._queue: list[tuple | None] = []
        self._pending: dict[str, Entry] = {}  # written, not yet committed
        self._with_result: dict[str, int] = {}  # ``accept(with_result=True)``'s queued inserts: where in the queue
        self._waiters: list[Callable[[BaseException | None], None]] = []  # ``when_durable``'s
        self._scheduled = False
        self._late = False  # the commit scheduled is ``later``'s (``later_s`` behind)
        self._timer: asyncio.TimerHandle | None = None
        self.later_s = COMMIT_LATER_S
        self.error: BaseException | None = None
        self.commits = 0

    # -- writes ----------------------------------------------------------------------------------
    def accept(self, id: str, job: str, kind: str, request: dict | str, safe_to_rerun: bool,
               *, with_result: bool = False) -> Entry | None:
        """Record a new action; returns the existing entry instead when ``id`` is still queued (a
        committed one is left as it is by the insert). No read of the database here: the ids the
        server makes are new, and callers with a client's id look it up with ``get`` first.

        ``with_result``: nothing acknowledges this acceptance but the action's result (a one-shot
        answered only with its result, under an id the server made and nobody can ask about
        again): its record asks for no commit of its own and goes to disk with its result (as
        one row, written done: an insert instead of an insert and an update, in one commit instead
        of two; other commits leave it queued, ``_commit``), or with a ``flush``. A crash before
        that leaves no record of an action whose caller was never answered, as a crash just before
        its acceptance would, or of one answered just before (``finish``: nothing runs twice, a
        record is lost);
        one never finished is committed by ``close`` as accepted (a restart re-runs it) unless
        taken back first (``forget``: the service does when the server closes before the action
        ends, its caller being told to retry). So no commit runs on the loop between a one-shot's
        submission and its manager's first step."""
        queued = self._pending.get(id)
        if queued is not None:
            return queued
        now = time.time()
        entry = Entry(id, job, kind, request, "accepted", None, None, safe_to_rerun, now)
        self._write(id, entry, ("INSERT OR IGNORE INTO actions (id, job, kind, request, state, safe, accepted_at) "
                                "VALUES (?, ?, ?, ?, 'accepted', ?, ?)",
                                (id, job, kind, _text(request), int(safe_to_rerun), now)), asks_commit=not with_result)
        if with_result:
            self._with_result[id] = len(self._queue) - 1
        return None

    def finish(self, id: str, outcome: str, response: dict | str) -> bool:
        """Record an action's result. Until it is committed, ``get`` shows the result with the
        request's fields as queued with it, or empty (readers of a finished entry use its state,
        outcome and response; a read of the committed row per finish would cost as much as the
        write).
        ``response`` (and ``accept``'s ``request``) may come as JSON text already (pydantic's
        ``model_dump_json`` is quicker than ``json.dumps(model_dump())``).

        True when none of the action was on disk: an acceptance made ``with_result`` and still
        queued, now one row written done. Its caller may then be answered before that commit: a
        crash first leaves no row, so a restart cannot run it again (what waiting for the commit
        guards against), and the server-made id it was accepted under is known to nobody else.
        False when its acceptance may be on disk already: answered before the result's commit,
        a crash would leave it accepted, and a restart would run it a second time."""
        before = self._pending.get(id)
        entry = Entry(id, before.job if before else "", before.kind if before else "", before.request if before else {},
                      "done", outcome, response, before.safe_to_rerun if before else False,
                      before.accepted_at if before else 0.0)
        if id in self._with_result and before is not None:  # its acceptance still queued: one row written done
            done = (_DONE_ROW, (id, before.job, before.kind, _text(before.request), outcome, _text(response),
                                int(before.safe_to_rerun), before.accepted_at, time.time()))
            self._queue[self._with_result.pop(id)] = done
            self._pending[id] = entry
            self._schedule(later=True)
            return True
        self._write(id, entry, ("UPDATE actions SET state='done', outcome=?, response=?, finished_at=? "
                                "WHERE id=? AND state!='done'", (outcome, _text(response), time.time(), id)))
        return False

    def forget(self, id: str) -> bool:
        """Take back an acceptance made ``with_result`` while it is still queued (the server closed
        before the action ended, and its caller was told to retry: a restart must not run it a
        second time); False when it is already on disk, or was never made so."""
        at = self._with_result.pop(id, None)
        if at is None:
            return False
        self._queue[at] = None
        self._pending.pop(id, None)
        return True

    # -- sessions (committed with the actions' writes: same group commit) ----------------------------
    def session_open(self, id: str, job: str, image: str | None) -> None:
        self._write(None, None, ("INSERT OR REPLACE INTO sessions (id, job, image, state, path, at) "
                                 "VALUES (?, ?, ?, 'awake', NULL, ?)", (id, job, image, time.time())))

    def session_rested(self, id: str, path: str | None) -> None:
        """The session is at rest with its state at ``path``, or (None) awake again."""
        self._write(None, None, ("UPDATE sessions SET state=?, path=?, at=? WHERE id=?",
                                 ("at_rest" if path else "awake", path, time.time(), id)))

    def session_closed(self, id: str) -> None:
        self._write(None, None, ("DELETE FROM sessions WHERE id=?", (id,)))

    def sessions(self) -> list[tuple[str, str, str | None, str, str | None]]:
        """Open sessions: (id, job, image, state, path)."""
        self.flush()
        return self._db.execute("SELECT id, job, image, state, path FROM sessions ORDER BY at").fetchall()

    def _write(self, id: str | None, entry: Entry | None, statement: tuple, asks_commit: bool = True) -> None:
        if self.error is not None:
            raise _unwritable(self.error)
        self._queue.append(statement)
        if id is not None and entry is not None:
            self._pending[id] = entry
        if asks_commit:
            self._schedule()

    def _schedule(self, later: bool = False) -> None:
        """The queue's commit, right after this loop iteration (now, outside a running loop);
        ``later``: ``later_s`` after (at least one iteration, behind the callbacks queued after
        this call: a one-shot's answer, which does not wait for it: ``finish``), or once
        ``COMMIT_LATER_MAX`` statements are queued. Nobody waits for such a commit, so the rows of
        every one-shot answered meanwhile go in one transaction: a commit on the loop costs about
        as much for one row as for dozens (the WAL's pages, the transaction), and under load
        answers end one or two a loop pass, which committed a pass behind made about one commit
        an action. A write asking for a commit now while only a later one is scheduled gets one
        now as well (it takes the later one's rows with it): others' ``durable`` never waits for
        a one-shot's answer."""
        if self._scheduled and (later or not self._late):
            if later and self._late and len(self._queue) - len(self._with_result) >= COMMIT_LATER_MAX:
                self._now(asyncio.get_running_loop())
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._commit()
            return
        if self._scheduled:  # only the later one is scheduled
            self._now(loop)
            return
        self._scheduled, self._late = True, later
        if later:
            self._timer = loop.call_later(self.later_s, self._commit)
        else:
            loop.call_soon(self._commit)

    def _now(self, loop: asyncio.AbstractEventLoop) -> None:
        """The later commit scheduled becomes one right after this iteration."""
        self._late = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop.call_soon(self._commit)

    async def durable(self) -> None:
        """Return once every write made before this call is committed (``when_durable``, awaited)."""
        if not self._queue and self.error is None:
            return  # nothing to wait for, and no future made for it
        fut = asyncio.get_running_loop().create_future()
        self.when_durable(lambda err: _settle(fut, err))
        await fut

    def when_durable(self, done: Callable[[BaseException | None], None]) -> None:
        """``durable`` as a callback: ``done(None)`` once every write made before this call is
        committed (now, if none is queued), ``done(error)`` if the commit failed."""
        if not self._queue:
            done(None if self.error is None else _unwritable(self.error))
            return
        self._waiters.append(done)
        self._schedule()  # (what is queued may have asked for none: ``accept``'s ``with_result``)

    def flush(self) -> None:
        """Commit what is queued now, the acceptances ``with_result`` still running too."""
        if self._queue:
            self._commit(everything=True)

    def _commit(self, everything: bool = False) -> None:
        """Commit the queue. An acceptance made ``with_result`` whose result has not come stays
        queued (but for ``flush``): it goes to disk with its result, as one row written done.
        Written now, its one-shot's answer would have to wait for its result's commit (``finish``
        False, or a restart could run it twice), and each such commit would take the acceptances
        of the one-shots running meanwhile with it: under load every one-shot then waited for a
        commit of its own, the loop's largest cost per one-shot (docs/scale.md)."""
        self._scheduled = self._late = False
        if self._timer is not None:  # (a flush before the later commit was due)
            self._timer.cancel()
            self._timer = None
        batch, self._queue = self._queue, []
        held: dict[str, int] = {}
        if not everything and self._with_result:
            for id, at in self._with_result.items():
                held[id] = len(self._queue)
                self._queue.append(batch[at])
                batch[at] = None
        self._with_result = held
        waiters, self._waiters = self._waiters, []
        if any(statement is not None for statement in batch):
            try:
                self._db.execute("BEGIN")
                for statement in batch:
                    if statement is not None:  # (None: an acceptance taken back, ``forget``)
                        self._db.execute(*statement)
                self._db.execute("COMMIT")
                self.commits += 1
                if self.commits % CHECKPOINT_EVERY == 0:
                    self._checkpoint()
            except sqlite3.Error as e:
                self.error = e  # (said in the log too: a one-shot answered before its commit waits for none)
                log.error("journal %s: a commit failed, nothing more can be accepted: %s", self.path, e)
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._pending.clear()  # not on disk: reads must not serve it
                _wake(waiters, _unwritable(e))
                return
        if held:
            pending = self._pending
            self._pending = {id: pending[id] for id in held if id in pending}
        else:
            self._pending.clear()
        _wake(waiters, None)

    def _checkpoint(self) -> None:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.path)
        self._checkpointer.ask()

    # -- reads -----------------------------------------------------------------------------------
    def get(self, id: str) -> Entry | None:
        queued = self._pending.get(id)
        if queued is not None:
            if isinstance(queued.response, str) or isinstance(queued.request, str):
                queued = replace(queued, request=_obj(queued.request), response=_obj(queued.response))
            return queued
        row = self._db.execute("SELECT id, job, kind, request, state, outcome, response, safe, accepted_at "
                               "FROM actions WHERE id=?", (id,)).fetchone()
        return _entry(row) if row else None

    def request_of(self, id: str) -> tuple[str, dict] | None:
        """An action's kind and request as accepted, or None: from the queued writes, or from disk
        when the queue holds only its result (``finish`` queues no request fields: a resubmission
        with another request in that window got the first one's result instead of a 409)."""
        queued = self._pending.get(id)
        if queued is not None and queued.kind:
            return queued.kind, _obj(queued.request)
        row = self._db.execute("SELECT kind, request FROM actions WHERE id=?", (id,)).fetchone()
        return (row[0], _obj(row[1])) if row else None

    def unfinished(self) -> list[Entry]:
        self.flush()
        rows = self._db.execute("SELECT id, job, kind, request, state, outcome, response, safe, accepted_at "
                                "FROM actions WHERE state!='done' ORDER BY accepted_at").fetchall()
        return [_entry(r) for r in rows]

    def close(self) -> None:
        """Commit what is queued, then close (and let another server have the journal)."""
        try:
            if self._checkpointer is not None:
                self._checkpointer.stop()
                self._checkpointer = None
            self.flush()
            self._db.close()  # the last connection: SQLite checkpoints the rest here
        finally:
            if self._lock >= 0:
                os.close(self._lock)  # closing the descriptor drops the flock
                self._lock = -1


class Checkpointer:
    """A thread with its own connection that copies the WAL into the database file when asked
    (``ask``: it never waits), so that no commit on the loop runs a checkpoint (``Journal``). A
    passive checkpoint takes no lock a writer waits for; the sqlite3 module releases the GIL while
    SQLite works, so the loop loses it only for the thread's few bytecodes per checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = 0
        self._due = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="journal checkpoint", daemon=True)
        self._thread.start()

    def ask(self) -> None:
        self._due.set()

    def stop(self) -> None:
        self._stopping = True
        self._due.set()
        self._thread.join()

    def _run(self) -> None:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=5000")
            while True:
                self._due.wait()
                self._due.clear()
                if self._stopping:
                    return
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.done += 1
                except sqlite3.Error as e:  # the next one tries again; commits go on regardless
                    log.warning("journal %s: checkpoint failed: %s", self.path, e)
        finally:
            db.close()


def _wake(waiters: list[Callable[[BaseException | None], None]], err: BaseException | None) -> None:
    """A commit's waiters, each told once."""
    for w in waiters:
        try:
            w(err)
        except Exception:  # the others must still be told
            log.exception("a journal commit's callback failed")


def _settle(fut: asyncio.Future, err: BaseException | None) -> None:
    """``durable``'s wait told by ``when_durable``."""
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _text(value: dict | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _obj(value):
    return json.loads(value) if isinstance(value, str) else value


class JournalError(RuntimeError):
    """The journal cannot be written (disk full, file removed): accepting more would lose them."""


def _unwritable(cause: BaseException) -> JournalError:
    return JournalError(f"the journal cannot be written: {cause}")


class JournalBusy(RuntimeError):
    """Another live server holds the journal."""


def _lock(path: str) -> int:
    """Take ``<path>.lock`` exclusively, without waiting, and write our pid in it; returns the
    descriptor, held until ``close`` (or until the process dies: then the kernel drops it). Not
    inherited across exec (Python's default), so sandboxes never hold it."""
    lock_path = path + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise JournalBusy(f"journal {path} is in use by another tangram serve (pid {holder}): stop that server, "
                          "or give this one its own journal with --journal PATH (or journal in the config)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def journal_owner(path: str) -> str:
    """The id of the server whose journal is ``path`` (made and stored in the file the first time:
    the module docstring). Readable before the server takes the journal's lock."""
    db = _connect(path)
    try:
        return _owner(db)
    finally:
        db.close()


def _owner(db: sqlite3.Connection) -> str:
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('owner', ?)", (uuid.uuid4().hex,))
    return db.execute("SELECT value FROM meta WHERE key='owner'").fetchone()[0]


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    return db


def _entry(row) -> Entry:
    return Entry(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5],
                 json.loads(row[6]) if row[6] else None, bool(row[7]), row[8])
