"""05: pick the checkpointing policy that fits a memory budget at the least recompute.

:func:`plan_checkpointing` considers every mode of
:func:`course_lib.checkpointing.enable_checkpointing` (``none``; ``selective``,
``attention`` and ``blocks`` with ``every = 1 .. n_layers``; ``sqrt``), predicts
for each the peak of one AdamW training step (:func:`predict_peak`) and the FLOPs
it recomputes (:func:`course_lib.checkpointing.step_flops`), and returns the
cheapest that fits:

* **cost**: recomputed FLOPs as ``FlopCounterMode`` counts them (matmuls and
  attention kernels), then, among equal FLOPs, fewer checkpointed regions (each
  reruns its pointwise ops: LayerNorm, GELU, softmax, dropout). ``selective``
  reruns no matmul (a fused attention kernel does run again), so it usually is
  the cheapest policy that saves anything.
* **peak**: the backward pass replayed node by node as
  :func:`course_lib.activations.predict_step_peak` does it for the plain model,
  starting from the activations the mode keeps
  (:func:`course_lib.checkpointing.predict_kept_bytes`); when the backward pass
  reaches a checkpointed region, the region's activations are rebuilt on top of
  what is live (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
  Cost": the peak is the kept inputs plus the largest region rebuilt). The AdamW
  step's own peak (gradients, ``m``, ``v`` and scratch) competes, and wins when
  activations are small. Bytes, above the parameters, as
  :func:`course_lib.measure.peak_memory` measures ``training_step``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from . import activations as act
from . import checkpointing as ckpt
from .models import GPTConfig
from .units import as_dtype, dtype_bytes, format_bytes

#: The modes the planner considers, in order of increasing recompute for one region.
PLAN_MODES = ("none", "selective", "attention", "blocks", "sqrt")


@dataclass(frozen=True)
class Candidate:
    """One policy, predicted: peak bytes of a training step and FLOPs recomputed."""

    mode: str
    every: int
    peak_bytes: int
    kept_bytes: int       # activations held from forward to backward
    recompute_flops: int  # FLOPs run again in the backward pass
    step_flops: int       # FLOPs of the plain step (forward + backward), for the fraction
    regions: int          # checkpointed regions (each reruns its pointwise ops)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs over the plain step's: 0.33 is one extra forward pass."""
        return self.recompute_flops / self.step_flops

    @property
    def cost(self) -> tuple[int, int]:
        """The planner's order: recomputed FLOPs, then the number of checkpointed regions."""
        return (self.recompute_flops, self.regions)

    @property
    def label(self) -> str:
        return self.mode if self.mode in ("none", "sqrt") else f"{self.mode}/{self.every}"


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen policy, its predictions, and every candidate considered."""

    mode: str
    every: int
    peak_bytes: int
    recompute_flops: int
    recompute_fraction: float
    budget_bytes: int
    candidates: tuple = field(repr=False)

    def table(self) -> str:
        """The candidates as text, cheapest first, the fitting ones marked."""
        rows = [f"{'policy':14s} {'peak':>11s} {'+FLOPs':>10s}  fits"]  # vs a plain step
        for c in self.candidates:
            mark = "<- chosen" if (c.mode, c.every) == (self.mode, self.every) else (
                "yes" if c.peak_bytes <= self.budget_bytes else "")
            rows.append(f"{c.label:14s} {format_bytes(c.peak_bytes):>11s} "
                        f"{c.recompute_fraction:10.1%}  {mark}")
        return "\n".join(rows)


class NothingFits(ValueError):
    """No policy's predicted peak is within the budget; ``candidates`` says how close each came."""

    def __init__(self, budget_bytes: int, candidates: tuple):
        self.budget_bytes, self.candidates = budget_bytes, candidates
        best = min(candidates, key=lambda c: c.peak_bytes)
        super().__init__(
            f"budget_bytes={budget_bytes} ({format_bytes(budget_bytes)}) is below every policy's "
            f"predicted peak; the smallest is {best.label} at {best.peak_bytes} bytes "
            f"({format_bytes(best.peak_bytes)}): shrink the batch or the sequence, or add memory")


def _regions(n_layers: int, mode: str, every: int) -> list[list[int]]:
    """Checkpointed regions as block lists (``attention``: the blocks whose core is checkpointed)."""
    if mode == "none":
        return []
    if mode == "sqrt":
        return ckpt.sequential_segments(n_layers, ckpt.sqrt_segments(n_layers))[:-1]
    return [[i] for i in ckpt.checkpointed_blocks(n_layers, every)]


def _block_terms(config: GPTConfig, b: int, s: int, dtype, mode: str) -> tuple[int, int, int]:
    """``(block, rebuilt, left)`` bytes for one checkpointed region of one block.

    ``block``: what a plain block keeps; ``rebuilt``: what recomputation adds when
    the backward pass reaches the region; ``left``: what the region still holds
    after its blocks' backward freed what a plain block frees (selective: matmul
    outputs no backward needs; attention: the QKV output its checkpoint held).
    """
    kinds = ("activation",)
    block = act.total_bytes(act.block_saved(config, b, s, dtype), kinds)
    X = b * s * config.d_model * dtype_bytes(dtype)
    if mode in ("blocks", "sqrt"):
        return block, block - X, 0
    one = replace(config, n_layers=1)
    kept = (ckpt.predict_kept_bytes(one, b, mode, seq_len=s, dtype=dtype)
            - ckpt.predict_kept_bytes(one, b, "blocks", seq_len=s, dtype=dtype) + X)
    if mode == "attention":
        core = act.attention_core_saved(config, b, s, dtype)
        rebuilt = act.total_bytes([i for i in core if "QKV output" not in i.what], kinds)
    else:  # selective: the matmul outputs are kept; the rest of the block is rebuilt
        fused = config.attention == "sdpa" and act.sdpa_kernel(config, dtype) != "math"
        shared = 4 * X + (3 * X if fused else 0)  # GELU's input (fc output); sdpa's q, k, v
        rebuilt = block - X - shared
    return block, rebuilt, kept + rebuilt - block


# The first backward node of the attention core in activations' replay: where the core reruns.
_CORE_BACKWARD = ("probs @ v backward", "sdpa flash backward")


class _Replay(act._Replay):
    """The backward replay of :mod:`course_lib.activations`, with recomputation inserted.

    ``recompute(label, nbytes, before=labels)`` adds ``nbytes`` of rebuilt
    activations now, or, with ``before``, just before the next node whose label
    starts with one of ``labels`` (the attention core reruns only when its own
    backward starts, after the MLP's).
    """

    pending = None

    def recompute(self, label: str, nbytes: int, before: tuple | None = None) -> None:
        if before is None:
            super().node(label, [(act._ACT, nbytes)])
        else:
            self.pending = (label, nbytes, before)

    def node(self, label: str, allocs, frees=()) -> None:
        if self.pending and label.startswith(self.pending[2]):
            pending, self.pending = self.pending, None
            super().node(pending[0], [(act._ACT, pending[1])])
        super().node(label, allocs, frees)


def _config_key(config: GPTConfig) -> tuple:
    return tuple(sorted(vars(config).items()))


@functools.lru_cache(maxsize=256)
def _per_mode(key: tuple, b: int, s: int, dtype: torch.dtype, mode: str) -> tuple:
    """``(kept with no checkpoint, block, rebuilt, left)`` bytes, computed once per shape and mode."""
    config = GPTConfig(**dict(key))
    none = ckpt.predict_kept_bytes(config, b, "none", seq_len=s, dtype=dtype)
    return (none, *_block_terms(config, b, s, dtype, mode))


def _kept_bytes(config: GPTConfig, b: int, s: int, dtype, mode: str, every: int) -> int:
    """:func:`course_lib.checkpointing.predict_kept_bytes`, by difference from the plain model."""
    if mode == "sqrt":
        return ckpt.predict_kept_bytes(config, b, mode, seq_len=s, dtype=dtype)
    none, block, rebuilt, left = _per_mode(_config_key(config), b, s, dtype, mode)
    kept_region = block - rebuilt + left  # what one checkpointed block keeps instead of `block`
    return none - len(_regions(config.n_layers, mode, every)) * (block - kept_region)


def predict_peak(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                 seq_len: int | None = None, dtype=torch.float32) -> act.StepPeak:
    """Predicted peak of one AdamW ``training_step`` of ``GPT(config)`` under checkpointing ``mode``.

    Bytes above the parameters, decomposed as :class:`course_lib.activations.StepPeak`
    (``.total`` is the figure; ``.moment`` says where in the step it falls).
    ``mode="none"`` is :func:`course_lib.activations.predict_step_peak`. CPU
    conventions (dropout masks in the activation dtype). Against the tracker on the CPU
    (``benchmarks/estimator_accuracy.py``, 160 configurations): exact to the byte without
    dropout; with dropout, ``blocks``, ``attention`` and ``selective`` can be low by up to 2%,
    2% and 6.5% (explicit attention: the selective rerun peaks in the *forward* pass, a moment
    this replay does not model), and in 16-bit with ``attention="sdpa"`` (the CPU's math
    kernel, fp32 inside) by up to 6%. On CUDA the allocator adds rounding and workspaces,
    and masks and AdamW's scratch differ: expect larger errors there.
    """
    moments = predict_moments(config, batch_size, mode, every, seq_len=seq_len, dtype=dtype)
    return max(moments.values(), key=lambda peak: peak.total)


def predict_moments(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                    seq_len: int | None = None, dtype=torch.float32) -> dict[str, act.StepPeak]:
    """The candidate moments of :func:`predict_peak` by name ("backward", "optimizer", and
    "forward" where SDPA's math kernel runs): a steady-state step, whose AdamW state already
    exists during the backward pass, needs the backward moment on its own."""
    seq_len = config.seq_len if seq_len is None else seq_len
    if mode == "none":
        return act.predict_step_moments(config, batch_size, seq_len, dtype)
    ckpt.checkpointed_blocks(config.n_layers, every)  # validates every
    if mode not in PLAN_MODES:
        raise ValueError(f"mode must be one of {PLAN_MODES}, got {mode!r}")
    b, s, dtype = batch_size, seq_len, as_dtype(dtype)
    kept = _kept_bytes(config, b, s, dtype, mode, every)
    _, block, rebuilt, left = _per_mode(_config_key(config), b, s, dtype, mode)
    regions = _regions(config.n_layers, mode, every)
    last = {region[-1]: region for region in regions}
    first = {region[0] for region in regions}
    # Without dropout the rerun stops before the block's last matmul (torch.utils.checkpoint
    # stops early once the backward has all it needs): its cached output is never consumed.
    X = b * s * config.d_model * dtype_bytes(dtype)
    tail = X if config.dropout == 0 else 0
    r = _Replay({act._GRAD: 0, act._ACT: kept, act._TMP: 4})
    act._replay_head(r, config, b, s, dtype)
    for i in reversed(range(config.n_layers)):
        if i in last:  # the backward pass unpacks a tensor of the region: it runs again
            extra = (len(last[i]) - 1) * block
            if mode == "selective":  # the rerun takes the kept matmul outputs from the cache,
                # which lets go of those no backward formula needs as they are consumed
                r.node(f"block {i}: cached matmul outputs consumed", [], [(act._ACT, left - tail)])
            r.recompute(f"block {i}: recomputation", rebuilt + extra,
                        before=_CORE_BACKWARD if mode == "attention" else None)
        act._replay_block(r, config, b, s, dtype)
        if i in first and mode in ("selective", "attention"):  # what its checkpoint still held
            r.node(f"block {i}: region released", [],
                   [(act._ACT, tail if mode == "selective" else left)])
    return act.replay_moments(r, act._param_bytes(config, dtype))


def candidates(config: GPTConfig, batch_size: int, *, seq_len: int | None = None,
               dtype=torch.float32, modes: tuple = PLAN_MODES) -> tuple:
    """Every policy of ``modes`` for this model and batch, predicted, cheapest first.

    ``every`` runs over ``1 .. n_layers`` for ``selective``, ``attention`` and
    ``blocks``; ``none`` and ``sqrt`` come once. Sorted by :attr:`Candidate.cost`.
    """
    if not isinstance(modes, tuple | list) or not modes or any(m not in PLAN_MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {PLAN_MODES}, got {modes!r}")
    seq_len = config.seq_len if seq_len is None else seq_len
    L = config.n_layers
    out = []
    for mode in modes:
        for every in (range(1, L + 1) if mode in ("selective", "attention", "blocks") else (1,)):
            flops, extra = ckpt.step_flops(config, batch_size, mode, every, seq_len=seq_len,
                                           dtype=dtype)
            peak = predict_peak(config, batch_size, mode, every, seq_len=seq_len, dtype=dtype)
            kept = (ckpt.predict_kept_bytes(config, batch_size, seq_len=seq_len, dtype=dtype)
                    if mode == "none" else _kept_bytes(config, batch_size, seq_len,
                                                       as_dtype(dtype), mode, every))
            out.append(Candidate(mode, every, peak.total, kept, extra, flops - extra,
                                 len(_regions(L, mode, every))))
    return tuple(sorted(out, key=lambda c: (c.cost, c.peak_bytes)))


def pareto_front(points) -> list:
    """The points no other point beats on both axes: ``(memory, time, label)`` tuples, by memory.

    A point is dominated if another has memory <= and time <= with one of them
    strictly smaller. Used on measured (peak bytes, step seconds) of every policy.
    """
    points = list(points)
    if any(len(p) < 2 for p in points):
        raise ValueError("points must be (memory, time, ...) tuples")
    front = [p for p in points if not any(
        q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)]
    return sorted(front, key=lambda p: (p[0], p[1]))


def plan_checkpointing(config: GPTConfig, batch_size: int, seq_len: int | None,
                       budget_bytes: int, *, dtype=torch.float32,
                       modes: tuple = PLAN_MODES) -> Plan:
    """The policy with the least recompute whose predicted step peak fits ``budget_bytes``.

    ``config``: a :class:`course_lib.models.GPTConfig`; ``batch_size`` and
    ``seq_len`` (None: ``config.seq_len``) the micro-batch; ``budget_bytes``: the
    memory the step may allocate above the parameters (an int, bytes). Returns a
    :class:`Plan` (``mode``, ``every``, predicted ``peak_bytes``, recomputed FLOPs
    and their fraction of the plain step, and all ``candidates``), to apply with
    ``enable_checkpointing(model, plan.mode, plan.every)``. Raises
    :class:`NothingFits` (a ``ValueError``) when no policy fits, and ``ValueError``
    naming the argument for bad input.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a course_lib.models.GPTConfig, got {type(config).__name__}")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int (bytes), got {budget_bytes!r}")
    options = candidates(config, batch_size, seq_len=seq_len, dtype=dtype, modes=modes)
    for c in options:
        if c.peak_bytes <= budget_bytes:
            return Plan(c.mode, c.every, c.peak_bytes, c.recompute_flops, c.recompute_fraction,
                        budget_bytes, options)
    raise NothingFits(budget_bytes, options)
