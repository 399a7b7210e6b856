"""The cgroup layer's logic on a v2 layout, against a directory tree shaped like cgroupfs (a test
double at the filesystem seam: this host is v1, and the v1 path is exercised by the sandbox tests)."""

from pathlib import Path

from arl_tangram.managers.sandbox.cgroups import _own_cgroups, open_root


def fake_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cg"
    (root / "svc").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "svc" / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    return root


def test_v2_root_is_made_under_our_own_cgroup_with_controllers_enabled(tmp_path):
    mount = fake_v2(tmp_path)
    root = open_root(mount, self_cgroup="0::/svc\n", tag="tangram-test")
    assert root is not None and root.v2
    parent = mount / "svc" / "tangram-test"
    assert root.dirs == {"unified": parent}
    assert (parent / "cgroup.subtree_control").read_text() == "+cpuset +memory +pids"
    g = root.create("sb1")
    assert (parent / "sb1").is_dir()
    g.set_memory(64 << 20)
    g.set_pids(32)
    g.set_cpus((3, 1))
    assert (parent / "sb1" / "memory.max").read_text() == str(64 << 20)
    assert (parent / "sb1" / "pids.max").read_text() == "32"
    assert (parent / "sb1" / "cpuset.cpus").read_text() == "1,3"
    g.freeze(True)
    assert (parent / "sb1" / "cgroup.freeze").read_text() == "1"
    (parent / "sb1" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert g.oom_kills() == 2
    (parent / "sb1" / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    assert g.cpu_seconds() == 1.5


def test_missing_controllers_mean_no_cgroups_and_a_warning(tmp_path, caplog):
    mount = fake_v2(tmp_path)
    (mount / "svc" / "cgroup.controllers").write_text("cpu io\n")
    assert open_root(mount, self_cgroup="0::/svc\n", tag="t") is None
    assert "falling back to rlimits" in caplog.text


def test_parsing_proc_self_cgroup():
    text = "12:pids:/a\n4:cpu,cpuacct:/b\n1:name=systemd:/c\n0::/d\n"
    own = _own_cgroups(text)
    assert own["pids"] == "/a" and own["cpu"] == "/b" and own["cpuacct"] == "/b" and own[""] == "/d"
