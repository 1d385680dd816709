"""What every benchmark shares: the notebooks to run, the machine they ran on, the result file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def notebooks(args: list[str], default: tuple[str, ...] = ("notebooks",)) -> list[Path]:
    """The notebooks named on the command line (files or folders), else every one in ``default``."""
    paths = []
    for item in args or default:
        path = Path(item) if Path(item).is_absolute() else ROOT / item
        if path.is_dir():
            paths += sorted(p for p in path.rglob("*.ipynb")  # companions in deeper/ too
                            if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb" and path.exists():
            paths.append(path)
        else:
            raise SystemExit(f"not a notebook or a folder of notebooks: {item}")
    return paths


def execute(nb, cwd: str, timeout: int, tries: int = 3) -> int:
    """Run ``nb`` in place in a fresh kernel (nbclient); return how many tries it took.

    nbclient can wait forever for a reply that never comes when a cell shows a widget
    (jupyter/nbclient#312, intermittent): a cell that outlasts ``timeout`` seconds is taken
    for that and the notebook is run again from a fresh kernel, at most ``tries`` times.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    for attempt in range(1, tries + 1):
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": cwd}}).execute()
            return attempt
        except CellTimeoutError:
            if attempt == tries:
                raise
            print(f"  a cell ran past {timeout} s; running the notebook again", file=sys.stderr)
    raise AssertionError("unreachable")


def summary(ms: list[float]) -> dict:
    """Median, 90th percentile and extremes of milliseconds (0.1 ms); NaN entries are dropped."""
    ms = sorted(x for x in ms if x == x)
    if not ms:
        return {"n": 0, "median_ms": None, "p90_ms": None, "min_ms": None, "max_ms": None}
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1), "p90_ms": round(p90, 1),
            "min_ms": round(ms[0], 1), "max_ms": round(ms[-1], 1)}


def machine() -> dict:
    """Where and with what a result was measured, so that figures can be compared fairly."""
    def pkg(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        **{name: pkg(name) for name in ("torch", "matplotlib", "ipywidgets", "jupyterlab")},
    }


def write(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` (via a .tmp file, so a crash leaves no half file)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)
    return path


def table(rows: list[list], header: list[str]) -> str:
    """A Markdown table (pastes into the README as it is)."""
    cells = [[str(x) for x in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
