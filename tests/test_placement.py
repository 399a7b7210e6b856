"""Where a run goes (``OneShots.placement``): one-shots share the host's CPUs, bounded to
their cores' worth of CPU time, where that bound holds; sessions, and one-shots where it cannot be
enforced, are pinned to their cores. At the manager's seam, with the cgroup root as a double (the
real groups are exercised in test_sandbox.py)."""

from types import SimpleNamespace

from arl_tangram.managers.sandbox.manager import SandboxConfig, SandboxManager

CPUS = (0, 1, 2, 3)


def manager(root=None, **config) -> SandboxManager:
    m = SandboxManager(SandboxConfig(cpus=CPUS, **config), lambda c: None)
    m.root = root
    return m


def test_one_shots_share_the_cpus_with_their_cores_as_a_quota_and_sessions_stay_pinned():
    m = manager(SimpleNamespace(bounds_cpu_time=True))
    assert m.shares_cpus
    assert m.pool.placement((2,), one_shot=True) == (CPUS, 1)
    assert m.pool.placement((1, 3), one_shot=True) == (CPUS, 2)
    assert m.pool.placement((2,), one_shot=False) == ((2,), None)


def test_pinned_where_cpu_time_cannot_be_bounded_or_sharing_is_off():
    """Without the cpu controller's quota, and without cgroups at all (an affinity holds code
    that sizes itself by it to its cores), one-shots are pinned as sessions are."""
    for m in (manager(SimpleNamespace(bounds_cpu_time=False)), manager(None),
              manager(SimpleNamespace(bounds_cpu_time=True), one_shots_share_cpus=False)):
        assert not m.shares_cpus
        assert m.pool.placement((2,), one_shot=True) == ((2,), None)


def test_without_cgroups_a_runs_affinity_is_where_its_sandbox_was_placed_and_thread_counts_its_cores():
    m = manager(None)
    sb = SimpleNamespace(cpus=(2,), rootfs=None)
    req = m.execution.base((2,), sb)
    assert req["cpus"] == [2] and req["env"]["TANGRAM_NUM_CPUS"] == "1" and req["env"]["OMP_NUM_THREADS"] == "1"
    assert m.execution.base((3,))["cpus"] == [3]  # no sandbox yet: its cores
    assert "cpus" not in manager(SimpleNamespace(bounds_cpu_time=True)).execution.base((2,), sb)  # a cpuset places it


def test_a_sandbox_writes_only_what_changed_the_tighter_bound_first():
    """Sharing: the quota before the wider cpuset; pinning again: the narrower cpuset before the
    quota goes, so that its processes are never bounded by neither. Nothing changed: no write
    (a cgroupfs round trip per one-shot otherwise)."""
    from arl_tangram.managers.sandbox.sandbox import Sandbox

    writes: list = []
    sb = Sandbox.__new__(Sandbox)  # its group alone: a recording double
    sb.group = SimpleNamespace(set_cpu_quota=lambda q: writes.append(("quota", q)),
                               set_cpus=lambda c: writes.append(("cpus", c)))
    sb._cpus, sb._quota = (2,), None
    sb.set_cpus(CPUS, 1)
    assert writes == [("quota", 1), ("cpus", CPUS)] and (sb.cpus, sb.cpu_quota) == (CPUS, 1)
    writes.clear()
    sb.set_cpus(CPUS, 1)
    assert writes == []
    sb.set_cpus(CPUS, 2)
    assert writes == [("quota", 2)]
    writes.clear()
    sb.set_cpus((3,), None)
    assert writes == [("cpus", (3,)), ("quota", None)] and (sb.cpus, sb.cpu_quota) == ((3,), None)
