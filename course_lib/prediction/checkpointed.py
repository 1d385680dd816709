"""04-05: what checkpointing keeps and what it costs, predicted tensor by tensor.

For a mode of :data:`course_lib.training.checkpointing.ALL_MODES` (the modes themselves are
training tools), the tensors each block keeps between the forward and the backward pass (exact
bytes, from :mod:`course_lib.prediction.activations`) and the FLOPs a step runs with its
recompute.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import torch

from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.prediction import activations as act
from course_lib.training.checkpointing import (
    SELECTIVE_MODES,
    check_kernel_mode,
    check_mode,
    checkpointed_regions,
)
from course_lib.units import dtype_bytes


def _selective_outputs(config: GPTConfig, b: int, s: int, t, mode: str = "selective") -> list:
    """What a selective mode keeps inside one block (:data:`ckpt.SAVE_OPS`' outputs)."""
    h, a, dtype = config.d_model, config.n_heads, t.compute
    items = [act.Saved("qkv (addmm)", "output", (b, s, 3 * h), dtype)]
    kernel = kernels.attention_kernel(config, dtype, t.gpu)
    if kernel in ("explicit", "math"):  # attention written with bmm: both outputs are kept
        inner = torch.float32 if kernel == "math" and dtype_bytes(dtype) == 2 else dtype
        items += [act.Saved("q @ k^T (bmm)", "scores", (b, a, s, s), inner),
                  act.Saved("probs @ v (bmm)", "output", (b, s, h), inner)]
    else:  # a fused kernel: its output and log-sum-exp, what its backward reads
        items += [item for item in act.core_items(config, b, s, t) if item.op.startswith("sdpa/")]
    items += [act.Saved("attn proj (addmm)", "output", (b, s, h), dtype),
              act.Saved("mlp fc (mm)" if config.fused_mlp else "mlp fc (addmm)", "output",
                        (b, s, 4 * h), dtype)]
    if mode == "save-kernel":  # the kernel's output, the MLP's out-projection's input
        items.append(act.Saved("bias_gelu (course kernel)", "output", (b, s, 4 * h), dtype))
    if config.dropout > 0:  # the recomputation reruns the dropout, which needs it
        items.append(act.Saved("mlp proj (addmm)", "output", (b, s, h), dtype))
    return items


def _attention_recomputed_block(config: GPTConfig, b: int, s: int, t) -> list:
    """One block with its attention core checkpointed: the core keeps its inputs only."""
    core = act.core_items(config, b, s, t)
    kept = [item for item in act.block_items(config, b, s, t) if item not in core]
    kept.append(act.Saved("checkpoint", "core inputs q, k, v: the QKV output",
                          (b, s, 3 * config.d_model), t.compute))
    kept += [item for item in core if item.op.startswith("sdpa/")
             and item.what.startswith("output")]
    return kept


def kept_layout(config: GPTConfig, batch_size: int, mode: str, every: int, segments: int | None,
                seq_len: int | None, dtype, gpu, autocast: bool = False):
    """``(embed, per_block, head, regions, full_block)``: what each part keeps under ``mode``."""
    b, s, t = act.prediction_args(config, batch_size, seq_len, dtype, gpu, autocast)
    embed, head = act.embedding_items(config, b, s, t), act.head_items(config, b, s, t)
    block = act.block_items(config, b, s, t)
    L = config.n_layers
    segments = check_mode(mode, every, segments, L)
    check_kernel_mode(mode, config)
    block_input = [act.Saved("checkpoint", "block input", (b, s, config.d_model), t.stream)]
    regions = checkpointed_regions(L, mode, every, segments)
    if mode in SELECTIVE_MODES:
        wrapped = block_input + _selective_outputs(config, b, s, t, mode)
    elif mode == "attention":
        wrapped = _attention_recomputed_block(config, b, s, t)
    else:
        wrapped = block_input
    per_block = [block] * L
    for region in regions:
        per_block[region[0]] = wrapped
        for i in region[1:]:
            per_block[i] = []
    return embed, per_block, head, regions, block


def kept_by_block(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                  segments: int | None = None, seq_len: int | None = None, dtype=torch.float32,
                  gpu=None, autocast: bool = False) -> list[list]:
    """What each transformer block keeps under ``mode``: one list of
    :class:`~course_lib.prediction.activations.Saved` per block.

    A checkpointed block keeps its ``(b, s, h)`` input; a ``sqrt`` segment its first block's
    input, the last segment everything; ``selective`` the input and the outputs of
    :data:`course_lib.training.checkpointing.SAVE_OPS`, ``save-kernel`` the course kernel's
    output too; ``attention`` all but the core's own tensors.
    Args:
        config, batch_size, seq_len, dtype, gpu, autocast: as :func:`.activations.block_saved`.
        mode (str): one of :data:`ALL_MODES` (the kernel modes need ``config.fused_mlp``).
        every (int): checkpoint blocks 0, every, 2*every, ...
        segments (int, optional): ``sqrt`` mode's segments (None: about ``sqrt(n_layers)``).
    Returns:
        list of list: per block, the :class:`.activations.Saved` items it keeps.
    """
    return kept_layout(config, batch_size, mode, every, segments, seq_len, dtype, gpu, autocast)[1]


def predict_kept_bytes(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                       segments: int | None = None, seq_len: int | None = None,
                       dtype=torch.float32, gpu=None, autocast: bool = False) -> int:
    """Bytes held between forward and backward under ``mode`` (token ids, targets, logits excluded),
    as the device allocates them. ``sqrt`` with ``k`` segments keeps ``k - 1`` inputs plus the
    last ``L - (k-1)*(L//k)`` blocks whole (Chen et al. 2016, section 4).
    Args:
        config, batch_size, mode, every, segments, seq_len, dtype, gpu, autocast: as kept_by_block.
    Returns:
        int: the bytes.
    """
    embed, per_block, head, _, _ = kept_layout(config, batch_size, mode, every, segments, seq_len,
                                               dtype, gpu, autocast)
    # Blocks of one kind share one list of items: sum each kind once (planners call this often).
    counts = collections.Counter(id(items) for items in per_block)
    kinds = {id(items): items for items in per_block}
    return (act.total_bytes(embed + head, act.STEP_KINDS, gpu)
            + sum(n * act.total_bytes(kinds[k], act.STEP_KINDS, gpu) for k, n in counts.items()))


def block_ratio(config: GPTConfig, batch_size: int, *, seq_len: int | None = None,
                dtype=torch.float32, gpu=None, autocast: bool = False) -> float:
    """``A / X``: the bytes a plain block keeps for backward over those of its input.

    ``A`` is one block's items without checkpointing, ``X`` what a checkpointed block keeps,
    both as the device allocates them: the ratio
    :func:`course_lib.training.checkpointing.best_segments` needs (lecture 04, section 3).
    Args:
        config, batch_size, seq_len, dtype, gpu, autocast: as :func:`kept_by_block`.
    Returns:
        float: ``A / X``.
    """
    check_config(config)
    kw = dict(seq_len=seq_len, dtype=dtype, gpu=gpu, autocast=autocast)
    one = dataclasses.replace(config, n_layers=1)
    plain, kept = (act.total_bytes(kept_by_block(one, batch_size, mode, **kw)[0], act.STEP_KINDS,
                                   gpu) for mode in ("none", "blocks"))
    return plain / kept


@dataclass(frozen=True)
class _CheckpointCost:
    """Predicted kept bytes and FLOPs of one forward+backward under a checkpointing mode."""

    mode: str
    kept_bytes: int
    flops: int
    flops_plain: int

    @property
    def flop_ratio(self) -> float:
        """``flops / flops_plain``: 1.33 is one more forward pass."""
        return self.flops / self.flops_plain


def step_flops(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
               segments: int | None = None, seq_len: int | None = None, dtype=torch.float32,
               gpu=None, autocast: bool = False) -> tuple[int, int]:
    """``(flops, recomputed)``: FLOPs of forward + backward + recomputation, and the recomputation's.

    As ``torch.utils.flop_counter.FlopCounterMode`` counts them (matmuls and attention): per
    block ``24*b*s*h^2`` of linears and ``4*b*s^2*h`` of attention, the head ``2*b*s*h*V``;
    backward twice the forward (a fused attention kernel 2.5x); the CPU flash kernel 0. A rerun
    stops at the last tensor the backward pass needs: without dropout a region's last linear
    (``8*b*s*h^2``) is not rerun; ``attention`` reruns ``Q K^T`` or the fused kernel;
    ``selective`` no matmul and no attention kernel.
    Args:
        config, batch_size, mode, every, segments, seq_len, dtype, gpu, autocast: as kept_by_block.
    Returns:
        tuple of int: ``(flops, recomputed)``.
    """
    b, s, t = act.prediction_args(config, batch_size, seq_len, dtype, gpu, autocast)
    L, h = config.n_layers, config.d_model
    segments = check_mode(mode, every, segments, L)
    kernel = kernels.attention_kernel(config, t.compute, t.gpu)
    linears, core, head = 24 * b * s * h * h, 4 * b * s * s * h, 2 * b * s * h * config.vocab_size
    core_backward = 2 * core if kernel in ("explicit", "math") else 5 * core // 2
    if t.gpu is None and kernel == "flash":
        core = core_backward = 0
    plain = L * (3 * linears + core + core_backward) + 3 * head
    regions = checkpointed_regions(L, mode, every, segments)
    extra = 0  # none; selective keeps every matmul and attention output it would rerun
    if mode in ("blocks", "sqrt"):
        tail = 0 if config.dropout > 0 else 8 * b * s * h * h
        extra = sum(len(r) * (linears + core) - tail for r in regions)
    elif mode == "attention":
        extra = len(regions) * (core // 2 if kernel in ("explicit", "math") else core)
    return plain + extra, extra


def checkpoint_cost(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                    segments: int | None = None, seq_len: int | None = None,
                    dtype=torch.float32, gpu=None, autocast: bool = False) -> _CheckpointCost:
    """Predicted kept bytes (:func:`predict_kept_bytes`) and FLOPs with and without the
    recomputation (:func:`step_flops`) of ``mode`` for ``GPT(config)``, and their ``flop_ratio``.
    Args:
        config, batch_size, mode, every, segments, seq_len, dtype, gpu, autocast: as kept_by_block.
    Returns:
        _CheckpointCost: its ``mode``, ``kept_bytes``, ``flops``, ``flops_plain``, ``flop_ratio``.
    """
    options = dict(segments=segments, seq_len=seq_len, dtype=dtype, gpu=gpu, autocast=autocast)
    flops, extra = step_flops(config, batch_size, mode, every, **options)
    return _CheckpointCost(mode, predict_kept_bytes(config, batch_size, mode, every, **options),
                           flops, flops - extra)
