"""The cgroup layer's logic on a v2 layout, against a directory tree shaped like cgroupfs (a test
double at the filesystem seam: this host is v1, and the v1 path is exercised by the sandbox tests)."""

import asyncio
import errno
from pathlib import Path

import pytest

from arl_tangram.managers.sandbox import cgroups
from arl_tangram.managers.sandbox.cgroups import LEAF, _own_cgroups, open_root


def fake_v2(tmp_path: Path, svc_controllers: str = "cpuset cpu memory pids") -> Path:
    root = tmp_path / "cg"
    (root / "svc").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "svc" / "cgroup.controllers").write_text(svc_controllers + "\n")
    (root / "svc" / "cgroup.subtree_control").write_text("")
    (root / "svc" / "cgroup.procs").write_text("")
    return root


class FakeKernel:
    """The two cgroupfs behaviours delegation depends on, at the module's seams: enabling
    controllers in a group makes them available to its children, and is refused while the group
    (not the root) has processes of its own; moving a process takes it out of its old group."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def enable(self, d: Path, controllers: set[str]) -> None:
        if d != self.mount and (d / "cgroup.procs").read_text().split():
            raise OSError(errno.EBUSY, "Device or resource busy")
        on = set((d / "cgroup.subtree_control").read_text().split()) | controllers
        (d / "cgroup.subtree_control").write_text(" ".join(sorted(on)))
        for child in d.iterdir():
            if child.is_dir():
                (child / "cgroup.controllers").write_text(" ".join(sorted(on)))

    def move(self, pid: str, dest: Path) -> None:
        for procs in self.mount.rglob("cgroup.procs"):
            procs.write_text("".join(p + "\n" for p in procs.read_text().split() if p != pid))
        (dest / "cgroup.procs").write_text(((dest / "cgroup.procs").read_text() if (dest / "cgroup.procs").exists()
                                            else "") + pid + "\n")


def test_v2_root_is_made_under_our_own_cgroup_with_controllers_enabled(tmp_path):
    mount = fake_v2(tmp_path)
    root = open_root(mount, self_cgroup="0::/svc\n", tag="tangram-test")
    assert root is not None and root.v2
    parent = mount / "svc" / "tangram-test"
    assert root.dirs == {"unified": parent}
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +cpuset +memory +pids"
    g = root.create("sb1")
    assert (parent / "sb1").is_dir()
    g.set_memory(64 << 20)
    g.set_pids(32)
    g.set_cpus((3, 1))
    assert (parent / "sb1" / "memory.max").read_text() == str(64 << 20)
    assert (parent / "sb1" / "pids.max").read_text() == "32"
    assert (parent / "sb1" / "cpuset.cpus").read_text() == "1,3"
    (parent / "sb1" / "cgroup.freeze").write_text("0")  # the kernel's file
    g.freeze(True)  # no event loop here: at once
    assert (parent / "sb1" / "cgroup.freeze").read_text() == "1"
    (parent / "sb1" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert g.oom_kills() == 2
    (parent / "sb1" / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    assert g.cpu_seconds() == 1.5


def test_a_freeze_from_the_event_loop_waits_its_grace_and_a_thaw_within_it_writes_nothing(tmp_path):
    """Back-to-back session steps: the freeze after one is cancelled by the next one's thaw,
    nothing written; an idle group is frozen once the grace is over, and thaws at once."""
    mount = fake_v2(tmp_path)
    g = open_root(mount, self_cgroup="0::/svc\n", tag="tangram-test").create("sb1")
    state = mount / "svc" / "tangram-test" / "sb1" / "cgroup.freeze"
    state.write_text("0")  # the kernel's file

    async def steps():
        g.freeze(True)
        assert state.read_text() == "0"  # still running within the grace
        g.freeze(False)  # the next step: the freeze is cancelled, nothing written
        await asyncio.sleep(cgroups.FREEZE_GRACE_S * 3)
        assert state.read_text() == "0"
        g.freeze(True)
        await asyncio.sleep(cgroups.FREEZE_GRACE_S * 3)
        assert state.read_text() == "1"  # idle past the grace: frozen
        g.freeze(False)
        assert state.read_text() == "0"

    asyncio.run(steps())


def test_missing_controllers_without_root_mean_no_cgroups_and_a_warning_saying_why(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(cgroups, "euid", lambda: 1000)
    mount = fake_v2(tmp_path, "cpu io")
    assert open_root(mount, self_cgroup="0::/svc\n", tag="t") is None
    assert "falling back to rlimits" in caplog.text and "not root to delegate" in caplog.text


@pytest.mark.parametrize("own", ["/svc", "/svc/" + LEAF])
def test_as_root_our_cgroup_becomes_a_delegated_subtree(tmp_path, monkeypatch, own):
    """The accelerator host's case: cpuset and pids not delegated to our cgroup, which has
    processes of its own (us, the shell that started us)."""
    monkeypatch.setattr(cgroups, "euid", lambda: 0)
    mount = fake_v2(tmp_path, "cpu memory")
    kernel = FakeKernel(mount)
    monkeypatch.setattr(cgroups, "_enable", kernel.enable)
    monkeypatch.setattr(cgroups, "_move", kernel.move)
    (mount / "svc" / "cgroup.procs").write_text("100\n101\n")
    root = open_root(mount, self_cgroup=f"0::{own}\n", tag="tangram-test")
    assert root is not None and root.dirs == {"unified": mount / "svc" / "tangram-test"}
    assert set((mount / "cgroup.subtree_control").read_text().split()) == {"cpu", "cpuset", "memory", "pids"}
    assert set((mount / "svc" / "cgroup.subtree_control").read_text().split()) == {"cpu", "cpuset", "memory",
                                                                                 "pids"}
    assert (mount / "svc" / "cgroup.procs").read_text().split() == []
    assert (mount / "svc" / LEAF / "cgroup.procs").read_text().split() == ["100", "101"]
    assert (mount / "svc" / "tangram-test" / "cgroup.subtree_control").read_text() == "+cpu +cpuset +memory +pids"


def test_a_kernel_without_the_controllers_is_a_clear_fallback(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(cgroups, "euid", lambda: 0)
    mount = fake_v2(tmp_path, "cpu memory")
    (mount / "cgroup.controllers").write_text("cpu io memory\n")
    assert open_root(mount, self_cgroup="0::/svc\n", tag="t") is None
    assert "offers no cpuset, pids controller" in caplog.text


def test_parsing_proc_self_cgroup():
    text = "12:pids:/a\n4:cpu,cpuacct:/b\n1:name=systemd:/c\n0::/d\n"
    own = _own_cgroups(text)
    assert own["pids"] == "/a" and own["cpu"] == "/b" and own["cpuacct"] == "/b" and own[""] == "/d"


def test_v2_cpu_time_quotas_where_the_cpu_controller_is_ours(tmp_path):
    """One-shots share the host's CPUs only where a group's CPU time can be bounded (``cpu.max``)."""
    mount = fake_v2(tmp_path)
    assert not open_root(mount, self_cgroup="0::/svc\n", tag="t").bounds_cpu_time  # no quota file: no CFS bandwidth
    (mount / "svc" / "t" / "cpu.max").write_text("max 100000\n")
    root = open_root(mount, self_cgroup="0::/svc\n", tag="t")
    assert root is not None and root.bounds_cpu_time
    g = root.create("sb")
    g.set_cpu_quota(2)
    assert (mount / "svc" / "t" / "sb" / "cpu.max").read_text() == "200000 100000"
    g.set_cpu_quota(None)
    assert (mount / "svc" / "t" / "sb" / "cpu.max").read_text() == "max 100000"
    other = fake_v2(tmp_path / "other", "cpuset memory pids")
    root = open_root(other, self_cgroup="0::/svc\n", tag="t")
    assert root is not None and not root.bounds_cpu_time


def fake_v1(tmp_path: Path, cpu: bool) -> Path:
    """A v1 layout; with ``cpu``, the cpu hierarchy with CFS bandwidth (the quota file the kernel
    makes in every group, here in the tag ``t``'s parent group)."""
    mount = tmp_path / "cg1"
    for c in cgroups.V1_CONTROLLERS + (("cpu",) if cpu else ()):
        (mount / c).mkdir(parents=True)
    if cpu:
        (mount / "cpu" / "t").mkdir()
        (mount / "cpu" / "t" / "cpu.cfs_quota_us").write_text("-1\n")
    (mount / "cpuset" / "cpuset.mems").write_text("0\n")
    (mount / "cpuset" / "cpuset.cpus").write_text("0-3\n")
    return mount


@pytest.mark.parametrize("cpu", [True, False])
def test_v1_cpu_time_quotas_need_the_cpu_hierarchy(tmp_path, cpu):
    mount = fake_v1(tmp_path, cpu)
    root = open_root(mount, self_cgroup="", tag="t")
    assert root is not None and root.bounds_cpu_time is cpu
    g = root.create("sb")
    assert (mount / "cpuset" / "t" / "sb" / "cpuset.cpus").read_text() == "0-3"
    if cpu:
        g.set_cpu_quota(1)
        d = mount / "cpu" / "t" / "sb"
        assert ((d / "cpu.cfs_period_us").read_text(), (d / "cpu.cfs_quota_us").read_text()) == ("100000", "100000")
        g.set_cpu_quota(None)
        assert (d / "cpu.cfs_quota_us").read_text() == "-1"


def test_v1_a_quota_above_an_ancestors_leaves_the_ancestors_bound(tmp_path, monkeypatch):
    """v1 refuses (EINVAL) a child's quota above its parent's, as in a container limited to fewer
    CPUs; the group then inherits the parent's quota, the tighter bound, instead of failing the run."""
    mount = fake_v1(tmp_path, cpu=True)
    root = open_root(mount, self_cgroup="", tag="t")
    g = root.create("sb")
    write = Path.write_text

    def kernel(self, text, *a, **k):
        if self.name == "cpu.cfs_quota_us" and text not in ("-1",) and int(text) > 200_000:
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", kernel)
    g.set_cpu_quota(2)
    assert (mount / "cpu" / "t" / "sb" / "cpu.cfs_quota_us").read_text() == "200000"
    g.set_cpu_quota(4)
    assert (mount / "cpu" / "t" / "sb" / "cpu.cfs_quota_us").read_text() == "-1"


def test_the_manager_raises_its_open_files_soft_limit_to_the_hard_one():
    """Awake sessions hold descriptors (pipes, the freezer's and memory's files kept open): a
    soft limit of 256 is raised to the hard limit, which stays as it was."""
    import subprocess
    import sys

    code = ("import resource; from arl_tangram.managers.sandbox.host import open_files_to_hard_limit as f;"
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (256, h));"
            "got = f(); print(got, *resource.getrlimit(resource.RLIMIT_NOFILE), h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    got, soft, hard, before = map(int, out.stdout.split())
    assert hard == before and soft == got and soft >= min(hard, 1 << 20) and soft > 256, out
