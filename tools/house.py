"""The house check: measures of ``src/arl_tangram`` read from its sources, each with its limit.

    python tools/house.py           # a table; the exit status is 1 when a limit is not met
    python tools/house.py --json    # the same as JSON (``tests/test_house.py`` asserts each limit)

Nothing is imported from the package: every measure is read with ``ast`` or a regular expression,
so the check runs on a tree that does not import (another checkout: ``--src``).

The measures and their limits:

``files``
    The largest files (top 10, by lines); ``managers/sandbox/manager.py`` under 400 lines.
``classes``
    The largest classes (top 10, by lines from ``class`` to their last statement); no class in
    ``managers/`` over 500 lines.
``cycles``
    No import cycle between the package's modules. Every import counts: at module level, inside a
    function (it runs as surely, only later) and under ``if TYPE_CHECKING:`` (a type checker, and a
    reader, still follow it). ``import a.b.c`` and ``from a.b import c`` are edges to the nearest
    module of the name (``a.b.c`` when it is a module, else ``a.b``); relative imports are resolved
    against the importing module's package; a module's own package ``__init__`` that Python runs
    first is not an edge. Each cycle is printed as a path, ``a -> b -> a``, each arrow with the line
    of its import.
``private``
    No access to another module's private names in ``src/`` outside ``bench/``. A private name
    starts with ``_`` and is not a dunder (``__x__``). A module *defines* a private name when it
    binds it at module level or in a class body (``def``, ``class``, an assignment, an annotated
    field, an ``import ... as _x``), in any function (``def _x`` nested), as an attribute of
    ``self`` or ``cls`` (``self._x = ...``), or lists it in ``__slots__``. Flagged are:

    * ``from <a module of the package> import _x``;
    * ``obj._x`` (read, written or deleted; also ``getattr``/``setattr``/``hasattr``/``delattr``
      with the literal ``"_x"``) where ``obj`` is not ``self``, ``cls`` or ``super()``, ``obj`` is
      not a module or name imported from outside the package (``os._exit``, ``sys._getframe``,
      ``_signal.signal`` through ``import signal as _signal``), and ``_x`` is defined by another
      module of the package and not by this one. A private name no module of the package defines
      is another library's (``namedtuple``'s ``_replace``), not flagged; one written on such an
      object (``obj._x = v``, ``setattr(obj, "_x", v)``) is flagged all the same, since the
      package then hangs its own private state on another module's object.

    The rule reads names, not types: a name defined both here and elsewhere is taken as this
    module's own, and ``obj`` is not traced to its class.
``references``
    At most 5 references to issues, rounds and reviews in ``src/`` (``bench/`` included): ``issue
    N`` / ``issue #N`` / ``issues N``, ``round N`` (not ``--x-rounds N``), an ordinal round
    (``seventeenth round``, ``2nd round``; not "first round", the engine's first scheduling
    round), and ``review ... M2``-style findings (a severity ``H``/``M``/``L`` and a number within
    60 characters after ``review``). Each is printed with its place.
``runtime_probes``
    No ``getattr`` probes of the runtime in ``server/``: a ``getattr`` call whose object mentions
    ``runtime`` (``getattr(service.runtime, "sandboxes", None)``) or a name assigned in the same
    function (or module) from such an expression, directly or through another such name
    (``local = getattr(service.runtime, ...)``, then ``getattr(local, "sessions")``). Each call
    counts, nested ones too.
``inside_stdlib``
    The agent inside the sandbox (``managers/sandbox/inside/``) imports the standard library and
    its own modules only: relatively, by their full name, or by the name the package runs under in
    the sandbox (``inside``, its folder's name: ``from inside import loop``). The package not
    written yet is a failure of this limit.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

PACKAGE = "arl_tangram"
SRC = Path(__file__).resolve().parent.parent / "src"

MANAGER = "managers/sandbox/manager.py"
MANAGER_MAX_LINES = 399  # under 400
CLASS_MAX_LINES = 500  # a class in managers/
REFERENCES_MAX = 5
INSIDE = "managers/sandbox/inside"
TOP = 10

_ORDINALS = ("second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
             "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth").split()
REFERENCE_PATTERNS = [
    re.compile(r"\bissues?\s*#?\d+", re.I),
    re.compile(r"(?<![-\w])rounds?\s+\d+", re.I),
    re.compile(r"\b(?:(?:twenty|thirty)[- ]?)?(?:" + "|".join(_ORDINALS) + r"|[2-9]\d*(?:st|nd|rd|th)|1\d+th)"
               r"[- ]rounds?\b", re.I),
    re.compile(r"\breview\b[^\n]{0,60}?\b[HML]\d+\b"),
]


@dataclass
class Module:
    name: str  # arl_tangram.runtime.base
    rel: str  # runtime/base.py
    path: Path
    text: str
    tree: ast.Module
    package: str  # the package its relative imports resolve against

    @cached_property
    def nodes(self) -> list[ast.AST]:
        """Every node of its tree (``ast.walk``'s order), walked once."""
        return list(ast.walk(self.tree))


@dataclass
class Measure:
    limit: str
    ok: bool
    value: object
    found: list[str] = field(default_factory=list)


def load(src: Path) -> dict[str, Module]:
    root = src / PACKAGE
    out: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(src).with_suffix("").parts)
        init = parts[-1] == "__init__"
        if init:
            parts.pop()
        name = ".".join(parts)
        text = path.read_text()
        out[name] = Module(name, path.relative_to(root).as_posix(), path, text, ast.parse(text, str(path)),
                           name if init else name.rpartition(".")[0])
    return out


def _private(name: str) -> bool:
    return len(name) > 1 and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(mod: Module, node: ast.ImportFrom) -> str:
    """The module ``from X import ...`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = mod.package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _nearest(name: str, modules: dict[str, Module]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


# -- sizes ---------------------------------------------------------------------------------------
def _lines(mod: Module) -> int:
    return len(mod.text.splitlines())


def classes(modules: dict[str, Module]) -> list[tuple[str, str, int]]:
    """(file, qualified class name, lines) of every class, largest first."""
    out = []

    def visit(mod: Module, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                out.append((mod.rel, name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(mod, child, f"{name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(mod, child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(mod, child, prefix)

    for mod in modules.values():
        visit(mod, mod.tree, "")
    return sorted(out, key=lambda c: (-c[2], c[0], c[1]))


# -- import cycles -------------------------------------------------------------------------------
def graph(modules: dict[str, Module]) -> dict[str, dict[str, str]]:
    """module -> {module it imports: where (``line`` and, when not at module level, how)}."""
    out: dict[str, dict[str, str]] = {}
    for mod in modules.values():
        edges: dict[str, str] = {}

        def add(target: str | None, line: int, how: str) -> None:
            if target and target != mod.name and target not in edges:
                edges[target] = f"{line}{f' ({how})' if how else ''}"

        def visit(node: ast.AST, how: str) -> None:
            if isinstance(node, ast.If) and _type_checking(node):
                for child in node.body:
                    visit(child, "TYPE_CHECKING")
                for child in node.orelse:
                    visit(child, how)
                return
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not how:
                how = "in a function"
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(_nearest(a.name, modules), node.lineno, how)
            elif isinstance(node, ast.ImportFrom):
                base = _base(mod, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    add(sub if sub in modules else _nearest(base, modules), node.lineno, how)
            for child in ast.iter_child_nodes(node):
                visit(child, how)

        visit(mod.tree, "")
        out[mod.name] = edges
    return out


def _components(g: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in g:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def cycles(g: dict[str, dict[str, str]]) -> list[list[str]]:
    """Cycles as paths (first module repeated last): the shortest through each module of each
    component that no path printed before passes through."""
    out = []
    for comp in _components(g):
        inside = set(comp)
        left = list(comp)
        while left:
            start = left[0]
            came: dict[str, str] = {}
            frontier = [start]
            found = None
            while frontier and found is None:
                nxt = []
                for v in frontier:
                    for w in sorted(g[v]):
                        if w == start:
                            found = v
                            break
                        if w in inside and w not in came:
                            came[w] = v
                            nxt.append(w)
                    if found is not None:
                        break
                frontier = nxt
            path = [start]
            v = found
            while v is not None and v != start:
                path.insert(1, v)
                v = came[v]
            path.append(start)
            out.append(path)
            left = [m for m in left if m not in path]
    return out


def _cycle_text(path: list[str], g: dict[str, dict[str, str]]) -> str:
    short = [m[len(PACKAGE) + 1:] for m in path]
    steps = [short[0]]
    for (a, b), name in zip(zip(path, path[1:]), short[1:]):
        steps.append(f"-[{g[a][b]}]-> {name}")
    return " ".join(steps)


# -- private accesses ----------------------------------------------------------------------------
def defined_private(mod: Module) -> set[str]:
    """The private names ``mod`` defines (the module docstring)."""
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name) and _private(node.id):
                names.add(node.id)

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _private(child.name):
                    names.add(child.name)
                visit(child, "class" if isinstance(child, ast.ClassDef) else "function")
                continue
            if scope != "function":
                if isinstance(child, ast.Assign):
                    for t in child.targets:
                        bind(t)
                    if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in child.targets):
                        for s in ast.walk(child.value):
                            if isinstance(s, ast.Constant) and isinstance(s.value, str) and _private(s.value):
                                names.add(s.value)
                elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                    bind(child.target)
                elif isinstance(child, (ast.For, ast.AsyncFor)):
                    bind(child.target)
                elif isinstance(child, (ast.Import, ast.ImportFrom)):
                    for a in child.names:
                        if a.asname and _private(a.asname):
                            names.add(a.asname)
            visit(child, scope)

    visit(mod.tree, "module")
    for node in mod.nodes:
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def _foreign_names(mod: Module) -> set[str]:
    """Names ``mod`` binds by importing from outside the package: modules and their members."""
    out: set[str] = set()
    for node in mod.nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != PACKAGE:
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] != PACKAGE:
            for a in node.names:
                out.add(a.asname or a.name)
    return out


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _own(obj: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own names."""
    return (isinstance(obj, ast.Name) and obj.id in ("self", "cls")) or (
        isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super")


def private_accesses(modules: dict[str, Module]) -> list[str]:
    defined = {name: defined_private(mod) for name, mod in modules.items()}
    owners: dict[str, set[str]] = {}
    for name, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(name)
    out = []
    for mod in modules.values():
        if mod.rel.startswith("bench/"):
            continue
        mine = defined[mod.name]
        foreign = _foreign_names(mod)

        def flag(node: ast.AST, what: str) -> None:
            out.append(f"{mod.rel}:{node.lineno}: {what}")

        def access(node: ast.AST, obj: ast.AST, attr: str, store: bool, how: str) -> None:
            if not _private(attr) or attr in mine or _own(obj):
                return
            root = _root(obj)
            if isinstance(root, ast.Name) and root.id in foreign:
                return
            others = sorted(m[len(PACKAGE) + 1:] for m in owners.get(attr, ()) if m != mod.name)
            if others:
                flag(node, f"{how} ({attr} is {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}'s)")
            elif store:
                flag(node, f"{how} (a private attribute put on another object)")

        for node in mod.nodes:
            if isinstance(node, ast.ImportFrom):
                base = _base(mod, node)
                if base.split(".")[0] == PACKAGE:
                    for a in node.names:
                        if _private(a.name):
                            flag(node, f"from {base[len(PACKAGE) + 1:] or PACKAGE} import {a.name}")
            elif isinstance(node, ast.Attribute):
                access(node, node.value, node.attr, not isinstance(node.ctx, ast.Load),
                       f"{ast.unparse(node.value)}.{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                access(node, node.args[0], node.args[1].value, node.func.id in ("setattr", "delattr"),
                       f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})")
    return out


# -- references ----------------------------------------------------------------------------------
def references(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        for i, line in enumerate(mod.text.splitlines(), 1):
            low = line.lower()
            if "issue" not in low and "round" not in low and "review" not in low:
                continue
            spans: list[tuple[int, int]] = []
            for pattern in REFERENCE_PATTERNS:
                for m in pattern.finditer(line):
                    if not any(a < m.end() and m.start() < b for a, b in spans):
                        spans.append((m.start(), m.end()))
            for a, b in sorted(spans):
                out.append(f"{mod.rel}:{i}: {line[a:b]!r}")
    return out


# -- runtime probes ------------------------------------------------------------------------------
def _mentions(node: ast.AST, names: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and (n.id == "runtime" or n.id in names):
            return True
        if isinstance(n, ast.Attribute) and n.attr == "runtime":
            return True
    return False


def runtime_probes(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        if not mod.rel.startswith("server/"):
            continue
        scopes: list[ast.AST] = [mod.tree] + [n for n in ast.walk(mod.tree)
                                              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in scopes:
            own: list[ast.AST] = []  # the scope's nodes, not its nested functions'

            def collect(node: ast.AST) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    own.append(child)
                    collect(child)

            collect(scope)
            tainted: set[str] = set()
            assigns = [(t, n.value) for n in own if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
                       if n.value is not None
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
            grew = True
            while grew:
                grew = False
                for target, value in assigns:
                    if _mentions(value, tainted):
                        for t in ast.walk(target):
                            if isinstance(t, ast.Name) and t.id not in tainted:
                                tainted.add(t.id)
                                grew = True
            for n in own:
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and n.args
                        and _mentions(n.args[0], tainted)):
                    out.append(f"{mod.rel}:{n.lineno}: getattr({ast.unparse(n.args[0])}, "
                               f"{ast.unparse(n.args[1]) if len(n.args) > 1 else ''})")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


# -- the agent inside the sandbox ----------------------------------------------------------------
def inside_imports(modules: dict[str, Module]) -> tuple[bool, list[str]]:
    """(whether the package exists, its imports of anything but the standard library and itself)."""
    package = f"{PACKAGE}.{INSIDE.replace('/', '.')}"
    own = INSIDE.rpartition("/")[2]  # its name in the sandbox
    mine = [m for m in modules.values() if m.name == package or m.name.startswith(package + ".")]
    out = []
    for mod in mine:
        for node in mod.nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(mod, node)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                if name == package or name.startswith(package + ".") or name.split(".")[0] == own:
                    continue
                if name.split(".")[0] in sys.stdlib_module_names:
                    continue
                out.append(f"{mod.rel}:{node.lineno}: imports {name}")
    return bool(mine), out


# -- the check -----------------------------------------------------------------------------------
def check(src: Path = SRC) -> dict:
    modules = load(src)
    sizes = sorted(((m.rel, _lines(m)) for m in modules.values()), key=lambda s: (-s[1], s[0]))
    cls = classes(modules)
    manager = next((n for rel, n in sizes if rel == MANAGER), None)
    big = [f"{f} {c}: {n} lines" for f, c, n in cls if f.startswith("managers/") and n > CLASS_MAX_LINES]
    g = graph(modules)
    cyc = [_cycle_text(p, g) for p in cycles(g)]
    private = private_accesses(modules)
    refs = references(modules)
    probes = runtime_probes(modules)
    has_inside, not_std = inside_imports(modules)
    measures = {
        "files": Measure(f"{MANAGER} under {MANAGER_MAX_LINES + 1} lines",
                         manager is None or manager <= MANAGER_MAX_LINES, manager,
                         [] if manager is None or manager <= MANAGER_MAX_LINES else [f"{MANAGER}: {manager} lines"]),
        "classes": Measure(f"no class in managers/ over {CLASS_MAX_LINES} lines", not big, len(big), big),
        "cycles": Measure("no import cycle (type-checking and function-level imports count)", not cyc, len(cyc), cyc),
        "private": Measure("no access to another module's private names in src/ outside bench/", not private,
                           len(private), private),
        "references": Measure(f"at most {REFERENCES_MAX} issue/round/review references in src/",
                              len(refs) <= REFERENCES_MAX, len(refs), refs),
        "runtime_probes": Measure("no getattr probes of the runtime in server/", not probes, len(probes), probes),
        "inside_stdlib": Measure(f"{INSIDE}/ imports the standard library and itself only",
                                 has_inside and not not_std, len(not_std) if has_inside else "absent",
                                 not_std if has_inside else [f"{INSIDE}/ is not there"]),
    }
    return {
        "src": str(src / PACKAGE),
        "files": len(sizes), "lines": sum(n for _, n in sizes),
        "largest_files": [{"file": f, "lines": n} for f, n in sizes[:TOP]],
        "largest_classes": [{"file": f, "class": c, "lines": n} for f, c, n in cls[:TOP]],
        "measures": {name: vars(m) for name, m in measures.items()},
    }


def table(report: dict) -> str:
    out = [f"house check of {report['src']}: {report['files']} files, {report['lines']:,} lines", "",
           "largest files                                                lines"]
    out += [f"  {f['file']:<58} {f['lines']:>5}" for f in report["largest_files"]]
    out += ["", "largest classes                                              lines"]
    out += [f"  {c['file'] + ' ' + c['class']:<58} {c['lines']:>5}" for c in report["largest_classes"]]
    out += ["", f"  {'measure':<15} {'value':>6}  {'':<4}  limit"]
    for name, m in report["measures"].items():
        out.append(f"  {name:<15} {str(m['value']):>6}  {'ok' if m['ok'] else 'FAIL':<4}  {m['limit']}")
    for name, m in report["measures"].items():
        if m["found"]:
            out += ["", f"{name}{'' if m['ok'] else ' (over its limit)'}:"]
            out += [f"  {line}" for line in m["found"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON rather than a table")
    ap.add_argument("--src", type=Path, default=SRC, help=f"the folder holding {PACKAGE}/ (default: %(default)s)")
    args = ap.parse_args(argv)
    report = check(args.src)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if all(m["ok"] for m in report["measures"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
