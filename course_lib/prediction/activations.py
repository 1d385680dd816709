"""02: exactly which tensors the course GPT saves for backward, op by op, on the CPU or a GPU.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.1) count ``s*b*h*(34 + 5*a*s/h)`` bytes per layer for a 16-bit transformer
(:func:`course_lib.prediction.formulas.transformer_activation_bytes`). This module counts op
by op for *our* :class:`course_lib.model.gpt.GPT`, so that the prediction equals
:func:`course_lib.measurement.memory.saved_bytes` to the byte: lists of :class:`Saved`, one
per distinct storage (a storage several ops save appears once), summed in bytes. The memory
engine (:mod:`course_lib.prediction.engine`) builds a whole step's peak on these lists.

Shapes: ``b`` batch, ``s`` sequence, ``h`` d_model, ``a`` heads, ``d = h/a``, ``V``
vocabulary. What each op keeps:

* LayerNorm: its input (``bsh`` elements) and, per token, the mean and 1/std;
* ``nn.Linear`` (``addmm``, or ``mm`` without bias): its input; the weight is a parameter;
* GELU: its input (the ``bs4h`` output of the first MLP matmul);
* dropout (``p > 0``): its mask;
* explicit attention: copies of ``q`` and ``k`` (``q @ k^T``), the scale as a 0-d float64
  host tensor (8 bytes), the ``s x s`` causal mask (bool), softmax's output, dropout's mask,
  the dropped probabilities and a copy of ``v``;
* fused attention (``F.scaled_dot_product_attention``): as its kernel
  (:func:`course_lib.model.kernels.sdpa_kernel`).

Where it runs (``gpu``: None for the CPU, a preset of :data:`course_lib.device.GPUS`, "cuda",
a :class:`~course_lib.device.GPU`) decides the dtypes of masks and LayerNorm statistics and
the attention kernel (:mod:`course_lib.model.kernels`). Under ``torch.autocast``
(``autocast=True``, ``dtype`` the autocast dtype) the parameters and residual stream stay
fp32, every linear keeps a 16-bit copy of its input and of its weight, and on CUDA explicit
attention's softmax returns fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.docstrings import fill_doc
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.prediction.target import Target
from course_lib.units import dtype_bytes
from course_lib.validation import (
    MAX_BATCH,
    positive_int,
)

_INDEX = torch.int64
_FP32 = torch.float32


@dataclass(frozen=True)
class Saved:
    """One storage autograd keeps for backward: which op saves it, what it is, its shape and dtype.

    ``kind`` (:data:`KINDS`): "activation", "input" (token ids and targets, allocated before the
    step), "weight copy" (autocast's 16-bit weight a matmul saves) or "scalar" (a 0-d host tensor).
    Made by the engine from checked inputs, tens of thousands per planner search: not checked again.
    """

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
        items (list of Saved): what a ``*_saved`` function returned.
        kinds (tuple of str): the kinds to count, of :data:`KINDS`.
        gpu (str or GPU, optional): None (exact bytes), or what
            :func:`course_lib.device.resolve_gpu` takes.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming ``items`` (not a list or tuple of :class:`Saved`), ``kinds`` (not a
            tuple or list of :data:`KINDS`) or ``gpu``.
    """
    if not isinstance(items, list | tuple) or not all(isinstance(i, Saved) for i in items):
        raise ValueError(f"items must be a list of course_lib.prediction.activations.Saved, got "
                         f"{type(items).__name__}")
    if kinds is not KINDS and (not isinstance(kinds, tuple | list)
                               or not all(isinstance(k, str) and k in KINDS for k in kinds)):
        raise ValueError(f"kinds must be a tuple of {KINDS}, got {kinds!r}")
    gpu = resolve_gpu(gpu)
    return sum(kernels.allocated(item.nbytes, gpu) for item in items if item.kind in kinds)


# --------------------------------------------------------------------------- validation

def prediction_args(config, batch_size, seq_len, dtype, gpu, autocast=False, *,
                    names=("batch_size", "seq_len")) -> tuple[int, int, Target]:
    """Every argument of a prediction checked and its :class:`Target` resolved once:
    ``(batch_size, seq_len, target)``; the prediction wing passes the target inward from here."""
    check_config(config)
    batch_size = positive_int(names[0], batch_size, maximum=MAX_BATCH)  # an int from here: a
    seq_len = positive_int(names[1], seq_len)  # numpy int would overflow in the products below
    if seq_len > config.seq_len:
        raise ValueError(f"{names[1]} must be at most config.seq_len={config.seq_len}, "
                         f"got {seq_len}")
    return batch_size, seq_len, Target.resolve(dtype, gpu, autocast)


# --------------------------------------------------------------------------- building blocks

def layernorm_items(name: str, b: int, s: int, h: int, t: Target) -> list[Saved]:
    """``native_layer_norm`` keeps its input (in ``t.stream``) and the per-token mean and 1/std
    (``rstd``, in ``t.stats``)."""
    return [Saved(name, "input", (b, s, h), t.stream),
            Saved(name, "mean", (b, s, 1), t.stats),
            Saved(name, "rstd", (b, s, 1), t.stats)]


def linear_items(name: str, what: str, b: int, s: int, n_in: int, n_out: int,
                  t: Target) -> list[Saved]:
    """A linear keeps its input; under autocast a 16-bit copy of it and of its weight."""
    if not t.autocast:
        return [Saved(name, f"input ({what})", (b, s, n_in), t.compute)]
    return [Saved(name, f"input: 16-bit copy of {what}", (b, s, n_in), t.compute),
            Saved(name, "weight: 16-bit copy (autocast cache)", (n_out, n_in), t.compute,
                  kind="weight copy")]


def _dropout_saved(name: str, shape: tuple, p: float, dtype: torch.dtype,
                   t: Target) -> list[Saved]:
    """Dropout with ``p > 0`` on input of ``dtype`` keeps its mask
    (:func:`course_lib.model.kernels.mask_dtype`); ``p = 0`` keeps nothing."""
    return [Saved(name, "mask", shape, t.mask(dtype))] if p > 0 else []


def core_items(config: GPTConfig, b: int, s: int, t: Target,
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

    The ``q``, ``k``, ``v`` views into the QKV output are ``(b, a, s, d)`` with
    the heads transposed; a matmul needs them as ``(b*a, s, d)`` batches and
    copies them (``3*bsh`` elements) unless ``b == 1`` or ``a == 1``, when the
    batches are views and the one QKV output storage (also ``3*bsh``) is kept.

    Which SDPA kernel runs decides the rest (Dao et al. 2022, FlashAttention: recompute inside
    a kernel): ``math``, the reference, keeps the ``b*a*s*s`` probabilities (fp32 for 16-bit
    input); ``flash``, ``efficient`` and ``cudnn`` keep only their output and a per-row
    log-sum-exp (fp32, ``b*a*s``; padded to 32 rows by ``efficient``), and rebuild the
    probabilities in their backward pass from q, k, v and the log-sum-exp.

    Args:
        config (GPTConfig): the course GPT's shape.
        b (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        s (int): tokens per sequence, from 1 to ``config.seq_len``.
        dtype (torch.dtype or str): fp32, bf16 or fp16 (with ``autocast``, the autocast dtype).
        gpu (str or GPU, optional): None for the CPU's kernels, or what
            :func:`course_lib.device.resolve_gpu` takes.
        autocast (bool): the forward pass runs under ``torch.autocast`` in ``dtype``.
        kernel (str, optional): the SDPA kernel to count, one of
            :data:`course_lib.model.kernels.SDPA_KERNELS` (as ``torch.nn.attention.sdpa_kernel`` forces
            one); None: the one the target picks (:func:`course_lib.model.kernels.sdpa_kernel`), or the
            explicit attention for ``config.attention == "explicit"``.

    Returns:
        list of Saved: the saved storages, in forward order.

    Raises:
        ValueError: naming the parameter, for a bad value (``autocast=True`` needs a 16-bit
            ``dtype``; ``kernel`` not one of the SDPA kernels, or one that cannot run on this
            target: :func:`course_lib.model.kernels.forced_kernel`).
    """
    b, s, t = prediction_args(config, b, s, dtype, gpu, autocast, names=("b", "s"))
    return core_items(config, b, s, t, kernels.forced_kernel(kernel, config, t.compute, t.gpu))


def runs_fused_mlp(config: GPTConfig, t: Target) -> bool:
    """Whether the attention's output reaches the out-projection as one storage (a fused SDPA
    kernel, not the math kernel), so no contiguous copy of the merged heads is kept."""
    return config.attention == "sdpa" and kernels.sdpa_kernel(config, t.compute, t.gpu) != "math"


def block_items(config: GPTConfig, b: int, s: int, t: Target) -> list[Saved]:
    """:func:`block_saved` for checked sizes and a resolved target."""
    h, p = config.d_model, config.dropout
    items = layernorm_items("ln1", b, s, h, t)
    items += linear_items("qkv", "ln1's output", b, s, h, 3 * h, t)
    items += core_items(config, b, s, t)
    if not runs_fused_mlp(config, t):  # a fused kernel's output is the out-projection's input (one storage)
        items += linear_items("attn proj", "the merged heads, contiguous", b, s, h, h, t)
    elif t.autocast:  # the kernel's output is already 16-bit: only the weight is copied
        items += linear_items("attn proj", "", b, s, h, h, t)[1:]
    # The course's bias-dropout-add keeps its seed, not a mask (config.fused_residual)
    resid_p = 0.0 if config.fused_residual else p
    items += _dropout_saved("attn resid dropout", (b, s, h), resid_p, t.compute, t)
    items += layernorm_items("ln2", b, s, h, t)
    items += linear_items("mlp fc", "ln2's output", b, s, h, 4 * h, t)
    if config.fused_mlp:  # the course kernel keeps its inputs: x @ W.T and the bias
        items.append(Saved("bias_gelu", "input x (fc's x @ W.T)", (b, s, 4 * h), t.compute))
        if t.autocast:  # the fp32 bias cast to the 16-bit matmul output's dtype
            items.append(Saved("bias_gelu", "bias: 16-bit copy", (4 * h,), t.compute,
                               kind="weight copy"))
    else:
        items.append(Saved("gelu", "input (fc's output)", (b, s, 4 * h), t.compute))
    proj = linear_items("mlp proj", "gelu's output", b, s, 4 * h, h, t)
    items += [replace(proj[0], what="input (gelu's output)"), *proj[1:]]
    items += _dropout_saved("mlp dropout", (b, s, h), resid_p, t.compute, t)
    return items


# The shape arguments of every count below, described once (:func:`course_lib.docstrings.fill_doc`).
_SHAPE_ARGS = """\
config (GPTConfig): the course GPT's shape (its ``attention`` and ``dropout`` too).
batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
seq_len (int, optional): tokens per sequence, from 1 to ``config.seq_len`` (None: that).
dtype (torch.dtype or str): the model's dtype, fp32, bf16 or fp16; with ``autocast``,
    the autocast dtype (16-bit) of a model kept in fp32.
gpu (str or GPU, optional): None for the CPU's kernels, or what
    :func:`course_lib.device.resolve_gpu` takes (a name of :data:`course_lib.device.GPUS`,
    "cuda", a ``GPU``).
autocast (bool): the forward pass runs under ``torch.autocast`` in ``dtype``.
"""


@fill_doc(shape_args=_SHAPE_ARGS)
def block_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                dtype=torch.float32, gpu=None, *, autocast: bool = False) -> list[Saved]:
    """Every storage one transformer ``Block`` keeps for backward, in forward order.

    ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``: LayerNorm 1 (input, mean,
    rstd); the QKV linear's input; the attention core; the out-projection's
    input; its dropout mask; LayerNorm 2; the MLP: first linear's input, GELU's
    input, second linear's input (GELU's output), dropout mask. Residual adds keep nothing.
    Under autocast each linear also keeps a 16-bit copy of its weight. With
    ``config.fused_mlp`` the course kernel keeps its input ``x @ W.T`` where GELU kept
    ``fc``'s output (the same bytes), and under autocast a 16-bit copy of the bias. With
    ``config.fused_residual`` the two residual dropouts keep no mask (the kernel keeps a seed).

    Args:
        {shape_args}

    Returns:
        list of Saved: the saved storages of one block.

    Raises:
        ValueError: naming the parameter, for a bad value (``autocast=True`` needs a 16-bit
            ``dtype``).
    """
    seq_len = check_config(config).seq_len if seq_len is None else seq_len
    b, s, t = prediction_args(config, batch_size, seq_len, dtype, gpu, autocast)
    return block_items(config, b, s, t)


def embedding_items(config: GPTConfig, b: int, s: int, t: Target) -> list[Saved]:
    """Token and position embeddings keep their indices (int64); the dropout after them its mask."""
    return [Saved("tok_emb", "token ids (the input)", (b, s), _INDEX, kind="input"),
            Saved("pos_emb", "positions (arange)", (s,), _INDEX),
            *_dropout_saved("emb dropout", (b, s, config.d_model), config.dropout, t.stream, t)]


def head_items(config: GPTConfig, b: int, s: int, t: Target) -> list[Saved]:
    """Final LayerNorm, the tied LM head's input, and ``cross_entropy(logits.float(), targets)``:
    ``log_softmax``'s fp32 output, the targets, ``nll_loss``'s 0-d ``total_weight``."""
    h, V = config.d_model, config.vocab_size
    return [*layernorm_items("ln_f", b, s, h, t),
            *linear_items("lm_head", "ln_f's output", b, s, h, V, t),
            Saved("log_softmax", "output, also nll_loss's input", (b * s, V), _FP32),
            Saved("nll_loss", "targets", (b * s,), _INDEX, kind="input"),
            Saved("nll_loss", "total_weight", (), _FP32)]


def _model_items(config: GPTConfig, b: int, s: int, t: Target) -> list[Saved]:
    """Everything the whole GPT keeps for ``loss.backward()``: embeddings, blocks, head, loss."""
    return [*embedding_items(config, b, s, t), *(block_items(config, b, s, t) * config.n_layers),
            *head_items(config, b, s, t)]


@fill_doc(shape_args=_SHAPE_ARGS)
def block_saved_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                      dtype=torch.float32, gpu=None, *, autocast: bool = False) -> int:
    """Bytes one block keeps for backward: the sum of :func:`block_saved`.

    Args:
        {shape_args}

    Returns:
        int: bytes, exact (not rounded to allocator blocks).

    Raises:
        ValueError: naming the parameter, for a bad value (``autocast=True`` needs a 16-bit
            ``dtype``).
    """
    return total_bytes(block_saved(config, batch_size, seq_len, dtype, gpu, autocast=autocast))


@fill_doc(shape_args=_SHAPE_ARGS)
def predict_saved_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                        dtype=torch.float32, gpu=None, *, autocast: bool = False) -> int:
    """Bytes the whole model keeps for backward, token ids and targets included.

    Equals ``course_lib.measurement.memory.saved_bytes(loss, model.parameters())`` for
    ``GPT(config).to(dtype)`` in training mode on the CPU (or ``GPT(config)`` under
    ``torch.autocast("cpu", dtype)`` with ``autocast=True``), to the byte.

    Args:
        {shape_args}

    Returns:
        int: bytes, summed over the embeddings, every block (:func:`block_saved`), the head.

    Raises:
        ValueError: naming the parameter, for a bad value (``autocast=True`` needs a 16-bit
            ``dtype``).

    Example:
        >>> predict_saved_bytes(GPTConfig(), 2)  # measured: memory.saved_bytes
        1256964
    """
    seq_len = check_config(config).seq_len if seq_len is None else seq_len
    return total_bytes(_model_items(config, *prediction_args(config, batch_size, seq_len, dtype,
                                                             gpu, autocast)))


def korthikanti_terms(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                      dtype=torch.bfloat16, gpu=None) -> dict[str, int]:
    """Where one block departs from Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)`` bytes.

    The paper's setting: explicit attention, dropout on, 16-bit activations
    (``config.attention`` is taken as "explicit"). The differences, in bytes:

    * ``"dropout masks"``: the paper counts 1 byte per mask element (two ``sbh``
      masks and one ``as^2b``); on the CPU masks have the activation's dtype (2 bytes);
    * ``"layernorm stats"``: mean and 1/std per token of both LayerNorms (``4sb``
      values), which the paper leaves out; fp32 on CUDA, the activation dtype on the CPU;
    * ``"causal mask"``: the ``s^2`` bool mask that ``masked_fill`` keeps;
    * ``"scale scalar"``: the 8-byte float64 tensor holding ``1/sqrt(d)``.

    Args:
        config (GPTConfig): the course GPT's shape, with ``dropout > 0``.
        batch_size (int): sequences b, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        seq_len (int, optional): tokens s, from 1 to ``config.seq_len`` (None: that).
        dtype (torch.dtype or str): a 16-bit dtype (bf16 or fp16).
        gpu (str or GPU, optional): None for the CPU's kernels, or what
            :func:`course_lib.device.resolve_gpu` takes.

    Returns:
        dict: bytes by name: ``"paper"`` (the formula), each difference above, and ``"block"``
        (:func:`block_saved_bytes`), with ``paper + differences == block``.

    Raises:
        ValueError: naming the parameter for a bad value, or without dropout or with fp32.
    """
    seq_len = check_config(config).seq_len if seq_len is None else seq_len
    b, s, t = prediction_args(config, batch_size, seq_len, dtype, gpu)
    if config.dropout == 0 or dtype_bytes(t.compute) != 2:
        raise ValueError("korthikanti_terms is for the paper's setting: config.dropout > 0 and a "
                         f"16-bit dtype, got dropout={config.dropout}, dtype={t.compute}")
    h, a = config.d_model, config.n_heads
    mask_extra = dtype_bytes(t.mask(t.compute)) - 1
    terms = {"paper": s * b * h * 34 + 5 * a * s * s * b,
             "dropout masks": (2 * s * b * h + a * s * s * b) * mask_extra,
             "layernorm stats": 4 * s * b * dtype_bytes(t.stats),
             "causal mask": s * s,
             "scale scalar": 8}
    terms["block"] = block_saved_bytes(replace(config, attention="explicit"), b, s, t.compute, t.gpu)
    return terms
