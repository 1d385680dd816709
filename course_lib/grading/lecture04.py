"""Checks for exercises/04_activation_checkpointing.ipynb.

What each block keeps is measured against a reference calling ``torch.utils.checkpoint`` itself;
the segment counts' answers, measured on real steps (``course_tools/hidden.py``,
``tests/test_grading_truths.py``), are written out.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.utils.checkpoint import checkpoint

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.training.checkpointing import measure_kept_bytes

from . import exactly, expect, grader, observe

_BLOCKS_CONFIG = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=3,
                           dropout=0.1)


def _blocks_case():
    """The case's model (seeded) and batch."""
    torch.default_generator.manual_seed(0)
    model = GPT(_BLOCKS_CONFIG)
    return model, random_tokens(_BLOCKS_CONFIG, 4, seed=1)


def _checkpoint_each(blocks, x):
    """The reference block loop: ``checkpoint(block, x, use_reentrant=False)`` for each."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def _blocks_grads(model, x, y):
    """The parameters' gradients of one seeded step (dropout draws the same masks each time)."""
    torch.default_generator.manual_seed(3)
    model(x, y)[1].backward()
    return [p.grad for p in model.parameters()]


def _blocks_run(fn) -> dict:
    """Run the model with ``fn`` as its block loop (beside the learner's code): gradients with
    dropout on, bytes kept for backward, whether blocks get gradients from an input without grad."""
    model, (x, y) = _blocks_case()
    model.run_blocks = lambda h: fn(model.blocks, h)
    grads = _blocks_grads(model, x, y)
    kept = measure_kept_bytes(model, x, y)
    for p in model.parameters():
        p.grad = None
    out = fn(model.blocks, torch.randn(2, 16, 32))
    requires_grad = bool(getattr(out, "requires_grad", False))
    if requires_grad:
        out.sum().backward()
    return {"grads": grads, "kept": kept, "out_requires_grad": requires_grad,
            "blocks_grads": all(p.grad is not None for p in model.blocks.parameters())}


@grader
def check_checkpoint_blocks(fn):
    """``fn(blocks, x)`` runs the blocks in order, each one a separate non-reentrant checkpoint."""
    plain, (x, y) = _blocks_case()
    run = observe(_blocks_run, fn)

    # 1. Same loss and gradients as the plain model, dropout on (independent: no checkpoint at all).
    truth = _blocks_grads(copy.deepcopy(plain), x, y)
    grads = run["grads"]
    expect(isinstance(grads, list) and len(grads) == len(truth)
           and all(g is not None for g in grads), "some parameters got no gradient",
           hint="return the output of the last block; checkpoint(block, x, use_reentrant=False)")
    expect(all(isinstance(a, torch.Tensor) and a.shape == b.shape
               and torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, truth)),
           "the gradients differ from those of the model without checkpointing (dropout is on)",
           hint="keep checkpoint's default preserve_rng_state=True, so that dropout draws the "
                "same masks when a block is rebuilt")

    # 2. It really checkpoints, block by block: only one (b, s, h) input per block stays kept.
    reference = copy.deepcopy(plain)  # each block its own non-reentrant checkpoint, written out
    reference.run_blocks = functools.partial(_checkpoint_each, reference.blocks)
    kept = run["kept"]
    truth, plain_kept = (measure_kept_bytes(m, x, y) for m in (reference, plain))
    expect(not exactly(kept, plain_kept),
           f"the model keeps {kept:,} bytes between forward and backward, as "
           "many as without checkpointing", hint="call torch.utils.checkpoint.checkpoint on each block")
    expect(exactly(kept, truth),
           f"the model keeps {kept:,} bytes between forward and backward; checkpointing "
           f"each block separately keeps {truth:,}",
           hint="one checkpoint per block (not one around the whole loop): each keeps its input")

    # 3. Inputs that do not require grad (a frozen embedding): the blocks must still get gradients.
    expect(run["out_requires_grad"] is True, "with an input that does not require grad, the "
           "output does not require grad either: the blocks' weights would get no gradient",
           hint="use_reentrant=False; the reentrant implementation only tracks the inputs")
    expect(run["blocks_grads"] is True,
           "with an input that does not require grad, the blocks' weights got no gradient",
           hint="use_reentrant=False")


#: The model and batch of :func:`check_choose_segments`.
SEGMENTS_CONFIG = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=16)
SEGMENTS_BATCH = 8

#: ``(budget bytes, segment count or None)``, answered from real steps of ``GPT(SEGMENTS_CONFIG)``
#: (``course_tools/hidden.py`` keeps their peaks and FLOPs): below the smallest peak, at it, at
#: the next, at the peaks of 4, 3 and 9 segments, and twice the largest.
SEGMENT_CASES = [(3959319, None), (3959320, 16), (4261656, 15), (5398168, 13), (5990168, 12),
                 (7247640, 9), (22457904, 1)]


@grader
def check_choose_segments(fn):
    """``fn(config, batch_size, budget)``: of the segment counts whose predicted step fits
    ``budget`` bytes, the one with the least recomputation (fewer on a tie), else None."""
    config, batch = SEGMENTS_CONFIG, SEGMENTS_BATCH
    for budget, want in SEGMENT_CASES:
        got = fn(config, batch, budget)
        expect(exactly(got, want),
               f"choose_segments(config, {batch}, budget={budget:,}) returned {got!r}, "
               f"expected {want!r}",
               hint="try every segment count from 1 to config.n_layers: keep those whose "
                    "predict(Step(config, batch_size, mode='sqrt', segments=k)).total is at "
                    "most the budget (<=), return the one with the fewest step_flops (neither "
                    "memory nor time is monotonic in k), or None if none fits")
