"""Model-service figures: host-to-device bandwidth, scoring throughput with and without batching,
and a MOPD-style run — 12 teacher services of different sizes sharing one device under Tangram,
against each service owning a dedicated device (replayed one service at a time on the same device
with its model preloaded, which is what a dedicated GPU would give it).

Runs on ``cuda`` (random-initialised transformers of 0.5B-7B parameters, bf16) or on ``cpu`` (the
same code with tiny models). ``python -m arl_tangram.bench.models --device cuda`` needs only torch
and pydantic, for machines without the CLI's other dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Callable

import torch

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


def _arrivals(n_services: int, requests: int, duration_s: float, seed: int) -> list[tuple[float, int]]:
    """Poisson-ish arrivals, bursty (a third of them in the middle fifth), Zipf(1.1) over services."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(n_services)]
    out = []
    for _ in range(requests):
        t = rng.uniform(0.4, 0.6) * duration_s if rng.random() < 1 / 3 else rng.uniform(0, duration_s)
        out.append((t, rng.choices(range(n_services), weights)[0]))
    return sorted(out)


async def _replay(services: list[ModelServiceConfig], arrivals: list[tuple[float, int]], seq_len: int,
                  vocab: int, names: list[str]) -> tuple[list[float], float, float]:
    async with Tangram.local(sandboxes=False, models=services, gpus=1) as tg:
        rt = tg.runtime
        while rt.engine.loading:  # prefetched copies first, as a dedicated deployment would have them
            await asyncio.sleep(0.05)
        rng = random.Random(1)
        held0 = rt.engine.usage.gpu_held_s
        start = time.perf_counter()

        async def one(at: float, svc: int) -> float:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            r = await tg.logprobs(names[svc], [rng.randrange(vocab) for _ in range(seq_len)])
            if not r.ok:
                raise RuntimeError(f"{names[svc]}: {r.outcome.value}: {r.message}")
            return r.act_s

        acts = await asyncio.gather(*(one(t, s) for t, s in arrivals))
        span = time.perf_counter() - start
        rt.engine.usage.advance(rt.engine.clock.now())
        return list(acts), span, rt.engine.usage.gpu_held_s - held0


async def _mopd(device: str, requests: int, duration_s: float, seq_len: int, vocab: int) -> dict:
    sizes = GPU_SIZES_B if device == "cuda" else (0.5,) * 12
    names = [f"teacher-{i}" for i in range(len(sizes))]
    services = [ModelServiceConfig(n, f"{TINY}:teacher_model", _model_kwargs(device, b, i, vocab), max_batch=16,
                                   max_wait_ms=5.0) for i, (n, b) in enumerate(zip(names, sizes))]
    arrivals = _arrivals(len(services), requests, duration_s, 0)
    shared_acts, shared_span, shared_held = await _replay(services, arrivals, seq_len, vocab, names)
    dedicated_acts: list[float] = []
    dedicated_span = 0.0
    for i, svc in enumerate(services):
        mine = [(t, 0) for t, s in arrivals if s == i]
        if mine:
            acts, span, _ = await _replay([svc], mine, seq_len, vocab, [names[i]])
            dedicated_acts += acts
            dedicated_span = max(dedicated_span, span)
    s_avg = sum(shared_acts) / len(shared_acts)
    d_avg = sum(dedicated_acts) / len(dedicated_acts)
    return {
        "services": len(services), "params_b": list(sizes), "requests": requests, "seq_len": seq_len,
        "shared_devices": 1, "dedicated_devices": len(services),
        "tangram_shared": {"avg_act_s": s_avg, "p50_act_s": percentile(sorted(shared_acts), 50),
                           "p99_act_s": percentile(sorted(shared_acts), 99), "gpu_seconds_held": shared_held},
        "task_isolated_dedicated": {"avg_act_s": d_avg, "p50_act_s": percentile(sorted(dedicated_acts), 50),
                                    "p99_act_s": percentile(sorted(dedicated_acts), 99),
                                    "gpu_seconds_held": dedicated_span * len(services)},
        "act_ratio_shared_over_dedicated": s_avg / d_avg,
    }


def run(device: str = "auto", log: Callable[[str], None] = print, requests: int | None = None) -> dict:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    result["h2d"] = h2d_gbps(device, 4.0 if cuda else 0.0)
    log(f"h2d: {result['h2d']}")
    vocab = 32000 if cuda else 512
    result["throughput"] = asyncio.run(_throughput(device, 256 if cuda else 64, 512 if cuda else 96, vocab))
    log(f"scoring throughput: {result['throughput']}")
    result["mopd"] = asyncio.run(_mopd(device, requests or (600 if cuda else 120), 20.0 if cuda else 6.0,
                                       512 if cuda else 64, vocab))
    m = result["mopd"]
    log(f"mopd: shared avg ACT {m['tangram_shared']['avg_act_s']:.3f}s vs dedicated "
        f"{m['task_isolated_dedicated']['avg_act_s']:.3f}s (x{m['act_ratio_shared_over_dedicated']:.2f})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    result = run(args.device, requests=args.requests)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
