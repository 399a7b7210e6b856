"""Fork, snapshot and restore of default sessions over HTTP, through both clients, against a real
``tangram serve`` (real sandboxes: a default session's workspace is layered copy-on-write)."""

from __future__ import annotations

import asyncio
import os
import shutil

import httpx
import pytest

from arl_tangram.client import AsyncTangramClient, TangramClient, TangramError
from servers import Server

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.skipif(os.geteuid() != 0, reason="layered workspaces mount overlays: root only")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("snap"), config={"sandbox": {"warm_pool": 1, "warm_sessions": 2}})
    yield s
    s.stop()


def test_a_default_session_forks_into_3_snapshots_and_restores_over_http(server):
    with TangramClient(server.url) as c:
        s = c.session(job="j")
        assert s.put_files({"notes/a.txt": b"from the parent"}).outcome == "ok"
        kids = s.fork(3)
        for i, k in enumerate(kids):
            r = k.exec(f"cat notes/a.txt; echo child{i} > own.txt")
            assert r.outcome == "ok" and r.run.stdout == "from the parent", r
        seen = [k.exec("cat own.txt").run.stdout for k in kids]
        assert seen == ["child0\n", "child1\n", "child2\n"]  # none sees another's writes
        snap = kids[1].snapshot()
        assert snap.snapshot.startswith("snap-") and snap.bytes > 0 and snap.session_id == kids[1].id
        assert snap.snapshot in [x.snapshot for x in c.snapshots()]
        back = c.restore(snap.snapshot, job="j")
        r = back.exec("cat notes/a.txt own.txt")
        assert r.outcome == "ok" and r.run.stdout == "from the parentchild1\n", r
        assert back.get_files(["own.txt"]) == {"own.txt": b"child1\n"}
        for x in (s, *kids, back):
            x.close()
        c.delete_snapshot(snap.snapshot)
        assert snap.snapshot not in [x.snapshot for x in c.snapshots()]


def test_the_async_client_does_the_same(server):
    async def main():
        async with AsyncTangramClient(server.url) as c:
            s = await c.session()
            await s.exec("echo async > f")
            [kid] = await s.fork(1)
            await kid.exec("echo kid >> f")
            snap = await kid.snapshot()
            back = await c.restore(snap.snapshot)
            r = await back.exec("cat f")
            parent = await s.exec("cat f")
            listed = [x.snapshot for x in await c.snapshots()]
            await c.delete_snapshot(snap.snapshot)
            images = await c.images()
            for x in (s, kid, back):
                await x.close()
            return r.run.stdout, parent.run.stdout, snap.snapshot in listed, images

    restored, parent, listed, images = asyncio.run(main())
    assert restored == "async\nkid\n" and parent == "async\n" and listed and isinstance(images, list)


def test_bad_ids_are_404s_naming_them(server):
    bad = "snap-" + "0" * 32
    with TangramClient(server.url, retries=0) as c:
        for call in (lambda: c.restore(bad), lambda: c.restore("../../etc/passwd"), lambda: c.delete_snapshot(bad)):
            with pytest.raises(TangramError) as e:
                call()
            assert e.value.status == 404 and ("bad" in e.value.message or "snap-" in e.value.message
                                              or "passwd" in e.value.message), e.value.message
    r = httpx.post(f"{server.url}/v1/sessions/no-such-session/snapshot")
    assert r.status_code == 404 and "no-such-session" in r.json()["message"]
    r = httpx.post(f"{server.url}/v1/sessions", json={"restore": bad, "image": "x"})
    assert r.status_code == 422 and "image" in r.json()["message"]


def test_snapshots_outlive_a_restart_of_the_server(tmp_path):
    journal = tmp_path / "j.sqlite3"
    first = Server(tmp_path, journal=journal)
    try:
        with TangramClient(first.url) as c:
            s = c.session()
            s.exec("echo kept > f")
            snap = s.snapshot().snapshot
    finally:
        first.stop()
    second = Server(tmp_path, journal=journal)
    try:
        with TangramClient(second.url) as c:
            assert snap in [x.snapshot for x in c.snapshots()]
            r = c.restore(snap).exec("cat f")
            assert r.outcome == "ok" and r.run.stdout == "kept\n"
    finally:
        second.stop()


def test_another_jobs_snapshot_is_a_404_under_api_keys(tmp_path):
    keys = [{"key": "a" * 16, "job": "a"}, {"key": "b" * 16, "job": "b"}]
    srv = Server(tmp_path, config={"api_keys": keys})
    try:
        with TangramClient(srv.url, token="a" * 16, retries=0) as a, TangramClient(srv.url, token="b" * 16,
                                                                                   retries=0) as b:
            s = a.session()
            s.exec("echo mine > f")
            snap = s.snapshot()
            assert snap.job == "a" and [x.snapshot for x in a.snapshots()] == [snap.snapshot]
            assert b.snapshots() == []
            for call in (lambda: b.restore(snap.snapshot), lambda: b.delete_snapshot(snap.snapshot)):
                with pytest.raises(TangramError) as e:
                    call()
                assert e.value.status == 404 and snap.snapshot in e.value.message
            assert a.restore(snap.snapshot).exec("cat f").run.stdout == "mine\n"
    finally:
        srv.stop()


def test_draining_a_node_of_one_machine_is_refused_naming_why(server):
    r = httpx.post(f"{server.url}/v1/cluster/nodes/anything/drain")
    assert r.status_code == 422 and "Ray" in r.json()["message"], r.text
