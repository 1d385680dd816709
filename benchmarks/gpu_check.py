"""The whole course on a CUDA machine, in one command: ``make gpu-check``.

    python benchmarks/gpu_check.py                      # every part (about 10 minutes on an H100)
    python benchmarks/gpu_check.py --part notebooks     # one part: notebooks, tests or benchmarks
    python benchmarks/gpu_check.py --part benchmarks --quick

Parts, each within 10 minutes on an H100 so that they can also run one per call:

* **notebooks**: every lecture, companion and solution notebook, run top to bottom from a
  fresh kernel with nbclient (their CUDA branches run here; ``--jobs N`` runs N at once),
  saved with outputs to ``build/gpu/``;
* **tests**: ``pytest -m gpu tests``: the engine against ``torch.cuda.max_memory_allocated``
  over 24+ configurations, the kernel rules against PyTorch's own choice, the allocator;
* **benchmarks**: ``estimator_accuracy.py --device cuda`` (predicted against measured step
  peaks: median 3 %, max 5 % is the goal), ``checkpoint_cost.py --device cuda`` (time and
  FLOPs per checkpointing mode), ``peak_anatomy.py --device cuda`` (where the engine and the
  allocator part from the live tensors) and ``widget_latency.py`` (each lecture's widgets, in a
  kernel that runs on the GPU).

The report, ``benchmarks/results/gpu_check.json``, holds the device (name, capability,
memory, driver, CUDA, cuDNN), the torch version, every figure the parts produced and every
failure with its message; a run of one part keeps the other parts' last results. Exit status:
0 when everything passed, 1 when something failed, 2 at once on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from bench_common import RESULTS, ROOT, execute, machine, notebooks, write

PARTS = ("notebooks", "tests", "benchmarks")
BUILD = ROOT / "build" / "gpu"
REPORT = "gpu_check"


def cuda_or_exit() -> dict:
    """The device's facts, or exit 2 with a message when this machine has no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}). Nothing was run. On a laptop or in CI, `make test` "
              "is the check; the CUDA-only tests are marked `gpu` and skipped there.",
              file=sys.stderr)
        raise SystemExit(2)
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    return {"name": props.name, "capability": [props.major, props.minor],
            "total_memory": int(props.total_memory), "free_memory_at_start": int(free),
            "mem_get_info_total": int(total), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
            "sdp_priority_order": list(torch._C._get_sdp_priority_order())}


def _run_one(path: Path, timeout: int) -> tuple[str, dict]:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    entry = {"ok": True}
    try:
        entry["tries"] = execute(nb, str(path.parent), timeout)
    except CellExecutionError as exc:
        entry = {"ok": False, "error": str(exc).strip().splitlines()[-1][:2000],
                 "traceback": str(exc)[-4000:]}
    except Exception as exc:  # a kernel that died, a timeout: recorded, the others still run
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    entry["seconds"] = round(time.perf_counter() - start, 1)
    out = BUILD / path.parent.name / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    key = f"{path.parent.name}/{path.name}"
    print(f"{'ok  ' if entry['ok'] else 'FAIL'} {key} ({entry['seconds']} s)"
          + ("" if entry["ok"] else f": {entry['error'][:300]}"), flush=True)
    return key, entry


def run_notebooks(timeout: int, jobs: int = 1) -> dict:
    """Execute every lecture, companion and solution in a fresh kernel; outputs to build/gpu/.

    With ``jobs`` > 1 that many kernels share the GPU at once: each measures its own
    allocator (``torch.cuda.max_memory_allocated`` is per process), but timings printed in
    the notebooks then include the others' load, and readings of the whole device
    (``torch.cuda.mem_get_info``: companion 06's probe of the CUDA context) see the other
    kernels' memory come and go. The figures of record come from ``jobs=1``.
    """
    from concurrent.futures import ThreadPoolExecutor

    paths = notebooks([], ("notebooks", "solutions"))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(pool.map(lambda path: _run_one(path, timeout), paths))
    return {"ok": all(r["ok"] for r in results.values()), "jobs": jobs,
            "notebooks": dict(sorted(results.items()))}


def run_tests() -> dict:
    """``pytest -m gpu tests``, read back from its JUnit XML."""
    BUILD.mkdir(parents=True, exist_ok=True)
    xml = BUILD / "gpu-tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests",
                           "-p", "no:cacheprovider", f"--junitxml={xml}"], cwd=ROOT,
                          capture_output=True, text=True)
    print(proc.stdout[-3000:], flush=True)
    cases, failures = 0, {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            cases += 1
            for tag in ("failure", "error"):
                bad = case.find(tag)
                if bad is not None:
                    name = f"{case.get('classname')}::{case.get('name')}"
                    failures[name] = (bad.get("message") or "")[:2000]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "tests": cases,
            "failures": failures, "tail": proc.stdout[-2000:]}


def _script(args: list[str], result: Path | None) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT / "benchmarks", capture_output=True,
                          text=True)
    print(proc.stdout[-4000:], flush=True)
    entry = {"ok": proc.returncode == 0, "returncode": proc.returncode,
             "stdout_tail": proc.stdout[-3000:], "stderr_tail": proc.stderr[-2000:]}
    if result is not None and result.exists():
        entry["result"] = json.loads(result.read_text())
    return entry


def run_benchmarks(quick: bool) -> dict:
    """The estimator-accuracy, checkpoint-cost, peak-anatomy and widget-latency benchmarks, on this
    GPU."""
    flag = ["--quick", "--out", str(BUILD / "quick.json")] if quick else []
    out = {
        "estimator_accuracy": _script(["estimator_accuracy.py", "--device", "cuda", *flag],
                                      RESULTS / "estimator_accuracy.json"),
        "checkpoint_cost": _script(["checkpoint_cost.py", "--device", "cuda", *flag],
                                   RESULTS / "checkpoint_cost.json"),
        "peak_anatomy": _script(["peak_anatomy.py", "--device", "cuda", *flag],
                                RESULTS / "peak_anatomy.json"),
    }
    # The widget benchmark writes one file per machine kind: keep the committed CPU figures.
    latency = RESULTS / "widget_latency.json"
    cpu_figures = latency.read_text() if latency.exists() else None
    try:
        out["widget_latency"] = _script(["widget_latency.py", *(["--repeats", "3"] if quick
                                                                 else [])], latency)
    finally:
        if cpu_figures is not None:
            latency.write_text(cpu_figures)
    for entry in out.values():  # keep only this device's run of the multi-device files
        runs = entry.get("result", {}).get("runs")
        if runs is not None:
            entry["result"] = runs.get("cuda")
    return {"ok": all(entry["ok"] for entry in out.values()), **out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--quick", action="store_true", help="benchmarks: a few configurations")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per notebook cell")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks: kernels run at once (their timings then share the GPU)")
    args = parser.parse_args(argv)
    device = cuda_or_exit()
    path = RESULTS / f"{REPORT}.json"
    for part in PARTS if args.part == "all" else (args.part,):
        start = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            result = {"notebooks": lambda: run_notebooks(args.timeout, args.jobs),
                      "tests": run_tests, "benchmarks": lambda: run_benchmarks(args.quick)}[part]()
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        # Read again before writing: parts may run at once, in separate processes.
        report = json.loads(path.read_text()) if path.exists() else {}
        if report.get("device", {}).get("name") != device["name"]:
            report = {}  # another GPU's results are not this one's
        report.update({"machine": machine(), "device": device})
        report.setdefault("parts", {})[part] = result
        write(REPORT, report)
    failed = [part for part, result in report["parts"].items() if not result.get("ok")]
    print(f"report: {path.relative_to(ROOT)}; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every part passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
