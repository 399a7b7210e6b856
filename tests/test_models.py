"""Model services on CPU "devices": the same manager and engine as on GPUs, tiny random models."""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")

from arl_tangram.core import ApiQuota, Outcome  # noqa: E402
from arl_tangram.managers.models.manager import ModelServiceConfig as M  # noqa: E402
from arl_tangram.runtime import Tangram  # noqa: E402

TINY = "arl_tangram.managers.models.tiny"


def run(body, **kw):
    async def main():
        async with Tangram.local(sandboxes=False, **kw) as tg:
            return await body(tg)
    return asyncio.run(main())


def test_batched_scores_equal_unbatched_scores():
    seqs = [[(7 * i + j) % 500 for j in range(3 + i % 5)] for i in range(24)]

    async def batched(tg):
        return await asyncio.gather(*(tg.score("rm", s) for s in seqs))

    async def one_by_one(tg):
        return [await tg.score("rm", s) for s in seqs]

    b = run(batched, models=[M("rm", f"{TINY}:reward_model", max_batch=8, max_wait_ms=20)])
    u = run(one_by_one, models=[M("rm", f"{TINY}:reward_model", max_batch=1)])
    assert all(r.outcome is Outcome.OK for r in b + u)
    assert max(r.act_s for r in b) > 0
    assert [r.result for r in b] == pytest.approx([r.result for r in u], abs=1e-5)
    teacher = run(lambda tg: asyncio.gather(tg.logprobs("t", [1, 2, 3]), tg.logprobs("t", [4, 5, 6, 7, 8])),
                  models=[M("t", f"{TINY}:teacher_model", max_wait_ms=20)])
    alone = run(lambda tg: tg.logprobs("t", [1, 2, 3]), models=[M("t", f"{TINY}:teacher_model")])
    assert len(teacher[0].result) == 2 and len(teacher[1].result) == 4
    assert teacher[0].result == pytest.approx(alone.result, abs=1e-5)
    assert all(v < 0 for v in teacher[1].result)


def test_eviction_and_reload_give_identical_results_and_memory_holds():
    models = [M(f"m{i}", f"{TINY}:reward_model", {"seed": i, "d_model": 128}, memory_gb=0.6) for i in range(3)]

    async def body(tg):
        seen = {}
        used = []
        for round_ in range(3):
            for i in range(3):
                r = await tg.score(f"m{i}", [1, 2, 3, 4])
                assert r.outcome is Outcome.OK
                seen.setdefault(i, []).append(r.result)
                used.append(tg.runtime.engine.gpu.gpus[0].used_gb)
        return seen, used, tg.runtime.models.loads

    seen, used, loads = run(body, models=models, gpus=1, gpu_memory_gb=1.0)
    assert loads >= 9 - 1, "one GPU of 1 GB cannot keep two 0.6 GB models: each switch reloads"
    assert all(u <= 1.0 + 1e-9 for u in used)
    for i, values in seen.items():
        assert values[0] == values[1] == values[2]  # evicted and reloaded: bit-identical


def test_bad_input_is_rejected_and_a_broken_loader_only_breaks_its_service():
    models = [M("rm", f"{TINY}:reward_model"), M("bad", f"{TINY}:no_such_loader"),
              M("t", f"{TINY}:teacher_model")]

    async def body(tg):
        return (await tg.score("ghost", [1]), await tg.score("rm", [1, 10**6]), await tg.score("rm", [[1, 2]]),
                await tg.score("rm", []), await tg.logprobs("t", [1]), await tg.score("t", [1, 2]),
                await tg.score("bad", [1]), await tg.score("rm", [1, 2]))

    ghost, oob, shape, empty, short, wrong_op, broken, fine = run(body, models=models)
    assert ghost.outcome is Outcome.REJECTED and "unknown model" in ghost.message
    assert oob.outcome is Outcome.REJECTED and "out of range" in oob.message
    assert shape.outcome is Outcome.REJECTED and "flat list" in shape.message
    assert empty.outcome is Outcome.REJECTED and short.outcome is Outcome.REJECTED
    assert wrong_op.outcome is Outcome.REJECTED and "has no 'score'" in wrong_op.message
    assert broken.outcome is Outcome.REJECTED and "failed to load" in broken.message
    assert fine.outcome is Outcome.OK


def test_api_quota_bounds_concurrency_and_rate():
    state = {"now": 0, "max": 0}

    async def handler(payload):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        if payload == "boom":
            raise ConnectionError("upstream 503")
        return payload * 2

    async def body(tg):
        t = time.monotonic()
        rs = await asyncio.gather(*(tg.call_api("search", i) for i in range(12)))
        elapsed = time.monotonic() - t
        return rs, elapsed, await tg.call_api("search", "boom")

    rs, elapsed, boom = run(body, apis={"search": (ApiQuota("search", rate_per_s=20, concurrency=3, burst=2),
                                                   handler)})
    assert [r.result for r in rs] == [2 * i for i in range(12)]
    assert state["max"] <= 3
    assert elapsed >= (12 - 2) / 20 - 0.02  # the bucket refills at 20/s after a burst of 2
    assert boom.outcome is Outcome.INFRA_ERROR and "503" in boom.message
