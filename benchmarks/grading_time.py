"""Benchmark 5: how long the sandboxed grader takes for a class, on CPU.

    python benchmarks/grading_time.py                  # 20 submissions of 00_setup, --jobs 1 and 2
    python benchmarks/grading_time.py --class-size 40 --jobs 1 2 4
    python benchmarks/grading_time.py --notebook 00_setup.ipynb 03_gradient_accumulation.ipynb

A class is made from exercises/NOTEBOOK (for each notebook given): half the submissions solved (the solution cells of
solutions/NOTEBOOK), half left as released. Each is graded as ``python -m course_tools.grade``
grades it (the notebook's run in a sandbox, then the checks in another), once per ``--jobs``
value; ``wall`` is the whole command, ``per submission`` the wall time divided by the class
size. Needs bubblewrap (``bwrap``). Results go to benchmarks/results/grading_time.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from bench_common import ROOT, machine, table, write

sys.path.insert(0, str(ROOT))

from course_tools import grade  # noqa: E402


def make_class(folder: Path, notebook: str, size: int) -> None:
    """``size`` submissions of ``notebook`` in ``folder``: even ones solved, odd ones released."""
    exercise = nbformat.read(ROOT / "exercises" / notebook, as_version=4)
    solution = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    for i in range(size):
        nb = nbformat.from_dict(exercise)
        if i % 2 == 0:
            for cell in nb.cells:
                grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
                if grade_id in answers:
                    cell.source = answers[grade_id]
        (folder / f"learner{i:03d}").mkdir()
        nbformat.write(nb, folder / f"learner{i:03d}" / notebook)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebook", nargs="+", default=["00_setup.ipynb"],
                        help="the assignments (a class of each)")
    parser.add_argument("--class-size", type=int, default=20, help="submissions (default 20)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="--jobs values")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.class_size < 1 or min(args.jobs) < 1:
        parser.error("--class-size and --jobs must be at least 1")
    env, rows, results = machine(), [], []
    for notebook in args.notebook:
        with tempfile.TemporaryDirectory(prefix="course-grading-") as tmp:
            folder = Path(tmp) / "submitted"
            folder.mkdir()
            make_class(folder, notebook, args.class_size)
            for jobs in args.jobs:
                load = os.getloadavg()[0]
                start = time.perf_counter()
                graded = grade.grade(folder, course=ROOT, assignment=notebook, jobs=jobs)
                wall = time.perf_counter() - start
                solved = sum(s.total == s.max_points for s in graded)
                result = {"notebook": notebook, "class_size": args.class_size, "jobs": jobs,
                          "wall_s": round(wall, 1),
                          "per_submission_s": round(wall / args.class_size, 2),
                          "full_marks": solved, "load_average_1min": round(load, 2)}
                results.append(result)
                rows.append([notebook, args.class_size, jobs, f"{wall:.1f}",
                             f"{wall / args.class_size:.2f}", solved, f"{load:.1f}"])
                print(f"{notebook}, jobs {jobs}: {wall:.1f} s", file=sys.stderr, flush=True)
    payload = {"benchmark": "grading time", "machine": env, "results": results}
    out = write("grading_time", payload) if args.out is None else args.out
    if args.out is not None:
        import json

        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(table(rows, ["notebook", "submissions", "jobs", "wall s", "per submission s",
                       "full marks", "load 1m"]))
    print(f"\n{env['cpu_count']} CPUs, torch {env['torch']}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
