"""Model services on every GPU node of a real Ray cluster on loopback (``ray.cluster_utils.Cluster``):
nodes declare Ray's ``GPU`` resource and CPU "devices" stand in for the GPUs; the head's engine
places copies on any node's GPUs, each node's agent holds the weights in its own memory and runs
the batches. A node's agent killed with calls in flight loses none and runs none twice."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every Ray address on 127.0.0.1
ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
pytest.importorskip("torch", reason="model services need torch")

from ray.cluster_utils import Cluster  # noqa: E402

from arl_tangram.core import Outcome  # noqa: E402
from arl_tangram.managers.models import tiny  # noqa: E402
from arl_tangram.managers.models.spec import ModelServiceConfig  # noqa: E402
from arl_tangram.runtime import Tangram  # noqa: E402

from raycluster import loopback_cluster  # noqa: E402
from servers import Server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TESTS = str(Path(__file__).parent)
SEQS = [[1 + i, 17, 42, 7 + i] for i in range(8)]


def _expected() -> list[float]:
    module, ops = tiny.reward_model()
    return ops["score"](module, SEQS)


@pytest.fixture
def gpu_cluster(monkeypatch):
    """A head without GPUs and two nodes of one "GPU" and no cores each; the agents import this
    checkout's sources and ``tests/model_fixtures.py`` (Ray workers inherit the environment)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    with loopback_cluster(*[{"num_cpus": 0, "num_gpus": 1}] * 2) as (c, nodes):
        yield c, nodes


def _rm(delay_s: float) -> list[ModelServiceConfig]:
    return [ModelServiceConfig("rm", "model_fixtures:slow_reward_model", {"delay_s": delay_s}, max_batch=1,
                               max_wait_ms=1, memory_gb=1.0)]


def test_calls_spread_over_gpu_nodes_and_a_killed_agent_loses_and_duplicates_none(gpu_cluster):
    c, _ = gpu_cluster
    want = _expected()
    records: Counter = Counter()
    ok_records: Counter = Counter()

    async def main():
        async with Tangram.ray(c.address, models=_rm(0.4), model_device="cpu", gpu_memory_gb=4.0,
                               rejoin_after_s=3600) as tg:  # killed agents stay dead here
            rt = tg.runtime
            rt.engine.listeners.append(lambda f: (records.update([f.action.id]),
                                                  f.outcome is Outcome.OK and ok_records.update([f.action.id])))
            gpu_nodes = [n for n in rt.nodes() if n["gpus"]]
            assert rt.engine.gpu.capacity == 2 and sorted(n["islands"] for n in gpu_nodes) == [[[0]], [[1]]]
            assert not rt.engine.cpu.capacity  # no cores anywhere: GPU work only
            for _ in range(100):  # before any call, the service is prefetched onto a node's GPU
                if rt.engine.gpu.instances.get("rm") and not rt.engine.loading:
                    break
                await asyncio.sleep(0.1)
            prefetched = [i.gpus for i in rt.engine.gpu.instances.get("rm", ())]
            assert len(prefetched) == 1 and not rt.engine.loading, prefetched
            home, local = rt.models.homes[prefetched[0][0]]
            assert await home.handle.resident.remote() == [("rm", (local,))]

            # concurrent calls scale the service out to a copy on each node
            seen: set[str] = set()

            async def watch():
                while True:
                    seen.update(n["name"] for n in rt.nodes() if n["running"])
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            first = await asyncio.gather(*(tg.score("rm", s) for s in SEQS))
            watcher.cancel()
            spread = set(seen)

            # a node's agent is killed while calls run on both nodes
            calls = [asyncio.ensure_future(tg.score("rm", s)) for s in SEQS]
            victim = None
            for _ in range(200):
                busy = [n for n in rt.nodes_by_id.values() if n.running and n.state == "alive"]
                if len(busy) == 2:
                    victim = busy[0]
                    break
                await asyncio.sleep(0.01)
            assert victim is not None, "calls should run on both nodes at once"
            in_flight = set(victim.running)
            ray.kill(victim.handle)
            after = await asyncio.wait_for(asyncio.gather(*calls), 120)
            capacity_after = rt.engine.gpu.capacity

            # a GPU node that joins adds its GPU, and calls run there
            c.add_node(num_cpus=0, num_gpus=1)
            for _ in range(600):
                if rt.engine.gpu.capacity == 2:
                    break
                await asyncio.sleep(0.1)
            joined = rt.engine.gpu.capacity
            newcomer = next(n for n in rt.nodes_by_id.values() if n.state == "alive" and n is not victim
                            and n.name not in spread)
            seen.clear()
            watcher = asyncio.ensure_future(watch())
            more = await asyncio.gather(*(tg.score("rm", s) for s in SEQS))
            watcher.cancel()

            # an agent that dies while its node is idle is noticed too (the membership loop)
            survivor = next(n for n in rt.nodes_by_id.values() if n.state == "alive" and n is not newcomer)
            ray.kill(survivor.handle)
            for _ in range(100):
                if rt.engine.gpu.capacity == 1:
                    break
                await asyncio.sleep(0.1)
            idle_lost = rt.engine.gpu.capacity
            last = await asyncio.gather(*(tg.score("rm", s) for s in SEQS[:3]))
            return (first, spread, in_flight, after, capacity_after, joined, newcomer.name, seen, more, idle_lost,
                    last, rt.nodes())

    first, spread, in_flight, after, capacity_after, joined, newcomer, seen, more, idle_lost, last, table = \
        asyncio.run(asyncio.wait_for(main(), 300))
    assert [r.outcome for r in first] == [Outcome.OK] * 8
    assert [r.result for r in first] == pytest.approx(want, abs=1e-5)
    assert len(spread) == 2, "the busy service should have had a copy on each GPU node"

    assert in_flight, "the killed node had calls running"
    lost = [r for r in after if r.outcome is not Outcome.OK]
    duplicated = [i for i, n in ok_records.items() if n > 1]
    assert lost == [] and duplicated == []
    assert [r.result for r in after] == pytest.approx(want, abs=1e-5)
    # a call may finish in the instant between the look and the kill (a loaded host): then it
    # has one record; every other one lost with its node re-ran exactly once
    rerun = [i for i in in_flight if records[i] == 2]
    assert rerun and all(records[i] in (1, 2) for i in in_flight), "each call lost with its node re-ran once"
    assert capacity_after == 1, "the dead node's GPU left the engine at once"

    assert joined == 2 and newcomer in seen and all(r.ok for r in more)
    assert [r.result for r in more] == pytest.approx(want, abs=1e-5)
    assert idle_lost == 1 and [r.result for r in last] == pytest.approx(want[:3], abs=1e-5)
    assert [n["state"] for n in table].count("dead") == 2


def test_serve_with_ray_serves_model_services_on_the_gpu_nodes(gpu_cluster, tmp_path):
    c, _ = gpu_cluster
    config = {"models": [{"name": "rm", "loader": "arl_tangram.managers.models.tiny:reward_model"}],
              "gpu_memory_gb": 4.0}
    head = Server(tmp_path, config=config, args=("--ray", c.address), start_timeout_s=120)
    try:
        info = httpx.get(f"{head.url}/v1/cluster", timeout=30).json()
        gpu_nodes = [n for n in info["nodes"] if n["gpus"]]
        assert info["backend"] == "ray" and len(gpu_nodes) == 2
        assert sorted(n["islands"] for n in gpu_nodes) == [[[0]], [[1]]]
        assert all(not n["sandboxes"] and n["state"] == "alive" for n in gpu_nodes)
        r = httpx.post(f"{head.url}/v1/models/rm/score", json={"tokens": SEQS[0]}, timeout=60).json()
        assert r["outcome"] == "ok" and r["value"] == pytest.approx(_expected()[0], abs=1e-5)
        bad = httpx.post(f"{head.url}/v1/models/rm/score", json={"tokens": [1, 10**6]}, timeout=60)
        assert bad.status_code < 500 and "out of range" in bad.text
        assert httpx.post(f"{head.url}/v1/models/nope/score", json={"tokens": [1]}, timeout=30).status_code == 404
    finally:
        head.stop()


def test_a_first_gpu_node_that_joins_later_brings_the_services(monkeypatch):
    """The head starts with no GPU node: calls are refused saying why; the first GPU node to join
    registers the services (their sizes as that node loaded them) and serves them."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    c.wait_for_nodes()

    async def main():
        async with Tangram.ray(c.address, models=_rm(0.0), model_device="cpu", gpu_memory_gb=4.0) as tg:
            rt = tg.runtime
            early = await tg.score("rm", SEQS[0])
            c.add_node(num_cpus=0, num_gpus=1)
            for _ in range(600):
                if rt.engine.gpu.capacity:
                    break
                await asyncio.sleep(0.1)
            models = [m.name for m in rt.engine.cluster.models]
            return early, models, await asyncio.gather(*(tg.score("rm", s) for s in SEQS[:3]))

    try:
        early, models, later = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    assert early.outcome is Outcome.REJECTED and "no GPU node has joined" in early.message
    assert models == ["rm"]
    assert [r.outcome for r in later] == [Outcome.OK] * 3
    assert [r.result for r in later] == pytest.approx(_expected()[:3], abs=1e-5)


def test_the_model_chaos_bench_counts_no_lost_and_no_duplicated_call():
    """``tangram bench cluster --gpu-nodes 2`` (the figure's harness), on CPU devices here."""
    from arl_tangram.bench.cluster import model_chaos

    row = model_chaos(2, 90, "cpu", lambda m: None)
    assert row["batches_running_on_killed_agent"] >= 1, row
    assert (row["lost"], row["duplicated"], row["outcomes"]) == (0, 0, {"ok": 90}), row
    # a batch may finish in the instant between the look and the kill: then nothing re-runs
    # (test_calls_spread_over_gpu_nodes_... re-runs for certain, with slow batches)
    assert row["batches_rerun"] <= row["batches_running_on_killed_agent"], row
    assert row["engine_records_per_batch_max"] == (2 if row["batches_rerun"] else 1) and row["gpus_left"] == 1, row


def test_nodes_whose_agents_died_get_new_agents_and_the_lost_calls_wait_for_them(gpu_cluster):
    """Both GPU nodes' agents are killed with calls running: Ray still lists the nodes (their
    raylets live), so after ``rejoin_after_s`` each gets a new agent that loads the services again;
    the lost calls, with no GPU left meanwhile, wait for them (not refused) and re-run once there.
    The new agents' GPUs have new global ids (nothing of the old agents is reused)."""
    c, _ = gpu_cluster
    records: Counter = Counter()

    async def main():
        async with Tangram.ray(c.address, models=_rm(0.3), model_device="cpu", gpu_memory_gb=4.0,
                               rejoin_after_s=1.0) as tg:
            rt = tg.runtime
            rt.engine.listeners.append(lambda f: records.update([f.action.id]))
            calls = [asyncio.ensure_future(tg.score("rm", s)) for s in SEQS]
            for _ in range(300):
                busy = [n for n in rt.nodes_by_id.values() if n.running and n.state == "alive"]
                if len(busy) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(busy) == 2, "calls should run on both nodes at once"
            in_flight = set().union(*(n.running for n in busy))
            for n in busy:
                ray.kill(n.handle)
            for _ in range(100):
                if rt.engine.gpu.capacity == 0:
                    break
                await asyncio.sleep(0.05)
            emptied = rt.engine.gpu.capacity
            results = await asyncio.wait_for(asyncio.gather(*calls), 200)
            back = [rt.nodes_by_id[n.ray_id] for n in busy]
            ids = sorted(i for i, (node, _) in rt.models.homes.items() if node in back)
            return in_flight, emptied, results, rt.engine.gpu.capacity, [(b is not n, b.rejoins, b.state)
                                                                        for b, n in zip(back, busy)], ids

    in_flight, emptied, results, capacity, back, ids = asyncio.run(asyncio.wait_for(main(), 300))
    assert emptied == 0 and capacity == 2 and back == [(True, 1, "alive")] * 2
    assert ids == [2, 3], "the new agents' GPUs have new global ids"
    assert [r.outcome for r in results] == [Outcome.OK] * 8
    assert [r.result for r in results] == pytest.approx(_expected(), abs=1e-5)
    # as above: a call that finished between the look and the kill has one record, not two
    assert in_flight and any(records[i] == 2 for i in in_flight), "the lost calls re-ran"
    assert all(records[i] in (1, 2) for i in in_flight), "each lost call re-ran once"
    assert all(n <= 2 for n in records.values())


def test_a_hugging_face_model_on_the_gpu_nodes_answers_as_transformers_does(gpu_cluster, tmp_path):
    """A tiny Llama saved with ``save_pretrained``: each GPU node's agent reads the directory into
    its own memory (the nodes share this machine's disk here); answers match transformers', and the
    head refuses what the model cannot take (its cards carry the model's positions and vocabulary)
    before anything crosses to a node."""
    pytest.importorskip("transformers")
    from model_fixtures import hf_reference, save_hf

    c, _ = gpu_cluster
    path = save_hf(tmp_path / "llama", "llama", tied=True, seed=1)
    seqs = [[5, 17, 3, 88, 41], [9, 2], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7], [33, 34, 35]]
    teacher = ModelServiceConfig("t", hf=path, task="logprobs", max_batch=2, max_wait_ms=20)

    async def main():
        async with Tangram.ray(c.address, models=[teacher], model_device="cpu", gpu_memory_gb=4.0) as tg:
            rt = tg.runtime
            rs = await asyncio.gather(*(tg.logprobs("t", s) for s in seqs * 3))
            long = await tg.logprobs("t", [1] * 65)
            oob = await tg.logprobs("t", [1, 96])
            return rs, long, oob, rt.engine.cluster.models

    rs, long, oob, models = asyncio.run(asyncio.wait_for(main(), 300))
    assert [r.outcome for r in rs] == [Outcome.OK] * 12, [r.message for r in rs]
    for seq, r in zip(seqs * 3, rs):
        assert r.result == pytest.approx(hf_reference(path, "logprobs", seq), abs=1e-4)
    assert long.outcome is Outcome.REJECTED and "longer than model 't''s 64 positions" in long.message
    assert oob.outcome is Outcome.REJECTED and "id 96 out of range [0, 96)" in oob.message
    assert [m.name for m in models] == ["t"] and models[0].weights_gb > 0


def test_the_cluster_bench_with_no_node_counts_runs_no_scaling_or_chaos(tmp_path):
    """``tangram bench cluster --nodes ""``: the model chaos run alone (on the accelerator machine,
    which has no bubblewrap for the one-shots' sandboxes); here with no GPU nodes either."""
    import json
    import subprocess
    import sys

    out = tmp_path / "c.json"
    p = subprocess.run([sys.executable, "-m", "arl_tangram.cli", "bench", "cluster", "--nodes", "", "--drain-sessions",
                        "0", "--restart-sessions", "0", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["scaling"] == [] and "chaos" not in r and "model_chaos" not in r
    assert r["engine"]["decisions_per_s"] > 0
