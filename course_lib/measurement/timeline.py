"""The GPU memory timeline of a piece of work, from the CUDA caching allocator's own trace.

``torch.cuda.memory._record_memory_history()`` makes the allocator log every
allocation and free (with its size, address and time) and
``torch.cuda.memory._snapshot()`` returns that log; PyTorch's viewer at
https://pytorch.org/memory_viz draws the same data from ``_dump_snapshot``. Here
the log becomes one curve, bytes allocated against time, that matplotlib draws
in a notebook (:func:`record_timeline`). On other devices :func:`track_timeline` draws the same curve from
the live-tensor tracker (:class:`course_lib.measurement.memory.LiveTensorTracker`), with the
event number as its clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.measurement.memory import LiveTensorTracker
from course_lib.model.kernels import CUDA_BLOCK
from course_lib.validation import WrongTypeError


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
    """The allocated-bytes curve of a ``torch.cuda.memory._snapshot()`` dictionary.

    ``alloc`` adds the block's ``size``, ``free_completed`` subtracts it, each rounded up to
    the allocator's 512-byte block (:data:`course_lib.model.kernels.CUDA_BLOCK`); the clock is
    the trace's ``time_us`` (µs), or the event index where an event has none.
    """
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if traces is None:
        raise ValueError("snapshot must be a dict from torch.cuda.memory._snapshot() "
                         "(with a 'device_traces' list)")
    if not isinstance(device, int) or isinstance(device, bool) or not 0 <= device < len(traces):
        raise ValueError(f"device must be an index below {len(traces)}, got {device!r}")
    if not isinstance(baseline, int) or isinstance(baseline, bool) or not 0 <= baseline < 2**63:
        raise ValueError(f"baseline must be a non-negative int of bytes, got {baseline!r}")
    live, clock, allocated = baseline, [], []
    for index, event in enumerate(traces[device]):
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
    """Run ``fn()`` with the CUDA allocator's history on and return its :class:`Timeline`.

    Times start at 0 (the first event). Recording is switched off afterwards,
    whatever ``fn`` does.

    Args:
        fn (callable): the work, called with no arguments.
        max_entries (int): the most allocator events the history keeps.

    Returns:
        Timeline: bytes allocated (in allocator blocks) after each event, clock in µs.

    Raises:
        ValueError: naming ``fn`` (not callable), or on a machine without CUDA.
    """
    if not callable(fn):
        raise WrongTypeError(f"fn must be callable with no arguments, got {fn!r}")
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
    """Run ``fn()`` under the live-tensor tracker and return bytes allocated after each event.

    Every device; the bytes are exact tensor storage, above what was live before
    ``fn`` (so the curve starts at 0), and the clock is the event number.

    Args:
        fn (callable): the work, called with no arguments.

    Returns:
        Timeline: with ``unit="event"``.

    Raises:
        ValueError: naming ``fn``, if it is not callable.
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
