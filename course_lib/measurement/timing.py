"""Step times, measured fairly: warmed up, synchronized (as ``torch.utils.benchmark``) and
interleaved, on the wall clock (which sees a GPU's work) and CPU time (steadier on a busy CPU).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.validation import (
    available_device as as_device,
    choice,
    function,
    integer,
    number,
    positive_int,
    text,
)

#: The clocks of :func:`step_times`' result (auto: wall clock on CUDA and MPS, CPU time on a CPU).
CLOCKS = ("auto", "wall", "cpu")


def synchronize(device: str | torch.device = "cpu") -> None:
    """Wait for the work queued on ``device`` (CUDA and MPS run kernels asynchronously)."""
    device = as_device("device", device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class _StepTimes:
    """Seconds of every timed run of each step, wall clock and CPU time."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    device: str

    def seconds(self, clock: str = "auto") -> dict[str, list[float]]:
        """Every run's seconds on one of :data:`CLOCKS`."""
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
        """The median per-round ratio of step ``name``'s time to ``baseline``'s (drift cancels)."""
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        now = time.perf_counter()
        if now > self.start + self.limit:
            raise TimeLimitExceeded(self.limit, now - self.start, self.what)
        return func(*args, **(kwargs or {}))


def within_seconds(fn: Callable[[], object], seconds: float, *,
                   what: str = "the work") -> tuple[object, float]:
    """Run ``fn()``, stopped at the first PyTorch op past ``seconds``; its result and wall time."""
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
               device: str | torch.device = "cpu") -> _StepTimes:
    """Time each step ``repeats`` times after ``warmup`` untimed runs, synchronized, round ``r``
    starting with step ``r mod len(steps)``; ``before(name)`` runs untimed before each run.
    Args:
        steps (mapping of str to callable): the steps by name, each without arguments.
        repeats (int): timed runs of each step.
        warmup (int): untimed runs of each step first.
        before (callable, optional): called with the step's name.
        device (torch.device or str): the device to synchronize.
    Returns:
        every run's seconds: ``seconds(clock)``, ``median``, ``best``, ``ratio``.
    Raises:
        ValueError: naming the argument, for a value out of range.
    """
    if not isinstance(steps, Mapping) or not steps:
        raise ValueError(f"steps must be a non-empty mapping of name -> callable, got {steps!r}")
    for name, step in steps.items():
        function(f"steps[{name!r}]", step)
    repeats = positive_int("repeats", repeats, maximum=MAX_RUNS)
    warmup = integer("warmup", warmup, minimum=0, maximum=MAX_RUNS)
    before = function("before", before, optional=True) or (lambda name: None)
    device = as_device("device", device)
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            before(name)
            steps[name]()
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            before(name)
            synchronize(device)
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            steps[name]()
            synchronize(device)
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    return _StepTimes(wall, cpu, device.type)


_KERNEL_CLASSES = ("matmul", "attention", "fused kernel", "other pointwise", "optimizer")
# ``linear`` and ``matmul`` hold their ``mm``.
_MATMUL_NAMES = frozenset(f"aten::{name}" for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"))


def _kernel_class(name: str) -> str | None:
    """The kernel class a profiler event's name names, or None."""
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if name.startswith("course::"):
        return "fused kernel"
    if "scaled_dot_product" in name:
        return "attention"
    return "matmul" if name in _MATMUL_NAMES else None


@dataclass(frozen=True)
class _TimeSplit:
    """One step's seconds by kernel class, on the ``"cpu"`` or ``"device"`` clock."""

    seconds: dict
    clock: str

    @property
    def total(self) -> float:
        """All the classes' seconds."""
        return sum(self.seconds.values())

    def shares(self) -> dict:
        """Each class's share of :attr:`total` (0 for an empty split)."""
        total = self.total
        return {name: (t / total if total else 0.0) for name, t in self.seconds.items()}


def _split_by_class(events: Iterable, *, device_time: bool = False) -> _TimeSplit:
    """Profiler events' self time, each under its outermost ancestor's kernel class."""
    seconds = Counter()
    attribute = "self_device_time_total" if device_time else "self_cpu_time_total"
    for event in events:
        outermost, node = "other pointwise", event
        while node is not None:
            outermost = _kernel_class(node.name) or outermost
            node = node.cpu_parent
        seconds[outermost] += getattr(event, attribute, 0) / 1e6  # µs
    return _TimeSplit({c: seconds[c] for c in _KERNEL_CLASSES}, "device" if device_time else "cpu")


def profile_step(step: Callable[[], object], *, device: str | torch.device = "cpu") -> _TimeSplit:
    """Run ``step()`` (warmed up) under ``torch.profiler``: each op's own time by its outermost
    op's kernel class (the kernels' device time on CUDA, the ops' CPU time elsewhere).
    Args:
        step (callable): the step, without arguments; warm it up with a run before.
        device (torch.device or str): where it runs.
    Returns:
        the seconds by kernel class (``total``, ``shares()``).
    Raises:
        ValueError: naming ``step`` or ``device``, for one of the wrong kind.
    """
    function("step", step)
    device = as_device("device", device)
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a timestamped line at every profile (its level 5); a level above it keeps a
    # notebook's outputs reproducible. The caller's environment comes back as it was.
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
    return _split_by_class(prof.events(), device_time=cuda)
