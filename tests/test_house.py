"""The house check (``tools/house.py``): each of its limits asserted on its own, so that a failure
names the measure; and its rules, on a small package written here, catching what they should and
only that."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "house.py"
MEASURES = ["files", "classes", "cycles", "private", "references", "runtime_probes", "inside_stdlib"]


def _house():
    spec = importlib.util.spec_from_file_location("house", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["house"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


house = _house()


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run([sys.executable, str(TOOL), "--json"], capture_output=True, text=True, timeout=300)
    out = json.loads(done.stdout)
    assert done.returncode == (0 if all(m["ok"] for m in out["measures"].values()) else 1), done.stderr
    return out


def test_the_check_prints_every_measure_and_the_largest(report):
    assert sorted(report["measures"]) == sorted(MEASURES)
    assert len(report["largest_files"]) == house.TOP and len(report["largest_classes"]) == house.TOP
    table = house.table(report)
    for name in MEASURES:
        assert f"  {name} " in table


@pytest.mark.parametrize("name", MEASURES)
def test_limit(report, name):
    m = report["measures"][name]
    assert m["ok"], f"{name}: {m['limit']}; found {m['value']}:\n" + "\n".join(m["found"])


# -- the rules, on a package written for them -----------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> dict:
    for rel, text in files.items():
        path = tmp_path / "arl_tangram" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return house.check(tmp_path)["measures"]


def test_cycles_count_type_checking_and_function_level_imports(tmp_path):
    m = _tree(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .two import B\n",
        "a/two.py": "def f():\n    from . import three\n",
        "a/three.py": "from ..a.one import x\n",
        "b.py": "import arl_tangram.a.one\n",  # into the cycle, not part of it
    })
    assert m["cycles"]["found"] == [
        "a.one -[3 (TYPE_CHECKING)]-> a.two -[2 (in a function)]-> a.three -[1]-> a.one"]
    assert not m["cycles"]["ok"]


def test_private_accesses_across_modules_and_not_the_standard_librarys(tmp_path):
    m = _tree(tmp_path, {
        "__init__.py": "",
        "svc.py": """
            class Service:
                def __init__(self):
                    self._record = []
                def _finish(self):
                    pass
            def _helper():
                pass
            """,
        "dialect.py": """
            import os
            import sys
            import signal as _signal
            from collections import namedtuple
            from .svc import _helper, Service
            P = namedtuple("P", "a")

            class Mine:
                def __init__(self):
                    self._own = 1
                def go(self, service, other, p):
                    service._finish()
                    getattr(service, "_record")
                    service._hung = 1
                    other._own = 2
                    super()._record
                    os._exit
                    sys._getframe()
                    _signal.signal
                    p._replace(a=2)
            """,
        "bench/__init__.py": "",
        "bench/tool.py": "from ..svc import _helper\n",
    })
    found = [f.split(": ", 1)[1] for f in m["private"]["found"]]
    assert sorted(found) == sorted(["from svc import _helper", "service._finish (_finish is svc's)",
                                    "getattr(service, '_record') (_record is svc's)",
                                    "service._hung (a private attribute put on another object)"])
    assert all(f.startswith("dialect.py:") for f in m["private"]["found"])


def test_references_in_the_sources(tmp_path):
    m = _tree(tmp_path, {
        "__init__.py": "",
        "x.py": '''
            """Issue 26, issue #15, the seventeenth round, a 2nd round, round 3 (review of issue 24, M3)."""
            # not: a first round of scheduling, --multigpu-rounds 4, issues, a review of the code
            ''',
    })
    found = [f.split(": ", 1)[1] for f in m["references"]["found"]]
    assert found == ["'Issue 26'", "'issue #15'", "'seventeenth round'", "'2nd round'", "'round 3'",
                     "'issue 24'"]  # one reference: the review's overlaps the issue's
    assert m["references"]["ok"] is False  # six, over five


def test_runtime_probes_in_the_server(tmp_path):
    m = _tree(tmp_path, {
        "__init__.py": "",
        "server/__init__.py": "",
        "server/d.py": """
            def f(service, request):
                local = getattr(service.runtime, "sandboxes", None)
                sb = getattr(local, "sessions", {}).get(1)
                getattr(request.app, "state", None)
                return getattr(sb, "group", None)
            """,
        "other.py": "def g(runtime):\n    return getattr(runtime, 'x', None)\n",  # not in server/
    })
    assert [f.split(":")[1] for f in m["runtime_probes"]["found"]] == ["3", "4", "6"]


def test_the_sandbox_agent_imports_the_standard_library_only(tmp_path):
    files = {"__init__.py": "", "managers/__init__.py": "", "managers/sandbox/__init__.py": "",
             "managers/sandbox/inside/__init__.py": "import os, json\nfrom . import loop\n",
             "managers/sandbox/inside/__main__.py": "from inside import loop\nimport _signal\n",
             "managers/sandbox/inside/loop.py": "from .. import spec\nimport uvloop\nimport asyncio\n",
             "managers/sandbox/spec.py": ""}
    m = _tree(tmp_path, files)
    found = [f.split(": ", 1)[1] for f in m["inside_stdlib"]["found"]]
    assert found == ["imports arl_tangram.managers.sandbox.spec", "imports uvloop"]


def test_sizes_and_their_limits(tmp_path):
    big = "class Big:\n" + "    x = 1\n" * 600
    m = _tree(tmp_path, {"__init__.py": "", "managers/__init__.py": "", "managers/sandbox/__init__.py": "",
                         "managers/sandbox/manager.py": big, "policy.py": big})
    assert m["files"]["value"] == 601 and not m["files"]["ok"]
    assert m["classes"]["found"] == ["managers/sandbox/manager.py Big: 601 lines"]
