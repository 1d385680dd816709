"""Memory over a piece of work: bytes allocated after each event. On CUDA from the allocator's
own log (the data of https://pytorch.org/memory_viz), elsewhere from the live-tensor tracker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.measurement.memory import LiveTensorTracker
from course_lib.model.kernels import CUDA_BLOCK
from course_lib.validation import WrongTypeError, function


@dataclass(frozen=True)
class Timeline:
    """Allocated bytes after each event: ``clock[i]`` -> ``allocated[i]`` (bytes)."""

    clock: list
    allocated: list
    unit: str = "µs"

    @property
    def peak(self) -> int:
        """Highest allocated bytes on the timeline."""
        return max(self.allocated)


def _timeline_from_snapshot(snapshot: dict, baseline: int = 0, device: int = 0) -> Timeline:
    """The allocated-bytes curve (512-byte blocks, µs) of a ``torch.cuda.memory._snapshot()``."""
    live, clock, allocated = baseline, [], []
    for index, event in enumerate(snapshot["device_traces"][device]):
        block = -(-event["size"] // CUDA_BLOCK) * CUDA_BLOCK
        if event["action"] == "alloc":
            live += block
        elif event["action"] == "free_completed":
            live -= block
        else:
            continue
        clock.append(event.get("time_us", index))
        allocated.append(live)
    if not allocated:
        raise ValueError("snapshot holds no allocation on that device: was history recorded?")
    return Timeline(clock, allocated)


def record_timeline(fn: Callable[[], object], *, max_entries: int = 1_000_000) -> Timeline:
    """Run ``fn()`` with the CUDA allocator's history on; its :class:`Timeline` in allocator
    blocks, clock in µs from the first event.
    Args:
        fn (callable): the work, without arguments, on the current CUDA device.
        max_entries (int): the most allocator events kept.
    Returns:
        Timeline: bytes allocated, those live before ``fn`` included.
    Raises:
        ValueError: on a machine without CUDA.
    """
    function("fn", fn)
    if not torch.cuda.is_available():
        raise ValueError("record_timeline needs a CUDA device; this machine has none")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    timeline = _timeline_from_snapshot(snapshot, baseline, torch.cuda.current_device())
    start = timeline.clock[0]
    return Timeline([t - start for t in timeline.clock], timeline.allocated)


def track_timeline(fn: Callable[[], object]) -> Timeline:
    """Run ``fn()`` under the live-tensor tracker; its :class:`Timeline` (tensor bytes by event).
    Args:
        fn (callable): the work, without arguments.
    Returns:
        Timeline: the live bytes of ``fn``'s tensors after each allocation or free.

    >>> track_timeline(lambda: torch.ones(1024) + 1).peak  # the ones and the sum, 4 KiB each
    8192
    """
    if not callable(fn):
        raise WrongTypeError(f"fn must be callable with no arguments, got {fn!r}")
    with LiveTensorTracker() as tracker:
        fn()
    changes = sorted([(r.born, r.nbytes) for r in tracker.storages]
                     + [(r.died, -r.nbytes) for r in tracker.storages if r.died is not None])
    live, allocated = 0, []
    for _, delta in changes:
        live += delta
        allocated.append(live)
    return Timeline([clock for clock, _ in changes], allocated, unit="event")
