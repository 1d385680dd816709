"""08: the other levers, beyond the precision, accumulation, checkpointing and sharding of 01-07.

The chunked loss (Liger Kernel; Wijmans et al. 2024, "Cut Your Losses"), 8- and 4-bit AdamW
states (torchao; Dettmers et al. 2022; Li et al. 2023) and LoRA (Hu et al. 2021). The optimizer
step in backward and activation offloading are hooks a learner writes: lecture 08 writes them.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn as nn

from course_lib.model.gpt import BLOCK_SHAPES, GPTConfig, check_config
from course_lib.units import storage_bytes
from course_lib.validation import (
    MAX_COUNT,
    integer,
    items,
    optional_positive_int,
    positive_int,
    tensor as check_tensor,
)

#: The largest tokens or chunk rows any function here takes.
MAX_TOKENS = MAX_COUNT


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``, ``chunk`` rows at a time (log-sum-exp kept)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index):
        n, wide = hidden.size(0), torch.promote_types(hidden.dtype, torch.float32)
        valid = targets != ignore_index
        count = valid.sum()  # a tensor: int() would make a GPU step wait for the device
        lse = torch.empty(n, dtype=wide, device=hidden.device)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for i in range(0, n, chunk):
            z = (hidden[i:i + chunk] @ weight.t()).to(wide)  # (c, V), at least fp32
            t, v = targets[i:i + chunk], valid[i:i + chunk]
            picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)  # the target's logit
            top = z.amax(dim=1)  # log-sum-exp in place: no second (c, V) buffer
            rows = z.sub_(top.unsqueeze(1)).exp_().sum(dim=1).log_().add_(top)
            del z
            lse[i:i + chunk] = rows
            total += ((rows - picked) * v).sum()
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total / count  # 0/0 = nan when every target is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse, count = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.size(0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad_loss / count
        for i in range(0, n, chunk):
            h, t = hidden[i:i + chunk], targets[i:i + chunk]
            z = (h @ weight.t()).to(lse.dtype)
            z.sub_(lse[i:i + chunk].unsqueeze(1)).exp_()              # softmax, in place
            z.scatter_add_(1, t.clamp(min=0).unsqueeze(1),
                           torch.full((t.numel(), 1), -1.0, dtype=z.dtype, device=z.device))
            z.mul_(((t != ctx.ignore_index) * scale).unsqueeze(1))    # ignored rows: 0
            g = z.to(hidden.dtype)
            del z
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[i:i + chunk])
            if grad_weight is not None:
                grad_weight.addmm_(g.t(), h)
            del g
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` without ever holding all of them.

    ``F.cross_entropy`` keeps the ``(N, V)`` log-softmax (fp32, ``4 N V`` bytes) and allocates two
    more such buffers in its backward pass. Here the forward pass keeps each row's log-sum-exp
    (``4 N`` bytes) and the backward pass recomputes ``chunk_size x V`` logits at a time: same
    loss and gradients, for one more ``hidden @ weight.T`` (``2 N h V`` FLOPs).

    Args:
        hidden (torch.Tensor): ``(N, h)`` or ``(B, T, h)`` final hidden states.
        weight (torch.Tensor): the ``(V, h)`` LM head weight.
        targets (torch.Tensor): ``(N,)`` or ``(B, T)`` target ids.
        chunk_size (int): rows of logits computed at a time.
        ignore_index (int): the target value that is not a token.
    Returns:
        torch.Tensor: the 0-d mean loss (fp32, or fp64), nan if all targets are ignored.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> import torch.nn.functional as F
        >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
        >>> t = torch.tensor([1, 2, 3, -100, 5, 9])
        >>> torch.allclose(chunked_cross_entropy(h, w, t, chunk_size=4),
        ...                F.cross_entropy(h @ w.T, t))
        True
    """
    chunk_size = positive_int("chunk_size", chunk_size, maximum=MAX_TOKENS)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3) \
            or not hidden.is_floating_point():
        raise ValueError("hidden must be a float tensor of shape (N, h) or (B, T, h), got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    h = hidden.size(-1)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.size(1) != h:
        raise ValueError(f"weight must be a (V, {h}) tensor, got "
                         f"{tuple(getattr(weight, 'shape', ())) or type(weight).__name__}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    check_tensor("targets", targets, integral=True)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden's without "
                         f"its last dimension), got {tuple(targets.shape)}")
    ignore_index = integer("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)
    return _ChunkedCrossEntropy.apply(hidden.reshape(-1, h), weight, targets.reshape(-1),
                                      chunk_size, ignore_index)


def _chunked_forward(model, idx, targets=None, ignore_index=-100):
    """The course GPT's forward with the loss of :func:`chunked_cross_entropy`: ``(None, loss)``."""
    if targets is None:
        return type(model).forward(model, idx)
    T = idx.size(1)
    if T > model.config.seq_len:
        raise ValueError(f"sequence length {T} exceeds config.seq_len={model.config.seq_len}")
    pos = torch.arange(T, device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    hidden = model.ln_f(model.run_blocks(x))
    loss = chunked_cross_entropy(hidden, model.lm_head.weight, targets, model.loss_chunk,
                                 ignore_index)
    return None, loss


def use_chunked_loss(model: nn.Module, chunk_size: int | None) -> nn.Module:
    """Switch a course GPT, per instance, to :func:`chunked_cross_entropy` (None: back);
    ``model(idx, targets)`` then returns ``(None, loss)``."""
    if not isinstance(model, nn.Module) or not hasattr(model, "lm_head") \
            or not hasattr(model, "ln_f"):
        raise ValueError(f"model must be a course GPT (with lm_head and ln_f), got {type(model)}")
    chunk_size = optional_positive_int("chunk_size", chunk_size, maximum=MAX_TOKENS)
    model.__dict__.pop("forward", None)
    model.loss_chunk = chunk_size
    if chunk_size is not None:
        model.forward = _chunked_forward.__get__(model)
    return model


def _flat_tensors(value) -> list[torch.Tensor]:
    """The plain tensors that hold ``value``: a tensor subclass's inner tensors, recursively."""
    if not isinstance(value, torch.Tensor):
        return []
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None or type(value) in (torch.Tensor, nn.Parameter):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [t for name in names for t in _flat_tensors(getattr(value, name))]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of an optimizer's state, measured from its tensors, each storage once.

    ``optimizer.state`` and ``optimizer.master`` (the fp32 copies of
    :class:`course_lib.training.mixed_precision.MasterWeightAdamW`); a quantized state (torchao's
    ``OptimState8bit``) counts its inner tensors (codes, scales, map); step counters included.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer, after its first step.
    Returns:
        int: the bytes of its state.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    state = getattr(optimizer, "state", None)
    if not hasattr(state, "values"):
        raise ValueError(f"optimizer must have a .state mapping, got {type(optimizer).__name__}")
    tensors = [t for s in state.values() for v in s.values() for t in _flat_tensors(v)]
    tensors += [t for m in getattr(optimizer, "master", ()) for t in _flat_tensors(m)]
    return storage_bytes(tensors)


#: torchao's block-wise quantized AdamW by bits: elements per fp32 scale, fp32 map entries.
_LOW_BIT = {8: {"block": 256, "qmap": 256}, 4: {"block": 128, "qmap": 16}}


def low_bit_state_bytes(numels: list[int], bits: int, *, param_bytes: int = 4) -> int:
    """Predicted bytes of AdamW's ``m`` and ``v`` (and step counters) with ``bits``-bit states.

    torchao (``AdamW8bit``/``AdamW4bit``) quantizes a state tensor of at least 4096 elements whose
    block size divides them: ``n x bits / 8`` bytes of codes, an fp32 scale per block (256 for
    8-bit, 128 for 4-bit) and an fp32 map (256 or 16 entries). Smaller tensors keep ``m`` and
    ``v`` in ``param_bytes``; ``bits=32`` is plain AdamW. Each tensor adds a 4-byte ``step``. Per
    large parameter: 8-bit 2.03 bytes, 4-bit 1.06, fp32 8, as :func:`optimizer_state_bytes`
    measures after the first step.
    Args:
        numels (list): each parameter tensor's elements.
        bits (int): 32, 8 or 4.
        param_bytes (int): bytes per element of a state kept unquantized.
    Returns:
        int: the predicted bytes.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (32, 8, 4):
        raise ValueError(f"bits must be one of (32, 8, 4), got {bits!r}")
    param_bytes = positive_int("param_bytes", param_bytes, maximum=8)
    total = 0
    for n in items("numels", numels):
        n = positive_int("numels", n, maximum=MAX_COUNT)  # an int: the sum stays exact
        total += 4  # the step counter
        spec = _LOW_BIT.get(bits)
        if spec and n >= 4096 and n % spec["block"] == 0:
            total += 2 * (n * bits // 8 + 4 * (n // spec["block"]) + 4 * spec["qmap"])
        else:
            total += 2 * n * param_bytes
    return total


def low_bit_adamw(bits: int):
    """torchao's ``AdamW8bit`` (``bits=8``) or ``AdamW4bit`` (``bits=4``) class.

    Imported on first use, its import-time messages about CUDA-only extensions silenced (an
    ``ImportError`` without torchao). Its step is ``torch.compile``-d per shape; lecture 08 runs it
    eagerly, under ``torch.compiler.set_stance("force_eager")``.
    Args:
        bits (int): 8 or 4.
    Returns:
        type: the optimizer class.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    # what torchao logs of the CUDA-only extensions it cannot load, and torch of an Enum it
    # registers: quiet for this import only, and nothing else's logging with them
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim import AdamW4bit, AdamW8bit
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return AdamW8bit if bits == 8 else AdamW4bit


#: The linear layers of a course GPT block LoRA can adapt (:data:`course_lib.model.gpt.BLOCK_SHAPES`).
_LORA_TARGETS = tuple(name for name, _, _ in BLOCK_SHAPES)


def lora_parameter_count(config: GPTConfig, rank: int,
                         targets: tuple[str, ...] = _LORA_TARGETS) -> int:
    """Trainable parameters of LoRA adapters of ``rank`` on every block's ``targets`` linears.

    An adapter beside a frozen ``W`` (``out x in``) adds ``B @ A``: ``rank x (in + out)``
    parameters (Hu et al. 2021, section 4.1); ``16 h rank`` per block with all four linears.

    Args:
        config (GPTConfig): the model's shape.
        rank (int): the adapters' rank, at most ``config.d_model``.
        targets (tuple): the adapted linears of each block, names of ``BLOCK_SHAPES``.
    Returns:
        int: the trainable parameters.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> lora_parameter_count(GPTConfig(d_model=64, n_layers=2), 8)  # 2 * 16 * 64 * 8
        16384
    """
    check_config(config)
    rank = positive_int("rank", rank, maximum=config.d_model)
    if (not isinstance(targets, tuple | list) or not targets
            or any(not isinstance(t, str) or t not in _LORA_TARGETS for t in targets)):
        raise ValueError(f"targets must be a non-empty tuple of {_LORA_TARGETS}, got {targets!r}")
    h = config.d_model
    per_block = sum(rank * (i * h + o * h) for name, i, o in BLOCK_SHAPES if name in targets)
    return config.n_layers * per_block


def frozen_linear_flops(config: GPTConfig, n_tokens: int) -> int:
    """FLOPs a frozen model skips in its backward pass: the weight gradients of its matmuls.

    ``2 N in out`` per linear: ``2 N x 12 h^2`` per block, ``2 N h V`` for the tied LM head.
    Args:
        config (GPTConfig): the model's shape.
        n_tokens (int): tokens in the batch.
    Returns:
        int: the FLOPs skipped.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    N, h = positive_int("n_tokens", n_tokens, maximum=MAX_TOKENS), config.d_model
    per_block = sum(i * o for _, i, o in BLOCK_SHAPES) * h * h  # 12 h^2
    return 2 * N * (config.n_layers * per_block + h * config.vocab_size)
