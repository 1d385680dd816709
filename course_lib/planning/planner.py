"""05: pick the checkpointing policy that fits a memory budget in the least predicted time.

:func:`plan_checkpointing` is a search over one :class:`~course_lib.prediction.step.Step`: it
replaces its ``mode`` and ``every`` with each policy of
:func:`course_lib.training.checkpointing.enable_checkpointing` (``none``; ``selective``,
``attention`` and ``blocks`` with ``every = 1 .. n_layers``; ``sqrt``), predicts each with
:func:`course_lib.prediction.predict.predict`, and keeps the fastest that fits:

* **peak**: ``predict(step).peak.step_peak``, the bytes above what lived before the step: what
  :func:`measure_peak` measures around a fresh model's first step (``first_step=True``).
* **time**: ``predict(step).seconds``: recomputed FLOPs at the matmul rate, rerun pointwise bytes
  at the memory bandwidth, operators and regions at their fixed costs. FLOPs alone made
  ``selective`` look free; on the CPU its per-op dispatch makes it the slowest policy that fits
  at lecture 05's budget.

:func:`choices` keeps the policies the planner picks for some budget; :func:`time_ratios`
times the forward and backward pass of several policies against no checkpointing.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from dataclasses import dataclass, replace

import torch

from course_lib.measurement import timing
from course_lib.measurement.memory import peak_memory
from course_lib.model.gpt import GPTConfig, random_tokens
from course_lib.prediction import checkpointed, step_setup
from course_lib.prediction.formulas import precision_of
from course_lib.prediction.predict import Step, predict
from course_lib.prediction.time_model import DeviceSpeed
from course_lib.training import checkpointing as ckpt
from course_lib.training.loop import train
from course_lib.units import format_bytes
from course_lib.validation import (
    MAX_BATCH,
    MAX_BYTES,
    WrongTypeError,
    available_device as as_device,
    boolean,
    items,
    positive_int,
)

#: The modes the planner considers, in order of increasing recompute for one region.
PLAN_MODES = ("none", "selective", "attention", "blocks", "sqrt")


@dataclass(frozen=True)
class Candidate:
    """One policy of the search: its step, the step's predicted peak above what lived before
    it and its seconds, the FLOPs it recomputes and those of the plain step."""

    step: Step
    peak_bytes: int
    seconds: float
    recompute_flops: int
    step_flops: int

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs over the plain step's: 0.33 is one extra forward pass."""
        return self.recompute_flops / self.step_flops

    @property
    def regions(self) -> int:
        """Checkpointed regions: each pays a fixed cost."""
        return len(ckpt.checkpointed_regions(self.step.config.n_layers, self.step.mode,
                                             self.step.every))

    @property
    def cost(self) -> tuple:
        """The planner's order: predicted seconds, then recomputed FLOPs, then regions."""
        return (self.seconds, self.recompute_flops, self.regions)

    @property
    def label(self) -> str:
        """The policy as ``mode/every`` ("blocks/2"), or the mode alone for none and sqrt."""
        return ckpt.policy_label(self.step.mode, self.step.every)


class NothingFits(ValueError):
    """No policy's predicted peak is within the budget (a ``ValueError``); ``candidates`` says
    how close each came."""

    def __init__(self, budget_bytes: int, candidates: tuple):
        self.budget_bytes, self.candidates = budget_bytes, candidates
        best = min(candidates, key=lambda c: c.peak_bytes)
        super().__init__(
            f"budget_bytes={budget_bytes} ({format_bytes(budget_bytes)}) is below every policy's "
            f"predicted peak; the smallest is {best.label} at {best.peak_bytes} bytes "
            f"({format_bytes(best.peak_bytes)}): shrink the batch or the sequence, or add memory")


def _flops(step: Step) -> tuple[int, int]:
    """``(flops, recomputed)`` of one micro-batch's forward and backward under the step's policy."""
    spec = step.spec
    return checkpointed.step_flops(step.config, step.micro_batch_size, step.mode, step.every,
                                   segments=step.segments, seq_len=step.seq_len,
                                   dtype=spec.compute, gpu=step.gpu, autocast=spec.autocast)


def recompute_fraction(step: Step) -> float:
    """The FLOPs ``step``'s checkpointing recomputes over those of its plain step.

    Counted as :func:`course_lib.prediction.checkpointed.step_flops` counts them (forward and
    backward, matmuls and attention kernels): 0.33 is one extra forward pass.

    Args:
        step (Step): the step; its ``mode``, ``every`` and ``segments`` are the policy.

    Returns:
        float: recomputed FLOPs over the plain step's.

    Raises:
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step`.

    Example:
        >>> config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)
        >>> recompute_fraction(Step(config, 2, mode="selective"))
        0.0
        >>> 0.2 < recompute_fraction(Step(config, 2, mode="blocks")) < 0.34
        True
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a Step, got {type(step).__name__}")
    flops, extra = _flops(step)
    return extra / (flops - extra)


def candidates(step: Step, *, modes: tuple = PLAN_MODES,
               speed: DeviceSpeed | None = None) -> tuple:
    """Every policy of ``modes`` for ``step``, predicted, fastest first.

    ``every`` runs over ``1 .. n_layers`` for ``selective``, ``attention`` and ``blocks``;
    ``none`` and ``sqrt`` come once. Sorted by :attr:`Candidate.cost`, then by peak.

    Args:
        step (Step): the step whose ``mode`` and ``every`` are replaced.
        modes (tuple of str): of :data:`PLAN_MODES`.
        speed (DeviceSpeed, optional): as :func:`course_lib.prediction.predict.predict`'s.

    Returns:
        tuple of Candidate: fastest first.

    Raises:
        TypeError: ``step`` not a Step.
        ValueError: ``modes`` not a non-empty subset of :data:`PLAN_MODES`.
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a Step, got {type(step).__name__}")
    if not isinstance(modes, tuple | list) or not modes or any(
            not isinstance(m, str) or m not in PLAN_MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {PLAN_MODES}, got {modes!r}")
    if speed is not None and not isinstance(speed, DeviceSpeed):
        raise WrongTypeError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    if step.gpu is not None and step.gpu.free_memory is not None:  # free memory: not the step's
        step = replace(step, gpu=replace(step.gpu, free_memory=None))
    return _candidates(replace(step, mode="none", every=1, segments=None), tuple(modes), speed)


@functools.lru_cache(maxsize=256)
def _candidates(step: Step, modes: tuple, speed: DeviceSpeed | None) -> tuple:
    """:func:`candidates`, cached: a widget asks for the same step at every budget."""
    out = []
    for mode in modes:
        for every in (range(1, step.config.n_layers + 1)
                      if mode in ("selective", "attention", "blocks") else (1,)):
            policy = replace(step, mode=mode, every=every)
            prediction = predict(policy, speed)
            flops, extra = _flops(policy)
            out.append(Candidate(policy, prediction.peak.step_peak, prediction.seconds, extra,
                                 flops - extra))
    return tuple(sorted(out, key=lambda c: (c.cost, c.peak_bytes)))


def _tie_key(value) -> tuple:
    """The order of labels among points of equal memory and time: strings by themselves,
    before anything else, which goes by its ``repr``."""
    return (0, value, "") if isinstance(value, str) else (1, "", repr(value))


def _point(p) -> tuple:
    """``(memory, time, labels...)`` checked: a tuple or list whose first two items are
    finite real numbers (not bools)."""
    if not isinstance(p, tuple | list) or len(p) < 2 or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool)
            and (isinstance(x, numbers.Integral) or math.isfinite(x)) for x in p[:2]):
        raise ValueError(f"points must be (memory, time, label) tuples with finite numbers for "
                         f"memory and time, got {p!r}")
    return p


def pareto_front(points) -> list:
    """The points no other point beats on both axes: ``(memory, time, label)`` tuples, by memory.

    A point is dominated if another has memory <= and time <= with one of them
    strictly smaller. Used on measured (peak bytes, step seconds) of every policy.
    Points of equal memory and time are all kept (neither beats the other). The result does
    not depend on the input's order: it is sorted by memory, then time, then label (strings in
    their own order, before other labels, which go by their ``repr``), and points equal in all
    of these are equal tuples. It takes ``O(n log n)``: one pass over the points sorted by
    memory and time.

    Args:
        points (iterable): tuples (or lists) ``(memory, time, ...)`` whose memory and time
            are finite real numbers (NaN, the infinities, bools and non-numbers are refused);
            what follows (the label) is kept as is.

    Returns:
        list of tuple: the front, sorted by memory.

    Raises:
        ValueError: naming ``points``, for anything else.

    Example:
        >>> pareto_front([(1, 5, "a"), (2, 3, "b"), (3, 4, "c")])  # c: more memory and time than b
        [(1, 5, 'a'), (2, 3, 'b')]
    """
    try:
        points = [_point(p) for p in points]
    except TypeError as exc:  # not iterable
        raise ValueError(f"points must be an iterable of (memory, time, label) tuples, "
                         f"got {points!r}") from exc
    ordered = sorted(points, key=lambda p: (p[0], p[1], tuple(map(_tie_key, p[2:]))))
    front, best = [], math.inf  # best: the least time among strictly smaller memories
    for _, group in itertools.groupby(ordered, key=lambda p: p[0]):
        group = list(group)
        fastest = group[0][1]  # sorted by time within equal memory
        if fastest < best:  # not beaten by a smaller memory; slower points of the group are
            front += [p for p in group if p[1] == fastest]
            best = fastest
    return front


def plan_checkpointing(step: Step, budget_bytes: int, *, modes: tuple = PLAN_MODES,
                       speed: DeviceSpeed | None = None) -> Candidate:
    """The policy with the least predicted step time whose predicted step peak fits ``budget_bytes``.

    Args:
        step (Step): the training step to plan; its ``mode`` and ``every`` are what the planner
            replaces. ``first_step=True`` plans a fresh model's first step, the one
            :func:`measure_peak` measures (its AdamW states are made within it).
        budget_bytes (int): the memory the step may allocate above what lives before it (the
            parameters; in steady state the optimizer state too), in bytes, from 1 to
            :data:`course_lib.validation.MAX_BYTES`.
        modes (tuple of str): the modes to consider, of :data:`PLAN_MODES`.
        speed (DeviceSpeed, optional): the time model's figures; None: those of the step's GPU
            (a preset's datasheet, or rates measured on this kernel's device).

    Returns:
        Candidate: the chosen policy (``step.mode``, ``step.every``), its predicted
        ``peak_bytes`` and ``seconds`` and the FLOPs it recomputes; apply it with
        ``enable_checkpointing(model, plan.step.mode, plan.step.every)``.

    Raises:
        NothingFits: (a ``ValueError``) when no policy fits; ``candidates`` holds them all.
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step`.
        ValueError: naming ``budget_bytes`` or ``modes``, for a bad value.

    Example:
        >>> config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)
        >>> step = Step(config, 4, first_step=True)
        >>> plan = plan_checkpointing(step, 10**9)  # room for anything: nothing is recomputed
        >>> plan.label, plan.recompute_fraction
        ('none', 0.0)
        >>> smallest = min(c.peak_bytes for c in candidates(step))
        >>> plan_checkpointing(step, smallest).peak_bytes == smallest
        True
    """
    budget_bytes = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    options = candidates(step, modes=modes, speed=speed)
    for c in options:
        if c.peak_bytes <= budget_bytes:
            return c
    raise NothingFits(budget_bytes, options)


def choices(options) -> tuple:
    """The candidates that :func:`plan_checkpointing` picks for some budget, fastest first: every
    other one is beaten by one of these (as fast or faster, a peak no higher)."""
    try:
        options = tuple(options) if not isinstance(options, str) else options
    except TypeError:
        options = None
    if not isinstance(options, tuple) or not options or not all(
            isinstance(c, Candidate) for c in options):
        raise ValueError(f"options must be a non-empty list of Candidates, got {options!r}")
    picked = set()
    for budget in {c.peak_bytes for c in options}:
        picked.add(next(i for i, c in enumerate(options) if c.peak_bytes <= budget))
    return tuple(options[i] for i in sorted(picked))


@step_setup.keeps_rng
def measure_peak(config: GPTConfig, batch_size: int, mode: str = "none", every: int = 1, *,
                 precision: str = "fp32", device: str | torch.device = "cpu") -> int:
    """Measured: the bytes the first training step allocates above the parameters.

    What ``predict(Step(config, batch_size, precision=..., mode=..., every=...,
    first_step=True)).peak.step_peak`` predicts: one
    step of :func:`course_lib.training.loop.train` (autocast and a GradScaler as the precision
    asks, :func:`course_lib.prediction.step_setup.train_options`) on a fresh model and optimizer of
    :func:`course_lib.prediction.step_setup.build` (seed 0), with random tokens, measured by
    :func:`course_lib.measurement.memory.peak_memory` (the CUDA allocator on CUDA, after a warm-up matmul
    that makes cuBLAS's workspace; the live-tensor tracker elsewhere).

    Args:
        config (GPTConfig): the model.
        batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        mode (str): the checkpointing mode.
        every (int): its stride.
        precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
        device (str or torch.device): where it runs.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    device = as_device("device", device)
    model, optimizer = step_setup.build(config, precision=precision, mode=mode, every=every,
                                        device=device)
    options = step_setup.train_options(precision, device)
    x, y = random_tokens(config, batch_size, device=device)
    if device.type == "cuda":  # cuBLAS allocates its workspace at the first matmul: not the step's
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
    return peak_memory(lambda: train(model, optimizer, [(x, y)], micro_batch_size=batch_size,
                                     **options), device=device.type)


@step_setup.keeps_rng
def time_ratios(config: GPTConfig, batch_size: int, policies, *, precision: str = "fp32",
                device: str | torch.device = "cpu", repeats: int = 5,
                optimizer: bool = False) -> dict:
    """Each policy's forward and backward pass (or whole step) timed against no checkpointing's.

    With ``optimizer=True`` each run is a whole training step (:func:`course_lib.training.loop.train`
    with AdamW): what :func:`plan_checkpointing` predicts, so the two compare.

    The models come from :func:`course_lib.prediction.step_setup.build` (seed 0) and run under autocast as
    the precision asks; :func:`course_lib.measurement.timing.step_times` times them in turn, round after
    round, after a warm-up (on a GPU the wall clock after synchronizing, elsewhere the process's
    CPU time); a ratio is the median over the rounds of ``seconds / seconds of none``.

    Args:
        config (GPTConfig): the model.
        batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        policies (list or tuple): up to 32 ``(mode, every)`` pairs (``("none", 1)`` is added if
            missing).
        precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
        device (str or torch.device): where it runs.
        repeats (int): rounds, from 1 to 100.
        optimizer (bool): time whole training steps (forward, backward, AdamW's step).

    Returns:
        dict: ``{label: ratio}`` (1.0: as fast as no checkpointing), labels as
        :func:`course_lib.training.checkpointing.policy_label` writes them, ``"none"`` first.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    repeats = positive_int("repeats", repeats, maximum=100)
    boolean("optimizer", optimizer)
    device = as_device("device", device)
    spec = precision_of(precision)
    x, y = random_tokens(config, batch_size, device=device)
    steps = {}
    policies = [tuple(p) if isinstance(p, tuple | list) and len(p) == 2 else None
                for p in items("policies", policies, max_len=32)]
    if None in policies:
        raise ValueError("policies must be (mode, every) pairs")
    for mode, every in [("none", 1), *(p for p in policies if p != ("none", 1))]:
        model, adamw = step_setup.build(config, precision=precision, mode=mode, every=every,
                                        device=device)
        steps[ckpt.policy_label(mode, every)] = functools.partial(
            train, model, adamw, [(x, y)], micro_batch_size=batch_size,
            **step_setup.train_options(precision, device)) if optimizer else functools.partial(
            _forward_backward, model, x, y, spec.compute if spec.autocast else None)
    times = timing.step_times(steps, repeats=repeats, device=device)
    return {name: times.ratio(name, "none") for name in steps}


def _forward_backward(model, x, y, amp_dtype) -> None:
    with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = model(x, y)[1]
    loss.backward()
    model.zero_grad(set_to_none=True)
