"""Checks for exercises/04_activation_checkpointing.ipynb."""

from __future__ import annotations

import copy

import torch

from .. import checkpointing as ckpt
from ..engine import predict_step_memory
from ..models import GPT, GPTConfig, random_tokens
from . import expect, grader


@grader
def check_checkpoint_blocks(fn):
    """``fn(blocks, x)`` runs the blocks in order, each one a separate non-reentrant checkpoint."""
    config = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=3, dropout=0.1)
    plain = GPT(config)
    model = copy.deepcopy(plain)
    model.run_blocks = lambda x: fn(model.blocks, x)
    x, y = random_tokens(config, 4)

    # 1. Same loss and gradients as the plain model, dropout on (independent: no checkpoint at all).
    grads = []
    for m in (plain, model):
        torch.manual_seed(3)
        loss = m(x, y)[1]
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    expect(all(g is not None for g in grads[1]), "some parameters got no gradient",
           hint="return the output of the last block; checkpoint(block, x, use_reentrant=False)")
    expect(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads)),
           "the gradients differ from those of the model without checkpointing (dropout is on)",
           hint="keep checkpoint's default preserve_rng_state=True, so that dropout draws the "
                "same masks when a block is rebuilt")

    # 2. It really checkpoints, block by block: only one (b, s, h) input per block stays kept.
    kept, truth = ckpt.measure_kept_bytes(model, x, y), ckpt.predict_kept_bytes(config, 4, "blocks")
    plain_kept = ckpt.predict_kept_bytes(config, 4, "none")
    expect(kept != plain_kept, f"the model keeps {kept:,} bytes between forward and backward, as "
           "many as without checkpointing", hint="call torch.utils.checkpoint.checkpoint on each block")
    expect(kept == truth, f"the model keeps {kept:,} bytes between forward and backward; checkpointing "
           f"each block separately keeps {truth:,}",
           hint="one checkpoint per block (not one around the whole loop): each keeps its input")

    # 3. Inputs that do not require grad (a frozen embedding): the blocks must still get gradients.
    for p in model.parameters():
        p.grad = None
    out = fn(model.blocks, torch.randn(2, 16, 32))
    expect(out.requires_grad, "with an input that does not require grad, the output does not "
           "require grad either: the blocks' weights would get no gradient",
           hint="use_reentrant=False; the reentrant implementation only tracks the inputs")
    out.sum().backward()
    expect(all(p.grad is not None for p in model.blocks.parameters()),
           "with an input that does not require grad, the blocks' weights got no gradient",
           hint="use_reentrant=False")


@grader
def check_choose_segments(fn):
    """``fn(config, batch_size, budget)``: of the segment counts whose predicted step peak (the
    engine's ``total``) fits ``budget`` bytes, the one with the least recomputation (fewer
    segments on a tie), else None."""
    config = GPTConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=16)
    batch = 8
    flops = {k: ckpt.step_flops(config, batch, "sqrt", segments=k)[0] for k in range(1, 17)}
    peak = {k: predict_step_memory(config, batch, mode="sqrt", segments=k).total
            for k in range(1, 17)}

    def truth(budget):
        fits = [k for k in peak if peak[k] <= budget]
        return min(fits, key=lambda k: (flops[k], k)) if fits else None

    peaks = sorted(set(peak.values()))
    budgets = [peaks[0] - 1, peaks[0], peaks[1], peak[4], peak[3], 20 * 10**6, 2 * peaks[-1]]
    for budget in budgets:
        want, got = truth(budget), fn(config, batch, budget)
        expect(got == want, f"choose_segments(config, {batch}, budget={budget:,}) returned {got!r}, "
               f"expected {want!r}",
               hint="try every segment count from 1 to config.n_layers: keep those whose "
                    "predict_step_memory(config, batch_size, mode='sqrt', segments=k).total is at "
                    "most the budget (<=), return the one with the fewest step_flops (neither "
                    "memory nor time is monotonic in k), or None if none fits")
