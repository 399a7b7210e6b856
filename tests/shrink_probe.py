"""What the tests of ``Shrink`` on a real sandbox share (tests/test_workers.py, tests/test_ray.py):
whether this host lets a test make cgroups, and the program that watches its own cores shrink."""

from __future__ import annotations

import os

import pytest

from arl_tangram.managers.sandbox.cgroups import open_root


def _writable_cgroups() -> bool:
    root = open_root(tag=f"tangram-probe-{os.getpid()}")
    if root is None:
        return False
    root.cleanup()
    return True


#: a shrink needs a cgroup to rewrite and two cores to take one back
needs_a_core_to_take_back = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not _writable_cgroups(),
    reason="needs 2 cores and writable cgroups to take a core back")

#: prints "<cores at start> <cores at the end>": waits (up to 20 s) for its cores to change
WATCH_CORES = """
import os, time
first = len(os.sched_getaffinity(0))
end = time.time() + 20
while first > 1 and len(os.sched_getaffinity(0)) == first and time.time() < end:
    time.sleep(0.01)
print(first, len(os.sched_getaffinity(0)))
"""
