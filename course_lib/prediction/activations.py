"""02: exactly which tensors the course GPT saves for backward, op by op, on the CPU or a GPU.

Korthikanti et al. (2022) count ``s*b*h*(34 + 5*a*s/h)`` bytes per 16-bit layer; this module
counts op by op for *our* GPT, as lists of :class:`Saved` (one per storage), equal to
:func:`course_lib.measurement.memory.saved_bytes` to the byte. The GPU decides the dtypes of
masks and LayerNorm statistics and the attention kernel; under ``autocast`` (``dtype`` the
autocast dtype) the residual stream stays fp32 and each linear keeps 16-bit copies of its input
and weight.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.prediction.step import Step
from course_lib.units import as_dtype, dtype_bytes
from course_lib.validation import MAX_BATCH, boolean, positive_int

_INDEX = torch.int64
_FP32 = torch.float32
# The precision whose dtypes a (dtype, autocast) pair names.
_PRECISION_OF = {(torch.float32, False): "fp32", (torch.bfloat16, False): "bf16",
                 (torch.float16, False): "fp16-mixed", (torch.bfloat16, True): "autocast-bf16",
                 (torch.float16, True): "autocast-fp16"}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Saved:
    """One storage autograd keeps for backward: the op, what it is, its shape, dtype and ``kind``
    (:data:`KINDS`: "input" for token ids and targets, "weight copy" for autocast's, "scalar"
    for a 0-d host tensor)."""

    op: str
    what: str
    shape: tuple
    dtype: torch.dtype
    kind: str = "activation"

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: ``prod(shape) * dtype_bytes(dtype)``."""
        return math.prod(self.shape) * dtype_bytes(self.dtype)


#: The kinds of :class:`Saved` storage (its docstring says what each is).
KINDS = ("activation", "weight copy", "input", "scalar")
#: The kinds a training step allocates on the device (token ids existed before it; the
#: scalar lives on the host).
STEP_KINDS = ("activation", "weight copy")


def total_bytes(items: list[Saved], kinds: tuple = KINDS, gpu: GPU | None = None) -> int:
    """Sum of ``nbytes`` over the ``items`` whose ``kind`` is in ``kinds`` (default: all).

    With a ``gpu``, each storage counts as the CUDA allocator holds it (rounded up to 512 bytes,
    :func:`course_lib.model.kernels.allocated`).
    Args:
        items (list of Saved): the storages.
        kinds (tuple of str): the kinds counted.
        gpu (GPU, optional): the device whose allocator rounds (None: exact bytes).
    Returns:
        int: the bytes.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not isinstance(items, list | tuple) or not all(isinstance(i, Saved) for i in items):
        raise ValueError(f"items must be a list of course_lib.prediction.activations.Saved, got "
                         f"{type(items).__name__}")
    if kinds is not KINDS and (not isinstance(kinds, tuple | list)
                               or not all(isinstance(k, str) and k in KINDS for k in kinds)):
        raise ValueError(f"kinds must be a tuple of {KINDS}, got {kinds!r}")
    gpu = resolve_gpu(gpu)
    return sum(kernels.allocated(item.nbytes, gpu) for item in items if item.kind in kinds)


@functools.lru_cache(maxsize=64)
def _step_of(precision: str, gpu: GPU | None) -> Step:
    """The Step whose dtypes and device rules the items follow (its precision and GPU)."""
    return Step(GPTConfig(), precision=precision, gpu=gpu)


def prediction_args(config, batch_size, seq_len, dtype, gpu, autocast=False, *,
                    names=("batch_size", "seq_len")) -> tuple[int, int, Step]:
    """A count's arguments checked: ``(batch_size, seq_len, step)``, the step with the dtypes."""
    check_config(config)
    seq_len = config.seq_len if seq_len is None else seq_len
    batch_size = positive_int(names[0], batch_size, maximum=MAX_BATCH)  # an int from here: a
    seq_len = positive_int(names[1], seq_len)  # numpy int would overflow in the products below
    if seq_len > config.seq_len:
        raise ValueError(f"{names[1]} must be at most config.seq_len={config.seq_len}, "
                         f"got {seq_len}")
    dtype = as_dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
    boolean("autocast", autocast)
    if autocast and dtype == torch.float32:
        raise ValueError("autocast=True needs a 16-bit dtype (torch.bfloat16 or torch.float16)")
    return batch_size, seq_len, _step_of(_PRECISION_OF[dtype, autocast], resolve_gpu(gpu))


def _layernorm_items(name: str, b: int, s: int, h: int, t: Step) -> list[Saved]:
    """``native_layer_norm`` keeps its input and the per-token mean and 1/std (``rstd``)."""
    return [Saved(name, "input", (b, s, h), t.stream),
            Saved(name, "mean", (b, s, 1), t.stats),
            Saved(name, "rstd", (b, s, 1), t.stats)]


def _linear_items(name: str, what: str, b: int, s: int, n_in: int, n_out: int,
                  t: Step) -> list[Saved]:
    """A linear keeps its input; under autocast a 16-bit copy of it and of its weight."""
    if not t.autocast:
        return [Saved(name, f"input ({what})", (b, s, n_in), t.compute)]
    return [Saved(name, f"input: 16-bit copy of {what}", (b, s, n_in), t.compute),
            Saved(name, "weight: 16-bit copy (autocast cache)", (n_out, n_in), t.compute,
                  kind="weight copy")]


def _dropout_saved(name: str, shape: tuple, p: float, dtype: torch.dtype, t: Step) -> list[Saved]:
    """Dropout with ``p > 0`` keeps its mask (:func:`course_lib.model.kernels.mask_dtype`)."""
    return [Saved(name, "mask", shape, t.mask(dtype))] if p > 0 else []


def core_items(config: GPTConfig, b: int, s: int, t: Step,
               kernel: str | None = None) -> list[Saved]:
    """What the attention core keeps for backward (:func:`attention_core_saved`, unchecked)."""
    a, p, h, dtype = config.n_heads, config.dropout, config.d_model, t.compute
    probs = (b, a, s, s)
    if config.attention == "explicit" and kernel is None:
        soft = kernels.autocast_softmax_dtype(dtype, t.gpu) if t.autocast else dtype
        cast = soft != dtype  # CUDA autocast: probs @ v casts the fp32 probabilities back
        items = [Saved("q @ k^T", "q (heads as batches)", (b, s, h), dtype),
                 Saved("q @ k^T", "k^T (heads as batches)", (b, s, h), dtype),
                 Saved("* 1/sqrt(d)", "the scalar, a 0-d float64 tensor", (), torch.float64,
                       kind="scalar"),
                 Saved("masked_fill", "causal mask (~tril)", (s, s), torch.bool),
                 Saved("softmax", "probabilities" + ("" if p > 0 or cast else
                                                     ", also probs @ v's input"), probs, soft)]
        items += _dropout_saved("attn dropout", probs, p, soft, t)
        if p > 0 or cast:
            what = "dropped probabilities" if p > 0 else "probabilities"
            items.append(Saved("probs @ v", what + (": 16-bit copy" if cast else ""), probs, dtype))
        items.append(Saved("probs @ v", "v (heads as batches)", (b, s, h), dtype))
        return items
    kernel = kernel or kernels.sdpa_kernel(config, dtype, t.gpu)
    if kernel == "math":  # the reference kernel, computing in fp32
        inner = _FP32 if dtype in (torch.bfloat16, torch.float16) else dtype
        items = [Saved("sdpa/math: q @ k^T", "q * sqrt(scale) (heads as batches)", (b, s, h), inner),
                 Saved("sdpa/math: q @ k^T", "k * sqrt(scale) (heads as batches)", (b, s, h), inner),
                 Saved("sdpa/math: softmax", "probabilities" + ("" if p > 0 else
                                                                 ", also probs @ v's input"),
                       probs, inner)]
        if p > 0:
            items += [Saved("sdpa/math: dropout", "mask", probs, t.mask(inner)),
                      Saved("sdpa/math: probs @ v", "dropped probabilities", probs, inner)]
        # v is not scaled: in fp32 with b == 1 or a == 1 its batches are views of the QKV output.
        v_shape = (b, s, 3 * h) if inner == dtype and (b == 1 or a == 1) else (b, s, h)
        what = "v: QKV output storage (a view)" if v_shape[-1] == 3 * h else "v (heads as batches)"
        return items + [Saved("sdpa/math: probs @ v", what, v_shape, inner)]
    # Fused kernels keep q, k, v (views of the one QKV output storage), their output
    # (laid out (b, s, a, d), so the proj's input is a view of it), and per-row log-sum-exp.
    rows = 32 * math.ceil(s / 32) if kernel == "efficient" else s  # memory-efficient pads to 32
    items = [Saved("qkv", "QKV output, kept by sdpa as q, k and v", (b, s, 3 * h), dtype),
             Saved(f"sdpa/{kernel}", "output, also the out-projection's input", (b, s, h), dtype),
             Saved(f"sdpa/{kernel}", "logsumexp", (b, a, rows), _FP32)]
    if t.gpu is None:  # the CPU's flash kernel keeps no RNG state
        return items
    # CUDA kernels keep their dropout RNG's seed and offset, with or without dropout (measured
    # with PyTorch 2.11 on an H200): memory-efficient's on the host, cuDNN's and flash's on the GPU
    if kernel == "flash":
        return items + [Saved("sdpa/flash", "RNG seed and offset", (2,), torch.uint64),
                        Saved("sdpa/flash", "RNG slot, unused", (), torch.uint64)]
    kind = "scalar" if kernel == "efficient" else "activation"
    return items + [Saved(f"sdpa/{kernel}", f"RNG {what}", (), torch.int64, kind=kind)
                    for what in ("seed", "offset")]


def attention_core_saved(config: GPTConfig, b: int, s: int, dtype, gpu=None, *,
                         autocast: bool = False, kernel: str | None = None) -> list[Saved]:
    """What ``CausalSelfAttention.core(q, k, v)`` keeps, for ``config.attention`` and ``config.dropout``.

    The head views are copied into ``(b*a, s, d)`` batches for a matmul unless ``b == 1`` or
    ``a == 1``. ``math`` keeps the ``b*a*s*s`` probabilities (fp32 for 16-bit input); ``flash``,
    ``efficient`` and ``cudnn`` their output and a per-row fp32 log-sum-exp, and rebuild the
    probabilities in backward (Dao et al. 2022). ``kernel`` forces one of
    :data:`course_lib.model.kernels.SDPA_KERNELS` (None: the device's).
    Args:
        config, dtype, gpu, autocast: as :func:`block_saved`.
        b, s (int): sequences, and tokens per sequence.
        kernel (str, optional): the kernel, as above.
    Returns:
        list of Saved: the storages, in forward order.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    b, s, t = prediction_args(config, b, positive_int("s", s), dtype, gpu, autocast,
                              names=("b", "s"))
    return core_items(config, b, s, t, kernels.forced_kernel(kernel, config, t.compute, t.gpu))


def block_items(config: GPTConfig, b: int, s: int, t: Step) -> list[Saved]:
    """:func:`block_saved` for checked sizes."""
    h, p = config.d_model, config.dropout
    items = _layernorm_items("ln1", b, s, h, t)
    items += _linear_items("qkv", "ln1's output", b, s, h, 3 * h, t)
    items += core_items(config, b, s, t)
    # a fused SDPA kernel's output is the out-projection's input (one storage)
    if config.attention != "sdpa" or kernels.sdpa_kernel(config, t.compute, t.gpu) == "math":
        items += _linear_items("attn proj", "the merged heads, contiguous", b, s, h, h, t)
    elif t.autocast:  # the kernel's output is already 16-bit: only the weight is copied
        items += _linear_items("attn proj", "", b, s, h, h, t)[1:]
    # The course's bias-dropout-add keeps its seed, not a mask (config.fused_residual)
    resid_p = 0.0 if config.fused_residual else p
    items += _dropout_saved("attn resid dropout", (b, s, h), resid_p, t.compute, t)
    items += _layernorm_items("ln2", b, s, h, t)
    items += _linear_items("mlp fc", "ln2's output", b, s, h, 4 * h, t)
    if config.fused_mlp:  # the course kernel keeps its inputs: x @ W.T and the bias
        items.append(Saved("bias_gelu", "input x (fc's x @ W.T)", (b, s, 4 * h), t.compute))
        if t.autocast:  # the fp32 bias cast to the 16-bit matmul output's dtype
            items.append(Saved("bias_gelu", "bias: 16-bit copy", (4 * h,), t.compute,
                               kind="weight copy"))
    else:
        items.append(Saved("gelu", "input (fc's output)", (b, s, 4 * h), t.compute))
    proj = _linear_items("mlp proj", "gelu's output", b, s, 4 * h, h, t)
    items += [replace(proj[0], what="input (gelu's output)"), *proj[1:]]
    items += _dropout_saved("mlp dropout", (b, s, h), resid_p, t.compute, t)
    return items


def block_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                dtype=torch.float32, gpu=None, *, autocast: bool = False) -> list[Saved]:
    """Every storage one transformer ``Block`` keeps for backward, in forward order.

    LayerNorm 1 (input, mean, rstd), the QKV input, the attention core, the out-projection's
    input, its dropout mask, LayerNorm 2, the MLP's inputs and dropout mask; residual adds keep
    nothing. ``fused_mlp``: the course kernel keeps ``x @ W.T``; ``fused_residual``: a seed.
    Args:
        config (GPTConfig): the course GPT's shape (its ``attention`` and ``dropout`` too).
        batch_size, seq_len (int): sequences, and tokens per sequence (None: ``config.seq_len``).
        dtype (torch.dtype or str): fp32, bf16 or fp16; with ``autocast``, the autocast dtype.
        gpu (str or GPU, optional): None for the CPU's kernels, or what ``resolve_gpu`` takes.
        autocast (bool): the forward pass runs under ``torch.autocast`` in ``dtype``.
    Returns:
        list of Saved: the storages, in forward order.
    """
    b, s, t = prediction_args(config, batch_size, seq_len, dtype, gpu, autocast)
    return block_items(config, b, s, t)


def embedding_items(config: GPTConfig, b: int, s: int, t: Step) -> list[Saved]:
    """Token and position embeddings keep their indices (int64); the dropout after them its mask."""
    return [Saved("tok_emb", "token ids (the input)", (b, s), _INDEX, kind="input"),
            Saved("pos_emb", "positions (arange)", (s,), _INDEX),
            *_dropout_saved("emb dropout", (b, s, config.d_model), config.dropout, t.stream, t)]


def head_items(config: GPTConfig, b: int, s: int, t: Step) -> list[Saved]:
    """Final LayerNorm, the tied head's input, and the loss's fp32 log-softmax, targets, weight."""
    h, V = config.d_model, config.vocab_size
    return [*_layernorm_items("ln_f", b, s, h, t),
            *_linear_items("lm_head", "ln_f's output", b, s, h, V, t),
            Saved("log_softmax", "output, also nll_loss's input", (b * s, V), _FP32),
            Saved("nll_loss", "targets", (b * s,), _INDEX, kind="input"),
            Saved("nll_loss", "total_weight", (), _FP32)]


def _model_items(config: GPTConfig, b: int, s: int, t: Step) -> list[Saved]:
    """Everything the whole GPT keeps for ``loss.backward()``: embeddings, blocks, head, loss."""
    return [*embedding_items(config, b, s, t), *(block_items(config, b, s, t) * config.n_layers),
            *head_items(config, b, s, t)]


def predict_saved_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                        dtype=torch.float32, gpu=None, *, autocast: bool = False) -> int:
    """Bytes the whole model keeps for backward, token ids and targets included: equals
    ``course_lib.measurement.memory.saved_bytes`` of a training step on the CPU, to the byte.
    Args:
        config, batch_size, seq_len, dtype, gpu, autocast: as :func:`block_saved`.
    Returns:
        int: the bytes.
    Example:
        >>> predict_saved_bytes(GPTConfig(), 2)  # measured: memory.saved_bytes
        1256964
    """
    return total_bytes(_model_items(config, *prediction_args(config, batch_size, seq_len, dtype,
                                                             gpu, autocast)))
