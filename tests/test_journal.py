"""The journal's group commit: reads see writes at once, ``durable()`` means on disk, and a burst
of writes costs a few commits on the writer thread, not one each."""

from __future__ import annotations

import asyncio
import sqlite3

from arl_tangram.server.journal import Journal


def _rows(path) -> dict[str, str]:
    db = sqlite3.connect(path)  # another connection: only what is committed
    try:
        return dict(db.execute("SELECT id, state FROM actions").fetchall())
    finally:
        db.close()


def test_writes_are_visible_at_once_and_on_disk_after_durable(tmp_path):
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)

    async def main():
        assert j.accept("a", "job", "run_code", {"x": 1}, True) is None
        assert j.get("a").state == "accepted"  # queued, already readable
        again = j.accept("a", "job", "run_code", {"x": 2}, True)
        assert again is not None and again.request == {"x": 1}  # the id is the idempotency key
        j.finish("a", "ok", {"out": 42})
        assert (j.get("a").state, j.get("a").response) == ("done", {"out": 42})
        await j.durable()
        assert _rows(path) == {"a": "done"}

    asyncio.run(main())
    j.close()
    j2 = Journal(path)
    assert j2.get("a").response == {"out": 42} and j2.unfinished() == []
    j2.close()


def test_a_burst_is_committed_in_a_few_transactions(tmp_path):
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)

    async def main():
        for i in range(500):
            j.accept(f"a{i}", "job", "run_code", {"i": i}, True)
        await j.durable()
        return j.commits

    commits = asyncio.run(main())
    assert len(_rows(path)) == 500 and commits < 100, commits
    assert len(j.unfinished()) == 500
    j.close()


def test_close_commits_what_is_queued(tmp_path):
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)
    for i in range(50):
        j.accept(f"b{i}", "job", "exec", {}, False)
    j.close()
    assert len(_rows(path)) == 50


def test_the_wal_is_checkpointed_by_its_thread_not_in_a_commit(tmp_path, monkeypatch):
    """Commits on the loop never checkpoint (SQLite's automatic checkpoint is off on the journal's
    connection); every ``CHECKPOINT_EVERY`` commits the checkpointer thread copies the WAL into the
    database file: a copy of that file alone, without the WAL, then holds the rows."""
    import shutil
    import time

    from arl_tangram.server import journal as journal_mod

    monkeypatch.setattr(journal_mod, "CHECKPOINT_EVERY", 8)
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)
    assert j._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0

    async def main():
        for i in range(8):
            j.accept(f"c{i}", "job", "run_code", {"i": i}, True)
            await j.durable()  # one commit each

    asyncio.run(main())
    assert j.commits == 8 and j._checkpointer is not None
    deadline = time.monotonic() + 10
    while j._checkpointer.done < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert j._checkpointer.done >= 1
    shutil.copy(path, tmp_path / "alone.sqlite3")  # the database file without its WAL
    assert len(_rows(str(tmp_path / "alone.sqlite3"))) == 8
    j.close()
    assert j._checkpointer is None
    assert len(_rows(path)) == 8


def test_ids_the_server_makes_sort_by_time_and_do_not_repeat():
    import re
    import time as _time

    from arl_tangram.server.journal import new_id

    first = [new_id("sf") for _ in range(2000)]
    _time.sleep(0.002)
    later = new_id("sf")
    assert all(re.fullmatch(r"sf-[0-9a-f]{32}", i) for i in first)
    assert len(set(first)) == len(first)
    assert later > max(first)  # a later millisecond sorts after every id of the earlier ones
    import random as _random

    _random.seed(7)  # a library seeding the process's generator does not make ids repeat
    a = new_id("sf")[-20:]
    _random.seed(7)
    assert new_id("sf")[-20:] != a


def test_when_durable_calls_back_once_the_writes_before_it_are_committed(tmp_path):
    """The callback form of ``durable`` (a one-shot's answer in the engine process): at once when
    nothing is queued, after the commit otherwise, and with the error when the commit failed."""
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)
    told: list = []

    async def main():
        j.when_durable(told.append)
        assert told == [None]  # nothing queued: at once
        j.accept("a", "job", "run_code", {"x": 1}, True)
        j.when_durable(lambda err: told.append((err, _rows(path))))
        assert len(told) == 1  # not before the commit
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert told[1] == (None, {"a": "accepted"})  # on disk when told
        j._db.execute("PRAGMA query_only=1")  # every write now fails
        j.accept("b", "job", "run_code", {"x": 2}, True)
        j.when_durable(lambda err: told.append(err))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert type(told[2]).__name__ == "JournalError" and "cannot be written" in str(told[2])
    j.close()


def test_finish_says_whether_none_of_the_action_was_on_disk_and_commits_it_behind_the_answer(tmp_path):
    """``finish`` is True only for an acceptance made ``with_result`` and still queued (its caller
    may be answered before the commit: a crash leaves no row to run again); False for one already
    on disk through another write's commit, and for an ordinary action. The True one's commit
    comes ``later_s`` after it (an ordinary one's comes after one loop iteration), behind a
    callback queued after the ``finish`` (the caller's answer), and then the row is on disk, done."""
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)

    async def settle():
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.sleep(j.later_s * 3)

    async def main():
        loop = asyncio.get_running_loop()
        seen: list[dict[str, str]] = []
        j.accept("a", "job", "run_code", {"x": 1}, True, with_result=True)
        assert j.finish("a", "ok", {"out": 1}) is True
        loop.call_soon(lambda: seen.append(_rows(path)))  # the answer, queued after the finish
        await settle()
        assert seen == [{}] and _rows(path) == {"a": "done"} and j.commits == 1  # answered first, then on disk

        # an ordinary write in the same pass is not held back by that later commit: its waiter is
        # told after one pass, as without it
        j.accept("c", "job", "run_code", {"x": 3}, True, with_result=True)
        assert j.finish("c", "ok", {"out": 3}) is True
        j.accept("v", "job", "exec", {}, False)
        told: list = []
        j.when_durable(told.append)
        await asyncio.sleep(0)  # one loop pass
        assert told == [None] and _rows(path) == {"a": "done", "c": "done", "v": "accepted"}, told
        await settle()

        j.accept("b", "job", "run_code", {"x": 2}, True, with_result=True)
        j.accept("w", "job", "exec", {}, False)  # its commit leaves b's acceptance queued
        await settle()
        assert "b" not in _rows(path) and _rows(path)["w"] == "accepted"
        assert j.finish("b", "ok", {"out": 2}) is True
        await settle()
        assert _rows(path)["b"] == "done"

        j.accept("b2", "job", "run_code", {"x": 2}, True, with_result=True)
        j.flush()  # (close's, recovery's) takes it to disk accepted
        assert _rows(path)["b2"] == "accepted"
        assert j.finish("b2", "ok", {"out": 2}) is False  # answered before its commit, a crash would re-run it
        assert j.finish("w", "ok", {}) is False
        await asyncio.wait_for(j.durable(), 5)
        assert _rows(path) == {"a": "done", "c": "done", "v": "accepted", "b": "done", "w": "done", "b2": "done"}

    asyncio.run(main())
    j.close()


def test_one_shots_answered_before_their_commit_share_one(tmp_path):
    """Results nobody waits for (``finish`` True), made in different loop passes within
    ``later_s``, go to disk in one commit, not one each; ``COMMIT_LATER_MAX`` of them queued
    commit at once; a write that asks for a commit takes them with it without waiting."""
    from arl_tangram.server import journal as journal_mod

    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)
    j.later_s = 0.5  # long against the passes below, however loaded the machine

    async def main():
        j.accept("long", "job", "run_code", {}, True, with_result=True)  # running through what follows
        for i in range(20):  # one answer a loop pass, as under load
            j.accept(f"a{i}", "job", "run_code", {"x": i}, True, with_result=True)
            assert j.finish(f"a{i}", "ok", {"out": i}) is True
            await asyncio.sleep(0)
        assert j.commits == 0 and _rows(path) == {}  # (one commit a pass or two before: fails here)
        await asyncio.sleep(1.0)
        assert j.commits == 1 and len(_rows(path)) == 20 and "long" not in _rows(path)
        # the commits of others left its acceptance queued: its answer need not wait for a commit
        assert j.finish("long", "ok", {}) is True
        await asyncio.sleep(1.0)
        assert j.commits == 2 and _rows(path)["long"] == "done"

        j.accept("b", "job", "run_code", {}, True, with_result=True)
        assert j.finish("b", "ok", {}) is True
        j.accept("w", "job", "exec", {}, False)  # asks for a commit: b goes with it, now
        await asyncio.wait_for(j.durable(), 0.4)
        assert j.commits == 3 and _rows(path)["b"] == "done" and _rows(path)["w"] == "accepted"

        for i in range(journal_mod.COMMIT_LATER_MAX):
            j.accept(f"c{i}", "job", "run_code", {}, True, with_result=True)
            j.finish(f"c{i}", "ok", {})
        for _ in range(3):
            await asyncio.sleep(0)
        assert j.commits == 4 and len(_rows(path)) == 23 + journal_mod.COMMIT_LATER_MAX

    asyncio.run(main())
    j.close()


def test_an_acceptance_answered_only_by_its_result_goes_to_disk_with_it(tmp_path):
    """``accept(with_result=True)`` (a one-shot under an id the server made): readable at once, no
    commit of its own; finished while still queued, one row written done (an insert, no update),
    wherever it sits among other writes; a waiter's or another write's commit leaves it queued
    (readable); on disk first through a ``flush``, then finished as any action; taken back while queued (``forget``), never on disk;
    never finished, committed by ``close`` as accepted."""
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)
    statements: list[str] = []
    j._db.set_trace_callback(statements.append)

    def writes() -> list[str]:
        return [s.split()[0] for s in statements if s.startswith(("INSERT", "UPDATE"))]

    async def settle():
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.sleep(j.later_s * 3)

    async def main():
        j.accept("a", "job", "run_code", {"x": 1}, True, with_result=True)
        assert j.get("a").state == "accepted"
        await settle()
        assert j.commits == 0 and _rows(path) == {}  # (fails if it asked for a commit of its own)
        j.finish("a", "ok", {"out": 1})  # nobody waits: the finish asks for the commit
        await settle()
        assert j.commits == 1 and _rows(path) == {"a": "done"} and writes() == ["INSERT"], statements
        db = sqlite3.connect(path)
        row = db.execute("SELECT job, kind, request, outcome, response, safe, finished_at >= accepted_at "
                         "FROM actions").fetchone()
        db.close()
        assert row == ("job", "run_code", '{"x": 1}', "ok", '{"out": 1}', 1, 1), row

        statements.clear()  # between two ordinary writes, each row its own
        j.accept("w1", "job", "exec", {}, False)
        j.accept("b", "job", "run_code", {"x": 2}, True, with_result=True)
        j.accept("w2", "job", "exec", {}, False)
        j.finish("b", "ok", {"out": 2})
        await asyncio.wait_for(j.durable(), 5)
        assert _rows(path) == {"a": "done", "w1": "accepted", "b": "done", "w2": "accepted"}
        assert writes() == ["INSERT"] * 3, statements
        assert j.get("b").response == {"out": 2} and j.get("w1").state == "accepted"

        statements.clear()  # another write's commit leaves it queued; on disk first through a
        j.accept("c", "job", "run_code", {"x": 3}, True, with_result=True)  # flush: its result is an update
        j.accept("w3", "job", "exec", {}, False)
        await settle()
        assert "c" not in _rows(path) and _rows(path)["w3"] == "accepted"
        j.flush()
        assert _rows(path)["c"] == "accepted"
        j.finish("c", "ok", {"out": 3})
        await asyncio.wait_for(j.durable(), 5)
        assert _rows(path)["c"] == "done" and writes() == ["INSERT", "INSERT", "UPDATE"], statements

        j.accept("d", "job", "run_code", {"x": 4}, True, with_result=True)
        await asyncio.wait_for(j.durable(), 5)  # a waiter's commit leaves it queued too
        assert "d" not in _rows(path) and j.get("d").state == "accepted"
        j.flush()
        assert _rows(path)["d"] == "accepted"

        j.accept("e", "job", "run_code", {"x": 5}, True, with_result=True)
        assert j.forget("e") and j.get("e") is None and not j.forget("d")
        j.accept("f", "job", "run_code", {"x": 6}, True, with_result=True)

    asyncio.run(main())
    assert "f" not in _rows(path)
    j.close()  # f never finished: committed as accepted, so a restart re-runs it; e never reached disk
    j2 = Journal(path)
    assert {e.id for e in j2.unfinished()} == {"w1", "w2", "w3", "d", "f"}
    j2.close()


def test_the_request_an_action_was_accepted_with_is_known_while_its_result_is_queued(tmp_path):
    """``finish`` queues the result without the request's fields: ``request_of`` reads them from
    disk then, so a resubmission with another request in that window is still compared (409)."""
    path = str(tmp_path / "j.sqlite3")
    j = Journal(path)

    async def main():
        j.accept("a", "job", "run_code", {"x": 1}, True)
        assert j.request_of("a") == ("run_code", {"x": 1})  # queued
        await j.durable()
        j.finish("a", "ok", {"out": 42})
        assert j.get("a").kind == ""  # the queued result carries no request
        assert j.request_of("a") == ("run_code", {"x": 1})  # read from disk
        await j.durable()
        assert j.request_of("a") == ("run_code", {"x": 1}) and j.request_of("b") is None

    asyncio.run(main())
    j.close()
