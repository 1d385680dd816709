"""Checks for exercises/05_selective_checkpointing.ipynb: the policies measured on real
checkpointed blocks; the planning answers written out (their rules live with the grader,
``course_tools/hidden.py``, and ``tests/test_grading_truths.py`` checks them)."""

from __future__ import annotations

import random

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from . import exactly, expect, grader

_aten = torch.ops.aten
_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _expect_policy(policy, ops, allowed, expected: str, hint: str) -> None:
    """Fail unless ``policy`` returns one of ``allowed`` (enum members: by identity, not by
    ``==``) for every op of ``ops``."""
    ctx = SelectiveCheckpointContext(is_recompute=False)
    for op in ops:
        got = policy(ctx, op)
        expect(any(exactly(got, a) for a in allowed),
               f"for {op} your policy returned {got!r}, expected {expected}", hint=hint)


@grader
def check_selective_policy(policy):
    """``policy(ctx, op, *args, **kwargs)`` saves ``mm``, ``addmm``, ``bmm`` and the fused attention
    ops' outputs (``ATTENTION_OPS``), and recomputes everything else."""
    from course_lib.model.gpt import GPT, GPTConfig
    from course_lib.training.checkpointing import ATTENTION_OPS
    from course_lib.training.policies import policy_cost

    _expect_policy(policy, (_aten.mm.default, _aten.addmm.default, _aten.bmm.default), _SAVE,
                   "MUST_SAVE", "nn.Linear with a bias dispatches aten.addmm, without one aten.mm,"
                   " and a batched q @ k^T aten.bmm; `op` is an OpOverload such as "
                   "torch.ops.aten.addmm.default, and it never equals the packet "
                   "torch.ops.aten.addmm")
    _expect_policy(policy, ATTENTION_OPS, _SAVE, "MUST_SAVE",
                   "F.scaled_dot_product_attention dispatches one fused op, not a matmul: save "
                   "its output too, or the backward pass runs the attention forward again")
    _expect_policy(policy, (_aten.gelu.default, _aten._softmax.default,
                            _aten.native_layer_norm.default, _aten.add.Tensor, _aten.mul.Tensor),
                   _RECOMPUTE, "PREFER_RECOMPUTE",
                   "pointwise ops, LayerNorm and softmax are cheap to rerun: recompute them")
    # End to end on one block of the course GPT (linears with bias), with either attention.
    for attention in ("explicit", "sdpa"):
        torch.default_generator.manual_seed(0)
        config = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1,
                           attention=attention)
        block = GPT(config).blocks[0]
        x = torch.randn(2, 8, 16, requires_grad=True)
        cost = policy_cost(block, x, policy=policy)
        for op in (_aten.addmm.default, _aten.bmm.default, *ATTENTION_OPS):
            expect(cost.recomputes(op) == 0, f"under your policy {op} ran again "
                   f"{cost.recomputes(op)} time(s) in the backward pass of a block with "
                   f"{attention} attention",
                   hint="save the outputs of the matmuls and of the attention kernel, so that "
                        "neither is recomputed")
        expect(cost.recomputes(_aten.gelu.default) >= 1, "GELU was not recomputed",
               hint="save only the matmul and attention outputs; everything else is recomputed")


def _every_cases() -> list[tuple]:
    """The public cases of :func:`check_choose_every`: six chosen, thirty from a seeded draw."""
    rng = random.Random(5)
    cases = [(6, 100, 10, 50, 700), (6, 100, 10, 50, 5000), (6, 100, 10, 50, 100),
             (12, 300, 20, 1000, 3500), (7, 64, 8, 0, 300), (1, 100, 10, 5, 105)]
    for _ in range(30):
        n, block = rng.randint(1, 24), rng.randint(20, 500)
        inp, fixed = rng.randint(1, block // 2), rng.randint(0, 1000)
        cases.append((n, block, inp, fixed, rng.randint(fixed, fixed + n * block + block)))
    return cases


#: The answers to :func:`_every_cases` (Chen et al. 2016's model: blocks 0, k, 2k, ... keep their
#: input, the others all they save; a rebuild adds to the peak only for the last block).
EVERY_ANSWERS = [6, 6, None, 3, 2, 1, 18, 7, 1, 1, 1, None, None, None, None, 1, 1, 1, 3, None,
                 None, None, 2, None, 2, 5, None, 1, 4, 2, 3, None, 1, 5, None, 1]


@grader
def check_choose_every(fn):
    """``fn(n_layers, block_bytes, input_bytes, fixed_bytes, budget_bytes)``: the largest every."""
    for (n, block, inp, fixed, budget), truth in zip(_every_cases(), EVERY_ANSWERS, strict=True):
        got = fn(n, block, inp, fixed, budget)
        expect(exactly(got, truth),
               f"choose_every(n_layers={n}, block_bytes={block}, input_bytes={inp}, "
               f"fixed_bytes={fixed}, budget_bytes={budget}) returned {got!r}, expected {truth!r}",
               hint="every=k checkpoints blocks 0, k, 2k, ... (ceil(n/k) blocks, each keeping its "
                    "input); the others keep everything; the rebuild of a checkpointed block adds "
                    "block - input only if it is the last block (k divides n - 1): before the "
                    "others are rebuilt, the blocks after them are freed; the largest k that fits "
                    "recomputes least; None if none fits")


def _front_cases() -> list[list]:
    """The public cases of :func:`check_pareto_front`: five chosen, twenty from a seeded draw."""
    rng = random.Random(7)
    cases = [[(10, 1.0, "none"), (4, 1.3, "full"), (6, 1.1, "half"), (7, 1.2, "worse")],
             [(5, 1.0, "a"), (5, 1.2, "same memory, slower"), (3, 1.2, "b")],
             [(5, 1.0, "a"), (6, 1.0, "same time, more memory"), (1, 2.0, "c")],
             [(2, 2.0, "only")], []]
    for _ in range(20):  # distinct (memory, time) pairs, so that the order is unique
        pairs = {(rng.randint(1, 9), rng.randint(1, 9) / 4) for _ in range(rng.randint(2, 10))}
        cases.append([(m, t, f"p{i}") for i, (m, t) in enumerate(sorted(pairs, key=str))])
    return cases


#: The labels of the front of each of :func:`_front_cases` (sorted by memory, then time).
FRONT_ANSWERS = [
    ["full", "half", "none"], ["b", "a"], ["c", "a"], ["only"], [], ["p0", "p2"], ["p0"],
    ["p0", "p4"], ["p0", "p3"], ["p0", "p1", "p2"], ["p0"], ["p0", "p1"], ["p0", "p3"],
    ["p0", "p1", "p4"], ["p0", "p1"], ["p0"], ["p0"], ["p0", "p1"], ["p0", "p3"],
    ["p0", "p1", "p2"], ["p0", "p2"], ["p0", "p1"], ["p0", "p1", "p4"], ["p0", "p2"], ["p0"],
]


@grader
def check_pareto_front(fn):
    """``fn(points)`` -> the non-dominated ``(memory, time, label)`` points, sorted by memory."""
    for points, labels in zip(_front_cases(), FRONT_ANSWERS, strict=True):
        by_label = {p[2]: p for p in points}
        truth = [by_label[label] for label in labels]
        got = fn(list(points))
        expect(isinstance(got, list) and exactly(got, truth),
               f"pareto_front({points}) returned {got!r}, expected {truth}",
               hint="drop a point when another has memory <= and time <= and is strictly better on "
                    "at least one; sort what remains by memory (then time)")


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _residual_blocks(width: int, p: float) -> torch.nn.Module:
    """Two MLP sublayers, ``x + dropout(W2 gelu(W1 LayerNorm(x)) + b, p)``, each ending in the
    course's bias-dropout-add kernel, as in lecture 05."""
    from course_lib.model.fused import bias_dropout_add

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width, bias=False)
            self.bias = torch.nn.Parameter(0.1 * torch.randn(width))

        def forward(self, x):
            h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
            return bias_dropout_add(h, self.bias, x, p)

    return torch.nn.Sequential(Residual(), Residual())


@grader
def check_kernel_policy(policy):
    """``policy(ctx, op, *args, **kwargs)`` saves the course kernel's output, recomputes the rest.

    Checked op by op, then on two MLP sublayers ending in the bias-dropout-add kernel,
    checkpointed as one region: it must keep one ``b x s x h`` tensor more than saving nothing
    (the first kernel's output; the second's is the region's output), rerun no kernel, and rerun
    every matmul.
    """
    from course_lib.training.checkpointing import ATTENTION_OPS
    from course_lib.training.policies import policy_cost

    kernel = torch.ops.course.bias_dropout_add.default
    _expect_policy(policy, (kernel,), _SAVE, "MUST_SAVE",
                   "the op a policy sees is the OpOverload torch.ops.course.bias_dropout_add."
                   "default; the packet torch.ops.course.bias_dropout_add never equals it")
    _expect_policy(policy, (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                            _aten.gelu.default, _aten.native_layer_norm.default, _aten.add.Tensor,
                            _aten.native_dropout.default, *ATTENTION_OPS), _RECOMPUTE,
                   "PREFER_RECOMPUTE", "save the kernel's output only: every other op, the "
                   "matmuls included, runs again in the backward pass")
    batch, seq, width = 2, 8, 16
    kept, runs = {}, {}
    for name, each in (("yours", policy), ("nothing saved", _recompute_all)):
        torch.default_generator.manual_seed(0)
        blocks = _residual_blocks(width, 0.25)
        cost = policy_cost(blocks, torch.randn(batch, seq, width, requires_grad=True), policy=each)
        kept[name], runs[name] = cost.kept_bytes, cost.recomputed
    # Independent of the engine: the first kernel's output is b x s x h fp32 elements.
    output_bytes = batch * seq * width * 4
    extra = kept["yours"] - kept["nothing saved"]
    expect(extra == output_bytes, f"your policy keeps {extra} bytes more than saving nothing, "
           f"expected {output_bytes} (the first kernel's {batch} x {seq} x {width} fp32 output)",
           hint="return MUST_SAVE for the kernel's OpOverload only")
    expect(runs["yours"][kernel] == 0, f"the kernel ran {runs['yours'][kernel]} time(s) in the "
           "backward pass", hint="a saved output is not recomputed: save the kernel's")
    matmul = _aten.addmm.default
    expect(runs["yours"][matmul] == runs["nothing saved"][matmul] > 0,
           f"the backward pass reran addmm {runs['yours'][matmul]} time(s), expected "
           f"{runs['nothing saved'][matmul]}", hint="recompute the matmuls: save the kernel only")
