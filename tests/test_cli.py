"""The command line as a user meets it: real subprocesses, exit codes, files written."""

import json
import subprocess
import sys

import pytest


def tangram(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "arl_tangram.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_simulate_without_client_remaining_turns(tmp_path):
    """``--no-client-remaining``: the simulated clients send no remaining turns (issue 13)."""
    out = tmp_path / "r.json"
    p = tangram("simulate", "--workload", "search", "--trajectories", "16", "--steps", "1", "--policy", "tangram",
                "--no-client-remaining", "--json", str(out))
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert report["client_remaining"] is False and report["results"][0]["policy"] == "tangram"


def test_simulate_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = tangram("simulate", "--workload", "rlvr", "--trajectories", "60", "--steps", "1",
                "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert report["workload"] == "rlvr"
    assert {r["policy"] for r in report["results"]} == {"tangram", "trajectory-static", "task-isolated", "fifo"}
    keys = {"policy", "num_actions", "avg_act_s", "p50_act_s", "p99_act_s", "avg_step_s", "cpu_core_seconds_held",
            "cpu_core_seconds_busy", "gpu_seconds_held", "gpu_seconds_busy", "cpu_utilization", "gpu_utilization"}
    assert all(keys <= set(r) for r in report["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tangram" in p.stdout and "avg ACT" in p.stdout


def test_export_then_replay_a_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    p = tangram("simulate", "--workload", "search", "--trajectories", "10", "--steps", "1", "--policy", "tangram",
                "--export-trace", str(trace))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "replay.json"
    p = tangram("simulate", "--trace", str(trace), "--policy", "fifo", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["results"][0]["policy"] == "fifo"


@pytest.mark.parametrize("args,needle", [
    (["--scale", "0"], "--scale"),
    (["--workload", "nope"], "nope"),
    (["--cpus", "-4"], "--cpus"),
    (["--trace", "/nonexistent/t.jsonl"], "cannot open"),
    (["--workload", "rlvr", "--trace", "x.jsonl"], "--workload and --trace"),
    (["--workload", "mopd", "--gpus", "0"], "--gpus"),
])
def test_bad_flags_exit_2_with_one_clear_message(args, needle):
    p = tangram("simulate", *args)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr


def test_bad_trace_line_exits_2_naming_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"step": 0, "trajectory": "t", "seq": 0, "service": "sandbox", "gap_s": 1, "work_s": 1}\n'
                     '{"step": 0, "trajectory": "t", "seq": 1, "service": "sandbox", "gap_s": "soon", "work_s": 1}\n')
    p = tangram("simulate", "--trace", str(trace))
    assert p.returncode == 2
    assert ":2:" in p.stderr and "gap_s" in p.stderr
    assert "Traceback" not in p.stderr


def test_min_resources_reports_a_scale_per_policy(tmp_path):
    out = tmp_path / "m.json"
    p = tangram("simulate", "--workload", "code_agent", "--trajectories", "16", "--steps", "1", "--min-resources",
                "--json", str(out))
    assert p.returncode == 0, p.stderr
    mr = json.loads(out.read_text())["min_resources"]
    assert mr["reference"] == "trajectory-static"
    t = mr["policies"]["tangram"]
    assert t["min_scale"] is not None and t["min_scale"] < 1 and t["resource_savings"] > 0


def test_bench_scheduler_prints_rates_per_depth(tmp_path):
    out = tmp_path / "b.json"
    p = tangram("bench", "scheduler", "--nodes", "4", "--seconds", "0.05", "--repeats", "3", "--json", str(out))
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    for key in ("actions_per_s", "actions_per_cpu_s"):
        rates = report[key]
        assert set(rates) == {"1000", "10000", "100000"} and all(v > 0 for v in rates.values())
    for depth, runs in report["actions_per_cpu_s_runs"].items():  # the figure is the median of the runs
        assert len(runs) == 3 and report["actions_per_cpu_s"][depth] == sorted(runs)[1]
    if report["compiled"]:  # the sources were measured too, in a child process
        assert len(report["pure_actions_per_cpu_s_at_10000_runs"]) == 3
        assert report["compiled_over_pure_at_10000"] > 0


def test_ci_runs_the_readme_commands_word_for_word():
    """.ci/run takes both commands from the README (the line after each one's comment), so they
    cannot drift apart; each command installs what it needs (CI installs nothing before them)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    lines = (root / "README.md").read_text().splitlines()
    ci = (root / ".ci" / "run").read_text()
    for marker in ("# install and run the main job", "# install and run the tests"):
        after = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith(marker)]
        assert len(after) == 1 and after[0].startswith("apt-get update && apt-get install -y bubblewrap"), after
        assert f'readme_command "{marker[2:]}"' in ci
    assert "pip install" not in ci.replace("python3 -m venv", "")  # nothing installed beside them


def test_help_keeps_every_default_it_names():
    """Rich markup ate hand-written "[default: ...]" texts ("SQLite journal of accepted actions .")."""
    env_cols = {"COLUMNS": "200"}
    import os
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "serve", "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env_cols})
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.replace("│", " ").split())
    assert "~/.local/state/arl-tangram/journal.sqlite3" in text, text
    assert "one per 4 cores up to 8" in text and "as --fronts" in text and " ." not in text, text
    q = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "evaluate", "--help"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, **env_cols})
    assert "0.125,0.25,0.5,1,2" in " ".join(q.stdout.replace("│", " ").split()), q.stdout


NO_TORCH = """
import sys
class _NoTorch:  # as on a machine where torch is not installed
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTorch())
"""


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
def test_everything_but_model_services_runs_without_torch(tmp_path):
    """``tangram serve`` died with ModuleNotFoundError: torch on a fresh machine (issue 20): the
    runtime imported the model manager at the top. The service, the embedded runtime, the clients
    and the simulator import and run without torch; a model service says what to install."""
    code = NO_TORCH + """
import asyncio
import arl_tangram.server.app, arl_tangram.server.service, arl_tangram.server.config
import arl_tangram.client, arl_tangram.sim.simulator, arl_tangram.cli
from arl_tangram.runtime import Tangram

async def main():
    async with Tangram.local() as tg:
        r = await tg.run("print(6 * 7)")
        print(r.outcome, r.stdout.strip())
asyncio.run(main())
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["ok", "42"], p.stdout + p.stderr[-3000:]
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "rm", "loader": "arl_tangram.managers.models.tiny:reward_model"}]}))
    serve = NO_TORCH + "from arl_tangram.cli import main\nsys.argv = ['tangram'] + sys.argv[1:]\nmain()\n"
    p = subprocess.run([sys.executable, "-c", serve, "serve", "--port", "9", "--journal", str(tmp_path / "j.sqlite3"),
                        "--config", str(config)], capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "pip install 'arl-tangram[models]'" in out and "Traceback" not in out, out[-3000:]
