"""Step times, measured fairly: warmed up, synchronized, interleaved.

Each lecture that compares step times (03's accumulation, 04's and 05's checkpointing, the
benchmarks) needs three precautions:

* **Warm-up.** A step's first call pays one-off costs (the allocator's pool, cuBLAS choosing
  kernels, ``torch.utils.checkpoint``'s first import): each step runs ``warmup`` times untimed.
* **Synchronization.** CUDA (and MPS) kernels run asynchronously: ``torch.cuda.synchronize()``
  before the clock starts and before it stops, as ``torch.utils.benchmark`` does.
* **Interleaving.** On a shared machine the speed drifts; every round times each step once, in
  an order rotated by one every round, so a drift falls on all of them alike.

Two clocks are kept per run: the wall clock (``time.perf_counter``), what a learner waits for,
and the process's CPU time (``time.process_time``, all threads), steadier on a shared CPU; only
the wall clock sees a GPU's work. :meth:`StepTimes.median` and :meth:`StepTimes.best` take
either, and by default the wall clock on CUDA and MPS.

:func:`within_seconds` stops work at the first op past a deadline (:class:`TimeLimitExceeded`),
so a step that is slow here costs at most the limit and one op. :func:`profile_step` runs one
step under ``torch.profiler`` and :func:`split_by_class` sorts each op's own time into
:data:`KERNEL_CLASSES` (lecture 05's companion): the CPU time of each op on the CPU, the device
time of its kernels on CUDA.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.validation import (
    WrongTypeError,
    available_device as as_device,
    choice,
    fields,
    function,
    integer,
    number,
    positive_int,
    text,
)

#: The clocks a :class:`StepTimes` reads (auto: wall clock on CUDA and MPS, CPU time on the CPU).
CLOCKS = ("auto", "wall", "cpu")


def synchronize(device: str | torch.device = "cpu") -> None:
    """Wait for the work queued on ``device``: CUDA and MPS run kernels asynchronously, the CPU
    has nothing queued."""
    device = as_device("device", device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class StepTimes:
    """Seconds of every timed run of each step, wall clock and CPU time."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    device: str

    def seconds(self, clock: str = "auto") -> dict[str, list[float]]:
        """Every run's seconds on one clock."""
        clock = choice("clock", clock, CLOCKS)
        if clock == "auto":
            clock = "cpu" if self.device == "cpu" else "wall"
        return self.wall if clock == "wall" else self.cpu

    def median(self, clock: str = "auto") -> dict[str, float]:
        """Median seconds of each step's runs."""
        return {name: statistics.median(t) for name, t in self.seconds(clock).items()}

    def best(self, clock: str = "auto") -> dict[str, float]:
        """Seconds of each step's fastest run: the run the machine disturbed least."""
        return {name: min(t) for name, t in self.seconds(clock).items()}

    def ratio(self, name: str, baseline: str, clock: str = "auto") -> float:
        """How many times longer step ``name`` takes than step ``baseline``: the median of the
        per-round ratios (each round ran both close together, so a drift cancels)."""
        runs = self.seconds(clock)
        name, baseline = choice("name", name, list(runs)), choice("baseline", baseline, list(runs))
        return statistics.median(a / b for a, b in zip(runs[name], runs[baseline], strict=True))


#: The most timed (or warm-up) runs of each step one call makes: enough for any median.
MAX_RUNS = 1000
#: The longest limit :func:`within_seconds` takes: an hour.
MAX_LIMIT_SECONDS = 3600.0


class TimeLimitExceeded(RuntimeError):
    """Work stopped at its deadline by :func:`within_seconds`."""

    def __init__(self, limit: float, elapsed: float, what: str = "the work"):
        self.limit, self.elapsed, self.what = limit, elapsed, what
        super().__init__(f"{what} was stopped after {elapsed:.2f} s: past its limit of "
                         f"{limit:.2f} s")


_DISPATCH_WARM: list = []


class _Deadline(TorchDispatchMode):
    """Raise :class:`TimeLimitExceeded` at the first op dispatched past ``start + limit``."""

    def __init__(self, limit: float, what: str):
        super().__init__()
        self.limit, self.what = limit, what
        self.start = time.perf_counter()
        self.deadline = self.start + limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        now = time.perf_counter()
        if now > self.deadline:
            raise TimeLimitExceeded(self.limit, now - self.start, self.what)
        return func(*args, **(kwargs or {}))


def within_seconds(fn: Callable[[], object], seconds: float, *,
                   what: str = "the work") -> tuple[object, float]:
    """Run ``fn()``, stopped at the first PyTorch op past ``seconds`` (every op looks at the
    clock); its result and wall time."""
    function("fn", fn)
    seconds = number("seconds", seconds, above=0.0, maximum=MAX_LIMIT_SECONDS)
    text("what", what)
    if not _DISPATCH_WARM:  # the first op under a dispatch mode in a process pays imports (~1 s)
        with _Deadline(MAX_LIMIT_SECONDS, "warm-up"):
            torch.ones(2).add(1)
        _DISPATCH_WARM.append(True)
    with _Deadline(seconds, what) as mode:
        result = fn()
    return result, time.perf_counter() - mode.start


def step_times(steps: Mapping[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1,
               before: Callable[[str], object] | None = None,
               device: str | torch.device = "cpu") -> StepTimes:
    """Time each step of ``steps`` ``repeats`` times, warmed up, synchronized and interleaved.

    Each step runs ``warmup`` times untimed; then ``repeats`` rounds time every step once, the
    order rotated by one step per round (round ``r`` starts with step ``r mod len(steps)``).
    Each timed run is ``synchronize(device)``, clocks read, ``step()``,
    ``synchronize(device)``, clocks read. ``before(name)``, when given, runs untimed before
    every run of step ``name`` (to switch a shared model to that step's policy, or to clear
    gradients).

    Args:
        steps (Mapping[str, Callable[[], object]]): the steps by name, each a call with no
            arguments.
        repeats (int): timed runs per step, from 1 to :data:`MAX_RUNS`.
        warmup (int): untimed runs per step before the first timed one, from 0 to
            :data:`MAX_RUNS`.
        before (Callable[[str], object], optional): run, untimed, before each run of a step.
        device (str or torch.device): where the steps run; on ``"cuda"`` and ``"mps"`` every
            timed run waits for the device's queue (:func:`synchronize`).

    Returns:
        StepTimes: every run's wall-clock and CPU seconds.

    Raises:
        ValueError: ``steps`` empty or holding a non-callable, ``repeats`` or ``warmup`` out of
            range,
            ``before`` not callable, or a bad ``device``.

    Example:
        >>> a = torch.ones(64, 64)
        >>> times = step_times({"matmul": lambda: a @ a}, repeats=3)
        >>> len(times.seconds()["matmul"]), list(times.median())
        (3, ['matmul'])
    """
    if not isinstance(steps, Mapping) or not steps:
        raise ValueError(f"steps must be a non-empty mapping of name -> callable, got {steps!r}")
    for name, step in steps.items():
        function(f"steps[{name!r}]", step)
    repeats = positive_int("repeats", repeats, maximum=MAX_RUNS)
    warmup = integer("warmup", warmup, minimum=0, maximum=MAX_RUNS)
    function("before", before, optional=True)
    device = as_device("device", device)
    names = list(steps)

    def prepare(name: str) -> None:
        if before is not None:
            before(name)

    for name in names:
        for _ in range(warmup):
            prepare(name)
            steps[name]()
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            prepare(name)
            synchronize(device)
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            steps[name]()
            synchronize(device)
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    return StepTimes(wall, cpu, device.type)


#: What :func:`split_by_class` sorts a step's time into.
KERNEL_CLASSES = ("matmul", "attention", "fused kernel", "other pointwise", "optimizer")
#: The matmul ops by the profiler's names (``linear`` and ``matmul`` hold their ``mm``).
_MATMUL_NAMES = frozenset(f"aten::{name}" for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"))


def _kernel_class(name: str) -> str | None:
    """The class of a profiler event, by its name; None for an event that names no class.

    ``Optimizer.step#...``/``zero_grad#...``: "optimizer"; ``course::`` ops: "fused kernel";
    ``scaled_dot_product`` in the name: "attention"; :data:`_MATMUL_NAMES`: "matmul".
    """
    if not isinstance(name, str):
        raise WrongTypeError(f"name must be a str, got {type(name).__name__}")
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if name.startswith("course::"):
        return "fused kernel"
    if "scaled_dot_product" in name:
        return "attention"
    return "matmul" if name in _MATMUL_NAMES else None


@dataclass(frozen=True)
class TimeSplit:
    """One step's time by kernel class (:func:`split_by_class`)."""

    seconds: dict
    clock: str

    def __post_init__(self):
        fields(self, seconds=dict, clock=("cpu", "device"))
        for name, seconds in self.seconds.items():
            if name not in KERNEL_CLASSES:
                raise ValueError(f"TimeSplit.seconds must have keys of {KERNEL_CLASSES}, got "
                                 f"{name!r}")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise TypeError(f"TimeSplit.seconds[{name!r}] must be a number, got "
                                f"{type(seconds).__name__}")
            if not 0 <= seconds < math.inf:
                raise ValueError(f"TimeSplit.seconds[{name!r}] must be a finite number of at "
                                 f"least 0, got {seconds!r}")

    @property
    def total(self) -> float:
        """All the classes' seconds."""
        return sum(self.seconds.values())

    def shares(self) -> dict:
        """Each class's share of :attr:`total` (0 for an empty split)."""
        total = self.total
        return {name: (t / total if total else 0.0) for name, t in self.seconds.items()}


def split_by_class(events: Iterable, *, device_time: bool = False) -> TimeSplit:
    """Sort the self time of profiler events (µs) into :data:`KERNEL_CLASSES`: each event's own
    time goes to the class of its outermost ancestor that has one (:func:`_kernel_class`), the
    rest to "other pointwise"; a checkpoint's rerun counts as what it runs."""
    if not isinstance(device_time, bool):
        raise WrongTypeError(f"device_time must be True or False, got {device_time!r}")
    try:
        events = list(events) if not isinstance(events, str | bytes) else None
    except TypeError:
        events = None
    if events is None or not all(isinstance(getattr(e, "name", None), str)
                                 and hasattr(e, "cpu_parent") for e in events):
        raise ValueError("events must be a profiler's events (prof.events()), each with a name "
                         "and a cpu_parent")
    seconds = Counter()
    attribute = "self_device_time_total" if device_time else "self_cpu_time_total"
    for event in events:
        outermost, node = "other pointwise", event
        while node is not None:
            outermost = _kernel_class(node.name) or outermost
            node = node.cpu_parent
        seconds[outermost] += getattr(event, attribute, 0) / 1e6
    return TimeSplit({c: seconds[c] for c in KERNEL_CLASSES}, "device" if device_time else "cpu")


def profile_step(step: Callable[[], object], *, device: str | torch.device = "cpu") -> TimeSplit:
    """Run ``step()`` once under ``torch.profiler`` and split its time by kernel class.

    Warm the step up first (the first run pays one-off costs). On CUDA the profiler records the
    kernels too and the split is their device time (:func:`split_by_class` with
    ``device_time=True``); elsewhere the ops' CPU time.

    Args:
        step (callable): one training step, called with no arguments.
        device (str or torch.device): where it runs.

    Returns:
        TimeSplit: seconds per class of :data:`KERNEL_CLASSES`.

    Raises:
        ValueError: naming ``step`` (not callable) or ``device``.
    """
    function("step", step)
    device = as_device("device", device)
    from torch.profiler import ProfilerActivity, profile

    # Kineto, the profiler's engine, prints a timestamped start and stop line at every profile
    # (its highest log level, 5); a level above it keeps a notebook's outputs reproducible. The
    # caller's environment comes back as it was.
    before = os.environ.get("KINETO_LOG_LEVEL")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        synchronize(device)
        with profile(activities=activities) as prof:
            step()
            synchronize(device)
    finally:
        if before is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
    return split_by_class(prof.events(), device_time=cuda)


__all__ = ["CLOCKS", "KERNEL_CLASSES", "TimeSplit", "profile_step",
           "split_by_class", "synchronize", "StepTimes", "step_times"]
