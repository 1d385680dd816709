"""course_tools.sandbox's cgroups: found where the grader may make them, set to the limits,
joined by the sandbox's first process, read back for CPU time, removed with what is left."""

import os
import subprocess
import sys
import time

import pytest

from course_tools import sandbox
from course_tools.sandbox import Cgroups, Limits

V1_PROC = "4:memory:/outer\n3:pids:/\n2:cpu:/\n1:cpuacct:/\n0::/\n"


def _v1_root(tmp_path):
    for controller in sandbox.CGROUP_V1:
        (tmp_path / controller / ("outer" if controller == "memory" else "")).mkdir(
            parents=True, exist_ok=True)
    return tmp_path


def test_v1_layout_is_found_below_the_graders_own_cgroup_and_limits_are_written(tmp_path):
    cgroups = Cgroups(str(_v1_root(tmp_path)), proc_cgroup=V1_PROC)
    assert cgroups.version == "v1" and cgroups.bases["memory"] == tmp_path / "memory" / "outer"
    group = cgroups.make("box-1", Limits(memory_bytes=1 << 30, processes=64))
    assert (tmp_path / "memory/outer/box-1/memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (tmp_path / "pids/box-1/pids.max").read_text() == "64"
    assert (tmp_path / "cpu/box-1/cpu.shares").read_text() == str(sandbox.CPU_SHARES)
    assert group.procs_files()[0].endswith("memory/outer/box-1/cgroup.procs")
    (tmp_path / "cpuacct/box-1/cpuacct.usage").write_text("2500000000")
    assert group.cpu_seconds() == 2.5
    (tmp_path / "memory/outer/box-1/memory.oom_control").write_text("oom_kill_disable 0\n"
                                                                   "oom_kill 1\n")
    assert group.out_of_memory()


def test_v2_layout_delegates_then_writes_its_limits(tmp_path):
    base = tmp_path / "user.slice" / "grader.scope"
    base.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids io")
    (base / "cgroup.controllers").write_text("cpu memory pids")
    (base / "cgroup.subtree_control").write_text("")
    (base / "cgroup.procs").write_text("4242\n")
    cgroups = Cgroups(str(tmp_path), proc_cgroup="0::/user.slice/grader.scope\n")
    assert cgroups.version == "v2"
    group = cgroups.make("box-1", Limits(memory_bytes=1 << 30, processes=64))
    assert (base / "grader" / "cgroup.procs").read_text() == "4242"  # moved to a leaf
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (base / "box-1" / "memory.max").read_text() == str(1 << 30)
    assert (base / "box-1" / "pids.max").read_text() == "64"
    (base / "box-1" / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1\n")
    assert group.cpu_seconds() == 1.5


def test_no_usable_hierarchy_is_reported_not_raised(tmp_path):
    cgroups = Cgroups(str(tmp_path), proc_cgroup="0::/\n")
    assert cgroups.version is None and cgroups.reason
    assert cgroups.make("box", Limits()) is None
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    (tmp_path / "cgroup.controllers").chmod(0o444)
    only_io = Cgroups(str(tmp_path), proc_cgroup="0::/sub\n")
    assert only_io.version is None and "controllers" in only_io.reason


def test_fresh_uids_avoid_uids_in_use_and_given_out(monkeypatch):
    uid = sandbox.fresh_uid(used=set())
    assert sandbox.SANDBOX_UID <= uid < 2**31
    drawn = iter([5, 5, 9])  # the first two land on a uid already given out
    monkeypatch.setattr("secrets.randbelow", lambda n: next(drawn))
    assert sandbox.fresh_uid(used={sandbox.SANDBOX_UID + 5}) == sandbox.SANDBOX_UID + 9


REAL = Cgroups()
needs_cgroups = pytest.mark.skipif(
    REAL.version is None and not os.environ.get("COURSE_REQUIRE_SANDBOX"),
    reason=f"no cgroup this process may make: {REAL.reason}")


@needs_cgroups
def test_a_real_cgroup_holds_the_sandbox_bounds_its_memory_and_is_removed():
    group = REAL.make(f"course-test-{os.getpid()}", Limits(memory_bytes=256 << 20, processes=16))
    assert group is not None, REAL.reason
    hog = ("import os, time\n"
           "kids = [os.fork() for _ in range(2)]\n"   # 4 processes, each trying 200 MiB
           "x = bytearray(200 << 20)\n"
           "for i in range(0, len(x), 4096): x[i] = 1\n"
           "time.sleep(30)\n")
    argv = ["/bin/sh", "-c", sandbox.JOIN_CGROUP, "sh", *group.procs_files(), "--",
            sys.executable, "-c", hog]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        end = time.monotonic() + 20
        while not group.out_of_memory() and time.monotonic() < end:
            time.sleep(0.1)
        assert group.out_of_memory()  # 800 MiB asked for, 256 MiB allowed: killed inside
        assert proc.pid in group.pids() or proc.poll() is not None
        assert group.cpu_seconds() > 0
    finally:
        proc.kill()
        proc.wait()
        group.remove()
    assert all(not os.path.exists(os.path.dirname(f)) for f in group.procs_files())
