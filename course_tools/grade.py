"""Grade a folder of submitted exercise notebooks, each in a sandbox of its own.

Command line (an instructor's tool, run from a checkout of the course)::

    python -m course_tools.grade DIR --course COURSE [--out scores.csv] [--assignment NAME]
        [--timeout 600] [--cell-timeout 120] [--jobs 1] [--executed FOLDER]
        [--memory 4G] [--processes 256] [--file-size 64M] [--disk 512M] [--cpu-time S]
        [--cell-output 100k] [--notebook-output 2M] [--grade-unmatched] [--unsafe-no-sandbox]

A submitted notebook is untrusted code. For every ``*.ipynb`` under ``DIR`` (regular files
only: links are refused; ``.ipynb_checkpoints`` is skipped):

1. **Match** it with a notebook of ``COURSE/solutions`` (``--assignment NAME``: that one for
   every submission; else the one its metadata says it was generated from, else the one with
   its file name, else the one whose released cells it holds most of). The checks, their names and
   their points come from that solutions notebook only. A submission that nothing matches
   scores 0, with the reason, unless ``--grade-unmatched`` is given: then it is graded as the
   assignment whose checks its own check cells call most, on all of that assignment's checks
   at their points (:func:`graded_as`), each called with the arguments solutions/ gives it
   (never the notebook's own; the verdicts still come from the sandbox).
2. **Run** the notebook, its check cells restored as released, in a fresh kernel inside a
   sandbox (see :mod:`course_tools.sandbox`), with a limit per cell (``--cell-timeout``: the
   kernel is interrupted), per notebook (``--timeout``), and on the output kept. This run only
   tells the learner how their notebook ran (``--executed`` saves it): no point depends on it.
3. **Judge** in a second, fresh sandbox: a process imports the pristine ``course_lib`` copy,
   then starts the learner's process, which runs the notebook's cells once, as Jupyter does (an
   IPython shell, in order, magics included, a cell's error not stopping the next; the check
   calls left out), and forks, before each check's cell, a process holding the names that cell
   saw. Each check runs in a *checker* process of its own, where no learner code has run, and
   calls the learner's functions in that process over a socket, accepting only plain values
   back (:mod:`course_tools.ipc`). A check that passed then tries cases drawn at grading time
   (:mod:`course_tools.hidden`). Each verdict is sent over a pipe the grader opened. The cells
   get ``--timeout`` seconds (each ``--cell-timeout``), a check ``--cell-timeout`` seconds: CPU
   seconds, with a wall-clock backstop of :data:`WALL_BACKSTOP` times the limit. Nothing the
   notebook prints, and no file it writes, is read as a verdict.
4. **Score** each check: its points if it passed, else 0 with the reason (failed, not done,
   error, timeout, crashed, not run).

The CSV has one row per submission: ``submission``, ``notebook``, a column of points per check,
``total``, ``max``, ``seconds``, ``notes``; cells that a spreadsheet would read as a formula are
escaped. Exit status: 0, or 2 for a usage error (bubblewrap missing included).

What remains trusted: where a check watches the learner's code run inside torch (hooks,
kept bytes, ``gc`` calls), a measure function runs next to that code, in the learner's process,
and its plain results are that process's word; the values the checker verifies itself
(gradients, weights, losses, answers to drawn cases) are not. Nothing a submission does reaches
another submission, the grader, the course or the output.
"""

from __future__ import annotations

import argparse
import ast
import compileall
import copy
import csv
import hashlib
import json
import math
import os
import queue
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from . import authoring
from .sandbox import UNSAFE_WARNING, Channel, Limits, Sandbox, kill

#: Seconds a cell may run past its limit after the interrupt before its sandbox is killed
#: (nbclient waits for the reply, then up to 4 s for the kernel's last output).
INTERRUPT_GRACE = 10.0
#: Seconds a sandbox may take to start its first process (import the course, start a kernel).
STARTUP = 120.0
#: With a cgroup, time limits count the sandbox's CPU seconds, so that a machine shared with
#: other sandboxes or other work does not make an honest check run out of time; a sandbox that
#: sleeps or waits (using no CPU) is stopped at this many times its limit in wall-clock time.
WALL_BACKSTOP = 3.0
NO_CGROUP_WARNING = """\
WARNING: no cgroup for the sandboxes ({}).
  Each process is still limited (memory, processes, file size, CPU time), but not the sandbox as
  a whole: many processes of one submission together can use more memory than --memory, crowd
  the CPU of its neighbours, and time limits count wall-clock time. Grade as root (cgroup v1) or
  in a delegated cgroup v2 subtree (systemd-run --user --scope -p Delegate=yes ...)."""
#: Submissions larger than this are not read.
MAX_NOTEBOOK_BYTES = 32 << 20
#: Characters of a check's message kept in the notes.
MESSAGE_CHARS = 300
#: Column names of the CSV that a check cannot take (``course_lib.grading.RESERVED`` too).
RESERVED = ("submission", "notebook", "total", "max", "seconds", "notes")
#: What a check can end as.
STATUSES = ("passed", "failed", "not done", "error", "timeout", "crashed", "not run")
#: The cases the grader draws when it grades (read by the check process, never by the learner's).
DRAWN_CASES = Path(__file__).with_name("hidden.py")
CHECK_CALL = re.compile(r"\bgrading\.check_(\w+)\(")
TOP_LEVEL_DEF = re.compile(r"^(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)", re.M)


@dataclass
class CheckResult:
    """The score of one check of one submission."""

    name: str            # the check, without "check_" ("tensor_nbytes")
    grade_id: str        # nbgrader's id of the check cell in solutions/
    max_points: float
    points: float = 0.0
    status: str = "not run"
    detail: str = ""


@dataclass
class Submission:
    """All checks of one submitted notebook."""

    path: str                       # relative to the graded folder
    notebook: str                   # the solutions notebook it was graded against, or ""
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    problem: str = ""               # why it could not be graded at all
    run_notes: list[str] = field(default_factory=list)  # how the notebook's own run went

    @property
    def total(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def max_points(self) -> float:
        return sum(c.max_points for c in self.checks)

    @property
    def notes(self) -> str:
        parts = [self.problem] if self.problem else []
        parts += [f"{c.name}: {c.status}" + (f" ({c.detail})" if c.detail else "")
                  for c in self.checks if c.status != "passed"]
        parts += [f"run: {note}" for note in self.run_notes]
        return "; ".join(parts)


# --- what solutions/ expects ------------------------------------------------------------------


@dataclass
class Expected:
    """A check of a solutions notebook: the call to make, its points, the released cell."""

    name: str
    grade_id: str
    points: float
    args: list[str]       # the argument expressions of the check call
    visible: str          # the check cell as released in exercises/


@dataclass
class Assignment:
    """What grading against one solutions notebook needs."""

    name: str
    checks: list[Expected]
    solution_ids: set[str]      # grade ids of the exercise cells
    solution_defs: set[str]     # names the exercise cells define
    released: set[str] = field(default_factory=set)  # the exercise's cells, normalised


def _call_of(source: str) -> tuple[str, list[str]] | None:
    """``(name, [argument source])`` of the first visible ``grading.check_NAME(...)`` call."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("check_")):
            quiet = any(k.arg == "quiet" for k in node.keywords)
            calls.append((quiet, node.func.attr.removeprefix("check_"),
                          [ast.unparse(a) for a in node.args]))
    calls.sort(key=lambda c: c[0])  # a visible call first
    return (calls[0][1], calls[0][2]) if calls else None


def load_assignment(path: Path) -> Assignment:
    """Read a solutions notebook: its checks (name, points, arguments) and exercise cells.

    Raises:
        authoring.AuthoringError: if the notebook breaks the marker rules or a check's points
            are not a finite number >= 0.
    """
    solution = nbformat.read(path, as_version=4)
    authoring.stamp_solution(solution)  # ids of cells an author has not stamped yet, in memory
    exercise = authoring.make_exercise(solution, path.name)
    checks, ids, defs = [], set(), set()
    for index, (sol, ex) in enumerate(zip(solution.cells, exercise.cells)):
        kind = authoring.cell_kind(sol)
        if kind == "solution":
            ids.add(sol.metadata["nbgrader"]["grade_id"])
            defs |= {n.name for n in ast.parse(sol.source).body
                     if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        elif kind == "check":
            call = _call_of(sol.source)
            if call is None:
                continue
            checks.append(Expected(call[0], sol.metadata["nbgrader"]["grade_id"],
                                   authoring.check_points(sol, f"{path.name} cell {index}"),
                                   call[1], ex.source))
    released = {_norm(c.source) for c in exercise.cells if _norm(c.source)}
    return Assignment(path.name, checks, ids, defs, released)


def _norm(source) -> str:
    if not isinstance(source, str):
        return ""
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def check_names(course_lib: Path) -> set[str]:
    """Names of the checks ``course_lib/grading`` defines (read from the source, not imported)."""
    names = set()
    for path in sorted((course_lib / "grading").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("check_"):
                names.add(node.name.removeprefix("check_"))
    return names


def _grade_id(cell) -> str | None:
    meta = cell.get("metadata", {}).get("nbgrader")
    value = meta.get("grade_id") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def match(nb, filename: str, assignments: dict[str, Assignment]) -> tuple[str | None, str]:
    """The solutions notebook a submission is graded against, and a note (or why none)."""
    course = nb.metadata.get("course")
    generated = course.get("generated_from") if isinstance(course, dict) else None
    named = Path(generated).name if isinstance(generated, str) else ""
    by_name = {name.casefold(): name for name in assignments}  # 00_setup.IPYNB is 00_setup.ipynb
    filed = by_name.get(filename.casefold())
    if named in assignments:
        note = (f"file name {filename!r} differs from its notebook {named!r}"
                if filed is not None and filed != named else "")
        return named, note
    if filed is not None:
        return filed, ""
    # Else by its cells: how many are word for word as released (titles, text, stubs, checks).
    mine = {_norm(c.source) for c in nb.cells} - {""}
    scores = {name: len(mine & a.released) for name, a in assignments.items()}
    ranked = sorted(scores.values(), reverse=True) + [0, 0]
    if ranked[0] >= 3 and ranked[0] > 2 * ranked[1]:
        return max(scores, key=scores.get), ""
    return None, ("no notebook of solutions/ matches it (not by its metadata, its file name or "
                  "its cells): scored 0; grade it with --assignment NAME")


# --- the jobs for the sandbox -----------------------------------------------------------------


def _is_exercise_cell(cell, assignment: Assignment | None) -> bool:
    if assignment is None:
        meta = cell.metadata.get("nbgrader")
        return isinstance(meta, dict) and meta.get("solution") is True
    if _grade_id(cell) in assignment.solution_ids:
        return True
    # The grader never parses a submission's code as Python: a line-start definition will do.
    defined = set(TOP_LEVEL_DEF.findall(cell.source))
    return bool(defined & assignment.solution_defs)


def _notebook_to_run(nb, assignment: Assignment | None):
    """The learner's notebook, outputs cleared, its check cells restored as released."""
    run = copy.deepcopy(nb)
    by_id = {c.grade_id: c for c in assignment.checks} if assignment else {}
    by_name = {c.name: c for c in assignment.checks} if assignment else {}
    for cell in run.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        expected = by_id.get(_grade_id(cell))
        if expected is None and authoring.cell_kind(cell) == "check":
            found = CHECK_CALL.search(cell.source)
            expected = by_name.get(found.group(1)) if found else None
        if expected is not None:
            cell.source = expected.visible
    return run


def _read_submission(path: Path):
    """The notebook at ``path``, read without following links or blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_NOTEBOOK_BYTES:
            raise ValueError(f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_NOTEBOOK_BYTES + 1)
    finally:
        os.close(fd)
    nb = nbformat.reads(data.decode("utf-8"), as_version=4)
    if not isinstance(nb.get("cells"), list) or not isinstance(nb.get("metadata"), dict):
        raise ValueError("no cells")
    for cell in nb.cells:
        if not isinstance(cell.get("source"), str) or not isinstance(cell.get("metadata"), dict):
            raise ValueError("a cell without source or metadata")
    return nb


# --- one grading run --------------------------------------------------------------------------


class _Deadline:
    """A time limit of one sandbox: its cgroup's CPU seconds where it has a cgroup (load from
    elsewhere does not count), with a wall-clock backstop of :data:`WALL_BACKSTOP` times the
    limit; wall-clock seconds where it has none, unless ``counted``: the sandbox counts its own
    CPU time (the judge does), and gets the backstop. ``grace``, the time an interrupted cell
    gets to answer, is added once to both limits: the backstop does not multiply it."""

    def __init__(self, proc, seconds: float, grace: float = 0.0, counted: bool = False):
        self.cgroup = getattr(proc, "cgroup", None)
        self.seconds, self.start_wall = seconds + grace, time.monotonic()
        self.start_cpu = self.cgroup.cpu_seconds() if self.cgroup is not None else 0.0
        backstop = self.cgroup is not None or counted
        self.wall = self.start_wall + seconds * (WALL_BACKSTOP if backstop else 1) + grace

    def expired(self) -> bool:
        if time.monotonic() >= self.wall:
            return True
        return (self.cgroup is not None
                and self.cgroup.cpu_seconds() - self.start_cpu >= self.seconds)


def _next(channel: Channel, *deadlines: _Deadline, tick=None) -> dict | None:
    """The sandbox's next message, or None once the pipe closes or any deadline has passed;
    ``tick()`` is called at least every half second while waiting."""
    while True:
        wake = min([time.monotonic() + 0.5] + [d.wall for d in deadlines])
        if tick is not None:
            tick()
        message = channel.next(wake)
        if message is not None or channel.closed or any(d.expired() for d in deadlines):
            return message


class _Run:
    """The state of one ``grade()`` call: the sandbox, the course copy, the assignments."""

    def __init__(self, course: Path, hidden: list[Path], limits: Limits, unsafe: bool,
                 timeout: float, cell_timeout: float):
        self.course, self.limits = course, limits
        self.timeout, self.cell_timeout = timeout, cell_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="course_grade_"))
        try:
            os.chmod(self.dir, 0o755)
            shutil.copytree(course / "course_lib", self.dir / "course" / "course_lib",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            compileall.compile_dir(self.dir / "course", quiet=2)
            (self.dir / "grader").mkdir()
            for name in ("inside.py", "ipc.py"):
                shutil.copy2(Path(__file__).with_name(name), self.dir / "grader" / name)
            for path in (self.dir / "course", self.dir / "grader"):
                for p in [path, *path.rglob("*")]:
                    os.chmod(p, 0o755 if p.is_dir() else 0o644)
            self.course_hash = _tree_hash(self.dir / "course")
            self.check_names = check_names(self.dir / "course" / "course_lib")
            self.sandbox = Sandbox(self.dir, hidden, limits, unsafe)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.slots: queue.Queue[int] = queue.Queue()
        self.jobs = 0
        #: The arguments solutions/ gives each check (``--grade-unmatched`` uses these only).
        self.canonical: dict[str, list[str]] = {}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _job_dir(self, job: dict, notebook=None, drawn: Path | None = None) -> Path:
        self.jobs += 1
        path = Path(tempfile.mkdtemp(prefix="job", dir=self.dir))
        os.chmod(path, 0o755)
        (path / "job.json").write_text(json.dumps(job))
        if drawn is not None:
            shutil.copyfile(drawn, path / "drawn.py")
        if notebook is not None:
            nbformat.write(notebook, path / "notebook.ipynb")
        for p in path.iterdir():
            os.chmod(p, 0o644)
        return path

    def _phase(self, command: str, job: dict, notebook, slot: int, limit: int,
               drawn: Path | None = None):
        """Start ``inside.py COMMAND`` in a fresh sandbox; return (process, channel, job dir)."""
        unsafe = self.sandbox.unsafe
        job_dir = self._job_dir(job, notebook, drawn)
        if notebook is not None:
            job["notebook"] = str(job_dir / "notebook.ipynb") if unsafe else "/job/notebook.ipynb"
            (job_dir / "job.json").write_text(json.dumps(job))
        read_fd, write_fd = os.pipe()
        try:
            proc = self.sandbox.start(command, job_dir, slot, write_fd,
                                      scratch=job_dir / "scratch" if unsafe else None)
        finally:
            os.close(write_fd)
        return proc, Channel(read_fd, proc.stderr, limit), job_dir

    def run_notebook(self, nb, slot: int) -> tuple[list[str], str | None]:
        """Run the notebook in a sandbox; return notes on how it went and the executed notebook."""
        cpu = self.limits.cpu_seconds or int(self.timeout) + 1
        job = {"limits": self._limits(cpu), "cell_timeout": self.cell_timeout,
               "cell_output_bytes": self.limits.cell_output_bytes,
               "notebook_output_bytes": self.limits.notebook_output_bytes,
               "notebook_bytes": MAX_NOTEBOOK_BYTES}
        proc, channel, job_dir = self._phase(
            "run", job, nb, slot, MAX_NOTEBOOK_BYTES + self.limits.notebook_output_bytes * 2)
        deadline = _Deadline(proc, self.timeout)
        cell_deadline = _Deadline(proc, STARTUP)
        notes, executed, current, finished = [], None, None, False
        timed_out, cut = [], []
        try:
            while True:
                message = _next(channel, deadline, cell_deadline)
                if message is None:
                    if channel.overflow:
                        notes.append("it sent more than the grader reads: stopped")
                    elif channel.closed:
                        if not finished:
                            why = channel.error_text()
                            notes.append("the notebook run ended early" + (
                                f" at cell {current}" if current is not None else "")
                                + (f" ({why})" if why else ""))
                    elif deadline.expired():
                        notes.append(f"stopped at the notebook time limit ({self.timeout:g} s)"
                                     + (f" in cell {current}" if current is not None else ""))
                    elif current is not None:
                        notes.append(f"stopped at cell {current}: no answer within the cell "
                                     "time limit and the interrupt's grace")
                    else:
                        notes.append("the kernel did not start")
                    break
                event = message.get("event")
                index = message.get("index") if isinstance(message.get("index"), int) else None
                if event == "ready":
                    cell_deadline = deadline
                elif event == "cell":
                    current = index
                    cell_deadline = _Deadline(proc, self.cell_timeout, INTERRUPT_GRACE)
                elif event == "cell_done":
                    current, cell_deadline = None, deadline
                    if message.get("timed_out") is True:
                        timed_out.append(index)
                    if message.get("cut") is True:
                        cut.append(index)
                elif event == "dead":
                    notes.append(f"the kernel died in cell {index}")
                elif event == "notebook" and isinstance(message.get("text"), str):
                    executed = message["text"]
                elif event == "end":
                    finished = True
                    cut += [i for i in message.get("cut", []) if isinstance(i, int)]
                    break
                elif event == "failed":
                    notes.append(f"the notebook could not be run ({str(message.get('detail'))[:200]})")
        finally:
            out_of_memory = proc.cgroup is not None and proc.cgroup.out_of_memory()
            kill(proc)
            channel.close()
            shutil.rmtree(job_dir, ignore_errors=True)
        if out_of_memory:
            notes.append(f"the sandbox ran out of memory ({self.limits.memory_bytes:,} bytes for "
                         "all its processes): the kernel killed one of them")
        if timed_out:
            notes.insert(0, f"cells {_cells(timed_out)} interrupted at the cell time limit")
        if cut:
            notes.append(f"output cut in cells {_cells(cut)}")
        return notes, executed

    def judge(self, cells: list[dict], checks: list[dict] | None, slot: int):
        """Run the checks in a sandbox; return ``{id: (status, detail)}``, the checks, a problem."""
        job = {"limits": self._limits(self.limits.cpu_seconds), "cells": cells,
               "checks": checks or [], "discover": checks is None,
               "canonical": self.canonical, "cell_timeout": self.cell_timeout,
               "timeout": self.timeout, "wall_backstop": WALL_BACKSTOP,
               "message_chars": MESSAGE_CHARS}
        proc, channel, job_dir = self._phase("judge", job, None, slot, 1 << 20,
                                             drawn=DRAWN_CASES)
        results, problem = {}, ""
        deadline = _Deadline(proc, STARTUP)
        try:
            while True:
                message = _next(channel, deadline, tick=lambda: _continue(proc))
                if message is None:
                    why = channel.error_text()
                    if proc.cgroup is not None and proc.cgroup.out_of_memory():
                        why = f"out of the sandbox's memory ({self.limits.memory_bytes:,} bytes)"
                    problem = ("the check process stopped answering" if not channel.closed
                               else "the check process ended early") + (f" ({why})" if why else "")
                    break
                event = message.get("event")
                if event == "ready":  # the judge holds the drawn cases open: no file is left
                    (job_dir / "drawn.py").unlink(missing_ok=True)
                if event == "checks" and checks is None:
                    checks = self._discovered(message.get("checks"))
                elif event == "check" and isinstance(message.get("id"), str):
                    status = message.get("status")
                    detail = message.get("detail")
                    results[message["id"]] = (status if status in STATUSES else "error",
                                              detail[:MESSAGE_CHARS] if isinstance(detail, str)
                                              else "")
                elif event == "failed":
                    problem = f"the checks could not run ({str(message.get('detail'))[:200]})"
                    break
                elif event == "end":
                    break
                if event == "program":  # the learner's cells, once, within --timeout
                    deadline = _Deadline(proc, self.timeout, INTERRUPT_GRACE, counted=True)
                elif event in ("ready", "check", "checks", "program_done"):
                    deadline = _Deadline(proc, self.cell_timeout, INTERRUPT_GRACE, counted=True)
        finally:
            kill(proc)
            channel.close()
            shutil.rmtree(job_dir, ignore_errors=True)
        return results, checks or [], problem

    def _discovered(self, found) -> list[dict]:
        checks = []
        for item in found if isinstance(found, list) else []:
            if (isinstance(item, dict) and item.get("name") in self.check_names
                    and item["name"] in self.canonical
                    and item["name"] not in {c["name"] for c in checks}):
                checks.append({"id": f"cell-check-{item['name']}", "name": item["name"],
                               "args": list(self.canonical[item["name"]])})
        return checks[:100]

    def _limits(self, cpu: int | None) -> dict:
        return {"memory_bytes": self.limits.memory_bytes, "processes": self.limits.processes,
                "file_bytes": self.limits.file_bytes, "cpu_seconds": cpu}

    def verify_course_copy(self) -> None:
        if _tree_hash(self.dir / "course") != self.course_hash:
            raise RuntimeError("the grading run's copy of course_lib changed while a submission "
                               "ran: the sandbox failed; stopping")


def _continue(proc) -> None:
    """SIGCONT to every process of a sandbox: the learner's code, running as the judge's user,
    can stop the judge, which would then wait for the backstop instead of answering."""
    cgroup = getattr(proc, "cgroup", None)
    for pid in cgroup.pids() if cgroup is not None else _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux's ``/proc/PID/task/TID/children``; none elsewhere)."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(p) for p in f.read().split()]
                found += children
                stack += children
        except (OSError, ValueError):
            continue
    return found


def _cells(indices) -> str:
    return ", ".join(str(i) for i in sorted(set(indices)))


def _tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def grade_notebook(path: Path, root: Path, run: _Run, assignments: dict[str, Assignment], *,
                   assignment: str | None, grade_unmatched: bool, slot: int,
                   executed: Path | None) -> Submission:
    """Grade one submitted notebook (it is only read); see the module docstring."""
    start = time.monotonic()
    sub = Submission(path=str(path.relative_to(root)), notebook="")
    try:
        nb = _read_submission(path)
    except Exception as exc:  # not a notebook at all, a link, a FIFO...
        sub.problem = f"unreadable notebook: {type(exc).__name__}: {exc}"[:300]
        return sub
    name, note = (assignment, "") if assignment else match(nb, path.name, assignments)
    if name is None and not grade_unmatched:
        sub.problem = note
        return sub
    chosen = assignments.get(name) if name else None
    sub.notebook = name or ""
    if note and chosen is not None:
        sub.run_notes.append(note)
    if chosen is not None and not chosen.checks:
        sub.problem = f"{name} has no check cells"
        return sub
    sub.run_notes += _run_and_save(run, nb, chosen, slot, executed, sub.path)
    cells = [{"source": c.source, "full": _is_exercise_cell(c, chosen), "id": _grade_id(c)}
             for c in nb.cells if c.cell_type == "code"]
    checks = None if chosen is None else [
        {"id": c.grade_id, "name": c.name, "args": c.args} for c in chosen.checks]
    results, checks, problem = run.judge(cells, checks, slot)
    if chosen is None:
        sub.notebook, sub.checks, sub.problem = graded_as(checks, assignments)
    else:
        sub.checks = [CheckResult(c.name, c.grade_id, c.points) for c in chosen.checks]
    if problem:
        sub.problem = "; ".join(p for p in (sub.problem, problem) if p)
    for result in sub.checks:
        status, detail = results.get(result.grade_id, ("not run", result.detail))
        result.status, result.detail = status, detail
        result.points = result.max_points if status == "passed" else 0.0
    sub.seconds = round(time.monotonic() - start, 1)
    return sub


def graded_as(called: list[dict], assignments: dict[str, Assignment]):
    """``(assignment, its checks, the row's note)`` for a notebook that ``solutions/`` cannot
    match, graded with ``--grade-unmatched``: the assignment whose checks its cells call most
    (the first by name on a tie), scored on all of that assignment's checks at their points, a
    check its cells do not call scoring 0; the checks of other assignments it calls are not
    graded. So a notebook scores against one assignment's maximum, which its row names, and
    another lecture's exercise cannot add to it.

    Args:
        called: the checks the judge found in its cells (``{"id", "name", ...}``).
        assignments: the notebooks of ``solutions/``, by name.
    """
    ids = {c["name"]: c["id"] for c in called}
    counts = {name: sum(c.name in ids for c in a.checks) for name, a in assignments.items()}
    best = max(sorted(counts), key=counts.get, default=None)
    if best is None or counts[best] == 0:
        return "", [], "not matched with solutions/, and its cells call no check of it: scored 0"
    checks = [CheckResult(c.name, ids.get(c.name, c.grade_id), c.points,
                          detail="" if c.name in ids else "no cell of the notebook calls it")
              for c in assignments[best].checks]
    return best, checks, (f"not matched with solutions/: graded as {best}, whose checks its cells "
                          f"call ({counts[best]} of {len(checks)})")


def _run_and_save(run: _Run, nb, chosen, slot, executed: Path | None, relpath: str) -> list[str]:
    notes, text = run.run_notebook(_notebook_to_run(nb, chosen), slot)
    if executed is not None:
        target = executed / relpath
        if text is None:
            notes.append("no executed notebook came back")
        else:
            _replace_file(target, lambda f: f.write(_text(inert_notebook(text))))
    return notes


#: Output formats a browser runs or renders as markup: an executed notebook returned to
#: learners carries none of them (``nbconvert --to html`` would keep a learner's ``<script>``).
ACTIVE_OUTPUTS = ("text/html", "application/javascript", "text/javascript", "image/svg+xml",
                  "text/markdown", "text/latex", "application/vnd.jupyter.widget-view+json",
                  "application/vnd.jupyter.widget-state+json")
REMOVED_NOTE = "[{} output removed by the grader: only text and images are returned]"
#: A URL scheme that a browser runs or opens as a page of its own (``javascript:``,
#: ``vbscript:``, ``data:``), in any case, with what a browser or Markdown drops inside it
#: (tabs, line breaks, a backslash escape before the colon).
ACTIVE_SCHEME = re.compile("(" + "|".join(r"[\t\n\r]*".join(word) for word in (
    "javascript", "vbscript", "data")) + r")([\t\n\r\\]*:)", re.IGNORECASE)


def inert_notebook(text: str) -> str:
    """An executed notebook without active content, for returning to learners.

    Rich outputs that a browser would run or render as markup (:data:`ACTIVE_OUTPUTS`) are
    removed, each leaving a ``text/plain`` note where nothing else was left; the widget state
    is dropped; raw cells become markdown; and markdown cells' HTML tags are escaped, so that a
    ``<script>`` or an ``onerror`` handler shows as text in JupyterLab and in
    ``nbconvert --to html`` alike. A zero-width space follows every ``&`` that could start an
    entity (Markdown renderers decode those in links, some twice) and precedes the colon of every
    :data:`ACTIVE_SCHEME`, which leaves such a link a harmless relative one. Text, PNG and JPEG
    outputs stay.

    Args:
        text: the executed notebook's JSON.

    Returns:
        The cleaned notebook's JSON (the input unchanged if it does not parse: it is then not
        a notebook any tool renders).
    """
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception:  # noqa: BLE001 - a broken notebook is returned as it came
        return text
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "raw":
            cell.cell_type = "markdown"
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
        if cell.cell_type == "markdown":
            # An entity must not survive even a renderer that decodes links twice.
            source = re.sub("&([#A-Za-z]?)", lambda m: "&amp;" + "\u200b" * bool(m[1]) + m[1],
                            cell.source).replace("<", "&lt;")
            cell.source = ACTIVE_SCHEME.sub("\\1\u200b\\2", source)
            cell.pop("attachments", None)
            continue
        for output in cell.get("outputs", []):
            data = output.get("data")
            if not isinstance(data, dict):
                continue
            removed = [mime for mime in list(data) if mime in ACTIVE_OUTPUTS
                       or not (mime.startswith("text/plain") or mime in ("image/png",
                                                                         "image/jpeg"))]
            for mime in removed:
                del data[mime]
            if removed and not data:
                data["text/plain"] = REMOVED_NOTE.format(", ".join(removed))
            output.get("metadata", {}).clear()
    return nbformat.writes(nb)


def _is_notebook_name(path: Path) -> bool:
    """Whether ``path`` names a notebook: ``.ipynb`` in any case (``00_setup.IPYNB`` too)."""
    return Path(path).suffix.lower() == ".ipynb"


#: The row of a submitted file that is not a notebook.
NOT_A_NOTEBOOK = "not graded: not a notebook (only .ipynb files are graded)"


def find_notebooks(root: Path) -> list[Path]:
    """Every file under ``root`` (or ``root`` itself), Jupyter's checkpoints excluded, sorted.

    Each gets a row of the scores: a notebook (:func:`_is_notebook_name`) is graded, any other
    file is listed with :data:`NOT_A_NOTEBOOK`, so that nothing a learner handed in goes
    unmentioned, except the hidden files an operating system leaves (``.DS_Store``, ``._*``) and
    ``Thumbs.db``. Symbolic links are listed too (and refused when read), never followed into
    folders.
    """
    root = Path(root)
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints")
        found += [Path(folder) / f for f in files if _is_notebook_name(f) or not (
            f.startswith(".") or f in ("Thumbs.db", "desktop.ini"))]
    return sorted(found)


def _positive(name: str, value) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def grade(folder, *, course, assignment: str | None = None, timeout: float = 600.0,
          cell_timeout: float = 120.0, jobs: int = 1, limits: Limits | None = None,
          executed=None, grade_unmatched: bool = False,
          unsafe_no_sandbox: bool = False) -> list[Submission]:
    """Grade every notebook under ``folder``, each in a sandbox of its own.

    Args:
        folder: a submitted notebook, or a folder of them (searched recursively).
        course: the course folder, holding ``solutions/`` and ``course_lib/``.
        assignment: grade every submission against this notebook of ``solutions/``
            (``"03_gradient_accumulation.ipynb"``); ``None`` matches each one.
        timeout: seconds the notebook's own run may take.
        cell_timeout: seconds each cell of that run, and each check, may take.
        jobs: submissions graded at once.
        limits: the resource limits of the sandbox (default :class:`Limits()`).
        executed: a folder to save each executed notebook in (for the learners), or ``None``.
        grade_unmatched: grade a notebook that ``solutions/`` cannot match as the assignment
            whose checks its own check cells call most (:func:`graded_as`), instead of scoring
            it 0.
        unsafe_no_sandbox: run without bubblewrap; prints :data:`UNSAFE_WARNING`.

    Returns:
        One :class:`Submission` per notebook, sorted by path.

    Raises:
        ValueError: naming the parameter, for a bad argument; also when bubblewrap is missing
            and ``unsafe_no_sandbox`` is False.

    Example::

        results = grade("submitted/", course=".", assignment="00_setup.ipynb", jobs=2)
        write_csv(results, "scores.csv")
    """
    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"folder must be an existing folder or notebook, got {str(folder)!r}")
    course = Path(course).resolve() if course is not None else None
    if course is None or not (course / "solutions").is_dir() or not (
            course / "course_lib" / "grading").is_dir():
        raise ValueError(f"course must be the course folder, holding solutions/ and "
                         f"course_lib/, got {str(course)!r}")
    timeout, cell_timeout = _positive("timeout", timeout), _positive("cell_timeout", cell_timeout)
    if not isinstance(jobs, int) or isinstance(jobs, bool) or not 1 <= jobs <= 64:
        raise ValueError(f"jobs must be an int from 1 to 64, got {jobs!r}")
    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise ValueError(f"limits must be a Limits, got {type(limits).__name__}")
    assignments = {p.name: load_assignment(p) for p in sorted((course / "solutions").glob(
        "*.ipynb"))}
    if assignment is not None and assignment not in assignments:
        raise ValueError(f"assignment must be one of {sorted(assignments)}, got {assignment!r}")
    resolved = folder.resolve()
    if executed is not None:
        executed = Path(executed).resolve()
        if _inside_any(executed, [resolved, course]):
            raise ValueError("executed must be a folder outside the submissions and the course, "
                             f"got {str(executed)!r}")
    if unsafe_no_sandbox:
        print(UNSAFE_WARNING, file=sys.stderr, flush=True)
    hidden = [course, resolved] + ([executed] if executed else [])
    run = _Run(course, hidden, limits, unsafe_no_sandbox, timeout, cell_timeout)
    for known in assignments.values():
        for expected in known.checks:
            run.canonical.setdefault(expected.name, list(expected.args))
    if run.sandbox.cgroups.version is None:
        print(NO_CGROUP_WARNING.format(run.sandbox.cgroups.reason), file=sys.stderr, flush=True)
    for slot in range(jobs):
        run.slots.put(slot)
    base = folder.parent if folder.is_file() else folder

    def one(path: Path) -> Submission:
        if not _is_notebook_name(path):
            return Submission(path=str(path.relative_to(base)), notebook="",
                              problem=NOT_A_NOTEBOOK)
        slot = run.slots.get()
        try:
            return grade_notebook(path, base, run, assignments, assignment=assignment,
                                  grade_unmatched=grade_unmatched, slot=slot, executed=executed)
        except Exception as exc:  # one odd notebook must not stop the grading of the others
            return Submission(path=str(path.relative_to(base)), notebook="",
                              problem=f"not graded: {type(exc).__name__}: {exc}"[:300])
        finally:
            run.verify_course_copy()
            run.slots.put(slot)

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, find_notebooks(folder)))
    finally:
        run.close()


def _inside_any(path: Path, folders: list[Path]) -> bool:
    return any(path == f or f in path.parents or path in f.parents for f in folders)


# --- the scores -------------------------------------------------------------------------------

_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value):
    """A CSV cell a spreadsheet shows as text: strings that start with ``= + - @``, a tab or a
    carriage return get a leading ``'`` (OWASP's advice against CSV injection).

    Example::

        spreadsheet_safe("=1+1+cmd|calc!A0.ipynb")  # "'=1+1+cmd|calc!A0.ipynb"
    """
    if isinstance(value, str) and value.startswith(_FORMULA):
        return "'" + value
    return value


def columns(results: list[Submission]) -> list[tuple[str, str]]:
    """``[(check name, column header)]``: a check named like a reserved column, or like another
    column, gets a header of its own (``check: total``, then ``check: total (2)``)."""
    names: list[str] = []
    for sub in results:
        for c in sub.checks:
            if c.name not in names:
                names.append(c.name)
    taken, out = set(RESERVED), []
    for name in names:
        header = name if name not in taken else f"check: {name}"
        number = 2
        while header in taken:
            header = f"check: {name} ({number})"
            number += 1
        taken.add(header)
        out.append((name, header))
    return out


def _text(value):
    """``value`` as text any UTF-8 file can hold: what cannot be encoded (a lone surrogate in
    an exception message, the byte 0xff of a file name decoded by ``os.fsdecode``) is written
    as its backslash escape instead of failing the whole file."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _private_folder(folder: Path) -> None:
    """Create ``folder`` and its missing parents, each open to its owner only (0700)."""
    for path in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another job made it meanwhile
            pass


def _replace_file(out: Path, write) -> None:
    """Write ``out`` through a temporary file beside it, renamed into place once complete: an
    error half-way leaves an older file whole and no temporary behind. Scores and learners'
    notebooks are private: the file is 0600 (``mkstemp``'s mode), in folders made 0700."""
    out = Path(out)
    _private_folder(out.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with open(fd, "w", encoding="utf-8", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _is_scores(path: Path) -> bool:
    """Whether an existing file is one the grader wrote: a scores CSV, or its JSON."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(64)
    return (head.startswith(b"submission,notebook,")
            or re.match(rb'\[\s*(\]|\{\s*"submission")', head) is not None)


def _score_files(out, folder, course, executed=None) -> tuple[Path, Path]:
    """The CSV and the JSON that ``--out`` names: ``scores.csv`` or ``scores.json``, the other
    beside it with the other suffix.

    Raises:
        ValueError: naming ``out``, if either would overwrite what a learner or an instructor
            wrote: a file inside the submissions, the executed notebooks or any folder of the
            course, or an existing file that is not an earlier scores file.
    """
    out = Path(out)
    csv_path, json_path = ((out.with_suffix(".csv"), out) if out.suffix.lower() == ".json"
                           else (out, out.with_suffix(".json")))
    course = Path(course).resolve()
    kept = [Path(folder).resolve(), *([Path(executed).resolve()] if executed else []),
            *(p.resolve() for p in (course.iterdir() if course.is_dir() else ()) if p.is_dir())]
    for path in (csv_path, json_path):
        if _inside_any(path.resolve(), kept) or (os.path.lexists(path) and not _is_scores(path)):
            raise ValueError(
                "out must be a new file or an earlier scores file, outside the submissions, the "
                f"executed notebooks and the course's folders, got {str(path)!r}")
    return csv_path, json_path


def write_results(results: list[Submission], out) -> None:
    """Save the results as JSON, before any formatting: ``out`` keeps every score and note even
    if a later step fails. Non-ASCII text is escaped (``ensure_ascii``), lone surrogates too.

    Args:
        results: what :func:`grade` returned.
        out: the JSON file to write (replaced atomically).
    """
    data = [{"submission": sub.path, "notebook": sub.notebook, "total": sub.total,
             "max": sub.max_points, "seconds": sub.seconds, "notes": sub.notes,
             "checks": {c.name: {"points": c.points, "status": c.status} for c in sub.checks}}
            for sub in results]
    _replace_file(Path(out), lambda f: json.dump(data, f, indent=1, ensure_ascii=True))


def write_csv(results: list[Submission], out) -> list[str]:
    """Write the scores, one row per submission; return the check columns' headers in order.

    The file is UTF-8, with any text that UTF-8 cannot hold escaped, and is written to a
    temporary file renamed into place: whatever a submission's notes or file name hold, the
    CSV is complete or the older one stays as it was.

    Args:
        results: what :func:`grade` returned.
        out: the CSV file to write.

    Returns:
        The headers of the check columns.
    """
    cols = columns(results)
    rows = [["submission", "notebook", *(h for _, h in cols), "total", "max", "seconds", "notes"]]
    for sub in results:
        points = {c.name: c.points for c in sub.checks}
        rows.append([sub.path, sub.notebook, *(_num(points[n]) if n in points else ""
                                               for n, _ in cols),
                     _num(sub.total), _num(sub.max_points), sub.seconds, sub.notes])
    safe = [[spreadsheet_safe(_text(v)) for v in row] for row in rows]
    _replace_file(Path(out), lambda f: csv.writer(f).writerows(safe))
    return [_text(h) for _, h in cols]


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def _printable(text: str) -> str:
    """Text for a terminal: control characters (a file name may hold escapes) shown escaped."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def summary(results: list[Submission]) -> str:
    """A plain-text summary: each submission's score and notes, then each check's pass rate."""
    lines = []
    width = max((len(_printable(s.path)) for s in results), default=10)
    for sub in results:
        lines.append(_printable(f"{_printable(sub.path):{width}s}  {_num(sub.total)}/"
                                f"{_num(sub.max_points)}" + (f"  {sub.notes}" if sub.notes else "")))
    counts: dict[str, list[int]] = {}
    for sub in results:
        for c in sub.checks:
            counts.setdefault(c.name, [0, 0])
            counts[c.name][0] += c.status == "passed"
            counts[c.name][1] += 1
    lines.append("")
    lines += [f"{name}: passed by {p} of {n}" for name, (p, n) in counts.items()]
    return "\n".join(lines)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912 (suffixes k, M, G, T, powers of 1024; none: bytes).

    Raises:
        ValueError: if ``text`` is not a positive size.
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", str(text))
    if not found:
        raise ValueError(f"size must look like 512M or 4G, got {text!r}")
    value = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    if value < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.grade",
        description="Grade a folder of submitted exercise notebooks, each in a sandbox.")
    parser.add_argument("folder", type=Path, help="folder of submissions (searched recursively)")
    parser.add_argument("--course", type=Path, required=True,
                        help="the course folder (holding solutions/ and course_lib/)")
    parser.add_argument("--out", type=Path, default=Path("scores.csv"),
                        help="the scores: a CSV, and the same name with .json beside it "
                             "(default scores.csv)")
    parser.add_argument("--assignment", help="grade every notebook against this solutions "
                        "notebook (e.g. 03_gradient_accumulation.ipynb)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for each notebook's own run (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=120.0,
                        help="seconds per cell of that run, and per check (default 120)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--executed", type=Path,
                        help="save each executed notebook here, for the learners")
    defaults = Limits()
    for flag, name, default, what in (
            ("--memory", "memory_bytes", "4G", "address space per process"),
            ("--processes", "processes", str(defaults.processes), "processes per sandbox"),
            ("--file-size", "file_bytes", "64M", "largest file written"),
            ("--disk", "disk_bytes", "512M", "size of the private /tmp"),
            ("--cell-output", "cell_output_bytes", "100k", "output kept per cell"),
            ("--notebook-output", "notebook_output_bytes", "2M", "output kept per notebook")):
        parser.add_argument(flag, dest=name, default=default, help=f"{what} (default {default})")
    parser.add_argument("--cpu-time", type=int, default=None,
                        help="CPU seconds per process (default: --timeout for the kernel, "
                             "--cell-timeout for each check)")
    parser.add_argument("--grade-unmatched", action="store_true",
                        help="grade a notebook that solutions/ cannot match as the assignment "
                             "whose checks its own cells call most, instead of scoring it 0")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run without bubblewrap: the submissions' code runs as you "
                             "(only for notebooks you trust)")
    args = parser.parse_args(argv)
    try:
        scores_csv, scores_json = _score_files(args.out, args.folder, args.course, args.executed)
        limits = Limits(memory_bytes=parse_size(args.memory_bytes),
                        processes=int(args.processes), file_bytes=parse_size(args.file_bytes),
                        disk_bytes=parse_size(args.disk_bytes), cpu_seconds=args.cpu_time,
                        cell_output_bytes=parse_size(args.cell_output_bytes),
                        notebook_output_bytes=parse_size(args.notebook_output_bytes))
        results = grade(args.folder, course=args.course, assignment=args.assignment,
                        timeout=args.timeout, cell_timeout=args.cell_timeout, jobs=args.jobs,
                        limits=limits, executed=args.executed,
                        grade_unmatched=args.grade_unmatched,
                        unsafe_no_sandbox=args.unsafe_no_sandbox)
    except (ValueError, authoring.AuthoringError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_results(results, scores_json)  # first: nothing formatted yet
    write_csv(results, scores_csv)
    print(summary(results))
    print(f"\nwrote {scores_csv} and {scores_json} ({len(results)} submissions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
