"""Task images from registries, for real: Debian's distribution registry (``docker-registry``) on
loopback, images pushed with ``skopeo`` from OCI layouts the tests write (tests/registrykit.py),
and pulls into the image store through a proxy that counts requests and misbehaves on demand.
Without the tools the registry tests skip naming them (``apt-get install -y docker-registry
skopeo``); the parsing tests run anywhere."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time

import pytest
from imagekit import docker_archive, host_tools, layer_tar
from registrykit import MISSING, Layout, Proxy, Registry, Rule, TokenServer, free_port, push

from arl_tangram.managers.sandbox.images import ImageError, ImageStore
from arl_tangram.managers.sandbox.registry import (BadReference, DigestMismatch, NoPlatform, NotFound, PullLimits,
                                                   RegistriesConfig, RegistryConfigError, TooLarge, Unauthorized,
                                                   Unreachable, parse, pull)
from arl_tangram.managers.sandbox.registry.auth import parse_challenges
from arl_tangram.managers.sandbox.registry.client import RegistryClient
from arl_tangram.managers.sandbox.registry.config import docker_credentials

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking whiteouts (mknod, trusted xattrs) needs root")
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)} (apt-get install -y "
                                 "docker-registry skopeo)")

BASE = [("dir", "etc"), ("file", "etc/motd", "from the base\n"), ("file", "etc/gone", "deleted above\n"),
        ("file", "usr/share/doc/big.txt", "x" * 50_000)]
BASE_TOP = [("whiteout", "etc/gone"), ("file", "etc/os-release", "ID=tiny\n"), ("symlink", "etc/motd.link", "motd")]


def app_layer(n: int) -> list[tuple]:
    return [("dir", "repo"), ("file", "repo/app.py", f"VERSION = {n}\n"), ("file", f"repo/only{n}.txt", str(n))]


# -- references, config, challenges (no registry) --------------------------------------------------

def test_references_are_read_as_docker_reads_them():
    cases = {
        "python:3.12": ("docker.io", "library/python", "3.12", ""),
        "python": ("docker.io", "library/python", "latest", ""),
        "me/tool": ("docker.io", "me/tool", "latest", ""),
        "index.docker.io/library/busybox:1": ("docker.io", "library/busybox", "1", ""),
        "ghcr.io/org/repo:tag": ("ghcr.io", "org/repo", "tag", ""),
        "127.0.0.1:5000/a/b/c:v1.2-x": ("127.0.0.1:5000", "a/b/c", "v1.2-x", ""),
        "localhost/x": ("localhost", "x", "latest", ""),
        "quay.io/a/b@sha256:" + "0" * 64: ("quay.io", "a/b", "", "sha256:" + "0" * 64),
        "a/b:t@sha256:" + "f" * 64: ("docker.io", "a/b", "t", "sha256:" + "f" * 64),
    }
    for text, (registry, repository, tag, digest) in cases.items():
        ref = parse(text)
        assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest), text
    assert str(parse("python:3.12")) == "docker.io/library/python:3.12"
    assert parse("python:3.12").api_host == "registry-1.docker.io" and parse("ghcr.io/a:b").api_host == "ghcr.io"
    bad = {"Python:3": "'Python' is not a valid repository", "a/b@sha256:123": "not a sha256 digest",
           "a:b:c": "not a valid repository", "a/b:-x": "not a valid tag", "": "empty",
           "a//b": "not a valid repository", "ex ample/x": "not a valid", "a/b@md5:" + "0" * 32: "not a sha256"}
    for text, message in bad.items():
        with pytest.raises(BadReference, match=message) as e:
            parse(text)
        assert repr(text) in str(e.value)  # every error names the reference as given
    with pytest.raises(ImageError):  # what callers catch
        parse("UPPER")


def test_the_registries_config_is_validated_naming_the_field(tmp_path):
    cfg = RegistriesConfig.from_toml({"policy": "tangram", "registries": [
        {"host": "index.docker.io", "mirrors": ["https://mirror.example:5000/", "127.0.0.1:5001"]},
        {"host": "127.0.0.1:5001", "insecure": True},
        {"host": "ghcr.io", "username": "me", "password": "secret"}]})
    assert cfg.host("docker.io").mirrors == ["mirror.example:5000", "127.0.0.1:5001"]
    assert cfg.host("127.0.0.1:5001").insecure and not cfg.host("quay.io").insecure
    assert cfg.credentials("ghcr.io") == ("me", "secret")
    client = RegistryClient(cfg)
    eps = client.endpoints(parse("python:3"))
    assert [(e.base, e.mirror) for e in eps] == [("https://mirror.example:5000", True),
                                                 ("http://127.0.0.1:5001", True),
                                                 ("https://registry-1.docker.io", False)]
    asyncio.run(client.aclose())
    bad = [({"registries": [{"host": "a b"}]}, "registries.0.host"),
           ({"registries": [{"host": "x.io", "insecure": "maybe"}]}, "registries.0.insecure"),
           ({"registries": [{"host": "x.io", "mirrors": ["http://m.io"]}]}, "registries.0.mirrors.*insecure = true"),
           ({"registries": [{"host": "x.io", "username": "u"}]}, "registries.0.*username and password"),
           ({"registries": [{"host": "x.io"}, {"host": "x.io"}]}, "registries: .*two tables"),
           ({"registries": [{"host": "x.io", "colour": 1}]}, "registries.0.colour"),
           ({"registries": {"host": "x.io"}}, "registries")]
    for data, message in bad:
        with pytest.raises(RegistryConfigError, match=message):
            RegistriesConfig.from_toml(data)
    # Docker's config.json: auths by host (Docker Hub under its v1 URL), "auth" or username/password
    dc = tmp_path / "config.json"
    dc.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hubuser:hubpass").decode()},
        "127.0.0.1:5000": {"username": "u", "password": "p:w"}}, "credsStore": "desktop"}))
    assert docker_credentials("docker.io", dc) == ("hubuser", "hubpass")
    assert docker_credentials("127.0.0.1:5000", dc) == ("u", "p:w")
    assert docker_credentials("ghcr.io", dc) is None and docker_credentials("x", tmp_path / "none.json") is None
    cfg = RegistriesConfig.from_toml({"docker_config": str(dc)})
    assert cfg.credentials("docker.io") == ("hubuser", "hubpass")


def test_www_authenticate_challenges_are_parsed():
    [c] = parse_challenges('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                           'scope="repository:library/python:pull"')
    assert c.scheme == "bearer" and c.params == {"realm": "https://auth.docker.io/token",
                                                 "service": "registry.docker.io",
                                                 "scope": "repository:library/python:pull"}
    two = parse_challenges('Basic realm="a, \\"quoted\\"", Bearer realm="https://t/x",service=s')
    assert [(c.scheme, c.params) for c in two] == [("basic", {"realm": 'a, "quoted"'}),
                                                   ("bearer", {"realm": "https://t/x", "service": "s"})]


# -- the store's layer checks, for pulled layers too ------------------------------------------------

@root_only
def test_a_layer_cannot_write_through_a_link_it_replaced(tmp_path):
    """A symlink to a host directory, then a directory entry of the same name, then a file in
    it: the file lands in the layer (the symlink is replaced), never on the host; and a hard link
    to a file under a directory since replaced by a symlink is refused."""
    outside = tmp_path / "host"
    outside.mkdir()
    os.chmod(outside, 0o700)
    store = ImageStore(tmp_path / "store")
    img = store.import_path(docker_archive(tmp_path / "a.tar", [[
        ("symlink", "d", str(outside)), ("dir", "d", 0o777), ("file", "d/planted", "x")]]), "replaced")
    layer = store.layer_dir(img.layers[0])
    assert stat.S_ISDIR(os.lstat(layer / "d").st_mode) and (layer / "d/planted").read_text() == "x"
    assert list(outside.iterdir()) == [] and stat.S_IMODE(os.stat(outside).st_mode) == 0o700
    # a directory given a mode, then replaced by a symlink: the mode is not applied through it
    store.import_path(docker_archive(tmp_path / "b.tar", [[("dir", "e", 0o777), ("symlink", "e", str(outside))]]),
                      "relinked")
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o700
    for entries in ([("file", "d/shadow", "x"), ("symlink", "d", str(outside)), ("hardlink", "h", "d/shadow")],
                    [("file", "d/shadow", "x"), ("file", "d", "now a file"), ("hardlink", "h", "d/shadow")]):
        with pytest.raises(ImageError, match="under the symlink|names no earlier file"):
            store.import_path(docker_archive(tmp_path / "c.tar", [entries]), "linked")


def _rich_layer() -> bytes:
    entries = [("dir", "ro", 0o555)]
    entries += [("file", f"ro/f{i}", f"file {i}\n" * i, 0o644 if i % 3 else 0o755) for i in range(150)]
    entries += [("hardlink", "ro/linked", "ro/f7"), ("file", "ro/t", "t"), ("hardlink", "ro/t2", "ro/t"),
                ("file", "x", "first"), ("dir", "x", 0o700),
                ("file", "x/in", "in"), ("file", "y", "old"), ("file", "y", "new", 0o4755),
                ("file", "gone", "soon"), ("whiteout", "gone"), ("file", "big", "b" * (5 << 20)),
                ("hardlink", "big2", "big"), ("symlink", "ro/up", "../x/in"), ("symlink", "s", "x"),
                ("dir", "s", 0o750), ("file", "s/f", "f"),
                ("dir", "d", 0o755), ("file", "d/a", "a"), ("symlink", "d/l", "a"), ("file", "d", "a file now"),
                ("dir", "o", 0o755), ("file", "o/keep", "k"), ("opaque", "o")]
    entries += [("file", f"many/m{i}", "m" * (i * 997 % 70_000)) for i in range(400)]
    owned = tarfile.TarInfo("owned")
    owned.uid, owned.gid, owned.mode, owned.size, owned.mtime = 1234, 5678, 0o2750, 3, 1_600_000_000
    entries.append(("raw", owned, b"abc"))
    link = tarfile.TarInfo("ownedlink")
    link.type, link.linkname, link.uid, link.gid, link.mtime = tarfile.SYMTYPE, "owned", 4321, 8765, 1_500_000_000
    entries.append(("raw", link, b""))
    return layer_tar(entries)


def _gids(root) -> dict:
    return {os.path.relpath(os.path.join(d, n), root): os.lstat(os.path.join(d, n)).st_gid
            for d, dirs, files in os.walk(root) for n in dirs + files}


@root_only
def test_a_child_process_unpacks_the_tree_one_thread_unpacks(tmp_path):
    """The unpacking child (``unpackproc``; gzip, zstd, or plain layers): hard links, files and a
    symlink replaced by directories and by other files, a directory replaced by a file, an opaque
    directory, whiteouts of files just made, a read-only directory, setuid and other owners (of a
    file and of a symlink), a large file and many small ones: the same tree, modes, owners and
    mtimes as written in order in this process."""
    import gzip

    import zstandard

    from arl_tangram.managers.sandbox.registry.unpackproc import unpack_in_child
    from arl_tangram.managers.sandbox.unpack import check_and_unpack

    tar = _rich_layer()
    blobs = {"plain": tar, "gzip": gzip.compress(tar), "zstd": zstandard.ZstdCompressor().compress(tar)}
    trees = []
    for how, kind, unpack in (("order", "plain", lambda s, d: check_and_unpack(s, d, "layer 0", None)),
                              *((f"child-{k}", k, lambda s, d: unpack_in_child(s, d, "layer 0", None))
                                for k in blobs)):
        dest = tmp_path / how
        dest.mkdir()
        digest, size = unpack(io.BytesIO(blobs[kind]), dest)
        trees.append((digest, size, _tree(dest), _gids(dest), os.getxattr(dest / "o", "trusted.overlay.opaque")))
    assert len(trees) == 4 and all(t == trees[0] for t in trees)
    assert trees[0][0] == hashlib.sha256(tar).hexdigest()
    tree, gids = trees[2][2], trees[2][3]  # (gzip)
    assert tree["ro/linked"] == tree["ro/f7"] and os.stat(tmp_path / "child-gzip/ro/linked").st_nlink == 2
    assert tree["y"][1:] == (0o4755, 0, 1_700_000_000 * 10**9, b"new") and tree["x/in"][4] == b"in"
    assert stat.S_ISCHR(tree["gone"][0]) and tree["owned"][1:3] == (0o2750, 1234) and gids["owned"] == 5678
    assert tree["ownedlink"][2:] == (4321, 1_500_000_000 * 10**9, "owned") and gids["ownedlink"] == 8765
    assert tree["d"][4] == b"a file now" and "d/a" not in tree and tree["many/m7"][4] == b"m" * 6979
    assert stat.S_IMODE(os.stat(tmp_path / "child-zstd/ro").st_mode) == 0o555


def _procs_naming(text: str) -> list[int]:
    """Processes whose command line holds ``text`` (an unpacking process names its ``dest``)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


class _Held:
    """A layer's bytes as a stream that stops after ``first`` bytes until ``go`` is set."""

    def __init__(self, blob: bytes, first: int) -> None:
        import threading

        self.blob, self.first, self.pos, self.go = blob, first, 0, threading.Event()
        self.held = threading.Event()

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.first:
            self.held.set()
            self.go.wait(30)
        end = self.pos + (1 << 16) if self.pos >= self.first else min(self.first, self.pos + (1 << 16))
        out, self.pos = self.blob[self.pos:end], min(end, len(self.blob))
        return out


@root_only
def test_a_full_disk_fails_the_layer_as_the_disks_and_leaves_nothing(tmp_path):
    """No inodes left in the unpacking child: the layer fails as the disk's error (``infra``),
    naming it, with nothing visible and no process of the unpacking left."""
    from arl_tangram.managers.sandbox.registry.unpackproc import unpack_in_child

    blob = _rich_layer()
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "nr_inodes=120", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = ImageStore(small / "store")
        with pytest.raises(ImageError, match=r"layer 0: cannot unpack: \[Errno 28\]") as e:
            store.unpack_layer(io.BytesIO(blob), "layer 0", unpack=unpack_in_child)
        assert e.value.infra and store.list() == []
        assert not os.listdir(small / "store" / "layers") and not _procs_naming(str(small))
    finally:
        subprocess.run(["umount", str(small)], check=True)


@root_only
def test_a_killed_unpacking_child_is_ours_and_leaves_nothing(tmp_path):
    """The unpacking child killed part way: an infrastructure error naming the layer, nothing
    visible, no process of the unpacking left."""
    import gzip
    import threading

    from arl_tangram.managers.sandbox.registry.unpackproc import unpack_in_child

    blob = gzip.compress(_rich_layer())
    store = ImageStore(tmp_path / "store")
    held = _Held(blob, len(blob) // 2)
    result: list = []
    runner = threading.Thread(target=lambda: result.append(_catch(lambda: store.unpack_layer(
        held, "layer 0", unpack=unpack_in_child))))
    runner.start()
    assert held.held.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _procs_naming(str(store.root)):
        time.sleep(0.02)
    children = _procs_naming(str(store.root))
    assert len(children) == 1
    os.kill(children[0], signal.SIGKILL)
    held.go.set()
    runner.join(60)
    error = result[0]
    assert isinstance(error, ImageError) and error.infra, error
    assert str(error).startswith("layer 0: the unpacking process ended (-9) without an answer")
    assert store.list() == [] and not os.listdir(store.root / "layers")
    assert not _procs_naming(str(tmp_path))


@root_only
def test_a_pulling_process_killed_outright_leaves_no_unpacking_process(tmp_path):
    """The process feeding an unpacking child killed (SIGKILL) half way through a layer: the child
    reads its pipe's end, fails the layer and ends; none is left."""
    blob = _rich_layer()
    (tmp_path / "layer").write_bytes(blob)
    dest = tmp_path / "dest"
    dest.mkdir()
    feeder = subprocess.Popen([sys.executable, "-c", f"""
import io, time
from arl_tangram.managers.sandbox.registry.unpackproc import unpack_in_child
blob = open({str(tmp_path / "layer")!r}, "rb").read()
class Half:
    pos = 0
    def read(self, n=-1):
        if self.pos >= len(blob) // 2:
            time.sleep(60)
        out = blob[self.pos:self.pos + (1 << 16)]
        self.pos += len(out)
        return out
unpack_in_child(Half(), {str(dest)!r}, "layer 0", None)
"""])
    def unpacking() -> list[int]:  # (the feeder's own command line names ``dest`` too)
        return [p for p in _procs_naming(str(dest)) if p != feeder.pid]

    try:
        deadline = time.monotonic() + 20
        while not unpacking() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(unpacking()) == 1
        feeder.kill()
        feeder.wait()
        deadline = time.monotonic() + 10
        while unpacking() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert unpacking() == []
    finally:
        feeder.kill()
        feeder.wait()


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # handed to the test's thread
        return e


@root_only
def test_zstd_layers_import_and_a_corrupt_one_is_named(tmp_path):
    import zstandard

    store = ImageStore(tmp_path / "store")
    tar = layer_tar(BASE)
    z = zstandard.ZstdCompressor().compress(tar)
    path = tmp_path / "z.tar"
    with tarfile.open(path, "w") as out:
        for name, data in (("l.tar", z), ("manifest.json", b'[{"Layers": ["l.tar"]}]')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    img = store.import_path(path, "zstd")
    assert (store.layer_dir(img.layers[0]) / "etc/motd").read_text() == "from the base\n"
    assert img.layers[0] == hashlib.sha256(tar).hexdigest()  # the same layer as its gzip twin
    with pytest.raises(ImageError, match="truncated or corrupt"):
        store.unpack_layer(io.BytesIO(z[: len(z) // 2]), "layer 0")
    assert sorted(p.name for p in (store.root / "layers").iterdir()) == [img.layers[0]]


def _tar_bytes(fmt: int, members: list[tuple[tarfile.TarInfo, bytes | None]], **kw) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, **kw) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "", **attrs) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mtime, info.mode = kind, size, link, 1_700_000_000, 0o644
    for k, v in attrs.items():
        setattr(info, k, v)
    return info


def _stream(data: bytes, chunk: int = 700) -> tuple[list[tuple], str]:
    """The members the store's reader finds in ``data`` (fed ``chunk`` bytes at a time, so that
    headers and files straddle chunks), each with its data; and the uncompressed tar's sha256."""
    from arl_tangram.managers.sandbox.layertar import Inflated, TarStream

    src = io.BytesIO(data)
    inflated = Inflated(lambda n: src.read(min(n, chunk)))
    tar = TarStream(inflated)
    out = [(m.name, m.type, m.linkname, m.size, m.mode, m.uid, m.gid, m.mtime,
            b"".join(bytes(p) for p in tar.data()) if m.isreg() else None) for m in tar]
    for _ in inflated:
        pass
    return out, inflated.digest()


def _tarfile_view(data: bytes) -> list[tuple]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        return [(m.name, m.type, m.linkname, m.size, m.mode, m.uid, m.gid, m.mtime,
                 tar.extractfile(m).read() if m.isreg() else None) for m in tar]


def test_the_layer_reader_finds_the_members_tarfile_finds_in_every_format():
    from arl_tangram.managers.sandbox.layertar import BadLayer

    deep = "d" * 90 + "/" + "e" * 60 + "/file.txt"  # needs ustar's prefix, GNU's long name or pax
    members = [(_info("etc", tarfile.DIRTYPE, mode=0o755), None),
               (_info("etc/motd", size=6), b"hello\n"),
               (_info(deep, size=3000), os.urandom(3000)),
               (_info("bin/long-link", tarfile.SYMTYPE, link="/" + "t" * 150), None),
               (_info("etc/motd.hard", tarfile.LNKTYPE, link="etc/motd"), None),
               (_info("big-owner", size=1, uid=3_000_000, gid=7), b"x"),
               (_info("caf\u00e9/\u00fc.txt", size=2), b"ok"),
               (_info("empty", size=0), b"")]
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        data = _tar_bytes(fmt, members)
        got, digest = _stream(data)
        assert got == _tarfile_view(data), fmt
        assert digest == hashlib.sha256(data).hexdigest() and got[2][0] == deep and got[5][5] == 3_000_000
    ustar = _tar_bytes(tarfile.USTAR_FORMAT, [m for m in members if len(m[0].linkname) < 100 and m[0].uid < 1 << 21
                                              and m[0].name.isascii()])
    assert _stream(ustar)[0] == _tarfile_view(ustar)
    # a pax global header applies to every member after it
    glob = _tar_bytes(tarfile.PAX_FORMAT, members[:3], pax_headers={"uid": "4242", "comment": "x"})
    got = _stream(glob)[0]
    assert got == _tarfile_view(glob) and {m[5] for m in got} == {4242}
    # compressed: gzip members one after another with zero padding between, zstd frames
    import gzip

    import zstandard

    plain = _tar_bytes(tarfile.PAX_FORMAT, members)
    half = len(plain) // 2
    gz = gzip.compress(plain[:half]) + b"\0" * 10 + gzip.compress(plain[half:]) + b"\0" * 3
    zst = zstandard.ZstdCompressor().compress(plain[:half]) + zstandard.ZstdCompressor().compress(plain[half:])
    for packed in (gz, zst):
        got, digest = _stream(packed, chunk=333)
        assert got == _tarfile_view(plain) and digest == hashlib.sha256(plain).hexdigest()
    # what no reader may take: garbage after the gzip stream, a bad checksum, a cut, a sparse file
    bad_sum = bytearray(plain)
    bad_sum[0] ^= 1
    sparse = bytearray(_tar_bytes(tarfile.GNU_FORMAT, [(_info("s", size=1), b"s")]))
    sparse[156:157] = tarfile.GNUTYPE_SPARSE
    sparse[148:156] = b"%06o\0 " % (sum(sparse[:148]) + sum(sparse[156:512]) + 256)
    cases = {"garbage": (gzip.compress(plain) + b"junk", "not gzip follow"),
             "checksum": (bytes(bad_sum), "bad checksum"),
             "cut": (plain[:1000], "truncated or corrupt"),
             "no end": (plain[:plain.rindex(b"ok") // 512 * 512 + 1024], "no end-of-archive marker"),
             "sparse": (bytes(sparse), "sparse file")}
    for what, (data, message) in cases.items():
        with pytest.raises(BadLayer, match=message):
            _stream(data)


def test_the_agent_compiled_by_an_image_keeps_only_its_modules_compiled_files(tmp_path):
    from arl_tangram.managers.sandbox import agentpyc

    # a "sandbox" that plants a link, a stray file and a directory beside the real compilation
    def sandbox(out: str) -> list[str]:
        junk = f'ln -s /etc/passwd {out}/loop.cpython-311.pyc.x; ln -s /etc/passwd {out}/zz.cpython-311.pyc; ' \
               f'echo x > {out}/evil.txt; mkdir {out}/loop.d; exec "$@"'
        return ["/bin/sh", "-c", junk, "sh", sys.executable, "-I"]

    made = agentpyc.compile_for(tmp_path, "a" * 64, sandbox)
    names = sorted(os.listdir(made))
    tag = sys.implementation.cache_tag
    assert f"loop.{tag}.pyc" in names and f"__init__.{tag}.pyc" in names
    assert all(n.endswith(f".{tag}.pyc") for n in names) and "zz.cpython-311.pyc" not in names
    assert all(stat.S_IMODE(os.lstat(os.path.join(made, n)).st_mode) == 0o644 for n in names)
    assert agentpyc.ready(tmp_path, "a" * 64) == made and agentpyc.ready(tmp_path, "b" * 64) is None
    assert agentpyc.compile_for(tmp_path, "b" * 64, lambda out: ["/bin/false"]) is None  # it could not
    assert not [p for p in (tmp_path / "agents").iterdir() if p.name.startswith(".")]
    assert agentpyc.prune(tmp_path, {"c" * 64}) == 1 and not list((tmp_path / "agents").iterdir())


# -- against a real registry -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """One registry with: tiny/base (two layers, gzip), tiny/app1 and tiny/app2 on it (app1's own
    layer zstd, app2 a Docker schema-2 image), tiny/multi (an index: arm64 and amd64),
    tiny/armonly (an index without amd64), tiny/bad (a layer escaping the root), tiny/sh (a
    shell and tools, for a session)."""
    if MISSING:
        pytest.skip(f"needs {' and '.join(MISSING)} (apt-get install -y docker-registry skopeo)")
    d = tmp_path_factory.mktemp("origin")
    reg = Registry(d / "registry")
    lay = Layout(d / "layout")
    lay.tag("base", lay.image([BASE, BASE_TOP]))
    lay.tag("app1", lay.image([BASE, BASE_TOP, app_layer(1)], ["gzip", "gzip", "zstd"]))
    lay.tag("app2", lay.image([BASE, BASE_TOP, app_layer(2)], ["gzip", "gzip", "none"]))
    for n in range(3, 5):
        lay.tag(f"app{n}", lay.image([BASE, BASE_TOP, app_layer(n)]))
    arm = lay.image([[("file", "arch", "arm64")]], arch="arm64")
    amd = lay.image([[("file", "arch", "amd64")]])
    lay.tag("multi", lay.index([arm, amd]))
    lay.tag("armonly", lay.index([arm]))
    lay.tag("bad", lay.image([BASE, [("file", "../evil", "x")]]))
    lay.tag("device", lay.image([BASE, [("chr", "dev/mem")]]))
    sh = host_tools("/usr/bin/dash", "/usr/bin/cat", "/usr/bin/ls") + [("symlink", "usr/bin/sh", "dash")]
    lay.tag("sh", lay.image([sh, [("file", "etc/motd", "pulled\n")], [("whiteout", "etc/motd"),
                                                                      ("file", "repo/task.txt", "task 7\n")]]))
    for tag in ("base", "app1", "app3", "app4", "bad", "device", "sh"):
        push(lay, tag, f"{reg.host}/tiny/{tag}:v1")
    push(lay, "app2", f"{reg.host}/tiny/app2:v1", fmt="v2s2")
    push(lay, "multi", f"{reg.host}/tiny/multi:v1", all_images=True)
    push(lay, "armonly", f"{reg.host}/tiny/armonly:v1", all_images=True)
    yield reg
    reg.close()


@pytest.fixture
def proxy(origin):
    p = Proxy(origin.host)
    yield p
    p.close()


def _config(*hosts: str, **extra) -> RegistriesConfig:
    return RegistriesConfig.from_toml({"registries": [{"host": h, "insecure": True, **extra} for h in hosts]})


def _fast(cfg: RegistriesConfig, **kw) -> RegistryClient:
    return RegistryClient(cfg, **{"backoff_s": 0.01, "max_wait_s": 2.0, "timeout_s": 10.0, **kw})


def _pull(ref: str, store: ImageStore, cfg: RegistriesConfig, events=None, **kw):
    async def main():
        async with _fast(cfg, **kw.pop("client", {})) as c:
            return await pull(ref, store, cfg, events.append if events is not None else None, client=c, **kw)

    return asyncio.run(main())


@root_only
@needs_tools
def test_layers_are_shared_by_digest_an_image_on_a_base_fetches_only_its_own(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    events = []
    app1 = _pull(f"{proxy.host}/tiny/app1:v1", store, cfg, events)
    assert app1.name == f"{proxy.host}/tiny/app1:v1" and len(app1.layers) == 3 and app1.digest.startswith("sha256:")
    assert proxy.blob_gets() == 4  # the config and three layers
    base_dir, top_dir, own_dir = (store.layer_dir(d) for d in app1.layers)
    assert (base_dir / "etc/motd").read_text() == "from the base\n"
    gone = os.lstat(top_dir / "etc/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # an overlay whiteout, as import makes it
    assert os.readlink(top_dir / "etc/motd.link") == "motd" and (own_dir / "repo/app.py").read_text() == "VERSION = 1\n"
    assert {e.state for e in events if e.index >= 0} >= {"downloading", "unpacking", "done"}
    # app2 (Docker schema 2, its own layer uncompressed) on the same base: only its own layer and config
    before = proxy.blob_gets()
    events.clear()
    app2 = _pull(f"{proxy.host}/tiny/app2:v1", store, cfg, events)
    assert app2.layers[:2] == app1.layers[:2] and app2.layers[2] != app1.layers[2]
    assert proxy.blob_gets() - before == 2
    assert [e.state for e in events if e.index in (0, 1)] == ["cached", "cached"]
    # a base imported by hand counts too: the same layers under the same digests
    store2 = ImageStore(tmp_path / "store2")
    store2.import_path(docker_archive(tmp_path / "base.tar", [BASE, BASE_TOP]), "hand-made")
    before = proxy.blob_gets()
    _pull(f"{proxy.host}/tiny/app3:v1", store2, cfg)
    assert proxy.blob_gets() - before == 2
    # ls: sizes, and what each shares with the others
    usage = {u["name"]: u for u in store.usage()}
    own = len("VERSION = 1\n") + 1
    assert usage[app1.name]["size_bytes"] == app1.size_bytes and app1.size_bytes - usage[app1.name]["shared_bytes"] == own
    # a second pull of the same tag: the manifest is asked again, no blob is fetched
    before = proxy.blob_gets()
    assert _pull(f"{proxy.host}/tiny/app1:v1", store, cfg).id == app1.id and proxy.blob_gets() - before == 1
    # by digest, with the image in the store: no request at all
    hits = sum(proxy.hits.values())
    by_digest = f"{proxy.host}/tiny/app1@{app1.digest}"
    pulled = _pull(by_digest, store, cfg)
    assert pulled.layers == app1.layers and sum(proxy.hits.values()) > hits  # first time: fetched once
    hits = sum(proxy.hits.values())
    assert _pull(by_digest, store, cfg).id == pulled.id and sum(proxy.hits.values()) == hits


@root_only
@needs_tools
def test_an_index_gives_its_linux_amd64_image_and_one_without_is_a_clear_error(tmp_path, origin):
    store = ImageStore(tmp_path / "store")
    cfg = _config(origin.host)
    img = _pull(f"{origin.host}/tiny/multi:v1", store, cfg)
    assert (store.layer_dir(img.layers[0]) / "arch").read_text() == "amd64"
    with pytest.raises(NoPlatform, match=rf"{origin.host}/tiny/armonly:v1: no linux/amd64 image .*linux/arm64"):
        _pull(f"{origin.host}/tiny/armonly:v1", store, cfg)
    with pytest.raises(NotFound, match=rf"{origin.host}/tiny/base:nope: not found .*404"):
        _pull(f"{origin.host}/tiny/base:nope", store, cfg)
    with pytest.raises(NotFound, match="tiny/nothing:v1: not found"):
        _pull(f"{origin.host}/tiny/nothing:v1", store, cfg)
    assert [i.name for i in store.list()] == [img.name]


@root_only
@needs_tools
def test_429_and_5xx_are_retried_honouring_retry_after_and_a_dead_registry_is_named(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    proxy.rules += [Rule("/manifests/", ("status", 503, None), 2), Rule("/blobs/", ("status", 429, 1), 1),
                    Rule("/blobs/", ("status", 502, None), 1)]
    t = time.monotonic()
    img = _pull(f"{proxy.host}/tiny/base:v1", store, cfg)
    assert time.monotonic() - t >= 1.0  # Retry-After: 1 waited out (the backoff alone is ~0.01 s)
    assert proxy.hits[f"/v2/tiny/base/manifests/v1"] == 3 and len(img.layers) == 2
    # past the retries: an error naming the reference and what was answered
    proxy.rules.append(Rule("/manifests/", ("status", 503, None), 10))
    with pytest.raises(Unreachable, match=rf"{proxy.host}/tiny/app1:v1: .*HTTP 503.*3 times"):
        _pull(f"{proxy.host}/tiny/app1:v1", store, cfg, client={"retries": 2})
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unreachable, match=rf"{dead}/tiny/base:v1: cannot reach {dead}"):
        _pull(f"{dead}/tiny/base:v1", store, _config(dead), client={"retries": 1})
    with pytest.raises(Unreachable, match="no TLS.*insecure"):  # plain HTTP only where the config says so
        _pull(f"{proxy.host}/tiny/base:v1", store, RegistriesConfig(), client={"retries": 1})
    assert [i.name for i in store.list()] == [img.name]


@root_only
@needs_tools
def test_a_blob_that_does_not_match_its_digest_is_refused_and_nothing_is_left(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    proxy.rules.append(Rule("/blobs/", ("corrupt",), 1000))
    with pytest.raises(DigestMismatch, match=rf"{proxy.host}/tiny/app4:v1: blob sha256:\w+ .*does not match"):
        _pull(f"{proxy.host}/tiny/app4:v1", store, cfg, client={"retries": 0})
    layers = store.root / "layers"
    assert store.list() == [] and (not layers.exists() or not list(layers.iterdir()))
    assert not [p for p in (store.root / "blobs").rglob("*") if p.is_file() and "locks" not in p.parts]
    proxy.rules.clear()
    assert len(_pull(f"{proxy.host}/tiny/app4:v1", store, cfg).layers) == 3


@root_only
@needs_tools
def test_bad_layers_and_manifests_past_the_bounds_are_refused_naming_the_reference(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    with pytest.raises(ImageError, match=rf"{proxy.host}/tiny/bad:v1: layer 1 .*escapes the root"):
        _pull(f"{proxy.host}/tiny/bad:v1", store, cfg)
    with pytest.raises(ImageError, match=rf"{proxy.host}/tiny/device:v1: layer 1 .*device node"):
        _pull(f"{proxy.host}/tiny/device:v1", store, cfg)
    assert store.list() == []
    leftovers = [p.name for p in (store.root / "layers").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    # a manifest of thousands of layers, one declaring a huge size: refused before any blob
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "sha256:" + "a" * 64, "size": 10}
    config = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + "b" * 64, "size": 10}
    many = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": config, "layers": [layer] * 5000}).encode()
    huge = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": config, "layers": [{**layer, "size": 1 << 50}]}).encode()
    mtype = "application/vnd.oci.image.manifest.v1+json"
    proxy.rules += [Rule("/tiny/many/manifests/", ("body", many, mtype)),
                    Rule("/tiny/huge/manifests/", ("body", huge, mtype))]
    blobs = proxy.blob_gets()
    with pytest.raises(TooLarge, match=rf"{proxy.host}/tiny/many:v1: the manifest lists 5000 layers"):
        _pull(f"{proxy.host}/tiny/many:v1", store, cfg)
    with pytest.raises(TooLarge, match=rf"{proxy.host}/tiny/huge:v1: the manifest declares {1 << 50} bytes"):
        _pull(f"{proxy.host}/tiny/huge:v1", store, cfg)
    assert proxy.blob_gets() == blobs
    # an image whose files expand past the limit is refused while it unpacks (a fresh store: the
    # bad images' good base layer may have been cached above)
    fresh = ImageStore(tmp_path / "fresh")
    with pytest.raises(ImageError, match="more than 1000 bytes"):
        _pull(f"{proxy.host}/tiny/base:v1", fresh, cfg, limits=PullLimits(max_layer_files_bytes=1000))
    assert store.list() == [] and fresh.list() == []


@root_only
@needs_tools
def test_concurrent_pulls_of_one_image_or_one_layer_download_each_blob_once(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    proxy.rules.append(Rule("/blobs/", ("delay", 0.3), 1000))  # so that the pulls overlap

    async def main():
        async with _fast(cfg) as c:
            return await asyncio.gather(*(pull(f"{proxy.host}/tiny/{name}:v1", store, cfg, client=c)
                                          for name in ("app1", "app1", "app1", "app3")))

    a, b, c3, other = asyncio.run(main())
    assert a.id == b.id == c3.id and other.layers[:2] == a.layers[:2]
    counts = {p: n for p, n in proxy.hits.items() if "/blobs/" in p}
    assert counts and set(counts.values()) == {1}, counts  # every blob once
    assert len(counts) == 2 + 3 + 1  # two configs, the shared base's two layers and each image's own


@root_only
@needs_tools
def test_a_pull_cancelled_while_another_waits_for_the_same_layer_leaves_it_to_finish(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    proxy.rules.append(Rule("/blobs/", ("delay", 0.6), 1000))

    async def main():
        first = asyncio.ensure_future(pull(f"{proxy.host}/tiny/app1:v1", store, cfg))  # each its own client
        second = asyncio.ensure_future(pull(f"{proxy.host}/tiny/app3:v1", store, cfg))
        await asyncio.sleep(0.9)  # past the configs: both wait for the shared base layers
        first.cancel()
        img = await second
        with pytest.raises(asyncio.CancelledError):
            await first
        return img

    img = asyncio.run(main())
    assert [i.name for i in store.list()] == [img.name] and len(img.layers) == 3
    counts = [n for p, n in proxy.hits.items() if "/blobs/" in p]
    assert set(counts) == {1}, proxy.hits


@pytest.mark.slow
@root_only
@needs_tools
def test_two_processes_pulling_one_image_download_each_blob_once(tmp_path, proxy):
    """Between processes a file lock per layer does what the flights do inside one."""
    (tmp_path / "c.toml").write_text(f'[[registries]]\nhost = "{proxy.host}"\ninsecure = true\n')
    proxy.rules.append(Rule("/blobs/", ("delay", 0.5), 1000))
    argv = [sys.executable, "-m", "arl_tangram.cli", "image", "pull", f"{proxy.host}/tiny/app4:v1", "--config",
            str(tmp_path / "c.toml"), "--store", str(tmp_path / "store"), "--quiet"]
    children = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [c.communicate(timeout=120) for c in children]
    assert [c.returncode for c in children] == [0, 0], outs
    assert json.loads(outs[0][0])["id"] == json.loads(outs[1][0])["id"]
    layers = {p: n for p, n in proxy.hits.items() if "/blobs/" in p}
    assert len(layers) == 4 and sum(layers.values()) == 3 + 2  # each layer once; the config by each


@root_only
@needs_tools
def test_a_pull_cut_part_way_resumes_and_one_killed_part_way_leaves_nothing_visible(tmp_path, proxy):
    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    # a connection cut mid-blob: the rest asked for with a Range request
    proxy.rules += [Rule("/blobs/", ("cut", 40), 1), Rule("/blobs/", ("cut", 40), 1, after=2)]  # the config, a layer
    img = _pull(f"{proxy.host}/tiny/app1:v1", store, cfg)
    assert len(img.layers) == 3 and proxy.ranges == ["bytes=40-"]  # the config is asked again whole
    # a pull killed while one of its layers stalls: nothing listed, and the next pull completes
    # it, fetching only what it had not
    (tmp_path / "c.toml").write_text(f'[[registries]]\nhost = "{proxy.host}"\ninsecure = true\n')
    store2 = tmp_path / "store2"
    proxy.hits.clear()
    proxy.rules.append(Rule("/tiny/app3/blobs/", ("delay", 0), 2))  # the config and the first layer pass
    proxy.rules.append(Rule("/tiny/app3/blobs/", ("stall", 10), 1))
    child = subprocess.Popen([sys.executable, "-m", "arl_tangram.cli", "image", "pull", f"{proxy.host}/tiny/app3:v1",
                              "--config", str(tmp_path / "c.toml"), "--store", str(store2), "--quiet"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while proxy.blob_gets() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    child.send_signal(signal.SIGKILL)
    child.wait()
    s2 = ImageStore(store2)
    assert s2.list() == []
    first = proxy.blob_gets()
    img3 = _pull(f"{proxy.host}/tiny/app3:v1", s2, cfg)
    assert [i.name for i in s2.list()] == [img3.name] and len(img3.layers) == 3
    assert proxy.blob_gets() - first < 4  # what the killed pull finished is not fetched again
    assert not [p.name for p in (store2 / "layers").iterdir() if p.name.startswith(".")]
    assert not list((store2 / "blobs").glob(".part-*"))


@root_only
@needs_tools
def test_a_download_that_starts_over_unpacks_the_layer_from_its_first_byte(tmp_path, proxy, monkeypatch):
    from arl_tangram.managers.sandbox.registry import pulling

    store = ImageStore(tmp_path / "store")
    cfg = _config(proxy.host)
    spoiled = []
    restart = pulling._Feed.restart

    def counted(feed):
        if feed.fed:  # bytes had reached the unpacking (each download's first call comes before any)
            spoiled.append(feed.stream)
        restart(feed)

    monkeypatch.setattr(pulling._Feed, "restart", counted)
    # the second layer is cut part way, and the registry then answers the rest's Range with the
    # whole blob: the download, and so the unpacking, start over
    proxy.rules += [Rule("/blobs/", ("cut", 40), 1, after=2), Rule("/blobs/", ("whole",), 1)]
    img = _pull(f"{proxy.host}/tiny/app4:v1", store, cfg)
    assert proxy.ranges == ["bytes=40-"] and len(img.layers) == 3 and spoiled == [0]
    assert (store.layer_dir(img.layers[0]) / "usr/share/doc/big.txt").read_text() == "x" * 50_000
    assert [i.name for i in store.list()] == [img.name]
    assert not [p.name for p in (store.root / "layers").iterdir() if p.name.startswith(".")]



def _tree(root) -> dict:
    """Every entry under ``root``: its kind, mode, owner, mtime (files and links), and content or
    link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            what = (open(full, "rb").read() if stat.S_ISREG(st.st_mode)
                    else os.readlink(full) if stat.S_ISLNK(st.st_mode) else st.st_rdev)
            out[os.path.relpath(full, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                                                 st.st_mtime_ns if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)
                                                 else 0, what)  # (a whiteout's is when it was made)
    return out


def _left_running(root) -> str:
    """What a failed check of "nothing left running" found: each unpacking child's command line,
    and this process's unpacking threads still alive (whose is it: this pull's or an earlier one's)."""
    found = []
    for pid in _unpack_children() + _procs_naming(str(root)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {cmd[-300:]}")
        except OSError:
            found.append(f"{pid}: gone since")
    threads = [t.name for t in threading.enumerate() if t.name == "tangram-unpack"]
    return f"left running: {found}; unpacking threads alive: {len(threads)}"


def _unpack_children() -> list[int]:
    """The unpacking processes this process started that still run."""
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = fh.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if ppid == me and b"unpack_child" in cmd:
            out.append(int(pid))
    return out


@root_only
@needs_tools
def test_a_layer_unpacked_in_a_child_process_is_the_one_unpacked_in_a_thread(tmp_path, proxy, monkeypatch):
    """Large layers go through a child process (``unpackproc``): the same tree, the same checks,
    nothing left visible or running when the layer is bad, its blob does not match, the download
    starts over, or the pull is cancelled; and a durable store syncs before a layer appears."""
    from arl_tangram.managers.sandbox import images as images_module

    cfg = _config(proxy.host)
    child = PullLimits(process_unpack_bytes=0, process_unpack_cpus=1)
    synced = []
    sync = images_module.syncfs
    monkeypatch.setattr(images_module, "syncfs", lambda p: (synced.append(str(p)), sync(p)))
    in_child, in_thread = ImageStore(tmp_path / "child"), ImageStore(tmp_path / "thread", durable=False)
    for name in ("sh", "app1", "app2"):  # a whiteout, a symlink; gzip, zstd and plain layers
        a = _pull(f"{proxy.host}/tiny/{name}:v1", in_child, cfg, limits=child)
        b = _pull(f"{proxy.host}/tiny/{name}:v1", in_thread, cfg)
        assert a.layers == b.layers
        for d in a.layers:
            assert _tree(in_child.layer_dir(d)) == _tree(in_thread.layer_dir(d))
    # the durable store synced its pulled layers behind the pulls (the store's file system, at
    # least once, none left to sync); the other wrote no marker
    assert in_child.synced(timeout=30) and synced and all(p == str(in_child.root.resolve()) for p in synced)
    assert not list((in_child.root / images_module.UNSYNCED).iterdir())
    assert not (in_thread.root / images_module.UNSYNCED).exists()
    assert stat.S_ISCHR(os.lstat(in_child.layer_dir(in_child.get(f"{proxy.host}/tiny/sh:v1").layers[2])
                                 / "etc/motd").st_mode)
    fresh = ImageStore(tmp_path / "fresh")
    with pytest.raises(ImageError, match=rf"{proxy.host}/tiny/bad:v1: layer 1 .*escapes the root"):
        _pull(f"{proxy.host}/tiny/bad:v1", fresh, cfg, limits=child)
    with pytest.raises(ImageError, match=rf"{proxy.host}/tiny/device:v1: layer 1 .*device node"):
        _pull(f"{proxy.host}/tiny/device:v1", fresh, cfg, limits=child)
    with pytest.raises(ImageError, match="more than 1000 bytes"):
        _pull(f"{proxy.host}/tiny/app3:v1", ImageStore(tmp_path / "small"), cfg,
              limits=PullLimits(process_unpack_bytes=0, process_unpack_cpus=1, max_layer_files_bytes=1000))
    proxy.rules.append(Rule("/tiny/app4/blobs/", ("corrupt",), 1000))
    with pytest.raises(DigestMismatch):
        _pull(f"{proxy.host}/tiny/app4:v1", fresh, cfg, limits=child, client={"retries": 0})
    proxy.rules.clear()
    # the download starts over (cut, then the whole blob for the Range): so does the child's unpacking
    proxy.rules += [Rule("/tiny/app4/blobs/", ("cut", 40), 1, after=2), Rule("/tiny/app4/blobs/", ("whole",), 1)]
    img = _pull(f"{proxy.host}/tiny/app4:v1", fresh, cfg, limits=child)
    assert (fresh.layer_dir(img.layers[0]) / "usr/share/doc/big.txt").read_text() == "x" * 50_000
    # cancelled while a layer's blob stalls: the child is gone and its directory with it
    proxy.rules.clear()
    proxy.rules.append(Rule("/tiny/app1/blobs/", ("stall", 10), 1, after=1))
    stalled = ImageStore(tmp_path / "stalled")

    async def cancelled():
        async with _fast(cfg) as c:
            task = asyncio.ensure_future(pull(f"{proxy.host}/tiny/app1:v1", stalled, cfg, client=c, limits=child))
            deadline = time.monotonic() + 20
            def under_way() -> bool:  # a child for each layer under way
                children = _unpack_children()
                return bool(children) and len(_procs_naming(str(stalled.root))) == len(children)

            while not under_way() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert under_way()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancelled())
    proxy.release.set()
    assert _unpack_children() == [] and _procs_naming(str(tmp_path)) == [], _left_running(tmp_path)
    assert [i.name for i in fresh.list()] == [img.name] and stalled.list() == []
    # a child that dies without an answer: an infrastructure error naming the layer, nothing left
    from arl_tangram.managers.sandbox.registry import unpackproc

    monkeypatch.setattr(unpackproc, "_BOOT", "import os, sys; sys.stderr.write('gone'); os._exit(3)")
    dead = ImageStore(tmp_path / "dead")
    with pytest.raises(ImageError, match=r"tiny/app1:v1: layer \d .*ended \(3\) without an answer: gone") as e:
        _pull(f"{proxy.host}/tiny/app1:v1", dead, cfg, limits=child)
    assert e.value.infra and dead.list() == []
    for store in (fresh, stalled, dead):
        assert not [p.name for p in (store.root / "layers").iterdir() if p.name.startswith(".")]

# -- authentication ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pushed_layout(tmp_path_factory):
    d = tmp_path_factory.mktemp("authlayout")
    lay = Layout(d / "layout")
    lay.tag("v1", lay.image([BASE]))
    return lay


@root_only
@needs_tools
def test_bearer_tokens_from_the_www_authenticate_challenge(tmp_path, pushed_layout):
    tokens = TokenServer(tmp_path / "token", {"alice": "wonderland"}, public={"pub/img"})
    reg = Registry(tmp_path / "registry", auth=("token", tokens))
    try:
        for repo in ("pub/img", "priv/img"):
            push(pushed_layout, "v1", f"{reg.host}/{repo}:v1", creds="alice:wonderland")
        store = ImageStore(tmp_path / "store")
        calls = tokens.calls
        img = _pull(f"{reg.host}/pub/img:v1", store, _config(reg.host))  # anonymous token
        assert len(img.layers) == 1 and tokens.calls - calls == 1  # one token for the whole pull
        with pytest.raises(Unauthorized, match=rf"{reg.host}/priv/img:v1: .*HTTP 401"):
            _pull(f"{reg.host}/priv/img:v1", store, _config(reg.host))
        assert _pull(f"{reg.host}/priv/img:v1", store, _config(reg.host, username="alice", password="wonderland"))
        with pytest.raises(Unauthorized, match=rf"{reg.host}/priv/img:v1: the token service .*refused the credentials"):
            _pull(f"{reg.host}/priv/img:v1", store, _config(reg.host, username="alice", password="no"))
        dc = tmp_path / "docker.json"
        dc.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"alice:wonderland").decode()}}}))
        cfg = RegistriesConfig.from_toml({"registries": [{"host": reg.host, "insecure": True}],
                                          "docker_config": str(dc)})
        store2 = ImageStore(tmp_path / "store2")
        assert _pull(f"{reg.host}/priv/img:v1", store2, cfg).layers == img.layers
    finally:
        reg.close()
        tokens.close()


@root_only
@needs_tools
def test_basic_credentials_for_an_htpasswd_registry(tmp_path, pushed_layout):
    reg = Registry(tmp_path / "registry", auth=("htpasswd", {"bob": "builder"}))
    try:
        push(pushed_layout, "v1", f"{reg.host}/team/img:v1", creds="bob:builder")
        store = ImageStore(tmp_path / "store")
        with pytest.raises(Unauthorized, match=rf"{reg.host}/team/img:v1: {reg.host} asks for a username and "
                                               "password"):
            _pull(f"{reg.host}/team/img:v1", store, _config(reg.host))
        with pytest.raises(Unauthorized, match=rf"{reg.host}/team/img:v1: .*refused access \(HTTP 401"):
            _pull(f"{reg.host}/team/img:v1", store, _config(reg.host, username="bob", password="wrong"))
        img = _pull(f"{reg.host}/team/img:v1", store, _config(reg.host, username="bob", password="builder"))
        assert len(img.layers) == 1 and store.list() == [img]
    finally:
        reg.close()


# -- mirrors ------------------------------------------------------------------------------------------

@root_only
@needs_tools
def test_mirrors_are_tried_first_and_the_origin_after(tmp_path, origin):
    front = Proxy(origin.host)  # counts what reaches the origin
    mirror = Registry(tmp_path / "mirror", proxy_of=f"http://{front.host}")  # a real pull-through cache
    mirror_front = Proxy(mirror.host)
    try:
        dead = f"127.0.0.1:{free_port()}"
        cfg = RegistriesConfig.from_toml({"registries": [
            {"host": front.host, "insecure": True, "mirrors": [dead, mirror_front.host]},
            {"host": mirror_front.host, "insecure": True}, {"host": dead, "insecure": True}]})
        store = ImageStore(tmp_path / "store")
        img = _pull(f"{front.host}/tiny/app1:v1", store, cfg)
        assert len(img.layers) == 3 and mirror_front.blob_gets() == 4
        store2 = ImageStore(tmp_path / "store2")  # a second node: the mirror again
        _pull(f"{front.host}/tiny/app1:v1", store2, cfg)
        assert mirror_front.blob_gets() == 8
        # what reached the origin came from the mirror (its cache filling), none from us
        assert front.blob_gets() >= 4 and "arl-tangram" not in front.agents, (front.log, mirror_front.log)
        # the mirror failing: the origin answers
        mirror_front.rules.append(Rule("/", ("status", 500, None), 1000))
        store3 = ImageStore(tmp_path / "store3")
        assert _pull(f"{front.host}/tiny/app3:v1", store3, cfg, client={"retries": 0}).layers[:2] == img.layers[:2]
        assert sum(n for p, n in front.hits.items() if "app3" in p) >= 2 and front.agents.get("arl-tangram", 0) >= 2
    finally:
        mirror_front.close()
        mirror.close()
        front.close()


# -- the command line and a session ---------------------------------------------------------------

@root_only
@needs_tools
def test_the_cli_pulls_with_a_config_and_lists_what_is_shared(tmp_path, origin):
    from typer.testing import CliRunner

    from arl_tangram.cli import app

    (tmp_path / "c.toml").write_text(f'[[registries]]\nhost = "{origin.host}"\ninsecure = true\n')
    args = ["--config", str(tmp_path / "c.toml"), "--store", str(tmp_path / "store"), "--quiet"]
    runner = CliRunner()
    one = runner.invoke(app, ["image", "pull", f"{origin.host}/tiny/app1:v1", *args])
    assert one.exit_code == 0, one.output
    first = json.loads(one.stdout)
    assert first["name"] == f"{origin.host}/tiny/app1:v1" and first["cached_layers"] == 0
    two = json.loads(runner.invoke(app, ["image", "pull", f"{origin.host}/tiny/app2:v1", *args]).stdout)
    assert two["cached_layers"] == 2
    listed = json.loads(runner.invoke(app, ["image", "ls", "--store", str(tmp_path / "store")]).stdout)
    assert [i["name"] for i in listed] == [first["name"], two["name"]]
    assert all(0 < i["shared_bytes"] < i["size_bytes"] for i in listed)
    bad = runner.invoke(app, ["image", "pull", "NotARef", *args])
    assert bad.exit_code == 2 and "'NotARef'" in bad.output
    (tmp_path / "bad.toml").write_text('[[registries]]\nhost = "x.io"\nmirrors = "m.io"\n')
    cfg = runner.invoke(app, ["image", "pull", "x.io/a:b", "--config", str(tmp_path / "bad.toml")])
    assert cfg.exit_code == 2 and "--config: registries.0.mirrors" in cfg.output


@pytest.mark.slow
@root_only
@needs_tools
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_session_runs_on_a_pulled_image(tmp_path, origin):
    from arl_tangram.core import Outcome
    from arl_tangram.managers.sandbox.manager import SandboxConfig
    from arl_tangram.runtime import Tangram

    store = ImageStore(tmp_path / "store")
    img = _pull(f"{origin.host}/tiny/sh:v1", store, _config(origin.host))

    async def main():
        cfg = SandboxConfig(warm_pool=0, image_store=str(store.root))
        async with Tangram.local(sandbox=cfg) as tg:
            s = await tg.session(image=img.name)
            r = await s.exec("cat /repo/task.txt; ls /etc; echo made > /repo/new; cat /repo/new")
            await s.close()
            return r

    r = asyncio.run(main())
    assert r.outcome is Outcome.OK, r.stderr
    assert r.stdout.splitlines()[0] == "task 7" and "motd" not in r.stdout and r.stdout.endswith("made\n")


@root_only
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.skipif(not os.path.isdir("/usr/lib/python3.11"), reason="needs the host's python3.11 to copy")
def test_an_image_with_its_own_python_starts_the_agent_compiled_by_it(tmp_path):
    from imagekit import python_layer

    from arl_tangram.core import Outcome
    from arl_tangram.managers.sandbox import agentpyc
    from arl_tangram.managers.sandbox.manager import SandboxConfig
    from arl_tangram.runtime import Tangram

    store = ImageStore(tmp_path / "store")
    img = store.import_path(docker_archive(tmp_path / "py.tar", [python_layer()]), "py")

    async def main():
        cfg = SandboxConfig(warm_pool=0, warm_sessions=0, image_store=str(store.root))
        async with Tangram.local(sandbox=cfg) as tg:
            first = await (await tg.session(image="py")).exec(python="print(6 * 7)")  # compiles it meanwhile
            for _ in range(200):
                if agentpyc.ready(store.root, img.id):
                    break
                await asyncio.sleep(0.05)
            s = await tg.session(image="py")
            seen = await s.exec(python="import json, os, sys\n"
                                "agent = [open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()\n"
                                "         and '--reap' in open(f'/proc/{p}/cmdline').read()]\n"
                                "print(json.dumps([sorted(os.listdir('/run/tangram/inside/__pycache__')), agent,\n"
                                "                  list(sys.version_info[:2])]))")
            return first, seen

    first, seen = asyncio.run(main())
    assert first.outcome is Outcome.OK and first.stdout == "42\n", first.stderr
    assert seen.outcome is Outcome.OK, seen.stderr
    pycs, agent, version = json.loads(seen.stdout)
    compiled = agentpyc.ready(store.root, img.id)
    assert compiled and pycs == sorted(os.listdir(compiled)) and version == [3, 11]
    assert agent and all("from inside import loop" in a for a in agent)  # started by import, not as a script
