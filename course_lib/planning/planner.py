"""05: pick the checkpointing policy that fits a memory budget in the least predicted time.

Predicted time, not FLOPs: FLOPs alone made ``selective`` look free; on the CPU its per-op
dispatch makes it the slowest policy that fits at lecture 05's budget.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from dataclasses import dataclass, replace

import torch

from course_lib.measurement.memory import peak_memory
from course_lib.model.gpt import random_tokens
from course_lib.prediction import checkpointed, step_setup
from course_lib.prediction.predict import Step, predict
from course_lib.prediction.time_model import DeviceSpeed
from course_lib.training import checkpointing as ckpt
from course_lib.training.loop import train
from course_lib.units import format_bytes
from course_lib.validation import (
    MAX_BYTES,
    WrongTypeError,
    available_device as as_device,
    positive_int,
)

#: The modes the planner considers, in order of increasing recompute for one region.
PLAN_MODES = ("none", "selective", "attention", "blocks", "sqrt")


@dataclass(frozen=True)
class _Candidate:
    """One policy: its step, predicted peak above what lived before it, seconds, FLOPs."""

    step: Step
    peak_bytes: int
    seconds: float
    recompute_flops: int
    step_flops: int

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs over the plain step's."""
        return self.recompute_flops / self.step_flops

    @property
    def regions(self) -> int:
        """Checkpointed regions: each pays a fixed cost."""
        return len(ckpt.checkpointed_regions(self.step.config.n_layers, self.step.mode,
                                             self.step.every))

    @property
    def cost(self) -> tuple:
        """The planner's order: seconds, recomputed FLOPs, checkpointed regions."""
        return (self.seconds, self.recompute_flops, self.regions)

    @property
    def label(self) -> str:
        """The policy as ``mode/every`` ("blocks/2"), or the mode alone for none and sqrt."""
        return ckpt.policy_label(self.step.mode, self.step.every)


class NothingFits(ValueError):
    """No policy's predicted peak is within the budget; ``candidates`` says how close each came."""

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

    As :func:`course_lib.prediction.checkpointed.step_flops` counts them (forward and backward):
    0.33 is one extra forward pass, 0 for ``selective`` (it recomputes no matmul).
    Args:
        step (Step): the step and its checkpointing policy.
    Returns:
        float: recomputed FLOPs over the plain step's.
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a Step, got {type(step).__name__}")
    flops, extra = _flops(step)
    return extra / (flops - extra)


def candidates(step: Step, *, modes: tuple = PLAN_MODES,
               speed: DeviceSpeed | None = None) -> tuple:
    """Every policy of ``modes`` (of :data:`PLAN_MODES`) for ``step``, predicted, fastest first.

    ``every`` runs over ``1 .. n_layers`` for ``selective``, ``attention`` and ``blocks``. Each
    candidate has ``step``, ``peak_bytes``, ``seconds``, ``recompute_fraction`` and ``label``;
    they are sorted by seconds, recomputed FLOPs, checkpointed regions, then peak.
    Args:
        step (Step): the step to plan; its policy is replaced.
        modes (tuple): a subset of :data:`PLAN_MODES`.
        speed (DeviceSpeed, optional): the device's figures (None: the step's GPU's).
    Returns:
        tuple: the candidates, fastest first.
    Raises:
        ValueError: naming the parameter, for a bad value.
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
            out.append(_Candidate(policy, prediction.peak.step_peak, prediction.seconds, extra,
                                  flops - extra))
    return tuple(sorted(out, key=lambda c: (c.cost, c.peak_bytes)))


def _tie_key(value) -> tuple:
    """The order of labels among equal points: strings first, the rest by ``repr``."""
    return (0, value, "") if isinstance(value, str) else (1, "", repr(value))


def _point(p) -> tuple:
    """``(memory, time, labels...)`` checked: memory and time finite real numbers."""
    if not isinstance(p, tuple | list) or len(p) < 2 or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool)
            and (isinstance(x, numbers.Integral) or math.isfinite(x)) for x in p[:2]):
        raise ValueError(f"points must be (memory, time, label) tuples with finite numbers for "
                         f"memory and time, got {p!r}")
    return p


def pareto_front(points) -> list:
    """The points no other point beats on both axes: ``(memory, time, label)`` tuples, by memory.

    A point is dominated if another has memory <= and time <= with one strictly smaller; points
    of equal memory and time are all kept. Memory and time must be finite real numbers. The
    result, sorted by memory, time, then label, does not depend on the input's order.
    Args:
        points (iterable): ``(memory, time, label...)`` tuples.
    Returns:
        list: the points of the front, sorted.
    Raises:
        ValueError: for a point that is not ``(memory, time, label)`` of finite numbers.
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
                       speed: DeviceSpeed | None = None) -> _Candidate:
    """The policy with the least predicted step time whose predicted step peak fits ``budget_bytes``.

    ``budget_bytes`` is what the step may allocate above what lives before it (the parameters;
    in steady state the optimizer state too). ``step.first_step=True`` plans a fresh model's
    first step, the one :func:`measure_peak` measures. Returns the chosen candidate (as
    :func:`candidates`); apply it with ``enable_checkpointing(model, plan.step.mode,
    plan.step.every)``. Raises :class:`NothingFits` (a ``ValueError``) when no policy fits.
    Args:
        step (Step): the step to plan.
        budget_bytes (int): the bytes the step may allocate above what lives before it.
        modes, speed: as :func:`candidates` takes them.
    Returns:
        object: the candidate chosen.
    Raises:
        ValueError: naming the parameter, for a bad value; :class:`NothingFits` if none fits.
    """
    budget_bytes = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    options = candidates(step, modes=modes, speed=speed)
    for c in options:
        if c.peak_bytes <= budget_bytes:
            return c
    raise NothingFits(budget_bytes, options)


def choices(options) -> tuple:
    """The candidates :func:`plan_checkpointing` picks for some budget, fastest first."""
    try:
        options = tuple(options) if not isinstance(options, str) else options
    except TypeError:
        options = None
    if not isinstance(options, tuple) or not options or not all(
            isinstance(c, _Candidate) for c in options):
        raise ValueError(f"options must be a non-empty list of Candidates, got {options!r}")
    picked = set()
    for budget in {c.peak_bytes for c in options}:
        picked.add(next(i for i, c in enumerate(options) if c.peak_bytes <= budget))
    return tuple(options[i] for i in sorted(picked))


@step_setup.keeps_rng
def measure_peak(step: Step, *, device: str | torch.device = "cpu") -> int:
    """Measured: the bytes ``step`` allocates above what lived before it (with ``first_step``,
    a fresh model's first step: above the parameters), what ``predict(step).peak.step_peak``
    predicts. The model is built with seed 0 and trained on random tokens on ``device``.
    Args:
        step (Step): a plain AdamW step on one device.
        device (str or torch.device): where to train.
    Returns:
        int: the peak bytes above what lived before the step.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a Step, got {type(step).__name__}")
    if step != Step(step.config, step.micro_batch_size, step.accumulation_steps, step.seq_len,
                    step.precision, step.mode, step.every, step.segments, gpu=step.gpu,
                    first_step=step.first_step, foreach=step.foreach):
        raise ValueError("step must be a plain AdamW step on one device (no loss_chunk or "
                         "lecture 08's levers) for measure_peak")
    device = as_device("device", device)
    model, optimizer = step_setup.build(step.config, precision=step.precision, mode=step.mode,
                                        every=step.every, segments=step.segments,
                                        foreach=step.foreach, device=device)
    options = step_setup.train_options(step.precision, device)
    x, y = random_tokens(step.config, step.batch_size, step.seq_len, device=device)

    def run():
        train(model, optimizer, [(x, y)], micro_batch_size=step.micro_batch_size,
              accumulation_steps=step.accumulation_steps, **options)

    if device.type == "cuda":  # cuBLAS allocates its workspace at the first matmul: not the step's
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
    if not step.first_step:
        run()  # AdamW's states are made in the first step
    return peak_memory(run, device=device.type)
