"""What the model benchmarks (1 and 4) share: the device and threads they run on,
and one result file holding a run per device, so that GPU figures sit beside CPU ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_common import RESULTS, machine

DEVICES = ("cpu", "cuda")
#: Torch threads on the CPU. The benchmark models are small: with 2 threads on a 2-core machine
#: that also runs other work, steps were several times slower than with 1 (oversubscription).
CPU_THREADS = 1


def arguments(doc: str, argv=None) -> argparse.Namespace:
    """``--quick``, ``--device cpu|cuda`` and ``--out PATH`` (a quick run writes only with --out)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configurations, for a try-out")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="result file (default: benchmarks/results/<name>.json, full runs only)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    return args


def setup(device: str) -> dict:
    """Fix the threads (CPU) and return what the results must say about the machine."""
    if device == "cpu":
        torch.set_num_threads(CPU_THREADS)
    info = {**machine(), "device": device, "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def save(name: str, device: str, run: dict, out: Path | None, quick: bool) -> Path | None:
    """Store ``run`` as ``runs[device]`` of the result file, keeping the other device's run."""
    path = out or (None if quick else RESULTS / f"{name}.json")
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.loads(path.read_text()) if path.exists() else {"benchmark": name, "runs": {}}
    payload["runs"][device] = run
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)
    return path
