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

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import checkpointing as ckpt
from . import engine
from .checkpointing import enable_checkpointing
from .device import resolve_gpu
from .engine import StepMemory, breakdown_rows, predict_step_memory
from .measure import LiveTensorTracker, peak_memory, resident_bytes
from .models import GPT, GPTConfig, gpt_param_count, param_numels
from .training import make_grad_scaler, train
from .units import format_bytes
from .validation import positive_int

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

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# --------------------------------------------------------------------------- validation

def _check_precision(precision) -> str:
    if precision not in FIT_PRECISIONS:
        raise ValueError(f"precision must be one of {FIT_PRECISIONS}, got {precision!r}")
    return precision


def _check_config(config) -> GPTConfig:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a course_lib.models.GPTConfig, got {type(config).__name__}")
    return config


def _check_policies(policies) -> tuple:
    modes = ckpt.MODES
    if (not isinstance(policies, Sequence) or not policies or any(
            not isinstance(p, tuple) or len(p) != 2 or p[0] not in modes
            or not isinstance(p[1], int) or p[1] < 1 for p in policies)):
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
    budget = positive_int("budget_bytes", budget_bytes)
    positive_int("max_batch", max_batch)
    policies = _check_policies(policies)
    seq_len = config.seq_len if seq_len is None else seq_len
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


def _check_space(widths, depths, head_size, aspect_ratio) -> None:
    positive_int("head_size", head_size)
    for name, values in (("widths", widths), ("depths", depths)):
        if not isinstance(values, Sequence) or not values:
            raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {values!r}")
        for v in values:
            positive_int(name, v)
    if aspect_ratio is not None and (
            not isinstance(aspect_ratio, tuple) or len(aspect_ratio) != 2
            or not 0 < aspect_ratio[0] <= aspect_ratio[1]):
        raise ValueError(f"aspect_ratio must be None or (low, high) with 0 < low <= high, "
                         f"got {aspect_ratio!r}")


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
    """
    _check_space(widths, depths, head_size, aspect_ratio)
    low, high = aspect_ratio or (0, float("inf"))
    configs = [GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=w, n_heads=w // head_size,
                         n_layers=L)
               for w in widths if w % head_size == 0 for L in depths if low <= w / L <= high]
    if not configs:
        raise ValueError(f"the search space is empty: no width in {tuple(widths)} is a multiple of "
                         f"head_size={head_size} with a depth in {tuple(depths)} in aspect_ratio="
                         f"{aspect_ratio}")
    return sorted(configs, key=lambda c: (-gpt_param_count(c), c.n_layers))


def _micro_batches(effective_batch: int, max_accumulation_steps: int | None) -> list[int]:
    """Micro-batch sizes that divide ``effective_batch`` in at most ``max_accumulation_steps``."""
    K = effective_batch if max_accumulation_steps is None else max_accumulation_steps
    return [d for d in range(1, effective_batch + 1)
            if effective_batch % d == 0 and effective_batch // d <= K]


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
    ``ValueError`` if nothing fits.

    Search: memory grows with depth at a fixed width, so each width's deepest
    fitting model is found by bisection (with the smallest micro-batch or the
    whole batch at once, the leanest policy first); widths are visited from the
    largest model the closed-form :func:`_lower_bound` allows them, and the
    search stops once that cannot beat the best found.
    """
    budget = positive_int("budget_bytes", budget_bytes)
    positive_int("seq_len", seq_len)
    positive_int("effective_batch", effective_batch)
    positive_int("vocab_size", vocab_size)
    if isinstance(precisions, str) or not isinstance(precisions, Sequence) or not precisions:
        raise ValueError(f"precisions must be a non-empty sequence of {FIT_PRECISIONS}, "
                         f"got {precisions!r}")
    for p in precisions:
        _check_precision(p)
    policies = _check_policies(policies)
    if max_accumulation_steps is not None:
        positive_int("max_accumulation_steps", max_accumulation_steps)
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
    """
    _check_config(config)
    spec = engine.precision_of(_check_precision(precision))
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
    options = {"amp_dtype": spec.compute if spec.autocast else None, "grad_scaler": None}
    if spec.grad_scaler:
        options["grad_scaler"] = make_grad_scaler(torch.device(device).type)
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
    b = positive_int("micro_batch_size", micro_batch_size)
    K = positive_int("accumulation_steps", accumulation_steps)
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
    budget = positive_int("budget_bytes", budget_bytes)
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
        super().__init__()
        self.budget_bytes, self.what = positive_int("budget_bytes", budget_bytes), what

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
    if not callable(fn):
        raise ValueError(f"fn must be callable with no arguments, got {fn!r}")
    budget = positive_int("budget_bytes", budget_bytes)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
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
           "breakdown_rows"]
