"""Grade a folder of submitted exercise notebooks: run each in isolation, score every check.

Command line::

    python -m course_lib.submissions DIR [--out scores.csv] [--timeout 600]
                                         [--cell-timeout 120] [--solutions solutions/]
                                         [--no-hidden-tests] [--jobs 1]

For every ``*.ipynb`` under ``DIR`` (``.ipynb_checkpoints`` excluded):

1. Find its solutions notebook: the one named in the notebook's
   ``metadata.course.generated_from`` (written by the exercise generator), else
   the one with the same file name in ``--solutions``.
2. Build the graded copy, as nbgrader's autograder does: every check cell
   (matched by its nbgrader ``grade_id``) gets the solution's source back,
   including its ``### BEGIN HIDDEN TESTS`` block, whose ``assert`` fails the
   cell unless the check really passed, so printing "✓" proves nothing; the
   cell also imports ``grading`` again, in case a learner's cell rebound the
   name. All outputs are cleared. A check cell that the learner deleted scores
   0 ("missing"), one the learner edited scores 0 ("edited"). Without a
   solutions notebook (or with ``--no-hidden-tests``) the check cells found in
   the submission are run as they are.
3. Run the copy in a temporary directory, in a fresh kernel started by a
   separate process, with a limit per cell (``--cell-timeout``: the kernel is
   interrupted, the cell fails, the next cells run) and per notebook
   (``--timeout``, reruns included). A cell that kills the kernel, or ignores
   the interrupt, is skipped in a fresh rerun, so it costs only its own checks.
   The submission file itself is only read, never written.
4. Score each check: its points if its cell ran without error and printed the
   check's own ``✓ name: passed.`` line; else 0, with the reason (failed, not
   done, error, timeout, crashed, missing, edited, not run).

The CSV has one row per submission: ``submission``, ``notebook``, one column
per check (points), ``total``, ``max``, ``seconds``, ``notes`` (the reasons
for every check not passed); a summary is printed. Like nbgrader, the checks
run inside the learner's kernel, so a learner who rewrites ``course_lib`` from
a notebook cell can defeat them; what this prevents is faked output, edited
check cells, and one bad cell taking the whole submission (or the grading run)
down with it. Exit status: 0, or 2 for a usage error.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from . import authoring

#: Seconds a cell may run past its limit after the interrupt before its kernel is killed.
INTERRUPT_GRACE = 5.0
#: At most this many cells are skipped (crashed or hung), each costing a fresh rerun.
MAX_RERUNS = 5
CHECK_NAME = re.compile(r"\bgrading\.check_(\w+)\(")
REIMPORT = "from course_lib import grading  # added by the grader"


@dataclass
class CheckResult:
    """The score of one check of one submission."""

    name: str            # the check, without "check_" ("tensor_nbytes")
    grade_id: str        # nbgrader's id of the check cell
    max_points: float
    points: float = 0.0
    status: str = "not run"  # passed, failed, not done, error, timeout, crashed, missing, edited
    detail: str = ""


@dataclass
class Submission:
    """All checks of one submitted notebook."""

    path: str                       # relative to the graded folder
    notebook: str                   # the solutions notebook it was matched with, or ""
    checks: list[CheckResult] = field(default_factory=list)
    hidden_tests: bool = False
    seconds: float = 0.0
    problem: str = ""               # why it could not be graded at all

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
        if self.checks and not self.hidden_tests:
            parts.append("no hidden tests: graded on printed output")
        return "; ".join(parts)


# --- what a notebook is expected to contain ---------------------------------------------------


@dataclass
class _Expected:
    name: str
    grade_id: str
    points: float
    source: str           # what the grader runs (with hidden tests)
    visible: str | None   # what the learner's copy should hold (None: unknown)


def _check_name(source: str) -> str:
    match = CHECK_NAME.search(source)
    return match.group(1) if match else "?"


def _grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def _expected_from_solution(solution, name: str) -> list[_Expected]:
    solution = copy.deepcopy(solution)
    authoring.stamp_solution(solution)  # grade ids as the generator wrote them
    exercise = authoring.make_exercise(solution, name)
    expected = []
    for sol_cell, ex_cell in zip(solution.cells, exercise.cells):
        if authoring.cell_kind(sol_cell) == "check":
            meta = sol_cell.metadata["nbgrader"]
            expected.append(_Expected(_check_name(sol_cell.source), meta["grade_id"],
                                      float(meta.get("points", 1)), sol_cell.source,
                                      ex_cell.source))
    return expected


def _expected_from_submission(nb) -> list[_Expected]:
    expected = []
    for index, cell in enumerate(nb.cells):
        if authoring.cell_kind(cell) == "check":
            meta = cell.metadata.get("nbgrader", {})
            expected.append(_Expected(_check_name(cell.source),
                                      meta.get("grade_id", f"cell-{index}"),
                                      float(meta.get("points", 1)), cell.source, None))
    return expected


def _find_solution(nb, path: Path, solutions: Path | None):
    if solutions is None:
        return None, ""
    generated_from = nb.metadata.get("course", {}).get("generated_from", "")
    for name in (Path(generated_from).name, path.name):
        if name and (solutions / name).is_file():
            return nbformat.read(solutions / name, as_version=4), name
    return None, ""


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _graded_copy(nb, expected: list[_Expected]) -> tuple:
    """The notebook to run, ``{grade_id: cell index}``, ``{grade_id: "missing" or "edited"}``."""
    graded = copy.deepcopy(nb)
    where, verdict = {}, {}
    by_id = {}
    for index, cell in enumerate(graded.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            by_id.setdefault(_grade_id(cell) or f"cell-{index}", index)
    for exp in expected:
        index = by_id.get(exp.grade_id)
        if index is None:  # metadata lost (some editors drop it): find the cell by its call
            index = next((i for i, c in enumerate(graded.cells) if c.cell_type == "code"
                          and f"grading.check_{exp.name}(" in c.source), None)
        if index is None:
            verdict[exp.grade_id] = "missing"
            continue
        cell = graded.cells[index]
        if exp.visible is not None and _norm(cell.source) not in (_norm(exp.visible),
                                                                  _norm(exp.source)):
            verdict[exp.grade_id] = "edited"
        # The check as released, hidden tests included, with the real `grading` bound again
        # (a learner's cell may have rebound the name to something that prints "✓").
        cell.source = f"{REIMPORT}\n{exp.source}"
        where[exp.grade_id] = index
    return graded, where, verdict


# --- running a notebook in a separate process --------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _execute_main() -> None:
    """Runner process: execute one notebook cell by cell, reporting progress to a JSON file."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb_path, out_path, progress_path = (Path(a) for a in sys.argv[1:4])
    cell_timeout = float(sys.argv[4])
    nb = nbformat.read(nb_path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(nb_path.parent)}})
    progress = {"kernel_pid": None, "cell": None, "started": None, "finished": [],
                "timed_out": [], "dead_at": None, "done": False}
    client.reset_execution_trackers()
    with client.setup_kernel():
        progress["kernel_pid"] = getattr(client.km.provisioner, "pid", None)
        _write_json(progress_path, progress)
        client.wait_for_reply(client.kc.kernel_info())
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            progress.update(cell=index, started=time.time())
            _write_json(progress_path, progress)
            start = time.monotonic()
            try:
                client.execute_cell(cell, index, execution_count=len(progress["finished"]) + 1)
            except DeadKernelError:
                progress["dead_at"] = index
                break
            if time.monotonic() - start >= cell_timeout:
                progress["timed_out"].append(index)
            progress["finished"].append(index)
            nbformat.write(nb, out_path)
        else:
            progress["done"] = True
    nbformat.write(nb, out_path)
    _write_json(progress_path, progress)


def _kill_group(pid: int | None) -> None:
    """Kill a process and its process group (the runner's session; the kernel's own session)."""
    if not pid:
        return
    try:
        if hasattr(os, "killpg") and os.getpgid(pid) == pid:  # a session leader: its group
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def _run_once(nb, workdir: Path, cell_timeout: float, deadline: float) -> dict:
    """Run ``nb`` in ``workdir`` in a runner process; return its progress and executed notebook."""
    nb_path, out_path, progress_path, log_path = (workdir / n for n in (
        "graded.ipynb", "executed.ipynb", "progress.json", "runner.log"))
    for path in (out_path, progress_path):
        path.unlink(missing_ok=True)
    nbformat.write(nb, nb_path)
    with open(log_path, "wb") as log:
        runner = subprocess.Popen(
            [sys.executable, "-c", "from course_lib.submissions import _execute_main; "
             "_execute_main()", str(nb_path), str(out_path), str(progress_path), str(cell_timeout)],
            cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    progress, killed = {}, None
    try:
        while runner.poll() is None:
            time.sleep(0.1)
            if progress_path.exists():
                progress = json.loads(progress_path.read_text())
            started = progress.get("started")
            if time.monotonic() > deadline:
                killed = ("timeout", "the notebook time limit")
            elif started and time.time() - started > cell_timeout + INTERRUPT_GRACE:
                killed = ("timeout", "ignored the interrupt at the cell time limit")
            if killed:
                break
    finally:
        if runner.poll() is None:
            _kill_group(runner.pid)
            runner.wait()
        if progress_path.exists():
            progress = json.loads(progress_path.read_text())
        if killed or runner.returncode:
            _kill_group(progress.get("kernel_pid"))
    progress["killed"] = killed
    if runner.returncode and not killed:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
        progress["runner_error"] = f"the grader's runner failed: {' '.join(tail)}"[:300]
    progress["executed"] = nbformat.read(out_path, as_version=4) if out_path.exists() else None
    return progress


def _execute_with_reruns(graded, workdir: Path, timeout: float, cell_timeout: float):
    """Run until the notebook completes, skipping each cell that crashed or hung in a fresh rerun.

    Returns the last run and ``{cell index: (status, detail)}`` of the skipped cells.
    """
    deadline = time.monotonic() + timeout
    skipped: dict[int, tuple[str, str]] = {}
    while True:
        nb = copy.deepcopy(graded)
        for index, (status, detail) in skipped.items():
            nb.cells[index].source = f"# skipped by the grader: {status} ({detail})"
        run = _run_once(nb, workdir, cell_timeout, deadline)
        for index in run.get("timed_out", []):  # interrupted: scored 0, not worth re-running
            skipped.setdefault(index, ("timeout", "interrupted at the cell time limit"))
        if run.get("dead_at") is not None:
            skipped[run["dead_at"]] = ("crashed", "the kernel died")
        elif run["killed"] and run.get("cell") is not None:
            skipped[run["cell"]] = run["killed"]
        else:
            return run, skipped  # done, or the runner itself failed
        if time.monotonic() > deadline or len(skipped) > MAX_RERUNS:
            return run, skipped


def _printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def _score(result: CheckResult, cell, run: dict, index: int) -> None:
    from .grading import FAIL, PASS, TODO  # here: importing the checks imports torch
    if cell is None or index not in run.get("finished", []):
        result.status = "not run"
        result.detail = "the notebook time limit came first" if run.get("killed") else ""
        return
    lines = [line.strip() for line in _printed(cell).splitlines()]
    mine = [line for line in lines if line.split(":", 1)[0] in (
        f"{mark} {result.name}" for mark in (PASS, FAIL, TODO))]
    errors = [o for o in cell.outputs if o.get("output_type") == "error"]
    if index in run.get("timed_out", []):
        result.status, result.detail = "timeout", "interrupted at the cell time limit"
    elif any(line.startswith(TODO) for line in mine):
        result.status = "not done"
    elif any(line.startswith(FAIL) for line in mine):
        result.status = "failed"
    elif errors:
        result.status = "failed" if errors[0].get("ename") == "AssertionError" else "error"
        result.detail = f"{errors[0].get('ename')}: {errors[0].get('evalue', '')}"[:200]
    elif f"{PASS} {result.name}: passed." in mine:
        result.status, result.points = "passed", result.max_points
    else:
        result.status, result.detail = "failed", "the check printed no verdict"


def grade_notebook(path: Path, root: Path, *, solutions: Path | None, timeout: float,
                   cell_timeout: float) -> Submission:
    """Grade one submitted notebook (read only); see the module docstring."""
    start = time.monotonic()
    sub = Submission(path=str(path.relative_to(root)), notebook="")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # not a notebook at all
        sub.problem = f"unreadable notebook: {type(exc).__name__}: {exc}"[:300]
        return sub
    solution, sub.notebook = _find_solution(nb, path, solutions)
    expected = (_expected_from_solution(solution, sub.notebook) if solution is not None
                else _expected_from_submission(nb))
    sub.hidden_tests = any(authoring.BEGIN_HIDDEN in e.source for e in expected)
    sub.checks = [CheckResult(e.name, e.grade_id, e.points) for e in expected]
    if not expected:
        sub.problem = "no check cells found"
        return sub
    graded, where, verdict = _graded_copy(nb, expected)
    with tempfile.TemporaryDirectory(prefix="course_grade_") as tmp:
        run, skipped = _execute_with_reruns(graded, Path(tmp), timeout, cell_timeout)
    executed = run.get("executed")
    sub.problem = run.get("runner_error", "")
    for result in sub.checks:
        index = where.get(result.grade_id)
        if result.grade_id in verdict:
            result.status = verdict[result.grade_id]
        elif index in skipped:
            result.status, result.detail = skipped[index]
        else:
            _score(result, executed.cells[index] if executed else None, run, index)
    sub.seconds = round(time.monotonic() - start, 1)
    return sub


def find_notebooks(root: Path) -> list[Path]:
    """Every ``*.ipynb`` under ``root`` (or ``root`` itself), checkpoints excluded, sorted."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def grade(root, *, solutions=authoring.ROOT / "solutions", timeout: float = 600.0,
          cell_timeout: float = 120.0, jobs: int = 1) -> list[Submission]:
    """Grade every notebook under ``root``; ``solutions`` None grades on printed output only."""
    root = Path(root)
    if not root.exists():
        raise ValueError(f"root must be an existing folder or notebook, got {str(root)!r}")
    for name, value in (("timeout", timeout), ("cell_timeout", cell_timeout)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    solutions = None if solutions is None else Path(solutions)
    if solutions is not None and not solutions.is_dir():
        raise ValueError(f"solutions must be a folder of solution notebooks, "
                         f"got {str(solutions)!r}")
    base = root.parent if root.is_file() else root

    def one(path: Path) -> Submission:
        try:
            return grade_notebook(path, base, solutions=solutions, timeout=timeout,
                                  cell_timeout=cell_timeout)
        except Exception as exc:  # one odd notebook must not stop the grading of the others
            return Submission(path=str(path.relative_to(base)), notebook="",
                              problem=f"not graded: {type(exc).__name__}: {exc}"[:300])

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, find_notebooks(root)))


def write_csv(results: list[Submission], out) -> list[str]:
    """Write the scores, one row per submission; return the check columns in order."""
    columns: list[str] = []
    for sub in results:
        for c in sub.checks:
            if c.name not in columns:
                columns.append(c.name)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["submission", "notebook", *columns, "total", "max", "seconds", "notes"])
        for sub in results:
            points = {c.name: c.points for c in sub.checks}
            writer.writerow([sub.path, sub.notebook, *(_num(points[c]) if c in points else ""
                                                        for c in columns),
                             _num(sub.total), _num(sub.max_points), sub.seconds, sub.notes])
    return columns


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def summary(results: list[Submission]) -> str:
    """A plain-text summary: each submission's score and notes, then each check's pass rate."""
    lines = []
    width = max((len(s.path) for s in results), default=10)
    for sub in results:
        lines.append(f"{sub.path:{width}s}  {_num(sub.total)}/{_num(sub.max_points)}"
                     + (f"  {sub.notes}" if sub.notes else ""))
    counts: dict[str, list[int]] = {}
    for sub in results:
        for c in sub.checks:
            counts.setdefault(c.name, [0, 0])
            counts[c.name][0] += c.status == "passed"
            counts[c.name][1] += 1
    lines.append("")
    lines += [f"{name}: passed by {p} of {n}" for name, (p, n) in counts.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.submissions",
                                     description="Grade a folder of submitted exercise notebooks.")
    parser.add_argument("folder", type=Path, help="folder of submissions (searched recursively)")
    parser.add_argument("--out", type=Path, default=Path("scores.csv"), help="CSV to write")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per notebook, reruns included (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=120.0,
                        help="seconds per cell before it is interrupted (default 120)")
    parser.add_argument("--solutions", type=Path, default=authoring.ROOT / "solutions",
                        help="solution notebooks holding the hidden tests (default: the course's)")
    parser.add_argument("--no-hidden-tests", action="store_true",
                        help="grade on printed output only, without solution notebooks")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    args = parser.parse_args(argv)
    try:
        results = grade(args.folder, solutions=None if args.no_hidden_tests else args.solutions,
                        timeout=args.timeout, cell_timeout=args.cell_timeout, jobs=args.jobs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_csv(results, args.out)
    print(summary(results))
    print(f"\nwrote {args.out} ({len(results)} submissions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
