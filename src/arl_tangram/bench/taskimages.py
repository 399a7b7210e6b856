"""Task images, as software-engineering RL uses them: a base image, and one image per task adding a
small real Python project with its own tests as one layer, in a real registry on loopback.

For ``tangram bench images`` and the tests (``tests/registrykit.py`` builds on it):

* ``Registry``: Debian's distribution registry (``docker-registry``) serving on 127.0.0.1;
* ``Layout`` and ``push``: images written as OCI layouts here and pushed with ``skopeo``;
* roots: ``debian_root`` (a Debian root from Debian's packages, python3, pytest, git and patch,
  made by ``mmdebstrap`` once and cached as a tar), ``host_python_root`` (the host's python3 with
  its standard library and compiled modules, pytest from this interpreter and ``patch``, copied
  in seconds: what the tests use);
* ``project``: task ``n``'s project (a package, its tests, a bug and the patch that fixes it).

Nothing here reaches outside 127.0.0.1 but ``mmdebstrap``, which fetches Debian's packages.
``MISSING`` names the tools not installed (``apt-get install -y docker-registry skopeo``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .server import free_port

REGISTRY = shutil.which("docker-registry")
SKOPEO = shutil.which("skopeo")
MISSING = [name for name, path in (("docker-registry", REGISTRY), ("skopeo", SKOPEO)) if path is None]
DEBIAN_PACKAGES = ("python3", "python3-pytest", "git", "patch")
_ACCESS = re.compile(r'"GET (\S+) HTTP/[\d.]+" (\d{3}) (\d+|-)')


def wait_http(url: str, timeout: float = 15.0) -> None:
    """Return once ``url`` answers at all (any status); ``RuntimeError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout}s") from None
            time.sleep(0.05)


class Registry:
    """``docker-registry serve`` on 127.0.0.1 with its storage in ``root``. ``extra``: more lines
    of its YAML config (authentication, a pull-through cache)."""

    def __init__(self, root: Path, extra: list[str] = (), access_log: bool = False) -> None:
        if REGISTRY is None:
            raise RuntimeError("needs docker-registry (apt-get install -y docker-registry)")
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        lines = ["version: 0.1", "log:", "  level: error", "  accesslog:", f"    disabled: {str(not access_log).lower()}",
                 "storage:",
                 "  filesystem:", f"    rootdirectory: {root / 'data'}", "  delete:", "    enabled: true",
                 "http:", f"  addr: 127.0.0.1:{self.port}", *extra]
        (root / "config.yml").write_text("\n".join(lines) + "\n")
        self.log = open(root / "registry.log", "wb")
        self.proc = subprocess.Popen([REGISTRY, "serve", str(root / "config.yml")], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://{self.host}/v2/")
        except RuntimeError:
            self.close()
            raise RuntimeError(f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}")

    def blob_gets(self) -> dict[str, list[int]]:
        """With ``access_log``: each blob path GET so far -> the bytes of each answer (200 and 206)."""
        self.log.flush()
        out: dict[str, list[int]] = {}
        for line in (self.root / "registry.log").read_text(errors="replace").splitlines():
            m = _ACCESS.search(line)
            if m and "/blobs/" in m.group(1) and m.group(2) in ("200", "206"):
                out.setdefault(m.group(1), []).append(int(m.group(3)) if m.group(3).isdigit() else 0)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- images as OCI layouts, pushed with skopeo -----------------------------------------------------

def compress(data: bytes, how: str, level: int = 6) -> tuple[bytes, str]:
    """A layer tar compressed ``gzip``, ``zstd`` or ``none``: (bytes, OCI media type)."""
    base = "application/vnd.oci.image.layer.v1.tar"
    if how == "gzip":
        return gzip.compress(data, compresslevel=level, mtime=0), base + "+gzip"
    if how == "zstd":
        if shutil.which("zstd"):
            out = subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
        else:
            import zstandard

            out = zstandard.ZstdCompressor().compress(data)
        return out, base + "+zstd"
    return data, base


@dataclass
class Layout:
    """An OCI image layout directory being written (blobs, and index.json's tagged entries)."""

    path: Path
    entries: list[dict] = field(default_factory=list)
    level: int = 6  # gzip's

    def blob(self, data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        d = self.path / "blobs" / "sha256"
        d.mkdir(parents=True, exist_ok=True)
        if not (d / h).exists():
            (d / h).write_bytes(data)
        return "sha256:" + h

    def image_of(self, tars: list[bytes], compression: str | list[str] = "gzip", env: list[str] | None = None,
                 arch: str = "amd64", workdir: str = "/", packed: dict[int, tuple[bytes, str]] | None = None) -> dict:
        """Write one image's blobs (its layers' tars given; ``packed``: layer index -> its blob and
        media type, compressed already); returns its manifest descriptor."""
        hows = compression if isinstance(compression, list) else [compression] * len(tars)
        descs = []
        for i, (t, how) in enumerate(zip(tars, hows)):
            data, mtype = (packed or {}).get(i) or compress(t, how, self.level)
            descs.append({"mediaType": mtype, "digest": self.blob(data), "size": len(data)})
        config = json.dumps({"architecture": arch, "os": "linux",
                             "config": {"Env": env or ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": workdir},
                             "rootfs": {"type": "layers",
                                        "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]}},
                            sort_keys=True).encode()
        manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                          "digest": self.blob(config), "size": len(config)},
                               "layers": descs}, sort_keys=True).encode()
        return {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": self.blob(manifest),
                "size": len(manifest), "platform": {"architecture": arch, "os": "linux"}}

    def tag(self, tag: str, desc: dict) -> None:
        self.entries.append({**desc, "annotations": {"org.opencontainers.image.ref.name": tag}})
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (self.path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.entries}))

    def index(self, images: list[dict]) -> dict:
        """An image index of ``images`` (their descriptors, with platforms)."""
        doc = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                          "manifests": images}, sort_keys=True).encode()
        return {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": self.blob(doc), "size": len(doc)}


def skopeo(*args: str, timeout: float = 600) -> None:
    """``skopeo ARGS`` with its own state (not the user's), plain HTTP to loopback allowed."""
    if SKOPEO is None:
        raise RuntimeError("needs skopeo (apt-get install -y skopeo)")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HOME": tmp, "TMPDIR": tmp, "REGISTRY_AUTH_FILE": os.path.join(tmp, "auth.json")}
        out = subprocess.run([SKOPEO, "--insecure-policy", *args], capture_output=True, text=True, env=env,
                             timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"skopeo {' '.join(args[:2])} failed: {out.stderr.strip()}")


def push(layout: Layout, tag: str, dest: str, creds: str | None = None, fmt: str | None = None,
         all_images: bool = False) -> None:
    """``skopeo copy oci:LAYOUT:TAG docker://DEST`` (plain HTTP to loopback)."""
    argv = ["copy", "-q", "--dest-tls-verify=false"]
    if creds:
        argv += ["--dest-creds", creds]
    if fmt:
        argv += ["--format", fmt]
    if all_images:
        argv += ["--all"]
    skopeo(*argv, f"oci:{layout.path}:{tag}", f"docker://{dest}")


# -- root filesystems ------------------------------------------------------------------------------

def tar_dir(root: Path) -> bytes:
    """A root filesystem directory as one layer's tar: sorted, owned by root, modes and mtimes
    kept (so that compiled modules stay valid), hard links as links."""
    buf = io.BytesIO()
    seen: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                arc = os.path.relpath(full, root)
                info = tar.gettarinfo(full, arc)
                if info is None or info.ischr() or info.isblk() or info.isfifo():
                    continue  # sockets, device nodes, FIFOs: no image may carry them (the store refuses them)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                st = os.lstat(full)
                if info.isreg() and st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        info.type, info.linkname, info.size = tarfile.LNKTYPE, seen[key], 0
                        tar.addfile(info)
                        continue
                    seen[key] = arc
                if info.isreg():
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _copy(src: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest, follow_symlinks=True)


def _libraries(exe: str) -> set[str]:
    out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
    return {w for line in out.splitlines() for w in line.split() if w.startswith("/")}


def host_python_root(dest: Path) -> Path:
    """A root of the host's ``python3`` (its whole standard library with the compiled modules it
    has, mtimes kept so they stay valid), ``pytest`` and what it imports from this interpreter's
    site-packages, ``dash`` as ``/bin/sh``, ``patch`` and a few coreutils; built once into
    ``dest`` (returned)."""
    done = dest / ".complete"
    if done.exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not os.path.isfile(f"/usr/bin/python{version}") or not os.path.isdir(f"/usr/lib/python{version}"):
        raise RuntimeError(f"no system python{version} (/usr/bin, /usr/lib) to copy")
    for d in ("usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "repo"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(target, dest / link)
    exes = {f"/usr/bin/python{version}": f"python{version}", "/usr/bin/dash": "dash"}
    for tool in ("patch", "cat", "ls", "head", "tail", "env", "mkdir", "rm"):
        if shutil.which(tool):
            exes[os.path.realpath(shutil.which(tool))] = tool
    libs: set[str] = set()
    for exe, name in exes.items():
        _copy(os.path.realpath(exe), dest / "usr/bin" / name)
        libs |= _libraries(exe)
    for lib in libs:
        rel = lib.lstrip("/")
        for top in ("lib/", "lib64/"):
            if rel.startswith(top):
                rel = "usr/" + rel
        _copy(os.path.realpath(lib), dest / rel)
    os.symlink("dash", dest / "usr/bin/sh")
    os.symlink(f"python{version}", dest / "usr/bin/python3")
    stdlib = f"/usr/lib/python{version}"
    skip = {"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
            "dist-packages"}
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            full = os.path.join(dirpath, f)
            if os.path.isfile(full):
                _copy(full, dest / os.path.relpath(full, "/"))
    site = dest / "usr/lib/python3/dist-packages"
    import _pytest
    import pluggy
    import pytest

    where = Path(pytest.__file__).resolve().parent.parent
    wanted = ["pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py", "exceptiongroup",
              "tomli"]
    del _pytest, pluggy
    for name in wanted:
        src = where / name
        if src.is_file():
            _copy(str(src), site / name)
        elif src.is_dir():
            shutil.copytree(src, site / name, copy_function=shutil.copy2)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    done.write_text("")
    return dest


def debian_root(cache: Path, suite: str = "bookworm", packages: tuple[str, ...] = DEBIAN_PACKAGES) -> Path:
    """A Debian root filesystem made from Debian's packages (minbase plus ``packages``) by
    ``mmdebstrap``, as a tar cached at ``cache/debian-SUITE-HASH.tar`` (made once: about a
    minute and 270 MB). Needs root and ``mmdebstrap`` (apt-get install -y mmdebstrap)."""
    key = hashlib.sha256(f"{suite} {' '.join(sorted(packages))}".encode()).hexdigest()[:12]
    out = cache / f"debian-{suite}-{key}.tar"
    if out.is_file():
        return out
    if out.exists():  # not a tar: left by something else
        shutil.rmtree(out, ignore_errors=True)
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise RuntimeError("needs mmdebstrap for the Debian base (apt-get install -y mmdebstrap)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{os.getpid()}-{out.name}")  # ends in .tar: mmdebstrap writes a tar for that name
    try:
        run = subprocess.run([exe, "--quiet", "--variant=minbase", "--mode=root", f"--include={','.join(packages)}",
                              "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                              "--dpkgopt=path-exclude=/usr/share/locale/*", suite, str(tmp)],
                             capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def root_layer(tar_path: Path) -> bytes:
    """A root filesystem tar (``debian_root``'s; plain or gzip-, bzip2-, xz- or zstd-compressed)
    as one layer: device nodes dropped (``mmdebstrap`` leaves /dev's; a sandbox gets its own), the
    rest as it is."""
    buf = io.BytesIO()
    with open(tar_path, "rb") as raw:
        if raw.read(4) == b"\x28\xb5\x2f\xfd":  # zstd: tarfile does not know it
            import zstandard

            raw.seek(0)
            src = tarfile.open(fileobj=zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True),
                               mode="r|")
        else:
            src = tarfile.open(tar_path)
        with src, tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
            for m in src:
                if m.ischr() or m.isblk() or m.isfifo():
                    continue
                dst.addfile(m, src.extractfile(m) if m.isreg() else None)
    return buf.getvalue()


# -- task projects ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """Task ``n``: its project as one layer's files under /repo, the patch that fixes its bug
    (``patch -p1`` in /repo), and how many of its tests pass once it is applied (all) and before."""

    n: int
    files: dict[str, str]
    patch: str
    tests: int
    failing: int


def project(n: int) -> Task:
    """A small real project: a package ``shapes{n}`` with area, perimeter and scaling functions and
    their tests; ``perimeter`` has a bug the patch fixes."""
    pkg = f"shapes{n}"
    side = 2 + n % 7
    module = (
        f'"""Task {n}: rectangles and squares."""\n\n'
        "from dataclasses import dataclass\n\n\n"
        "@dataclass(frozen=True)\nclass Rect:\n    w: float\n    h: float\n\n"
        "    def area(self) -> float:\n        return self.w * self.h\n\n"
        "    def perimeter(self) -> float:\n        return self.w + self.h\n\n"
        "    def scaled(self, k: float) -> \"Rect\":\n        return Rect(self.w * k, self.h * k)\n\n\n"
        f"def square(side: float = {side}) -> Rect:\n    return Rect(side, side)\n")
    fixed = module.replace("        return self.w + self.h\n", "        return 2 * (self.w + self.h)\n")
    tests = (
        f"from {pkg}.geometry import Rect, square\n\n\n"
        "def test_area():\n    assert Rect(2, 3).area() == 6\n\n\n"
        "def test_perimeter():\n    assert Rect(2, 3).perimeter() == 10\n\n\n"
        f"def test_square():\n    assert square().area() == {side * side}\n\n\n"
        f"def test_square_perimeter():\n    assert square().perimeter() == {4 * side}\n\n\n"
        "def test_scaled():\n    assert Rect(1, 2).scaled(3) == Rect(3, 6)\n")
    files = {f"repo/{pkg}/__init__.py": "", f"repo/{pkg}/geometry.py": module, "repo/tests/__init__.py": "",
             "repo/tests/test_geometry.py": tests, "repo/pyproject.toml":
             f'[project]\nname = "{pkg}"\nversion = "0.{n}"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
             "repo/README.md": f"# {pkg}\n\nTask {n}: make the tests pass.\n"}
    import difflib

    path = f"{pkg}/geometry.py"
    patch = "".join(difflib.unified_diff(module.splitlines(True), fixed.splitlines(True), f"a/{path}", f"b/{path}"))
    return Task(n, files, patch, tests=5, failing=2)


def task_layer(task: Task) -> bytes:
    """``task``'s files as one layer's tar (directories first, fixed mtimes: the same task is
    the same layer every time)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({os.path.dirname(p) for p in task.files} | {"repo"})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tar.addfile(info)
        for path in sorted(task.files):
            data = task.files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def run_task_command(patch_path: str = "/workspace/fix.patch") -> str:
    """The shell command of one task's step: apply the patch, run the project's tests."""
    return (f"cd /repo && patch -s -p1 < {patch_path} && "
            "python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -n 1")


# -- a registry that misbehaves ----------------------------------------------------------------------

class BadRegistry:
    """A registry API on 127.0.0.1 whose every image is bad in its own way: ``bad/many:v1`` (a
    manifest of 5,000 layers), ``bad/huge:v1`` (a layer declaring a petabyte), ``bad/mismatch:v1``
    (a layer whose bytes are not its digest's), ``bad/escape:v1`` and ``bad/device:v1`` (a layer
    with a path out of the root, a device node); anything else is a 404."""

    def __init__(self) -> None:
        import http.server
        import threading

        docs: dict[str, tuple[bytes, str]] = {}
        blobs: dict[str, bytes] = {}

        def blob(data: bytes) -> dict:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            blobs[digest] = data
            return {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": len(data)}

        def image(repo: str, layers: list[dict], diff_ids: list[str]) -> None:
            config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                                 "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
            cdesc = {**blob(config), "mediaType": "application/vnd.oci.image.config.v1+json"}
            doc = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                              "config": cdesc, "layers": layers}).encode()
            docs[f"/v2/bad/{repo}/manifests/v1"] = (doc, "application/vnd.oci.image.manifest.v1+json")

        fake = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "sha256:" + "a" * 64, "size": 10}
        image("many", [fake] * 5000, ["sha256:" + "b" * 64] * 5000)
        image("huge", [{**fake, "size": 1 << 50}], ["sha256:" + "b" * 64])
        for repo, entry in (("escape", ("file", "../escaped")), ("device", ("chr", "dev/mem"))):
            tar = _one_member_tar(*entry)
            image(repo, [blob(gzip.compress(tar, mtime=0))], ["sha256:" + hashlib.sha256(tar).hexdigest()])
        good = _one_member_tar("file", "etc/motd")
        layer = blob(gzip.compress(good, mtime=0))
        blobs[layer["digest"]] = gzip.compress(good + b"\0" * 512, mtime=0)  # served: not what its digest names
        image("mismatch", [layer], ["sha256:" + hashlib.sha256(good).hexdigest()])

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/v2/":
                    body, ctype = b"{}", "application/json"
                elif path in docs:
                    body, ctype = docs[path]
                elif "/blobs/" in path and path.rsplit("/", 1)[1] in blobs:
                    body, ctype = blobs[path.rsplit("/", 1)[1]], "application/octet-stream"
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _one_member_tar(kind: str, name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        if kind == "chr":
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 1
            tar.addfile(info)
        else:
            info.size = 2
            tar.addfile(info, io.BytesIO(b"x\n"))
    return buf.getvalue()
