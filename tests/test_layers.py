"""The package's layers, read from the sources: the arrows between packages that
docs/architecture.md draws ("Dependencies"). An import inside a function counts (it runs as surely,
only later); one under ``if TYPE_CHECKING:`` does not (it never runs). No import cycle, counting
even those, is ``tools/house.py``'s measure (``tests/test_house.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "arl_tangram"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path) -> set[str]:
    """The package's modules ``module`` imports (the nearest module of each name imported)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:  # ``from . import x``: the module x, where x is one
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for name in found:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_the_parser_sees_imports_of_every_kind():
    assert "arl_tangram.engine" in GRAPH["arl_tangram.driver"]  # from .engine import ...
    assert "arl_tangram.runtime.workers" in GRAPH["arl_tangram.runtime.local"]  # inside a function
    assert "arl_tangram.server.front" not in GRAPH["arl_tangram.server.app"]  # under TYPE_CHECKING


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


@pytest.mark.parametrize("low, high", [("runtime", "server"), ("managers", "runtime"), ("managers", "server"),
                                       ("core", "runtime"), ("policy", "runtime"), ("core", "server"),
                                       ("policy", "server"), ("core", "managers"), ("policy", "managers")])
def test_a_lower_layer_never_imports_a_higher_one(low, high):
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if _package(m) == low
                   for d in deps if _package(d) == high)
    assert wrong == []


def test_the_build_knows_every_plain_module_the_compiled_ones_import():
    """``build.stale`` checks these too: compiled against them, the hot path is stale after an edit."""
    from arl_tangram import build

    hot = {f"{PACKAGE}.{m.replace('/', '.')}" for m in build.HOT_PATH}
    imported = {d for m in hot for d in GRAPH[m] if d not in hot}
    assert {f"{PACKAGE}.{m.replace('/', '.')}" for m in build.HOT_PATH_IMPORTS} == imported


def test_a_plain_module_edited_after_the_build_makes_it_stale(tmp_path, monkeypatch):
    import os

    from arl_tangram import build

    (tmp_path / "setup.py").write_text("")  # a source checkout
    pkg = tmp_path / "src" / PACKAGE
    (pkg / "core").mkdir(parents=True)
    for name, t in (("pools.cpython-311-x86_64-linux-gnu.so", 2000), ("pools.py", 1000), ("seam.py", 1500)):
        (pkg / "core" / name).write_bytes(b"")
        os.utime(pkg / "core" / name, (t, t))
    monkeypatch.setattr(build, "ROOT", pkg)
    assert build.stale() == []
    os.utime(pkg / "core" / "seam.py", (3000, 3000))  # the engine's seam, edited after the build
    assert build.stale() == ["core/seam.py"]
