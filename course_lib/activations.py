"""02: exactly which tensors the course GPT saves for backward, and the peak of a training step.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1) count ``s*b*h*(34 + 5*a*s/h)`` bytes per layer for a
16-bit transformer (:func:`course_lib.memory.transformer_activation_bytes`).
This module derives the same kind of count op by op for *our*
:class:`course_lib.models.GPT`, so that the prediction equals
:func:`course_lib.measure.saved_bytes` to the byte. Each function returns a list
of :class:`Saved` items, one per distinct storage autograd keeps; a storage that
several ops save (a view, or a tensor that is both one op's output and the next
one's input) appears once, and its ``what`` says who shares it. Sums are in bytes.

Shapes: ``b`` batch, ``s`` sequence, ``h`` d_model, ``a`` heads, ``d = h/a``,
``V`` vocabulary, ``e`` bytes of the model's dtype. What each op keeps:

* LayerNorm: its input (``bsh`` elements) and, per token, the mean and 1/std;
* ``nn.Linear`` (``addmm``, or ``mm`` without bias): its input; the weight is a parameter;
* GELU: its input (the ``bs4h`` output of the first MLP matmul);
* dropout (``p > 0``): its mask. On the CPU ``F.dropout`` multiplies by a scaled
  noise tensor of the input's dtype and saves that (``e`` bytes per element); on
  CUDA the fused ``native_dropout`` saves a ``bool`` mask (1 byte), as the paper assumes;
* explicit attention: ``q @ k^T`` reshapes the transposed head views into copies
  of ``q`` and ``k``; ``* (1/sqrt(d))`` saves the Python scalar as a 0-d float64
  tensor (8 bytes); ``masked_fill`` the ``s x s`` causal mask (bool); softmax its
  output; dropout its mask; ``probs @ v`` the dropped probabilities and a copy of ``v``;
* fused attention (``F.scaled_dot_product_attention``): which kernel runs decides it,
  see :func:`sdpa_kernel`.

What differs between devices (``device="cpu"`` is what the tests check to the
byte; ``"cuda"`` follows the CUDA kernels' documented outputs):

===========================  ============================  =================================
                             CPU                           CUDA
===========================  ============================  =================================
dropout mask                 dtype of the activation       bool, 1 byte
LayerNorm mean and 1/std     dtype of the activation       fp32 (the accumulation type)
fused attention, dropout on  math kernel, fp32 inside      flash (16-bit) / memory-efficient
fused attention, dropout 0   flash kernel                  flash (16-bit) / memory-efficient
===========================  ============================  =================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .memory import PRECISIONS, training_memory
from .models import GPTConfig, gpt_param_count, param_numels
from .units import as_dtype, dtype_bytes
from .validation import positive_int

DEVICES = ("cpu", "cuda")
SDPA_KERNELS = ("flash", "efficient", "math")
_INDEX = torch.int64
_FP32 = torch.float32
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Saved:
    """One storage autograd keeps for backward: which op saves it, what it is, its shape and dtype.

    ``kind`` is "activation" for what the forward pass allocates, "input" for the
    token ids and targets (saved too, so ``saved_bytes`` counts them, but allocated
    before the step), "scalar" for the 0-d float64 tensor autograd wraps around a
    Python number (a host tensor made outside the dispatcher: the live-tensor
    tracker does not see it, and on CUDA it is not GPU memory).
    """

    op: str
    what: str
    shape: tuple
    dtype: torch.dtype
    kind: str = "activation"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


KINDS = ("activation", "input", "scalar")


def total_bytes(items: list[Saved], kinds: tuple = KINDS) -> int:
    """Sum of ``nbytes`` over the ``items`` whose ``kind`` is in ``kinds`` (default: all)."""
    return sum(item.nbytes for item in items if item.kind in kinds)


# --------------------------------------------------------------------------- validation

def _check(config, batch_size, seq_len, dtype, device) -> tuple[int, int, torch.dtype]:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a course_lib.models.GPTConfig, got {type(config).__name__}")
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    if seq_len > config.seq_len:
        raise ValueError(f"seq_len must be at most config.seq_len={config.seq_len}, got {seq_len}")
    dtype = as_dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return batch_size, seq_len, dtype


def _mask_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    return torch.bool if device == "cuda" else dtype


def _stats_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    return _FP32 if device == "cuda" else dtype


# --------------------------------------------------------------------------- building blocks

def _layernorm_saved(name: str, b: int, s: int, h: int, dtype: torch.dtype,
                    device: str = "cpu") -> list[Saved]:
    """``native_layer_norm`` keeps its input and the per-token mean and 1/std (``rstd``)."""
    stats = _stats_dtype(dtype, device)
    return [Saved(name, "input", (b, s, h), dtype),
            Saved(name, "mean", (b, s, 1), stats),
            Saved(name, "rstd", (b, s, 1), stats)]


def _dropout_saved(name: str, shape: tuple, p: float, dtype: torch.dtype,
                  device: str = "cpu") -> list[Saved]:
    """Dropout with ``p > 0`` keeps its mask (see the module table for its dtype); ``p = 0`` keeps nothing."""
    return [Saved(name, "mask", shape, _mask_dtype(dtype, device))] if p > 0 else []


def sdpa_kernel(config: GPTConfig, dtype, device: str = "cpu") -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for the course GPT in training.

    CPU (PyTorch 2.4+): the flash kernel, except with dropout, which it does not
    implement; then the "math" reference kernel, which upcasts 16-bit inputs to
    fp32 and materialises the ``s x s`` scores. CUDA: flash for 16-bit dtypes with
    a head size that is a multiple of 8 up to 256 (GPUs of compute capability
    8.0+), else the memory-efficient kernel (fp32, and Colab's T4).
    """
    dtype = as_dtype(dtype)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return "math" if config.dropout > 0 else "flash"
    d = config.d_head
    if dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256:
        return "flash"
    return "efficient"


def attention_core_saved(config: GPTConfig, b: int, s: int, dtype, device: str = "cpu") -> list[Saved]:
    """What ``CausalSelfAttention.core(q, k, v)`` keeps, for ``config.attention`` and ``config.dropout``.

    The ``q``, ``k``, ``v`` views into the QKV output are ``(b, a, s, d)`` with
    the heads transposed; a matmul needs them as ``(b*a, s, d)`` batches and
    copies them (``3*bsh`` elements) unless ``b == 1`` or ``a == 1``, when the
    batches are views and the one QKV output storage (also ``3*bsh``) is kept.
    """
    b, s, dtype = _check(config, b, s, dtype, device)
    a, p, h = config.n_heads, config.dropout, config.d_model
    probs = (b, a, s, s)
    if config.attention == "explicit":
        items = [Saved("q @ k^T", "q (heads as batches)", (b, s, h), dtype),
                 Saved("q @ k^T", "k^T (heads as batches)", (b, s, h), dtype),
                 Saved("* 1/sqrt(d)", "the scalar, a 0-d float64 tensor", (), torch.float64,
                       kind="scalar"),
                 Saved("masked_fill", "causal mask (~tril)", (s, s), torch.bool),
                 Saved("softmax", "probabilities" + ("" if p > 0 else ", also probs @ v's input"),
                       probs, dtype)]
        items += _dropout_saved("attn dropout", probs, p, dtype, device)
        if p > 0:
            items.append(Saved("probs @ v", "dropped probabilities", probs, dtype))
        items.append(Saved("probs @ v", "v (heads as batches)", (b, s, h), dtype))
        return items
    kernel = sdpa_kernel(config, dtype, device)
    if kernel == "math":  # CPU with dropout: the reference kernel, computing in fp32
        inner = _FP32 if dtype in (torch.bfloat16, torch.float16) else dtype
        items = [Saved("sdpa/math: q @ k^T", "q * sqrt(scale) (heads as batches)", (b, s, h), inner),
                 Saved("sdpa/math: q @ k^T", "k * sqrt(scale) (heads as batches)", (b, s, h), inner),
                 Saved("sdpa/math: softmax", "probabilities", probs, inner),
                 Saved("sdpa/math: dropout", "mask", probs, inner),
                 Saved("sdpa/math: probs @ v", "dropped probabilities", probs, inner)]
        # v is not scaled: in fp32 with b == 1 or a == 1 its batches are views of the QKV output.
        v_shape = (b, s, 3 * h) if inner == dtype and (b == 1 or a == 1) else (b, s, h)
        what = "v: QKV output storage (a view)" if v_shape[-1] == 3 * h else "v (heads as batches)"
        return items + [Saved("sdpa/math: probs @ v", what, v_shape, inner)]
    # Fused kernels keep q, k, v (views of the one QKV output storage), their output
    # (laid out (b, s, a, d), so the proj's input is a view of it), and per-row log-sum-exp.
    rows = s if kernel == "flash" else 32 * math.ceil(s / 32)  # memory-efficient pads to 32
    items = [Saved("qkv", "QKV output, kept by sdpa as q, k and v", (b, s, 3 * h), dtype),
             Saved("sdpa", "output, also the out-projection's input", (b, s, h), dtype),
             Saved("sdpa", "logsumexp", (b, a, rows), _FP32)]
    if device == "cuda":
        items.append(Saved("sdpa", "RNG seed and offset", (2,), _INDEX))
    return items


def block_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                dtype=torch.float32, device: str = "cpu") -> list[Saved]:
    """Every storage one transformer ``Block`` keeps for backward, in forward order.

    ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``: LayerNorm 1 (input, mean,
    rstd); the QKV linear's input; the attention core; the out-projection's
    input; its dropout mask; LayerNorm 2; the MLP: first linear's input, GELU's
    input, second linear's input (GELU's output), dropout mask. Residual adds keep nothing.
    """
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, dtype = _check(config, batch_size, seq_len, dtype, device)
    h, p = config.d_model, config.dropout
    fused = config.attention == "sdpa" and sdpa_kernel(config, dtype, device) != "math"
    items = _layernorm_saved("ln1", b, s, h, dtype, device)
    items.append(Saved("qkv", "input (ln1's output)", (b, s, h), dtype))
    items += attention_core_saved(config, b, s, dtype, device)
    if not fused:  # a fused kernel's output is the out-projection's input (one storage)
        items.append(Saved("attn proj", "input (heads merged, contiguous)", (b, s, h), dtype))
    items += _dropout_saved("attn resid dropout", (b, s, h), p, dtype, device)
    items += _layernorm_saved("ln2", b, s, h, dtype, device)
    items += [Saved("mlp fc", "input (ln2's output)", (b, s, h), dtype),
              Saved("gelu", "input (fc's output)", (b, s, 4 * h), dtype),
              Saved("mlp proj", "input (gelu's output)", (b, s, 4 * h), dtype)]
    items += _dropout_saved("mlp dropout", (b, s, h), p, dtype, device)
    return items


def embedding_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                    dtype=torch.float32, device: str = "cpu") -> list[Saved]:
    """Token and position embeddings keep their indices (int64); the dropout after them its mask."""
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, dtype = _check(config, batch_size, seq_len, dtype, device)
    return [Saved("tok_emb", "token ids (the input)", (b, s), _INDEX, kind="input"),
            Saved("pos_emb", "positions (arange)", (s,), _INDEX),
            *_dropout_saved("emb dropout", (b, s, config.d_model), config.dropout, dtype, device)]


def head_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
               dtype=torch.float32, device: str = "cpu") -> list[Saved]:
    """Final LayerNorm, the tied LM head (an ``mm``: it keeps its input), and the loss.

    ``F.cross_entropy(logits.float(), targets)`` is ``log_softmax`` (keeps its
    fp32 output, ``bsV * 4`` bytes, whatever the model's dtype) then ``nll_loss``
    (keeps the same tensor, the targets, and a 0-d fp32 ``total_weight``). The
    logits themselves are not kept.
    """
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, dtype = _check(config, batch_size, seq_len, dtype, device)
    h, V = config.d_model, config.vocab_size
    return [*_layernorm_saved("ln_f", b, s, h, dtype, device),
            Saved("lm_head", "input (ln_f's output)", (b, s, h), dtype),
            Saved("log_softmax", "output, also nll_loss's input", (b * s, V), _FP32),
            Saved("nll_loss", "targets", (b * s,), _INDEX, kind="input"),
            Saved("nll_loss", "total_weight", (), _FP32)]


def model_saved(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                dtype=torch.float32, device: str = "cpu") -> list[Saved]:
    """Everything the whole GPT keeps for ``loss.backward()``: embeddings, every block, head and loss."""
    blocks = block_saved(config, batch_size, seq_len, dtype, device)
    return [*embedding_saved(config, batch_size, seq_len, dtype, device),
            *(blocks * config.n_layers),
            *head_saved(config, batch_size, seq_len, dtype, device)]


def block_saved_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                      dtype=torch.float32, device: str = "cpu") -> int:
    """Bytes one block keeps for backward: the sum of :func:`block_saved`."""
    return total_bytes(block_saved(config, batch_size, seq_len, dtype, device))


def predict_saved_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                        dtype=torch.float32, device: str = "cpu") -> int:
    """Bytes the whole model keeps for backward, token ids and targets included.

    Equals ``course_lib.measure.saved_bytes(loss, model.parameters())`` for
    ``GPT(config).to(dtype)`` in training mode on the CPU, to the byte.
    """
    return total_bytes(model_saved(config, batch_size, seq_len, dtype, device))


def korthikanti_terms(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                      dtype=torch.bfloat16, device: str = "cpu") -> dict[str, int]:
    """Where one block departs from Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)`` bytes.

    The paper's setting: explicit attention, dropout on, 16-bit activations
    (``config.attention`` is taken as "explicit"; ``ValueError`` without dropout
    or with fp32). Returns bytes: ``"paper"`` (the formula), each difference, and
    ``"block"`` (:func:`block_saved_bytes`), with ``paper + differences == block``:

    * ``"dropout masks"``: the paper counts 1 byte per mask element (two ``sbh``
      masks and one ``as^2b``); on the CPU masks have the activation's dtype (2 bytes);
    * ``"layernorm stats"``: mean and 1/std per token of both LayerNorms (``4sb``
      values), which the paper leaves out; fp32 on CUDA, the activation dtype on the CPU;
    * ``"causal mask"``: the ``s^2`` bool mask that ``masked_fill`` keeps;
    * ``"scale scalar"``: the 8-byte float64 tensor holding ``1/sqrt(d)``.
    """
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, dtype = _check(config, batch_size, seq_len, dtype, device)
    if config.dropout == 0 or dtype_bytes(dtype) != 2:
        raise ValueError("korthikanti_terms is for the paper's setting: config.dropout > 0 and a "
                         f"16-bit dtype, got dropout={config.dropout}, dtype={dtype}")
    h, a = config.d_model, config.n_heads
    mask_extra = dtype_bytes(_mask_dtype(dtype, device)) - 1
    terms = {"paper": s * b * h * 34 + 5 * a * s * s * b,
             "dropout masks": (2 * s * b * h + a * s * s * b) * mask_extra,
             "layernorm stats": 4 * s * b * dtype_bytes(_stats_dtype(dtype, device)),
             "causal mask": s * s,
             "scale scalar": 8}
    terms["block"] = block_saved_bytes(replace(config, attention="explicit"), b, s, dtype, device)
    return terms


# --------------------------------------------------------------------------- will it fit?

#: The activation dtype of each precision of :func:`course_lib.memory.training_memory`.
ACTIVATION_DTYPE = {"fp32": torch.float32, "fp16-mixed": torch.float16,
                    "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16}


def memory_budget(config: GPTConfig, batch_size: int, seq_len: int | None = None, *,
                  precision: str = "bf16-mixed", optimizer: str = "adamw",
                  device: str = "cuda") -> dict[str, int]:
    """Bytes one training step of the course GPT needs, in three stacked parts.

    * ``"model states"``: parameters, gradients, optimizer state and master weights,
      :func:`course_lib.memory.training_memory` of ``gpt_param_count(config)``
      (independent of batch and sequence);
    * ``"activations"``: what autograd saves, :func:`predict_saved_bytes` in the
      precision's activation dtype (:data:`ACTIVATION_DTYPE`), token ids included;
    * ``"logits gradients"``: the two fp32 ``b*s*V`` gradients in flight at the
      start of backward (``nll_loss`` and ``log_softmax`` backward).

    Conservative: it counts the gradients as alive while the activations are, as
    they are from the second step of gradient accumulation on. Allocator rounding,
    fragmentation and the CUDA context are not counted.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    seq_len = config.seq_len if seq_len is None else seq_len
    dtype = ACTIVATION_DTYPE[precision]
    b, s, dtype = _check(config, batch_size, seq_len, dtype, device)
    states = training_memory(gpt_param_count(config), optimizer=optimizer, precision=precision)
    saved = model_saved(config, b, s, dtype, device)
    return {"model states": states.total,
            "activations": total_bytes(saved, ("activation", "input")),
            "logits gradients": 2 * b * s * config.vocab_size * 4}


# --------------------------------------------------------------------------- a whole training step

@dataclass(frozen=True)
class StepPeak:
    """Predicted peak of one AdamW training step, in bytes, above the parameters.

    ``total = gradients + optimizer_state + activations + transient`` is the
    figure :func:`course_lib.measure.peak_memory` measures for
    :func:`course_lib.measure.training_step` on a fresh model (the parameters
    were there before: ``parameters`` is reported beside it, not in ``total``).
    ``moment`` names where in the step the peak falls.
    """

    moment: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int

    @property
    def model_states(self) -> int:
        return self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.gradients + self.optimizer_state + self.activations + self.transient


# Categories of the step timeline (bytes): what the predictor tracks while it replays backward.
_GRAD, _ACT, _TMP = "gradients", "activations", "transient"


class _Replay:
    """Live bytes per category while the backward pass is replayed node by node.

    A node first allocates its outputs one by one (the peak is checked after each),
    then frees what it no longer needs: its incoming gradient and the tensors it saved.
    """

    def __init__(self, live: dict):
        self.live = dict(live)
        self.best = dict(live)
        self.moment = "end of forward"

    def node(self, label: str, allocs, frees=()) -> None:
        for category, nbytes in allocs:
            if nbytes:
                self.live[category] += nbytes
                if sum(self.live.values()) > sum(self.best.values()):
                    self.best, self.moment = dict(self.live), label
        for category, nbytes in frees:
            self.live[category] -= nbytes


def _param_bytes(config: GPTConfig, dtype: torch.dtype) -> list[int]:
    """Bytes of each parameter tensor, in ``model.parameters()`` order."""
    e = dtype_bytes(dtype)
    return [n * e for n in param_numels(config)]


def _replay_head(r: _Replay, config: GPTConfig, b: int, s: int, dtype: torch.dtype) -> None:
    e, h, V = dtype_bytes(dtype), config.d_model, config.vocab_size
    X, st, logits4 = b * s * h * e, b * s * dtype_bytes(_stats_dtype(dtype, "cpu")), b * s * V * 4
    r.node("loss.backward(): d loss = 1", [(_TMP, 4)])  # held until backward() returns
    r.node("nll_loss backward", [(_TMP, logits4)], [(_ACT, 4)])  # frees total_weight
    r.node("log_softmax backward", [(_TMP, logits4)], [(_TMP, logits4), (_ACT, logits4)])
    g_logits = logits4
    if e != 4:  # logits.float() in the loss: its backward casts the gradient back
        r.node("logits.float() backward", [(_TMP, b * s * V * e)], [(_TMP, logits4)])
        g_logits = b * s * V * e
    r.node("lm_head backward", [(_TMP, X), (_GRAD, V * h * e)], [(_TMP, g_logits), (_ACT, X)])
    r.node("ln_f backward", [(_TMP, X), (_GRAD, h * e), (_GRAD, h * e * config.bias)],
           [(_TMP, X), (_ACT, X + 2 * st)])


def _replay_attention(r: _Replay, config: GPTConfig, b: int, s: int, dtype: torch.dtype) -> None:
    """From the out-projection's backward to the concatenated q, k, v gradient (3X, live)."""
    e, h, a, p = dtype_bytes(dtype), config.d_model, config.n_heads, config.dropout
    X, bias = b * s * h * e, config.bias
    proj = [(_TMP, X), (_GRAD, h * h * e), (_GRAD, h * e * bias)]
    kernel = "explicit" if config.attention == "explicit" else sdpa_kernel(config, dtype, "cpu")
    if kernel == "flash":  # the proj's input is the kernel's output, freed with it
        r.node("attn proj backward", proj)
        r.node("sdpa flash backward", [(_TMP, X)] * 3,
               [(_TMP, X), (_ACT, 3 * X + X + b * a * s * 4)])
        r.node("q, k, v gradients concatenated", [(_TMP, 3 * X)], [(_TMP, 3 * X)])
        return
    ei = e if kernel == "explicit" or e == 4 else 4  # the math kernel computes in fp32
    Xi, S = b * s * h * ei, b * a * s * s * ei
    r.node("attn proj backward", proj, [(_TMP, X * (p > 0)), (_ACT, X)])
    if ei != e:
        r.node("sdpa output cast backward", [(_TMP, Xi)], [(_TMP, X)])
    r.node("merge heads backward (copy)", [(_TMP, Xi)], [(_TMP, Xi if ei != e else X)])
    dropped = S if p > 0 else 0
    # With b == 1 or a == 1 the head batches are views of the QKV output (see
    # attention_core_saved); that storage goes only when q and k have been used too.
    v_view = (b == 1 or a == 1) and ei == e
    v = 0 if v_view else Xi
    r.node("probs @ v backward", [(_TMP, Xi), (_TMP, S)], [(_TMP, Xi), (_ACT, v + dropped)])
    if p > 0:
        mask = S if kernel == "math" else b * a * s * s * e
        r.node("attention dropout backward", [(_TMP, S)], [(_TMP, S), (_ACT, mask)])
    r.node("softmax backward", [(_TMP, S)], [(_TMP, S), (_ACT, S)])
    if kernel == "explicit":
        r.node("masked_fill backward", [(_TMP, S)], [(_TMP, S), (_ACT, s * s)])
        r.node("scale backward", [(_TMP, S)], [(_TMP, S)])
    qk = 3 * X if v_view and kernel == "explicit" else 2 * Xi + (3 * X if v_view else 0)
    r.node("q @ k^T backward", [(_TMP, Xi), (_TMP, Xi)], [(_TMP, S), (_ACT, qk)])
    if kernel == "math":
        r.node("q, k scale backward", [(_TMP, Xi), (_TMP, Xi)], [(_TMP, 2 * Xi)])
    if ei != e:
        r.node("q, k, v cast back", [(_TMP, X)] * 3, [(_TMP, 3 * Xi)])
    r.node("split heads backward (copies)", [(_TMP, X), (_TMP, X)], [(_TMP, 2 * X)])
    r.node("q, k, v gradients concatenated", [(_TMP, 3 * X)], [(_TMP, 3 * X)])


def _replay_block(r: _Replay, config: GPTConfig, b: int, s: int, dtype: torch.dtype) -> None:
    """One block, top to bottom; enters and leaves with one ``X`` gradient live."""
    e, h, p, bias = dtype_bytes(dtype), config.d_model, config.dropout, config.bias
    X, F = b * s * h * e, 4 * b * s * h * e
    st = b * s * dtype_bytes(_stats_dtype(dtype, "cpu"))
    mask = b * s * h * e if p > 0 else 0
    ln = [(_TMP, X), (_GRAD, h * e), (_GRAD, h * e * bias)]
    if p > 0:
        r.node("mlp dropout backward", [(_TMP, X)], [(_ACT, mask)])
    r.node("mlp proj backward", [(_TMP, F), (_GRAD, 4 * h * h * e), (_GRAD, h * e * bias)],
           [(_TMP, X * (p > 0)), (_ACT, F)])
    r.node("gelu backward", [(_TMP, F)], [(_TMP, F), (_ACT, F)])
    r.node("mlp fc backward", [(_TMP, X), (_GRAD, 4 * h * h * e), (_GRAD, 4 * h * e * bias)],
           [(_TMP, F), (_ACT, X)])
    r.node("ln2 backward", ln, [(_TMP, X), (_ACT, X + 2 * st)])
    r.node("residual: gradients added", [(_TMP, X)], [(_TMP, 2 * X)])
    if p > 0:
        r.node("attn resid dropout backward", [(_TMP, X)], [(_ACT, mask)])
    _replay_attention(r, config, b, s, dtype)
    r.node("qkv backward", [(_TMP, X), (_GRAD, 3 * h * h * e), (_GRAD, 3 * h * e * bias)],
           [(_TMP, 3 * X), (_ACT, X)])
    r.node("ln1 backward", ln, [(_TMP, X), (_ACT, X + 2 * st)])
    r.node("residual: gradients added", [(_TMP, X)], [(_TMP, 2 * X)])


def adamw_scratch_bytes(param_bytes: list[int]) -> int:
    """Largest scratch of PyTorch's single-tensor AdamW (the CPU default), in bytes.

    Per parameter ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``
    holds two parameter-sized temporaries at once, while the previous parameter's
    ``denom`` is still referenced: ``max_i(P[i-1] + 2*P[i])``.
    """
    return max((param_bytes[i - 1] if i else 0) + 2 * n for i, n in enumerate(param_bytes))


def predict_step_peak(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                      dtype=torch.float32) -> StepPeak:
    """Predicted peak of :func:`course_lib.measure.training_step` with AdamW on a fresh GPT (CPU).

    ``peak_memory`` of that step counts what the step allocates (the parameters
    were there before). Three moments compete:

    * **in backward**: all saved activations (:func:`model_saved`, minus the token
      ids and targets, which existed before) plus the loss, then the backward pass
      replayed node by node: each node allocates its outputs (the gradient it passes
      down, and weight gradients) and then frees its incoming gradient and what it
      saved. The *transient* is what is in flight at the worst moment: the
      ``bsV`` fp32 gradients of the loss, or inside the top block the ``4bsh``
      gradient of the MLP's hidden layer or the ``as^2b`` gradient of the
      attention probabilities, plus the residual stream's gradient held for the skip
      connection;
    * **in the optimizer step**: gradients (``P`` elements), AdamW's ``m`` and ``v``
      (``2P``, created at the first step), a 4-byte ``step`` per parameter tensor,
      and the transient :func:`adamw_scratch_bytes`, plus the 4-byte loss;
    * **in forward**, only where SDPA runs its math kernel (the CPU with dropout):
      the last block's attention scratch (:func:`_math_forward_peak`).

    Returns the largest, decomposed (:class:`StepPeak`). The 0-d float64 scalar of
    explicit attention is left out: autograd makes it outside the dispatcher, so
    the tracker never sees it, and on CUDA it lives in host memory. Against the
    tracker (PyTorch 2.13, CPU, AdamW's default single-tensor update) this is exact
    to the byte for the shapes in the tests, and within 3% by design elsewhere.
    """
    moments = predict_step_moments(config, batch_size, seq_len, dtype)
    return max(moments.values(), key=lambda peak: peak.total)


def predict_step_moments(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                         dtype=torch.float32) -> dict[str, StepPeak]:
    """The candidate moments of :func:`predict_step_peak`, by name: "backward", "optimizer",
    and "forward" where SDPA's math kernel runs; the peak is the largest."""
    seq_len = config.seq_len if seq_len is None else seq_len
    b, s, dtype = _check(config, batch_size, seq_len, dtype, "cpu")
    params = _param_bytes(config, dtype)
    saved = [item for item in model_saved(config, b, s, dtype) if item.kind == "activation"]
    r = _Replay({_GRAD: 0, _ACT: total_bytes(saved), _TMP: 4})  # 4: the loss
    _replay_head(r, config, b, s, dtype)
    for _ in range(config.n_layers):
        _replay_block(r, config, b, s, dtype)
    forward = _math_forward_peak(config, b, s, dtype, params)
    moments = replay_moments(r, params)
    return {"forward": forward, **moments} if forward else moments


def replay_moments(r: _Replay, params: list[int]) -> dict[str, StepPeak]:
    """The backward moment a finished replay ``r`` found, and the AdamW step's, for parameter
    tensors of ``params`` bytes: gradients, ``m`` and ``v`` (created at the first step), a
    4-byte ``step`` per tensor, :func:`adamw_scratch_bytes` and the 4-byte loss."""
    P = sum(params)
    return {
        "backward": StepPeak(moment=r.moment, parameters=P, gradients=r.best[_GRAD],
                             optimizer_state=0, activations=r.best[_ACT], transient=r.best[_TMP]),
        "optimizer": StepPeak(moment="AdamW step", parameters=P, gradients=P,
                              optimizer_state=2 * P + 4 * len(params), activations=0,
                              transient=adamw_scratch_bytes(params) + 4),
    }


def _math_forward_peak(config: GPTConfig, b: int, s: int, dtype: torch.dtype,
                       params: list[int]) -> StepPeak | None:
    """The forward-pass moment that can win on the CPU: the last block's math-kernel attention.

    The reference kernel's scratch is alive at its end: in 16-bit, fp32 copies of
    q, k, v and one scaled copy, the additive causal mask (fp32 ``s^2``), a 16-bit
    copy of the probabilities, the fp32 output and its 16-bit cast
    (``5*bsh*4 + 4s^2 + bas^2*e + bsh*e``); in fp32 one scaled copy, the mask and
    the output (``2*bsh*4 + 4s^2``); and the QKV output (``3*bsh*e``) the kernel
    reads from. Everything saved up to that point is alive too.
    """
    if config.attention != "sdpa" or sdpa_kernel(config, dtype, "cpu") != "math":
        return None
    e, h, a = dtype_bytes(dtype), config.d_model, config.n_heads
    Xi = b * s * h * 4
    views = b == 1 or a == 1  # head batches are views: no copies (attention_core_saved)
    if e == 4:
        scratch = 2 * Xi + 4 * s * s + (0 if views else 3 * b * s * h * e)  # QKV output saved as v
    else:
        copies = 3 * Xi if views else 5 * Xi
        scratch = copies + 4 * s * s + b * a * s * s * e + b * s * h * e + 3 * b * s * h * e
    block = block_saved(config, b, s, dtype)
    last_core = max(i for i, item in enumerate(block) if item.op.startswith("sdpa"))
    after = total_bytes(block[last_core + 1:]) + total_bytes(head_saved(config, b, s, dtype),
                                                             ("activation",))
    saved = total_bytes(model_saved(config, b, s, dtype), ("activation",)) - after
    return StepPeak(moment="last block's attention (forward)", parameters=sum(params),
                    gradients=0, optimizer_state=0, activations=saved, transient=scratch)
