"""The compiled hot path (``setup.py``, ``arl_tangram.build``) and its sources are one program:
the same decisions, records that travel between processes, and a switch that really switches."""

import copy
import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl_tangram import build
from arl_tangram.core.action import Action, Allocation, Demand, Finished, Outcome, Setup
from arl_tangram.core.cluster import ApiQuota, Cluster, CpuNode, GpuNode, ModelSpec
from arl_tangram.core.pools import Instance
from arl_tangram.core.records import Completion, Load, Loaded, Running
from arl_tangram.policy.action_level import Options, tangram_policy
from arl_tangram.policy.base import Costs, Evict, Grow, Prefetch, Release, Reserve, Shrink, Start
from arl_tangram.sim.compare import run_policy
from arl_tangram.sim.workloads import generate

CASES = [("code_agent", 24, 0.5), ("mopd", 48, 0.5), ("search", 24, 1.0), ("mixed", 12, 0.5)]
POLICIES = ("tangram", "trajectory-static", "fifo")


def summaries() -> dict:
    """What ``tangram simulate`` reports, for a few workloads, scales and policies."""
    from arl_tangram.core import scale_cluster

    out = {}
    for name, n, scale in CASES:
        wl = generate(name, seed=3, trajectories=n, steps=1)
        for policy in POLICIES:
            run = run_policy(wl, scale_cluster(wl.default_cluster, scale), policy, 3)
            out[f"{name}/{scale}/{policy}"] = run.summary
    return out


def in_sources(code: str) -> str:
    env = {**os.environ, "ARL_TANGRAM_PURE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=300).stdout


def test_the_switch_imports_the_sources():
    out = in_sources("from arl_tangram import build, engine; print(build.compiled(), engine.__file__)")
    compiled, path = out.split()
    assert compiled == "False" and path.endswith("engine.py")


@pytest.mark.skipif(not build.compiled(), reason="this install runs the sources only (nothing compiled to compare)")
def test_compiled_and_sources_decide_the_same():
    here = json.loads(json.dumps(summaries()))
    there = json.loads(in_sources("import json, sys; sys.path.insert(0, 'tests'); from test_build import summaries; "
                                  "print(json.dumps(summaries()))").strip().splitlines()[-1])
    assert there == here


RECORDS = [
    Demand({"cpu": (1, 4)}),
    Action("a1", "sandbox", Demand({"cpu": (1, 2)}), job="j", trajectory="t", step=3, operation="shell",
           hint_s=0.5, parallel_fraction=0.5, timeout_s=9.0, payload={"code": "x"}, remaining_turns=2),
    Allocation("cpu", 2, (4, 5), Setup.THAW, (), "r", False, 1.0),
    Completion("a1", Outcome.OK, 0.1, 0.2, "m", {"stdout": "x"}, 0.3),
]
RECORDS += [Running(RECORDS[1], RECORDS[2], 1.5), Start(RECORDS[1], 2, 2),
            Finished(RECORDS[1], Outcome.FAILED, 1.0, 1.5, 2.0, 0.1, 0.4, 2, "exit 1")]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_travel_between_processes_whole(record):
    back = pickle.loads(pickle.dumps(record))
    assert type(back) is type(record)
    for f in dataclasses.fields(record):
        mine, theirs = getattr(record, f.name), getattr(back, f.name)
        if isinstance(mine, Action):
            assert dataclasses.astuple(mine) == dataclasses.astuple(theirs)
        else:
            assert theirs == mine, f.name
    assert dataclasses.replace(record) is not record


FROZEN = [
    CpuNode("c", 2, 8.0), GpuNode("g", 2, 40.0, 2, 20.0, ((0, 1),)), ApiQuota("s", 2.0, 3, 1.0),
    ModelSpec("m", 4.0, 2, 0.5, 10.0),
    Cluster((CpuNode("c", 2),), (GpuNode("g", 2),), (ApiQuota("s", 2.0, 3),), (ModelSpec("m", 4.0),)),
    Load("k", "m", (0, 1), 2.0, Instance("m", (0, 1), 2.0)), Loaded("k"), Grow("a1", 1), Shrink("a1", 1),
    Prefetch("m", (0,)),
    Evict("m", (0,)), Reserve("k", "cpu", 0, 2), Release("k"), Costs(session_mem_gb=1.0),
    Options(ordering="fifo", job_weights={"j": 2.0}),
]


@pytest.mark.parametrize("value", FROZEN, ids=lambda r: type(r).__name__)
def test_frozen_records_and_settings_pickle_and_copy(value):
    """Compiled, a frozen dataclass's default pickling sets its fields through the frozen
    ``__setattr__`` and fails (``FrozenInstanceError``): ``Loaded`` is a report of the manager seam,
    a ``Cluster`` or ``Options`` is what a caller ships to another process or copies."""
    for back in (pickle.loads(pickle.dumps(value)), copy.copy(value), copy.deepcopy(value)):
        assert type(back) is type(value)
        assert repr(back) == repr(value)  # ``Load`` holds an ``Instance``, compared by identity


def test_a_policy_deep_copies():
    policy = tangram_policy(aging_per_s=0.2)
    assert copy.deepcopy(policy).opt == policy.opt


def test_an_action_rebuilt_is_validated_again():
    a = Action("x", "model:m")
    assert a.pool == "gpu" and a.demand.ranges == {"gpu": (1, 1)}
    assert dataclasses.replace(a, service="sandbox").pool == "cpu"


def test_stale_names_a_source_newer_than_its_compiled_module(tmp_path, monkeypatch):
    (tmp_path / "setup.py").write_text("")  # a source checkout: <root>/setup.py, <root>/src/<package>
    tmp_path = tmp_path / "src" / "arl_tangram"
    (tmp_path / "core").mkdir(parents=True)
    so = tmp_path / "core" / "pools.cpython-311-x86_64-linux-gnu.so"
    src = tmp_path / "core" / "pools.py"
    so.write_bytes(b"")
    src.write_text("")
    os.utime(so, (1000, 1000))
    os.utime(src, (2000, 2000))
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.stale() == ["core/pools.py"]
    os.utime(so, (3000, 3000))
    assert build.stale() == []
    # a module compiled by an older build and no longer in HOT_PATH shadows its source too
    (tmp_path / "core" / "seam.py").write_text("")
    (tmp_path / "core" / "seam.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert build.stale() == ["core/seam.py"]
    (tmp_path.parent.parent / "setup.py").unlink()  # an installed wheel: never stale
    assert build.stale() == []


@pytest.mark.skipif(not build.compiled(), reason="nothing compiled to be stale")
def test_a_checkout_edited_since_its_build_runs_its_sources(tmp_path):
    src = os.path.dirname(os.path.dirname(build.__file__))
    shutil.copytree(src, tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (tmp_path / "setup.py").write_text("")
    edited = tmp_path / "src" / "arl_tangram" / "engine.py"
    os.utime(edited, (time.time() + 5, time.time() + 5))  # edited after the build
    code = "from arl_tangram import build, engine; print(build.compiled(), engine.__file__)"
    p = subprocess.run([sys.executable, "-W", "always", "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "src")},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    compiled, path = p.stdout.split()
    assert compiled == "False" and path == str(edited)
    assert "older than their sources (engine.py)" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not build.compiled(), reason="the rest of the suite already runs the sources here")
def test_the_engine_and_policy_tests_pass_on_the_sources_too():
    """The suite runs the compiled build where there is one; the plain one is what a machine
    without a compiler gets, so its core tests run as well."""
    tests = os.path.dirname(__file__)
    files = [os.path.join(tests, f) for f in ("test_core.py", "test_engine.py", "test_policy.py", "test_hot_path.py",
                                              "test_properties.py")]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *files],
                       env={**os.environ, "ARL_TANGRAM_PURE": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    assert " passed" in p.stdout


@pytest.mark.slow
@pytest.mark.skipif(not build.compiled(), reason="this machine does not compile the hot path")
def test_a_hot_path_mypy_rejects_fails_the_install_naming_the_way_out(tmp_path):
    """mypyc type-checks before it compiles, and exits on an error: a user building with another
    mypy than the one ``pyproject.toml`` pins (``--no-build-isolation``, a newer release) may meet
    one. The install then says how to install anyway, as for a failed compile. Built as pip builds
    it, in its isolated build environment (which has the pinned mypy; this interpreter may not:
    running ``setup.py`` here, with no mypyc, compiled nothing and passed)."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src-tree"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, src)
    shutil.copytree(root / "src", src / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    with open(src / "src" / "arl_tangram" / "waits.py", "a") as f:
        f.write('\nNOT_AN_INT: int = "x"  # what a stricter mypy might find\n')
    env = {k: v for k, v in os.environ.items() if k != "ARL_TANGRAM_PURE"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"), str(src)],
                       env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "ARL_TANGRAM_PURE=1 installs it as plain Python" in out, out[-3000:]


def test_a_rebuild_that_leaves_the_shim_as_it_was_is_not_stale(tmp_path, monkeypatch):
    """mypyc puts a group's code in one shared library beside the package; ``setup.py build_ext
    --inplace`` after an edit rebuilds it but not the per-module shims, whose C never changes
    (measured: shim 12:49:18, source edited 12:57:29, library 12:57:56). Counted by the shim
    alone, the fresh build was stale, and the package ran its sources."""
    (tmp_path / "setup.py").write_text("")
    pkg = tmp_path / "src" / "arl_tangram"
    (pkg / "core").mkdir(parents=True)
    shim = pkg / "core" / "pools.cpython-311-x86_64-linux-gnu.so"
    src = pkg / "core" / "pools.py"
    lib = tmp_path / "src" / "b1dd19a5c282d436d25d__mypyc.cpython-311-x86_64-linux-gnu.so"
    other = tmp_path / "src" / "81d243bd2c585b0f4821__mypyc.cpython-311-x86_64-linux-gnu.so"  # another group's
    shim.write_bytes(b"\0b1dd19a5c282d436d25d__mypyc\0init_arl_tangram___core___pools\0")
    for path, t in ((shim, 1000), (src, 2000), (lib, 3000), (other, 5000)):
        if not path.exists():
            path.write_bytes(b"")
        os.utime(path, (t, t))
    monkeypatch.setattr(build, "ROOT", pkg)
    assert build.stale() == []
    os.utime(src, (4000, 4000))  # edited after the library's build
    assert build.stale() == ["core/pools.py"]
