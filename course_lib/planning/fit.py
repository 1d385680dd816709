"""06: fit it together: the largest GPT, or the largest batch, that trains within a memory budget.

Each search starts from one :class:`~course_lib.prediction.step.Step` (a steady-state AdamW
step) and replaces its fields: the model, the micro-batch and accumulation steps, the precision,
the checkpointing policy. Each setting is predicted by
:func:`course_lib.prediction.predict.predict`, after the engine's cheap lower bound
(:func:`course_lib.prediction.engine.floor`) has not already ruled it out.

:func:`largest_batch` finds one model's largest micro-batch under each checkpointing policy;
:func:`settings` every setting of a step's batch that fits, fastest first; :func:`fit_model` the
largest GPT of a search space and the fastest setting that trains it. The guard is
:mod:`course_lib.planning.guard`'s.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from course_lib.measurement import timing
from course_lib.model.gpt import CONFIG_MAXIMUM, GPTConfig, gpt_param_count, random_tokens
from course_lib.planning.planner import recompute_fraction
from course_lib.prediction import engine, step_setup
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import PRECISIONS, precision_of
from course_lib.prediction.predict import Prediction, Step, predict
from course_lib.prediction.time_model import DeviceSpeed
from course_lib.training import checkpointing as ckpt
from course_lib.training.loop import train
from course_lib.units import format_bytes
from course_lib.validation import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    WrongTypeError,
    available_device as as_device,
    items,
    number,
    optional_positive_int,
    positive_int,
)

#: The precision recipes the search may try (:data:`course_lib.prediction.formulas.PRECISIONS`).
FIT_PRECISIONS = PRECISIONS
#: The checkpointing policies the search considers, ``(mode, every)``, in order of increasing
#: recompute (:func:`course_lib.prediction.checkpointed.step_flops`): none; matmul outputs kept,
#: the rest of every block recomputed; every other block whole; every block; sqrt(n) segments.
#: The order of FLOPs is not that of time (lecture 05 measures ``selective`` as the slowest): a
#: setting is chosen by its predicted step time (:func:`settings`).
FIT_POLICIES = (("none", 1), ("selective", 1), ("blocks", 2), ("blocks", 1), ("sqrt", 1))
#: Default search space (:func:`search_space`): d_model in steps of 128, 1 to 128 layers,
#: 64-wide heads, d_model / n_layers between 32 and 128.
DEFAULT_WIDTHS = tuple(range(128, 8192 + 1, 128))
DEFAULT_DEPTHS = tuple(range(1, 129))
DEFAULT_ASPECT_RATIO = (32, 128)
#: The most sequences per optimizer step the searches take (:data:`course_lib.validation.MAX_BATCH`;
#: GPT-3's batches held 1,600 sequences). The micro-batches are its divisors.
MAX_EFFECTIVE_BATCH = MAX_BATCH
#: The most widths, and the most depths, a search space takes (the defaults hold 64 and 128).
MAX_SEARCH_VALUES = 1024
#: The most (width, depth) pairs a search space takes: ``len(widths) * len(depths)`` (the
#: default 64 x 128 = 8,192), each a configuration of about :data:`CONFIG_BYTES`.
MAX_SEARCH_PAIRS = 2**15
#: An upper estimate of the bytes of one ``GPTConfig`` of a search space (measured: 234).
CONFIG_BYTES = 256
#: The most bytes the cache of search spaces holds; the least recently used go beyond it.
MAX_CACHE_BYTES = 32 * 2**20


def _check_policies(policies) -> tuple:
    modes = ckpt.MODES
    if (isinstance(policies, str) or not isinstance(policies, Sequence) or not policies or any(
            not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], str)
            or p[0] not in modes or not isinstance(p[1], int) or isinstance(p[1], bool)
            or not 1 <= p[1] <= MAX_COUNT for p in policies)):
        raise ValueError(f"policies must be a non-empty sequence of (mode, every) pairs with mode "
                         f"in {modes}, got {policies!r}")
    return tuple(policies)


def _check_step(step) -> Step:
    """``step``, a plain steady Step: all that the engine's floor, which prunes searches, knows."""
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a course_lib.prediction.step.Step, got "
                             f"{type(step).__name__}")
    if step != Step(step.config, step.micro_batch_size, step.accumulation_steps, step.seq_len,
                    step.precision, step.mode, step.every, gpu=step.gpu):
        raise ValueError("step must be a plain steady step (no segments, first_step, foreach, "
                         "loss_chunk or lecture 08's levers): the searches replace its model, "
                         "batch, precision and checkpointing only")
    return step


def _check_speed(speed) -> DeviceSpeed | None:
    if speed is not None and not isinstance(speed, DeviceSpeed):
        raise WrongTypeError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    return speed


def _fits(step: Step, budget: int) -> bool:
    """Whether ``step``'s predicted peak is within ``budget``, its cheap floors asked first."""
    return (engine.floor(step) <= budget and engine.model_floor(step) <= budget
            and predict(step).total <= budget)


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


def largest_batch(step: Step, budget_bytes: int, *,
                  policies: Sequence[tuple[str, int]] = FIT_POLICIES,
                  max_batch: int = 1 << 16) -> list[BatchFit]:
    """For each checkpointing policy, the largest micro-batch of ``step`` that fits ``budget_bytes``.

    Predicted peak memory grows with the micro-batch, so each is found by doubling, then
    bisection, over ``1 .. max_batch``.

    Args:
        step (Step): the model, accumulation steps, sequence length, precision and GPU; the search
            replaces its micro-batch and checkpointing.
        budget_bytes (int): the memory, in bytes, from 1 to :data:`course_lib.validation.MAX_BYTES`.
        policies (sequence of tuple): ``(mode, every)`` pairs.
        max_batch (int): the largest micro-batch tried, up to
            :data:`course_lib.validation.MAX_BATCH`.

    Returns:
        list of BatchFit: one per policy, in their order.

    Raises:
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step`.
        ValueError: naming the argument, for a bad value.

    Example:
        >>> config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)
        >>> none, blocks = largest_batch(Step(config), 2**21, policies=[("none", 1), ("blocks", 1)])
        >>> none.micro_batch_size < blocks.micro_batch_size, blocks.memory.total <= 2**21
        (True, True)
    """
    step = _check_step(step)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    max_batch = positive_int("max_batch", max_batch, maximum=MAX_BATCH)
    out = []
    for mode, every in _check_policies(policies):
        policy = replace(step, mode=mode, every=every)

        def fits(b, policy=policy):
            return _fits(replace(policy, micro_batch_size=b), budget)

        top = 1  # doubling, then bisection of the last interval
        while top < max_batch and fits(min(2 * top, max_batch)):
            top = min(2 * top, max_batch)
        b = _largest(fits, range(top, min(2 * top, max_batch + 1)))
        out.append(BatchFit(mode, every, b,
                            predict(replace(policy, micro_batch_size=b)).peak if b else None,
                            recompute_fraction(policy)))
    return out


# --------------------------------------------------------------------------- the fastest setting

@dataclass(frozen=True)
class Fit:
    """A setting that fits: its step's :class:`~course_lib.prediction.predict.Prediction`
    (``prediction.step`` the step), the budget in bytes, and the FLOPs its checkpointing
    recomputes over a plain step's."""

    prediction: Prediction
    budget_bytes: int
    recompute_fraction: float

    @property
    def step(self) -> Step:
        """The setting: model, micro-batch, accumulation steps, precision, checkpointing."""
        return self.prediction.step

    @property
    def memory(self) -> StepMemory:
        """The step's peak moment, by category."""
        return self.prediction.peak

    @property
    def peak_bytes(self) -> int:
        """Predicted peak bytes of the step."""
        return self.prediction.total

    @property
    def seconds(self) -> float:
        """Predicted seconds of one optimizer step."""
        return self.prediction.seconds

    @property
    def n_params(self) -> int:
        """The model's parameters."""
        return gpt_param_count(self.step.config)

    @property
    def label(self) -> str:
        """The checkpointing policy as ``mode/every`` ("blocks/2"), or the mode alone."""
        return ckpt.policy_label(self.step.mode, self.step.every)

    def summary(self) -> str:
        """Six lines: the model, the precision, the batch, the checkpointing, the step's
        predicted time and its peak."""
        s, c = self.step, self.step.config
        seconds = self.seconds
        return "\n".join([
            f"model      : {self.n_params / 1e6:,.2f}M parameters: d_model={c.d_model}, "
            f"n_layers={c.n_layers}, n_heads={c.n_heads}, seq_len={c.seq_len}, vocab={c.vocab_size}",
            f"precision  : {s.precision}",
            f"batch      : {s.micro_batch_size} x {s.accumulation_steps} accumulation steps "
            f"= {s.batch_size} sequences per optimizer step",
            f"checkpoint : {self.label} (+{self.recompute_fraction:.0%} FLOPs against a plain step)",
            f"step time  : {f'{seconds * 1e3:.1f} ms' if seconds < 1 else f'{seconds:.2f} s'} "
            f"predicted {self.prediction.time.basis}",
            f"peak       : {format_bytes(self.peak_bytes)} predicted, budget "
            f"{format_bytes(self.budget_bytes)} ({self.peak_bytes / self.budget_bytes:.0%})",
        ])


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in ``O(sqrt(n))``."""
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


def _settings(step: Step, budget: int, policies: tuple, max_accumulation_steps: int | None,
              speed: DeviceSpeed | None) -> list[Fit]:
    """:func:`settings` of checked arguments: per policy, a bisection over the micro-batches."""
    n = step.batch_size
    micro = _micro_batches(n, max_accumulation_steps)
    below = micro[:-1] if micro[-1] == n else micro
    rows = []
    for mode, every in policies:
        at = functools.cache(lambda b, mode=mode, every=every: replace(
            step, micro_batch_size=b, accumulation_steps=n // b, mode=mode, every=every))
        largest = _largest(lambda b, at=at: _fits(at(b), budget), below)
        fitting = [b for b in below if b <= largest]
        if below is not micro and _fits(at(n), budget):  # no accumulated gradient to hold
            fitting.append(n)
        if fitting:
            recompute = recompute_fraction(at(fitting[0]))
        for b in fitting:
            p = predict(at(b), speed)
            rows.append(((p.seconds, recompute, -b, mode, every), Fit(p, budget, recompute)))
    return [fit for _, fit in sorted(rows, key=lambda row: row[0])]


def settings(step: Step, budget_bytes: int, *,
             policies: Sequence[tuple[str, int]] = FIT_POLICIES,
             max_accumulation_steps: int | None = None,
             speed: DeviceSpeed | None = None) -> list[Fit]:
    """Every setting of ``step``'s model, batch and precision that fits ``budget_bytes``, fastest first.

    A setting is a checkpointing policy of ``policies`` and a micro-batch ``b`` dividing
    ``step.batch_size``, with ``step.batch_size // b`` accumulation steps. Each is predicted by
    :func:`course_lib.prediction.predict.predict`, memory and time; the first is what
    :func:`fit_model` chooses for the model it finds. Ties go to the least recompute, then the
    largest micro-batch.

    Args:
        step (Step): the model, the sequences per optimizer step (``step.batch_size``), the
            sequence length, the precision and the GPU.
        budget_bytes (int): the memory, in bytes, from 1 to :data:`course_lib.validation.MAX_BYTES`.
        policies (sequence of tuple): ``(mode, every)`` checkpointing policies.
        max_accumulation_steps (int, optional): the most accumulation steps (None: no limit).
        speed (DeviceSpeed, optional): the time model's figures; None: those of the step's GPU
            (:func:`course_lib.prediction.time_model.device_speed`).

    Returns:
        list of Fit: fastest first; empty when nothing fits.

    Raises:
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step` or a
            ``speed`` that is not a :class:`~course_lib.prediction.time_model.DeviceSpeed`.
        ValueError: naming the argument, for a bad value.

    Example:
        >>> config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)
        >>> fastest = settings(Step(config, 8), 2**21)[0]
        >>> fastest.step.batch_size, fastest.peak_bytes <= 2**21
        (8, True)
    """
    step = _check_step(step)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    max_accumulation_steps = optional_positive_int(
        "max_accumulation_steps", max_accumulation_steps, maximum=MAX_EFFECTIVE_BATCH)
    return _settings(step, budget, _check_policies(policies), max_accumulation_steps,
                     _check_speed(speed))


@step_setup.keeps_rng
def measure_seconds(fits: Sequence[Fit], *, device: str | torch.device = "cpu",
                    repeats: int = 3) -> list[float]:
    """Each setting's optimizer step measured: the median seconds over ``repeats`` runs.

    Each :class:`Fit`'s step is built (:func:`course_lib.prediction.step_setup.build`, seed 0)
    and trained one whole optimizer step on random tokens, its micro-batches and accumulation
    steps as the setting says; :func:`course_lib.measurement.timing.step_times` times the steps
    in turn, round after round, after a warm-up (on a GPU the wall clock after synchronizing,
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
        s = f.step
        model, optimizer = step_setup.build(s.config, precision=s.precision, mode=s.mode,
                                            every=s.every, device=device)
        x, y = random_tokens(s.config, s.batch_size, device=device)
        steps[str(i)] = functools.partial(
            train, model, optimizer, [(x, y)], micro_batch_size=s.micro_batch_size,
            accumulation_steps=s.accumulation_steps,
            **step_setup.train_options(s.precision, device))
    medians = timing.step_times(steps, repeats=repeats, device=device).median()
    return [medians[str(i)] for i in range(len(fits))]


# --------------------------------------------------------------------------- the largest model

def _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size) -> None:
    positive_int("head_size", head_size, maximum=CONFIG_MAXIMUM["d_model"])
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
    positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])


def search_space(*, widths: Sequence[int] = DEFAULT_WIDTHS, depths: Sequence[int] = DEFAULT_DEPTHS,
                 head_size: int = 64, aspect_ratio: tuple | None = DEFAULT_ASPECT_RATIO,
                 seq_len: int = 1024, vocab_size: int = 50257) -> list[GPTConfig]:
    """The GPT shapes :func:`fit_model` chooses from, largest first (most parameters).

    ``n_heads = d_model // head_size`` and, unless ``aspect_ratio`` is None,
    ``low <= d_model / n_layers <= high``: Kaplan et al. (2020, "Scaling Laws for Neural Language
    Models", figure 5) find the loss within a few percent for aspect ratios of about 20 to 200.

    Args:
        widths, depths (sequence of int): ``d_model`` and ``n_layers`` values to try, at most
            :data:`MAX_SEARCH_VALUES` each and :data:`MAX_SEARCH_PAIRS` pairs.
        head_size (int): ``d_model // n_heads``.
        aspect_ratio (tuple, optional): ``(low, high)`` bounds on ``d_model / n_layers``, or None.
        seq_len (int): tokens per sequence.
        vocab_size (int): the vocabulary.

    Returns:
        list of GPTConfig: the shapes, most parameters first.

    Raises:
        ValueError: naming the argument, for a bad value or an empty space.

    Example:
        >>> [c.n_layers for c in search_space(widths=[64], depths=range(1, 9), head_size=32,
        ...                                   aspect_ratio=(16, 32), seq_len=16, vocab_size=10)]
        [4, 3, 2]
    """
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    return list(_search_space(tuple(int(w) for w in widths), tuple(int(d) for d in depths),
                              int(head_size), None if aspect_ratio is None else tuple(aspect_ratio),
                              int(seq_len), int(vocab_size)))


#: The cached search spaces: arguments -> configurations, least recently used first.
_SPACES: collections.OrderedDict = collections.OrderedDict()


def _search_space(*key) -> tuple:
    """:func:`search_space` of checked arguments, cached (a widget asks again and again) within
    :data:`MAX_CACHE_BYTES`."""
    if key in _SPACES:
        _SPACES.move_to_end(key)
        return _SPACES[key]
    space = _SPACES[key] = _build_space(*key)
    while sum(len(v) for v in _SPACES.values()) * CONFIG_BYTES > MAX_CACHE_BYTES \
            and len(_SPACES) > 1:
        _SPACES.popitem(last=False)
    return space


def _build_space(widths: tuple, depths: tuple, head_size: int, aspect_ratio: tuple | None,
                 seq_len: int, vocab_size: int) -> tuple:
    low, high = aspect_ratio or (0, float("inf"))
    sized = []  # (-parameters, depth, config)
    for w in widths:
        column = [L for L in depths if w % head_size == 0 and low <= w / L <= high]
        if column:
            # Every depth was checked (_check_space): the width's one-layer config is checked in
            # full and copied with the others, which skips most of the space's build time. Every
            # block has the same parameters: the count is linear in the depth.
            one = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=w,
                            n_heads=w // head_size, n_layers=1)
            base = gpt_param_count(one)
            per_block = gpt_param_count(replace(one, n_layers=2)) - base
            for L in column:
                config = object.__new__(GPTConfig)
                config.__dict__.update(vars(one), n_layers=L)
                sized.append((-(base + (L - 1) * per_block), L, config))
    if not sized:
        raise ValueError(f"the search space is empty: no width in {widths} is a multiple of "
                         f"head_size={head_size} with a depth in {depths} in aspect_ratio="
                         f"{aspect_ratio}")
    return tuple(config for *_, config in sorted(sized, key=lambda row: row[:2]))


def _columns(space: Sequence[GPTConfig], within_bound: Callable[[GPTConfig], bool]
             ) -> dict[int, list[GPTConfig]]:
    """The models of ``space`` by width, each column the depths, ascending, ``within_bound``
    (which grows with depth and with width); the widths with none left out."""
    by_width: dict[int, list[GPTConfig]] = {}
    for c in sorted(space, key=lambda c: (c.d_model, c.n_layers)):
        by_width.setdefault(c.d_model, []).append(c)
    limit = math.inf  # a depth over the bound at a narrower width is over it at a wider one
    for width, column in list(by_width.items()):
        column = [c for c in column if c.n_layers < limit]
        within = len(column) if not column or within_bound(column[-1]) else _largest(
            lambda i, c=column: within_bound(c[i - 1]), range(1, len(column)))
        if within < len(column):
            limit = column[within].n_layers
        if within:
            by_width[width] = column[:within]
        else:
            del by_width[width]
    return by_width


def fit_model(budget_bytes: int, *, space: Sequence[GPTConfig] | None = None,
              effective_batch: int = 32, precisions: Sequence[str] = ("bf16-mixed", "fp32"),
              policies: Sequence[tuple[str, int]] = FIT_POLICIES,
              max_accumulation_steps: int | None = None, gpu=None,
              speed: DeviceSpeed | None = None) -> Fit:
    """The largest GPT of ``space`` that trains within ``budget_bytes``, and how.

    "Largest" is the most parameters. A model fits if one setting's predicted peak is at most
    the budget; a setting is a precision of ``precisions``, a micro-batch ``b`` dividing
    ``effective_batch`` with ``effective_batch // b`` accumulation steps, and a checkpointing
    policy of ``policies``. For the largest model that fits, the setting chosen is: the first
    precision of ``precisions`` that fits (the order is a preference, since precisions train
    differently: ``"bf16-mixed"`` before ``"fp32"`` by default; pure ``"bf16"`` only if listed),
    then the fastest of its policies and micro-batches (:func:`settings`).

    Search: memory grows with depth and with width, so each width's deepest fitting model is
    found by bisection, among the depths whose :func:`course_lib.prediction.engine.floor` is
    within the budget and whose models beat the best found so far; it stops once no width can.

    Args:
        budget_bytes (int): the memory, in bytes, up to :data:`course_lib.validation.MAX_BYTES`.
        space (sequence of GPTConfig, optional): the models to choose from (None:
            :func:`search_space`'s default, GPT-2's vocabulary and 1,024 tokens).
        effective_batch (int): sequences per optimizer step, up to :data:`MAX_EFFECTIVE_BATCH`.
        precisions (sequence of str): of :data:`FIT_PRECISIONS`, in order of preference.
        policies (sequence of tuple): ``(mode, every)`` checkpointing policies.
        max_accumulation_steps (int, optional): the most accumulation steps (None: no limit).
        gpu (str or GPU, optional): where it trains, as :class:`~course_lib.prediction.step.Step`
            takes it (the budget is still ``budget_bytes``).
        speed (DeviceSpeed, optional): the time model's figures, as :func:`settings` takes them.

    Returns:
        Fit: the model's fastest setting, its prediction (memory and time).

    Raises:
        ValueError: if nothing fits, and naming the argument for a bad one.

    Example:
        >>> space = search_space(widths=range(16, 129, 16), depths=range(1, 9), head_size=16,
        ...                      seq_len=32, vocab_size=64, aspect_ratio=None)
        >>> plan = fit_model(4 * 2**20, space=space, effective_batch=4)
        >>> plan.step.config.d_model, plan.step.config.n_layers, plan.step.precision, plan.label
        (48, 8, 'fp32', 'blocks/1')
        >>> plan.peak_bytes <= 4 * 2**20
        True
    """
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    space = search_space() if space is None else items("space", space, min_len=1,
                                                       max_len=MAX_SEARCH_PAIRS)
    if not all(isinstance(c, GPTConfig) for c in space):
        raise WrongTypeError("space must hold GPTConfig only (search_space makes one)")
    effective_batch = positive_int("effective_batch", effective_batch, maximum=MAX_EFFECTIVE_BATCH)
    precisions = items("precisions", precisions, min_len=1, max_len=len(FIT_PRECISIONS))
    for p in precisions:
        precision_of(p, "precisions")
    policies = _check_policies(policies)
    max_accumulation_steps = optional_positive_int(
        "max_accumulation_steps", max_accumulation_steps, maximum=MAX_EFFECTIVE_BATCH)
    speed = _check_speed(speed)
    # The one Step of the search, checked here: every other is a replacement of it.
    base = Step(space[0], effective_batch, gpu=gpu)
    micro = _micro_batches(effective_batch, max_accumulation_steps)
    # The smallest micro-batch, or the whole batch with no accumulated gradient, each
    # checkpointing every block (the least kept): their floors are under every setting's peak.
    least_kept = [replace(base, micro_batch_size=b, accumulation_steps=effective_batch // b,
                       precision=p, mode="blocks")
               for p in precisions for b in sorted({micro[0], micro[-1]})]
    policy_order = sorted(policies, key=lambda p: -recompute_fraction(
        replace(base, mode=p[0], every=p[1])))  # the leanest first: a fitting model exits early

    def within_bound(config: GPTConfig) -> bool:
        return any(engine.floor(replace(s, config=config)) <= budget for s in least_kept)

    def fits(config: GPTConfig) -> bool:  # in some policy, precision and extreme micro-batch
        # no policy keeps less than blocks/1: its floor over the budget rules them all out, and
        # the optimizer step's moment, the same for every policy and micro-batch, too
        open_ = [s for s in (replace(s, config=config) for s in least_kept)
                 if engine.floor(s) <= budget and engine.model_floor(s) <= budget]
        return any(_fits(replace(s, mode=m, every=e), budget)
                   for m, e in policy_order for s in open_)

    by_width = _columns(space, within_bound)
    # Memory grows with depth and with width: a wider width's deepest fitting depth fits every
    # narrower width too, and only a depth that beats the best found needs trying (the first of
    # them alone, first: most widths cannot beat it at all).
    deepest: dict[int, int] = {}  # width -> its deepest depth known to fit (0: none)
    best, most = None, 0  # the largest model found to fit, its parameters
    for width in sorted(by_width, key=lambda w: -gpt_param_count(by_width[w][-1])):
        column = by_width[width]
        if gpt_param_count(column[-1]) <= most:
            break  # no model of this or any later width can beat the best
        fitting = max((d for w, d in deepest.items() if w > width), default=0)
        known = sum(c.n_layers <= fitting for c in column)  # column[:known] fit
        lo = max(known, _largest(lambda i, c=column, m=most: gpt_param_count(c[i - 1]) <= m,
                                 range(1, len(column) + 1)))  # column[lo:] beat the best
        if lo == len(column) or not fits(column[lo]):
            top = known
        else:
            top = _largest(lambda i, column=column: fits(column[i - 1]),
                           range(lo + 2, len(column) + 1)) or lo + 1
        deepest[width] = column[top - 1].n_layers if top else 0
        if top and gpt_param_count(column[top - 1]) > most:
            best, most = column[top - 1], gpt_param_count(column[top - 1])
    for precision in precisions if best is not None else ():
        found = _settings(replace(base, config=best, precision=precision), budget, policies,
                          max_accumulation_steps, speed)
        if found:
            return found[0]
    smallest = min(space, key=gpt_param_count)
    raise ValueError(f"budget_bytes={budget} ({format_bytes(budget)}) is too small for the smallest "
                     f"model of the space (d_model={smallest.d_model}, n_layers="
                     f"{smallest.n_layers}, seq_len={smallest.seq_len}, "
                     f"vocab_size={smallest.vocab_size})")


__all__ = ["FIT_PRECISIONS", "FIT_POLICIES", "BatchFit", "Fit", "largest_batch", "search_space",
           "settings", "measure_seconds", "fit_model"]
