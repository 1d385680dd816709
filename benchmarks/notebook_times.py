"""Benchmark 3: how long each notebook takes to run top to bottom, on CPU, in a fresh kernel.

    python benchmarks/notebook_times.py                       # notebooks/ and solutions/
    python benchmarks/notebook_times.py notebooks/02_x.ipynb  # some notebooks or folders
    python benchmarks/notebook_times.py --repeat 3 --check    # median of 3; exit 1 over budget

Each notebook is executed with nbclient (as ``make outputs`` and nbval do) from a temporary
copy, so nothing is written back. ``wall`` is the whole run including the kernel's start;
``cells`` is the sum of the cells' own execution times (nbclient's timestamps). The GPU is
hidden (``CUDA_VISIBLE_DEVICES=""``) unless ``--any-device``. Budgets are the course's own:
a lecture in under 60 s, a solution notebook in under 15 s. Results go to
benchmarks/results/notebook_times.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import nbformat
from bench_common import ROOT, execute, machine, notebooks, table, write

BUDGET_S = {"notebooks": 60, "solutions": 15, "exercises": 15}


def _seconds(cell) -> float:
    timing = cell.metadata.get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def run_once(path: Path, timeout: int) -> dict:
    """Execute a copy of ``path``; wall seconds, summed cell seconds, the slowest cell."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="course-times-") as tmp:
        # Run beside a copy of the notebook, as nbval does from the notebook's own folder.
        shutil.copy(path, Path(tmp) / path.name)
        start = time.perf_counter()
        tries = execute(nb, tmp, timeout)
        wall = time.perf_counter() - start
    per_cell = [(i, _seconds(c)) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    slowest = max(per_cell, key=lambda item: item[1])
    if tries > 1:  # the clock ran through the stuck tries too: keep the cells' own times
        wall = sum(s for _, s in per_cell)
    return {"wall_s": wall, "cells_s": sum(s for _, s in per_cell), "tries": tries,
            "slowest_cell": slowest[0], "slowest_cell_s": slowest[1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks solutions)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per notebook; the median is kept")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds per cell before the notebook is run again")
    parser.add_argument("--any-device", action="store_true", help="do not hide the GPU")
    parser.add_argument("--check", action="store_true", help="exit 1 if a notebook is over budget")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.any_device:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the kernels nbclient starts
    env = machine()
    rows, results = [], []
    for path in notebooks(args.paths, default=("notebooks", "solutions")):
        load = os.getloadavg()[0]  # other work on the machine slows every figure
        runs = [run_once(path, args.timeout) for _ in range(args.repeat)]
        wall = statistics.median(r["wall_s"] for r in runs)
        best = min(runs, key=lambda r: abs(r["wall_s"] - wall))
        budget = BUDGET_S.get(path.parent.name)
        result = {"notebook": str(path.relative_to(ROOT)), "runs": args.repeat,
                  "wall_s": round(wall, 2), "wall_s_all": [round(r["wall_s"], 2) for r in runs],
                  "cells_s": round(best["cells_s"], 2), "slowest_cell": best["slowest_cell"],
                  "slowest_cell_s": round(best["slowest_cell_s"], 2), "tries": best["tries"],
                  "budget_s": budget,
                  "within_budget": budget is None or wall <= budget,
                  "load_average_1min": round(load, 2)}
        results.append(result)
        rows.append([result["notebook"], f"{wall:.1f}", f"{result['cells_s']:.1f}",
                     f"{result['slowest_cell']} ({result['slowest_cell_s']:.1f} s)",
                     "-" if budget is None else f"{budget} {'ok' if result['within_budget'] else 'OVER'}",
                     f"{load:.1f}"])
        print(f"{result['notebook']}: {wall:.1f} s", file=sys.stderr, flush=True)
    device = "any" if args.any_device else "cpu"
    out = write("notebook_times", {"benchmark": "notebook execution time", "device": device,
                                   "machine": env, "results": results})
    print(table(rows, ["notebook", "wall s", "cells s", "slowest cell", "budget s", "load 1m"]))
    print(f"\n{env['cpu_count']} CPUs, load {env['load_average_1min']} at start, "
          f"torch {env['torch']}, device {device}; written to {out.relative_to(ROOT)}")
    return 1 if args.check and not all(r["within_budget"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
