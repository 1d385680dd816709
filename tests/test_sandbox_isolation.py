"""The kernel state that namespaces do not isolate: keyrings and new user namespaces.

A probe runs in a real sandbox, started as the grader starts one, from a process that holds a
secret in its session keyring (a child of the test, so that the test's own keyring is left
alone). The probe does what ``inside.py`` does first (leave the session keyring), then tries
what a hostile submission would: find the grader's key, read its payload from the grader's
keyring, list it in ``/proc/keys``, leave a key for the next submission in its uid's user
keyring, and make a user namespace in which it is uid 0. Threads, ``fork`` and subprocesses
must still work under the filter (``clone3`` answers ``ENOSYS`` and glibc falls back).
"""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
from notebook_tools import ROOT

from course_tools import sandbox

pytestmark = pytest.mark.skipif(
    sandbox.find_bwrap() is None and not os.environ.get("COURSE_REQUIRE_SANDBOX"),
    reason="bubblewrap (bwrap) is not installed (apt-get install bubblewrap)")

PROBE = r'''
import ctypes, json, os, subprocess, sys, threading
sys.path.insert(0, "/grader")
import inside

out = {"uid": os.getuid()}
if JOIN:
    inside._own_session_keyring()
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": {"keyctl": 250, "add_key": 248, "unshare": 272},
      "aarch64": {"keyctl": 219, "add_key": 217, "unshare": 97}}[MACHINE]

def call(name, *args):
    r = libc.syscall(NR[name], *args)
    return r if r != -1 else -ctypes.get_errno()

# KEYCTL_SEARCH (10) of the session keyring (-3) for the grader's key
key = call("keyctl", 10, -3, b"user", b"course-grader-secret", 0)
out["search"] = key
# KEYCTL_READ (11) of the grader's key by its id, as /proc/keys would have told it
buf = ctypes.create_string_buffer(64)
out["read"] = call("keyctl", 11, GRADER_KEY, buf, 64)
out["payload"] = buf.value.decode(errors="replace")
out["proc_keys"] = "course-grader-secret" in open("/proc/keys").read()
# add_key into the user keyring (-4): a note for the next submission
out["add_key"] = call("add_key", b"user", b"note", b"hi", 2, -4)
out["userns"] = call("unshare", 0x10000000)
t = threading.Thread(target=out.__setitem__, args=("thread", True)); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["subprocess"] = subprocess.run([sys.executable, "-c", "print(6 * 7)"],
                                   capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
'''

# Runs in a child of the test: a session keyring of its own holding the secret, then two
# sandboxes started as the grader starts them.
GRADER = r'''
import ctypes, json, subprocess, sys
from pathlib import Path
from course_tools import sandbox

libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (250, 248), "aarch64": (219, 217)}[sys.argv[3]]
assert libc.syscall(NR[0], 1, None) > 0, "could not make a session keyring for the test"
key = libc.syscall(NR[1], b"user", b"course-grader-secret", b"s3cret", 6, -3)
assert key > 0, ctypes.get_errno()
run = Path(sys.argv[1])
box = sandbox.Sandbox(run, [run / "hidden"], sandbox.Limits())
results = []
for join in (True, False):
    code = sys.argv[2].replace("JOIN", str(join)).replace("GRADER_KEY", str(key)).replace(
        "MACHINE", repr(sys.argv[3]))
    fd = box._seccomp_fd()
    argv = box._bwrap_args(None, fd) + [sandbox.python_executable(), "-I", "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, pass_fds=(fd,), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results.append(json.loads(done.stdout))
print(json.dumps({"key": key, "probes": results}))
'''


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    if platform.machine() not in sandbox.SYSCALLS:
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    run = tmp_path_factory.mktemp("sandbox")
    for name in ("course", "grader", "hidden"):
        (run / name).mkdir()
    shutil.copy2(ROOT / "course_tools" / "inside.py", run / "grader" / "inside.py")
    done = subprocess.run([sys.executable, "-c", GRADER, str(run), PROBE, platform.machine()],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_graders_session_key_cannot_be_found_read_or_listed(probes):
    joined, plain = probes["probes"]
    EPERM = -1
    for probe in (joined, plain):  # the filter alone refuses every key operation
        assert probe["search"] == EPERM and probe["read"] == EPERM
        assert "s3cret" not in probe["payload"]
    assert not joined["proc_keys"], "the grader's key is listed in the sandbox's /proc/keys"


def test_no_key_can_be_left_for_another_submission(probes):
    for probe in probes["probes"]:
        assert probe["add_key"] == -1  # EPERM


def test_no_user_namespace_and_no_root(probes):
    for probe in probes["probes"]:
        assert probe["userns"] == -1  # EPERM
        assert probe["uid"] != 0


def test_threads_fork_and_subprocesses_still_work_under_the_filter(probes):
    for probe in probes["probes"]:
        assert probe["thread"] and probe["fork"] == 7 and probe["subprocess"] == "42"


@pytest.mark.skipif(os.geteuid() != 0, reason="uids are drawn when the grader runs as root")
def test_every_sandbox_runs_as_a_uid_of_its_own(probes):
    uids = [probe["uid"] for probe in probes["probes"]]
    assert len(set(uids)) == len(uids) and min(uids) >= sandbox.SANDBOX_UID


def test_the_filter_is_whole_instructions_and_refuses_unknown_machines():
    for machine in sandbox.SYSCALLS:
        program = sandbox.seccomp_filter(machine)
        assert len(program) % 8 == 0 and 10 < len(program) // 8 < 64
    with pytest.raises(ValueError, match="machine must be one of"):
        sandbox.seccomp_filter("sparc64")
