"""06: the guard: a memory budget enforced while a step runs (the allocator's cap, or a tracker)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.measurement.memory import LiveTensorTracker, peak_memory
from course_lib.units import format_bytes
from course_lib.validation import (
    MAX_BYTES,
    available_device as as_device,
    function,
    positive_int,
    text,
)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class MemoryBudgetExceeded(RuntimeError):
    """More memory than the budget: needed, or live in the op ``at`` (:class:`BudgetTracker`).
    Args:
        needed_bytes, budget_bytes (int): the bytes needed (or live) and the budget.
        what, at (str): what ran out of memory; the op it did it in (None: predicted).
    """

    def __init__(self, needed_bytes: int, budget_bytes: int, what: str = "the step", *,
                 at: str | None = None):
        self.needed_bytes, self.budget_bytes, self.what, self.at = needed_bytes, budget_bytes, what, at
        if at is None:
            message = (f"{what} needs {format_bytes(needed_bytes)}, "
                       f"{format_bytes(needed_bytes - budget_bytes)} over the budget of "
                       f"{format_bytes(budget_bytes)}")
        else:
            message = (f"{what} went over the budget of {format_bytes(budget_bytes)} in {at} "
                       f"({format_bytes(needed_bytes)} live)")
        super().__init__(message)


class BudgetTracker(LiveTensorTracker):
    """A :class:`~course_lib.measurement.memory.LiveTensorTracker` that raises
    :class:`MemoryBudgetExceeded` at the op whose live tensors exceed ``budget_bytes``: an
    out-of-memory error for devices without a memory limit (the CPU).
    Args:
        budget_bytes (int): the most live bytes allowed.
        what (str): what runs, for the message.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """

    def __init__(self, budget_bytes: int, what: str = "the work"):
        budget_bytes = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
        super().__init__()
        self.budget_bytes, self.what = budget_bytes, text("what", what)
        self.breach = None  # the first MemoryBudgetExceeded, kept even if the work catches it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live > self.budget_bytes:
            # the op's name as a reader knows it: aten.gelu.default -> gelu
            op = getattr(getattr(func, "overloadpacket", None), "__name__", None) or str(func)
            error = MemoryBudgetExceeded(self.live, self.budget_bytes, self.what, at=op)
            self.breach = self.breach or error
            raise error
        return out


@dataclass
class _Trial:
    """What :func:`run_within_budget` saw."""

    ok: bool
    peak_bytes: int | None
    message: str
    result: object = None
    error: str | None = None


def run_within_budget(fn: Callable[[], object], budget_bytes: int, *, what: str = "training",
                      device: str | torch.device | None = None) -> _Trial:
    """Run ``fn()`` with at most ``budget_bytes`` of device memory; catch running out of it.

    ``fn`` creates all it trains, so that all of its memory counts. On CUDA
    ``torch.cuda.set_per_process_memory_fraction(budget / total memory)`` caps the caching
    allocator; elsewhere a :class:`BudgetTracker` counts live tensors. After a failure the memory
    is freed and the kernel goes on.
    Args:
        fn (Callable[[], object]): the work; it creates all it trains.
        budget_bytes (int): the most device bytes allowed.
        what (str): what runs, for the message.
        device (str or torch.device, optional): None: CUDA if available, else the CPU.
    Returns:
        object: ``ok``, ``peak_bytes`` (None after a failure), ``message``, ``result``.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    function("fn", fn)
    budget = positive_int("budget_bytes", budget_bytes, maximum=MAX_BYTES)
    text("what", what)
    device = as_device("device", device if device is not None
                       else "cuda" if torch.cuda.is_available() else "cpu")
    failure = None
    if device.type == "cuda":
        gc.collect()  # blocks cached from earlier work would count against the fraction
        torch.cuda.empty_cache()
        # set_per_process_memory_fraction wants an index: "cuda" alone is refused
        index = torch.cuda.current_device() if device.index is None else device.index
        total = torch.cuda.get_device_properties(index).total_memory
        # the caller's own cap comes back afterwards (an older PyTorch cannot tell it: 1.0)
        before = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
        result, ooms = [], torch.cuda.memory_stats(index).get("num_ooms", 0)
        try:
            start = torch.cuda.memory_allocated(index)
            peak = start + peak_memory(lambda: result.append(fn()), device="cuda")
        except _OOM as exc:  # the real thing: the allocator could not get a block
            # its first two sentences: "CUDA out of memory. Tried to allocate 2.00 GiB"
            first = ". ".join(str(exc).splitlines()[0].split(". ")[:2])
            failure = f"torch.OutOfMemoryError: {first}"
        finally:
            torch.cuda.set_per_process_memory_fraction(before, index)
        # An OutOfMemoryError is a RuntimeError, which the work may catch and carry on from:
        # the allocator's count of them still tells
        if failure is None and torch.cuda.memory_stats(index).get("num_ooms", 0) > ooms:
            failure = ("torch.OutOfMemoryError: CUDA out of memory, caught inside "
                       f"{what} (it went on)")
    else:
        result, tracker = [], BudgetTracker(budget, what)
        try:
            with tracker:
                result.append(fn())
            peak = tracker.peak
        except MemoryBudgetExceeded as exc:
            failure = f"MemoryBudgetExceeded: {exc}"
        if failure is None and tracker.breach is not None:  # caught inside the work, which went on
            failure = f"MemoryBudgetExceeded: {tracker.breach}"
    if failure is not None:
        result.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return _Trial(False, None, f"✗ {what} ran out of memory under a budget of "
                      f"{format_bytes(budget)}; memory freed, the kernel goes on\n  {failure}",
                      error=failure)
    return _Trial(True, peak, f"✓ {what} fits: peak {format_bytes(peak)} of a budget of "
                  f"{format_bytes(budget)} ({peak / budget:.0%})", result[0])

