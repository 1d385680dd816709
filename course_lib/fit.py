"""06: fit it together: the largest GPT, or the largest batch, that trains within a memory budget.

Every step is predicted by the memory engine
(:func:`course_lib.engine.predict_step_memory`, re-exported here as
:func:`predict_step_memory`) for a *steady-state* optimizer step (the second and
later: AdamW's ``m`` and ``v`` exist before it starts) of ``K`` accumulated
micro-batches, on the CPU or on a GPU (``gpu``: a preset of
:data:`course_lib.device.GPUS` or this kernel's). Precisions are the engine's
(:data:`course_lib.engine.PRECISIONS`); mixed precision saves activation memory,
not model-state memory: the claim check of lecture 06 measures it.

:func:`largest_batch` finds, for one model, the largest micro-batch under each
checkpointing policy; :func:`fit_model` finds the largest GPT of a search space
and the settings (precision, micro-batch, accumulation steps, checkpointing)
that train it with a given effective batch. :func:`build` makes the model and
optimizer those predictions are for, and :func:`measure_step_memory` measures
them. :func:`run_within_budget` runs a training function under the budget: on
CUDA it sets ``torch.cuda.set_per_process_memory_fraction`` and catches the real
``OutOfMemoryError``; elsewhere a :class:`BudgetTracker` stops the work when
its live tensors exceed the budget. Either way the result is a :class:`Trial`
with a clear message, and the kernel survives.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from . import checkpointing as ckpt
from . import engine
from .checkpointing import enable_checkpointing
from .device import resolve_gpu
from .engine import StepMemory, breakdown_rows, predict_step_memory
from .measure import LiveTensorTracker, peak_memory, resident_bytes
from .memory import MAX_WORLD_SIZE
from .models import CONFIG_MAXIMUM, GPT, MAX_SEED, GPTConfig, gpt_param_count, param_numels
from .training import make_grad_scaler, train
from .units import format_bytes
from .validation import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    boolean,
    choice,
    function,
    integer,
    number,
    optional_positive_int,
    positive_int,
    text,
)
from .validation import device as as_device

FIT_PRECISIONS = engine.PRECISIONS
#: The checkpointing policies the search considers, ``(mode, every)``, in order of increasing
#: recompute (:func:`course_lib.checkpointing.step_flops`): none; matmul outputs kept, the rest
#: of every block recomputed; every other block whole; every block; sqrt(n) segments.
FIT_POLICIES = (("none", 1), ("selective", 1), ("blocks", 2), ("blocks", 1), ("sqrt", 1))
#: Default search space of :func:`fit_model`: d_model in steps of 128, 1 to 128 layers, 64-wide heads,
#: d_model / n_layers between 32 and 128 (see :func:`search_space`).
DEFAULT_WIDTHS = tuple(range(128, 8192 + 1, 128))
DEFAULT_DEPTHS = tuple(range(1, 129))
DEFAULT_ASPECT_RATIO = (32, 128)
#: The most sequences per optimizer step :func:`fit_model` takes (16M, as every batch size of
#: the course: :data:`course_lib.validation.MAX_BATCH`; GPT-3's batches held 1,600 sequences).
#: Its micro-batches are the divisors of the effective batch, found in
#: ``O(sqrt(effective_batch))``.
MAX_EFFECTIVE_BATCH = MAX_BATCH
#: The most widths, and the most depths, a search space takes (the defaults hold 64 and 128).
MAX_SEARCH_VALUES = 1024

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# --------------------------------------------------------------------------- validation

def _check_precision(precision, name: str = "precision") -> str:
    return choice(name, precision, FIT_PRECISIONS)


def _check_config(config) -> GPTConfig:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a course_lib.models.GPTConfig, got {type(config).__name__}")
    return config


def _check_policies(policies) -> tuple:
    modes = ckpt.MODES
    if (isinstance(policies, str) or not isinstance(policies, Sequence) or not policies or any(
            not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], str)
            or p[0] not in modes or not isinstance(p[1], int) or isinstance(p[1], bool)
            or not 1 <= p[1] <= MAX_COUNT for p in policies)):
        raise ValueError(f"policies must be a non-empty sequence of (mode, every) pairs with mode "
                         f"in {modes}, got {policies!r}")
    return tuple(policies)


def model_dtype(precision: str) -> torch.dtype:
    """The dtype of the model's parameters under ``precision`` (fp32 under autocast)."""
    return engine.precision_of(_check_precision(precision)).params


def _label(mode: str, every: int) -> str:
    return mode if mode in ("none", "sqrt") else f"{mode}/{every}"


def _recompute_fraction(config: GPTConfig, mode: str, every: int, seq_len: int) -> float:
    """Recomputed FLOPs over the plain step's (:func:`course_lib.checkpointing.step_flops`)."""
    flops, extra = ckpt.step_flops(config, 1, mode, every, seq_len=seq_len)
    return extra / (flops - extra)


# --------------------------------------------------------------------------- the largest batch

@dataclass(frozen=True)
class BatchFit:
    """The largest micro-batch of one checkpointing policy (0 if not even one sequence fits)."""

    mode: str
    every: int
    micro_batch_size: int
    memory: StepMemory | None  # predicted at that micro-batch (None when it is 0)
    recompute_fraction: float

    @property
    def label(self) -> str:
        """The policy as ``mode/every`` ("blocks/2"), or the mode alone for none and sqrt."""
        return _label(self.mode, self.every)


def _largest(fits: Callable[[int], bool], candidates: Sequence[int]) -> int:
    """The largest of the ascending ``candidates`` for which ``fits`` holds (monotone), else 0."""
    lo, hi = 0, len(candidates)  # fits(candidates[i]) for i < lo; not for i >= hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid + 1
        else:
            hi = mid
    return candidates[lo - 1] if lo else 0


def largest_batch(config: GPTConfig, budget_bytes: int, *, precision: str = "fp32",
                  accumulation_steps: int = 1, seq_len: int | None = None,
                  policies: Sequence[tuple[str, int]] = FIT_POLICIES,
                  max_batch: int = 1 << 16, gpu=None) -> list[BatchFit]:
    """For each checkpointing policy, the largest micro-batch whose predicted step fits ``budget_bytes``.

    Predicted peak memory grows with the micro-batch, so each is found by
    bisection over ``1 .. max_batch`` with :func:`predict_step_memory` for ``gpu``
    (None: the CPU's kernels; a preset name or a :class:`~course_lib.device.GPU`). Returns
    one :class:`BatchFit` per policy of ``policies`` (``(mode, every)`` pairs),
    in their order.
    """
    _check_config(config)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    positive_int("max_batch", max_batch, maximum=MAX_BATCH)
    positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    _check_precision(precision)
    policies = _check_policies(policies)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len,
                                                                  maximum=config.seq_len)
    gpu = resolve_gpu(gpu)
    out = []
    for mode, every in policies:
        def memory(b, mode=mode, every=every):
            return predict_step_memory(config, b, accumulation_steps, precision=precision,
                                       mode=mode, every=every, seq_len=seq_len, gpu=gpu)

        # Bisection over a doubling range: probe 1, 2, 4, ... then bisect the last interval.
        top = 1
        while top < max_batch and memory(min(2 * top, max_batch)).total <= budget:
            top = min(2 * top, max_batch)
        b = _largest(lambda b: memory(b).total <= budget, range(top, min(2 * top, max_batch + 1)))
        out.append(BatchFit(mode, every, b, memory(b) if b else None,
                            _recompute_fraction(config, mode, every, seq_len)))
    return out


# --------------------------------------------------------------------------- the largest model

@dataclass(frozen=True)
class Fit:
    """What :func:`fit_model` chose: a GPT, how to train it, and its predicted memory (bytes)."""

    config: GPTConfig
    n_params: int
    precision: str
    micro_batch_size: int
    accumulation_steps: int
    mode: str
    every: int
    memory: StepMemory
    budget_bytes: int
    recompute_fraction: float

    @property
    def peak_bytes(self) -> int:
        return self.memory.total

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.accumulation_steps

    @property
    def label(self) -> str:
        """The checkpointing policy as ``mode/every`` ("blocks/2"), or the mode alone."""
        return _label(self.mode, self.every)

    def summary(self) -> str:
        c = self.config
        return "\n".join([
            f"model      : {self.n_params / 1e6:,.2f}M parameters: d_model={c.d_model}, "
            f"n_layers={c.n_layers}, n_heads={c.n_heads}, seq_len={c.seq_len}, vocab={c.vocab_size}",
            f"precision  : {self.precision}",
            f"batch      : {self.micro_batch_size} x {self.accumulation_steps} accumulation steps "
            f"= {self.effective_batch} sequences per optimizer step",
            f"checkpoint : {self.label} (+{self.recompute_fraction:.0%} FLOPs against a plain step)",
            f"peak       : {format_bytes(self.peak_bytes)} predicted, budget "
            f"{format_bytes(self.budget_bytes)} ({self.peak_bytes / self.budget_bytes:.0%})",
        ])


def _check_space(widths, depths, head_size, aspect_ratio, seq_len=1024,
                 vocab_size=50257) -> None:
    positive_int("head_size", head_size, maximum=CONFIG_MAXIMUM["d_model"])
    for name, values, maximum in (("widths", widths, CONFIG_MAXIMUM["d_model"]),
                                  ("depths", depths, CONFIG_MAXIMUM["n_layers"])):
        if (isinstance(values, str) or not isinstance(values, Sequence) or not values
                or len(values) > MAX_SEARCH_VALUES):
            raise ValueError(f"{name} must be a non-empty sequence of at most "
                             f"{MAX_SEARCH_VALUES} positive ints, got {values!r}")
        for v in values:
            positive_int(name, v, maximum=maximum)
    if aspect_ratio is not None:
        bad = not isinstance(aspect_ratio, tuple) or len(aspect_ratio) != 2
        if not bad:
            try:
                low, high = (number("aspect_ratio", x, above=0.0) for x in aspect_ratio)
            except ValueError:
                bad = True
            else:
                bad = low > high
        if bad:
            raise ValueError(f"aspect_ratio must be None or (low, high) with 0 < low <= high, "
                             f"finite numbers, got {aspect_ratio!r}")
    positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])


def search_space(*, widths: Sequence[int] = DEFAULT_WIDTHS, depths: Sequence[int] = DEFAULT_DEPTHS,
                 head_size: int = 64, aspect_ratio: tuple | None = DEFAULT_ASPECT_RATIO,
                 seq_len: int = 1024, vocab_size: int = 50257) -> list[GPTConfig]:
    """The GPT shapes :func:`fit_model` chooses from, largest first (most parameters).

    ``d_model`` in ``widths`` (those that ``head_size`` divides), ``n_layers`` in
    ``depths``, ``n_heads = d_model // head_size``, and, unless ``aspect_ratio`` is
    None, ``low <= d_model / n_layers <= high``: Kaplan et al. (2020, "Scaling
    Laws for Neural Language Models", figure 5) find that at a fixed parameter
    count the loss changes by only a few percent for aspect ratios between about
    20 and 200 (GPT-2 124M: 64, GPT-3 175B: 128); outside, a "largest" model
    would be a needle (one very wide layer) or a thread (a hundred narrow ones).

    Raises:
        ValueError: naming the argument: ``widths`` and ``depths`` must be non-empty sequences
            of at most :data:`MAX_SEARCH_VALUES` ints within
            :data:`course_lib.models.CONFIG_MAXIMUM`, ``aspect_ratio`` None or two finite
            numbers ``0 < low <= high``; also when no configuration is left.
    """
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    return list(_search_space(tuple(widths), tuple(depths), head_size,
                              None if aspect_ratio is None else tuple(aspect_ratio), seq_len,
                              vocab_size))


@functools.lru_cache(maxsize=64)
def _search_space(widths: tuple, depths: tuple, head_size: int, aspect_ratio: tuple | None,
                  seq_len: int, vocab_size: int) -> tuple:
    """:func:`search_space` of checked arguments, cached (a widget asks again and again)."""
    low, high = aspect_ratio or (0, float("inf"))
    configs = [GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=w, n_heads=w // head_size,
                         n_layers=L)
               for w in widths if w % head_size == 0 for L in depths if low <= w / L <= high]
    if not configs:
        raise ValueError(f"the search space is empty: no width in {widths} is a multiple of "
                         f"head_size={head_size} with a depth in {depths} in aspect_ratio="
                         f"{aspect_ratio}")
    return tuple(sorted(configs, key=lambda c: (-gpt_param_count(c), c.n_layers)))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in ``O(sqrt(n))`` (``n`` a positive int)."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _micro_batches(effective_batch: int, max_accumulation_steps: int | None) -> list[int]:
    """Micro-batch sizes that divide ``effective_batch`` in at most ``max_accumulation_steps``."""
    K = effective_batch if max_accumulation_steps is None else max_accumulation_steps
    return [d for d in _divisors(effective_batch) if effective_batch // d <= K]


def _settings(config: GPTConfig, budget: int, effective_batch: int, precision: str,
              policies: tuple, max_accumulation_steps: int | None = None,
              gpu=None) -> Fit | None:
    """The cheapest way to train ``config`` in ``precision`` under ``budget``, or None.

    Policies are tried in order of increasing recompute; for the first with any
    fitting micro-batch (a divisor of ``effective_batch``), its largest one.
    """
    micro = _micro_batches(effective_batch, max_accumulation_steps)
    seq_len = config.seq_len
    for mode, every in sorted(policies, key=lambda p: _recompute_fraction(config, *p, seq_len)):
        def memory(b, mode=mode, every=every):
            return predict_step_memory(config, b, effective_batch // b, precision=precision,
                                       mode=mode, every=every, gpu=gpu)

        # Without accumulation the gradient is never whole during a backward pass, so the whole
        # batch at once can fit where half of it with accumulation does not: try it on its own.
        # Below it, memory grows with the micro-batch: bisect.
        if micro[-1] == effective_batch and memory(effective_batch).total <= budget:
            b = effective_batch
        else:
            b = _largest(lambda b: memory(b).total <= budget, micro[:-1] or micro)
        if b:
            return Fit(config, gpt_param_count(config), precision, b, effective_batch // b,
                       mode, every, memory(b), budget,
                       _recompute_fraction(config, mode, every, seq_len))
    return None


#: Bytes per parameter of (resident model states, gradients at the optimizer step), per precision.
_STATE_BYTES = {"fp32": (12, 4), "fp16-mixed": (14, 4), "bf16-mixed": (14, 4), "bf16": (6, 2),
                "autocast-fp16": (12, 4), "autocast-bf16": (12, 4)}


def _lower_bound(config: GPTConfig, precision: str) -> int:
    """A quick lower bound on any step's peak (closed form): the resident model states plus the
    larger of the gradients at the optimizer step and, in the backward pass, the loss's fp32
    log-probabilities with their two gradients for one sequence (never checkpointed)."""
    P = gpt_param_count(config)
    resident, grads = _STATE_BYTES[precision]
    return resident * P + max(grads * P, 3 * config.seq_len * config.vocab_size * 4)


def fit_model(budget_bytes: int, *, seq_len: int = 1024, effective_batch: int = 32,
              vocab_size: int = 50257, widths: Sequence[int] = DEFAULT_WIDTHS,
              depths: Sequence[int] = DEFAULT_DEPTHS, head_size: int = 64,
              aspect_ratio: tuple | None = DEFAULT_ASPECT_RATIO,
              precisions: Sequence[str] = ("bf16-mixed", "fp32"),
              policies: Sequence[tuple[str, int]] = FIT_POLICIES,
              max_accumulation_steps: int | None = None, gpu=None) -> Fit:
    """The largest GPT of the search space that trains within ``budget_bytes``, and how.

    Search space: :func:`search_space` (``d_model`` in ``widths``, ``n_layers`` in
    ``depths``, heads of ``head_size``, an ``aspect_ratio`` range; ``seq_len`` and
    ``vocab_size`` fixed). "Largest" is the most parameters. A configuration fits
    if one setting's :func:`predict_step_memory` is at most the budget; a setting
    is a precision of ``precisions``, a micro-batch ``b`` dividing
    ``effective_batch`` (sequences per optimizer step) with ``effective_batch // b``
    accumulation steps (at most ``max_accumulation_steps``; None: no limit), and a
    checkpointing policy of ``policies``. For the largest fitting model the
    setting chosen is: the first precision of ``precisions`` that fits (the order
    is a preference: ``"bf16-mixed"`` before ``"fp32"`` by default; pure
    ``"bf16"`` only if listed), then the policy with the least recompute, then
    the largest micro-batch. ``gpu``: where it trains, as :func:`predict_step_memory`
    takes it (the budget is still ``budget_bytes``). Returns a :class:`Fit`; raises
    ``ValueError`` if nothing fits, and ``ValueError`` naming the argument for a bad one:
    counts are ints, not bools or floats, with stated maxima (``effective_batch`` and
    ``max_accumulation_steps`` up to :data:`MAX_EFFECTIVE_BATCH`, ``seq_len`` and
    ``vocab_size`` up to :data:`course_lib.models.CONFIG_MAXIMUM`, ``budget_bytes`` up to
    :data:`course_lib.validation.MAX_BYTES`, at most :data:`MAX_SEARCH_VALUES` widths and depths).

    Search: memory grows with depth at a fixed width, so each width's deepest
    fitting model is found by bisection (with the smallest micro-batch or the
    whole batch at once, the leanest policy first); widths are visited from the
    largest model the closed-form :func:`_lower_bound` allows them, and the
    search stops once that cannot beat the best found.
    """
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    positive_int("effective_batch", effective_batch, maximum=MAX_EFFECTIVE_BATCH)
    positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])
    if isinstance(precisions, str) or not isinstance(precisions, Sequence) or not precisions:
        raise ValueError(f"precisions must be a non-empty sequence of {FIT_PRECISIONS}, "
                         f"got {precisions!r}")
    for p in precisions:
        _check_precision(p, "precisions")
    policies = _check_policies(policies)
    optional_positive_int("max_accumulation_steps", max_accumulation_steps,
                          maximum=MAX_EFFECTIVE_BATCH)
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    gpu = resolve_gpu(gpu)
    micro = _micro_batches(effective_batch, max_accumulation_steps)
    # The least memory: the smallest micro-batch, or the whole batch without accumulation (see
    # _settings); a model fits if one of them does.
    extremes = sorted({micro[0], micro[-1]})
    configs = search_space(widths=widths, depths=depths, head_size=head_size,
                           aspect_ratio=aspect_ratio, seq_len=seq_len, vocab_size=vocab_size)
    by_width: dict[int, list[GPTConfig]] = {}
    for c in sorted(configs, key=lambda c: c.n_layers):
        if min(_lower_bound(c, p) for p in precisions) <= budget:
            by_width.setdefault(c.d_model, []).append(c)
    lean = sorted(policies, key=lambda p: -_recompute_fraction(configs[-1], *p, seq_len))

    def fits(config: GPTConfig) -> bool:  # in some precision, policy and extreme micro-batch
        return any(predict_step_memory(config, b, effective_batch // b, precision=p, mode=m,
                                       every=ev, gpu=gpu).total <= budget
                   for p in sorted(precisions, key=lambda p: _lower_bound(config, p))
                   for m, ev in lean for b in extremes)

    best = None
    for width in sorted(by_width, key=lambda w: -gpt_param_count(by_width[w][-1])):
        column = by_width[width]  # by depth, all within the closed-form bound
        if best is not None and gpt_param_count(column[-1]) <= gpt_param_count(best):
            break  # no deeper model of this or any later width can beat the best
        i = _largest(lambda i, column=column: fits(column[i - 1]), range(1, len(column) + 1))
        if i and (best is None or gpt_param_count(column[i - 1]) > gpt_param_count(best)):
            best = column[i - 1]
    if best is not None:
        for precision in precisions:
            fit = _settings(best, budget, effective_batch, precision, policies,
                            max_accumulation_steps, gpu)
            if fit is not None:
                return fit
    smallest = configs[-1]
    raise ValueError(f"budget_bytes={budget} ({format_bytes(budget)}) is too small for the smallest "
                     f"configuration of the search space (d_model={smallest.d_model}, "
                     f"n_layers={smallest.n_layers}, seq_len={seq_len}, vocab_size={vocab_size})")


# --------------------------------------------------------------------------- the fit ladder

#: The levers of :func:`ladder`, by group: one setting per group is in force at a time.
LADDER_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss",
                 "optimizer in backward", "optimizer states", "offload activations",
                 "offload optimizer", "LoRA", "ZeRO")
#: Groups that change the job rather than how it runs: LoRA trains other parameters, ZeRO
#: needs more GPUs. The ladder tries them last.
JOB_CHANGING = ("LoRA", "ZeRO")


@dataclass(frozen=True)
class Plan:
    """One way to run a training step: a setting per lever (the defaults are the plain step).

    ``precision``, ``accumulation_steps``, ``mode``/``every`` and ``loss_chunk`` are the memory
    engine's; ``in_backward`` (:func:`course_lib.levers.optimizer_in_backward`),
    ``state_bits`` (32, 8 or 4: :func:`course_lib.levers.low_bit_state_bytes`),
    ``offload_activations`` (``save_on_cpu``), ``offload_optimizer`` (optimizer states and
    master weights on the host, the step on the CPU), ``lora_rank`` (adapters on every
    block linear, the rest frozen) and ``zero_stage`` over ``world_size`` GPUs adjust its
    moments with the closed forms of :func:`predict_plan`.

    Every field is checked when the plan is made (``ValueError`` naming it): counts are ints,
    not bools (``accumulation_steps`` up to :data:`course_lib.validation.MAX_BATCH`,
    ``world_size`` up to :data:`course_lib.memory.MAX_WORLD_SIZE`), switches are bools.
    """

    precision: str = "fp32"
    accumulation_steps: int = 1
    mode: str = "none"
    every: int = 1
    loss_chunk: int | None = None
    in_backward: bool = False
    state_bits: int = 32
    offload_activations: bool = False
    offload_optimizer: bool = False
    lora_rank: int | None = None
    zero_stage: int = 0
    world_size: int = 1

    def __post_init__(self):
        _check_precision(self.precision)
        positive_int("accumulation_steps", self.accumulation_steps, maximum=MAX_BATCH)
        choice("mode", self.mode, ckpt.MODES)
        positive_int("every", self.every, maximum=MAX_COUNT)
        optional_positive_int("loss_chunk", self.loss_chunk, maximum=MAX_COUNT)
        for name in ("in_backward", "offload_activations", "offload_optimizer"):
            boolean(name, getattr(self, name))
        if isinstance(self.state_bits, bool) or self.state_bits not in (32, 8, 4) or not isinstance(
                self.state_bits, int):
            raise ValueError(f"state_bits must be one of (32, 8, 4), got {self.state_bits!r}")
        optional_positive_int("lora_rank", self.lora_rank, maximum=MAX_COUNT)
        integer("zero_stage", self.zero_stage, minimum=0, maximum=3)
        positive_int("world_size", self.world_size, maximum=MAX_WORLD_SIZE)


def _plan_moments(config: GPTConfig, batch_size: int, plan: Plan, gpu, seq_len: int
                  ) -> list[StepMemory]:
    from . import activations as act
    from . import levers
    from .units import dtype_bytes

    K = plan.accumulation_steps
    if batch_size % K:
        raise ValueError(f"accumulation_steps must divide batch_size={batch_size}, got {K}")
    b = batch_size // K
    spec = engine.precision_of(plan.precision)
    moments = dict(engine.predict_moments(
        config, b, K, precision=plan.precision, mode=plan.mode, every=plan.every,
        seq_len=seq_len, gpu=gpu, loss_chunk=plan.loss_chunk))
    numels = param_numels(config)
    pb, sb = dtype_bytes(spec.params), dtype_bytes(spec.state)
    if plan.in_backward:  # no moment holds every gradient: one parameter's at a time
        largest = max(numels)
        opt = moments.pop("optimizer")
        for name in [n for n in moments if n.startswith("backward")]:
            moments[name] = replace(moments[name],
                                    gradients=min(moments[name].gradients, largest * pb))
        # the largest parameter's step (the tied embedding's comes last, after the activations)
        scratch = engine.adamw_scratch_bytes([largest * sb] * 2) + largest * 4 * spec.master
        moments["optimizer"] = replace(opt, moment="optimizer step in backward (largest tensor)",
                                       gradients=largest * pb, transient=scratch)
    if plan.lora_rank:  # A (r x in) and B (out x r) beside every block linear
        r, h = plan.lora_rank, config.d_model
        trained = [n for _ in range(config.n_layers) for i, o in ((1, 3), (1, 1), (1, 4), (4, 1))
                   for n in (r * i * h, o * h * r)]
    else:
        trained = numels
    trainable = sum(trained)
    state = (levers.low_bit_state_bytes(trained, plan.state_bits, param_bytes=sb)
             if plan.state_bits != 32 or plan.lora_rank else None)  # None: the engine's count
    resident_acts = None
    if plan.offload_activations:  # on the device: what the op being differentiated needs
        args = (config, b, seq_len, spec.compute, gpu)
        where = resolve_gpu(gpu)
        resident_acts = max(act.total_bytes(act.block_saved(*args, autocast=spec.autocast),
                                            act.STEP_KINDS, where),
                            act.total_bytes(act.head_saved(*args, autocast=spec.autocast),
                                            act.STEP_KINDS, where))
    N, z = plan.world_size, plan.zero_stage
    out = []
    for name, m in moments.items():
        fields_ = dict(parameters=m.parameters, master_weights=m.master_weights,
                       optimizer_state=m.optimizer_state, gradients=m.gradients,
                       activations=m.activations, transient=m.transient)
        if plan.lora_rank:
            # frozen base in the model's dtype; adapters trained (gradients, state, masters)
            fields_["parameters"] = m.parameters + trainable * pb
            fields_["master_weights"] = trainable * 4 if spec.master else 0
            fields_["gradients"] = min(m.gradients, trainable * pb)
            fields_["activations"] = m.activations + (
                4 * config.n_layers * b * seq_len * plan.lora_rank * dtype_bytes(spec.compute)
                if m.activations else 0)
            if name == "optimizer":  # the adapters' AdamW scratch
                fields_["transient"] = engine.adamw_scratch_bytes([n * sb for n in trained])
        if state is not None and m.optimizer_state:
            fields_["optimizer_state"] = state
        if resident_acts is not None:
            fields_["activations"] = min(m.activations, resident_acts)
        if plan.offload_optimizer:
            fields_["optimizer_state"] = fields_["master_weights"] = 0
            if name == "optimizer":  # the step runs on the host
                fields_["transient"] = 0
        if z >= 1:
            fields_["optimizer_state"] = -(-fields_["optimizer_state"] // N)
            fields_["master_weights"] = -(-fields_["master_weights"] // N)
        if z >= 2:
            fields_["gradients"] = -(-fields_["gradients"] // N)
        if z >= 3:  # sharded, plus one block's parameters gathered while it runs
            block = (12 * config.d_model ** 2 + 13 * config.d_model) * pb
            fields_["parameters"] = -(-fields_["parameters"] // N) + block
        out.append(StepMemory(m.moment, **fields_, first_step=m.first_step))
    return out


def predict_plan(config: GPTConfig, batch_size: int, plan: Plan = Plan(), *, gpu=None,
                 seq_len: int | None = None) -> StepMemory:
    """Predicted peak bytes of one steady-state step of ``batch_size`` sequences run as ``plan``.

    The memory engine (:func:`course_lib.engine.predict_moments`) predicts the moments
    of the step for the plan's precision, micro-batch (``batch_size / accumulation_steps``),
    checkpointing and chunked loss; closed forms then adjust each moment for the other
    levers:

    * optimizer in backward: the gradients of a moment shrink to the largest parameter's,
      and the optimizer moment holds that one gradient and its AdamW scratch;
    * 8-/4-bit states: :func:`course_lib.levers.low_bit_state_bytes`;
    * activation offloading: the device keeps what one block (or the head) needs at a
      time, the largest of the two (``save_on_cpu`` brings a tensor back when its op's
      backward runs; an upper bound on the device when the copies keep pace);
    * optimizer offloading: optimizer states and master weights on the host, the step there;
    * LoRA of rank ``r``: frozen parameters keep only their weights; gradients, states and
      master weights are the adapters' (:func:`course_lib.levers.lora_parameter_count`);
      activations stay, plus each adapter's ``b x s x r`` intermediate;
    * ZeRO stage 1/2/3 over ``world_size`` GPUs: optimizer states and master weights, then
      gradients, then parameters divided by ``N`` (Rajbhandari et al. 2020), stage 3 plus
      one block's parameters gathered.

    Args:
        config: the model. batch_size: sequences per optimizer step. plan: the settings.
        gpu: where the step runs (as the engine's ``gpu``). seq_len: tokens per sequence.

    Returns:
        The :class:`StepMemory` of the worst moment.

    Raises:
        ValueError: naming the argument: a bad config, batch, plan field or combination
            (optimizer in backward with accumulation).
    """
    _check_config(config)
    positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    _check_plan(plan)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len)
    return max(_plan_moments(config, batch_size, plan, gpu, seq_len), key=lambda m: m.total)


def _check_plan(plan) -> Plan:
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a course_lib.fit.Plan, got {type(plan).__name__}")
    plan.__post_init__()  # a frozen dataclass can still be changed through object.__setattr__
    if plan.in_backward and plan.accumulation_steps > 1:
        raise ValueError("in_backward cannot be combined with accumulation_steps > 1: the "
                         "optimizer would step after every micro-batch")
    return plan


def step_seconds(config: GPTConfig, batch_size: int, plan: Plan, gpu: str, *,
                 seq_len: int | None = None, utilization: float = 0.4) -> float:
    """Predicted seconds of one optimizer step: compute plus the transfers no overlap hides.

    Compute: the step's FLOPs (:func:`course_lib.checkpointing.step_flops` with the
    plan's recomputation; ``+ 2 N h V`` for the chunked loss's second head matmul;
    ``-`` the frozen weights' gradient matmuls under LoRA,
    :func:`course_lib.levers.frozen_linear_flops`, plus ``6 N r (in + out)`` for its
    adapters) at ``utilization`` times the GPU's datasheet peak (16-bit tensor cores for
    the mixed and 16-bit precisions, fp32 otherwise; :data:`course_lib.levers.GPU_SPECS`).
    Transfers at the datasheet link bandwidth, not overlapped (an upper bound): activation
    offloading moves the kept activations out and back (``2 x`` kept bytes per micro-batch),
    optimizer offloading the gradients out and the parameters back (``2 P x`` bytes), ZeRO
    moves ``2 P`` (stages 1, 2) or ``3 P`` (stage 3) parameter-sized messages per GPU.
    Micro-batches and element-wise work (the optimizer, quantization) are not counted.

    Raises:
        ValueError: naming the argument: a GPU without figures, a ``utilization`` outside
            (0, 1], a bad config, batch, plan or ``seq_len``, or ``accumulation_steps`` that
            do not divide ``batch_size``.
    """
    from . import levers
    from .units import dtype_bytes

    _check_config(config)
    positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    _check_plan(plan)
    spec_gpu = levers.gpu_spec(gpu)
    number("utilization", utilization, above=0.0, maximum=1.0)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len,
                                                                  maximum=config.seq_len)
    spec = engine.precision_of(plan.precision)
    K = plan.accumulation_steps
    if batch_size % K:
        raise ValueError(f"accumulation_steps must divide batch_size={batch_size}, got {K}")
    b = batch_size // K
    flops, _ = ckpt.step_flops(config, b, plan.mode, plan.every, seq_len=seq_len,
                               dtype=spec.compute, gpu=gpu, autocast=spec.autocast)
    flops *= K
    tokens = batch_size * seq_len
    if plan.loss_chunk is not None:
        flops += 2 * tokens * config.d_model * config.vocab_size
    if plan.lora_rank:
        flops += (6 * tokens * levers.lora_parameter_count(config, plan.lora_rank)
                  - levers.frozen_linear_flops(config, tokens))
    peak = spec_gpu.half_flops if spec.compute != torch.float32 else spec_gpu.fp32_flops
    seconds = flops / (peak * utilization)
    if plan.offload_activations:
        kept = ckpt.predict_kept_bytes(config, b, plan.mode, plan.every, seq_len=seq_len,
                                       dtype=spec.compute, gpu=gpu, autocast=spec.autocast)
        seconds += levers.transfer_seconds(2 * K * kept, spec_gpu.host_link)
    P = gpt_param_count(config)
    pb = dtype_bytes(spec.params)
    if plan.offload_optimizer:
        seconds += levers.transfer_seconds(2 * P * pb, spec_gpu.host_link)
    if plan.zero_stage:
        volume = (3 if plan.zero_stage == 3 else 2) * P * pb
        seconds += levers.transfer_seconds(volume, spec_gpu.peer_link)
    return seconds


@dataclass(frozen=True)
class Rung:
    """One lever of :func:`ladder`, applied alone to the plain step.

    ``bytes_saved``: predicted peak bytes it removes (negative: it adds); ``time_paid``:
    the step's predicted time it adds, as a fraction of the plain step's (negative: it
    speeds the step up); ``how``: "engine" where the memory engine predicts the lever
    itself, "engine + formula" where a closed form adjusts the engine's moments.
    """

    lever: str
    group: str
    plan: Plan
    memory: StepMemory
    bytes_saved: int
    time_paid: float
    how: str

    @property
    def bytes_per_time(self) -> float:
        """Bytes saved per unit of time paid (inf for a lever that costs no time)."""
        return self.bytes_saved / self.time_paid if self.time_paid > 0 else math.inf


@dataclass(frozen=True)
class Ladder:
    """What :func:`ladder` found: every lever alone (``rungs``, cheapest first) and the
    combination, lever by lever, that brings the step under the GPU's memory."""

    config: GPTConfig
    gpu: str
    budget_bytes: int
    batch_size: int
    seq_len: int
    baseline: StepMemory
    rungs: tuple
    steps: tuple          # ((lever, StepMemory after adding it, time paid so far), ...)
    plan: Plan
    fits: bool

    @property
    def memory(self) -> StepMemory:
        """The predicted peak of the combination."""
        return self.steps[-1][1] if self.steps else self.baseline

    def table(self) -> str:
        """The rungs as a text table: saved bytes, time paid, bytes per time."""
        lines = [f"{'lever':34s} {'saves':>11s} {'time paid':>10s} {'peak':>11s}  how"]
        for r in self.rungs:
            lines.append(f"{r.lever:34s} {format_bytes(r.bytes_saved):>11s} "
                         f"{r.time_paid:>+10.1%} {format_bytes(r.memory.total):>11s}  {r.how}")
        return "\n".join(lines)


def _ladder_rungs(config, batch_size, gpu, seq_len, *, loss_chunk, lora_rank, world_size):
    from .device import GPUS, pick_dtype

    half = "fp16-mixed" if pick_dtype(GPUS[gpu]) == torch.float16 else "bf16-mixed"
    levers_ = [(f"precision {half}", "precision", dict(precision=half))]
    if batch_size > 1:
        levers_.append((f"accumulation: {batch_size} x 1 sequence", "accumulation",
                        dict(accumulation_steps=batch_size)))
    for mode, every in FIT_POLICIES[1:]:
        levers_.append((f"checkpointing {_label(mode, every)}", "checkpointing",
                        dict(mode=mode, every=every)))
    levers_ += [(f"chunked loss ({loss_chunk} tokens)", "chunked loss", dict(loss_chunk=loss_chunk)),
                ("optimizer step in backward", "optimizer in backward", dict(in_backward=True)),
                ("8-bit AdamW states", "optimizer states", dict(state_bits=8)),
                ("4-bit AdamW states", "optimizer states", dict(state_bits=4)),
                ("offload activations (save_on_cpu)", "offload activations",
                 dict(offload_activations=True)),
                ("offload optimizer states", "offload optimizer", dict(offload_optimizer=True)),
                (f"LoRA rank {lora_rank} (base frozen)", "LoRA", dict(lora_rank=lora_rank))]
    levers_ += [(f"ZeRO-{z} on {world_size} GPUs", "ZeRO",
                 dict(zero_stage=z, world_size=world_size)) for z in (1, 2, 3)]
    return levers_


_ENGINE_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss")


def ladder(config: GPTConfig, gpu: str, *, batch_size: int = 8, seq_len: int | None = None,
           budget_bytes: int | None = None, loss_chunk: int = 1024, lora_rank: int = 16,
           world_size: int = 8, utilization: float = 0.4) -> Ladder:
    """Every lever of the course for training ``config`` on ``gpu``, ranked, and the mix that fits.

    The plain step is fp32 AdamW, the whole batch of ``batch_size`` sequences at once,
    nothing checkpointed, offloaded or sharded. Each lever alone (a :class:`Rung`)
    is predicted with :func:`predict_plan` (bytes saved) and :func:`step_seconds` (time
    paid, as a fraction of the plain step's); the rungs are ranked cheapest first (least
    time paid, then most bytes saved), with the job-changing levers (:data:`JOB_CHANGING`:
    LoRA trains other parameters, ZeRO needs ``world_size`` GPUs) last. The combination
    then adds the rungs in that order, each one only if it lowers the predicted peak in the
    company of those already in (a lever of a group already in replaces it if that is
    lower), until the step fits ``budget_bytes`` (default the GPU's memory).

    Args:
        config: the model. gpu: a preset name of :data:`course_lib.device.GPUS`.
        batch_size: sequences per optimizer step. seq_len: tokens per sequence.
        budget_bytes: device bytes to fit in (default ``GPUS[gpu].total_memory``).
        loss_chunk: tokens per chunk of the chunked loss. lora_rank: the adapters' rank.
        world_size: GPUs for the ZeRO rungs. utilization: share of the GPU's peak FLOP/s
            the step reaches (:func:`step_seconds`).

    Returns:
        A :class:`Ladder`.

    Raises:
        ValueError: naming the argument.

    Example:
        >>> cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
        >>> result = ladder(cfg, "T4", batch_size=8)
        >>> result.fits, result.rungs[0].time_paid < 0
        (True, True)
    """
    from .device import GPUS

    _check_config(config)
    choice("gpu", gpu, tuple(GPUS))
    positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len)
    if seq_len > config.seq_len:
        raise ValueError(f"seq_len must be at most config.seq_len={config.seq_len}, got {seq_len}")
    budget = GPUS[gpu].total_memory if budget_bytes is None else positive_int(
        "budget_bytes", budget_bytes, maximum=MAX_BYTES)
    positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    positive_int("lora_rank", lora_rank, maximum=MAX_COUNT)
    positive_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
    number("utilization", utilization, above=0.0, maximum=1.0)
    base_plan = Plan()

    def memory(plan):
        return predict_plan(config, batch_size, plan, gpu=gpu, seq_len=seq_len)

    def seconds(plan):
        return step_seconds(config, batch_size, plan, gpu, seq_len=seq_len,
                            utilization=utilization)

    baseline, base_time = memory(base_plan), seconds(base_plan)
    rungs = []
    for lever, group, change in _ladder_rungs(config, batch_size, gpu, seq_len,
                                              loss_chunk=loss_chunk, lora_rank=lora_rank,
                                              world_size=world_size):
        plan = replace(base_plan, **change)
        m = memory(plan)
        rungs.append(Rung(lever, group, plan, m, baseline.total - m.total,
                          seconds(plan) / base_time - 1,
                          "engine" if group in _ENGINE_GROUPS else "engine + formula"))
    rungs.sort(key=lambda r: (r.group in JOB_CHANGING, round(r.time_paid, 6), -r.bytes_saved))

    plan, current, steps = base_plan, baseline, []
    for rung in rungs:
        if current.total <= budget:
            break
        change = {k: getattr(rung.plan, k) for k in vars(rung.plan)
                  if getattr(rung.plan, k) != getattr(base_plan, k)}
        trial = replace(plan, **change)
        try:
            m = memory(trial)
        except ValueError:  # an incompatible pair (optimizer in backward with accumulation)
            continue
        if m.total < current.total:
            plan, current = trial, m
            steps.append((rung.lever, m, seconds(plan) / base_time - 1))
    return Ladder(config, gpu, budget, batch_size, seq_len, baseline, tuple(rungs), tuple(steps),
                  plan, current.total <= budget)


# --------------------------------------------------------------------------- training it

class MasterWeightAdamW:
    """AdamW on fp32 master copies of a 16-bit model's parameters (mixed precision, Megatron-style).

    The model holds fp16 or bf16 parameters and gets 16-bit gradients; this optimizer
    keeps an fp32 copy of every parameter (the master weights) and AdamW's
    ``m`` and ``v`` in fp32: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter
    (Micikevicius et al. 2018, "Mixed Precision Training"; Rajbhandari et al.
    2020, ZeRO, section 3.1). :meth:`prepare_grads` turns each 16-bit gradient into
    an fp32 one on the master copy (freeing the 16-bit one); ``step()`` does that if
    it was not done, runs AdamW, and copies the master weights back into the model.
    While it runs, the fp32 gradients briefly make it 18 bytes per parameter.

    :func:`course_lib.training.train` calls :meth:`prepare_grads` before clipping and
    before a ``GradScaler`` unscales, so both see the fp32 master gradients
    (``param_groups`` are the master weights'): that is how fp16 training with loss
    scaling works here (``GradScaler`` refuses to unscale fp16 gradients). bf16 needs
    no loss scaling. ``optimizer`` is the inner ``torch.optim.AdamW``.
    """

    def __init__(self, params, **adamw_kwargs):
        try:
            params = list(params)
        except TypeError:
            raise ValueError(f"params must be an iterable of tensors, got {params!r}") from None
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise ValueError(f"params must be an iterable of tensors (model.parameters()), got "
                             f"{[type(p).__name__ for p in params]}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params must hold at least one tensor that requires grad")
        self.master = [p.detach().float().requires_grad_(True) for p in self.params]
        adamw_kwargs.setdefault("foreach", False)
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Move every 16-bit gradient of the model to its fp32 master copy (once per step)."""
        for p, master in zip(self.params, self.master):
            if p.grad is not None:
                master.grad = p.grad.float()
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.prepare_grads()
        self.optimizer.step()
        for p, master in zip(self.params, self.master):
            p.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in (*self.params, *self.master):
            t.grad = None


def build(config: GPTConfig, *, precision: str = "fp32", mode: str = "none", every: int = 1,
          device: str | torch.device = "cpu", lr: float = 1e-3, seed: int = 0):
    """``(model, optimizer)`` for training ``config`` in ``precision`` with checkpointing ``mode``.

    The model is ``GPT(config)`` in :func:`model_dtype` on ``device`` with
    :func:`course_lib.checkpointing.enable_checkpointing`; the optimizer is
    ``torch.optim.AdamW(foreach=False)`` (the per-tensor implementation, whose
    scratch the prediction counts), or :class:`MasterWeightAdamW` for the mixed
    precisions. Train it with :func:`train_options` (autocast, loss scaling).

    ``seed``: an int from 0 to :data:`course_lib.models.MAX_SEED` (not a bool or a float);
    ``lr``: a finite number >= 0; ``device``: a device ("cpu", "cuda", a ``torch.device``).

    Raises:
        ValueError: naming the argument.
    """
    _check_config(config)
    spec = engine.precision_of(_check_precision(precision))
    ckpt._check_mode(mode, every, None, config.n_layers)
    device = as_device("device", device)
    lr = number("lr", lr, minimum=0.0)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=spec.params)
    enable_checkpointing(model, mode, every)
    if spec.master:
        return model, MasterWeightAdamW(model.parameters(), lr=lr)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)


def train_options(precision: str, device: str | torch.device = "cpu") -> dict:
    """The keyword arguments of :func:`course_lib.training.train` for ``precision``.

    ``amp_dtype`` for the autocast precisions, and a fresh ``GradScaler`` wherever fp16
    computes (fp16-mixed, autocast-fp16); keep the dict for the whole run, so that the
    scaler keeps its scale from step to step.
    """
    spec = engine.precision_of(_check_precision(precision))
    device = as_device("device", device)
    options = {"amp_dtype": spec.compute if spec.autocast else None, "grad_scaler": None}
    if spec.grad_scaler:
        options["grad_scaler"] = make_grad_scaler(device.type)
    return options


def measure_step_memory(config: GPTConfig, micro_batch_size: int, accumulation_steps: int = 1, *,
                        precision: str = "fp32", mode: str = "none", every: int = 1,
                        device: str | torch.device = "cpu", loss_chunk: int | None = None) -> int:
    """Measured peak bytes of a steady-state step, to compare with :func:`predict_step_memory`.

    Builds the model and optimizer (:func:`build`), trains one step (which
    creates AdamW's state), then measures the second step with
    :func:`course_lib.measure.peak_memory` (the CUDA allocator on CUDA, the
    live-tensor tracker elsewhere) and adds what was resident before it.
    ``loss_chunk``: the model computes its loss with
    :func:`course_lib.levers.chunked_cross_entropy` in chunks of that many tokens
    (:func:`course_lib.levers.use_chunked_loss`), each micro-batch's mean divided by
    ``K``; not with the autocast precisions.
    """
    _check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    if b * K > MAX_BATCH:
        raise ValueError(f"micro_batch_size * accumulation_steps must be at most {MAX_BATCH:,} "
                         f"sequences, got {b} * {K}")
    optional_positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    device = as_device("device", device)
    model, optimizer = build(config, precision=precision, mode=mode, every=every, device=device)
    options = train_options(precision, device)
    x, y = _tokens(config, b * K, device)
    if loss_chunk is not None:
        from .levers import use_chunked_loss

        if options["amp_dtype"] is not None or options["grad_scaler"] is not None:
            raise ValueError(f"loss_chunk is measured without autocast or loss scaling only, "
                             f"got precision={precision!r}")
        use_chunked_loss(model, loss_chunk)

    def step():
        if loss_chunk is None:
            train(model, optimizer, [(x, y)], micro_batch_size=b, accumulation_steps=K, **options)
            return
        for xk, yk in zip(x.split(b), y.split(b)):
            loss = model(xk, yk)[1]
            (loss if K == 1 else loss / K).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(step, device=torch.device(device).type)


def _tokens(config: GPTConfig, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (n, config.seq_len + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


# --------------------------------------------------------------------------- the guard

class MemoryBudgetExceeded(RuntimeError):
    """More memory than the budget: predicted before running (:func:`check_budget`) or reached
    while running (:class:`BudgetTracker`, ``at`` names the op). Bytes in ``needed_bytes``."""

    def __init__(self, needed_bytes: int, budget_bytes: int, what: str = "the step", *,
                 at: str | None = None):
        self.needed_bytes, self.budget_bytes, self.what, self.at = needed_bytes, budget_bytes, what, at
        if at is None:
            message = (f"{what} needs {format_bytes(needed_bytes)}, "
                       f"{format_bytes(needed_bytes - budget_bytes)} over the budget of "
                       f"{format_bytes(budget_bytes)}")
        else:
            message = (f"{what} went over the budget of {format_bytes(budget_bytes)} at {at} "
                       f"({format_bytes(needed_bytes)} live)")
        super().__init__(message)


def check_budget(needed, budget_bytes: int, what: str = "the step") -> None:
    """Raise :class:`MemoryBudgetExceeded` if ``needed`` (bytes, or a :class:`StepMemory`)
    is over ``budget_bytes``: the planner's verdict before anything runs."""
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    text("what", what)
    needed = needed.total if isinstance(needed, StepMemory) else needed
    if not isinstance(needed, int) or isinstance(needed, bool) or needed < 0:
        raise ValueError(f"needed must be a StepMemory or a non-negative int of bytes, got {needed!r}")
    if needed > budget:
        raise MemoryBudgetExceeded(needed, budget, what)


class BudgetTracker(LiveTensorTracker):
    """A :class:`~course_lib.measure.LiveTensorTracker` that raises :class:`MemoryBudgetExceeded`
    as soon as the live tensors it counts exceed ``budget_bytes``: an out-of-memory error for
    devices without a memory limit (the CPU), at the op that crossed the line."""

    def __init__(self, budget_bytes: int, what: str = "the work"):
        budget_bytes = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
        super().__init__()
        self.budget_bytes, self.what = budget_bytes, text("what", what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live > self.budget_bytes:
            raise MemoryBudgetExceeded(self.live, self.budget_bytes, self.what, at=str(func))
        return out


@dataclass
class Trial:
    """What :func:`run_within_budget` saw: ``ok``, the measured ``peak_bytes`` (when it ran to
    the end), a one-line ``message``, and ``fn``'s ``result``."""

    ok: bool
    peak_bytes: int | None
    message: str
    result: object = None


def run_within_budget(fn: Callable[[], object], budget_bytes: int, *, what: str = "training",
                      device: str | torch.device | None = None) -> Trial:
    """Run ``fn()`` with at most ``budget_bytes`` of device memory; catch running out of it.

    ``fn`` should create everything it trains (model, optimizer, data), so that
    all of its memory counts. On CUDA the budget is enforced by the allocator:
    ``torch.cuda.set_per_process_memory_fraction(budget / total memory)`` (it caps
    the memory the caching allocator may reserve, fragmentation included; other
    tensors already on the device count too) and a ``torch.OutOfMemoryError`` is
    caught. Elsewhere a :class:`BudgetTracker` counts ``fn``'s live tensors and
    raises :class:`MemoryBudgetExceeded`. After a failure the references are
    dropped, ``gc.collect()`` runs and, on CUDA, ``torch.cuda.empty_cache()``
    returns the cached blocks, so the kernel goes on. Other errors propagate.
    """
    function("fn", fn)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    text("what", what)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = as_device("device", device)
    kind = device.type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this machine has no CUDA device")
    failure = None
    if kind == "cuda":
        gc.collect()  # blocks cached from earlier work would count against the fraction
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), torch.device(device))
        result = []
        try:
            start = torch.cuda.memory_allocated()
            peak = start + peak_memory(lambda: result.append(fn()), device="cuda")
        except _OOM as exc:  # the real thing: the allocator could not get a block
            failure = f"torch.OutOfMemoryError: {str(exc).splitlines()[0]}"
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, torch.device(device))
    else:
        result = []
        try:
            with BudgetTracker(budget, what) as tracker:
                result.append(fn())
            peak = tracker.peak
        except MemoryBudgetExceeded as exc:
            failure = f"MemoryBudgetExceeded: {exc}"
    if failure is not None:
        result.clear()
        gc.collect()
        if kind == "cuda":
            torch.cuda.empty_cache()
        return Trial(False, None, f"✗ {what} ran out of memory under a budget of "
                     f"{format_bytes(budget)}. {failure}. Memory freed; the kernel is fine.")
    return Trial(True, peak, f"✓ {what} fits: peak {format_bytes(peak)} of a budget of "
                 f"{format_bytes(budget)} ({peak / budget:.0%})", result[0])


__all__ = ["FIT_PRECISIONS", "FIT_POLICIES", "StepMemory", "BatchFit", "Fit", "Trial",
           "MasterWeightAdamW", "MemoryBudgetExceeded", "BudgetTracker", "param_numels",
           "predict_step_memory", "measure_step_memory", "largest_batch", "search_space",
           "fit_model", "build", "train_options", "check_budget", "run_within_budget", "model_dtype",
           "breakdown_rows", "Plan", "predict_plan", "step_seconds", "Rung", "Ladder", "ladder",
           "LADDER_GROUPS", "JOB_CHANGING"]
