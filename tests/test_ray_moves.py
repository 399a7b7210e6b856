"""A session moved to another Ray node keeps its Python state and its files (its rest blob
carried through the object store and woken there); one whose state cannot be carried whole is not
moved for balance, and a drain that must move it says its interpreter lost what it held. On a
real 2-node Ray cluster on loopback (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every Ray address on 127.0.0.1
ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")

from arl_tangram.core import Outcome  # noqa: E402
from arl_tangram.managers.sandbox.manager import SandboxConfig  # noqa: E402
from arl_tangram.runtime import Tangram  # noqa: E402

from raycluster import loopback_cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


def test_a_moved_session_keeps_its_variables_and_files_and_an_unpicklable_one_stays_home():
    async def main():
        with loopback_cluster({"num_cpus": 1}, {"num_cpus": 1}) as (c, _):
            async with Tangram.ray(c.address, sandbox=SandboxConfig(warm_pool=1)) as tg:
                rt = tg.runtime
                s = await tg.session()
                first = await s.exec(python="state = {'n': 41}\nopen('notes.txt', 'w').write('kept')")
                assert first.ok, first.message
                home = rt.sandboxes.homes[s.id]
                other = next(n for n in rt.nodes_by_id.values() if n is not home and n.index is not None)
                moved = await rt.sandboxes.move(s.id, other)
                where = rt.sandboxes.homes[s.id]
                after = await s.exec(python="state['n'] += 1\nprint(state['n'], open('notes.txt').read())")
                ran_on = rt.sandboxes.homes[s.id]

                u = await tg.session()
                await u.exec(python="x = 7\ng = (i for i in range(3))")  # a generator: not picklable
                u_home = rt.sandboxes.homes[u.id]
                u_other = next(n for n in rt.nodes_by_id.values() if n is not u_home and n.index is not None)
                stayed = await rt.sandboxes.move(u.id, u_other)
                u_where = rt.sandboxes.homes[u.id]
                u_after = await u.exec(python="print(x, next(g))")
                forced = await rt.sandboxes.move(u.id, u_other, balance=False)  # as a drain moves it
                u_forced = await u.exec(python="print(x)")
                u_g = await u.exec(python="print(g)")
                return (moved, where is other, after, ran_on is other, stayed, u_where is u_home, u_after,
                        forced, rt.sandboxes.homes[u.id] is u_other, u_forced, u_g, rt.sandboxes.moves)

    (moved, went, after, ran_there, stayed, u_home, u_after, forced, u_went, u_forced, u_g,
     moves) = asyncio.run(asyncio.wait_for(main(), 240))
    assert moved is None and went and ran_there
    assert after.outcome is Outcome.OK and after.stdout == "42 kept\n", (after.outcome, after.message, after.stderr)
    assert after.result.info.get("woken")  # woken from its carried blob, as a rested session wakes
    # a generator cannot be carried: a move for balance leaves it home, untouched
    assert stayed is not None and "g" in stayed and u_home
    assert u_after.outcome is Outcome.OK and u_after.stdout == "7 0\n", (u_after.message, u_after.stderr)
    # a drain must move it: what it held goes, and the answer says so (never a silent NameError)
    assert forced is None and u_went and moves == 2
    assert u_forced.outcome is Outcome.OK and u_forced.stdout == "7\n", (u_forced.message, u_forced.stderr)
    assert "g" in u_forced.message and "without" in u_forced.message, u_forced.message
    assert u_g.outcome is not Outcome.OK and "NameError" in (u_g.stderr + u_g.message)
