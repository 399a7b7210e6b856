"""Builds tiny container images for the tests: docker-save and OCI archives of hand-made layers.

A layer is a list of entries: ``("file", path, data[, mode])``, ``("dir", path[, mode])``,
``("symlink", path, target)``, ``("hardlink", path, target)``, ``("whiteout", path)`` (deletes
``path`` of a lower layer), ``("opaque", dir)``, ``("chr", path)`` (a device node: always refused),
``("raw", TarInfo)``. ``host_tools`` copies host executables with the libraries they load, so an
image can have a real ``/bin/sh`` (dash) or bash without downloading anything.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path


def layer_tar(entries: list[tuple]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            kind, path = e[0], e[1] if len(e) > 1 else None
            if kind == "raw":
                tar.addfile(e[1], io.BytesIO(e[2]) if len(e) > 2 else None)
                continue
            info = tarfile.TarInfo(path)
            info.mtime = 1_700_000_000
            if kind == "file":
                data = e[2] if isinstance(e[2], bytes) else e[2].encode()
                info.size, info.mode = len(data), (e[3] if len(e) > 3 else 0o644)
                tar.addfile(info, io.BytesIO(data))
                continue
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, (e[2] if len(e) > 2 else 0o755)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e[2]
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e[2]
            elif kind == "whiteout":
                d, b = os.path.split(path)
                info.name = os.path.join(d, ".wh." + b)
            elif kind == "opaque":
                info.name = os.path.join(path, ".wh..wh..opq")
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            else:
                raise ValueError(kind)
            tar.addfile(info)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_archive(path: Path, layers: list[list[tuple]], env: list[str] | None = None) -> Path:
    """A classic ``docker save`` archive: manifest.json, a config, ``<id>/layer.tar`` per layer."""
    tars = [layer_tar(entries) for entries in layers]
    config = json.dumps({"config": {"Env": env or ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest()
                                                                   for t in tars]}}).encode()
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    names = [f"{hashlib.sha256(t).hexdigest()}/layer.tar" for t in tars]
    with tarfile.open(path, "w") as tar:
        _add(tar, cfg_name, config)
        for name, t in zip(names, tars):
            _add(tar, name, t)
        _add(tar, "manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": ["test:latest"],
                                                "Layers": names}]).encode())
    return path


def oci_archive(path: Path, layers: list[list[tuple]], compress: bool = True) -> Path:
    """An OCI image layout (index.json, blobs/sha256/...), layers gzip-compressed by default."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        blobs[h] = data
        return "sha256:" + h

    tars = [layer_tar(entries) for entries in layers]
    layer_descs = []
    for t in tars:
        data = gzip.compress(t, mtime=0) if compress else t
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else ""),
                            "digest": blob(data), "size": len(data)})
    config = json.dumps({"config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "TANGRAM_IMAGE=oci"]},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "config": {"digest": blob(config), "size": len(config)},
                           "layers": layer_descs}).encode()
    index = {"schemaVersion": 2, "manifests": [{"digest": blob(manifest), "size": len(manifest)}]}
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(index).encode())
        for h, data in blobs.items():
            _add(tar, f"blobs/sha256/{h}", data)
    return path


def host_tools(*exes: str) -> list[tuple]:
    """Entries copying host executables and the shared libraries they need (via ldd)."""
    entries: dict[str, tuple] = {"bin": ("symlink", "bin", "usr/bin"), "lib": ("symlink", "lib", "usr/lib"),
                                 "lib64": ("symlink", "lib64", "usr/lib64")}
    files: set[str] = set()
    for exe in exes:
        files.add(os.path.realpath(exe))
        out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        for line in out.splitlines():
            for word in line.split():
                if word.startswith("/"):
                    files.add(word)
    for f in sorted(files):
        real = os.path.realpath(f)
        dest = f.lstrip("/")
        for top in ("lib/", "lib64/", "bin/"):
            if dest.startswith(top):
                dest = "usr/" + dest
        with open(real, "rb") as fh:
            entries[dest] = ("file", dest, fh.read(), 0o755)
    for exe in exes:
        real = os.path.realpath(exe)
        name = os.path.basename(exe)
        dest = "usr/bin/" + name
        if dest not in entries:
            with open(real, "rb") as fh:
                entries[dest] = ("file", dest, fh.read(), 0o755)
    return list(entries.values())


def python_layer(version: str = "3.11") -> list[tuple]:
    """The host's python3 with the part of its standard library the runner and site need, and an
    empty dist-packages (so "pip install" into the image is importable at once)."""
    lib = f"/usr/lib/python{version}"
    entries = host_tools("/usr/bin/dash", f"/usr/bin/python{version}") + [
        ("symlink", "usr/bin/sh", "dash"), ("symlink", "usr/bin/python3", f"python{version}"),
        ("dir", f"usr/local/lib/python{version}/dist-packages")]
    for name in sorted(os.listdir(lib)):
        if name.endswith(".py"):
            with open(os.path.join(lib, name), "rb") as fh:
                entries.append(("file", f"usr/lib/python{version}/{name}", fh.read()))
    for pkg in ("encodings", "collections", "importlib", "re", "json", "lib-dynload"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(lib, pkg)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                full = os.path.join(dirpath, f)
                with open(full, "rb") as fh:
                    entries.append(("file", "usr/" + os.path.relpath(full, "/usr"), fh.read(), 0o755))
    return entries
