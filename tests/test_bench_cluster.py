"""``tangram bench cluster``'s parts: the CPU meter of a head and a Ray cluster's processes (read
from real processes titled as Ray titles its own), the hops of one action, the cores a run pins,
and the whole bench on a loopback Ray cluster (slow)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from arl_tangram.bench.cluster import split_cores
from arl_tangram.bench.cluster_head import breakdown
from arl_tangram.bench.cluster_hops import HOPS, MainSampler, SpySampler, group_of, hops_of
from arl_tangram.bench.cpu import ClusterCpuMeter

BURN = "import time\nt = time.process_time() + {s}\nwhile time.process_time() < t:\n    pass\ntime.sleep(60)"

# a head: its main thread burns, a thread named as Ray names its C++ threads burns, a Python
# thread (the interpreter's name) burns; the threads stay alive (a thread gone is "other")
HEAD = """
import ctypes, threading, time
done = threading.Semaphore(0)
def burn(s, name=None):
    if name:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME, as Ray's threads are named
    t = time.thread_time() + s
    while time.thread_time() < t:
        pass
    done.release()
    time.sleep(60)
for args in ((0.3, "worker.io"), (0.2,)):
    threading.Thread(target=burn, args=args, daemon=True).start()
t = time.thread_time() + 0.4
while time.thread_time() < t:
    pass
done.acquire(); done.acquire()
print("done", flush=True)
time.sleep(60)
"""


def _titled(title: str, seconds: float) -> subprocess.Popen:
    """A process whose ``argv[0]`` is ``title`` (as Ray's are) that burns ``seconds`` of CPU."""
    return subprocess.Popen(["bash", "-c", f'exec -a "{title}" {sys.executable} -c "$0"', BURN.format(s=seconds)])


def _spent(pid: int, at_least: float, timeout_s: float = 30.0) -> None:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    deadline = time.monotonic() + timeout_s
    while (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") < at_least:
        assert time.monotonic() < deadline, f"process {pid} did not burn {at_least} s"
        time.sleep(0.05)
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()


def test_the_cluster_meter_reads_the_head_by_thread_and_ray_s_processes_by_title():
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdout=subprocess.PIPE, text=True)
    procs = {"agent": _titled("ray::NodeAgent", 0.3), "raylet": _titled("/opt/ray/core/src/ray/raylet/raylet", 0.2),
             "gcs": _titled("/opt/ray/core/src/ray/gcs/gcs_server", 0.2), "worker": _titled("ray::IDLE", 0.2),
             "unrelated": _titled("something-else", 0.2)}
    try:
        meter = ClusterCpuMeter(head.pid, ray_root=os.getpid(), client_pid=os.getpid())
        before = meter.read()
        assert head.stdout.readline().strip() == "done"
        for p, s in [(procs["agent"], 0.3), (procs["raylet"], 0.2), (procs["gcs"], 0.2), (procs["worker"], 0.2)]:
            _spent(p.pid, s)
        cpu = ClusterCpuMeter.per_action(before, meter.read(), 1)
    finally:
        for p in (head, *procs.values()):
            p.kill()
            p.wait()
    h = cpu["head"]
    assert 300 <= h["main"] <= 700 and 200 <= h["ray_threads"] <= 500 and 100 <= h["other_threads"] <= 400, h
    assert h["total"] == round(sum(v for k, v in h.items() if k not in ("total", "sys")), 3)
    assert 0 <= h["sys"]["main"] <= h["main"] and 0 <= h["sys"]["ray_threads"] <= h["ray_threads"], h
    assert len(cpu["agents"]["each"]) == 1 and 200 <= cpu["agents"]["total"] <= 450, cpu["agents"]
    assert cpu["agents"]["threads"]["main"] >= 200 and cpu["agents"]["threads"]["ray_threads"] == 0, cpu["agents"]
    ray = cpu["ray"]
    assert ray["raylet"] >= 150 and ray["gcs"] >= 150 and ray["ray_workers"] >= 150, ray
    assert ray["ray_services"] == 0, ray  # the untitled process is nobody's: not counted
    assert cpu["all"] == round(h["total"] + cpu["agents"]["total"] + ray["total"] + cpu["sandboxes"], 3)
    assert cpu["machine"] >= cpu["all"] * 0.8, cpu  # the host was at least as busy as the parts read


def test_an_agent_that_starts_between_readings_counts_from_its_start_and_one_gone_is_missing():
    gone = _titled("ray::NodeAgent", 0.0)
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _spent(gone.pid, 0.0)
        meter = ClusterCpuMeter(head.pid, ray_root=os.getpid())
        time.sleep(0.3)  # its interpreter started
        before = meter.read()
        assert list(before["agents"]) == [gone.pid]
        gone.kill()
        gone.wait()
        new = _titled("ray::NodeAgent", 0.2)
        try:
            _spent(new.pid, 0.2)
            cpu = ClusterCpuMeter.per_action(before, meter.read(), 2)
        finally:
            new.kill()
            new.wait()
    finally:
        head.kill()
        head.wait()
    assert cpu["agents"]["started_between"] == 1 and len(cpu["agents"]["each"]) == 1
    assert cpu["agents"]["each"][0] >= 100  # 0.2 s over 2 actions, its start included


def test_one_action_s_hops_run_from_the_client_s_call_to_its_answer_and_a_missing_point_drops_it():
    head = {"started": 10.002, "answered": 10.020, "finished": 10.021}
    agent = [10.005, 10.006, 10.016, 10.017]
    h = hops_of((10.0, 10.022), head, agent)
    assert list(h) == list(HOPS)
    assert h["sandbox"] == pytest.approx(10.0) and h["link_out"] == pytest.approx(3.0)
    assert sum(h.values()) == pytest.approx(22.0)
    assert hops_of((10.0, 10.022), {**head, "answered": None}, agent) is None
    assert hops_of((10.0, 10.022), head, [10.005, 0.0, 10.016, 10.017]) is None  # the sandbox never started


def test_the_profile_groups_name_who_owns_a_function():
    assert group_of(("/x/site-packages/ray/_private/worker.py", 1, "get")) == "ray"
    assert group_of(("~", 0, "<method 'submit_actor_task' of 'ray._raylet.CoreWorker' objects>")) == "ray"
    assert group_of(("/src/arl_tangram/engine.py", 1, "submit")) == "engine"
    assert group_of(("/src/arl_tangram/runtime/ray_nodes.py", 1, "run_on_node")) == "runtime"
    assert group_of(("/usr/lib/python3.12/asyncio/base_events.py", 1, "_run_once")) == "asyncio"
    assert group_of(("/src/arl_tangram/bench/cluster_hops.py", 1, "one")) == "bench"
    assert group_of(("~", 0, "<function Pickler.dump at 0x7f>")) == "ray"  # Ray's serialisation of a call
    assert group_of(("/usr/lib/python3.12/selectors.py", 451, "select")) == "asyncio"
    assert group_of(("/usr/lib/python3.12/json/encoder.py", 1, "encode")) == "other"
    # the HTTP head's own: its journal apart from the rest of the service (requests, records)
    assert group_of(("/src/arl_tangram/server/journal.py", 280, "_commit")) == "journal"
    assert group_of(("/src/arl_tangram/server/service.py", 566, "_record_as")) == "service"
    assert group_of(("/site-packages/pydantic/main.py", 587, "model_dump_json")) == "service"


def test_py_spy_s_raw_stacks_count_the_main_thread_s_innermost_frames_and_the_loop_s_c_code_apart():
    sampler = SpySampler()
    me = sampler.native_id
    sampler.read(f"thread ({me}): MainThread;<module> (/x/cli.py:9);Runner.run (/usr/lib/python3.12/asyncio/runners.py:118) 30\n"
                 f"thread ({me}): MainThread;Runner.run (/usr/lib/python3.12/asyncio/runners.py:118);"
                 f"FrameProtocol.send (/src/arl_tangram/link.py:135) 10\n"
                 f"thread ({me + 1}): other;Thread.run (/usr/lib/python3.12/threading.py:982) 99\n"
                 "not a stack line\n")
    assert sampler.groups == {"loop_c": 30, "engine": 10}, sampler.groups
    shares = sampler.shares(4.0)
    assert shares["ms_per_action"] == {"loop_c": 3.0, "engine": 1.0} and shares["idle_samples"] is None, shares
    assert shares["top"][1]["function"] == "link.py:135 send", shares


@pytest.mark.skipif(not SpySampler.available(), reason="py-spy is not installed (or may not read this process)")
def test_py_spy_finds_the_main_thread_in_the_function_it_spins_in():
    with SpySampler(every_s=0.005) as sampler:
        _spin(1.0)
    shares = sampler.shares(10.0)
    assert shares["top"][0]["function"].endswith("_spin") and shares["top"][0]["share"] > 0.8, shares


@pytest.mark.skipif(not SpySampler.available(), reason="py-spy is not installed (or may not read this process)")
def test_py_spy_reads_another_process_s_main_thread():
    """The HTTP head's profile (``cluster_head._profiled``): the sampler pointed at a process of its
    own (the head's engine process) finds that process's main thread where it spins."""
    code = ("import time\ndef far_away_spin(s):\n    t = time.thread_time() + s\n    while time.thread_time() < t:\n"
            "        pass\nprint('up', flush=True)\nfar_away_spin(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        with SpySampler(every_s=0.005, pid=proc.pid) as sampler:
            time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    shares = sampler.shares(10.0)
    assert shares["top"][0]["function"].endswith("far_away_spin") and shares["top"][0]["share"] > 0.8, shares


def _spin(seconds: float) -> None:
    t = time.thread_time() + seconds
    while time.thread_time() < t:
        pass


def test_the_sampler_finds_the_main_thread_busy_in_its_function_and_idle_in_an_epoll_wait():
    import select

    # busy, then idle, each until the sampler has seen it 40 times (~0.1 s at 2 ms on a quiet
    # host; a loaded one schedules the sampler's thread late, so the time is not fixed)
    with MainSampler(every_s=0.002) as sampler:
        deadline = time.monotonic() + 10
        while sum(sampler.groups.values()) < 40 and time.monotonic() < deadline:
            _spin(0.05)
        with select.epoll() as ep:
            while sampler.idle < 40 and time.monotonic() < deadline + 10:
                ep.poll(0.05)  # an event loop's wait for events, as uvloop's (in C) or selectors'
    shares = sampler.shares(10.0)
    assert shares["top"][0]["function"].endswith("_spin") and shares["top"][0]["share"] > 0.8, shares
    assert shares["idle_samples"] >= 40 and shares["samples"] >= 40, shares
    assert sum(shares["ms_per_action"].values()) == pytest.approx(10.0, abs=0.01)


def test_the_nodes_sandboxes_take_the_first_cores_and_the_head_the_rest():
    assert split_cores(1, 1, {0, 1}) == ({0}, {1})
    assert split_cores(2, 1, {0, 1}) == ({0, 1}, set())  # none left: the head runs anywhere
    assert split_cores(8, 1, set(range(16))) == (set(range(8)), set(range(8, 16)))
    assert split_cores(4, 2, {2, 3, 5, 7, 11, 13, 17, 19, 23}) == ({2, 3, 5, 7, 11, 13, 17, 19}, {23})
    assert split_cores(3, 4, {0, 1}) == ({0, 1}, set())


def tangram(*args):
    return subprocess.run([sys.executable, "-m", "arl_tangram.cli", *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


def test_a_rounds_breakdown_says_what_its_slowest_revisits_are_made_of():
    fast = [(0.010, {"queue_s": 0.001, "setup_s": 0.0, "exec_s": 0.008, "woken": False})] * 198
    slow = [(0.900, {"queue_s": 0.002, "setup_s": 0.850, "exec_s": 0.009, "woken": True})] * 2
    b = breakdown(fast + slow)
    assert b["all"] == {"n": 200, "latency_ms": 10.0, "queue_ms": 1.0, "setup_ms": 0.0, "exec_ms": 8.0,
                        "rest_ms": 1.0, "woken": 2}, b
    tail = b["slowest_1pct"]
    assert tail["n"] == 2 and tail["setup_ms"] == 850.0 and tail["woken"] == 2 and tail["rest_ms"] == 39.0, tail
    assert breakdown([]) == {} and breakdown([(0.005, {})])["all"]["exec_ms"] is None


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bench_cluster_reports_each_part_s_cpu_the_hops_the_local_server_and_the_sessions(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "c.json"
    p = tangram("bench", "cluster", "--nodes", "1", "--actions", "40", "--chaos", "0", "--drain-sessions", "0",
                "--restart-sessions", "0", "--hops", "30", "--hops-alone", "5", "--profiled", "20", "--sessions", "6",
                "--session-sample", "3", "--json", str(out))
    assert p.returncode == 0, p.stderr + p.stdout[-3000:]
    r = json.loads(out.read_text())
    row = r["scaling"][0]
    assert row["nodes"] == 1 and row["errors"] == 0 and row["actions_per_s"] > 0, row
    cpu = row["cpu_ms_per_action"]
    assert cpu["head"]["main"] > 0 and cpu["sandboxes"] > 0 and cpu["ray"]["raylet"] >= 0, cpu
    assert len(cpu["agents"]["each"]) == 1 and cpu["agents"]["total"] > 0, cpu
    assert row["idle_cpu_per_s"]["ray_total"] >= 0
    assert {"ray", "gcs", "raylet", "agents"} <= set(row["net_of_idle_ms_per_action"]), row
    hops = row["hops"]
    assert hops["alone"]["n"] == 5 and hops["loaded"]["n"] == 30, hops
    assert set(hops["loaded"]["p50_ms"]) == {*HOPS, "total"} and hops["loaded"]["p50_ms"]["sandbox"] > 0
    assert hops["message_bytes"]["call"] > 0 and hops["message_bytes"]["answer"] > 0
    assert hops["profiled"]["n"] == 20 and hops["profiled"]["samples"] > 0, hops["profiled"]
    assert hops["loop"] in ("uvloop", "asyncio")
    local = r["local"]
    assert local["errors"] == 0 and local["cpu_ms_per_action"]["agents"]["each"] == [], local
    assert local["cpu_ms_per_action"]["ray"]["total"] == 0 and r["ray_vs_local"] > 0
    s = r["sessions"]
    assert s["opened"] == 6 and s["revisits_ok"] == 6 and s["alone_ok"] == 3 and s["failures"] == [], s
    assert s["client"] == "aiohttp", s  # (the test extra installs it)
    assert s["moves_during_revisits"] is not None and s["moves_during_revisits"] >= 0, s
    assert s["per_core"]["revisits_ok"] == 6 and s["per_core"]["p50_ms"] > 0, s
    for parts in (s["parts"], s["per_core"]["parts"]):  # each revisit's own times, read from its result
        assert parts["all"]["n"] == 6 and parts["slowest_1pct"]["n"] == 1, parts
        assert parts["all"]["exec_ms"] > 0 and parts["all"]["queue_ms"] is not None, parts
        assert parts["slowest_1pct"]["latency_ms"] >= parts["all"]["latency_ms"], parts
    assert r["targets"]["revisit_p50_ms"]["measured"] == s["revisit_p50_ms"], r["targets"]
    assert s["revisit_p50_ms"] > 0 and s["alone_p50_ms"] > 0 and sum(s["sessions_per_node"]) == 6, s


def test_the_targets_read_the_largest_cluster_the_sessions_and_the_chaos_run():
    from arl_tangram.bench.cluster import targets

    def row(nodes, main, ray):
        return {"nodes": nodes, "cpu_ms_per_action": {"head": {"main": main, "ray_threads": ray}}}

    t = targets({"scaling": [row(1, 0.5, 0.0), row(8, 0.15, 0.02)], "scaling_ratio": {"1": 1.0, "8": 6.4},
                 "ray_vs_local": 0.7, "sessions": {"revisit_p50_ms": 12.0, "revisit_p99_ms": 140.0,
                                                   "per_core": {"p50_ms": 4.0, "p99_ms": 20.0}},
                 "chaos": {"lost": 0}})
    assert t["scaling_1_to_top"] == {"measured": 6.4, "target": ">= 6 (1 to 8 nodes)", "met": True, "nodes": 8}
    assert t["ray_vs_local"]["met"] is False and t["head_cpu_ms_per_action"]["measured"] == 0.17
    assert t["head_cpu_ms_per_action"]["met"] is True
    assert t["revisit_p50_ms"]["met"] is True and t["revisit_p99_ms"]["met"] is False
    assert t["revisit_one_per_core_p99_ms"]["met"] is True and t["chaos_lost"]["met"] is True
    empty = targets({"scaling": []})
    assert all(v["met"] is None for v in empty.values()), empty
