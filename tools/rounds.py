"""The engine process's own work per one-shot around the engine (``Runtime``, ``Driver``,
``Engine``, the policy), without sandboxes or HTTP: a CPU manager double answers the runs it was
given ``k`` at a time, one batch per loop pass, as one read of a sandbox worker's link hands the
engine process several answers on a many-core host. Prints JSON: CPU µs per action, scheduling
rounds per action, actions per second.

A script beside the sources, not a ``tangram bench`` command, so that the same file measures
another checkout's code for an A/B (imports are absolute; it reaches into the runtime's private
``_arm`` to count rounds)::

    ARL_TANGRAM_PURE=1 PYTHONPATH=<a checkout's src> python3 tools/rounds.py --k 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from arl_tangram.core.action import Outcome
from arl_tangram.core.seam import Completion
from arl_tangram.driver import Driver
from arl_tangram.managers.sandbox.spec import SandboxConfig, SandboxResult
from arl_tangram.runtime.api import Tangram
from arl_tangram.runtime.local import LocalRuntime


class Batches:
    """Answers what it started, up to ``k`` a loop pass."""

    def __init__(self, sink, k: int) -> None:
        self.sink = sink
        self.k = k
        self.config = SandboxConfig()
        self.held: list[str] = []
        self.armed = False

    async def start_up(self) -> None:
        pass

    async def shut_down(self) -> None:
        pass

    def start(self, action, allocation) -> None:
        self.held.append(action.id)
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self.answer)

    def answer(self) -> None:
        self.armed = False
        batch, self.held = self.held[:self.k], self.held[self.k:]
        if self.held:
            self.armed = True
            asyncio.get_running_loop().call_soon(self.answer)
        for aid in batch:
            self.sink(Completion(aid, Outcome.OK, 0.0, 0.0, "", SandboxResult()))

    def cancel(self, action_id: str) -> None:
        pass

    def close_session(self, trajectory: str) -> None:
        pass


def measure(k: int = 8, actions: int = 20_000, cores: int = 16) -> dict:
    rounds = [0]

    class Counting(Driver):
        __slots__ = ()

        def tick(self) -> int:
            rounds[0] += 1
            return super().tick()

    async def main() -> dict:
        rt = LocalRuntime(sandboxes=lambda sink, expire: Batches(sink, k), cores=cores, memory_gb=64)
        rt.driver = Counting(rt.engine, rt._arm)
        async with Tangram(rt) as tg:
            gate = asyncio.Semaphore(4 * cores)

            async def one() -> None:
                async with gate:
                    r = await tg.run("print(1)")
                    assert r.ok, r

            await asyncio.gather(*(one() for _ in range(500)))  # warm-up
            rounds[0] = 0
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(one() for _ in range(actions)))
            c1, t1 = time.process_time(), time.perf_counter()
        return {"k": k, "actions": actions, "cores": cores, "cpu_us_per_action": round((c1 - c0) / actions * 1e6, 1),
                "rounds_per_action": round(rounds[0] / actions, 3), "actions_per_s": round(actions / (t1 - t0))}

    try:
        import uvloop
        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=8, help="answers a loop pass")
    ap.add_argument("--actions", type=int, default=20_000)
    ap.add_argument("--cores", type=int, default=16)
    a = ap.parse_args()
    print(json.dumps(measure(a.k, a.actions, a.cores)))
