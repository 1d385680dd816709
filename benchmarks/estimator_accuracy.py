"""Benchmark 1: predicted against measured peak memory of a full training step.

    python benchmarks/estimator_accuracy.py                 # 160 configurations on the CPU
    python benchmarks/estimator_accuracy.py --quick         # 8, results not written
    python benchmarks/estimator_accuracy.py --device cuda   # the same grid, GPU-sized

One training step of the course GPT (``course_lib.measurement.memory.training_step``: forward, backward,
AdamW ``step()``, ``zero_grad``) on a fresh model, so that the gradients and AdamW's ``m`` and
``v`` are created inside the step, as they are in a first step. **Measured**: the parameters'
bytes plus ``course_lib.measurement.memory.peak_memory`` of the step (bytes above what was live before it:
the live-tensor tracker on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA, after a warm-up
that creates the cuBLAS workspaces). Three estimates of the same figure, in bytes:

* **course**: the memory engine, ``course_lib.prediction.predict.predict(Step(config, batch,
  precision=, mode=, seq_len=, gpu=, first_step=True, foreach=))``: ``total``, parameters
  included. On CUDA it is asked for this GPU (``gpu="cuda"``: its attention kernel, bool
  dropout masks, fp32 LayerNorm statistics, 512-byte blocks, step counters on the host) and
  for the multi-tensor AdamW that is PyTorch's default there (``foreach=True``); on the CPU for
  the CPU's kernels and the per-tensor AdamW.
* **states only**: ``course_lib.prediction.formulas.training_memory(P, optimizer="adamw", precision=...)``,
  parameters + gradients + optimizer state, what ``accelerate estimate-memory`` and DeepSpeed's
  estimators count (no activations).
* **formula**: states only, plus Korthikanti et al.'s per-layer activation count
  (``course_lib.prediction.formulas.transformer_activation_bytes``, 16-bit values, scaled by ``e/2`` for
  ``e``-byte activations) times the layers: ``recompute="none"`` for no checkpointing,
  ``"selective"`` for ``attention`` (the paper's selective recompute is this mode), ``"full"``
  for ``blocks``. The paper has no count for ``sqrt`` segments or op-level ``selective``: the
  formula is not applied there (its statistics leave those rows out).

Relative error ``(predicted - measured) / measured``; the summary gives the median and the maximum
of its absolute value per estimator (target for the course predictor: median <= 3%, max <= 3%,
and never more than 1% under the measured peak),
on the total and, in the JSON, also above the parameters (every estimate gets them exactly).

The grid: attention (explicit, sdpa) x precision (fp32, bf16 weights with AdamW, state in bf16
too: "pure bf16") x checkpointing mode (none, blocks, sqrt, selective, attention; every block)
x 8 shapes, a half fraction of batch (2, 8) x sequence (64, 256) x layers (4, 8) x dropout
(0, 0.1): dropout is on where an odd number of the other three are at their high level. CPU:
vocabulary 256, d_model 64, 4 heads; CUDA: vocabulary 8192, d_model 512, 8 heads, batch (4, 16),
sequence (256, 1024), layers (4, 12). Results: benchmarks/results/estimator_accuracy.json,
``runs[device]`` (a CUDA run is stored beside the CPU one).
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass

import torch
from bench_common import table
from bench_device import arguments, save, setup

from course_lib.measurement.memory import peak_memory, training_step
from course_lib.model.gpt import GPT, GPTConfig, gpt_param_count, random_tokens
from course_lib.prediction.formulas import training_memory, transformer_activation_bytes
from course_lib.prediction.predict import Step, predict
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.units import MiB, dtype_bytes

ATTENTIONS = ("explicit", "sdpa")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("none", "blocks", "sqrt", "selective", "attention")
#: The recompute setting of Korthikanti et al.'s formula that matches each mode, where one does.
FORMULA_RECOMPUTE = {"none": "none", "attention": "selective", "blocks": "full"}
ESTIMATORS = ("course", "states only", "formula")
#: The course predictor's target: median and maximum |error|, and the most it may be low (a
#: planner trusting a prediction under the peak runs out of memory).
TARGET_MEDIAN, TARGET_MAX, TARGET_LOW = 0.03, 0.03, 0.01

MODEL = {"cpu": dict(vocab_size=256, d_model=64, n_heads=4),
         "cuda": dict(vocab_size=8192, d_model=512, n_heads=8)}
LEVELS = {"cpu": dict(batch=(2, 8), seq=(64, 256), layers=(4, 8)),
          "cuda": dict(batch=(4, 16), seq=(256, 1024), layers=(4, 12))}
DROPOUT = (0.0, 0.1)


@dataclass(frozen=True)
class Case:
    """One configuration: model (its ``seq_len`` is the step's), batch, precision, mode."""

    config: GPTConfig
    batch: int
    precision: str
    mode: str

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    def describe(self) -> dict:
        c = self.config
        return {"attention": c.attention, "precision": self.precision, "mode": self.mode,
                "batch": self.batch, "seq_len": c.seq_len, "layers": c.n_layers,
                "dropout": c.dropout}


def shapes(device: str) -> list[tuple[int, int, int, float]]:
    """``(batch, seq, layers, dropout)``: a half fraction of the 2^4 design (see the module doc)."""
    lv = LEVELS[device]
    out = []
    for i in range(8):
        high = [(i >> bit) & 1 for bit in range(3)]
        out.append((lv["batch"][high[0]], lv["seq"][high[1]], lv["layers"][high[2]],
                    DROPOUT[sum(high) % 2]))
    return out


def grid(device: str = "cpu", quick: bool = False) -> list[Case]:
    """Every configuration of the benchmark (``quick``: one shape, modes none and blocks: 8)."""
    cases = []
    for b, s, n_layers, p in shapes(device)[:1 if quick else None]:
        for attention in ATTENTIONS:
            config = GPTConfig(**MODEL[device], seq_len=s, n_layers=n_layers, dropout=p,
                               attention=attention)
            for precision in PRECISIONS:
                for mode in MODES[:2] if quick else MODES:
                    cases.append(Case(config, b, precision, mode))
    return cases


def estimates(case: Case, device: str = "cpu") -> dict:
    """Bytes of the step's peak, parameters included, from each estimator (None: not defined)."""
    c, b, dtype = case.config, case.batch, case.dtype
    cuda = device == "cuda"
    peak = predict(Step(c, b, precision=case.precision, mode=case.mode,
                        gpu="cuda" if cuda else None, first_step=True, foreach=cuda)).peak
    states = training_memory(gpt_param_count(c), optimizer="adamw", precision=case.precision).total
    recompute = FORMULA_RECOMPUTE.get(case.mode)
    formula = None
    if recompute is not None:
        per_16bit = transformer_activation_bytes(c.seq_len, b, c.d_model, c.n_heads, c.n_layers,
                                                 recompute=recompute)
        formula = states + per_16bit * dtype_bytes(dtype) // 2
    return {"parameters": peak.parameters, "moment": peak.moment,
            "course": peak.total, "states only": states, "formula": formula}


def measure(case: Case, device: str = "cpu") -> tuple[int, int]:
    """``(parameter bytes, peak bytes above them)`` of one training step on a fresh model."""
    torch.manual_seed(0)
    model = enable_checkpointing(GPT(case.config).to(device, case.dtype), case.mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = random_tokens(case.config, case.batch, device=device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, peak_memory(lambda: training_step(model, optimizer, x, y), device=device)


def release(device: str) -> None:
    """Free what the last measurement left (its model is garbage once ``measure`` returned)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def warm_up(device: str) -> None:
    """Run one step per attention kind and precision first: on CUDA this creates the cuBLAS
    workspaces (kept by the allocator, so not a step's allocation), everywhere it loads the
    lazily imported code of ``torch.utils.checkpoint``."""
    for attention in ATTENTIONS:
        config = GPTConfig(**MODEL[device], seq_len=32, n_layers=1, attention=attention)
        for precision in PRECISIONS:
            measure(Case(config, 1, precision, "blocks"), device)


def _error(predicted, measured):
    return None if predicted is None else (predicted - measured) / measured


def evaluate(cases: list[Case], device: str = "cpu") -> list[dict]:
    """One row per case: measured and predicted bytes, and each estimator's relative error."""
    rows = []
    for case in cases:
        est = estimates(case, device)
        row = {**case.describe(), "moment": est["moment"], "parameters": est["parameters"]}
        try:
            params, peak = measure(case, device)
        except torch.cuda.OutOfMemoryError:
            rows.append({**row, "measured": None, "note": "out of memory"})
            continue
        finally:
            release(device)
        if params != est["parameters"]:
            raise AssertionError(f"parameter bytes: predicted {est['parameters']}, model {params}")
        row["measured"] = params + peak
        for name in ESTIMATORS:
            row[f"predicted {name}"] = est[name]
            row[f"error {name}"] = _error(est[name], params + peak)
            above = None if est[name] is None else est[name] - params
            row[f"error {name} above parameters"] = _error(above, peak)
        rows.append(row)
    return rows


def _stats(errors: list) -> dict:
    errors = [abs(e) for e in errors if e is not None]
    if not errors:
        return {"n": 0, "median_abs_error": None, "max_abs_error": None}
    return {"n": len(errors), "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors)}


def summarise(rows: list[dict]) -> dict:
    """Median and maximum absolute relative error per estimator; the course's also per mode."""
    done = [r for r in rows if r.get("measured") is not None]
    out = {"configurations": len(rows), "measured": len(done)}
    for basis, suffix in (("total", ""), ("above parameters", " above parameters")):
        out[basis] = {name: _stats([r[f"error {name}{suffix}"] for r in done])
                      for name in ESTIMATORS}
    course = out["total"]["course"]
    signed = [r["error course"] for r in done]
    out["course lowest error"] = min(signed) if signed else None
    out["course meets target"] = (course["n"] > 0 and course["median_abs_error"] <= TARGET_MEDIAN
                                  and course["max_abs_error"] <= TARGET_MAX
                                  and out["course lowest error"] >= -TARGET_LOW)
    out["course by mode"] = {mode: _stats([r["error course"] for r in done if r["mode"] == mode])
                             for mode in MODES}
    peaks = [r["moment"] for r in done]
    out["peak in the AdamW step"] = sum(m == "AdamW step" for m in peaks)
    return out


def _pct(x, sign: str = "+") -> str:
    return "-" if x is None else f"{100 * x:{sign}.1f}%"


def _stat_cells(s: dict) -> list:
    return [s["n"], _pct(s["median_abs_error"], ""), _pct(s["max_abs_error"], "")]


def print_report(rows: list[dict], summary: dict, info: dict) -> None:
    header = ["attention", "prec", "mode", "b", "s", "L", "p", "measured MiB", "peak at",
              *(f"{name} err" for name in ESTIMATORS)]
    body = [[r["attention"], r["precision"], r["mode"], r["batch"], r["seq_len"], r["layers"],
             r["dropout"], "OOM" if r["measured"] is None else f"{r['measured'] / MiB:.2f}",
             r["moment"][:28], *(_pct(r.get(f"error {name}")) for name in ESTIMATORS)]
            for r in rows]
    print(table(body, header))
    print(f"\n{summary['measured']} configurations measured on {info['device']} "
          f"({info.get('gpu', info['processor'])}, {info['torch_threads']} thread(s), torch "
          f"{info['torch']}); the predicted peak falls in the AdamW step in "
          f"{summary['peak in the AdamW step']}, in the forward or backward pass elsewhere.\n")
    lines = []
    for basis in ("total", "above parameters"):
        for name in ESTIMATORS:
            lines.append([basis, name, *_stat_cells(summary[basis][name])])
    print(table(lines, ["error of", "estimator", "n", "median abs error", "max abs error"]))
    by_mode = [[mode, *_stat_cells(s)] for mode, s in summary["course by mode"].items()]
    print("\ncourse predictor by checkpointing mode (total):")
    print(table(by_mode, ["mode", "n", "median abs error", "max abs error"]))
    verdict = "meets" if summary["course meets target"] else "MISSES"
    print(f"\ncourse predictor {verdict} the target (median <= {TARGET_MEDIAN:.0%}, "
          f"max <= {TARGET_MAX:.0%}, never more than {TARGET_LOW:.0%} low; lowest "
          f"{_pct(summary['course lowest error'])})")


def main(argv=None) -> int:
    args = arguments(__doc__, argv)
    info = setup(args.device)
    cases = grid(args.device, args.quick)
    warm_up(args.device)
    rows = evaluate(cases, args.device)
    summary = summarise(rows)
    print_report(rows, summary, info)
    run = {"machine": info, "quick": args.quick, "model": MODEL[args.device],
           "optimizer": "torch.optim.AdamW, PyTorch's default implementation for the device",
           "summary": summary, "rows": rows}
    path = save("estimator_accuracy", args.device, run, args.out, args.quick)
    print(f"\nwritten: {path}" if path else "\nquick run: nothing written (pass --out to write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
