"""06: fit it together: the largest GPT, or the largest batch, that trains within a memory budget.

Every step is predicted by the memory engine
(:func:`course_lib.prediction.engine.predict_step_memory`, re-exported here as
:func:`predict_step_memory`) for a steady-state optimizer step (AdamW's ``m`` and ``v`` exist)
of ``K`` accumulated micro-batches, on the CPU or a GPU (a preset of
:data:`course_lib.device.GPUS` or this kernel's), in the engine's
:data:`course_lib.prediction.engine.PRECISIONS`.

:func:`largest_batch` finds the largest micro-batch of one model under each checkpointing
policy; :func:`fit_model` the largest GPT of a search space and the fastest settings that train
it with a given effective batch (:func:`course_lib.prediction.time_model.step_time`;
:func:`settings` lists them all). The set-up and its measured step are
:mod:`course_lib.prediction.step_setup`'s; the guard is :mod:`course_lib.planning.guard`'s.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from course_lib.device import resolve_gpu
from course_lib.measurement import timing
from course_lib.model.gpt import (
    CONFIG_MAXIMUM,
    GPTConfig,
    check_config,
    gpt_param_count,
    random_tokens,
)
from course_lib.planning.planner import recompute_fraction
from course_lib.prediction import engine, step_setup, time_model
from course_lib.prediction.engine import StepMemory, predict_step_memory
from course_lib.prediction.formulas import training_memory
from course_lib.training import checkpointing as ckpt
from course_lib.training.loop import train
from course_lib.units import format_bytes
from course_lib.validation import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    available_device as as_device,
    items,
    number,
    optional_positive_int,
    positive_int,
)

#: The precision recipes the search may try (the engine's).
FIT_PRECISIONS = engine.PRECISIONS
#: The checkpointing policies the search considers, ``(mode, every)``, in order of increasing
#: recompute (:func:`course_lib.prediction.checkpointed.step_flops`): none; matmul outputs kept, the rest
#: of every block recomputed; every other block whole; every block; sqrt(n) segments. The order
#: of FLOPs is not that of time (lecture 05 measures ``selective`` as the slowest): a setting is
#: chosen by its predicted step time (:func:`settings`).
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
#: The most (width, depth) pairs a search space takes: ``len(widths) * len(depths)`` (the
#: default 64 x 128 = 8,192). A pair's configuration holds about :data:`CONFIG_BYTES`, so a
#: space is at most about 8 MiB and built in about a second.
MAX_SEARCH_PAIRS = 2**15
#: An upper estimate of the bytes of one ``GPTConfig`` of a search space (measured: 234).
CONFIG_BYTES = 256
#: The most bytes the cache of search spaces holds (estimated as :data:`CONFIG_BYTES` per
#: configuration); the least recently used spaces are dropped beyond it.
MAX_CACHE_BYTES = 32 * 2**20

# --------------------------------------------------------------------------- validation

def _check_policies(policies) -> tuple:
    modes = ckpt.MODES
    if (isinstance(policies, str) or not isinstance(policies, Sequence) or not policies or any(
            not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], str)
            or p[0] not in modes or not isinstance(p[1], int) or isinstance(p[1], bool)
            or not 1 <= p[1] <= MAX_COUNT for p in policies)):
        raise ValueError(f"policies must be a non-empty sequence of (mode, every) pairs with mode "
                         f"in {modes}, got {policies!r}")
    return tuple(policies)


# --------------------------------------------------------------------------- the largest batch

@dataclass(frozen=True)
class BatchFit:
    """The largest micro-batch of one checkpointing policy (0 if not even one sequence fits)."""

    mode: str
    every: int
    micro_batch_size: int
    memory: StepMemory | None
    recompute_fraction: float

    @property
    def label(self) -> str:
        """The policy as ``mode/every`` ("blocks/2"), or the mode alone for none and sqrt."""
        return ckpt.policy_label(self.mode, self.every)


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
    bisection over ``1 .. max_batch`` with :func:`predict_step_memory`.

    Args:
        config (GPTConfig): the model.
        budget_bytes (int): the memory, in bytes, from 1 to
            :data:`course_lib.validation.MAX_BYTES`.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        accumulation_steps (int): micro-batches per optimizer step.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len`` (None: that).
        policies (sequence of tuple): ``(mode, every)`` pairs.
        max_batch (int): the largest micro-batch tried, up to
            :data:`course_lib.validation.MAX_BATCH`.
        gpu (str or GPU, optional): None (the CPU's kernels), a preset name or a
            :class:`~course_lib.device.GPU`.

    Returns:
        list of BatchFit: one per policy, in their order.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    check_config(config)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    max_batch = positive_int("max_batch", max_batch, maximum=MAX_BATCH)
    accumulation_steps = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    engine.precision_of(precision)
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
                            recompute_fraction(config, 1, mode, every, seq_len=seq_len)))
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
    time: time_model.StepTime

    @property
    def seconds(self) -> float:
        """Predicted seconds of one optimizer step: ``time.seconds``."""
        return self.time.seconds

    @property
    def peak_bytes(self) -> int:
        """Predicted peak bytes of the step: ``memory.total``."""
        return self.memory.total

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step: ``micro_batch_size * accumulation_steps``."""
        return self.micro_batch_size * self.accumulation_steps

    @property
    def label(self) -> str:
        """The checkpointing policy as ``mode/every`` ("blocks/2"), or the mode alone."""
        return ckpt.policy_label(self.mode, self.every)

    def summary(self) -> str:
        """Six lines: the model, the precision, the batch, the checkpointing, the step's
        predicted time and its peak."""
        c = self.config
        return "\n".join([
            f"model      : {self.n_params / 1e6:,.2f}M parameters: d_model={c.d_model}, "
            f"n_layers={c.n_layers}, n_heads={c.n_heads}, seq_len={c.seq_len}, vocab={c.vocab_size}",
            f"precision  : {self.precision}",
            f"batch      : {self.micro_batch_size} x {self.accumulation_steps} accumulation steps "
            f"= {self.effective_batch} sequences per optimizer step",
            f"checkpoint : {self.label} (+{self.recompute_fraction:.0%} FLOPs against a plain step)",
            f"step time  : {_format_seconds(self.seconds)} predicted {self.time.basis}",
            f"peak       : {format_bytes(self.peak_bytes)} predicted, budget "
            f"{format_bytes(self.budget_bytes)} ({self.peak_bytes / self.budget_bytes:.0%})",
        ])


def _format_seconds(seconds: float) -> str:
    """``"32.1 ms"`` below a second, ``"1.25 s"`` from one."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _check_space(widths, depths, head_size, aspect_ratio, seq_len=1024,
                 vocab_size=50257) -> None:
    head_size = positive_int("head_size", head_size, maximum=CONFIG_MAXIMUM["d_model"])
    for name, values, maximum in (("widths", widths, CONFIG_MAXIMUM["d_model"]),
                                  ("depths", depths, CONFIG_MAXIMUM["n_layers"])):
        if (isinstance(values, str) or not isinstance(values, Sequence) or not values
                or len(values) > MAX_SEARCH_VALUES):
            raise ValueError(f"{name} must be a non-empty sequence of at most "
                             f"{MAX_SEARCH_VALUES} positive ints, got {values!r}")
        for v in values:
            positive_int(name, v, maximum=maximum)
    if len(widths) * len(depths) > MAX_SEARCH_PAIRS:
        raise ValueError(f"widths and depths must make at most {MAX_SEARCH_PAIRS:,} pairs "
                         f"(len(widths) * len(depths)), got {len(widths):,} * {len(depths):,}")
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
    seq_len = positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    vocab_size = positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])


def search_space(*, widths: Sequence[int] = DEFAULT_WIDTHS, depths: Sequence[int] = DEFAULT_DEPTHS,
                 head_size: int = 64, aspect_ratio: tuple | None = DEFAULT_ASPECT_RATIO,
                 seq_len: int = 1024, vocab_size: int = 50257) -> list[GPTConfig]:
    """The GPT shapes :func:`fit_model` chooses from, largest first (most parameters).

    ``n_heads = d_model // head_size`` and, unless ``aspect_ratio`` is None,
    ``low <= d_model / n_layers <= high``: Kaplan et al. (2020, "Scaling Laws for Neural Language
    Models", figure 5) find the loss within a few percent for aspect ratios of about 20 to 200.
    """
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    return list(_search_space(tuple(int(w) for w in widths), tuple(int(d) for d in depths),
                              int(head_size),
                              None if aspect_ratio is None else tuple(aspect_ratio), int(seq_len),
                              int(vocab_size)))


#: The cached search spaces: arguments -> configurations, least recently used first.
_SPACES: collections.OrderedDict = collections.OrderedDict()


def _search_space(*key) -> tuple:
    """:func:`search_space` of checked arguments, cached (a widget asks again and again) within
    :data:`MAX_CACHE_BYTES`."""
    if key in _SPACES:
        _SPACES.move_to_end(key)
        return _SPACES[key]
    space = _build_space(*key)
    _SPACES[key] = space
    while sum(len(v) for v in _SPACES.values()) * CONFIG_BYTES > MAX_CACHE_BYTES \
            and len(_SPACES) > 1:
        _SPACES.popitem(last=False)
    return space


def _build_space(widths: tuple, depths: tuple, head_size: int, aspect_ratio: tuple | None,
                 seq_len: int, vocab_size: int) -> tuple:
    low, high = aspect_ratio or (0, float("inf"))
    configs = []
    for w in widths:
        column = [L for L in depths if w % head_size == 0 and low <= w / L <= high]
        if column:
            # Every depth was checked (_check_space): the width's first config is checked in
            # full and copied with the others, which skips most of the space's build time.
            first = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=w,
                              n_heads=w // head_size, n_layers=column[0])
            configs.append(first)
            for L in column[1:]:
                config = copy.copy(first)
                object.__setattr__(config, "n_layers", L)
                configs.append(config)
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


def _fitting(config: GPTConfig, budget: int, effective_batch: int, precision: str,
             policies: tuple, max_accumulation_steps: int | None, gpu, speed) -> list:
    """Every ``(seconds, recompute, -b, mode, every, b)`` of ``config`` in ``precision`` whose
    step fits ``budget``, fastest first, and the memory of each, as ``(rows, memory)``.

    Per policy the whole batch is tried alone, then the largest fitting micro-batch is found
    by bisection (memory grows with it).
    """
    seq_len = config.seq_len
    micro = _micro_batches(effective_batch, max_accumulation_steps)
    memories = {}

    def memory(mode, every, b):
        if (mode, every, b) not in memories:
            memories[mode, every, b] = predict_step_memory(
                config, b, effective_batch // b, precision=precision, mode=mode, every=every,
                gpu=gpu)
        return memories[mode, every, b]

    def fits(b, mode, every):  # a step whose floor is over the budget is not predicted
        return (engine.predict_floor(config, b, effective_batch // b, precision=precision,
                                     mode=mode, every=every, gpu=gpu) <= budget
                and memory(mode, every, b).total <= budget)

    rows = []
    for mode, every in policies:
        below = micro[:-1] if micro[-1] == effective_batch else micro
        largest = _largest(lambda b, mode=mode, every=every: fits(b, mode, every), below)
        fitting = [b for b in below if b <= largest]
        if below is not micro and fits(effective_batch, mode, every):
            fitting.append(effective_batch)
        recompute = recompute_fraction(config, 1, mode, every, seq_len=seq_len) if fitting else 0.0
        rows += [(time_model.step_seconds(config, b, effective_batch // b, mode=mode,
                                          every=every, precision=precision, gpu=gpu,
                                          speed=speed), recompute, -b, mode, every, b)
                 for b in fitting]
    return sorted(rows), memory


def _fit_of(config: GPTConfig, budget: int, effective_batch: int, precision: str, row, memory,
            gpu, speed) -> Fit:
    mode, every, b = row[3:]
    return Fit(config, gpt_param_count(config), precision, b, effective_batch // b, mode, every,
               memory(mode, every, b), budget, row[1],
               time_model.step_time(config, b, effective_batch // b, mode=mode, every=every,
                                    precision=precision, gpu=gpu, speed=speed))


def _settings(config: GPTConfig, budget: int, effective_batch: int, precision: str,
              policies: tuple, max_accumulation_steps: int | None = None,
              gpu=None, speed=None) -> Fit | None:
    """The fastest way to train ``config`` in ``precision`` under ``budget``, or None; ties go to
    the least recompute, then the largest micro-batch."""
    rows, memory = _fitting(config, budget, effective_batch, precision, policies,
                            max_accumulation_steps, gpu, speed)
    if not rows:
        return None
    return _fit_of(config, budget, effective_batch, precision, rows[0], memory, gpu, speed)


def _check_speed(speed):
    """``speed`` if it is a DeviceSpeed or None (then
    :func:`course_lib.prediction.time_model.device_speed` of the target, asked only when a
    time is)."""
    if speed is not None and not isinstance(speed, time_model.DeviceSpeed):
        raise ValueError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    return speed


def settings(config: GPTConfig, budget_bytes: int, *, effective_batch: int = 32,
             precision: str = "fp32", policies: Sequence[tuple[str, int]] = FIT_POLICIES,
             max_accumulation_steps: int | None = None, gpu=None,
             speed: time_model.DeviceSpeed | None = None) -> list[Fit]:
    """Every setting of one model and precision whose step fits ``budget_bytes``, fastest first.

    A setting is a checkpointing policy of ``policies`` and a micro-batch ``b`` dividing
    ``effective_batch`` (with ``effective_batch // b`` accumulation steps). Each is timed by the
    course's one time model (:func:`course_lib.prediction.time_model.step_time`) and its step
    predicted by :func:`predict_step_memory`; the first is what :func:`fit_model` chooses for
    the model it finds. Ties go to the least recompute, then the largest micro-batch.

    Args:
        config (GPTConfig): the model.
        budget_bytes (int): the memory, in bytes, from 1 to
            :data:`course_lib.validation.MAX_BYTES`.
        effective_batch (int): sequences per optimizer step, up to :data:`MAX_EFFECTIVE_BATCH`.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        policies (sequence of tuple): ``(mode, every)`` checkpointing policies.
        max_accumulation_steps (int, optional): the most accumulation steps (None: no limit).
        gpu (str or GPU, optional): where it trains, as :func:`predict_step_memory` takes it.
        speed (DeviceSpeed, optional): the time model's figures; default
            :func:`course_lib.prediction.time_model.device_speed` of ``gpu`` (this CPU measured
            once, or a preset's datasheet).

    Returns:
        list of Fit: fastest first; empty when nothing fits.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    check_config(config)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    effective_batch = positive_int("effective_batch", effective_batch, maximum=MAX_EFFECTIVE_BATCH)
    engine.precision_of(precision)
    policies = _check_policies(policies)
    max_accumulation_steps = optional_positive_int(
        "max_accumulation_steps", max_accumulation_steps, maximum=MAX_EFFECTIVE_BATCH)
    gpu = resolve_gpu(gpu)
    speed = _check_speed(speed)
    rows, memory = _fitting(config, budget, effective_batch, precision, policies,
                            max_accumulation_steps, gpu, speed)
    return [_fit_of(config, budget, effective_batch, precision, row, memory, gpu, speed)
            for row in rows]


@step_setup.keeps_rng
def measure_seconds(fits: Sequence[Fit], *, device: str | torch.device = "cpu",
                    repeats: int = 3) -> list[float]:
    """Each setting's optimizer step measured: the median seconds over ``repeats`` runs.

    Each :class:`Fit` is built (:func:`course_lib.prediction.step_setup.build`, seed 0) and
    trained one whole optimizer step on random tokens, its micro-batches and accumulation steps
    as the setting says; :func:`course_lib.measurement.timing.step_times` times the steps in
    turn, round after round, after a warm-up (on a GPU the wall clock after synchronizing,
    elsewhere the process's CPU time), as the time model's figures for this device were
    measured. What :attr:`Fit.seconds` predicts, so the two compare.

    Args:
        fits (sequence of Fit): up to 16 settings (:func:`settings`, :func:`fit_model`).
        device (str or torch.device): where they run.
        repeats (int): rounds, from 1 to 100.

    Returns:
        list of float: seconds per optimizer step, in the order of ``fits``.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    fits = items("fits", fits, max_len=16)
    if not fits or not all(isinstance(f, Fit) for f in fits):
        raise ValueError(f"fits must be a non-empty sequence of Fit, got {fits!r:.80}")
    repeats = positive_int("repeats", repeats, maximum=100)
    device = as_device("device", device)
    steps = {}
    for i, f in enumerate(fits):
        model, optimizer = step_setup.build(f.config, precision=f.precision, mode=f.mode,
                                            every=f.every, device=device)
        x, y = random_tokens(f.config, f.effective_batch, device=device)
        steps[str(i)] = functools.partial(
            train, model, optimizer, [(x, y)], micro_batch_size=f.micro_batch_size,
            accumulation_steps=f.accumulation_steps,
            **step_setup.train_options(f.precision, device))
    medians = timing.step_times(steps, repeats=repeats, device=device).median()
    return [medians[str(i)] for i in range(len(fits))]


def _state_bytes(precision: str) -> tuple[int, int]:
    """Bytes per parameter of (resident model states, gradients at the optimizer step) of AdamW
    in ``precision`` (:func:`course_lib.prediction.formulas.training_memory`)."""
    one = training_memory(1, optimizer="adamw", precision=precision)
    at_step = one.master_weights if engine.precision_of(precision).master else one.gradients
    return one.parameters + one.master_weights + one.optimizer_state, at_step


#: :func:`_state_bytes` of every precision, once (the search asks for thousands of models).
_STATE_BYTES = {precision: _state_bytes(precision) for precision in FIT_PRECISIONS}


def _lower_bound(config: GPTConfig, precision: str) -> int:
    """A closed-form lower bound on any step's peak: resident states plus the larger of the
    step's gradients and one sequence's fp32 log-probabilities with their two gradients."""
    P = gpt_param_count(config)
    resident, grads = _STATE_BYTES[precision]
    return resident * P + max(grads * P, 3 * config.seq_len * config.vocab_size * 4)


def fit_model(budget_bytes: int, *, seq_len: int = 1024, effective_batch: int = 32,
              vocab_size: int = 50257, widths: Sequence[int] = DEFAULT_WIDTHS,
              depths: Sequence[int] = DEFAULT_DEPTHS, head_size: int = 64,
              aspect_ratio: tuple | None = DEFAULT_ASPECT_RATIO,
              precisions: Sequence[str] = ("bf16-mixed", "fp32"),
              policies: Sequence[tuple[str, int]] = FIT_POLICIES,
              max_accumulation_steps: int | None = None, gpu=None,
              speed: time_model.DeviceSpeed | None = None) -> Fit:
    """The largest GPT of the search space that trains within ``budget_bytes``, and how.

    Search space: :func:`search_space` (``d_model`` in ``widths``, ``n_layers`` in ``depths``, heads
    of ``head_size``, an ``aspect_ratio`` range; ``seq_len`` and ``vocab_size`` fixed). "Largest" is
    the most parameters. A configuration fits if one setting's :func:`predict_step_memory` is at
    most the budget; a setting is a precision of ``precisions``, a micro-batch ``b`` dividing
    ``effective_batch`` with ``effective_batch // b`` accumulation steps, and a checkpointing policy
    of ``policies``. For the largest fitting model the setting chosen is: the first precision of
    ``precisions`` that fits (the order is a preference, since precisions train differently:
    ``"bf16-mixed"`` before ``"fp32"`` by default; pure ``"bf16"`` only if listed), then, of the
    policies and micro-batches that fit in it, the fastest by predicted step time (:func:`settings`;
    the course's one time model, :func:`course_lib.prediction.time_model.step_time`).

    Search: memory grows with depth and with width, so each width's deepest fitting model is
    found by bisection; a setting whose :func:`course_lib.prediction.engine.predict_floor` is
    over the budget is not predicted, and the search stops once no width can beat the best found.

    Args:
        budget_bytes (int): the memory, in bytes, up to :data:`course_lib.validation.MAX_BYTES`.
        seq_len (int): tokens per sequence, up to :data:`course_lib.model.gpt.CONFIG_MAXIMUM`.
        effective_batch (int): sequences per optimizer step, up to
            :data:`MAX_EFFECTIVE_BATCH`.
        vocab_size (int): the vocabulary, up to :data:`course_lib.model.gpt.CONFIG_MAXIMUM`.
        widths, depths (sequence of int): ``d_model`` and ``n_layers`` values to try.
        head_size (int): ``d_model // n_heads``.
        aspect_ratio (tuple, optional): ``(low, high)`` bounds on ``d_model / n_layers``, or None.
        precisions (sequence of str): of :data:`FIT_PRECISIONS` (the engine's), in order of
            preference.
        policies (sequence of tuple): ``(mode, every)`` checkpointing policies.
        max_accumulation_steps (int, optional): the most accumulation steps (None: no limit),
            up to :data:`MAX_EFFECTIVE_BATCH`.
        gpu (str or GPU, optional): where it trains, as :func:`predict_step_memory` takes it (the
            budget is still ``budget_bytes``).
        speed (DeviceSpeed, optional): the time model's figures; default
            :func:`course_lib.prediction.time_model.device_speed` of ``gpu``.

    Returns:
        Fit: the model, its setting, its predicted memory and time.

    Raises:
        ValueError: if nothing fits, and naming the argument for a bad one: counts are ints,
            not bools or floats, with the maxima above.
    """
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    seq_len = positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    effective_batch = positive_int("effective_batch", effective_batch, maximum=MAX_EFFECTIVE_BATCH)
    vocab_size = positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])
    if isinstance(precisions, str) or not isinstance(precisions, Sequence) or not precisions:
        raise ValueError(f"precisions must be a non-empty sequence of {FIT_PRECISIONS}, "
                         f"got {precisions!r}")
    for p in precisions:
        engine.precision_of(p, "precisions")
    policies = _check_policies(policies)
    max_accumulation_steps = optional_positive_int(
        "max_accumulation_steps", max_accumulation_steps, maximum=MAX_EFFECTIVE_BATCH)
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    gpu = resolve_gpu(gpu)
    speed = _check_speed(speed)
    micro = _micro_batches(effective_batch, max_accumulation_steps)
    # The least memory: the smallest micro-batch, or the whole batch without accumulation (see
    # _settings); a model fits if one of them does.
    extremes = sorted({micro[0], micro[-1]})
    configs = search_space(widths=widths, depths=depths, head_size=head_size,
                           aspect_ratio=aspect_ratio, seq_len=seq_len, vocab_size=vocab_size)
    by_width: dict[int, list[GPTConfig]] = {}
    for c in sorted(configs, key=lambda c: c.n_layers):
        by_width.setdefault(c.d_model, []).append(c)
    for width, column in list(by_width.items()):  # the depths within the closed-form bound
        n = _largest(lambda i, column=column: min(_lower_bound(column[i - 1], p)
                                                  for p in precisions) <= budget,
                     range(1, len(column) + 1))
        by_width[width] = column[:n]
        if not n:
            del by_width[width]
    lean = sorted(policies, key=lambda p: -recompute_fraction(configs[-1], 1, *p, seq_len=seq_len))

    def fits(config: GPTConfig) -> bool:  # in some precision, policy and extreme micro-batch
        # The leanest policies first; a setting whose floor (the backward pass's first moment,
        # a fraction of a prediction's cost) is over the budget is ruled out unpredicted.
        return any(engine.predict_floor(config, b, effective_batch // b, precision=p, mode=m,
                                        every=ev, gpu=gpu) <= budget
                   and predict_step_memory(config, b, effective_batch // b, precision=p, mode=m,
                                           every=ev, gpu=gpu).total <= budget
                   for m, ev in lean
                   for p in sorted(precisions, key=lambda p: _lower_bound(config, p))
                   for b in extremes)

    # Memory grows with depth and with width, so a wider width's deepest fitting depth fits
    # every narrower width too (widths are visited widest-bound first): no need to try it again.
    deepest: dict[int, int] = {}  # width -> deepest fitting depth of its column (0: none)
    best = None
    for width in sorted(by_width, key=lambda w: -gpt_param_count(by_width[w][-1])):
        column = by_width[width]  # by depth, all within the closed-form bound
        if best is not None and gpt_param_count(column[-1]) <= gpt_param_count(best):
            break  # no deeper model of this or any later width can beat the best
        floor = max((d for w, d in deepest.items() if w > width), default=0)
        known = sum(c.n_layers <= floor for c in column)  # they fit
        i = _largest(lambda i, column=column: fits(column[i - 1]),
                     range(known + 1, len(column) + 1)) or known
        deepest[width] = column[i - 1].n_layers if i else 0
        if i and (best is None or gpt_param_count(column[i - 1]) > gpt_param_count(best)):
            best = column[i - 1]
    if best is not None:
        for precision in precisions:
            fit = _settings(best, budget, effective_batch, precision, policies,
                            max_accumulation_steps, gpu, speed)
            if fit is not None:
                return fit
    smallest = configs[-1]
    raise ValueError(f"budget_bytes={budget} ({format_bytes(budget)}) is too small for the smallest "
                     f"configuration of the search space (d_model={smallest.d_model}, "
                     f"n_layers={smallest.n_layers}, seq_len={seq_len}, vocab_size={vocab_size})")


__all__ = ["FIT_PRECISIONS", "FIT_POLICIES", "BatchFit", "Fit", "largest_batch", "search_space",
           "settings", "measure_seconds", "fit_model"]
