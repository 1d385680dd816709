"""One bubblewrap sandbox per submission, and the grader's end of the pipe out of it.

The sandbox (``bwrap``, Debian package ``bubblewrap``) sees:

* read-only: the system (``/usr`` and the ``/bin``, ``/lib*``, ``/sbin`` links, the few ``/etc``
  files the dynamic loader needs), the Python environment running the grader (its prefixes and
  site-packages folders, nothing else of ``sys.path``), a copy of
  ``course_lib`` made for this grading run at ``/course``, the grader's ``inside.py`` at
  ``/grader`` and this submission's job at ``/job``;
* writable: a private ``/tmp`` (a tmpfs of ``disk_bytes``; the working folder ``/tmp/work`` is
  in it) and ``/dev/shm`` (the same size);
* nothing else: not ``solutions/``, the course folder, the other submissions or the output
  folder; no network (its own network namespace, loopback only); its own PID, IPC and UTS
  namespaces (it cannot see or signal the grader, and when the sandbox ends every process in
  it dies, detached or not); a new session (no terminal injection); the root is read-only.

Namespaces do not isolate the kernel's keyrings, so a seccomp filter (:func:`seccomp_filter`)
refuses ``add_key``, ``request_key`` and every ``keyctl`` but one: joining a new, empty session
keyring, which ``inside.py`` does before anything else, so that no process of the sandbox holds
the grader's session keyring. The same filter refuses new user namespaces (``unshare`` or
``clone`` with ``CLONE_NEWUSER``; ``clone3``, whose flags a filter cannot read, answers
``ENOSYS`` and the C library falls back to ``clone``), which the sandbox never needs.

It runs as an unprivileged user with no capabilities: as root, bwrap sets the sandbox up and
``setpriv`` drops to a uid of its own, with an empty bounding set and ``no_new_privs``; as
another user, bwrap's user namespace maps it to uid 65534. Each sandbox draws a uid that no
process of the machine runs as and no earlier sandbox of the run had (:func:`fresh_uid`), so
that its process limit counts its own processes only and its per-user kernel state (the user
keyring among it) starts empty. ``inside.py`` then applies the per-process resource limits
(address space, processes, file size, CPU time) before any of the submission's code runs.

Where the grader may make cgroups (root with cgroup v1, or a delegated cgroup v2 subtree, see
:class:`Cgroups`), every sandbox also runs in a cgroup of its own: its memory limit bounds the
whole sandbox (the kernel's OOM killer acts inside it, never on a neighbour or the grader), its
process count is its own, it has an equal CPU weight, and the grader reads its CPU time, so that
time limits count CPU time where the machine is shared. Without one, the grader warns and
relies on the per-process limits and wall-clock time.

Without bubblewrap the grader refuses to run, unless told ``unsafe=True``
(``--unsafe-no-sandbox``): then the same processes run directly, with the same resource
limits and a temporary working folder, but as the instructor (see :data:`UNSAFE_WARNING`).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: The lowest uid a sandboxed process runs as when the grader runs as root (one per sandbox).
SANDBOX_UID = 1_900_000
INSIDE = Path(__file__).with_name("inside.py")


def python_executable() -> str:
    """This Python, by a path that exists in the sandbox (its folder's links resolved, so that a
    virtual environment reached through a link still finds its ``pyvenv.cfg``)."""
    folder = os.path.realpath(os.path.dirname(sys.executable))
    return os.path.join(folder, os.path.basename(sys.executable))

UNSAFE_WARNING = """\
WARNING: grading WITHOUT a sandbox (--unsafe-no-sandbox).
  Each submission's code runs as you, on this machine. It can read and change any file you can
  (solutions/, course_lib, the other submissions, the scores file, your home folder), use the
  network, signal or trace the grader, and leave processes running after it exits. The verdicts
  still come from a fresh process that imports course_lib first, and the resource limits still
  apply, but nothing stops a hostile notebook from tampering with them or with other
  submissions. Use this only for notebooks you trust; install bubblewrap to grade a class."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of each sandboxed process, and caps on what a submission may print.

    Args:
        memory_bytes: address space of each process (``RLIMIT_AS``).
        processes: processes of the sandbox's user (``RLIMIT_NPROC``).
        file_bytes: largest file a process may write (``RLIMIT_FSIZE``).
        disk_bytes: size of the private ``/tmp`` (and of ``/dev/shm``).
        cpu_seconds: CPU time of each process (``RLIMIT_CPU``); ``None``: the notebook time
            limit (``timeout``) for the notebook's kernel, the cell limit for each check.
        cell_output_bytes: output kept per cell of the notebook run; the rest is cut and noted.
        notebook_output_bytes: output kept per notebook run.
    """

    memory_bytes: int = 4 << 30
    processes: int = 256
    file_bytes: int = 64 << 20
    disk_bytes: int = 512 << 20
    cpu_seconds: int | None = None
    cell_output_bytes: int = 100_000
    notebook_output_bytes: int = 2_000_000

    def __post_init__(self):
        for name in ("memory_bytes", "processes", "file_bytes", "disk_bytes",
                     "cell_output_bytes", "notebook_output_bytes", "cpu_seconds"):
            value = getattr(self, name)
            if value is None and name == "cpu_seconds":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def find_bwrap() -> str | None:
    """The path of bubblewrap's ``bwrap`` on ``PATH``, or ``None``."""
    return shutil.which("bwrap")


def _parents(path: str) -> list[str]:
    parts = Path(path).parts
    return [str(Path(*parts[:i])) for i in range(2, len(parts))]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def environment_paths(hidden: list[Path]) -> list[str]:
    """The folders of this Python environment that the sandbox mounts read-only: its prefixes
    and its site-packages folders (never other ``sys.path`` entries, such as a checkout that
    pytest or ``PYTHONPATH`` put there).

    Raises:
        ValueError: if one of them holds one of the ``hidden`` folders (the course, the
            submissions, the output), which the sandbox must not see.
    """
    import site

    hidden = [Path(os.path.realpath(h)) for h in hidden]
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                           sys.base_exec_prefix)}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths.add(os.path.dirname(os.path.dirname(python_executable())))
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        if os.path.isdir(folder):
            paths.add(os.path.realpath(folder))
    paths = {p for p in paths if p != "/" and not p.startswith("/usr/") and p != "/usr"}
    for path in paths:
        for h in hidden:
            if _inside(h, Path(path)):
                raise ValueError(f"the Python environment at {path} contains {h}, which the "
                                 "sandbox must not see; grade from an environment outside it")
    # Keep the outermost folders only.
    return sorted(p for p in paths if not any(q != p and _inside(Path(p), Path(q))
                                              for q in paths))


class Sandbox:
    """Builds the command that runs ``inside.py`` for one submission.

    Args:
        run_dir: this grading run's folder, holding ``course/`` (the copy of ``course_lib``)
            and ``grader/inside.py``.
        hidden: folders the sandbox must not see (checked against the environment's paths).
        limits: the resource limits.
        unsafe: run without bubblewrap (see :data:`UNSAFE_WARNING`).

    Raises:
        ValueError: if bubblewrap is missing and ``unsafe`` is False, or it cannot start here.
    """

    def __init__(self, run_dir: Path, hidden: list[Path], limits: Limits, unsafe: bool = False):
        self.run_dir, self.limits, self.unsafe = Path(run_dir), limits, unsafe
        self.bwrap = None if unsafe else find_bwrap()
        self.root = hasattr(os, "geteuid") and os.geteuid() == 0
        self.env_paths = environment_paths(hidden) if not unsafe else []
        self.cgroups = Cgroups()
        self.started = 0
        self.uids_given: set[int] = set()
        self.uid_lock = threading.Lock()
        if unsafe:
            return
        if self.bwrap is None:
            raise ValueError(
                "unsafe_no_sandbox must be given to grade without bubblewrap: `bwrap` is not on "
                "PATH (Debian/Ubuntu: apt-get install bubblewrap; it exists for Linux only). "
                "Without it every submission's code would run as you, with your files.")
        self.setpriv = shutil.which("setpriv") if self.root else None
        if self.root and self.setpriv is None:
            raise ValueError("unsafe_no_sandbox must be given: running as root, the sandbox "
                             "needs `setpriv` (util-linux) to drop to an unprivileged user")
        read_fd = self._seccomp_fd()
        try:
            probe = subprocess.run(self._bwrap_args(None, read_fd) + ["true"], capture_output=True,
                                   timeout=60, pass_fds=(read_fd,))
        finally:
            os.close(read_fd)
        if probe.returncode:
            raise ValueError("unsafe_no_sandbox must be given: bubblewrap cannot start a "
                             f"sandbox here: {probe.stderr.decode(errors='replace')[-300:]}")

    @staticmethod
    def _seccomp_fd() -> int:
        """A pipe's read end holding :func:`seccomp_filter` (bwrap reads it to the end)."""
        program = seccomp_filter()
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, program)  # a few hundred bytes: the pipe's buffer holds them
        finally:
            os.close(write_fd)
        return read_fd

    def _next_uid(self) -> int:
        with self.uid_lock:  # sandboxes start from several threads
            uid = fresh_uid(used=self.uids_given)
            self.uids_given.add(uid)
        return uid

    def _bwrap_args(self, job_dir: Path | None, seccomp_fd: int) -> list[str]:
        args = [self.bwrap]
        for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(name):
                args += ["--symlink", os.readlink(name), name]
            elif os.path.isdir(name):
                args += ["--ro-bind", name, name]
        args += ["--ro-bind", "/usr", "/usr"]
        for name in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
                     "/etc/alternatives", "/etc/localtime"):
            if os.path.exists(name):
                args += ["--ro-bind", name, name]
        size = str(self.limits.disk_bytes)
        # The private /tmp first: a Python environment that lives under /tmp (a checkout
        # there) is mounted onto it below, instead of being hidden by it.
        args += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp",
                 "--perms", "1777", "--dir", "/tmp/work"]
        made = {"/usr", "/etc", "/tmp", "/tmp/work"}
        for path in self.env_paths:
            for parent in _parents(path):
                if parent not in made:
                    made.add(parent)
                    args += ["--perms", "0755", "--dir", parent]
            args += ["--ro-bind", path, path]
        args += ["--ro-bind", str(self.run_dir / "course"), "/course",
                 "--ro-bind", str(self.run_dir / "grader"), "/grader"]
        if job_dir is not None:
            args += ["--ro-bind", str(job_dir), "/job"]
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
                 "--remount-ro", "/",
                 "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--unshare-cgroup-try", "--hostname", "sandbox",
                 "--die-with-parent", "--new-session", "--chdir", "/tmp/work", "--clearenv",
                 "--seccomp", str(seccomp_fd)]
        for key, value in self.environment("/tmp/work", "/course").items():
            args += ["--setenv", key, value]
        if not self.root:
            args += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
        else:
            uid = str(self._next_uid())
            args += ["--", self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return args

    @staticmethod
    def environment(home: str, course: str) -> dict[str, str]:
        """The environment of the sandboxed processes (nothing is inherited from the grader's)."""
        bindir = os.path.dirname(python_executable())
        return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": home, "USER": "learner",
                "LOGNAME": "learner", "TMPDIR": "/tmp" if home == "/tmp/work" else home,
                "LANG": "C.UTF-8", "PYTHONPATH": course, "PYTHONDONTWRITEBYTECODE": "1",
                "COURSE_GRADER_COURSE": course, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "MPLBACKEND": "Agg", "MPLCONFIGDIR": f"{home}/.matplotlib",
                "IPYTHONDIR": f"{home}/.ipython", "JUPYTER_PLATFORM_DIRS": "1",
                "JUPYTER_RUNTIME_DIR": f"{home}/.jupyter-runtime",
                "PYDEVD_DISABLE_FILE_VALIDATION": "1"}

    def start(self, command: str, job_dir: Path, slot: int, fd: int,
              scratch: Path | None = None) -> subprocess.Popen:
        """Start ``inside.py COMMAND /job/job.json FD`` in a fresh sandbox (``scratch``: the
        working folder in unsafe mode).

        Where :class:`Cgroups` found a usable hierarchy, the sandbox runs in a cgroup of its own
        (``proc.cgroup``; None otherwise): a shell joins it, then ``exec`` turns it into bubblewrap, so
        every process of the sandbox is inside from the first one on.
        """
        self.started += 1
        cgroup = self.cgroups.make(f"course-grade-{os.getpid()}-{self.started}", self.limits)
        if self.unsafe:
            scratch = Path(scratch)
            (scratch / "work").mkdir(parents=True, exist_ok=True)
            env = self.environment(str(scratch / "work"), str(self.run_dir / "course"))
            argv = [sys.executable, "-I", str(self.run_dir / "grader" / "inside.py"), command,
                    str(job_dir / "job.json"), str(fd)]
            kwargs = {"cwd": scratch / "work"}
            passed = (fd,)
        else:
            seccomp_fd = self._seccomp_fd()
            argv = self._bwrap_args(job_dir, seccomp_fd) + [
                python_executable(), "-I", "/grader/inside.py", command, "/job/job.json", str(fd)]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            kwargs, passed = {}, (fd, seccomp_fd)
        if cgroup is not None:
            argv = ["/bin/sh", "-c", JOIN_CGROUP, "sh", *cgroup.procs_files(), "--", *argv]
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    pass_fds=passed, start_new_session=True, **kwargs)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            if not self.unsafe:
                os.close(seccomp_fd)
        proc.cgroup = cgroup  # None where no cgroup could be made
        return proc


# --- the seccomp filter ------------------------------------------------------------------------

#: Per machine: the audit architecture and the numbers of the calls the filter looks at
#: (``<asm/unistd.h>``; ``<linux/audit.h>`` for the architectures).
SYSCALLS = {
    "x86_64": (0xC000003E, {"keyctl": 250, "add_key": 248, "request_key": 249,
                            "unshare": 272, "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, {"keyctl": 219, "add_key": 217, "request_key": 218,
                             "unshare": 97, "clone": 220, "clone3": 435}),
}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_NEWUSER, _KEYCTL_JOIN_SESSION_KEYRING = 0x10000000, 1
_ARG0, _ARG1 = 16, 24  # offsetof(struct seccomp_data, args[i]); the low word first (little-endian)


def seccomp_filter(machine: str | None = None) -> bytes:
    """The sandbox's seccomp program (classic BPF, ``struct sock_filter`` array) for bubblewrap's
    ``--seccomp FD``.

    It refuses with ``EPERM``: ``add_key``, ``request_key``, every ``keyctl`` except
    ``KEYCTL_JOIN_SESSION_KEYRING`` with no name (a new, empty session keyring), and ``unshare``
    or ``clone`` asking for ``CLONE_NEWUSER``; ``clone3`` gets ``ENOSYS``, so that glibc falls
    back to ``clone``, whose flags the filter can read (as Docker's default profile does). Any
    other ABI (i386 or x32 calls on x86_64, whose numbers mean other calls) kills the process.
    Everything else is allowed: the sandbox's mounts, namespaces and limits do the rest.

    Args:
        machine: ``platform.machine()`` of the machine (the running one when None).

    Raises:
        ValueError: for a machine the filter has no numbers for.
    """
    import platform

    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise ValueError(f"machine must be one of {sorted(SYSCALLS)}, got {machine!r}")
    audit, nr = SYSCALLS[machine]

    def deny_if_newuser():  # A = the low word of the flags
        return [(_LD, 0, 0, _ARG0), (_JSET, 0, 1, _CLONE_NEWUSER),
                (_RET, 0, 0, _ERRNO | _EPERM), (_RET, 0, 0, _ALLOW)]

    join_only = [(_LD, 0, 0, _ARG0), (_JEQ, 0, 5, _KEYCTL_JOIN_SESSION_KEYRING),
                 (_LD, 0, 0, _ARG1), (_JEQ, 0, 3, 0), (_LD, 0, 0, _ARG1 + 4), (_JEQ, 0, 1, 0),
                 (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | _EPERM)]
    cases = [("keyctl", join_only), ("add_key", [(_RET, 0, 0, _ERRNO | _EPERM)]),
             ("request_key", [(_RET, 0, 0, _ERRNO | _EPERM)]),
             ("unshare", deny_if_newuser()), ("clone", deny_if_newuser()),
             ("clone3", [(_RET, 0, 0, _ERRNO | _ENOSYS)])]
    program = [(_LD, 0, 0, 4), (_JEQ, 1, 0, audit), (_RET, 0, 0, _KILL), (_LD, 0, 0, 0)]
    if machine == "x86_64":  # x32 calls: the number with bit 30 set
        program += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _KILL)]
    for name, body in cases:  # each body ends in a return; a miss jumps over it, A = nr still
        program += [(_JEQ, 0, len(body), nr[name]), *body]
    program.append((_RET, 0, 0, _ALLOW))
    return b"".join(struct.pack("=HBBI", *ins) for ins in program)


#: Joins the cgroups named before ``--`` (their cgroup.procs files), then runs what follows;
#: exit 97 if a cgroup cannot be joined, so that no sandbox runs outside its limits.
JOIN_CGROUP = ('while [ "$1" != -- ]; do echo $$ > "$1" || exit 97; shift; done; shift; '
               'exec "$@"')


# --- a cgroup per sandbox -----------------------------------------------------------------------

#: The controllers each sandbox's cgroup uses: memory for the whole sandbox, a process count,
#: a CPU weight and the CPU time it used.
CGROUP_V1 = ("memory", "pids", "cpu", "cpuacct")
CGROUP_V2 = ("memory", "pids", "cpu")
#: The CPU weight of every sandbox (cgroup v1 ``cpu.shares``; v2 ``cpu.weight`` is 100): equal
#: weights, so that a sandbox running 240 busy processes gets the CPU of one sandbox, not of 240.
CPU_SHARES = 1024


def _own_cgroup(version: str, controller: str, proc_cgroup: str) -> str | None:
    """This process's path in ``controller``'s hierarchy, read from ``/proc/self/cgroup``."""
    for line in proc_cgroup.splitlines():
        number, names, path = (line.split(":", 2) + ["", ""])[:3]
        if version == "v2" and number == "0" and names == "":
            return path
        if version == "v1" and controller in names.split(","):
            return path
    return None


class Cgroups:
    """Where this grader may make a cgroup for each sandbox, and how (cgroup v1 or v2).

    A cgroup bounds the whole sandbox, which per-process resource limits cannot: its memory
    (every process together; the kernel's OOM killer then acts inside the sandbox only), its
    process count (``pids.max``, counted per sandbox, not per uid machine-wide) and its share of
    the CPU (an equal weight per sandbox); and it tells how much CPU time the sandbox used, so
    that time limits can count CPU time on a shared machine.

    The grader needs write access to a cgroup hierarchy with these controllers: root with cgroup
    v1 (``/sys/fs/cgroup/memory``, ``pids``, ``cpu``, ``cpuacct``), or a cgroup v2 subtree with
    the memory, pids and cpu controllers delegated to it (root, or ``systemd-run --user
    --scope -p Delegate=yes``). Each grading run makes a folder of its own below the grader's
    own cgroup, and one folder per sandbox below that.

    Args:
        root (str): where the hierarchies are mounted (``/sys/fs/cgroup``; a test passes a
            folder laid out the same way).
        proc_cgroup (str, optional): the text of ``/proc/self/cgroup`` (read when None).

    Attributes:
        version (str or None): ``"v1"``, ``"v2"``, or None when no usable hierarchy was found.
        reason (str): why none is usable ("" when one is).
    """

    def __init__(self, root: str = "/sys/fs/cgroup", proc_cgroup: str | None = None):
        self.root, self.version, self.reason, self.bases = Path(root), None, "", {}
        if proc_cgroup is None:
            try:
                proc_cgroup = Path("/proc/self/cgroup").read_text()
            except OSError:
                proc_cgroup = ""
        v1 = {c: _own_cgroup("v1", c, proc_cgroup) for c in CGROUP_V1}
        if all(v1.values()) and all((self.root / c).is_dir() for c in CGROUP_V1):
            self.version = "v1"
            self.bases = {c: self.root / c / v1[c].lstrip("/") for c in CGROUP_V1}
        else:
            own = _own_cgroup("v2", "", proc_cgroup)
            unified = self.root if (self.root / "cgroup.controllers").exists() else (
                self.root / "unified")
            base = unified / own.lstrip("/") if own is not None else None
            if base is not None and (unified / "cgroup.controllers").exists():
                offered = (base / "cgroup.controllers").read_text().split() if (
                    base / "cgroup.controllers").exists() else []
                if set(CGROUP_V2) <= set(offered):
                    self.version, self.bases = "v2", {"": base}
                else:
                    self.reason = (f"the cgroup v2 subtree {base} offers {offered or 'no'} "
                                   f"controllers, not {list(CGROUP_V2)}")
            else:
                self.reason = "no cgroup v1 memory/pids/cpu/cpuacct hierarchy and no cgroup v2"
        if self.version is not None and not all(os.access(b, os.W_OK)
                                                for b in self.bases.values()):
            self.reason = f"no write access to {', '.join(map(str, self.bases.values()))}"
            self.version = None

    def make(self, name: str, limits: Limits) -> Cgroup | None:
        """A new cgroup ``name`` below the grader's own, with ``limits``; None if it fails.

        Raises nothing: a machine where the cgroup cannot be made grades with per-process
        limits (the reason is kept in :attr:`reason`).
        """
        if self.version is None:
            return None
        try:
            if self.version == "v2":
                self._delegate()
            return Cgroup(self, name, limits)
        except OSError as exc:
            self.reason = f"could not make a cgroup: {exc}"
            return None

    def _delegate(self) -> None:
        """cgroup v2: enable the controllers for the grader's children. A cgroup that holds
        processes cannot, so the grader's processes move to a leaf ``grader`` first."""
        base = self.bases[""]
        wanted = set(CGROUP_V2)
        if wanted <= set((base / "cgroup.subtree_control").read_text().split()):
            return
        leaf = base / "grader"
        leaf.mkdir(exist_ok=True)
        for pid in (base / "cgroup.procs").read_text().split():
            _write(leaf / "cgroup.procs", pid, must=False)  # one that just ended is fine
        _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in CGROUP_V2))


class Cgroup:
    """One sandbox's cgroup (made by :meth:`Cgroups.make`): limits, CPU time, removal."""

    def __init__(self, cgroups: Cgroups, name: str, limits: Limits):
        self.version = cgroups.version
        self.dirs = {c: base / name for c, base in cgroups.bases.items()}
        made = []
        try:
            for folder in self.dirs.values():
                folder.mkdir()
                made.append(folder)
            if self.version == "v1":
                _write(self.dirs["memory"] / "memory.limit_in_bytes", limits.memory_bytes)
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", limits.memory_bytes,
                       must=False)  # only with swap accounting: no escape into swap
                _write(self.dirs["pids"] / "pids.max", limits.processes)
                _write(self.dirs["cpu"] / "cpu.shares", CPU_SHARES)
            else:
                folder = self.dirs[""]
                _write(folder / "memory.max", limits.memory_bytes)
                _write(folder / "memory.swap.max", 0, must=False)
                _write(folder / "pids.max", limits.processes)
                _write(folder / "cpu.weight", 100)
        except OSError:
            for folder in reversed(made):
                _rmdir(folder)
            raise

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join this cgroup."""
        return [str(folder / "cgroup.procs") for folder in self.dirs.values()]

    def cpu_seconds(self) -> float:
        """CPU time used by every process of the sandbox so far, in seconds (0 if unreadable)."""
        try:
            if self.version == "v1":
                return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
            for line in (self.dirs[""] / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return 0.0

    def out_of_memory(self) -> bool:
        """Whether the kernel's OOM killer killed a process of this sandbox."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        folder = self.dirs["memory" if self.version == "v1" else ""]
        try:
            for line in (folder / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        folder = self.dirs["pids" if self.version == "v1" else ""]
        try:
            return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def remove(self) -> None:
        """Kill whatever is left in the cgroup, then remove it."""
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
        for folder in self.dirs.values():
            _rmdir(folder)


def _write(path: Path, value, must: bool = True) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if must:
            raise


def _rmdir(folder: Path) -> None:
    for _ in range(50):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)  # the last process is still leaving


def fresh_uid(used: set[int] | None = None) -> int:
    """A uid from :data:`SANDBOX_UID` up, below 2**31, that no process of this machine runs as
    and that is not in ``used`` (the uids this run already gave out).

    A fresh uid per sandbox: ``RLIMIT_NPROC`` counts a uid machine-wide, and the kernel keeps
    per-uid state (the user keyring) after the uid's processes end.
    """
    import secrets

    taken = set(used or ())
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if entry.name.isdigit():
            try:
                taken.add(os.stat(entry.path).st_uid)
            except OSError:
                pass
    while True:
        uid = SANDBOX_UID + secrets.randbelow(2**31 - SANDBOX_UID)
        if uid not in taken:
            return uid


def kill(proc: subprocess.Popen) -> None:
    """Kill a sandbox: bwrap's session (``--die-with-parent`` takes its PID namespace along),
    then whatever is left in its cgroup, which is removed."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            try:
                proc.kill()
            except OSError:
                pass
    proc.wait()
    cgroup = getattr(proc, "cgroup", None)
    if cgroup is not None:
        cgroup.remove()


class Channel:
    """The grader's end of the pipe from ``inside.py``: JSON lines, read with time limits.

    The read end is non-blocking and only ever waited on with ``select``, so a sandbox that
    stops writing (or stops altogether) costs at most the time limit the caller gives; a
    message longer than ``limit`` bytes ends the channel.
    """

    def __init__(self, fd: int, stderr, limit: int):
        self.fd, self.stderr, self.limit = fd, stderr, limit
        os.set_blocking(fd, False)
        if stderr is not None:
            os.set_blocking(stderr.fileno(), False)
        self.buffer, self.closed, self.overflow = b"", False, False
        self.error_tail = b""

    def _drain_stderr(self) -> None:
        try:
            while chunk := os.read(self.stderr.fileno(), 65536):
                self.error_tail = (self.error_tail + chunk)[-4000:]
        except (BlockingIOError, OSError):
            pass

    def next(self, deadline: float) -> dict | None:
        """The next message, or ``None`` at ``deadline`` (monotonic) or when the pipe closes."""
        while True:
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    return message
                continue
            if self.closed:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            watched = [self.fd] + ([self.stderr.fileno()] if self.stderr is not None else [])
            ready, _, _ = select.select(watched, [], [], min(left, 1.0))
            if self.stderr is not None and self.stderr.fileno() in ready:
                self._drain_stderr()
            if self.fd not in ready:
                continue
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                self.closed = True
                continue
            self.buffer += chunk
            if len(self.buffer) > self.limit:
                self.closed = self.overflow = True
                self.buffer = b""

    def error_text(self) -> str:
        if self.stderr is not None:
            self._drain_stderr()
        lines = self.error_tail.decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        os.close(self.fd)
        if self.stderr is not None:
            self.stderr.close()
