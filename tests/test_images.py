"""Image import: layers unpacked once into the content-addressed cache in overlayfs' format, and
bad archives refused before anything is cached. Images are built by the tests (tests/imagekit.py)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
from imagekit import docker_archive, layer_tar, oci_archive

from arl_tangram.managers.sandbox.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking whiteouts (mknod, trusted xattrs) needs root")

BASE = [("dir", "etc"), ("file", "etc/motd", "hello\n"), ("file", "etc/gone", "old\n"),
        ("dir", "opt/data"), ("file", "opt/data/old.txt", "old"),
        ("file", "usr/bin/tool", "#!/bin/sh\necho tool\n", 0o750),
        ("dir", "secret", 0o700)]
TOP = [("whiteout", "etc/gone"), ("opaque", "opt/data"), ("file", "opt/data/new.txt", "new"),
       ("symlink", "etc/motd.link", "/etc/motd"), ("symlink", "usr/bin/rel", "../../etc/motd"),
       ("file", "repo/a.py", "print(1)\n"), ("hardlink", "repo/b.py", "repo/a.py")]


def _store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def _cached(store: ImageStore) -> list[str]:
    d = store.root / "layers"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_docker_archive_is_unpacked_in_overlay_format(tmp_path):
    store = _store(tmp_path)
    img = store.import_path(docker_archive(tmp_path / "a.tar", [BASE, TOP]), "tiny")
    assert len(img.layers) == 2 and img.env["PATH"].startswith("/usr/local/bin")
    base, top = (store.layer_dir(d) for d in img.layers)
    gone = os.lstat(top / "etc/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # an overlay whiteout
    assert os.getxattr(top / "opt/data", "trusted.overlay.opaque") == b"y"
    assert os.readlink(top / "etc/motd.link") == "/etc/motd" and os.readlink(top / "usr/bin/rel") == "../../etc/motd"
    assert os.stat(top / "repo/a.py").st_ino == os.stat(top / "repo/b.py").st_ino
    assert stat.S_IMODE(os.stat(base / "usr/bin/tool").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(base / "secret").st_mode) == 0o700
    assert os.stat(base / "etc/motd").st_mtime == 1_700_000_000


def test_layers_are_content_addressed_shared_and_removed_with_their_last_image(tmp_path):
    store = _store(tmp_path)
    a = store.import_path(docker_archive(tmp_path / "a.tar", [BASE, TOP]), "a")
    b = store.import_path(oci_archive(tmp_path / "b.tar", [BASE, [("file", "other", "x")]]), "b:v1")
    assert a.layers[0] == b.layers[0]  # the same base, gzip or not: unpacked once
    assert len(_cached(store)) == 3
    assert [i.name for i in store.list()] == ["a", "b:v1"] and store.get("b:v1").env["TANGRAM_IMAGE"] == "oci"
    gone = store.remove("a")
    assert gone == [a.layers[1]] and len(_cached(store)) == 2
    store.remove("b:v1")
    assert _cached(store) == [] and store.list() == []
    with pytest.raises(ImageError, match="no image named 'a'"):
        store.get("a")


def test_a_root_filesystem_directory_is_imported_with_its_links(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/motd").write_text("dir\n")
    os.link(root / "etc/motd", root / "etc/motd.hard")
    os.symlink("/etc/motd", root / "motd")
    store = _store(tmp_path)
    img = store.import_path(root, "fromdir")
    layer = store.layer_dir(img.layers[0])
    assert (layer / "etc/motd").read_text() == "dir\n" and os.readlink(layer / "motd") == "/etc/motd"
    assert os.stat(layer / "etc/motd").st_ino == os.stat(layer / "etc/motd.hard").st_ino
    assert store.import_path(root, "again").layers == img.layers


def _raw(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    return ("raw", info, data)


BAD = {
    "dotdot": ([_raw("../evil", data=b"x")], "escapes the root"),
    "dotdot-deep": ([_raw("a/../../evil", data=b"x")], "escapes the root"),
    "absolute": ([_raw("/etc/evil", data=b"x")], "absolute path"),
    "symlink-out": ([("symlink", "a/link", "../../../etc/passwd")], "points out of the image"),
    "hardlink-out": ([("hardlink", "a/h", "../../etc/passwd")], "escapes the root"),
    "hardlink-absent": ([("hardlink", "a/h", "etc/passwd")], "names no earlier file"),
    "through-symlink": ([("symlink", "etc", "/tmp"), ("file", "etc/x", "x")], "under the symlink"),
    "device": ([("chr", "dev/mem")], "device node"),
    "fifo": ([_raw("p", tarfile.FIFOTYPE)], "FIFO"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_layer_fails_the_import_before_anything_is_cached(tmp_path, case):
    entries, message = BAD[case]
    store = _store(tmp_path)
    # the bad layer comes second: the good first layer must not be cached either
    archive = docker_archive(tmp_path / "bad.tar", [BASE, entries])
    with pytest.raises(ImageError, match=message):
        store.import_path(archive, "bad")
    assert _cached(store) == [] and store.list() == []


def test_truncated_unknown_and_malformed_archives_are_refused(tmp_path):
    store = _store(tmp_path)
    good = docker_archive(tmp_path / "good.tar", [BASE, TOP]).read_bytes()
    cases = {
        "truncated": (good[: len(good) // 2], "truncated|corrupt|missing"),
        "random": (os.urandom(4096), "not an image archive|not a tar"),
        "empty-tar": (_tar({"hello.txt": b"hi"}), "neither a docker-save nor an OCI"),
        "bad-manifest": (_tar({"manifest.json": b"{not json"}), "manifest.json: not valid JSON"),
        "missing-layer": (_tar({"manifest.json": b'[{"Config": "c.json", "Layers": ["x/layer.tar"]}]'}),
                          "missing from the archive"),
        "corrupt-layer": (_tar({"manifest.json": b'[{"Layers": ["l.tar"]}]', "l.tar": layer_tar(BASE)[:700]}),
                          "truncated or corrupt"),
        "zstd-layer": (_tar({"manifest.json": b'[{"Layers": ["l.tar"]}]', "l.tar": b"\x28\xb5\x2f\xfd" + b"0" * 64}),
                       "zstd"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(data)
        with pytest.raises(ImageError, match=message):
            store.import_path(path, name)
    assert _cached(store) == []
    with pytest.raises(ImageError, match="does not exist"):
        store.import_path(tmp_path / "nope.tar", "x")
    with pytest.raises(ImageError, match="--name"):
        store.import_path(tmp_path / "good.tar", "../evil")


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_image_cli_imports_lists_removes_and_refuses_bad_archives(tmp_path):
    import json

    from typer.testing import CliRunner

    from arl_tangram.cli import app

    runner = CliRunner()
    store = ["--store", str(tmp_path / "store")]
    ok = runner.invoke(app, ["image", "import", str(docker_archive(tmp_path / "a.tar", [BASE, TOP])), "--name",
                             "tiny", *store])
    assert ok.exit_code == 0, ok.output
    assert len(json.loads(ok.stdout)["layers"]) == 2
    listed = runner.invoke(app, ["image", "ls", *store])
    assert [i["name"] for i in json.loads(listed.stdout)] == ["tiny"]
    bad = runner.invoke(app, ["image", "import", str(docker_archive(tmp_path / "b.tar", [BAD["dotdot"][0]])),
                              "--name", "bad", *store])
    assert bad.exit_code == 2 and "escapes the root" in bad.output
    gone = runner.invoke(app, ["image", "rm", "tiny", *store])
    assert gone.exit_code == 0 and json.loads(gone.stdout)["layers_deleted"] == 2
    missing = runner.invoke(app, ["image", "rm", "tiny", *store])
    assert missing.exit_code == 2 and "no image named 'tiny'" in missing.output


def test_docker_save_variants_shared_layer_links_and_the_oci_flavoured_layout(tmp_path):
    import hashlib
    import json

    base, top = layer_tar(BASE), layer_tar(TOP)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # docker save links a repeated layer to its first copy
        for name, data in {"a/layer.tar": base, "c/layer.tar": top,
                           "manifest.json": json.dumps([{"Layers": ["a/layer.tar", "b/layer.tar", "c/layer.tar"]}])
                           .encode()}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("b/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../a/layer.tar"
        tar.addfile(link)
    (tmp_path / "linked.tar").write_bytes(buf.getvalue())
    store = _store(tmp_path)
    img = store.import_path(tmp_path / "linked.tar", "linked")
    assert img.layers[0] == img.layers[1] != img.layers[2]
    blobs = {f"blobs/sha256/{hashlib.sha256(t).hexdigest()}": t for t in (base, top)}  # Docker 25+
    layout = _tar({**blobs, "oci-layout": b"{}", "index.json": b'{"manifests": []}',
                   "manifest.json": json.dumps([{"Layers": list(blobs)}]).encode()})
    (tmp_path / "oci-docker.tar").write_bytes(layout)
    assert store.import_path(tmp_path / "oci-docker.tar", "docker25").layers == (img.layers[0], img.layers[2])


# -- a pulled layer's sync behind it (``ImageStore._place``, ``check_unsynced``) ----------------------

def _pulled(store: ImageStore, members: list) -> str:
    """A layer as a pull places it (``unpack_layer``): its digest."""
    return store.unpack_layer(io.BytesIO(layer_tar(members)), "layer 0")[0]


def test_a_pulled_layer_is_visible_at_once_and_synced_behind_it(tmp_path, monkeypatch):
    import threading

    from arl_tangram.managers.sandbox import images
    gate, seen = threading.Event(), []

    def slow_syncfs(path):  # the disk's flush, held until the test lets it go
        seen.append(sorted(p.name for p in (store.root / images.UNSYNCED).iterdir()))
        gate.wait(10)
    monkeypatch.setattr(images, "syncfs", slow_syncfs)
    store = _store(tmp_path)
    digest = _pulled(store, BASE)
    # the pull is done and its layer usable while the sync has not ended: its marker says so
    assert (store.layer_dir(digest) / "etc/motd").read_text() == "hello\n"
    assert (store.root / images.UNSYNCED / digest).read_text() == images.boot_id()
    assert not store.synced(timeout=0.2)
    gate.set()
    assert store.synced(timeout=10)
    assert seen == [[digest]] and not (store.root / images.UNSYNCED / digest).exists()


def test_an_import_or_a_store_syncing_first_syncs_before_the_layer_appears(tmp_path, monkeypatch):
    from arl_tangram.managers.sandbox import images
    visible_at_sync = []
    monkeypatch.setattr(images, "syncfs", lambda path: visible_at_sync.append(
        [n for n in _cached(store) if not n.startswith(".")]))
    store = ImageStore(tmp_path / "store", sync_behind=False)
    first = _pulled(store, BASE)
    store.import_path(docker_archive(tmp_path / "a.tar", [TOP]), "top")
    # each sync ran before its layer was renamed into place (only the one before it visible), and
    # no marker was written
    assert visible_at_sync == [[], [first]]
    assert not (store.root / images.UNSYNCED).exists()


def test_a_start_removes_a_layer_left_unsynced_by_another_boot_and_syncs_this_boots(tmp_path, monkeypatch):
    from arl_tangram.managers.sandbox import images
    store = _store(tmp_path)
    img = store.import_path(docker_archive(tmp_path / "a.tar", [BASE, TOP]), "tiny")
    base, top = img.layers
    markers = store.root / images.UNSYNCED
    markers.mkdir()
    (markers / base).write_text("another-boot")  # the machine went down before its sync
    (markers / top).write_text(images.boot_id())  # a process of this boot was killed before it
    (markers / "not-a-digest").write_text("x")
    synced = []
    monkeypatch.setattr(images, "syncfs", lambda path: synced.append(path))
    assert store.check_unsynced() == 1
    assert not store.has_layer(base) and store.has_layer(top)
    assert store.synced(timeout=10) and synced
    assert sorted(p.name for p in markers.iterdir()) == ["not-a-digest"]
    with pytest.raises(ImageError, match="missing"):  # named, not used half there: a pull fetches it again
        store.get("tiny")
