"""The sandbox's agent as a package (``managers/sandbox/inside``): the standard library only, its
state in one object, and a one-shot loading only what it uses."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from runnerkit import PRELUDE, run_with_runner

from arl_tangram.managers.sandbox.isolation import INSIDE

MODULES = sorted(INSIDE.glob("*.py"))


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, 0, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node, node.level, node.module or ""
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            arg = node.args[0] if node.args else None
            level = node.args[4].value if len(node.args) > 4 and isinstance(node.args[4], ast.Constant) else 0
            if isinstance(arg, ast.Constant):
                yield node, level, arg.value
            else:  # (the loop's table of operations: names of its own modules, relative)
                assert level == 1, f"{path.name}:{node.lineno}: a computed import that is not relative"


def test_the_agent_imports_the_standard_library_and_itself_only():
    """It runs under the sandbox's interpreter (an image's own python among them): nothing of the
    server's packages or environment can be there."""
    assert {p.name for p in MODULES} >= {"__init__.py", "__main__.py", "loop.py", "procs.py", "zygote.py"}
    seen = set()
    for path in MODULES:
        for node, level, name in _imports(path):
            where = f"{path.name}:{node.lineno}"
            if level:
                assert level == 1, f"{where}: reaches above the package"
                continue
            top = name.split(".")[0]
            seen.add(top)
            if top == "inside":  # the entry imports the package by the name it has in the sandbox
                assert path.name == "__main__.py", where
                continue
            assert top in sys.stdlib_module_names, f"{where}: {name} is not in the standard library"
            assert top != "arl_tangram", where
    assert "os" in seen and "arl_tangram" not in seen


def test_the_agent_keeps_its_state_in_one_object():
    """What outlives a request lives on ``inside.State``: no ``global`` statement, no module-level
    list (the shape the old module kept its state in), and every other module-level name a
    constant (upper case), an import, a function or a class."""
    for path in MODULES:
        tree = ast.parse(path.read_text(), str(path))
        assert not any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(tree)), path.name
        for node in tree.body:
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                assert isinstance(t, ast.Name), f"{path.name}:{node.lineno}"
                assert t.id.lstrip("_").isupper() or t.id in ("_socket", "ctypes"), f"{path.name}:{node.lineno}: {t.id}"
            if targets:
                assert not isinstance(node.value, (ast.List, ast.ListComp)), f"{path.name}:{node.lineno}: a list"


LOADED = PRELUDE + r'''
import base64, tempfile
from inside import loop
from inside.zygote import Zygote
st.workspace = tempfile.mkdtemp()
os.chdir(st.workspace)  # (as loop.main does)
st.zygote = Zygote(st)
def mods():
    return sorted(m for m in sys.modules if m == "inside" or m.startswith("inside."))
seen = {"start": mods()}
run = lambda req: loop.handler(st, req["op"])(st, req)
run({"op": "python", "code": "print(1)"})
run({"op": "write", "files": {"main.sh": base64.b64encode(b"echo 1").decode()}})
r = run({"op": "run", "argv": ["bash", "main.sh"]})
run({"op": "read", "paths": ["main.sh"]})
run({"op": "reset", "dirs": {}})
seen["one_shots"] = mods()
seen["bash"] = base64.b64decode(r["stdout"]).decode()
run({"op": "fs", "call": "stat", "path": st.workspace})
seen["fs"] = mods()
r = run({"op": "cell", "code": "1 + 1"})
seen["cell"] = [mods(), r["display"]]
r = run({"op": "shell", "command": "echo $((2 + 3))"})
seen["shell"] = [mods(), base64.b64decode(r["stdout"]).decode()]
run({"op": "rest", "roots": []})
seen["rest"] = mods()
print(json.dumps(seen), file=out)
'''


def test_a_one_shot_loads_only_what_it_uses(tmp_path):
    """A sandbox's start and its one-shots (python, bash, files, the reset) import the loop,
    processes, the zygote, files and the reset; the filesystem calls, sessions, cells, the shell
    and rest and wake are imported by their first request."""
    seen = run_with_runner(tmp_path, LOADED)
    base = ["inside", "inside.loop", "inside.procs", "inside.zygote"]
    assert seen["start"] == base, seen
    one_shots = sorted(base + ["inside.files", "inside.reset"])
    assert seen["one_shots"] == one_shots and seen["bash"] == "1\n", seen
    assert seen["fs"] == sorted(one_shots + ["inside.fsops"]), seen
    cell = sorted(one_shots + ["inside.fsops", "inside.sessions"])
    assert seen["cell"] == [cell, [{"text/plain": "2"}]], seen  # (cells and pickling: in the session's interpreter)
    shell = sorted(cell + ["inside.shell", "inside.shellio"])
    assert seen["shell"] == [shell, "5\n"], seen
    assert seen["rest"] == sorted(shell + ["inside.rest"]), seen


EARLIER_BLOB = PRELUDE + r'''
import marshal, pickle, types
from inside import pickling
# a namespace as the agent before this package packed it: its helpers were the module ``runner``'s
# (or ``__main__``'s, run as a script); a blob of that kind must still load after an upgrade
for where in ("runner", "__main__"):
    mod = types.ModuleType(where) if where == "runner" else sys.modules["__main__"]
    sys.modules[where] = mod
    for name in ("_rest_fn", "_rest_fn_fill", "_rest_cls", "_rest_cls_fill"):
        stand_in = getattr(pickling, name)
        fake = types.FunctionType(stand_in.__code__, stand_in.__globals__, name, stand_in.__defaults__)
        fake.__module__, fake.__qualname__ = where, name
        setattr(mod, name, fake)
    ns = {"__name__": "__main__"}
    exec("k = 7\ndef f(x):\n    return x + k\nclass C:\n    y = 2\nc = C()", ns)
    saved = pickling._rest_fn, pickling._rest_fn_fill, pickling._rest_cls, pickling._rest_cls_fill
    pickling._rest_fn, pickling._rest_fn_fill, pickling._rest_cls, pickling._rest_cls_fill = (
        mod._rest_fn, mod._rest_fn_fill, mod._rest_cls, mod._rest_cls_fill)
    st.namespace = ns
    blob = pickling.rest_dump(st, {k: v for k, v in ns.items() if k != "__builtins__"})
    pickling._rest_fn, pickling._rest_fn_fill, pickling._rest_cls, pickling._rest_cls_fill = saved
    assert b"_rest_fn" in blob and b"inside.pickling" not in blob and (where != "runner" or b"runner" in blob), blob
    if where == "runner":
        del sys.modules["runner"]
    for name in ("_rest_fn", "_rest_fn_fill", "_rest_cls", "_rest_cls_fill"):
        delattr(mod, name)  # gone, as after an upgrade
    st.namespace = {"__name__": "__main__"}
    r = pickling.load_here(st, {"state": marshal.dumps({"ns": blob, "cwd": os.getcwd(), "environ": dict(os.environ),
                                                        "path": list(sys.path)}, 4)})
    got = st.namespace
    print(json.dumps([where, r["dropped"], got["f"](1), got["c"].y, got["f"].__globals__ is got]), file=out)
'''


def test_a_namespace_the_agent_packed_before_it_was_a_package_still_wakes(tmp_path):
    """Rested sessions are kept on disk across a server's restart: a blob whose functions and
    classes were packed by ``runner._rest_fn`` (or ``__main__``'s, the agent run as a script) loads
    with the package's own helpers, the functions bound to the namespace they are loaded into."""
    script = tmp_path / "earlier.py"
    script.write_text(EARLIER_BLOB)
    import subprocess
    p = subprocess.run([sys.executable, "-I", str(script), str(INSIDE.parent)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [__import__("json").loads(line) for line in p.stdout.splitlines()]
    assert lines == [["runner", {}, 8, 2, True], ["__main__", {}, 8, 2, True]], lines
