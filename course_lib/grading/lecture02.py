"""Checks for exercises/02_activations_vs_gradients.ipynb.

Truths measured here, independently of the learner's formula: the MLP's saved bytes on a real
module, the distinct saved storages with ``saved_tensors_hooks``. The largest CPU batch is
written out (measured by ``tests/test_grading_truths.py``); on the GPU presets it is searched
against :func:`course_lib.prediction.predict.predict`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.measurement.memory import saved_bytes
from course_lib.model.gpt import GPT, MLP, GPTConfig, random_tokens
from course_lib.prediction.predict import Step, predict

from ..device import GPUS
from ..units import storage_bytes, storage_key
from . import exactly, expect, grader, observe


@grader
def check_mlp_saved_bytes(fn):
    """``fn(batch, seq, d_model, dtype, dropout)``: bytes the course MLP saves for backward."""
    cases = [(2, 8, 16, torch.float32, 0.0), (3, 5, 32, torch.float32, 0.1),
             (1, 7, 24, torch.bfloat16, 0.2), (4, 3, 8, torch.bfloat16, 0.0)]
    for b, s, h, dtype, p in cases:
        torch.default_generator.manual_seed(0)
        mlp = MLP(GPTConfig(d_model=h, n_heads=1, dropout=p)).to(dtype).train()
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        truth = saved_bytes(mlp(x), mlp.parameters())
        got = fn(b, s, h, dtype, p)
        expect(exactly(got, truth),
               f"mlp_saved_bytes({b}, {s}, {h}, {dtype}, dropout={p}) returned "
               f"{got!r}, measured {truth}",
               hint="list what each op keeps: fc keeps its input (b*s*h), GELU its input "
                    "(b*s*4h), proj its input (GELU's output, b*s*4h), and dropout with p > 0 its "
                    "mask, which on the CPU has the activation's dtype")


def _hook_truth(build) -> int:
    """Bytes of the distinct non-parameter storages saved while ``build()`` runs, seen by hooks."""
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, params = build()
    weights = {storage_key(p) for p in params}
    return storage_bytes(t for t in seen if storage_key(t) not in weights)


def _mlp_with_dropout():
    torch.default_generator.manual_seed(0)
    mlp = MLP(GPTConfig(d_model=16, n_heads=1, dropout=0.1)).train()
    x = torch.randn(3, 4, 16, requires_grad=True)
    return mlp(x), list(mlp.parameters())


def _gpt_sdpa():
    # (Explicit attention would also keep a 0-d float64 for 1/sqrt(d), which hooks never see.)
    torch.default_generator.manual_seed(0)
    cfg = GPTConfig(vocab_size=30, seq_len=8, d_model=16, n_heads=2, n_layers=1, attention="sdpa")
    model = GPT(cfg).to(torch.bfloat16)
    x, y = (t.clone() for t in random_tokens(cfg, 2))
    return model(x, y)[1], list(model.parameters())


def _drawn_sequential(widths: list[int], acts: list[str], batch: int, seed: int):
    """A ``nn.Sequential`` of Linear layers of ``widths`` with the activations ``acts`` between
    them (``"relu"``, ``"tanh"``, ``"gelu"``), run on a seeded batch: ``(output, params)``."""
    torch.default_generator.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(acts):
            layers.append({"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[acts[i]]())
    model = nn.Sequential(*layers)
    return model(torch.randn(batch, widths[0], requires_grad=True)), list(model.parameters())


_BUILDS = {"nn.Sequential(Linear, ReLU, Linear, Tanh, Linear)":
           lambda: _drawn_sequential([12, 24, 24, 6], ["relu", "tanh"], 5, 0),
           "the course MLP with dropout": _mlp_with_dropout,
           "a bf16 GPT with sdpa attention": _gpt_sdpa}


def _distinct_answer(fn, name: str):
    """The learner's answer for the graph ``name`` builds (run beside the learner's code)."""
    return fn(*_BUILDS[name]())


def _drawn_distinct_answer(fn, widths, acts, batch, seed):
    """The learner's answer for a drawn graph (run beside the learner's code)."""
    return fn(*_drawn_sequential(widths, acts, batch, seed))


@grader
def check_distinct_saved_bytes(fn):
    """``fn(output, params)``: bytes of the distinct non-parameter storages autograd keeps."""
    for name, build in _BUILDS.items():
        truth = _hook_truth(build)
        got = observe(_distinct_answer, fn, name)
        expect(exactly(got, truth),
               f"for {name} you returned {got!r}, autograd keeps {truth} bytes",
               hint="one row per (node, saved tensor), but several rows can share one storage "
                    "(ReLU's output is also the next Linear's input; sdpa keeps q, k, v as views "
                    "of one tensor): count each storage_id once, at its nbytes, and skip "
                    "parameters")


#: The CPU cases' model: two blocks, SDPA attention, no dropout.
SMALL = GPTConfig(vocab_size=96, seq_len=32, d_model=32, n_heads=2, n_layers=2)

#: ``(seq_len, capacity, precision, most sequences)``: steps of ``GPT(SMALL)`` measured on real
#: tensors (``course_tools/hidden.py`` keeps the bytes): between 11 and 12, exactly 6, not one.
MEASURED_CASES = [(24, 1889688, "fp32", 11), (32, 823672, "bf16", 6), (24, 506483, "fp32", 0)]


@grader
def check_largest_batch(fn):
    """``fn(config, seq_len, capacity, precision, gpu)``: the largest micro-batch whose predicted
    step (``predict(Step(...)).total`` on ``gpu``) fits ``capacity`` bytes, 0 if none."""
    gpt2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12,
                     dropout=0.1, attention="sdpa")
    wide = GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_layers=8,
                     dropout=0.0, attention="explicit")

    def need(cfg, b, s, precision, gpu):
        return predict(Step(cfg, b, seq_len=s, precision=precision, gpu=gpu)).total

    hint = ("use predict(Step(config, batch, seq_len=..., precision=..., gpu=...)).total, "
            "which counts the model states too (they do not shrink with the batch); return the "
            "last batch whose total is <= capacity, and 0 when even batch 1 does not fit; pass "
            "gpu on: a T4 picks other kernels than an A100")
    for s, capacity, precision, truth in MEASURED_CASES:
        got = fn(SMALL, s, capacity, precision, None)
        expect(exactly(got, truth),
               f"largest_batch(d_model={SMALL.d_model}, n_layers={SMALL.n_layers}, "
               f"seq_len={s}, capacity={capacity:,}, {precision!r}, gpu=None) returned {got!r}; "
               f"measured on the CPU, {truth} sequences fit", hint=hint)

    t4 = GPUS["T4"].total_memory  # what PyTorch reports, as the lectures use
    cases = [(gpt2, 1024, t4, "fp16-mixed", "T4"),
             (gpt2, 1024, t4, "bf16-mixed", "T4"),
             (gpt2, 512, 40 * 2**30, "fp32", "A100 40GB"),
             (wide, 2048, 80 * 2**30, "bf16-mixed", "H100 80GB"),
             (gpt2, 256, need(gpt2, 7, 256, "bf16-mixed", "A100 80GB"), "bf16-mixed", "A100 80GB")]
    for cfg, s, capacity, precision, gpu in cases:
        truth = 0
        while need(cfg, truth + 1, s, precision, gpu) <= capacity:
            truth += 1
        got = fn(cfg, s, capacity, precision, gpu)
        expect(exactly(got, truth),
               f"largest_batch(d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
               f"seq_len={s}, capacity={capacity:,}, {precision!r}, gpu={gpu!r}) returned "
               f"{got!r}, expected {truth}", hint=hint)
