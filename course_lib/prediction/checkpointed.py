"""04-05: what checkpointing keeps and what it costs, predicted tensor by tensor.

The checkpointing modes themselves (:func:`course_lib.training.checkpointing.enable_checkpointing`, the
segments, the op-level policies' saved ops) are training tools; this module predicts, for a mode
of :data:`course_lib.training.checkpointing.ALL_MODES`, the tensors each block keeps between the forward
and the backward pass (exact bytes, from the saved-tensor rules of
:mod:`course_lib.prediction.activations`) and the FLOPs a step runs with its recompute.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import torch

from course_lib.device import resolve_gpu
from course_lib.docstrings import fill_doc
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.prediction import activations as act
from course_lib.training.checkpointing import (
    ALL_MODES,
    SELECTIVE_MODES,
    check_kernel_mode,
    check_mode,
    checkpointed_regions,
)
from course_lib.units import dtype_bytes
from course_lib.validation import fields


def _selective_outputs(config: GPTConfig, b: int, s: int, t, mode: str = "selective") -> list:
    """What ``selective`` mode keeps inside one block: the outputs of its matmuls and of a fused
    attention kernel (:data:`course_lib.training.checkpointing.SAVE_OPS`), but the MLP's
    output unless dropout follows it; in ``save-kernel`` mode the course kernel's output too."""
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
    """One block with its attention core checkpointed: the core keeps only its inputs q, k, v (views
    of the one QKV output) and, for fused kernels, its output (the out-projection's input)."""
    core = act.core_items(config, b, s, t)
    kept = [item for item in act.block_items(config, b, s, t) if item not in core]
    kept.append(act.Saved("checkpoint", "core inputs q, k, v: the QKV output",
                          (b, s, 3 * config.d_model), t.compute))
    kept += [item for item in core if item.op.startswith("sdpa/")
             and item.what.startswith("output")]
    return kept


def kept_layout(config: GPTConfig, batch_size: int, mode: str, every: int, segments: int | None,
            seq_len: int | None, dtype, gpu, autocast: bool = False):
    """``(embed, per_block, head, regions, full_block)``: the items kept by the embeddings, by
    each block (blocks inside a ``sqrt`` segment but its first keep nothing) and by the head;
    the checkpointed regions; one block's items without checkpointing."""
    check_config(config)
    seq_len = config.seq_len if seq_len is None else seq_len
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


# The arguments that the predictions below share, described once
# (:func:`course_lib.docstrings.fill_doc`).
_POLICY_ARGS = """\
config (GPTConfig): the course GPT's shape.
batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
mode (str): one of :data:`ALL_MODES` (:data:`KERNEL_MODES` for ``config.fused_mlp`` only).
every (int): in ``blocks``, ``selective``, ``attention`` and the kernel modes, checkpoint
    blocks 0, every, 2*every, ... (:func:`checkpointed_blocks`).
"""
_KERNEL_ARGS = """\
segments (int, optional): in ``sqrt`` mode, the number of segments (default
    :func:`course_lib.training.checkpointing.sqrt_segments`), from 1 to ``n_layers``.
seq_len (int, optional): tokens per sequence, at most ``config.seq_len`` (None: that).
dtype (torch.dtype or str): the activations' dtype (fp32, bf16, fp16); with
    ``autocast``, the autocast dtype.
gpu (str or GPU, optional): None for the CPU's kernels, or what
    :func:`course_lib.device.resolve_gpu` takes.
autocast (bool): the forward pass runs under ``torch.autocast`` in ``dtype``.
"""


@fill_doc(policy_args=_POLICY_ARGS, kernel_args=_KERNEL_ARGS)
def kept_by_block(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                  segments: int | None = None, seq_len: int | None = None, dtype=torch.float32,
                  gpu=None, autocast: bool = False) -> list[list]:
    """What each transformer block keeps under ``mode``: one list of storages per block.

    Built from :mod:`course_lib.prediction.activations` (one :class:`~course_lib.prediction.activations.Saved`
    per storage). A checkpointed block keeps its input ``(b, s, h)`` only; a
    ``sqrt`` segment keeps its first block's input (its other blocks nothing), the
    last segment everything; ``selective`` keeps the input and the outputs of the matmuls and of a
    fused attention kernel (:data:`course_lib.training.checkpointing.SAVE_OPS`; the MLP's output only under dropout), and
    ``save-kernel`` the course kernel's output too; ``attention``
    keeps everything but the attention core's own tensors.

    Args:
        {policy_args}
        {kernel_args}

    Returns:
        list of list: per block, the :class:`~course_lib.prediction.activations.Saved` items it keeps.

    Raises:
        ValueError: naming the parameter, for a bad value (``segments`` outside ``sqrt`` mode
            included).
    """
    return kept_layout(config, batch_size, mode, every, segments, seq_len, dtype, gpu, autocast)[1]


def kept_items(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
               segments: int | None = None, seq_len: int | None = None, dtype=torch.float32,
               gpu=None, autocast: bool = False) -> list:
    """The storages ``GPT(config)`` keeps from forward to backward under ``mode``."""
    embed, per_block, head, _, _ = kept_layout(config, batch_size, mode, every, segments, seq_len,
                                           dtype, gpu, autocast)
    return [*embed, *(item for items in per_block for item in items), *head]


@fill_doc(policy_args=_POLICY_ARGS, kernel_args=_KERNEL_ARGS)
def predict_kept_bytes(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                       segments: int | None = None, seq_len: int | None = None,
                       dtype=torch.float32, gpu=None, autocast: bool = False) -> int:
    """Bytes held between forward and backward under ``mode`` (token ids, targets, logits excluded).

    The sum of :func:`kept_items` as the device allocates it (rounded per storage on a GPU).
    Per-block checkpointing of ``L`` blocks keeps ``L * b*s*h`` elements instead of ``L``
    times :func:`course_lib.prediction.activations.block_saved_bytes`; ``sqrt`` with ``k`` segments keeps
    ``(k - 1)`` inputs plus the last ``L - (k-1)*(L//k)`` blocks whole (Chen et al. 2016,
    section 4).

    Args:
        {policy_args}
        {kernel_args}

    Returns:
        int: bytes.

    Raises:
        ValueError: naming the parameter, for a bad value (``segments`` outside ``sqrt`` mode
            included).
    """
    gpu = resolve_gpu(gpu)
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

    ``A`` is one block's items without checkpointing, ``X`` what a checkpointed block keeps
    (its ``(b, s, h)`` input), both from :func:`kept_by_block`, as the device allocates them.
    The ratio :func:`course_lib.training.checkpointing.best_segments` needs. Lecture 04, section 3.

    Args:
        config (GPTConfig): the course GPT's shape.
        batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len`` (None: that).
        dtype (torch.dtype or str): the activations' dtype (fp32, bf16, fp16); with
            ``autocast``, the autocast dtype.
        gpu (str or GPU, optional): None for the CPU's kernels, or what
            :func:`course_lib.device.resolve_gpu` takes.
        autocast (bool): the forward pass runs under ``torch.autocast`` in ``dtype``.

    Returns:
        float: the ratio, above 1.

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    kw = dict(seq_len=seq_len, dtype=dtype, gpu=gpu, autocast=autocast)
    one = dataclasses.replace(config, n_layers=1)
    gpu = resolve_gpu(gpu)
    plain = act.total_bytes(kept_by_block(one, batch_size, "none", **kw)[0], act.STEP_KINDS, gpu)
    kept = act.total_bytes(kept_by_block(one, batch_size, "blocks", **kw)[0], act.STEP_KINDS, gpu)
    return plain / kept


@dataclass(frozen=True)
class CheckpointCost:
    """Predicted cost of one forward+backward of the GPT under a checkpointing mode (bytes, FLOPs);
    the peak of the whole step is :func:`course_lib.prediction.predict.predict`'s."""

    mode: str
    kept_bytes: int
    flops: int
    flops_plain: int

    def __post_init__(self):
        fields(self, mode=ALL_MODES, kept_bytes=int, flops=int, flops_plain=int)
        if not 0 < self.flops_plain <= self.flops:  # a step computes; recomputing adds to it
            raise ValueError(f"CheckpointCost.flops_plain must be from 1 to flops={self.flops}, "
                             f"got {self.flops_plain}")

    @property
    def flop_ratio(self) -> float:
        """``flops / flops_plain``: 1.33 is one more forward pass; wall time follows it only
        where the step is compute-bound."""
        return self.flops / self.flops_plain


@fill_doc(policy_args=_POLICY_ARGS, kernel_args=_KERNEL_ARGS)
def step_flops(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
               segments: int | None = None, seq_len: int | None = None, dtype=torch.float32,
               gpu=None, autocast: bool = False) -> tuple[int, int]:
    """``(flops, recomputed)``: FLOPs of forward + backward + recomputation, and the recomputation's.

    Counted as ``torch.utils.flop_counter.FlopCounterMode`` counts them (2 per
    multiply-add, matmuls and attention kernels only). Forward: each block's
    linears ``24*b*s*h^2`` and its attention core ``4*b*s^2*h`` (the full
    ``s x s`` square although it is causal), the LM head ``2*b*s*h*V``; the
    backward pass costs twice the forward, except a fused attention kernel,
    counted at 2.5x (it recomputes the scores). ``FlopCounterMode`` has no formula
    for the CPU flash kernel (``sdpa`` on the CPU without dropout): 0 there.

    Recomputation: a region reruns its forward only up to the last tensor its
    backward needs (``torch.utils.checkpoint`` stops early): autograd saves an op's
    inputs before it runs, and without dropout nothing saves the output of a region's
    last linear (the MLP's output projection, ``8*b*s*h^2``), so it is not rerun;
    ``attention`` reruns ``Q K^T`` (``P V``'s output is not saved) or the whole fused
    kernel; ``selective`` reruns no matmul and no attention kernel (their outputs are kept;
    the MLP's output, when not kept, is past the point where the recomputation stops).
    ``gpu`` (None: the CPU) decides the attention kernel (:func:`course_lib.model.kernels.sdpa_kernel`).

    Args:
        {policy_args}
        {kernel_args}

    Returns:
        tuple of int: ``(flops, recomputed)``, FLOPs.

    Raises:
        ValueError: naming the parameter, for a bad value (``segments`` outside ``sqrt`` mode
            included).
    """
    check_config(config)
    L = config.n_layers
    segments = check_mode(mode, every, segments, L)
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, t = act.prediction_args(config, batch_size, seq_len, dtype, gpu, autocast)
    h = config.d_model
    kernel = kernels.attention_kernel(config, t.compute, t.gpu)
    linears, core, head = 24 * b * s * h * h, 4 * b * s * s * h, 2 * b * s * h * config.vocab_size
    core_backward = 2 * core if kernel in ("explicit", "math") else 5 * core // 2
    if t.gpu is None and kernel == "flash":
        core = core_backward = 0
    plain = L * (3 * linears + core + core_backward) + 3 * head
    regions = checkpointed_regions(L, mode, every, segments)
    if mode in ("blocks", "sqrt"):
        tail = 0 if config.dropout > 0 else 8 * b * s * h * h
        extra = sum(len(r) * (linears + core) - tail for r in regions)
    elif mode == "attention":
        extra = len(regions) * (core // 2 if kernel in ("explicit", "math") else core)
    else:  # none; selective keeps every matmul and attention output it would rerun
        extra = 0
    return plain + extra, extra


@fill_doc(policy_args=_POLICY_ARGS, kernel_args=_KERNEL_ARGS)
def checkpoint_cost(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                    segments: int | None = None, seq_len: int | None = None,
                    dtype=torch.float32, gpu=None, autocast: bool = False) -> CheckpointCost:
    """Predicted kept bytes and compute of ``mode`` for ``GPT(config)``: a :class:`CheckpointCost`.

    Args:
        {policy_args}
        {kernel_args}

    Returns:
        CheckpointCost: kept bytes, FLOPs with and without the recomputation.

    Raises:
        ValueError: naming the parameter, for a bad value (``segments`` outside ``sqrt`` mode
            included).
    """
    options = dict(segments=segments, seq_len=seq_len, dtype=dtype, gpu=gpu, autocast=autocast)
    flops, extra = step_flops(config, batch_size, mode, every, **options)
    return CheckpointCost(mode, predict_kept_bytes(config, batch_size, mode, every, **options),
                          flops, flops - extra)
