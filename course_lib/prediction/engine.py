"""The memory engine: the peak bytes of one training step of the course GPT, on the CPU or a GPU.

:func:`course_lib.prediction.predict.predict` asks it for the :func:`moments` of a
:class:`~course_lib.prediction.step.Step`, each a :class:`StepMemory` by the categories of
:data:`course_lib.units.MEMORY_CATEGORIES`; ``total`` is what ``torch.cuda.max_memory_allocated``
reports from a clean start. Three moments compete: **backward**, every kept activation and then
the backward pass replayed node by node (checkpointed regions rebuilt where the pass reaches
them, Chen et al. 2016); **optimizer**, the gradients, AdamW's state and its scratch
(:func:`adamw_scratch_bytes`); **forward**, the last block's attention where SDPA's math kernel
or explicit attention builds its ``s x s`` maps. The GPU decides the attention kernel, the
dtypes of masks and statistics and the allocator's rounding (:mod:`course_lib.model.kernels`).
Exact to the byte on the CPU for one micro-batch in fp32 and pure 16-bit (the tests).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace

import torch

from course_lib.device import GPU
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, param_numels
from course_lib.prediction import activations as act, checkpointed
from course_lib.prediction.formulas import (  # noqa: F401 (re-exported)
    PRECISION,
    PRECISIONS,
    precision_of,
)
from course_lib.prediction.step import Step
from course_lib.training import checkpointing as ckpt
from course_lib.units import MEMORY_CATEGORIES, dtype_bytes
from course_lib.validation import MAX_BYTES, integer

#: The checkpointing modes the engine predicts (:data:`course_lib.training.checkpointing.MODES`).
MODES = ckpt.MODES
_F32 = torch.float32


@dataclass(frozen=True)
class StepMemory:
    """Predicted bytes at one moment of a step, by category (``first_step``: AdamW's first)."""

    moment: str
    parameters: int
    master_weights: int
    optimizer_state: int
    gradients: int
    activations: int
    transient: int
    first_step: bool = False

    @property
    def model_states(self) -> int:
        """Parameters, master weights and optimizer state."""
        return self.parameters + self.master_weights + self.optimizer_state

    @property
    def total(self) -> int:
        """All bytes the device holds at this moment."""
        return self.model_states + self.gradients + self.activations + self.transient

    @property
    def before_step(self) -> int:
        """Parameters, master weights and, in steady state, the optimizer state."""
        return (self.parameters + self.master_weights
                + (0 if self.first_step else self.optimizer_state))

    @property
    def step_peak(self) -> int:
        """``total - before_step``: what ``measurement.memory.peak_memory`` measures."""
        return self.total - self.before_step

    def as_dict(self) -> dict[str, int]:
        """Field name -> bytes of each of :data:`course_lib.units.MEMORY_CATEGORIES`, in order."""
        return {name: getattr(self, name) for name in MEMORY_CATEGORIES}


def breakdown_rows(memory: StepMemory) -> list[tuple[str, int]]:
    """``(label, bytes)`` of a :class:`StepMemory`'s nonzero categories, for a stacked bar.
    Args:
        memory (StepMemory): a step's bytes by category.
    Returns:
        list of tuple: ``(label, bytes)`` per nonzero category.
    Raises:
        ValueError: naming ``memory``, when it is not a StepMemory.
    """
    if not isinstance(memory, StepMemory):
        raise ValueError(f"memory must be a course_lib.prediction.engine.StepMemory, got "
                         f"{type(memory).__name__}")
    return [(MEMORY_CATEGORIES[name].label, v) for name, v in memory.as_dict().items() if v]


_GRAD, _ACT, _TMP = "gradients", "activations", "transient"


class _Replay:
    """Live bytes per category while the backward pass is replayed node by node.

    ``accumulating``: a micro-batch after the first, whose ``.grad`` tensors exist: each new
    gradient is transient, added in place (``AccumulateGrad``) and freed as soon as it is made.
    """

    def __init__(self, live: dict, accumulating: bool = False):
        self.live = dict(live)
        self.best = dict(live)
        self.moment = "end of forward"
        self.pending = None
        self.accumulating = accumulating

    def node(self, label: str, allocs, frees=()) -> None:
        if self.pending and label.startswith(self.pending[2]):
            (pending_label, nbytes, _, scratch), self.pending = self.pending, None
            self._node(pending_label, [(_ACT, nbytes), (_TMP, scratch)], [(_TMP, scratch)])
        self._node(label, allocs, frees)

    def _node(self, label, allocs, frees) -> None:
        if self.accumulating:
            added = [n for c, n in allocs if c == _GRAD]
            allocs = [(_TMP if c == _GRAD else c, n) for c, n in allocs]
            frees = [*frees, *((_TMP, n) for n in added)]
        for category, nbytes in allocs:
            if nbytes:
                self.live[category] += nbytes
                if sum(self.live.values()) > sum(self.best.values()):
                    self.best, self.moment = dict(self.live), label
        for category, nbytes in frees:
            self.live[category] -= nbytes

    @classmethod
    def effect(cls, replay, accumulating: bool) -> _Effect:
        """Run ``replay(r)`` from nothing: the :class:`_Effect` of that stretch of one block."""
        r = cls(dict.fromkeys((_GRAD, _ACT, _TMP), 0), accumulating)
        r.best = dict.fromkeys(r.live, -(1 << 62))  # any node beats the start
        replay(r)
        return _Effect(dict(r.best), r.moment, dict(r.live), 0, 1)

    def apply(self, effect: _Effect, top: int) -> None:
        """Add ``effect``, a stretch of blocks whose first (highest) is block ``top``."""
        at_worst = {c: self.live[c] + effect.worst[c] for c in self.live}
        if sum(at_worst.values()) > sum(self.best.values()):
            self.best, self.moment = at_worst, effect.label.format(i=top - effect.offset)
        self.live = {c: self.live[c] + effect.end[c] for c in self.live}


@dataclass(frozen=True)
class _Effect:
    """A stretch of blocks replayed from nothing: live bytes at its worst node and after it."""

    worst: dict
    label: str
    end: dict
    offset: int
    blocks: int

    def then(self, other: _Effect) -> _Effect:
        later = {c: self.end[c] + other.worst[c] for c in self.end}
        first = sum(later.values()) <= sum(self.worst.values())  # the earlier wins a tie
        return _Effect(self.worst if first else later, self.label if first else other.label,
                       {c: self.end[c] + other.end[c] for c in self.end},
                       self.offset if first else self.blocks + other.offset,
                       self.blocks + other.blocks)

    def repeat(self, times: int) -> _Effect:
        """This stretch ``times`` in a row (the first is worst if it frees more than it keeps)."""
        k = times - 1 if sum(self.end.values()) > 0 else 0
        return _Effect({c: self.worst[c] + k * self.end[c] for c in self.end}, self.label,
                       {c: times * self.end[c] for c in self.end}, k * self.blocks + self.offset,
                       times * self.blocks)


class _Backward:
    """The backward pass of the course GPT, node by node, in bytes as the device allocates them."""

    def __init__(self, config: GPTConfig, b: int, s: int, t, accumulating: bool = False):
        self.config, self.b, self.s, self.t, self.params = config, b, s, t, t.spec.params
        self.accumulating = accumulating
        #: The tied head's weight gradient waits in autograd's input buffer for the embedding's,
        #: so it is never freed at once: a gradient in the first micro-batch, transient after.
        self.tied = _TMP if accumulating else _GRAD
        self.sum_in_place = False  # the plain head's weight gradient is still referenced
        #: Replaying a checkpointed region: ``torch.utils.checkpoint`` drops a recomputed tensor
        #: from its store as the backward pass unpacks it, so a saved input goes with its last
        #: use (before a linear's bias gradient) rather than when its node is done.
        self.in_region = False
        h = config.d_model
        self.x_compute = self.bytes(b * s * h, t.compute)  # one (b, s, h) tensor, compute dtype
        self.x_stream = self.bytes(b * s * h, t.stream)  # ... in the residual stream's dtype
        self.hidden = self.bytes(4 * b * s * h, t.compute)  # the MLP's hidden layer
        self.ln_stat = self.bytes(b * s, t.stats)  # LayerNorm's mean (or 1/std)
        self.kernel = kernels.attention_kernel(config, t.compute, t.gpu)
        # With the fused residual the projections' biases get their gradients from the kernel
        self.proj_bias = False if config.fused_residual else None

    def bytes(self, numel: int, dtype: torch.dtype) -> int:
        return kernels.allocated(numel * dtype_bytes(dtype), self.t.gpu)

    def _cast(self, r: _Replay, label: str, dtype_in_bytes: int, dtype_out_bytes: int) -> None:
        r.node(label, [(_TMP, dtype_out_bytes)], [(_TMP, dtype_in_bytes)])

    def linear(self, r: _Replay, label: str, n_in: int, n_out: int, grad_in: int, frees,
               bias: bool | None = None, category: str = _GRAD) -> None:
        """A linear's backward: input, weight (and bias) gradients; under autocast via 16 bit."""
        bias = self.config.bias if bias is None else bias
        w, bb = n_in * n_out, n_out * bias
        w_grad, b_grad = (category, self.bytes(w, self.params)), (_GRAD, self.bytes(bb, self.params))
        if self.t.autocast:
            w16, b16 = self.bytes(w, self.t.compute), self.bytes(bb, self.t.compute)
            r.node(label, [(_TMP, grad_in), (_TMP, w16), (_TMP, b16)], [*frees, (_ACT, w16)])
            r.node(label + ": weight gradients cast to fp32", [w_grad, b_grad], [(_TMP, w16 + b16)])
        elif self.in_region and bb:  # the saved input goes after the weight gradient's matmul
            r.node(label, [(_TMP, grad_in), w_grad], [f for f in frees if f[0] == _ACT])
            r.node(label + ": bias gradient", [b_grad], [f for f in frees if f[0] != _ACT])
        else:
            r.node(label, [(_TMP, grad_in), w_grad, b_grad], frees)

    def head(self, r: _Replay) -> None:
        c, b, s = self.config, self.b, self.s
        h, V = c.d_model, c.vocab_size
        logits4 = self.bytes(b * s * V, _F32)
        four = self.bytes(1, _F32)
        r.node("loss.backward(): d loss = 1", [(_TMP, four)])  # held until backward() returns
        r.node("nll_loss backward", [(_TMP, logits4)], [(_ACT, four)])  # frees total_weight
        r.node("log_softmax backward", [(_TMP, logits4)], [(_TMP, logits4), (_ACT, logits4)])
        g = logits4
        if self.t.compute != _F32:  # logits.float() in the loss: its backward casts the gradient back
            g = self.bytes(b * s * V, self.t.compute)
            self._cast(r, "logits.float() backward", logits4, g)
        self.linear(r, "lm_head backward", h, V, self.x_compute,
                    [(_TMP, g), (_ACT, self.x_compute)], bias=False, category=self.tied)
        self.layernorm(r, "ln_f backward")

    def chunked_head(self, r: _Replay, chunk: int) -> None:
        """The backward of ``levers.chunked_cross_entropy``, chunk by chunk."""
        c, b, s, t = self.config, self.b, self.s, self.t
        h, V, N = c.d_model, c.vocab_size, b * s
        n = min(chunk, N)
        four = self.bytes(1, _F32)
        r.node("loss.backward(): d loss = 1", [(_TMP, four)])
        r.node("chunked loss backward: gradients allocated",
               [(_TMP, self.x_compute), (self.tied, self.bytes(V * h, self.params)), (_TMP, four)])
        # Its weight gradient, back from Python, is referenced by nothing else, except under a
        # Python dispatch mode (the CPU's LiveTensorTracker): a GPU step sums in place.
        self.sum_in_place = t.gpu is not None
        z = self.bytes(n * V, _F32)
        if t.compute == _F32:
            # the chunk's logits; the target indices (int64) and the -1s of the one-hot
            r.node("chunked loss backward: one chunk's logits",
                   [(_TMP, z), (_TMP, self.bytes(n, torch.int64)), (_TMP, self.bytes(n, _F32))],
                   [(_TMP, z + self.bytes(n, torch.int64) + self.bytes(n, _F32))])
        else:
            zc = self.bytes(n * V, t.compute)
            r.node("chunked loss backward: one chunk's logits", [(_TMP, zc), (_TMP, z)],
                   [(_TMP, zc)])
            r.node("chunked loss backward: the chunk's gradient cast back", [(_TMP, zc)],
                   [(_TMP, zc + z)])
        # Returning frees the incoming gradient, the saved hidden states, log-sum-exps and count.
        saved = self.x_compute + self.bytes(N, _F32) + self.bytes(1, torch.int64)
        r.node("chunked loss backward: done", [], [(_TMP, four), (_ACT, saved)])
        self.layernorm(r, "ln_f backward")

    def embeddings(self, r: _Replay) -> None:
        """Below the first block: dropout, then the position and the token embeddings."""
        c, b, s, t = self.config, self.b, self.s, self.t
        h, V = c.d_model, c.vocab_size
        # embeddings run in the stream's dtype (fp32 under autocast)
        x_stream, emb = self.x_stream, t.stream
        if c.dropout > 0:
            mask = self.bytes(b * s * h, t.mask(t.stream))
            r.node("emb dropout backward", [(_TMP, x_stream)], [(_TMP, x_stream), (_ACT, mask)])
        pos = self.bytes(s * h, emb)
        r.node("pos_emb backward: gradient summed over the batch", [(_TMP, pos)])
        r.node("pos_emb backward", [(_GRAD, self.bytes(c.seq_len * h, self.params))],
               [(_TMP, pos), (_ACT, self.bytes(s, torch.int64))])
        # Autograd adds the tied weight's two gradients in place only into a tensor nothing else
        # references, then accumulates the sum into .grad.
        emb = self.bytes(V * h, self.params)
        if self.sum_in_place:
            r.node("tok_emb backward", [(_TMP, emb)],
                   [(_TMP, emb + x_stream), *([(self.tied, emb)] if self.accumulating else ())])
        else:
            r.node("tok_emb backward", [(_TMP, emb)], [(_TMP, x_stream)])
            r.node("tied weight: its two gradients summed", [(_GRAD, emb)],
                   [(self.tied, emb), (_TMP, emb)])

    def layernorm(self, r: _Replay, label: str) -> None:
        if self.t.autocast:  # the linear's 16-bit input gradient, back to the fp32 stream
            self._cast(r, label.replace("backward", "output cast backward"), self.x_compute,
                       self.x_stream)
        h, bias = self.config.d_model, self.config.bias
        r.node(label, [(_TMP, self.x_stream), (_GRAD, self.bytes(h, self.params)),
                       (_GRAD, self.bytes(h * bias, self.params))],
               [(_TMP, self.x_stream), (_ACT, self.x_stream + 2 * self.ln_stat)])

    def block(self, r: _Replay) -> None:
        """One block, top to bottom (``fused_residual``: the caller ran the MLP's kernel first)."""
        c, b, s, t = self.config, self.b, self.s, self.t
        h, p, ac = c.d_model, c.dropout, t.autocast
        x_compute, x_stream, hidden = self.x_compute, self.x_stream, self.hidden
        mask = self.bytes(b * s * h, t.mask(t.compute)) if p > 0 else 0
        # The gradient into a branch: the stream's own (shared with the skip connection) or, under
        # autocast, a 16-bit copy of it that the branch frees; after dropout, dropout's output.
        g_in = x_compute if (p > 0 or ac or c.fused_residual) else 0
        if not c.fused_residual:
            if ac:
                r.node("mlp: gradient cast to 16-bit", [(_TMP, x_compute)])
            if p > 0:
                r.node("mlp dropout backward", [(_TMP, x_compute)],
                       [(_TMP, x_compute if ac else 0), (_ACT, mask)])
        self.linear(r, "mlp proj backward", 4 * h, h, hidden, [(_TMP, g_in), (_ACT, hidden)],
                    bias=self.proj_bias)
        if c.fused_mlp:
            self.bias_gelu(r)
            self.linear(r, "mlp fc backward (x @ W.T)", h, 4 * h, x_compute,
                        [(_TMP, hidden), (_ACT, x_compute)], bias=False)
        else:
            r.node("gelu backward", [(_TMP, hidden)], [(_TMP, hidden), (_ACT, hidden)])
            self.linear(r, "mlp fc backward", h, 4 * h, x_compute,
                        [(_TMP, hidden), (_ACT, x_compute)])
        self.layernorm(r, "ln2 backward")
        r.node("residual: gradients added", [(_TMP, x_stream)], [(_TMP, 2 * x_stream)])
        if c.fused_residual:
            self.bias_dropout_add(r, "attention")
        else:
            if ac:
                r.node("attention: gradient cast to 16-bit", [(_TMP, x_compute)])
            if p > 0:
                r.node("attn resid dropout backward", [(_TMP, x_compute)],
                       [(_TMP, x_compute if ac else 0), (_ACT, mask)])
        self.attention(r, g_in)
        self.linear(r, "qkv backward", h, 3 * h, x_compute,
                    [(_TMP, 3 * x_compute), (_ACT, x_compute)])
        self.layernorm(r, "ln1 backward")
        r.node("residual: gradients added", [(_TMP, x_stream)], [(_TMP, 2 * x_stream)])

    def bias_dropout_add(self, r: _Replay, branch: str) -> None:
        """The course's bias-dropout-add backward (``config.fused_residual``)."""
        h, t = self.config.d_model, self.t
        f32 = self.bytes(h, _F32)
        label = f"{branch}: bias_dropout_add backward (course kernel)"
        if t.stream == _F32:  # the fp32 sum is the bias's gradient
            r.node(label, [(_TMP, self.x_stream), (_GRAD, f32)])
        else:
            r.node(label, [(_TMP, self.x_stream), (_TMP, f32), (_GRAD, self.bytes(h, self.params))],
                   [(_TMP, f32)])
        if t.autocast:
            self._cast(r, f"{branch}: gradient cast to 16-bit", self.x_stream, self.x_compute)

    def bias_gelu(self, r: _Replay) -> None:
        """The course kernel's bias-GELU backward (:mod:`course_lib.model.fused`)."""
        n, hidden, t = 4 * self.config.d_model, self.hidden, self.t
        f32, e = self.bytes(n, _F32), self.bytes(n, t.compute)
        frees = [(_TMP, hidden), (_ACT, hidden)]  # the incoming gradient, the saved input x
        label = "bias_gelu backward (course kernel)"
        if t.compute == _F32:
            r.node(label, [(_TMP, hidden), (_GRAD, f32)], frees)
        elif not t.autocast:
            r.node(label, [(_TMP, hidden), (_TMP, f32), (_GRAD, e)], [(_TMP, f32), *frees])
        else:
            r.node(label, [(_TMP, hidden), (_TMP, f32), (_TMP, e)],
                   [(_TMP, f32), *frees, (_ACT, e)])  # and the saved 16-bit copy of the bias
            r.node("bias cast backward", [(_GRAD, self.bytes(n, self.params))], [(_TMP, e)])

    def attention(self, r: _Replay, g_in: int) -> None:
        """From the out-projection's backward to the concatenated q, k, v gradient (3 X, live)."""
        c, b, s, t = self.config, self.b, self.s, self.t
        h, a, p = c.d_model, c.n_heads, c.dropout
        X, kernel = self.x_compute, self.kernel
        if kernel in ("flash", "cudnn", "efficient"):
            # The proj's input is the kernel's output, freed with the kernel's saved tensors.
            self.linear(r, "attn proj backward", h, h, X, [(_TMP, g_in)], bias=self.proj_bias)
            saved = act.total_bytes(act.core_items(c, b, s, t), act.STEP_KINDS, t.gpu)
            scratch = 0
            if t.gpu is not None:  # fp32 accumulators of the CUDA backward kernels
                rows = 128 * math.ceil(s / 128)
                if kernel == "efficient":
                    scratch = self.bytes(b * a * 32 * math.ceil(s / 32), _F32)
                else:
                    d32 = 32 * math.ceil(c.d_head / 32)
                    scratch = (self.bytes(b * a * rows * d32, _F32)
                               + self.bytes(b * a * rows, _F32))
            grads = [(_TMP, X)] * 3
            if kernel == "efficient" and t.gpu is not None:  # one (b, s, 3, a, d) buffer
                grads = [(_TMP, self.bytes(3 * b * s * h, t.compute))]
            r.node(f"fused attention backward ({kernel})", [*grads, (_TMP, scratch)],
                   [(_TMP, scratch), (_TMP, X), (_ACT, saved)])
            r.node("q, k, v gradients concatenated", [(_TMP, 3 * X)],
                   [(_TMP, sum(n for _, n in grads))])
            return
        math_kernel = kernel == "math"
        inner = _F32 if math_kernel and t.compute != _F32 else t.compute
        soft = inner if math_kernel else (
            kernels.autocast_softmax_dtype(t.compute, t.gpu) if t.autocast else t.compute)
        cast = soft != inner  # CUDA autocast: softmax in fp32, probs @ v on a 16-bit copy
        heads_x = self.bytes(b * s * h, inner)
        scores = self.bytes(b * a * s * s, inner)
        probs = self.bytes(b * a * s * s, soft)
        self.linear(r, "attn proj backward", h, h, X, [(_TMP, g_in), (_ACT, X)],
                    bias=self.proj_bias)
        if inner != t.compute:
            self._cast(r, "sdpa output cast backward", X, heads_x)
        r.node("merge heads backward (copy)", [(_TMP, heads_x)],
               [(_TMP, heads_x if inner != t.compute else X)])
        kept_probs = scores if (p > 0 or cast) else 0  # a storage of its own for probs @ v
        # With b == 1 or a == 1 the head batches are views of the QKV output (see
        # activations.core_items); that storage goes only when q and k have been used too.
        v_view = (b == 1 or a == 1) and inner == t.compute
        v = 0 if v_view else heads_x
        r.node("probs @ v backward", [(_TMP, heads_x), (_TMP, scores)],
               [(_TMP, heads_x), (_ACT, v + kept_probs)])
        if cast:
            self._cast(r, "probabilities cast backward", scores, probs)
        if p > 0:
            mask = self.bytes(b * a * s * s, t.mask(soft))
            r.node("attention dropout backward", [(_TMP, probs)], [(_TMP, probs), (_ACT, mask)])
        r.node("softmax backward", [(_TMP, probs)], [(_TMP, probs), (_ACT, probs)])
        if cast:
            self._cast(r, "scores cast backward", probs, scores)
        if not math_kernel:
            r.node("masked_fill backward", [(_TMP, scores)],
                   [(_TMP, scores), (_ACT, self.bytes(s * s, torch.bool))])
            r.node("scale backward", [(_TMP, scores)], [(_TMP, scores)])
        qkv_out = self.bytes(3 * b * s * h, t.compute)
        qk = qkv_out if v_view and not math_kernel else 2 * heads_x + (qkv_out if v_view else 0)
        r.node("q @ k^T backward", [(_TMP, heads_x), (_TMP, heads_x)], [(_TMP, scores), (_ACT, qk)])
        if math_kernel:
            r.node("q, k scale backward", [(_TMP, heads_x), (_TMP, heads_x)], [(_TMP, 2 * heads_x)])
        if inner != t.compute:
            r.node("q, k, v cast back", [(_TMP, X)] * 3, [(_TMP, 3 * heads_x)])
        r.node("split heads backward (copies)", [(_TMP, X), (_TMP, X)], [(_TMP, 2 * X)])
        r.node("q, k, v gradients concatenated", [(_TMP, 3 * X)], [(_TMP, 3 * X)])


# The first backward node of the attention core: where a checkpointed core reruns.
_CORE_BACKWARD = ("probs @ v backward", "fused attention backward")


def adamw_scratch_bytes(param_bytes: list[int]) -> int:
    """Largest scratch of PyTorch's single-tensor AdamW (``foreach=False``), in bytes.

    Per parameter ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds two
    parameter-sized temporaries while the previous parameter's ``denom`` is still referenced:
    ``max_i(P[i-1] + 2*P[i])`` over ``param_bytes``, the parameters' bytes in the optimizer's order.
    Args:
        param_bytes (list of int): the parameters' bytes, in the optimizer's order.
    Returns:
        int: the bytes.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> adamw_scratch_bytes([400, 40])  # 2 * 400 for the first parameter
        800
    """
    if isinstance(param_bytes, str) or not isinstance(param_bytes, list | tuple) or not param_bytes:
        raise ValueError(f"param_bytes must be a non-empty list of ints (bytes), got "
                         f"{param_bytes!r}")
    for n in param_bytes:
        integer("param_bytes", n, minimum=0, maximum=MAX_BYTES)
    return _adamw_scratch(tuple(param_bytes))


def _adamw_scratch(param_bytes: tuple[int, ...]) -> int:
    """:func:`adamw_scratch_bytes` of checked sizes (the engine's own)."""
    return max((param_bytes[i - 1] if i else 0) + 2 * n for i, n in enumerate(param_bytes))


@functools.lru_cache(maxsize=1024)
def _block_terms(config: GPTConfig, b: int, s: int, t, mode: str) -> tuple[int, int, int]:
    """``(block, rebuilt, left)``: a plain block's kept bytes, its rerun's, the region's extra."""
    gpu = t.gpu
    block = act.total_bytes(act.block_items(config, b, s, t), act.STEP_KINDS, gpu)
    h = config.d_model
    x_in = kernels.allocated(b * s * h * dtype_bytes(t.stream), gpu)  # the block's input
    if mode in ("blocks", "sqrt"):
        return block, block - x_in, 0
    kw = dict(seq_len=s, dtype=t.compute, gpu=gpu, autocast=t.autocast)
    kept = (checkpointed.predict_kept_bytes(config, b, mode, **kw)
            - checkpointed.predict_kept_bytes(config, b, "blocks", **kw) + x_in)
    if mode == "attention":
        core = act.core_items(config, b, s, t)
        rebuilt = act.total_bytes([i for i in core if "QKV output" not in i.what],
                                  act.STEP_KINDS, gpu)
    else:  # selective: the matmul and attention outputs are kept; the rest is rebuilt
        fc_out = kernels.allocated(4 * b * s * h * dtype_bytes(t.compute), gpu)  # GELU's input
        # A fused kernel's saved tensors (q, k, v in the QKV output, its output, log-sum-exp)
        # are all kept outputs: none is rebuilt.
        core = (act.core_items(config, b, s, t) if config.attention == "sdpa"
                and kernels.sdpa_kernel(config, t.compute, gpu) != "math" else [])
        rebuilt = block - x_in - fc_out - act.total_bytes(core, act.STEP_KINDS, gpu)
        if mode == "save-kernel":  # the course kernel's output (the MLP proj's input) is kept
            rebuilt -= fc_out
    return block, rebuilt, kept + rebuilt - block


def _chunked_kept(config: GPTConfig, b: int, s: int, t) -> int:
    """What the chunked loss keeps minus what the plain one keeps (log-sum-exps and the int64
    target count for log-softmax and its fp32 total weight)."""
    n = b * s
    return (kernels.allocated(4 * n, t.gpu) + kernels.allocated(8, t.gpu)
            - kernels.allocated(4 * n * config.vocab_size, t.gpu) - kernels.allocated(4, t.gpu))


@functools.lru_cache(maxsize=1024)
def _kept_pieces(one: GPTConfig, b: int, s: int, t, mode: str) -> tuple[int, int, int]:
    """``(outside the blocks, a plain block, a checkpointed region's first block)``: bytes kept."""
    embed, (wrapped,), head, _, block = checkpointed.kept_layout(one, b, mode, 1, None, s, t.compute,
                                                                 t.gpu, t.autocast)
    total = functools.partial(act.total_bytes, kinds=act.STEP_KINDS, gpu=t.gpu)
    return total(embed) + total(head), total(block), total(wrapped)


def _kept_bytes(config: GPTConfig, b: int, s: int, t, mode: str, every: int,
                segments: int | None) -> int:
    """:func:`checkpointed.predict_kept_bytes` from per-piece sums."""
    # none, blocks and sqrt keep the same pieces (a region's first block keeps its input)
    piece_mode = "blocks" if mode in ("none", "sqrt") else mode
    outside, block, wrapped = _kept_pieces(_one_layer(config), b, s, t, piece_mode)
    regions = ckpt.checkpointed_regions(config.n_layers, mode, every, segments)
    covered = sum(len(region) for region in regions)
    return outside + (config.n_layers - covered) * block + len(regions) * wrapped


def _rerun_core(one: GPTConfig, b: int, s: int, t) -> tuple[int, int] | None:
    """``(after, scratch)`` of a block's rerun: saved after its core, the core's end scratch."""
    if t.autocast or one.fused_mlp:
        return None
    kernel = kernels.attention_kernel(one, t.compute, t.gpu)
    block = act.block_items(one, b, s, t)
    core = act.core_items(one, b, s, t)
    end = max(i for i, item in enumerate(block) if item in core)
    total = functools.partial(act.total_bytes, kinds=act.STEP_KINDS, gpu=t.gpu)
    if kernel == "math":
        return total(block[end + 1:]), _math_scratch(one, b, s, t)
    if kernel != "explicit":
        return None
    qkv_out = kernels.allocated(3 * b * s * one.d_model * dtype_bytes(t.compute), t.gpu)
    scratch = qkv_out + _explicit_core_peak(one, b, s, t, saved=True, keep_scores=False) \
        - total(core)
    return total(block[end + 1:]), scratch


def _selective_rerun(one: GPTConfig, b: int, s: int, t, after: int,
                     scratch: int) -> tuple[int, int, int]:
    """:func:`_rerun_core` under the selective policy's cache, plus the cached scores' bytes."""
    n, gpu, e = b * s * one.d_model, t.gpu, dtype_bytes(t.compute)
    inner = 4 if kernels.attention_kernel(one, t.compute, gpu) == "math" else e
    fc_out = kernels.allocated(4 * n * e, gpu)
    scores = kernels.allocated(b * one.n_heads * s * s * inner, gpu)
    return (after - fc_out,
            scratch - kernels.allocated(3 * n * e, gpu) - kernels.allocated(n * inner, gpu),
            scores)


def _rerun_core_scratch(one: GPTConfig, b: int, s: int, t) -> int:
    """What a rerun core holds at its end beyond what it saves, its inputs and its output."""
    core = _rerun_core(one, b, s, t)
    if core is None:
        return 0
    n, gpu, e = b * s * one.d_model, t.gpu, dtype_bytes(t.compute)
    out = kernels.allocated(n * e, gpu)
    if kernels.attention_kernel(one, t.compute, gpu) == "math" and e != 4:
        out += kernels.allocated(4 * n, gpu)  # the fp32 output, then its 16-bit cast
    return core[1] - kernels.allocated(3 * n * e, gpu) - out


@functools.lru_cache(maxsize=4096)
def _block_effect(one: GPTConfig, b: int, s: int, t, mode: str, rerun: int | None,
                  released: bool, left: int, accumulating: bool) -> _Effect:
    """One block's backward pass, after its region's recomputation, before its release."""
    bw = _Backward(one, b, s, t, accumulating)
    bw.in_region = rerun is not None and mode in ("blocks", "sqrt", *ckpt.SELECTIVE_MODES)

    # With dropout a selective policy caches the MLP's projection output for a rerun of the
    # dropout; the fused residual's rerun stops before it, at the projection's input, so the
    # region holds it until it is released.
    held = bw.x_compute if one.fused_residual and one.dropout > 0 and mode in ckpt.SELECTIVE_MODES else 0

    def one_block(r: _Replay) -> None:
        if one.fused_residual:
            bw.bias_dropout_add(r, "mlp")
        if rerun is not None:  # the backward pass unpacks a tensor of the region: it runs again
            core = _rerun_core(one, b, s, t) if mode in ("blocks", "sqrt", "selective") else None
            if core is None and mode in ckpt.SELECTIVE_MODES:  # the rerun takes the kept outputs
                # from the cache, which lets go of those no backward formula needs
                r.node("block {i}: cached outputs consumed", [], [(_ACT, left - held)])
            if core is not None:  # the rerun's attention core at its end, then the block's rest
                after, scratch = core
                if mode == "selective":  # its QKV output, its output and the MLP's are cached
                    after, scratch, scores = _selective_rerun(one, b, s, t, after, scratch)
                    r.node("block {i}: cached scores consumed", [], [(_ACT, scores)])
                r.node("block {i}: rerun's attention",
                       [(_ACT, rerun - after), (_TMP, scratch)], [(_TMP, scratch)])
                if mode == "selective":  # the other cached outputs the rerun consumed, held by
                    # the attention's locals until it returns (the QKV output by q, k and v)
                    r.node("block {i}: cached outputs consumed", [],
                           [(_ACT, left - scores - held)])
                r.node("block {i}: recomputation", [(_ACT, after)])
            elif mode == "attention":  # the core alone, with its scratch (the QKV output is kept),
                # rerun when the backward pass reaches it
                r.pending = ("block {i}: recomputation", rerun, _CORE_BACKWARD,
                             _rerun_core_scratch(one, b, s, t))
            else:
                r.node("block {i}: recomputation", [(_ACT, rerun)])
        bw.block(r)
        if released and (mode == "attention" or held):  # what its checkpoint still held
            r.node("block {i}: region released", [], [(_ACT, held or left)])

    return _Replay.effect(one_block, accumulating)


def _backward_moment(config: GPTConfig, b: int, s: int, t, mode: str, every: int,
                     segments: int | None, loss_chunk: int | None, grads: int = 0) -> dict:
    """``{"live": ..., "moment": ...}`` at the worst moment of one micro-batch's backward pass;
    ``grads``: the bytes of the ``.grad`` tensors earlier micro-batches left (none: the first)."""
    kept = _kept_bytes(config, b, s, t, mode, every, segments)
    if loss_chunk is not None:
        kept += _chunked_kept(config, b, s, t)
    bw = _Backward(config, b, s, t, accumulating=grads > 0)
    r = _Replay({_GRAD: grads, _ACT: kept, _TMP: bw.bytes(1, _F32)}, bw.accumulating)  # the loss
    if loss_chunk is None:
        bw.head(r)
    else:
        bw.chunked_head(r, loss_chunk)
    regions = ckpt.checkpointed_regions(config.n_layers, mode, every, segments)
    last = {region[-1]: region for region in regions}
    first = {region[0] for region in regions}
    one = _one_layer(config)  # every block is alike: one is replayed (cached)
    block, rebuilt, left = _block_terms(one, b, s, t, mode) if regions else (0, 0, 0)

    def kind_of(i: int) -> tuple:
        rerun = rebuilt + (len(last[i]) - 1) * block if i in last else None
        return rerun, i in first and mode in (*ckpt.SELECTIVE_MODES, "attention")

    # Blocks of one kind free and allocate the same: each kind is replayed once (and cached),
    # a run of like blocks is added in one go, and so is a repeated pair of runs (what every
    # k-th block and sqrt segments give: a checkpointed block, then k - 1 plain ones).
    runs = [(kind, len(list(run))) for kind, run in
            itertools.groupby(reversed(range(config.n_layers)), key=kind_of)]

    def run_effect(kind, n) -> _Effect:
        return _block_effect(one, b, s, t, mode, *kind, left, bw.accumulating).repeat(n)

    top, i = config.n_layers - 1, 0
    while i < len(runs):
        pair, times = runs[i:i + 2], 1
        while len(pair) == 2 and runs[i + 2 * times:i + 2 * times + 2] == pair:
            times += 1
        if times > 1:
            effect = run_effect(*pair[0]).then(run_effect(*pair[1])).repeat(times)
            i += 2 * times
        else:
            effect = run_effect(*runs[i])
            i += 1
        r.apply(effect, top)
        top -= effect.blocks
    bw.embeddings(r)
    return {"live": r.best, "moment": r.moment}


def _chunked_forward(config: GPTConfig, b: int, s: int, t, mode: str, every: int,
                     segments: int | None, loss_chunk: int) -> dict:
    """The chunked loss's forward moment: every kept activation plus the last chunk's logits."""
    n, V, gpu = min(loss_chunk, b * s), config.vocab_size, t.gpu
    kept = (checkpointed.predict_kept_bytes(config, b, mode, every, segments=segments, seq_len=s,
                                    dtype=t.compute, gpu=gpu, autocast=t.autocast)
            + _chunked_kept(config, b, s, t))
    z = kernels.allocated(4 * n * V, gpu)
    if t.compute == _F32:  # the logits, the clamped target ids, the picked logits
        peak = z + kernels.allocated(8 * n, gpu) + kernels.allocated(4 * n, gpu)
    else:  # the 16-bit product and its fp32 copy
        peak = z + kernels.allocated(n * V * dtype_bytes(t.compute), gpu)
    scratch = kernels.allocated(b * s, gpu) + kernels.allocated(4, gpu) + peak  # mask, total
    return {"live": {_GRAD: 0, _ACT: kept, _TMP: scratch}, "moment": "chunked loss (forward)"}


def _math_scratch(config: GPTConfig, b: int, s: int, t) -> int:
    """What SDPA's math kernel holds at its end beyond what it saves (:func:`_math_forward`)."""
    gpu, e, a, n = t.gpu, dtype_bytes(t.compute), config.n_heads, b * s * config.d_model

    def al(numel, nbytes):
        return kernels.allocated(numel * nbytes, gpu)

    views = b == 1 or a == 1  # head batches are views: no copies (activations.core_items)
    if e == 4:
        return 2 * al(n, 4) + al(s * s, 4) + (0 if views else al(3 * n, e))
    copies = (3 if views else 5) * al(n, 4)
    return copies + al(s * s, 4) + al(b * a * s * s, e) + al(n, e) + al(3 * n, e)


def _math_forward(config: GPTConfig, b: int, s: int, t) -> dict | None:
    """The forward moment where SDPA runs its math kernel: the last block's attention."""
    if config.attention != "sdpa" or kernels.sdpa_kernel(config, t.compute, t.gpu) != "math":
        return None
    gpu = t.gpu
    block = act.block_items(config, b, s, t)
    last_core = max(i for i, item in enumerate(block) if item.op.startswith("sdpa"))
    head = act.head_items(config, b, s, t)
    after = (act.total_bytes(block[last_core + 1:], act.STEP_KINDS, gpu)
             + act.total_bytes(head, act.STEP_KINDS, gpu))
    whole = [*act.embedding_items(config, b, s, t), *(block * config.n_layers), *head]
    saved = act.total_bytes(whole, act.STEP_KINDS, gpu) - after
    return {"live": {_GRAD: 0, _ACT: saved, _TMP: _math_scratch(config, b, s, t)},
            "moment": "last block's attention (forward)"}


def _explicit_core_peak(config: GPTConfig, b: int, s: int, t, *, saved: bool,
                        keep_scores: bool) -> int:
    """Bytes above its start at the worst moment of the explicit core's forward."""
    a, p, e = config.n_heads, config.dropout, dtype_bytes(t.compute)
    gpu = t.gpu

    def al(numel, dtype_bytes_):
        return kernels.allocated(numel * dtype_bytes_, gpu)

    X = 0 if (b == 1 or a == 1) else al(b * s * config.d_model, e)  # a head-batched copy
    S = al(b * a * s * s, e)
    M = al(b * a * s * s, dtype_bytes(t.mask(t.compute)))
    B = al(s * s, 1)
    # Allocations and (negative) frees in order; the peak is the largest running sum.
    sizes = [X, X, S,                                # q, k copies; q @ k^T
             S,                                      # * 1/sqrt(d)
             -(0 if saved else 2 * X) - (0 if keep_scores else S),
             B, B, -B,                               # ones, tril (the local mask)
             B, S,                                   # ~mask, masked_fill
             -S - (0 if saved else B),               # the scaled scores; ~mask unless saved
             S]                                      # softmax
    if p > 0:
        sizes += [M, S, -(0 if saved else S + M)]    # dropout: its mask, its output
    sizes += [X,                                     # v copy
              al(b * s * config.d_model, e)]         # probs @ v
    return max(itertools.accumulate(sizes, initial=0))


@functools.lru_cache(maxsize=1024)
def _explicit_forward(config: GPTConfig, b: int, s: int, t, mode: str, every: int,
                      segments: int | None) -> dict | None:
    """The forward moment of explicit attention: the last block's core at its worst."""
    if config.attention != "explicit" or t.autocast:
        return None
    gpu, L, h = t.gpu, config.n_layers, config.d_model
    embed, per_block, _, regions, _ = checkpointed.kept_layout(config, b, mode, every, segments, s,
                                                   t.compute, gpu, t.autocast)
    total = functools.partial(act.total_bytes, kinds=act.STEP_KINDS, gpu=gpu)
    below = total(embed) + sum(total(items) for items in per_block[:L - 1])
    wrapped = {region[0] for region in regions}
    last_wrapped = mode != "sqrt" and L - 1 in wrapped  # sqrt leaves the last segment plain
    x_in = kernels.allocated(b * s * h * dtype_bytes(t.stream), gpu)
    qkv_out = kernels.allocated(3 * b * s * h * dtype_bytes(t.compute), gpu)
    ln_and_input = total(act.block_items(config, b, s, t)[:4])  # ln1's and the QKV input
    if not last_wrapped or mode == "attention":
        start = ln_and_input + qkv_out
    else:  # blocks, selective: the block's input, LayerNorm's output (the attention's argument,
        # alive until the attention returns) and the QKV output (cached or not)
        start = 2 * x_in + qkv_out
    core = _explicit_core_peak(config, b, s, t, saved=not last_wrapped,
                               keep_scores=last_wrapped and mode in ckpt.SELECTIVE_MODES)
    return {"live": {_GRAD: 0, _ACT: below + start, _TMP: core},
            "moment": "last block's attention (forward)"}


@functools.lru_cache(maxsize=4096)
def _one_layer(config: GPTConfig) -> GPTConfig:
    """``config`` with one block: the per-block pieces every depth shares (made and checked once)."""
    return replace(config, n_layers=1)


@dataclass(frozen=True)
class _Sizes:
    """The parameters of one model as a device allocates them in one dtype, in bytes."""

    total: int           # all parameter tensors
    last: int            # the last tensor (the final LayerNorm's)
    adamw_scratch: int   # :func:`adamw_scratch_bytes` of these tensors
    count: int           # how many tensors


@functools.lru_cache(maxsize=64)
def _target(precision: str, gpu: GPU | None) -> Step:
    """The Step whose dtypes and device rules the internals read (only its precision and GPU)."""
    return Step(GPTConfig(), precision=precision, gpu=gpu)


@functools.lru_cache(maxsize=1024)
def _block_sizes(one: GPTConfig, element_bytes: int, gpu: GPU | None) -> tuple[_Sizes, _Sizes]:
    """:class:`_Sizes` of ``one`` (a one-block model) and of the same model with two blocks."""
    sizes = [tuple(kernels.allocated(n * element_bytes, gpu) for n in param_numels(c))
             for c in (one, replace(one, n_layers=2))]
    return tuple(_Sizes(sum(s), s[-1], _adamw_scratch(s), len(s)) for s in sizes)


def _param_sizes(config: GPTConfig, element_bytes: int, gpu: GPU | None) -> _Sizes:
    """:class:`_Sizes` of ``config`` from those of one and two blocks (all blocks are alike)."""
    one, two = _block_sizes(_one_layer(config), element_bytes, gpu)
    if config.n_layers == 1:
        return one
    extra = config.n_layers - 2
    return _Sizes(two.total + extra * (two.total - one.total), two.last, two.adamw_scratch,
                  two.count + extra * (two.count - one.count))


def _model_states(config: GPTConfig, precision: str, gpu: GPU | None) -> tuple[_Sizes, int, int]:
    """``(the parameters' sizes, master weights' bytes, optimizer state's bytes)``."""
    spec = PRECISION[precision]
    params = _param_sizes(config, dtype_bytes(spec.params), gpu)
    states = _param_sizes(config, dtype_bytes(spec.state), gpu)
    steps = states.count * kernels.allocated(4, gpu) if kernels.optimizer_steps_on_device(gpu) else 0
    master = _param_sizes(config, 4, gpu).total if spec.master else 0
    return params, master, 2 * states.total + steps


@functools.lru_cache(maxsize=8192)
def _moments(config: GPTConfig, b: int, K: int, precision: str, mode: str, every: int,
             segments: int | None, s: int, gpu: GPU | None, first_step: bool,
             foreach: bool, loss_chunk: int | None = None) -> dict[str, StepMemory]:
    t = _target(precision, gpu)
    params, master, state = _model_states(config, precision, gpu)
    P = params.total
    resident = dict(parameters=P, master_weights=master,
                    optimizer_state=0 if first_step else state, first_step=first_step)
    out = {}
    # The forward moment: SDPA's math kernel scratch (no checkpointing), or the explicit core's
    # s x s maps (every mode: a checkpointed core still builds them).
    forward = _math_forward(config, b, s, t) if mode == "none" else None
    if forward is None:
        forward = _explicit_forward(config, b, s, t, mode, every, segments)
    if loss_chunk is not None:
        chunked = _chunked_forward(config, b, s, t, mode, every, segments, loss_chunk)
        if forward is None or sum(chunked["live"].values()) > sum(forward["live"].values()):
            forward = chunked
    backward = _backward_moment(config, b, s, t, mode, every, segments, loss_chunk)
    for name, found in (("forward", forward), ("backward", backward)):
        if found is None:
            continue
        live = found["live"]
        out[name] = StepMemory(f"{name}, micro-batch 1: {found['moment']}", **resident,
                               gradients=live[_GRAD], activations=live[_ACT],
                               transient=live[_TMP])
        if K > 1 and name == "forward":  # the .grad tensors exist; the forward adds no gradient
            out[name + " 2+"] = StepMemory(f"{name}, micro-batch 2+: {found['moment']}", **resident,
                                           gradients=P, activations=live[_ACT],
                                           transient=live[_TMP] + live[_GRAD])
        elif K > 1:  # replayed with the .grad tensors there: each new gradient is transient
            again = _backward_moment(config, b, s, t, mode, every, segments, loss_chunk, P)
            live = again["live"]
            out[name + " 2+"] = StepMemory(f"{name}, micro-batch 2+: {again['moment']}",
                                           **resident, gradients=live[_GRAD],
                                           activations=live[_ACT], transient=live[_TMP])
    out["optimizer"] = _optimizer_moment(config, precision, gpu, foreach, first_step)
    return out


@functools.lru_cache(maxsize=4096)
def _optimizer_moment(config: GPTConfig, precision: str, gpu: GPU | None, foreach: bool,
                      first_step: bool) -> StepMemory:
    """The optimizer step's moment: the model's and its precision's alone (cached)."""
    spec = PRECISION[precision]
    params, master, state = _model_states(config, precision, gpu)
    optimizer = dict(parameters=params.total, master_weights=master, optimizer_state=state,
                     first_step=first_step)
    loss = kernels.allocated(4, gpu)
    if spec.master:  # fp32 copies of the gradients replace the 16-bit ones one tensor at a time
        master_grads = _param_sizes(config, 4, gpu)
        scratch = max(2 * params.last,
                      master_grads.total if foreach else master_grads.adamw_scratch)
        return StepMemory("optimizer step (fp32 master gradients)", **optimizer,
                          gradients=master_grads.total, activations=0, transient=scratch + loss)
    states = _param_sizes(config, dtype_bytes(spec.state), gpu)
    scratch = states.total if foreach else states.adamw_scratch
    return StepMemory("AdamW step", **optimizer, gradients=params.total, activations=0,
                      transient=scratch + loss)


@functools.lru_cache(maxsize=8192)
def _floor(config: GPTConfig, b: int, K: int, precision: str, mode: str, every: int, s: int,
           gpu: GPU | None) -> int:
    params, master, state = _model_states(config, precision, gpu)
    kept = _kept_bytes(config, b, s, _target(precision, gpu), mode, every, None)
    return (params.total + master + state + (params.total if K > 1 else 0) + kept
            + kernels.allocated(4, gpu))


def moments(step: Step) -> dict[str, StepMemory]:
    """The moments of a checked :class:`Step` that compete for its peak, in the step's order."""
    return dict(_moments(step.config, step.micro_batch_size, step.accumulation_steps,
                         step.precision, step.mode, step.every, step.segments, step.seq_len,
                         _card(step), step.first_step, step.runs_foreach, step.loss_chunk))


def floor(step: Step) -> int:
    """A lower bound on a :class:`Step`'s peak: the moment its backward pass starts."""
    return _floor(step.config, step.micro_batch_size, step.accumulation_steps, step.precision,
                  step.mode, step.every, step.seq_len, _card(step))


def model_floor(step: Step) -> int:
    """A lower bound on the peak of every step of this model and precision: its optimizer step."""
    return _optimizer_moment(step.config, step.precision, _card(step), step.runs_foreach,
                             False).total


def _card(step: Step) -> GPU | None:
    """The step's GPU without its free memory, which does not change the step (a cache key)."""
    gpu = step.gpu
    return gpu if gpu is None or gpu.free_memory is None else replace(gpu, free_memory=None)
