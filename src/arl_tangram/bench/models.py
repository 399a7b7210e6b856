"""Model-service figures: host-to-device bandwidth, scoring throughput with and without batching,
a MOPD-style run — 12 teacher services of different sizes sharing one device under Tangram, at
several compute shares (1: one batch on the GPU at a time; smaller: batches of different
services overlap on their own CUDA streams), against each service owning a dedicated device
(replayed one service at a time on the same device with its model preloaded, which is what a
dedicated GPU would give it) — time to first score for a 7B model from a cold start and from host
RAM after it scaled to zero, a model split over 2 GPUs against the same weights on one, and
Hugging Face services (a Qwen2-shaped teacher and reward model saved to a directory, served from
it: host load, first answer, throughput unbatched vs batched).

Runs on ``cuda`` (random-initialised transformers of 0.5B-7B parameters, bf16) or on ``cpu`` (the
same code with tiny models; two CPU "devices" stand in for two GPUs). ``python -m
arl_tangram.bench.models --device cuda`` needs only torch and pydantic, for machines without the
CLI's other dependencies. ``--sections`` picks parts; ``--merge`` adds the sections of an earlier
JSON (so the long dedicated baseline can run in a call of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from ..managers.models import graphs as graphs_mod, manager, packing
from ..managers.models.graphs import GRAPH_JUDGES
from ..managers.models.manager import ModelServiceConfig
from ..runtime import Tangram
from ..sim.metrics import percentile

TINY = "arl_tangram.managers.models.tiny"
GPU_SIZES_B = (0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.5, 1.5, 2.0, 3.0, 3.0, 7.0)


def h2d_gbps(device: str, gb: float) -> dict:
    if device != "cuda":
        return {"pinned_gbps": None, "pageable_gbps": None, "note": "no CUDA device"}
    n = int(gb * (1 << 30)) // 2
    out = {}
    for kind, host in (("pinned", torch.empty(n, dtype=torch.bfloat16).pin_memory()),
                       ("pageable", torch.empty(n, dtype=torch.bfloat16))):
        dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"{kind}_gbps"] = round(n * 2 / min(times) / 1e9, 1)
        del dev
    out["bytes"] = n * 2
    return out


def _model_kwargs(device: str, billions: float, seed: int, vocab: int) -> dict:
    if device == "cuda":
        from ..managers.models.tiny import TinyConfig
        c = TinyConfig.of_size(billions, vocab=vocab, seed=seed)
        return {"vocab": c.vocab, "d_model": c.d_model, "layers": c.layers, "heads": c.heads, "seed": seed,
                "dtype": "bfloat16", "init_device": "cuda"}
    return {"vocab": vocab, "d_model": 64, "layers": 2, "heads": 4, "seed": seed}


async def _throughput(device: str, seq_len: int, requests: int, vocab: int) -> dict:
    out = {}
    for label, max_batch in (("unbatched", 1), ("batched", 32)):
        svc = ModelServiceConfig("rm", f"{TINY}:reward_model", _model_kwargs(device, 0.5, 0, vocab),
                                 max_batch=max_batch, max_wait_ms=2.0)
        async with Tangram.local(sandboxes=False, models=[svc], gpus=1) as tg:
            rng = random.Random(0)
            seqs = [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(requests)]
            await tg.score("rm", seqs[0])  # warm: the model is resident
            t = time.perf_counter()
            rs = await asyncio.gather(*(tg.score("rm", s) for s in seqs))
            elapsed = time.perf_counter() - t
            assert all(r.ok for r in rs), rs[0].message
            out[f"{label}_per_s"] = round(requests / elapsed, 1)
    out["speedup"] = round(out["batched_per_s"] / out["unbatched_per_s"], 2)
    return out


def _hf_dirs(device: str, root: str) -> dict[str, tuple[str, float]]:
    """A teacher (causal LM) and a reward model (sequence classification) with Qwen2's
    architecture and random weights, saved with ``save_pretrained`` under ``root`` as a downloaded
    model would lie: Qwen2.5-0.5B's shape in bf16 on CUDA, a tiny one on CPU. Returns each
    directory and its parameters in billions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    cuda = device == "cuda"
    shape = (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768)
             if cuda else dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    out = {}
    for name, cls, extra in (("teacher", Qwen2ForCausalLM, {"tie_word_embeddings": True}),
                             ("rm", Qwen2ForSequenceClassification, {"num_labels": 1, "pad_token_id": 0})):
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):
            model = cls(Qwen2Config(**shape, **extra)).to(torch.bfloat16 if cuda else torch.float32)
        path = os.path.join(root, name)
        model.save_pretrained(path)
        out[name] = (path, sum(p.numel() for p in model.parameters()) / 1e9)
        del model
    _release_memory()
    return out


async def _hf_throughput(device: str, seq_len: int, requests: int) -> dict:
    """Hugging Face services served from their directories: host load time (safetensors into
    page-locked host memory), the first answer (onto the GPU, warmed), and throughput unbatched
    (max_batch 1) vs batched (32) for the teacher's logprobs and the reward model's score."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as root:
        dirs = _hf_dirs(device, root)
        for name, op in (("teacher", "logprobs"), ("rm", "score")):
            path, billions = dirs[name]
            res: dict = {"params_b": round(billions, 3), "task": op}
            for label, max_batch in (("unbatched", 1), ("batched", 32)):
                svc = ModelServiceConfig(name, hf=path, task=op, max_batch=max_batch, max_wait_ms=2.0)
                t0 = time.perf_counter()
                async with Tangram.local(sandboxes=False, models=[svc], gpus=1) as tg:
                    host_s = time.perf_counter() - t0
                    call = getattr(tg, op)
                    vocab = tg.runtime.models.loaded[name].vocab
                    rng = random.Random(0)
                    seqs = [[rng.randrange(1, vocab) for _ in range(seq_len)] for _ in range(requests)]
                    t1 = time.perf_counter()
                    first = await call(name, seqs[0])  # onto the GPU (and warmed) now
                    first_s = time.perf_counter() - t1
                    t = time.perf_counter()
                    rs = await asyncio.gather(*(call(name, x) for x in seqs))
                    elapsed = time.perf_counter() - t
                    assert first.ok and all(r.ok for r in rs), (first.message, rs[0].message)
                    res[f"{label}_per_s"] = round(requests / elapsed, 1)
                    res[f"{label}_avg_act_s"] = sum(r.act_s for r in rs) / len(rs)
                    if label == "unbatched":
                        res["host_load_s"] = host_s
                        res["first_answer_s"] = first_s
                        res["load_log"] = tg.runtime.models.load_log[:1]
                _release_memory()
            res["speedup"] = round(res["batched_per_s"] / res["unbatched_per_s"], 2)
            out[name] = res
    out["seq_len"], out["requests"] = seq_len, requests
    return out


def _arrivals(n_services: int, requests: int, duration_s: float, seed: int) -> list[tuple[float, int]]:
    """Poisson-ish arrivals, bursty (a third of them in the middle fifth), Zipf(1.1) over services."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(n_services)]
    out = []
    for _ in range(requests):
        t = rng.uniform(0.4, 0.6) * duration_s if rng.random() < 1 / 3 else rng.uniform(0, duration_s)
        out.append((t, rng.choices(range(n_services), weights)[0]))
    return sorted(out)


def _stats(acts: list[float]) -> dict:
    xs = sorted(acts)
    return {"avg_act_s": sum(xs) / len(xs), "p50_act_s": percentile(xs, 50), "p99_act_s": percentile(xs, 99)}


async def _replay(services: list[ModelServiceConfig], arrivals: list[tuple[float, int]], seq_len: int,
                  vocab: int, names: list[str]) -> tuple[list[float], float, float]:
    async with Tangram.local(sandboxes=False, models=services, gpus=1) as tg:
        rt = tg.runtime
        while rt.engine.loading:  # prefetched copies first, as a dedicated deployment would have them
            await asyncio.sleep(0.05)
        rng = random.Random(1)
        held0 = rt.engine.usage.gpu_held_s
        start = time.perf_counter()

        loads0 = rt.models.loads
        slow: list[dict] = []
        _GC_PAUSES.clear()
        marks = _label_batches(rt.models)
        prof = _profiler_start()

        async def one(at: float, svc: int) -> float:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            r = await tg.logprobs(names[svc], [rng.randrange(vocab) for _ in range(seq_len)])
            if not r.ok:
                raise RuntimeError(f"{names[svc]}: {r.outcome.value}: {r.message}")
            slow.append({"model": names[svc], "at_s": round(at, 3), "act_s": r.act_s, "queue_s": r.queue_s,
                         "setup_s": r.setup_s, "exec_s": r.exec_s})
            return r.act_s

        async def stop_profiler() -> None:
            await asyncio.sleep(PROFILE["seconds"])
            _profiler_stop(prof, start, marks)

        stopper = asyncio.ensure_future(stop_profiler()) if prof is not None else None
        acts = await asyncio.gather(*(one(t, s) for t, s in arrivals))
        span = time.perf_counter() - start
        if stopper is not None:
            await stopper
        rt.engine.usage.advance(rt.engine.clock.now())
        held = rt.engine.usage.gpu_held_s - held0
        # where the tail comes from: the slowest requests, loads during the run, allocator retries
        # (a cudaMalloc that failed, freed the cache and synchronised the device)
        def phases(b: dict) -> dict:
            at = b["submitted"] - start
            return {"model": b["model"], "rows": b["rows"], "at_s": round(at, 3),
                    "to_thread_ms": round((b.get("thread", 0) - b["submitted"]) * 1e3, 2),
                    "gate_ms": round((b.get("gate", b.get("thread", 0)) - b.get("thread", 0)) * 1e3, 2),
                    "run_ms": round((b.get("done", 0) - b.get("gate", b.get("thread", 0))) * 1e3, 2),
                    "back_ms": round((b["returned"] - b.get("done", 0)) * 1e3, 2)}
        batches = [b for b in rt.models.batch_log if b["submitted"] >= start]
        _replay.tail = {"slowest": sorted(slow, key=lambda x: -x["act_s"])[:8],  # type: ignore[attr-defined]
                        "slowest_batches": [phases(b) for b in sorted(batches, key=lambda b: b["submitted"]
                                                                      - b["returned"])[:8]],
                        "gc_pauses_over_20ms": list(_GC_PAUSES),
                        "slow_batch_allocator": [m for m in marks if m["ms"] >= 100][:8],
                        "loads_during_run": rt.models.loads - loads0, "evictions": rt.models.evictions,
                        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)
                        if torch.cuda.is_available() else 0}
        _replay.copies = [{k: x.get(k) for k in ("model", "graphs", "warm_s", "logprobs")}  # type: ignore[attr-defined]
                          for x in rt.models.load_log]
        _replay.requests = slow  # type: ignore[attr-defined]  # every request's phases (``_breakdown``)
    _release_memory()
    return list(acts), span, held


def _breakdown(requests: list[dict]) -> dict:
    """Where the average ACT goes, over all requests and per service: waiting for a batch and the
    GPU (queue), loading (setup) and the batch itself (exec), in ms; shared and dedicated runs
    side by side say whether a gap is queueing behind other services or slower batches."""
    def avg(xs: list[dict]) -> dict:
        n = len(xs) or 1
        return {"n": len(xs), **{f"{k}_ms": round(sum(x[f"{k}_s"] for x in xs) / n * 1e3, 3)
                                 for k in ("act", "queue", "setup", "exec")}}
    models = sorted({x["model"] for x in requests}, key=lambda m: (len(m), m))
    return {"all": avg(requests), "by_model": {m: avg([x for x in requests if x["model"] == m]) for m in models}}


_GC_PAUSES: list[float] = []
_gc_started = [0.0]


def _gc_watch(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    elif (dt := time.perf_counter() - _gc_started[0]) > 0.02:
        _GC_PAUSES.append(round(dt, 3))


gc.callbacks.append(_gc_watch)


def _release_memory() -> None:
    """Free the last runtime's host and device copies before the next one loads its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: the bench's profiler settings (``--profile``): where traces go, how long into each shared replay
PROFILE: dict = {"dir": None, "seconds": 7.0, "runs": 0, "slow_ms": 100.0}

#: allocator counters compared before and after each batch (``_label_batches``)
_ALLOC_COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")


def _alloc_counters() -> dict:
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {k: st.get(k, 0) for k in _ALLOC_COUNTERS}


def _label_batches(models) -> list[dict]:
    """Wrap every loaded op so that each batch is a named range in a profile (``batch MODEL xROWS``)
    and leaves its duration and the allocator's counters around it (device mallocs and frees,
    syncs of all streams, retries) in the returned list: where a slow batch waited."""
    marks: list[dict] = []

    def wrap(name: str, fn: Callable) -> Callable:
        def op(module, batch):
            before = _alloc_counters()
            t = time.perf_counter()
            with torch.profiler.record_function(f"batch {name} x{len(batch)}"):
                out = fn(module, batch)
            ms = (time.perf_counter() - t) * 1e3
            after = _alloc_counters()
            marks.append({"model": name, "rows": len(batch), "t": t, "ms": round(ms, 2),
                          **{k: after[k] - before[k] for k in after if after[k] != before[k]}})
            return out
        op.tangram_inner = fn  # type: ignore[attr-defined]
        return op

    for name, ld in models.loaded.items():
        ld.ops = {k: wrap(name, getattr(v, "tangram_inner", v)) for k, v in ld.ops.items()}
    return marks


def _profiler_start():
    """A torch.profiler over the first ``PROFILE["seconds"]`` of a shared replay, or None."""
    if PROFILE["dir"] is None:
        return None
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # batches run in worker threads: without this only the event loop's thread is recorded
        cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        cfg = None
    prof = torch.profiler.profile(activities=acts, experimental_config=cfg)
    prof.start()
    return prof


def _profiler_stop(prof, start: float, marks: list[dict]) -> None:
    """Stop, write the trace (gzip) and a summary of what ran during each batch of 100 ms or more
    (``profile_summary``)."""
    import gzip

    prof.stop()
    PROFILE["runs"] += 1
    os.makedirs(PROFILE["dir"], exist_ok=True)
    raw = os.path.join(tempfile.gettempdir(), f"tangram-trace-{os.getpid()}.json")
    prof.export_chrome_trace(raw)
    with open(raw) as fh:
        trace = json.load(fh)
    os.unlink(raw)
    summary = profile_summary(trace.get("traceEvents", []), PROFILE["slow_ms"] * 1e3)
    base = os.path.join(PROFILE["dir"], f"run{PROFILE['runs']}")
    with open(base + "-summary.json", "w") as fh:
        json.dump({"slow_batches_by_counters": [m for m in marks if m["ms"] >= PROFILE["slow_ms"]], **summary}, fh,
                  indent=1)
    windows = summary.get("windows_us", [])
    keep = [e for e in trace.get("traceEvents", []) if e.get("ph") != "X"
            or any(a - 20_000 <= e.get("ts", 0) <= b + 20_000 for a, b in windows)]
    with gzip.open(base + "-slow.json.gz", "wt") as fh:
        json.dump({**trace, "traceEvents": keep}, fh)


def profile_summary(events: list[dict], slow_us: float = 100_000) -> dict:
    """What a chrome trace shows during each ``batch ...`` range of at least ``slow_us``: the
    batch thread's longest CPU ops and CUDA runtime/driver calls, runtime calls by name (count,
    total ms), the GPU's kernels and copies in the range (count, busy ms, the longest, per
    stream); and the trace's longest runtime calls overall."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    api = ("cuda_runtime", "cuda_driver")
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    out: dict = {"events": len(xs), "batches": [], "windows_us": []}
    out["longest_runtime_calls"] = [
        {"name": e["name"], "ms": round(e["dur"] / 1e3, 2), "tid": e.get("tid")}
        for e in sorted((e for e in xs if e.get("cat") in api), key=lambda e: -e["dur"])[:15]]
    slow = sorted((e for e in xs if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("batch ")
                   and e["dur"] >= slow_us), key=lambda e: e["ts"])
    for b in sorted(sorted(slow, key=lambda e: -e["dur"])[:6], key=lambda e: e["ts"]):  # the 6 longest
        a, z = b["ts"], b["ts"] + b["dur"]
        inside = [e for e in xs if e["ts"] < z and e["ts"] + e["dur"] > a]
        mine = [e for e in inside if e.get("tid") == b.get("tid") and e.get("pid") == b.get("pid") and e is not b]
        calls: dict[str, list] = {}
        for e in inside:
            if e.get("cat") in api:
                c = calls.setdefault(e["name"], [0, 0.0])
                c[0] += 1
                c[1] += e["dur"] / 1e3
        kernels = [e for e in inside if e.get("cat") in gpu]
        spans = sorted((max(a, e["ts"]), min(z, e["ts"] + e["dur"])) for e in kernels)
        busy, end = 0.0, a
        for s0, s1 in spans:
            if s1 > end:
                busy += s1 - max(s0, end)
                end = s1
        streams: dict[str, list] = {}
        for e in kernels:
            st = streams.setdefault(str(e.get("tid")), [0, 0.0])
            st[0] += 1
            st[1] += e["dur"] / 1e3
        out["windows_us"].append((a, z))
        out["batches"].append({
            "name": b["name"], "ms": round(b["dur"] / 1e3, 2), "tid": b.get("tid"),
            "own_longest": [{"name": e["name"], "cat": e.get("cat"), "ms": round(e["dur"] / 1e3, 2),
                             "at_ms": round((e["ts"] - a) / 1e3, 2)}
                            for e in sorted(mine, key=lambda e: -e["dur"])[:25]],
            "runtime_calls": {k: [v[0], round(v[1], 2)] for k, v in sorted(calls.items(), key=lambda kv: -kv[1][1])[:15]},
            "gpu_ops": len(kernels), "gpu_busy_ms": round(busy / 1e3, 2),
            "gpu_longest": [{"name": e["name"][:120], "ms": round(e["dur"] / 1e3, 3), "stream": e.get("tid"),
                             "at_ms": round((e["ts"] - a) / 1e3, 2)}
                            for e in sorted(kernels, key=lambda e: -e["dur"])[:10]],
            "gpu_by_stream": {k: [v[0], round(v[1], 2)] for k, v in streams.items()}})
    return out


def _mopd_services(device: str, vocab: int, share: float) -> tuple[list[ModelServiceConfig], list[str]]:
    sizes = GPU_SIZES_B if device == "cuda" else (0.5,) * 12
    names = [f"teacher-{i}" for i in range(len(sizes))]
    return [ModelServiceConfig(n, f"{TINY}:teacher_model", _model_kwargs(device, b, i, vocab), max_batch=16,
                               max_wait_ms=5.0, compute_share=share)
            for i, (n, b) in enumerate(zip(names, sizes))], names


def _variant(spec: str) -> tuple[float, float | None, str | None]:
    """``"0.25"``, ``"0.25@5"``, ``"1+one_row"``: a compute share, and optionally the interpreter's
    thread switch interval in ms during that run instead of the model manager's
    (``GPU_SWITCH_INTERVAL_S``, 0.2 ms on CUDA; Python's default, 5 ms, lets a thread that comes back
    from a CUDA call wait that long for the GIL while other batches' threads run Python) and how
    warm-ups judge graphs (``graphs.GRAPH_JUDGE``)."""
    spec, _, judge = spec.partition("+")
    share, _, ms = spec.partition("@")
    if judge and judge not in GRAPH_JUDGES:
        raise ValueError(f"shares: unknown graph judge {judge!r} (known: {', '.join(GRAPH_JUDGES)})")
    return float(share), (float(ms) if ms else None), (judge or None)


async def _mopd_shared(device: str, requests: int, duration_s: float, seq_len: int, vocab: int,
                       variants: list[str], log: Callable[[str], None]) -> dict:
    """All 12 services on one device, once per variant (compute share 1: batches one at a time)."""
    arrivals = _arrivals(12, requests, duration_s, 0)
    by = {}
    for spec in variants:
        share, switch_ms, judge = _variant(spec)
        services, names = _mopd_services(device, vocab, share)
        chosen, chosen_judge = manager.GPU_SWITCH_INTERVAL_S, manager.GRAPH_JUDGE
        if switch_ms is not None:
            manager.GPU_SWITCH_INTERVAL_S = switch_ms / 1000  # what the manager sets while it serves
        if judge is not None:
            manager.GRAPH_JUDGE = judge
        effective = manager.GPU_SWITCH_INTERVAL_S if device == "cuda" else sys.getswitchinterval()
        try:
            acts, _, held = await _replay(services, arrivals, seq_len, vocab, names)
        finally:
            manager.GPU_SWITCH_INTERVAL_S, manager.GRAPH_JUDGE = chosen, chosen_judge
        key = base = f"{share:.3g}" + (f"@{switch_ms:g}ms" if switch_ms is not None else "") + (f"+{judge}" if judge else "")
        while key in by:  # the same variant again (a second run in the process): its own entry
            key = f"{base}#{sum(k.split('#')[0] == base for k in by) + 1}"
        by[key] = {"compute_share": share, "switch_interval_ms": effective * 1e3,
                   "graph_judge": judge or manager.GRAPH_JUDGE, **_stats(acts),
                   "gpu_seconds_held": held, "tail": getattr(_replay, "tail", {}),
                   "breakdown": _breakdown(getattr(_replay, "requests", [])),
                   "copies": getattr(_replay, "copies", [])}
        log(f"mopd shared, {key}: { {k: v for k, v in by[key].items() if k not in ('copies', 'tail', 'breakdown')} }")
        log(f"mopd shared, {key}, ms: {by[key]['breakdown']['all']}")
    sizes = GPU_SIZES_B if device == "cuda" else (0.5,) * 12
    return {"services": 12, "params_b": list(sizes), "requests": requests, "seq_len": seq_len,
            "shared_devices": 1, "dedicated_devices": 12, "by_compute_share": by}


async def _dedicated_acts(device: str, requests: int, duration_s: float, seq_len: int, vocab: int,
                          only: range | list[int] | None = None) -> tuple[list[float], float]:
    services, names = _mopd_services(device, vocab, 1.0)
    arrivals = _arrivals(len(services), requests, duration_s, 0)
    acts: list[float] = []
    span = 0.0
    _dedicated_acts.requests = []  # type: ignore[attr-defined]
    for i, svc in enumerate(services):
        mine = [(t, 0) for t, s in arrivals if s == i]
        if mine and (only is None or i in only):
            a, sp, _ = await _replay([svc], mine, seq_len, vocab, [names[i]])
            acts += a
            span = max(span, sp)
            _dedicated_acts.requests += getattr(_replay, "requests", [])  # type: ignore[attr-defined]
    return acts, span


def _mopd_dedicated(device: str, requests: int, duration_s: float, seq_len: int, vocab: int,
                    gpus: int = 1) -> dict:
    """Each service alone on a device, its own arrivals only: what a dedicated GPU gives it. With
    ``gpus`` > 1, that many services replay at once, one per GPU (a process each, so they share
    neither a GPU nor an interpreter)."""
    reqs: list[dict] = []
    if gpus <= 1:
        acts, span = asyncio.run(_dedicated_acts(device, requests, duration_s, seq_len, vocab))
        reqs = getattr(_dedicated_acts, "requests", [])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for g in range(gpus):
                out = os.path.join(tmp, f"{g}.json")
                cmd = [sys.executable, "-m", "arl_tangram.bench.models", "--device", device, "--requests",
                       str(requests), "--dedicated-part", f"{g}/{gpus}", "--json", out]
                procs.append((subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(g)},
                                               stdout=subprocess.DEVNULL), out))
            acts, span = [], 0.0
            for p, out in procs:
                if p.wait() != 0:
                    raise RuntimeError(f"dedicated replay part {out} failed (exit {p.returncode})")
                with open(out) as fh:
                    part = json.load(fh)
                acts += part["acts"]
                span = max(span, part["span_s"])
                reqs += part.get("requests", [])
    return {**_stats(acts), "gpu_seconds_held": span * 12, "parallel_gpus": gpus, "breakdown": _breakdown(reqs)}


def _compare(m: dict) -> None:
    """Pick the variant with the lowest average ACT as ``tangram_shared`` (every variant
    measured stays in ``by_compute_share``) and the ratios to the dedicated baseline."""
    by = m.get("by_compute_share") or {}
    d = m.get("task_isolated_dedicated")
    if not by:
        return
    best = min(by, key=lambda k: by[k]["avg_act_s"])
    m["tangram_shared"] = {"variant": best, **by[best]}
    if d:
        m["act_ratio_shared_over_dedicated"] = by[best]["avg_act_s"] / d["avg_act_s"]
        m["p99_ratio_shared_over_dedicated"] = by[best]["p99_act_s"] / d["p99_act_s"]
        m["ratios_by_compute_share"] = {k: {"avg": v["avg_act_s"] / d["avg_act_s"],
                                            "p99": v["p99_act_s"] / d["p99_act_s"]} for k, v in by.items()}
        ded = (d.get("breakdown") or {}).get("by_model") or {}
        if ded:  # per service: which ones the gap comes from, and whether it is queueing or the batch
            m["by_model_shared_minus_dedicated_ms"] = {
                k: {name: {f: round(x[f] - ded[name][f], 3) for f in ("act_ms", "queue_ms", "exec_ms")}
                    for name, x in (v.get("breakdown") or {}).get("by_model", {}).items() if name in ded}
                for k, v in by.items()}


async def _wait_scaled_to_zero(rt, model: str, timeout_s: float = 60.0) -> None:
    t = time.perf_counter()
    while rt.engine.gpu.instances.get(model) or any(k[0] == model for k in rt.models.instances):
        if time.perf_counter() - t > timeout_s:
            raise RuntimeError(f"{model} did not scale to zero in {timeout_s} s")
        await asyncio.sleep(0.02)


async def _time_to_first_score(device: str, vocab: int, seq_len: int) -> dict:
    """Cold: from nothing (the loader builds the weights — random here, where a real loader
    reads a checkpoint — copies them to host RAM and page-locks them) to the first score. From
    host RAM: the copy scaled to zero after ``idle_s``; the next request loads and scores."""
    billions = 7.0 if device == "cuda" else 0.05
    kw = _model_kwargs(device, billions, 0, vocab)
    if device != "cuda":
        kw.update(d_model=256, layers=4)
    svc = ModelServiceConfig("big", f"{TINY}:reward_model", kw, idle_s=1.0)
    seq = list(range(1, seq_len + 1))
    t0 = time.perf_counter()
    async with Tangram.local(sandboxes=False, models=[svc], gpus=1) as tg:
        rt = tg.runtime
        host_s = time.perf_counter() - t0
        cold = await tg.score("big", seq)
        cold_s = time.perf_counter() - t0
        resident = await tg.score("big", seq)
        await _wait_scaled_to_zero(rt, "big")
        t1 = time.perf_counter()
        warm = await tg.score("big", seq)
        from_host_s = time.perf_counter() - t1
        assert cold.ok and warm.ok and resident.ok, (cold.message, warm.message)
        weights_gb = rt.models.loaded["big"].weights_gb
    _release_memory()
    return {"params_b": billions, "weights_gb": round(weights_gb, 2), "idle_s": svc.idle_s,
            "cold_start_s": cold_s, "cold_host_ram_load_s": host_s, "cold_first_score_act_s": cold.act_s,
            "from_host_ram_s": from_host_s, "from_host_ram_load_s": warm.setup_s,
            "resident_score_act_s": resident.act_s, "same_score": warm.result == cold.result}


def _h2d_concurrent_gbps(n: int, gb: float = 4.0) -> float:
    """Host-to-GPU from page-locked memory onto ``n`` GPUs at once, in total."""
    k = int(gb * (1 << 30)) // 2
    hosts = [torch.empty(k, dtype=torch.bfloat16).pin_memory() for _ in range(n)]
    devs = [torch.empty(k, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(n)]
    streams = [torch.cuda.Stream(f"cuda:{i}") for i in range(n)]
    best = None
    for _ in range(4):
        t = time.perf_counter()
        for h, d, st in zip(hosts, devs, streams):
            with torch.cuda.stream(st):
                d.copy_(h, non_blocking=True)
        for st in streams:
            st.synchronize()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return round(n * k * 2 / best / 1e9, 1)


def _h2d_sources(n: int, gb: float = 7.0, reps: int = 3) -> dict:
    """Host-to-GPU copies of ``gb`` to each of ``n`` GPUs at once (one copy per GPU, as a packed
    load makes), from page-locked memory made two ways: torch's ``pin_memory`` (cudaHostAlloc) and
    torch's allocation registered in place (cudaHostRegister, what the manager does). Per GPU: the
    best copy time by CUDA events; in total: the best wall time of all copies."""
    k = int(gb * 1e9) // 4096 * 4096
    out: dict = {}
    for kind in ("pin_memory", "registered"):
        if kind == "pin_memory":
            host = torch.empty(n * k, dtype=torch.uint8).pin_memory()
            ptr = 0
        else:
            host = packing.host_buffer(n * k)
            host.fill_(1)  # touch every page first, as reading weights into it does
            ptr = manager._pin_in_place(host.untyped_storage())
        devs = [torch.empty(k, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
        streams = [torch.cuda.Stream(f"cuda:{i}") for i in range(n)]
        walls, per_gpu = [], [[] for _ in range(n)]
        for _ in range(reps):
            t = time.perf_counter()
            took = _copies_at_once(host, devs, streams, k)
            walls.append(time.perf_counter() - t)
            for i, s in enumerate(took):
                per_gpu[i].append(s)
        out[kind] = {"wall_s_best": round(min(walls), 4), "total_gbps": round(n * k / min(walls) / 1e9, 1),
                     "per_gpu_gbps_best": [round(k / min(x) / 1e9, 1) for x in per_gpu],
                     "per_gpu_s_all": [[round(v, 4) for v in x] for x in per_gpu]}
        if ptr:
            manager._unpin([ptr])
        del host, devs
        torch.cuda.empty_cache()
    return out


def _copies_at_once(host, dsts: list, streams: list, k: int) -> list[float]:
    """Copy ``host``'s i-th ``k`` bytes to ``dsts[i]`` on ``streams[i]``, all issued before any
    wait; each copy's seconds by CUDA events."""
    evs = []
    for i, (d, st) in enumerate(zip(dsts, streams)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(st)
        with torch.cuda.stream(st):
            d.copy_(host[i * k:(i + 1) * k], non_blocking=True)
        b.record(st)
        evs.append((a, b))
    for st in streams:
        st.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in evs]


#: the destination of a raw copy (``_h2d_after_free``): blocks the caching allocator kept from a
#: freed tensor twice the size; fresh driver memory right after the freed tensor went back to the
#: driver; fresh driver memory once that hand-back was 0.3 s ago
AFTER_FREE_CASES = ("reused", "fresh_after_free", "fresh_settled")


def _h2d_after_free(n: int, gb: float = 7.0, reps: int = 3) -> dict:
    """One copy of ``gb`` from page-locked memory to each of ``n`` GPUs at once, right after a
    tensor of twice that size on each was freed, by where the copy lands (``AFTER_FREE_CASES``),
    the cases alternating: separates "a load into blocks reused from an evicted copy copies
    slower" from "a load racing the hand-back of the evicted copy's memory copies slower" (the
    2-GPU load right after an eviction: its first GPU's copy at ~45 GB/s, not 55). Per GPU: each
    copy's time by CUDA events."""
    k = int(gb * 1e9) // 4096 * 4096
    host = torch.empty(n * k, dtype=torch.uint8).pin_memory()
    streams = [torch.cuda.Stream(f"cuda:{i}") for i in range(n)]
    per: dict[str, list[list[float]]] = {c: [[] for _ in range(n)] for c in AFTER_FREE_CASES}
    for _ in range(reps):
        for case in AFTER_FREE_CASES:
            big = [torch.empty(2 * k, dtype=torch.uint8, device=f"cuda:{i}").fill_(1) for i in range(n)]
            for i in range(n):
                torch.cuda.synchronize(i)
            del big
            if case != "reused":
                torch.cuda.empty_cache()
            if case == "fresh_settled":
                time.sleep(0.3)
            dsts = [torch.empty(k, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
            for i, s in enumerate(_copies_at_once(host, dsts, streams, k)):
                per[case][i].append(s)
            del dsts
            torch.cuda.empty_cache()
            time.sleep(0.3)
    out: dict = {"gpus": n, "bytes_per_gpu": k, "reps": reps}
    for case, xs in per.items():
        out[case] = {"copy_s_per_gpu": [[round(v, 4) for v in x] for x in xs],
                     "gbps_per_gpu_median": [round(k / sorted(x)[len(x) // 2] / 1e9, 1) for x in xs]}
    del host
    return out


#: how the multigpu section loads, alternating in one run: packed, as the manager does by default
#: (evictions hand memory back once loads are quiet: the next load reuses the evicted copy's
#: blocks); packed with the hand-back right after each eviction (``packed_lazy``); with no
#: hand-back (``packed_kept``); packed once the GPUs were left quiet (0.3 s, device syncs, the
#: cache handed back: the ceiling; docs/models.md has the figures). Also: ``per_tensor``, and
#: the parts of settling apart: ``packed_synced`` (pause and syncs, the cache kept) and
#: ``packed_emptied`` (the cache handed back alone, no pause); ``packed_alloc_first``: every GPU's
#: part allocated before the first copy is issued (the manager issues each copy as soon as its
#: part is allocated)
MULTI_GPU_MODES = ("packed", "packed_lazy", "packed_kept", "packed_settled")
SETTLE = {"packed_settled": (0.3, True, True), "packed_synced": (0.3, True, False), "packed_emptied": (0.0, False, True)}
#: packed loads with the manager's evictions handing memory back one way (``manager.HAND_BACK``);
#: ``packed``, ``per_tensor`` and the ``SETTLE`` modes use the manager's default ("deferred")
HAND_BACK_MODES = {"packed_lazy": "lazy", "packed_kept": "kept", "packed_deferred": "deferred"}
#: packed loads whose parts come from another stream's cache (``manager.ALLOC_ON``): ``packed_load_stream``
#: allocates each GPU's part on that GPU's load stream; ``packed_default_stream`` on the thread's current one
ALLOC_MODES = {"packed_load_stream": "load", "packed_default_stream": "default"}
#: packed loads whose graph captures empty every GPU's cache first, or not (``graphs.EMPTY_CACHE_ON_CAPTURE``):
#: emptying, the 1-GPU copy's warm-up hands the evicted 2-GPU copy's blocks back before its next load
CAPTURE_MODES = {"packed_capture_empties": True, "packed_capture_keeps": False}


def _settle(mode: str) -> None:
    pause, sync, empty = SETTLE[mode]
    time.sleep(pause)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()) if sync else ():
            torch.cuda.synchronize(i)
        if empty:
            torch.cuda.empty_cache()


async def _multi_gpu(device: str, vocab: int, seq_len: int, rounds: int = 3,
                     modes: tuple[str, ...] = MULTI_GPU_MODES, raw: bool = True) -> dict:
    """The same weights as a 1-GPU copy and as a copy split over 2 GPUs: load time from host RAM
    (scaled to zero between rounds, so every round loads) and the scores of both. Each round loads
    both copies packed (``packing``: one copy per GPU) and tensor by tensor (one copy per tensor,
    the load before packing), alternating, so the two ways compare in one run; the load log's
    CUDA events give each GPU's copy time apart from the issuing thread's."""
    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, this host has {torch.cuda.device_count()}"}
    billions = 7.0 if cuda else 0.05
    kw = _model_kwargs(device, billions, 5, vocab)
    if not cuda:
        kw.update(d_model=256, layers=4)
    # one batch of all 8 sequences on both, so the two copies compute exactly the same thing
    services = [ModelServiceConfig("one", f"{TINY}:reward_model", kw, gpus=1, idle_s=0.2, max_batch=8,
                                   max_wait_ms=100.0),
                ModelServiceConfig("two", f"{TINY}:reward_model", kw, gpus=2, idle_s=0.2, max_batch=8,
                                   max_wait_ms=100.0)]
    rng = random.Random(2)
    seqs = [[rng.randrange(vocab) for _ in range(seq_len - i * 7)] for i in range(8)]
    scores: dict[str, list] = {}
    latency: dict[str, list] = {"one": [], "two": []}
    discovered = None
    if cuda:
        from ..managers.models.topology import discover_gpus
        discovered = [g.island for g in discover_gpus()[:2]]
    # one island of both, whatever was discovered: this measures the split itself (over PCIe when
    # the GPUs have no NVLink between them)
    async with Tangram.local(sandboxes=False, models=services, gpus=2, gpu_island_size=2) as tg:
        rt = tg.runtime
        rt.models.trace_cache = True  # what each GPU's cache held before each part was allocated
        empties = graphs_mod.EMPTY_CACHE_ON_CAPTURE
        made: list[str] = []  # the way each load of the log was made
        for _ in range(rounds):
            for mode in modes:
                rt.models.pack = mode != "per_tensor"
                rt.models.hand_back = HAND_BACK_MODES.get(mode, manager.HAND_BACK)
                rt.models.alloc_first = mode == "packed_alloc_first"
                rt.models.alloc_on = ALLOC_MODES.get(mode, manager.ALLOC_ON)
                graphs_mod.EMPTY_CACHE_ON_CAPTURE = CAPTURE_MODES.get(mode, empties)
                for name in ("one", "two"):
                    if mode in SETTLE:  # the GPUs left quiet before this load, in one of the ways
                        await asyncio.to_thread(_settle, mode)
                    n = len(rt.models.load_log)
                    rs = await asyncio.gather(*(tg.score(name, s) for s in seqs))
                    assert all(r.ok for r in rs), rs[0].message
                    made += [mode] * (len(rt.models.load_log) - n)
                    scores[name] = [r.result for r in rs]
                    resident = await tg.score(name, seqs[0])
                    latency[name].append(resident.act_s)
                    await _wait_scaled_to_zero(rt, name)
        rt.models.pack = True
        rt.models.hand_back = manager.HAND_BACK
        rt.models.alloc_first = False
        rt.models.alloc_on = manager.ALLOC_ON
        graphs_mod.EMPTY_CACHE_ON_CAPTURE = empties
        log_ = rt.models.load_log
        islands = rt.cluster.gpu_nodes[0].islands()
    _release_memory()
    out: dict = {"params_b": billions, "gpus": 2, "islands": islands, "discovered_island_of_each_gpu": discovered,
                 "rounds": rounds}
    out["loads"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()
                     if k in ("model", "packed", "seconds", "warm_s", "issue_s", "alloc_s", "build_s", "wait_s", "copy_s",
                              "new_segments", "new_segments_per_gpu", "cache_before", "alloc_on", "graphs",
                              "since_hand_back_s", "hand_back")}
                    for x in log_]
    for i, x in enumerate(out["loads"]):
        x["mode"] = made[i] if i < len(made) else None
    for mode in modes:
        packed = mode != "per_tensor"
        mine = [x for i, x in enumerate(log_) if i < len(made) and made[i] == mode]
        # the load itself (skeleton, copies, assignment); the warm-up after it is reported apart
        loads = {n: sorted(x["seconds"] - x.get("warm_s", 0.0) for x in mine if x["model"] == n) for n in ("one", "two")}
        one, two = loads["one"][len(loads["one"]) // 2], loads["two"][len(loads["two"]) // 2]
        phases = {n: {k: round(min(x[k] for x in mine if x["model"] == n), 4) for k in ("issue_s", "build_s", "wait_s")}
                  for n in ("one", "two")}
        res = {"load_s_1gpu": one, "load_s_2gpu": two, "load_speedup": one / two, "load_speedup_best":
               loads["one"][0] / loads["two"][0], "load_s_all": loads, "load_phases_min_s": phases}
        if packed and cuda:  # per GPU: the copy engine's time (CUDA events) and its rate
            copies = {n: [x["copy_s"] for x in mine if x["model"] == n] for n in ("one", "two")}
            res["copy_s_per_gpu"] = copies
            res["copy_gbps_per_gpu_best"] = {
                n: [round(x["bytes"] / len(x["copy_s"]) / min(c[i] for c in copies[n]) / 1e9, 1)
                    for i in range(len(copies[n][0]))] for n in ("one", "two")
                for x in [next(y for y in mine if y["model"] == n)]}
        out[mode] = res
    if "packed" in out and "per_tensor" in out:
        out["packed_over_per_tensor_2gpu_load"] = out["per_tensor"]["load_s_2gpu"] / out["packed"]["load_s_2gpu"]
    for mode in modes:
        out[f"load_speedup_{mode}"] = out[mode]["load_speedup"]
    out["load_speedup"] = out[modes[0]]["load_speedup"]
    out["warm_s"] = {n: [round(x.get("warm_s", 0.0), 3) for x in log_ if x["model"] == n] for n in ("one", "two")}
    diff = max(abs(a - b) for a, b in zip(scores["one"], scores["two"]))
    scale = max(abs(a) for a in scores["one"]) or 1.0
    out.update({"score_max_abs_diff": diff, "score_max_rel_diff": diff / scale, "scores_identical": diff == 0.0,
                "resident_act_s_1gpu": min(latency["one"]), "resident_act_s_2gpu": min(latency["two"]),
                "resident_ratio_2gpu_over_1gpu": min(latency["two"]) / min(latency["one"])})
    if cuda:
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(2)]
    if cuda and raw:  # the raw copies the loads compare with (``--no-multigpu-raw`` skips them)
        out["h2d_concurrent_2gpu_gbps"] = _h2d_concurrent_gbps(2)
        out["h2d_one_gpu_gbps"] = _h2d_concurrent_gbps(1)
        out["h2d_sources_2gpu"] = _h2d_sources(2)
        out["h2d_sources_1gpu"] = _h2d_sources(1, gb=14.0)
    return out


SECTIONS = ("h2d", "throughput", "hf", "mopd", "dedicated", "ttfs", "multigpu")


def run(device: str = "auto", log: Callable[[str], None] = print, requests: int | None = None,
        sections: tuple[str, ...] = SECTIONS, shares: list[str] | None = None, merge: dict | None = None,
        dedicated_gpus: int = 1, multigpu_modes: tuple[str, ...] = MULTI_GPU_MODES, multigpu_rounds: int = 3,
        multigpu_raw: bool = True) -> dict:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"sections: unknown {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")
    known_modes = ("packed", "per_tensor", "packed_alloc_first", *SETTLE, *HAND_BACK_MODES, *ALLOC_MODES, *CAPTURE_MODES)
    bad = [m for m in multigpu_modes if m not in known_modes]
    if bad or not multigpu_modes:
        raise ValueError(f"multigpu_modes: unknown {', '.join(bad) or '(none given)'} (known: {', '.join(known_modes)})")
    cuda = device == "cuda"
    result: dict = dict(merge or {})
    result.update({"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                   "host": {"cpus": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
                                                                       * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}})
    result["graphs_min_gain"] = manager.MIN_GAIN
    result["graphs_judge"] = manager.GRAPH_JUDGE
    if cuda:
        from ..managers.models.topology import discover_gpus
        result["gpus_discovered"] = [{"index": g.index, "memory_gb": round(g.memory_gb, 1), "island": g.island,
                                      "name": g.name} for g in discover_gpus()]
    vocab = 32000 if cuda else 512
    requests = requests or (600 if cuda else 120)
    duration_s, seq_len = (20.0, 512) if cuda else (6.0, 64)
    if "h2d" in sections:
        result["h2d"] = h2d_gbps(device, 4.0 if cuda else 0.0)
        if cuda:
            try:  # a diagnostic: its failure must not cost the sections after it
                result["h2d"]["after_free"] = _h2d_after_free(min(2, torch.cuda.device_count()))
            except Exception as e:
                result["h2d"]["after_free"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"h2d: {result['h2d']}")
    if "throughput" in sections:
        result["throughput"] = asyncio.run(_throughput(device, 256 if cuda else 64, 512 if cuda else 96, vocab))
        log(f"scoring throughput: {result['throughput']}")
    if "hf" in sections:
        try:
            import transformers  # noqa: F401
            result["hf"] = asyncio.run(_hf_throughput(device, 256 if cuda else 32, 256 if cuda else 48))
        except ModuleNotFoundError as e:
            result["hf"] = {"skipped": f"needs {e.name}"}
        log(f"hugging face services: {result['hf']}")
    if "mopd" in sections:
        shares = shares or (["1", "0.25", "0.0833"] if cuda else ["1", "0.5"])
        m = asyncio.run(_mopd_shared(device, requests, duration_s, seq_len, vocab, shares, log))
        result["mopd"] = {**result.get("mopd", {}), **m}
    if "dedicated" in sections:
        d = _mopd_dedicated(device, requests, duration_s, seq_len, vocab, dedicated_gpus)
        result.setdefault("mopd", {})["task_isolated_dedicated"] = d
        log(f"mopd dedicated: { {k: v for k, v in d.items() if k != 'breakdown'} }")
        log(f"mopd dedicated, ms: {d['breakdown']['all']}")
    if "mopd" in result:
        _compare(result["mopd"])
        m = result["mopd"]
        if "act_ratio_shared_over_dedicated" in m:
            log(f"mopd: shared avg ACT {m['tangram_shared']['avg_act_s']:.3f}s ({m['tangram_shared']['variant']}) "
                f"vs dedicated "
                f"{m['task_isolated_dedicated']['avg_act_s']:.3f}s (x{m['act_ratio_shared_over_dedicated']:.2f}, "
                f"p99 x{m['p99_ratio_shared_over_dedicated']:.2f})")
    if "ttfs" in sections:
        result["time_to_first_score"] = asyncio.run(_time_to_first_score(device, vocab, 512 if cuda else 64))
        log(f"time to first score: {result['time_to_first_score']}")
    if "multigpu" in sections:
        result["multi_gpu"] = asyncio.run(_multi_gpu(device, vocab, 512 if cuda else 64, rounds=multigpu_rounds,
                                                     modes=multigpu_modes, raw=multigpu_raw))
        log(f"multi-GPU instance: {result['multi_gpu']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--shares", default=None, help="shared MOPD runs: compute shares, each optionally with a "
                    "thread switch interval in ms and a graph judge, e.g. 1,1@5,0.25,1+one_row (default interval: "
                    "the manager's 0.2 ms on CUDA; judge: graphs.GRAPH_JUDGE)")
    ap.add_argument("--merge", default=None, help="JSON of an earlier run whose sections to include")
    ap.add_argument("--dedicated-gpus", type=int, default=1, help="replay that many dedicated services at once, "
                    "one per GPU")
    ap.add_argument("--profile", default=None, help="a directory: profile each shared MOPD replay's first "
                    "--profile-s seconds (torch.profiler; a summary of the slow batches and their trace)")
    ap.add_argument("--profile-s", type=float, default=7.0)
    ap.add_argument("--profile-slow-ms", type=float, default=100.0, help="the batches the profile summary "
                    "describes: those of at least this many ms")
    ap.add_argument("--min-gain", type=float, default=None, help="keep a copy's CUDA graphs only where they are "
                    "this many times faster than eager (default: graphs.MIN_GAIN; 0 keeps them always)")
    ap.add_argument("--multigpu-modes", default=",".join(MULTI_GPU_MODES),
                    help=f"the multigpu section's ways to load, of packed, per_tensor, packed_alloc_first, "
                    f"{', '.join((*SETTLE, *HAND_BACK_MODES, *ALLOC_MODES, *CAPTURE_MODES))}")
    ap.add_argument("--multigpu-rounds", type=int, default=3, help="loads of each way and copy in the multigpu section")
    ap.add_argument("--no-multigpu-raw", action="store_true", help="skip the multigpu section's raw copies")
    ap.add_argument("--dedicated-part", default=None, help=argparse.SUPPRESS)  # "i/n": a worker of the above
    args = ap.parse_args()
    if args.dedicated_part:
        i, n = map(int, args.dedicated_part.split("/"))
        dev = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
        cuda = dev == "cuda"
        acts, span = asyncio.run(_dedicated_acts(dev, args.requests or (600 if cuda else 120),
                                                 20.0 if cuda else 6.0, 512 if cuda else 64,
                                                 32000 if cuda else 512, range(i, 12, n)))
        with open(args.json, "w") as fh:
            json.dump({"acts": acts, "span_s": span, "requests": getattr(_dedicated_acts, "requests", [])}, fh)
        return
    PROFILE["dir"], PROFILE["seconds"], PROFILE["slow_ms"] = args.profile, args.profile_s, args.profile_slow_ms

    if args.min_gain is not None:
        manager.MIN_GAIN = args.min_gain
    merge = None
    if args.merge:
        with open(args.merge) as fh:
            merge = json.load(fh)
    shares = args.shares.split(",") if args.shares else None
    result = run(args.device, requests=args.requests, sections=tuple(x for x in args.sections.split(",") if x),
                 shares=shares, merge=merge, dedicated_gpus=args.dedicated_gpus,
                 multigpu_modes=tuple(args.multigpu_modes.split(",")), multigpu_rounds=args.multigpu_rounds,
                 multigpu_raw=not args.no_multigpu_raw)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
