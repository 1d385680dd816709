"""Gradient accumulation: one batch's gradient, computed micro-batch by micro-batch.

A batch of ``B`` samples is cut into ``K = B / b`` micro-batches whose gradients add up before one
optimizer step, so activation memory follows ``b``, not ``B``. The sum is the full batch's
gradient only if each micro-batch's loss carries the right weight (``normalize``):

* ``"tokens"`` (correct): each micro-batch's summed token loss over ``N``, the batch's tokens;
* ``"mean-of-means"``: each micro-batch's mean over ``K``: with padding it over-weights short
  micro-batches (Hugging Face ``transformers``' Trainer until v4.46, pull request #34191);
* ``"sum-of-means"``: the means summed, the division by ``K`` forgotten: ``K`` times too large.

The losses are cross-entropy over ``model(inputs)`` logits (a tuple's first item); a course GPT on
the chunked loss (:func:`course_lib.training.levers.use_chunked_loss`) gives its own mean.
:func:`course_lib.training.loop.train` weights each micro-batch with :func:`micro_batch_loss`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: How a loss over micro-batches is normalised: by tokens (right), or two of the bugs.
NORMALIZATIONS = ("tokens", "mean-of-means", "sum-of-means")
#: Token ids and ``ignore_index`` are int64 values.
INT64 = (-(2**63), 2**63 - 1)


def micro_batch_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                     normalize: str = "tokens", total_tokens: int | None = None,
                     accumulation_steps: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """The share of checked arguments whose ``backward()`` adds this micro-batch's gradient:
    ``S_k / N`` (``"tokens"``), ``(S_k / n_k) / K`` (``"mean-of-means"``) or ``S_k / n_k``."""
    if getattr(model, "loss_chunk", None) is not None:  # no (N, V) logits: the model's own mean
        mean = model(inputs, targets, ignore_index=ignore_index)[1]
        summed = mean * (targets != ignore_index).sum()
    else:
        logits = model(inputs)
        logits = logits[0] if isinstance(logits, tuple | list) else logits
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                 ignore_index=ignore_index, reduction="sum")
    if normalize == "tokens":
        return summed / total_tokens
    n_k = int((targets != ignore_index).sum())
    if n_k == 0:
        raise ValueError(f"a micro-batch holds no target tokens: its mean loss is 0/0 "
                         f"(normalize={normalize!r}); use normalize='tokens'")
    mean = summed / n_k
    return mean / accumulation_steps if normalize == "mean-of-means" else mean
