"""06: the largest GPT, or the largest batch, that trains within a memory budget.

Each search replaces fields of one :class:`~course_lib.prediction.step.Step` and predicts each
setting (:func:`course_lib.prediction.predict.predict`) once the engine's floor allows it.
"""

from __future__ import annotations

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

#: The checkpointing policies searched, ``(mode, every)``, in order of increasing recompute
#: FLOPs (not of time: lecture 05 measures ``selective`` as the slowest).
FIT_POLICIES = (("none", 1), ("selective", 1), ("blocks", 2), ("blocks", 1), ("sqrt", 1))
# The default search space: d_model by 128s, 1 to 128 layers, d_model / n_layers in 32..128.
_WIDTHS = tuple(range(128, 8192 + 1, 128))
_DEPTHS = tuple(range(1, 129))
_ASPECT_RATIO = (32, 128)
#: The most sequences per optimizer step (GPT-3's batches held 1,600).
MAX_EFFECTIVE_BATCH = MAX_BATCH
#: The most widths, and the most depths, of a search space; the most (width, depth) pairs.
MAX_SEARCH_VALUES = 1024
MAX_SEARCH_PAIRS = 2**15


def _check_policies(policies) -> tuple:
    """``policies`` checked: a non-empty sequence of ``(mode, every)`` pairs."""
    if (isinstance(policies, str) or not isinstance(policies, Sequence) or not policies or any(
            not isinstance(p, tuple) or len(p) != 2 or not isinstance(p[0], str)
            or p[0] not in ckpt.MODES or not isinstance(p[1], int) or isinstance(p[1], bool)
            or not 1 <= p[1] <= MAX_COUNT for p in policies)):
        raise ValueError(f"policies must be a non-empty sequence of (mode, every) pairs with mode "
                         f"in {ckpt.MODES}, got {policies!r}")
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


@dataclass(frozen=True)
class _BatchFit:
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
                  policies: Sequence[tuple[str, int]] = FIT_POLICIES) -> list[_BatchFit]:
    """For each checkpointing policy, the largest micro-batch of ``step`` that fits ``budget_bytes``.

    Predicted peak memory grows with the micro-batch: bisection over 1 to 65,536.
    Args:
        step (Step): a plain steady step; its micro-batch and policy are replaced.
        budget_bytes (int): bytes available.
        policies (Sequence[tuple[str, int]]): the ``(mode, every)`` policies to try.
    Returns:
        list: one record per policy, in the order of ``policies``: ``mode``, ``every``,
        ``label``, ``micro_batch_size``, ``memory`` (the peak moment), ``recompute_fraction``.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    step = _check_step(step)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    out = []
    for mode, every in _check_policies(policies):
        policy = replace(step, mode=mode, every=every)
        b = _largest(lambda b, policy=policy: _fits(replace(policy, micro_batch_size=b), budget),
                     range(1, 2**16 + 1))
        out.append(_BatchFit(mode, every, b,
                             predict(replace(policy, micro_batch_size=b)).peak if b else None,
                             recompute_fraction(policy)))
    return out


@dataclass(frozen=True)
class Fit:
    """A setting that fits: its step's prediction, the budget in bytes, and the FLOPs its
    checkpointing recomputes over a plain step's."""

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
        """Six lines: model, precision, batch, checkpointing, predicted time and peak."""
        s, c, seconds = self.step, self.step.config, self.seconds
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
        recompute = recompute_fraction(at(fitting[0])) if fitting else None
        for b in fitting:
            p = predict(at(b), speed)
            rows.append(((p.seconds, recompute, -b, mode, every), Fit(p, budget, recompute)))
    return [fit for _, fit in sorted(rows, key=lambda row: row[0])]


def settings(step: Step, budget_bytes: int, *,
             policies: Sequence[tuple[str, int]] = FIT_POLICIES,
             speed: DeviceSpeed | None = None) -> list[Fit]:
    """Every setting of ``step``'s model, batch and precision that fits ``budget_bytes``, fastest first.

    A setting is a policy of ``policies`` and a micro-batch ``b`` dividing ``step.batch_size``
    (``step.batch_size // b`` accumulation steps), predicted by
    :func:`~course_lib.prediction.predict.predict`. Ties go to the least recompute, then the
    largest micro-batch. Empty if none fits.
    Args:
        step (Step): a plain steady step: its model, batch and precision.
        budget_bytes (int): bytes available.
        policies (Sequence[tuple[str, int]]): the ``(mode, every)`` policies to try.
        speed (DeviceSpeed, optional): the device's figures (None: the step's GPU's).
    Returns:
        list[Fit]: the settings that fit, fastest first.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    step = _check_step(step)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    if speed is not None and not isinstance(speed, DeviceSpeed):
        raise WrongTypeError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    return _settings(step, budget, _check_policies(policies), None, speed)


@step_setup.keeps_rng
def measure_seconds(fits: Sequence[Fit], *, device: str | torch.device = "cpu",
                    repeats: int = 3) -> list[float]:
    """Each setting's optimizer step measured: the median seconds over ``repeats`` (1..100) rounds.

    What :attr:`Fit.seconds` predicts: up to 16 fits' steps built (seed 0), trained on random
    tokens and timed in turn by :func:`course_lib.measurement.timing.step_times`.
    Args:
        fits (Sequence[Fit]): up to 16 settings, as :func:`settings` gives them.
        device (str or torch.device): where to train.
        repeats (int): the rounds timed.
    Returns:
        list[float]: the median seconds of each fit, in order.
    Raises:
        ValueError: naming the parameter, for a bad value.
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
        steps[str(i)] = functools.partial(
            train, model, optimizer, [random_tokens(s.config, s.batch_size, device=device)],
            micro_batch_size=s.micro_batch_size, accumulation_steps=s.accumulation_steps,
            **step_setup.train_options(s.precision, device))
    medians = timing.step_times(steps, repeats=repeats, device=device).median()
    return [medians[str(i)] for i in range(len(fits))]


def _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size) -> None:
    """:func:`search_space`'s arguments checked."""
    positive_int("head_size", head_size, maximum=CONFIG_MAXIMUM["d_model"])
    for name, values, maximum in (("widths", widths, CONFIG_MAXIMUM["d_model"]),
                                  ("depths", depths, CONFIG_MAXIMUM["n_layers"])):
        for v in items(name, values, min_len=1, max_len=MAX_SEARCH_VALUES):
            positive_int(name, v, maximum=maximum)
    if len(widths) * len(depths) > MAX_SEARCH_PAIRS:
        raise ValueError(f"widths and depths must make at most {MAX_SEARCH_PAIRS:,} pairs "
                         f"(len(widths) * len(depths)), got {len(widths):,} * {len(depths):,}")
    if aspect_ratio is not None:
        try:
            if not isinstance(aspect_ratio, tuple) or len(aspect_ratio) != 2:
                raise ValueError
            low, high = (number("aspect_ratio", x, above=0.0) for x in aspect_ratio)
            if low > high:
                raise ValueError
        except ValueError:
            raise ValueError(f"aspect_ratio must be None or (low, high) with 0 < low <= high, "
                             f"finite numbers, got {aspect_ratio!r}") from None
    positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    positive_int("vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"])


def search_space(*, widths: Sequence[int] = _WIDTHS, depths: Sequence[int] = _DEPTHS,
                 head_size: int = 64, aspect_ratio: tuple | None = _ASPECT_RATIO,
                 seq_len: int = 1024, vocab_size: int = 50257) -> list[GPTConfig]:
    """The GPT shapes :func:`fit_model` chooses from, most parameters first.

    ``d_model`` from ``widths``, ``n_layers`` from ``depths`` (at most
    :data:`MAX_SEARCH_VALUES` each, :data:`MAX_SEARCH_PAIRS` pairs), ``n_heads = d_model //
    head_size`` and, unless ``aspect_ratio`` is None, ``low <= d_model / n_layers <= high``:
    Kaplan et al. (2020, "Scaling Laws for Neural Language Models", figure 5) find the loss
    within a few percent for aspect ratios of about 20 to 200.
    Args:
        widths, depths (Sequence[int]): the values of ``d_model`` and ``n_layers``.
        head_size, seq_len, vocab_size (int): ``d_model // n_heads``, and the config's.
        aspect_ratio (tuple, optional): ``(low, high)``, the bounds of ``d_model / n_layers``.
    Returns:
        list[GPTConfig]: the shapes, most parameters first.
    Example:
        >>> [c.n_layers for c in search_space(widths=[64], depths=range(1, 9), head_size=32,
        ...                                   aspect_ratio=(16, 32), seq_len=16, vocab_size=10)]
        [4, 3, 2]
    """
    _check_space(widths, depths, head_size, aspect_ratio, seq_len, vocab_size)
    return list(_build_space(tuple(int(w) for w in widths), tuple(int(d) for d in depths),
                             int(head_size), None if aspect_ratio is None else tuple(aspect_ratio),
                             int(seq_len), int(vocab_size)))


# the explorer's six sequence lengths and two more, each at most MAX_SEARCH_PAIRS configs of
# about 234 bytes: under 64 MiB in all
@functools.lru_cache(maxsize=8)
def _build_space(widths: tuple, depths: tuple, head_size: int, aspect_ratio: tuple | None,
                 seq_len: int, vocab_size: int) -> tuple:
    """:func:`search_space` of checked arguments, most parameters first (then the shallowest)."""
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


def _model_tests(base: Step, budget: int, precisions: Sequence[str], policies: tuple,
                 max_accumulation_steps: int | None) -> tuple[Callable, Callable]:
    """``(within_bound, fits)`` of a model: a cheap floor under every setting; some setting fits."""
    micro = _micro_batches(base.batch_size, max_accumulation_steps)
    # The smallest micro-batch, or the whole batch with no accumulated gradient, each
    # checkpointing every block (the least kept): their floors are under every setting's peak.
    least_kept = [replace(base, micro_batch_size=b, accumulation_steps=base.batch_size // b,
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

    return within_bound, fits


def _largest_model(space: Sequence[GPTConfig], within_bound: Callable[[GPTConfig], bool],
                   fits: Callable[[GPTConfig], bool]) -> GPTConfig | None:
    """The model of ``space`` with the most parameters that ``fits`` (None if none does)."""
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
    return best


def fit_model(budget_bytes: int, *, space: Sequence[GPTConfig] | None = None,
              effective_batch: int = 32, precisions: Sequence[str] = ("bf16-mixed", "fp32"),
              policies: Sequence[tuple[str, int]] = FIT_POLICIES,
              max_accumulation_steps: int | None = None, gpu=None) -> Fit:
    """The largest GPT of ``space`` (most parameters) that trains within ``budget_bytes``, and how.

    A model fits if one setting's predicted peak is within the budget: a precision of
    ``precisions``, a micro-batch dividing ``effective_batch`` and a policy of ``policies``
    (as :func:`settings`). For the largest model that fits, the first precision of
    ``precisions`` that fits (an order of preference: precisions train differently), then its
    fastest setting (:func:`settings`). Memory grows with depth and with width, so each width's
    deepest fitting model is found by bisection.
    Args:
        budget_bytes, effective_batch (int): bytes available; sequences per optimizer step.
        space (Sequence[GPTConfig], optional): the models to choose from (:func:`search_space`'s).
        precisions (Sequence[str]): the precisions to try, preferred first.
        policies (Sequence[tuple[str, int]]): the ``(mode, every)`` policies to try.
        max_accumulation_steps (int, optional): the most accumulation steps (None: any).
        gpu: as :class:`~course_lib.prediction.step.Step` takes it.
    Returns:
        Fit: the largest model that fits, in its fastest setting.
    Raises:
        ValueError: naming the parameter, for a bad value, or if nothing fits.
    """
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    space = search_space() if space is None else items("space", space, min_len=1,
                                                       max_len=MAX_SEARCH_PAIRS)
    if not all(isinstance(c, GPTConfig) for c in space):
        raise WrongTypeError("space must hold GPTConfig only (search_space makes one)")
    effective_batch = positive_int("effective_batch", effective_batch, maximum=MAX_EFFECTIVE_BATCH)
    precisions = items("precisions", precisions, min_len=1, max_len=len(PRECISIONS))
    for p in precisions:
        precision_of(p, "precisions")
    policies = _check_policies(policies)
    max_accumulation_steps = optional_positive_int(
        "max_accumulation_steps", max_accumulation_steps, maximum=MAX_EFFECTIVE_BATCH)
    base = Step(space[0], effective_batch, gpu=gpu)  # checked once: every other replaces it
    best = _largest_model(space, *_model_tests(base, budget, precisions, policies,
                                               max_accumulation_steps))
    for precision in precisions if best is not None else ():
        found = _settings(replace(base, config=best, precision=precision), budget, policies,
                          max_accumulation_steps, None)
        if found:
            return found[0]
    smallest = min(space, key=gpt_param_count)
    raise ValueError(f"budget_bytes={budget} ({format_bytes(budget)}) is too small for the smallest "
                     f"model of the space (d_model={smallest.d_model}, n_layers="
                     f"{smallest.n_layers}, seq_len={smallest.seq_len}, "
                     f"vocab_size={smallest.vocab_size})")
