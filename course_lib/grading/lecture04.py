"""Checks for exercises/04_activation_checkpointing.ipynb.

The truths do not come from ``course_lib.training.checkpointing`` or the memory engine,
which the exercises use: what checkpointing each block keeps is measured on a
reference that calls ``torch.utils.checkpoint`` itself, and the segment counts'
step peaks and FLOPs were measured on real steps (kept by the grader,
``course_tools/hidden.py``; the public cases' answers are written out here because the
exercise's answer comes from the engine, pure arithmetic, and must not move when a
learner's torch differs; ``tests/test_grading_truths.py`` measures the steps again).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.training.checkpointing import measure_kept_bytes

from . import exactly, expect, grader, observe, seed_cpu


def _per_block_reference(blocks, x):
    """The reference: each block its own non-reentrant checkpoint, written out."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


_BLOCKS_CONFIG = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=3,
                           dropout=0.1)


def _blocks_case():
    """The case's model (seeded) and batch."""
    seed_cpu(0)
    model = GPT(_BLOCKS_CONFIG)
    return model, random_tokens(_BLOCKS_CONFIG, 4, seed=1)


def _blocks_grads(model, x, y):
    seed_cpu(3)
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
    """``fn(blocks, x)`` runs the blocks in order, each one a separate non-reentrant checkpoint.

    Args:
        fn (callable): the learner's ``checkpoint_blocks``, called as above.
    """
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
    reference = copy.deepcopy(plain)
    reference.run_blocks = lambda h: _per_block_reference(reference.blocks, h)
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

#: ``(budget bytes, segment count or None)``: the public cases of :func:`check_choose_segments`,
#: answered from steps of ``GPT(SEGMENTS_CONFIG)`` measured on real tensors (peak bytes and
#: FLOPs of every segment count, kept by the grader, ``course_tools/hidden.py``): below the
#: smallest peak, at it, at the next, at the peaks of 4, 3 and 9 segments, and twice the
#: largest; written out.
SEGMENT_CASES = [(3959319, None), (3959320, 16), (4261656, 15), (5398168, 13), (5990168, 12),
                 (7247640, 9), (22457904, 1)]


@grader
def check_choose_segments(fn):
    """``fn(config, batch_size, budget)``: the cheapest segment count that fits ``budget``.

    Of the segment counts whose predicted step peak (the engine's ``total``) fits ``budget``
    bytes, the one with the least recomputation (fewer segments on a tie), else None.

    Args:
        fn (callable): the learner's ``choose_segments``, called as above.
    """
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
