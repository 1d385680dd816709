"""benchmarks/estimator_accuracy.py and benchmarks/checkpoint_cost.py run end to end on tiny models.

Smoke tests, so that the benchmarks cannot rot: every script's ``main`` runs with a tiny
configuration and writes its result file to a temporary folder. No timing is asserted.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_device  # noqa: E402
import checkpoint_cost  # noqa: E402
import estimator_accuracy as accuracy  # noqa: E402
import peak_anatomy  # noqa: E402

from course_lib.model.gpt import GPTConfig, gpt_param_count  # noqa: E402
from course_lib.prediction.formulas import training_memory  # noqa: E402

TINY = dict(vocab_size=32, seq_len=16, d_model=16, n_heads=2, n_layers=2)


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()  # setup() sets the benchmark's thread count
    yield
    torch.set_num_threads(threads)


def test_accuracy_grid_covers_every_dimension():
    cases = accuracy.grid("cpu")
    assert len(cases) >= 24
    rows = [case.describe() for case in cases]
    for key, values in (("attention", accuracy.ATTENTIONS), ("precision", ("fp32", "bf16")),
                        ("mode", accuracy.MODES), ("batch", (2, 8)), ("seq_len", (64, 256)),
                        ("layers", (4, 8)), ("dropout", (0.0, 0.1))):
        assert {row[key] for row in rows} == set(values), key
    assert len(accuracy.grid("cpu", quick=True)) == 8


def test_formula_estimate_is_states_plus_korthikanti():
    config = GPTConfig(**TINY)
    states = training_memory(gpt_param_count(config), precision="fp32").total
    full = accuracy.estimates(accuracy.Case(config, 2, "fp32", "blocks"))
    assert full["states only"] == states
    assert full["formula"] == states + 2 * 16 * 2 * 16 * 2 * 2  # 2sbh per layer, in fp32: x2
    assert accuracy.estimates(accuracy.Case(config, 2, "bf16", "sqrt"))["formula"] is None


def test_estimator_accuracy_main(tmp_path, monkeypatch, capsys):
    tiny = GPTConfig(**TINY)
    cases = [accuracy.Case(tiny, 2, precision, mode)
             for precision in ("fp32", "bf16") for mode in ("none", "blocks")]
    monkeypatch.setattr(accuracy, "grid", lambda device, quick: cases)
    out = tmp_path / "estimator_accuracy.json"
    assert accuracy.main(["--quick", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["cpu"]
    assert run["machine"]["torch_threads"] == bench_device.CPU_THREADS
    assert len(run["rows"]) == 4 and all(row["measured"] > 0 for row in run["rows"])
    assert run["summary"]["course meets target"]  # the predictor is exact on the CPU
    assert "course predictor meets the target" in capsys.readouterr().out


def test_checkpoint_cost_main(tmp_path, monkeypatch):
    monkeypatch.setitem(checkpoint_cost.SETUP, "cpu",
                        dict(model=TINY, batch=2, dtype=torch.float32, rounds=7))
    out = tmp_path / "checkpoint_cost.json"
    assert checkpoint_cost.main(["--quick", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["runs"]["cpu"]["results"]
    assert set(results) == set(checkpoint_cost.ATTENTIONS)
    for result in results.values():
        none, blocks = result["rows"]
        assert len(none["seconds"]) == result["rounds"] == 2
        assert none["time_ratio"] == none["flop_ratio"] == 1.0
        assert blocks["flop_ratio"] > 1.0 and blocks["kept_saved"] > 0
        assert blocks["flops_counted"] == blocks["flops_predicted"]


def test_save_keeps_the_other_device(tmp_path):
    path = tmp_path / "x.json"
    bench_device.save("x", "cuda", {"a": 1}, path, quick=False)
    bench_device.save("x", "cpu", {"b": 2}, path, quick=False)
    assert json.loads(path.read_text()) == {"benchmark": "x", "runs": {"cuda": {"a": 1},
                                                                      "cpu": {"b": 2}}}
    assert bench_device.save("x", "cpu", {}, None, quick=True) is None


def test_widget_latency_times_every_control_and_the_reference(tmp_path):
    import nbformat
    import widget_latency

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import gc\n"
        "import ipywidgets as widgets\n"
        "from course_lib.views.widgets import live_plot\n"
        "live_plot(lambda fig, n, on: (on and gc.collect(), fig.subplots().plot([0, n])),\n"
        "          {'n': widgets.IntSlider(value=1, min=1, max=9),\n"
        "           'on': widgets.Checkbox(value=False)})")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "one_widget.ipynb"
    nbformat.write(nb, path)
    rows = widget_latency.kernel_latency(path, repeats=3, timeout=120)
    assert [(r["cell"], r["control"]) for r in rows] == [(0, "n"), (0, "on"), (-1, "n")]
    assert all(len(r["ms"]) >= 3 and len(r["render_ms"]) == len(r["ms"]) for r in rows)
    assert all(0 < render <= total for r in rows for render, total in zip(r["render_ms"], r["ms"]))
    named = widget_latency.ROOT / "notebooks" / path.name  # results name notebooks by repo path
    kinds = {w["cell"]: w["kind"] for w in widget_latency.widgets_of(named, rows)}
    assert kinds == {0: "formula", -1: "reference"}
    # Checking the box runs a full collection inside the change: timed apart, and taken out of
    # the first visit that the target judges.
    on = next(r for r in rows if r["control"] == "on")
    assert len(on["gc_ms"]) == len(on["ms"]) and on["gc_ms"][0] > 0  # the first value: True
    widget = next(w for w in widget_latency.widgets_of(named, rows) if w["cell"] == 0)
    assert widget["full_gc_count"] >= 1
    assert on["first_ms"][0] - on["gc_ms"][0] - 0.1 <= widget["first_max_without_gc_ms"] \
        <= widget["first_max_ms"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_gpu_check_stops_at_once_without_cuda():
    import subprocess
    import time

    root = Path(__file__).resolve().parent.parent
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Nothing was run" in proc.stderr
    assert time.perf_counter() - start < 30


def test_grading_time_builds_a_class_half_solved(tmp_path):
    import grading_time
    import nbformat

    grading_time.make_class(tmp_path, "00_setup.ipynb", 3)
    notebooks = sorted(tmp_path.rglob("*.ipynb"))
    assert [p.parent.name for p in notebooks] == ["learner000", "learner001", "learner002"]
    solved = ["NotImplementedError" not in "".join(
        c.source for c in nbformat.read(p, 4).cells if c.cell_type == "code") for p in notebooks]
    assert solved == [True, False, True]


def test_peak_anatomy_on_the_cpu_the_engine_is_the_live_tensors(tmp_path, capsys):
    """Its tracker, on the CPU, sees the step the engine predicts: the same bytes, and the ops
    holding them at the peak; with a storage made before it, or a view, counted nowhere."""
    out = tmp_path / "peak_anatomy.json"
    assert peak_anatomy.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]["cpu"]["rows"]
    assert len(rows) == 2 and all(r["engine"] == r["tensors"] > 0 for r in rows)
    assert all(r["allocator"] is None and r["held_at_peak"] for r in rows)
    before = torch.ones(1000)
    with peak_anatomy.OpTracker() as tracker:
        view = before.view(10, 100)  # aliases a storage made before: not counted
        made = before * 2  # 4,000 bytes by "mul", alive at the peak
        del view
    assert tracker.peak_holders() == (made.nbytes, [("mul", made.nbytes)])
    assert tracker.peak_holders(512) == (4096, [("mul", 4096)])  # the CUDA allocator's blocks
